"""ddp.py trains to the same weights as one device, however the batch is spread; so does
zero.py, ddp.py with Adam's state sharded (ZeRO-1), whose checkpoint ddp.py resumes."""

import re
import shutil

import pytest
import torch
from torch.utils.data import DistributedSampler


from common import SimpleModel, make_dataset
from conftest import (CUDA_DEFAULTS, CUDA_JOB_FLAGS, FP32_VAL_TOL, FP64_CLIP, FP64_JOB, FP64_SEEDS,
                      JOB, TOL, VAL_TOL, assert_fp64_run_equals_the_fp64_oracle,
                      assert_gpu_run_equals_oracle, assert_norms_are_the_oracles, assert_profiled,
                      early_results, fails_clearly, fp32_reference, fp64, load_saved,
                      logged_losses, logged_val_losses, max_diff, moe, needs_2_gpus, needs_cuda, ok,
                      python, refused_in_one_line, run_as_only_rank, run_commands, succeeded,
                      summary_val_loss, torchrun)
from reference import reference_val_loss, token_loss

SEED_A, SEED_B = FP64_SEEDS[0], FP64_SEEDS[-1]

# name: (ranks, conftest.ranks_cmd, or None for `python ddp.py`; extra flags). Each trains JOB,
# or FP64_JOB where the flags say fp64(seed). One rank: the resume test, which continues on 1.
RUNS = {
    # fp32, what users run: the short job (and traces steps 5-7)
    "2 ranks": (2, ["--profile={folder}/trace"]),
    # `python ddp.py` starts 4, which clip the gradient at every step, with CUDA's defaults,
    # training a mixture of 3 experts, top-1 (tests/test_moe.py), over 3 micro-batches: its
    # balancing loss takes the 4 ranks' routing (one device's micro-batch)
    "fp64, spawn 4 ranks, 3 experts, accum 3, clip, CUDA's Adam": (None, [
        CUDA_DEFAULTS, "--nproc=4", *fp64(SEED_B, clip=FP64_CLIP), *moe(3, 1, 3)[0]]),
}
# zero.py's, the same way: Adam's state sharded over 2 ranks; and fp64 on odd flags: 3 ranks
# (the held-out set pads), 3 micro-batches, blocks that recompute their activations (compiled:
# tp.py's spawn run and single.py), and a checkpoint at the end, which ddp.py continues on 1 rank
ZERO_RUNS = {
    "zero, 2 ranks": (2, []),
    "zero, fp64, 3 ranks, accum 3, AC": (3, [*fp64(SEED_A), "--accum-steps=3",
                                             "--activation-checkpointing",
                                             "--checkpoint={folder}/ckpt.pt"]),
}
FP64_RUNS = {  # name: (seed, clip, the oracle's mixture)
    "zero, fp64, 3 ranks, accum 3, AC": (SEED_A, None, {}),
    "fp64, spawn 4 ranks, 3 experts, accum 3, clip, CUDA's Adam": (SEED_B, FP64_CLIP,
                                                                   moe(3, 1, 3)[1])}


def early_launches(folder):  # queued when the tests are collected
    return [*run_commands("ddp.py", RUNS, folder)[0],
            *run_commands("zero.py", ZERO_RUNS, folder)[0]], None


@pytest.fixture(scope="module")
def runs():
    """{name: (result, path it saved to)} of RUNS (ddp.py) and ZERO_RUNS (zero.py)."""
    folder, results = early_results(__name__)
    paths = [*run_commands("ddp.py", RUNS, folder)[1],
             *run_commands("zero.py", ZERO_RUNS, folder)[1]]
    return dict(zip([*RUNS, *ZERO_RUNS], zip(results, paths)))


def state_mib(stdout):
    return float(re.search(r"\| state ([0-9.]+) MiB/rank", stdout).group(1))


def weights(runs, name):
    return succeeded(runs[name])[1]


