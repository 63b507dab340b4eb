"""Fully Sharded Data Parallel (FSDP2): each process keeps 1/N of the model, gathers the rest.

What it teaches
    DDP keeps a full copy of the weights, the gradients and Adam's two moments on every rank.
    FSDP shards all of it: `fully_shard` replaces every parameter by a DTensor of which each of
    the N ranks holds one slice of rows, so each rank stores 1/N of the weights, the gradients
    and the optimizer state. Just before a block runs (forward, and again in backward), its
    ranks all-gather the block's full weights, and free them once it is done; after a block's
    backward the gradients are reduce-scattered: summed over the ranks (averaged, like DDP) and
    cut so each rank keeps the gradient of its own slice, and Adam steps on that slice only.
    Data parallel all the same: rank r trains on shard r of each global batch, so with batch B
    on N ranks the result equals one device with batch B; the tests prove it in float64 to 1e-9.

When to use it
    The model, its gradients and its optimizer state do not fit on one device (Adam in fp32
    needs 16 bytes per parameter before any activation), and the devices have fast links
    (NVLink, InfiniBand): every step moves the weights through the network, not only the
    gradients.
When not
    The model fits: ddp.py is simpler and faster (no all-gather in every forward and backward).
    Slow links between the devices: cut the model into stages instead (pipeline.py).

Two knobs between DDP and full sharding (docs/memory.md measures each)
    --reshard-after-forward false keeps each block's gathered weights from its forward to its
    backward: one all-gather per block per step instead of two, at the memory of the whole
    weights during the step (ZeRO-2's trade: gradients and Adam's state stay sharded).
    --replicate R (HSDP) shards over groups of N/R ranks and replicates across the R groups:
    the all-gathers and reduce-scatters stay inside a group (one machine's fast links), and
    only an all-reduce of the 1/(N/R) gradient shards crosses between groups. The layout for
    several machines: --replicate <machines>, so each machine holds one whole copy.

Launch
    python fsdp.py                          # starts its own workers: one per GPU, or 2 on a CPU
    python fsdp.py --nproc 4 --device cpu   # 4 CPU workers on one machine
    torchrun --nproc_per_node=2 fsdp.py     # what clusters use; same flags after the script
    torchrun --nproc_per_node=8 fsdp.py --mixed-precision bf16   # compute in bf16
    torchrun --nproc_per_node=4 fsdp.py --replicate 2   # HSDP: 2 copies, each sharded in 2
    torchrun --nproc_per_node=2 fsdp.py --reshard-after-forward false   # ZeRO-2-like
    torchrun --nproc_per_node=2 fsdp.py --fp64   # float64: within 1e-9 of single.py --fp64
    # sharded checkpoints (a folder: each rank writes its shard), resumable on any number of
    # ranks; turn one into a single plain file with torch's own converter:
    torchrun --nproc_per_node=2 --max-restarts=3 fsdp.py --checkpoint ckpt
    python -m torch.distributed.checkpoint.format_utils dcp_to_torch \
        ckpt/$(cat ckpt/latest) full.pt    # torch.load(...)["model"] is SimpleModel's state_dict
    # several machines: as in ddp.py (torchrun --nnodes ... --rdzv-backend=c10d ...)
    Smallest hardware: any laptop CPU (2 processes over gloo). On GPUs, NCCL: one GPU per rank.

What is trusted
    A checkpoint is data: the folder is read through load_sharded (plumbing/sharded.py), which
    never runs code from it, where torch's own dcp.load would (docs/checkpoints.md). The
    rendezvous store has no authentication: trusted networks only (docs/traps.md#trust).

What changes from replicating (DDP) to sharding
    diff ddp.py fsdp.py

Docs
    https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html
    https://pytorch.org/tutorials/intermediate/FSDP_tutorial.html
    https://pytorch.org/docs/stable/distributed.checkpoint.html
Tested with torch 2.10.0 (the oldest that requirements.txt admits), 2.13.0 and 2.15.0, on CPU/gloo.
"""

import datetime
import itertools
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.profiler import record_function
from torch.utils.data import DataLoader, DistributedSampler

from common import SimpleModel, loss_fn, make_dataset, seed_everything
from plumbing.balance import balance
from plumbing.buffers import fill_buffers
from plumbing.checkpoints import save_atomic
from plumbing.flags import check_shared_flags, compile_and_checkpoint, launch_world, shared_parser
from plumbing.flags import positive
from plumbing.meter import Meter, Profiler, eval_line, held_bytes, log_line, print0
from plumbing.model_check import check_model
from plumbing.ranks import launch
from plumbing.sharded import latest_checkpoint, load_sharded, step_folder


