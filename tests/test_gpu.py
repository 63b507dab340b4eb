"""The GPU proof's own tests: what only a GPU can show (docs/gpu.md). The GPU run of each
script against the CPU oracle lives beside that script's CPU tests; every GPU test carries the
`gpu` mark, so `python -m pytest -q -rs tests -m gpu` runs all of them, and skips each with
its reason where there is no GPU."""

import json
import shutil
import sys

import pytest

from conftest import (COMPILE_TOL, CUDA_JOB_FLAGS, REPO, launch, launch_together, load_saved,
                      max_diff, needs_cuda, ok, python_cmd)

# Peak GPU memory shows what activation checkpointing buys only where activations dominate
# the weights and Adam's state: a wide batch through a narrow model.
MEMORY_FLAGS = [*CUDA_JOB_FLAGS, "--batch-size=2048", "--steps=4"]  # the whole dataset


def peak_allocated_mib(stdout):
    line = next(l for l in stdout.splitlines() if l.startswith("done | "))
    return float(line.split("peak mem ")[1].split(" MiB allocated")[0])


@needs_cuda
def test_compiled_and_checkpointed_gpu_runs_equal_the_oracle_and_checkpointing_saves_memory(
        reference, tmp_path):
    """single.py on the GPU: eager, --compile, --activation-checkpointing and both, each within
    COMPILE_TOL of the CPU oracle after JOB; then the same four at a batch where activations
    dominate: checkpointing lowers the peak of allocated memory, compiled or not."""
    variants = {"eager": [], "compiled": ["--compile"],
                "checkpointed": ["--activation-checkpointing"],
                "compiled, checkpointed": ["--compile", "--activation-checkpointing"]}
    job = launch_together([python_cmd("single.py", *CUDA_JOB_FLAGS, *flags,
                                      f"--save={tmp_path / f'{i}.pt'}")
                           for i, flags in enumerate(variants.values())], timeout=400)
    for i, (name, result) in enumerate(zip(variants, job)):
        ok(result)
        diff = max_diff(load_saved(tmp_path / f"{i}.pt"), reference[1])
        print(f"single.py --device cuda, {name}: {diff:.2e} from the CPU oracle")
        assert diff < COMPILE_TOL, (name, diff)
    wide = launch_together([python_cmd("single.py", *MEMORY_FLAGS, *flags)
                            for flags in variants.values()], timeout=400)
    peaks = {name: peak_allocated_mib(ok(result)) for name, result in zip(variants, wide)}
    print("peak allocated MiB at batch 2048:", peaks)
    assert peaks["checkpointed"] < peaks["eager"]
    assert peaks["compiled, checkpointed"] < peaks["compiled"]


@needs_cuda
def test_profile_on_the_gpu_records_cuda_kernels_in_every_recorded_step(tmp_path):
    ok(launch(*python_cmd("single.py", *CUDA_JOB_FLAGS, f"--profile={tmp_path}"), timeout=120))
    events = json.loads((tmp_path / "trace_rank0.json").read_text())["traceEvents"]
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")
             and e.get("cat") != "gpu_user_annotation"]  # the CPU's, not their GPU shadows
    kernels = [e for e in events if e.get("cat") == "kernel"]
    print(f"{len(kernels)} CUDA kernels recorded in {len(steps)} steps")
    assert len(steps) == 3
    assert kernels, "the trace holds no CUDA kernel: CUDA activity was not recorded"


@needs_cuda
def test_the_timeline_figure_regenerates_from_a_gpu_run(tmp_path):
    """docs/figures.py --device cuda --quick, in a copy of the repository (the committed
    pictures stay as they are), writes docs/timeline-gpu.png."""
    pytest.importorskip("matplotlib", reason="needs matplotlib: pip install -r "
                                             "docs/requirements.txt")
    copy = tmp_path / "repo"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".git", "*.png"))
    ok(launch(sys.executable, copy / "docs" / "figures.py", "--device=cuda", "--quick",
              timeout=400))
    assert (copy / "docs" / "timeline-gpu.png").stat().st_size > 0
