"""What the scripts decide from the GPUs they find, proven on a CPU by faking what they read
(torch.cuda.is_available, device_count, get_device_capability, the accelerator): default worker
and stage counts on 1-8 GPUs, the autocast type by compute capability, every script's CPU run
where GPUs are visible, one GPU per rank (srun --gpus-per-task=1), FSDP's mesh on the CPU
where a GPU is visible, weights saved as CPU tensors, and a clock that waits for every GPU."""

import argparse
import concurrent.futures
import datetime
import importlib
import sys
import types

from unittest import mock

import pytest
import torch
import torch.distributed as dist

import common
import plumbing.checkpoints
import plumbing.compile
import plumbing.diagnostics
import plumbing.flags
import plumbing.meter
import plumbing.ranks
from conftest import (JOB_FLAGS, TOL, free_port, launch, load_saved, max_diff, ok,
                      refused_in_one_line, run_as_only_rank, run_in_process)

# GPUs: the workers `python ddp.py` / `python fsdp.py` start by default for --batch-size 64
# (the most that divide it), and the stages `python pipeline.py` cuts --blocks 4 into, with
# the processes it starts for them: one per stage, or one driving both stages on 1 GPU.
DEFAULT_WORKERS = {1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 4, 8: 8}
DEFAULT_STAGES = {1: 2, 2: 2, 3: 3, 4: 4, 5: 4, 6: 4, 7: 4, 8: 4}
STAGE_PROCESSES = {1: 1, 2: 2, 3: 3, 4: 4, 5: 4, 6: 4, 7: 4, 8: 4}


