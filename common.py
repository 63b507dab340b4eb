"""What every script in this collection shares and none of them teaches.

First the model and the data (read these: every script trains them); then, behind a banner,
the plumbing (flags and their checks, launching, checkpoints, the meter and the profiler) and
the diagnostics (`python common.py`). No technique lives here: each is in its own script, and
its diff against the one before shows it. Importing this file does nothing but define things.
"""

import argparse
import contextlib
import datetime
import functools
import json
import os
import pickle
import shutil
import socket
import sys
import sysconfig
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

try:
    import resource  # the peak memory of this process: Linux and macOS
except ImportError:  # Windows
    resource = None

VOCAB = 32  # token ids 0..31
SEQ_LEN = 16  # tokens a sequence feeds the model; scored on the next token at each
PERIOD = SEQ_LEN // 2  # a sequence is PERIOD random tokens, repeated (see make_dataset)
DATASET_SIZE = 2048  # training sequences
VAL_SIZE = 1000  # held-out sequences
MLP_RATIO = 4  # a block's inner width, in multiples of its hidden width
DATA_SEED = 1234  # fixed: the task is the same whatever --seed says; --seed moves init and order


class Attention(nn.Module):
    """Causal multi-head self-attention: q, k, v, attention within each head, and `o`, which
    mixes the heads back. Separate q, k, v: tp.py's column cut gives each rank whole heads of
    all three (a fused qkv must be laid out for it: docs/course.md#putting-your-own-model-in)."""

    def __init__(self, hidden, heads):
        super().__init__()
        # A head's width, not a count: the heads are as many as q, k and v hold, H on one
        # device, H/T on a rank of tp.py's (a count kept here would split those into H).
        self.head_width = hidden // heads
        self.q = nn.Linear(hidden, hidden)
        # No bias on k: softmax ignores what it adds to all of a query's scores alike, so its
        # gradient is rounding noise, which Adam turns into full-size steps: drift, no learning.
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, hidden)
        self.o = nn.Linear(hidden, hidden)

    def forward(self, x):
        batch, seq, _ = x.shape
        # (batch, seq, width) -> (batch, heads, seq, head_width): attention runs per head.
        q, k, v = (proj(x).view(batch, seq, -1, self.head_width).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        y = self.attend(q, k, v)
        return self.o(y.transpose(1, 2).reshape(batch, seq, -1))

    def attend(self, q, k, v):
        """Each query's weighted sum of the values of the keys at or before its position.
        cp.py puts its own here, for a rank that holds pieces of each sequence."""
        # is_causal: token t attends to tokens 0..t only, so it cannot read the token it is
        # asked to predict. PyTorch picks the kernel (flash, memory-efficient, or plain math).
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Expert(nn.Module):
    """One expert of a mixture: a dense block's feed-forward, `up`, GELU, `down`."""

    def __init__(self, hidden):
        super().__init__()
        self.up = nn.Linear(hidden, MLP_RATIO * hidden)
        self.down = nn.Linear(MLP_RATIO * hidden, hidden)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """A mixture of `experts` feed-forwards (--experts, --top-k k): a router's softmax scores
    each token for every expert, the token goes to its k best, their outputs added up weighted
    by its probabilities: not renormalized (with k = 1 that would be 1, and the router would
    learn nothing from the loss). Dropless: no capacity (docs/moe.md)."""

    def __init__(self, hidden, experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        # Keyed "0", "1", ...: ep.py deletes those a rank does not hold; the rest keep names.
        self.experts = nn.ModuleDict({str(e): Expert(hidden) for e in range(experts)})

    def forward(self, x):
        tokens = x.flatten(0, -2)  # (batch x sequence, hidden): each token on its own
        logits = self.router(tokens)
        # Probabilities in fp32 at least, whatever the compute dtype (autocast, bf16 weights):
        # they are summed over every token below, where bf16 keeps 8 bits.
        probs = F.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (tokens, k): the k best experts
        # For balance_loss: the token slots each expert got, counted as integers (bincount would
        # read back to the host on a GPU), and the router's probabilities summed (the gradient's
        # path), in fp32 at least: the counts exact up to 2**24 per micro-batch.
        slots = chosen.flatten()
        counts = torch.zeros_like(probs[0], dtype=torch.int64).scatter_add_(
            0, slots, torch.ones_like(slots))
        self.routed = torch.stack([counts.to(probs.dtype), probs.sum(dim=0)])
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
    (`up`, `down`) or the mixture (`moe`) of norm(x). Attention mixes positions, the
    feed-forward works on each alone. tp.py's plan: two all-reduces per block each way."""

    def __init__(self, hidden, heads, experts=0, top_k=1):
        super().__init__()
        self.attn_norm = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.mlp_norm = nn.LayerNorm(hidden)
        self.moe = MoE(hidden, experts, top_k) if experts else None
        if not experts:
            self.up = nn.Linear(hidden, MLP_RATIO * hidden)
            self.down = nn.Linear(MLP_RATIO * hidden, hidden)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        if self.moe is not None:
            return x + self.moe(self.mlp_norm(x))
        # GELU, as GPT-2: at ReLU's kink, two correct summation orders (ranks, GPU kernels) of
        # an input near 0 pass its gradient or not, and Adam parts fp32 runs (docs/drift.md).
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class SimpleModel(nn.Module):
    """A small causal language model: tokens -> embedding + position embedding -> `blocks` x
    Block -> final LayerNorm -> `output` (logits over the vocabulary at every position).

    GPT-2's shape in miniature (about 0.2 M parameters at the defaults). No dropout (its masks
    are each process's own); LayerNorm, unlike BatchNorm, ignores which samples share a rank.
    The blocks are a ModuleDict keyed "0", "1", ...: a pipeline stage deletes those it does not
    own and keeps the full model's parameter names (its state_dict is a slice of the full one).
    """

    # What tp.py cuts, by name ("*": any block), and how (tp.py's `styles`): the model's plan,
    # as Hugging Face's models carry theirs (base_model_tp_plan).
    tp_plan = {"blocks.*.attn_norm": "norm", "blocks.*.attn": "shared_input",
               "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise",
               "blocks.*.attn.v": "colwise", "blocks.*.attn.o": "rowwise",
               "blocks.*.mlp_norm": "norm", "blocks.*.up": "colwise", "blocks.*.down": "rowwise",
               "norm": "norm", "output": "head"}

    def __init__(self, hidden=64, blocks=4, heads=4, experts=0, top_k=1):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.pos = nn.Embedding(SEQ_LEN, hidden)  # learned: one vector per position
        self.blocks = nn.ModuleDict({str(i): Block(hidden, heads, experts, top_k)
                                     for i in range(blocks)})
        self.norm = nn.LayerNorm(hidden)
        # Untied from `embed` (GPT-2 ties them): a pipeline would hold a tied weight on its first
        # and last stages (pipeline.py refuses it). Untied, every parameter lives in one place.
        self.output = nn.Linear(hidden, VOCAB)

    def forward(self, x, positions=None):
        if self.embed is not None:  # a pipeline's later stages take activations, not tokens
            # positions: where x's tokens sit in their sequences (pieces of them under cp.py)
            if positions is None:
                positions = torch.arange(x.shape[1], device=x.device)
            x = self.embed(x) + self.pos(positions)
        for block in self.blocks.values():
            x = block(x)
        if self.output is not None:  # only the last stage has the head
            x = self.output(self.norm(x))
        return x

    @classmethod
    def from_args(cls, args):
        """The model that --hidden, --blocks, --heads, --experts and --top-k describe."""
        return cls(args.hidden, args.blocks, args.heads, args.experts, args.top_k)

    def routed(self):
        """MoE.routed of every block, from the last forward: (blocks, 2, experts)."""
        return torch.stack([block.moe.routed for block in self.blocks.values()])


def balance_loss(routed, top_k):
    """The Switch/GShard load-balancing loss, E x sum over experts of f_e x P_e (f_e: expert e's
    share of the token slots, at most 1/k; P_e: its mean router probability), averaged over the
    blocks: 1 when balanced (always, with k = E), up to E/k. Only P carries a gradient. From
    `routed` summed over the ranks that share one device's micro-batch (a product of means)."""
    tokens = routed[0, 0].sum() / top_k
    share, mean_prob = routed[:, 0] / (tokens * top_k), routed[:, 1] / tokens
    return routed.shape[-1] * (share * mean_prob).sum(dim=-1).mean()


def loss_fn(logits, targets, reduction="mean"):
    """Cross-entropy over every predicted token: logits (batch, seq, VOCAB), targets (batch,
    seq). reduction="sum" for sums that add up across batches and ranks (with targets.numel()
    tokens): evaluation divides once, at the end."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)


def make_dataset(split="train", dtype=torch.float32):
    """Token sequences with a structure only attention can learn, the same every time.

    Each sequence is PERIOD random tokens, then the same PERIOD tokens again (and the first
    once more): SEQ_LEN + 1 tokens, cut into the input (tokens 0..15) and the targets (1..16:
    the next token at each position). The first PERIOD - 1 targets are random and keep the
    loss above (PERIOD - 1) / SEQ_LEN x ln(VOCAB) = 1.52; from position PERIOD - 1 on, the next
    token is a copy of the one PERIOD back. So the held-out loss falls from ln(32) = 3.47
    towards 1.52 as far as attention learns to look back (the training loss can go lower by
    memorizing). split "train": DATASET_SIZE sequences; "val": VAL_SIZE others (3, 6 and 7
    ranks make DistributedSampler pad them). Its own generator: the global RNG is left alone.
    `dtype` does not change the tokens (integers): --fp64 trains on the same data.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    g = torch.Generator().manual_seed(DATA_SEED)
    first = torch.randint(VOCAB, (DATASET_SIZE, PERIOD), generator=g)
    if split == "val":
        first = torch.randint(VOCAB, (VAL_SIZE, PERIOD), generator=g)
    tokens = first.repeat(1, 3)[:, :SEQ_LEN + 1]
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def seed_everything(seed):
    """Seed the global RNGs, so every process that builds SimpleModel gets the same weights."""
    torch.manual_seed(seed)  # also seeds every CUDA device


# ---------------------------------------------------------------------------------------------
# Plumbing: what every script shares and none of them teaches. A learner can stop reading here:
# each piece says which scripts call it and why; the techniques live in the scripts.
# ---------------------------------------------------------------------------------------------


def positive(kind):
    """argparse type: a positive int or float, with an error that names the fix."""

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}")
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
        if value == float("inf") or value != value:  # float("inf"), float("nan") parse
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        return value

    return parse


def torch_older_than(major, minor):
    """Whether this torch is older than major.minor."""
    return tuple(int(v) for v in torch.__version__.split(".")[:2]) < (major, minor)


def compile_problem(use_cuda, fp64=False):
    """Why --compile cannot work on this machine, as a one-line error, or None if it can.

    torch.compile fails late and at length (a compiler's traceback from inside the first
    step, in every process) where it could be told at once what is missing.
    """
    try:  # on a Python it does not support, torch.compile says so at once
        torch.compile(lambda: None)
    except RuntimeError as e:
        return f"--compile: {e}; use a Python that torch.compile supports, or drop --compile"
    if not use_cuda:
        if shutil.which(os.environ.get("CXX", "g++")) is None:
            return ("--compile on the CPU: inductor compiles C++ and finds no compiler "
                    "(g++, or $CXX); install one (apt-get install g++) or drop --compile")
        # Measured: 2.10 and 2.12 crash in the first backward ("expected scalar type Double
        # but found Float" in the compiled causal attention's backward), 2.13 and 2.15 train.
        if fp64 and torch_older_than(2, 13):
            return (f"--compile with --fp64 on the CPU: torch {torch.__version__}'s compiled "
                    "attention fails in backward in float64 (pytorch/pytorch#185539); use "
                    "torch 2.13 or later, or drop one of the two flags")
        return None
    # On a GPU inductor writes Triton kernels, and Triton builds each kernel's launcher as a
    # small C extension module: with $CC, else gcc, else clang, against Python.h.
    if shutil.which(os.environ.get("CC", "")) is None and shutil.which("gcc") is None \
            and shutil.which("clang") is None:
        return ("--compile on a GPU: Triton builds its kernel launchers with a C compiler and "
                "finds none ($CC, gcc or clang); install one (apt-get install gcc) or drop "
                "--compile")
    if not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        return ("--compile on a GPU: Triton builds its kernel launchers against Python's "
                "headers and finds no Python.h; install them (apt-get install python3-dev) "
                "or drop --compile")
    return None


# --- The flags every script shares, and their checks. Each script's parse_args starts from
# shared_parser, adds its technique's flags to its groups, and calls check_shared_flags;
# the scripts that run several ranks then call launch_world. A learner can skip this: the
# flags are listed in docs/usage.md, and a bad one is refused in one line that names the fix. ---

def shared_parser(doc, accum=True, sharded=False, ranks=False, moe=True,
                  nproc_help="workers to start without torchrun (default: 1 per GPU, 2 on a CPU)"):
    """An ArgumentParser with the flags every script shares, in groups a script adds to
    (`parser.groups["hardware"]`, say): training, model, hardware, output. accum: the
    --accum-steps flag (pipeline.py has micro-batches instead). sharded: --checkpoint is a
    folder of shards (fsdp.py, tp.py), not a file. ranks: a script that runs several ranks,
    with --backend, --nproc (helped by nproc_help) and --timeout. moe=False: --experts is
    refused in one line (the script trains the dense model only)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.sharded, parser.moe = sharded, moe
    groups = parser.groups = {title: parser.add_argument_group(title)
                              for title in ("training", "model", "hardware", "output")}
    train = groups["training"]
    train.add_argument("--steps", type=positive(int), default=100, help="optimizer steps in all")
    train.add_argument("--batch-size", type=positive(int), default=64,
                       help="global batch: samples per optimizer step, over all ranks and "
                            "micro-batches")
    train.add_argument("--lr", type=positive(float), default=3e-3, help="Adam learning rate")
    train.add_argument("--seed", type=int, default=0, help="seeds the weights and the data order")
    train.add_argument("--fp64", action="store_true",
                       help="train in float64 (weights, data, Adam's state, every collective): "
                            "slower, but a correct strategy then ends within 1e-9 of "
                            "single.py --fp64 (its rounding: ~1e-13), so a gap is a bug")
    if accum:
        train.add_argument("--accum-steps", type=positive(int), default=1,
                           help="micro-batches accumulated per optimizer step")
    train.add_argument("--clip", type=float, default=0.0,
                       help="clip the gradient norm to this, e.g. 1.0 (default 0: no clipping, "
                            "so the defaults train exactly like every other script)")
    train.add_argument("--log-every", type=positive(int), default=20, help="steps between logs")
    train.add_argument("--eval-every", type=positive(int), default=25,
                       help="steps between evaluations on the held-out set (and at the end)")
    model = groups["model"]
    model.add_argument("--hidden", type=positive(int), default=64, help="width of each block")
    model.add_argument("--blocks", type=positive(int), default=4, help="transformer blocks")
    model.add_argument("--heads", type=positive(int), default=4,
                       help="attention heads per block (must divide --hidden)")
    model.add_argument("--experts", type=int, default=0, metavar="E",
                       help="a mixture of E experts in place of each block's feed-forward "
                            "(default 0: the dense model)")
    model.add_argument("--top-k", type=positive(int), default=1, metavar="K",
                       help="experts each token goes to (with --experts)")
    model.add_argument("--balance", type=float, default=0.01, metavar="C",
                       help="the load-balancing loss's coefficient (with --experts)")
    hardware = groups["hardware"]
    hardware.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                          help="auto: CUDA if available, else CPU")
    hardware.add_argument("--compile", action="store_true",
                          help="compile each block with torch.compile (inductor)")
    hardware.add_argument("--activation-checkpointing", action="store_true",
                          help="drop each block's activations after forward and recompute "
                               "them in backward: less memory, about one more forward")
    if ranks:
        hardware.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                              help="auto: NCCL where every rank has a GPU of its own, else gloo")
        hardware.add_argument("--nproc", type=positive(int), default=None, help=nproc_help)
        # PyTorch's default, 10 minutes: a shorter one kills a healthy job while one rank is
        # busy alone (writing a checkpoint, compiling). The tests pass a short one, to fail fast.
        hardware.add_argument("--timeout", type=positive(float), default=600.0,
                              help="seconds a collective (or a send) may wait for a peer "
                                   "before the job fails")
    output = groups["output"]
    output.add_argument("--save", metavar="PATH", help="write the final weights (a state_dict)")
    output.add_argument("--profile", metavar="DIR",
                        help="write a Chrome trace of steps 5-7 per rank into DIR "
                             "(torch.profiler; open in ui.perfetto.dev)")
    output.add_argument("--checkpoint", metavar="PATH",
                        help="a folder: resume from it if it holds one; write sharded state "
                             "there" if sharded else
                             "resume from PATH if it exists; write model, optimizer, step there")
    output.add_argument("--checkpoint-every", type=positive(int), default=50, metavar="N",
                        help="write --checkpoint every N steps (and at the end)")
    return parser


def check_shared_flags(parser, args, compile_check=True):
    """Refuse a bad shared flag in one line (parser.error: usage, the line, exit 2). Returns
    whether this run uses CUDA. compile_check=False: the script says itself why it refuses
    --compile (dataparallel.py)."""
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here; use --device cpu (or auto)")
    problem = compile_problem(use_cuda, args.fp64) if args.compile and compile_check else None
    if problem:  # no compiler, say
        parser.error(problem)
    if args.hidden % args.heads:
        parser.error(f"--heads {args.heads} must divide --hidden {args.hidden} (each head takes "
                     f"--hidden / --heads of it); use a divisor of {args.hidden}")
    # One process: the batch divides into micro-batches. Several ranks: launch_world's caller
    # checks the batch against ranks x micro-batches, with the message that names both.
    if "nproc" not in args and args.batch_size % getattr(args, "accum_steps", 1):
        parser.error(f"--batch-size {args.batch_size} must be divisible by "
                     f"--accum-steps {args.accum_steps}; use a multiple of {args.accum_steps}")
    if getattr(parser, "sharded", False) and not use_cuda and torch_older_than(2, 9):
        # fsdp.py and tp.py's 2D: older ones sum FSDP's gradients over gloo, not average them
        parser.error(f"torch {torch.__version__}: FSDP on CPU (gloo) needs torch 2.9 or later "
                     "(older ones sum the gradients: docs/torch-versions.md); upgrade torch")
    if args.experts and not parser.moe:
        parser.error(f"--experts: {parser.prog} trains the dense model only; use single.py, "
                     "ddp.py or fsdp.py for a mixture of experts")
    if not 0 <= args.experts or args.experts and not args.top_k <= args.experts:
        parser.error(f"--experts {args.experts} --top-k {args.top_k}: need 0 experts (dense), "
                     "or at least --top-k of them")
    if not 0 <= args.balance < float("inf"):
        parser.error(f"--balance {args.balance}: must be 0 or a positive, finite coefficient")
    if args.experts and args.top_k == args.experts and args.balance:
        parser.error(f"--top-k {args.top_k} --experts {args.experts}: every token goes to every "
                     "expert, so the balancing loss is the constant 1; add --balance 0")
    if not 0 <= args.clip < float("inf"):  # nan too: it would train into nan
        parser.error(f"--clip {args.clip}: must be 0 (no clipping) or a positive, finite norm")
    if args.batch_size > DATASET_SIZE:
        parser.error(f"--batch-size {args.batch_size} is larger than the dataset "
                     f"({DATASET_SIZE} samples); use at most {DATASET_SIZE}")
    for flag, path in (("--save", args.save), ("--checkpoint", args.checkpoint)):
        if path and not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
            parser.error(f"{flag} {path}: its folder does not exist or is not writable; "
                         "create it first")
    return use_cuda


def launch_world(parser, args, width=None, own_gpus=True, data_parallel=True, stages=False):
    """(world size, ranks on this machine, GPUs on it) of a script that runs several ranks,
    with the checks every such script shares: torchrun's ranks, or --nproc workers (default: one per
    GPU, 2 on a CPU, or fewer where that many would not divide the batch, nor `width`: what TP
    cuts; stages: pipeline.py's, one stage per GPU, at most one per block); each rank's own GPU
    (own_gpus; ddp.py lets gloo ranks share one); a --backend that carries this device's
    tensors; and (data_parallel: every rank trains on its own shard of each batch, as in ddp.py
    and fsdp.py) a batch the ranks' micro-batches divide. Call it after check_shared_flags."""
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    gpus = machine_gpus() if use_cuda else 0
    if stages:
        default = min(gpus or 2, args.blocks)
        hint = f"one stage per block; pass --blocks {gpus} to use all"
    else:
        accum = getattr(args, "accum_steps", 1)  # pipelines have micro-batches instead
        default = most_workers(gpus, args.batch_size, accum, width)
        heads = f" (and --heads a multiple of {gpus})" if width is not None else ""
        hint = (f"the most that divide --batch-size {args.batch_size}; pass a multiple of "
                f"{gpus * accum}{heads} to use all")
    world_size, local_world = ranks(args, default, gpus, hint)
    if own_gpus and use_cuda and local_world > gpus and "RANK" not in os.environ:
        # else setup() tells; DDP's fallback (gloo ranks sharing a GPU) does not carry over.
        parser.error(f"{local_world} ranks on this machine but {gpus} GPU(s): NCCL needs one "
                     "GPU per rank; use fewer ranks or --device cpu")
    carrier = "nccl" if use_cuda else "gloo"  # NCCL carries GPU tensors, gloo CPU ones
    if own_gpus and args.backend not in ("auto", carrier):
        parser.error(f"--backend {args.backend}: {'GPU' if use_cuda else 'CPU'} tensors travel "
                     f"over {carrier} only; use --backend {carrier} (or auto)")
    if not own_gpus and args.backend == "nccl" and (
            not gpus or local_world > gpus and "RANK" not in os.environ):
        parser.error(f"--backend nccl: {local_world} ranks on this machine but {gpus} GPU(s); "
                     "NCCL needs one GPU per rank: use fewer ranks or --backend gloo")
    if data_parallel:
        check_batch(parser, args, world_size, f"world size {world_size}")
    return world_size, local_world, gpus


def grid(parser, args, flag, world_size):
    """The ranks as a grid of groups of `flag`'s size (--tp, --cp: all ranks by default, stored
    back in args), refused in one line unless it divides the world size; the D = W/size groups
    train on their own shards of every batch, which D x --accum-steps must divide. Returns D."""
    name = flag.lstrip("-")
    size = getattr(args, name) or world_size
    setattr(args, name, size)
    if world_size % size:
        parser.error(f"{flag} {size} must divide the world size {world_size} (the ranks form "
                     f"a grid of {name.upper()} groups); use a divisor of {world_size}")
    check_batch(parser, args, world_size // size, f"the {world_size // size} "
                f"{name.upper()} group(s)")
    return world_size // size


def check_batch(parser, args, groups, name):
    """Refuse a --batch-size that `groups` data-parallel groups (each trains on its own shard
    of every batch; `name` says what they are) x --accum-steps micro-batches do not divide."""
    if args.batch_size % (groups * args.accum_steps):
        parser.error(f"--batch-size {args.batch_size} must be divisible by {name} x "
                     f"--accum-steps {args.accum_steps}; "
                     f"use a multiple of {groups * args.accum_steps}")


# --- --compile and --activation-checkpointing: the same in every script (docs/compile.md).
# Each script calls compile_and_checkpoint at the one place where its order matters: right
# after the model is built, before DDP, fully_shard, TP's plan or PipelineStage take it. ---

def compile_and_checkpoint(blocks, args):
    """--compile and --activation-checkpointing, per block, in place. Both wrap the block's
    forward method, not the module, so the parameter names stay SimpleModel's (no "_orig_mod."
    prefix, no checkpoint wrapper's): checkpoints and --save files load with or without them."""
    for block in blocks:
        if args.compile:
            # The block's forward, compiled (inductor). Before checkpointing wraps it
            # (measured: 1 graph either way round, but 0 when the whole module is compiled
            # after its forward was patched: docs/compile.md). Inside, backward's recomputation
            # runs the compiled code again. The first step pays the compile time (the
            # summary's "first step").
            block.forward = torch.compile(block.forward)
        if args.activation_checkpointing:
            # Keep only the block's input after forward; backward runs its forward again for
            # the rest (the norms' outputs, q, k, v, attention's output, GELU's input and
            # output: docs/compile.md counts them), at about one more forward's compute.
            # Non-reentrant, the current implementation.
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def most_workers(gpus, batch_size, accum_steps=1, width=None):
    """The default worker count: one per GPU (2 on a machine without), or fewer where that many
    would not divide the batch evenly (on 6 GPUs --batch-size 64 runs on 4, 16 samples each;
    --batch-size 96 would use all 6), nor `width` if given (what tensor parallelism cuts)."""
    return max((n for n in range(1, (gpus or 2) + 1) if batch_size % (n * accum_steps) == 0
                and (width is None or width % n == 0)), default=1)


def machine_gpus():
    """How many GPUs this process sees. torchrun and the scripts' own workers (`python ddp.py`)
    show every worker all of the machine's: then it is the machine's count, local rank r drives
    cuda:(r mod count), and more ranks than GPUs share them. Under a launcher a rank may see
    fewer: only its own (srun --gpus-per-task=1, a per-rank CUDA_VISIBLE_DEVICES, a container
    per rank), or the one GPU every task of the node sees too. A count cannot tell those apart;
    the GPUs' identities can, once the ranks meet (gpu_sharers, in every setup())."""
    return torch.cuda.device_count()


def gpu_sharers(store, device):
    """How many ranks of this machine drive the GPU this rank drives, itself included (1: a GPU
    of its own, as NCCL needs). Each rank publishes its GPU's UUID in the store the ranks meet
    in, under its machine's name and local rank, and reads the others': an index means nothing
    across processes (every rank of `srun --gpus-per-task=1` drives its own cuda:0, and two
    tasks on a one-GPU node drive the same cuda:0), a UUID names one physical GPU."""
    return sharing(store, int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]),
                   str(torch.cuda.get_device_properties(device).uuid))


