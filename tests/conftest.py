"""Launch the scripts as users do, with a timeout, and read back what they saved."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # common.py, for the model and the data
sys.path.insert(0, str(Path(__file__).resolve().parent))  # reference.py

from common import SimpleModel  # noqa: E402

# A small job that still crosses two epoch boundaries (4096 // 1200 = 3 steps per epoch), with a
# batch that 1, 2, 3, 4 and 6 ranks (and 2 ranks x 2 or 3 micro-batches) all divide.
JOB = dict(steps=8, batch_size=1200, lr=1e-2, seed=3, hidden=32, blocks=3)
JOB_FLAGS = [f"--{k.replace('_', '-')}={v}" for k, v in JOB.items()]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                  reason=f"needs 2 GPUs, found {torch.cuda.device_count()}")


def launch(*cmd, timeout=90, env=None):
    """Run a command from the repo root. A hung collective fails the test after `timeout`
    seconds (the whole process group, workers included, is killed) instead of hanging CI."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(list(map(str, cmd)), cwd=REPO, env=full_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} still running after {timeout}s\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def python(script, *args, **kw):
    return launch(sys.executable, script, *args, **kw)


def torchrun(nproc, script, *args, **kw):
    # --standalone picks a free port, so tests never collide on torchrun's default 29500.
    return launch(sys.executable, "-m", "torch.distributed.run", "--standalone",
                  f"--nproc_per_node={nproc}", script, *args, **kw)


def ok(result):
    """Assert the command succeeded; return its stdout."""
    assert result.returncode == 0, (
        f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}")
    return result.stdout


def fails_clearly(result, *needles):
    """Assert a non-zero exit whose message names each needle (the flag and the fix)."""
    assert result.returncode != 0, f"expected failure, got exit 0\n{result.stdout}"
    for needle in needles:
        assert needle in result.stderr, f"{needle!r} not in stderr:\n{result.stderr}"


def load_saved(path, hidden=JOB["hidden"], blocks=JOB["blocks"]):
    """Load a --save file the way a user would: weights_only, strict, into a fresh SimpleModel."""
    model = SimpleModel(hidden=hidden, blocks=blocks)
    model.load_state_dict(torch.load(path, weights_only=True), strict=True)
    return model.state_dict()


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def logged_losses(stdout):
    """The loss column of the per-step log lines."""
    return [float(x) for x in re.findall(r"^step +\d+/\d+ \| loss ([0-9.e+-]+)", stdout, re.M)]


@pytest.fixture(scope="session")
def reference():
    """The oracle's final weights for JOB (computed once)."""
    from reference import reference_train
    return reference_train(**JOB)
