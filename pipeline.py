"""Pipeline parallelism and model parallelism: cut SimpleModel into stages, one per device.

What it teaches
    When a model does not fit on one device, cut its layers into consecutive stages and put
    each stage on its own device. Two ways, one file:
    - `python pipeline.py` or `torchrun --nproc_per_node=2 pipeline.py`: pipeline parallelism
      with torch.distributed.pipelining. One process per stage; the batch is cut into
      micro-batches that flow through the stages like an assembly line, so the stages work
      at the same time on different micro-batches. Idle time shrinks to the "bubble" below.
    - `python pipeline.py --nproc 1`: model parallelism in one process. Activations travel
      from stage to stage inside forward (`x.to(next_device)`), and autograd carries the
      gradients back. Only one stage works at a time, so with S stages each GPU idles (S-1)/S
      of the time.
    Both end with the same weights as one device with the same global batch (tests/), and
    write the same checkpoint as single.py: it resumes on any number of stages, or in single.py.
    (`Pipe`, in many older guides, is gone since PyTorch 2.4: docs/torch-versions.md.)

    Schedules (--schedule; drawn and measured in docs/pipeline.md): gpipe runs all forwards,
    then all backwards; 1f1b each backward as soon as it can, holding p micro-batches of
    activations, not m. Each idles (p-1)/(m+p-1) of a step (the "bubble"; p stages, m
    micro-batches). interleaved-1f1b runs V stages per rank (--stages-per-rank) in a loop:
    a V times smaller bubble, for V times the sends. zero-bubble cuts each backward in two,
    the inputs' gradient, which the stage before waits for, and the weights', which fills the
    bubble. zbv and dualpipev run 2 stages per rank in a V.

When to use it
    The model (with its optimizer state) does not fit on one device, and its layers can be cut
    into a chain. Pipelining also spans machines with slow links well: only activations at the
    cuts travel, not all the gradients.
When not
    The model fits on one device: ddp.py is simpler and faster (no bubble). Within one machine
    with fast links, sharding (FSDP) is often the easier way to fit a large model.

Launch
    python pipeline.py                         # starts its stages: one per GPU, or 2 on a CPU
    torchrun --nproc_per_node=2 pipeline.py    # what clusters use; same flags after the script
    torchrun --nproc_per_node=3 pipeline.py --schedule 1f1b --microbatches 6 --batch-size 60
    python pipeline.py --nproc 1 --stages 2    # model parallel: one process drives 2 stages
    python pipeline.py --fp64                  # float64: within 1e-9 of single.py --fp64
    # survive a crash: torchrun restarts the group, which resumes from the checkpoint
    torchrun --nproc_per_node=2 --max-restarts=3 pipeline.py --checkpoint ckpt.pt
    Smallest hardware: any CPU (stages share it; pipeline ranks talk over gloo).

What changes from data parallelism
    Most of ddp.py (the micro-batches replace its accumulation, the stages its replicas): read
    this file top to bottom, as lesson 6 of docs/course.md guides it.

Docs
    https://pytorch.org/docs/stable/distributed.pipelining.html
    https://pytorch.org/tutorials/intermediate/pipelining_tutorial.html
Tested with torch 2.10.0 (the oldest that requirements.txt admits), 2.13.0 and 2.15.0, on CPU/gloo.
"""

import copy
import datetime
import itertools
import os

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV,
                                          ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
from torch.profiler import record_function
from torch.utils.data import DataLoader, RandomSampler

from common import (BOS, SEQ_LEN, VOCAB, SimpleModel, documents, loss_fn, make_dataset,
                    seed_everything)
from plumbing.checkpoints import gather_full_state, optimizer_share, read_checkpoint
from plumbing.checkpoints import save_atomic, train_state
from plumbing.compile import torch_older_than
from plumbing.flags import check_shared_flags, compile_and_checkpoint, launch_world, positive
from plumbing.flags import shared_parser
from plumbing.meter import Meter, Profiler, eval_line, log_line, print0
from plumbing.model_check import check_model
from plumbing.ranks import launch

# --schedule: (torch's class, its stages per rank by default, placed in a V: docs/pipeline.md)
SCHEDULES = {"gpipe": (ScheduleGPipe, 1, False), "1f1b": (Schedule1F1B, 1, False),
             "interleaved-1f1b": (ScheduleInterleaved1F1B, 2, False),
             "zero-bubble": (ScheduleInterleavedZeroBubble, 2, False),
             "zbv": (ScheduleZBVZeroBubble, 2, True), "dualpipev": (ScheduleDualPipeV, 2, True)}


