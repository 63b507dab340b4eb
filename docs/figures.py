"""Make the README's pictures from real runs of the scripts: nothing here is drawn by hand.

    pip install -r docs/requirements.txt
    python docs/figures.py            # every figure into docs/ (some 120 runs: the longest here)
    python docs/figures.py --quick    # the same figures from shorter runs (what CI checks)

proof.png      training and validation loss against step for every strategy on the tests' job,
               and the largest weight difference from the one-device run against step, in
               fp32 and with --fp64 (where it stays at rounding, ~1e-15).
drift.png      1 rank against 2 ranks over a long run, several seeds: where rounding stays,
               and where Adam amplifies it (docs/drift.md); in fp32 and in fp64.
timeline.png   one training step of every rank, from `--profile` traces: compute and
               communication in their own colours (DDP, DDP by hand, FSDP, pipeline GPipe
               and 1F1B).
pipeline.png   every schedule of pipeline.py on 2 ranks, one step per rank, and its idle share
               (the bubble) measured from the trace beside the theory's.
experts.png    the tokens each expert of a mixture (4 experts, top-2) receives over training, with
               and without the load-balancing loss (--balance), from the summary line of a
               chain of runs, each resuming the last one's checkpoint.
timeline-gpu.png   the same from this machine's GPUs (python docs/figures.py --device cuda;
               on one GPU: 2 DDP ranks sharing it over gloo, FSDP on 1 rank, model
               parallelism); the GPU tests regenerate it (docs/gpu.md).

Each run is launched as a user would (python X.py / torchrun), with OMP_NUM_THREADS=1.
"""

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
from common import SimpleModel, loss_fn, make_dataset  # noqa: E402

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
# label: (launcher prefix, script, flags): every strategy, on the defaults of the scripts
STRATEGIES = {
    "one device (single.py)": ([sys.executable], "single.py", []),
    "DataParallel": ([sys.executable], "dataparallel.py", []),
    "DDP, 2 ranks": ([*TORCHRUN, "--nproc_per_node=2"], "ddp.py", []),
    "DDP, 4 ranks": ([*TORCHRUN, "--nproc_per_node=4"], "ddp.py", []),
    "FSDP, 2 ranks": ([*TORCHRUN, "--nproc_per_node=2"], "fsdp.py", []),
    "pipeline GPipe, 2 stages": ([*TORCHRUN, "--nproc_per_node=2"], "pipeline.py",
                                 ["--schedule=gpipe"]),
    "pipeline 1F1B, 2 stages": ([*TORCHRUN, "--nproc_per_node=2"], "pipeline.py",
                                ["--schedule=1f1b"]),
    "TP, 3 ranks (a head each)": ([*TORCHRUN, "--nproc_per_node=3"], "tp.py", []),
    # (sequence and loss parallelism cut the 16 positions and the 32 logits: no degree that
    # also divides the job's 3 heads; docs/proofs.md has them on jobs of 2 and 4 heads)
    "CP, 2 ranks (ring attention)": ([*TORCHRUN, "--nproc_per_node=2"], "cp.py",
                                     ["--cp-method=ring"]),
    "AMP bf16": ([sys.executable], "amp.py", ["--dtype=bf16"]),
}


def launch(prefix, script, flags, device="cpu"):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run([*prefix, script, f"--device={device}", *flags], cwd=REPO, env=env,
                            text=True, capture_output=True, timeout=900)
    if result.returncode:
        raise SystemExit(f"{script} {' '.join(flags)} failed:\n{result.stderr[-3000:]}")
    return result.stdout


def weights(path):
    return torch.load(path, weights_only=True)


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


# The tests' fp32 job (tests/conftest.py's JOB): batch 300, the scripts' default lr and seed.
JOB = ["--batch-size=300", "--lr=0.003", "--seed=0", "--hidden=24", "--blocks=3", "--heads=3"]


