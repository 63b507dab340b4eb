"""diloco.py trains; in float64 it is a plain W-replica DiLoCo loop (tests/reference.py's
reference_diloco) to 1e-12, every printed number included; a checkpoint written mid-round
resumes to the same bits; with one inner step, SGD and outer lr 1 it is DDP with SGD, one
device's training; with momentum 0 and outer lr 1 it is torch's own PostLocalSGDOptimizer."""

import shutil

import pytest
import torch

from conftest import (FP64_CLIP, FP64_JOB, FP64_SEEDS, FP64_TOL, JOB, JOB_FLAGS, VAL_TOL,
                      early_results, fp64, launch, load_saved, logged_losses, logged_norms,
                      logged_step_losses, logged_val_losses, max_diff, ok, ranks_cmd,
                      run_as_only_rank, run_commands, succeeded, summary_val_loss)
from reference import reference_diloco, reference_train, reference_val_loss

SEED = FP64_SEEDS[0]
# The proofs in float64, where rounding is ~1e-13 and a gap is a bug: 12 steps (crossing an
# epoch: 11 of batch 180), rounds of H = 4; the checkpoint at step 6, mid-round (6 = 4 + 2)
STEPS, H, CKPT_STEP = 12, 4, 6
DILOCO_TOL = 1e-12
PROOF = [*fp64(SEED, steps=STEPS, clip=FP64_CLIP), "--accum-steps=3", f"--inner-steps={H}",
         "--log-every=1"]
SGD = [*fp64(SEED, steps=STEPS), "--inner-optimizer=sgd", "--outer-lr=1", "--outer-momentum=0",
       "--log-every=1"]
# name: (ranks, flags[, the script, where not diloco.py]), each training JOB with its flags
RUNS = {
    # 3 ranks, 3 micro-batches each, every replica clipping its own gradient, Adam and Nesterov
    "fp64, 3 ranks, accum 3, clip, H 4": (3, PROOF),
    # the same, stopped at step 6 with a checkpoint, which the resume test continues to 12
    "the same to step 6, checkpoint": (3, [*PROOF, f"--steps={CKPT_STEP}",
                                           "--checkpoint={folder}/ckpt.pt"]),
    "H 1, SGD, outer lr 1, momentum 0": (2, [*SGD, "--inner-steps=1"]),
    # Adam inside, the weights averaged every 3 steps: local SGD, ours and torch's
    "H 3, outer lr 1, momentum 0": (2, [*fp64(SEED, steps=STEPS), "--inner-steps=3",
                                        "--outer-lr=1", "--outer-momentum=0"]),
    "torch's PostLocalSGDOptimizer, H 3": (2, [*fp64(SEED, steps=STEPS), "--inner-steps=3"],
                                            "tests/local_sgd.py"),
}
# The quick tier's (-m quick, on the oldest and newest torch too): torch's own local SGD
QUICK = ["H 3, outer lr 1, momentum 0", "torch's PostLocalSGDOptimizer, H 3"]


def early_launches(folder, quick=False):  # queued when the tests are collected (conftest.py)
    """The default run (2 ranks, all defaults), then RUNS (under -m quick: QUICK's only)."""
    default = ranks_cmd(2, "diloco.py", "--device=cpu")
    commands = run_commands("diloco.py", RUNS, folder)[0]
    return [default, *(cmd if name in QUICK or not quick else None
                       for name, cmd in zip(RUNS, commands))], None


@pytest.fixture(scope="module")
def runs():
    """{name: (result, path it saved to)}; "default": (result, None)."""
    folder, results = early_results(__name__)
    paths = run_commands("diloco.py", RUNS, folder)[1]
    return {"default": (results[0], None), **dict(zip(RUNS, zip(results[1:], paths)))}


@pytest.mark.quick
def test_default_run_on_2_ranks_trains_loss_and_validation_loss_fall(runs):
    out = ok(runs["default"][0])
    losses, val_losses = logged_losses(out), logged_val_losses(out)
    assert losses[-1] < 0.5 * losses[0], losses
    assert len(val_losses) == 4 and val_losses == sorted(val_losses, reverse=True), val_losses
    assert summary_val_loss(out) == val_losses[-1]


def oracle(steps=STEPS):
    norms = []
    initial, final, losses = reference_diloco(
        steps, FP64_JOB["batch_size"], FP64_JOB["lr"], SEED, JOB["hidden"], JOB["blocks"],
        JOB["heads"], ranks=3, inner_steps=H, outer_lr=0.7, outer_momentum=0.9, clip=FP64_CLIP,
        fp64=True, norms=norms)
    return final, losses, norms


def test_fp64_diloco_on_3_ranks_is_the_plain_loop_to_1e_12_and_prints_its_numbers(runs):
    """The saved (outer) weights, every step's printed loss (the replicas' mean), rank 0's
    gradient norm, and the validation loss of the outer weights: the plain loop's."""
    out, weights = succeeded(runs["fp64, 3 ranks, accum 3, clip, H 4"])
    expected, losses, norms = oracle()
    diff = max_diff(weights, expected)
    print(f"diloco fp64, 3 ranks: {diff:.2e} from reference_diloco")  # pytest -s
    assert diff < DILOCO_TOL, f"{diff:.2e}"
    assert sorted(logged_step_losses(out)) == list(range(1, STEPS + 1))
    for step, loss in logged_step_losses(out).items():
        assert loss == pytest.approx(losses[step - 1], abs=1e-6), f"loss of step {step}"
    for step, norm in logged_norms(out).items():
        assert norm == pytest.approx(norms[step - 1], rel=1e-6), f"norm of step {step}"
    assert min(norms) > FP64_CLIP  # every replica's clip acted at every step (rank 0's, here)
    exact = reference_val_loss(expected, JOB["hidden"], JOB["blocks"], JOB["heads"])
    assert summary_val_loss(out) == pytest.approx(exact, abs=VAL_TOL)