@pytest.fixture
def fake_gpus(monkeypatch):
    """A machine with `n` CUDA GPUs of compute capability `capability`, as torch reports it."""
    monkeypatch.delenv("RANK", raising=False)  # not under torchrun

    def install(n, capability=(8, 0)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        # Adam.step asks the current stream whether a CUDA graph is being captured, CPU
        # tensors or not (torch's CUDA builds: a CUDA context on GPU 0 for a CPU run; torch
        # 2.10 asks torch.cuda, later ones torch.accelerator). A real GPU answers no.
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        monkeypatch.setattr(torch.accelerator, "current_stream",
                            lambda device=None: types.SimpleNamespace(is_capturing=lambda: False))
    return install


@pytest.mark.parametrize("script", ["ddp", "fsdp"])
@pytest.mark.parametrize("gpus", sorted(DEFAULT_WORKERS))
def test_default_workers_on_1_to_8_gpus_divide_the_default_batch(script, gpus, fake_gpus,
                                                                 capsys):
    fake_gpus(gpus)
    args = importlib.import_module(script).parse_args([])
    assert args.nproc == DEFAULT_WORKERS[gpus]
    assert args.batch_size % args.nproc == 0
    said = capsys.readouterr().out
    if args.nproc < gpus:  # the user is told, with the fix
        assert f"{args.nproc} of {gpus} GPUs" in said and f"multiple of {gpus}" in said
    else:
        assert said == ""


@pytest.mark.parametrize("gpus", sorted(DEFAULT_STAGES))
def test_default_pipeline_stages_on_1_to_8_gpus_fit_the_blocks(gpus, fake_gpus, capsys):
    fake_gpus(gpus)
    import pipeline
    args = pipeline.parse_args([])
    assert (args.stages, args.nproc) == (DEFAULT_STAGES[gpus], STAGE_PROCESSES[gpus])
    said = capsys.readouterr().out
    if gpus > 4:  # the user is told, with the fix
        assert f"4 of {gpus} GPUs, one stage per block; pass --blocks {gpus}" in said
    else:
        assert said == ""
    assert pipeline.parse_args(["--blocks=8"]).stages == max(gpus, 2)


@pytest.mark.parametrize("capability, dtype", [((7, 0), "fp16"), ((7, 5), "fp16"),
                                               ((8, 0), "bf16"), ((9, 0), "bf16")])
def test_amp_auto_dtype_is_bf16_only_from_compute_capability_8(capability, dtype, fake_gpus,
                                                              monkeypatch):
    """V100 (7.0) and T4 (7.5) emulate bf16 (torch.cuda.is_bf16_supported() says yes):
    fp16 + GradScaler is their fast path."""
    fake_gpus(1, capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda precision: None)
    import amp
    args = amp.parse_args([])
    assert (amp.setup(args), args.dtype) == (torch.device("cuda", 0), dtype)


def test_fsdp_on_cpu_builds_its_mesh_on_the_cpu_where_an_accelerator_is_visible(tmp_path):
    """fully_shard without mesh= puts its mesh on torch._C._get_accelerator(), the GPU, whatever
    --device says. Faked here in a one-rank run (the environment torchrun gives it): the run
    must train on the CPU and end with a plain state_dict."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    save = tmp_path / "w.pt"
    code = ("import torch, fsdp; torch._C._get_accelerator = lambda: torch.device('cuda'); "
            f"fsdp.main({[*JOB_FLAGS, '--steps=2', f'--save={save}']!r})")
    out = ok(launch(sys.executable, "-c", code, env=env))
    assert "fsdp: 1 ranks | backend gloo | device cpu" in out
    assert load_saved(save)


class OnGpu(torch.Tensor):
    """Stands in for a CUDA tensor on a machine without one: .cpu() gives a plain tensor, and a
    file that holds one does not load with torch.load(weights_only=True), as a file of CUDA
    tensors does not load on a machine without a GPU."""

    def cpu(self):
        return self.as_subclass(torch.Tensor).clone()


def test_save_atomic_writes_cpu_tensors_that_load_anywhere(tmp_path):
    model = common.SimpleModel(hidden=8, blocks=1, heads=2)
    on_gpu = {k: v.detach().clone().as_subclass(OnGpu) for k, v in model.state_dict().items()}
    optimizer_state = {"state": {0: {"step": torch.tensor(3.0).as_subclass(OnGpu)}},
                       "param_groups": [{"lr": 0.1, "params": [0]}]}
    plumbing.checkpoints.save_atomic({"model": on_gpu, "optimizer": optimizer_state},
                                     tmp_path / "c.pt")
    loaded = torch.load(tmp_path / "c.pt", weights_only=True)  # no map_location needed
    assert type(loaded["model"]["embed.weight"]) is torch.Tensor
    assert max_diff(loaded["model"], model.state_dict()) == 0
    assert loaded["optimizer"]["state"][0]["step"] == 3.0


def test_the_clock_waits_for_every_gpu_of_a_model_parallel_run(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(str(device)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 2**21)
    devices = [torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 1)]
    meter = plumbing.meter.Meter(devices)
    synced.clear()
    meter.step(64)
    assert synced == ["cuda:0", "cuda:1"]
    summary = meter.summary(0.1, common.SimpleModel(8, 1, 2), 0.1)  # both GPUs, once each, summed
    assert "peak mem 2.0 MiB allocated, 4.0 MiB reserved (CUDA, 2 GPUs)" in summary
    assert "model TFLOP/s (job)" in summary


# Each script's own flags for a run that equals the oracle (amp.py: autocast off).
ON_ONE_DEVICE = {"single": [], "dataparallel": [], "amp": ["--dtype=fp32"]}
ON_ONE_RANK = {"ddp": [], "fsdp": [], "tp": [], "pipeline": [], "cp": []}


@pytest.mark.parametrize("script", [*ON_ONE_DEVICE, *ON_ONE_RANK])
def test_every_cpu_run_where_gpus_are_visible_ends_with_the_oracles_weights(
        script, fake_gpus, reference, tmp_path, monkeypatch):
    """--device cpu on a machine with 2 GPUs (faked: any CUDA call would fail) stays on the CPU.
    DataParallel used to take the GPUs anyway, and refuse the CPU model."""
    fake_gpus(2)
    # Where a GPU is visible and the default group is gloo, DeviceMesh gives its group an NCCL
    # side too ("cpu:gloo,cuda:nccl", torch 2.10), which only a real GPU can construct: the
    # fake asks for the gloo side alone, the one a CPU run uses.
    real_new_group = torch.distributed.device_mesh.new_group
    monkeypatch.setattr(torch.distributed.device_mesh, "new_group", lambda *args, **kwargs:
                        real_new_group(*args, **{**kwargs, "backend": "gloo"}
                                       if kwargs.get("backend") == "cpu:gloo,cuda:nccl"
                                       else kwargs))
    if script in ON_ONE_DEVICE:
        out, weights = run_in_process(script, ON_ONE_DEVICE[script], tmp_path)
    else:  # the distributed scripts, as torchrun's only worker
        out, weights = run_as_only_rank(script, ON_ONE_RANK[script], tmp_path)
    assert "MiB (RSS)" in out  # the summary measured the CPU process: no GPU was used
    assert max_diff(weights, reference[1]) < TOL


class Joined(Exception):
    """Raised by a faked init_process_group: setup() got as far as joining the group."""


def join(module, flags):
    """What a rank of `module` does up to its group: meet (plumbing), then setup(), as
    `python module.py` (its name in meet's refusals)."""
    args = module.parse_args(flags)
    with mock.patch.object(sys, "argv", [f"{module.__name__}.py"]):
        plumbing.ranks.meet(args)
    module.setup(args)


@pytest.fixture
def joining(monkeypatch):
    """Fakes what setup() calls on a GPU before it joins; returns what it was called with."""
    calls = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.setdefault("gpu", device))
    monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda precision: None)

    def init_process_group(backend=None, **kwargs):
        calls.update(backend=backend, device_id=kwargs.get("device_id"))
        raise Joined
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    return calls


