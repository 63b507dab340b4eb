"""Every script, run with its defaults, trains: the loss and the validation
loss fall. The flags they share have the same defaults everywhere, so the same flags give the
same numbers whichever script runs them. And the quick tier: every script, its defaults in
float64 for 20 steps, trains and ends with one device's weights."""

import functools
import importlib
import re
import shutil
import sys

import pytest
import torch

from common import SimpleModel

from conftest import (FP64_TOL, REPO, VAL_TOL, assert_norms_are_the_oracles, early_results,
                      initial_val_loss, load_saved, logged_losses, logged_step_losses,
                      logged_val_losses, max_diff, ok, summary_numbers, summary_val_loss,
                      torchrun_cmd)
from reference import reference_train, reference_val_loss

SCRIPTS = ["single", "dataparallel", "ddp", "zero", "diloco", "fsdp", "tp", "amp", "pipeline", "cp", "ep",
           "nd",
           *(f"from_scratch.{name}" for name in ("ddp", "zero", "fsdp", "tp", "pipeline"))]
# Each launched as its docstring says (`python X.py` forked by tests/preloaded.py, which has
# imported torch already), all queued with the other launches when the tests are collected.
# Model parallelism (pipeline.py --nproc 1) is proven on JOB by tests/test_pipeline.py.
# Defaults all, except --device=cpu: "auto" would pick a GPU where there is one, and a GPU
# machine must pass this suite too.
LAUNCHED = {
    "torchrun --nproc_per_node=2 ddp.py": torchrun_cmd(2, "ddp.py", "--device=cpu"),
    "python zero.py": [sys.executable, "zero.py", "--device=cpu"],  # starts 2 workers
    "python fsdp.py": [sys.executable, "fsdp.py", "--device=cpu"],  # starts 2 workers
    "python pipeline.py": [sys.executable, "pipeline.py", "--device=cpu"],  # starts 2 stages
    "python tp.py": [sys.executable, "tp.py", "--device=cpu"],  # starts 2 workers
    "python cp.py": [sys.executable, "cp.py", "--device=cpu"],  # starts 2 workers
    "python ep.py": [sys.executable, "ep.py", "--device=cpu"],  # 2 workers, 2 experts each
    "python nd.py": [sys.executable, "nd.py", "--device=cpu"],  # 4 workers: 2 (pp) x 2 (tp)
    **{f"python {script}.py": [sys.executable, f"{script}.py", "--device=cpu"]
       for script in ("single", "dataparallel", "amp")},  # one process each
    # the by-hand twins, each as its docstring's first line starts it (2 workers each)
    **{f"python from_scratch/{script}.py": [sys.executable, f"from_scratch/{script}.py",
                                            "--device=cpu"]
       for script in ("ddp", "zero", "fsdp", "tp", "pipeline")},
}


# The quick tier (python -m pytest -q -m quick tests), for a learner's first minutes: each
# script as LAUNCHED runs it, its defaults all, in float64 for 20 of its 100 steps. One launch
# per script shows both that it trains and that it is one device's training, to 1e-9: the
# oracle (tests/reference.py) trains the default model on the same 20 global batches. The
# whole suite adds the fp32 runs above, all 100 steps, and each script's proofs on odd flags.
FIRST_STEPS = ["--fp64", "--steps=20", "--eval-every=10"]
QUICK = [f"{name} --fp64" for name in LAUNCHED]


def early_launches(folder, quick=False):  # queued when the tests are collected (conftest.py)
    """LAUNCHED, then each in float64 for 20 steps (QUICK; only those under -m quick). The
    README's first command runs ddp.py copied into an empty folder with what the README says
    to copy beside it (common.py, plumbing/), as a learner takes it away."""
    copy = folder / "copy"
    copy.mkdir()
    for name in ("ddp.py", "common.py"):
        shutil.copy(REPO / name, copy / name)
    shutil.copytree(REPO / "plumbing", copy / "plumbing",
                    ignore=shutil.ignore_patterns("__pycache__"))
    readme_first = torchrun_cmd(2, copy / "ddp.py", "--device=cpu")
    commands = {name: readme_first if name == "torchrun --nproc_per_node=2 ddp.py" else cmd
                for name, cmd in LAUNCHED.items()}
    return [*([None] * len(LAUNCHED) if quick else commands.values()),
            *([*cmd, *FIRST_STEPS, f"--save={folder / f'{i}.pt'}"]
              for i, cmd in enumerate(commands.values()))], None


@pytest.fixture(scope="module")
def default_runs():
    """{name: (stdout, stderr)} of every script's default run, and of its first 20 steps in
    float64 (named "... --fp64"), with the path it saved to."""
    folder, results = early_results(__name__)
    return {name: (ok(result), result.stderr, folder / f"{i % len(LAUNCHED)}.pt")
            for i, (name, result) in enumerate(zip([*LAUNCHED, *QUICK], results))
            if result is not None}


@pytest.mark.parametrize("name", LAUNCHED)
def test_default_run_trains_loss_and_validation_loss_fall(name, default_runs):
    out, err, _ = default_runs[name]
    # gloo workers that trained correctly must not abort at exit (see ddp.py's run())
    assert "terminate called" not in err
    losses, val_losses = logged_losses(out), logged_val_losses(out)
    # From ln(32) = 3.47 (guessing) to under half of it: the copied half of every sequence,
    # which only attention can predict, is learned (common.make_dataset; the floor is 1.52).
    assert losses[-1] < 0.5 * losses[0], losses
    assert len(val_losses) == 4, val_losses  # --eval-every 25 of --steps 100
    assert val_losses[-1] < 0.5 * initial_val_loss(), val_losses
    assert val_losses == sorted(val_losses, reverse=True), val_losses  # and keeps falling
    assert summary_val_loss(out) == val_losses[-1]
    assert all(x > 0 for x in summary_numbers(out))  # samples/s, ms/step, peak memory


