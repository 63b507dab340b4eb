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


def reference_train(steps, batch_size, lr, seed, hidden, blocks, heads, clip=None, ranks=1,
                    fp64=False, norms=None):
    """Return (initial state_dict, final state_dict, loss of every step).

    clip: if given, the gradient norm is clipped to it before each step (the scripts' --clip).
    norms: if a list, each step's gradient norm (before clipping) is appended to it.
    ranks: the gradient as N data-parallel ranks add it up: the mean of N per-rank mean
    gradients, rank r taking every N-th sample of the batch from the r-th on (as
    DistributedSampler deals them), each on one thread (as the scripts' workers run). The
    same arithmetic in the same order, so it follows an N-rank run past the horizon where
    any two summation orders drift apart (docs/drift.md).
    fp64: everything in float64, from the fp32 initial weights and data cast (as --fp64 does).
    """
    dtype = torch.float64 if fp64 else torch.float32
    torch.manual_seed(seed)
    model = SimpleModel(hidden=hidden, blocks=blocks, heads=heads).to(dtype)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    x, y = make_dataset().tensors  # token ids: integers in any precision
    steps_per_epoch = len(x) // batch_size  # the tail of each epoch is dropped
    losses = []
    for step in range(steps):
        epoch, k = divmod(step, steps_per_epoch)
        if k == 0:  # a fresh permutation each epoch, drawn from seed + epoch
            order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
        batch = order[k * batch_size:(k + 1) * batch_size]
        optimizer.zero_grad()
        if ranks == 1:
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
    return initial, model.state_dict(), losses


def reference_val_loss(weights, hidden, blocks, heads):
    """The exact mean cross-entropy per token of `weights` over the whole held-out set, in
    float64: one forward over all of it, no batches, no ranks."""
    model = SimpleModel(hidden=hidden, blocks=blocks, heads=heads).double()
    model.load_state_dict(weights)
    x, y = make_dataset("val").tensors
    with torch.no_grad():
        return token_loss(model(x), y).item()