def test_gpu_sharers_counts_the_ranks_of_the_machine_whose_gpu_has_the_same_uuid():
    """4 local ranks, two of them on one GPU: each learns how many drive its own, however the
    ranks arrive (each waits in the store for the others)."""
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=30))
    uuids = ["GPU-a", "GPU-b", "GPU-a", "GPU-c"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        counts = list(pool.map(lambda r: plumbing.ranks.sharing(store, r, 4, uuids[r]),
                               [3, 2, 1, 0]))
    assert counts == [1, 2, 1, 2]


@pytest.fixture
def machine_of(fake_gpus, monkeypatch):
    """A machine whose local rank r sees one GPU, its cuda:0, with the UUID uuids[r] (a GPU of
    its own, or one that other ranks see too). This process is rank 0, started by `launcher`;
    the other ranks publish their GPUs in the store the ranks meet in, from threads."""
    def install(launcher, uuids, module):
        fake_gpus(1)
        n = len(uuids)
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(n),
               "LOCAL_WORLD_SIZE": str(n)}
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        if launcher == "torchrun":  # torchrun with a per-rank CUDA_VISIBLE_DEVICES, say
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
        else:  # srun --gpus-per-task=1, or two tasks on a one-GPU node
            monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device: types.SimpleNamespace(uuid=uuids[0]))
        store = dist.HashStore()
        store.set_timeout(datetime.timedelta(seconds=30))
        monkeypatch.setattr(plumbing.ranks, "rendezvous_store", lambda *args: store)
        # meet() tells env:// to join the store it serves (faked above), not to host one
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
        pool = concurrent.futures.ThreadPoolExecutor(n - 1)
        for r in range(1, n):
            pool.submit(plumbing.ranks.sharing, store, r, n, uuids[r])
        pool.shutdown(wait=False)
    return install


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
@pytest.mark.parametrize("script", ["ddp", "fsdp", "tp", "pipeline", "cp"])
def test_ranks_that_each_see_one_gpu_of_their_own_each_drive_it_as_cuda0_over_nccl(
        script, launcher, machine_of, joining):
    """srun --gpus-per-task=1, a container per rank, or torchrun with a per-rank
    CUDA_VISIBLE_DEVICES: 4 ranks on a machine, each seeing one GPU, its own (4 UUIDs). Every
    rank drives its cuda:0 over NCCL; none refuses or falls back to gloo."""
    module = importlib.import_module(script)
    machine_of(launcher, ["GPU-0", "GPU-1", "GPU-2", "GPU-3"], module)
    with pytest.raises(Joined):
        join(module, ["--device=cuda"])
    assert joining == {"gpu": torch.device("cuda", 0), "backend": "nccl",
                       "device_id": torch.device("cuda", 0)}


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
@pytest.mark.parametrize("script", ["fsdp", "tp", "pipeline", "cp"])
def test_ranks_that_see_the_same_one_gpu_are_refused_in_one_line(script, launcher, machine_of,
                                                                joining, capsys):
    """Two Slurm tasks on a one-GPU node, or torchrun's 2 ranks on one GPU: both see one GPU,
    the same (one UUID). NCCL cannot share a GPU between ranks: refused before the group."""
    module = importlib.import_module(script)
    machine_of(launcher, ["GPU-0", "GPU-0"], module)
    with pytest.raises(SystemExit) as exit_:
        join(module, ["--device=cuda"])
    assert str(exit_.value).startswith(f"{script}.py: error: 2 ")
    assert "drive one GPU" in str(exit_.value) and "\n" not in str(exit_.value)
    assert "backend" not in joining  # the group was never joined


@pytest.mark.parametrize("script", ["fsdp", "tp", "pipeline", "cp"])
def test_python_x_py_refuses_more_workers_than_gpus_before_starting_them(script, fake_gpus,
                                                                       capsys):
    """`python X.py --nproc 2` on one GPU: its own workers all see the machine's GPUs, so the
    count is certain, and it refuses in one line before any worker starts."""
    fake_gpus(1)
    refused_in_one_line(script, ["--device=cuda", "--nproc=2"], "but 1 GPU(s)", capsys)


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_ddp_ranks_that_see_the_same_one_gpu_share_it_over_gloo(launcher, machine_of, joining,
                                                                capsys):
    import ddp
    machine_of(launcher, ["GPU-0", "GPU-0"], ddp)
    with pytest.raises(Joined):
        join(ddp, ["--device=cuda"])
    assert joining == {"gpu": torch.device("cuda", 0), "backend": "gloo", "device_id": None}
    with pytest.raises(SystemExit, match="2 ranks, one GPU: use --backend gloo"):
        machine_of(launcher, ["GPU-0", "GPU-0"], ddp)
        join(ddp, ["--device=cuda", "--backend=nccl"])


