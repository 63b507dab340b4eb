"""Measure the tables of docs/proofs.md: every strategy against the oracle (tests/reference.py),
in fp32 on the tests' short job and in fp64 on the fp64 proof's flags, on two seeds.

    python docs/proofs.py          # some 60 launches
    python docs/proofs.py "TP 2 (4 heads)" "TP 4 (4 heads)"    # only the rows named

Each run is launched as a user would (torchrun, or `python X.py` for one process), with the
tests' flags (tests/conftest.py: JOB, and FP64_JOB with --fp64), saves its weights with --save,
and is compared with the oracle in the same precision, with the same head count. Prints the
largest weight difference and the printed validation loss beside the oracle's exact one.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]
import conftest  # noqa: E402
from reference import reference_train, reference_val_loss  # noqa: E402

ROWS = {  # label: (ranks under torchrun, or None for `python script`; script; flags)
    "single.py": (None, "single.py", []),
    "single.py --accum-steps 3": (None, "single.py", ["--accum-steps=3"]),
    "dataparallel.py --accum-steps 3 (CPU: a pass-through)": (None, "dataparallel.py",
                                                              ["--accum-steps=3"]),
    "amp.py --dtype fp32 --accum-steps 3": (None, "amp.py", ["--dtype=fp32",
                                                             "--accum-steps=3"]),
    "DDP, 2 ranks": (2, "ddp.py", []),
    "DDP, 3 ranks x --accum-steps 3": (3, "ddp.py", ["--accum-steps=3"]),
    "ZeRO-1, 4 ranks": (4, "zero.py", []),
    "FSDP, 2 ranks": (2, "fsdp.py", []),
    "FSDP, 3 ranks x --accum-steps 3": (3, "fsdp.py", ["--accum-steps=3"]),
    "HSDP 2x2, reshard false": (4, "fsdp.py", ["--replicate=2",
                                               "--reshard-after-forward=false"]),
    "TP 3 (3 heads: one each)": (3, "tp.py", []),
    "TP 2 (4 heads)": (2, "tp.py", ["--heads=4"]),
    "TP 4 (4 heads)": (4, "tp.py", ["--heads=4"]),
    "2D 2x2 x --accum-steps 3 (4 heads)": (4, "tp.py", ["--heads=4", "--tp=2",
                                                         "--accum-steps=3"]),
    "TP 2 + SP (4 heads)": (2, "tp.py", ["--heads=4", "--sequence-parallel"]),
    "TP 4 + SP (4 heads)": (4, "tp.py", ["--heads=4", "--sequence-parallel"]),
    "TP 2 + SP + loss parallel (4 heads)": (2, "tp.py", ["--heads=4", "--sequence-parallel",
                                                         "--loss-parallel"]),
    "TP 4 + SP + loss parallel (4 heads)": (4, "tp.py", ["--heads=4", "--sequence-parallel",
                                                         "--loss-parallel"]),
    "2D 2x2 + SP + loss parallel x --accum-steps 3 (4 heads)": (4, "tp.py", [
        "--heads=4", "--tp=2", "--sequence-parallel", "--loss-parallel", "--accum-steps=3"]),
    "CP 2, all-gather": (2, "cp.py", []),
    "CP 2, ring x --accum-steps 3": (2, "cp.py", ["--cp-method=ring", "--accum-steps=3"]),
    "CP 4, all-gather x --accum-steps 3": (4, "cp.py", ["--accum-steps=3"]),
    "CP 4, ring": (4, "cp.py", ["--cp-method=ring"]),
    "dp 2 x CP 2, all-gather": (4, "cp.py", ["--cp=2"]),
    "dp 2 x CP 2, ring x --accum-steps 3": (4, "cp.py", ["--cp=2", "--cp-method=ring",
                                                         "--accum-steps=3"]),
    "CP 2, Ulysses (4 heads)": (2, "cp.py", ["--cp-method=ulysses", "--heads=4"]),
    "CP 4, Ulysses x --accum-steps 3 (4 heads)": (4, "cp.py", [
        "--cp-method=ulysses", "--heads=4", "--accum-steps=3"]),
    "dp 2 x CP 2, Ulysses (4 heads)": (4, "cp.py", ["--cp=2", "--cp-method=ulysses",
                                                    "--heads=4"]),
    "pipeline GPipe, 2 stages x 4 micro-batches": (2, "pipeline.py", ["--microbatches=4"]),
    "pipeline 1F1B, 3 stages x 6 micro-batches": (3, "pipeline.py", ["--schedule=1f1b",
                                                                    "--microbatches=6"]),
    "model parallel, 3 stages in one process": (None, "pipeline.py", ["--nproc=1",
                                                                      "--stages=3"]),
    "single.py --compile --activation-checkpointing": (None, "single.py", [
        "--compile", "--activation-checkpointing"]),
}


def run(label, flags, folder):
    nproc, script, extra = ROWS[label]
    path = folder / f"{abs(hash((label, *flags)))}.pt"
    cmd = [sys.executable, script] if nproc is None else conftest.torchrun_cmd(nproc, script)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.Popen([*cmd, *conftest.JOB_FLAGS, *flags, *extra, f"--save={path}"],
                            cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE), path


def measure(flags, fp64, seed):
    """{label: (max weight difference, printed val loss, the oracle's exact one)}."""
    folder = Path(tempfile.mkdtemp())
    oracles, results = {}, {}
    batch = int(next(f for f in [*conftest.JOB_FLAGS, *flags][::-1]
                     if f.startswith("--batch-size=")).split("=")[1])

    def divides(label):  # ranks x micro-batches must divide the batch (JOB's 300: not 3 x 3)
        nproc, _, extra = ROWS[label]
        accum = next((int(f.split("=")[1]) for f in extra if f.startswith("--accum-steps=")), 1)
        return batch % ((nproc or 1) * accum) == 0

    labels = [label for label in ROWS if divides(label) and label in SHOWN]
    for i in range(0, len(labels), 2):  # two at a time: the machine has 2 cores
        started = {label: run(label, flags, folder) for label in labels[i:i + 2]}
        for label, (proc, path) in started.items():
            out, err = proc.communicate(timeout=900)
            if proc.returncode:
                raise SystemExit(f"{label} failed:\n{err[-3000:]}")
            heads = next((int(f.split("=")[1]) for f in ROWS[label][2]
                          if f.startswith("--heads=")), conftest.JOB["heads"])
            if heads not in oracles:
                job = dict(conftest.JOB, heads=heads, seed=seed,
                           **(conftest.FP64_JOB if fp64 else {}))
                weights = reference_train(**job, fp64=fp64)[1]
                exact = reference_val_loss(weights, job["hidden"], job["blocks"], heads)
                oracles[heads] = weights, exact
            weights, exact = oracles[heads]
            saved = conftest.load_saved(path)
            results[label] = (conftest.max_diff(saved, weights),
                              conftest.summary_val_loss(out), exact)
    return results


SHOWN = [label for label in ROWS if label in sys.argv[1:] or not sys.argv[1:]]


def main():
    seeds = conftest.FP64_SEEDS
    fp32 = measure([], False, conftest.JOB["seed"])
    fp64 = {s: measure(conftest.fp64(s), True, s) for s in seeds}
    print("| strategy | fp32, JOB | " + " | ".join(f"fp64, seed {s}" for s in seeds) + " |")
    print("|---|---|" + "---|" * len(seeds))
    for label in SHOWN:
        cells = [f"{r[label][0]:.1e}" if label in r else "(batch 300 / 9: n/a)"
                 for r in (fp32, *(fp64[s] for s in seeds))]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("\nprinted validation loss (exact, float64 oracle):")
    for name, results in [("fp32, JOB", fp32), *((f"fp64, seed {s}", fp64[s]) for s in seeds)]:
        printed = sorted({f"{v:.6f}" for _, v, _ in results.values()})
        exact = sorted({f"{e:.7f}" for _, _, e in results.values()})
        print(f"  {name}: printed {', '.join(printed)}; exact {', '.join(exact)}")


if __name__ == "__main__":
    main()
