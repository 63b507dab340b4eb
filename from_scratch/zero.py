"""ZeRO by hand: Adam's state (ZeRO-1) and the gradients (ZeRO-2) sharded, from plain collectives.

What it teaches
    zero.py, written by hand: what ZeroRedundancyOptimizer (and DDP under it) do there, here
    with all_reduce, reduce_scatter_tensor and all_gather_into_tensor, one rung of the ZeRO
    ladder per --zero:
    - The weights lie in one flat buffer, padded to N equal slices, and the model's parameters
      are views of it (rank 0's weights, broadcast). Rank r owns slice r: Adam is built on that
      slice alone, so it keeps the two moments of 1/N of the weights.
    - Backward runs on the plain model; micro-batches add up in .grad with no communication.
      Then the gradient is flattened as the weights, times 1/N (DDP's order), and summed:
      --zero 1: all-reduced, as DDP does: every rank holds the whole average, and uses 1/N.
      --zero 2: reduce-scattered: each rank receives only its slice, for half the traffic.
    - --clip: the whole gradient's norm, its slices' squares summed over the ranks.
    - Adam steps the slice; an all-gather of the slices gives every rank the new weights.
    Per fp32 weight each rank holds 8 + 8/N bytes (ZeRO-1: weights, whole gradient, 1/N of the
    moments) or 4 + 12/N (ZeRO-2), against DDP's 16; the summary's state counts what it holds.
    A checkpoint gathers the moments on rank 0 as one plain Adam state, as zero.py's.

Where the real ones differ
    ZeroRedundancyOptimizer deals whole parameters to the ranks (greedily by size) and
    broadcasts them; DeepSpeed cuts one flat buffer as here. DeepSpeed's ZeRO-2 reduce-scatters
    bucket by bucket during backward and frees each gradient once sent; here the whole local
    gradient exists from backward (and over the micro-batches, as under no_sync()) to the
    reduce-scatter: the summary's state is what a rank keeps from the step's communication on.

Leaves out
    Overlap of communication with backward (from_scratch/ddp.py shows it), bucketing, mixed
    precision's fp32 master weights, and ZeRO-3 (the weights sharded too: from_scratch/fsdp.py).

Launch
    python from_scratch/zero.py                        # starts its own workers: one per GPU, or 2
    torchrun --nproc_per_node=2 from_scratch/zero.py   # ZeRO-1; zero.py's flags
    torchrun --nproc_per_node=2 from_scratch/zero.py --zero 2 --fp64 --save hand.pt
    torchrun --nproc_per_node=2 zero.py --fp64 --save zero.pt  # the same weights as hand.pt
    torchrun --nproc_per_node=2 --max-restarts=3 from_scratch/zero.py --checkpoint ckpt.pt
    Smallest hardware: any laptop CPU (2 processes over gloo).

What ZeroRedundancyOptimizer and DDP do in zero.py, written by hand
    diff zero.py from_scratch/zero.py

Docs
    https://arxiv.org/abs/1910.02054 (ZeRO: the stages and their bytes per weight)
    https://pytorch.org/docs/stable/distributed.optim.html (what zero.py uses)
Tested with torch 2.10.0, 2.13.0 and 2.15.0, on CPU/gloo.
"""

import datetime
import itertools
import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import record_function
from torch.utils.data import DataLoader, DistributedSampler

# common.py and plumbing/ are one folder up, in the collection's root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import SimpleModel, loss_fn, make_dataset, seed_everything
from plumbing.balance import balance
from plumbing.checkpoints import read_checkpoint, save_atomic, train_state
from plumbing.flags import check_shared_flags, compile_and_checkpoint, launch_world, shared_parser
from plumbing.meter import Meter, Profiler, eval_line, log_line, print0
from plumbing.model_check import check_model
from plumbing.ranks import fail, launch


