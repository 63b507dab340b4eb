"""fsdp.py: sharding the model over N ranks trains to the same weights as one device; its
sharded checkpoints resume on any number of ranks; each rank holds 1/N of the training state."""

import importlib
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
                      JOB_FLAGS, TOL, assert_checkpoints_resume_to_the_oracle,
                      assert_fp64_run_equals_the_fp64_oracle, assert_gpu_run_equals_oracle,
                      assert_norms_are_the_oracles, assert_profiled, early_runs, fp32_reference,
                      fp64, launch_together, launched_runs, logged_losses, max_diff, moe,
                      needs_cuda, ok, refused_in_one_line, run_as_only_rank, succeeded,
                      summary_val_loss, torchrun, torchrun_cmd)

# bf16 compute, fp32 reduction and weights: the final loss measured 4.9e-6 from fp32's, relative
# (docs/proofs.md).
BF16_REL_TOL = 0.01

SEED_A, SEED_B = FP64_SEEDS[0], FP64_SEEDS[-1]

MIXTURE = moe(5, 2)
HSDP = "fp64, spawn 4 ranks, HSDP 2x2, reshard false, clip, CUDA's Adam, 5 experts, top-2"
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
}
FP64_RUNS = {"fp64, 3 ranks, accum 3, AC": (SEED_A, None, {}),  # name: (seed, clip, mixture)
             HSDP: (SEED_B, FP64_CLIP, MIXTURE[1])}


early_launches = early_runs("fsdp.py", RUNS)  # queued when the tests are collected


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp")
    launched = launched_runs(__name__, "fsdp.py", RUNS)
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
    """load_sharded (plumbing/sharded.py) checks the index and the shards on every rank before the
    collective load: the same files, the same ValueError on every rank."""
    marker = tmp_path / "ran"
    copy = damage(runs["2 ranks"][1].parent / "ckpt", case, tmp_path / "c", marker)
    before = files(copy)
    def refuse(why):
        raise ValueError(why)

    with pytest.raises(ValueError, match=re.escape(DAMAGED[case])):
        plumbing.sharded.load_sharded({}, copy / (copy / "latest").read_text(), refuse)
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