def test_a_checkpoint_written_mid_round_resumes_to_the_same_bits(runs, tmp_path):
    """Step 6 is two steps into the second round: the file holds the outer weights and
    momentum and each replica's own weights and Adam state, which differ. Continued to step 12
    on 3 ranks, the weights and every printed loss are the uninterrupted run's, bit for bit."""
    folder = runs["the same to step 6, checkpoint"][1].parent
    ok(runs["the same to step 6, checkpoint"][0])
    state = torch.load(folder / "ckpt.pt", weights_only=True)
    assert state["step"] == CKPT_STEP and len(state["replicas"]) == 3
    replicas = [r["model"] for r in state["replicas"]]
    assert max_diff(replicas[0], replicas[1]) > 0 and max_diff(replicas[0], state["model"]) > 0
    shutil.copy(folder / "ckpt.pt", tmp_path / "ckpt.pt")
    out = ok(launch(*ranks_cmd(3, "diloco.py", *JOB_FLAGS, *PROOF,
                               f"--checkpoint={tmp_path / 'ckpt.pt'}",
                               f"--save={tmp_path / 'w.pt'}")))
    assert f"at step {CKPT_STEP}" in out
    whole_out, whole = succeeded(runs["fp64, 3 ranks, accum 3, clip, H 4"])
    resumed = load_saved(tmp_path / "w.pt")
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)
    whole_losses = logged_step_losses(whole_out)
    assert logged_step_losses(out) == {s: whole_losses[s] for s in range(CKPT_STEP + 1, STEPS + 1)}


def test_one_inner_step_of_sgd_with_outer_lr_1_and_no_momentum_is_one_devices_sgd(runs):
    """outer - mean(outer - (outer - lr g_r)) = outer - lr mean(g_r): DDP with SGD, which is
    one device with SGD on the whole batch (every rank counts as many targets, so the mean of
    their means is the batch's mean)."""
    out, weights = succeeded(runs["H 1, SGD, outer lr 1, momentum 0"])
    norms = []
    _, expected, losses = reference_train(**{**JOB, **FP64_JOB, "steps": STEPS, "seed": SEED},
                                          fp64=True, sgd=True, norms=norms)
    diff = max_diff(weights, expected)
    print(f"diloco H 1, SGD: {diff:.2e} from one device's SGD")  # pytest -s
    assert diff < DILOCO_TOL, f"{diff:.2e}"
    for step, loss in logged_step_losses(out).items():
        assert loss == pytest.approx(losses[step - 1], abs=1e-6), f"loss of step {step}"


@pytest.mark.quick
def test_outer_lr_1_without_momentum_is_torchs_post_local_sgd_optimizer(runs):
    """PostLocalSGDOptimizer around Adam, with PeriodicModelAverager(period=3, warmup_steps=2),
    averages the weights after steps 3, 6, 9, 12 and lets each rank step alone between, its
    Adam state its own: local SGD, as diloco.py with outer lr 1 and momentum 0 is."""
    _, ours = succeeded(runs["H 3, outer lr 1, momentum 0"])
    _, torchs = succeeded(runs["torch's PostLocalSGDOptimizer, H 3"])
    diff = max_diff(ours, torchs)
    print(f"diloco H 3, outer lr 1, momentum 0: {diff:.2e} from PostLocalSGDOptimizer")
    assert diff < DILOCO_TOL, f"{diff:.2e}"
    _, one_device, _ = reference_train(**{**JOB, **FP64_JOB, "steps": STEPS, "seed": SEED},
                                       fp64=True)
    assert max_diff(ours, one_device) > FP64_TOL  # and local SGD is not one device's training


def test_a_checkpoint_another_script_or_other_diloco_flags_wrote_is_refused_in_one_line(
        tmp_path):
    """ddp.py's checkpoint holds no replicas, and a diloco.py one written with another
    --inner-steps would end its rounds elsewhere: each refused in one line, the file left."""
    ckpt = tmp_path / "ckpt.pt"
    run_as_only_rank("ddp", ["--steps=1", f"--checkpoint={ckpt}"], tmp_path)
    with pytest.raises(SystemExit) as exit_:
        run_as_only_rank("diloco", ["--steps=2", f"--checkpoint={ckpt}"], tmp_path)
    assert str(exit_.value) == (f"diloco.py: error: --checkpoint {ckpt}: it holds no replicas: "
                                "written by another script; start afresh or point elsewhere")
    ckpt.unlink()
    run_as_only_rank("diloco", ["--steps=1", f"--checkpoint={ckpt}"], tmp_path)
    written = ckpt.read_bytes()
    with pytest.raises(SystemExit) as exit_:
        run_as_only_rank("diloco", ["--steps=2", "--inner-steps=3", f"--checkpoint={ckpt}"],
                         tmp_path)
    assert str(exit_.value) == (
        f"diloco.py: error: --checkpoint {ckpt}: written with --inner-steps 5 --outer-lr 0.7 "
        "--outer-momentum 0.9 --inner-optimizer adam; use the same")
    assert ckpt.read_bytes() == written
