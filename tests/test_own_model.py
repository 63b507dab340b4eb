"""docs/course.md's "Putting your own model in" is true: a user's model (tests/user_model.py, a
regression MLP with its own data and loss) put in where the section says, four names in
common.py, trains in single.py, ddp.py and fsdp.py, and the distributed runs equal one device
in float64."""

import shutil

import pytest

from conftest import (FP64_TOL, REPO, early_results, fp64, load_saved, logged_losses, max_diff, ok,
                      python_cmd, ranks_cmd)

# What the section tells a user to write at the end of common.py (the scripts import these
# names from it, so they now get the user's).
SWAP = "\nfrom user_model import SimpleModel, flops_per_sample, loss_fn, make_dataset\n"
FLAGS = [*fp64(1), "--hidden=32", "--blocks=3", "--device=cpu"]


RUNS = {"single": lambda folder, *flags: python_cmd(folder / "single.py", *flags),
        "ddp": lambda folder, *flags: ranks_cmd(2, folder / "ddp.py", *flags),
        "fsdp": lambda folder, *flags: python_cmd(folder / "fsdp.py", "--nproc=2", *flags)}


def early_launches(folder):  # queued when the tests are collected (conftest.py)
    for script in ("single.py", "ddp.py", "fsdp.py"):
        shutil.copy(REPO / script, folder)
    shutil.copy(REPO / "tests" / "user_model.py", folder)
    (folder / "common.py").write_text((REPO / "common.py").read_text() + SWAP)
    return [cmd(folder, *FLAGS, f"--save={folder / name}.pt")
            for name, cmd in RUNS.items()], None


@pytest.fixture(scope="module")
def own_model_runs():
    folder, results = early_results(__name__)
    return {name: (ok(result), folder / f"{name}.pt") for name, result in zip(RUNS, results)}


def test_a_users_mlp_trains_in_single_ddp_and_fsdp(own_model_runs):
    for name, (out, _) in own_model_runs.items():
        losses = logged_losses(out)
        assert losses[-1] < 0.5 * losses[0], (name, losses)


def test_a_users_mlp_in_ddp_and_fsdp_equals_one_device_in_fp64(own_model_runs):
    import user_model
    one = load_saved(own_model_runs["single"][1], model=user_model.SimpleModel(32, 3))
    assert "input.weight" in one  # the MLP's weights, not the transformer's
    for name in ("ddp", "fsdp"):
        weights = load_saved(own_model_runs[name][1], model=user_model.SimpleModel(32, 3))
        assert max_diff(weights, one) < FP64_TOL, name
