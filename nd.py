"""N-D parallelism: pipeline (pp) x FSDP (dp) x context (cp) x tensor parallelism (tp), one mesh.

What it teaches
    A large job uses several techniques at once, each where its communication fits: TP inside
    a machine (two activation all-reduces per block each way, on the fastest links), CP beside
    it for long sequences (K and V per block), stages across machines (only the activations at
    the cuts travel), and FSDP over the rest (one all-gather and one reduce-scatter per block,
    overlapped). Here the W ranks form a DeviceMesh of shape (pp, dp, cp, tp), named (and
    FSDP's view of it, (pp, dp_cp, tp)), from --pp P, --cp C and --tp T (dp = W/(P C T)):
    - "pp": the P ranks that hold the stages of one pipeline (pipeline.py's `cut`, V stages
      per rank with --stages-per-rank, placed in a loop or a V), driven by any of its
      schedules (--schedule);
    - "tp": inside each stage, tp.py's plan cuts every block's matrices over T ranks;
    - "cp": each rank holds 1/C of every sequence (cp.py's chunks), its attention reaching the
      others' keys and values (--cp-method); the stages pass (B/(D M), S/C, H) activations,
      and the tokens' positions travel through the schedule with the micro-batches;
    - "dp": the D pipelines, each on its own 1/D of every batch; fully_shard shards the TP
      pieces over dp x cp together (each of those ranks holds tokens no other has).
    Per stage, in this order: TP's plan, then fully_shard, then a PipelineStage (each step
    says why at its line). With the same global batch the result equals one device: the tests
    prove it in float64 to 1e-9 on 8 ranks (2 x 2 x 2 of the four), for every schedule.

When to use it
    A model too big for FSDP alone on the machines you have, with more GPUs than TP can use
    inside one machine: TP 8 inside each machine, PP across a few of them, FSDP (dp) across
    the rest, as torchtitan and Megatron-LM train Llama-class models; CP too when one
    sequence's activations are too big for a stage's rank (long contexts). docs/planning.md
    sizes such layouts for Llama 3 8B and 70B on 8 to 512 GPUs, and 8B at 128K tokens.
When not
    Anything that fits with fewer dimensions: each adds its own communication and its own
    constraints (a bubble, batch and head counts to divide). Start from fsdp.py, add TP
    (tp.py) when the layers are too big, PP when the machines are too many.

Launch
    torchrun --nproc_per_node=8 nd.py --pp 2 --tp 2    # 2 stages x 2 shards x 2 TP ranks
    python nd.py --nproc 8 --pp 2 --tp 2 --schedule zbv --microbatches 4
    python nd.py                 # its own 4 workers on a CPU: 2 stages x 2 TP ranks, dp 1
    python nd.py --fp64 --nproc 8 --pp 2 --tp 2   # float64: within 1e-9 of single.py --fp64
    python nd.py --nproc 8 --pp 2 --cp 2 --tp 2 --cp-method ring   # each sequence in 2 pieces
    torchrun --nproc_per_node=4 nd.py --pp 1 --tp 1 --cp 2   # FSDP x CP: dp 2 x cp 2, no pipe
    # single.py's checkpoint file: resumes on another mesh, in pipeline.py or in single.py
    torchrun --nproc_per_node=8 nd.py --pp 2 --tp 2 --checkpoint ckpt.pt
    # 2 machines of 8 GPUs: TP inside each machine, the pipeline across them
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        nd.py --pp 2 --tp 8 --heads 8
    Smallest hardware: any CPU (4 processes over gloo share its cores, 8 for three
    dimensions, 16 for all four). On GPUs (nd.py has not run on one yet): NCCL, one GPU per
    rank, every TP group inside one machine (the mesh's last dimension), CP beside it.

What is added to the pipeline
    diff pipeline.py nd.py: the mesh, then per stage tp.py's plan and FSDP (tp.parallelize)
    and cp.py's attention before the PipelineStage; the orders are said at their lines, with
    the error each other order gives. Built on "meta", filled from rank 0's CPU, a checkpoint
    gathered back to it a tensor at a time: a device holds its pieces and one whole tensor
    (docs/memory.md).

Docs
    https://pytorch.org/docs/stable/distributed.pipelining.html
    https://pytorch.org/docs/stable/distributed.tensor.parallel.html
    https://github.com/pytorch/torchtitan (the same composition, at scale)
    docs/long-sequences.md (CP, FSDP x CP, and CP inside this mesh)
Tested with torch 2.10.0 (the oldest that requirements.txt admits), 2.13.0 and 2.15.0, on CPU/gloo.
"""

