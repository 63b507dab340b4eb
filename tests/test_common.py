"""common.py: the diagnostics find what this machine has and prove the ranks can talk."""

import re

import common
from conftest import REPO, early_results, ok, torchrun_cmd


def early_launches(folder):  # queued when the tests are collected (conftest.py)
    return [torchrun_cmd(2, "common.py", "--device=cpu")], None


def test_environment_report_names_torch_backends_and_a_launch_command():
    report = common.environment_report()
    assert f"torch {common.torch.__version__}" in report
    assert "process-group backends: gloo" in report
    assert "launch: torchrun --nproc_per_node=" in report


def test_communication_check_verifies_an_all_reduce_and_measures_bandwidth():
    """`torchrun --nproc_per_node=2 common.py`, queued with the other launches: the timings
    measure a busy machine, and only their being there is asserted."""
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
    import types
    peak = 300 * 2**20  # bytes, as macOS would say it
    monkeypatch.setattr(common, "resource", types.SimpleNamespace(
        RUSAGE_SELF=0, getrusage=lambda who: types.SimpleNamespace(ru_maxrss=peak)))
    monkeypatch.setattr(common.sys, "platform", "darwin")
    assert common.peak_rss() == "300.0 MiB (RSS)"
    monkeypatch.setattr(common.sys, "platform", "linux")  # the same number, read as KiB
    assert common.peak_rss() == f"{300 * 2**10:.1f} MiB (RSS)"
    monkeypatch.setattr(common, "resource", None)
    assert common.peak_rss() == "n/a (RSS: not measured on Windows)"


def test_no_script_imports_a_module_windows_lacks_outside_a_fallback():
    """`import resource` (or fcntl, termios, pwd, grp) at the top of a script would stop it
    from starting on Windows: only common.py imports one, inside try/except ImportError."""
    import ast
    unix_only = {"resource", "fcntl", "termios", "pwd", "grp"}
    for path in sorted(REPO.glob("*.py")):
        tree = ast.parse(path.read_text())
        guarded = {id(node) for t in ast.walk(tree) if isinstance(t, ast.Try)
                   for node in ast.walk(t)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in guarded:
                names = {a.name for a in node.names} if isinstance(node, ast.Import) \
                    else {node.module}
                assert not names & unix_only, f"{path.name}: import {names & unix_only}"
