"""Tensor parallelism (TP), and 2D parallelism: each layer's matrices cut across devices.

What it teaches
    DDP and FSDP split the batch; TP splits each layer. Every Block of SimpleModel is a
    transformer block, attention then a feed-forward pair, and with T ranks in a TP group
    (Megatron-LM's scheme, torch.distributed.tensor.parallel):
    - attention is cut by heads: q, k and v by columns (ColwiseParallel), so rank t holds H/T
      whole heads of each and runs attention on them from the whole input, with no
      communication; the output projection `o` by rows (RowwiseParallel): rank t multiplies its
      heads' outputs by its rows and gets a partial sum, and one all-reduce adds the T of them;
    - the feed-forward pair likewise: `up` by columns (1/T of the inner units per rank), `down`
      by rows, one all-reduce. Backward mirrors both: one all-reduce of the block's input
      gradient before attention (q, k and v together) and one before `up`.
    So each rank holds and updates 1/T of every block's matrices, gradients and Adam state, and
    moves 4 activation-sized all-reduces per block per step, whatever the batch is cut into;
    the norms, embeddings and head stay whole on every rank. All the ranks of one TP group work
    on the same samples. With --tp T smaller than the world size W, the W ranks form a grid of
    W/T groups ("dp") of T ranks ("tp"): TP inside each group, FSDP across the groups, each
    group on its own shard of every batch (2D). With global batch B the result equals one
    device with batch B: the tests prove it in float64 to 1e-9. The model's tp_plan names what
    is cut; tp.py refuses one it cannot follow (docs/questions.md#putting-your-own-model-in).

    --sequence-parallel (SP, Megatron-LM's, which comes with TP in transformers): between the
    TP regions (the norms, the residual sums) each rank holds 1/T of the sequence instead of
    the whole of it. Each all-reduce becomes a reduce-scatter (onto the sequence parts) and an
    all-gather (before the next region), which together move what it moved; two more
    all-gathers at the ends and one small all-reduce of the norms' gradients a step, and the
    norms' activations shrink to 1/T. --loss-parallel: the output layer is cut over the
    vocabulary and its logits stay cut through the cross-entropy (loss_parallel()): no rank
    ever holds the whole logits, for a real vocabulary (50-200 k) the largest activation.

When to use it
    The layers themselves are too big, or too slow, for one device, and the devices have the
    fastest links there are (NVLink, inside one machine): every block all-reduces activations
    four times per step (twice in forward, twice in backward), in the critical path. Large
    models use TP inside a machine and FSDP (or pipelining) across: --tp 8 on 8-GPU machines.
When not
    Over ordinary networks or across machines (TP's all-reduces would wait on every block),
    or when the model fits with DDP or FSDP, which move less and overlap it with compute.

Launch
    python tp.py                              # starts its own workers: one per GPU, or 2
    torchrun --nproc_per_node=2 tp.py         # pure TP: each block cut in 2
    torchrun --nproc_per_node=4 tp.py --tp 2  # 2D: 2 TP groups of 2, FSDP across them
    torchrun --nproc_per_node=8 tp.py --tp 2 --replicate 2 --mixed-precision bf16  # fsdp.py's
    torchrun --nproc_per_node=2 tp.py --sequence-parallel --loss-parallel  # SP, loss parallel
    torchrun --nproc_per_node=4 tp.py --tp 2 --checkpoint ckpt   # resumable on any mesh
    torchrun --nproc_per_node=2 tp.py --fp64  # float64: within 1e-9 of single.py --fp64
    Smallest hardware: any laptop CPU (2 processes over gloo). On GPUs, NCCL: one GPU per rank,
    and every TP group inside one machine.

What is trusted
    A checkpoint is data: the folder is read through load_sharded (plumbing/sharded.py), which
    never runs code from it, where torch's own dcp.load would (docs/checkpoints.md). The
    rendezvous store has no authentication: trusted networks only (docs/traps.md#trust).

What changes from sharding (FSDP) to cutting each layer (TP, and 2D)
    diff fsdp.py tp.py

Docs
    https://pytorch.org/docs/stable/distributed.tensor.parallel.html
    https://pytorch.org/tutorials/intermediate/TP_tutorial.html (SP and loss parallelism too)
    https://pytorch.org/docs/stable/distributed.checkpoint.html
Tested with torch 2.10.0 (the oldest that requirements.txt admits), 2.13.0 and 2.15.0, on CPU/gloo.
"""

