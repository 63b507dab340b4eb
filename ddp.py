"""DistributedDataParallel (DDP): one process per device, gradients averaged during backward.

What it teaches
    Each process holds a full copy of SimpleModel and trains on its own shard of every global
    batch. During backward, DDP all-reduces the gradients bucket by bucket (overlapping the
    communication with the rest of backward), so after `loss.backward()` every replica holds
    the gradient of the *whole* global batch and the optimizer steps stay identical on all ranks.
    With global batch B on N ranks (B/N per rank), the result equals one device with batch B:
    the tests in tests/ prove it in float64 to 1e-9.

When to use it
    Whenever the model fits on one device and you have more than one device: one machine or
    many, GPUs or CPUs. PyTorch recommends it over DataParallel even on a single machine.
When not
    The model (plus optimizer state) does not fit on one device: shard it (fsdp.py) or cut it
    into stages (pipeline.py).

ZeRO-1 (--zero1), and why DDP stops there
    Adam keeps two moments per weight: with fp32 weights and gradients that is half of the 16
    bytes every replica holds per weight. --zero1 (ZeroRedundancyOptimizer) gives each rank the
    moments of 1/N of the parameters: it steps only those and then broadcasts them, so the
    weights end as plain DDP's and the memory per rank falls from 16 to 8 + 8/N bytes per
    weight, for one broadcast of the weights per step. Sharding more needs another
    communication pattern than DDP's: ZeRO-2 (gradients) replaces the all-reduce with a
    reduce-scatter, ZeRO-3 (weights) gathers each layer before use. That is FSDP: fsdp.py,
    whose --reshard-after-forward false is ZeRO-2's trade. docs/memory.md measures the ladder.

Launch
    python ddp.py                          # starts its own workers: one per GPU, or 2 on a CPU
    python ddp.py --nproc 4 --device cpu   # 4 CPU workers on one machine
    python ddp.py --zero1                  # ZeRO-1: Adam's state sharded over the ranks
    torchrun --nproc_per_node=2 ddp.py     # what clusters use; same flags after the script
    # "my DDP run doesn't match one GPU": compare in float64, where rounding cannot part them
    # (fp32 can, by 1e-2 on a long run): within 1e-9 of single.py --fp64, or a bug
    torchrun --nproc_per_node=2 ddp.py --fp64 --save ddp.pt
    # survive a crash: torchrun restarts the group, which resumes from the checkpoint
    torchrun --nproc_per_node=2 --max-restarts=3 ddp.py --checkpoint ckpt.pt
    # several machines, elastic (run the same line on each; 1 to 4 machines may take part,
    # and ranks are given out in order of arrival, whatever --node-rank says). The world size
    # is 8, 16, 24 or 32: --batch-size 96 is a multiple of each (64 is not of 24, and every
    # refusal would cost a restart):
    torchrun --nnodes=1:4 --nproc_per_node=8 --max-restarts=3 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST:29500 --rdzv-id=myjob ddp.py --batch-size 96 \
        --checkpoint /shared/ckpt.pt
    # several machines, static (ranks follow --node-rank: 0 on HOST, 1 on the other):
    torchrun --nnodes=2 --node-rank=0 --nproc_per_node=8 --master-addr=HOST \
        --master-port=29500 ddp.py
    The rendezvous store has no authentication: use it on a trusted network only.
    Smallest hardware: any laptop CPU (2 processes over gloo).

What data parallelism adds to one device
    diff single.py ddp.py

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
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import record_function
from torch.utils.data import DataLoader, DistributedSampler

from common import Meter, Profiler, SimpleModel, eval_line, log_line, make_dataset
from common import check_resumable, fail, flops_per_sample, held_bytes, loss_fn, print0
from common import save_atomic, seed_everything, unloadable
from common import gpu_sharers, launch, leave, rendezvous_store
from common import check_shared_flags, compile_and_checkpoint, launch_world, shared_parser


def parse_args(argv=None):
    parser = shared_parser(__doc__, ranks=True)  # the flags every script shares (docs/usage.md)
    hardware = parser.groups["hardware"]
    hardware.add_argument("--zero1", action="store_true",
                          help="ZeRO-1: each rank keeps and updates Adam's state for 1/N of the "
                               "parameters (ZeroRedundancyOptimizer); same weights, less memory")
    args = parser.parse_args(argv)
    use_cuda = check_shared_flags(parser, args)  # and their checks: one line that names the fix
    # torchrun's ranks, or the --nproc workers started here (common.launch_world). DDP lets
    # gloo ranks share a GPU (setup() says so), so the one-GPU-per-rank check is its own:
    world_size, local_world, gpus = launch_world(parser, args, use_cuda, own_gpus=False)
    if args.backend == "nccl" and (not gpus or local_world > gpus and "RANK" not in os.environ):
        parser.error(f"--backend nccl: {local_world} ranks on this machine but {gpus} GPU(s); "
                     "NCCL needs one GPU per rank: use fewer ranks or --backend gloo")
    if args.batch_size % (world_size * args.accum_steps):
        parser.error(f"--batch-size {args.batch_size} must be divisible by world size "
                     f"{world_size} x --accum-steps {args.accum_steps}; "
                     f"use a multiple of {world_size * args.accum_steps}")
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
        # Before init_process_group: NCCL binds to the *current* device, and without this
        # every rank would create its context and buffers on cuda:0.
        torch.cuda.set_device(device)
        # fp32 means fp32: TF32 off, so a GPU run matches the CPU to ~1e-6 (docs/traps.md#tf32).
        torch.set_float32_matmul_precision("highest")
    else:
        device = torch.device("cpu")
    store = rendezvous_store(rank, world_size, args.timeout)  # the launcher's, or rank 0's
    # NCCL wants a GPU of its own for every rank: told by UUIDs, not counts (common.py).
    sharers = gpu_sharers(store, device) if use_cuda else 1
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if use_cuda and sharers == 1 else "gloo"
    if backend == "nccl" and sharers > 1:
        fail(f"{os.path.basename(__file__)}: error: {sharers} ranks, one GPU: use --backend gloo")
    # The timeout turns a dead or stuck peer into an error on every survivor, not a hang.
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=args.timeout),
                            device_id=device if backend == "nccl" else None)
    print0(f"ddp: {world_size} ranks | backend {backend} | device {device.type} | "
           f"torch {torch.__version__}")
    if sharers > 1:
        # Host copies: a test setup; EXCLUSIVE_PROCESS GPUs refuse it (docs/traps.md#gloo-on-gpus).
        print0(f"ddp: {sharers} ranks share a GPU over gloo: slow")
    return rank, world_size, device


def evaluate(model, dataset, rank, world_size, batch_size, device):
    """The mean cross-entropy per token over the whole held-out set, exactly. Every rank must
    call it: it ends in a collective (rank 0 alone would hang, pytorch/pytorch#54059)."""
    model.eval()  # SimpleModel has no dropout or BatchNorm, but the model you copy this to may
    # --- DDP: evaluate a shard on each rank, then add the sums up ---
    # Without drop_last, DistributedSampler pads every rank's shard to the same length with
    # duplicates at its end: a rank's real samples are its first len(range(rank, n, N))
    # (docs/traps.md#padding).
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    real = len(range(rank, len(dataset), world_size))
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # token losses, tokens
    with torch.no_grad():  # no graph, no activations kept: evaluation needs far less memory
        for x, y in loader:
            x, y = x[:real].to(device), y[:real].to(device)  # the padded duplicates: left out
            real -= len(x)
            # The unwrapped model: no DDP hook, so nothing collective hides in this forward
            # (DDP's can broadcast buffers: a hang where the ranks' batch counts differ).
            sums[0] += loss_fn(model(x), y, reduction="sum")
            sums[1] += y.numel()
    # Sums and counts, not means: the average of per-rank means would weigh a 333-sample
    # shard like a 334-sample one and count the duplicates, and change with the number of
    # ranks (pytorch/pytorch#25162).
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    # --- end ---
    model.train()
    return (sums[0] / sums[1]).item()


def train(args, rank, world_size, device):
    """Train; return the unwrapped model, the final loss (the ranks' mean) and val loss."""
    # --fp64: every tensor in float64. In fp32 another summation order (ranks, micro-batches,
    # stages, TP's partial sums) moves the last bits, and Adam, which divides each gradient
    # entry by its own size, makes that visible within some steps (docs/drift.md); in float64
    # a correct strategy stays within 1e-9 of one device (rounding: ~1e-13), so any gap is a
    # bug. Built (and the data drawn) in fp32, then cast: an fp64 run starts from exactly the
    # fp32 run's numbers.
    dtype = torch.float64 if args.fp64 else torch.float32
    # Same seed on every rank: the replicas start alike (DDP would broadcast rank 0's anyway).
    seed_everything(args.seed)
    model = SimpleModel(args.hidden, args.blocks, args.heads).to(device, dtype)
    # --compile and --activation-checkpointing, per block, before DDP wraps the model: its
    # gradient hooks then stay outside the compiled code (common.py, docs/compile.md)
    compile_and_checkpoint(model.blocks.values(), args)
    # --- DDP: wrap the model ---
    # The wrapper broadcasts rank 0's weights and registers hooks that all-reduce (average)
    # each bucket of gradients (bucket_cap_mb, 25 MB) as soon as backward has produced it, so
    # communication overlaps the rest of backward. gradient_as_bucket_view makes each .grad a
    # view into its bucket, not a copy: a copy less each way and a gradient's memory saved;
    # don't .detach_() such a .grad.
    # Compiled blocks (--compile, above) leave DDP's hooks outside the compiled code, so the
    # buckets' all-reduces overlap backward as usual (compiling the wrapper: docs/compile.md).
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    gradient_as_bucket_view=True)
    # --- end ---
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    if args.zero1:
        # ZeRO-1: the parameters are dealt to the ranks, balanced by size; each rank's Adam
        # holds and steps its own share only, then step() broadcasts every share from its owner:
        # plain DDP's weights. Weights and gradients stay whole (DDP's all-reduce is as before).
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                            lr=args.lr)
    # (Every rank reads the same file into its replica: they stay identical.)
    start_step = load_checkpoint(args, model, optimizer) if args.checkpoint else 0

    dataset, val_set = make_dataset("train", dtype), make_dataset("val", dtype)
    # --- DDP: shard the data ---
    # Every epoch, DistributedSampler draws one permutation of the dataset from seed + epoch
    # (the same on every rank) and gives rank r the positions r, r+N, r+2N, ... of it. With
    # B/N samples per rank, step k sees positions k*B .. k*B+B-1 of the permutation spread
    # over the N ranks: the batch one device with batch B sees at step k, and with the N
    # per-rank mean gradients averaged, the same update. drop_last: the same tail for any N | B.
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
        for micro in range(args.accum_steps):
            x, y = next(micro_batches)
            x, y = x.to(device), y.to(device)
            # Divided by K so that K micro-batch gradients add up to the mean over the
            # whole batch, not K times it (which would act like a K times larger lr).
            # --- DDP: accumulate gradients without communicating ---
            # no_sync() skips the all-reduce; it must cover forward *and* backward: forward is
            # where DDP decides whether the coming backward syncs. The last one syncs the sum.
            last = micro == args.accum_steps - 1
            with contextlib.nullcontext() if last else ddp_model.no_sync():
                with record_function("forward"):
                    loss = loss_fn(ddp_model(x), y) / args.accum_steps
                with record_function("backward"):
                    loss.backward()
            # --- end ---
            loss_sum += loss.detach()
        with record_function("optimizer step"):
            # --clip. Every replica holds the averaged gradient of the whole batch now: all
            # ranks measure the same norm and clip alike (each clipping its own gradient before
            # the average would part the replicas). Returns the norm before clipping.
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                       args.clip or float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        samples_per_s = meter.step(args.batch_size)
        profiler.step()

        if step == 0 or (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            # A collective, so every rank must reach it at the same steps: the condition
            # depends only on the step. Printing is rank 0's job; averaging is everybody's.
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
            final_loss = loss_sum.item()
            print0(log_line(step + 1, args.steps, final_loss, grad_norm.item(),
                        samples_per_s))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            # every rank, at the same steps: it is a collective
            with meter.paused(), record_function("evaluation"):
                val_loss = evaluate(model, val_set, rank, world_size,
                                    args.batch_size // world_size, device)
            print0(eval_line(step + 1, args.steps, val_loss))
        if args.checkpoint and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
            # One writer: the replicas are identical. Nothing in the file depends on the world
            # size: saved on 2 ranks, it resumes on 1 or 3 (elastic torchrun goes on with fewer).
            if args.zero1:
                # The moments are spread over the ranks: gather them on rank 0 first (a
                # collective, timed in docs/memory.md): a plain Adam state_dict, as without it.
                optimizer.consolidate_state_dict(to=0)
            if rank == 0:
                save_checkpoint(args, model, optimizer, step + 1)
            if args.zero1:
                # Written: drop rank 0's consolidated copy of every rank's moments, which would
                # stay in its memory until the next checkpoint (no public call frees it; the
                # attribute is the one consolidate_state_dict itself empties and refills).
                optimizer._all_state_dicts.clear()
    profiler.stop()
    print0(meter.summary(final_loss, flops_per_sample=flops_per_sample(model), val_loss=val_loss,
                         state_bytes=held_bytes(model, optimizer)))
    return model, final_loss, val_loss


def save_checkpoint(args, model, optimizer, step):
    """Everything needed to continue exactly where this run is: the data position is a
    function of (seed, step, global batch) only, so those three are all it needs besides the
    weights and Adam's state."""
    save_atomic({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "step": step, "batch_size": args.batch_size, "seed": args.seed,
                 "fp64": args.fp64, "heads": args.heads},
                args.checkpoint)
    print(f"checkpoint: step {step} -> {args.checkpoint}", flush=True)


def load_checkpoint(args, model, optimizer):
    """Resume from --checkpoint if it holds one: the weights, Adam's state; return the step to
    start from (0 without one). A bad one stops with one line and is left as it was."""
    def refuse(why):
        fail(f"{os.path.basename(__file__)}: error: --checkpoint {args.checkpoint}: {why}")

    if not os.path.exists(args.checkpoint):
        return 0
    try:
        # weights_only: a checkpoint is data, and unpickling arbitrary objects runs code.
        # map_location cpu: a checkpoint written on a GPU loads on any machine, and Adam's step
        # counters stay CPU scalars (on a GPU they would cost a sync per parameter per step);
        # load_state_dict then copies the weights and the moments to their device.
        state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
    except Exception as e:  # truncated, not a torch file, not a dict, another model size...
        refuse(unloadable(e))  # what is wrong with it, and what to do (common.py)
    check_resumable(state, args, refuse)  # the same --batch-size, --seed, --fp64 (common.py)
    optimizer.load_state_dict(state["optimizer"])  # puts Adam's moments on the device
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        # Its load_state_dict also fills the wrapper's own `state` with a second copy of this
        # rank's moments, on their device, that nothing reads: Adam's share held twice.
        optimizer.state.clear()
    print0(f"resumed from {args.checkpoint} at step {state['step']}")
    return state["step"]


def run(args):
    """What each worker process does: join, train, save, leave."""
    rank, world_size, device = setup(args)
    model, _, _ = train(args, rank, world_size, device)
    if args.save and rank == 0:
        # The unwrapped model: DDP's own state_dict names every weight "module.<name>", and
        # SimpleModel.load_state_dict(strict=True) would refuse those keys.
        save_atomic(model.state_dict(), args.save)  # CPU tensors: loads anywhere (common.py)
    leave()  # destroy_process_group(), on a clean exit only (why: common.leave)


def main(argv=None):
    args = parse_args(argv)
    launch(run, args)  # one rank under torchrun, else --nproc of them started here (common.py)


if __name__ == "__main__":
    main()
