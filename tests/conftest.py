"""Launch the scripts as users do, with a timeout, and read back what they saved."""

import concurrent.futures
import contextlib
import functools
import importlib
import importlib.util
import io
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # common.py, for the model and the data
sys.path.insert(0, str(Path(__file__).resolve().parent))  # reference.py

import common  # noqa: E402
from common import SimpleModel  # noqa: E402


def free_port():
    """A TCP port that is free now on 127.0.0.1 (the OS picks it; never hard-code one). Another
    program could take it before it is bound: then that fails at once, it does not hang."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

# Two proofs, each where it holds (docs/proofs.md):
#
# fp32, what users run: JOB, a short job that still crosses an epoch boundary (2048 // 300 = 6
# steps per epoch), with a batch that 1, 2, 3, 4 and 6 ranks (and 2 ranks x 2 or 3
# micro-batches) all divide, at the scripts' defaults (lr 3e-3, seed 0), on a small
# transformer (3 blocks of width 24, 3 heads: an odd head count). fp32 holds only over a short
# horizon: Adam divides each gradient entry by its own size, so an entry made of terms that
# nearly cancel turns another summation order's last bit into a visible step (on JOB, the
# oracle's own 1-, 2- and 3-rank sums part by 2.0e-5 with 4 heads, 1.4e-6 with 3, and at most
# 9.5e-6 on twelve seeds: TOL, below; docs/drift.md). So the fp32 runs are this one job, on
# the scripts' default seed, held to TOL of the plain one-device oracle.
#
# fp64, the proof on flags nobody chose: FP64_JOB, 40 steps of batch 180 (11 steps per epoch:
# four epochs), lr 0.01 (3.3x the default), on two seeds, with odd world sizes and
# accumulation. In float64 two correct strategies agree to ~1e-13 over 48 steps (measured on
# seeds 1-8, any two of 1, 2 and 3 ranks: at most 1.7e-13 at batch 360, 4.5e-13 at FP64_JOB's
# 180 on seeds 1-4; python docs/drift.py), so FP64_TOL is over three orders of magnitude above
# rounding and a gap is a bug. (At lr 0.03 float64 parts further: 3.2e-9 on seed 2 here;
# docs/drift.md.) Any seeds prove it: FP64_SEEDS=7,8 python -m pytest -q tests runs the fp64
# proof on seeds 7, 8.
JOB = dict(steps=8, batch_size=300, lr=3e-3, seed=0, hidden=24, blocks=3, heads=3)
FP64_JOB = dict(steps=40, batch_size=180, lr=0.01)  # 180: 2, 3 and 4 ranks, x3 micro-batches
FP64_SEEDS = [int(s) for s in os.environ.get("FP64_SEEDS", "1,2").split(",")]
FP64_TOL = 1e-9
# --clip on the fp64 proof's runs that name it: below every step's gradient norm of FP64_JOB
# (measured: at least 0.11 on seeds 1-8 over 48 steps, clipped or not), so clipping acts at
# every step; each such test also checks that against the oracle's norms.
FP64_CLIP = 0.02
# Every test names its device: on a machine with GPUs, "auto" would move a CPU test there.
JOB_FLAGS = [*(f"--{k.replace('_', '-')}={v}" for k, v in JOB.items()), "--device=cpu"]
CUDA_JOB_FLAGS = [*JOB_FLAGS[:-1], "--device=cuda"]


def fp64(seed, steps=FP64_JOB["steps"], clip=None):
    """Flags that turn JOB into FP64_JOB on `seed` (they come after JOB's, and the last wins),
    clipped to `clip` if given."""
    job = dict(FP64_JOB, steps=steps, seed=seed, **({"clip": clip} if clip else {}))
    return ["--fp64", *(f"--{k.replace('_', '-')}={v}" for k, v in job.items())]


def moe(experts, top_k, accum=1):
    """The flags of a mixture of experts (and --accum-steps, which its balancing loss depends
    on), and the oracle's matching keywords (fp64_reference, assert_fp64_run_equals_...)."""
    flags = [f"--experts={experts}", f"--top-k={top_k}", f"--accum-steps={accum}"]
    return flags, dict(experts=experts, top_k=top_k, accum=accum)


@functools.lru_cache(maxsize=None)
def fp64_reference(seed, steps=FP64_JOB["steps"], clip=None, heads=JOB["heads"], experts=0,
                   top_k=1, accum=1, blocks=JOB["blocks"], data="repeat"):
    """The oracle's (initial, final weights, losses, gradient norms, and with experts the tokens
    each got, or None) for FP64_JOB on `seed`,
    in float64, clipped to `clip` if given, with `heads` heads (tensor parallelism needs a
    count its degree divides); with `experts`, the mixture of experts (top_k, and the
    load-balancing loss per micro-batch of `accum`); on --data `data`."""
    from reference import reference_train
    norms, routed = [], []
    return (*reference_train(**{**JOB, **FP64_JOB, "steps": steps, "seed": seed,
                                "heads": heads, "blocks": blocks}, fp64=True, clip=clip, norms=norms,
                             experts=experts, top_k=top_k, accum=accum, routed=routed,
                             data=common.make_dataset("train", data),
                             bos=common.BOS if data == "packed" else None), norms,
            routed[0] if routed else None)

# One rule for every strategy and device: the saved weights are within TOL of the oracle's
# (tests/reference.py: one device, one batch per step, on the CPU) after JOB. Another summation
# order (ranks, micro-batches, TP's partial sums, cuBLAS on a GPU) moves fp32's last bits, and
# Adam's update divides each gradient entry by its own size plus eps (1e-8), so an entry whose
# terms nearly cancel turns a rounding difference into a visible step. Measured on a 2-core AMD
# EPYC (AVX512), torch 2.13.0, every strategy on JOB against the one-device oracle: at most
# 2.0e-5 (TP on 4 ranks with 4 heads; the oracle's own 1- and 3-rank sums of that 4-head model
# part by as much), every 3-head run at most 2.1e-6 (docs/proofs.md, `python docs/proofs.py`):
# TOL is 5x the largest. A real mistake (a wrong sample, a missing average, a skipped sync)
# moves 1e-2 or more here, and far more than FP64_TOL in fp64 (the bug zoo, tests/test_zoo.py).
# GPU runs (TF32 off) are held to the same bound: cuBLAS sums in other orders than the CPU,
# within the same fp32 rounding, so the same amplification bounds it; `pytest -m gpu` prints
# each GPU run's figure (docs/gpu.md, which says what one GPU printed).
# SimpleModel's MLP uses GELU, not ReLU, for this: at ReLU's kink an input within rounding of 0
# lets one order pass a token's gradient through a unit and another not, and Adam carries that
# on (6.3e-4 within JOB on one CPU; docs/drift.md tells that history). Smooth GELU has no such
# switch, so every fp32 test compares with one device, not with an oracle that adds up as the
# run does.
TOL = 1e-4
GPU_TOL = TOL
# torch.compile fuses a block's ops into generated kernels, which may round in other places:
# one more summation order. Measured on JOB (CPU, inductor, torch 2.13): single.py compiled
# with activation checkpointing 2.1e-6 from the oracle (docs/proofs.md), within the eager
# strategies' spread. The CPU test proves compile in fp64 (tests/test_single.py), which says
# more; this bound is the GPU tests'.
COMPILE_TOL = TOL

# The gradient norm printed in fp32 (7 significant digits, so up to 5e-7 of rounding), against
# the oracle's: the oracle's own 1- to 4-rank sums of JOB print norms at most 1.8e-7 apart
# (relative), so NORM_RTOL leaves 20x. A norm of the wrong thing (one rank's shards, one stage's
# part) is 10% or more off. fp64 runs are held to 1e-6, the 7 digits printed.
NORM_RTOL = 1e-5

# The validation loss is printed with 6 decimals (rounding: up to 5e-7): an fp64 run prints the
# oracle's exact value to its digits. A naive average of per-rank means on 3 ranks is 5.7e-5 off
# (tests/test_ddp.py, on JOB's weights: 4.6e-5), 46x this bound.
VAL_TOL = 1e-6
# fp32 runs end up to 2.0e-5 from the oracle's weights, which could move the validation loss in
# its 6th decimal; measured on JOB, every strategy printed the exact value rounded to 6
# decimals (docs/proofs.md): 5e-6 is 10x the printing's rounding, and the naive average above
# is still 9x over it.
FP32_VAL_TOL = 5e-6

# The GPU tests: each carries the `gpu` mark, so `python -m pytest -q -rs tests -m gpu` runs
# them and nothing else (docs/gpu.md), and skips each with its reason where no GPU is.
GPUS = torch.cuda.device_count()  # read once, before any test fakes it


def needs_cuda(test):
    return pytest.mark.gpu(pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")(test))


def needs_2_gpus(test):
    return pytest.mark.gpu(pytest.mark.skipif(
        GPUS < 2, reason=f"needs 2 GPUs (NCCL: one per rank), found {GPUS}")(test))


def pytest_addoption(parser):
    parser.addoption("--matrix", action="store_true", help="also run every script on every model "
                     "of docs/models.py (tests/test_matrix.py; ~90 launches)")


MATRIX = False  # --matrix, read when pytest starts


def pytest_configure(config):
    global MATRIX
    MATRIX = config.getoption("--matrix")
    config.addinivalue_line("markers", "gpu: runs on a CUDA GPU (python -m pytest -q -rs tests "
                                       "-m gpu; docs/gpu.md)")
    config.addinivalue_line("markers", "quick: the quick tier (python -m pytest -q -m quick "
                                       "tests): each script's defaults, 20 steps in fp64, against the oracle")
    # One thread for the runs in this process, as for every launched one (OMP_NUM_THREADS=1,
    # start()): the queued launches below keep every core busy, and OpenMP's threads wait for
    # each other at every op by spinning, so two threads on a shared core stall each other:
    # measured, the in-process tests of test_amp.py took 263 s beside the queue, 8 s alone.
    torch.set_num_threads(1)
    global PRELOADED
    PRELOADED = Preloaded()  # imports torch while the tests are collected


# The environment every launch starts from: this process's, as the tests began. Not os.environ
# at the launch: the queued launches below start from other threads, at any moment, and a test
# running in this process may have set RANK, WORLD_SIZE, ... for itself (as_torchrun) just then.
ENV = dict(os.environ)


# A command that starts with CUDA_DEFAULTS runs every process of it (workers it spawns too) with
# CUDA's defaults forced on the CPU: Adam's foreach path (tests/cuda_defaults/sitecustomize.py).
# In RUNS, a flag: run_commands puts it in front of the command.
CUDA_DEFAULTS = "cuda-defaults"
CUDA_DEFAULTS_DIR = Path(__file__).resolve().parent / "cuda_defaults"


def start(*cmd, env=None, merge_stderr=False, nice=0, preloaded=True):
    """Start a command from the repo root, in a process group of its own (see finish).

    A CPU run (--device=cpu) is shown no GPU (CUDA_VISIBLE_DEVICES=""): torch takes a GPU's
    CUDA context, streams and RNG in places (DCP's writer, TorchDynamo) whenever one is
    visible, even for CPU tensors, and on a GPU machine every CPU rank of the suite would
    crowd onto GPU 0. What the scripts do where a GPU *is* visible and --device cpu is asked
    for is proven in process, with the GPU faked (tests/test_gpu_logic.py). `nice`: a lower
    priority, which the command's workers inherit. A CPU run of a script (`python X.py`, or
    ranks_cmd's ranks) is forked by tests/preloaded.py unless `preloaded` is False: it starts
    with torch imported; the result is read as from a Popen (Forked)."""
    cmd = list(map(str, cmd))
    if cmd[0] == CUDA_DEFAULTS:
        cmd = cmd[1:]
        env = {**(env or {}), "CUDA_DEFAULTS_ON_CPU": "1", "PYTHONPATH": os.pathsep.join(
            p for p in (str(CUDA_DEFAULTS_DIR), ENV.get("PYTHONPATH")) if p)}
    cpu_only = {"CUDA_VISIBLE_DEVICES": ""} if "--device=cpu" in cmd else {}
    full_env = {**ENV, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **cpu_only,
                **(env or {})}
    if cmd[0] == RANKS or (preloaded and cpu_only and cmd[0] == sys.executable
                           and cmd[1].endswith(".py")):
        proc = PRELOADED.start(cmd, full_env, merge_stderr, nice)
    else:
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                                start_new_session=True,
                                preexec_fn=(lambda: os.nice(nice)) if nice else None)
    proc.started = time.monotonic()
    return proc


@pytest.fixture
def cuda_defaults(monkeypatch):
    """CUDA_DEFAULTS for a test that runs a script in this process, undone after it."""
    spec = importlib.util.spec_from_file_location("cuda_defaults",
                                                  CUDA_DEFAULTS_DIR / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.force(monkeypatch.setattr)


RANKS = "ranks"
LAUNCH_IDS = itertools.count()
PRELOADED = None  # the Preloaded client, from pytest_configure


def ranks_cmd(nproc, script, *args):
    """`nproc` ranks of `script` on the CPU, started as torchrun starts its workers (RANK,
    WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, and its agent's store, which this process hosts),
    each forked by tests/preloaded.py. For the proofs; what torchrun itself does (its agent,
    its restarts, its reports) is proven with the real one (torchrun_cmd)."""
    assert "--device=cpu" in map(str, args), "ranks_cmd starts CPU runs only"
    return [RANKS, f"--nproc={nproc}", str(script), *args]


class Forked:
    """A command tests/preloaded.py started: what finish() and kill() use of a Popen."""

    def __init__(self, args, folder, merge_stderr, store=None):
        self.args, self.folder, self.merge_stderr = args, folder, merge_stderr
        self.store = store  # the agent's store of ranks_cmd's ranks, held until they end
        self.done = concurrent.futures.Future()  # its exit status, from the reader
        self.returncode = None

    def poll(self):
        return self.done.result() if self.done.done() else None

    def communicate(self, timeout=None):
        try:
            self.returncode = self.done.result(timeout)
        except concurrent.futures.TimeoutError:
            raise subprocess.TimeoutExpired(self.args, timeout) from None
        self.store = None
        out = (self.folder / "out").read_text(errors="replace")
        err = None if self.merge_stderr else (self.folder / "err").read_text(errors="replace")
        shutil.rmtree(self.folder, ignore_errors=True)
        return out, err


class Preloaded:
    """The client of tests/preloaded.py's server, started once, when the tests start."""

    def __init__(self):
        self.server = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("preloaded.py"))], cwd=REPO,
            env={**ENV, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        self.launches, self.lock = {}, threading.Lock()
        threading.Thread(target=self.read, daemon=True).start()

    def read(self):
        for line in self.server.stdout:
            reply = json.loads(line)
            self.launches.pop(reply["id"]).done.set_result(reply["rc"])
        for launch_ in list(self.launches.values()):  # the server died: fail, do not hang
            launch_.done.set_result(-signal.SIGKILL)

    def send(self, message):
        with self.lock:
            self.server.stdin.write(json.dumps(message).encode() + b"\n")
            self.server.stdin.flush()

    def start(self, cmd, env, merge_stderr, nice):
        folder = Path(tempfile.mkdtemp(prefix="forked-"))
        store = None
        if cmd[0] == RANKS:
            nproc, argv = int(cmd[1].removeprefix("--nproc=")), cmd[2:]
            store = torch.distributed.TCPStore("127.0.0.1", 0, nproc, is_master=True,
                                               wait_for_workers=False)
            procs = [{"argv": argv, "env": {
                **env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RESTART_COUNT": "0"}} for r in range(nproc)]
        else:
            procs = [{"argv": cmd[1:], "env": env}]
        launch_ = Forked(cmd, folder, merge_stderr, store)
        with self.lock:
            launch_.id = next(LAUNCH_IDS)
            self.launches[launch_.id] = launch_
        self.send({"id": launch_.id, "cwd": str(REPO), "out": str(folder / "out"),
                   "err": None if merge_stderr else str(folder / "err"), "nice": nice,
                   "procs": procs})
        return launch_

    def kill(self, launch_, sig="SIGKILL"):
        self.send({"kill": launch_.id, "signal": sig})

    def stop(self):
        self.server.stdin.close()  # the server kills what it started, and exits
        self.server.wait(timeout=30)


def kill(proc):
    """SIGKILL a started command and every process it started."""
    if isinstance(proc, Forked):
        PRELOADED.kill(proc)
    else:
        os.killpg(proc.pid, signal.SIGKILL)


# How long a launch may run before it counts as hung: far above any run's time, because a
# 2-core machine's speed varies: the same suite took 8 minutes on one and 26 on another, where
# a 40-step restart under torchrun went past 90 s. A real hang costs the timeout, once.
LAUNCH_TIMEOUT = 300


def finish(proc, timeout=LAUNCH_TIMEOUT):
    """Wait for a started command. A hung collective fails the test after `timeout` seconds
    (the whole process group, workers included, is killed) instead of hanging CI; a forked
    one (tests/preloaded.py) first prints each process's Python stack: where each rank was."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if isinstance(proc, Forked):
            PRELOADED.kill(proc, "SIGUSR1")
            time.sleep(2)
        kill(proc)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(proc.args)} still running after {timeout}s\n{out}\n{err}")
    if os.environ.get("LAUNCH_TIMES"):  # a file: each launch's seconds (--durations misses
        with open(os.environ["LAUNCH_TIMES"], "a") as log:  # the queued ones)
            log.write(f"{time.monotonic() - proc.started:6.1f} {' '.join(map(str, proc.args))}\n")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def launch(*cmd, timeout=LAUNCH_TIMEOUT, env=None):
    return finish(start(*cmd, env=env), timeout)


def launch_together(commands, timeout=LAUNCH_TIMEOUT + 100, env=None):
    """Run several commands at the same time; return their results in order. Independent
    runs overlap one's imports and rendezvous with another's compute: the suite stays fast."""
    procs = [start(*cmd, env=env) for cmd in commands]
    try:
        return [finish(proc, timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill(proc)


# Launches the test modules ask for early, as early_launches(folder) -> (commands, env), each
# module's fixture taking the results with early_results(its __name__). They are queued, in
# the order the modules' tests run, as soon as the tests are collected, and LAUNCH_SLOTS of
# them run at a time beside the tests that run in this process: on a 2-core machine the
# cores never wait for a test to start the next launch, and the suite ends minutes sooner.
# They run at a lower priority (nice): a test waiting in this process, or on a launch of its
# own, goes first, and the queue takes what CPU is left; otherwise ten queued workers would
# leave this process a tenth of a core and every in-process test would wait for the whole
# queue. So a queued launch may take longer than one a test starts: its timeout is longer, and
# counts from its own start, not from when the queue reaches it. How much longer depends on the
# machine: four ranks of many small collectives, niced behind busy tests, took 40 s here and
# were still short of their 20th step after 300 s on a slower CI machine.
LAUNCH_SLOTS = 3
QUEUED_TIMEOUT = 600
EARLY = {}  # module name: (folder, futures of its results, in order)
EARLY_FOLDERS = []
QUEUE = concurrent.futures.ThreadPoolExecutor(max_workers=LAUNCH_SLOTS)
# An early launch may also be a function (launch_and_kill_a_worker, say): a run that mostly
# waits (for a timeout, a restart) and needs this process to watch it. Those start at once,
# each in a thread of its own, beside the queue: their waiting overlaps the tests' compute.
WATCHERS = concurrent.futures.ThreadPoolExecutor(max_workers=4)
RUNNING = set()  # queued launches started and not yet finished, to stop at the end


def run_queued(cmd, env, timeout):
    proc = start(*cmd, env=env, nice=10)
    RUNNING.add(proc)
    try:
        return finish(proc, timeout)
    finally:
        RUNNING.discard(proc)


def pytest_collection_finish(session):
    modules = {}  # in the order their tests run
    for item in session.items:
        if getattr(item, "module", None) is not None:
            modules.setdefault(item.module.__name__, item.module)
    for module in modules.values():
        if hasattr(module, "early_launches"):
            folder = Path(tempfile.mkdtemp(prefix=f"{module.__name__}-"))
            EARLY_FOLDERS.append(folder)
            # Only quick tests chosen (-m quick): only the runs they read
            quick = all(item.get_closest_marker("quick") for item in session.items
                        if getattr(item, "module", None) is module)
            commands, env = (module.early_launches(folder, quick=True) if quick
                             else module.early_launches(folder))
            EARLY[module.__name__] = folder, [
                NOT_LAUNCHED if cmd is None else WATCHERS.submit(cmd) if callable(cmd)
                else QUEUE.submit(run_queued, cmd, env, QUEUED_TIMEOUT) for cmd in commands]


NOT_LAUNCHED = concurrent.futures.Future()  # an early launch left out (quick): its result None
NOT_LAUNCHED.set_result(None)


def pytest_sessionfinish(session):
    QUEUE.shutdown(wait=False, cancel_futures=True)  # queued, never collected (-x, say)
    WATCHERS.shutdown(wait=False, cancel_futures=True)
    for proc in list(RUNNING):
        if proc.poll() is None:
            kill(proc)
    if PRELOADED is not None:
        PRELOADED.stop()
    for folder in EARLY_FOLDERS:
        shutil.rmtree(folder, ignore_errors=True)


def early_results(module_name):
    """(folder, results in order) of the launches `module_name` asked for early."""
    folder, futures = EARLY.pop(module_name)
    return folder, [future.result() for future in futures]


def python_cmd(script, *args):
    return [sys.executable, script, *args]


def torchrun_cmd(nproc, script, *args):
    # --standalone picks a free port, so tests never collide on torchrun's default 29500.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", script, *args]


def python(script, *args, **kw):
    return launch(*python_cmd(script, *args), **kw)


def torchrun(nproc, script, *args, **kw):
    return launch(*torchrun_cmd(nproc, script, *args), **kw)


def run_commands(script, runs, folder):
    """The commands of `runs` ({name: (N, flags)}: N ranks (ranks_cmd), or N = None for
    `python script`) and the files they save to. Each run trains JOB with its flags ("{folder}"
    in a flag stands for `folder`) and saves its weights. A run (N, flags, other) runs the
    script `other` instead (a by-hand twin from from_scratch/ beside its wrapper's runs)."""
    commands, paths = [], []
    for i, (nproc, flags, *other) in enumerate(runs.values()):
        script_ = other[0] if other else script
        paths.append(folder / f"{str(script_).replace('/', '-').removesuffix('.py')}-{i}.pt")
        args = [*JOB_FLAGS, *(f.format(folder=folder) for f in flags if f != CUDA_DEFAULTS),
                f"--save={paths[-1]}"]
        commands.append([CUDA_DEFAULTS] * (CUDA_DEFAULTS in flags) + (
            python_cmd(script_, *args) if nproc is None else ranks_cmd(nproc, script_, *args)))
    return commands, paths


def early_runs(script, runs):
    """A module's early_launches for `runs` (see run_commands); its fixture takes them with
    launched_runs. Under -m quick (only the module's quick tests chosen) none is launched."""
    return lambda folder, quick=False: ([None] * len(runs) if quick
                                        else run_commands(script, runs, folder)[0], None)


def launched_runs(module_name, script, runs):
    """{name: (result, path it saved to)} of the runs early_runs(script, runs) launched."""
    folder, results = early_results(module_name)
    return dict(zip(runs, zip(results, run_commands(script, runs, folder)[1])))


def mutated(script, edits, folder, name="the mistake"):
    """A copy of `script` (a path from the repo's root) with `edits` made, as folder/<script>:
    each edit (lines of the real script, the mistake in their place), or (file, lines,
    mistake) for an edit of another file (common.py), copied beside it. Fails loudly if the
    lines an edit replaces are not in the real file exactly once: the bug zoo (tests/test_zoo.py)
    can never quietly test nothing."""
    texts = {}
    for edit in edits:
        file, old, new = edit if len(edit) == 3 else (script, *edit)
        text = texts.get(file, (REPO / file).read_text())
        assert text.count(old) == 1, (
            f"{name}: {file} no longer holds these lines exactly once; update the zoo:\n{old}")
        texts[file] = text.replace(old, new)
    texts.setdefault(script, (REPO / script).read_text())  # the script, with common.py's edits
    folder.mkdir(parents=True, exist_ok=True)
    for file, text in texts.items():  # a copied common.py is the one the copy imports
        (folder / file).parent.mkdir(parents=True, exist_ok=True)
        (folder / file).write_text(text)
    return folder / script


def run_in_process(script, flags, folder):
    """Run a single-process script's main() in this process, as `python script JOB flags` would
    but without paying seconds of torch imports for a new process; return (stdout, weights).
    `script`: a module name, or a module (a mutated copy, tests/test_zoo.py)."""
    module = importlib.import_module(script) if isinstance(script, str) else script
    path = folder / f"{abs(hash((module.__name__, *flags)))}.pt"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.main([*JOB_FLAGS, *flags, f"--save={path}"])
    return out.getvalue(), load_saved(path)


def run_as_only_rank(script, flags, folder):
    """run_in_process, as torchrun's only worker: a process group of one, in this process. The
    distributed scripts' code path (group, wrapper, collectives) without a new process."""
    world_of_one = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        with mock.patch.dict(os.environ, world_of_one):
            return run_in_process(script, flags, folder)
    finally:  # a run that failed left its group behind: the next test would find it
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def assert_checkpoints_resume_to_the_oracle(script, checkpoints, folder, seed, clip=None,
                                            heads=JOB["heads"], steps=FP64_JOB["steps"]):
    """Continue each of `checkpoints` ({(ranks, extra flags): path}, written at the end of
    FP64_JOB (or its first `steps`) on `seed`, clipped to `clip`; or {...: (path, seed, clip[,
    the oracle's model keywords])} for a run of its own) for 8 more steps, on that many ranks,
    all at once. Each must say where it resumed and end within FP64_TOL of the fp64 oracle's
    weights after as many uninterrupted steps, with its exact validation loss."""
    runs = {key: (*value, {})[:4] if isinstance(value, tuple) else (value, seed, clip, {})
            for key, value in checkpoints.items()}
    resumed = launch_together([
        ranks_cmd(nproc, script, *JOB_FLAGS, *fp64(seed_, steps + 8, clip_), *extra,
                     f"--checkpoint={path}", f"--save={folder / f'w{i}.pt'}")
        for i, ((nproc, *extra), (path, seed_, clip_, _)) in enumerate(runs.items())])
    for i, (result, (_, seed_, clip_, mixture)) in enumerate(zip(resumed, runs.values())):
        out = ok(result)
        assert "resumed from" in out and f"at step {steps}" in out
        assert_fp64_run_equals_the_fp64_oracle((out, load_saved(folder / f"w{i}.pt")), seed_,
                                               steps + 8, clip_, heads, **mixture)


def succeeded(run):
    """(stdout, saved weights) of a run from launch_runs, once it is known to have exited 0."""
    result, path = run
    return ok(result), load_saved(path)


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


def load_saved(path, model=None):
    """Load a --save file the way a user would: weights_only, strict, into a fresh model (JOB's
    SimpleModel with the file's blocks and experts, or `model`) of the file's dtype (a --fp64 file holds float64 tensors; a float32
    model would round them)."""
    weights = torch.load(path, weights_only=True)
    experts = len({key.split(".")[4] for key in weights if ".moe.experts." in key})
    blocks = len({key.split(".")[1] for key in weights if key.startswith("blocks.")})
    model = model or SimpleModel(JOB["hidden"], blocks, JOB["heads"], experts)
    model = model.to(next(iter(weights.values())).dtype)
    model.load_state_dict(weights, strict=True)
    return model.state_dict()


def assert_gpu_run_equals_oracle(result, path, reference):
    """A GPU run exited 0 and saved weights within GPU_TOL of the CPU oracle's."""
    ok(result)
    diff = max_diff(load_saved(path), reference[1])
    print(f"GPU run {' '.join(result.args[1:3])}: max weight difference {diff:.2e} from the "
          f"CPU oracle")  # the figure docs/gpu.md asks for (pytest -s shows it)
    assert diff < GPU_TOL, f"max weight difference {diff:.2e}"


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def logged_losses(stdout):
    """The loss column of the per-step log lines."""
    return list(logged_step_losses(stdout).values())


@functools.lru_cache(maxsize=None)
def fp32_reference():
    """The oracle's (initial, final weights, losses, gradient norms) for JOB in fp32: one
    device, one batch per step."""
    from reference import reference_train
    norms = []
    return (*reference_train(**JOB, norms=norms), norms)


@pytest.fixture(scope="session")
def reference():
    """fp32_reference(), for the tests that compare a run with one device."""
    return fp32_reference()


def assert_fp64_run_equals_the_fp64_oracle(run, seed, steps=FP64_JOB["steps"], clip=None,
                                           heads=JOB["heads"], **model):
    """A --fp64 run (stdout, saved weights) on `seed` (clipped to `clip`, if given): float64
    weights within FP64_TOL of the fp64 oracle's, the printed validation loss the oracle's exact
    one (to its 6 decimals), and the loss and gradient norm of every logged step the oracle's:
    every number it prints is one device's, to the digits printed. `model`: the oracle's
    model keywords where they are not JOB's (`blocks`; a mixture: conftest.moe)."""
    from reference import reference_val_loss
    out, weights = run
    _, expected, losses, norms, routed = fp64_reference(seed, steps, clip, heads, **model)
    assert all(w.dtype == torch.float64 for w in weights.values())
    diff = max_diff(weights, expected)
    print(f"fp64 run: max weight difference {diff:.2e} from the fp64 oracle")  # pytest -s
    assert diff < FP64_TOL, f"max weight difference {diff:.2e} from the fp64 oracle"
    exact = reference_val_loss(expected, JOB["hidden"], model.get("blocks", JOB["blocks"]),
                               heads, model.get("experts", 0), model.get("top_k", 1))
    assert summary_val_loss(out) == pytest.approx(exact, abs=VAL_TOL)
    assert_norms_are_the_oracles(out, norms, rel=1e-6)  # float64: to the digits printed
    for step, loss in logged_step_losses(out).items():  # 6 decimals
        assert loss == pytest.approx(losses[step - 1], abs=1e-6), f"loss of step {step}"
    if clip:
        assert min(norms) > clip  # so the clip acted at every step
    # The summary's count of the tokens each expert got over the run: one device's (a resumed
    # run counts its own steps only)
    if routed is not None and "resumed from" not in out:
        line = next(line for line in out.splitlines() if line.startswith("experts |"))
        printed = [[int(n) for n in block.split()] for block in
                   line.split(": ")[1].split(" | ")[:len(routed)]]
        assert printed == routed.round().long().tolist()


def assert_norms_are_the_oracles(stdout, norms, rel=NORM_RTOL):
    """The gradient norm printed on every logged step (7 significant digits) is the oracle's
    norm at that step to `rel`: the whole gradient's, however it is sharded."""
    logged = logged_norms(stdout)
    assert logged, "no step logged a gradient norm"
    for step, norm in logged.items():
        assert norm == pytest.approx(norms[step - 1], rel=rel), f"step {step}"


def logged_step_losses(stdout):
    """{step: the loss its log line printed}."""
    return {int(step): float(loss) for step, loss in re.findall(
        r"^step +(\d+)/\d+ \| loss ([0-9.e+-]+)", stdout, re.M)}


def logged_norms(stdout):
    """{step: the gradient norm its log line printed}."""
    return {int(step): float(norm) for step, norm in re.findall(
        r"^step +(\d+)/\d+ \| loss [^|]+\| grad norm ([0-9.e+-]+)", stdout, re.M)}


@pytest.fixture(scope="session")
def reference_val(reference):
    """The oracle's exact validation loss at the end of JOB."""
    from reference import reference_val_loss
    return reference_val_loss(reference[1], JOB["hidden"], JOB["blocks"], JOB["heads"])


def initial_val_loss(seed=0, hidden=64, blocks=4, heads=4):
    """The validation loss of the untrained model (by default, the scripts' default one)."""
    from reference import reference_val_loss
    torch.manual_seed(seed)
    return reference_val_loss(SimpleModel(hidden, blocks, heads).state_dict(), hidden, blocks,
                              heads)


def summary_val_loss(stdout):
    """The validation loss at the end of the summary line."""
    line = next(l for l in stdout.splitlines() if l.startswith("done | "))
    m = re.search(r"\| val loss ([0-9.]+)$", line)
    assert m, f"summary line does not end with the validation loss: {line}"
    return float(m.group(1))


def logged_val_losses(stdout):
    """The validation losses of the eval lines, in order."""
    return [float(x) for x in re.findall(r"^eval +\d+/\d+ \| val loss ([0-9.]+)", stdout, re.M)]


def worker_pids(launcher_pid, script):
    """PIDs of the workers a launcher started: torchrun's run `script`; `python X.py`'s are
    forked by its forkserver (a child of the launcher), or are spawn's spawn_main."""
    processes = []  # (pid, parent's pid, command line)
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                processes.append((int(entry), ppid, f.read()))
        except OSError:  # the process ended while we looked
            continue
    servers = {pid for pid, ppid, cmdline in processes
               if ppid == launcher_pid and b"forkserver" in cmdline}
    return sorted(pid for pid, ppid, cmdline in processes if pid not in servers
                  and (ppid in servers or ppid == launcher_pid
                       and (script.encode() in cmdline or b"spawn_main" in cmdline)))


def launch_and_kill_a_worker(*cmd, script, when, timeout=LAUNCH_TIMEOUT):
    """Start `cmd`; once a line of its output contains `when`, SIGKILL its last worker.
    Return (CompletedProcess with stdout and stderr together, seconds from kill to exit)."""
    proc = start(*cmd, merge_stderr=True, preloaded=False)  # a Popen: its stdout, its children
    lines, killed_at = [], None
    deadline = time.monotonic() + timeout
    try:
        for line in proc.stdout:  # ends when the launcher exits
            lines.append(line)
            if killed_at is None and when in line:
                victims = worker_pids(proc.pid, script)
                assert victims, "no worker process found"
                os.kill(victims[-1], signal.SIGKILL)
                killed_at = time.monotonic()
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(cmd, timeout)
        proc.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"still running after {timeout}s:\n{''.join(lines)}")
    assert killed_at is not None, f"never saw {when!r}:\n{''.join(lines)}"
    out = "".join(lines)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, out), time.monotonic() - killed_at


def refused_in_one_line(script, flags, message, capsys):
    """parse_args of `script` (imported, not launched) exits 2 with exactly one error line,
    which contains `message`. Bad flags are refused before any process or group starts.
    On the CPU unless `flags` names another --device (the later flag wins)."""
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(script).parse_args(["--device=cpu", *flags])
    assert exit_.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], errors


@pytest.fixture
def fake_world(monkeypatch):
    """A process group of `ranks` in this process, seen from `rank`, whose collectives do
    nothing (torch's test backend), its ranks `per_machine` to a machine as torchrun numbers
    them (nd.py's mesh)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def world(ranks, rank=0, per_machine=None):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_machine or ranks))
        torch.distributed.init_process_group("fake", store=FakeStore(), rank=rank,
                                             world_size=ranks)
    yield world
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture
def world_of_8(fake_world):
    """fake_world of 8 ranks, seen from rank 0, `per_machine` to a machine."""
    return lambda per_machine: fake_world(8, per_machine=per_machine)


@pytest.fixture
def as_torchrun(monkeypatch):
    """The environment torchrun gives each worker of a job with `n` ranks on this machine."""
    def set_world(n):
        for var, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(n),
                           "LOCAL_WORLD_SIZE": str(n)}.items():
            monkeypatch.setenv(var, value)
    return set_world


def summary_numbers(stdout):
    """The numbers of the final summary line: samples/s, ms/step, peak MiB (and TFLOP/s)."""
    line = next(l for l in stdout.splitlines() if l.startswith("done | "))
    m = re.search(r"\| ([0-9.]+) samples/s \| ([0-9.]+) ms/step \| peak mem ([0-9.]+) MiB", line)
    assert m, f"summary line has the wrong format: {line}"
    return [float(x) for x in m.groups()]


def assert_profiled(folder, ranks, *needles):
    """`--profile folder` wrote one Chrome trace per rank (JSON, as Perfetto reads it), and
    each of its recorded steps (ProfilerStep#N, 3 of them) holds an event named by every
    needle: a name, or a tuple of names of which one will do (gloo has no reduce-scatter)."""
    assert sorted(p.name for p in folder.iterdir()) == [f"trace_rank{r}.json" for r in
                                                         range(ranks)]
    for rank in range(ranks):
        events = [e for e in json.loads((folder / f"trace_rank{rank}.json").read_text())[
            "traceEvents"] if e.get("ph") == "X"]
        steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
        assert len(steps) == 3, [e["name"] for e in steps]
        for step in steps:
            names = {e["name"] for e in events
                     if step["ts"] <= e["ts"] < step["ts"] + step["dur"]}
            for needle in needles:
                alternatives = needle if isinstance(needle, tuple) else (needle,)
                assert names & set(alternatives), (rank, step["name"], needle)