def proof(steps, checkpoints, folder):
    """Loss curves of every strategy over `steps` of the tests' job, and the weight difference
    from one device after each of `checkpoints` steps (a run of that many steps, saved), in
    fp32 and with --fp64 (every strategy but AMP in bf16, which refuses it)."""
    curves, diffs, diffs64 = {}, {}, {}
    for label, (prefix, script, flags) in STRATEGIES.items():
        for precision in ([""] if script == "amp.py" else ["", "--fp64"]):
            for n in checkpoints:
                out = launch(prefix, script, [
                    *JOB, *flags, *filter(None, [precision]), f"--steps={n}", "--log-every=1",
                    f"--eval-every={max(1, steps // 20)}",
                    f"--save={folder}/{script}{len(flags)}{precision}{n}.pt"])
                if n == steps and not precision:
                    losses = [(int(s), float(x)) for s, x in re.findall(
                        r"^step +(\d+)/\d+ \| loss ([0-9.]+)", out, re.M)]
                    val = [(int(s), float(x)) for s, x in re.findall(
                        r"^eval +(\d+)/\d+ \| val loss ([0-9.]+)", out, re.M)]
                    curves[label] = losses, val
        print(f"proof: {label} done", flush=True)
    one = "one device (single.py)"
    for label, (prefix, script, flags) in STRATEGIES.items():
        if label != one:
            diffs[label] = [max_diff(weights(f"{folder}/{script}{len(flags)}{n}.pt"),
                                     weights(f"{folder}/single.py0{n}.pt")) for n in checkpoints]
            if script != "amp.py":
                diffs64[label] = [max_diff(weights(f"{folder}/{script}{len(flags)}--fp64{n}.pt"),
                                           weights(f"{folder}/single.py0--fp64{n}.pt"))
                                  for n in checkpoints]

    fig, (ax_loss, ax_diff) = plt.subplots(1, 2, figsize=(12, 4.6))
    colors = plt.cm.tab10.colors + plt.cm.Dark2.colors  # 18: a colour per strategy
    for (label, (losses, val)), color in zip(curves.items(), colors):
        ax_loss.plot(*zip(*losses), color=color, lw=1, alpha=0.8, label=label)
        ax_loss.plot(*zip(*val), color=color, lw=2.2, ls="--")
    ax_loss.set(xlabel="optimizer step", ylabel="cross-entropy per token", yscale="linear",
                title="Every strategy trains the same run\n(solid: training loss of the step's "
                      "batch; dashed: validation loss)")
    ax_loss.legend(fontsize=7, ncol=2)
    floor = 1e-17  # where a difference of exactly 0 is drawn
    for (label, d), color in zip(diffs.items(), colors[1:]):
        ax_diff.plot(checkpoints, [max(v, floor) for v in d], marker="o", color=color,
                     label=label)
        if label in diffs64:  # the same run with --fp64, against single.py --fp64
            ax_diff.plot(checkpoints, [max(v, floor) for v in diffs64[label]], marker=".",
                         ls="--", lw=1, color=color)
    for bound, text in ((1e-4, "fp32 tests' bound (the short job)"),
                        (1e-9, "fp64 tests' bound (40 steps, lr 0.01)")):
        ax_diff.axhline(bound, color="gray", ls=":", lw=1)
        ax_diff.text(checkpoints[0], bound * 1.5, text, fontsize=7, color="gray")
    ax_diff.set(xlabel="optimizer step", ylabel=f"max |weight - one device's| (0 drawn at "
                                                f"{floor:.0e})",
                xscale="log", yscale="log", ylim=(floor / 2, 1),
                title="Weights: fp32 (solid) parts as rounding grows; --fp64 (dashed)\n"
                      "stays at float64's rounding (bf16 rounds every matmul)")
    ax_diff.legend(fontsize=7, ncol=3, loc="center", bbox_to_anchor=(0.5, 0.37))  # no curve here
    fig.suptitle(f"{len(STRATEGIES)} strategies on the tests' job (batch 300 crossing an epoch, "
                 f"Adam lr 3e-3, SimpleModel hidden 24 x 3 blocks, 3 heads), {cpu_name()}, torch "
                 f"{torch.__version__}", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "proof.png"), dpi=110)
    return ({label: d[-1] for label, d in diffs.items()},
            {label: d[-1] for label, d in diffs64.items()})


