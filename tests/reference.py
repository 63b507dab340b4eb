"""The oracle: SimpleModel trained on one device, written as plainly as possible.

Nothing here is imported from the scripts under test; only the model and the data (common.py)
are shared. Every strategy in this collection must end with the weights this loop ends with.
"""

import torch
import torch.nn.functional as F

from common import SimpleModel, make_dataset


def token_loss(logits, targets, reduction="mean"):
    """Cross-entropy over every predicted token (written here, not imported from the scripts)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           reduction=reduction)


def moe_balance_loss(model, top_k):
    """The mixture of experts' Switch/GShard load-balancing loss of the last forward, written
    here from the model's routing counts and probabilities: E x sum_e f_e x P_e, over blocks."""
    losses = []
    for block in model.blocks.values():
        counts, prob_sums = block.moe.routed
        tokens = counts.sum() / top_k
        losses.append(len(counts) * ((counts / (tokens * top_k)) * (prob_sums / tokens)).sum())
    return sum(losses) / len(losses)


def reference_train(steps, batch_size, lr, seed, hidden, blocks, heads, clip=None, ranks=1,
                    fp64=False, norms=None, experts=0, top_k=1, balance=0.01, accum=1,
                    routed=None):
    """Return (initial state_dict, final state_dict, loss of every step).

    clip: if given, the gradient norm is clipped to it before each step (the scripts' --clip).
    norms: if a list, each step's gradient norm (before clipping) is appended to it.
    ranks: the gradient as N data-parallel ranks add it up: the mean of N per-rank mean
    gradients, rank r taking every N-th sample of the batch from the r-th on (as
    DistributedSampler deals them), each on one thread (as the scripts' workers run). The
    same arithmetic in the same order, so it follows an N-rank run past the horizon where
    any two summation orders drift apart (docs/drift.md).
    fp64: everything in float64, from the fp32 initial weights and data cast (as --fp64 does).
    experts, top_k, balance: a mixture of experts in every block (--experts, --top-k), trained
    on each of `accum` micro-batches' loss plus `balance` x its load-balancing loss (which,
    unlike the cross-entropy, depends on how the batch is cut: --accum-steps); routed: if a
    list, the tokens each expert got, (blocks, experts), over the whole run, appended at the end.
    """
    dtype = torch.float64 if fp64 else torch.float32
    torch.manual_seed(seed)
    model = SimpleModel(hidden, blocks, heads, experts, top_k).to(dtype)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    x, y = make_dataset().tensors  # token ids: integers in any precision
    steps_per_epoch = len(x) // batch_size  # the tail of each epoch is dropped
    losses, tokens = [], 0
    for step in range(steps):
        epoch, k = divmod(step, steps_per_epoch)
        if k == 0:  # a fresh permutation each epoch, drawn from seed + epoch
            order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
        batch = order[k * batch_size:(k + 1) * batch_size]
        optimizer.zero_grad()
        if experts:
            loss = 0.0
            for micro in batch.chunk(accum):
                part = token_loss(model(x[micro]), y[micro])
                tokens = tokens + torch.stack([b.moe.routed[0] for b in model.blocks.values()])
                part = (part + balance * moe_balance_loss(model, top_k)) / accum
                part.backward()
                loss += part.detach()
        elif ranks == 1:
            loss = token_loss(model(x[batch]), y[batch])
            loss.backward()
        else:
            loss, grads = 0.0, []
            for r in range(ranks):
                part = token_loss(model(x[batch[r::ranks]]), y[batch[r::ranks]])
                grads.append(torch.autograd.grad(part, list(model.parameters())))
                loss += part.detach() / ranks
            for p, *g in zip(model.parameters(), *grads):
                p.grad = sum(gi / ranks for gi in g)
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        if norms is not None:
            norms.append(norm.item())
        optimizer.step()
        losses.append(loss.item())
    if routed is not None and experts:
        routed.append(tokens.detach())
    return initial, model.state_dict(), losses


def reference_val_loss(weights, hidden, blocks, heads, experts=0, top_k=1):
    """The exact mean cross-entropy per token of `weights` over the whole held-out set, in
    float64: one forward over all of it, no batches, no ranks."""
    model = SimpleModel(hidden, blocks, heads, experts, top_k).double()
    model.load_state_dict(weights)
    x, y = make_dataset("val").tensors
    with torch.no_grad():
        return token_loss(model(x), y).item()