def parse_args(argv=None):
    parser = shared_parser(__doc__, sharded=True, ranks=True)
    hardware = parser.groups["hardware"]
    hardware.add_argument("--reshard-after-forward", choices=["true", "false"], default="true",
                          help="false: keep the gathered weights for backward (less traffic)")
    hardware.add_argument("--replicate", type=positive(int), default=1, metavar="R",
                          help="HSDP: R replicas, each sharded over N/R ranks (default 1: FSDP)")
    hardware.add_argument("--mixed-precision", choices=["off", "bf16"], default="off",
                          help="bf16: compute in bf16, reduce gradients and keep weights in fp32")
    args = parser.parse_args(argv)
    check_shared_flags(parser, args)  # and their checks: one line that names the fix
    world_size = launch_world(parser, args)[0]  # torchrun's ranks, or --nproc started here
    if world_size % args.replicate:
        parser.error(f"--replicate {args.replicate} must divide the world size {world_size}")
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
    print0(f"fsdp: {world_size} ranks | backend {args.backend} | device {device.type} | "
           f"torch {torch.__version__}")
    return rank, world_size, device


def evaluate(model, dataset, rank, world_size, batch_size, device):
    """The mean cross-entropy per token over the whole held-out set."""
    model.eval()  # SimpleModel has no dropout or BatchNorm, but the model you copy this to may
    # --- FSDP: evaluate a shard on each rank, then add the sums up ---
    # Without drop_last, DistributedSampler pads the shards to one length with duplicates:
    # a rank's real samples are its first len(range(rank, n, N)) (docs/traps.md#padding).
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size // world_size, sampler=sampler)  # B/N each
    real = len(range(rank, len(dataset), world_size))
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # token losses, tokens
    with torch.no_grad():  # no graph, no activations kept: evaluation needs far less memory
        for x, y in loader:
            # A sharded forward is a collective: every rank forwards each padded batch whole,
            # then counts its real samples only (cut first, an empty one could fail on one rank).
            logits, y = model(x.to(device))[:real], y[:real].to(device)
            real -= len(y)
            # Sums, divided once at the end: the mean of per-batch means would overweight a
            # smaller last batch.
            sums[0] += loss_fn(logits, y, reduction="sum")
            sums[1] += (y != -100).sum()  # the targets that count: cross_entropy skips -100s
    # Sums here too: a mean of the ranks' means would weigh a 333-sample shard like a 334 one.
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    # Free the gathered weights FSDP keeps for a backward that never comes (the root's, at least)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    # --- end ---
    model.train()
    return (sums[0] / sums[1]).item()