def drift(steps, seeds, batch=28, lr=0.01):
    """1 rank against 2 ranks, step by step: the same arithmetic as ddp.py (2 ranks: the mean
    of two per-rank mean gradients over every other sample, which tests/test_ddp_failures.py
    proves bit-identical to `torchrun --nproc_per_node=2 ddp.py`), in fp32 and in fp64 (the
    same initial weights and data, cast, as --fp64 does)."""
    fig, ax = plt.subplots(figsize=(8, 4.6))
    finals = {}
    colors = plt.cm.tab10.colors
    for (seed, dtype), color in zip([(s, d) for s in seeds for d in (torch.float32,
                                                                      torch.float64)],
                                    [c for c in colors[:len(seeds)] for _ in range(2)]):
        x, y = make_dataset().tensors
        torch.manual_seed(seed)
        one = SimpleModel().to(dtype)
        two = SimpleModel().to(dtype)
        two.load_state_dict(one.state_dict())
        opts = [torch.optim.Adam(m.parameters(), lr=lr) for m in (one, two)]
        per_epoch, diffs = len(x) // batch, []
        for step in range(steps):
            epoch, k = divmod(step, per_epoch)
            if k == 0:
                order = torch.randperm(len(x), generator=torch.Generator().manual_seed(
                    seed + epoch))
            b = order[k * batch:(k + 1) * batch]
            for opt in opts:
                opt.zero_grad()
            loss_fn(one(x[b]), y[b]).backward()
            grads = [torch.autograd.grad(loss_fn(two(x[b[r::2]]), y[b[r::2]]),
                                         list(two.parameters())) for r in range(2)]
            for p, g0, g1 in zip(two.parameters(), *grads):
                p.grad = g0 / 2 + g1 / 2
            for opt in opts:
                opt.step()
            diffs.append(max((p - q).abs().max().item()
                             for p, q in zip(one.parameters(), two.parameters())))
        fp64 = dtype == torch.float64
        finals[seed, "fp64" if fp64 else "fp32"] = diffs
        ax.plot(range(1, steps + 1), [max(d, 1e-17) for d in diffs], lw=1, color=color,
                ls="--" if fp64 else "-", label=f"seed {seed}{', fp64' if fp64 else ''}")
    ax.axhline(1e-4, color="gray", ls=":", lw=1)
    ax.axhline(1e-9, color="gray", ls=":", lw=1)
    ax.set(xlabel="optimizer step", ylabel="max |weight, 1 rank - weight, 2 ranks|",
           yscale="log", ylim=(1e-17, 1),
           title=f"1 rank against 2 ranks: the same math, another summation order\n"
                 f"(ddp.py's arithmetic, batch {batch}, Adam lr {lr}; solid: fp32, dashed: fp64)\n"
                 f"{cpu_name()}, torch {torch.__version__}")
    ax.legend(fontsize=7, ncol=2, loc="center right")
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "drift.png"), dpi=110)
    return finals


