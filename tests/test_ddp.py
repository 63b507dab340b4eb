"""ddp.py trains to the same weights as one device, however the batch is spread; so does
zero.py, ddp.py with Adam's state sharded (ZeRO-1), whose checkpoint ddp.py resumes. Their
by-hand twins (from_scratch/ddp.py, from_scratch/zero.py) train to the wrappers' weights."""

import json
import importlib
import re
import shutil

import pytest
import torch
from torch.utils.data import DistributedSampler


from common import SimpleModel, make_dataset
from conftest import (CUDA_DEFAULTS, CUDA_JOB_FLAGS, FP32_VAL_TOL, FP64_CLIP, FP64_JOB, FP64_SEEDS,
                      FP64_TOL, JOB, JOB_FLAGS, REPO, TOL, VAL_TOL,
                      assert_fp64_run_equals_the_fp64_oracle, assert_gpu_run_equals_oracle,
                      assert_norms_are_the_oracles, assert_profiled, early_results, fails_clearly,
                      fp32_reference, fp64, fp64_reference, launch, load_saved, logged_losses,
                      logged_norms, logged_step_losses, logged_val_losses, max_diff,
                      moe, mutated, needs_2_gpus, needs_cuda, ok, python, ranks_cmd,
                      refused_in_one_line, run_as_only_rank, run_commands, succeeded,
                      summary_val_loss, torchrun)
from reference import reference_val_loss, token_loss

SEED_A, SEED_B = FP64_SEEDS[0], FP64_SEEDS[-1]

CAP_MB = 0.02  # from_scratch/ddp.py's --bucket-cap-mb: JOB's fp32 model in 4 buckets
# name: (ranks, conftest.ranks_cmd, or None for `python ddp.py`; extra flags[, the script, where
# not ddp.py: its by-hand twin]). Each trains JOB,
# or FP64_JOB where the flags say fp64(seed). One rank: the resume test, which continues on 1.
RUNS = {
    # fp32, what users run: the short job (and traces steps 5-7)
    "2 ranks": (2, ["--profile={folder}/trace"]),
    # 4 ranks, which clip the gradient at every step, with CUDA's defaults,
    # training a mixture of 3 experts, top-1 (tests/test_moe.py), over 3 micro-batches: its
    # balancing loss takes the 4 ranks' routing (one device's micro-batch)
    "fp64, 4 ranks, 3 experts, accum 3, clip, CUDA's Adam": (4, [
        CUDA_DEFAULTS, *fp64(SEED_B, clip=FP64_CLIP), *moe(3, 1, 3)[0]]),
    # by hand, beside each (from_scratch/ddp.py): the trace of a model in 4 buckets...
    "by hand, 2 ranks": (2, ["--profile={folder}/hand-trace", f"--bucket-cap-mb={CAP_MB}"],
                         "from_scratch/ddp.py"),
    # ...and the flags of the fp64 run above, for its weights and every number it prints
    "by hand, fp64, 4 ranks, 3 experts, accum 3, clip, CUDA's Adam": (4, [
        CUDA_DEFAULTS, *fp64(SEED_B, clip=FP64_CLIP), *moe(3, 1, 3)[0]],
        "from_scratch/ddp.py"),
}
# zero.py's, the same way: Adam's state sharded over 2 ranks; and fp64 on odd flags: 3 ranks
# (the held-out set pads), 3 micro-batches, clipped by the norm of the whole gradient (which ZeRO
# by hand sums over its slices), blocks that recompute their activations (compiled:
# tp.py's spawn run and single.py), and a checkpoint at the end, which ddp.py continues on 1 rank
ZERO_RUNS = {
    "zero, 2 ranks": (2, []),
    "zero, fp64, 3 ranks, accum 3, AC": (3, [*fp64(SEED_A, clip=FP64_CLIP), "--accum-steps=3",
                                             "--activation-checkpointing",
                                             "--checkpoint={folder}/ckpt.pt"]),
    # by hand (from_scratch/zero.py): ZeRO-1 beside the run above it, ZeRO-2 beside the fp64 one
    "zero by hand, ZeRO-1, 2 ranks": (2, ["--zero=1"], "from_scratch/zero.py"),
    "zero by hand, ZeRO-2, fp64, 3 ranks, accum 3, AC": (3, [
        *fp64(SEED_A, clip=FP64_CLIP), "--accum-steps=3", "--activation-checkpointing",
        "--checkpoint={folder}/hand-ckpt.pt", "--zero=2"], "from_scratch/zero.py"),
}
FP64_RUNS = {  # name: (seed, clip, the oracle's mixture)
    "zero, fp64, 3 ranks, accum 3, AC": (SEED_A, FP64_CLIP, {}),
    "fp64, 4 ranks, 3 experts, accum 3, clip, CUDA's Adam": (SEED_B, FP64_CLIP,
                                                                   moe(3, 1, 3)[1]),
    "zero by hand, ZeRO-2, fp64, 3 ranks, accum 3, AC": (SEED_A, FP64_CLIP, {}),
    "by hand, fp64, 4 ranks, 3 experts, accum 3, clip, CUDA's Adam": (
        SEED_B, FP64_CLIP, moe(3, 1, 3)[1])}
