"""Measure the memory ladder of docs/memory.md: DDP, ZeRO-1, FSDP (reshard false and true) and
HSDP, on 2 and 4 ranks, at a size where the training state dominates.

    python docs/memory.py          # the table, and docs/memory.png

Each configuration runs twice, launched as a user would (torchrun, OMP_NUM_THREADS=1):
  - once plain, for samples/s, the peak memory and the state each rank holds (the summary's
    `state X MiB/rank`: weights, gradients and Adam's moments, as the script counts them);
  - once with --profile, for the bytes its collectives carry: every communication event of
    rank 0's trace in the recorded steps (torch.profiler records each collective with the
    shape and type of its tensor), divided by the steps. A collective's payload is the whole
    tensor it carries; the bytes a rank sends follow from it by the ring algorithms gloo and
    NCCL use (all-reduce 2(N-1)/N x payload, all-gather and reduce-scatter (N-1)/N, broadcast
    (N-1)/N on average over its roots), and the theory column says what ZeRO's paper predicts
    for psi bytes of weights. A benchmark, not a test: nothing here asserts anything.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# 4 blocks of hidden 384, 6 heads: 7.1 M parameters, 28.5 MB of fp32 weights; Adam in fp32
# needs 16 bytes per parameter (114 MB), well above the activations of a batch of 8 sequences
# (128 tokens: ~13 x 384 x 4 bytes per token per block, ~10 MB).
SIZE = ["--hidden=384", "--blocks=4", "--heads=6", "--batch-size=8", "--steps=10",
        "--log-every=1000", "--eval-every=1000", "--device=cpu"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
CONFIGS = {  # name: (script, flags, the bytes each rank sends per step in theory, psi units)
    "DDP": ("ddp.py", [], "2(N-1)/N: the gradient's all-reduce"),
    "ZeRO-1": ("zero.py", [],
               "2(N-1)/N + (N-1)/N: the all-reduce, then every share broadcast by its owner"),
    "FSDP, reshard false": ("fsdp.py", ["--reshard-after-forward=false"],
                            "2(N-1)/N: one all-gather, one reduce-scatter"),
    "FSDP, reshard true": ("fsdp.py", [], "3(N-1)/N: two all-gathers, one reduce-scatter"),
    "HSDP 2x2": ("fsdp.py", ["--replicate=2"],
                 "3(M-1)/M in a group of M=2, + 2(R-1)/R of the 1/M shard across R=2"),
}
# the bytes one rank sends for a collective whose whole tensor is `payload` bytes, among n
# ranks (ring algorithms)
SENT = {"all_reduce": lambda p, n: 2 * (n - 1) / n * p,
        "all_gather": lambda p, n: (n - 1) / n * p,
        "reduce_scatter": lambda p, n: (n - 1) / n * p,
        # a broadcast's root sends it once, every rank but the last in the chain passes it on:
        # (n-1)/n of it per rank, on average over the roots, as every rank broadcasts its share
        "broadcast": lambda p, n: (n - 1) / n * p,
        # point to point (cp.py's ring): a send carries its tensor once; a receive sends nothing
        "send": lambda p, n: p, "recv": lambda p, n: 0.0,
        # an all-to-all (cp.py's Ulysses): a rank keeps its own 1/n piece and sends the rest
        "all_to_all": lambda p, n: (n - 1) / n * p}
# the same collectives under the names other calls record (DTensor's, all_gather_into_tensor)
ALIASES = {"all_gather_into_tensor": "all_gather", "_allgather_base": "all_gather",
           "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
           "allreduce": "all_reduce", "all_to_all_single": "all_to_all",
           "alltoall_base": "all_to_all"}
TYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2,
              "long int": 8, "int": 4}  # the count of the targets that count: an integer


def launch(n, script, flags, env):
    result = subprocess.run([*TORCHRUN, f"--nproc_per_node={n}", script, *SIZE, *flags],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode:
        raise SystemExit(f"{script} {flags} on {n} ranks failed:\n{result.stderr[-3000:]}")
    return next(l for l in result.stdout.splitlines() if l.startswith("done | "))


def communication(trace, group):
    """(payload bytes per step by collective, bytes rank 0 sends per step) from a trace: each
    gloo:<collective> / nccl:<collective> event of the recorded steps, with the shape and type
    of the tensor it was given (an all-gather is given this rank's piece: x group for the
    whole)."""
    events = [e for e in json.loads(Path(trace).read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    payload, sent = {}, 0.0
    for e in events:
        backend, _, name = e["name"].partition(":")
        name = ALIASES.get(name, name)
        if backend not in ("gloo", "nccl") or not any(
                s["ts"] <= e["ts"] < s["ts"] + s["dur"] for s in steps):
            continue
        if name not in SENT:
            raise SystemExit(f"no ring formula for collective {name!r}: add it to SENT")
        numel = 1
        for d in e["args"]["Input Dims"][0]:
            numel *= d
        size = numel * TYPE_BYTES[e["args"]["Input type"][0]] * (
            group if name == "all_gather" else 1)
        payload[name] = payload.get(name, 0) + size / len(steps)
        sent += SENT[name](size, group) / len(steps)
    return payload, sent


def main():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    psi = None
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for n in (2, 4):
            for name, (script, flags, theory) in CONFIGS.items():
                if name.startswith("HSDP") and n != 4:
                    continue
                line = launch(n, script, flags, env)
                trace = os.path.join(folder, str(n) + re.sub(r"\W+", "_", name))
                launch(n, script, [*flags, f"--profile={trace}"], env)
                group = 2 if name.startswith("HSDP") else n  # HSDP 2x2: groups of 2
                payload, sent = communication(os.path.join(trace, "trace_rank0.json"), group)
                state = float(re.search(r"state ([0-9.]+) MiB/rank", line).group(1))
                peak = float(re.search(r"peak mem ([0-9.]+) MiB", line).group(1))
                rate = float(re.search(r"\| ([0-9.]+) samples/s", line).group(1))
                if psi is None:  # DDP's state is 16 bytes per parameter: 4 of them weights
                    psi = state * 2**20 / 4
                rows.append((n, name, state, peak, sent / psi, theory, rate,
                             ", ".join(f"{k} {v / 2**20:.1f}" for k, v in payload.items())))
                print(rows[-1], flush=True)
    print(f"\npsi = {psi / 1e6:.1f} MB of fp32 weights\n")
    print("| ranks | configuration | state per rank (MiB) | peak RSS per rank (MiB) | "
          "sent per rank per step (psi) | theory (psi) | samples/s | payload per step (MiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for n, name, state, peak, sent, theory, rate, payload in rows:
        print(f"| {n} | {name} | {state:.1f} | {peak:.0f} | {sent:.2f} | {theory} | "
              f"{rate:.0f} | {payload} |")
    picture(rows, psi)


def picture(rows, psi):
    """docs/memory.png: state per rank against bytes sent per rank, one point per row."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for n, marker in ((2, "o"), (4, "s")):
        mine = [r for r in rows if r[0] == n]
        ax.scatter([r[4] for r in mine], [r[2] for r in mine], marker=marker, s=60,
                   label=f"{n} ranks")
        for r in mine:
            ax.annotate(r[1], (r[4], r[2]), textcoords="offset points", xytext=(6, 4),
                        fontsize=8)
    ax.set(xlabel=f"bytes each rank sends per step, in psi (the weights: {psi / 1e6:.1f} MB)",
           ylabel="training state per rank (MiB): weights, gradients, Adam",
           title="The memory ladder, measured (docs/memory.py, CPU, gloo)")
    ax.set_ylim(bottom=0)
    ax.set_xlim(right=max(r[4] for r in rows) + 0.6)  # room for the last label
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(REPO / "docs" / "memory.png", dpi=110)
    print("wrote docs/memory.png")


if __name__ == "__main__":
    main()
