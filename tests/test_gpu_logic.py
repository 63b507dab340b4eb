"""What the scripts decide from the GPUs they find, proven on a CPU by faking what they read
(torch.cuda.is_available, device_count, get_device_capability, the accelerator): default worker
and stage counts on 1-8 GPUs, the autocast type by compute capability, FSDP's mesh on the CPU
where a GPU is visible, weights saved as CPU tensors, and a clock that waits for every GPU."""

import importlib
import sys

import pytest
import torch

import common
from conftest import JOB_FLAGS, free_port, load_saved, max_diff, ok, launch

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
    assert amp.setup(amp.parse_args([])) == (torch.device("cuda", 0), dtype)


def test_fsdp_on_cpu_builds_its_mesh_on_the_cpu_where_an_accelerator_is_visible(tmp_path):
    """fully_shard without mesh= puts its mesh on torch._C._get_accelerator(), the GPU, whatever
    --device says. Faked here in a one-rank run (the environment torchrun gives it): the run
    must train on the CPU and end with a plain state_dict."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    save = tmp_path / "w.pt"
    code = ("import torch, fsdp; torch._C._get_accelerator = lambda: torch.device('cuda'); "
            f"fsdp.main({[*JOB_FLAGS, '--steps=2', f'--save={save}']!r})")
    out = ok(launch(sys.executable, "-c", code, env=env, timeout=60))
    assert "fsdp: 1 ranks | backend gloo | device cpu" in out
    assert load_saved(save)


class OnGpu(torch.Tensor):
    """Stands in for a CUDA tensor on a machine without one: .cpu() gives a plain tensor, and a
    file that holds one does not load with torch.load(weights_only=True), as a file of CUDA
    tensors does not load on a machine without a GPU."""

    def cpu(self):
        return self.as_subclass(torch.Tensor).clone()


def test_save_atomic_writes_cpu_tensors_that_load_anywhere(tmp_path):
    model = common.SimpleModel(hidden=8, blocks=1)
    on_gpu = {k: v.detach().clone().as_subclass(OnGpu) for k, v in model.state_dict().items()}
    optimizer_state = {"state": {0: {"step": torch.tensor(3.0).as_subclass(OnGpu)}},
                       "param_groups": [{"lr": 0.1, "params": [0]}]}
    common.save_atomic({"model": on_gpu, "optimizer": optimizer_state}, tmp_path / "c.pt")
    loaded = torch.load(tmp_path / "c.pt", weights_only=True)  # no map_location needed
    assert type(loaded["model"]["input.weight"]) is torch.Tensor
    assert max_diff(loaded["model"], model.state_dict()) == 0
    assert loaded["optimizer"]["state"][0]["step"] == 3.0


def test_the_clock_waits_for_every_gpu_of_a_model_parallel_run(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(str(device)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 2**20)
    devices = [torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 1)]
    meter = common.Meter(devices)
    synced.clear()
    meter.step(64)
    assert synced == ["cuda:0", "cuda:1"]
    assert "peak mem 2.0 MiB (CUDA)" in meter.summary(0.1, 1, 0.1)  # both GPUs, once each