def test_dataparallel_refuses_activation_checkpointing_on_2_gpus_in_one_line(fake_gpus, capsys):
    fake_gpus(1)
    import dataparallel
    assert dataparallel.parse_args(["--device=cuda", "--activation-checkpointing"])
    fake_gpus(2)
    refused_in_one_line("dataparallel", ["--device=cuda", "--activation-checkpointing"],
                        "not with DataParallel on 2 GPUs", capsys)


def test_why_a_dataparallel_replica_would_run_gpu0s_checkpointed_forward():
    """The reason for the refusal above: a forward stored on a module instance is copied, bound
    to the original, into every replica DataParallel makes of it (the scripts' own wrapping)."""
    block = common.Block(4, 2)
    plumbing.flags.compile_and_checkpoint([block], argparse.Namespace(compile=False,
                                                              activation_checkpointing=True))
    replica = block._replicate_for_data_parallel()
    assert replica.forward.args[0].__self__ is block


def test_the_profiler_records_gpu_kernels_only_for_a_run_on_a_gpu(fake_gpus, monkeypatch,
                                                                  tmp_path):
    fake_gpus(1)
    asked = []

    class Recorder:
        def __init__(self, activities, **kwargs):
            asked.append(set(activities))

        def start(self):
            pass
    monkeypatch.setattr(torch.profiler, "profile", Recorder)
    cpu, cuda = torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA
    plumbing.meter.Profiler(tmp_path, 0, torch.device("cpu"))
    plumbing.meter.Profiler(tmp_path, 0, [torch.device("cpu"), torch.device("cuda", 0)])
    assert asked == [{cpu}, {cpu, cuda}]


@pytest.mark.parametrize("backend, destroyed", [("nccl", True), ("gloo", False)])
def test_a_refusal_over_nccl_leaves_the_group_before_its_one_line(backend, destroyed,
                                                                 monkeypatch):
    left = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: left.append(True))
    with pytest.raises(SystemExit, match="^the reason$"):
        plumbing.ranks.fail("the reason")
    assert left == ([True] if destroyed else [])


def test_the_communication_check_binds_nccl_to_its_rank_s_gpu(fake_gpus, as_torchrun, joining,
                                                             monkeypatch):
    """torchrun's 2 ranks, both seeing the machine's 2 GPUs: rank 1 drives cuda:1 (its own,
    told by its UUID, beside rank 0's cuda:0)."""
    fake_gpus(2)
    as_torchrun(2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(uuid=f"GPU-{device.index}"))
    store = dist.HashStore()
    monkeypatch.setattr(plumbing.diagnostics, "rendezvous_store", lambda *args: store)
    with concurrent.futures.ThreadPoolExecutor(1) as rank0, pytest.raises(Joined):
        rank0.submit(plumbing.ranks.sharing, store, 0, 2, "GPU-0")
        plumbing.diagnostics.communication_check()
    assert joining == {"gpu": torch.device("cuda", 1), "backend": "nccl",
                       "device_id": torch.device("cuda", 1)}


@pytest.mark.parametrize("gpus", [3, 6])
def test_the_diagnostics_suggest_the_rank_count_ddp_py_takes(gpus, fake_gpus, monkeypatch):
    fake_gpus(gpus)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 5))
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(
        name="GPU", total_memory=2**35, major=9, minor=0))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: True)
    report = plumbing.diagnostics.environment_report()
    import ddp
    assert f"torchrun --nproc_per_node={ddp.parse_args([]).nproc} ddp.py" in report
    assert f"{DEFAULT_WORKERS[gpus]} of {gpus} GPUs divide --batch-size 64" in report


@pytest.mark.parametrize("missing, says", [("compiler", "finds none ($CC, gcc or clang)"),
                                           ("Python.h", "finds no Python.h")])
def test_compile_on_a_gpu_without_what_triton_builds_with_is_refused_in_one_line(
        missing, says, fake_gpus, monkeypatch, tmp_path, capsys):
    fake_gpus(1)
    monkeypatch.delenv("CC", raising=False)
    if missing == "compiler":
        monkeypatch.setattr(plumbing.compile.shutil, "which", lambda name: None)
    else:
        monkeypatch.setattr(plumbing.compile.sysconfig, "get_paths",
                            lambda: {"include": str(tmp_path)})
    refused_in_one_line("single", ["--device=cuda", "--compile"], says, capsys)
