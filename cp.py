"""Context parallelism (CP): every rank holds a piece of every sequence; attention sees all of it.

What it teaches
    DDP splits the batch, TP each layer; CP splits each *sequence*. The C ranks of a CP group
    train on the same sequences, each on 1/C of the tokens of every one of them, with the whole
    model. Everything in a transformer works on each token alone (the embeddings, the norms,
    the MLP, the output layer, the loss) except attention, where a token's query meets the keys
    and values of every token before it, and most of those live on other ranks. So attention,
    and attention only, communicates:
    - --cp-method allgather: each block all-gathers K and V over the CP group; every rank then
      attends its own queries over the whole sequence, under the causal mask written from the
      tokens' real positions. The all-gather is autograd-aware: its backward is a
      reduce-scatter that hands each rank the gradient of its own K and V, summed over all the
      ranks whose queries read them. Llama 3 trained its long contexts this way.
    - --cp-method ring (ring attention): K and V travel round the ring of C ranks, C - 1 hops,
      each rank passing on the block it holds and receiving its neighbour's; each rank attends
      its queries over each block as it comes and merges the partial results by their
      log-sum-exp (the softmax of the whole row, assembled from each block's own: flash
      attention's trick). With a fused kernel a rank holds two blocks at a time, never the
      whole sequence's K and V; here autograd keeps every block it received for backward.
    - --cp-method ulysses (DeepSpeed-Ulysses): an all-to-all trades each rank's tokens of every
      head for every token of 1/C of the heads; each rank attends its heads over the whole
      sequence with the model's own attention, and a second all-to-all trades the output back
      (each one's backward is the opposite trade). C must cut the heads into whole ones
      (grouped K/V heads too, or be a multiple of them: copies); other counts are refused.
    Load balance: under the causal mask a late token attends to many keys and an early one to
    few, so with contiguous pieces the last rank would do C times the first's work (and the
    first would sit idle). The sequence is cut into 2C chunks and rank i takes chunks i and
    2C-1-i, an early one and a late one: every rank the same work. Each token keeps its place:
    the position embedding reads the token's position in its sequence, not on its rank.
    Weights and their gradients are whole on every rank, as in DDP (a CP rank, like a DP rank,
    saw part of the batch): DDP averages them over every rank. With --cp C smaller than the
    world size W, the ranks form a grid of W/C groups ("dp") of C ("cp"), each group on samples
    of its own. Each rank's loss is the mean over its own tokens: every rank holds as many, so
    their average over the W ranks is the mean over the batch. With global batch B the result
    equals one device with batch B: the tests prove it in float64 to 1e-9. Long contexts come
    with big models: FSDP x CP, the weights sharded over data x context, is nd.py's
    (python nd.py --pp 1 --tp 1 --cp C), where its mesh is.

When to use it
    Sequences so long that one sequence's activations (which grow with its length) do not fit
    on a device even with activation checkpointing: long-context training, 100k tokens and
    more. The exchanges (K and V, per layer) grow with the length; attention's compute grows
    with its square, so the longer the sequence, the better the ring hides them behind it.
    Ulysses' bytes per rank fall as C grows (4 (C-1)/C of its S/C tokens' activations per
    block, less with grouped K/V heads), the others' grow; but its C stops at the heads.
When not
    Short sequences (ours: 16 tokens): the exchanges cost more than the attention they split;
    split the batch instead (ddp.py, fsdp.py). PyTorch's own context_parallel() runs the ring
    inside its flash and memory-efficient CUDA kernels: on GPUs at scale, use it (or
    torchtitan); this script writes CP with public collectives so it runs anywhere and can be
    read, and proves it.

Launch
    python cp.py                                   # starts its own workers: 1 per GPU, or 2
    torchrun --nproc_per_node=2 cp.py              # each sequence in 2 pieces (all-gather)
    torchrun --nproc_per_node=2 cp.py --cp-method ring
    torchrun --nproc_per_node=4 cp.py --cp-method ulysses   # one head of the 4 per rank
    torchrun --nproc_per_node=4 cp.py --cp 2       # dp 2 x cp 2: two groups, 2 pieces each
    torchrun --nproc_per_node=2 cp.py --fp64       # float64: within 1e-9 of single.py --fp64
    torchrun --nproc_per_node=4 cp.py --checkpoint ckpt.pt   # resumes on any --cp, and in nd.py
    Smallest hardware: any laptop CPU (2 processes over gloo). On GPUs, NCCL: one GPU per rank,
    and a CP group inside one machine where it can be (its exchanges are per layer).

What context parallelism adds to data parallelism
    diff ddp.py cp.py

Docs
    https://pytorch.org/tutorials/prototype/context_parallel.html (PyTorch's, CUDA only)
    https://arxiv.org/abs/2310.01889 (ring attention)
    https://arxiv.org/abs/2407.21783 (Llama 3: all-gather CP, the load-balanced chunks)
    https://arxiv.org/abs/2309.14509 (DeepSpeed-Ulysses)
    docs/long-sequences.md (CP inside nd.py's mesh, FSDP x CP among it)
Tested with torch 2.10.0 (the oldest that requirements.txt admits), 2.13.0 and 2.15.0, on CPU/gloo.
"""