def parse_args(argv=None):
    parser = shared_parser(__doc__, ranks=True)  # the flags every script shares (docs/usage.md)
    parser.groups["hardware"].add_argument(
        "--zero", type=int, choices=[1, 2], default=1,
        help="1: gradients all-reduced, Adam's state sharded; 2: gradients reduce-scattered too")
    args = parser.parse_args(argv)
    check_shared_flags(parser, args)  # and their checks: one line that names the fix
    launch_world(parser, args, own_gpus=False)  # torchrun's ranks, or --nproc started here
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
    print0(f"zero by hand: ZeRO-{args.zero} | {world_size} ranks | backend {args.backend} | "
           f"device {device.type} | torch {torch.__version__}")
    return rank, world_size, device


def evaluate(model, dataset, rank, world_size, batch_size, device):
    """The mean cross-entropy per token over the whole held-out set."""
    model.eval()  # SimpleModel has no dropout or BatchNorm, but the model you copy this to may
    # --- DDP: each rank evaluates a shard, unwrapped (no DDP hook), then the sums add up ---
    # Without drop_last, DistributedSampler pads the shards to one length with duplicates:
    # a rank's real samples are its first len(range(rank, n, N)) (docs/traps.md#padding).
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size // world_size, sampler=sampler)  # B/N each
    real = len(range(rank, len(dataset), world_size))
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # token losses, tokens
    with torch.no_grad():  # no graph, no activations kept: evaluation needs far less memory
        for x, y in loader:
            # Forwarded whole, then cut: a rank's last batch can be empty, and forwards fail on it
            logits, y = model(x.to(device))[:real], y[:real].to(device)
            real -= len(y)
            # Sums, divided once at the end: the mean of per-batch means would overweight a
            # smaller last batch.
            sums[0] += loss_fn(logits, y, reduction="sum")
            sums[1] += (y != -100).sum()  # the targets that count: cross_entropy skips -100s
    # Sums here too: a mean of the ranks' means would weigh a 333-sample shard like a 334 one.
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    # --- end ---
    model.train()
    return (sums[0] / sums[1]).item()


