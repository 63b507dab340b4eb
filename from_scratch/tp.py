"""Tensor parallelism (TP) by hand: Megatron-LM's cut layers from two autograd functions.

What it teaches
    tp.py, written by hand: what DTensor and parallelize_module do there for pure TP, here with
    plain tensors and all_reduce. Every rank builds one device's model from --seed and keeps its
    slice of each layer the model's tp_plan cuts (SimpleModel.tp_plan, the plan tp.py hands to
    parallelize_module), over all T ranks:
    - "colwise" (q, k, v, up): 1/T of the output features, rows of the weight and of the bias:
      H/T whole heads of q, k and v, 1/T of the inner units of up; no communication;
    - "rowwise" (o, down): 1/T of the input features, columns of the weight: each rank's
      product is a partial sum, and an all-reduce adds up the T of them.
    Two autograd functions carry all of it (Megatron-LM's f and g). f, before a cut region
    (attention as a whole: "shared_input"; `up`): identity forward, and backward all-reduces the
    input's gradient, of which each rank's slice computed a part. g, after o and down: the
    all-reduce forward, identity backward (the output's gradient is whole on every rank). Four
    all-reduces per block per micro-batch, two each way, as tp.py. Attention computes with the
    H/T heads its slice holds: common.py's Attention splits q by a head's width, not by a head
    count, so nothing in it changes. The gradient norm for --clip is the whole gradient's: the
    slices' squares summed over the ranks, the whole tensors counted once.

Where tp.py differs
    A DTensor carries its layout (Shard, Replicate, Partial) and DTensor redistributes where an
    op needs another, so parallelize_module only says how each layer is cut; here each layer's
    communication is written where it happens, and a slice says so by an attribute (tp_dim, as
    Megatron-LM marks its cut weights with partition_dim). The row-parallel bias is added as
    DTensor adds it, b/T on each rank before the all-reduce (Megatron-LM adds b after it: equal
    up to rounding); the gradient norm is summed in another order than torch's over DTensors
    (equal up to rounding). tp.py builds on "meta" and fills each rank's shards from rank 0;
    here every rank builds the whole model first, so it must fit in one process's memory.

Leaves out
    2D (--tp smaller than the world: FSDP across TP groups), --sequence-parallel,
    --loss-parallel and --checkpoint (each refused in one line: use tp.py); a plan that cuts an
    nn.Embedding (tp.py cuts it, by hand it stops in one line).

Launch
    python from_scratch/tp.py                            # starts its own workers: one per GPU, or 2
    torchrun --nproc_per_node=2 from_scratch/tp.py       # each block cut in 2
    torchrun --nproc_per_node=2 from_scratch/tp.py --fp64 --save hand.pt
    torchrun --nproc_per_node=2 tp.py --fp64 --save tp.pt  # hand.pt's, to the bit
    python -m pytest -q tests/test_tp.py -k by_hand       # the proofs, and its mistakes
    Smallest hardware: any laptop CPU (2 processes over gloo). On GPUs, NCCL: one GPU per rank,
    all on one machine.

What DTensor and parallelize_module do in tp.py, written by hand
    diff tp.py from_scratch/tp.py

Docs
    https://arxiv.org/abs/1909.08053 (Megatron-LM, section 3: f and g)
    https://pytorch.org/docs/stable/distributed.tensor.parallel.html (what tp.py uses)
Tested with torch 2.10.0, 2.13.0 and 2.15.0, on CPU/gloo.
"""

import datetime
import itertools
import os
import sys
import types
from fnmatch import fnmatch

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function
from torch.utils.data import DataLoader, DistributedSampler

# common.py and plumbing/ are one folder up, in the collection's root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import SimpleModel, loss_fn, make_dataset, seed_everything
from plumbing.balance import balance
from plumbing.checkpoints import save_atomic
from plumbing.flags import check_shared_flags, compile_and_checkpoint, launch_world, shared_parser
from plumbing.flags import check_tp, grid, positive
from plumbing.meter import Meter, Profiler, eval_line, held_bytes, log_line, print0
from plumbing.model_check import check_model
from plumbing.ranks import fail, launch


