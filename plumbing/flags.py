"""The flags every script shares, and their checks (docs/usage.md lists them all).

Each script's parse_args starts from shared_parser, adds its technique's flags to its groups,
and calls check_shared_flags; the scripts that run several ranks then call launch_world (and
grid, for a grid of TP or CP groups, and check_tp, for TP's). A bad flag is refused in one line
that names the fix, before any process starts (whether --compile can work here:
plumbing/compile.py). compile_and_checkpoint applies --compile and --activation-checkpointing
at the one place in each script where their order matters.
"""

import argparse
import functools
import os
import sys

import torch
from torch.utils.checkpoint import checkpoint

import common
from plumbing.compile import compile_problem
from plumbing.ranks import machine_gpus, ranks


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


# Flags a script no longer has, and where their users go: one line, not argparse's "unrecognized".
MOVED = {"cp.py": {"--fsdp": "FSDP x CP is nd.py's: python nd.py --pp 1 --tp 1 --cp C "
                             "(FSDP over data x context, no pipeline)"}}


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose refusals are one line, `prog: error: ...` (no usage block
    above it), printed by one process: under torchrun every rank parses the same flags."""

    def error(self, message):
        for flag, where in MOVED.get(self.prog, {}).items():  # a flag that left for another script
            if message.startswith("unrecognized arguments") and flag in message.split():
                message = f"{flag}: {where}"
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def shared_parser(doc, accum=True, sharded=False, ranks=False, moe=True, replicas=False,
                  nproc_help="workers to start without torchrun (default: 1 per GPU, 2 on a CPU)"):
    """An ArgumentParser with the flags every script shares, in groups a script adds to
    (`parser.groups["hardware"]`, say): training, model, hardware, output. accum: the
    --accum-steps flag (pipeline.py has micro-batches instead). sharded: --checkpoint is a
    folder of shards (fsdp.py, tp.py), not a file. ranks: a script that runs several ranks,
    with --backend, --nproc (helped by nproc_help) and --timeout. moe=False: --experts is
    refused in one line (the script trains the dense model only). replicas: one process copies
    the model onto every GPU at every step (DataParallel, dataparallel.py): check_shared_flags
    refuses what cannot follow the copies, and check_model counts them as ranks."""
    parser = Parser(description=doc.split("\n")[0])
    parser.moe, parser.replicas = moe, replicas
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
    train.add_argument("--data", choices=common.DATA, default="repeat",
                       help="common.make_dataset's kind: repeat (every target counts), padded, "
                            "prompt (some do not), packed documents (docs/counts.md)")
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


def check_shared_flags(parser, args):
    """Refuse a bad shared flag in one line (parser.error: usage, the line, exit 2). Returns
    whether this run uses CUDA. A parser with replicas also gets `parser.ranks`: the model's
    copies that each see a part of the batch (one per GPU, 1 on the CPU), for check_model."""
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here; use --device cpu (or auto)")
    if args.fp64 and getattr(args, "mixed_precision", "off") != "off":  # fsdp.py's bf16
        parser.error(f"--fp64 with --mixed-precision {args.mixed_precision}: drop one of them")
    if parser.replicas:  # DataParallel: a copy of the model per GPU, made again every step
        parser.ranks = torch.cuda.device_count() if use_cuda else 1  # the CPU: no copies at all
        if args.compile:  # torch.compile does not follow the copies (its docs recommend DDP)
            parser.error("--compile: not with DataParallel, which copies the model to each GPU "
                         "every step; use ddp.py --compile (or single.py --compile)")
        if args.activation_checkpointing and parser.ranks > 1:
            # The checkpointed forward (compile_and_checkpoint) is stored on each block's
            # __dict__, bound to the block on GPU 0, and DataParallel copies a module's __dict__
            # into every replica: each would run GPU 0's weights on its own GPU's slice, and fail.
            parser.error(f"--activation-checkpointing: not with DataParallel on {parser.ranks} "
                         "GPUs (its replicas would all run GPU 0's weights); use ddp.py "
                         "--activation-checkpointing, or one GPU (CUDA_VISIBLE_DEVICES=0)")
    problem = compile_problem(use_cuda, args.fp64) if args.compile else None
    if problem:  # no compiler, say
        parser.error(problem)
    # One process: the batch divides into micro-batches. Several ranks: launch_world's caller
    # checks the batch against ranks x micro-batches, with the message that names both.
    if "nproc" not in args and args.batch_size % getattr(args, "accum_steps", 1):
        parser.error(f"--batch-size {args.batch_size} must be divisible by "
                     f"--accum-steps {args.accum_steps}; use a multiple of {args.accum_steps}")
    if args.experts and not parser.moe:
        parser.error(f"--experts: {parser.prog} trains the dense model only; use single.py, "
                     "ddp.py or fsdp.py for a mixture of experts")
    if not 0 <= args.balance < float("inf"):
        parser.error(f"--balance {args.balance}: must be 0 or a positive, finite coefficient")
    if args.experts and args.top_k == args.experts and args.balance:
        parser.error(f"--top-k {args.top_k} --experts {args.experts}: every token goes to every "
                     "expert, so the balancing loss is the constant 1; add --balance 0")
    if not 0 <= args.clip < float("inf"):  # nan too: it would train into nan
        parser.error(f"--clip {args.clip}: must be 0 (no clipping) or a positive, finite norm")
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
    # For plumbing.ranks.meet, before setup(): whether ranks may share a GPU over gloo, and
    # what its refusal calls them
    args.gpu_sharing, args.who = not own_gpus, "stages" if stages else "ranks"
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


def check_tp(parser, args, local_world, world_size=None):
    """TP's groups of --tp ranks (tp.py, nd.py), refused in one line unless T divides the
    heads, the sequence (--sequence-parallel), the vocabulary (--loss-parallel) and the
    `local_world` ranks of each machine; and, given the `world_size`, fsdp.py's options (tp.py)
    unless there is FSDP (2D) for them to act on, and --replicate divides its W/T groups."""
    if args.heads % args.tp:
        parser.error(f"--tp {args.tp} must divide --heads {args.heads} (each rank computes "
                     f"whole heads); use --heads {args.heads * args.tp} or another --tp")
    if getattr(args, "sequence_parallel", False) and common.SEQ_LEN % args.tp:
        parser.error(f"--sequence-parallel: --tp {args.tp} must divide the sequence length "
                     f"{common.SEQ_LEN} (each rank keeps an equal part of it); use a divisor of it")
    if getattr(args, "loss_parallel", False) and common.VOCAB % args.tp:
        parser.error(f"--loss-parallel: --tp {args.tp} must divide the vocabulary {common.VOCAB} "
                     "(each rank keeps the logits of an equal part of it); use a divisor of it")
    if local_world % args.tp:  # a TP group is T consecutive ranks, numbered machine by machine
        parser.error(f"--tp {args.tp}: {local_world} ranks per machine, so a TP group would span "
                     f"machines (all-reduces on the network); use a --tp dividing {local_world}")
    fsdp = (getattr(args, "replicate", 1), getattr(args, "reshard_after_forward", "true"),
            getattr(args, "mixed_precision", "off"))
    if world_size == args.tp and fsdp != (1, "true", "off"):
        parser.error("--replicate, --reshard-after-forward and --mixed-precision are FSDP's, and "
                     "pure TP runs no FSDP: use a --tp below the world size (2D)")
    if world_size and (world_size // args.tp) % fsdp[0]:
        parser.error(f"--replicate {fsdp[0]} must divide the {world_size // args.tp} groups of "
                     "--tp ranks (2D); use a divisor, or a smaller --tp")


def check_batch(parser, args, groups, name):
    """Refuse a --batch-size that `groups` data-parallel groups (each trains on its own shard
    of every batch; `name` says what they are) x --accum-steps micro-batches do not divide."""
    if args.batch_size % (groups * args.accum_steps):
        parser.error(f"--batch-size {args.batch_size} must be divisible by {name} x "
                     f"--accum-steps {args.accum_steps}; "
                     f"use a multiple of {groups * args.accum_steps}")


def most_workers(gpus, batch_size, accum_steps=1, width=None):
    """The default worker count: one per GPU (2 on a machine without), or fewer where that many
    would not divide the batch evenly (on 6 GPUs --batch-size 64 runs on 4, 16 samples each;
    --batch-size 96 would use all 6), nor `width` if given (what tensor parallelism cuts)."""
    return max((n for n in range(1, (gpus or 2) + 1) if batch_size % (n * accum_steps) == 0
                and (width is None or width % n == 0)), default=1)


def compile_and_checkpoint(blocks, args):
    """--compile and --activation-checkpointing, per block, in place. Both wrap the block's
    forward method, not the module, so the parameter names stay SimpleModel's (no "_orig_mod."
    prefix, no checkpoint wrapper's): checkpoints and --save files load with or without them."""
    for block in blocks:
        if args.compile:
            # The block's forward, compiled (inductor). Before checkpointing wraps it (the
            # order, and why not the whole module: docs/compile.md). Inside, backward's
            # recomputation runs the compiled code again. The first step pays the compile time (the
            # summary's "first step").
            block.forward = torch.compile(block.forward)
        if args.activation_checkpointing:
            # Keep only the block's input after forward; backward runs its forward again for
            # the rest (the norms' outputs, q, k, v, attention's output, GELU's input and
            # output: docs/compile.md counts them), at about one more forward's compute.
            # Non-reentrant, the current implementation.
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