import contextlib
import datetime
import functools
import itertools
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import record_function
from torch.utils.data import DataLoader, DistributedSampler

from common import BOS, SEQ_LEN, SimpleModel, documents, loss_fn, make_dataset, seed_everything
from plumbing.balance import balance
from plumbing.checkpoints import read_checkpoint, save_atomic, train_state
from plumbing.flags import check_shared_flags, compile_and_checkpoint, launch_world, shared_parser
from plumbing.flags import grid, positive
from plumbing.meter import Meter, Profiler, eval_line, held_bytes, log_line, print0
from plumbing.model_check import check_model
from plumbing.ranks import launch


def parse_args(argv=None):
    parser = shared_parser(__doc__, ranks=True)  # the flags every script shares (docs/usage.md)
    hardware = parser.groups["hardware"]
    hardware.add_argument("--cp", type=positive(int), default=None, help="ranks per context-"
                          "parallel group, each with 1/CP of every sequence (default: all)")
    hardware.add_argument("--cp-method", choices=["allgather", "ring", "ulysses"],
                          default="allgather",
                          help="how attention reaches the tokens the other ranks hold")
    args = parser.parse_args(argv)
    check_shared_flags(parser, args)  # and their checks: one line that names the fix
    world_size = launch_world(parser, args, data_parallel=False)[0]  # torchrun's, or --nproc
    grid(parser, args, "--cp", world_size)  # --cp: all ranks by default; W/C groups
    if SEQ_LEN % (2 * args.cp):
        parser.error(f"--cp {args.cp}: the sequence length {SEQ_LEN} must cut into 2 x --cp equal"
                     f" chunks (each rank takes two); use a --cp that divides {SEQ_LEN // 2}")
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
    print0(f"cp: {world_size} ranks = {world_size // args.cp} (dp) x {args.cp} (cp), "
           f"{args.cp_method} | backend {args.backend} | "
           f"device {device.type} | torch {torch.__version__}")
    return rank, world_size, device


def evaluate(model, dataset, rank, world_size, batch_size, device, positions, packed):
    """The mean cross-entropy per token over the whole held-out set."""
    model.eval()  # SimpleModel has no dropout or BatchNorm, but the model you copy this to may
    # --- CP: evaluate a shard on each CP group (rank: its "dp" rank), then add the sums up ---
    # Without drop_last, DistributedSampler pads the shards to one length with duplicates:
    # a rank's real samples are its first len(range(rank, n, N)) (docs/traps.md#padding).
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size // world_size, sampler=sampler)  # B/N each
    real = len(range(rank, len(dataset), world_size))
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # token losses, tokens
    with torch.no_grad():  # no graph, no activations kept: evaluation needs far less memory
        for x, y in loader:
            docs = {"docs": documents(x, BOS)[:, positions].to(device)} if packed else {}
            x, y = x[:, positions].to(device), y[:real, positions].to(device)  # its tokens
            real -= len(y)
            # A CP forward is a collective: every rank forwards the padded batch whole, as
            # often, then scores its real samples (cut first, the last could be empty).
            logits = model(x, positions=positions.to(device), **docs)[:len(y)]
            sums[0] += loss_fn(logits, y, reduction="sum")
            sums[1] += (y != -100).sum()  # the targets that count: cross_entropy skips -100s
    # Sums here too: a mean of the ranks' means would weigh a 333-sample shard like a 334 one.
    # Over every rank: each holds tokens no other rank has.
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    # --- end ---
    model.train()
    return (sums[0] / sums[1]).item()


