"""nd.py: a pipeline of TP-cut, FSDP-sharded stages, each sequence cut over CP ranks, on one
(pp, dp, cp, tp) mesh (one stage, --pp 1, is FSDP x CP: tests/test_cp.py) trains to one
device's weights, losses and gradient norms in float64 under every schedule, on 8 ranks
(2 x 2 x 2 of the four); its checkpoint, written with CP, resumes on a mesh without it and in
single.py; no rank holds a whole stage at the build or the
save; a mesh whose TP groups would span machines, and every flag the mesh cannot divide, is
refused in one line."""

import itertools
import shutil
import types

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from common import SimpleModel
from plumbing.compile import torch_older_than
from conftest import (CUDA_DEFAULTS, CUDA_JOB_FLAGS, FP64_CLIP, FP64_SEEDS,
                      assert_checkpoints_resume_to_the_oracle,
                      assert_fp64_run_equals_the_fp64_oracle, assert_gpu_run_equals_oracle,
                      early_runs, fp64, launched_runs, needs_2_gpus,
                      refused_in_one_line, run_in_process, succeeded, torchrun)

SEED_A, SEED_B = FP64_SEEDS[0], FP64_SEEDS[-1]
# 8 steps of FP64_JOB's batch 180, continued to 16 across an epoch (11 steps each) by the
# resumed runs: on 8 ranks every step is dozens of collectives, so the composition's proof
# keeps to the horizon where its mistakes show (the zoo: 4 steps) and leaves the long one to
# the scripts it composes (tests/test_pipeline.py, tests/test_tp.py: 40 steps).
STEPS = 8
# 4 blocks: 4 stages when 2 ranks run 2 each; 4 heads: TP 2 cuts whole heads
MODEL = ["--blocks=4", "--heads=4", "--pp=2", "--tp=2"]
ORACLE = {"blocks": 4, "heads": 4}
# name: (seed, clip, flags). Every schedule on 8 ranks, on flags nobody chose: 2 to 6
# micro-batches, clipping by the whole gradient's norm over every dimension, recomputed blocks
# (under a split backward too), CUDA's Adam. Three of the four dimensions at a time, so that
# every pair meets: pp x cp x tp (Ulysses under gpipe, the ring under a V), pp x dp x cp
# (1f1b: FSDP over dp x cp, data dealt over dp), pp x dp x tp (the others). gpipe's
# checkpoint (step 8, with CP) is continued below on a mesh without it, and by single.py.
# (All four at once, 2 x 2 x 2 x 2, is 16 processes: no pair it adds.)
CP = ["--cp=2", "--tp=1"]
SCHEDULES = {
    "gpipe, pp x cp x tp, ulysses, 3 micro-batches, clip": (SEED_A, FP64_CLIP, [
        "--schedule=gpipe", "--microbatches=3", "--cp=2", "--cp-method=ulysses",
        "--checkpoint={folder}/nd.pt"]),
    "1f1b, pp x dp x cp, ring, 2 micro-batches, CUDA's Adam": (SEED_B, None, [
        CUDA_DEFAULTS, "--schedule=1f1b", "--microbatches=2", *CP, "--cp-method=ring"]),
    "interleaved-1f1b, 6 micro-batches, clip": (SEED_B, FP64_CLIP, [
        "--schedule=interleaved-1f1b", "--microbatches=6"]),
    "zero-bubble, 2 micro-batches, AC, CUDA's Adam": (SEED_A, None, [
        CUDA_DEFAULTS, "--schedule=zero-bubble", "--microbatches=2",
        "--activation-checkpointing"]),
    "zbv, pp x cp x tp, ring, 2 micro-batches, clip": (SEED_B, FP64_CLIP, [
        "--schedule=zbv", "--microbatches=2", "--cp=2", "--cp-method=ring"]),
    "dualpipev, 6 micro-batches": (SEED_A, None, ["--schedule=dualpipev", "--microbatches=6"]),
}
if torch_older_than(2, 12):  # its gloo cannot run a V (pipeline.py refuses: tests/test_pipeline)
    del SCHEDULES["zbv, pp x cp x tp, ring, 2 micro-batches, clip"]
    del SCHEDULES["dualpipev, 6 micro-batches"]