def test_ddp_on_2_ranks_equals_one_device_in_fp32(runs):
    """Against one device: the oracle's one batch (conftest.TOL)."""
    out, weights_ = succeeded(runs["2 ranks"])
    _, expected, _, norms = fp32_reference()
    assert max_diff(weights_, expected) < TOL
    assert_norms_are_the_oracles(out, norms)


def test_zero1_on_2_ranks_equals_one_device_and_holds_8_plus_8_over_2_bytes_per_weight(runs):
    """zero.py: Adam's moments (8 of the 16 bytes per fp32 weight) dealt over 2 ranks: 12
    bytes per weight on each, as far as the greedy split by size balances them."""
    out, weights_ = succeeded(runs["zero, 2 ranks"])
    assert max_diff(weights_, fp32_reference()[1]) < TOL
    plain = state_mib(succeeded(runs["2 ranks"])[0])
    assert state_mib(out) == pytest.approx(plain * 12 / 16, rel=0.05)


@pytest.mark.parametrize("name", FP64_RUNS)
def test_fp64_ddp_or_zero1_on_3_and_4_ranks_with_accumulation_or_clipping_equals_the_fp64_oracle(
        name, runs):
    """40 steps, four epochs, lr 0.01, two seeds: within 1e-9, and the exact validation loss
    (on 3 ranks the held-out set pads; the test below shows what a naive average would do);
    on 4 ranks a mixture of experts, its balancing loss and token counts one device's."""
    seed, clip, mixture = FP64_RUNS[name]
    assert_fp64_run_equals_the_fp64_oracle(succeeded(runs[name]), seed, clip=clip, **mixture)


def test_logged_loss_is_the_whole_batch_loss_averaged_over_ranks(runs):
    losses = logged_losses(succeeded(runs["2 ranks"])[0])
    expected = fp32_reference()[2]
    assert losses[0] == pytest.approx(expected[0], abs=1e-5)
    assert losses[-1] == pytest.approx(expected[-1], abs=1e-5)


def test_validation_loss_is_the_exact_mean_over_the_held_out_set_on_2_ranks(runs, reference_val):
    out = succeeded(runs["2 ranks"])[0]
    assert summary_val_loss(out) == pytest.approx(reference_val, abs=FP32_VAL_TOL)
    assert logged_val_losses(out)[-1] == summary_val_loss(out)


def test_three_ranks_pad_the_held_out_set_so_averaging_rank_means_would_be_wrong(reference):
    """What the 3-rank fp64 test above guards against (its exact validation loss on 3 ranks):
    DistributedSampler deals 1002 indices for 1000 samples (two duplicates), and the mean of
    the per-rank means misses the exact value by far more than VAL_TOL."""
    val_set, world_size = make_dataset("val"), 3
    shards = [list(DistributedSampler(val_set, num_replicas=world_size, rank=r, shuffle=False))
              for r in range(world_size)]
    assert len(val_set) == 1000 and sum(map(len, shards)) == 1002
    model = SimpleModel(JOB["hidden"], JOB["blocks"], JOB["heads"]).double()
    model.load_state_dict(reference[1])
    x, y = val_set.tensors
    with torch.no_grad():
        naive = sum(token_loss(model(x[s]), y[s]).item() for s in shards) / world_size
    exact = reference_val_loss(reference[1], JOB["hidden"], JOB["blocks"], JOB["heads"])
    assert abs(naive - exact) > 10 * VAL_TOL


def test_profile_writes_a_trace_per_rank_with_the_phases_and_the_all_reduce_of_every_step(
        runs):
    """And the profiled run still ends with the oracle's weights (the tests above)."""
    assert_profiled(runs["2 ranks"][1].parent / "trace", 2, "forward", "backward",
                    "optimizer step", ("gloo:all_reduce", "nccl:all_reduce"))


