"""The oracle: one device's training, written as plainly as possible, from the architecture's
description, not from its code.

It imports nothing it checks: neither the scripts nor the model's forward. Only the initial
weights (SimpleModel's state_dict for a seed) and the data (make_dataset) come from common.py;
everything computed from them is written here, from what docs/course.md and common.py's
docstrings say the model is:

    tokens -> embed + pos -> blocks -> LayerNorm `norm` -> `output` (logits)
    block:  x + o(causal multi-head attention of q, k, v of attn_norm(x)), then
            x + down(GELU(up(mlp_norm(x))))            (dense)
            x + sum over its k best experts e of p_e x down_e(GELU(up_e(mlp_norm(x))))
                (a mixture: p the router's softmax, not renormalized over the k; dropless)
    loss:   mean cross-entropy of every next token that counts, over the whole batch
            (a target of -100 does not count: a prompt's, padding) (+ --balance x the
            Switch/GShard load-balancing loss E x sum_e f_e P_e, averaged over the blocks,
            with a mixture, per micro-batch, over its tokens whose targets count)

So a changed line in the model's forward (a softmax over the wrong axis, the causal mask
dropped, the top-k renormalized) moves the model away from this oracle, and every proof
fails. Every strategy in this collection must end with the weights this loop ends with.
"""

import math

import torch

from common import SimpleModel, make_dataset

LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which the model uses


def layer_norm(x, weight, bias):
    """Normalize each token's vector to mean 0 and variance 1 (biased), then scale and shift."""
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + LAYER_NORM_EPS) * weight + bias


def linear(x, w, prefix):
    """x W^T + b, where the layer named `prefix` has a bias (k has none)."""
    y = x @ w[prefix + ".weight"].T
    bias = w.get(prefix + ".bias")
    return y if bias is None else y + bias


