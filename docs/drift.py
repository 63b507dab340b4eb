"""Measure the tables of docs/drift.md: how far 1 rank and N ranks' arithmetic part, with the
oracle's own loop (tests/reference.py: `reference_train(ranks=N)` adds the gradient up as N
data-parallel ranks do, in the same order).

    python docs/drift.py          # both tables (about 3 minutes on 2 cores)

The picture of the same page (drift.png) is docs/figures.py's. A benchmark of rounding, not a
test: another CPU's kernels may move these numbers, never past the fp64 bound at lr 0.01.
"""

import multiprocessing
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

THREADS = 1  # as the tests run the oracle, and as torchrun runs each rank
SIZE = dict(hidden=24, blocks=3, heads=3)  # the tests' model (tests/conftest.py: JOB)
GELU = {}  # F.gelu itself, kept by a worker that swaps it (below)


def weights(steps, batch, lr, seed, ranks, fp64, threads, relu=False):
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    # The history column: SimpleModel's MLP (it calls F.gelu, common.py) with ReLU, as it had
    # until GELU replaced it; set on every call, since a pool's worker runs several jobs.
    GELU.setdefault("gelu", F.gelu)
    F.gelu = torch.relu if relu else GELU["gelu"]
    from reference import reference_train
    return reference_train(steps, batch, lr, seed, **SIZE, ranks=ranks, fp64=fp64)[1]


def apart(job):
    """Largest weight difference between any two of 1 rank and `ranks` after `steps`."""
    steps, batch, lr, seed, ranks, fp64, threads, *relu = job
    runs = [weights(steps, batch, lr, seed, n, fp64, threads, *relu) for n in (1, *ranks)]
    return max(max((a[k] - b[k]).abs().max().item() for k in a)
               for i, a in enumerate(runs) for b in runs[i + 1:])


def main():
    import torch
    print(f"torch {torch.__version__}, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, {THREADS} thread per run; model: hidden "
          "24, 3 blocks, 3 heads (the tests')")
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        horizons, seeds = (1, 2, 4, 8), range(12)
        print("\nThe tests' JOB (fp32, batch 300, lr 3e-3), any two of 1, 2 and 3 ranks:")
        print("\n| seed | " + " | ".join(f"{s} step{'s' * (s > 1)}" for s in horizons)
              + " | 8 steps, ReLU for GELU |")
        print("|---|" + "---|" * (len(horizons) + 1))
        for seed in seeds:
            jobs = [(s, 300, 3e-3, seed, (2, 3), False, THREADS) for s in horizons]
            found = pool.map(apart, [*jobs, (*jobs[-1], True)])
            print(f"| {seed} | " + " | ".join(f"{d:.1e}" for d in found) + " |", flush=True)
        rows = [("0.01, batch 360", 0.01, 360, range(1, 9)),
                ("0.01, batch 180 (the tests' FP64_JOB)", 0.01, 180, range(1, 5)),
                ("0.03, batch 360", 0.03, 360, range(1, 5))]
        print("\n| lr | seeds | largest difference after 48 steps (any two of 1, 2 and 3 ranks) |")
        print("|---|---|---|")
        for label, lr, batch, seeds in rows:
            found = pool.map(apart, [(48, batch, lr, s, (2, 3), True, THREADS) for s in seeds])
            cell = f"{max(found):.1e}" if lr == 0.01 else ", ".join(f"{d:.1e}" for d in found)
            print(f"| {label} | {seeds[0]} to {seeds[-1]} | {cell} |", flush=True)


if __name__ == "__main__":
    main()
