"""cp.py's Ulysses attention against attention over the whole sequence, on one batch, in float64:
its output at the tokens each rank holds, and the gradients of q, k and v through both
all-to-alls, for 8 query heads and 8, 4, 2 or 1 key/value heads (GQA; fewer than the ranks:
copied, one per rank), on a CP group of 4 (every rank) and on two groups of 2, with and without
packed documents; around a model's own attention with grouped heads (grouped_attend). The
reference repeats each key/value head for the query heads it serves
(Llama's repeat_kv) and masks by position and document over the whole sequence. Without GQA,
the bytes each rank's forward all-to-alls send are counted: 4 (C-1)/C x S x H x bytes / C per
sample (q, k and v traded for heads, the output traded back; H = heads x head width).

Run by tests/test_cp.py as 4 CPU ranks (conftest.ranks_cmd, which asks for --device=cpu); prints
the largest gap on rank 0; exits non-zero on a gap over 1e-12.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cp  # noqa: E402
from common import SEQ_LEN  # noqa: E402

HEADS, WIDTH, BATCH = 8, 4, 3


def grouped_attend(q, k, v, docs=None):
    """A model's own attention with grouped K/V heads, the grouping read off the shapes (as
    SDPA's enable_gqa does), causal, by document where packed: what Ulysses wraps."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if docs is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    same = docs[:, None, :, None] == docs[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=same.tril())


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert world == 4, "run on 4 ranks: one group of 4, two of 2"
pairs = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])]  # every rank makes every group
worst, counted = 0.0, set()
for c, group in ((world, dist.group.WORLD), (2, pairs[rank // 2])):
    me = dist.get_rank(group)
    mine = cp.token_positions(me, c)
    all_positions = torch.cat([cp.token_positions(r, c) for r in range(c)])
    for kv_heads in (8, 4, 2, 1):
        if kv_heads < c and c % kv_heads:
            continue
        for packed in (False, True):
            torch.manual_seed(kv_heads + 10 * packed)  # the same batch on every rank
            q = torch.randn(BATCH, HEADS, SEQ_LEN, WIDTH, dtype=torch.float64)
            k, v = torch.randn(2, BATCH, kv_heads, SEQ_LEN, WIDTH, dtype=torch.float64)
            grad = torch.randn(BATCH, HEADS, SEQ_LEN, WIDTH, dtype=torch.float64)
            starts = torch.rand(BATCH, SEQ_LEN) < 0.25  # a document begins here
            docs = starts.cumsum(1)
            for t in (q, k, v):
                t.requires_grad_()
            may_see = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool).tril()
            if packed:
                may_see = may_see & (docs[:, None, :, None] == docs[:, None, None, :])
            repeat = HEADS // kv_heads
            whole = F.scaled_dot_product_attention(
                q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1),
                attn_mask=may_see)
            expected = torch.autograd.grad(whole, (q, k, v), grad)
            sent = []  # what this rank's forward all-to-alls send: all but its own piece
            trade = cp.dist.all_to_all_single
            cp.dist.all_to_all_single = lambda out, x, **kw: sent.append(
                x.numel() * x.element_size() * (c - 1) / c) or trade(out, x, **kw)
            ours = cp.attend_ulysses(q[:, :, mine], k[:, :, mine], v[:, :, mine],
                                     docs[:, mine] if packed else None, group=group,
                                     all_positions=all_positions, attend=grouped_attend)
            cp.dist.all_to_all_single = trade
            if kv_heads == HEADS:  # 4 (C-1)/C x S x H x bytes / C: q, k, v there, out back
                formula = 4 * (c - 1) / c * BATCH * SEQ_LEN * HEADS * WIDTH * 8 / c
                assert sum(sent) == formula, (sum(sent), formula)
                counted.add((c, sum(sent)))
            # Each rank's gradients are those of its tokens' q, k, v; the group's sum is all
            grads = torch.autograd.grad(ours, (q, k, v), grad[:, :, mine])
            for g in grads:
                dist.all_reduce(g, group=group)
            gaps = [(ours - whole[:, :, mine]).abs().max()] + [
                (g - e).abs().max() for g, e in zip(grads, expected)]
            worst = max(worst, *(gap.item() for gap in gaps))
result = torch.tensor(worst, dtype=torch.float64)
dist.all_reduce(result, op=dist.ReduceOp.MAX)
if rank == 0:
    print(f"ulysses against whole attention, fp64: largest gap {result.item():.1e}; bytes a "
          f"rank sends per layer forward (C, bytes): {sorted(counted)}, the formula's", flush=True)
dist.destroy_process_group()
sys.exit(0 if result.item() < 1e-12 else 1)