def trace_rows(folder):
    """Per rank: (name, start, duration, kind) of one recorded step, times relative to it."""
    rows = {}
    for name in sorted(os.listdir(folder)):
        rank = int(re.search(r"rank(\d+)", name).group(1))
        with open(os.path.join(folder, name)) as f:
            # The host's events only: a GPU run's trace also holds its kernels and the GPU's
            # shadows of the marks (cat "kernel", "gpu_user_annotation", "gpu_memcpy"...).
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"
                      and not e.get("cat", "").startswith(("kernel", "gpu_"))]
        steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")),
                       key=lambda e: e["ts"])
        step = steps[len(steps) // 2]  # the middle recorded step
        t0, t1 = step["ts"], step["ts"] + step["dur"]
        spans = []
        for e in events:
            if not t0 <= e["ts"] < t1:
                continue
            kind = event_kind(e["name"])
            if kind:
                spans.append((e["name"], (e["ts"] - t0) / 1e3, e["dur"] / 1e3, kind))
        rows[rank] = (spans, step["dur"] / 1e3)
    return rows


def event_kind(name):
    """What an event of the trace is, for the picture: the scripts' own marks (forward,
    backward, optimizer step), the pipeline schedules' (Forward i, Backward i; 1F1B marks none,
    so its layers' ops stand in: aten::linear in forward, autograd's functions in backward),
    and the collectives (gloo:..., nccl:...)."""
    if name.startswith(("gloo:", "nccl:")):
        return "communication"
    if name == "optimizer step":
        return "optimizer"
    if name in ("forward", "aten::linear") or re.fullmatch(r"Forward \d+|PP:\d+F\d+", name):
        return "forward"
    if re.fullmatch(r"PP:\d+W\d+", name):  # a zero-bubble schedule's weights' gradient
        return "weights"
    if name == "backward" or re.fullmatch(r"Backward \d+|PP:\d+[BI]\d+", name) or name.startswith(
            "autograd::engine::evaluate_function"):
        return "backward"
    return None


def timelines(folder, batch, device="cpu"):
    runs = {
        "DDP, 2 ranks": ([*TORCHRUN, "--nproc_per_node=2"], "ddp.py", []),
        # its twin (docs/from_scratch.md), in buckets of 1 MB: each all-reduce inside backward
        "DDP by hand, 2 ranks, buckets of 1 MB": ([*TORCHRUN, "--nproc_per_node=2"],
                                                  "from_scratch/ddp.py", ["--bucket-cap-mb=1"]),
        "FSDP, 2 ranks": ([*TORCHRUN, "--nproc_per_node=2"], "fsdp.py", []),
        "pipeline GPipe, 2 stages, 4 micro-batches": ([*TORCHRUN, "--nproc_per_node=2"],
                                                      "pipeline.py", ["--schedule=gpipe"]),
        "pipeline 1F1B, 2 stages, 4 micro-batches": ([*TORCHRUN, "--nproc_per_node=2"],
                                                     "pipeline.py", ["--schedule=1f1b"]),
    }
    if device == "cuda" and torch.cuda.device_count() < 2:
        # One GPU: NCCL needs a GPU per rank, so two DDP ranks share it over gloo, and FSDP and
        # the pipeline run as one process.
        runs = {"DDP, 2 ranks sharing 1 GPU (gloo)": runs["DDP, 2 ranks"],
                "FSDP, 1 rank": ([*TORCHRUN, "--nproc_per_node=1"], "fsdp.py", []),
                "model parallel, 2 stages in 1 process": ([sys.executable], "pipeline.py", [])}
    colors = {"forward": "#4c72b0", "backward": "#55a868", "optimizer": "#8172b2",
              "communication": "#dd8452"}
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.5 + 1.3 * len(runs)))
    for ax, (label, (prefix, script, flags)) in zip(axes, runs.items()):
        out = os.path.join(folder, re.sub(r"\W+", "_", label))
        launch(prefix, script, [*flags, "--steps=8", f"--batch-size={batch}",
                                "--hidden=256", f"--profile={out}"], device)
        rows = trace_rows(out)
        for rank, (spans, _) in rows.items():
            for kind in ("forward", "backward", "optimizer", "communication"):
                bars = [(start, dur) for _, start, dur, k in spans if k == kind]
                height = 0.35 if kind == "communication" else 0.7
                ax.broken_barh(bars, (rank - height / 2, height), color=colors[kind])
        ax.set_yticks(list(rows), [f"rank {r}" for r in rows])
        ax.invert_yaxis()
        ax.set_title(f"{label}: one step (ms)", fontsize=9, loc="left")
        ax.set_xlim(0, max(total for _, total in rows.values()))
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    axes[-1].set_xlabel("milliseconds since the start of the step")
    where = f"{cpu_name()}, gloo" if device == "cpu" else \
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    fig.suptitle(f"Where a step's time goes, per rank (torch.profiler, --profile; batch {batch}, "
                 f"hidden 256; {where})\ncommunication includes waiting for the "
                 "peer: in a pipeline, the bubble", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.legend(handles, list(colors), fontsize=8, ncol=4, loc="upper center",
               bbox_to_anchor=(0.5, 0.935))
    fig.savefig(os.path.join(HERE, "timeline.png" if device == "cpu" else "timeline-gpu.png"),
                dpi=110)


SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev"]


def idle(path):
    """A rank's idle share of the pipelined part of its recorded steps (each from its start to
    its "optimizer step"), averaged: the time its main thread ran no operator. gloo's
    send/recv events are left out: they span the transfer, done by gloo's own threads."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    shares = []
    for step in (e for e in events if e["name"].startswith("ProfilerStep#")):
        end = next(e["ts"] for e in events if e["name"] == "optimizer step"
                   and step["ts"] <= e["ts"] < step["ts"] + step["dur"])
        ops = sorted((e["ts"], min(e["ts"] + e["dur"], end)) for e in events
                     if e.get("cat") == "cpu_op" and e["tid"] == step["tid"]
                     and not e["name"].startswith("gloo:") and step["ts"] <= e["ts"] < end)
        busy, reach = 0.0, step["ts"]
        for start, stop in ops:  # the union of the intervals
            busy += max(0.0, stop - max(start, reach))
            reach = max(reach, stop)
        shares.append(1 - busy / (end - step["ts"]))
    return sum(shares) / len(shares)


def schedules(folder, microbatches, batch):
    """pipeline.py's schedules on 2 ranks (4 blocks: 1 stage per rank for gpipe and 1f1b,
    else 2), --profile'd: each rank's middle step as a timeline, and its idle share beside
    the theory's (p - 1) / (v m + p - 1), for p ranks, v stages per rank, m micro-batches."""
    fig, axes = plt.subplots(len(SCHEDULES), 1, figsize=(11, 1.2 + 1.25 * len(SCHEDULES)))
    colors = {"forward": "#4c72b0", "backward": "#55a868", "weights": "#c44e52"}
    measured = {}
    for ax, schedule in zip(axes, SCHEDULES):
        out = os.path.join(folder, f"schedule-{schedule}")
        launch([*TORCHRUN, "--nproc_per_node=2"], "pipeline.py", [
            f"--schedule={schedule}", f"--microbatches={microbatches}", "--steps=8",
            f"--batch-size={batch}", "--hidden=256", f"--profile={out}"])
        v = 1 if schedule in ("gpipe", "1f1b") else 2
        theory = 1 / (v * microbatches + 1) if v == 1 or schedule == "interleaved-1f1b" else None
        measured[schedule] = ([idle(os.path.join(out, f"trace_rank{r}.json")) for r in (0, 1)],
                              theory)
        rows = trace_rows(out)
        for rank, (spans, _) in rows.items():
            for kind, color in colors.items():
                bars = [(start, dur) for _, start, dur, k in spans if k == kind]
                ax.broken_barh(bars, (rank - 0.35, 0.7), color=color)
        ax.set_yticks(list(rows), [f"rank {r}" for r in rows])
        ax.invert_yaxis()
        ax.set_xlim(0, max(total for _, total in rows.values()))
        shares = ", ".join(f"rank {r} {share:.0%}" for r, share in enumerate(measured[schedule][0]))
        ax.set_title(f"{schedule} ({v} stage{'s' * (v > 1)} per rank). Idle, of the pipelined "
                     f"part: {shares}" + (f"; theory {theory:.0%}" if theory else ""),
                     fontsize=9, loc="left")
    axes[-1].set_xlabel("milliseconds since the start of the step (the optimizer step last)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, ["forward", "backward (the inputs' gradient, in zero-bubble ones)",
                         "the weights' gradient (zero-bubble)"], fontsize=8, ncol=3,
               loc="upper center", bbox_to_anchor=(0.5, 0.955))
    fig.suptitle(f"pipeline.py's schedules, 2 ranks, {microbatches} micro-batches of "
                 f"{batch // microbatches}, hidden 256, 4 blocks (torch.profiler, --profile; "
                 f"{cpu_name()}, gloo, torch {torch.__version__})", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(os.path.join(HERE, "pipeline.png"), dpi=110)
    return measured


def experts(steps, every, folder, coefficients=(0.0, 0.01, 0.1)):
    """single.py --experts 4 --top-k 2 (ep.py's default mixture; ep.py's counts are its own,
    token for token: tests/test_ep.py) for `steps`, in a chain of runs of `every` steps, each
    resuming the last one's --checkpoint: a resumed run's summary counts the tokens its own
    steps routed, so each link gives one interval's load. Per --balance coefficient, each
    link's (blocks, experts) counts; the coefficients run two at a time."""
    def chain(coefficient):
        counts, ckpt = [], os.path.join(folder, f"experts{coefficient}.pt")
        for end in range(every, steps + 1, every):
            out = launch([sys.executable], "single.py", [
                "--experts=4", "--top-k=2", f"--balance={coefficient}", f"--steps={end}",
                f"--checkpoint={ckpt}", "--log-every=1000", "--eval-every=1000"])
            line = next(x for x in out.splitlines() if x.startswith("experts |"))
            counts.append([[int(n) for n in block.split()]
                           for block in line.split(": ")[1].split(" | ")[:-1]])
        return torch.tensor(counts, dtype=torch.float64)  # (links, blocks, experts)

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as pool:
        loads = dict(zip(coefficients, pool.map(chain, coefficients)))
    ends = list(range(every, steps + 1, every))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for coefficient, counts in loads.items():
        busiest = (counts.max(-1).values / counts.mean(-1)).max(-1).values
        label = f"--balance {coefficient:g}" + (" (the default)" if coefficient == 0.01 else "")
        left.plot(ends, busiest, marker="o", label=label)
    left.axhline(1, color="gray", lw=0.8)
    left.set(xlabel="step", ylabel="busiest expert / mean (the worst block)",
             title=f"Load per {every} steps: 1 is even; 2, one expert in every top 2")
    left.legend(fontsize=8)
    block = 3  # the last block, where the load drifts furthest here
    for coefficient, style in ((coefficients[0], "-"), (coefficients[-1], "--")):
        shares = loads[coefficient][:, block] / loads[coefficient][:, block].sum(-1, keepdim=True)
        for e in range(shares.shape[-1]):
            right.plot(ends, shares[:, e], style, color=f"C{e}",
                       label=f"expert {e}" if style == "-" else None)
    right.axhline(0.25, color="gray", lw=0.8)
    right.set(xlabel="step", ylabel="share of the block's token slots",
              title=f"Block {block}: each expert's share; solid --balance {coefficients[0]:g}, "
                    f"dashed {coefficients[-1]:g}")
    right.set_ylim(0.1, None)  # room for the legend below the lines
    right.legend(fontsize=7, ncol=4, loc="lower center")
    fig.suptitle("Tokens per expert over training: single.py --experts 4 --top-k 2 (hidden 64, "
                 f"4 blocks, batch 64, lr 0.003); {cpu_name()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "experts.png"), dpi=110)
    return {c: (counts.max(-1).values / counts.mean(-1)).max(-1).values.tolist()
            for c, counts in loads.items()}


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            name = re.search(r"model name\s*: (.*)", f.read()).group(1).strip()
    except (OSError, AttributeError):
        name = platform.processor() or platform.machine()
    return f"{name}, {os.cpu_count()} cores"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="shorter runs (what CI checks): the same figures, less history")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: only the timeline, from runs on this machine's GPUs, into "
                             "docs/timeline-gpu.png (the other figures are the CPU's proofs)")
    args = parser.parse_args()
    if args.device == "cuda":
        with tempfile.TemporaryDirectory() as folder:
            timelines(folder, batch=64 if args.quick else 256, device="cuda")
        print("wrote", os.path.join("docs", "timeline-gpu.png"))
        return
    with tempfile.TemporaryDirectory() as folder:
        if args.quick:
            proof_finals, proof_finals64 = proof(8, [1, 8], folder)  # 8: the tests' horizon
            drift_finals = drift(60, [0, 1])
            timelines(folder, batch=16)
            loads = experts(100, 50, folder)
            bubbles = schedules(folder, 4, 16)
        else:
            proof_finals, proof_finals64 = proof(64, [1, 4, 16, 64], folder)
            drift_finals = drift(1000, [0, 1, 2, 3])
            timelines(folder, batch=64)
            loads = experts(400, 25, folder)
            bubbles = schedules(folder, 8, 128)
    print("max weight difference from one device at the last step:")
    for label, d in proof_finals.items():
        print(f"  {label}: {d:.1e}" + (f", with --fp64 {proof_finals64[label]:.1e}"
                                      if label in proof_finals64 else ""))
    for (seed, precision), d in drift_finals.items():
        marks = {s: d[s - 1] for s in (1, 10, 50, 150, 300, 1000, len(d)) if s <= len(d)}
        print(f"drift seed {seed} {precision}: " + ", ".join(f"step {s} {v:.1e}"
                                                            for s, v in marks.items()))
    for coefficient, busiest in loads.items():
        print(f"experts, --balance {coefficient:g}: busiest / mean per interval " +
              " ".join(f"{b:.3f}" for b in busiest))
    for schedule, (shares, theory) in bubbles.items():
        print(f"pipeline {schedule}: idle " + ", ".join(f"{s:.1%}" for s in shares) +
              (f" (theory {theory:.1%})" if theory else ""))
    print("wrote", ", ".join(os.path.join("docs", f) for f in (
        "proof.png", "drift.png", "timeline.png", "experts.png", "pipeline.png")))


if __name__ == "__main__":
    main()