# by-hand run: the wrapper's run of the same flags
TWINS = {"by hand, 2 ranks": "2 ranks",
         "by hand, fp64, 4 ranks, 3 experts, accum 3, clip, CUDA's Adam":
             "fp64, 4 ranks, 3 experts, accum 3, clip, CUDA's Adam",
         "zero by hand, ZeRO-1, 2 ranks": "zero, 2 ranks",
         "zero by hand, ZeRO-2, fp64, 3 ranks, accum 3, AC": "zero, fp64, 3 ranks, accum 3, AC"}




def early_launches(folder):  # queued when the tests are collected
    mistakes = [ranks_cmd(2, mutated(*MISTAKES[name], folder / f"m{i}", name), *JOB_FLAGS,
                          *flags, f"--save={folder / f'm{i}' / 'w.pt'}")
                for i, (name, flags) in enumerate(LAUNCHED.items())]
    # PYTHONPATH: a mistake's copy lives outside the repo, and imports its common.py
    return [*run_commands("ddp.py", RUNS, folder)[0],
            *run_commands("zero.py", ZERO_RUNS, folder)[0], *mistakes], {
                "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def runs():
    """{name: (result, path it saved to)} of RUNS (ddp.py) and ZERO_RUNS (zero.py), and of
    the launched mistakes (LAUNCHED: the file of its saved weights)."""
    folder, results = early_results(__name__)
    paths = [*run_commands("ddp.py", RUNS, folder)[1],
             *run_commands("zero.py", ZERO_RUNS, folder)[1],
             *(folder / f"m{i}" / "w.pt" for i in range(len(LAUNCHED)))]
    return dict(zip([*RUNS, *ZERO_RUNS, *LAUNCHED], zip(results, paths)))


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
    out, resumed = run_as_only_rank("ddp", [*fp64(SEED_A, steps=steps, clip=FP64_CLIP),
                                            f"--checkpoint={tmp_path / 'c1.pt'}"], tmp_path)
    assert f"resumed from {tmp_path / 'c1.pt'} at step {FP64_JOB['steps']}" in out
    assert_fp64_run_equals_the_fp64_oracle((out, resumed), SEED_A, steps, FP64_CLIP)


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


# The by-hand twins: from_scratch/ddp.py (DDP's buckets and hooks written with all_reduce) and
# from_scratch/zero.py (ZeRO-1 and ZeRO-2 written with all_reduce, reduce_scatter, all_gather)

# On 2 ranks a + b is b + a, and DDP's factor 1/2 is exact: the twin's weights are the
# wrapper's, bit for bit. On 3 and 4 ranks gloo's ring adds each element in an order set by its
# place in the buffer, and the twins lay the gradient out otherwise than DDP's rebuilt bucket:
# the last bits part (and a norm summed otherwise, under --clip).
BIT_IDENTICAL = {"by hand, 2 ranks", "zero by hand, ZeRO-1, 2 ranks"}


@pytest.mark.parametrize("name", TWINS)
def test_by_hand_twin_ends_within_1e_12_of_its_wrapper_run_and_prints_its_numbers(name, runs):
    """The same flags, the same weights (to 1e-12, or the same bits: BIT_IDENTICAL), the same
    printed losses, validation loss and gradient norms (to the 7 digits printed)."""
    out, hand = succeeded(runs[name])
    wrapper_out, wrapper = succeeded(runs[TWINS[name]])
    diff = max_diff(hand, wrapper)
    print(f"{name}: {diff:.2e} from the wrapper")  # the figure the docs quote (pytest -s)
    assert diff == 0 if name in BIT_IDENTICAL else diff <= 1e-12, f"{diff:.2e}"
    assert logged_step_losses(out) == logged_step_losses(wrapper_out)
    assert summary_val_loss(out) == summary_val_loss(wrapper_out)
    norms = logged_norms(wrapper_out)
    assert logged_norms(out).keys() == norms.keys()
    for step, norm in logged_norms(out).items():
        assert norm == pytest.approx(norms[step], rel=1e-6), f"step {step}"


def buckets(cap_mb, element_size):
    """The buckets DDP's rule makes of JOB's model: the parameters in reverse order, a bucket
    closed once it holds cap bytes or more."""
    count, size = 1, 0
    for p in reversed(list(SimpleModel(JOB["hidden"], JOB["blocks"], JOB["heads"]).parameters())):
        if size >= cap_mb * 2**20:
            count, size = count + 1, 0
        size += p.numel() * element_size
    return count


def all_reduces_in_each_backward(trace):
    """Per recorded step of a Chrome trace: the all-reduces that started during each backward,
    how many of the gradients' the step started in all, and whether the first started while that backward was
    still accumulating gradients (an AccumulateGrad of it starting later)."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]

    def within(outer, name):
        return sorted((e for e in events if outer["ts"] <= e["ts"] < outer["ts"] + outer["dur"]
                       and name(e["name"])), key=lambda e: e["ts"])
    steps = []
    for step in within({"ts": 0, "dur": float("inf")}, lambda n: n.startswith("ProfilerStep#")):
        backwards = within(step, lambda n: n == "backward")
        launched = [within(b, lambda n: n in ("gloo:all_reduce", "nccl:all_reduce"))
                    for b in backwards]
        last = backwards[-1]
        accumulated = within(last, lambda n: n == "torch::autograd::AccumulateGrad")
        # The gradients' all-reduces: from the first forward on (the step's count of targets,
        # one all-reduce of an integer, comes before it)
        first = within(step, lambda n: n == "forward")[0]["ts"]
        steps.append(([len(a) for a in launched],
                      sum(e["ts"] >= first for e in within(
                          step, lambda n: n in ("gloo:all_reduce", "nccl:all_reduce"))),
                      bool(launched[-1]) and launched[-1][0]["ts"] < accumulated[-1]["ts"]))
    assert len(steps) == 3, steps
    return steps


def test_ddp_by_hand_all_reduces_each_bucket_while_backward_still_runs_on_every_rank(runs):
    """Overlap, shown: in every recorded step of both ranks' traces (--profile), the first
    bucket's all-reduce starts inside backward while autograd is still adding gradients into
    .grad (an AccumulateGrad starts after it), and the step makes one per bucket, 4 (the last
    bucket's may start as backward returns: its hook is backward's last work)."""
    assert buckets(CAP_MB, 4) == 4
    succeeded(runs["by hand, 2 ranks"])
    for rank in range(2):
        for in_backward, in_step, overlapped in all_reduces_in_each_backward(
                runs["by hand, 2 ranks"][1].parent / "hand-trace" / f"trace_rank{rank}.json"):
            assert in_backward[0] >= 1 and in_step == 4 and overlapped


def test_ddp_by_hand_all_reduces_one_bucket_each_on_the_last_micro_batch_and_none_before(
        tmp_path):
    """Collectives counted against theory: 3 micro-batches, 4 buckets (a world of 1, in this
    process: the hooks all-reduce even then) make 4 all-reduces per step, none started during
    the first two backwards: what ddp.py's no_sync() does, by hand. (When each starts within
    the last is the overlap test's: on a loaded machine a one-rank all-reduce's event can begin
    as backward returns.)"""
    run_as_only_rank("from_scratch.ddp", ["--accum-steps=3", f"--bucket-cap-mb={CAP_MB}",
                                          f"--profile={tmp_path}/trace"], tmp_path)
    for in_backward, in_step, _ in all_reduces_in_each_backward(
            tmp_path / "trace" / "trace_rank0.json"):
        assert in_backward[:2] == [0, 0] and in_step == 4


@pytest.mark.parametrize("name, stage, ranks, element_size", [
    ("zero by hand, ZeRO-1, 2 ranks", 1, 2, 4),
    ("zero by hand, ZeRO-2, fp64, 3 ranks, accum 3, AC", 2, 3, 8)])
def test_zero_by_hand_holds_per_rank_what_its_stage_says(name, stage, ranks, element_size, runs):
    """The summary's state, against theory. The weights lie in one buffer padded to N slices of
    S (P weights, S = ceil(P / N)), e bytes each: every rank holds all of them (e N S), the
    gradient (ZeRO-1: all of it, all-reduced, e N S; ZeRO-2: its slice, reduce-scattered,
    e S) and Adam's two moments of its slice (2 e S). Per fp32 weight: 8 + 8/N bytes (ZeRO-1,
    zero.py's own, whose greedy deal of whole parameters the test checks to 5%), 4 + 12/N
    (ZeRO-2)."""
    out = succeeded(runs[name])[0]
    weights = sum(p.numel() for p in SimpleModel(JOB["hidden"], JOB["blocks"],
                                                 JOB["heads"]).parameters())
    shard = -(-weights // ranks)
    held = element_size * (ranks * shard + (ranks * shard if stage == 1 else shard) + 2 * shard)
    assert state_mib(out) == pytest.approx(held / 2**20, abs=5e-4)
    if stage == 1:
        assert state_mib(out) == pytest.approx(state_mib(succeeded(runs["zero, 2 ranks"])[0]),
                                               rel=0.05)


def test_zero_by_hand_checkpoint_is_zero_py_s_plain_adam_state(runs):
    """Both 3-rank fp64 runs write one plain Adam state on rank 0 (what single.py and ddp.py
    resume): the same keys, steps and hyperparameters, and the moments within 1e-12."""
    hand, wrapper = (torch.load(runs[name][1].parent / file, weights_only=True) for name, file in
                     [("zero by hand, ZeRO-2, fp64, 3 ranks, accum 3, AC", "hand-ckpt.pt"),
                      ("zero, fp64, 3 ranks, accum 3, AC", "ckpt.pt")])
    assert hand.keys() == wrapper.keys() and hand["step"] == wrapper["step"]
    assert max_diff(hand["model"], wrapper["model"]) <= 1e-12
    assert hand["optimizer"]["param_groups"] == wrapper["optimizer"]["param_groups"]
    assert hand["optimizer"]["state"].keys() == wrapper["optimizer"]["state"].keys()
    for i, state in wrapper["optimizer"]["state"].items():
        assert state.keys() == hand["optimizer"]["state"][i].keys()
        assert max_diff(hand["optimizer"]["state"][i], state) <= 1e-12


def test_fp64_zero_by_hand_resumes_zero_py_s_3_rank_checkpoint_on_1_rank(runs, tmp_path):
    """zero.py's 3-rank checkpoint (a plain Adam state), resumed by hand on 1 rank (a world of
    one, in this process) with ZeRO-2 to step 48: within 1e-9 of 48 steps on one device."""
    shutil.copy(runs["zero, fp64, 3 ranks, accum 3, AC"][1].parent / "ckpt.pt", tmp_path / "c.pt")
    steps = FP64_JOB["steps"] + 8
    out, resumed = run_as_only_rank("from_scratch.zero", [
        *fp64(SEED_A, steps=steps, clip=FP64_CLIP), "--zero=2",
        f"--checkpoint={tmp_path / 'c.pt'}"], tmp_path)
    assert f"at step {FP64_JOB['steps']}" in out
    assert_fp64_run_equals_the_fp64_oracle((out, resumed), SEED_A, steps, FP64_CLIP)


@needs_cuda
@pytest.mark.parametrize("script, flags", [("from_scratch/ddp.py", [f"--bucket-cap-mb={CAP_MB}"]),
                                           ("from_scratch/zero.py", ["--zero=2"])])
def test_by_hand_ddp_and_zero_over_nccl_on_one_gpu_equal_one_device(script, flags, reference,
                                                                     tmp_path):
    result = torchrun(1, script, *CUDA_JOB_FLAGS, *flags, "--backend=nccl",
                      f"--save={tmp_path / 'w.pt'}")
    assert_gpu_run_equals_oracle(result, tmp_path / "w.pt", reference)


@needs_2_gpus
@pytest.mark.parametrize("script, flags", [("from_scratch/ddp.py", [f"--bucket-cap-mb={CAP_MB}"]),
                                           ("from_scratch/zero.py", ["--zero=1"]),
                                           ("from_scratch/zero.py", ["--zero=2"])])
def test_by_hand_ddp_and_zero_over_nccl_on_two_gpus_equal_one_device(script, flags, reference,
                                                                      tmp_path):
    result = torchrun(2, script, *CUDA_JOB_FLAGS, *flags, "--backend=nccl",
                      f"--save={tmp_path / 'w.pt'}")
    assert_gpu_run_equals_oracle(result, tmp_path / "w.pt", reference)


# The by-hand twin's mistakes (the bug zoo, tests/test_zoo.py: each an exact replacement of
# lines of the real file, in a copy)
MISTAKES = {
    "by hand: the average forgotten": ("from_scratch/ddp.py", [(
        '        torch.mul(p.grad.view(-1), 1 / self.world_size, out=bucket["views"][p])\n',
        '        bucket["views"][p].copy_(p.grad.view(-1))  # the sum, not the average\n')]),
    "by hand: rank 1 fills its buckets from the other end": ("from_scratch/ddp.py", [(
        "        for p in reversed(params):\n",
        "        for p in reversed(params) if dist.get_rank() == 0 else params:\n")]),
}
LAUNCHED = {"by hand: the average forgotten": fp64(SEED_A, steps=4)}  # name: flags, 2 ranks


def test_ddp_by_hand_without_the_average_misses_the_oracle_while_its_loss_matches(runs):
    """The sum of N gradients, not their mean: Adam divides each step by the gradient's own
    size, so the loss printed is one device's to its six decimals, and only the weights (and
    the printed gradient norm, N times one device's) show it."""
    out, weights_ = succeeded(runs["by hand: the average forgotten"])
    _, expected, losses, norms, _ = fp64_reference(SEED_A, 4)
    diff = max_diff(weights_, expected)
    print(f"the average forgotten: {diff:.2e} from the fp64 oracle")
    assert diff > FP64_TOL
    assert logged_losses(out)[-1] == pytest.approx(losses[-1], abs=1e-6)
    assert logged_norms(out)[1] == pytest.approx(2 * norms[0], rel=1e-6)