@pytest.mark.parametrize("name", LAUNCHED)
def test_default_run_prints_no_warning_and_no_traceback(name, default_runs):
    """A learner's first run says nothing that sounds like a bug: no Python warning (FSDP2's
    "returned a view tensor ... wrong gradients", say), no C++ one (glog's W lines), and no
    traceback, on stdout or stderr."""
    out, err, _ = default_runs[name]
    noise = [line for line in (out + err).splitlines()
             if re.search(r"Warning|Traceback|^\[?W\d{4} ", line)]
    assert not noise, noise


@pytest.mark.quick
def test_shared_flags_have_the_same_defaults_in_every_script(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    defaults = {name: vars(importlib.import_module(name).parse_args([])) for name in SCRIPTS}
    shared = set.intersection(*(set(d) for d in defaults.values()))
    assert {"steps", "batch_size", "lr", "seed", "log_every", "eval_every", "hidden",
            "blocks", "heads", "device", "save"} <= shared
    # ep.py trains a mixture by default (a dense model has no experts to spread): 4, top-2
    assert (defaults["ep"]["experts"], defaults["ep"]["top_k"]) == (4, 2)
    for key in shared - {"experts", "top_k"}:
        assert len({repr(d[key]) for d in defaults.values()}) == 1, (key, defaults)
    assert {(d["experts"], d["top_k"]) for name, d in defaults.items() if name != "ep"} == {(0, 1)}
    # amp.py's extra knob is off by default: its fp32 run is the others' run
    assert defaults["amp"]["clip"] == 0


def trained_numbers(log):
    """The step and eval lines of a log without their timings: what a machine repeats exactly."""
    return [re.sub(r" *\|? *[0-9.]+ samples/s", "", line).rstrip()
            for line in log.splitlines() if line.startswith(("step ", "eval "))]


def test_the_readme_shows_what_its_first_command_prints_on_the_cpu_and_torch_it_names(
        default_runs):
    """README's output block (`torchrun --nproc_per_node=2 ddp.py`): its losses, gradient
    norms and validation losses are what that command prints now. Checked where the README
    says it was measured (that CPU and torch); another CPU's kernels may move the last digits."""
    readme = (REPO / "README.md").read_text()
    block = re.search(r"`torchrun --nproc_per_node=2 ddp.py` ends like this.*?```\n(.*?)```",
                      readme, re.S).group(1)
    cpu, capability, version = re.search(
        r"Measured on \d+ cores of an? (.+?) \(CPU capability (\w+)\), torch (\S+?);",
        " ".join(readme.split())).groups()
    here = (open("/proc/cpuinfo").read() if sys.platform == "linux" else "",
            torch.backends.cpu.get_cpu_capability(), torch.__version__)
    if cpu not in here[0] or here[1:] != (capability, version):
        pytest.skip(f"the README's output was measured on an {cpu}, {capability}, torch "
                    f"{version}; this is {here[1]}, torch {here[2]}")
    out, _, _ = default_runs["torchrun --nproc_per_node=2 ddp.py"]
    assert trained_numbers(block) == trained_numbers(out)


@functools.lru_cache(maxsize=None)
def oracle(experts, top_k):
    """The fp64 oracle's (final weights, losses, gradient norms, validation loss) for the
    scripts' defaults (single.py's parse_args), 20 steps: `experts`, top_k for ep.py's mixture."""
    import single
    d = single.parse_args(["--device=cpu"])
    model = dict(hidden=d.hidden, blocks=d.blocks, heads=d.heads, experts=experts, top_k=top_k)
    norms = []
    _, weights, losses = reference_train(20, d.batch_size, d.lr, d.seed, fp64=True, norms=norms,
                                         **model)
    return weights, losses, norms, reference_val_loss(weights, **model), SimpleModel(**model)


@pytest.mark.quick
@pytest.mark.parametrize("name", QUICK)
def test_each_script_its_defaults_in_fp64_trains_and_equals_the_fp64_oracle(name, default_runs):
    """20 steps at lr 3e-3 from ln(32): the loss and the validation loss fall, and the weights,
    every logged loss and gradient norm and the validation loss are one device's; nothing
    warns."""
    out, err, saved = default_runs[name]
    noise = [line for line in (out + err).splitlines()
             if re.search(r"Warning|Traceback|^\[?W\d{4} ", line)]
    assert not noise, noise
    losses, val_losses = logged_losses(out), logged_val_losses(out)
    assert losses[-1] < losses[0], losses
    assert initial_val_loss() > val_losses[0] > val_losses[1], val_losses  # steps 10 and 20
    mixture = (4, 2) if "ep.py" in name else (0, 1)  # ep.py's default: 4 experts, top-2
    weights, expected_losses, norms, val_loss, model = oracle(*mixture)
    diff = max_diff(load_saved(saved, model), weights)
    assert diff < FP64_TOL, f"max weight difference {diff:.2e} from the fp64 oracle"
    assert summary_val_loss(out) == pytest.approx(val_loss, abs=VAL_TOL)
    assert_norms_are_the_oracles(out, norms, rel=1e-6)  # float64: to the digits printed
    for step, loss in logged_step_losses(out).items():
        assert loss == pytest.approx(expected_losses[step - 1], abs=1e-6), f"loss of step {step}"