# --- CP: which tokens a rank holds, and attention across the ranks ---
def chunks_of(cp_rank, cp):
    """The two chunks (of 2 x cp, in sequence order) that rank `cp_rank` of a CP group holds:
    an early one and its mirror from the end, so every rank has the same causal attention work
    (chunk i attends to i + 1 chunks, chunk 2C-1-i to 2C - i: 2C + 1 on every rank)."""
    return cp_rank, 2 * cp - 1 - cp_rank


def token_positions(cp_rank, cp):
    """The positions in the sequence of the tokens rank `cp_rank` holds, in its order."""
    chunk = SEQ_LEN // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunks_of(cp_rank, cp)])


class AllGather(torch.autograd.Function):
    """Every rank of `group`'s x, joined along the sequence (dim -2), in rank order. Backward:
    every rank read each x, so its gradient is the sum of theirs: a reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim=-2)

    @staticmethod
    def backward(ctx, grad):
        pieces = [g.contiguous() for g in grad.chunk(dist.get_world_size(ctx.group), dim=-2)]
        mine = torch.empty_like(pieces[0])
        dist.reduce_scatter(mine, pieces, group=ctx.group)
        return mine, None


def attend_allgather(q, k, v, docs=None, *, group, positions, all_positions):
    """Causal attention of this rank's queries over every rank's keys and values (packed: docs)."""
    kv = AllGather.apply(torch.stack([k, v]), group)  # one collective for both
    # Causal by position, not by index: `is_causal` would compare this rank's 4th query with
    # the 4th key of the gathered sequence, which is not the token before it.
    may_see = all_positions <= positions[:, None]  # (this rank's tokens, all tokens)
    if docs is not None:  # and by document: every rank's docs too, a small all-gather
        all_docs = AllGather.apply(docs[:, None, :, None], group)  # (batch, 1, all tokens, 1)
        may_see = may_see & (docs[:, None, :, None] == all_docs.mT)
    return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=may_see)


class RingPass(torch.autograd.Function):
    """Send x to the next rank of `group`'s ring, return the previous one's; backward: back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return pass_on(x, group, +1)

    @staticmethod
    def backward(ctx, grad):
        return pass_on(grad, ctx.group, -1), None


def pass_on(x, group, step):
    me, size = dist.get_rank(group), dist.get_world_size(group)
    to, source = (dist.get_global_rank(group, (me + s) % size) for s in (step, -step))
    received = torch.empty_like(x)
    # Sends and receives together, so no rank waits for its receiver before it can receive.
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x.contiguous(), to, group),
                                        dist.P2POp(dist.irecv, received, source, group)]):
        work.wait()
    return received


def block_attention(q, k, v, hidden):
    """Attention of q over one block of keys, but the `hidden` ones (a mask, or None): its output
    and each query's log-sum-exp (merge() weighs the blocks by it). In float32 at least, as
    PyTorch's own merges: a bf16 log-sum-exp rounds by up to 1/64, an error in every output."""
    wide = torch.promote_types(q.dtype, torch.float32)
    q, k, v = q.to(wide), k.to(wide), v.to(wide)
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if hidden is not None:
        # Not -inf: packed, a query may see no key of a block (another document's), and
        # exp(-inf - -inf) is NaN. This lse is then ~ -3e38: merge() weighs the block by 0.
        scores = scores.masked_fill(hidden, torch.finfo(wide).min)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse) @ v, lse


def merge(parts):
    """One softmax over all the blocks: each one's output weighed by exp(its lse - all's lse)."""
    lse = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)
    return sum(out * torch.exp(part_lse - lse) for out, part_lse in parts)