RUNS = {name: (8, [*(f for f in flags if f == CUDA_DEFAULTS), *fp64(seed, STEPS, clip), *MODEL,
                   *(f for f in flags if f != CUDA_DEFAULTS)])
        for name, (seed, clip, flags) in SCHEDULES.items()}

early_launches = early_runs("nd.py", RUNS)  # queued when the tests are collected


@pytest.fixture(scope="module")
def runs():
    return launched_runs(__name__, "nd.py", RUNS)


@pytest.mark.parametrize("name", SCHEDULES)
def test_fp64_every_schedule_on_a_2x2x2_mesh_equals_the_fp64_oracle(name, runs):
    seed, clip, _ = SCHEDULES[name]
    assert_fp64_run_equals_the_fp64_oracle(succeeded(runs[name]), seed, STEPS, clip,
                                           **ORACLE)


def test_fp64_checkpoint_resumes_on_another_mesh_and_in_single_py(runs, tmp_path):
    """gpipe's checkpoint of pp 2 x cp 2 x tp 2 (step 8) continued to step 16, across an epoch,
    on 2 (pp) x 2 (dp) x 1 (cp) x 1 (tp) ranks, 2 stages each, and by single.py: each ends
    within 1e-9 of 16 uninterrupted steps on one device."""
    written = runs["gpipe, pp x cp x tp, ulysses, 3 micro-batches, clip"][1].parent / "nd.pt"
    for copy in ("mesh.pt", "single.pt"):
        shutil.copy(written, tmp_path / copy)
    assert_checkpoints_resume_to_the_oracle("nd.py", {
        (4, *MODEL[:-1], "--tp=1", "--schedule=interleaved-1f1b", "--microbatches=2"):
            (tmp_path / "mesh.pt", SEED_A, FP64_CLIP, {"blocks": 4})}, tmp_path, SEED_A,
        heads=4, steps=STEPS)
    run = run_in_process("single", [*fp64(SEED_A, STEPS + 8, FP64_CLIP), *MODEL[:2],
                                    f"--checkpoint={tmp_path}/single.pt"], tmp_path)
    assert f"at step {STEPS}" in run[0]
    assert_fp64_run_equals_the_fp64_oracle(run, SEED_A, STEPS + 8, FP64_CLIP, **ORACLE)


class Built(Exception):
    """Raised in place of nd.py's first PipelineStage: its stage is built."""


def peak_bytes(prof):
    """The most bytes of tensors allocated at once in `prof`'s span, over what was held before
    it: torch.profiler's record of every allocation and free, in order (whole in a fake group;
    under gloo some frees are missing from it, so docs/memory.md counts malloc's bytes)."""
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    return max(itertools.accumulate(e.self_cpu_memory_usage for e in events), default=0)


def test_no_rank_holds_a_whole_stage_at_the_build_or_the_save(as_torchrun, fake_world,
                                                               monkeypatch):
    """nd.py as rank 4 (the second stage's sender) of a fake world of 8 (2 x 2 x 2 in this
    process: collectives that send nothing but allocate what they return). From train()'s
    start to its first PipelineStage it allocates its pieces (a quarter of a stage: dp x tp =
    4), under half a stage; while it gathers a checkpoint, under one stage's weights: one
    whole tensor at a time (docs/memory.md: what the other ways hold). (Rank 0's CPU holds the
    whole model, the weights it hands out and the file it writes; on a CPU that is its device
    too, so it is not measured here.)"""
    import nd
    from pipeline import cut
    rank = 4
    as_torchrun(8)
    args = nd.parse_args(["--device=cpu", "--fp64", "--hidden=64", *MODEL])
    built = []  # its stage (gpipe: one a rank)

    def stop(stage, *_, **__):
        built.append(stage)
        raise Built

    monkeypatch.setattr(nd, "PipelineStage", stop)
    # Rank 0's weights come by torch's broadcast, one tensor at a time (its source, 2.10 to
    # 2.15), which a fake group cannot carry: its object broadcast sends nothing.
    monkeypatch.setattr(nd, "set_model_state_dict", lambda *_, **__: None)
    # One such world a process: a second's all-gathers name the first's group ("Could not
    # resolve the process group ...").
    fake_world(8, rank=rank)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as build:
        with pytest.raises(Built):
            nd.train(args, rank, 8, torch.device("cpu"))
    optimizers = [torch.optim.Adam(part.parameters()) for part in built]
    for optimizer in optimizers:  # as after a step: a count and two moments per parameter
        for p in optimizer.param_groups[0]["params"]:
            optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as save:
        nd.gather_full_state(args, list(zip(built, optimizers)))  # as nd.py's save calls it
    with torch.device("meta"):
        model = SimpleModel.from_args(args).to(torch.float64)
    stage = min(8 * sum(p.numel() for p in cut(model, i, 2).parameters()) for i in range(2))
    assert peak_bytes(build) < stage / 2 and peak_bytes(save) < stage, (
        peak_bytes(build), peak_bytes(save), stage)


