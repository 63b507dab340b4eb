"""Pipeline parallelism by hand: GPipe and 1F1B from send and recv, one stage per rank.

What it teaches
    What torch.distributed.pipelining does for pipeline.py, written with point-to-point sends.
    Each rank keeps one stage of SimpleModel (pipeline.py's cut: its share of the blocks, the
    embeddings on the first, the norm and the head on the last). The batch is cut into
    micro-batches; for each, a stage receives the activations from the stage before, runs its
    blocks and sends its output on; the last stage computes the loss. Backward runs the other
    way: a stage receives the gradient of its output, runs autograd through its blocks, and
    sends the gradient of its input back. The schedule is only the order of these steps:
    gpipe runs every forward, then every backward (m micro-batches of activations held);
    1f1b starts with the forwards the later stages need (stages - rank - 1 of them), then
    alternates one forward with one backward, then runs the backwards left (at most stages -
    rank held). Each loss is divided by the micro-batches' count, so their gradients add up to
    the batch's mean (what the library's scale_grads does, after the backwards).
    It ends with the weights of pipeline.py with the same flags, and of one device (tests/).

    Where the library differs: it divides the summed gradients once, after the last backward
    (with 3 or 6 micro-batches the two round differently; with a power of two the runs are
    bit-identical). Its 1F1B starts a stage's sends with its next receive in one
    batch_isend_irecv, as NCCL needs where two stages send to each other at once (its GPipe
    batches them apart); here both schedules do, and wait for each send at once.
    Left out: the library's shape inference (here the flags give the shapes), arbitrary
    inputs, outputs and keyword arguments per stage, and every schedule with more than one
    stage per rank (interleaved-1f1b, zero-bubble, zbv, dualpipev: use pipeline.py).
    `python from_scratch/pipeline.py --nproc 1` is pipeline.py's model parallelism, unchanged.

Launch (from the collection's root)
    python from_scratch/pipeline.py                         # 2 stages on a CPU, one per GPU
    torchrun --nproc_per_node=2 from_scratch/pipeline.py    # what clusters use
    torchrun --nproc_per_node=3 from_scratch/pipeline.py --schedule 1f1b --microbatches 6 \
        --batch-size 60
    torchrun --nproc_per_node=2 from_scratch/pipeline.py --fp64   # pipeline.py's weights
    Smallest hardware: any CPU (stages share it; they talk over gloo).

What changes from the wrapper
    diff pipeline.py from_scratch/pipeline.py

Docs
    https://pytorch.org/docs/stable/distributed.html#point-to-point-communication
    https://pytorch.org/docs/stable/distributed.pipelining.html
Tested with torch 2.10.0, 2.13.0 and 2.15.0, on CPU/gloo. NCCL (a GPU per stage) is proven only
where 2 GPUs are: `python -m pytest -q tests/test_pipeline.py -m gpu -k by_hand`.
"""

import copy
import datetime
import itertools
import os
import sys

import torch
import torch.distributed as dist
from torch.profiler import record_function
from torch.utils.data import DataLoader, RandomSampler

# common.py and plumbing/ are one folder up, in the collection's root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import BOS, SEQ_LEN, SimpleModel, documents, loss_fn, make_dataset, seed_everything
from plumbing.checkpoints import gather_full_state, optimizer_share, read_checkpoint
from plumbing.checkpoints import save_atomic, train_state
from plumbing.flags import check_shared_flags, compile_and_checkpoint, launch_world, positive
from plumbing.flags import shared_parser
from plumbing.meter import Meter, Profiler, eval_line, log_line, print0
from plumbing.model_check import check_model
from plumbing.ranks import launch

# --schedule: pipeline.py's; the first two run here, the others (stages per rank > 1) there
SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev"]


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


