"""pipeline.py: pipelined stages and model parallelism train to the same weights as one
device, and their checkpoints resume on any number of stages, or in single.py."""

import shutil

import pytest
import torch

from plumbing.compile import torch_older_than
from conftest import (CUDA_DEFAULTS, CUDA_JOB_FLAGS, FP32_VAL_TOL, FP64_CLIP, FP64_JOB, FP64_SEEDS,
                      JOB, TOL, assert_checkpoints_resume_to_the_oracle,
                      assert_fp64_run_equals_the_fp64_oracle, assert_gpu_run_equals_oracle,
                      assert_norms_are_the_oracles, assert_profiled, early_runs, fp64,
                      launched_runs, logged_losses, max_diff, needs_2_gpus, needs_cuda, python,
                      refused_in_one_line, run_as_only_rank, run_in_process, succeeded,
                      summary_val_loss, torchrun)
from reference import reference_train

SEED_A, SEED_B = FP64_SEEDS[0], FP64_SEEDS[-1]

RUNS = {  # name: (stages: ranks, conftest.ranks_cmd; flags). Each schedule in fp32 and fp64.
    # fp32, what users run: the short job; traces steps 5-7, and writes a checkpoint every 4
    # steps, which single.py continues below
    "2 stages, gpipe": (2, ["--schedule=gpipe", "--microbatches=4", "--profile={folder}/trace",
                            "--checkpoint={folder}/ckpt.pt", "--checkpoint-every=4"]),
    # fp64 on odd flags: 4 blocks cut 1, 1, 2; 1F1B's checkpoint (step 40) is continued on 2
    # ranks in a V (zbv) and in single.py (compiled: tp.py's spawn run and single.py;
    # compiling costs each process seconds)
    "fp64, 3 stages, 1f1b, AC": (3, [*fp64(SEED_A), "--blocks=4", "--schedule=1f1b",
                                     "--microbatches=6", "--activation-checkpointing",
                                     "--checkpoint={folder}/ckpt64.pt"]),
    # clipped by the norm of the whole gradient, its parts added up over the stages
    "fp64, 2 stages, gpipe, clip, CUDA's Adam": (2, [CUDA_DEFAULTS, *fp64(SEED_B, clip=FP64_CLIP),
                                                   "--schedule=gpipe",
                                        "--microbatches=3"]),
    # virtual stages: 6 blocks, 3 stages per rank in a loop (rank 0: 0, 2, 4), clipped
    "fp64, 2 ranks x 3 stages, interleaved-1f1b, clip": (2, [
        *fp64(SEED_B, clip=FP64_CLIP), "--blocks=6", "--schedule=interleaved-1f1b",
        "--stages-per-rank=3", "--microbatches=6"]),
    # each backward cut in two (the inputs' gradient, then the weights'), recomputing inside
    "fp64, 2 ranks x 2 stages, zero-bubble, AC, CUDA's Adam": (2, [
        CUDA_DEFAULTS, *fp64(SEED_A), "--blocks=4", "--schedule=zero-bubble",
        "--microbatches=4", "--activation-checkpointing"]),
    # a V: rank 0 runs the first and the last stage, so the loss is on the inputs' rank
    "fp64, 2 ranks in a V, dualpipev, clip": (2, [*fp64(SEED_B, clip=FP64_CLIP), "--blocks=4",
                                                 "--schedule=dualpipev", "--microbatches=4"]),
}
FP64_RUNS = {  # name: (seed, clip, blocks)
    "fp64, 3 stages, 1f1b, AC": (SEED_A, None, 4),
    "fp64, 2 stages, gpipe, clip, CUDA's Adam": (SEED_B, FP64_CLIP, JOB["blocks"]),
    "fp64, 2 ranks x 3 stages, interleaved-1f1b, clip": (SEED_B, FP64_CLIP, 6),
    "fp64, 2 ranks x 2 stages, zero-bubble, AC, CUDA's Adam": (SEED_A, None, 4),
    "fp64, 2 ranks in a V, dualpipev, clip": (SEED_B, FP64_CLIP, 4)}
# zbv: the 3 stages' checkpoint, continued below. The gloo of torch < 2.12 cannot send to its own
# rank, as a V's start does: pipeline.py refuses zbv and dualpipev there (tested below).
V_ON_GLOO = not torch_older_than(2, 12)
if not V_ON_GLOO:
    del RUNS["fp64, 2 ranks in a V, dualpipev, clip"]


early_launches = early_runs("pipeline.py", RUNS)  # queued when the tests are collected


@pytest.fixture(scope="module")
def runs():
    return launched_runs(__name__, "pipeline.py", RUNS)


@pytest.fixture(scope="module")
def model_parallel(tmp_path_factory):
    """One process driving 3 stages (`--nproc 1 --stages 3`), run in this process as torchrun
    would start its only worker, in fp32 and in fp64 on both seeds (clipped); `python
    pipeline.py` (2 stages, spawned) is launched by test_defaults."""
    folder = tmp_path_factory.mktemp("model_parallel")
    return {seed: run_as_only_rank("pipeline", [
        "--nproc=1", "--stages=3", *(fp64(seed, clip=FP64_CLIP) if seed is not None else [])],
        folder) for seed in [None, *FP64_SEEDS]}


