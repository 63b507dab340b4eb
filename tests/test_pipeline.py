"""pipeline.py: pipelined stages and model parallelism train to the same weights as one
device, and their checkpoints resume on any number of stages, or in single.py. Its by-hand twin,
from_scratch/pipeline.py (GPipe and 1F1B from send and recv), ends where pipeline.py ends."""

import json
import shutil

import pytest
import torch

from plumbing.compile import torch_older_than
from conftest import (CUDA_DEFAULTS, CUDA_JOB_FLAGS, FP32_VAL_TOL, FP64_CLIP, FP64_JOB, FP64_SEEDS,
                      FP64_TOL, JOB, JOB_FLAGS, REPO, TOL, assert_checkpoints_resume_to_the_oracle,
                      assert_fp64_run_equals_the_fp64_oracle, assert_gpu_run_equals_oracle,
                      assert_norms_are_the_oracles, assert_profiled, early_results, fp64,
                      fp64_reference, load_saved, logged_losses, logged_norms, logged_step_losses,
                      max_diff, mutated, needs_2_gpus, needs_cuda, ok, python,
                      ranks_cmd, refused_in_one_line, run_as_only_rank, run_commands,
                      run_in_process, succeeded, summary_val_loss, torchrun)
from reference import reference_train

SEED_A, SEED_B = FP64_SEEDS[0], FP64_SEEDS[-1]
BY_HAND = "from_scratch/pipeline.py"

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
    # The by-hand twin, on two of the runs above with their flags (a trace and a checkpoint
    # path of its own): each is compared with pipeline.py's run directly.
    "by hand: fp64, 3 stages, 1f1b, AC": (3, [
        *fp64(SEED_A), "--blocks=4", "--schedule=1f1b", "--microbatches=6",
        "--activation-checkpointing", "--checkpoint={folder}/ckpt64_by_hand.pt",
        "--profile={folder}/trace_by_hand_1f1b"], BY_HAND),
    "by hand: fp64, 2 stages, gpipe, clip, CUDA's Adam": (2, [
        CUDA_DEFAULTS, *fp64(SEED_B, clip=FP64_CLIP), "--schedule=gpipe", "--microbatches=3",
        "--profile={folder}/trace_by_hand_gpipe"], BY_HAND),
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