def parse_args(argv=None):
    parser = shared_parser(__doc__, accum=False, ranks=True, moe=False)  # the shared flags
    pipe = parser.add_argument_group("pipeline")
    pipe.add_argument("--stages", type=positive(int), default=None, help="stages of --nproc 1 "
                      "(model parallelism; default: one per GPU, or 2); else one per rank")
    pipe.add_argument("--microbatches", type=positive(int), default=None,
                      help="micro-batches per step, the pipeline's accumulation (default 4)")
    pipe.add_argument("--schedule", choices=list(SCHEDULES), default=None,
                      help="order of the micro-batches' forwards and backwards (default gpipe)")
    pipe.add_argument("--stages-per-rank", type=positive(int), default=None, help="virtual "
                      "stages per rank (default: 1 for gpipe and 1f1b, else 2)")
    args = parser.parse_args(argv)
    check_shared_flags(parser, args)  # and their checks: one line that names the fix
    # torchrun's ranks, or the --nproc workers started here: a stage each
    world_size, _, gpus = launch_world(parser, args, data_parallel=False, stages=True)
    check_stages(parser, args, world_size, gpus)
    check_model(parser, args, cut=cut)  # and the model: what would train silently wrong, refused
    return args


def check_stages(parser, args, world_size, gpus, scheduled=False):
    """One process driving every stage (model parallelism), or one stage per rank: its checks.
    scheduled: one rank runs a schedule too (nd.py --pp 1, the data and context ranks around it)."""
    if world_size == 1 and not scheduled:  # no schedule to ask for
        for flag, value in (("--microbatches", args.microbatches), ("--schedule", args.schedule),
                            ("--stages-per-rank", args.stages_per_rank)):
            if value is not None:
                parser.error(f"{flag}: one process (model parallelism) runs no pipeline "
                             "schedule; drop it, or run the stages on 2 or more ranks")
        args.stages = args.stages or min(max(gpus, 2), args.blocks)
    elif args.stages is not None:
        parser.error(f"--stages {args.stages}: with {world_size} ranks the stages are the ranks "
                     "x --stages-per-rank; drop --stages, or use --nproc 1 for stages in one "
                     "process")
    else:
        args.schedule, m = args.schedule or "gpipe", args.microbatches or 4
        _, per_rank, v_shaped = SCHEDULES[args.schedule]
        v = args.stages_per_rank = args.stages_per_rank or per_rank
        args.stages, args.microbatches, rounds = world_size * v, m, max(1, m // world_size)
        if (per_rank == 1 or v_shaped) and v != per_rank:
            parser.error(f"--stages-per-rank {v}: --schedule {args.schedule} runs {per_rank} "
                         "per rank; interleaved-1f1b and zero-bubble run any number")
        if args.batch_size % m:
            parser.error(f"--microbatches {m} must divide --batch-size {args.batch_size} "
                         "(micro-batches of equal size); pick a divisor")
        if args.schedule in ("1f1b", "dualpipev") and m < args.stages:
            parser.error(f"--schedule {args.schedule} needs --microbatches >= stages "
                         f"({args.stages}); use --microbatches {args.stages} or more")
        if per_rank > 1 and not v_shaped and m % rounds:  # rounds of one micro-batch per rank
            parser.error(f"--microbatches {m}: --schedule {args.schedule} runs rounds of "
                         f"{world_size} (the ranks); use {world_size * rounds}")
        if v_shaped and not gpus and torch_older_than(2, 12):  # gloo 2.10, 2.11 (NCCL: unmeasured)
            parser.error(f"--schedule {args.schedule}: the gloo of torch {torch.__version__} "
                         "cannot send to its own rank, as a V's two stages on one rank do at "
                         "start; use torch 2.12 or later, or interleaved-1f1b")
        if args.compile and args.schedule in ("zero-bubble", "zbv", "dualpipev"):
            parser.error(f"--compile: --schedule {args.schedule} splits each backward in two, "
                         "which torch.compile does not support; use interleaved-1f1b")
    if args.stages > args.blocks:  # each stage holds a block (and the ends)
        parser.error(f"{args.stages} stages but --blocks {args.blocks}: every stage needs a "
                     f"block; use --blocks {args.stages} or more, or fewer stages")


def setup(args):
    """Join the process group; return this process's rank, the world size and the device of
    every stage it drives (one, unless it is the only process)."""
    rank = int(os.environ["RANK"])  # which stage this process runs
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
    if world_size > 1:
        print0(f"pipeline: {world_size} ranks x {args.stages_per_rank} stages | schedule "
               f"{args.schedule} | {args.microbatches} micro-batches | backend {args.backend} | "
               f"device {device.type} | torch {torch.__version__}")
        return rank, world_size, [device]
    # The only process: model parallelism, the stages on devices of their own where it can.
    gpus = torch.cuda.device_count() if use_cuda else 0
    devices = [torch.device("cuda", i % gpus) if gpus else device for i in range(args.stages)]
    print(f"pipeline: model parallel | {args.stages} stages on {', '.join(map(str, devices))} | "
          f"torch {torch.__version__}", flush=True)
    if len(set(devices)) < len(devices):
        print("pipeline: fewer devices than stages, so stages share a device: the code "
              "path is the same, the memory relief is not", flush=True)
    return rank, world_size, devices


def cut(model, stage, stages):
    """Stage `stage` of `stages`: a copy of the model that keeps only its share of the blocks,
    plus the embeddings on the first stage and the final norm and output layer on the last.

    Deleting from a full copy keeps the full model's parameter names ("blocks.3.up.weight"),
    so the stages' state_dicts are slices of the full one and merge back by name.
    (A model too big for one device is built on "meta" and each stage materializes its part.)
    """
    part = copy.deepcopy(model)
    names = list(part.blocks.keys())
    mine = names[stage * len(names) // stages:(stage + 1) * len(names) // stages]
    for name in names:
        if name not in mine:
            del part.blocks[name]
    if stage != 0:
        part.embed = part.pos = None
    if stage != stages - 1:
        part.norm = part.output = None
    return part


def placement(args, world_size):
    """The rank of each stage: all in this process (model parallelism); else in a loop, rank r
    running stages r, r + W, ... (one each with gpipe and 1f1b); or in a V (zbv, dualpipev):
    rank r runs r and 2W - 1 - r, so the last stage, and the loss, sit with the first."""
    if world_size == 1:
        return [0] * args.stages
    if SCHEDULES[args.schedule][2]:
        return [min(i, 2 * world_size - 1 - i) for i in range(args.stages)]
    return [i % world_size for i in range(args.stages)]


def evaluate(stages, owner, dataset, rank, devices, batch_size, hidden, dtype, packed):
    """The mean cross-entropy per token over the whole held-out set, the same on every rank
    (a collective: forward only, stage by stage). `owner[i]`: the rank of stage i."""
    for stage_module in stages:
        stage_module.eval()  # no dropout or BatchNorm here, but the model you copy this to may
    loader = DataLoader(dataset, batch_size=batch_size)  # every rank: the same batches, in order
    sums = torch.zeros(2, dtype=torch.float64, device=devices[-1])  # token losses, tokens
    with torch.no_grad():  # no graph, no activations kept: evaluation needs far less memory
        for x, y in loader:
            # Packed: every stage's blocks keep the documents apart; read from the tokens
            docs = documents(x, BOS) if packed else None
            mine = iter(zip(stages, devices * len(stages)))  # this rank's, in order
            for i in (i for i, r in enumerate(owner) if r == rank):
                stage_module, device = next(mine)
                # --- Pipeline parallelism: forward only, activations handed on by hand ---
                # What a schedule does underneath, by plain send/recv. No micro-batches: with
                # no backward to overlap with, the stages simply work one after the other.
                if i > 0 and owner[i - 1] != rank:  # (batch, sequence, hidden) from before
                    x = torch.empty(*x.shape[:2], hidden, device=device, dtype=dtype)
                    dist.recv(x, src=owner[i - 1])
                x = stage_module(x.to(device), **on(device, docs))
                if i + 1 < len(owner) and owner[i + 1] != rank:
                    dist.send(x, dst=owner[i + 1])
                # --- end ---
            if owner[-1] != rank:
                continue  # only the last stage has outputs to score
            # Sums, divided once at the end: the mean of per-batch means would overweight a
            # smaller last batch.
            sums[0] += loss_fn(x, y.to(x.device), reduction="sum")
            sums[1] += (y != -100).sum()  # the targets that count: cross_entropy skips -100s
    if len(set(owner)) > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)  # the last stage's sums, to every rank
    for stage_module in stages:
        stage_module.train()
    return (sums[0] / sums[1]).item()


def train(args, rank, world_size, devices):
    """Train; return the full model's final weights (on rank 0, with --save), the final loss
    and the final validation loss."""
    # --fp64: in float64 a correct strategy ends within 1e-9 of one device, where fp32's
    # rounding, amplified by Adam, can part them (docs/drift.md). Built in fp32, then cast.
    dtype = torch.float64 if args.fp64 else torch.float32
    seed_everything(args.seed)  # every rank builds the same full model before cutting it
    model = SimpleModel.from_args(args).to(dtype)
    # Into the full model, before the cut: every stage then starts from its slice of the file.
    state = load_checkpoint(args, model) if args.checkpoint else None
    owner = placement(args, world_size)
    held = [i for i, r in enumerate(owner) if r == rank]  # this rank's stages, in order
    if world_size == 1:
        # --- Model parallelism: every stage in this process, each on its device ---
        stages = [cut(model, i, len(devices)).to(d) for i, d in enumerate(devices)]
        # --- end ---
    else:
        stages = [cut(model, i, args.stages).to(devices[0]) for i in held]  # this rank's only
    # --compile and --activation-checkpointing, per block, before any wrapper
    compile_and_checkpoint([block for stage_module in stages
                            for block in stage_module.blocks.values()], args)
    if world_size > 1:
        # --- Pipeline parallelism: this rank's stage, and the schedule that drives it ---
        device = devices[0]
        # PipelineStage knows its neighbours by stage index. Told one micro-batch's input and
        # output (on "meta": shapes only; in the run's dtype, which sizes the buffers), it need
        # not infer them by sending pickled objects between stages (docs/torch-versions.md).
        # Stage 0 takes token ids; the stages hand on (micro-batch, sequence, hidden), whose
        # gradient goes back (requires_grad); the last returns logits.
        shape, last = (args.batch_size // args.microbatches, SEQ_LEN), args.stages - 1
        pipe = [PipelineStage(
            part, i, args.stages, device,
            input_args=torch.empty(shape, device="meta", dtype=torch.long) if i == 0 else
            torch.empty(*shape, args.hidden, device="meta", dtype=dtype, requires_grad=True),
            output_args=torch.empty(*shape, VOCAB if i == last else args.hidden,
                                    device="meta", dtype=dtype, requires_grad=True))
            for i, part in zip(held, stages)]
        # The loss runs on the last stage, once per micro-batch: its summed loss over N/M, N the
        # step's count of targets that count (the loop sets `tokens`). scale_grads=True (the
        # default, spelled out) divides the M backwards' sum by M after the last: one device's
        # gradient, however the counts fall between the micro-batches. (A micro-batch's mean
        # would weigh a short one like a long one; divided by M twice, M times too small.)
        # The zero-bubble schedules cut each backward in two, the inputs' gradient first (the
        # previous stage waits for it), the weights' later, by autograd.grad on the stage: a
        # wrapper's gradient hooks (DDP's, FSDP's) may not fire as in one backward.
        schedule_class, per_rank, _ = SCHEDULES[args.schedule]
        tokens = torch.ones((), dtype=torch.int64)  # the step's N, set in the loop

        def micro_loss(output, target):
            return loss_fn(output, target, reduction="sum") * args.microbatches / tokens

        schedule = schedule_class(pipe[0] if per_rank == 1 else pipe, scale_grads=True,
                                  n_microbatches=args.microbatches, loss_fn=micro_loss)
        is_first, is_last = 0 in held, last in held  # a V puts both on rank 0
        # --- end ---
    # Each stage's optimizer sees only its own parameters; together they are one Adam.
    optimizer = torch.optim.Adam([p for s in stages for p in s.parameters()], lr=args.lr)
    start_step = 0
    if state is not None:
        # This rank's share of the file's Adam state, numbered as its own optimizer numbers it
        optimizer.load_state_dict(optimizer_share(
            state["optimizer"], args, [name for s in stages for name, _ in s.named_parameters()]))
        start_step = state["step"]
        print0(f"resumed from {args.checkpoint} at step {start_step}")

    dataset, val_set = make_dataset("train", args.data), make_dataset("val", args.data)
    # Every rank walks through the same global batches (the first stage needs the inputs, the
    # last the targets), in single.py's order: the permutation drawn from seed + epoch.
    generator = torch.Generator()
    sampler = RandomSampler(dataset, generator=generator)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    steps_per_epoch = len(loader)

    meter = Meter(devices)  # every stage's device: the clock waits for all of them
    profiler = Profiler(args.profile, rank, devices)  # does nothing without --profile
    final_loss = val_loss = float("nan")
    for step in range(start_step, args.steps):
        epoch, index = divmod(step, steps_per_epoch)
        if index == 0 or step == start_step:
            generator.manual_seed(args.seed + epoch)
            # A resumed run skips the part of the epoch that was trained before the stop.
            batches = itertools.islice(loader, index, None)
        x, y = next(batches)
        # Packed: where each token's document begins, for every stage's attention
        docs = documents(x, BOS) if args.data == "packed" else None
        if world_size == 1:
            # --- Model parallelism: hand the activations from device to device ---
            # While one stage computes, the others wait: nothing overlaps.
            with record_function("forward"):
                for stage_module, device in zip(stages, devices):
                    x = stage_module(x.to(device), **on(device, docs))
                loss = loss_fn(x, y.to(x.device))
            with record_function("backward"):
                loss.backward()  # autograd follows the .to() calls back across the devices
            loss = loss.detach()
            # --- end ---
        else:
            # --- Pipeline parallelism: one call runs the whole schedule ---
            # Micro-batches, every forward and backward in the schedule's order, sent on.
            losses = []  # (the schedule marks each micro-batch's "Forward i", "Backward i")
            # Every rank holds the whole batch: the count is read from it, no communication.
            tokens.fill_((y != -100).sum())  # cross_entropy skips -100s (a prompt's, padding)
            # The first stage's rank feeds the inputs, the last stage's the targets.
            inputs = [x.to(device)] if is_first else []
            targets = dict(target=y.to(device), losses=losses) if is_last else {}
            # Keywords go to every stage, cut into the micro-batches as the inputs are
            schedule.step(*inputs, **targets, **on(device, docs))
            # Each is its sum x M / N: their mean is the whole batch's loss.
            loss = (torch.stack(losses).mean().detach() if is_last
                    else torch.zeros((), device=device, dtype=dtype))
            # --- end ---
        with record_function("optimizer step"):
            # --clip. A stage's own norm is of a part of the gradient (clip_grad_norm_ on it
            # would clip each stage by its own factor): the stages' squared norms, added up
            # over the pipeline (as torchtitan does), make the whole one.
            params = [p for s in stages for p in s.parameters()]
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            if world_size > 1:
                grad_norm = grad_norm.square()
                dist.all_reduce(grad_norm)
                grad_norm = grad_norm.sqrt()
            torch.nn.utils.clip_grads_with_norm_(params, args.clip or float("inf"), grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        samples_per_s = meter.step(args.batch_size)
        profiler.step()

        if step == 0 or (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            if world_size > 1:
                # Only the last stage knows the loss; this collective brings it to rank 0,
                # so every rank must reach it at the same steps.
                dist.all_reduce(loss, op=dist.ReduceOp.SUM)
            final_loss = loss.item()
            print0(log_line(step + 1, args.steps, final_loss, grad_norm.item(),
                        samples_per_s))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            # every rank, at the same steps: it sends and receives
            with meter.paused(), record_function("evaluation"):
                val_loss = evaluate(stages, owner, val_set, rank, devices, args.batch_size,
                                    args.hidden, dtype, args.data == "packed")
            print0(eval_line(step + 1, args.steps, val_loss))
        if args.checkpoint and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
            # Every rank sends its slice of the weights and of Adam's state to rank 0, which
            # writes single.py's file: it resumes on any number of stages, or in single.py.
            weights, adam = gather_full_state(args, [(s, optimizer) for s in stages])
            if rank == 0:
                save_checkpoint(args, weights, adam, step + 1)
    profiler.stop()
    print0(meter.summary(final_loss, model, val_loss=val_loss))
    weights = gather_full_state(args, [(s, None) for s in stages])[0] if args.save else None
    return weights, final_loss, val_loss


def on(device, docs):
    """A stage's keywords: `docs` on its device, packed; none unpacked (your model's too)."""
    return {} if docs is None else {"docs": docs.to(device)}


def save_checkpoint(args, weights, adam, step):
    """Everything needed to continue exactly where this run is: the data position is a
    function of (seed, step, global batch) only, so those three are all it needs besides the
    weights and Adam's state."""
    save_atomic({"model": weights, "optimizer": adam,
                 **train_state(args, step)}, args.checkpoint)
    print(f"checkpoint: step {step} -> {args.checkpoint}", flush=True)


def load_checkpoint(args, model):
    """Read --checkpoint into the model if it exists (return its state, or None if there is
    none); a bad one stops with one line and is left as it was."""
    state = read_checkpoint(args, __file__)  # torch.load(weights_only=True), checked; or None
    if state is not None:
        model.load_state_dict(state["model"])
    return state


def run(args):
    """What each process does: set up, train, save."""
    rank, world_size, devices = setup(args)
    weights, _, _ = train(args, rank, world_size, devices)
    if args.save and rank == 0:
        # Reassembled from every stage: SimpleModel's own keys, so it loads with strict=True.
        save_atomic(weights, args.save)  # CPU tensors: loads anywhere
    dist.destroy_process_group()  # on a clean exit only: after an error, peers may hang


def main(argv=None):
    args = parse_args(argv)
    launch(run, args)  # one rank under torchrun, else --nproc of them started here


if __name__ == "__main__":
    main()