def test_ddp_by_hand_buckets_launched_in_another_order_on_one_rank_stop_the_job_in_seconds(
        tmp_path):
    """Collectives pair up by their order on each rank: rank 1 fills its buckets from the
    other end, so its first all-reduce meets rank 0's first with another size. Gloo checks the
    size: the rank that receives more than it expects stops with gloo's "collective mismatch"
    (an abort in gloo's own thread), and the launcher then ends the other, as torchrun does. The
    other may first see its peer gone and say so in one line, or be ended before it can: both
    are right, so only a line it does print is checked. (NCCL checks no size and hangs: there
    --timeout ends it with that one line.) Within the test's limit, not a hang."""
    name = "by hand: rank 1 fills its buckets from the other end"
    path = mutated(*MISTAKES[name], tmp_path, name)
    result = launch(*ranks_cmd(2, path, *JOB_FLAGS, *fp64(SEED_A, steps=4),
                               f"--bucket-cap-mb={CAP_MB}", "--timeout=2"),
                    env={"PYTHONPATH": str(REPO)})
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert "Is there a distributed collective mismatch in your code?" in result.stderr
    said = [line for line in result.stderr.splitlines() if line.startswith("ddp.py: error:")]
    assert all(re.match(r"ddp\.py: error: rank [01]: a collective gave up \(", line)
               for line in said), result.stderr


def test_zero_by_hand_refuses_a_tied_weight_in_one_line_instead_of_two_copies():
    """One flat buffer would hold a tied weight twice (once per name) and train two copies
    apart; the twin stops in one line (zero.py's optimizer keeps it one parameter)."""
    model = SimpleModel(JOB["hidden"], JOB["blocks"], JOB["heads"])
    model.output.weight = model.embed.weight  # GPT-2's tie
    with pytest.raises(SystemExit, match="the model ties weights, which one flat buffer would "
                                         "hold twice"):
        importlib.import_module("from_scratch.zero").flatten(model, 0, 2)
