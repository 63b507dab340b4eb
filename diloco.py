"""DiLoCo (local SGD): replicas that step alone for H steps, then average what they moved.

What it teaches
    Each process holds a full copy of SimpleModel and trains it on its own shard of every global
    batch, as in ddp.py, but with no communication at all for --inner-steps H steps: its own
    gradient (its shard's mean loss), its own Adam. Then one all-reduce averages the replicas'
    pseudo-gradients (the outer weights, where the round began, minus the weights they reached),
    an outer optimizer (SGD with Nesterov momentum) steps the outer weights on that average, and
    every replica starts the next round from them. One all-reduce of every weight per H steps:
    1/H of DDP's bytes. It is not one device's training (H = 1 with plain SGD for both
    optimizers and outer lr 1 is, where every replica counts as many targets). The tests prove
    that, that momentum 0 is torch's own PostLocalSGDOptimizer, and the weights within 1e-12
    of a plain W-replica loop in fp64, and every printed number to the digits printed.

When to use it
    Slow links between the replicas (machines, data centres): each round sends what DDP sends in
    one step, so a link H times slower costs the same. Douillard et al. train with H = 500.
When not
    Fast links: DDP takes the whole batch's gradient every step, and DiLoCo's replicas learn
    from a smaller batch between rounds. The model does not fit on one device: fsdp.py.

Launch
    python diloco.py                          # starts its own workers: one per GPU, or 2 on a CPU
    python diloco.py --inner-steps 20 --outer-lr 0.7 --outer-momentum 0.9
    torchrun --nproc_per_node=2 diloco.py     # same flags after the script
    torchrun --nproc_per_node=2 --max-restarts=3 diloco.py --checkpoint ckpt.pt
    # several machines (its use: slow links between them), the same line on each:
    torchrun --nnodes=2 --node-rank=0 --nproc_per_node=8 --master-addr=HOST \
        --master-port=29500 diloco.py --inner-steps 100
    A --checkpoint brings every replica's weights and optimizer to rank 0: W x 16 bytes per
    parameter over the slow link; checkpoint rarely.
    Smallest hardware: any laptop CPU (2 processes over gloo).

What it changes in ddp.py
    diff ddp.py diloco.py

Docs
    https://arxiv.org/abs/2311.08105 (DiLoCo: Distributed Low-Communication Training)
    https://pytorch.org/docs/stable/distributed.optim.html (PostLocalSGDOptimizer)
Tested with torch 2.10.0 (the oldest that requirements.txt admits), 2.13.0 and 2.15.0, on CPU/gloo.
"""

import copy
import datetime
import itertools
import os

import torch
import torch.distributed as dist
from torch.profiler import record_function
from torch.utils.data import DataLoader, DistributedSampler

from common import SimpleModel, loss_fn, make_dataset, seed_everything
from plumbing.balance import balance
from plumbing.checkpoints import every_rank, read_checkpoint, save_atomic, train_state
from plumbing.flags import check_shared_flags, compile_and_checkpoint, launch_world, shared_parser
from plumbing.flags import positive
from plumbing.meter import Meter, Profiler, eval_line, held_bytes, log_line, print0
from plumbing.model_check import check_model
from plumbing.ranks import fail, launch


def parse_args(argv=None):
    parser = shared_parser(__doc__, ranks=True)  # the flags every script shares (docs/usage.md)
    training = parser.groups["training"]
    training.add_argument("--inner-steps", type=positive(int), default=5, metavar="H",
                          help="steps each replica takes alone between two averages")
    training.add_argument("--outer-lr", type=positive(float), default=0.7,
                          help="the outer SGD's learning rate (1 with momentum 0: the average)")
    training.add_argument("--outer-momentum", type=float, default=0.9,
                          help="the outer SGD's Nesterov momentum (0: plain SGD)")
    training.add_argument("--inner-optimizer", choices=["adam", "sgd"], default="adam",
                          help="each replica's own optimizer, at --lr")
    args = parser.parse_args(argv)
    if not 0 <= args.outer_momentum < 1:
        parser.error(f"--outer-momentum {args.outer_momentum}: must be in [0, 1)")
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
    print0(f"diloco: {world_size} ranks | backend {args.backend} | device {device.type} | "
           f"torch {torch.__version__}")
    return rank, world_size, device


