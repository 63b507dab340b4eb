"""plumbing/: the diagnostics find what this machine has and prove the ranks can talk; what
it decides by platform (peak memory, the store) lets every script start on macOS and Windows."""

import re
import sys
import threading
import types

import pytest
import torch

import plumbing.diagnostics
import plumbing.meter
import plumbing.ranks
from conftest import REPO, early_results, ok, run_as_only_rank, run_in_process, torchrun_cmd


def early_launches(folder):  # queued when the tests are collected (conftest.py)
    return [torchrun_cmd(2, "-m", "plumbing.diagnostics", "--device=cpu")], None


def test_environment_report_names_torch_backends_and_a_launch_command():
    report = plumbing.diagnostics.environment_report()
    assert f"torch {torch.__version__}" in report
    assert "process-group backends: gloo" in report
    assert "launch: torchrun --nproc_per_node=" in report


def test_communication_check_verifies_an_all_reduce_and_measures_bandwidth():
    """`torchrun --nproc_per_node=2 -m plumbing.diagnostics`, queued with the other launches: the
    timings measure a busy machine, and only their being there is asserted."""
    out = ok(early_results(__name__)[1][0])
    assert "all-reduce verified on 2 ranks (gloo, cpu); barrier passed" in out
    # the table's rows: four numbers (gloo's own "[Gloo] Rank 1 is connected ..." lines of two
    # ranks can interleave into a line that starts with a digit too)
    rows = [line.split() for line in out.splitlines()
            if re.fullmatch(r"\s*\d+(\s+[0-9.]+){3}\s*", line)]
    assert len(rows) == 6  # one per message size, 64 KiB .. 64 MiB
    for nbytes, us, algbw, busbw in rows:
        assert int(nbytes) > 0 and float(us) > 0 and float(algbw) > 0
        assert float(busbw) == float(algbw)  # 2(n-1)/n = 1 for two ranks


def test_peak_memory_reads_kib_on_linux_bytes_on_macos_and_nothing_on_windows(monkeypatch):
    """ru_maxrss counts KiB on Linux and bytes on macOS (1024x apart); Windows has no
    `resource` module at all. Faked: the platform and the kernel's answer."""
    peak = 300 * 2**20  # bytes, as macOS would say it
    monkeypatch.setattr(plumbing.meter, "resource", types.SimpleNamespace(
        RUSAGE_SELF=0, getrusage=lambda who: types.SimpleNamespace(ru_maxrss=peak)))
    monkeypatch.setattr(plumbing.meter.sys, "platform", "darwin")
    assert plumbing.meter.peak_rss() == "300.0 MiB (RSS)"
    monkeypatch.setattr(plumbing.meter.sys, "platform", "linux")  # the same number, read as KiB
    assert plumbing.meter.peak_rss() == f"{300 * 2**10:.1f} MiB (RSS)"
    monkeypatch.setattr(plumbing.meter, "resource", None)
    assert plumbing.meter.peak_rss() == "n/a (RSS: not measured on Windows)"


def test_no_script_imports_a_module_windows_lacks_outside_a_fallback():
    """`import resource` (or fcntl, termios, pwd, grp) at the top of a script would stop it
    from starting on Windows: only plumbing/meter.py imports one, inside try/except ImportError."""
    import ast
    unix_only = {"resource", "fcntl", "termios", "pwd", "grp"}
    for path in sorted([*REPO.glob("*.py"), *REPO.glob("plumbing/*.py")]):
        tree = ast.parse(path.read_text())
        guarded = {id(node) for t in ast.walk(tree) if isinstance(t, ast.Try)
                   for node in ast.walk(t)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in guarded:
                names = {a.name for a in node.names} if isinstance(node, ast.Import) \
                    else {node.module}
                assert not names & unix_only, f"{path.name}: import {names & unix_only}"


class Platform(types.ModuleType):
    """The `sys` plumbing/ sees, saying it runs on `platform`; everything else is the real sys."""

    def __init__(self, platform):
        super().__init__("sys")
        self.platform = platform

    def __getattr__(self, name):
        return getattr(sys, name)


@pytest.mark.parametrize("platform", ["darwin", "win32"])
@pytest.mark.parametrize("script", ["single", "dataparallel", "amp", "pipeline",
                                    "ddp", "fsdp", "tp", "cp"])
def test_every_script_starts_and_trains_a_step_where_plumbing_takes_it_for_macos_or_windows(
        script, platform, monkeypatch, tmp_path):
    """What plumbing/ decides by platform, faked for the whole run: on Windows there is no
    `resource` module and the rank's store is a TCPStore without libuv (PyTorch's Windows
    wheels lack it); on macOS the peak memory is read in bytes. The distributed scripts run as
    torchrun's only worker (the store then is rank 0's own, the one srun's ranks use)."""
    monkeypatch.setattr(plumbing.meter, "sys", Platform(platform))
    monkeypatch.setattr(plumbing.ranks, "sys", Platform(platform))
    if platform == "win32":
        monkeypatch.setattr(plumbing.meter, "resource", None)
    # The stores this run makes, in this thread: the queued launches' own (conftest's threads)
    # go through the same torch.distributed.TCPStore meanwhile
    stores, here = [], threading.get_ident()
    real_store = plumbing.ranks.dist.TCPStore
    monkeypatch.setattr(plumbing.ranks.dist, "TCPStore",
                        lambda *args, **kwargs: (threading.get_ident() == here
                                                 and stores.append(kwargs))
                        or real_store(*args, **kwargs))
    flags = ["--steps=1", *(["--dtype=fp32"] if script == "amp" else [])]
    run = run_in_process if script in ("single", "dataparallel", "amp") else run_as_only_rank
    out, weights = run(script, flags, tmp_path)
    summary = out.splitlines()[-1]
    assert summary.startswith("done | steps 1 |") and weights
    assert ("n/a (RSS: not measured on Windows)" in summary) == (platform == "win32")
    assert all(store["use_libuv"] == (platform != "win32") for store in stores)
    assert len(stores) == (run is run_as_only_rank)


@pytest.mark.parametrize("script", ["ddp", "fsdp", "tp", "cp", "pipeline"])
def test_a_torch_without_torch_distributed_is_told_in_one_line(script, monkeypatch):
    """Some builds (older macOS wheels, some Windows and conda ones) have no torch.distributed:
    the distributed scripts say so in one line, before anything starts."""
    monkeypatch.setattr(plumbing.ranks.dist, "is_available", lambda: False)
    module = __import__(script)
    with pytest.raises(SystemExit) as exit_:
        module.main(["--device=cpu", "--nproc=1"])
    assert "has no torch.distributed" in str(exit_.value) and "\n" not in str(exit_.value)
