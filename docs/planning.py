"""From this machine to a real cluster: what each rank of a (pp, dp, cp, tp) layout holds and
sends per step, for Llama 3 8B and 70B on 8, 64 and 512 GPUs, Llama 3 8B at 128K tokens, and the
same arithmetic checked against nd.py at small scale. Writes the tables of docs/planning.md.

    python docs/planning.py            # the tables (seconds)
    python docs/planning.py --check    # and 6 nd.py runs on this CPU beside the formula (minutes)

The arithmetic, one rule per dimension (docs/planning.md says why each holds):
- pp: a stage holds L / (P V) blocks per virtual stage, the first the embeddings, the last the
  final norm and the head; the busiest rank is the one that holds the most.
- tp: cuts the blocks' matrices (q, k, v, o and the feed-forward's) and, as torchtitan does, the
  embeddings and the head over the vocabulary; norms stay whole.
- dp: FSDP shards every tensor it is given along its first dimension, rank 0 taking the
  rounded-up share; with CP, over the dp x cp ranks (each holds tokens no other does).
- cp: a rank holds S/C tokens of every sequence, and each block's attention reaches the other
  ranks' keys and values: all-gathered (their gradients reduce-scattered back), or round a ring.
"""

import argparse
import math
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GB = 1e9

MODELS = {  # Llama 3's published shapes (grouped-query attention, SwiGLU, RMSNorm, untied head)
    "Llama 3 8B": dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256),
    "Llama 3 70B": dict(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256),
}
SEQ, BATCH = 8192, 512  # tokens per sequence; sequences per step (4 M tokens, Llama 3's start)
LONG_SEQ, LONG_BATCH = 131072, 32  # 128K tokens per sequence, the same 4 M tokens per step
GPU_BYTES = 80 * GB
USABLE = 0.9  # of it, for what the table does not count (allocator, NCCL's buffers, CUDA)
PER_MACHINE = 8
NVLINK, INFINIBAND = 450 * GB, 50 * GB  # bytes/s one GPU sends: H100 NVLink; a 400 Gb/s NIC
PEAK, MFU = 989e12, 0.4  # H100 bf16 dense FLOP/s, and the share of it a good run reaches
LAYOUTS = {8: [(1, 8, 1), (1, 4, 2), (1, 1, 8), (2, 1, 4), (2, 4, 1)],
           64: [(1, 64, 1), (1, 8, 8), (2, 4, 8), (4, 2, 8), (8, 8, 1)],
           512: [(1, 512, 1), (1, 64, 8), (4, 16, 8), (8, 8, 8), (16, 4, 8), (16, 32, 1)]}
LONG_LAYOUTS = {64: [(1, 8, 1, 8), (1, 1, 8, 8), (1, 8, 8, 1)],  # (pp, dp, cp, tp)
                512: [(2, 32, 1, 8), (1, 8, 8, 8), (1, 4, 16, 8), (1, 32, 16, 1)]}


def llama_tensors(m):
    """[(where, shape, tp-cut dimension or None)] of a Llama model: where is a block index, or
    "first" / "last" for the tensors of the first and the last stage."""
    h, hd = m["hidden"], m["hidden"] // m["heads"]
    kv = m["kv_heads"] * hd
    block = [((h, h), 0), ((kv, h), 0), ((kv, h), 0), ((h, h), 1),  # q, k, v by heads; o by rows
             ((m["ffn"], h), 0), ((m["ffn"], h), 0), ((h, m["ffn"]), 1),  # gate, up; down
             ((h,), None), ((h,), None)]  # the two RMSNorms
    return ([("first", (m["vocab"], h), 0)] +
            [(i, shape, cut) for i in range(m["layers"]) for shape, cut in block] +
            [("last", (h,), None), ("last", (m["vocab"], h), 0)])


def simple_model_tensors(hidden, blocks, heads):
    """The same list for SimpleModel, read off the real module; tp.py's plan cuts q, k, v and up
    (weights and biases) by rows and o and down (weights) by columns, nothing else."""
    sys.path.insert(0, str(REPO))
    from common import SimpleModel
    out = []
    for name, p in SimpleModel(hidden, blocks, heads).named_parameters():
        m = re.match(r"blocks\.(\d+)\.(.*)", name)
        where = int(m.group(1)) if m else ("first" if name.startswith(("embed", "pos")) else
                                           "last")
        rest = m.group(2) if m else ""
        cut = (0 if re.match(r"attn\.[qkv]\.|up\.", rest) else
               1 if rest in ("attn.o.weight", "down.weight") else None)
        out.append((where, tuple(p.shape), cut))
    return out


