"""docs/questions.md's "Putting your own model in" is true, on two models the scripts were not
written for, each put in where the section says (one line at the end of a copy of common.py):

- tests/user_model.py, a regression MLP with its own data and loss: single.py, ddp.py and
  fsdp.py train it, and the distributed runs equal one device in float64;
- tests/gpt_like.py, a small GPT-2 (a fused qkv layer, a head tied to its embedding, GPT-2's
  names, its own TP plan): single.py, ddp.py, fsdp.py and tp.py (2D: 2 TP groups of 2, FSDP
  across them, sequence parallelism inside) all equal one device in float64, in the weights,
  every logged loss and gradient norm and the validation loss, the tie kept.

And what the scripts cannot train as one device does is refused in one line that names the
fix: the tied head cut over the vocabulary, a TP plan key that names no module, a plan that
cuts nothing, a tied weight in a pipeline, BatchNorm where ranks or micro-batches each see a
part of the batch."""

import shutil

import pytest
import torch
import torch.nn as nn

import common
import plumbing.model_check
import gpt_like
import user_model
from conftest import (FP64_TOL, REPO, early_results, fp64, load_saved, logged_losses,
                      logged_norms, logged_step_losses, max_diff, ok, python_cmd, ranks_cmd,
                      refused_in_one_line, summary_val_loss)

# What the section tells a user to write at the end of common.py (the scripts import these
# names from it, so they now get the user's). The GPT-2 keeps common.py's data and loss.
SWAPS = {"mlp": "\nfrom user_model import SimpleModel, loss_fn, make_dataset\n",
         "gpt": "\nfrom gpt_like import SimpleModel\n"}
FLAGS = {"mlp": [*fp64(1), "--hidden=32", "--blocks=3", "--device=cpu"],
         # 4 heads: TP 2 cuts whole ones; a loss and a norm logged every 4th step
         "gpt": [*fp64(1), "--hidden=24", "--blocks=3", "--heads=4", "--log-every=4",
                 "--device=cpu"]}
RUNS = {"single": lambda folder, *flags: python_cmd(folder / "single.py", *flags),
        "ddp": lambda folder, *flags: ranks_cmd(2, folder / "ddp.py", *flags),
        "fsdp": lambda folder, *flags: python_cmd(folder / "fsdp.py", "--nproc=2", *flags),
        # 2D with SP, and fsdp.py's weights kept from forward to backward
        "tp": lambda folder, *flags: ranks_cmd(4, folder / "tp.py", "--tp=2",
                                               "--sequence-parallel",
                                               "--reshard-after-forward=false", *flags)}
SCRIPTS = {"mlp": ["single", "ddp", "fsdp"], "gpt": ["single", "ddp", "fsdp", "tp"]}
MODELS = {"mlp": lambda: user_model.SimpleModel(32, 3),
          "gpt": lambda: gpt_like.SimpleModel(24, 3, 4)}


def early_launches(folder):  # queued when the tests are collected (conftest.py)
    commands = []
    for model, scripts in SCRIPTS.items():
        (folder / model).mkdir()
        for script in scripts:
            shutil.copy(REPO / f"{script}.py", folder / model)
        shutil.copy(REPO / "tests" / f"{'user_model' if model == 'mlp' else 'gpt_like'}.py",
                    folder / model)
        shutil.copytree(REPO / "plumbing", folder / model / "plumbing")  # what the README says
        (folder / model / "common.py").write_text((REPO / "common.py").read_text() + SWAPS[model])
        commands += [RUNS[script](folder / model, *FLAGS[model],
                                  f"--save={folder / model / script}.pt") for script in scripts]
    return commands, None


@pytest.fixture(scope="module")
def own_model_runs():
    """{(model, script): (stdout, the weights it saved, as a state_dict)}."""
    folder, results = early_results(__name__)
    names = [(model, script) for model, scripts in SCRIPTS.items() for script in scripts]
    runs = {}
    for (model, script), result in zip(names, results):
        path = folder / model / f"{script}.pt"
        load_saved(path, model=MODELS[model]())  # it loads strictly into the user's model
        runs[model, script] = ok(result), torch.load(path, weights_only=True)  # as written
    return runs


@pytest.mark.parametrize("model", SCRIPTS)
def test_a_users_model_trains_in_every_script(own_model_runs, model):
    for script in SCRIPTS[model]:
        losses = logged_losses(own_model_runs[model, script][0])
        assert losses[-1] < (0.5 if model == "mlp" else 0.85) * losses[0], (script, losses)


def test_a_users_mlp_in_ddp_and_fsdp_equals_one_device_in_fp64(own_model_runs):
    _, one = own_model_runs["mlp", "single"]
    assert "input.weight" in one  # the MLP's weights, not the transformer's
    for script in ("ddp", "fsdp"):
        assert max_diff(own_model_runs["mlp", script][1], one) < FP64_TOL, script