def gelu(x):
    """GELU, exact: x times the standard normal's CDF at x."""
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def attention(x, w, prefix, heads, doc):
    """Causal multi-head self-attention: each head's query at position t weighs the values of
    positions 0..t of its own document (`doc`: each token's document number) by the softmax of
    its scaled dot products with their keys."""
    batch, seq, width = x.shape
    q, k, v = (linear(x, w, f"{prefix}.{name}").reshape(batch, seq, heads, width // heads)
               .permute(0, 2, 1, 3) for name in ("q", "k", "v"))  # (batch, heads, seq, d)
    scores = q @ k.transpose(-1, -2) / math.sqrt(width // heads)  # (batch, heads, seq, seq)
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)  # key after query: masked
    other = doc[:, None, :, None] != doc[:, None, None, :]  # another document's key: masked
    weights = torch.softmax(scores.masked_fill(future | other, float("-inf")), dim=-1)
    y = (weights @ v).permute(0, 2, 1, 3).reshape(batch, seq, width)
    return linear(y, w, f"{prefix}.o")


def feed_forward(x, w, prefix):
    return linear(gelu(linear(x, w, f"{prefix}.up")), w, f"{prefix}.down")


def mixture(x, w, prefix, experts, top_k, counted=None):
    """Each token through its top_k experts by router probability, their outputs added up
    weighted by those probabilities (not renormalized). Written densely: every expert runs on
    every token and a token's weight for an expert it did not choose is 0. Returns the output
    and the routing statistics: the token slots each expert got (integers) and the router's
    probabilities summed over the tokens, those whose targets count (`counted`, a mask) if
    given."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(tokens @ w[f"{prefix}.router.weight"].T, dim=-1)  # (tokens, E)
    top = probs.topk(top_k, dim=-1).indices  # (tokens, k)
    chosen = torch.zeros_like(probs, dtype=torch.bool).scatter(1, top, True)
    gate = probs * chosen  # p_e where e is among the token's k best, else 0
    out = sum(gate[:, e, None] * feed_forward(tokens, w, f"{prefix}.experts.{e}")
              for e in range(experts))
    keep = torch.ones(len(tokens), dtype=torch.bool) if counted is None else counted.reshape(-1)
    return out.reshape(x.shape), (chosen[keep].sum(0), probs[keep].sum(0))


def forward(w, x, heads, experts=0, top_k=1, bos=None, counted=None):
    """Logits (batch, seq, vocabulary) of the weights `w` (a state_dict's names) for tokens x,
    and per block the routing statistics of a mixture (else an empty list). bos: packed
    documents, each begun by this token: a token's position counts from its document's start,
    and it attends within its document only. counted: the routing statistics of those
    tokens only (a mask)."""
    blocks = len({name.split(".")[1] for name in w if name.startswith("blocks.")})
    doc = torch.zeros_like(x) if bos is None else (x == bos).cumsum(dim=1)
    position = torch.zeros_like(x)
    for t in range(1, x.shape[1]):  # one more than the token before, 0 at a document's start
        position[:, t] = torch.where(doc[:, t] == doc[:, t - 1], position[:, t - 1] + 1, 0)
    h = w["embed.weight"][x] + w["pos.weight"][position]
    routing = []
    for i in range(blocks):
        b = f"blocks.{i}"
        h = h + attention(layer_norm(h, w[f"{b}.attn_norm.weight"], w[f"{b}.attn_norm.bias"]),
                          w, f"{b}.attn", heads, doc)
        normed = layer_norm(h, w[f"{b}.mlp_norm.weight"], w[f"{b}.mlp_norm.bias"])
        if experts:
            out, stats = mixture(normed, w, f"{b}.moe", experts, top_k, counted)
            routing.append(stats)
            h = h + out
        else:
            h = h + feed_forward(normed, w, b)
    return linear(layer_norm(h, w["norm.weight"], w["norm.bias"]), w, "output"), routing


def token_sum(logits, targets):
    """The summed cross-entropy of every next token that counts: -log of the softmax at the
    right token, where the target is not -100."""
    counts = targets != -100
    log_probs = logits.log_softmax(dim=-1)
    picked = -log_probs.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return torch.where(counts, picked, torch.zeros_like(picked)).sum()


def counted(targets):
    """How many targets count: those that are not -100."""
    return (targets != -100).sum()


def token_loss(logits, targets):
    """The mean cross-entropy of the tokens that count."""
    return token_sum(logits, targets) / counted(targets)


def balance_loss(routing, top_k):
    """The Switch/GShard load-balancing loss E x sum_e f_e P_e of one forward, averaged over the
    blocks: f_e the share of the token slots expert e got, P_e its mean router probability."""
    losses = []
    for counts, prob_sums in routing:
        tokens = counts.sum() // top_k  # integers: a token's k slots go to k experts
        share = counts.to(prob_sums.dtype) / (tokens * top_k)
        losses.append(len(counts) * (share * (prob_sums / tokens)).sum())
    return sum(losses) / len(losses)


def initial_weights(seed, hidden, blocks, heads, experts=0, top_k=1):
    """The model's starting weights for `seed`: what every script builds (from common.py)."""
    torch.manual_seed(seed)
    return SimpleModel(hidden, blocks, heads, experts, top_k).state_dict()


def reference_train(steps, batch_size, lr, seed, hidden, blocks, heads, clip=None, ranks=1,
                    fp64=False, norms=None, experts=0, top_k=1, balance=0.01, accum=1,
                    routed=None, data=None, bos=None, sgd=False):
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
    data: the training set, if not make_dataset()'s (a user's, with targets of -100). Every
    step's loss is divided by the count of the whole batch's targets that count. bos: the
    data is packed documents, each begun by this token (forward()). sgd: plain SGD at lr (no
    momentum) instead of Adam.
    """
    dtype = torch.float64 if fp64 else torch.float32
    initial = {name: t.to(dtype) for name, t in
               initial_weights(seed, hidden, blocks, heads, experts, top_k).items()}
    w = {name: t.clone().requires_grad_() for name, t in initial.items()}
    params = list(w.values())
    optimizer = torch.optim.SGD(params, lr=lr) if sgd else torch.optim.Adam(params, lr=lr)
    x, y = (make_dataset() if data is None else data).tensors  # token ids, in any precision
    steps_per_epoch = len(x) // batch_size  # the tail of each epoch is dropped
    losses, tokens = [], 0
    for step in range(steps):
        epoch, k = divmod(step, steps_per_epoch)
        if k == 0:  # a fresh permutation each epoch, drawn from seed + epoch
            order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
        batch = order[k * batch_size:(k + 1) * batch_size]
        optimizer.zero_grad()
        count = counted(y[batch])  # the whole batch's, whatever the micro-batches or ranks
        if experts:
            loss = 0.0
            for micro in batch.chunk(accum):
                logits, routing = forward(w, x[micro], heads, experts, top_k, bos,
                                          counted=y[micro] != -100)
                tokens = tokens + torch.stack([counts for counts, _ in routing])
                part = (token_sum(logits, y[micro]) / count
                        + balance * balance_loss(routing, top_k) / accum)
                part.backward()
                loss += part.detach()
        elif ranks == 1:
            loss = token_sum(forward(w, x[batch], heads, bos=bos)[0], y[batch]) / count
            loss.backward()
        else:
            loss, grads = 0.0, []
            for r in range(ranks):
                shard = batch[r::ranks]
                part = token_sum(forward(w, x[shard], heads, bos=bos)[0], y[shard]) * ranks / count
                grads.append(torch.autograd.grad(part, params))
                loss += part.detach() / ranks
            for p, *g in zip(params, *grads):
                p.grad = sum(gi / ranks for gi in g)
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if norms is not None:
            norms.append(norm.item())
        optimizer.step()
        losses.append(loss.item())
    if routed is not None and experts:
        routed.append(tokens)
    final = {name: t.detach().clone() for name, t in w.items()}
    return initial, final, losses


def reference_diloco(steps, batch_size, lr, seed, hidden, blocks, heads, ranks, inner_steps,
                     outer_lr, outer_momentum, sgd=False, clip=None, fp64=False, norms=None):
    """DiLoCo on `ranks` replicas, one after the other in one process. Return (initial weights,
    the outer weights after the last complete round, each step's loss: the mean of the
    replicas' losses).

    Replica r trains its own weights on every N-th sample of each global batch from the r-th
    on (its DistributedSampler shard), its loss the mean over its own shard's targets that
    count, stepped by its own optimizer (Adam, or plain SGD if `sgd`, at lr, its state never
    reset), its gradient clipped to `clip` by its own norm. norms: if a list, replica 0's
    gradient norm (before clipping) of each step is appended. After every inner_steps-th step
    the pseudo-gradient g = mean over r of (outer - w_r); Nesterov's SGD, written out:
    buf = m buf + g (buf = g the first time), outer -= outer_lr (g + m buf), or
    outer -= outer_lr g at m = 0; then every replica's weights are set to the outer ones.
    """
    dtype = torch.float64 if fp64 else torch.float32
    initial = {name: t.to(dtype) for name, t in
               initial_weights(seed, hidden, blocks, heads).items()}
    outer = {name: t.clone() for name, t in initial.items()}
    replicas = [{name: t.clone().requires_grad_() for name, t in initial.items()}
                for _ in range(ranks)]
    optimizers = [(torch.optim.SGD if sgd else torch.optim.Adam)(list(w.values()), lr=lr)
                  for w in replicas]
    momentum = None
    x, y = make_dataset().tensors
    steps_per_epoch = len(x) // batch_size
    losses = []
    for step in range(steps):
        epoch, k = divmod(step, steps_per_epoch)
        if k == 0:
            order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
        batch = order[k * batch_size:(k + 1) * batch_size]
        loss = 0.0
        for r, (w, optimizer) in enumerate(zip(replicas, optimizers)):
            shard = batch[r::ranks]
            optimizer.zero_grad()
            part = token_loss(forward(w, x[shard], heads)[0], y[shard])  # its own count
            part.backward()
            params = list(w.values())
            if clip:
                norm = torch.nn.utils.clip_grad_norm_(params, clip)
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            if norms is not None and r == 0:
                norms.append(norm.item())
            optimizer.step()
            loss += part.item() / ranks
        losses.append(loss)
        if (step + 1) % inner_steps == 0:
            with torch.no_grad():
                g = {name: sum(outer[name] - w[name] for w in replicas) / ranks for name in outer}
                if outer_momentum:
                    momentum = (g if momentum is None else
                                {n: outer_momentum * momentum[n] + g[n] for n in g})
                    g = {n: g[n] + outer_momentum * momentum[n] for n in g}
                outer = {n: outer[n] - outer_lr * g[n] for n in outer}
                for w in replicas:
                    for name, t in w.items():
                        t.copy_(outer[name])
    return initial, outer, losses


def reference_val_loss(weights, hidden, blocks, heads, experts=0, top_k=1, data=None,
                       bos=None):
    """The exact mean cross-entropy per counted token of `weights` over the whole held-out set
    (`data`, if not make_dataset("val")'s; bos: packed, as forward()), in float64: one forward
    over all of it, no batches, no ranks. (hidden and blocks: the weights' own shapes say
    them; kept for the callers' symmetry.)"""
    w = {name: t.double() for name, t in weights.items()}
    x, y = (make_dataset("val") if data is None else data).tensors
    with torch.no_grad():
        return token_loss(forward(w, x, heads, experts, top_k, bos)[0], y).item()