def attend_ring(q, k, v, docs=None, *, group):
    """Causal attention of this rank's queries over every rank's keys and values, by ring."""
    me, cp = dist.get_rank(group), dist.get_world_size(group)
    queries = q.chunk(2, dim=-2)  # this rank's two chunks
    parts = ([], [])  # per query chunk: (output, log-sum-exp) over each key chunk it sees
    kv = torch.stack([k, v])  # one message for both
    later = q.new_ones(queries[0].shape[-2:-1] * 2, dtype=torch.bool).triu(1)
    if docs is not None:  # packed: every rank's, in rank order (a small all-gather), by chunk
        every = AllGather.apply(docs[:, None, :, None], group).chunk(2 * cp, dim=-2)
    for hop in range(cp):
        source = (me - hop) % cp  # whose tokens kv holds: this rank's own, then each other's
        for i, (query, q_chunk, part) in enumerate(zip(queries, chunks_of(me, cp), parts)):
            for j, (key_value, k_chunk) in enumerate(zip(kv.chunk(2, dim=-2),
                                                         chunks_of(source, cp))):
                # A key chunk after the query chunk is masked whole: skip its work. (Half the
                # chunk pairs; the load balance gives every rank the same number of them.)
                if k_chunk > q_chunk:
                    continue
                hidden = later if k_chunk == q_chunk else None  # its own: t sees up to t
                if docs is not None:  # and another document's: (batch, 1, query, key)
                    other = every[2 * me + i] != every[2 * source + j].mT
                    hidden = other if hidden is None else hidden | other
                part.append(block_attention(query, *key_value, hidden))
        if hop < cp - 1:
            # Every rank passes its block on at every hop, whatever it skipped: a rank that
            # skipped the exchange would leave the ring's sends unmatched (a hang to --timeout).
            kv = RingPass.apply(kv, group)
    return torch.cat([merge(part) for part in parts], dim=-2).to(q.dtype)  # as it came in


class AllToAll(torch.autograd.Function):
    """x cut in C along dim `scatter`, piece i sent to rank i of `group`; the C pieces received
    joined along dim `gather`, in rank order. Backward: the same trade back, the dims swapped."""

    @staticmethod
    def forward(ctx, x, group, scatter, gather):
        ctx.group, ctx.dims = group, (gather, scatter)
        return all_to_all(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.group, *ctx.dims), None, None, None


def all_to_all(x, group, scatter, gather):
    """x cut in C along `scatter`, piece i to rank i; the pieces received, joined along `gather`."""
    pieces = torch.stack(x.chunk(dist.get_world_size(group), dim=scatter))  # piece i: rank i's
    received = torch.empty_like(pieces)
    dist.all_to_all_single(received, pieces, group=group)  # dim 0 split evenly over the ranks
    return torch.cat(received.unbind(), dim=gather)