def evaluate(model, dataset, rank, world_size, batch_size, device):
    """The mean cross-entropy per token over the whole held-out set."""
    model.eval()  # SimpleModel has no dropout or BatchNorm, but the model you copy this to may
    # --- DDP: each rank evaluates a shard, then the sums add up ---
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
    # --fp64: in float64 a correct run ends within 1e-12 of the tests' plain DiLoCo loop, where
    # fp32's rounding, amplified by Adam, can part them (docs/drift.md). Built in fp32, then cast.
    dtype = torch.float64 if args.fp64 else torch.float32
    seed_everything(args.seed)
    model = SimpleModel.from_args(args).to(device, dtype)
    # --- DiLoCo: rank 0's weights on every replica, and the outer weights: a copy of them ---
    for t in [*model.parameters(), *model.buffers()]:  # as DDP's wrap: one start for all
        dist.broadcast(t.detach(), src=0)
    # The outer weights, where every round starts: a second model, evaluated and saved, never
    # trained: copied before --compile and --activation-checkpointing wrap the replica's blocks.
    outer = copy.deepcopy(model)
    # --- end ---
    # --compile and --activation-checkpointing, per block, before any wrapper
    compile_and_checkpoint(model.blocks.values(), args)
    # --- DiLoCo: the outer optimizer, SGD with Nesterov momentum (torch refuses it at 0) ---
    outer_optimizer = torch.optim.SGD(outer.parameters(), lr=args.outer_lr,
                                      momentum=args.outer_momentum,
                                      nesterov=args.outer_momentum > 0)
    # Each replica's own optimizer. Its state (Adam's moments) is this replica's, and is kept
    # across rounds: the outer step resets the weights, not the inner optimizer.
    optimizer = (torch.optim.Adam(model.parameters(), lr=args.lr) if args.inner_optimizer == "adam"
                 else torch.optim.SGD(model.parameters(), lr=args.lr))
    # --- end ---
    start_step = (load_checkpoint(args, rank, world_size, model, optimizer, outer, outer_optimizer)
                  if args.checkpoint else 0)

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
        # --- DiLoCo: each replica steps alone: the count of its own B/N samples, no all-reduce ---
        # Its loss is the mean over the targets that count in its shard (single.py's on B/N):
        # no gradient is averaged. The round's average weighs every replica alike, whatever its
        # count: with padding or prompts, a mean of the replicas' means (none counted: 0, not NaN).
        tokens = sum((y != -100).sum() for _, y in batches).clamp(min=1).to(device)
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            with record_function("forward"):
                loss = loss_fn(model(x), y, reduction="sum") / tokens
                loss = loss + balance(model, args, y) / args.accum_steps  # its own routing
            with record_function("backward"):
                loss.backward()
            loss_sum += loss.detach()
        # --- end ---
        with record_function("optimizer step"):
            # --clip: scale the whole gradient, as one vector, down to this norm if it is
            # larger (0: never; the norm is still measured). Returns the norm before clipping.
            # Each replica clips its own gradient; the norm printed is rank 0's.
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                       args.clip or float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if (step + 1) % args.inner_steps == 0:  # a function of the step only: a resumed run agrees
            with record_function("outer step"):
                outer_step(model, outer, outer_optimizer, world_size)
        samples_per_s = meter.step(args.batch_size)
        profiler.step()

        if step == 0 or (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            # A collective: every rank reaches it, at steps that depend on the step only. The
            # mean of the replicas' losses, each on its own weights.
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
            final_loss = loss_sum.item()
            print0(log_line(step + 1, args.steps, final_loss, grad_norm.item(),
                        samples_per_s))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            with meter.paused(), record_function("evaluation"):
                # The outer weights, the same on every rank (mid-round the replicas' differ)
                val_loss = evaluate(outer, val_set, rank, world_size, args.batch_size, device)
            print0(eval_line(step + 1, args.steps, val_loss))
        if args.checkpoint and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
            # A collective: rank 0 gathers every replica's weights and optimizer, and writes
            save_checkpoint(args, rank, model, optimizer, outer, outer_optimizer, step + 1)
    profiler.stop()
    print0(meter.summary(final_loss, model, val_loss=val_loss,
                         state_bytes=held_bytes(model, optimizer)
                         + held_bytes(outer, outer_optimizer)))
    # The outer weights: every replica's after the last round; if --steps is not a multiple of
    # --inner-steps, the steps after it are not in them.
    return outer, final_loss, val_loss


def outer_step(model, outer, outer_optimizer, world_size):
    """End a round: the replicas' pseudo-gradients (outer - local) averaged, the outer weights
    stepped on the average, every replica reset to them."""
    # --- DiLoCo: one all-reduce per round, of one flat buffer of every pseudo-gradient ---
    with torch.no_grad():
        pseudo = torch.cat([(o - p).flatten() for o, p in zip(outer.parameters(),
                                                              model.parameters())])
        dist.all_reduce(pseudo)  # one collective for every weight, not one per tensor
        pseudo /= world_size
        for o, g in zip(outer.parameters(), pseudo.split([o.numel() for o in outer.parameters()])):
            o.grad = g.view_as(o)  # as if backward had made it: the outer step's "gradient"
        outer_optimizer.step()  # outer -= lr x (Nesterov of the mean pseudo-gradient)
        outer_optimizer.zero_grad(set_to_none=True)  # the flat buffer, freed till next round
        for p, o in zip(model.parameters(), outer.parameters()):
            p.copy_(o)  # the next round starts from the outer weights, on every replica
    # --- end ---


def save_checkpoint(args, rank, model, optimizer, outer, outer_optimizer, step):
    """Everything needed to continue exactly where this run is, mid-round too: the outer
    weights and momentum (the same on every rank), and each replica's own weights and optimizer
    state (its own), in one file that rank 0 writes atomically (never one rank's state from
    another step). The data position and the round's are functions of (seed, step, global
    batch, H) only: the DiLoCo flags are saved and checked."""
    # --- DiLoCo: every replica's state, on rank 0 (a collective; tensors, never pickles) ---
    replicas = every_rank({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                          next(model.parameters()).device)
    # --- end ---
    if rank == 0:
        save_atomic({"model": outer.state_dict(), "outer_optimizer": outer_optimizer.state_dict(),
                     "replicas": replicas, "diloco": diloco_flags(args),
                     **train_state(args, step)}, args.checkpoint)
        print(f"checkpoint: step {step} -> {args.checkpoint}", flush=True)


def diloco_flags(args):
    return {flag: getattr(args, flag.strip("-").replace("-", "_")) for flag in (
        "--inner-steps", "--outer-lr", "--outer-momentum", "--inner-optimizer")}


def load_checkpoint(args, rank, world_size, model, optimizer, outer, outer_optimizer):
    """Resume from --checkpoint if it holds one: the outer weights and momentum, and this
    rank's replica; return the step to start from (0 without one). A bad one stops with one
    line and is left as it was."""
    state = read_checkpoint(args, __file__)  # torch.load(weights_only=True), checked; or None
    if state is None:
        return 0
    why = ("it holds no replicas: written by another script; start afresh or point elsewhere"
           if "replicas" not in state else
           f"written by {len(state['replicas'])} ranks; resume it on as many"
           if len(state["replicas"]) != world_size else
           "written with " + " ".join(f"{k} {v}" for k, v in state["diloco"].items())
           + "; use the same" if state["diloco"] != diloco_flags(args) else None)
    if why:  # each rank reads the file and refuses alike
        fail(f"diloco.py: error: --checkpoint {args.checkpoint}: {why}")
    outer.load_state_dict(state["model"])
    outer_optimizer.load_state_dict(state["outer_optimizer"])
    model.load_state_dict(state["replicas"][rank]["model"])  # mid-round: this replica's own
    optimizer.load_state_dict(state["replicas"][rank]["optimizer"])
    print0(f"resumed from {args.checkpoint} at step {state['step']}")
    return state["step"]


def run(args):
    """What each process does: set up, train, save."""
    rank, world_size, device = setup(args)
    outer, _, _ = train(args, rank, world_size, device)
    if args.save and rank == 0:
        save_atomic(outer.state_dict(), args.save)  # the outer weights; CPU tensors
    dist.destroy_process_group()  # on a clean exit only: after an error, peers may hang


def main(argv=None):
    args = parse_args(argv)
    launch(run, args)  # one rank under torchrun, else --nproc of them started here


if __name__ == "__main__":
    main()
