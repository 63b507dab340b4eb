"""Measure docs/long-sequences.md: plain TP, TP + SP, TP + SP + loss parallelism, and CP by
all-gather, by ring and by Ulysses' all-to-all, on 2 and 4 ranks, on sequences long enough
that attention dominates.

    python docs/sequences.py                  # the table (about 10 minutes on 2 cores)
    python docs/sequences.py --seq-len 512    # another length
    python docs/sequences.py --only "CP, all-gather" "CP, ring" "CP, Ulysses"   # CP's three

Each run is a script launched by torchrun *through this file*, which first lengthens the
sequences (common.SEQ_LEN, the data's period, a small held-out set: the position embedding
and the data follow) and then runs the script as `python script.py` would:

    torchrun --nproc_per_node=2 docs/sequences.py --seq-len 1024 --script cp.py --cp-method ring

and, at the end, prints rank 0's activation memory: the bytes of the tensors autograd saves
for backward in a step (torch.autograd.graph.saved_tensors_hooks; each storage once, the
weights left out; the largest step), which is what grows with the sequence. Each
configuration runs twice (OMP_NUM_THREADS=1): plain, for the step time (the summary's
ms/step) and the activations; with --profile, for the bytes rank 0 sends per step (its
trace's collectives and sends, read as docs/memory.py reads them). A benchmark, not a test.
"""

import argparse
import os
import re
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SIZE = ["--hidden=64", "--blocks=2", "--heads=4", "--batch-size=4", "--steps=8", "--lr=1e-3",
        "--log-every=1000", "--eval-every=1000", "--device=cpu"]
CONFIGS = {  # name: (script, flags)
    "TP": ("tp.py", []),
    "TP + SP": ("tp.py", ["--sequence-parallel"]),
    "TP + SP + loss parallel": ("tp.py", ["--sequence-parallel", "--loss-parallel"]),
    "CP, all-gather": ("cp.py", ["--cp-method=allgather"]),
    "CP, ring": ("cp.py", ["--cp-method=ring"]),
    "CP, Ulysses": ("cp.py", ["--cp-method=ulysses"]),
}


def lengthen(seq_len):
    """Make common's sequences seq_len tokens long, before any script imports its constants."""
    sys.path.insert(0, str(REPO))
    import common
    common.SEQ_LEN, common.PERIOD, common.VAL_SIZE = seq_len, seq_len // 2, 8


def count_activations():
    """Record, per optimizer step, the bytes autograd saved for backward (weights left out);
    return the list it fills."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    saved, steps = {}, []

    def pack(t):
        storage = local(t).untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    def before_step(optimizer, args, kwargs):
        weights = {local(p).untyped_storage().data_ptr()
                   for group in optimizer.param_groups for p in group["params"]}
        steps.append(sum(n for ptr, n in saved.items() if ptr not in weights))
        saved.clear()

    from torch.optim.optimizer import register_optimizer_step_pre_hook
    register_optimizer_step_pre_hook(before_step)
    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t).__enter__()
    return steps


def run_script(seq_len, script, argv):
    """What torchrun starts: one rank of `script`, on longer sequences."""
    lengthen(seq_len)
    steps = count_activations()
    sys.argv = [script, *argv]
    runpy.run_path(str(REPO / script), run_name="__main__")
    if os.environ.get("RANK", "0") == "0":
        print(f"activations: {max(steps) / 2**20:.1f} MiB", flush=True)


def launch(n, seq_len, script, flags):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={n}", __file__, f"--seq-len={seq_len}", "--script", script,
           *SIZE, *flags]
    result = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=1800)
    if result.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    return result.stdout


def main(seq_len, only):
    sys.path.insert(0, str(REPO / "docs"))
    from memory import communication
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for n in (1, 2, 4):
            for name, (script, flags) in CONFIGS.items():
                if n == 1 and name != "CP, all-gather" or n > 1 and only and name not in only:
                    continue  # one device: the baseline
                out = launch(n, seq_len, script, flags)
                summary = next(l for l in out.splitlines() if l.startswith("done | "))
                trace = os.path.join(folder, str(n) + re.sub(r"\W+", "_", name))
                launch(n, seq_len, script, [*flags, f"--profile={trace}"])
                payload, sent = communication(os.path.join(trace, "trace_rank0.json"), n)
                rows.append((n, name if n > 1 else "one device (cp.py, 1 rank)",
                             float(re.search(r"activations: ([0-9.]+)", out).group(1)),
                             sent / 2**20, float(re.search(r"([0-9.]+) ms/step", summary)
                                                 .group(1)),
                             ", ".join(f"{k} {v / 2**20:.1f}" for k, v in payload.items())))
                print(rows[-1], flush=True)
    print(f"\nsequence {seq_len} tokens; {' '.join(SIZE)}\n")
    print("| ranks | configuration | activations per rank (MiB) | sent per rank per step (MiB) "
          "| ms/step | payload per step (MiB) |")
    print("|---|---|---|---|---|---|")
    for n, name, activations, sent, ms, payload in rows:
        print(f"| {n} | {name} | {activations:.1f} | {sent:.1f} | {ms:.0f} | {payload} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--script", help="(what torchrun starts) run this script, one rank of it")
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), metavar="NAME",
                        help="these configurations only (and the one device)")
    known, rest = parser.parse_known_args()
    if known.script:
        run_script(known.seq_len, known.script, rest)
    else:
        main(known.seq_len, known.only)
