"""Expert parallelism (EP): every rank holds some of each block's experts; tokens travel to them.

What it teaches
    A mixture of experts (--experts E, --top-k k, common.MoE) multiplies a block's feed-forward
    weights by E while each token uses only k of them. EP spreads the experts: each of the EP
    ranks of an "ep" group holds E/EP of every block's experts, and the rest of the model
    (attention, norms, embeddings, head, routers) is replicated, as in DDP. Each rank routes
    its own tokens; an all-to-all sends each token's hidden state to the rank that holds its
    expert (dispatch, the counts exchanged first), the expert runs on what arrived, and a
    second all-to-all brings the outputs back (combine), where they add up by the router's
    weights, as on one device. With EP < W ranks the ranks form a grid of W/EP "dp" groups of
    EP: each group holds every expert once and trains on its own shard of the batch.
    Every gradient is summed over exactly the ranks that hold its parameter (an expert's over
    "dp", the rest over all), then divided by W: the mistake that makes an expert's gradient
    EP times too large while the loss curve looks right (pytorch/pytorch#160285) is one
    divisor. The load-balancing loss takes every rank's routing: one device's micro-batch.
    With the same global batch the result equals one device (single.py --experts E --top-k k):
    the tests prove it in float64 to 1e-9.

When to use it
    A mixture of experts whose experts do not fit on every device, or whose all-reduce of every
    expert's gradient over all ranks (DDP) costs more than moving the tokens: DeepSeek-V3,
    Mixtral and Qwen-MoE are trained with it, beside data, tensor and pipeline parallelism.
When not
    A dense model (nothing to spread), or experts small enough that ddp.py's replicas hold
    them: two all-to-alls per block each way cost more than DDP's one all-reduce here.

Launch
    python ep.py                           # its own workers: 4 experts over 2 ranks on a CPU
    torchrun --nproc_per_node=2 ep.py      # what clusters use; same flags after the script
    torchrun --nproc_per_node=4 ep.py --ep 2   # 2 "dp" groups x 2 ranks, 2 experts each
    python ep.py --experts 6 --top-k 1 --nproc 2 --fp64   # 3 experts per rank, float64
    # does it match one device? within 1e-9 of single.py --fp64 --experts 4 --top-k 2
    Smallest hardware: any CPU (2 processes over gloo).

What expert parallelism adds to data parallelism
    diff ddp.py ep.py

Docs
    https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_to_all_single
    docs/moe.md (the mixture, the balancing loss, capacity and why this one is dropless)
Tested with torch 2.10.0 (the oldest that requirements.txt admits), 2.13.0 and 2.15.0, on CPU/gloo.
"""

import datetime
import functools
import itertools
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import record_function
from torch.utils.data import DataLoader, DistributedSampler

from common import SimpleModel, loss_fn, make_dataset, seed_everything
from plumbing.balance import balance
from plumbing.checkpoints import read_checkpoint, save_atomic, train_state
from plumbing.checkpoints import gather_full_state, optimizer_share  # one device's file
from plumbing.flags import check_shared_flags, compile_and_checkpoint, launch_world, shared_parser
from plumbing.flags import grid, positive
from plumbing.meter import Meter, Profiler, eval_line, held_bytes, log_line, print0
from plumbing.model_check import check_model
from plumbing.ranks import launch


def parse_args(argv=None):
    parser = shared_parser(__doc__, ranks=True)  # the flags every script shares (docs/usage.md)
    # EP spreads experts, so it trains a mixture by default: 4 experts, each token to 2.
    parser.set_defaults(experts=4, top_k=2)
    parser.groups["hardware"].add_argument("--ep", type=positive(int), default=None, help=(
        "ranks in each expert-parallel group, sharing every block's experts (default: all)"))
    args = parser.parse_args(argv)
    check_shared_flags(parser, args)  # and their checks: one line that names the fix
    world_size = launch_world(parser, args)[0]  # torchrun's ranks, or --nproc started here
    grid(parser, args, "--ep", world_size)  # --ep: all ranks by default; W/EP groups
    if not args.experts or args.experts % args.ep:
        parser.error(f"--ep {args.ep} must divide --experts {args.experts} (each rank holds "
                     f"experts / ep of them); use --experts {args.ep * 2} or another --ep")
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
    print0(f"ep: {world_size} ranks = {world_size // args.ep} (dp) x {args.ep} (ep), "
           f"{args.experts // args.ep} of {args.experts} experts each | backend {args.backend} | "
           f"device {device.type} | torch {torch.__version__}")
    return rank, world_size, device