def sharing(store, local_rank, local_world, uuid):
    """gpu_sharers, given what it reads: the local ranks whose GPU has this `uuid`.
    Waits (up to the store's timeout) until every rank of the machine has published its own."""
    machine = dist.PrefixStore(f"gpu_of_local_rank/{socket.gethostname()}", store)
    machine.set(str(local_rank), uuid)
    return sum(machine.get(str(r)).decode() == uuid for r in range(local_world))


# --- How a process becomes a rank: the same in every distributed script, and none of their
# technique. `python ddp.py` starts its own workers and gives each the environment torchrun
# would (and a share of the cores' threads, where torchrun gives 1: spawned()); under
# torchrun (or srun, or any launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE)
# each process is one rank already. ---

def ranks(args, default, gpus, to_use_all):
    """The world size and the number of ranks on this machine, for parse_args' checks.

    torchrun's, which it sets for every worker; without a launcher, --nproc workers, `default`
    if it is not given (said in one line when that leaves GPUs idle, with `to_use_all`).
    """
    if "RANK" in os.environ:
        return int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if args.nproc is None:
        args.nproc = default
        if args.nproc < gpus:
            print(f"{os.path.basename(sys.argv[0])}: {args.nproc} of {gpus} GPUs, "
                  f"{to_use_all}", flush=True)
    return args.nproc, args.nproc