def stage_of(where, layers, stages):
    """The stage of a tensor: pipeline.cut's split of the blocks, the ends on the end stages."""
    if where == "first":
        return 0
    if where == "last":
        return stages - 1
    return next(s for s in range(stages) if where < (s + 1) * layers // stages)


def held(tensors, layers, pp, dp, tp, v=1, v_shaped=False):
    """Elements each pp rank's first dp and tp rank holds: each tensor cut over tp along its
    cut dimension, then sharded over dp along its first (rank 0: the rounded-up share), on
    the stages its pp rank runs (in a loop, or in a V)."""
    stages = pp * v
    owner = [min(s, 2 * pp - 1 - s) if v_shaped else s % pp for s in range(stages)]
    per_rank = [0] * pp
    for where, shape, cut in tensors:
        shape = list(shape)
        if cut is not None:
            shape[cut] //= tp
        shape[0] = math.ceil(shape[0] / dp)
        per_rank[owner[stage_of(where, layers, stages)]] += math.prod(shape)
    return per_rank


def activation_bytes(m, tokens, tp, recompute, cp=1):
    """bf16 bytes a block keeps for backward per micro-batch of `tokens` tokens, flash attention
    (no scores kept): the norms' inputs and outputs (4h, whole on each TP rank), q, k, v and the
    attention's output (2h + 2 kv, cut), the feed-forward's gate, up, SiLU and product (4 ffn,
    cut); with full recomputation, the block's input alone. With CP (`tokens` the rank's S/C),
    the other C - 1 ranks' K and V too: all-gathered, they are kept for backward (cp.py's)."""
    h, kv = m["hidden"], m["kv_heads"] * m["hidden"] // m["heads"]
    if recompute:
        return 2 * h * tokens
    return (2 * tokens * (4 * h + (2 * h + 2 * kv + 4 * m["ffn"]) / tp)
            + gathered_kv(m, tokens, tp, cp))


def kv_piece(m, tokens, tp):
    """bf16 bytes of one rank's K and V in one block, per micro-batch of `tokens` tokens (S/C
    with CP): the message each CP exchange is made of."""
    return 2 * 2 * tokens * m["kv_heads"] * m["hidden"] // m["heads"] // tp


def gathered_kv(m, tokens, tp, cp):
    """The other ranks' K and V a block keeps for backward: C - 1 pieces (all-gather CP)."""
    return (cp - 1) * kv_piece(m, tokens, tp)


def link(size, stride):
    """Bytes per second of a group of `size` ranks `stride` apart: NVLink if they fit in one
    machine of PER_MACHINE consecutive ranks, else InfiniBand."""
    return NVLINK if size * stride <= PER_MACHINE else INFINIBAND


def plan(name, pp, dp, tp, recompute, cp=1, seq=SEQ, batch=BATCH):
    """One row: bytes per rank (the busiest stage's), bytes each rank sends per step in each
    dimension and the seconds its links take for them, the bubble, the compute."""
    m = MODELS[name]
    tensors = llama_tensors(m)
    h, params = m["hidden"], sum(math.prod(shape) for _, shape, _ in tensors)
    shards = dp * cp  # FSDP's ranks: the data and context ranks (nd.py's "dp_cp")
    elements = max(held(tensors, m["layers"], pp, shards, tp))  # the busiest stage's share
    state = 16 * elements  # fp32 weights and gradients, Adam's two moments: all sharded
    # bf16 weights gathered over dp x cp: with a pipeline, the stage's for the whole step (one
    # all-gather per step, as nd.py does); without, two blocks at a time (FSDP's prefetch)
    block = sum(math.prod(s) for w, s, _ in tensors if w == 0) // tp
    gathered = 0 if shards == 1 else 2 * elements * shards if pp > 1 else 2 * 2 * block
    micro = batch // dp  # micro-batches of one sequence (a CP group shares it): the pipeline's M
    tokens = seq // cp  # of each sequence, on this rank
    in_flight = min(pp, micro)  # 1F1B: the first stage keeps P micro-batches' activations
    layers_here = m["layers"] // pp
    acts = in_flight * layers_here * activation_bytes(m, tokens, tp, recompute, cp)
    kv_held = 0 if recompute else in_flight * layers_here * gathered_kv(m, tokens, tp, cp)
    # TP: per block and micro-batch 4 all-reduces of the activations (6 when recomputing),
    # bf16, each sending 2(T-1)/T of its size (a ring)
    tp_sent = 2 * (tp - 1) / tp * 2 * tokens * h * layers_here * micro * (6 if recompute else 4)
    # FSDP: with a pipeline, the stage's bf16 weights gathered once a step; without, each
    # block's twice per micro-batch (forward, backward); the fp32 gradients reduce-scattered
    # once a step (accumulated unsynced between, as fsdp.py does)
    dp_sent = (shards - 1) * (2 * (1 if pp > 1 else 2 * micro) + 4) * elements
    # CP: per block and micro-batch, forward, the rank's K, V piece to each of the C - 1 others
    # (all-gather; the ring: C - 1 hops of a piece); backward, as much of their gradients back
    # (reduce-scatter; the ring: C - 1 hops). A recomputed forward gathers again.
    cp_step = (cp - 1) * kv_piece(m, tokens, tp)
    cp_sent = cp_step * layers_here * micro * (3 if recompute else 2)
    # Ulysses instead (cp.py --cp-method ulysses): per block and micro-batch, forward, (C-1)/C
    # of the rank's q, k, v (traded for heads) and of the attention's output (traded back);
    # backward, as much. K and V hold at least one head per CP rank (GQA: copies). None where
    # C does not cut the heads of a TP rank.
    kv_wide = max(m["kv_heads"] // tp, cp) * h // m["heads"]
    ulysses = m["heads"] // tp % cp == 0 and (m["kv_heads"] // tp % cp == 0
                                              or cp % (m["kv_heads"] // tp) == 0)
    ulysses_sent = ((cp - 1) / cp * tokens * (2 * h // tp + 2 * kv_wide) * 2 * layers_here
                    * micro * (3 if recompute else 2)) if ulysses else None
    # PP: a middle stage sends each micro-batch's output on and its input's gradient back
    pp_sent = 2 * micro * tokens * h * 2 if pp > 1 else 0
    # 6 FLOPs per parameter and token; the long-context table adds causal attention's scores
    # and weighted sums, 6 L h S per token (forward and backward, half the keys), which grow
    # with the sequence: at 128K they outweigh the rest (docs/planning.md)
    flops = 6 * params + (6 * m["layers"] * h * seq if seq != SEQ else 0)
    compute = flops * batch * seq / (pp * dp * cp * tp) / (MFU * PEAK)  # seconds
    return dict(params=params, state=state, gathered=gathered, acts=acts, kv_held=kv_held,
                total=state + gathered + acts, tp_sent=tp_sent, dp_sent=dp_sent,
                cp_sent=cp_sent, cp_step=cp_step, pp_sent=pp_sent, ulysses_sent=ulysses_sent,
                ul_s=ulysses_sent / link(cp, tp) if ulysses_sent else None,
                tp_s=tp_sent / link(tp, 1),
                dp_s=dp_sent / link(shards, tp), cp_s=cp_sent / link(cp, tp),
                pp_s=pp_sent / link(pp, dp * cp * tp), bubble=(pp - 1) / (micro + pp - 1),
                compute=compute)


def tables():
    out = []
    for name in MODELS:
        params = sum(math.prod(s) for _, s, _ in llama_tensors(MODELS[name]))
        out.append(f"\n### {name} ({params / 1e9:.2f} B parameters; {BATCH} sequences of "
                   f"{SEQ} tokens per step)\n")
        out.append("| GPUs | pp x dp x tp | state | gathered weights | activations "
                   "(recompute) | per rank (recompute) | fits 80 GB? | TP sends | FSDP sends | "
                   "PP sends | bubble (1F1B) | compute |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for gpus, layouts in LAYOUTS.items():
            for pp, dp, tp in layouts:
                if pp * dp * tp != gpus:
                    raise SystemExit(f"layout {pp}x{dp}x{tp} is not {gpus} GPUs")
                full, ac = plan(name, pp, dp, tp, False), plan(name, pp, dp, tp, True)
                # the smallest that fits: recompute only where the activations do not
                row = full if full["total"] < USABLE * GPU_BYTES else ac
                fits = ("yes" if row is full else
                        "with recompute" if ac["total"] < USABLE * GPU_BYTES else "no")
                sends = [f"{row[k] / GB:,.1f} GB, {row[k[:3] + 's']:.1f} s" if row[k] else "-"
                         for k in ("tp_sent", "dp_sent", "pp_sent")]
                out.append(
                    f"| {gpus} | {pp} x {dp} x {tp} | {full['state'] / GB:.1f} GB | "
                    f"{full['gathered'] / GB:.1f} GB | {full['acts'] / GB:.1f} "
                    f"({ac['acts'] / GB:.1f}) GB | {full['total'] / GB:.1f} "
                    f"({ac['total'] / GB:.1f}) GB | {fits} | {' | '.join(sends)} | "
                    f"{row['bubble']:.1%} | {row['compute']:.1f} s |")
    return "\n".join(out) + "\n" + long_context()


def long_context():
    """The table of Llama 3 8B at 128K tokens: the layouts with and without CP (all-gather)."""
    name = "Llama 3 8B"
    out = [f"\n### {name} at 128K tokens ({LONG_BATCH} sequences of {LONG_SEQ} tokens per step; "
           "CP all-gather)\n",
           "| GPUs | pp x dp x cp x tp | state | gathered weights | activations (recompute) | "
           "of which others' K, V | per rank (recompute) | fits 80 GB? | K, V a CP step sends | "
           "CP sends | Ulysses would send | TP sends | FSDP sends | PP sends | bubble (1F1B) | "
           "compute |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for gpus, layouts in LONG_LAYOUTS.items():
        for pp, dp, cp, tp in layouts:
            if pp * dp * cp * tp != gpus or LONG_BATCH % dp:
                raise SystemExit(f"layout {pp}x{dp}x{cp}x{tp}: not {gpus} GPUs, or dp does "
                                 f"not divide {LONG_BATCH} sequences")
            full, ac = (plan(name, pp, dp, tp, r, cp, LONG_SEQ, LONG_BATCH) for r in (False, True))
            row = full if full["total"] < USABLE * GPU_BYTES else ac
            fits = ("yes" if row is full else
                    "with recompute" if ac["total"] < USABLE * GPU_BYTES else "no")
            sends = [f"{row[k] / GB:,.1f} GB, {row[k[:2] + '_s']:.1f} s" if row[k] else
                     "-" if cp == 1 or k != "ulysses_sent" else "no: heads"
                     for k in ("cp_sent", "ulysses_sent", "tp_sent", "dp_sent", "pp_sent")]
            step = f"{row['cp_step'] / 2**20:,.0f} MiB" if cp > 1 else "-"
            out.append(
                f"| {gpus} | {pp} x {dp} x {cp} x {tp} | {full['state'] / GB:.1f} GB | "
                f"{full['gathered'] / GB:.1f} GB | {full['acts'] / GB:.1f} "
                f"({ac['acts'] / GB:.1f}) GB | {full['kv_held'] / GB:.1f} GB | "
                f"{full['total'] / GB:.1f} ({ac['total'] / GB:.1f}) GB | {fits} | {step} | "
                f"{' | '.join(sends)} | {row['bubble']:.1%} | {row['compute']:.1f} s |")
    return "\n".join(out)


# The small-scale check: nd.py at its defaults (hidden 64, 4 blocks, 4 heads, batch 64, fp32) on
# six meshes, 2 micro-batches. Rank 0's summary prints the state it holds (plumbing/meter.py
# held_bytes: weights, gradients and Adam's moments, each DTensor's local piece); its --profile
# trace of steps 5-7 holds every send (PP, and the ring's hops), every all-reduce of an
# activation (TP), every all-gather of its FSDP shard (dp x cp) and of its K, V piece (CP), and
# every reduce-scatter of their gradients, each with its tensor's shape. Rank 0 runs the first
# stage (and in a V the last): it sends activations forward (and gradients back from the last
# stage).
CHECKS = [(8, 2, 1, 2, "gpipe", None), (4, 2, 1, 2, "gpipe", None), (4, 2, 1, 1, "gpipe", None),
          (8, 2, 1, 2, "zbv", None), (4, 2, 2, 1, "gpipe", "ring"),
          (8, 2, 2, 2, "gpipe", "allgather")]  # (ranks, pp, cp, tp, schedule, CP's method)
HIDDEN, BLOCKS, HEADS, BATCH_HERE, M, STEPS = 64, 4, 4, 64, 2, 8


def counted(trace, activation, kv, cp):
    """Bytes per step rank 0's trace shows: sent to the next stage, all-reduced over TP (the
    activation-shaped ones), all-gathered over dp x cp (its shard), and CP's: its K, V piece
    (`kv`'s shape) all-gathered, or sent a hop round the ring, and their gradients
    reduce-scattered back, or sent a hop back. An all-gather or a reduce-scatter counts the
    C - 1 pieces it sends (the ring algorithm's; gloo's own reduce-scatter is C all-reduces)."""
    import json
    size = {"float": 4, "double": 8}
    sums = {"send": 0, "tp": 0, "dp": 0, "cp": 0}
    for e in json.loads(Path(trace).read_text())["traceEvents"]:
        if e.get("ph") != "X" or "Input Dims" not in e.get("args", {}):
            continue
        dims, kind = e["args"]["Input Dims"][0], e["args"]["Input type"][0]
        while dims and isinstance(dims[0], list):  # a list of tensors: its first
            dims = dims[0]
        n = math.prod(dims) * size.get(kind, 0)
        if e["name"] in ("gloo:send", "nccl:send"):
            sums["cp" if dims == kv else "send"] += n  # a ring hop, or a stage's output
        elif e["name"] == "_c10d_functional::all_reduce" and dims == activation:
            sums["tp"] += n
        elif e["name"] in ("gloo:all_gather", "nccl:all_gather") and dims == kv:
            sums["cp"] += (cp - 1) * n
        elif e["name"] == "c10d::reduce_scatter_" and dims == kv:  # its output: this rank's
            sums["cp"] += (cp - 1) * math.prod(dims) * 4
        elif e["name"] in ("gloo:all_gather", "nccl:all_gather"):
            sums["dp"] += math.prod(dims) * 4  # its input: this rank's flat shard, fp32
    return {k: v / 3 for k, v in sums.items()}  # the Profiler records 3 steps


def formula(ranks, pp, cp, tp, schedule):
    """One check's shapes and the rules' numbers for rank 0: its micro-batch's activation
    shape, its K, V piece's, and the state (MiB) and bytes per step the table compares (CP's
    the same for the all-gather and the ring)."""
    tensors = simple_model_tensors(HIDDEN, BLOCKS, HEADS)
    dp = ranks // (pp * cp * tp)
    v, v_shaped = (2, True) if schedule == "zbv" else (1, False)
    elements = held(tensors, BLOCKS, pp, dp * cp, tp, v, v_shaped)[0]
    micro = [BATCH_HERE // (dp * M), 16 // cp, HIDDEN]  # one micro-batch's activation
    # its K and V stacked, as cp.py sends them: (2, batch, heads, tokens, head width)
    kv = [2, micro[0], HEADS // tp, micro[1], HIDDEN // HEADS]
    blocks_here = BLOCKS // (pp * v) * v  # rank 0's stages' blocks
    return micro, kv, {
        "state": 16 * elements / 2**20,
        "send": M * math.prod(micro) * 4 * (2 if v_shaped else 1),
        "tp": 4 * blocks_here * M * math.prod(micro) * 4 if tp > 1 else 0,
        "dp": 4 * elements if dp * cp > 1 else 0,
        # per block and micro-batch: C - 1 pieces forward, as many gradients back
        "cp": 2 * (cp - 1) * blocks_here * M * math.prod(kv) * 4}


def check():
    import tempfile
    rows = ["| ranks | pp x dp x cp x tp | schedule | rank 0 runs | state (MiB): formula, "
            "printed | PP sends (bytes/step): formula, counted | TP all-reduces (bytes/step): "
            "formula, counted | FSDP shard gathered (bytes/step): formula, counted | CP's K, V "
            "sent (bytes/step): formula, counted |",
            "|---|---|---|---|---|---|---|---|---|"]
    for ranks, pp, cp, tp, schedule, method in CHECKS:
        dp = ranks // (pp * cp * tp)
        micro, kv, expected = formula(ranks, pp, cp, tp, schedule)
        with tempfile.TemporaryDirectory() as folder:
            result = subprocess.run(
                [sys.executable, "nd.py", "--device=cpu", f"--nproc={ranks}", f"--pp={pp}",
                 f"--cp={cp}", f"--tp={tp}", f"--schedule={schedule}", f"--steps={STEPS}",
                 f"--microbatches={M}", f"--profile={folder}"]
                + ([f"--cp-method={method}"] if method else []),
                cwd=REPO, capture_output=True, text=True, timeout=600,
                env={**os.environ, "OMP_NUM_THREADS": "1"})
            printed = re.search(r"\| state ([0-9.]+) MiB/rank", result.stdout)
            if not printed:
                raise SystemExit(f"nd.py failed:\n{result.stdout}\n{result.stderr}")
            seen = counted(Path(folder) / "trace_rank0.json", micro, kv, cp)
        mine = "0 and 3 (a V)" if schedule == "zbv" else "0"
        how = f"{schedule}, CP {method}" if method else schedule
        rows.append(f"| {ranks} | {pp} x {dp} x {cp} x {tp} | {how} | stage {mine} | "
                    f"{expected['state']:.4f}, {printed.group(1)} | "
                    + " | ".join(f"{expected[k]:,.0f}, {seen[k]:,.0f}"
                                 for k in ("send", "tp", "dp", "cp"))
                    + " |")
        print(rows[-1], flush=True)
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="also run nd.py at small scale")
    args = parser.parse_args(argv)
    print(tables())
    if args.check:
        print()
        check()


if __name__ == "__main__":
    main()
