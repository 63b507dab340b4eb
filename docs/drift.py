"""Measure the tables of docs/drift.md: how far 1 rank and N ranks' arithmetic part, with the
oracle's own loop (tests/reference.py: `reference_train(ranks=N)` adds the gradient up as N
data-parallel ranks do, in the same order).

    python docs/drift.py          # both tables (about 2 minutes on 2 cores)

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


def weights(steps, batch, lr, seed, ranks, fp64, threads):
    import torch
    torch.set_num_threads(threads)
    from reference import reference_train
    return reference_train(steps, batch, lr, seed, **SIZE, ranks=ranks, fp64=fp64)[1]


def apart(job):
    """Largest weight difference between 1 rank and each of `ranks` after `steps`."""
    steps, batch, lr, seed, ranks, fp64, threads = job
    one = weights(steps, batch, lr, seed, 1, fp64, threads)
    return max(max((one[k] - w[k]).abs().max().item() for k in one)
               for w in (weights(steps, batch, lr, seed, n, fp64, threads) for n in ranks))


def main():
    import torch
    print(f"torch {torch.__version__}, {THREADS} thread per run; model: hidden 24, 3 blocks, "
          "3 heads (the tests')")
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        horizons = (1, 2, 4, 8)
        fp32 = pool.map(apart, [(s, 300, 3e-3, 0, (2, 3), False, THREADS) for s in horizons])
        print("\n| job | " + " | ".join(f"{s} step{'s' * (s > 1)}" for s in horizons) + " |")
        print("|---|" + "---|" * len(horizons))
        print("| the tests' JOB: fp32, batch 300, lr 3e-3, seed 0 (1 rank against 2 and 3) | "
              + " | ".join(f"{d:.1e}" for d in fp32) + " |")
        rows = [("0.01, batch 360", 0.01, 360, range(1, 9)),
                ("0.01, batch 180 (the tests' FP64_JOB)", 0.01, 180, range(1, 5)),
                ("0.03, batch 360", 0.03, 360, range(1, 5))]
        print("\n| lr | seeds | largest difference after 48 steps (1 rank against 2 and 3) |")
        print("|---|---|---|")
        for label, lr, batch, seeds in rows:
            found = pool.map(apart, [(48, batch, lr, s, (2, 3), True, THREADS) for s in seeds])
            cell = f"{max(found):.1e}" if lr == 0.01 else ", ".join(f"{d:.1e}" for d in found)
            print(f"| {label} | {seeds[0]} to {seeds[-1]} | {cell} |", flush=True)


if __name__ == "__main__":
    main()