import contextlib
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
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)
from torch.profiler import record_function
from torch.utils.data import DataLoader, DistributedSampler

from common import SimpleModel, loss_fn, make_dataset, seed_everything
from plumbing.balance import balance
from plumbing.buffers import fill_buffers
from plumbing.checkpoints import save_atomic
from plumbing.flags import check_shared_flags, compile_and_checkpoint, launch_world, shared_parser
from plumbing.flags import check_tp, grid, positive
from plumbing.meter import Meter, Profiler, eval_line, held_bytes, log_line, print0
from plumbing.model_check import check_cut, check_model
from plumbing.replicate import replicate_the_rest
from plumbing.ranks import launch
from plumbing.sharded import latest_checkpoint, load_sharded, step_folder


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
    print0(f"tp: {world_size} ranks = {world_size // args.tp} (dp) x {args.tp} (tp) | "
           f"backend {args.backend} | device {device.type} | torch {torch.__version__}")
    return rank, world_size, device


def evaluate(model, dataset, mesh, batch_size, device):
    """The mean cross-entropy per token over the whole held-out set."""
    model.eval()  # SimpleModel has no dropout or BatchNorm, but the model you copy this to may
    # --- TP: evaluate a shard on each TP group, then add the sums up ---
    rank, world_size = mesh.get_local_rank("dp"), mesh["dp"].size()
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
            sums[0] += whole(loss_fn(logits, y, reduction="sum"))
            sums[1] += (y != -100).sum()  # the targets that count: cross_entropy skips -100s
    # Sums here too: a mean of the ranks' means would weigh a 333-sample shard like a 334 one.
    # Over "dp" only: the T ranks of a TP group work on the same samples, hold the same sums.
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=mesh.get_group("dp"))
    # Free the gathered weights FSDP keeps for a backward that never comes (the root's, at least)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    # --- end ---
    model.train()
    return (sums[0] / sums[1]).item()