import datetime
import itertools
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.profiler import record_function
from torch.utils.data import DataLoader, DistributedSampler

from common import (BOS, SEQ_LEN, VOCAB, SimpleModel, documents, loss_fn, make_dataset,
                    seed_everything)
from plumbing.buffers import fill_buffers
from plumbing.checkpoints import gather_full_state, named_adam, read_checkpoint, save_atomic
from plumbing.checkpoints import train_state
from plumbing.flags import check_shared_flags, compile_and_checkpoint, launch_world, positive
from plumbing.flags import check_tp, shared_parser
from plumbing.meter import Meter, Profiler, eval_line, held_bytes, log_line, print0
from plumbing.model_check import check_model
from plumbing.ranks import fail, launch
from pipeline import SCHEDULES, check_stages, cut, on, placement  # the pipeline's pieces
from tp import parallelize  # TP's plan, then fully_shard over "dp_cp": tp.py's 2D, per stage
from cp import cut_sequences, token_positions  # attention across the CP group (cp.py)


def parse_args(argv=None):
    parser = shared_parser(__doc__, accum=False, ranks=True, moe=False,
                           nproc_help="workers to start without torchrun (default: --pp x "
                                      "--cp x --tp)")
    hardware, pipe = parser.groups["hardware"], parser.add_argument_group("pipeline")
    hardware.add_argument("--pp", type=positive(int), default=2, help="pipeline ranks")
    hardware.add_argument("--tp", type=positive(int), default=2, help="ranks per TP group")
    hardware.add_argument("--cp", type=positive(int), default=1, help="ranks per context-"
                          "parallel group, each with 1/CP of every sequence (cp.py)")
    hardware.add_argument("--cp-method", choices=["allgather", "ring", "ulysses"],
                          default="allgather", help="how attention reaches the other CP ranks' "
                          "tokens (cp.py's)")
    pipe.add_argument("--microbatches", type=positive(int), default=None,
                      help="micro-batches per step, the pipeline's accumulation (default 4)")
    pipe.add_argument("--schedule", choices=list(SCHEDULES), default=None,
                      help="the pipeline's schedule (default gpipe; docs/pipeline.md)")
    pipe.add_argument("--stages-per-rank", type=positive(int), default=None,
                      help="virtual stages per pipeline rank (default: 1 for gpipe and 1f1b, "
                           "else 2)")
    parser.set_defaults(stages=None)  # pipeline.check_stages sets it: --pp x --stages-per-rank
    args = parser.parse_args(argv)
    check_shared_flags(parser, args)  # and their checks: one line that names the fix
    # torchrun's ranks, or the --nproc workers started here (default: --pp x --cp x --tp)
    args.nproc = args.nproc or args.pp * args.cp * args.tp
    world_size, local_world, gpus = launch_world(parser, args, data_parallel=False)
    # pipeline.py's: schedule, stages, micro-batches; --pp 1 runs a schedule of one stage
    check_stages(parser, args, args.pp, gpus, scheduled=True)
    check_mesh(parser, args, world_size, local_world)
    check_model(parser, args, cut=cut)  # and the model: what would train silently wrong, refused
    return args


def check_mesh(parser, args, world_size, local_world):
    """The mesh (pp, dp, cp, tp): each a divisor of what it cuts, TP inside a machine."""
    model_ranks = args.pp * args.cp * args.tp  # one pipeline's ranks; dp is the rest
    if world_size % model_ranks:
        parser.error(f"--pp {args.pp} x --cp {args.cp} x --tp {args.tp} must divide the world "
                     f"size {world_size} (dp is the rest); use {model_ranks} ranks or a multiple")
    check_tp(parser, args, local_world)  # as tp.py: T divides the heads and a machine's ranks
    if SEQ_LEN % (2 * args.cp):  # as cp.py: each CP rank takes 2 of 2C equal chunks
        parser.error(f"--cp {args.cp}: the sequence length {SEQ_LEN} must cut into 2 x --cp "
                     f"equal chunks; use a --cp that divides {SEQ_LEN // 2}")
    dp = world_size // model_ranks
    if args.batch_size % (dp * args.microbatches):
        parser.error(f"--batch-size {args.batch_size} must be divisible by the {dp} "
                     f"pipeline(s) (dp) x --microbatches {args.microbatches}; use a multiple "
                     f"of {dp * args.microbatches}")


