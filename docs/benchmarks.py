"""Run the performance comparisons of docs/performance.md and print their tables.

    python docs/benchmarks.py            # every table, every repetition (~17 minutes, 2 cores)
    python docs/benchmarks.py checkpointing   # one table (9 minutes here, on 2 cores)
    python docs/benchmarks.py tp ddp     # only these tables
    python docs/benchmarks.py ddp fsdp --batch=512   # the ddp and fsdp tables at another batch
    python docs/benchmarks.py ddp fsdp --batch=512 --reps=5   # and 5 repetitions of each row
    python docs/benchmarks.py ep-save    # ep.py's rank 0 in a save
    python docs/benchmarks.py by-hand    # each wrapper against its twin in from_scratch/
    python docs/benchmarks.py count      # what the global count of targets costs a step
    python docs/benchmarks.py slow-link  # ddp.py against diloco.py over a slowed link

Every command runs with OMP_NUM_THREADS=1 (one thread per process, as torchrun sets it for
several ranks) at a size where the weights dominate, and reads samples/s from the summary line
(after 3 warm-up steps). Commands of one row that belong together (the "ceiling": two
independent one-rank runs of half the batch) run at the same time; rows run one after the
other, alternating the contenders, so that the machine's drift hits them alike. A benchmark,
not a test: nothing here asserts a speed.
"""

import os
import re
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = ["--hidden=256", "--blocks=2", "--heads=4", "--steps=20", "--log-every=1000",
        "--eval-every=1000", "--device=cpu"]  # 1.6 M parameters: a 6.4 MB gradient
PARAMS = 1.6e6
HIDDEN, SEQ = 256, 16
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def torchrun(n, script, batch, *flags):
    return [*TORCHRUN, f"--nproc_per_node={n}", script, *SIZE, f"--batch-size={batch}", *flags]


def python(script, batch, *flags):
    return [sys.executable, script, *SIZE, f"--batch-size={batch}", *flags]