def parallelize(model, mesh, sequence_parallel=False, vocab_parallel=False, shard_blocks=True,
                shard_over="dp", keep=False, compute_dtype=None):
    """Cut each Block over mesh["tp"] (and the activations between them along the sequence:
    sequence_parallel; the head over the vocabulary: vocab_parallel); 2D: shard over
    mesh[shard_over], each block on its own (shard_blocks) and the rest, or the whole model as
    one (nd.py, over "dp_cp"), with fsdp.py's options (keep: --reshard-after-forward false;
    compute_dtype: --mixed-precision)."""
    # --- TP: cut each block's attention by heads and its MLP by inner units ---
    # ColwiseParallel cuts a weight by output features: its output, cut, is what
    # RowwiseParallel (cut by input features) takes, adding up its partial sums in one
    # all-reduce. q, k, v by columns (whole heads: --tp divides --heads), `o` by rows; `up` by
    # columns, `down` by rows (GELU acts elementwise). The norms, embeddings and head stay whole.
    # --- SP: between the TP regions, each rank keeps 1/T of the sequence ---
    # The norms and the residual sums, computed alike on every rank of a group, cut along the
    # sequence instead: a region's all-reduce becomes a reduce-scatter after it and an
    # all-gather before the next (the same bytes), and those activations shrink to 1/T.
    between = Shard(1) if sequence_parallel else Replicate()
    styles = {  # each kind of the model's tp_plan (SimpleModel.tp_plan) as torch's style
        "colwise": ColwiseParallel(input_layouts=between),
        "rowwise": RowwiseParallel(output_layouts=between),
        # The attention's input made a DTensor once, before q, k and v: backward then
        # all-reduces their three input gradients as one sum (not three all-reduces).
        "shared_input": PrepareModuleInput(input_layouts=between,
                                           desired_input_layouts=Replicate()),
        # SP: the norms see 1/T of the tokens, their gradients are Partial() sums (train()
        # adds them up); left out, each rank's norms would drift apart on its own tokens.
        "norm": SequenceParallel() if sequence_parallel else None, "head": None}
    # The ends: with SP the first block takes its part of the sequence, the final norm works on
    # parts; loss parallelism cuts the head over the vocabulary and leaves its logits cut.
    first = PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1),
                               use_local_output=True)
    block0 = next(n for n, m in model.named_modules() if m is next(iter(model.blocks.values())))
    ends = {block0: first} if sequence_parallel else {}
    if vocab_parallel:
        styles["head"] = ColwiseParallel(input_layouts=between, output_layouts=Shard(-1),
                                         use_local_output=False)
    elif sequence_parallel:
        styles["head"] = PrepareModuleInput(input_layouts=between, use_local_output=True,
                                            desired_input_layouts=Replicate())
    # q, k and v, inside the attention's shared input, take it whole; `up` takes `between`.
    inside = tuple(f"{name}." for name, kind in model.tp_plan.items() if kind == "shared_input")
    plan = {name: ColwiseParallel() if kind == "colwise" and name.startswith(inside) else
            styles[kind] for name, kind in model.tp_plan.items() if styles[kind]}
    tensors = len(list(model.parameters()))  # a tied weight counts once
    parallelize_module(model, mesh["tp"], {**ends, **plan})
    # What TP leaves whole (norms, embeddings, head) becomes a replicated DTensor too: beside
    # DTensors a plain tensor stops Adam's foreach path, "got mixed torch.Tensor and DTensor".
    # Each parameter once: a head tied to its embedding stays one tensor (plumbing/replicate.py).
    replicate_the_rest(model, mesh["tp"])
    check_cut(model, tensors)  # every layer the plan cuts is cut, no tie split: checked
    # --- end ---
    # --- 2D: FSDP across the TP groups, after TP ---
    # TP first, then fully_shard over mesh[shard_over] cuts the pieces (1/(D*T) of a block per
    # rank); the other order fails, "Cannot distribute a DTensor with device mesh". Blocks, root.
    # fsdp.py's options are fully_shard's arguments, as there (HSDP: a 2D shard_over).
    if mesh[shard_over].size() > 1:
        dtype = next(model.parameters()).dtype
        mp_policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=dtype)
        for block in model.blocks.values() if shard_blocks else ():
            fully_shard(block, mesh=mesh[shard_over], mp_policy=mp_policy,
                        reshard_after_forward=not keep)
        # The root: None, torch's default for it, keeps its weights for backward (they run last)
        fully_shard(model, mesh=mesh[shard_over], reshard_after_forward=False if keep else None,
                    mp_policy=MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=dtype,
                                                   output_dtype=dtype))
    return model


