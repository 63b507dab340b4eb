"""DDP by hand: buckets of gradients all-reduced while backward goes on, from plain collectives.

What it teaches
    ddp.py, written by hand: what DistributedDataParallel does there, here with
    broadcast, a hook per parameter and all_reduce(async_op=True).
    - At the start rank 0's weights are broadcast, so every replica starts the same.
    - The parameters go into buckets of at most --bucket-cap-mb (default 25, DDP's
      bucket_cap_mb), in reverse order: backward makes the last layers' gradients first.
    - A post-accumulate-grad hook per parameter copies its gradient, times 1/N, into its
      bucket; when a bucket is full its all-reduce starts at once, asynchronously, while
      backward computes the earlier layers' gradients (the overlap). Buckets start in one
      order on every rank, whatever order their hooks come in: all-reduces pair up by order.
    - After backward: wait for each bucket; each .grad becomes a view of its average in the
      bucket (ddp.py's gradient_as_bucket_view), so no second copy is kept; clip, step.
    - Accumulation without communication (DDP's no_sync()): the hooks do nothing on the
      micro-batches before the last; autograd adds their gradients into .grad meanwhile.
    Each gradient is multiplied by 1/N before the sum, as DDP does: on 2 ranks the same bits
    as ddp.py, on more within the last bits (below).

Where DDP differs
    DDP rebuilds its buckets after the first step in the order the gradients became ready,
    and its first bucket holds 1 MB; these buckets stay as built. Summed in another place of
    a bucket, a gradient can differ in its last bit on 3 ranks or more (gloo's ring adds each
    element in an order set by its place); on 2 ranks a + b is b + a.

Leaves out
    find_unused_parameters (a parameter with no gradient stops the step in an assertion),
    static_graph, communication hooks (register_comm_hook: fp16 compression, PowerSGD),
    broadcast_buffers (buffers are broadcast once, not before every forward), join() for
    uneven inputs, and DDP's C++ speed.

Launch
    python from_scratch/ddp.py                       # starts its own workers: one per GPU, or 2
    torchrun --nproc_per_node=2 from_scratch/ddp.py  # what clusters use; ddp.py's flags
    torchrun --nproc_per_node=2 from_scratch/ddp.py --fp64 --bucket-cap-mb 0.05 --save hand.pt
    torchrun --nproc_per_node=2 ddp.py --fp64 --save ddp.pt  # the same weights as hand.pt
    torchrun --nproc_per_node=2 --max-restarts=3 from_scratch/ddp.py --checkpoint ckpt.pt
    Smallest hardware: any laptop CPU (2 processes over gloo).

What DistributedDataParallel does in ddp.py, written by hand
    diff ddp.py from_scratch/ddp.py

Docs
    https://pytorch.org/docs/stable/notes/ddp.html (the buckets, the hooks, the overlap)
    https://arxiv.org/abs/2006.15704 (PyTorch Distributed: DDP's design)
Tested with torch 2.10.0, 2.13.0 and 2.15.0, on CPU/gloo.
"""

import contextlib
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
from plumbing.flags import (check_shared_flags, compile_and_checkpoint, launch_world, positive,
                            shared_parser)
from plumbing.meter import Meter, Profiler, eval_line, held_bytes, log_line, print0
from plumbing.model_check import check_model
from plumbing.ranks import launch


def parse_args(argv=None):
    parser = shared_parser(__doc__, ranks=True)  # the flags every script shares (docs/usage.md)
    parser.groups["hardware"].add_argument(
        "--bucket-cap-mb", type=positive(float), default=25,
        help="gradients all-reduced per bucket of this many MB (default 25, DDP's)")
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
    print0(f"ddp by hand: {world_size} ranks | backend {args.backend} | device {device.type} | "
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


# --- DDP by hand: buckets of gradients, each all-reduced while backward goes on ---
class Reducer:
    """DDP's reducer: the parameters in buckets of about `cap` bytes, in reverse order
    (backward makes the last layers' gradients first); a hook per parameter copies its
    gradient, times 1/N, into its bucket, and a full bucket's all-reduce starts at once,
    asynchronously, while backward computes the earlier layers' gradients."""

    def __init__(self, params, cap, world_size):
        self.world_size, self.sync, self.next = world_size, True, 0
        self.buckets = []  # each: {views: {param: its slice of flat}, flat, left, work}
        groups, size = [[]], 0
        for p in reversed(params):
            if size >= cap:  # DDP's rule: a bucket closes once it holds cap bytes or more
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += p.numel() * p.element_size()
        for i, group in enumerate(groups):
            flat = torch.zeros(sum(p.numel() for p in group), dtype=params[0].dtype,
                               device=params[0].device)
            views = dict(zip(group, flat.split([p.numel() for p in group])))
            self.buckets.append({"views": views, "flat": flat, "left": len(group)})
            for p in group:  # called once autograd has added this backward's part to p.grad
                p.register_post_accumulate_grad_hook(lambda p, i=i: self.ready(i, p))

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate into .grad without communicating: the hooks do nothing meanwhile."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def ready(self, i, p):
        if not self.sync:
            return
        bucket = self.buckets[i]
        # As DDP: times 1/N while copying, before the sum (dividing the sum instead would round
        # otherwise at N = 3). Not why 3 ranks part from ddp.py in the last bit: the place of
        # each gradient in the buffer is (docs/from_scratch.md).
        torch.mul(p.grad.view(-1), 1 / self.world_size, out=bucket["views"][p])
        bucket["left"] -= 1
        # Launched in bucket order only, whatever order the hooks came in: all-reduces pair
        # up by their order on each rank, so bucket 1 on one rank would meet bucket 0 on
        # another: unrelated gradients summed, or a size mismatch (gloo stops; NCCL, which
        # checks no size, would wait for --timeout: not run here).
        while self.next < len(self.buckets) and self.buckets[self.next]["left"] == 0:
            bucket = self.buckets[self.next]
            bucket["work"] = dist.all_reduce(bucket["flat"], async_op=True)
            self.next += 1

    def wait(self):
        """After backward: wait for every bucket; each .grad becomes its average's view."""
        assert self.next == len(self.buckets), "a parameter got no gradient in backward"
        for bucket in self.buckets:
            bucket["work"].wait()
            for p, view in bucket["views"].items():
                # As ddp.py's gradient_as_bucket_view: no second copy of the gradient is kept
                p.grad = view.view_as(p)
            bucket["left"] = len(bucket["views"])
        self.next = 0
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
    # --- DDP by hand: rank 0's weights broadcast, gradients averaged in backward ---
    for tensor in [*model.parameters(), *model.buffers()]:  # one start, however each seeded
        dist.broadcast(tensor.detach(), src=0)
    reducer = Reducer(list(model.parameters()), args.bucket_cap_mb * 2**20, world_size)
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
            # no_sync(): the hooks do nothing in this backward. The last one syncs the sum.
            with reducer.no_sync() if micro < args.accum_steps - 1 else contextlib.nullcontext():
                with record_function("forward"):
                    loss = loss_fn(model(x), y, reduction="sum") * world_size / tokens
                    loss = loss + balance(model, args, y, dist.group.WORLD) / args.accum_steps
                with record_function("backward"):
                    loss.backward()
            # --- end ---
            loss_sum += loss.detach()
        with record_function("optimizer step"):
            reducer.wait()  # DDP by hand: every bucket's average, in each .grad
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