def evaluate(model, dataset, rank, world_size, batch_size, device):
    """The mean cross-entropy per token over the whole held-out set."""
    model.eval()  # SimpleModel has no dropout or BatchNorm, but the model you copy this to may
    # --- DDP: evaluate a shard on each rank, then add the sums up ---
    # Without drop_last, DistributedSampler pads the shards to one length with duplicates:
    # a rank's real samples are its first len(range(rank, n, N)) (docs/traps.md#padding).
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size // world_size, sampler=sampler)  # B/N each
    real = len(range(rank, len(dataset), world_size))
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # token losses, tokens
    with torch.no_grad():  # no graph, no activations kept: evaluation needs far less memory
        for x, y in loader:
            # EP's forward is a collective: every rank forwards the padded batch whole, as
            # often, then counts its real samples only (cut first, the last could be empty).
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


# --- EP: each rank holds some of every block's experts; tokens travel to them and back ---
class AllToAll(torch.autograd.Function):
    """Rows of x to every rank of `group` (`sent[r]` rows to rank r, in rank order); returns
    the rows every rank sent here (`received[r]` from rank r). Backward: the gradients of the
    rows go back the way the rows came, an all-to-all with the counts swapped."""

    @staticmethod
    def forward(ctx, x, received, sent, group):
        ctx.received, ctx.sent, ctx.group = received, sent, group
        out = x.new_empty(sum(received), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), received, sent, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(sum(ctx.sent), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.sent, ctx.received, group=ctx.group)
        return out, None, None, None


def run_experts_ep(tokens, weights, chosen, moe, experts, group):
    """MoE.run_experts across the ranks of `group`: rank r holds experts r x E/EP .. (r+1) x
    E/EP - 1 (`moe.experts`, keyed by their global numbers). Each token's k slots go to the
    ranks of their experts (dispatch), the experts run on what arrived, and the outputs come
    back (combine), where they add up by the router's weights, as on one device."""
    ranks, mine = dist.get_world_size(group), len(moe.experts)
    # The slots (slot i: token i // k's choice) by expert, so by the rank that holds it, counted
    # by searchsorted: bincount reads its largest value back to the host on a GPU.
    slots, order = chosen.flatten().sort(stable=True)
    per_expert = torch.searchsorted(slots, torch.arange(experts + 1, device=slots.device)).diff()
    # The counts first: each rank learns how many rows it will receive, for which expert.
    incoming = torch.empty_like(per_expert)
    dist.all_to_all_single(incoming, per_expert, group=group)
    # The block's one read to the host (a GPU waits for its queue): all_to_all_single's sizes
    per_expert, incoming = torch.stack([per_expert, incoming]).view(2, ranks, mine).tolist()
    sent, received = [sum(row) for row in per_expert], [sum(row) for row in incoming]
    # Each token once per slot by expand: its backward sums the k copies. An index repeating it
    # would add by index in backward (index_select's, repeat_interleave's: atomics on a GPU).
    rows = tokens[:, None].expand(*chosen.shape, -1).flatten(0, 1)[order]
    rows = AllToAll.apply(rows, received, sent, group)  # dispatch
    pieces = rows.split([count for row in incoming for count in row])  # by (rank, my expert)
    outs = [expert(torch.cat(pieces[j::mine])).split([row[j] for row in incoming])
            for j, expert in enumerate(moe.experts.values())]
    done = torch.cat([outs[j][r] for r in range(ranks) for j in range(mine)])
    back = AllToAll.apply(done, sent, received, group)  # combine: in the order they were sent
    share = weights.flatten()[order, None] * back
    # Each slot back in place (a permutation), a token's k slots summed in order: no atomic adds
    return share[order.argsort()].view(*chosen.shape, -1).sum(1).to(tokens.dtype)


def hold_experts(model, mesh):
    """Keep this rank's experts of every block, delete the others, and route each block's
    tokens to them across mesh["ep"]."""
    group, ep_rank, ep = mesh.get_group("ep"), mesh.get_local_rank("ep"), mesh["ep"].size()
    for block in model.blocks.values():
        experts = len(block.moe.experts)
        for e in list(block.moe.experts):
            if int(e) // (experts // ep) != ep_rank:
                del block.moe.experts[e]
        block.moe.run_experts = functools.partial(run_experts_ep, moe=block.moe,
                                                  experts=experts, group=group)


def is_expert(name):
    return ".moe.experts." in name


def sync_grads(model, mesh):
    """Every gradient summed over exactly the ranks that hold its parameter, then divided by
    the world size W: each rank's loss is W x its tokens' sum over the global count, so one
    device's gradient is the W ranks' sum / W. The replicated parameters: over every rank. An expert:
    its tokens' gradients came back through the all-to-all to the rank that holds it, from
    its whole EP group; summed over "dp" (the W/EP ranks that hold it). Divided by W/EP
    instead, an expert's gradient would be EP times too large."""
    world = dist.get_world_size()
    params = list(model.named_parameters())
    for held, group in ((False, None), (True, mesh.get_group("dp"))):
        grads = [p.grad for name, p in params if is_expert(name) == held]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=group)
        for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(summed.view_as(g) / world)