def rates(*commands, **env):
    """Run the commands at the same time; return each one's samples/s (and its summary)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    procs = [subprocess.Popen(c, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL) for c in commands]
    out = []
    for proc in procs:
        stdout, _ = proc.communicate(timeout=900)
        line = next(l for l in stdout.splitlines() if l.startswith("done | "))
        out.append((float(re.search(r"\| ([0-9.]+) samples/s", line).group(1)), line))
    return out


def table(title, header, rows):
    print(f"\n**{title}**\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |", flush=True)


def medians(rows, column):
    """Below a table: each batch's median of a ratio column (its rows' repetitions)."""
    for batch in dict.fromkeys(row[0] for row in rows):
        ratios = [float(row[column].rstrip("%")) for row in rows if row[0] == batch]
        print(f"\nbatch {batch}: median {statistics.median(ratios):.0f}% of {len(ratios)} "
              f"(lowest {min(ratios):.0f}%, highest {max(ratios):.0f}%)", flush=True)


def ddp(reps=3, batches=(128, 256)):
    rows = []
    for batch in batches:
        for _ in range(reps):
            (one, _), = rates(torchrun(1, "ddp.py", batch))
            (two, _), = rates(torchrun(2, "ddp.py", batch))
            ceiling = sum(r for r, _ in rates(torchrun(1, "ddp.py", batch // 2),
                                              torchrun(1, "ddp.py", batch // 2)))
            rows.append([str(batch), f"{one:.0f}", f"{two:.0f}", f"{ceiling:.0f}",
                         f"{ceiling / one:.2f}x", f"{two / ceiling:.0%}"])
    table("DDP against the ceiling (samples/s)", ["global batch", "1 rank", "DDP, 2 ranks",
          "ceiling (2 independent)", "ceiling / 1 rank", "DDP / ceiling"], rows)
    medians(rows, 5)


def tp(reps=1):
    rows = []
    for batch in (16, 64):
        for _ in range(reps):
            (d, _), = rates(torchrun(2, "ddp.py", batch))
            (t, _), = rates(torchrun(2, "tp.py", batch))
            ceiling = sum(r for r, _ in rates(torchrun(1, "ddp.py", batch // 2),
                                              torchrun(1, "ddp.py", batch // 2)))
            # bytes each moves per step, in theory: TP all-reduces a (B, S, H) activation four
            # times per block (two in forward, two in backward); DDP the gradient once.
            tp_mb = 4 * 2 * batch * SEQ * HIDDEN * 4 / 1e6
            ddp_mb = PARAMS * 4 / 1e6
            rows.append([str(batch), f"{d:.0f}", f"{t:.0f}", f"{ceiling:.0f}", f"{t / d:.0%}",
                         f"{t / ceiling:.0%}", f"{tp_mb:.1f}", f"{ddp_mb:.1f}"])
    table("TP against DDP and the ceiling, 2 ranks (samples/s)", [
        "global batch", "DDP", "TP", "ceiling", "TP / DDP", "TP / ceiling",
        "TP MB/step (theory)", "DDP MB/step (theory)"], rows)


def fsdp(reps=3, batches=(256,)):
    rows = []
    for batch, i in [(batch, i) for batch in batches for i in range(reps)]:
        (d, _), = rates(torchrun(2, "ddp.py", batch))
        (f, line), = rates(torchrun(2, "fsdp.py", batch))
        state = re.search(r"state ([0-9.]+ MiB/rank)", line).group(1)
        rows.append([str(batch), str(i + 1), f"{d:.0f}", f"{f:.0f}", f"{f / d:.0%}", state])
    table("FSDP against DDP, 2 ranks (samples/s)", ["global batch", "repetition", "DDP", "FSDP",
                                                    "FSDP / DDP", "FSDP state per rank"], rows)
    medians(rows, 4)


def pipeline(reps=2):
    rows = []
    for i in range(reps):
        (mp, _), = rates(python("pipeline.py", 128, "--nproc=1", "--stages=2"))
        (g, _), = rates(torchrun(2, "pipeline.py", 128, "--schedule=gpipe"))
        (f, _), = rates(torchrun(2, "pipeline.py", 128, "--schedule=1f1b"))
        rows.append([str(i + 1), f"{mp:.0f}", f"{g:.0f}", f"{f:.0f}", f"{g / (2 * mp):.0%}",
                     f"{f / (2 * mp):.0%}"])
    table("Pipeline against model parallelism, 2 stages, batch 128, 4 micro-batches "
          "(samples/s)", ["repetition", "model parallel (1 process)", "GPipe", "1F1B",
                          "GPipe / (2 x model parallel)", "1F1B / (2 x model parallel)"], rows)


def dataparallel(reps=2):
    rows = []
    for i in range(reps):
        (s, _), = rates(python("single.py", 128))
        (d, _), = rates(python("dataparallel.py", 128))
        (r, _), = rates(torchrun(1, "ddp.py", 128))
        rows.append([str(i + 1), f"{s:.0f}", f"{d:.0f}", f"{r:.0f}"])
    table("One device: single.py, DataParallel and one DDP rank, batch 128 (samples/s)",
          ["repetition", "single.py", "dataparallel.py", "ddp.py, 1 rank"], rows)


def checkpointing(reps=2):
    """Activation checkpointing where activations dominate: a deep model on a large batch (8
    blocks of hidden 256, 4 heads; 256 sequences of 16 tokens per rank), wide enough that a
    block's time is its matrix products, not Python (at hidden 64 the recomputed forward also
    repeats the Python and dispatch work that dominates there: docs/compile.md). What a block
    keeps for backward, per token, in theory: about 16 x hidden numbers; with checkpointing,
    only its input (1 x hidden) and one block's recomputation at a time.

    Memory is the peak RSS of rank 0's process. As it comes, that counts what glibc's malloc
    keeps of freed tensors for reuse (it raises its own threshold for giving memory back to
    the system as the program frees large blocks), so it says little about what was alive at
    once. Each run is therefore repeated with MALLOC_MMAP_THRESHOLD_ fixed at 128 KiB: every
    tensor that large gets its own mapping, returned at once when freed, and the peak RSS
    follows the live tensors. The activations are that peak above the same run on a batch of
    2 (torch, the weights, Adam's state, gloo's buffers). Times come from the plain runs (the
    mapping costs page faults: those runs are slower)."""
    flags = ["--hidden=256", "--blocks=8", "--heads=4", "--steps=8", "--batch-size=512",
             "--log-every=1000", "--eval-every=1000", "--device=cpu"]
    live = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}

    def peak(line):
        return float(re.search(r"peak mem ([0-9.]+) MiB", line).group(1))
    rows = []
    for script in ("ddp.py", "fsdp.py"):
        command = [*TORCHRUN, "--nproc_per_node=2", script, *flags]
        (_, line), = rates([*command, "--batch-size=2"], **live)
        base = peak(line)
        rows.append([script, "(batch 2: no activations)", "", "", "", f"{base:.0f}", ""])
        for _ in range(reps):
            for ac in ([], ["--activation-checkpointing"]):
                (rate, line), = rates([*command, *ac])
                (_, live_line), = rates([*command, *ac], **live)
                ms = float(re.search(r"([0-9.]+) ms/step", line).group(1))
                rows.append([script, "on" if ac else "off", f"{rate:.0f}", f"{ms:.0f}",
                             f"{peak(line):.0f}", f"{peak(live_line):.0f}",
                             f"{peak(live_line) - base:.0f}"])
    table("Activation checkpointing, 2 ranks, 8 blocks of hidden 256, batch 512 (rank 0's "
          "process)", ["script", "checkpointing", "samples/s", "ms/step", "peak RSS MiB",
                       "peak RSS MiB, 128 KiB mmap threshold", "activations MiB (above batch 2)"],
          rows)


def compiled(reps=1):
    """torch.compile of each block, at the default size and at the performance size: samples/s
    (after 3 warm-up steps) and the first step, which pays the compile."""
    rows = []
    sizes = {"default (hidden 64 x 4, batch 64)": ["--steps=60", "--log-every=1000",
                                                   "--eval-every=1000", "--device=cpu"],
             "performance (hidden 256 x 2, batch 128)": [*SIZE, "--batch-size=128"]}
    for size, flags in sizes.items():
        for _ in range(reps):
            for compile_ in ([], ["--compile"]):
                (rate, line), = rates([*TORCHRUN, "--nproc_per_node=2", "ddp.py", *flags,
                                       *compile_])
                first = float(re.search(r"first step ([0-9.]+) s", line).group(1))
                rows.append([size, "compiled" if compile_ else "eager", f"{rate:.0f}",
                             f"{first:.2f}"])
    table("torch.compile, ddp.py on 2 ranks", ["size", "mode", "samples/s", "first step (s)"],
          rows)


def ep(reps=3, batch=128):
    """ep.py against ddp.py on the same mixture (4 experts, top-2) at 2 ranks: samples/s of
    each, alternating, every repetition; then one --profile run of each: a step's time and the
    part of it in collectives (gloo:... events of rank 0's trace, docs/figures.py's reading),
    and the training state each rank holds."""
    from figures import trace_rows  # docs/figures.py: needs docs/requirements.txt
    mixture = ["--experts=4", "--top-k=2"]
    rows = []
    for i in range(reps):
        (d, _), = rates(torchrun(2, "ddp.py", batch, *mixture))
        (e, _), = rates(torchrun(2, "ep.py", batch, *mixture))
        rows.append([str(i + 1), f"{d:.0f}", f"{e:.0f}", f"{e / d:.0%}"])
    table(f"EP against DDP on a mixture of 4 experts, top-2, 2 ranks, batch {batch} "
          "(samples/s)", ["repetition", "DDP", "EP", "EP / DDP"], rows)
    medians([[batch, *row[1:]] for row in rows], 3)
    rows = []
    for script in ("ddp.py", "ep.py"):
        folder = os.path.join(REPO, f".benchmark-trace-{script}")
        (_, line), = rates(torchrun(2, script, batch, *mixture, f"--profile={folder}"))
        spans, step = trace_rows(folder)[0]
        comm = sum(dur for name, _, dur, kind in spans if kind == "communication")
        count = sum(1 for _, _, _, kind in spans if kind == "communication")
        state = re.search(r"state ([0-9.]+ MiB/rank)", line).group(1)
        rows.append([script, f"{step:.1f}", f"{comm:.1f} ({comm / step:.0%})", str(count), state])
        subprocess.run(["rm", "-rf", folder], check=True)
    table("Where a step goes (rank 0, one profiled step)", [
        "script", "step (ms)", "in collectives (ms)", "collectives per step",
        "training state per rank"], rows)


def alltoall(steps=8):
    """Bytes ep.py's all-to-alls carry per step, counted from --profile traces (the tensor each
    gloo:all_to_all was given, every rank's, over the 3 recorded steps), against the formula:
    per block, dispatch and combine in forward and again in backward, each N x k rows of the
    hidden size (N: the step's tokens in an EP group, every rank's), plus the counts (E
    int64 per rank) once per forward. ep.py's defaults: 2 ranks, 4 experts, top-2, batch 64,
    hidden 64, 4 blocks, fp32."""
    import json
    folder = os.path.join(REPO, ".benchmark-trace-alltoall")
    subprocess.run([*TORCHRUN, "--nproc_per_node=2", "ep.py", "--device=cpu",
                    f"--steps={steps}", f"--profile={folder}"], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    size = {"float": 4, "double": 8, "long int": 8, "c10::BFloat16": 2, "c10::Half": 2}
    counted, calls = 0, 0
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name)) as f:
            for e in json.load(f)["traceEvents"]:
                if e.get("ph") == "X" and e["name"] in ("gloo:all_to_all", "nccl:all_to_all"):
                    rows, cols = (e["args"]["Input Dims"][0] + [1])[:2]
                    counted += rows * cols * size[e["args"]["Input type"][0]]
                    calls += 1
    subprocess.run(["rm", "-rf", folder], check=True)
    counted, calls = counted / 3, calls / 3  # the Profiler records 3 steps
    blocks, hidden, experts, k, ranks, tokens = 4, 64, 4, 2, 2, 64 * 16
    hidden_bytes = blocks * 4 * tokens * k * hidden * 4
    count_bytes = blocks * ranks * experts * 8
    table("ep.py's all-to-alls per step, both ranks together (python ep.py's defaults)",
          ["all-to-alls per step (counted)", "bytes per step (counted)",
           "formula: blocks x 4 x N x k x hidden x 4 B", "+ counts: blocks x ranks x E x 8 B",
           "formula total"],
          [[f"{calls:.0f}", f"{counted:,.0f}", f"{hidden_bytes:,}", f"{count_bytes:,}",
            f"{hidden_bytes + count_bytes:,}"]])


def ep_save(script="ep.py", ranks=8):
    """Rank 0's memory while ep.py gathers its checkpoint (plumbing/checkpoints.py's
    gather_full_state), at hidden 256, 8 experts, 4 blocks, fp32, EP 8 (each rank holds one
    expert per block), after an Adam step. In this process, as rank 0 of a group of `ranks`
    whose collectives move nothing (torch's test backend "fake"): the code allocates every
    tensor it would, at its size, on the device it chooses; the bytes received are zeros. On a GPU: the peak of the bytes
    allocated on it during the gather, over those allocated before (torch.cuda's counters). On
    the CPU, where the device is the host: the process's peak resident memory during the
    gather (VmHWM, reset just before) over its resident memory before. `script`: the ep.py
    whose experts are cut (hold_experts); the gather is plumbing's, whatever the script."""
    import argparse
    import importlib.util

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    sys.path.insert(0, REPO)
    from common import SimpleModel
    from plumbing.checkpoints import gather_full_state
    spec = importlib.util.spec_from_file_location("ep_measured", os.path.join(REPO, script))
    ep_ = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ep_)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def memory(field):  # bytes: the device's allocated (now or peak), or the process's RSS
        if device.type == "cuda":
            return (torch.cuda.memory_allocated() if field == "VmRSS"
                    else torch.cuda.max_memory_allocated())
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    recv = dist.recv

    def receive(tensor, *args, **kwargs):  # writes every byte, as a real one would (RSS counts
        work = recv(tensor, *args, **kwargs)  # the pages written, not those only allocated)
        tensor.zero_()
        return work

    dist.recv = receive
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    mesh = init_device_mesh(device.type, (1, ranks), mesh_dim_names=("dp", "ep"))
    model = SimpleModel(hidden=256, blocks=4, heads=4, experts=8, top_k=2)
    experts = sum(p.numel() * 4 for name, p in model.named_parameters() if ep_.is_expert(name))
    ep_.hold_experts(model, mesh)
    model.to(device)
    optimizer = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # Adam's moments exist from the first step on
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: the peak resident memory (VmHWM) starts again from now
    before = memory("VmRSS")
    flags = argparse.Namespace(hidden=256, blocks=4, heads=4, experts=8, top_k=2)
    state = gather_full_state(flags, [(model, optimizer)])
    grown = memory("VmHWM") - before
    table(f"{script}: rank 0 gathering a checkpoint, EP {ranks}, {device.type}",
          ["every expert's weights (MiB)", "received: 3 x (EP-1)/EP of them (MiB)",
           "measured: peak during the gather over before (MiB)"],
          [[f"{experts / 2**20:.1f}", f"{3 * (ranks - 1) / ranks * experts / 2**20:.1f}",
            f"{grown / 2**20:.1f}"]])
    dist.destroy_process_group()
    dist.recv = recv
    return state


def by_hand(reps=3, batch=128):
    """Each wrapper against its twin written by hand (from_scratch/), 2 ranks, alternating."""
    pairs = {"ddp.py": [], "zero.py": [], "fsdp.py": [], "tp.py": [],
             "pipeline.py": ["--schedule=1f1b"]}
    rows = []
    for i in range(reps):
        for script, flags in pairs.items():
            (w, _), = rates(torchrun(2, script, batch, *flags))
            (h, _), = rates(torchrun(2, f"from_scratch/{script}", batch, *flags))
            rows.append([script, str(i + 1), f"{w:.0f}", f"{h:.0f}", f"{h / w:.0%}"])
    table(f"Each wrapper against its by-hand twin, 2 ranks, batch {batch} (samples/s)",
          ["wrapper", "repetition", "wrapper", "by hand", "by hand / wrapper"], rows)
    for script in pairs:
        ratios = [float(row[4].rstrip("%")) for row in rows if row[0] == script]
        print(f"\n{script}: median {statistics.median(ratios):.0f}% of {len(ratios)} "
              f"(lowest {min(ratios):.0f}%, highest {max(ratios):.0f}%)", flush=True)


COUNT_LINE = "        dist.all_reduce(tokens)\n"  # ddp.py's global count (docs/counts.md)
ONE_ALL_REDUCE = """
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
tokens = torch.ones((), dtype=torch.int64)
for i in range(2200):
    if i == 200:
        start = time.perf_counter()
    dist.all_reduce(tokens)
if dist.get_rank() == 0:
    print(f"{(time.perf_counter() - start) / 2000 * 1e6:.0f}")
dist.destroy_process_group()
"""


def count(reps=3, batch=128):
    """What the global count of targets costs per step: ddp.py on 2 ranks against a copy of it
    without the count's all-reduce (each rank divides by its own count, the mistake of
    docs/counts.md, which does the same work otherwise), rows alternating; and one all-reduce
    of an int64 alone on 2 gloo ranks, timed over 2000 calls."""
    text = open(os.path.join(REPO, "ddp.py")).read()
    assert text.count(COUNT_LINE) == 1
    uncounted = os.path.join(REPO, ".benchmark_ddp_uncounted.py")
    with open(uncounted, "w") as f:
        f.write(text.replace(COUNT_LINE, ""))
    alone = os.path.join(REPO, ".benchmark_one_all_reduce.py")
    with open(alone, "w") as f:
        f.write(ONE_ALL_REDUCE)
    rows = []
    try:
        for _ in range(reps):
            (counted, line), = rates(torchrun(2, "ddp.py", batch))
            (plain, _), = rates(torchrun(2, uncounted, batch))
            step = float(re.search(r"\| ([0-9.]+) ms/step", line).group(1))
            micro = subprocess.run([*TORCHRUN, "--nproc_per_node=2", alone], cwd=REPO,
                                   capture_output=True, text=True, check=True,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.split()[-1]
            rows.append([str(batch), f"{plain:.0f}", f"{counted:.0f}",
                         f"{100 * counted / plain:.0f}%", f"{step:.1f}", micro])
    finally:
        os.remove(uncounted)
        os.remove(alone)
    table("ddp.py, 2 ranks: the step's global count of targets (one int64 all-reduce)",
          ["batch", "samples/s without the count", "samples/s with it", "ratio",
           "ms/step with it", "one int64 all-reduce alone, us"], rows)
    medians(rows, 3)


# A slow link, emulated (slow_link): every all-reduce first waits for the time its bytes take
# over a ring at SLOW_LINK_BITS bits/s, 2(N-1)/N x its bytes sent per rank, before it starts
# (no overlap with compute, for DDP's buckets either): torch.distributed.all_reduce, patched,
# which diloco.py's pseudo-gradient, the loss and the count call, and DDP's buckets through
# torch's allreduce_hook registered as its communication hook (which calls it too). Every
# rank adds the bytes it all-reduced to SLOW_LINK_LOG. Put on the workers' PYTHONPATH as sitecustomize.py, so neither
# script holds a line of it.
SLOW_LINK = """
import atexit, os, time
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

BITS, SENT = float(os.environ["SLOW_LINK_BITS"]), [0]


def wait(tensor):
    size = tensor.numel() * tensor.element_size()
    SENT[0] += size
    n = dist.get_world_size()
    if BITS:
        time.sleep(8 * size * 2 * (n - 1) / n / BITS)


real_all_reduce = dist.all_reduce


def all_reduce(tensor, *args, **kwargs):
    wait(tensor)
    return real_all_reduce(tensor, *args, **kwargs)


real_init = DistributedDataParallel.__init__


def init(self, *args, **kwargs):
    real_init(self, *args, **kwargs)
    self.register_comm_hook(None, allreduce_hook)  # dist.all_reduce: the one above


dist.all_reduce, DistributedDataParallel.__init__ = all_reduce, init


@atexit.register
def log():
    with open(os.environ["SLOW_LINK_LOG"], "a") as f:
        f.write(f"{os.environ.get('RANK')} {SENT[0]}\\n")
"""


def slow_link(reps=1, batch=128, inner_steps=5):
    """ddp.py against diloco.py (--inner-steps 5) on 2 ranks, over a link slowed to each
    bandwidth (SLOW_LINK): samples/s, ms/step, and the bytes each rank all-reduced per step."""
    import tempfile
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(SLOW_LINK)
    steps = int(next(f for f in SIZE if f.startswith("--steps=")).split("=")[1])
    rows = []
    for _ in range(reps):
        for bits in (0, 10e9, 1e9, 100e6):
            row = ["unslowed" if not bits else f"{bits / 1e9:g} Gbit/s"]
            for script, flags in (("ddp.py", []), ("diloco.py", [f"--inner-steps={inner_steps}"])):
                log = os.path.join(folder, f"{script}.log")
                if os.path.exists(log):
                    os.remove(log)
                (rate, line), = rates(torchrun(2, script, batch, *flags), SLOW_LINK_BITS=str(bits),
                                      SLOW_LINK_LOG=log, PYTHONPATH=os.pathsep.join(
                                          p for p in (folder, os.environ.get("PYTHONPATH")) if p))
                step = float(re.search(r"\| ([0-9.]+) ms/step", line).group(1))
                sent = max(int(l.split()[1]) for l in open(log))
                row += [f"{rate:.0f}", f"{step:.1f}", f"{sent / steps / 1e6:.2f}"]
            row.append(f"{float(row[4]) / float(row[1]):.2f}")
            rows.append(row)
    table(f"ddp.py against diloco.py --inner-steps {inner_steps}, 2 ranks, batch {batch}, "
          "over a slowed link", ["link", "ddp samples/s", "ddp ms/step", "ddp MB/step/rank",
                                 "diloco samples/s", "diloco ms/step", "diloco MB/step/rank",
                                 "diloco/ddp"], rows)


TABLES = {"ddp": ddp, "tp": tp, "fsdp": fsdp, "pipeline": pipeline,
          "dataparallel": dataparallel, "checkpointing": checkpointing, "compile": compiled,
          "ep": ep, "alltoall": alltoall, "ep-save": ep_save, "by-hand": by_hand,
          "count": count, "slow-link": slow_link}

if __name__ == "__main__":
    import torch
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, size: {' '.join(SIZE)}")
    options = dict(a[2:].split("=") for a in sys.argv[1:] if a.startswith("--"))
    for name in [a for a in sys.argv[1:] if not a.startswith("--")] or TABLES:
        kwargs = {"reps": int(options["reps"])} if "reps" in options else {}
        if "batch" in options and name in ("ddp", "fsdp"):
            kwargs["batches"] = (int(options["batch"]),)
        if "script" in options and name == "ep-save":
            kwargs = {"script": options["script"]}
        TABLES[name](**kwargs)