def test_the_mesh_puts_each_tp_group_inside_a_machine(world_of_8):
    import nd
    world_of_8(4)  # 2 machines of 4 (conftest.world_of_8)
    mesh, shards = nd.make_mesh(types.SimpleNamespace(pp=2, cp=1, tp=2), 8,
                                types.SimpleNamespace(type="cpu"))
    assert mesh.mesh_dim_names == ("pp", "dp", "cp", "tp")
    assert mesh["tp"].mesh.tolist() == [0, 1] and mesh["pp"].mesh.tolist() == [0, 4]
    assert shards["dp_cp"].mesh.tolist() == mesh["dp"].mesh.tolist() == [0, 2]
    # 2 (pp) x 2 (dp) x 2 (cp): rank 0's data group [0, 2], its CP group [0, 1]; FSDP's view
    # holds the four ranks of both, and its pipeline and TP groups are the mesh's
    mesh, shards = nd.make_mesh(types.SimpleNamespace(pp=2, cp=2, tp=1), 8,
                                types.SimpleNamespace(type="cpu"))
    assert mesh["dp"].mesh.tolist() == [0, 2] and mesh["cp"].mesh.tolist() == [0, 1]
    assert shards["dp_cp"].mesh.tolist() == [0, 1, 2, 3]
    assert shards["pp"].mesh.tolist() == mesh["pp"].mesh.tolist() == [0, 4]
    assert shards["tp"].mesh.tolist() == mesh["tp"].mesh.tolist() == [0]


@pytest.mark.parametrize("world, flags, message", [
    (8, ["--pp=3"], "--pp 3 x --cp 1 x --tp 2 must divide the world size 8"),
    (8, ["--cp=3"], "--pp 2 x --cp 3 x --tp 2 must divide the world size 8"),
    (32, ["--cp=16", "--tp=1"], "--cp 16: the sequence length 16 must cut into 2 x --cp"),
    (16, ["--cp=2", "--batch-size=60"], "divisible by the 2 pipeline(s) (dp) x --microbatches"),
    (6, ["--tp=3"], "--tp 3 must divide --heads 4"),
    (8, ["--batch-size=60"], "must be divisible by the 2 pipeline(s) (dp) x --microbatches 4"),
    (8, ["--pp=4", "--schedule=interleaved-1f1b"], "8 stages but --blocks 4"),
    (8, ["--experts=4"], "trains the dense model only"),
    # Ulysses under TP 2: 2 heads of the 4 per TP rank, which --cp 4 does not cut
    (16, ["--cp=4", "--cp-method=ulysses"], "SimpleModel's 4 query and 4 key/value heads over "
     "--tp 2 do not cut evenly into --cp 4"),
])
def test_a_mesh_the_flags_cannot_divide_is_refused_in_one_line(world, flags, message,
                                                                as_torchrun, capsys):
    as_torchrun(world)
    refused_in_one_line("nd", flags, message, capsys)


def test_a_tp_group_that_would_span_machines_is_refused(as_torchrun, capsys, monkeypatch):
    as_torchrun(8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    refused_in_one_line("nd", ["--tp=2"], "3 ranks per machine, so a TP group would span",
                        capsys)


@needs_2_gpus
def test_nd_on_two_gpus_over_nccl_equals_one_device(reference, tmp_path):
    """2 pipeline ranks of JOB (3 heads: --tp 1), over NCCL."""
    result = torchrun(2, "nd.py", *CUDA_JOB_FLAGS, "--pp=2", "--tp=1",
                      f"--save={tmp_path / 'w.pt'}")
    assert_gpu_run_equals_oracle(result, tmp_path / "w.pt", reference)
