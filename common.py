"""The shared SimpleModel: the model every script trains, its data and its loss. Nothing else.

A small causal transformer, GPT-2's shape in miniature, with an optional mixture of experts.
Scripts change it only at its extension points: Attention.attend (cp.py), MoE.run_experts
(ep.py), SimpleModel.tp_plan (tp.py, nd.py), SimpleModel.blocks (pipeline stages). Your own
model replaces SimpleModel here (docs/questions.md#putting-your-own-model-in). plumbing/ holds
what every script shares and no lesson teaches: you need not open it.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 32  # token ids 0..31
SEQ_LEN = 16  # tokens a sequence feeds the model; scored on the next token at each
PERIOD = SEQ_LEN // 2  # a sequence is PERIOD random tokens, repeated (see make_dataset)
DATASET_SIZE = 2048  # training sequences
VAL_SIZE = 1000  # held-out sequences
MLP_RATIO = 4  # a block's inner width, in multiples of its hidden width
DATA_SEED = 1234  # fixed: the task is the same whatever --seed says; --seed moves init and order
DATA = ("repeat", "padded", "prompt", "packed")  # --data: the kinds make_dataset makes
BOS = 0  # --data packed: the token that begins each document (SimpleModel.bos)
IGNORE = -100  # a target that does not count: cross_entropy skips it, the counts leave it out


class Attention(nn.Module):
    """Causal multi-head self-attention. Separate q, k, v: tp.py gives each rank whole heads."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.head_width = hidden // heads  # not a count: heads are as many as q holds (tp.py)
        self.q = nn.Linear(hidden, hidden)
        # No bias on k: softmax ignores it, and Adam turns its rounding-noise gradient into steps.
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, hidden)
        self.o = nn.Linear(hidden, hidden)

    def forward(self, x, docs=None):
        batch, seq, _ = x.shape
        # (batch, seq, width) -> (batch, heads, seq, head_width): attention runs per head.
        q, k, v = (proj(x).view(batch, seq, -1, self.head_width).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        y = self.attend(q, k, v, docs)
        return self.o(y.transpose(1, 2).reshape(batch, seq, -1))

    def attend(self, q, k, v, docs=None):
        """Each query's weighted sum of the values at or before it, in its document if `docs`
        (documents()) says where each begins. cp.py's: across ranks."""
        # is_causal: token t attends to tokens 0..t only: it cannot read what it must predict.
        if docs is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        same = docs[:, None, :, None] == docs[:, None, None, :]  # (batch, 1: all heads, q, k)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=same.tril())


class Expert(nn.Module):
    """One expert of a mixture: a dense block's feed-forward, `up`, GELU, `down`."""

    def __init__(self, hidden):
        super().__init__()
        self.up = nn.Linear(hidden, MLP_RATIO * hidden)
        self.down = nn.Linear(MLP_RATIO * hidden, hidden)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """A mixture of feed-forwards: a router's softmax scores each token for every expert, the
    token goes to its top_k best, their outputs added up weighted by its probabilities, not
    renormalized (with k = 1 that is 1: the router would learn nothing). Dropless (docs/moe.md)."""

    def __init__(self, hidden, experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        # Keyed "0", "1", ...: ep.py deletes those a rank does not hold; the rest keep names.
        self.experts = nn.ModuleDict({str(e): Expert(hidden) for e in range(experts)})

    def forward(self, x):
        tokens = x.flatten(0, -2)  # (batch x sequence, hidden): each token on its own
        logits = self.router(tokens)
        # In fp32 at least, whatever the compute dtype: summed over every token below.
        probs = F.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (tokens, k): the k best experts
        # Per token, for routed(): its k experts as 0s and 1s (exact integers), its probabilities
        self.routed = (torch.zeros_like(probs, dtype=torch.int64).scatter_(1, chosen, 1), probs)
        return self.run_experts(tokens, weights, chosen).view_as(x)

    def run_experts(self, tokens, weights, chosen):
        """Each token through its k experts, added up by weight (ep.py's: across ranks)."""
        out = torch.zeros_like(tokens)
        for e, expert in self.experts.items():
            token, slot = torch.where(chosen == int(e))  # the tokens that chose e, and the slot
            share = weights[token, slot, None] * expert(tokens[token])
            out = out.index_add(0, token, share.to(out.dtype))  # (under autocast: 16 bits)
        return out


class Block(nn.Module):
    """A pre-norm block (as GPT-2 and Llama): x + attn(norm(x)), then x + the feed-forward
    (`up`, `down`) or the mixture (`moe`) of norm(x). tp_plan: two all-reduces each way."""

    def __init__(self, hidden, heads, experts=0, top_k=1):
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.mlp_norm = nn.LayerNorm(hidden)
        self.moe = MoE(hidden, experts, top_k) if experts else None
        if not experts:
            self.up = nn.Linear(hidden, MLP_RATIO * hidden)
            self.down = nn.Linear(MLP_RATIO * hidden, hidden)

    def forward(self, x, docs=None):
        x = x + self.attn(self.attn_norm(x), docs=docs)  # by keyword: tp.py's hooks take x
        if self.moe is not None:
            return x + self.moe(self.mlp_norm(x))
        # GELU, as GPT-2: ReLU's kink parts correct fp32 runs' gradients near 0 (docs/drift.md).
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class SimpleModel(nn.Module):
    """Tokens -> embedding + position embedding -> `blocks` x Block -> LayerNorm -> `output`
    (logits at every position). No dropout (its masks are each process's own); LayerNorm,
    unlike BatchNorm, ignores which samples share a rank."""

    # What tp.py cuts, by name ("*": any block), and how: as Hugging Face's base_model_tp_plan.
    tp_plan = {"blocks.*.attn_norm": "norm", "blocks.*.attn": "shared_input",
               "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise",
               "blocks.*.attn.v": "colwise", "blocks.*.attn.o": "rowwise",
               "blocks.*.mlp_norm": "norm", "blocks.*.up": "colwise", "blocks.*.down": "rowwise",
               "norm": "norm", "output": "head"}

    def __init__(self, hidden=64, blocks=4, heads=4, experts=0, top_k=1, bos=None):
        super().__init__()
        self.bos = bos  # a packed batch's documents begin at this token (None: one per sequence)
        self.embed = nn.Embedding(VOCAB, hidden)
        self.pos = nn.Embedding(SEQ_LEN, hidden)  # learned: one vector per position
        # Keyed "0", "1", ...: a pipeline stage deletes the blocks it does not own, and the rest
        # keep the full model's names (its state_dict is a slice of the full one).
        self.blocks = nn.ModuleDict({str(i): Block(hidden, heads, experts, top_k)
                                     for i in range(blocks)})
        self.norm = nn.LayerNorm(hidden)
        # Untied from `embed` (GPT-2 ties them): a pipeline would hold a tied weight on its first
        # and last stages (pipeline.py refuses it). Untied, every parameter lives in one place.
        self.output = nn.Linear(hidden, VOCAB)

    def forward(self, x, positions=None, docs=None):
        if self.embed is not None:  # a pipeline's later stages take activations, not tokens
            # positions: where x's tokens sit in their sequences (pieces of them under cp.py)
            if positions is None:
                positions = torch.arange(x.shape[1], device=x.device)
            docs = documents(x, self.bos) if docs is None and self.bos is not None else docs
            # Packed, each document's positions restart at 0, as if it were alone
            x = self.embed(x) + self.pos(positions if docs is None else positions - docs)
        for block in self.blocks.values():
            x = block(x, docs=docs)
        if self.output is not None:  # only the last stage has the head
            x = self.output(self.norm(x))
        return x

    @classmethod
    def from_args(cls, args):
        """The model the flags describe, or a ValueError that parse_args prints in one line."""
        if args.hidden % args.heads:
            raise ValueError(f"--heads {args.heads} must divide --hidden {args.hidden} (each head "
                             f"takes --hidden / --heads of it); use a divisor of {args.hidden}")
        if args.experts < 0 or args.experts and args.top_k > args.experts:
            raise ValueError(f"--experts {args.experts} --top-k {args.top_k}: need 0 experts "
                             "(dense), or at least --top-k of them")
        bos = BOS if getattr(args, "data", None) == "packed" else None
        return cls(args.hidden, args.blocks, args.heads, args.experts, args.top_k, bos)

    def flops_per_sample(self):
        """Training FLOPs of a sequence as MFU counts them (nanoGPT's), by shape: sharded too."""
        dense = sum(m.in_features * m.out_features for m in self.modules()
                    if isinstance(m, nn.Linear))
        for m in (m for m in self.modules() if isinstance(m, MoE)):  # a token meets top_k
            expert = sum(2 * e.up.weight.numel() for e in m.experts.values())
            dense -= (len(m.experts) - m.top_k) * expert // len(m.experts)
        attention = sum(12 * m.o.in_features * SEQ_LEN for m in self.modules()
                        if isinstance(m, Attention))
        return SEQ_LEN * (6 * dense + attention)

    def routed(self, counted=None):
        """Every block's MoE.routed from the last forward, summed over the tokens that count
        (`counted`: a mask of them, as the targets'; None: all): (blocks, 2, experts)."""
        keep = 1 if counted is None else counted.flatten()[:, None]  # (no host sync: no indexing)
        sums = [((slots * keep).sum(dim=0).to(probs.dtype), (probs * keep).sum(dim=0))
                for slots, probs in (block.moe.routed for block in self.blocks.values())]
        return torch.stack([torch.stack(pair) for pair in sums])


def balance_loss(routed, top_k):
    """The Switch/GShard load-balancing loss, E x sum over experts of f_e x P_e (f_e: expert e's
    share of the token slots, at most 1/k; P_e: its mean router probability), averaged over the
    blocks: 1 when balanced (always, with k = E), up to E/k. Only P carries a gradient. From
    `routed` summed over the ranks that share one device's micro-batch (a product of means)."""
    tokens = (routed[0, 0].sum() / top_k).clamp(min=1)  # none that count: 0, not 0/0
    share, mean_prob = routed[:, 0] / (tokens * top_k), routed[:, 1] / tokens
    return routed.shape[-1] * (share * mean_prob).sum(dim=-1).mean()


def loss_fn(logits, targets, reduction="mean"):
    """Cross-entropy per token; "sum" adds up across batches and ranks (evaluation's sums)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)


def documents(x, bos):
    """Where each token's document begins: the index of the last `bos` at or before it (0
    before the first), shape (batch, sequence). Tokens in one document share it."""
    index = torch.arange(x.shape[-1], device=x.device).expand_as(x)
    return torch.where(x == bos, index, 0).cummax(dim=-1).values


def make_dataset(split="train", kind="repeat"):
    """Sequences only attention can learn, the same every time (its own generator): PERIOD
    random tokens, then the same again, inputs tokens 0..15 and targets 1..16. The first
    PERIOD - 1 targets are random, so the held-out loss falls from ln(32) = 3.47 only towards
    (PERIOD - 1) / SEQ_LEN x ln(VOCAB) = 1.52, as far as attention learns to look back. "val":
    VAL_SIZE others. kind, --data (docs/counts.md): "padded", each its own length, then padding;
    "prompt", a first part that does not count; "packed", 2 or 3 documents each begun by BOS."""
    if split not in ("train", "val") or kind not in DATA:
        raise ValueError(f"make_dataset({split!r}, {kind!r}): 'train' or 'val', and one of {DATA}")
    g = torch.Generator().manual_seed(DATA_SEED)
    first = torch.randint(VOCAB, (DATASET_SIZE, PERIOD), generator=g)
    if split == "val":
        first = torch.randint(VOCAB, (VAL_SIZE, PERIOD), generator=g)
    tokens = first.repeat(1, 3)[:, :SEQ_LEN + 1]
    # The layouts draw after the tokens: those stay --data repeat's
    cut = torch.randint(2, SEQ_LEN - 1, (len(tokens), 2), generator=g).sort(dim=1).values
    where, ignore = torch.arange(SEQ_LEN + 1), torch.zeros_like(tokens, dtype=torch.bool)
    if kind == "padded":  # inputs 0..cut+1 real, the last with no target; then padding (any id)
        tokens, ignore = tokens.masked_fill(where > cut[:, 1:] + 1, BOS), where > cut[:, 1:]
    if kind == "prompt":
        ignore = where < cut[:, :1]
    if kind == "packed":  # documents begin at 0, cut[0] and, in odd rows, cut[1]
        cut[::2, 1] = cut[::2, 0]
        begins = torch.zeros_like(ignore).scatter_(1, F.pad(cut, (1, 0)), True)
        start = documents(begins.long(), 1)  # where each token's document begins
        repeat = start + 1 + (where - start - 1).clamp(min=0) % 3  # BOS, a b c a b c a...
        tokens = tokens.masked_fill(tokens == BOS, 1).gather(1, repeat)
        tokens, ignore = tokens.masked_fill(begins, BOS), begins.roll(-1, dims=1)
    return torch.utils.data.TensorDataset(tokens[:, :-1],
                                          tokens[:, 1:].masked_fill(ignore[:, :-1], IGNORE))


def seed_everything(seed):
    """Seed the global RNGs, so every process that builds SimpleModel gets the same weights."""
    torch.manual_seed(seed)  # also seeds every CUDA device