def setup(args):
    """Join the process group; return this process's rank, the world size and its device."""
    rank = int(os.environ["RANK"])  # its place in the mesh
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
    dp = world_size // (args.pp * args.cp * args.tp)
    print0(f"nd: {world_size} ranks = {args.pp} (pp) x {dp} (dp) x {args.cp} (cp, "
           f"{args.cp_method}) x {args.tp} (tp) | schedule {args.schedule}, {args.stages} stages, "
           f"{args.microbatches} micro-batches | backend {args.backend} | device {device.type} | "
           f"torch {torch.__version__}")
    return rank, world_size, device


def make_mesh(args, world_size, device):
    """The mesh, (pp, dp, cp, tp) row-major, its dimensions named, and the same ranks as
    (pp, dp_cp, tp), FSDP's view; refused in one line if a TP group would span machines."""
    # --- N-D: one mesh; its last dimensions' ranks are consecutive, on one machine ---
    # Row-major: a TP group is T consecutive ranks, which torchrun puts on one machine; a CP
    # group's C ranks are T apart, within C x T consecutive ones (on one machine when C x T fits
    # in it: K and V cross the group in every block, forward and backward); a pipeline's stages
    # are dp x cp x tp ranks apart, across machines. The other order, tp first, would put TP's
    # all-reduces, two per block each way, on the network.
    dp = world_size // (args.pp * args.cp * args.tp)
    mesh = init_device_mesh(device.type, (args.pp, dp, args.cp, args.tp),
                            mesh_dim_names=("pp", "dp", "cp", "tp"))
    # FSDP shards over the data and context ranks as one dimension (each holds tokens no other
    # does). torch has no public way to merge two dimensions of a mesh (torchtitan calls the
    # private DeviceMesh._flatten): the same ranks again, as (pp, dp x cp, tp). Row-major too:
    # rank ((p D + d) C + c) T + t sits at (p, d C + c, t), so each group is the same ranks.
    shards = init_device_mesh(device.type, (args.pp, dp * args.cp, args.tp),
                              mesh_dim_names=("pp", "dp_cp", "tp"))
    # torchrun numbers ranks machine by machine: a group whose ranks // the ranks per machine
    # differ spans machines. Checked on the mesh TP runs on: a mesh's shape cannot tell its order.
    per_machine = int(os.environ["LOCAL_WORLD_SIZE"])
    group = shards["tp"].mesh.flatten().tolist()
    if len({r // per_machine for r in group}) > 1:
        fail(f"nd.py: error: the TP group {group} spans machines of {per_machine} ranks: "
             "build the mesh with \"tp\" last, (pp, dp, cp, tp), so its ranks are consecutive")
    # --- end ---
    return mesh, shards


def evaluate(stages, owner, mesh, shards, dataset, batch_size, hidden, dtype, positions,
             packed):
    """The mean cross-entropy per token over the whole held-out set, the same on every rank:
    each pipeline ("dp") on its shard, forward only, stage by stage (pipeline.py's way); each
    rank of a CP group on its `positions` of every sequence."""
    device = positions.device
    for stage_module in stages:
        stage_module.eval()  # no dropout or BatchNorm here, but the model you copy this to may
    pp, dp = mesh.get_group("pp"), mesh.get_group("dp")
    me, dp_rank, dp_size = mesh.get_local_rank("pp"), mesh.get_local_rank("dp"), dp.size()
    # Without drop_last, DistributedSampler pads the shards to one length with duplicates:
    # a pipeline's real samples are its first len(range(rank, n, N)) (docs/traps.md#padding).
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    real = len(range(dp_rank, len(dataset), dp_size))
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # token losses, tokens
    with torch.no_grad():  # no graph, no activations kept: evaluation needs far less memory
        for x, y in loader:
            # Forwarded whole, then cut (the last could be empty); CP: this rank's tokens
            docs = documents(x.to(device), BOS)[:, positions] if packed else None  # before the cut
            x, y = x.to(device)[:, positions], y[:real].to(device)[:, positions]
            real -= len(y)
            mine = iter(stages)
            for i in (i for i, r in enumerate(owner) if r == me):
                stage_module = next(mine)
                # --- N-D: along "pp" by hand, as pipeline.py; TP's collectives inside ---
                if i > 0 and owner[i - 1] != me:  # (batch, sequence, hidden) from before
                    x = torch.empty(*x.shape[:2], hidden, device=device, dtype=dtype)
                    dist.recv(x, src=dist.get_global_rank(pp, owner[i - 1]), group=pp)
                x = stage_module(x, positions=positions, **on(device, docs))  # (stage 0 reads them)
                if i + 1 < len(owner) and owner[i + 1] != me:
                    dist.send(x.contiguous(), dst=dist.get_global_rank(pp, owner[i + 1]),
                              group=pp)
                # --- end ---
            if owner[-1] == me:  # only the last stage has outputs to score
                sums[0] += loss_fn(x[:len(y)], y, reduction="sum")
                sums[1] += (y != -100).sum()  # the targets that count: cross_entropy skips -100s
    # Over "dp_cp" (the pipelines' shards, each CP rank's tokens), then "pp" (to the stages
    # without the loss); the T ranks of a TP group hold the same sums.
    dist.all_reduce(sums, group=shards.get_group("dp_cp"))
    dist.all_reduce(sums, group=pp)
    for stage_module in stages:  # free the weights FSDP's roots keep for no backward
        for module in stage_module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        stage_module.train()
    return (sums[0] / sums[1]).item()


def train(args, rank, world_size, device):
    """Train; return the full model's weights (on rank 0, with --save), the final loss and the
    final validation loss."""
    # --fp64: in float64 a correct strategy ends within 1e-9 of one device, where fp32's
    # rounding, amplified by Adam, can part them (docs/drift.md). Built in fp32, then cast.
    dtype = torch.float64 if args.fp64 else torch.float32
    # On "meta": shapes, no storage; every rank knows every stage's names and shapes for free.
    with torch.device("meta"):
        model = SimpleModel.from_args(args).to(dtype)
    # Every rank reads the file, one device's, checked; mmap: a rank reads only its pages
    state = read_checkpoint(args, __file__, mmap=True) if args.checkpoint else None
    mesh, shards = make_mesh(args, world_size, device)
    dp = mesh["dp"].size()
    owner = placement(args, args.pp)  # stage i's "pp" rank: a loop, or a V (pipeline.py)
    held = [i for i, r in enumerate(owner) if r == mesh.get_local_rank("pp")]
    # --- N-D: each stage cut, TP over "tp", FSDP over "dp_cp", CP over "cp", then the pipe ---
    # TP before fully_shard (tp.parallelize does both): the other order fails, "Cannot
    # distribute a DTensor with device mesh ...". Both before the PipelineStage (it takes the
    # stage as it will run) and the optimizer (it must hold the sharded parameters). A stage is
    # one FSDP unit (shard_blocks=False), gathered whole while it runs: block by block, the
    # zero-bubble schedules left the later stages' block gradients None (docs/pipeline.md).
    stages = []
    for i in held:
        part = cut(model, i, args.stages)
        compile_and_checkpoint(part.blocks.values(), args)  # per block, before any wrapper
        stages.append(parallelize(part, shards, shard_blocks=False, shard_over="dp_cp"))
        part.to_empty(device=device)  # storage for this rank's pieces only, uninitialized
        if args.cp > 1:  # CP: each block's attention across "cp" (cp.py's)
            cut_sequences(part, mesh, args.cp_method)
    positions = token_positions(mesh.get_local_rank("cp"), args.cp)  # this rank's tokens
    where = positions.to(device)  # on the device too: the position embedding's input
    full = one = None  # rank 0's CPU only: one device's model (--seed), its weights or the file's
    if rank == 0:
        seed_everything(args.seed)
        one = SimpleModel.from_args(args).to(dtype)
        full = state["model"] if state is not None else one.state_dict()
    # Rank 0's tensors to all ranks, a call per j-th stage of each; not strict: others' keys too.
    for j, part in enumerate(stages):
        slot = [i for i in range(len(owner)) if owner[:i].count(owner[i]) == j]
        names = {name for i in slot for name in cut(model, i, len(owner)).state_dict()}
        set_model_state_dict(part, {name: full[name] for name in names} if full else {},
                             options=StateDictOptions(full_state_dict=True,
                                                      broadcast_from_rank0=True, strict=False))
    fill_buffers(stages, one, device, full=model)  # what no state_dict holds (fsdp.py says why)
    del full, one  # rank 0's copy: each stage holds its pieces now
    # A PipelineStage talks along "pp" only (group=): its neighbours are the ranks with the same
    # dp, cp and tp coordinates. Each micro-batch is 1/(dp M) of the global batch, and 1/C of
    # each sequence: left at SEQ_LEN, gloo takes the larger buffer, and the run dies later.
    shape = (args.batch_size // (dp * args.microbatches), SEQ_LEN // args.cp)
    last = args.stages - 1
    pipe = [PipelineStage(
        part, i, args.stages, device, group=mesh.get_group("pp"),
        input_args=torch.empty(shape, device="meta", dtype=torch.long) if i == 0 else
        torch.empty(*shape, args.hidden, device="meta", dtype=dtype, requires_grad=True),
        output_args=torch.empty(*shape, VOCAB if i == last else args.hidden, device="meta",
                                dtype=dtype, requires_grad=True))
        for i, part in zip(held, stages)]
    # A micro-batch's loss: its summed loss x M x D x C / N, N the step's count of targets that
    # count over every pipeline and CP piece (the loop sets `tokens`). scale_grads divides the
    # M backwards' sum by M, and FSDP averages over "dp_cp", D x C ranks: one device's
    # gradient. The stage keeps FSDP from reducing until the last micro-batch, then runs its
    # reduce, before scale_grads.
    schedule_class, per_rank, _ = SCHEDULES[args.schedule]
    tokens = torch.ones((), dtype=torch.int64, device=device)  # the step's N, set in the loop
    spread = args.microbatches * shards["dp_cp"].size()  # M x D x C

    def micro_loss(output, target):
        return loss_fn(output, target, reduction="sum") * spread / tokens

    schedule = schedule_class(pipe[0] if per_rank == 1 else pipe, scale_grads=True,
                              n_microbatches=args.microbatches, loss_fn=micro_loss)
    is_first, is_last = 0 in held, last in held
    # After the cut, TP and FSDP. One Adam per stage (together one device's Adam): the
    # state-dict API below names one module's parameters, and each stage is a module.
    params = [p for part in stages for p in part.parameters()]
    optimizers = [torch.optim.Adam(part.parameters(), lr=args.lr) for part in stages]
    # --- end ---
    start_step = 0
    if state is not None:
        # Each stage's pieces of the file's Adam state (one device's), keyed by parameter
        # name: set_optimizer_state_dict cuts each as its parameter is cut (tp, then dp_cp).
        for part, optimizer in zip(stages, optimizers):
            full = named_adam(state["optimizer"], args, part)
            set_optimizer_state_dict(part, optimizer, full,
                                     options=StateDictOptions(full_state_dict=True))
        start_step = state["step"]
        print0(f"resumed from {args.checkpoint} at step {start_step}")

    dataset, val_set = make_dataset("train", args.data), make_dataset("val", args.data)
    # Every rank of a pipeline (pp x cp x tp) walks the same batches: dealt over "dp" only (over
    # dp x cp, a CP group would cut different samples); each CP rank keeps its tokens of them.
    sampler = DistributedSampler(dataset, num_replicas=dp, rank=mesh.get_local_rank("dp"),
                                 shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size // dp, sampler=sampler,
                        drop_last=True)
    steps_per_epoch = len(loader)

    meter = Meter(device)
    profiler = Profiler(args.profile, rank, device)  # does nothing without --profile
    final_loss = val_loss = float("nan")
    for step in range(start_step, args.steps):
        epoch, index = divmod(step, steps_per_epoch)
        if index == 0 or step == start_step:
            sampler.set_epoch(epoch)  # else every epoch replays epoch 0's order
            # A resumed run skips the part of the epoch that was trained before the stop.
            batches = itertools.islice(loader, index, None)
        x, y = next(batches)
        # Packed: where each token's document begins, read from the whole sequence
        docs = documents(x, BOS)[:, positions] if args.data == "packed" else None
        x, y = x[:, positions], y[:, positions]  # CP: this rank's tokens of each sequence
        # The global count: one all-reduce of an integer a step, over the pipelines and pieces
        tokens.fill_((y != -100).sum())  # cross_entropy skips -100s (a prompt's, padding)
        dist.all_reduce(tokens, group=shards.get_group("dp_cp"))
        # --- Pipeline parallelism: one call runs the schedule, along "pp" ---
        losses = []
        inputs = [x.to(device)] if is_first else []
        targets = dict(target=y.to(device), losses=losses) if is_last else {}
        # CP: where each token sits in its sequence, a keyword cut into micro-batches with x;
        # left out, the first stage would embed every piece at positions 0..S/C-1, silently.
        schedule.step(*inputs, **targets, positions=where.expand(len(x), -1), **on(device, docs))
        loss = (torch.stack(losses).mean().detach() if is_last
                else torch.zeros((), device=device, dtype=dtype))
        # --- end ---
        with record_function("optimizer step"):
            # --- N-D: --clip by the norm of the whole gradient, over every dimension ---
            # The DTensors' norm covers "dp_cp" and "tp" (their squares summed over the stage's
            # ranks); the stages' squares are then added up over "pp". Clipped per stage, or
            # per TP group, each part would be scaled by a factor of its own.
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params]).full_tensor()
            grad_norm = grad_norm.square()
            dist.all_reduce(grad_norm, group=mesh.get_group("pp"))
            grad_norm = grad_norm.sqrt()
            torch.nn.utils.clip_grads_with_norm_(params, args.clip or float("inf"), grad_norm)
            # --- end ---
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        samples_per_s = meter.step(args.batch_size)
        profiler.step()

        if step == 0 or (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            # The last stage's loss, averaged over the pipelines and CP's pieces, to every rank
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=shards.get_group("dp_cp"))
            dist.all_reduce(loss, group=mesh.get_group("pp"))
            final_loss = loss.item()
            print0(log_line(step + 1, args.steps, final_loss, grad_norm.item(), samples_per_s))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            with meter.paused(), record_function("evaluation"):
                val_loss = evaluate(stages, owner, mesh, shards, val_set, args.batch_size // dp,
                                    args.hidden, dtype, where, args.data == "packed")
            print0(eval_line(step + 1, args.steps, val_loss))
        if args.checkpoint and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
            # Rank 0 gathers single.py's file: it resumes on any mesh, or in single.py.
            with meter.paused():
                # --- N-D: one whole tensor at a time on a device ---
                # Not get_state_dict(full_state_dict=True): a stage and its moments whole on
                # each rank's device (cpu_offload=True keeps them on global rank 0 only: other
                # stages' senders get none). gather_full_state makes each DTensor whole by
                # full_tensor() (an all-gather over its stage's dp x cp x tp ranks), the stage's
                # first rank sends it to rank 0, into its CPU, and it is freed before the next.
                weights, adam = gather_full_state(args, list(zip(stages, optimizers)))
                # --- end ---
                if rank == 0:
                    save_checkpoint(args, weights, adam, step + 1)
    profiler.stop()
    print0(meter.summary(final_loss, model, val_loss=val_loss, state_bytes=sum(
        held_bytes(part, optimizer) for part, optimizer in zip(stages, optimizers))))
    weights = gather_full_state(args, [(s, None) for s in stages])[0] if args.save else None
    return weights, final_loss, val_loss


def save_checkpoint(args, weights, adam, step):
    """Everything needed to continue exactly where this run is: the data position is a
    function of (seed, step, global batch) only, so those three are all it needs besides the
    weights and Adam's state."""
    save_atomic({"model": weights, "optimizer": adam,
                 **train_state(args, step)}, args.checkpoint)
    print(f"checkpoint: step {step} -> {args.checkpoint}", flush=True)


def run(args):
    """What each process does: set up, train, save."""
    rank, world_size, device = setup(args)
    weights, _, _ = train(args, rank, world_size, device)
    if args.save and rank == 0:
        # Reassembled from every stage: SimpleModel's own keys, so it loads with strict=True.
        save_atomic(weights, args.save)  # CPU tensors: loads anywhere
    dist.destroy_process_group()  # on a clean exit only: after an error, peers may hang


def main(argv=None):
    args = parse_args(argv)
    launch(run, args)  # one rank under torchrun, else --nproc of them started here


if __name__ == "__main__":
    main()