def rendezvous(args, device, script, who="ranks", gloo_fallback=False):
    """The store the ranks meet in and the backend, for setup()'s init_process_group: every
    distributed script's, and none of its technique. On a CPU: gloo. On GPUs: NCCL, which needs
    a GPU of its own for every rank, told by the GPUs' UUIDs (gpu_sharers), not by counts;
    ranks (or `who`: pipeline.py's stages) that share one stop in one line naming `script`,
    before the group. gloo_fallback (ddp.py): they share it over gloo instead (or as
    --backend says), slowly, said in one line."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = rendezvous_store(rank, world_size, args.timeout)  # the launcher's, or rank 0's
    sharers = gpu_sharers(store, device) if device.type == "cuda" else 1
    name = os.path.basename(script)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if gloo_fallback:
        if args.backend != "auto" or sharers > 1:
            backend = "gloo" if args.backend == "auto" else args.backend
        if backend == "nccl" and sharers > 1:
            fail(f"{name}: error: {sharers} ranks, one GPU: use --backend gloo")
        if sharers > 1 and rank == 0:
            # Host copies: a test setup; EXCLUSIVE_PROCESS GPUs refuse it
            # (docs/traps.md#gloo-on-gpus).
            print(f"{name[:-3]}: {sharers} ranks share a GPU over gloo: slow", flush=True)
    elif sharers > 1:
        fail(f"{name}: error: {sharers} {who} drive one GPU, and NCCL needs one GPU per "
             f"{who[:-1]}: use fewer {who}")
    return store, backend


def rendezvous_store(rank, world_size, timeout_s):
    """The store the ranks meet in, for setup() to compare GPUs in and init_process_group to
    use. The launcher's (torchrun's agent, or launch() below), with keys of their own for every
    restart attempt: without the prefix a restarted gloo group reads the dead attempt's
    addresses and hangs or fails (docs/traps.md#restarts). Without one (srun's ranks), the
    store init_process_group would make itself: rank 0 hosts it at MASTER_ADDR:MASTER_PORT."""
    address = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return tcp_store(*address, world_size, is_master=rank == 0, timeout=timeout)
    return dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}",
                            tcp_store(*address, world_size, is_master=False, timeout=timeout))


def tcp_store(*args, **kwargs):
    """dist.TCPStore on every platform. Its default server since torch 2.4 is libuv, which
    PyTorch's Windows wheels have been built without: asked for it there, the store fails
    ("use_libuv was requested but PyTorch was build without libuv support", pytorch/pytorch
    #139990; torchrun on Windows needs USE_LIBUV=0 for the same reason). So TCPStore's older
    server on Windows; elsewhere, libuv."""
    return dist.TCPStore(*args, use_libuv=sys.platform != "win32", **kwargs)


def leave():
    """Leave the process group at a clean exit. Call it only there: after an exception a peer
    may be waiting in a collective this rank will never join, and tearing the group down under
    it can deadlock (pytorch/torchtitan#1342); the exception exits non-zero instead and the
    launcher ends the rest."""
    gloo = dist.get_backend() == "gloo"
    dist.destroy_process_group()
    if gloo:
        # Lets gloo's threads drop their last tensors while Python is alive; without it a
        # worker can abort at exit with SIGABRT on torch 2.13 (docs/traps.md#sigabrt).
        time.sleep(0.2)


def free_port():
    """A TCP port that is free now on 127.0.0.1 (the OS picks it; never hard-code one).

    Another program could take it before whoever needs it binds it; then that fails at once
    with "address already in use" rather than hanging. (launch() does not use it: its store
    binds a port and holds it.)
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawned(local_rank, run, args, port):
    """Entry point of a worker the script started itself: set the rank's environment torchrun
    would set, then run(args). One difference: its thread count (below)."""
    # Without a limit, N workers each start one thread per core and fight over the cores
    # (2-3x slower on a laptop CPU). torchrun sets OMP_NUM_THREADS=1 unless you set it, which
    # leaves cores idle where the workers are fewer than the cores; here each worker gets an
    # equal share of them instead (cores // N: 1 each on 2 cores, 4 each for 2 workers on 8).
    # Your own OMP_NUM_THREADS wins, as it does under torchrun.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, os.cpu_count() // args.nproc))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(args.nproc),
                      LOCAL_WORLD_SIZE=str(args.nproc),
                      # The store is the launcher's, as under torchrun: rendezvous_store() joins it.
                      TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    as_rank(run, args)


# How gloo says that a collective's peer is gone or never came (NCCL's errors are DistErrors).
PEER_LOST = ("Timed out waiting", "Application timeout", "Connection closed by peer",
             "Connection reset by peer")


def as_rank(run, args):
    """run(args) as one rank. A collective that gives up (a peer died, or never reached it
    within --timeout) ends the rank with one line, not a page of C++ frames: which rank, what
    gloo or NCCL said, and the two usual causes."""
    quiet_known_warnings()  # two that torch prints on these correct runs (why: its docstring)
    try:
        run(args)
    except RuntimeError as e:  # torch.distributed.DistError is one
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if not (isinstance(e, dist.DistError) or any(s in first for s in PEER_LOST)):
            raise
        said = first.split("] ")[-1].split(". ")[0]  # gloo's words, without its source file
        fail(f"{os.path.basename(sys.argv[0])}: error: rank {os.environ.get('RANK')}: a "
             f"collective gave up ({said}): a peer stopped, or the ranks did "
             f"not all make the same collectives (--timeout {args.timeout:g} s)",
             leave_group=False)


def launch(run, args):
    """run(args) in this process if a launcher made it a rank; else in args.nproc workers on
    this machine, started here, with one exit status for all of them."""
    if not dist.is_available():  # a torch built without it (some macOS and Windows builds)
        fail(f"{os.path.basename(sys.argv[0])}: error: this torch {torch.__version__} has no "
             "torch.distributed; install PyTorch's wheel from pytorch.org (or use single.py)")
    if "RANK" in os.environ:
        as_rank(run, args)  # torchrun started one process per rank; this is one of them
        return
    # The rendezvous store, hosted here as torchrun's agent hosts its own: on a port the OS
    # picks and this process holds, so nothing can take it before the workers connect (a port
    # only found free, then bound by rank 0 seconds later, can be: "address already in use").
    store = tcp_store("127.0.0.1", 0, args.nproc, is_master=True, wait_for_workers=False)
    # mp.spawn passes each worker its index, waits for all, and if one fails it terminates
    # the others and raises here.
    try:
        mp.spawn(spawned, args=(run, args, store.port), nprocs=args.nproc)
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
        # A worker that stopped with a message of its own (a bad --checkpoint, say) has
        # printed it already and exited 1: end with its exit status, not with spawn's
        # dozen-line traceback under the message. Anything else (a crash, a signal): spawn's
        # message, which carries the worker's traceback, in place of ours.
        code = getattr(e, "exit_code", None)
        raise SystemExit(code if code is not None and code > 0
                         else f"{os.path.basename(sys.argv[0])}: {e}")


# --- The mixture of experts' load-balancing loss, as the scripts that train one add it. ---

def balance(model, args, group=None):
    """--balance x the load-balancing loss (balance_loss) of the micro-batch just forwarded; 0
    for the dense model, whose numbers it leaves exactly as they were. With `group`: over all
    its ranks, which hold one device's micro-batch between them (ddp.py, fsdp.py): their
    routing summed, differentiably (AllReduce), so each adds the loss one device computes."""
    if not args.experts:
        return 0.0
    routed = model.routed()
    if group is not None:
        routed = AllReduce.apply(routed, group)
    # The tokens each expert got, counted over the run for the summary's last line.
    model.tokens_per_expert = (routed[:, 0].detach().to(torch.int64)  # integers: no rounding
                               + getattr(model, "tokens_per_expert", 0))
    return args.balance * balance_loss(routed, args.top_k)


class AllReduce(torch.autograd.Function):
    """A sum over `group`'s ranks that autograd goes through: every rank's input fed every
    rank's output, so its gradient is the sum of their gradients (an all-reduce too). Under
    DDP's averaging that gives each parameter one device's gradient of the shared loss."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


# --- The one-line error, rank 0's prints, and a checkpoint's bookkeeping: saved atomically,
# on the CPU, with the train state that says whether a run can continue it (every script's
# save_checkpoint and load_checkpoint call these; what a learner must see stays there:
# weights_only, map_location, the unwrap, DCP). ---

def fail(message, leave_group=True):
    """Stop this process with `message` as its one error line (on stderr) and exit status 1.

    Under torchrun the line also goes into the error file torchrun gives each worker
    (TORCHELASTIC_ERROR_FILE), so the "Root Cause" at the bottom of torchrun's failure report
    repeats it, instead of "To enable traceback see: ...".
    The scripts call it where every rank stops at the same point for the same reason (a
    checkpoint that all of them read and refuse), so no peer waits inside a collective and
    NCCL's group can be left cleanly: it would otherwise warn at exit that
    destroy_process_group() was never called, under the one line. (A gloo group is left to the
    exit, as it always was: tearing it down here could abort the exit on torch 2.13,
    docs/traps.md#sigabrt.) leave_group=False where a peer may be stuck in a collective.
    """
    if leave_group and dist.is_initialized() and dist.get_backend() == "nccl":
        dist.destroy_process_group()
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {
                "py_callstack": message, "timestamp": str(int(time.time()))}}}, f)
    raise SystemExit(message)


def print0(*args):
    """print on rank 0 only (or always, in a single process)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def to_cpu(obj):
    """A copy of `obj` (tensors, possibly inside dicts, lists and tuples) with every tensor on
    the CPU. A file of CUDA tensors does not load on a machine without a GPU unless the reader
    knows to pass map_location ("Attempting to deserialize object on a CUDA device")."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def save_atomic(obj, path):
    """torch.save of CPU copies of `obj` that never leaves a half-written file at `path`.

    Write a temporary file in the same folder, flush it to disk, then os.replace() it over
    `path` in one step: a crash at any moment leaves either the old file or the new one.
    (Same folder, because os.replace is atomic only within one filesystem.) The tensors go to
    the CPU first, so weights trained on a GPU load on a laptop with a plain torch.load.
    """
    obj = to_cpu(obj)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def unloadable(error):
    """Why a checkpoint's model weights did not load (the exception torch.load or
    load_state_dict raised), and what to do, for the one-line refusal."""
    text = str(error)
    if '"module.' in text and "Unexpected key" in text:
        # ddp_model.state_dict(): the wrapper names each weight module.<name>
        return ("its weights are named module.<name>: saved from the DDP wrapper's state_dict; "
                "save model.state_dict() (the wrapped model, ddp_model.module) instead, or "
                "strip the prefix")
    if "size mismatch" in text or "Missing key" in text:
        return "saved with another model size; use its --hidden and --blocks"
    return f"cannot be read ({type(error).__name__}); move it away or point elsewhere"


def optimizer_share(full_state, full, held):
    """The part of one device's Adam state_dict (`full_state`, whose parameters are numbered in
    the order of the names `full`, a model's named_parameters) that belongs to the parameters
    named `held` (a stage's, a rank's experts'), numbered from 0 in their order, as their
    optimizer numbers them (pipeline.py, ep.py: a checkpoint of one device's shape, resumed
    by ranks that hold slices of the model). `full` may be a model."""
    if isinstance(full, nn.Module):
        full = [name for name, _ in full.named_parameters()]
    index = {name: i for i, name in enumerate(full)}
    group = dict(full_state["param_groups"][0], params=list(range(len(held))))
    return {"state": {i: full_state["state"][index[name]] for i, name in enumerate(held)},
            "param_groups": [group]}


def receive(like, src, device):
    """A tensor shaped like `like` (and of its dtype), received from rank `src` through
    `device` (NCCL sends GPU tensors only), returned on `like`'s device."""
    received = torch.empty_like(like, device=device)
    dist.recv(received, src=src)
    return received.to(like.device)


def train_state(args, step):
    """What a checkpoint holds besides the weights and the optimizer's state, for
    check_resumable: the step, and what the data order and the model depend on (the data
    position is a function of --seed, the step and --batch-size only)."""
    return {"step": step, "batch_size": args.batch_size, "seed": args.seed, "fp64": args.fp64,
            "hidden": args.hidden, "blocks": args.blocks, "heads": args.heads,
            "experts": args.experts, "top_k": args.top_k}


def check_resumable(saved, args, refuse):
    """Call refuse(why) if this run cannot continue the checkpoint whose train state is `saved`
    exactly: another model size (where it says) or head count, --batch-size or --seed (the
    data order would not continue), or the other precision (loading would cast the weights
    and Adam's moments silently, and the run would go on in another precision than it
    started in)."""
    if "hidden" in saved and (saved["hidden"], saved["blocks"]) != (args.hidden, args.blocks):
        refuse(f"saved with --hidden {saved['hidden']} --blocks {saved['blocks']}; "
               "use the same model size")
    # The head count shapes no weight (q, k, v are hidden x hidden whatever it is), so the
    # weights would load and the attention would compute something else: the file says it.
    if saved.get("heads") != args.heads:
        refuse(f"saved with --heads {saved.get('heads')}; use --heads {saved.get('heads')}")
    # --top-k shapes no weight either (and a dense file has no experts: 0, 1 the defaults)
    experts, top_k = saved.get("experts", 0), saved.get("top_k", 1)
    if (experts, top_k) != (args.experts, args.top_k):
        refuse(f"saved with --experts {experts} --top-k {top_k}; use the same")
    for flag, key in (("--batch-size", "batch_size"), ("--seed", "seed")):
        if saved.get(key) != getattr(args, key):
            refuse(f"written with {flag} {saved.get(key)}, not {getattr(args, key)}: the data "
                   f"order would not continue; use {flag} {saved.get(key)}")
    if saved.get("fp64", False) != args.fp64:
        refuse("written with --fp64; add --fp64 to continue it" if saved.get("fp64")
               else "written without --fp64; drop --fp64 to continue it")


# Sharded checkpoints (fsdp.py, tp.py): --checkpoint is a folder of DCP checkpoints, one
# subfolder per step, and a file `latest` naming the complete one. A new step is written beside
# the old one, and `latest` is switched to it with one atomic os.replace only once it is
# complete: a crash at any moment leaves `latest` naming a whole checkpoint. Then the old one is
# removed.

def commit_sharded(folder, name, train_state):
    """On rank 0, once every rank has written folder/name: its train state (small, the same on
    every rank) as train_state.json, then `latest` switched to it, then the older steps gone."""
    with open(os.path.join(folder, name, "train_state.json"), "w") as f:
        json.dump(train_state, f)
    tmp = os.path.join(folder, "latest.tmp")
    with open(tmp, "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, "latest"))
    for old in os.listdir(folder):
        if old.startswith("step_") and old != name:
            shutil.rmtree(os.path.join(folder, old))
    print(f"checkpoint: step {train_state['step']} -> {folder}/{name}", flush=True)


def latest_sharded(folder, refuse):
    """(the step folder `latest` names, its train state), or (None, None) where `folder` holds
    no checkpoint yet; refuse(why) where it cannot be one. Reads small files only: every rank
    calls it before any collective, and all get the same answer."""
    if not os.path.exists(folder):
        return None, None
    if not os.path.isdir(folder):
        refuse("is a file; fsdp.py and tp.py keep sharded checkpoints in a folder: "
               "point elsewhere")
    latest = os.path.join(folder, "latest")
    if not os.path.exists(latest):
        if os.listdir(folder):
            refuse("this folder holds no checkpoint of fsdp.py or tp.py (no 'latest' file); "
                   "point --checkpoint at a new or empty folder")
        return None, None
    try:
        with open(latest) as f:
            step_folder = os.path.join(folder, f.read().strip())
        with open(os.path.join(step_folder, "train_state.json")) as f:
            return step_folder, json.load(f)
    except (OSError, ValueError) as e:
        refuse(f"cannot be read ({type(e).__name__}); move it away or point elsewhere")


# The classes a checkpoint index (.metadata) of torch.distributed.checkpoint is made of: DCP's
# own metadata dataclasses, the file reader's storage record, and the torch types they hold.
DCP_METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("collections", "OrderedDict"),
}


class NotCheckpointData(pickle.UnpicklingError):
    """A pickle that names a class or function no checkpoint index holds."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP index and refuses any other class or function (os.system, say)."""

    def find_class(self, module, name):
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in DCP_METADATA_GLOBALS or is_dtype:
            return super().find_class(module, name)
        raise NotCheckpointData(f"{module}.{name}")


def load_sharded(state, folder, refuse):
    """dcp.load(state, checkpoint_id=folder), reading the checkpoint as data, never as code;
    refuse(why) where it cannot be read, on every rank alike.

    torch trusts a DCP folder: it reads the index (.metadata) with a plain pickle.load, and every
    non-tensor value in the shards (the optimizer's lr, betas...) with torch.load(weights_only=
    False), so a hostile folder runs any code it names on load (pytorch/pytorch#189308). Here
    the index goes through MetadataUnpickler and each value through weights_only=True first.
    Before any collective, every rank checks what the files alone can tell (the index, each
    shard present and long enough) and raises ValueError with the reason: the same files give
    the same answer on every rank, so all stop together. What goes wrong later, inside
    dcp.load, raises DCP's CheckpointException on every rank.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        _load_data_only(state, folder)
    except ValueError as e:  # found before any collective, the same on every rank
        refuse(f"{e}; move it away or point elsewhere")
    except (Exception, CheckpointException) as e:  # raised on every rank by the collective
        # (CheckpointException derives from BaseException: `except Exception` misses it.)
        refuse(f"cannot be read ({type(e).__name__}); move it away or point elsewhere")


def _load_data_only(state, folder):
    """load_sharded's work: ValueError for what the files alone show, then dcp.load."""
    # Imported here: only the sharded scripts need it, and it takes most of a second.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class DataOnlyReader(dcp.FileSystemReader):
        def read_metadata(self):  # (no **kwargs: DCP then skips its per-rank fallback)
            with open(os.path.join(self.path, ".metadata"), "rb") as f:
                metadata = MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class DataOnlyPlanner(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            # The default unpickles with weights_only=False. The same bytes through
            # weights_only=True first: anything but plain data stops here.
            torch.load(value, weights_only=True)
            value.seek(0)
            super().load_bytes(read_item, value)

    reader = DataOnlyReader(folder)
    try:
        metadata = reader.read_metadata()
    except FileNotFoundError:
        raise ValueError("its index (.metadata) is missing")
    except NotCheckpointData as e:
        raise ValueError(f"its index (.metadata) calls {e}, which no checkpoint does: "
                         "refused, nothing was run")
    except Exception as e:  # empty, truncated, garbage
        raise ValueError(f"its index (.metadata) cannot be read ({type(e).__name__})")
    if not isinstance(metadata, Metadata) or not metadata.storage_data:
        raise ValueError("its index (.metadata) is not a checkpoint's")
    for info in metadata.storage_data.values():
        shard = os.path.join(folder, str(info.relative_path))
        if not os.path.isfile(shard):
            raise ValueError(f"shard {info.relative_path} is missing")
        if os.path.getsize(shard) < info.offset + info.length:
            raise ValueError(f"shard {info.relative_path} is cut short")
    dcp.load(state, storage_reader=reader, planner=DataOnlyPlanner())


def quiet_known_warnings():
    """Silence, in this process, exactly two messages that torch prints on correct runs of
    these scripts (every rank of every script calls it: as_rank), each harmless here:
    - FSDP2's "FSDP2-wrapped module (...) returned a view tensor ... can cause backward to fail
      or produce wrong gradients" (torch 2.13 and later, at the first forward; fsdp.py, and
      tp.py in 2D). An in-place op on a module's output would skip the backward hook FSDP
      registers on it. The root's output is the logits, a view (nn.Linear on batch x sequence
      x hidden folds it into one matrix product and views the result back), and nothing here
      writes into it in place.
    - DTensor's "2 sequential all_reduce (or all_gather) operations will be performed. This is
      suboptimal ... may give inconsistent results between ranks" (tp.py in 2D, once per rank):
      clip_grad_norm_ sums the norm of a gradient sharded over "dp" and "tp" over one, then
      the other (two all-reduces of one number each, where a flattened mesh, a private API
      today, would make one), and --save gathers a weight cut by both in two all-gathers.
      Every rank gets the same numbers all the same: an all-gather copies, and each all-reduce
      gives its group one result, the groups of the second adding up equal inputs."""
    import logging
    import warnings
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    logging.getLogger("torch.distributed.tensor._redistribute").addFilter(
        lambda record: "This is suboptimal" not in record.getMessage())


def flops_per_sample(model):
    """Training FLOPs of one sequence as MFU counts them (nanoGPT's estimate): 6 per weight per
    token for every weight that multiplies (forward 2, backward 4; the embeddings only look
    up), plus attention's scores and weighted sums, 12 x hidden x SEQ_LEN per block per token.
    From the layers' shapes, so it holds for a sharded model too."""
    dense = sum(m.in_features * m.out_features for m in model.modules()
                if isinstance(m, nn.Linear))
    # A mixture's experts each see top_k / experts of the tokens: count the weights a token uses.
    dense -= sum((len(m.experts) - m.top_k) * sum(
        e.up.in_features * e.up.out_features * 2 for e in m.experts.values()) // len(m.experts)
        for m in model.modules() if isinstance(m, MoE))
    attention = sum(12 * m.o.in_features * SEQ_LEN for m in model.modules()
                    if isinstance(m, Attention))
    return SEQ_LEN * (6 * dense + attention)


def num_params(model):
    return sum(p.numel() for p in model.parameters())


def held_bytes(model, optimizer):
    """Bytes this rank holds for weights, gradients and Adam's two moments: the summary's
    `state`. Of a sharded tensor (a DTensor: FSDP, TP) it counts this rank's piece,
    to_local(); of ZeRO-1's optimizer the moments of this rank's share (its local Adam,
    .optim). A gradient has its weight's size (it exists from backward to zero_grad); Adam's
    step counters are scalars, left out."""
    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    weights = sum(local(p).numel() * p.element_size() for p in model.parameters())
    moments = sum(local(v).numel() * v.element_size()
                  for state in getattr(optimizer, "optim", optimizer).state.values()
                  for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return 2 * weights + moments


def peak_rss():
    """This process's peak resident memory (Python and torch included), as the summary prints
    it: ru_maxrss counts KiB on Linux and bytes on macOS; Windows has no `resource` module."""
    if resource is None:
        return "n/a (RSS: not measured on Windows)"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return f"{peak / (2**20 if sys.platform == 'darwin' else 2**10):.1f} MiB (RSS)"


class Meter:
    """Throughput of the training loop, timed the way a benchmark must be.

    CUDA kernels run asynchronously, so the clock is read only after synchronizing every GPU
    this process drives (`device`: one device, or a list of them, as model parallelism has);
    the first `warmup` steps (allocator, kernel selection, first communication) are not timed,
    unless the run is too short to have any other steps.
    """

    def __init__(self, device, warmup=3):
        devices = device if isinstance(device, (list, tuple)) else [device]
        self.gpus = sorted({d for d in devices if d.type == "cuda"}, key=str)
        self.warmup = warmup
        self.steps = self.samples = self.warm_samples = 0
        self.first_step = float("nan")
        self.start = self.last = self._now()
        self.warm_start = None

    def _now(self):
        for gpu in self.gpus:
            torch.cuda.synchronize(gpu)
        return time.perf_counter()

    @contextlib.contextmanager
    def paused(self):
        """Leave the time spent inside (evaluation, checkpoints) out of the training rates."""
        begin = self._now()
        yield
        gap = self._now() - begin
        self.start += gap
        self.last += gap
        if self.warm_start is not None:
            self.warm_start += gap

    def step(self, samples):
        """Call after each optimizer step; returns samples/s of that step."""
        now = self._now()
        rate = samples / max(now - self.last, 1e-9)
        self.last = now
        self.steps += 1
        self.samples += samples
        if self.steps == 1:
            # The first step pays for what happens once (torch.compile compiling, allocating,
            # connecting): reported apart, and never in samples/s.
            self.first_step = now - self.start
        if self.steps == self.warmup:
            self.warm_start, self.warm_samples = now, 0
        elif self.steps > self.warmup:
            self.warm_samples += samples
        return rate

    def summary(self, loss, model, val_loss, state_bytes=None):
        """The final line: steps, final loss, samples/s, step time, peak memory, `model`'s
        TFLOP/s, the first step's time, the bytes of training state each rank holds (if given),
        and the validation loss; for a mixture of experts, a line of the tokens each expert
        got over the run (balance() counts them, every rank's)."""
        if self.steps > self.warmup:
            timed, samples, elapsed = (self.steps - self.warmup, self.warm_samples,
                                       self.last - self.warm_start)
        else:
            timed, samples, elapsed = self.steps, self.samples, self.last - self.start
        rate = samples / max(elapsed, 1e-9)
        if self.gpus:
            # Summed over the GPUs this process drives. Allocated: what tensors held at the
            # peak. Reserved: what the caching allocator took from the GPU for them (the
            # figure nvidia-smi's share of this process is closer to, CUDA context aside).
            allocated = sum(torch.cuda.max_memory_allocated(gpu) for gpu in self.gpus)
            reserved = sum(torch.cuda.max_memory_reserved(gpu) for gpu in self.gpus)
            peak = (f"{allocated / 2**20:.1f} MiB allocated, {reserved / 2**20:.1f} MiB "
                    f"reserved (CUDA{f', {len(self.gpus)} GPUs' if len(self.gpus) > 1 else ''})")
        else:
            peak = peak_rss()
        line = (f"done | steps {self.steps} | final loss {loss:.6f} | {rate:.1f} samples/s"
                f" | {1e3 * elapsed / max(timed, 1):.2f} ms/step | peak mem {peak}")
        if self.gpus:
            # The model's FLOPs, as MFU counts them (flops_per_sample, above). `rate` is the
            # whole job's samples/s (the global batch), so this is the job's figure, not one
            # GPU's, and activation checkpointing's recomputation (about 2 more per weight per
            # token) is not in it.
            line += f" | {flops_per_sample(model) * rate / 1e12:.2f} model TFLOP/s (job)"
        line += f" | first step {self.first_step:.2f} s"
        if state_bytes is not None:
            line += f" | state {state_bytes / 2**20:.3f} MiB/rank"
        line += f" | val loss {val_loss:.6f}"
        counts = getattr(model, "tokens_per_expert", None)
        if counts is not None:  # (blocks, experts): the busiest expert against the mean
            line += "\nexperts | tokens routed to each, per block: " + " | ".join(
                " ".join(f"{n:.0f}" for n in block) for block in counts.tolist())
            busiest = (counts.max(1).values / counts.double().mean(1)).max()
            line += f" | busiest / mean {busiest:.3f}"
        return line


class Profiler:
    """torch.profiler over a few steps after warm-up, one Chrome trace per rank.

    With `folder` None it does nothing. Otherwise steps 1-3 run unrecorded (warm-up: compile,
    allocation, first connections), step 4 warms the profiler up, steps 5-7 are recorded, and
    `folder`/trace_rank<R>.json is written: open it in https://ui.perfetto.dev or
    chrome://tracing. Recorded steps run slower (every op is timed, and its inputs' shapes
    kept), and the summary's samples/s includes them: profile and benchmark in separate runs.
    `device`: the run's device, or the list of them; GPU kernels are recorded only if one is.
    """

    def __init__(self, folder, rank, device, skip=3, warmup=1, active=3):
        self.prof = None
        if folder is None:
            return
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"trace_rank{rank}.json")
        activities = [torch.profiler.ProfilerActivity.CPU]
        devices = device if isinstance(device, (list, tuple)) else [device]
        if any(d.type == "cuda" for d in devices):
            # Only when this run uses a GPU: CUDA activity starts CUPTI and a CUDA context
            # (on GPU 0, in every rank) even for a run that never touches the GPU.
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(
            activities=activities, record_shapes=True,
            schedule=torch.profiler.schedule(skip_first=skip, wait=0, warmup=warmup,
                                             active=active, repeat=1),
            on_trace_ready=lambda prof: prof.export_chrome_trace(path))
        self.prof.start()
        print0(f"profiling steps {skip + warmup + 1}-{skip + warmup + active} into "
               f"{folder}/trace_rank*.json (those steps run slower)")

    def step(self):
        """Call once at the end of every training step."""
        if self.prof is not None:
            self.prof.step()

    def stop(self):
        if self.prof is not None:
            self.prof.stop()


def log_line(step, steps, loss, grad_norm, samples_per_s):
    """The per-step line every script prints, so their logs can be compared side by side.
    grad_norm: the whole gradient's norm, before --clip (7 significant digits)."""
    return (f"step {step:5d}/{steps} | loss {loss:.6f} | grad norm {grad_norm:.6e} | "
            f"{samples_per_s:10.1f} samples/s")


def eval_line(step, steps, val_loss):
    """The line printed after each evaluation on the held-out set."""
    return f"eval {step:5d}/{steps} | val loss {val_loss:.6f}"


# --- Your model, checked before any process starts: what would train differently from one
# device without an error is refused in one line (docs/course.md#putting-your-own-model-in).

def check_model(parser, args, ranks=None):
    """Refuse (parser.error) a model this run would train silently differently from one
    device: BatchNorm where ranks (`ranks`: by default this run's) or micro-batches each see a
    part of the batch; a tied weight in a pipeline (--microbatches), whose stages would each
    train a copy; and with --tp (tp.py, nd.py) a tp_plan that names a module the model lacks, an
    unknown kind, cuts nothing, or cuts a tied head over the vocabulary (--loss-parallel)."""
    from fnmatch import fnmatch
    with torch.device("meta"):  # shapes only, however large (as fsdp.py and tp.py build it)
        model = SimpleModel.from_args(args)
    name = type(model).__name__
    if ranks is None:  # a script with --nproc runs torchrun's ranks, or --nproc of its own
        ranks = (int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else args.nproc or 1
                 ) if "nproc" in args else 1
    micro = getattr(args, "accum_steps", None) or getattr(args, "microbatches", None) or 1
    for path, module in model.named_modules():  # _BatchNorm: every BatchNorm, Sync and Lazy too
        # SyncBatchNorm syncs over a process group: none under DataParallel (no --nproc)
        sync = isinstance(module, nn.SyncBatchNorm) and micro == 1 and "nproc" in args
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and ranks * micro > 1 and not sync:
            parser.error(f"{name}.{path} is a {type(module).__name__}: it normalizes by the "
                         "statistics of the samples it sees, and here ranks or micro-batches "
                         "each see a part of the batch; use nn.GroupNorm or nn.LayerNorm (or, on "
                         "GPUs without micro-batches, nn.SyncBatchNorm.convert_sync_batchnorm)")
    holders = {}  # a parameter's names: two or more where it is tied
    for path, p in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(p), []).append(path)
    tied = [paths for paths in holders.values() if len(paths) > 1]
    if tied and "microbatches" in args:  # pipeline.py, nd.py
        parser.error(f"{' and '.join(tied[0])} are one tensor (tied): a pipeline holds them "
                     "on two stages, which would train two copies apart; untie them (a "
                     "weight of its own for each), or use ddp.py, fsdp.py or tp.py")
    if "tp" not in args:
        return
    plan = getattr(model, "tp_plan", None) or {}
    kinds = ("colwise", "rowwise", "shared_input", "norm", "head")  # tp.py's styles of them
    names = [path.split(".") for path, _ in model.named_modules()]
    def resolved(key):  # as parallelize_module matches it: name by name, "*" for any
        return [".".join(n) for n in names if len(n) == len(key.split("."))
                and all(map(fnmatch, n, key.split(".")))]
    for key, kind in plan.items():
        if kind not in kinds:
            parser.error(f"{name}.tp_plan[{key!r}] = {kind!r}: a kind tp.py does not know; "
                         f"use one of {', '.join(kinds)}")
        if not resolved(key):
            parser.error(f"{name}.tp_plan: {key!r} names no module of {name} (torch would "
                         "skip it with a warning); write the names model.named_modules() "
                         "gives, with * for a block's key")
        layers = [model.get_submodule(path) for path in resolved(key)]
        other = next((m for m in layers if not isinstance(m, (nn.Linear, nn.Embedding))), None)
        if kind in ("colwise", "rowwise") and other is not None:
            parser.error(f"{name}.tp_plan: {key!r} is a {type(other).__name__}, and TP cuts "
                         "nn.Linear and nn.Embedding only; make it an nn.Linear (a Conv1D's "
                         "weight is a Linear's, transposed)")
    if getattr(args, "sequence_parallel", False) and not resolved("blocks.0"):
        parser.error(f"--sequence-parallel: tp.py gives the first block, blocks.0, its part of "
                     f"the sequence, and {name} has none; register the blocks as `blocks`, an "
                     "nn.ModuleDict keyed \"0\", \"1\", ...")
    if not {"colwise", "rowwise"} & set(plan.values()):
        parser.error(f"{name}.tp_plan cuts nothing (no colwise or rowwise layer): every rank "
                     "would hold and compute the whole model; write one "
                     "(docs/course.md#putting-your-own-model-in)")
    heads = {m for key, kind in plan.items() if kind == "head" for m in resolved(key)}
    for paths in tied if getattr(args, "loss_parallel", False) else ():
        if any(path.rsplit(".", 1)[0] in heads for path in paths):
            parser.error(f"--loss-parallel: {' and '.join(paths)} are one tensor (tied), and "
                         "loss parallelism would cut the head's over the vocabulary, the "
                         "other's left whole; drop --loss-parallel, or untie them")


# ---------------------------------------------------------------------------------------------
# Diagnostics: run this file, not import it.
#   python common.py                          what this machine has, and the launch that fits
#   torchrun --nproc_per_node=2 common.py     can the ranks talk, and how fast (all-reduce)
#   torchrun --nproc_per_node=2 common.py --device cpu    the same over gloo, GPUs or not
# ---------------------------------------------------------------------------------------------


def environment_report():
    """Versions, GPUs, peer access, process-group backends, and the launch command that fits."""
    lines = [f"torch {torch.__version__} | python {sys.version.split()[0]} | "
             f"{os.cpu_count()} CPU cores | {torch.get_num_threads()} torch threads"]
    gpus = torch.cuda.device_count()
    if gpus:
        lines.append(f"CUDA {torch.version.cuda} | cuDNN {torch.backends.cudnn.version()} | "
                     f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
        for i in range(gpus):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i} {p.name} | {p.total_memory / 2**30:.1f} GiB | "
                         f"compute capability {p.major}.{p.minor} | "
                         f"bf16 {'yes' if p.major >= 8 else 'no (use fp16 + GradScaler)'}")
        for i in range(gpus):
            for j in range(i + 1, gpus):
                # Without peer access, GPU-to-GPU copies bounce through host memory.
                ok = torch.cuda.can_device_access_peer(i, j)
                lines.append(f"peer access cuda:{i} <-> cuda:{j}: {'yes' if ok else 'no'}")
    else:
        lines.append("CUDA: no GPU visible" + (" (CPU-only build of torch)"
                                               if torch.version.cuda is None else ""))
    backends = [name for name, available in (("gloo", dist.is_gloo_available()),
                                             ("nccl", dist.is_nccl_available()),
                                             ("mpi", dist.is_mpi_available()))
                if available]
    lines.append(f"process-group backends: {', '.join(backends)}")
    # What `python ddp.py` starts: as many ranks as divide its default --batch-size 64.
    nproc = most_workers(gpus, 64)
    lines.append(f"launch: torchrun --nproc_per_node={nproc} ddp.py   "
                 f"({'one rank per GPU, NCCL' if gpus else 'CPU ranks over gloo'}"
                 f"{f'; {nproc} of {gpus} GPUs divide --batch-size 64' if nproc < gpus else ''})"
                 f"; check first: torchrun --nproc_per_node={nproc} common.py")
    return "\n".join(lines)


def communication_check(device="auto", timeout_s=60, sizes=tuple(4**k for k in range(7, 13)),
                        iters=10):
    """Under torchrun: verify an all-reduce on every rank, then measure its bandwidth.
    device "auto": NCCL on GPUs when every rank has one of its own, else gloo on the CPU."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = rendezvous_store(rank, world, timeout_s)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()) \
        if device != "cpu" and torch.cuda.is_available() else torch.device("cpu")
    use_nccl = device.type == "cuda" and gpu_sharers(store, device) == 1
    if use_nccl:
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # A peer that never arrives, or cannot be reached, ends in an error after timeout_s.
    # device_id binds NCCL to this rank's GPU (else barrier() guesses it, with a warning).
    dist.init_process_group("nccl" if use_nccl else "gloo", store=store, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if use_nccl else None)
    backend = dist.get_backend()
    x = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(x)
    expected = world * (world + 1) / 2
    if not torch.all(x == expected):
        raise SystemExit(f"rank {rank}: all-reduce gave {x.tolist()}, expected {expected}")
    dist.barrier()
    print0(f"all-reduce verified on {world} ranks ({backend}, {device.type}); barrier passed")
    print0(f"{'bytes':>12} {'time (us)':>12} {'algbw (GB/s)':>14} {'busbw (GB/s)':>14}")
    for numel in sizes:
        t = torch.ones(numel, device=device)
        for _ in range(2):  # warm-up: connection setup, buffers
            dist.all_reduce(t)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / iters
        # nccl-tests' definitions: algbw = bytes / time; busbw = algbw * 2(n-1)/n, what each
        # link carries in a ring all-reduce, comparable to the hardware's link bandwidth.
        algbw = numel * 4 / seconds / 1e9
        print0(f"{numel * 4:12d} {seconds * 1e6:12.1f} {algbw:14.3f} "
               f"{algbw * 2 * (world - 1) / world:14.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="diagnostics (see the comment above)")
    parser.add_argument("--device", choices=["auto", "cpu"], default="auto",
                        help="under torchrun: cpu checks gloo on the CPU even where GPUs are")
    args = parser.parse_args()
    if "RANK" in os.environ:
        communication_check(args.device)
    else:
        print(environment_report())