def check_stages(parser, args, world_size, gpus):
    """One process driving every stage (model parallelism), or one stage per rank: its checks."""
    if world_size == 1:  # no schedule to ask for
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
        if args.schedule not in SCHEDULES[:2]:
            parser.error(f"--schedule {args.schedule} runs several stages per rank; by hand, "
                         "gpipe and 1f1b run one: use pipeline.py")
        if (args.stages_per_rank or 1) > 1:
            parser.error(f"--stages-per-rank {args.stages_per_rank}: by hand, one stage per "
                         "rank; use pipeline.py")
        args.stages_per_rank, args.stages, args.microbatches = 1, world_size, m
        if args.batch_size % m:
            parser.error(f"--microbatches {m} must divide --batch-size {args.batch_size} "
                         "(micro-batches of equal size); pick a divisor")
        if args.schedule in ("1f1b", "dualpipev") and m < args.stages:
            parser.error(f"--schedule {args.schedule} needs --microbatches >= stages "
                         f"({args.stages}); use --microbatches {args.stages} or more")
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
        print0(f"pipeline by hand: {world_size} ranks x {args.stages_per_rank} stages | schedule "
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
    """The rank of each stage: all in this process (model parallelism); else one per rank."""
    if world_size == 1:
        return [0] * args.stages
    return list(range(args.stages))


# --- Pipeline parallelism by hand: the schedule, the sends and receives, the loss scaling ---
def schedule(name, stage, stages, m):
    """The order in which stage `stage` of `stages` runs the forwards ("F", i) and backwards
    ("B", i) of a step's m micro-batches."""
    forwards, backwards = [("F", i) for i in range(m)], [("B", i) for i in range(m)]
    if name == "gpipe":  # every forward, then every backward: m micro-batches held
        return forwards + backwards
    # 1F1B: first the forwards the later stages need before a backward can come back
    # (warm-up), then one forward and one backward in turn, then the backwards left
    # (cool-down): at most stages - stage micro-batches held
    warm = min(stages - stage - 1, m)
    steady = [action for pair in zip(forwards[warm:], backwards) for action in pair]
    return forwards[:warm] + steady + backwards[m - warm:]


def exchange(sends, receives):
    """Start these sends and receives ((tensor, peer rank) pairs) as one batch; wait for all.

    One batch (batch_isend_irecv: an NCCL group): in 1F1B a stage sends an activation on
    while the next stage sends a gradient back, two sends that must progress together to
    complete, and NCCL's rule (ncclSend's docs) is that such operations be fused in one
    group; as two blocking sends facing each other they can hang."""
    ops = [dist.P2POp(dist.isend, tensor, peer) for tensor, peer in sends]
    ops += [dist.P2POp(dist.irecv, tensor, peer) for tensor, peer in receives]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def pipeline_step(args, part, stage, x, y, docs, device, dtype):
    """Every micro-batch of the batch (x, y; docs, packed) forward and backward through this
    rank's stage, in --schedule's order; the gradients add up in .grad. Return the batch's
    loss on the last stage (0 on the others)."""
    m, first, last = args.microbatches, stage == 0, stage == args.stages - 1
    # Equal micro-batches, cut as the library cuts them
    xs, ys = x.to(device).tensor_split(m), y.to(device).tensor_split(m)
    docs = [None] * m if docs is None else docs.tensor_split(m)  # every stage's, packed
    # N, the batch's count of targets that count (cross_entropy skips -100s): every rank holds y
    tokens = (y != -100).sum()
    # What travels between stages, both ways: (micro-batch, sequence, hidden). The flags give
    # the shape; the library can also infer it by sending it ahead.
    shape = (args.batch_size // m, SEQ_LEN, args.hidden)
    inputs, outputs, losses, sends = {}, {}, [], []  # held from forward i until backward i
    for kind, i in schedule(args.schedule, stage, args.stages, m):
        # A forward receives activations from the stage before, a backward the gradient of
        # its output from the stage after (none at the ends); the last action's sends go too.
        edge = first if kind == "F" else last
        received = [] if edge else [torch.empty(shape, device=device, dtype=dtype)]
        exchange(sends, [(t, stage - 1 if kind == "F" else stage + 1) for t in received])
        with record_function(f"Forward {i}" if kind == "F" else f"Backward {i}"):
            if kind == "F":
                # A leaf that requires grad: backward leaves the gradient to send back in it
                inputs[i] = received[0].requires_grad_() if received else xs[i]
                outputs[i] = part(inputs[i], **on(device, docs[i]))
                if last:
                    # The micro-batch's summed loss over N/m: however the counts fall, the m
                    # of them add up to m times the batch's mean
                    loss = loss_fn(outputs[i], ys[i], reduction="sum") * m / tokens
                    losses.append(loss.detach())
                    # scale_grads by hand: m micro-batches' backwards add up in .grad, so
                    # each is divided by m; undivided, the gradient is m times the
                    # batch's, and Adam, nearly blind to scale, hides it in the loss curve.
                    outputs[i] = loss / m
                sends = [] if last else [(outputs[i].detach(), stage + 1)]
            else:
                # From the received gradient of the output (the loss itself on the last)
                torch.autograd.backward(outputs.pop(i), received or None)
                grad = inputs.pop(i).grad  # of the stage's input (None for token ids)
                sends = [] if first else [(grad, stage - 1)]
    exchange(sends, [])  # the last backward's gradient (on the first stage: nothing)
    # Each is its sum x m / N: their mean is the whole batch's loss.
    return torch.stack(losses).mean() if last else torch.zeros((), device=device, dtype=dtype)
# --- end ---


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
            # --- Pipeline parallelism: every micro-batch through this rank's stage, by hand ---
            loss = pipeline_step(args, stages[0], rank, x, y, docs, devices[0], dtype)
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