def parse_args(argv=None):
    parser = shared_parser(__doc__, sharded=True, ranks=True, moe=False)
    hardware = parser.groups["hardware"]
    hardware.add_argument("--reshard-after-forward", choices=["true", "false"], default="true",
                          help="false: keep the gathered weights for backward (less traffic)")
    hardware.add_argument("--replicate", type=positive(int), default=1, metavar="R",
                          help="HSDP: R replicas, each sharded over N/R ranks (default 1: FSDP)")
    hardware.add_argument("--mixed-precision", choices=["off", "bf16"], default="off",
                          help="bf16: compute in bf16, reduce gradients and keep weights in fp32")
    hardware.add_argument("--tp", type=positive(int), default=None, help="ranks per tensor-"
                          "parallel group (default: all, pure TP); fewer: 2D, FSDP across them")
    hardware.add_argument("--sequence-parallel", action="store_true", help="also cut the "
                          "activations between the TP regions along the sequence (SP)")
    hardware.add_argument("--loss-parallel", action="store_true",
                          help="keep the logits cut over the vocabulary through the loss")
    args = parser.parse_args(argv)
    check_shared_flags(parser, args)  # and their checks: one line that names the fix
    # torchrun's ranks, or the --nproc workers started here
    world_size, local_world, _ = launch_world(parser, args, width=args.heads, data_parallel=False)
    grid(parser, args, "--tp", world_size)  # --tp: all ranks by default; W/T groups
    if args.tp < world_size:  # by hand: pure TP, one group of all the ranks
        parser.error(f"--tp {args.tp}: 2D (FSDP across TP groups) is not written by hand; "
                     f"use tp.py --tp {args.tp}")
    for flag in ("--sequence-parallel", "--loss-parallel", "--checkpoint"):
        if getattr(args, flag[2:].replace("-", "_")):
            parser.error(f"{flag}: not written by hand; use tp.py {flag}")
    check_tp(parser, args, local_world, world_size)  # T divides what it cuts, the machines
    check_model(parser, args)  # and the model: what would train silently wrong, refused
    return args


def setup(args):
    """Join the process group; return this process's rank, the world size and its device."""
    rank = int(os.environ["RANK"])  # which shard of the data this process trains on
    local_rank = int(os.environ["LOCAL_RANK"])  # which device on *this* machine it drives
    world_size = int(os.environ["WORLD_SIZE"])
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        # LOCAL_RANK, not RANK, picks the GPU: on the second machine RANK starts at 8 and
        # cuda:8 does not exist. Modulo the GPUs it sees: one shown only its own has cuda:0.
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        # Before init_process_group: else NCCL puts every rank's context on cuda:0.
        torch.cuda.set_device(device)
        # fp32 means fp32: TF32 off, so a GPU run matches the CPU to ~1e-6 (docs/traps.md#tf32).
        torch.set_float32_matmul_precision("highest")
    else:
        device = torch.device("cpu")
    # init_process_group reads torchrun's environment: where the ranks meet (MASTER_ADDR,
    # MASTER_PORT), who this one is (RANK, WORLD_SIZE). --backend: NCCL between GPUs of their
    # own, else gloo ("auto", resolved before setup()). The timeout turns a dead or stuck peer
    # into an error on every survivor, not a hang.
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout),
                            device_id=device if args.backend == "nccl" else None)
    print0(f"tp by hand: {world_size} ranks = {world_size // args.tp} (dp) x {args.tp} (tp) | "
           f"backend {args.backend} | device {device.type} | torch {torch.__version__}")
    return rank, world_size, device


def evaluate(model, dataset, batch_size, device):
    """The mean cross-entropy per token over the whole held-out set."""
    model.eval()  # SimpleModel has no dropout or BatchNorm, but the model you copy this to may
    # --- TP by hand: one TP group, every rank forwards every batch (a collective) ---
    # Its ranks work on the same samples and hold the same sums: no sampler, no sum over ranks.
    loader = DataLoader(dataset, batch_size=batch_size)
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # token losses, tokens
    with torch.no_grad():  # no graph, no activations kept: evaluation needs far less memory
        for x, y in loader:
            logits, y = model(x.to(device)), y.to(device)
            # Sums, divided once at the end: the mean of per-batch means would overweight a
            # smaller last batch.
            sums[0] += loss_fn(logits, y, reduction="sum")
            sums[1] += (y != -100).sum()  # the targets that count: cross_entropy skips -100s
    # --- end ---
    model.train()
    return (sums[0] / sums[1]).item()