def train(args, rank, world_size, device):
    """Train; return the model, the final loss and the final validation loss."""
    # --fp64: in float64 a correct strategy ends within 1e-9 of one device, where fp32's
    # rounding, amplified by Adam, can part them (docs/drift.md). Built in fp32, then cast.
    dtype = torch.float64 if args.fp64 else torch.float32
    # --- FSDP: build the model without memory, shard it, then fill the shards ---
    # On the "meta" device a module has shapes but no storage: any size costs nothing here.
    with torch.device("meta"):
        model = SimpleModel.from_args(args).to(dtype)
    # --compile and --activation-checkpointing, per block, before any wrapper
    compile_and_checkpoint(model.blocks.values(), args)
    # --mixed-precision bf16: weights gathered and used in bf16; the gradients reduced and the
    # output returned in `dtype` (a bf16 sum of N ranks' gradients rounds away the small ones).
    compute_dtype = torch.bfloat16 if args.mixed_precision == "bf16" else None  # None: as is
    mp_policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=dtype)
    # The ranks the shards are spread over, on `device` (else the machine's GPUs). --replicate R
    # (HSDP): R rows of N/R ranks, each row sharded; the rows all-reduce like DDP replicas.
    mesh = init_device_mesh(device.type, (args.replicate, world_size // args.replicate),
                            mesh_dim_names=("replicate", "shard")) if args.replicate > 1 \
        else init_device_mesh(device.type, (world_size,))
    keep = args.reshard_after_forward == "false"  # ZeRO-2-like: one all-gather less, more memory
    # Each Block is one unit, all-gathered just before it runs and freed after: only the running
    # block (and the next, prefetched) is whole. Blocks first, then the root (embeddings, final
    # norm, head: without it, their gradients are never averaged, silently).
    for block in model.blocks.values():
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=not keep)
    fully_shard(model, mesh=mesh, reshard_after_forward=not keep, mp_policy=MixedPrecisionPolicy(
        param_dtype=compute_dtype, reduce_dtype=dtype, output_dtype=dtype))
    model.to_empty(device=device)  # storage for this rank's shards only (uninitialized)
    # Rank 0 builds the real model on the CPU, from --seed (one device's starting weights);
    # the call cuts it up and sends every rank its shards (too big for rank 0: init per shard).
    one = None
    if rank == 0:
        seed_everything(args.seed)
        one = SimpleModel.from_args(args).to(dtype)
    set_model_state_dict(model, {} if one is None else one.state_dict(),
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # The buffers a state_dict leaves out (RoPE's), which to_empty() left garbage: rank 0's
    fill_buffers(model, one, device)
    # --- end ---
    # After sharding, never before: it makes every parameter a DTensor, and an
    # optimizer built earlier would hold the old tensors, which get no gradients: silently.
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    start_step = load_checkpoint(args, model, optimizer) if args.checkpoint else 0

    dataset, val_set = make_dataset("train", args.data), make_dataset("val", args.data)
    # --- FSDP: shard the data, as DDP does ---
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
        # --- FSDP: the global count, one all-reduce of an integer a step, before any forward ---
        # A rank counts its share of the batch; one device divides by every rank's. The reduce-scatter
        # averages the gradients over the N ranks, so each rank's loss is multiplied by N.
        tokens = tokens.to(device)
        dist.all_reduce(tokens)
        # --- end ---
        for micro, (x, y) in enumerate(batches):
            x, y = x.to(device), y.to(device)
            # --- FSDP: accumulate gradients without communicating ---
            # FSDP has no no_sync(): this switch skips the reduce-scatter, keeping whole gradients
            # (their memory) until the last micro-batch reduce-scatters the sum.
            model.set_requires_gradient_sync(micro == args.accum_steps - 1)
            with record_function("forward"):
                loss = loss_fn(model(x), y, reduction="sum") * world_size / tokens
                loss = loss + balance(model, args, y, dist.group.WORLD) / args.accum_steps
            with record_function("backward"):
                loss.backward()
            # --- end ---
            loss_sum += loss.detach()
        with record_function("optimizer step"):
            # --clip: scale the whole gradient, as one vector, down to this norm if it is
            # larger (0: never; the norm is still measured). Returns the norm before clipping.
            # Of DTensor shards: their squares summed over the mesh, not ~1/sqrt(N) of it.
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
            print0(log_line(step + 1, args.steps, final_loss, grad_norm.full_tensor().item(),
                        samples_per_s))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            with meter.paused(), record_function("evaluation"):
                val_loss = evaluate(model, val_set, rank, world_size, args.batch_size, device)
            print0(eval_line(step + 1, args.steps, val_loss))
        if args.checkpoint and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
            with meter.paused():  # every rank writes its own shards: a collective
                save_checkpoint(args, model, optimizer, step + 1)
    profiler.stop()
    print0(meter.summary(final_loss, model, val_loss=val_loss,
                         state_bytes=held_bytes(model, optimizer)))
    return model, final_loss, val_loss


def save_checkpoint(args, model, optimizer, step):
    """Everything needed to continue exactly where this run is: the data position is a
    function of (seed, step, global batch) only, so those three are all it needs besides the
    weights and Adam's state. DCP writes each rank's shards and an index of them: any number
    of ranks can read it."""
    model_state, optimizer_state = get_state_dict(model, optimizer)  # this rank's slices
    with step_folder(args, step) as folder:  # a new one; `latest` names it once whole
        # A collective: each rank writes its shards; rank 0 writes the index (.metadata) last.
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)


def load_checkpoint(args, model, optimizer):
    """Resume from --checkpoint if it holds one: the weights, Adam's state; return the step to
    start from (0 without one). A bad one stops with one line and is left as it was."""
    state = latest_checkpoint(args, __file__)  # the step `latest` names, checked; or None
    if state is None:
        return 0
    # Only now: on an optimizer without state, get_state_dict makes Adam's by a zero step.
    model_state, optimizer_state = get_state_dict(model, optimizer)  # this rank's slices
    shards = {"model": model_state, "optimizer": optimizer_state}
    # dcp.load, reading the folder as data only: torch's own unpickles parts of it (runs code)
    load_sharded(shards, state)
    set_state_dict(model, optimizer, model_state_dict=shards["model"],
                   optim_state_dict=shards["optimizer"])
    print0(f"resumed from {args.checkpoint} at step {state['step']}")
    return state["step"]


def run(args):
    """What each process does: set up, train, save."""
    rank, world_size, device = setup(args)
    model, _, _ = train(args, rank, world_size, device)
    if args.save:
        # Full tensors, not this rank's DTensor slices, gathered by a collective; cpu_offload:
        # only rank 0 gets them, in CPU memory, so no device ever holds the whole model.
        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                       cpu_offload=True))
        if rank == 0:
            save_atomic(weights, args.save)
    dist.destroy_process_group()  # on a clean exit only: after an error, peers may hang


def main(argv=None):
    args = parse_args(argv)
    launch(run, args)  # one rank under torchrun, else --nproc of them started here


if __name__ == "__main__":
    main()
