"""common.py: the diagnostics find what this machine has and prove the ranks can talk."""

import re

import common
from conftest import early_results, ok, torchrun_cmd


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