# --- ZeRO by hand: the weights in one flat buffer, of which each rank steps a slice ---
def flatten(model, rank, world_size):
    """Rank 0's weights in one flat buffer, padded to N equal slices, which the model's
    parameters become views of; return it and this rank's slice (the parameter Adam steps)."""
    params = [(module, name, p) for module in model.modules()
              for name, p in module.named_parameters(recurse=False)]
    if len({id(p) for *_, p in params}) < len(params):  # a tied weight: one tensor, two names
        fail("from_scratch/zero.py: error: the model ties weights, which one flat buffer would "
             "hold twice and train as two copies; untie them, or use zero.py")
    size = sum(p.numel() for *_, p in params)
    flat = params[0][2].new_zeros(-(-size // world_size) * world_size)
    offset = 0
    for module, name, p in params:
        view = flat[offset:offset + p.numel()].view_as(p)
        view.copy_(p.detach())
        setattr(module, name, torch.nn.Parameter(view))  # the same weight, now inside flat
        offset += p.numel()
    dist.broadcast(flat, src=0)  # one start on every rank, as DDP's
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    return flat, torch.nn.Parameter(flat.view(world_size, -1)[rank])


def gather_adam_state(model, optimizer, rank, world_size):
    """On rank 0, Adam's state as plain Adam over model.parameters() would hold it (None on
    the others): every rank's slice of the two moments gathered there (a collective)."""
    shard = optimizer.param_groups[0]["params"][0]
    state, whole = optimizer.state[shard], {}
    for key in ("exp_avg", "exp_avg_sq"):
        slices = [torch.empty_like(state[key]) for _ in range(world_size)] if rank == 0 else None
        dist.gather(state[key], slices, dst=0)
        whole[key] = torch.cat(slices) if rank == 0 else None
    if rank != 0:
        return None
    params = list(model.parameters())
    sizes = [p.numel() for p in params] + [shard.numel() * world_size - sum(
        p.numel() for p in params)]  # the padding, left out
    pieces = {key: value.split(sizes) for key, value in whole.items()}
    return {"state": {i: {"step": state["step"].clone(),
                          **{key: pieces[key][i].view_as(p).clone() for key in pieces}}
                      for i, p in enumerate(params)},
            "param_groups": [{**optimizer.param_groups[0], "params": list(range(len(params)))}]}
# --- end ---


def train(args, rank, world_size, device):
    """Train; return the model, the final loss and the final validation loss."""
    # --fp64: in float64 a correct strategy ends within 1e-9 of one device, where fp32's
    # rounding, amplified by Adam, can part them (docs/drift.md). Built in fp32, then cast.
    dtype = torch.float64 if args.fp64 else torch.float32
    seed_everything(args.seed)
    model = SimpleModel.from_args(args).to(device, dtype)
    # --compile and --activation-checkpointing, per block, before any wrapper
    compile_and_checkpoint(model.blocks.values(), args)
    # --- ZeRO by hand: the weights in one flat buffer; Adam steps this rank's 1/N of it ---
    flat, shard = flatten(model, rank, world_size)  # and rank 0's weights on every rank
    optimizer = torch.optim.Adam([shard], lr=args.lr)  # its moments: 1/N of the weights' size
    # --- end ---
    start_step = load_checkpoint(args, model, optimizer) if args.checkpoint else 0

    dataset, val_set = make_dataset("train", args.data), make_dataset("val", args.data)
    # --- DDP: shard the data ---
    # Each epoch one permutation from seed + epoch, the same on every rank, of which rank r
    # takes positions r, r+N, ...: the N ranks' B/N samples are one device's batch of B.
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    micro_batch = args.batch_size // (world_size * args.accum_steps)
    loader = DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True)
    # --- end ---
    steps_per_epoch = len(loader) // args.accum_steps

    meter = Meter(device)
    profiler = Profiler(args.profile, rank, device)  # does nothing without --profile
    final_loss = val_loss = float("nan")
    held = None  # the state this rank holds (the summary's), measured at each step
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
        # --- DDP: the global count, one all-reduce of an integer a step, before any forward ---
        # A rank counts its share of the batch; one device divides by every rank's. DDP
        # averages the gradients over the N ranks, so each rank's loss is multiplied by N.
        tokens = tokens.to(device)
        dist.all_reduce(tokens)
        # --- end ---
        for micro, (x, y) in enumerate(batches):
            x, y = x.to(device), y.to(device)
            # --- DDP: accumulate gradients without communicating ---
            # Nothing to skip: autograd adds each micro-batch into .grad, and the gradient is
            # communicated once, in the step below, as under DDP's no_sync().
            with record_function("forward"):
                loss = loss_fn(model(x), y, reduction="sum") * world_size / tokens
                loss = loss + balance(model, args, y, dist.group.WORLD) / args.accum_steps
            with record_function("backward"):
                loss.backward()
            # --- end ---
            loss_sum += loss.detach()
        with record_function("optimizer step"):
            # --- ZeRO by hand: average the gradient, step this rank's slice, share it ---
            # This rank's gradient, flat as the weights, times 1/N before the sum (as DDP)
            grads = torch.mul(torch.cat([p.grad.flatten() for p in model.parameters()] + [
                flat.new_zeros(flat.numel() - sum(p.numel() for p in model.parameters()))]),
                1 / world_size)
            model.zero_grad(set_to_none=True)  # the flat copy is the gradient from here on
            if args.zero == 1:  # all-reduce: every rank gets the whole average, uses its slice
                dist.all_reduce(grads)
                shard.grad = grads.view(world_size, -1)[rank]
            else:  # reduce-scatter: half the traffic, and each rank gets its slice only
                shard.grad = flat.new_empty(shard.numel())
                dist.reduce_scatter_tensor(shard.grad, grads)
                grads = shard.grad  # the whole one freed: this rank holds 1/N of the gradient
            # --clip: the whole gradient's norm, the slices' squares summed over the ranks (a
            # rank's own slice alone would scale each slice by another factor)
            grad_norm = shard.grad.square().sum()
            dist.all_reduce(grad_norm)
            grad_norm = grad_norm.sqrt()
            if args.clip:  # clip_grad_norm_'s rule: scale down to --clip where it is larger
                shard.grad.mul_((args.clip / (grad_norm + 1e-6)).clamp(max=1))
            optimizer.step()
            # The summary's state: what this rank holds from backward to the step's end
            held = flat.nbytes + grads.nbytes + sum(
                v.nbytes for v in optimizer.state[shard].values() if v.dim())
            optimizer.zero_grad(set_to_none=True)
            del grads
            # Every rank's updated slice to every rank, into the buffer the model's weights
            # are views of: the replicas end the step equal. From a copy: the input would
            # otherwise be a slice of the output.
            dist.all_gather_into_tensor(flat, shard.detach().clone())
            # --- end ---
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
                val_loss = evaluate(model, val_set, rank, world_size, args.batch_size, device)
            print0(eval_line(step + 1, args.steps, val_loss))
        if args.checkpoint and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
            # --- ZeRO by hand: every rank sends its slice of Adam's state to rank 0 ---
            state = gather_adam_state(model, optimizer, rank, world_size)
            if rank == 0:  # one writer: the replicas are identical; resumes on any world size
                save_checkpoint(args, model, state, step + 1)
            del state
            # --- end ---
    profiler.stop()
    print0(meter.summary(final_loss, model, val_loss=val_loss,
                         state_bytes=held))
    return model, final_loss, val_loss


def save_checkpoint(args, model, adam_state, step):
    """Everything needed to continue exactly where this run is: the data position is a
    function of (seed, step, global batch) only, so those three are all it needs besides the
    weights and Adam's state."""
    save_atomic({"model": model.state_dict(), "optimizer": adam_state,
                 **train_state(args, step)}, args.checkpoint)
    print(f"checkpoint: step {step} -> {args.checkpoint}", flush=True)


def load_checkpoint(args, model, optimizer):
    """Resume from --checkpoint if it holds one: the weights, Adam's state; return the step to
    start from (0 without one). A bad one stops with one line and is left as it was."""
    state = read_checkpoint(args, __file__)  # torch.load(weights_only=True), checked; or None
    if state is None:
        return 0
    model.load_state_dict(state["model"])
    # --- ZeRO by hand: this rank's slice of a plain Adam state, laid out as the weights ---
    plain, shard = state["optimizer"], optimizer.param_groups[0]["params"][0]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = {}
    for key in ("exp_avg", "exp_avg_sq"):  # every parameter's, flat and padded as the weights
        # By index, as Adam numbers model.parameters(): the file's key order is not that
        whole = torch.cat([plain["state"][i][key].flatten() for i in range(len(plain["state"]))])
        whole = torch.cat([whole, whole.new_zeros(shard.numel() * world_size - len(whole))])
        # A copy: a view of the slice would keep every rank's moments alive in this one
        mine[key] = whole.view(world_size, -1)[rank].clone()
    optimizer.load_state_dict({"state": {0: {"step": plain["state"][0]["step"], **mine}},
                               "param_groups": [{**plain["param_groups"][0], "params": [0]}]})
    # --- end ---
    print0(f"resumed from {args.checkpoint} at step {state['step']}")
    return state["step"]


def run(args):
    """What each process does: set up, train, save."""
    rank, world_size, device = setup(args)
    model, _, _ = train(args, rank, world_size, device)
    if args.save and rank == 0:
        # The unwrapped model: the wrapper's state_dict names each weight "module.<name>"
        save_atomic(model.state_dict(), args.save)  # CPU tensors: loads anywhere
    dist.destroy_process_group()  # on a clean exit only: after an error, peers may hang


def main(argv=None):
    args = parse_args(argv)
    launch(run, args)  # one rank under torchrun, else --nproc of them started here


if __name__ == "__main__":
    main()
