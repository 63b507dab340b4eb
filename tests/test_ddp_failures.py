"""ddp.py survives failures: restarts resume from checkpoints to the same weights, on any
number of ranks; a dead peer ends the job; bad input is refused in one line."""

import argparse
import functools
import importlib
import os
import sys

import pytest
import torch

import common
import plumbing.checkpoints
import plumbing.ranks
from conftest import (JOB, early_results, free_port, launch_and_kill_a_worker, launch_together,
                      load_saved,
                      max_diff, refused_in_one_line, torchrun_cmd)
from reference import reference_train
from conftest import FP64_TOL

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# Long enough (~1-2 s of training) that a worker can be killed mid-run, on a tiny model.
LONG = dict(JOB, steps=40, batch_size=60)  # 16 steps an epoch: the resume crosses epochs
LONG_FLAGS = [*(f"--{k.replace('_', '-')}={v}" for k, v in LONG.items()), "--device=cpu"]


def early_launches(folder):  # started when the tests are collected (conftest.py)
    """Runs that mostly wait (for a restart, for the process group's timeout), each watched
    from a thread of this process, which kills a worker once a line appears: they wait
    beside the other tests instead of before them."""
    restart = [*TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=1", "ddp.py",
               *LONG_FLAGS, "--fp64", f"--checkpoint={folder / 'ckpt.pt'}",
               "--checkpoint-every=10", f"--save={folder / 'w.pt'}"]
    dead_peer = {"torchrun": [*TORCHRUN, "--standalone", "--nproc_per_node=2", "ddp.py"],
                 "spawn": [sys.executable, "ddp.py", "--nproc=2", "--device=cpu"]}
    return [functools.partial(launch_and_kill_a_worker, *restart, script="ddp.py",
                              when="checkpoint: step 20"),
            *(functools.partial(launch_and_kill_a_worker, *cmd, *LONG_FLAGS, "--timeout=10",
                                "--log-every=1", script="ddp.py", when="step    10/")
              for cmd in dead_peer.values())], None


@pytest.fixture(scope="module")
def watched():
    """(folder, [the restarted run, the dead peer under torchrun, under spawn]): each a
    (CompletedProcess, seconds from the kill to the exit)."""
    return early_results(__name__)


def test_sigkill_of_a_worker_under_max_restarts_resumes_to_the_one_device_weights(watched):
    folder, [(result, _), *_] = watched
    assert result.returncode == 0, result.stdout
    assert "resumed from" in result.stdout  # the group really restarted from the file
    # In float64 the restarted job is the uninterrupted one on one device, where fp32's
    # summation orders could part them over 40 steps (docs/drift.md).
    _, expected, _ = reference_train(**LONG, fp64=True)
    assert max_diff(load_saved(folder / "w.pt"), expected) < FP64_TOL


