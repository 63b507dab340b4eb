"""fsdp.py: sharding the model over N ranks trains to the same weights as one device; its
sharded checkpoints resume on any number of ranks; each rank holds 1/N of the training state.
Its by-hand twin, from_scratch/fsdp.py (flat shards, all-gathers and reduce-scatters), equals it
in float64, makes FSDP2's collectives, holds 1/N and frees each unit after use; its mistake is
caught (the end of this file)."""

import contextlib
import importlib
import io
import json
import os
import pickle
import re
import shutil
import sys
import warnings

import pytest
import torch

import common
import plumbing.sharded
from common import SimpleModel
from conftest import (CUDA_DEFAULTS, CUDA_JOB_FLAGS, FP32_VAL_TOL, FP64_CLIP, FP64_SEEDS, JOB,
                      JOB_FLAGS, REPO, TOL, assert_checkpoints_resume_to_the_oracle,
                      assert_fp64_run_equals_the_fp64_oracle, assert_gpu_run_equals_oracle,
                      assert_norms_are_the_oracles, assert_profiled, early_results, fp32_reference,
                      fp64, launch_together, load_saved, logged_losses, logged_norms,
                      logged_step_losses, logged_val_losses, max_diff, moe, mutated,
                      needs_2_gpus, needs_cuda, ok, ranks_cmd, refused_in_one_line,
                      run_as_only_rank, run_commands, succeeded, summary_val_loss, torchrun,
                      torchrun_cmd)

# bf16 compute, fp32 reduction and weights: the final loss measured 4.9e-6 from fp32's, relative
# (docs/proofs.md).
BF16_REL_TOL = 0.01

SEED_A, SEED_B = FP64_SEEDS[0], FP64_SEEDS[-1]

MIXTURE = moe(5, 2)
HSDP = "fp64, spawn 4 ranks, HSDP 2x2, reshard false, clip, CUDA's Adam, 5 experts, top-2"
HAND = "from_scratch/fsdp.py"  # the by-hand twin: flat shards, all-gathers, reduce-scatters
HAND_3 = "by hand: fp64, 3 ranks, accum 3, AC"
HAND_2 = "by hand: fp64, 2 ranks, reshard false, clip, CUDA's Adam, 5 experts, top-2"
RUNS = {  # name: (ranks, conftest.ranks_cmd, or None for `python fsdp.py`; extra flags)
    # fp32, what users run: the short job; also writes a sharded checkpoint every 4 steps,
    # which the damaged-checkpoint tests below break in every way
    "2 ranks": (2, ["--checkpoint={folder}/ckpt", "--checkpoint-every=4"]),
    # fp64 on odd flags: uneven shards (32 rows as 11, 11, 10), 3 micro-batches, recomputing
    # inside them, traces steps 5-7; a checkpoint at steps 20 and 40, continued on 2 ranks
    "fp64, 3 ranks, accum 3, AC": (3, [*fp64(SEED_A), "--accum-steps=3",
                                                "--activation-checkpointing",
                                                "--profile={folder}/trace",
                                                "--checkpoint={folder}/ckpt64",
                                                "--checkpoint-every=20"]),
    # `python fsdp.py` starts its own 2 workers (4 ranks: ddp.py's and tp.py's runs; compiled:
    # tp.py's spawn run, the same lines; each process costs seconds of CPU)
    # `python fsdp.py --nproc 4`: HSDP, 2 replicas each sharded in 2, the gathered weights kept
    # from forward to backward (ZeRO-2's trade), clipped by the norm of the whole gradient; its
    # checkpoint (step 40) is continued as plain FSDP on 2 ranks; it trains a mixture of 5
    # experts, top-2 (tests/test_moe.py): each rank routes its own tokens, the balancing loss
    # over all 4 ranks' routing
    HSDP: (None, [CUDA_DEFAULTS, "--nproc=4", *fp64(SEED_B, clip=FP64_CLIP), *MIXTURE[0],
                  "--replicate=2", "--reshard-after-forward=false", "--checkpoint={folder}/hsdp"]),
    # The by-hand twin, with the 3-rank run's flags (its checkpoints aside: fsdp.py's), traced
    HAND_3: (3, [*fp64(SEED_A), "--accum-steps=3", "--activation-checkpointing",
                 "--profile={folder}/hand_trace"], HAND),
    # and the HSDP run's model, seed and clipping, and its gathered weights kept from forward
    # to backward, on 2 ranks of plain FSDP (its --replicate is fsdp.py's), traced
    HAND_2: (2, [CUDA_DEFAULTS, *fp64(SEED_B, clip=FP64_CLIP), *MIXTURE[0],
                 "--reshard-after-forward=false", "--profile={folder}/hand_trace_2"], HAND),
}
FP64_RUNS = {"fp64, 3 ranks, accum 3, AC": (SEED_A, None, {}),  # name: (seed, clip, mixture)
             HSDP: (SEED_B, FP64_CLIP, MIXTURE[1])}
