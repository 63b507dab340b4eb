"""ep.py: the experts spread over the ranks, tokens sent to them by all-to-all, trains to one
device's weights (single.py with the same mixture) in float64, the tokens each expert got
included; its checkpoint resumes on another EP degree and in single.py."""

import shutil

import pytest

from conftest import (CUDA_JOB_FLAGS, FP64_CLIP, FP64_JOB, FP64_SEEDS, JOB, JOB_FLAGS,
                      assert_fp64_run_equals_the_fp64_oracle, early_runs, fp64, launch,
                      launched_runs, load_saved, moe, needs_2_gpus, needs_cuda, ok, ranks_cmd,
                      refused_in_one_line, run_in_process, succeeded, torchrun)

SEED_A, SEED_B = FP64_SEEDS[0], FP64_SEEDS[-1]

# name: (ranks, flags, seed, clip, the oracle's mixture). fp64 on flags nobody chose: EP 2, a
# grid of 2 "dp" groups x EP 2, an odd expert count per rank (3), k = 1 and 2, accumulation,
# clipping, and a checkpoint that EP 4 (one expert per rank) and single.py continue.
MIXTURES = {
    "ep 2, 4 experts, top-2, accum 3, clip": (2, ["--ep=2"], SEED_A, FP64_CLIP, moe(4, 2, 3)),
    "dp 2 x ep 2, 6 experts, top-1, accum 3, clip": (4, ["--ep=2"], SEED_B, FP64_CLIP,
                                                     moe(6, 1, 3)),
}
RUNS = {name: (ranks, [*flags, *fp64(seed, clip=clip), *mixture[0],
                       *(["--checkpoint={folder}/ep.pt"] if name.startswith("ep 2") else [])])
        for name, (ranks, flags, seed, clip, mixture) in MIXTURES.items()}

early_launches = early_runs("ep.py", RUNS)  # queued when the tests are collected


@pytest.fixture(scope="module")
def runs():
    return launched_runs(__name__, "ep.py", RUNS)


@pytest.mark.parametrize("name", MIXTURES)
def test_fp64_expert_parallel_run_equals_the_fp64_oracle(name, runs):
    _, _, seed, clip, (_, oracle) = MIXTURES[name]
    assert_fp64_run_equals_the_fp64_oracle(succeeded(runs[name]), seed, clip=clip, **oracle)


def test_fp64_checkpoint_from_ep_2_resumes_on_ep_4_and_in_single_py(runs, tmp_path):
    """The file rank 0 wrote after FP64_JOB on EP 2 (every expert gathered): 4 ranks holding
    one expert each continue it 4 steps, and so does single.py; both end at the oracle's
    weights after FP64_JOB + 4 steps."""
    name = "ep 2, 4 experts, top-2, accum 3, clip"
    _, _, seed, clip, (flags, oracle) = MIXTURES[name]
    succeeded(runs[name])
    source = runs[name][1].parent / "ep.pt"  # its --checkpoint, beside its --save
    steps = FP64_JOB["steps"] + 4
    for script in ("ep", "single"):
        shutil.copy(source, tmp_path / f"{script}.pt")
        args = [*fp64(seed, steps=steps, clip=clip), *flags,
                f"--checkpoint={tmp_path}/{script}.pt"]
        if script == "single":
            run = run_in_process("single", args, tmp_path)
        else:
            saved = tmp_path / "ep4.pt"
            result = launch(*ranks_cmd(4, "ep.py", *JOB_FLAGS, *args, f"--save={saved}"))
            run = ok(result), load_saved(saved)
        assert "resumed from" in run[0]
        assert_fp64_run_equals_the_fp64_oracle(run, seed, steps=steps, clip=clip, **oracle)


def test_the_tokens_each_expert_got_are_printed_and_add_up_to_every_tokens_k_slots(runs):
    """The summary's last line counts the tokens routed to each expert over the run, every
    rank's: each token's k slots once. (That they are one device's counts, token for token,
    every fp64 proof checks: assert_fp64_run_equals_the_fp64_oracle.)"""
    out = succeeded(runs["ep 2, 4 experts, top-2, accum 3, clip"])[0]
    line = next(line for line in out.splitlines() if line.startswith("experts |"))
    per_block = line.split(": ")[1].split(" | ")[:JOB["blocks"]]
    tokens = FP64_JOB["steps"] * FP64_JOB["batch_size"] * 16 * 2  # top-2: each token twice
    assert all(sum(map(int, block.split())) == tokens for block in per_block)


@pytest.mark.parametrize("flags, message", [
    (["--nproc=2", "--experts=3"], "--ep 2 must divide --experts 3"),
    (["--nproc=2", "--experts=0"], "--ep 2 must divide --experts 0"),
    (["--nproc=4", "--ep=3"], "--ep 3 must divide the world size 4"),
])
def test_a_bad_expert_layout_is_refused_in_one_line(flags, message, capsys):
    refused_in_one_line("ep", ["--device=cpu", *flags], message, capsys)


@needs_cuda
def test_fp64_ep_over_nccl_on_one_gpu_equals_the_fp64_oracle(tmp_path):
    """NCCL's all-to-all with uneven splits, in float64: one rank, every expert its own."""
    flags, oracle = moe(4, 2, 3)
    result = torchrun(1, "ep.py", *CUDA_JOB_FLAGS, *fp64(SEED_A), *flags,
                      f"--save={tmp_path / 'w.pt'}")
    assert_fp64_run_equals_the_fp64_oracle((ok(result), load_saved(tmp_path / "w.pt")), SEED_A,
                                           **oracle)


@needs_2_gpus
def test_fp64_ep_over_nccl_on_two_gpus_equals_the_fp64_oracle(tmp_path):
    flags, oracle = moe(4, 2, 3)
    result = torchrun(2, "ep.py", *CUDA_JOB_FLAGS, *fp64(SEED_B), *flags,
                      f"--save={tmp_path / 'w.pt'}")
    assert_fp64_run_equals_the_fp64_oracle((ok(result), load_saved(tmp_path / "w.pt")), SEED_B,
                                           **oracle)