def attend_ulysses(q, k, v, docs=None, *, group, all_positions, attend):
    """The block's own `attend`, on every token of the sequence for 1/C of the heads
    (DeepSpeed-Ulysses): trade this rank's tokens of every head for every token of its heads,
    attend, trade back. The traded tokens come in rank order (all_positions): sorted first."""
    cp, order = dist.get_world_size(group), all_positions.argsort()
    if k.shape[1] < cp:  # GQA with fewer K/V heads than ranks: copies, one per rank
        k, v = (t.repeat_interleave(cp // t.shape[1], dim=1) for t in (k, v))
    # (batch, heads, my tokens, width) -> (batch, heads/C, all tokens, width): rank i gets the
    # i-th C-th of the heads (of K and V too: the ones its queries read)
    q = AllToAll.apply(q, group, 1, 2)[:, :, order]
    k, v = AllToAll.apply(torch.stack([k, v]), group, 2, 3)[:, :, :, order]  # one collective
    if docs is not None:  # packed: every token's document, a small all-gather
        docs = AllGather.apply(docs[:, None, :, None], group)[:, 0, order, 0]
    # Whole sequences of whole heads, in order: the model's attention as it is (its causal
    # mask, its kernel; a grouped-heads one must read the grouping off q's and k's shapes)
    out = attend(q, k, v) if docs is None else attend(q, k, v, docs)
    return AllToAll.apply(out[:, :, all_positions], group, 2, 1)  # back: my tokens, all heads


def cut_sequences(model, mesh, method):
    """Make each block's attention reach across mesh["cp"]; return this rank's tokens' positions."""
    group, cp_rank, cp = mesh.get_group("cp"), mesh.get_local_rank("cp"), mesh["cp"].size()
    positions, where = token_positions(cp_rank, cp), next(model.parameters()).device
    all_positions = torch.cat([token_positions(r, cp) for r in range(cp)]).to(where)
    for block in model.blocks.values():
        block.attn.attend = {  # all-gather and ring replace the attention; Ulysses wraps it
            "allgather": functools.partial(attend_allgather, group=group, all_positions=
                                           all_positions, positions=positions.to(where)),
            "ring": functools.partial(attend_ring, group=group),
            "ulysses": functools.partial(attend_ulysses, group=group, all_positions=
                                         all_positions, attend=block.attn.attend)}[method]
    return positions
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
    # --- CP: the ranks as a grid, each block's attention reaching across its CP group ---
    # On `device`: W/C rows ("dp") of C ranks ("cp"), row-major: a CP group on one machine.
    mesh = init_device_mesh(device.type, (world_size // args.cp, args.cp),
                            mesh_dim_names=("dp", "cp"))
    positions = cut_sequences(model, mesh, args.cp_method)  # on the CPU: they index batches
    where = positions.to(device)  # and on the device, the position embedding's input
    # --- end ---
    # --- DDP: wrap the model: rank 0's weights broadcast, gradients averaged in backward ---
    # Backward fills the gradients into buckets of 25 MB (the first one 1 MB), and DDP
    # all-reduces each bucket as soon as it is full. Each .grad is a view into its bucket.
    # Over every rank, CP's too: the ranks' gradients of their tokens' mean losses average
    # to the gradient of the batch's mean loss.
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    gradient_as_bucket_view=True)
    # --- end ---
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    start_step = load_checkpoint(args, model, optimizer) if args.checkpoint else 0

    dataset, val_set = make_dataset("train", args.data), make_dataset("val", args.data)
    # --- DDP: shard the data ---
    # Each epoch one permutation from seed + epoch, the same on every rank, of which rank r
    # takes positions r, r+N, ...: the N ranks' B/N samples are one device's batch of B.
    # Over the CP groups ("dp"): a group's ranks take the same samples (their pieces of them).
    dp_rank, dp = mesh.get_local_rank("dp"), mesh["dp"].size()
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
        tokens = sum((y[:, positions] != -100).sum() for _, y in batches)  # CP: of its pieces
        # --- DDP: the global count, one all-reduce of an integer a step, before any forward ---
        # A rank counts its share of the batch; one device divides by every rank's. DDP
        # averages the gradients over the N ranks, so each rank's loss is multiplied by N.
        tokens = tokens.to(device)
        dist.all_reduce(tokens)
        # --- end ---
        for micro, (x, y) in enumerate(batches):
            # Packed: the tokens' documents, read from the whole sequence (a keyword only then)
            packed = ({"docs": documents(x, BOS)[:, positions].to(device)}
                      if args.data == "packed" else {})
            x, y = x[:, positions].to(device), y[:, positions].to(device)  # CP: this rank's pieces
            # --- DDP: accumulate gradients without communicating ---
            # no_sync() skips the all-reduce; it must cover forward *and* backward: forward is
            # where DDP decides whether the coming backward syncs. The last one syncs the sum.
            with ddp_model.no_sync() if micro < args.accum_steps - 1 else contextlib.nullcontext():
                with record_function("forward"):
                    # where in the sequence each token of x is (not 0, 1, ... on this rank)
                    loss = loss_fn(ddp_model(x, positions=where, **packed), y, reduction="sum")
                    loss = loss * world_size / tokens
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
            # Over every rank, CP's too: rank 0's own loss is that of its pieces only.
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
            final_loss = loss_sum.item()
            print0(log_line(step + 1, args.steps, final_loss, grad_norm.item(),
                        samples_per_s))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            with meter.paused(), record_function("evaluation"):
                val_loss = evaluate(model, val_set, dp_rank, dp, args.batch_size, device, positions,
                                    args.data == "packed")
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