def test_fp64_zero1_checkpoint_from_3_ranks_resumes_in_ddp_py_on_1_rank(runs, tmp_path):
    """zero.py's 3-rank checkpoint (step 40: Adam's state gathered from the 3 ranks), continued
    to step 48 by ddp.py on 1 rank with plain Adam (torchrun's only worker, in this process),
    ends within 1e-9 of 48 uninterrupted steps on one device (and proves 1-rank DDP too).
    Nothing in the file depends on the world size or on ZeRO-1."""
    shutil.copy(runs["zero, fp64, 3 ranks, accum 3, AC"][1].parent / "ckpt.pt",
                tmp_path / "c1.pt")
    steps = FP64_JOB["steps"] + 8
    out, resumed = run_as_only_rank("ddp", [*fp64(SEED_A, steps=steps),
                                            f"--checkpoint={tmp_path / 'c1.pt'}"], tmp_path)
    assert f"resumed from {tmp_path / 'c1.pt'} at step {FP64_JOB['steps']}" in out
    assert_fp64_run_equals_the_fp64_oracle((out, resumed), SEED_A, steps)


def test_every_layer_is_trained(runs, reference):
    """Gradients reach every parameter: each tensor moved away from its initial value."""
    initial, final = reference[0], weights(runs, "2 ranks")
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
def test_ddp_two_ranks_sharing_one_gpu_fall_back_to_gloo_and_equal_one_device(reference,
                                                                             tmp_path):
    """torchrun, 2 ranks, 1 visible GPU, the same UUID: --backend auto picks gloo (NCCL needs a
    GPU per rank), and rank 0 alone says so."""
    result = torchrun(2, "ddp.py", *CUDA_JOB_FLAGS, f"--save={tmp_path / 'w.pt'}",
                      env={"CUDA_VISIBLE_DEVICES": "0"})
    assert_gpu_run_equals_oracle(result, tmp_path / "w.pt", reference)
    assert result.stdout.count("2 ranks share a GPU over gloo") == 1


@needs_2_gpus
def test_ddp_nccl_two_gpus_equals_one_device(reference, tmp_path):
    result = torchrun(2, "ddp.py", *CUDA_JOB_FLAGS, "--backend=nccl",
                      f"--save={tmp_path / 'w.pt'}")
    assert_gpu_run_equals_oracle(result, tmp_path / "w.pt", reference)


@needs_cuda
def test_fp64_ddp_over_nccl_on_one_gpu_equals_the_fp64_oracle(tmp_path):
    """NCCL all-reduces float64 as it does float32."""
    result = torchrun(1, "ddp.py", *CUDA_JOB_FLAGS, *fp64(SEED_A), "--backend=nccl",
                      "--accum-steps=3", f"--save={tmp_path / 'w.pt'}")
    assert_fp64_run_equals_the_fp64_oracle((ok(result), load_saved(tmp_path / "w.pt")), SEED_A)



def test_zero1_holds_its_adam_share_once_after_resuming_and_after_each_checkpoint(
        tmp_path, monkeypatch):
    """ZeroRedundancyOptimizer.load_state_dict also fills the wrapper's own `state` with a copy
    of this rank's moments, which nothing reads (on a GPU: 8 + 16/N bytes per weight where
    8 + 8/N would do), and consolidate_state_dict leaves every rank's moments in rank 0's memory
    after the checkpoint is written. zero.py frees both: counted on one rank, resumed."""
    import zero
    seen = []
    real_load = zero.load_checkpoint

    def load(args, model, optimizer):
        step = real_load(args, model, optimizer)
        seen.append(optimizer)
        return step

    monkeypatch.setattr(zero, "load_checkpoint", load)
    ckpt = f"--checkpoint={tmp_path / 'ckpt.pt'}"
    run_as_only_rank("zero", ["--steps=2", ckpt], tmp_path)  # writes it at step 2
    run_as_only_rank("zero", ["--steps=4", ckpt], tmp_path)  # resumes at step 2
    resumed = seen[-1]
    assert sum(len(s) for s in resumed.optim.state.values()) > 0  # the share Adam steps
    assert len(resumed.state) == 0  # and no second copy of it
    assert resumed._all_state_dicts == []  # nor rank 0's consolidated one, once written