@pytest.mark.parametrize("script", SCRIPTS["gpt"][1:])
def test_a_users_gpt2_in_ddp_fsdp_and_2d_tp_equals_one_device_in_fp64(own_model_runs, script):
    """Every number the run prints is one device's, to its digits, and its weights are within
    FP64_TOL; the saved head is the saved embedding (a state_dict names a tied weight twice)."""
    one_out, one = own_model_runs["gpt", "single"]
    out, weights = own_model_runs["gpt", script]
    assert "blocks.0.attn.c_attn.weight" in weights  # the GPT-2's weights
    assert max_diff(weights, one) < FP64_TOL
    assert torch.equal(weights["lm_head.weight"], weights["wte.weight"])
    assert logged_step_losses(out) == pytest.approx(logged_step_losses(one_out), abs=1e-6)
    assert len(logged_norms(out)) == 11
    assert logged_norms(out) == pytest.approx(logged_norms(one_out), rel=1e-6)
    assert summary_val_loss(out) == pytest.approx(summary_val_loss(one_out), abs=1e-6)


GPT = ["--hidden=24", "--blocks=3", "--heads=4"]


class Typo(gpt_like.SimpleModel):  # a plan written for SimpleModel's names
    tp_plan = {**gpt_like.SimpleModel.tp_plan, "blocks.*.attn.q": "colwise"}


class Unplanned(gpt_like.SimpleModel):  # the norms only: every rank would hold everything
    tp_plan = {"blocks.*.ln_1": "norm", "blocks.*.ln_2": "norm"}


class WithBatchNorm(user_model.SimpleModel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.norm = nn.BatchNorm1d(32)


class WithDropout(user_model.SimpleModel):  # a GPT-2 of Hugging Face's: p=0.1 by default
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.drop = nn.Dropout(0.1)


class WithSyncBatchNorm(WithBatchNorm):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.norm = nn.SyncBatchNorm(32)


@pytest.mark.parametrize("script, model, world, flags, message", [
    ("tp", gpt_like.SimpleModel, 2, [*GPT, "--loss-parallel"],
     "--loss-parallel: wte.weight and lm_head.weight are one tensor (tied)"),
    ("tp", Typo, 2, GPT, "Typo.tp_plan: 'blocks.*.attn.q' names no module of Typo"),
    ("tp", Unplanned, 2, GPT, "Unplanned.tp_plan cuts nothing (no colwise or rowwise layer)"),
    ("pipeline", gpt_like.SimpleModel, 2, GPT,
     "wte.weight and lm_head.weight are one tensor (tied): a pipeline holds them on two "
     "stages"),
    ("ddp", WithBatchNorm, 2, [], "WithBatchNorm.norm is a BatchNorm1d"),
    ("fsdp", WithBatchNorm, 2, [], "use nn.GroupNorm or nn.LayerNorm"),
    ("single", WithBatchNorm, 1, ["--accum-steps=2"], "WithBatchNorm.norm is a BatchNorm1d"),
    ("ddp", WithSyncBatchNorm, 1, ["--accum-steps=2"], "WithSyncBatchNorm.norm is a SyncBatchNorm"),
    ("ddp", WithDropout, 2, [], "WithDropout.drop is a Dropout(p=0.1): each rank"),
    ("single", user_model.SimpleModel, 1, ["--experts=4"], "SimpleModel has no mixture of experts"),
])
def test_what_a_script_would_train_silently_wrong_is_refused_in_one_line(
        script, model, world, flags, message, as_torchrun, monkeypatch, capsys):
    as_torchrun(world)
    monkeypatch.setattr(common, "SimpleModel", model)  # the line at the end of common.py
    refused_in_one_line(script, flags, message, capsys)


@pytest.mark.parametrize("script, model, flags", [
    ("single", WithBatchNorm, []),  # one process, the whole batch: BatchNorm is one device's
    ("single", WithDropout, []),  # one process, one draw per step: one device's
    ("ddp", WithSyncBatchNorm, []),  # synced over the ranks, no micro-batches
    ("tp", gpt_like.SimpleModel, [*GPT, "--sequence-parallel"]),  # a tie TP keeps
])
def test_what_trains_as_one_device_is_not_refused(script, model, flags, as_torchrun,
                                                  monkeypatch):
    as_torchrun(2)
    monkeypatch.setattr(common, "SimpleModel", model)
    __import__(script).parse_args(["--device=cpu", *flags])


def test_dataparallel_refuses_syncbatchnorm_which_no_group_syncs_there(monkeypatch, capsys):
    """DataParallel's replicas share no process group: SyncBatchNorm would normalize each
    replica's slice of the batch on its own, as BatchNorm does (2 GPUs, faked)."""
    import argparse
    monkeypatch.setattr(common, "SimpleModel", WithSyncBatchNorm)
    args = __import__("dataparallel").parse_args(["--device=cpu"])
    with pytest.raises(SystemExit):
        plumbing.model_check.check_model(
            argparse.ArgumentParser(prog="dataparallel.py"), args, ranks=2)
    assert "WithSyncBatchNorm.norm is a SyncBatchNorm" in capsys.readouterr().err