# --- TP by hand: Megatron-LM's f and g, all the communication of a cut block ---
class Copy(torch.autograd.Function):
    """f: the input of a cut region, whole on every rank. Identity forward; backward adds up
    the input's gradient over the group: each rank's slice of the layers computed a part."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # A copy, as all_reduce works in place: autograd may hand this same tensor to other
        # inputs too (an add gives its two inputs one gradient tensor)
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class Reduce(torch.autograd.Function):
    """g: the partial sums of a row-parallel layer added up over the group. All-reduce forward;
    identity backward: the sum's gradient is every partial sum's, whole on every rank."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()  # all_reduce works in place; autograd's input stays as it was
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def row_parallel(linear, x):
    """A row-parallel layer's forward (its method): this rank's columns times its slice of the
    input, a partial sum, and g adds up the T of them over linear.tp_group."""
    bias, group = linear.bias, linear.tp_group
    if bias is not None:
        # Added as DTensor adds it in tp.py, b/T on each rank before the sum: the same
        # operations, so the same bits (Megatron-LM adds b after the sum: equal up to
        # rounding). b's gradient stays whole: written `bias / T`, autograd would divide it by
        # T too, and b would learn T times too slowly while everything else looks right.
        bias = bias.detach() / group.size() + (bias - bias.detach())
    return Reduce.apply(F.linear(x, linear.weight, bias), group)


def parallelize(model, group):
    """Cut, in place, each layer model.tp_plan names over `group`'s T ranks, as tp.py's
    parallelize_module does with the same plan: "colwise" keeps 1/T of the output features
    (rows of the weight and of the bias), "rowwise" 1/T of the input features (columns); f
    before each cut region ("shared_input": attention, whose q, k and v share it; a colwise
    layer outside one), g after each rowwise layer. The norms, embeddings and head stay whole."""
    rank, size = group.rank(), group.size()

    def keep(module, name, dim):  # this rank's slice of module.<name> along dim, marked so
        whole = getattr(module, name)
        if whole is not None:
            if whole.shape[dim] % size:  # chunk would cut uneven slices, which no rank expects
                fail(f"from_scratch/tp.py: error: {type(module).__name__} {name} of "
                     f"{whole.shape[dim]} features on {size} ranks; use a count that divides it")
            part = nn.Parameter(whole.detach().chunk(size, dim)[rank].clone())
            part.tp_dim = dim  # gathered on that dim by --save; its norm summed over the ranks
            setattr(module, name, part)

    tensors = len(list(model.parameters()))  # a tied weight counted once
    inside = tuple(f"{key}." for key, kind in model.tp_plan.items() if kind == "shared_input")
    for key, kind in model.tp_plan.items():
        for name, module in model.named_modules():
            if not fnmatch(name, key) or name.count(".") != key.count("."):
                continue  # "*" stands for one name, as parallelize_module reads a key
            if kind.endswith("wise") and not isinstance(module, nn.Linear):
                fail(f"from_scratch/tp.py: error: tp_plan cuts {name}, a {type(module).__name__}; "
                     "by hand only nn.Linear is cut: use tp.py")
            # q, k and v take attention's input, f'd once: three gradients summed, one all-reduce
            if kind == "shared_input" or kind == "colwise" and not key.startswith(inside):
                module.register_forward_pre_hook(
                    lambda _, args: (Copy.apply(args[0], group), *args[1:]))
            if kind == "colwise":
                keep(module, "weight", 0)
                keep(module, "bias", 0)
            elif kind == "rowwise":  # its bias stays whole: row_parallel adds b/T per rank
                keep(module, "weight", 1)
                # A method, one function for every layer: --compile then compiles a block once
                module.tp_group, module.forward = group, types.MethodType(row_parallel, module)
    if len(list(model.parameters())) != tensors:  # keep() gave a tied weight's holders two
        fail("from_scratch/tp.py: error: tp_plan cuts a tied weight, which would train as two "
             "copies apart; untie it, or use tp.py, which keeps it one tensor")
    return model


def clip_grad_norm(model, max_norm, group):
    """torch's clip_grad_norm_ of a model of slices and whole tensors: the whole gradient's
    norm (the slices' squares summed over the group, the whole tensors', the same on every
    rank, counted once), every gradient scaled by one factor. Returns the norm before."""
    params = list(model.parameters())
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if hasattr(p, "tp_dim")])
    norm = norm.square()
    dist.all_reduce(norm, group=group)  # else each rank clips by its own slices' norm
    whole = torch.nn.utils.get_total_norm([p.grad for p in params if not hasattr(p, "tp_dim")])
    norm = (norm + whole.square()).sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
# --- end ---


