"""pipeline.py: pipelined stages and model parallelism train to the same weights as one
device, and their checkpoints resume on any number of stages, or in single.py."""

import os
import shutil
from unittest import mock

import pytest

from conftest import (CUDA_JOB_FLAGS, JOB, TOL, VAL_TOL, assert_checkpoints_resume_to_the_oracle,
                      assert_gpu_run_equals_oracle, assert_profiled, free_port, launch_runs,
                      logged_losses, max_diff, needs_2_gpus, needs_cuda, python,
                      refused_in_one_line, run_in_process, succeeded, summary_val_loss, torchrun)
from reference import reference_train

RUNS = {  # name: (stages: ranks under torchrun; flags). Each schedule once, 2 and 3 stages once.
    # traces steps 5-7, and writes a checkpoint every 4 steps: the resume test continues it
    "2 stages, gpipe": (2, ["--schedule=gpipe", "--microbatches=4", "--profile={folder}/trace",
                            "--checkpoint={folder}/ckpt.pt", "--checkpoint-every=4"]),
    # (compiled: tp.py's spawn run and single.py; compiling costs each process seconds)
    "3 stages, 1f1b, AC": (3, ["--schedule=1f1b", "--microbatches=4",
                               "--activation-checkpointing"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch_runs("pipeline.py", RUNS, tmp_path_factory.mktemp("pipeline"))


@pytest.fixture(scope="module")
def model_parallel(tmp_path_factory):
    """One process driving 3 stages (`--nproc 1 --stages 3`), run in this process as torchrun
    would start its only worker; `python pipeline.py` (2 stages, spawned) is launched by
    test_defaults."""
    world_of_one = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    with mock.patch.dict(os.environ, world_of_one):
        return run_in_process("pipeline", ["--nproc=1", "--stages=3"],
                              tmp_path_factory.mktemp("model_parallel"))


def test_model_parallel_stages_in_one_process_equal_one_device(model_parallel, reference,
                                                               reference_val):
    out, weights = model_parallel
    assert "model parallel | 3 stages" in out
    assert "stages share a device" in out  # said once, on a machine with fewer devices
    assert max_diff(weights, reference[1]) < TOL
    losses = logged_losses(out)
    assert losses[-1] < 0.5 * losses[0]
    assert summary_val_loss(out) == pytest.approx(reference_val, abs=VAL_TOL)


@pytest.mark.parametrize("name", RUNS)
def test_pipeline_equals_one_device(name, runs, reference):
    out, weights = succeeded(runs[name])
    assert max_diff(weights, reference[1]) < TOL
    # the loss the last stage computed, brought to rank 0, is the whole batch's loss
    assert logged_losses(out)[-1] == pytest.approx(reference[2][-1], abs=1e-5)


@pytest.mark.parametrize("name", RUNS)
def test_validation_through_the_stages_is_the_exact_mean_over_the_held_out_set(
        name, runs, reference_val):
    out = succeeded(runs[name])[0]
    assert summary_val_loss(out) == pytest.approx(reference_val, abs=VAL_TOL)


def test_profile_writes_a_trace_per_stage_with_every_micro_batch_and_the_sends(runs):
    """The schedule marks each micro-batch's forward and backward; activations go down and
    gradients up with send/recv. The run still equals one device (above)."""
    assert_profiled(runs["2 stages, gpipe"][1].parent / "trace", 2, "Forward 3", "Backward 3",
                    "optimizer step", ("gloo:send", "nccl:send"), ("gloo:recv", "nccl:recv"))


def test_checkpoint_of_2_stages_resumes_on_3_stages_and_in_single_py(runs, tmp_path):
    """Rank 0 gathers every stage's weights and Adam state into the file single.py writes:
    the 2-stage checkpoint (step 8), continued to step 12 on 3 stages and by single.py, ends
    with the weights of 12 uninterrupted steps on one device."""
    written = runs["2 stages, gpipe"][1].parent / "ckpt.pt"
    for copy in ("c3.pt", "single.pt"):
        shutil.copy(written, tmp_path / copy)
    assert_checkpoints_resume_to_the_oracle("pipeline.py", {3: tmp_path / "c3.pt"}, tmp_path,
                                            TOL)
    out, weights = run_in_process("single", ["--steps=12", f"--checkpoint={tmp_path}/single.pt"],
                                  tmp_path)
    assert "resumed from" in out and "at step 8" in out
    assert max_diff(weights, reference_train(**dict(JOB, steps=12))[1]) < TOL


def test_microbatches_that_do_not_divide_the_batch_are_a_clear_error(as_torchrun, capsys):
    as_torchrun(2)
    refused_in_one_line("pipeline", ["--batch-size=64", "--microbatches=5"],
                        "--microbatches 5 must divide --batch-size 64", capsys)


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
    refused_in_one_line("pipeline", ["--stages=3"], "--stages 3: with 2 ranks every rank is a "
                        "stage; drop --stages, or use --nproc 1", capsys)


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
