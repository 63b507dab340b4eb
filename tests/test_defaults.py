"""Every script, launched with its defaults as a user would, trains: the loss and the validation
loss fall. The flags they share have the same defaults everywhere, so the same flags give the
same numbers whichever script runs them."""

import importlib

import pytest

from conftest import (initial_val_loss, launch_together, logged_losses, logged_val_losses, ok,
                      python_cmd, summary_numbers, summary_val_loss, torchrun_cmd)

SCRIPTS = ["dataparallel", "ddp", "fsdp", "amp", "pipeline"]
# The pipelined stages (torchrun pipeline.py) are proven on JOB by tests/test_pipeline.py.
DEFAULT_RUNS = {
    "torchrun --nproc_per_node=2 ddp.py": torchrun_cmd(2, "ddp.py"),  # the README's first
    "python dataparallel.py": python_cmd("dataparallel.py"),
    "python amp.py": python_cmd("amp.py"),
    "python pipeline.py": python_cmd("pipeline.py"),
    "python fsdp.py": python_cmd("fsdp.py"),  # starts 2 workers on a CPU
}


@pytest.fixture(scope="module")
def default_runs():
    return dict(zip(DEFAULT_RUNS, launch_together(DEFAULT_RUNS.values())))


@pytest.mark.parametrize("name", DEFAULT_RUNS)
def test_default_run_trains_loss_and_validation_loss_fall(name, default_runs):
    out = ok(default_runs[name])
    # gloo workers that trained correctly must not abort at exit (see ddp.py's run())
    assert "terminate called" not in default_runs[name].stderr
    losses, val_losses = logged_losses(out), logged_val_losses(out)
    assert losses[-1] < 0.1 * losses[0], losses
    assert len(val_losses) == 4, val_losses  # --eval-every 50 of --steps 200
    assert val_losses[-1] < 0.1 * initial_val_loss(), val_losses
    assert summary_val_loss(out) == val_losses[-1]
    assert all(x > 0 for x in summary_numbers(out))  # samples/s, ms/step, peak memory


def test_shared_flags_have_the_same_defaults_in_every_script(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    defaults = {name: vars(importlib.import_module(name).parse_args([])) for name in SCRIPTS}
    shared = set.intersection(*(set(d) for d in defaults.values()))
    assert {"steps", "batch_size", "lr", "seed", "log_every", "eval_every", "hidden",
            "blocks", "device", "save"} <= shared
    for key in shared:
        assert len({repr(d[key]) for d in defaults.values()}) == 1, (key, defaults)
    # amp.py's extra knob is off by default: its fp32 run is the others' run
    assert defaults["amp"]["clip"] == 0