def train(args, rank, world_size, device):
    """Train; return the model, the final loss and the final validation loss."""
    # --fp64: in float64 a correct strategy ends within 1e-9 of one device, where fp32's
    # rounding, amplified by Adam, can part them (docs/drift.md). Built in fp32, then cast.
    dtype = torch.float64 if args.fp64 else torch.float32
    # --- TP by hand: one device's model on every rank, each keeping its slices ---
    # Every rank builds it from --seed (on the CPU, as one device's), so no rank sends weights.
    seed_everything(args.seed)
    model = SimpleModel.from_args(args).to(device, dtype)
    # --compile and --activation-checkpointing, per block, before any wrapper
    compile_and_checkpoint(model.blocks.values(), args)
    group = dist.group.WORLD  # pure TP: one TP group of all the ranks
    parallelize(model, group)
    # --- end ---
    # After cutting, never before: it puts new tensors (the slices) in the model, and an
    # optimizer built earlier would hold the old ones, which get no gradients: silently.
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    start_step = 0  # --checkpoint: tp.py

    dataset, val_set = make_dataset("train", args.data), make_dataset("val", args.data)
    # --- TP: shard the data by TP group, not by rank ---
    # A TP group's ranks compute slices of the same samples (fed by rank, the all-reduces
    # would add up slices of different ones): the batch is dealt over the D = W/T groups.
    dp_rank, dp = 0, 1  # pure TP: one group, D = 1
    sampler = DistributedSampler(dataset, num_replicas=dp, rank=dp_rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    micro_batch = args.batch_size // (dp * args.accum_steps)
    loader = DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True)
    # --- end ---
    steps_per_epoch = len(loader) // args.accum_steps

    meter = Meter(device)
    profiler = Profiler(args.profile, rank, device)  # does nothing without --profile
    final_loss = val_loss = float("nan")
    for step in range(start_step, args.steps):
        epoch, index = divmod(step, steps_per_epoch)
        if index == 0 or step == start_step:
            # Without set_epoch every epoch replays epoch 0's order (the seed never moves).
            sampler.set_epoch(epoch)
            # A resumed run skips the part of the epoch that was trained before the stop.
            micro_batches = itertools.islice(loader, index * args.accum_steps, None)
        loss_sum = torch.zeros((), device=device, dtype=dtype)
        # The step's K micro-batches, drawn first: their summed losses are divided by the targets
        # that count in all of them (cross_entropy skips -100s: a prompt's, padding), as one
        # batch's mean is. A micro-batch's mean over K would weigh a short one like a long one.
        batches = [next(micro_batches) for _ in range(args.accum_steps)]
        tokens = sum((y != -100).sum() for _, y in batches)
        for micro, (x, y) in enumerate(batches):
            x, y = x.to(device), y.to(device)
            with record_function("forward"):
                loss = loss_fn(model(x), y, reduction="sum") / tokens
                loss = loss + balance(model, args, y, dist.group.WORLD) / args.accum_steps
            with record_function("backward"):
                loss.backward()
            loss_sum += loss.detach()
        with record_function("optimizer step"):
            # --clip: scale the whole gradient, as one vector, down to this norm if it is
            # larger (0: never; the norm is still measured). Returns the norm before clipping.
            # Of slices: their squares summed over the group, not ~1/sqrt(T) of it.
            grad_norm = clip_grad_norm(model, args.clip or float("inf"), group)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        samples_per_s = meter.step(args.batch_size)
        profiler.step()

        if step == 0 or (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            # A collective: every rank reaches it, at steps that depend on the step only.
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
            final_loss = loss_sum.item()
            print0(log_line(step + 1, args.steps, final_loss, grad_norm.item(),
                        samples_per_s))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            with meter.paused(), record_function("evaluation"):
                val_loss = evaluate(model, val_set, args.batch_size, device)
            print0(eval_line(step + 1, args.steps, val_loss))
    profiler.stop()
    print0(meter.summary(final_loss, model, val_loss=val_loss,
                         state_bytes=held_bytes(model, optimizer)))
    return model, final_loss, val_loss


def run(args):
    """What each process does: set up, train, save."""
    rank, world_size, device = setup(args)
    model, _, _ = train(args, rank, world_size, device)
    if args.save:
        # --- TP by hand: one device's state_dict, each slice gathered from every rank ---
        # A collective, one tensor at a time: every rank takes part; rank 0 writes.
        weights = {}
        for name, tensor in model.state_dict(keep_vars=True).items():  # with their marks
            weights[name] = tensor.detach()
            if hasattr(tensor, "tp_dim"):
                pieces = [torch.empty_like(weights[name]) for _ in range(world_size)]
                dist.all_gather(pieces, weights[name].contiguous())
                weights[name] = torch.cat(pieces, tensor.tp_dim)
        # --- end ---
        if rank == 0:
            save_atomic(weights, args.save)
    dist.destroy_process_group()  # on a clean exit only: after an error, peers may hang


def main(argv=None):
    args = parse_args(argv)
    launch(run, args)  # one rank under torchrun, else --nproc of them started here


if __name__ == "__main__":
    main()