def test_model_parallel_stages_in_one_process_equal_one_device(model_parallel, reference,
                                                               reference_val):
    out, weights = model_parallel[None]
    assert "model parallel | 3 stages" in out
    assert "stages share a device" in out  # said once, on a machine with fewer devices
    assert max_diff(weights, reference[1]) < TOL
    losses = logged_losses(out)
    assert losses[-1] < losses[0] - 0.1  # it trains (JOB: 3.66 -> 3.50 in fp32)
    assert summary_val_loss(out) == pytest.approx(reference_val, abs=FP32_VAL_TOL)
    assert_norms_are_the_oracles(out, reference[3])


@pytest.mark.parametrize("seed", FP64_SEEDS)
def test_fp64_clipped_model_parallel_equals_the_fp64_oracle_on_any_seed(seed, model_parallel):
    assert_fp64_run_equals_the_fp64_oracle(model_parallel[seed], seed, clip=FP64_CLIP)


def test_pipeline_equals_one_device_in_fp32(runs, reference, reference_val):
    out, weights = succeeded(runs["2 stages, gpipe"])
    assert max_diff(weights, reference[1]) < TOL
    # the loss the last stage computed, brought to rank 0, is the whole batch's loss
    assert logged_losses(out)[-1] == pytest.approx(reference[2][-1], abs=1e-5)
    # evaluated through the stages: the exact mean over the held-out set
    assert summary_val_loss(out) == pytest.approx(reference_val, abs=FP32_VAL_TOL)
    assert_norms_are_the_oracles(out, reference[3])  # every stage's part, added up


@pytest.mark.parametrize("name", FP64_RUNS)
def test_fp64_every_schedule_equals_the_fp64_oracle(name, runs):
    """gpipe, 1f1b, interleaved-1f1b (3 virtual stages per rank), zero-bubble (each backward
    in two) and dualpipev (a V) on odd flags: one device's weights within 1e-9 after 40 steps,
    every logged loss and gradient norm, the exact validation loss (zbv: the resume below)."""
    if name not in RUNS:
        pytest.skip(f"torch {torch.__version__}'s gloo cannot run a V schedule (refused)")
    seed, clip, blocks = FP64_RUNS[name]
    assert_fp64_run_equals_the_fp64_oracle(succeeded(runs[name]), seed, clip=clip, blocks=blocks)


def test_profile_writes_a_trace_per_stage_with_every_micro_batch_and_the_sends(runs):
    """The schedule marks each micro-batch's forward and backward; activations go down and
    gradients up with send/recv. The run still equals one device (above)."""
    assert_profiled(runs["2 stages, gpipe"][1].parent / "trace", 2, "Forward 3", "Backward 3",
                    "optimizer step", ("gloo:send", "nccl:send"), ("gloo:recv", "nccl:recv"))


def test_checkpoint_of_2_stages_resumes_in_single_py(runs, tmp_path):
    """Rank 0 gathers every stage's weights and Adam state into the file single.py writes: the
    fp32 2-stage checkpoint (step 8), continued to step 12 by single.py, ends with the weights
    of 12 uninterrupted steps on one device."""
    shutil.copy(runs["2 stages, gpipe"][1].parent / "ckpt.pt", tmp_path / "single.pt")
    out, weights = run_in_process("single", ["--steps=12", f"--checkpoint={tmp_path}/single.pt"],
                                  tmp_path)
    assert "resumed from" in out and "at step 8" in out
    assert max_diff(weights, reference_train(**dict(JOB, steps=12))[1]) < TOL


def test_fp64_checkpoint_of_3_stages_resumes_on_2_ranks_in_a_v_and_in_single_py(runs, tmp_path):
    """The fp64 1F1B checkpoint of 3 stages (step 40), continued to step 48 on 2 ranks of 2
    stages each in a V (zbv; interleaved-1f1b where torch's gloo cannot run a V) and by
    single.py, ends within 1e-9 of 48 uninterrupted steps on one device."""
    written = runs["fp64, 3 stages, 1f1b, AC"][1].parent / "ckpt64.pt"
    for copy in ("c2.pt", "single.pt"):
        shutil.copy(written, tmp_path / copy)
    schedule = "zbv" if V_ON_GLOO else "interleaved-1f1b"
    assert_checkpoints_resume_to_the_oracle("pipeline.py", {
        (2, f"--schedule={schedule}", "--microbatches=4", "--blocks=4"):
            (tmp_path / "c2.pt", SEED_A, None, {"blocks": 4})}, tmp_path, SEED_A)
    steps = FP64_JOB["steps"] + 8
    run = run_in_process("single", [*fp64(SEED_A, steps=steps), "--blocks=4",
                                    f"--checkpoint={tmp_path}/single.pt"], tmp_path)
    assert f"at step {FP64_JOB['steps']}" in run[0]
    assert_fp64_run_equals_the_fp64_oracle(run, SEED_A, steps, blocks=4)


