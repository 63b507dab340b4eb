"""Fully Sharded Data Parallel (FSDP, ZeRO-3) by hand: flat shards, all-gathers, reduce-scatters.

What it teaches
    fsdp.py, written by hand: what fully_shard does there, here with plain tensors and four
    collectives. A unit is what fully_shard(module) takes: each Block, then the root (the
    embeddings, the final norm and the head, what the blocks leave). Its parameters are laid
    end to end in one flat buffer, padded to a multiple of N, and rank r keeps the r-th 1/N of
    it (`shard`): the only Parameter left, so Adam steps on 1/N of the weights, with 1/N of its
    moments. The module's weights become views of `full`, the whole buffer, whose memory exists
    only while the unit is in use:
    - before the unit's forward, all_gather_into_tensor fills it from the N shards;
    - after its forward, it is freed (its storage resized to 0), and gathered again by a hook
      on its output's gradient, just before its backward reads the weights it saved;
    - backward sums the unit's gradients into full.grad (a view's gradient reaches its
      buffer); then reduce_scatter_tensor sums full.grad over the ranks and hands each rank
      the 1/N of the sum its shard needs, divided by N: their mean, one device's gradient of
      the whole batch (on the last micro-batch only: the others keep full.grad); it is freed.
    The gradient norm for --clip is the whole gradient's: each rank's squares of its shards,
    summed over the ranks by an all-reduce. Rank 0 alone builds one device's model from --seed,
    and sends it one unit at a time (a broadcast), each rank keeping its 1/N.

Where fsdp.py (FSDP2) differs
    FSDP2 shards each parameter on dim 0 as a DTensor (its rows cut in N, padded), so a
    checkpoint, the optimizer and clip_grad_norm_ see one device's parameter names; here a unit
    is one flat buffer (FSDP1's FlatParameter), which fits the collectives and hides the names.
    It copies the shards into and out of its all-gather's buffer, where here the views are the
    buffer; it all-gathers the next block during this block's backward (prefetching, and on a
    GPU on streams of its own, overlapping compute), here one unit after another; it divides
    float64 gradients partly before the sum (by a power of 2 near sqrt(N), against overflow)
    and the rest after, here by N after. The same numbers all the same: bit-identical to
    fsdp.py on 2 ranks (unclipped), within the last bits on 3 (docs/from_scratch.md says why).

Leaves out
    --replicate (HSDP), --mixed-precision and --checkpoint (each refused in one line: use
    fsdp.py). --reshard-after-forward false is kept: the gathered weights stay from forward to
    backward (ZeRO-2's trade: one all-gather per unit per micro-batch instead of two).

Launch
    python from_scratch/fsdp.py                       # starts its own workers: one per GPU, or 2
    torchrun --nproc_per_node=3 from_scratch/fsdp.py --batch-size 63  # units cut in 3, padded
    torchrun --nproc_per_node=2 from_scratch/fsdp.py --fp64 --save hand.pt
    torchrun --nproc_per_node=2 fsdp.py --fp64 --save fsdp.pt  # hand.pt's equal, to the bit
    python -m pytest -q tests/test_fsdp.py -k by_hand   # the proofs, and its mistakes
    Smallest hardware: any laptop CPU (2 processes over gloo). On GPUs, NCCL: one GPU per rank.

What fully_shard does in fsdp.py, written by hand
    diff fsdp.py from_scratch/fsdp.py

Docs
    https://arxiv.org/abs/1910.02054 (ZeRO: stage 3 shards the weights too)
    https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html (what fsdp.py uses)
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
from plumbing.buffers import fill_buffers
from plumbing.checkpoints import save_atomic
from plumbing.flags import check_shared_flags, compile_and_checkpoint, launch_world, shared_parser
from plumbing.flags import positive
from plumbing.meter import Meter, Profiler, eval_line, held_bytes, log_line, print0
from plumbing.model_check import check_model
from plumbing.ranks import fail, launch


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
    for flag, used in (("--replicate", args.replicate > 1), ("--checkpoint", args.checkpoint),
                       ("--mixed-precision", args.mixed_precision != "off")):
        if used:  # what this file leaves out (its docstring says why)
            parser.error(f"{flag}: not written by hand here; use fsdp.py")
    check_shared_flags(parser, args)  # and their checks: one line that names the fix
    launch_world(parser, args)  # torchrun's ranks, or --nproc started here
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
    print0(f"fsdp by hand: {world_size} ranks | backend {args.backend} | device {device.type} | "
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
    # --- end ---
    model.train()
    return (sums[0] / sums[1]).item()


# --- FSDP by hand: a unit of parameters sharded as one flat buffer ---
class Unit:
    """What fully_shard(module) takes: the module's parameters that no unit holds yet, laid end
    to end in one flat buffer, padded to a multiple of N, of which rank r keeps the r-th 1/N
    (`shard`, registered on the module in their place: what Adam steps). The module's weights
    become views of `full`, the whole buffer, which holds memory only from an all-gather to its
    free."""

    def __init__(self, model, name, source, device, reshard_after_forward):
        module, prefix = model.get_submodule(name), name + "." if name else ""
        params = [(n, p) for n, p in module.named_parameters() if not hasattr(p, "unit")]
        self.names = [prefix + n for n, _ in params]  # as one device's state_dict names them
        self.shapes, self.numels = [p.shape for _, p in params], [p.numel() for _, p in params]
        world_size, numel = dist.get_world_size(), sum(self.numels)
        padded = -(-numel // world_size) * world_size  # rounded up: N equal shards
        self.numels.append(padded - numel)
        full = torch.zeros(padded, dtype=params[0][1].dtype, device=device)
        if dist.get_rank() == 0:  # one device's starting weights, from rank 0's model
            full[:numel] = torch.cat([source.get_parameter(n).flatten() for n in self.names])
        dist.broadcast(full, src=0)  # the whole unit to every rank, which keeps its 1/N
        module.shard = torch.nn.Parameter(full.view(world_size, -1)[dist.get_rank()].clone())
        # A leaf of its own, not a Parameter: backward sums the unit's gradients into its .grad
        # (each weight a view of it), the reduce-scatter's input, padding zeros included.
        self.full = full.requires_grad_()
        self.owners = []  # (submodule, attribute) of each weight
        for n, _ in params:
            owner, _, leaf = n.rpartition(".")
            self.owners.append((module.get_submodule(owner), leaf))
            delattr(*self.owners[-1])  # no longer a Parameter: Adam never sees it
        module.shard.unit = self  # marked: the next unit up (the root) leaves it out
        self.shard, self.reshard_after_forward = module.shard, reshard_after_forward
        self.sync = True  # reduce-scatter after backward (the loop's last micro-batch)
        self.free()
        module.register_forward_pre_hook(self.before_forward)
        module.register_forward_hook(self.after_forward)
        self.full.register_post_accumulate_grad_hook(self.after_backward)

    def views(self):
        """The unit's weights, views of `full` in the module's shapes."""
        return [piece.view(shape) for piece, shape in zip(self.full.split(self.numels),
                                                          self.shapes)]

    def gather(self):
        """The whole buffer from the N shards, unless it is whole already."""
        storage = self.full.untyped_storage()
        if storage.size() == 0:
            storage.resize_(self.full.numel() * self.full.element_size())
            # Into .data: its writes bump no version counter. Backward reads the views it saved
            # in forward, and would refuse them as changed in place: they are the same values.
            dist.all_gather_into_tensor(self.full.data, self.shard.detach())

    def free(self):
        """Keep the views (the graph holds them), drop their memory: storage of size 0."""
        self.full.untyped_storage().resize_(0)

    def before_forward(self, module, args):
        self.gather()
        # Views made anew at each forward: backward reaches them (and so after_backward) just
        # after the module's own backward. Of the nodes ready, backward runs the newest first:
        # views made once, older than the whole graph, would keep every unit whole to its end.
        for (owner, leaf), view in zip(self.owners, self.views()):
            setattr(owner, leaf, view)

    def after_forward(self, module, args, output):
        if not torch.is_grad_enabled():  # evaluation: no backward comes
            self.free()
        elif self.reshard_after_forward:
            self.free()
            # Gathered again just before the module's backward: this hook runs as soon as the
            # gradient of its output is known. Without it, backward reads storage of size 0.
            output.register_hook(lambda grad: self.gather())

    def after_backward(self, full):
        """Once backward has summed every gradient of the unit into full.grad."""
        if self.sync:  # the last micro-batch: the gradients summed over micro-batches
            grad = torch.empty_like(self.shard)
            dist.reduce_scatter_tensor(grad, full.grad)  # summed over the ranks, 1/N kept
            grad /= dist.get_world_size()  # their mean: one device's gradient of the whole batch
            self.shard.grad = grad if self.shard.grad is None else self.shard.grad + grad
            full.grad = None
        self.free()
# --- end ---


def train(args, rank, world_size, device):
    """Train; return the model, the final loss and the final validation loss."""
    # --fp64: in float64 a correct strategy ends within 1e-9 of one device, where fp32's
    # rounding, amplified by Adam, can part them (docs/drift.md). Built in fp32, then cast.
    dtype = torch.float64 if args.fp64 else torch.float32
    # --- FSDP by hand: build the model without memory, shard it, then fill the shards ---
    # On the "meta" device a module has shapes but no storage: any size costs nothing here.
    with torch.device("meta"):
        model = SimpleModel.from_args(args).to(dtype)
    # --compile and --activation-checkpointing, per block, before any wrapper
    compile_and_checkpoint(model.blocks.values(), args)
    keep = args.reshard_after_forward == "false"  # ZeRO-2-like: one all-gather less, more memory
    # Rank 0 builds the real model on the CPU, from --seed (one device's starting weights), and
    # sends it to the others one unit at a time, each keeping its 1/N.
    full = None
    if rank == 0:
        seed_everything(args.seed)
        full = SimpleModel.from_args(args).to(dtype).requires_grad_(False)  # values only
    # Each Block is one unit, all-gathered just before it runs and freed after: only the running
    # block and the root are whole. Blocks first, then the root: what they leave (embeddings,
    # final norm, head).
    if len(list(model.parameters())) < len(list(model.named_parameters(remove_duplicate=False))):
        fail("from_scratch/fsdp.py: error: the model ties weights, which two units or two views "
             "would hold apart; untie them, or use fsdp.py")
    path = {id(m): name for name, m in model.named_modules()}  # "blocks.0", wherever they sit
    model.units = [Unit(model, path[id(block)], full, device, not keep)
                   for block in model.blocks.values()] + [Unit(model, "", full, device, not keep)]
    fill_buffers(model, full, device)  # no unit holds buffers: rank 0's (plumbing/buffers.py)
    # --- end ---
    # After sharding, never before: the model's parameters are then the shards, and an
    # optimizer built earlier would hold the old tensors, which get no gradients: silently.
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    start_step = 0  # --checkpoint: refused (fsdp.py resumes)

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
            # Each unit skips the reduce-scatter, keeping whole gradients (their memory) until
            # the last micro-batch reduce-scatters the sum.
            for unit in model.units:
                unit.sync = micro == args.accum_steps - 1
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
            # Of the shards: their squares summed over the ranks, not ~1/sqrt(N) of it.
            squares = sum(p.grad.pow(2).sum() for p in model.parameters())
            dist.all_reduce(squares)
            grad_norm = squares.sqrt()
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), args.clip or float("inf"),
                                                 grad_norm)
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
    profiler.stop()
    print0(meter.summary(final_loss, model, val_loss=val_loss,
                         state_bytes=held_bytes(model, optimizer)))
    return model, final_loss, val_loss


def run(args):
    """What each process does: set up, train, save."""
    rank, world_size, device = setup(args)
    model, _, _ = train(args, rank, world_size, device)
    if args.save:
        # Whole tensors, gathered one unit at a time (a collective: every rank takes part);
        # only rank 0 keeps them, in CPU memory, so no device ever holds the whole model.
        weights = {}
        for unit in model.units:
            unit.gather()
            weights.update({name: w.detach().to("cpu", copy=True)
                            for name, w in zip(unit.names, unit.views()) if rank == 0})
            unit.free()
        if rank == 0:
            save_atomic(weights, args.save)
    dist.destroy_process_group()  # on a clean exit only: after an error, peers may hang


def main(argv=None):
    args = parse_args(argv)
    launch(run, args)  # one rank under torchrun, else --nproc of them started here


if __name__ == "__main__":
    main()