def test_crash_while_writing_a_checkpoint_leaves_the_previous_one(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    plumbing.checkpoints.save_atomic({"step": torch.tensor(1)}, path)

    def dies_halfway(obj, f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt  # or a full disk, a kill, a power cut...

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        plumbing.checkpoints.save_atomic({"step": torch.tensor(2)}, path)
    assert torch.load(path, weights_only=True)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left


@pytest.mark.parametrize("launcher", [1, 2], ids=["torchrun", "spawn"])
def test_a_dead_peer_ends_the_job_with_an_error(launcher, watched):
    result, seconds = watched[1][launcher]
    assert result.returncode != 0
    # within the process-group timeout (10 s), plus the launcher's teardown on a busy machine;
    # a hang would last until launch_and_kill_a_worker's own timeout
    assert seconds < 10 + 10


def load_checkpoint(module, args, model):
    """module.load_checkpoint on `model`; what it would restore besides (the optimizer, amp.py's
    scaler) is None: every refusal comes before they are touched."""
    extra = module.load_checkpoint.__code__.co_argcount - 2
    return module.load_checkpoint(args, model, *[None] * extra)


@pytest.mark.parametrize("script", ["single", "dataparallel", "ddp", "amp", "pipeline", "cp"])
def test_corrupt_or_mismatched_checkpoint_is_a_clear_error_and_is_not_overwritten(
        script, tmp_path):
    """load_checkpoint, which every rank calls before the first collective, stops with one
    line (SystemExit: exit status 1) and leaves the file as it was."""
    module = importlib.import_module(script)
    args = module.parse_args(["--device=cpu", *(["--nproc=1"] if script in ("ddp", "pipeline",
                                                                            "cp") else [])])
    ckpt = args.checkpoint = str(tmp_path / "ckpt.pt")
    args.hidden = 32  # the run's model, as the flags describe it
    cases = [(b"garbage", "cannot be read")]
    plumbing.checkpoints.save_atomic({"model": common.SimpleModel(hidden=16).state_dict()}, ckpt)
    cases.append((open(ckpt, "rb").read(), "saved with another model size; use its --hidden"))
    # the same weights' shapes, another head count: they would load, and compute otherwise
    plumbing.checkpoints.save_atomic({"model": common.SimpleModel(hidden=32, heads=2).state_dict(),
                                      "heads": 2, "batch_size": 64, "seed": 0, "fp64": False,
                                      "optimizer": {}, "step": 1}, ckpt)
    cases.append((open(ckpt, "rb").read(), "saved with --heads 2; use --heads 2"))
    for content, message in cases:
        with open(ckpt, "wb") as f:
            f.write(content)
        with pytest.raises(SystemExit) as exit_:
            load_checkpoint(module, args, common.SimpleModel(hidden=32))
        assert str(exit_.value).startswith(f"{script}.py: error: --checkpoint {ckpt}: {message}")
        assert open(ckpt, "rb").read() == content


@pytest.mark.parametrize("script", ["single", "dataparallel", "ddp", "pipeline", "cp"])
def test_checkpoint_of_the_other_precision_is_refused_in_one_line_and_left_as_it_was(
        script, tmp_path):
    """load_state_dict would cast an fp64 checkpoint into an fp32 run (or the reverse) silently."""
    module = importlib.import_module(script)
    nproc = ["--nproc=1"] if script in ("ddp", "pipeline", "cp") else []
    ckpt = tmp_path / "ckpt.pt"
    for saved_fp64, flags, message in [(True, [], "written with --fp64; add --fp64"),
                                       (False, ["--fp64"], "written without --fp64; drop --fp64")]:
        args = module.parse_args(["--device=cpu", *nproc, *flags, f"--checkpoint={ckpt}"])
        model = common.SimpleModel().to(torch.float64 if saved_fp64 else torch.float32)
        plumbing.checkpoints.save_atomic({"model": model.state_dict(), "batch_size": 64, "seed": 0,
                            "fp64": saved_fp64, "heads": 4}, ckpt)
        before = ckpt.read_bytes()
        line = f"{script}.py: error: --checkpoint {ckpt}: {message}"
        with pytest.raises(SystemExit, match=line):
            load_checkpoint(module, args, common.SimpleModel())
        assert ckpt.read_bytes() == before


def test_checkpoint_with_another_batch_size_is_a_clear_error(tmp_path):
    import ddp
    args = ddp.parse_args(["--device=cpu", "--nproc=1", "--batch-size=32"])
    args.checkpoint = str(tmp_path / "ckpt.pt")
    model = common.SimpleModel()
    plumbing.checkpoints.save_atomic({"model": model.state_dict(), "batch_size": 64, "seed": 0,
                                      "heads": 4}, args.checkpoint)
    with pytest.raises(SystemExit, match="with --batch-size 64, not 32.*use --batch-size 64"):
        load_checkpoint(ddp, args, model)


# Bad flags are refused by parse_args before any process starts: called here directly, they
# exit with argparse's status 2 and one "error:" line naming the flag and the fix.
SCRIPTS = ["single", "dataparallel", "ddp", "diloco", "fsdp", "tp", "amp", "pipeline", "cp", "ep", "nd",
           *(f"from_scratch.{name}" for name in ("ddp", "zero", "fsdp", "tp", "pipeline"))]
BAD_FLAGS = [
    (["--steps=0"], "--steps: must be greater than 0"),
    (["--batch-size=-8"], "--batch-size: must be greater than 0"),
    (["--lr=0"], "--lr: must be greater than 0"),
    (["--eval-every=0"], "--eval-every: must be greater than 0"),
    (["--clip=-1"], "--clip -1.0: must be 0 (no clipping) or a positive, finite norm"),
    (["--clip=nan"], "--clip nan: must be 0 (no clipping) or a positive, finite norm"),
    (["--lr=nan"], "--lr: must be a finite number, got nan"),
    (["--lr=inf"], "--lr: must be a finite number, got inf"),
    (["--device=tpu"], "--device: invalid choice: 'tpu'"),
    (["--save=/no/such/folder/w.pt"], "--save /no/such/folder/w.pt: its folder does not exist"),
]


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("flags, message", BAD_FLAGS)
def test_bad_flags_are_refused_in_one_line(script, flags, message, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    refused_in_one_line(script, flags, message, capsys)


DISTRIBUTED_BAD_FLAGS = [
    (["--backend=mpi"], "--backend: invalid choice: 'mpi'"),
    (["--device=cuda"], "--device cuda: CUDA is not available here"),
    (["--backend=nccl", "--device=cpu"], "NCCL needs one GPU per rank"),
]


@pytest.mark.parametrize("script, flags, message", [
    *[("ddp", f, m) for f, m in DISTRIBUTED_BAD_FLAGS],
    ("pipeline", ["--backend=mpi"], "--backend: invalid choice: 'mpi'"),
    ("pipeline", ["--device=cuda"], "--device cuda: CUDA is not available here"),
    ("pipeline", ["--backend=nccl", "--device=cpu"], "CPU tensors travel over gloo only"),
    ("fsdp", ["--replicate=3"], "--replicate 3 must divide the world size 2"),
    ("diloco", ["--outer-momentum=1"], "--outer-momentum 1.0: must be in [0, 1)"),
    ("diloco", ["--inner-steps=0"], "--inner-steps: must be greater than 0"),
    ("nd", ["--backend=nccl", "--device=cpu"], "CPU tensors travel over gloo only"),
    *[(script, ["--checkpoint=/no/such/c.pt"], "--checkpoint /no/such/c.pt: its folder")
      for script in ("single", "ddp", "amp", "pipeline", "nd")],
])
def test_bad_distributed_flags_are_refused_in_one_line(script, flags, message, capsys,
                                                       as_torchrun):
    if "--device=cuda" in flags and torch.cuda.is_available():
        pytest.skip("CUDA is available here, so --device cuda is valid")
    as_torchrun(2)
    refused_in_one_line(script, flags, message, capsys)


def test_bad_checkpoint_ends_in_its_one_line_on_every_launch_path(tmp_path):
    """`python ddp.py` ends with the worker's line (no mp.spawn traceback under it), exit 1;
    under torchrun the same line is the "Root Cause" of torchrun's failure report."""
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(b"garbage")
    flags = ["--steps=2", f"--checkpoint={ckpt}"]
    spawned, under_torchrun = launch_together([
        [sys.executable, "ddp.py", "--nproc=1", "--device=cpu", *flags],
        torchrun_cmd(1, "ddp.py", "--device=cpu", *flags)])
    line = f"ddp.py: error: --checkpoint {ckpt}: cannot be read"
    assert spawned.returncode == 1, spawned.stderr
    assert "Traceback" not in spawned.stderr
    assert spawned.stderr.strip().splitlines()[-1].startswith(line), spawned.stderr
    assert under_torchrun.returncode != 0
    assert line in under_torchrun.stderr.split("Root Cause")[-1], under_torchrun.stderr
    assert ckpt.read_bytes() == b"garbage"


@pytest.mark.parametrize("omp", [None, "3"])
def test_spawned_workers_split_the_cores_unless_omp_num_threads_is_set(omp, monkeypatch):
    # spawned() sets RANK, WORLD_SIZE, ... in os.environ: give it a copy, so that they do not
    # leak into the environment of every command the later tests launch.
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    monkeypatch.setattr(os, "environ", {**env, **({"OMP_NUM_THREADS": omp} if omp else {})})
    threads = []
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # as OMP_NUM_THREADS=3 would have set it at start-up
    monkeypatch.setattr(plumbing.ranks, "meet", lambda args: None)  # no peer to meet
    try:
        plumbing.ranks.spawned(0, lambda args: threads.append(torch.get_num_threads()),
                               argparse.Namespace(nproc=2, backend="gloo"), free_port())
    finally:
        torch.set_num_threads(before)
    assert threads == [3 if omp else max(1, os.cpu_count() // 2)]


@pytest.mark.parametrize("script", ["single", "amp", "ddp", "fsdp", "tp", "pipeline", "cp",
                                    "nd"])
def test_compile_without_a_cpp_compiler_or_on_an_unsupported_python_is_refused_in_one_line(
        script, capsys, monkeypatch):
    """Faked: inductor finds no C++ compiler on the CPU; torch.compile refuses this Python."""
    import shutil
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    refused_in_one_line(script, ["--compile"], "--compile on the CPU: inductor compiles C++ "
                        "and finds no compiler (g++, or $CXX); install one", capsys)

    def unsupported(*args, **kwargs):
        raise RuntimeError("Python 3.15+ not yet supported for torch.compile")
    monkeypatch.setattr(torch, "compile", unsupported)
    refused_in_one_line(script, ["--compile"], "--compile: Python 3.15+ not yet supported",
                        capsys)


@pytest.mark.parametrize("script", ["single", "amp", "ddp", "fsdp", "tp", "pipeline", "cp"])
def test_compile_with_fp64_on_a_torch_older_than_2_13_is_refused_in_one_line_on_the_cpu(
        script, capsys, monkeypatch):
    """torch 2.10 and 2.12 crash in the first backward of the compiled causal attention in
    float64 on the CPU (pytorch/pytorch#185539; measured); 2.13 trains. Faked: the version."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(torch, "__version__", "2.12.0+cpu")
    refused_in_one_line(script, ["--compile", "--fp64"], "--compile with --fp64 on the CPU: "
                        "torch 2.12.0+cpu's compiled attention fails in backward", capsys)
    parse_args = importlib.import_module(script).parse_args
    one_rank = ["--nproc=1"] if script not in ("single", "amp") else []
    parse_args(["--device=cpu", "--compile", *one_rank])  # fp32 compiles on 2.12
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    parse_args(["--device=cpu", "--compile", "--fp64", *one_rank])


def test_compile_with_dataparallel_is_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    refused_in_one_line("dataparallel", ["--compile"], "--compile: not with DataParallel", capsys)