TWINS = {HAND_3: "fp64, 3 ranks, accum 3, AC", HAND_2: HSDP}  # by hand: fsdp.py's run beside it




def early_launches(folder):
    """RUNS, and the by-hand twin's mistakes (HAND_MISTAKES, below), each a copy in
    folder/m<i>, 2 ranks, fp64, 4 steps: all queued when the tests are collected."""
    commands, _ = run_commands("fsdp.py", RUNS, folder)
    for i, (name, edits) in enumerate(HAND_MISTAKES.items()):
        path = mutated(HAND, edits, folder / f"m{i}", name)
        commands.append(ranks_cmd(2, path, *JOB_FLAGS, *fp64(SEED_A, steps=4),
                                  f"--save={folder / f'm{i}' / 'w.pt'}"))
    return commands, {"PYTHONPATH": str(REPO)}  # the copies live outside the repo: plumbing/


@pytest.fixture(scope="module")
def early():
    return early_results(__name__)


@pytest.fixture(scope="module")
def runs(early, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp")
    launched = dict(zip(RUNS, zip(early[1], run_commands("fsdp.py", RUNS, early[0])[1])))
    # one rank, as torchrun's only worker, in this process: bf16 compute, fp32 state
    return {**launched, "1 rank, bf16": ((run_as_only_rank(
        "fsdp", ["--mixed-precision=bf16"], folder)), None)}


def state_mib(stdout):
    return float(re.search(r"\| state ([0-9.]+) MiB/rank", stdout).group(1))


def test_fsdp_on_2_ranks_equals_one_device_in_fp32(runs, reference_val):
    """Against one device: the oracle's one batch (conftest.TOL)."""
    out, weights = succeeded(runs["2 ranks"])  # --save: a plain state_dict, strict
    _, expected, losses, norms = fp32_reference()
    assert max_diff(weights, expected) < TOL
    assert summary_val_loss(out) == pytest.approx(reference_val, abs=FP32_VAL_TOL)
    assert logged_losses(out)[-1] == pytest.approx(losses[-1], abs=1e-5)
    assert_norms_are_the_oracles(out, norms)  # the norm of the whole, not of a shard


@pytest.mark.parametrize("name", FP64_RUNS)
def test_fp64_fsdp_on_3_ranks_and_hsdp_2x2_clipped_equal_the_fp64_oracle(
        name, runs):
    """Reductions in float64 too (MixedPrecisionPolicy's reduce_dtype follows the weights):
    within 1e-9 after 40 steps at lr 0.01, on two seeds; the HSDP run's mixture, its
    balancing loss and the tokens each expert got included."""
    seed, clip, mixture = FP64_RUNS[name]
    assert_fp64_run_equals_the_fp64_oracle(succeeded(runs[name]), seed, clip=clip, **mixture)


def test_profile_writes_a_trace_per_rank_with_the_phases_and_the_collectives_of_every_step(
        runs):
    """FSDP all-gathers each block's weights and reduce-scatters its gradients (over gloo,
    which has no reduce-scatter, as an all-reduce). The run still equals one device (above)."""
    trace = runs["fp64, 3 ranks, accum 3, AC"][1].parent / "trace"
    assert_profiled(trace, 3, "forward", "backward", "optimizer step",
                    ("gloo:all_gather", "nccl:all_gather"),
                    ("gloo:all_reduce", "nccl:reduce_scatter"))


def test_each_rank_holds_a_1_over_n_share_of_the_training_state(runs):
    # (bf16 computes in bf16 copies; the sharded weights and Adam's state stay fp32)
    one = state_mib(runs["1 rank, bf16"][0][0])
    two = state_mib(succeeded(runs["2 ranks"])[0])
    assert two == pytest.approx(one / 2, rel=0.01)
    # weights + gradients + Adam's two moments: 4 fp32 numbers per parameter
    n_params = sum(v.numel() for v in reference_state().values())
    assert one == pytest.approx(16 * n_params / 2**20, abs=1e-3)


def reference_state():
    return SimpleModel(JOB["hidden"], JOB["blocks"], JOB["heads"]).state_dict()


def test_bf16_mixed_precision_trains_to_the_fp32_loss(runs, reference):
    out = runs["1 rank, bf16"][0][0]
    losses = logged_losses(out)
    assert losses[-1] < losses[0] - 0.1  # it trains (JOB: 3.66 -> 3.50 in fp32)
    assert losses[-1] == pytest.approx(reference[2][-1], rel=BF16_REL_TOL)


def test_fp64_checkpoints_of_fsdp_and_hsdp_resume_on_2_ranks_as_each_other(runs, tmp_path):
    """The 3-rank run's sharded checkpoint (step 40), continued to step 48 as HSDP on 2 ranks
    (2 replicas of 1 shard), and the HSDP 2x2 run's, continued as plain FSDP on 2 ranks (the
    shards cut anew, the gathered weights kept from forward to backward), each end within
    1e-9 of 48 uninterrupted steps on one device. (1 rank: ddp.py's resume test; tp.py's
    resumes change the mesh.)"""
    ckpt = runs["fp64, 3 ranks, accum 3, AC"][1].parent / "ckpt64"
    # step 20 was written, then replaced by step 40 once that was complete
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000040"]
    shutil.copytree(ckpt, tmp_path / "c2")
    # what a crash in the middle of writing step 44 leaves: a folder `latest` does not name
    (tmp_path / "c2" / "step_00000044").mkdir()
    (tmp_path / "c2" / "step_00000044" / "__0_0.distcp").write_bytes(b"half a shard")
    hsdp = runs[HSDP][1].parent / "hsdp"
    assert_checkpoints_resume_to_the_oracle("fsdp.py", {
        (2, "--replicate=2"): tmp_path / "c2",
        (2, "--reshard-after-forward=false", *MIXTURE[0]): (hsdp, SEED_B, FP64_CLIP, MIXTURE[1])},
        tmp_path, SEED_A)


def test_sharded_checkpoint_becomes_one_plain_file_that_loads_into_simplemodel(runs, tmp_path):
    """What the docstring's `python -m torch.distributed.checkpoint.format_utils dcp_to_torch`
    calls: the 2-rank run's checkpoint, merged, holds the run's final weights."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    ckpt = runs["2 ranks"][1].parent / "ckpt"
    dcp_to_torch_save(ckpt / (ckpt / "latest").read_text(), tmp_path / "full.pt")
    merged = torch.load(tmp_path / "full.pt", weights_only=True)["model"]
    model = SimpleModel(JOB["hidden"], JOB["blocks"], JOB["heads"])
    model.load_state_dict(merged, strict=True)
    assert max_diff(model.state_dict(), succeeded(runs["2 ranks"])[1]) == 0.0


@pytest.mark.parametrize("content, message", [
    ("garbage latest", "cannot be read (FileNotFoundError)"),
    ("not a folder", "is a file; fsdp.py and tp.py keep sharded checkpoints in a folder"),
    ("other files", "holds no checkpoint of fsdp.py or tp.py"),
    ("other size", "saved with --hidden 16 --blocks 3; use the same model size"),
    ("other batch", "written with --batch-size 60, not 64"),
    ("other precision", "written with --fp64; add --fp64 to continue it"),
    ("other heads", "saved with --heads 2; use --heads 2"),
])
def test_bad_checkpoint_is_refused_in_one_line_and_left_as_it_was(content, message, tmp_path):
    """load_checkpoint reads the small files first, on every rank, before any collective."""
    import fsdp
    args = fsdp.parse_args(["--device=cpu", "--nproc=1", "--hidden=32", "--blocks=3"])
    ckpt = tmp_path / "ckpt"
    args.checkpoint = str(ckpt)
    if content == "not a folder":
        ckpt.write_bytes(b"a ddp.py checkpoint, say")
    else:
        ckpt.mkdir()
        if content == "garbage latest":
            (ckpt / "latest").write_text("step_00000099")
        elif content == "other files":
            (ckpt / "notes.txt").write_text("mine")
        else:
            (ckpt / "step_00000004").mkdir()
            (ckpt / "latest").write_text("step_00000004")
            meta = dict(step=4, batch_size=64, seed=0, hidden=32, blocks=3, heads=4)
            meta.update({"other size": dict(hidden=16), "other batch": dict(batch_size=60),
                         "other precision": dict(fp64=True), "other heads": dict(heads=2)}[content])
            (ckpt / "step_00000004" / "train_state.json").write_text(json.dumps(meta))
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as exit_:
        fsdp.load_checkpoint(args, None, None)
    assert str(exit_.value).startswith(f"fsdp.py: error: --checkpoint {ckpt}: ")
    assert message in str(exit_.value)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


class RunsCode:
    """Unpickled, it runs a shell command: what a hostile checkpoint hides."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def damage(ckpt, case, copy, marker):
    """A copy of the sharded checkpoint folder `ckpt`, damaged (or made hostile) as `case` says.
    A hostile copy would create the file `marker` if it were ever unpickled as code."""
    shutil.copytree(ckpt, copy)
    step = copy / (copy / "latest").read_text()
    if case == "truncated shard":
        with open(step / "__0_0.distcp", "r+b") as f:
            f.truncate(100)
    elif case == "missing shard":
        (step / "__1_0.distcp").unlink()
    elif case == "corrupt index":
        (step / ".metadata").write_bytes(b"\x80\x04garbage")
    elif case == "empty index":
        (step / ".metadata").write_bytes(b"")
    elif case == "hostile index":
        (step / ".metadata").write_bytes(pickle.dumps(RunsCode(f"touch {marker}")))
    elif case == "hostile value":
        # A whole, well-formed checkpoint whose optimizer lr, a non-tensor value DCP stores as
        # pickled bytes, runs a command when unpickled. Written with DCP itself, one process.
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        dcp_to_torch_save(step, copy / "full.pt")
        full = torch.load(copy / "full.pt", weights_only=True)
        (copy / "full.pt").unlink()
        full["optimizer"]["param_groups"][0]["lr"] = RunsCode(f"touch {marker}")
        for f in step.glob("*.distcp"):
            f.unlink()
        (step / ".metadata").unlink()
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(full, checkpoint_id=step)
    return copy


DAMAGED = {  # case: what the one line says
    "truncated shard": "shard __0_0.distcp is cut short",
    "missing shard": "shard __1_0.distcp is missing",
    "corrupt index": "its index (.metadata) cannot be read",
    "empty index": "its index (.metadata) cannot be read (EOFError)",
    "hostile index": "its index (.metadata) calls posix.system, which no checkpoint does",
}


def files(folder):
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("case", DAMAGED)
def test_damaged_or_hostile_index_is_refused_before_any_collective_and_runs_nothing(
        case, runs, tmp_path):
    """read_data_only (plumbing/sharded.py) checks the index and the shards on every rank before
    the collective load: the same files, the same ValueError on every rank."""
    marker = tmp_path / "ran"
    copy = damage(runs["2 ranks"][1].parent / "ckpt", case, tmp_path / "c", marker)
    before = files(copy)
    def refuse(why):
        raise ValueError(why)

    with pytest.raises(ValueError, match=re.escape(DAMAGED[case])):
        plumbing.sharded.read_data_only({}, copy / (copy / "latest").read_text(), refuse)
    assert not marker.exists() and files(copy) == before


# Both launch paths, at once, and both ways a refusal happens: before any collective (every
# case of DAMAGED, proven one by one above: here a damaged shard) and inside the collective
# load (a hostile value, refused on every rank).
LAUNCHED_DAMAGE = {
    ("spawn", "truncated shard"): DAMAGED["truncated shard"],
    ("torchrun", "hostile value"): "cannot be read (CheckpointException)",
}


def test_damaged_or_hostile_checkpoint_stops_every_rank_in_one_line_on_both_launch_paths(
        runs, tmp_path):
    """`python fsdp.py` ends with the line (exit 1, no traceback); under torchrun the line is
    the Root Cause. Nothing hostile runs and the folder is left as it was."""
    ckpt = runs["2 ranks"][1].parent / "ckpt"
    cases, commands = [], []
    for i, ((launcher, case), message) in enumerate(LAUNCHED_DAMAGE.items()):
        marker = tmp_path / f"ran{i}"
        copy = damage(ckpt, case, tmp_path / f"c{i}", marker)
        flags = [*JOB_FLAGS, "--steps=10", f"--checkpoint={copy}"]
        commands.append([sys.executable, "fsdp.py", "--nproc=2", *flags] if launcher == "spawn"
                        else torchrun_cmd(2, "fsdp.py", *flags))
        cases.append((launcher, case, copy, files(copy), marker,
                      f"fsdp.py: error: --checkpoint {copy}: {message}"))
    for (launcher, case, copy, before, marker, line), result in zip(
            cases, launch_together(commands)):
        assert result.returncode != 0, (launcher, case, result.stdout)
        if launcher == "spawn":
            assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
            # the last line but torch's own log lines ("W1122 ... Terminating process ...":
            # mp.spawn ending the other worker, which may have printed the line too)
            ours = [l for l in result.stderr.splitlines() if not re.match(r"[IWE]\d{4} ", l)]
            assert ours[-1].startswith(line), result.stderr
        else:
            assert line in result.stderr.split("Root Cause")[-1], result.stderr
        assert not marker.exists(), f"{case}: the checkpoint ran code"
        assert files(copy) == before


@pytest.mark.parametrize("flags, message", [
    (["--batch-size=64"], "--batch-size 64 must be divisible by world size 3"),
    (["--backend=nccl", "--device=cpu"], "CPU tensors travel over gloo only"),
    (["--batch-size=60", "--fp64", "--mixed-precision=bf16"],
     "--fp64 with --mixed-precision bf16: drop one of them"),
])
def test_bad_flags_are_refused_in_one_line(flags, message, as_torchrun, capsys):
    as_torchrun(3)
    refused_in_one_line("fsdp", flags, message, capsys)


@needs_cuda
def test_fsdp_nccl_one_rank_on_gpu_equals_one_device(reference, tmp_path):
    result = torchrun(1, "fsdp.py", *CUDA_JOB_FLAGS, f"--save={tmp_path / 'w.pt'}")
    assert_gpu_run_equals_oracle(result, tmp_path / "w.pt", reference)


@needs_cuda
def test_fsdp_bf16_on_gpu_trains_to_the_fp32_loss(reference):
    out = ok(torchrun(1, "fsdp.py", *CUDA_JOB_FLAGS, "--mixed-precision=bf16"))
    assert logged_losses(out)[-1] == pytest.approx(reference[2][-1], rel=BF16_REL_TOL)


def test_evaluation_on_6_ranks_forwards_no_empty_batch_and_counts_only_real_samples(
        fake_world, monkeypatch):
    """The 1,000 held-out samples on 6 ranks: 167 each, padded, 166 real on ranks 4 and 5;
    batches of 83 leave those two a last batch of one padded duplicate. Each rank forwards it
    (a sharded forward is a collective: its peers wait in the all-gather) and counts none of it.
    Cut to its real samples first, that batch would be empty, which bf16's flash attention
    refuses on a GPU (pytorch/pytorch#133780). Rank 5 of a world whose collectives do nothing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    fsdp = importlib.import_module("fsdp")
    fake_world(6, rank=5)
    model = SimpleModel(JOB["hidden"], 2, JOB["heads"])
    mesh = init_device_mesh("cpu", (6,))
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    forwarded, counted = [], []
    model.register_forward_pre_hook(lambda _, args: forwarded.append(len(args[0])))
    monkeypatch.setattr(fsdp.dist, "all_reduce", lambda sums, op: counted.append(sums[1].item()))
    fsdp.evaluate(model, common.make_dataset("val"), 5, 6, 6 * 83, torch.device("cpu"))
    assert forwarded == [83, 83, 1]
    assert counted == [166 * common.SEQ_LEN]


# The by-hand twin, from_scratch/fsdp.py: fully_shard's units, gathers and reduce-scatters

def by_hand():
    return importlib.import_module("from_scratch.fsdp")


@pytest.mark.parametrize("name", TWINS)
def test_fp64_fsdp_by_hand_equals_fsdp_py_and_the_fp64_oracle_and_prints_the_same_numbers(
        name, runs):
    """Beside fsdp.py's run of the same flags (3 ranks: 32 rows as 11, 11, 10, whose flat
    buffers pad to 3 equal shards; 3 micro-batches; recomputed blocks), or of the same model,
    seed and clipping (the HSDP run, 2 x 2 ranks, against 2 ranks by hand): within 1e-12 of its
    weights, the same printed losses, gradient norms and validation losses, and within the
    fp64 oracle's bound of one device. Measured on 2 ranks, unclipped: to the bit. On 3,
    1.1e-15: fsdp.py lays each parameter's rows out in the reduce-scatter's buffer, by hand
    each rank's 1/3 is one piece of the flat buffer, and gloo adds 3 ranks' values in an order
    that depends on where they lie; and FSDP2 divides float64 by 2 before the sum and by 1.5
    after it, by hand by 3 after."""
    seed, clip, mixture = FP64_RUNS[TWINS[name]]
    out, weights = succeeded(runs[TWINS[name]])
    hand_out, hand = succeeded(runs[name])
    assert f"fsdp by hand: {2 if name == HAND_2 else 3} ranks" in hand_out
    diff = max_diff(hand, weights)
    print(f"by hand: max weight difference {diff:.2e} from fsdp.py")  # pytest -s
    assert diff <= 1e-12
    assert logged_step_losses(hand_out) == logged_step_losses(out)
    assert logged_norms(hand_out) == logged_norms(out)
    assert logged_val_losses(hand_out) == logged_val_losses(out)
    assert_fp64_run_equals_the_fp64_oracle((hand_out, hand), seed, clip=clip, **mixture)


GATHER, REDUCE_SCATTER = "c10d::_allgather_base_", "c10d::_reduce_scatter_base_"


def collectives(trace, ranks):
    """[(all-gathers, reduce-scatters) of each recorded step, on each of `ranks`] of
    --profile's traces: the ops all_gather_into_tensor and reduce_scatter_tensor record (FSDP2's
    too)."""
    counts = []
    for rank in ranks:
        events = [e for e in json.loads((trace / f"trace_rank{rank}.json").read_text())[
            "traceEvents"] if e.get("ph") == "X"]
        for step in (e for e in events if e["name"].startswith("ProfilerStep#")):
            names = [e["name"] for e in events
                     if step["ts"] <= e["ts"] < step["ts"] + step["dur"]]
            counts.append((names.count(GATHER), names.count(REDUCE_SCATTER)))
    return counts


def test_by_hand_all_gathers_each_unit_twice_per_micro_batch_and_reduce_scatters_it_once(runs):
    """Per step of K micro-batches over B blocks and the root, as FSDP2 does with
    reshard_after_forward=True (which fsdp.py passes to the root too): each of the B + 1 units
    all-gathered before its forward and again before its backward, 2K(B + 1); reduce-scattered
    once, after the last micro-batch's backward, B + 1. Counted in fsdp.py's trace and the
    twin's (every rank of it), in each of the 3 recorded steps: 24 and 4. The weights kept
    from forward to backward (--reshard-after-forward false, 1 micro-batch): K(B + 1), as
    ZeRO-2 gathers."""
    blocks, accum = JOB["blocks"], 3
    theory = (2 * accum * (blocks + 1), blocks + 1)
    assert collectives(runs[HAND_3][1].parent / "hand_trace", range(3)) == [theory] * 3 * 3
    assert collectives(runs["fp64, 3 ranks, accum 3, AC"][1].parent / "trace", [0]) == [theory] * 3
    assert collectives(runs[HAND_2][1].parent / "hand_trace_2", [0]) == [(blocks + 1,
                                                                          blocks + 1)] * 3


def gathers(hand, keep, as_torchrun, fake_world, monkeypatch):
    """Train `hand` (the twin, or a copy of it) as rank 0 of 3 in this process, 2 steps of 2
    micro-batches, the gathered weights kept (keep) or not: (its units, and at each gather: the
    unit and the units then whole, its stdout). Torch's test backend: collectives that do
    nothing, so its numbers mean nothing here, its memory all."""
    as_torchrun(3)
    args = hand.parse_args([*JOB_FLAGS, "--steps=2", "--accum-steps=2",
                            f"--reshard-after-forward={str(not keep).lower()}"])
    fake_world(3, rank=0)
    units, whole = [], []
    init, gather = hand.Unit.__init__, hand.Unit.gather

    def recorded_init(self, *a):
        init(self, *a)
        units.append(self)

    def recorded_gather(self):
        gather(self)
        whole.append((units.index(self), {i for i, u in enumerate(units)
                                          if u.full.untyped_storage().size()}))
    monkeypatch.setattr(hand.Unit, "__init__", recorded_init)
    monkeypatch.setattr(hand.Unit, "gather", recorded_gather)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        hand.train(args, 0, 3, torch.device("cpu"))
    return units, whole, out.getvalue()


@pytest.mark.parametrize("keep", [False, True])
def test_by_hand_each_rank_holds_1_over_n_and_a_block_is_whole_only_while_it_runs(
        keep, as_torchrun, fake_world, monkeypatch):
    """The summary's state on rank 0 of 3: a shard of each unit, padded to a multiple of 3, of
    the weights, their gradients and Adam's two moments, 4 x 4 bytes each (fp32): 1/3 of one
    device's and the padding. Each time a unit is gathered, the only other unit whole is the
    root (embeddings, head: first in forward, last in backward): a block is freed after its
    forward and again after its backward. Kept (ZeRO-2's trade), each is freed after its
    backward only. After the run, none is whole (gathers: the run)."""
    units, whole, out = gathers(by_hand(), keep, as_torchrun, fake_world, monkeypatch)
    sizes = [sum(p.numel() for p in block.parameters()) for block in reference_blocks()]
    assert [u.shard.numel() for u in units] == [-(-n // 3) for n in sizes]
    assert state_mib(out) == pytest.approx(16 * sum(-(-n // 3) for n in sizes) / 2**20, abs=1e-3)
    assert state_mib(out) == pytest.approx(16 * sum(sizes) / 3 / 2**20, abs=1e-3)
    root = len(units) - 1  # gathered as a forward starts (and again as a backward starts)
    assert all(others == {root} for unit, others in whole if unit == root)
    if keep:  # by the first forward's end, every unit at once
        assert whole[JOB["blocks"]] == (JOB["blocks"] - 1, set(range(len(units))))
    else:
        assert all(others <= {unit, root} for unit, others in whole)
    assert not any(u.full.untyped_storage().size() for u in units)


def reference_blocks():
    """JOB's model cut as fully_shard cuts it: each block, then the root's own parameters."""
    model = SimpleModel(JOB["hidden"], JOB["blocks"], JOB["heads"])
    root = torch.nn.ParameterList(p for n, p in model.named_parameters()
                                  if not n.startswith("blocks."))
    return [*model.blocks.values(), root]


@pytest.mark.parametrize("flags, message", [
    (["--replicate=2"], "--replicate: not written by hand here; use fsdp.py"),
    (["--mixed-precision=bf16"], "--mixed-precision: not written by hand here; use fsdp.py"),
    (["--checkpoint=ckpt"], "--checkpoint: not written by hand here; use fsdp.py"),
    (["--batch-size=64"], "--batch-size 64 must be divisible by world size 3"),  # fsdp.py's too
])
def test_by_hand_refuses_what_it_leaves_out_in_one_line(flags, message, as_torchrun, capsys):
    as_torchrun(3)
    refused_in_one_line("from_scratch.fsdp", flags, message, capsys)


@needs_cuda
def test_fsdp_by_hand_nccl_one_rank_on_gpu_equals_one_device(reference, tmp_path):
    result = torchrun(1, HAND, *CUDA_JOB_FLAGS, f"--save={tmp_path / 'w.pt'}")
    assert_gpu_run_equals_oracle(result, tmp_path / "w.pt", reference)


@needs_2_gpus
def test_fp64_fsdp_by_hand_on_two_gpus_over_nccl_equals_the_fp64_oracle(tmp_path):
    """Each unit's shards on 2 GPUs, all-gathered and reduce-scattered over NCCL, in float64,
    3 micro-batches, clipped."""
    result = torchrun(2, HAND, *CUDA_JOB_FLAGS, *fp64(SEED_A, clip=FP64_CLIP), "--accum-steps=3",
                      f"--save={tmp_path / 'w.pt'}")
    assert_fp64_run_equals_the_fp64_oracle((ok(result), load_saved(tmp_path / "w.pt")), SEED_A,
                                           clip=FP64_CLIP)


# The by-hand twin's mistakes (docs/exercises.md): each made in a copy of from_scratch/fsdp.py,
# launched early, 2 ranks, fp64, 4 steps
HAND_MISTAKES = {  # name: [(lines of the real file, the mistake in their place)]
    "FSDP by hand: the gathered weights freed before backward": [(
        "            output.register_hook(lambda grad: self.gather())\n", "")],
}


@pytest.fixture(scope="module")
def hand_mistakes(early):
    """{name: its result} of each of the by-hand twin's mistakes."""
    return dict(zip(HAND_MISTAKES, early[1][len(RUNS):]))


def test_by_hand_weights_freed_before_backward_stop_it_at_the_first_backward(hand_mistakes):
    """Freed after forward and never gathered again: the graph still holds the views it saved
    (a Linear's weight, for its input's gradient), now of storage of size 0. Every rank stops
    at its first backward, in the head's, with torch's error, not with wrong numbers."""
    result = hand_mistakes["FSDP by hand: the gathered weights freed before backward"]
    assert result.returncode != 0
    assert "out of bounds for storage of size 0" in result.stderr
    assert "step     1/4" not in result.stdout


def imported(path):
    """The mutated copy at `path`, imported as a module of its own (not the real twin)."""
    spec = importlib.util.spec_from_file_location(f"mutant_{path.parent.parent.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_by_hand_views_made_once_keep_every_block_whole_until_backward_ends(
        tmp_path, as_torchrun, fake_world, monkeypatch):
    """The weights' views made once, when the unit is built, not at each forward: the numbers
    stay the same to the bit (measured), and the memory goes. Backward runs the graph's newest
    nodes first; views older than all of it reach their unit's gradient only when backward
    ends, so no block is freed after its backward: the last micro-batch's backward gathers
    block 0 while every block is whole. In this process (gathers), as its test above."""
    copy = imported(mutated(HAND, [(
        "        self.free()\n        module.register_forward_pre_hook",
        "        for (owner, leaf), view in zip(self.owners, self.views()):\n"
        "            setattr(owner, leaf, view)\n"
        "        self.free()\n        module.register_forward_pre_hook"), (
        "        for (owner, leaf), view in zip(self.owners, self.views()):\n"
        "            setattr(owner, leaf, view)\n\n    def after_forward", "\n    def after_forward")],
        tmp_path, "FSDP by hand: the views made once"))
    units, whole, _ = gathers(copy, False, as_torchrun, fake_world, monkeypatch)
    assert (0, set(range(len(units)))) in whole


class Tied(SimpleModel):
    """SimpleModel with its head tied to its embedding, as GPT-2's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.output.weight = self.embed.weight


def test_by_hand_a_tied_weight_stops_in_one_line_not_two_copies(monkeypatch, tmp_path):
    """A user's model that ties its head to its embedding: two units (or two views of one)
    would hold the one tensor apart and train two copies; the twin stops in one line (fsdp.py
    keeps it one DTensor)."""
    hand = importlib.import_module("from_scratch.fsdp")
    monkeypatch.setattr(hand, "SimpleModel", Tied)
    with pytest.raises(SystemExit, match="the model ties weights, which two units or two views "
                                         "would hold apart; untie them, or use fsdp.py"):
        run_as_only_rank(hand, [], tmp_path)