def test_microbatches_that_do_not_divide_the_batch_are_a_clear_error(as_torchrun, capsys):
    as_torchrun(2)
    refused_in_one_line("pipeline", ["--batch-size=64", "--microbatches=5"],
                        "--microbatches 5 must divide --batch-size 64", capsys)


@pytest.mark.parametrize("flag", ["--microbatches=8", "--schedule=1f1b", "--stages-per-rank=2"])
def test_one_process_refuses_the_schedule_flags_it_would_ignore(flag, capsys, monkeypatch):
    """Model parallelism runs the whole batch through the stages in turn: no micro-batches,
    no schedule. Asked for, they are refused in one line, not silently ignored."""
    monkeypatch.delenv("RANK", raising=False)
    refused_in_one_line("pipeline", ["--nproc=1", flag], f"{flag.split('=')[0]}: one process "
                        "(model parallelism) runs no pipeline schedule", capsys)


def test_more_stages_than_blocks_is_a_clear_error(as_torchrun, capsys):
    as_torchrun(3)
    refused_in_one_line("pipeline", ["--blocks=2"], "3 stages but --blocks 2: every stage "
                        "needs a block; use --blocks 3 or more", capsys)


def test_more_model_parallel_stages_than_blocks_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    refused_in_one_line("pipeline", ["--nproc=1", "--stages=5", "--blocks=4"],
                        "5 stages but --blocks 4", capsys)


def test_1f1b_with_fewer_microbatches_than_stages_is_a_clear_error(as_torchrun, capsys):
    as_torchrun(3)
    refused_in_one_line("pipeline", ["--schedule=1f1b", "--microbatches=2", "--batch-size=60"],
                        "--schedule 1f1b needs --microbatches >= stages (3)", capsys)


def test_stages_other_than_the_ranks_are_a_clear_error(as_torchrun, capsys):
    as_torchrun(2)
    refused_in_one_line("pipeline", ["--stages=3"], "--stages 3: with 2 ranks the stages are the "
                        "ranks x --stages-per-rank; drop --stages, or use --nproc 1", capsys)


@pytest.mark.parametrize("flags, message", [
    (["--stages-per-rank=2"], "--stages-per-rank 2: --schedule gpipe runs 1 per rank"),
    (["--schedule=zbv", "--stages-per-rank=3"], "--stages-per-rank 3: --schedule zbv runs 2"),
    (["--schedule=interleaved-1f1b", "--microbatches=5", "--batch-size=60"],
     "--microbatches 5: --schedule interleaved-1f1b runs rounds of 2 (the ranks); use 4"),
    (["--schedule=dualpipev", "--microbatches=2"],
     "--schedule dualpipev needs --microbatches >= stages (4)"),
    (["--schedule=interleaved-1f1b", "--stages-per-rank=3"], "6 stages but --blocks 4"),
    (["--schedule=zero-bubble", "--compile"], "--compile: --schedule zero-bubble splits each "
     "backward in two, which torch.compile does not support; use interleaved-1f1b"),
])
def test_a_schedule_asked_for_what_it_cannot_run_is_refused_in_one_line(flags, message,
                                                                         as_torchrun, capsys):
    as_torchrun(2)
    refused_in_one_line("pipeline", ["--device=cpu", *flags], message, capsys)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_a_v_schedule_on_the_gloo_of_torch_older_than_2_12_is_refused_in_one_line(
        schedule, as_torchrun, capsys, monkeypatch):
    """Measured: on torch 2.10 and 2.11 a V's start (each stage greeting its neighbours, one of
    them on its own rank) ends in gloo's "Pair is not connected"; 2.12 and 2.13 run it."""
    as_torchrun(2)
    monkeypatch.setattr("pipeline.torch_older_than", lambda major, minor: True)
    refused_in_one_line("pipeline", ["--device=cpu", f"--schedule={schedule}"],
                        f"--schedule {schedule}: the gloo of torch", capsys)


@needs_cuda
def test_model_parallel_on_cuda_equals_one_device(reference, tmp_path):
    """Two stages on cuda:0 and cuda:1, or both on cuda:0 with one GPU."""
    result = python("pipeline.py", *CUDA_JOB_FLAGS, "--nproc=1", "--stages=2",
                    f"--save={tmp_path / 'w.pt'}")
    assert "on cuda:0, cuda:" in result.stdout
    assert_gpu_run_equals_oracle(result, tmp_path / "w.pt", reference)


@needs_2_gpus
def test_pipeline_on_two_gpus_over_nccl_equals_one_device(reference, tmp_path):
    result = torchrun(2, "pipeline.py", *CUDA_JOB_FLAGS, "--backend=nccl",
                      f"--save={tmp_path / 'w.pt'}")
    assert_gpu_run_equals_oracle(result, tmp_path / "w.pt", reference)
