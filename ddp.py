"""DistributedDataParallel (DDP): one process per device, gradients averaged during backward.

What it teaches
    Each process holds a full copy of SimpleModel and trains on its own shard of every global
    batch. During backward, DDP all-reduces the gradients bucket by bucket, overlapping the rest
    of backward: after `loss.backward()` every replica holds the *whole* batch's gradient, so
    clipping and the step need nothing more and stay identical on all ranks. With global batch
    B on N ranks (B/N each) it equals one device with batch B: the tests prove it to 1e-9 (fp64).

When to use it
    Whenever the model fits on one device and you have more than one device: one machine or
    many, GPUs or CPUs. PyTorch recommends it over DataParallel even on a single machine.
When not
    The model (plus optimizer state) does not fit on one device: shard Adam's state
    (zero.py), or everything (fsdp.py), or cut the model into stages (pipeline.py).

Launch
    python ddp.py                          # starts its own workers: one per GPU, or 2 on a CPU
    python ddp.py --nproc 4 --device cpu   # 4 CPU workers on one machine
    torchrun --nproc_per_node=2 ddp.py     # what clusters use; same flags after the script
    # "my DDP run doesn't match one GPU": compare in float64, where rounding cannot part them
    # (fp32 can, by 1e-2 on a long run): within 1e-9 of single.py --fp64, or a bug
    torchrun --nproc_per_node=2 ddp.py --fp64 --save ddp.pt
    # survive a crash: torchrun restarts the group, which resumes from the checkpoint
    torchrun --nproc_per_node=2 --max-restarts=3 ddp.py --checkpoint ckpt.pt
    # several machines, elastic: the same line on each; 1 to 4 machines take part, ranks given
    # out in order of arrival (whatever --node-rank says). --batch-size 96 divides every world
    # size it may meet (8, 16, 24, 32; 64 does not divide 24, and a refusal costs a restart):
    torchrun --nnodes=1:4 --nproc_per_node=8 --max-restarts=3 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST:29500 --rdzv-id=myjob ddp.py --batch-size 96 \
        --checkpoint /shared/ckpt.pt
    # several machines, static (ranks follow --node-rank: 0 on HOST, 1 on the other):
    torchrun --nnodes=2 --node-rank=0 --nproc_per_node=8 --master-addr=HOST \
        --master-port=29500 ddp.py
    The rendezvous store has no authentication: use it on a trusted network only.
    Smallest hardware: any laptop CPU (2 processes over gloo).

What data parallelism adds to one device, and what comes next
    diff single.py ddp.py
    diff ddp.py zero.py    # ZeRO-1: Adam's state sharded over the ranks

Docs
    https://pytorch.org/docs/stable/notes/ddp.html
    https://pytorch.org/tutorials/intermediate/ddp_tutorial.html
Tested with torch 2.10.0 (the oldest that requirements.txt admits), 2.13.0 and 2.15.0, on CPU/gloo.
"""

import contextlib
import datetime
import itertools
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import record_function
from torch.utils.data import DataLoader, DistributedSampler

from common import SimpleModel, loss_fn, make_dataset, seed_everything
from plumbing.balance import balance
from plumbing.checkpoints import read_checkpoint, save_atomic, train_state
from plumbing.flags import check_shared_flags, compile_and_checkpoint, launch_world, shared_parser
from plumbing.meter import Meter, Profiler, eval_line, held_bytes, log_line, print0
from plumbing.model_check import check_model
from plumbing.ranks import launch


def parse_args(argv=None):
    parser = shared_parser(__doc__, ranks=True)  # the flags every script shares (docs/usage.md)
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
    print0(f"ddp: {world_size} ranks | backend {args.backend} | device {device.type} | "
           f"torch {torch.__version__}")
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


def train(args, rank, world_size, device):
    """Train; return the model, the final loss and the final validation loss."""
    # --fp64: in float64 a correct strategy ends within 1e-9 of one device, where fp32's
    # rounding, amplified by Adam, can part them (docs/drift.md). Built in fp32, then cast.
    dtype = torch.float64 if args.fp64 else torch.float32
    seed_everything(args.seed)
    model = SimpleModel.from_args(args).to(device, dtype)
    # --compile and --activation-checkpointing, per block, before any wrapper
    compile_and_checkpoint(model.blocks.values(), args)
    # --- DDP: wrap the model: rank 0's weights broadcast, gradients averaged in backward ---
    # Backward fills the gradients into buckets of 25 MB (the first one 1 MB), and DDP
    # all-reduces each bucket as soon as it is full. Each .grad is a view into its bucket.
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    gradient_as_bucket_view=True)
    # --- end ---
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
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
            # no_sync() skips the all-reduce; it must cover forward *and* backward: forward is
            # where DDP decides whether the coming backward syncs. The last one syncs the sum.
            with ddp_model.no_sync() if micro < args.accum_steps - 1 else contextlib.nullcontext():
                with record_function("forward"):
                    loss = loss_fn(ddp_model(x), y, reduction="sum") * world_size / tokens
                    loss = loss + balance(model, args, y, dist.group.WORLD) / args.accum_steps
                with record_function("backward"):
                    loss.backward()
            # --- end ---
            loss_sum += loss.detach()
        with record_function("optimizer step"):
            # --clip: scale the whole gradient, as one vector, down to this norm if it is
            # larger (0: never; the norm is still measured). Returns the norm before clipping.
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                       args.clip or float("inf"))
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
                val_loss = evaluate(model, val_set, rank, world_size, args.batch_size, device)
            print0(eval_line(step + 1, args.steps, val_loss))
        if args.checkpoint and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
            if rank == 0:  # one writer: the replicas are identical; resumes on any world size
                save_checkpoint(args, model, optimizer, step + 1)
    profiler.stop()
    print0(meter.summary(final_loss, model, val_loss=val_loss,
                         state_bytes=held_bytes(model, optimizer)))
    return model, final_loss, val_loss


def save_checkpoint(args, model, optimizer, step):
    """Everything needed to continue exactly where this run is: the data position is a
    function of (seed, step, global batch) only, so those three are all it needs besides the
    weights and Adam's state."""
    save_atomic({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 **train_state(args, step)}, args.checkpoint)
    print(f"checkpoint: step {step} -> {args.checkpoint}", flush=True)


def load_checkpoint(args, model, optimizer):
    """Resume from --checkpoint if it holds one: the weights, Adam's state; return the step to
    start from (0 without one). A bad one stops with one line and is left as it was."""
    state = read_checkpoint(args, __file__)  # torch.load(weights_only=True), checked; or None
    if state is None:
        return 0
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])  # puts Adam's moments on the device
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