def early_launches(folder):  # queued when the tests are collected
    """RUNS, and the by-hand twin's mistakes (below), each a copy in folder/m<i> that finds
    common.py and plumbing/ on PYTHONPATH."""
    mutants = [ranks_cmd(nproc, mutated(BY_HAND, edits, folder / f"m{i}", name), *JOB_FLAGS,
                         *flags, f"--save={folder / f'm{i}' / 'w.pt'}")
               for i, (name, (edits, nproc, flags)) in enumerate(BY_HAND_MISTAKES.items())]
    return [*run_commands("pipeline.py", RUNS, folder)[0], *mutants], {
        "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def launched():
    """(folder, results in order) of early_launches."""
    return early_results(__name__)


@pytest.fixture(scope="module")
def runs(launched):
    folder, results = launched
    return dict(zip(RUNS, zip(results, run_commands("pipeline.py", RUNS, folder)[1])))


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


# The by-hand twin: from_scratch/pipeline.py against pipeline.py with the same flags

BY_HAND_PAIRS = {"by hand: fp64, 3 stages, 1f1b, AC": "fp64, 3 stages, 1f1b, AC",
                 "by hand: fp64, 2 stages, gpipe, clip, CUDA's Adam":
                     "fp64, 2 stages, gpipe, clip, CUDA's Adam"}


@pytest.mark.parametrize("name", BY_HAND_PAIRS)
def test_by_hand_ends_where_pipeline_py_ends_and_prints_its_numbers(name, runs):
    """1F1B on 3 stages (4 blocks cut 1, 1, 2; 6 micro-batches; AC) and GPipe on 2 (3
    micro-batches, clipped by the whole gradient's norm, CUDA's Adam): within 1e-12 of
    pipeline.py with the same flags, within 1e-9 of one device, and every loss, gradient norm
    and validation loss printed is pipeline.py's. Not bit-identical: each micro-batch's loss
    is divided by 3 (or 6) before its backward, where the library divides the gradients'
    sum once, after the last: two roundings (with 4 micro-batches, a power of two, both are
    exact and the runs bit-identical)."""
    wrapper = BY_HAND_PAIRS[name]
    (out, weights), (theirs, their_weights) = succeeded(runs[name]), succeeded(runs[wrapper])
    assert "pipeline by hand: " in out
    assert max_diff(weights, their_weights) <= 1e-12
    assert logged_step_losses(out) == logged_step_losses(theirs)
    assert logged_norms(out) == logged_norms(theirs)
    assert summary_val_loss(out) == summary_val_loss(theirs)
    seed, clip, blocks = FP64_RUNS[wrapper]
    assert_fp64_run_equals_the_fp64_oracle((out, weights), seed, clip=clip, blocks=blocks)


def test_by_hand_checkpoint_holds_pipeline_py_s_weights_and_adam_state(runs):
    """The same gather (plumbing/checkpoints.gather_full_state) over the same cut: the 1F1B
    run's file, single.py's format, holds pipeline.py's weights and Adam moments to 1e-12, so
    it resumes wherever pipeline.py's does (above)."""
    folder = runs["fp64, 3 stages, 1f1b, AC"][1].parent
    mine, theirs = (torch.load(folder / name, weights_only=True)
                    for name in ("ckpt64_by_hand.pt", "ckpt64.pt"))
    assert mine.keys() == theirs.keys() and mine["step"] == theirs["step"] == FP64_JOB["steps"]
    assert max_diff(mine["model"], theirs["model"]) <= 1e-12
    assert mine["optimizer"]["param_groups"] == theirs["optimizer"]["param_groups"]
    for i, state in theirs["optimizer"]["state"].items():
        assert max_diff(mine["optimizer"]["state"][i], state) <= 1e-12


def step_in_theory(schedule, rank, stages, m):
    """What `rank` does in one step, in order. Its forwards and backwards: gpipe every
    forward, then every backward; 1f1b a warm-up of stages - rank - 1 forwards, then a forward
    and a backward in turn, then the backwards left (cool-down). A forward receives its
    activations from the stage before ("recv"; not on the first) and sends its own on
    ("send"; not on the last); a backward receives its output's gradient from the stage after
    (not on the last) and sends its input's gradient back (not on the first)."""
    forwards, backwards = [f"Forward {i}" for i in range(m)], [f"Backward {i}" for i in range(m)]
    if schedule == "gpipe":
        order = forwards + backwards
    else:
        warm = stages - rank - 1
        order = forwards[:warm]
        for forward, backward in zip(forwards[warm:], backwards):
            order += [forward, backward]
        order += backwards[m - warm:]
    first, last, events = rank == 0, rank == stages - 1, []
    for name in order:
        receives, sends = (not first, not last) if name.startswith("F") else (not last, not first)
        events += ["recv"] * receives + [name] + ["send"] * sends
    return events


def traced_steps(folder, rank):
    """The recorded steps of `rank`'s trace, each as its "Forward i" and "Backward i" marks
    and its sends and receives, in order of time."""
    events = sorted((e for e in json.loads((folder / f"trace_rank{rank}.json").read_text())[
        "traceEvents"] if e.get("ph") == "X"), key=lambda e: e["ts"])
    p2p = {"gloo:send": "send", "gloo:recv": "recv"}
    return [[p2p.get(e["name"], e["name"]) for e in events
             if step["ts"] <= e["ts"] < step["ts"] + step["dur"]
             and (e["name"] in p2p or e["name"].startswith(("Forward ", "Backward ")))]
            for step in events if step["name"].startswith("ProfilerStep#")]


def in_order(events):
    """The sends and receives between two marks sorted: started in one batch, their order in
    time is a tie."""
    runs_, out = [], []
    for event in events + [None]:
        if event in ("send", "recv"):
            runs_.append(event)
            continue
        out += sorted(runs_) + ([event] if event else [])
        runs_ = []
    return out


@pytest.mark.parametrize("name, schedule, stages, m", [
    ("by hand: fp64, 3 stages, 1f1b, AC", "1f1b", 3, 6),
    ("by hand: fp64, 2 stages, gpipe, clip, CUDA's Adam", "gpipe", 2, 3)])
def test_by_hand_sends_receives_and_runs_each_micro_batch_in_the_schedule_s_order(
        name, schedule, stages, m, runs):
    """From the --profile trace (3 steps per rank): each rank's forwards and backwards in the
    schedule's order (step_in_theory), each received input just before the forward or backward
    that needs it, each output sent just after: per step and stage boundary, m activations
    forward and m gradients back, so a rank with two neighbours sends 2m and receives 2m. And
    what the order means for memory: at most m micro-batches' activations held with gpipe,
    stages - rank with 1f1b."""
    folder = runs[name][1].parent / f"trace_by_hand_{schedule}"
    for rank in range(stages):
        theory = step_in_theory(schedule, rank, stages, m)
        neighbours = (rank > 0) + (rank < stages - 1)
        assert theory.count("send") == theory.count("recv") == m * neighbours
        steps = traced_steps(folder, rank)
        assert len(steps) == 3
        for events in steps:
            assert in_order(events) == in_order(theory), rank
        held, most = 0, 0  # micro-batches between their forward and their backward
        for event in steps[0]:
            held += event.startswith("Forward") - event.startswith("Backward")
            most = max(most, held)
        assert most == (m if schedule == "gpipe" else stages - rank)


@pytest.mark.parametrize("flags, message", [
    (["--schedule=interleaved-1f1b"], "--schedule interleaved-1f1b runs several stages per "
     "rank; by hand, gpipe and 1f1b run one: use pipeline.py"),
    (["--schedule=zbv"], "--schedule zbv runs several stages per rank"),
    (["--stages-per-rank=2"], "--stages-per-rank 2: by hand, one stage per rank; use "
     "pipeline.py")])
def test_by_hand_refuses_more_than_one_stage_per_rank_in_one_line(flags, message, as_torchrun,
                                                                   capsys):
    as_torchrun(2)
    refused_in_one_line("from_scratch.pipeline", flags, message, capsys)


@needs_2_gpus
def test_by_hand_1f1b_on_two_gpus_over_nccl_equals_one_device(reference, tmp_path):
    """NCCL runs a rank's operations with one peer in order: 1F1B's facing sends (an
    activation on, a gradient back) need exchange()'s one batch. No 1-GPU test: a pipeline
    of one stage per rank needs a GPU per rank (NCCL cannot put two ranks on one), and one
    process is pipeline.py's model parallelism, unchanged (tested above)."""
    result = torchrun(2, BY_HAND, *CUDA_JOB_FLAGS, "--backend=nccl", "--schedule=1f1b",
                      f"--save={tmp_path / 'w.pt'}")
    assert "pipeline by hand: 2 ranks" in result.stdout
    assert_gpu_run_equals_oracle(result, tmp_path / "w.pt", reference)


# The by-hand twin's mistakes

BY_HAND_MISTAKES = {  # name: (edits of from_scratch/pipeline.py, ranks, flags)
    "by hand: the micro-batches' losses not divided by their count": ([(
        "                    outputs[i] = loss / m\n",
        "                    outputs[i] = loss  # (mistake) each micro-batch's mean, whole\n")],
        2, [*fp64(SEED_A, steps=4), "--microbatches=4"]),
}


def by_hand_mistake(name, launched):
    """(stdout, saved weights) of the launched mistake `name`."""
    folder, results = launched
    i = list(BY_HAND_MISTAKES).index(name)
    return ok(results[len(RUNS) + i]), load_saved(folder / f"m{i}" / "w.pt")


def test_by_hand_micro_batch_losses_not_divided_add_up_to_m_times_the_gradient(launched):
    """4 micro-batches' gradients add up to 4 times the batch's. The first step's loss is one
    device's (the forward is right), and Adam, dividing each gradient entry by its own size,
    almost undoes the scale: the loss curve hides it. The printed gradient norm is 4 times
    one device's, and in fp64 the weights part from it."""
    out, weights = by_hand_mistake(
        "by hand: the micro-batches' losses not divided by their count", launched)
    _, expected, losses, norms, _ = fp64_reference(SEED_A, 4)
    assert logged_step_losses(out)[1] == pytest.approx(losses[0], abs=1e-6)
    assert logged_norms(out)[1] == pytest.approx(4 * norms[0], rel=1e-6)
    assert max_diff(weights, expected) > FP64_TOL