def clip_grads(model, mesh, max_norm):
    """clip_grad_norm_ of the whole gradient: the replicated parameters' squares (the same on
    every rank) and the experts', added up over the EP group (each rank holds others)."""
    params = list(model.named_parameters())
    squares = [sum(p.grad.pow(2).sum() for name, p in params if is_expert(name) == held)
               for held in (False, True)]
    dist.all_reduce(squares[1], group=mesh.get_group("ep"))
    norm = (squares[0] + squares[1]).sqrt()
    torch.nn.utils.clip_grads_with_norm_([p for _, p in params], max_norm, norm)
    return norm
# --- end ---


def train(args, rank, world_size, device):
    """Train; return the model, the final loss and the final validation loss."""
    # --fp64: in float64 a correct strategy ends within 1e-9 of one device, where fp32's
    # rounding, amplified by Adam, can part them (docs/drift.md). Built in fp32, then cast.
    dtype = torch.float64 if args.fp64 else torch.float32
    seed_everything(args.seed)
    model = SimpleModel.from_args(args).to(dtype)  # on the CPU: its device gets its share only
    # --compile and --activation-checkpointing, per block, before any wrapper
    compile_and_checkpoint(model.blocks.values(), args)
    # --- EP: the ranks as a grid, each holding its share of every block's experts ---
    # On `device`: W/EP rows ("dp") of EP ranks ("ep"), row-major: an EP group on one machine.
    mesh = init_device_mesh(device.type, (world_size // args.ep, args.ep),
                            mesh_dim_names=("dp", "ep"))
    hold_experts(model, mesh)
    model.to(device)  # its share (docs/moe.md); the optimizer, made after the cut, holds it only
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
        # --- EP: the global count, one all-reduce of an integer a step, before any forward ---
        # A rank counts its share of the batch; one device divides by every rank's. sync_grads
        # divides the gradients by the N ranks, so each rank's loss is multiplied by N.
        tokens = tokens.to(device)
        dist.all_reduce(tokens)
        # --- end ---
        for micro, (x, y) in enumerate(batches):
            x, y = x.to(device), y.to(device)
            with record_function("forward"):
                loss = loss_fn(model(x), y, reduction="sum") * world_size / tokens
                loss = loss + balance(model, args, y, dist.group.WORLD) / args.accum_steps
            with record_function("backward"):
                loss.backward()  # no wrapper: the gradients stay this rank's, summed below
            loss_sum += loss.detach()
        with record_function("optimizer step"):
            # --- EP: every gradient over exactly the ranks that hold it, once per step ---
            sync_grads(model, mesh)
            # --clip: scale the whole gradient, as one vector, down to this norm if it is
            # larger (0: never; the norm is still measured). Returns the norm before clipping.
            # The experts' part of the norm: over the EP group (each rank holds others).
            grad_norm = clip_grads(model, mesh, args.clip or float("inf"))
            # --- end ---
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
            with meter.paused():  # every rank: rank 0 gathers, then writes
                save_checkpoint(args, model, optimizer, step + 1)
    profiler.stop()
    print0(meter.summary(final_loss, model, val_loss=val_loss,
                         state_bytes=held_bytes(model, optimizer)))
    return model, final_loss, val_loss


def save_checkpoint(args, model, optimizer, step):
    """Everything needed to continue exactly where this run is: the data position is a
    function of (seed, step, global batch) only, so those three are all it needs besides the
    weights and Adam's state."""
    # A collective: rank 0 gathers single.py's file (one device's), which any EP degree resumes
    weights, adam = gather_full_state(args, [(model, optimizer)])
    if weights is None:  # not rank 0
        return
    save_atomic({"model": weights, "optimizer": adam,
                 **train_state(args, step)}, args.checkpoint)
    print(f"checkpoint: step {step} -> {args.checkpoint}", flush=True)


def load_checkpoint(args, model, optimizer):
    """Resume from --checkpoint if it holds one: the weights, Adam's state; return the step to
    start from (0 without one). A bad one stops with one line and is left as it was."""
    state = read_checkpoint(args, __file__)  # torch.load(weights_only=True), checked; or None
    if state is None:
        return 0
    mine = model.state_dict()  # one device's file: the experts this rank lacks left out
    model.load_state_dict({name: t for name, t in state["model"].items()
                           if name in mine or not is_expert(name)})
    optimizer.load_state_dict(optimizer_share(state["optimizer"], args, model))  # its share
    print0(f"resumed from {args.checkpoint} at step {state['step']}")
    return state["step"]


def run(args):
    """What each process does: set up, train, save."""
    rank, world_size, device = setup(args)
    model, _, _ = train(args, rank, world_size, device)
    weights = gather_full_state(args, [(model, None)])[0] if args.save else None  # a collective
    if args.save and rank == 0:
        save_atomic(weights, args.save)  # CPU tensors: loads anywhere
    dist.destroy_process_group()  # on a clean exit only: after an error, peers may hang


def main(argv=None):
    args = parse_args(argv)
    launch(run, args)  # one rank under torchrun, else --nproc of them started here


if __name__ == "__main__":
    main()
