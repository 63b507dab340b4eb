"""ddp.py trains to the same weights as one device, however the batch is spread."""

import shutil

import pytest
import torch
from torch.utils.data import DistributedSampler

import torch.nn.functional as F

from common import SimpleModel, make_dataset
from conftest import (CUDA_JOB_FLAGS, JOB, TOL, VAL_TOL,
                      assert_checkpoints_resume_to_the_oracle, assert_gpu_run_equals_oracle,
                      assert_profiled, fails_clearly, launch_runs, logged_losses,
                      logged_val_losses, max_diff, needs_2_gpus, needs_cuda, python,
                      refused_in_one_line, succeeded, summary_val_loss, torchrun)
from reference import reference_val_loss



# name: (ranks under torchrun, or None for `python ddp.py`; extra flags). Each trains JOB.
RUNS = {  # one rank: see the resume test, which continues on 1 (and 3) ranks
    # also writes a checkpoint every 4 steps: the resume test below continues from it
    "torchrun 2 ranks": (2, ["--checkpoint={folder}/ckpt.pt", "--checkpoint-every=4",
                             "--profile={folder}/trace"]),  # and traces steps 5-7
    # activation checkpointing recomputes the same operations: the same weights, bit for bit
    "spawn 2 ranks, AC": (None, ["--nproc=2", "--activation-checkpointing"]),
    # (compiled: tp.py's spawn run and single.py; compiling costs each process seconds)
    "torchrun 2 ranks, accum 3, AC": (2, ["--accum-steps=3", "--activation-checkpointing"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return launch_runs("ddp.py", RUNS, tmp_path_factory.mktemp("ddp"))


def weights(runs, name):
    return succeeded(runs[name])[1]


# 1 rank: the resume test continues on 1 rank. 3 ranks (the held-out set pads): fsdp.py's and
# the test below, which shows what the padding would do to a naive average.
@pytest.mark.parametrize("name", ["torchrun 2 ranks"])
def test_ddp_on_n_ranks_equals_one_device(name, runs, reference):
    assert max_diff(weights(runs, name), reference[1]) < TOL


def test_logged_loss_is_the_whole_batch_loss_averaged_over_ranks(runs, reference):
    losses = logged_losses(succeeded(runs["torchrun 2 ranks"])[0])
    assert losses[0] == pytest.approx(reference[2][0], abs=1e-5)
    assert losses[-1] == pytest.approx(reference[2][-1], abs=1e-5)


@pytest.mark.parametrize("name", ["torchrun 2 ranks", "spawn 2 ranks, AC"])
def test_validation_loss_is_the_exact_mean_over_the_held_out_set_on_n_ranks(
        name, runs, reference_val):
    out = succeeded(runs[name])[0]
    assert summary_val_loss(out) == pytest.approx(reference_val, abs=VAL_TOL)
    assert logged_val_losses(out)[-1] == summary_val_loss(out)


def test_three_ranks_pad_the_held_out_set_so_averaging_rank_means_would_be_wrong(reference):
    """What the 3-rank test above guards against: DistributedSampler deals 1002 indices for
    1000 samples (two duplicates), and the mean of the per-rank means misses the exact value
    by far more than VAL_TOL."""
    val_set, world_size = make_dataset("val"), 3
    shards = [list(DistributedSampler(val_set, num_replicas=world_size, rank=r, shuffle=False))
              for r in range(world_size)]
    assert len(val_set) == 1000 and sum(map(len, shards)) == 1002
    model = SimpleModel(hidden=JOB["hidden"], blocks=JOB["blocks"]).double()
    model.load_state_dict(reference[1])
    x, y = (t.double() for t in val_set.tensors)
    with torch.no_grad():
        naive = sum(F.mse_loss(model(x[s]), y[s]).item() for s in shards) / world_size
    exact = reference_val_loss(reference[1], JOB["hidden"], JOB["blocks"])
    assert abs(naive - exact) > 10 * VAL_TOL


def test_profile_writes_a_trace_per_rank_with_the_phases_and_the_all_reduce_of_every_step(
        runs):
    """And the profiled run still ends with the oracle's weights (the tests above)."""
    assert_profiled(runs["torchrun 2 ranks"][1].parent / "trace", 2, "forward", "backward",
                    "optimizer step", ("gloo:all_reduce", "nccl:all_reduce"))


def test_checkpoint_from_2_ranks_resumes_on_1_rank(runs, tmp_path):
    """The 2-rank run's checkpoint (step 8), continued to step 12 on 1 rank, ends with the
    weights of 12 uninterrupted steps on one device (and proves 1-rank DDP too). On 3 ranks:
    fsdp.py's resume test; the checkpoint does not depend on the world size in either."""
    shutil.copy(runs["torchrun 2 ranks"][1].parent / "ckpt.pt", tmp_path / "c1.pt")
    assert_checkpoints_resume_to_the_oracle("ddp.py", {1: tmp_path / "c1.pt"}, tmp_path, TOL)


def test_spawn_path_with_activation_checkpointing_equals_torchrun_without_bit_for_bit(runs):
    assert max_diff(weights(runs, "spawn 2 ranks, AC"), weights(runs, "torchrun 2 ranks")) == 0.0


def test_checkpointed_blocks_with_accumulation_equal_one_big_batch(runs, reference):
    assert max_diff(weights(runs, "torchrun 2 ranks, accum 3, AC"), reference[1]) < TOL


def test_every_layer_is_trained(runs, reference):
    """Gradients reach every parameter: each tensor moved away from its initial value."""
    initial, final = reference[0], weights(runs, "torchrun 2 ranks")
    for name in final:
        assert (final[name] - initial[name]).abs().max() > 1e-4, f"{name} did not train"


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sampler_shards_are_the_global_batch_without_duplicates(world_size):
    """Rank r's k-th batch of B/N samples, gathered over the N ranks, is exactly positions
    k*B .. k*B+B-1 of the epoch's permutation: the batch one device sees at step k."""
    dataset, batch, seed, epoch = make_dataset(), 1200, 7, 1
    shards = []
    for rank in range(world_size):
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=seed,
                                     drop_last=True)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + epoch))
    per_rank = batch // world_size
    for k in range(len(dataset) // batch):
        gathered = [i for s in shards for i in s[k * per_rank:(k + 1) * per_rank]]
        assert len(set(gathered)) == batch  # no sample twice
        assert sorted(gathered) == sorted(order[k * batch:(k + 1) * batch].tolist())
    every = [i for s in shards for i in s]
    assert len(set(every)) == len(every)  # and no sample on two ranks in the whole epoch


def test_batch_not_divisible_by_world_size_is_a_clear_error(as_torchrun, capsys):
    fails_clearly(python("ddp.py", "--nproc=3", "--device=cpu", "--batch-size=64"),
                  "--batch-size 64 must be divisible by world size 3", "multiple of 3")
    as_torchrun(2)
    refused_in_one_line("ddp", ["--batch-size=64", "--accum-steps=3"],
                        "world size 2 x --accum-steps 3; use a multiple of 6", capsys)


@needs_cuda
def test_ddp_nccl_one_rank_on_gpu_equals_one_device(reference, tmp_path):
    result = torchrun(1, "ddp.py", *CUDA_JOB_FLAGS, "--backend=nccl",
                      f"--save={tmp_path / 'w.pt'}")
    assert_gpu_run_equals_oracle(result, tmp_path / "w.pt", reference)


@needs_cuda
def test_ddp_two_gloo_ranks_sharing_one_gpu_equals_one_device(reference, tmp_path):
    result = torchrun(2, "ddp.py", *CUDA_JOB_FLAGS, "--backend=gloo",
                      f"--save={tmp_path / 'w.pt'}")
    assert_gpu_run_equals_oracle(result, tmp_path / "w.pt", reference)


@needs_2_gpus
def test_ddp_nccl_two_gpus_equals_one_device(reference, tmp_path):
    result = torchrun(2, "ddp.py", *CUDA_JOB_FLAGS, "--backend=nccl",
                      f"--save={tmp_path / 'w.pt'}")
    assert_gpu_run_equals_oracle(result, tmp_path / "w.pt", reference)