def train(args, rank, world_size, device):
    """Train; return the model, the final loss and the final validation loss."""
    # --fp64: in float64 a correct strategy ends within 1e-9 of one device, where fp32's
    # rounding, amplified by Adam, can part them (docs/drift.md). Built in fp32, then cast.
    dtype = torch.float64 if args.fp64 else torch.float32
    # --- TP: build the model without memory, cut it (and shard it), then fill the pieces ---
    # On the "meta" device a module has shapes but no storage: any size costs nothing here.
    with torch.device("meta"):
        model = SimpleModel.from_args(args).to(dtype)
    # --compile and --activation-checkpointing, per block, before any wrapper
    compile_and_checkpoint(model.blocks.values(), args)
    # The ranks as a grid on `device`: W/T rows ("dp") of T ranks ("tp"), row-major, so a TP
    # group is T consecutive ranks, which torchrun places on one machine.
    mesh = init_device_mesh(device.type, (world_size // args.tp, args.tp),
                            mesh_dim_names=("dp", "tp"))
    # --mixed-precision bf16: weights gathered and used in bf16; the gradients reduced and the
    # output returned in `dtype` (a bf16 sum of N ranks' gradients rounds away the small ones).
    compute_dtype = torch.bfloat16 if args.mixed_precision == "bf16" else None  # None: as is
    # --replicate R (HSDP): the D groups as R rows of D/R, each row sharded; the rows all-reduce
    # like DDP replicas. The same ranks, named for FSDP: (replicate, shard, tp).
    fsdp_mesh, over = mesh, "dp"
    if args.replicate > 1:
        fsdp_mesh = init_device_mesh(device.type, (args.replicate, world_size // (
            args.replicate * args.tp), args.tp), mesh_dim_names=("replicate", "shard", "tp"))
        over = ("replicate", "shard")
    keep = args.reshard_after_forward == "false"  # ZeRO-2-like: one all-gather less, more memory
    parallelize(model, fsdp_mesh, args.sequence_parallel, args.loss_parallel, shard_over=over,
                keep=keep, compute_dtype=compute_dtype)
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

    cut_logits = loss_parallel if args.loss_parallel else contextlib.nullcontext
    dataset, val_set = make_dataset("train", args.data), make_dataset("val", args.data)
    # --- TP: shard the data by TP group, not by rank ---
    # A TP group's ranks compute slices of the same samples (fed by rank, the all-reduces
    # would add up slices of different ones): the batch is dealt over the D = W/T groups.
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
        tokens = sum((y != -100).sum() for _, y in batches)
        # --- TP: the global count, one all-reduce of an integer a step, over "dp" ---
        # A TP group's ranks hold the same samples: counted once, over the D = W/T groups. 2D's
        # FSDP averages the gradients over the D groups, so each loss is multiplied by D.
        tokens = tokens.to(device)
        dist.all_reduce(tokens, group=mesh.get_group("dp"))
        # --- end ---
        for micro, (x, y) in enumerate(batches):
            x, y = x.to(device), y.to(device)
            # --- TP: accumulate gradients (TP's all-reduces, of activations, run in each) ---
            # 2D, as fsdp.py: FSDP's switch skips the reduce-scatter, keeping whole gradients
            # (their memory) until the last micro-batch reduce-scatters the sum.
            if dp > 1:
                model.set_requires_gradient_sync(micro == args.accum_steps - 1)
            # --- Loss parallelism: the loss and its backward run on the cut logits ---
            # loss_parallel(): the cross-entropy of logits cut over the vocabulary, from
            # all-reduces of one number per token; backward, in pieces too, runs inside it.
            with cut_logits(), record_function("forward"):
                loss = whole(loss_fn(model(x), y, reduction="sum")) * dp / tokens
                loss = loss + balance(model, args, y, dist.group.WORLD) / args.accum_steps
            with cut_logits(), record_function("backward"):
                loss.backward()
            # --- end ---
            loss_sum += loss.detach()
        with record_function("optimizer step"):
            # --- SP: the norms' gradients, added up over the TP group once per step ---
            sum_partial_grads(model)
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
            with meter.paused(), record_function("evaluation"), cut_logits():
                val_loss = evaluate(model, val_set, mesh, args.batch_size, device)
            print0(eval_line(step + 1, args.steps, val_loss))
        if args.checkpoint and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
            with meter.paused():  # every rank writes its own shards: a collective
                save_checkpoint(args, model, optimizer, step + 1)
    profiler.stop()
    print0(meter.summary(final_loss, model, val_loss=val_loss,
                         state_bytes=held_bytes(model, optimizer)))
    return model, final_loss, val_loss


def whole(loss):
    """A loss as a plain tensor (under loss_parallel() it is a replicated DTensor)."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def sum_partial_grads(model):
    """SP: add up the norms' partial gradients over the TP group in one all-reduce, as
    Megatron-LM does; left Partial(), every reader (clipping, each of Adam's ops) would
    all-reduce each again. (2D: FSDP's backward has summed them already.)"""
    partial = [p for p in model.parameters()
               if p.grad is not None and any(pl.is_partial() for pl in p.grad.placements)]
    if partial:
        mesh = partial[0].grad.device_mesh  # pure TP's one mesh dimension
        flat = torch.cat([p.grad.to_local().flatten() for p in partial])
        dist.all_reduce(flat, group=mesh.get_group())
        for p, summed in zip(partial, flat.split([p.numel() for p in partial])):
            p.grad = DTensor.from_local(summed.view(p.shape), mesh, [Replicate()])


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
