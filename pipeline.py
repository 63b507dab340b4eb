"""Model parallelism and pipeline parallelism: cut SimpleModel into stages, one per device.

What it teaches
    When a model does not fit on one device, cut its layers into consecutive stages and put
    each stage on its own device. Two ways, one file:
    - `python pipeline.py`: model parallelism in one process. Activations travel from stage
      to stage inside forward (`x.to(next_device)`), and autograd carries the gradients back.
      Only one stage works at a time, so with S stages each GPU idles (S-1)/S of the time.
    - `torchrun --nproc_per_node=2 pipeline.py`: pipeline parallelism with
      torch.distributed.pipelining. One process per stage; the batch is cut into
      micro-batches that flow through the stages like an assembly line, so the stages work
      at the same time on different micro-batches. Idle time shrinks to the "bubble" below.
    Both end with the same weights as one device with the same global batch (tests/).

    `torch.distributed.pipeline.sync.Pipe`, which many guides still show, is gone: it was
    deprecated in PyTorch 2.3 and removed in 2.4 (pytorch/pytorch#121464, #127354).
    torch.distributed.pipelining, new in 2.4, replaces it: one process per stage, talking
    through torch.distributed, so stages can sit on different machines.

    Schedules, 2 stages and 4 micro-batches, one time slot per forward (F) or backward (B):

        t:          1   2   3   4   5   6   7   8   9   10
        GPipe
          stage 0:  F0  F1  F2  F3  .   .   B0  B1  B2  B3     all forwards, then all
          stage 1:  .   F0  F1  F2  F3  B0  B1  B2  B3  .      backwards
        1F1B
          stage 0:  F0  F1  .   B0  F2  B1  F3  B2  .   B3     one forward, one backward
          stage 1:  .   F0  B0  F1  B1  F2  B2  F3  B3  .      as soon as possible

    Each stage idles p-1 of m+p-1 slots in each direction (the "." above): the bubble fraction
    (p-1)/(m+p-1) = 1/5 here, so at best m/(m+p-1) = 80% of the ideal speed. More micro-batches
    shrink the bubble. 1F1B has the same bubble but frees each micro-batch's activations as soon
    as its backward has run: stage 0 holds at most p = 2 micro-batches of activations instead of
    GPipe's m = 4, which is why 1F1B is the default choice for large m.

When to use it
    The model (with its optimizer state) does not fit on one device, and its layers can be cut
    into a chain. Pipelining also spans machines with slow links well: only activations at the
    cuts travel, not all the gradients.
When not
    The model fits on one device: ddp.py is simpler and faster (no bubble). Within one machine
    with fast links, sharding (FSDP) is often the easier way to fit a large model.

Launch
    python pipeline.py                              # model parallel: stages on cuda:0, cuda:1...
    torchrun --nproc_per_node=2 pipeline.py         # pipeline: 2 stages, GPipe, 4 micro-batches
    torchrun --nproc_per_node=3 pipeline.py --schedule 1f1b --microbatches 6
    Smallest hardware: any CPU (stages share it; pipeline ranks talk over gloo).

What changes from data parallelism
    diff ddp.py pipeline.py

Docs
    https://pytorch.org/docs/stable/distributed.pipelining.html
    https://pytorch.org/tutorials/intermediate/pipelining_tutorial.html
Tested with torch 2.10.0 (the oldest that requirements.txt admits), 2.13.0 and 2.15.0, on CPU/gloo.
"""

import argparse
import copy
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.profiler import record_function
from torch.utils.data import DataLoader, RandomSampler

from common import DATASET_SIZE, IN_FEATURES, OUT_FEATURES, Meter, Profiler, SimpleModel
from common import eval_line, log_line, make_dataset, num_params, positive, print0, save_atomic
from common import seed_everything

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    train = parser.add_argument_group("training")
    train.add_argument("--steps", type=positive(int), default=200, help="optimizer steps in all")
    train.add_argument("--batch-size", type=positive(int), default=64,
                       help="global batch: samples per optimizer step, all micro-batches")
    train.add_argument("--lr", type=positive(float), default=3e-3, help="Adam learning rate")
    train.add_argument("--seed", type=int, default=0, help="seeds the weights and the data order")
    train.add_argument("--log-every", type=positive(int), default=20, help="steps between logs")
    train.add_argument("--eval-every", type=positive(int), default=50,
                       help="steps between evaluations on the held-out set (and at the end)")
    model = parser.add_argument_group("model")
    model.add_argument("--hidden", type=positive(int), default=64, help="width of each block")
    model.add_argument("--blocks", type=positive(int), default=4, help="number of hidden blocks")
    pipe = parser.add_argument_group("pipeline")
    pipe.add_argument("--stages", type=positive(int), default=None,
                      help="model parallel only (under torchrun: the world size); "
                           "default: the number of GPUs, or 2")
    pipe.add_argument("--microbatches", type=positive(int), default=4,
                      help="micro-batches per step (torchrun only)")
    pipe.add_argument("--schedule", choices=sorted(SCHEDULES), default="gpipe",
                      help="order of forwards and backwards (torchrun only)")
    hardware = parser.add_argument_group("hardware")
    hardware.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                          help="auto: CUDA if available, else CPU")
    hardware.add_argument("--compile", action="store_true",
                          help="compile each block with torch.compile (inductor)")
    hardware.add_argument("--activation-checkpointing", action="store_true",
                          help="drop each block's activations after forward and recompute "
                               "them in backward: less memory, about one more forward")
    hardware.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                          help="auto: NCCL when every rank has a GPU of its own, else gloo")
    hardware.add_argument("--timeout", type=positive(float), default=60.0,
                          help="seconds a send/recv may wait for a peer before the job fails")
    output = parser.add_argument_group("output")
    output.add_argument("--save", metavar="PATH", help="write the final weights (a state_dict)")
    output.add_argument("--profile", metavar="DIR",
                        help="write a Chrome trace of steps 5-7 per rank into DIR "
                             "(torch.profiler; open in ui.perfetto.dev)")
    args = parser.parse_args(argv)

    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here; use --device cpu (or auto)")
    if args.compile or args.activation_checkpointing:
        # Both work per stage in principle; this file keeps to the pipeline itself.
        parser.error("--compile and --activation-checkpointing are not shown with pipelining "
                     "here; see single.py, ddp.py, fsdp.py or tp.py")
    gpus = torch.cuda.device_count() if use_cuda else 0
    if "RANK" in os.environ:  # torchrun: one stage per rank
        stages = int(os.environ["WORLD_SIZE"])
        local_world = int(os.environ["LOCAL_WORLD_SIZE"])
        if stages < 2:
            parser.error("pipeline parallelism needs 2 or more ranks "
                         "(torchrun --nproc_per_node=2 ...); for one process run "
                         "`python pipeline.py`")
        if use_cuda and local_world > gpus:
            # DDP's gloo fallback (ranks sharing a GPU) does not carry over: gloo sends and
            # receives CPU tensors only, and a stage's activations live on its GPU.
            parser.error(f"{local_world} stages on this machine but {gpus} GPU(s): each stage "
                         "needs a GPU of its own; use fewer ranks or --device cpu")
        carrier = "nccl" if use_cuda else "gloo"  # NCCL carries GPU tensors, gloo CPU ones
        if args.backend not in ("auto", carrier):
            parser.error(f"--backend {args.backend}: the stages send "
                         f"{'GPU' if use_cuda else 'CPU'} tensors, which only {carrier} carries "
                         f"here; use --backend {carrier} (or auto)")
        if args.batch_size % args.microbatches:
            parser.error(f"--microbatches {args.microbatches} must divide --batch-size "
                         f"{args.batch_size} (micro-batches of equal size); pick a divisor")
        if args.schedule == "1f1b" and args.microbatches < stages:
            parser.error(f"--schedule 1f1b needs --microbatches >= stages ({stages}); "
                         f"use --microbatches {stages} or more")
    else:
        # One stage per GPU (at least 2, to show the cut), but never more than the blocks:
        # 8 GPUs and --blocks 4 make 4 stages; pass --blocks 8 to use all 8.
        stages = args.stages = args.stages or min(max(gpus, 2), args.blocks)
    if stages > args.blocks:
        # Every stage gets at least one block (input layer on the first, output on the last).
        parser.error(f"{stages} stages but --blocks {args.blocks}: every stage needs a block; "
                     f"use --blocks {stages} or more, or fewer stages")
    if args.batch_size > DATASET_SIZE:
        parser.error(f"--batch-size {args.batch_size} is larger than the dataset "
                     f"({DATASET_SIZE} samples); use at most {DATASET_SIZE}")
    if args.save and not os.access(os.path.dirname(os.path.abspath(args.save)), os.W_OK):
        parser.error(f"--save {args.save}: its folder does not exist or is not writable; "
                     "create it first")
    return args


def setup(args):
    """Return this process's rank, the number of ranks, and the device of each local stage."""
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        # fp32 means fp32: TF32 off, so a GPU run matches the CPU to ~1e-6 (docs/traps.md#tf32).
        torch.set_float32_matmul_precision("highest")
    if "RANK" not in os.environ:
        # Model parallelism: this one process drives every stage.
        gpus = torch.cuda.device_count() if use_cuda else 0
        devices = [torch.device("cuda", i % gpus) if gpus else torch.device("cpu")
                   for i in range(args.stages)]
        print(f"pipeline: model parallel | {args.stages} stages on "
              f"{', '.join(map(str, devices))} | torch {torch.__version__}", flush=True)
        if len(set(devices)) < len(devices):
            print("pipeline: fewer devices than stages, so stages share a device: the code "
                  "path is the same, the memory relief is not", flush=True)
        return 0, 1, devices
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if use_cuda:
        # LOCAL_RANK, not RANK, picks the GPU (RANK counts over all machines).
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # before init_process_group: NCCL binds to it
    else:
        device = torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"  # parse_args checked that every stage has a GPU
    # The timeout turns a dead peer into an error instead of a send/recv that waits forever.
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout),
                            device_id=device if backend == "nccl" else None)
    print0(f"pipeline: {world_size} stages | schedule {args.schedule} | {args.microbatches} "
           f"micro-batches | backend {backend} | device {device.type} | torch {torch.__version__}")
    return rank, world_size, [device]


def cut(model, stage, stages):
    """Stage `stage` of `stages`: a copy of the model that keeps only its share of the blocks,
    plus the input layer on the first stage and the output layer on the last.

    Deleting from a full copy keeps the full model's parameter names ("blocks.3.up.weight"),
    so the stages' state_dicts are slices of the full one and merge back with a dict update.
    (A model too big for one device is built on the "meta" device first and each stage then
    materializes only its own part: the same cut, without the memory.)
    """
    part = copy.deepcopy(model)
    names = list(part.blocks.keys())
    mine = names[stage * len(names) // stages:(stage + 1) * len(names) // stages]
    for name in names:
        if name not in mine:
            del part.blocks[name]
    if stage != 0:
        part.input = None
    if stage != stages - 1:
        part.output = None
    return part


def evaluate(stages, dataset, rank, world_size, devices, batch_size, hidden):
    """The mean squared error over every sample of the held-out set, the same on every rank.

    Forward only, stage by stage; with several ranks, every rank must call it (it sends,
    receives and ends in a collective).
    """
    for stage_module in stages:
        stage_module.eval()  # no dropout or BatchNorm here, but the model you copy this to may
    loader = DataLoader(dataset, batch_size=batch_size)  # every rank: the same batches, in order
    sums = torch.zeros(2, dtype=torch.float64, device=devices[-1])  # squared errors, values
    with torch.no_grad():  # no graph, no activations kept: evaluation needs far less memory
        for x, y in loader:
            if world_size == 1:
                for stage_module, device in zip(stages, devices):
                    x = stage_module(x.to(device))
            else:
                # --- Pipeline parallelism: forward only, activations handed on by hand ---
                # The schedules drive training (and, in recent torch, a forward-only eval());
                # plain send/recv works on every torch this file supports and shows what the
                # schedule does underneath. No micro-batches: without backward there is
                # nothing to overlap with, so the stages simply work one after the other.
                device = devices[0]
                if rank == 0:
                    x = x.to(device)
                else:  # the activations of the previous stage: (batch, hidden)
                    x = torch.empty(len(x), hidden, device=device)
                    dist.recv(x, src=rank - 1)
                x = stages[0](x)
                if rank < world_size - 1:
                    dist.send(x, dst=rank + 1)
                    continue  # only the last stage has outputs to score
                # --- end pipeline parallelism ---
            # Sums, divided once at the end: the mean of per-batch means would overweight a
            # smaller last batch.
            sums[0] += F.mse_loss(x, y.to(x.device), reduction="sum")
            sums[1] += y.numel()
    if world_size > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)  # the last stage's sums, to every rank
    for stage_module in stages:
        stage_module.train()
    return (sums[0] / sums[1]).item()


def train(args, rank, world_size, devices):
    """Train; return the full model's final weights (on rank 0), the final loss and the final
    validation loss."""
    seed_everything(args.seed)  # every rank builds the same full model before cutting it
    model = SimpleModel(hidden=args.hidden, blocks=args.blocks)
    if world_size == 1:
        # --- Model parallelism: every stage in this process, each on its device ---
        stages = [cut(model, i, len(devices)).to(d) for i, d in enumerate(devices)]
        # --- end model parallelism ---
    else:
        # --- Pipeline parallelism: this rank's stage, and the schedule that drives it ---
        device = devices[0]
        stages = [cut(model, rank, world_size).to(device)]
        # PipelineStage knows its neighbours by stage index (rank - 1 and rank + 1). Left to
        # itself it would infer the activation shapes from the first micro-batch, sending them
        # between stages as pickled objects (docs/torch-versions.md: NumPy). Example input and
        # output of one micro-batch (on "meta": shapes only, no memory) skip that. An input
        # that requires grad is one whose gradient goes back to the previous stage.
        micro = args.batch_size // args.microbatches
        width_in = IN_FEATURES if rank == 0 else args.hidden
        width_out = OUT_FEATURES if rank == world_size - 1 else args.hidden
        stage = PipelineStage(
            stages[0], rank, world_size, device,
            input_args=torch.empty(micro, width_in, device="meta", requires_grad=rank > 0),
            output_args=torch.empty(micro, width_out, device="meta", requires_grad=True))
        # loss_fn runs on the last stage, once per micro-batch, and returns that
        # micro-batch's *mean* loss. Backward of M such losses adds up M mean gradients:
        # M times the gradient of the whole batch. scale_grads=True (the default, spelled
        # out here) divides the gradients by M after the last backward, so the optimizer
        # sees exactly the gradient one device computes on the whole batch.
        schedule = SCHEDULES[args.schedule](stage, n_microbatches=args.microbatches,
                                            loss_fn=F.mse_loss, scale_grads=True)
        is_first, is_last = rank == 0, rank == world_size - 1
        # --- end pipeline parallelism ---
    # Each stage's optimizer sees only its own parameters; together they are one Adam.
    optimizer = torch.optim.Adam([p for s in stages for p in s.parameters()], lr=args.lr)

    dataset, val_set = make_dataset("train"), make_dataset("val")
    # Every rank walks through the same global batches (the first stage needs the inputs,
    # the last the targets): the permutation drawn from seed + epoch, as in every script.
    generator = torch.Generator()
    sampler = RandomSampler(dataset, generator=generator)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    steps_per_epoch = len(loader)

    meter = Meter(devices)  # every stage's device: the clock waits for all of them
    profiler = Profiler(args.profile, rank)  # does nothing without --profile
    for step in range(args.steps):
        epoch, index = divmod(step, steps_per_epoch)
        if index == 0:
            generator.manual_seed(args.seed + epoch)
            batches = iter(loader)
        x, y = next(batches)
        if world_size == 1:
            # --- Model parallelism: hand the activations from device to device ---
            # While one stage computes, the others wait: nothing overlaps.
            with record_function("forward"):
                for stage_module, device in zip(stages, devices):
                    x = stage_module(x.to(device))
                loss = F.mse_loss(x, y.to(x.device))
            with record_function("backward"):
                loss.backward()  # autograd follows the .to() calls back across the devices
            loss = loss.detach()
            # --- end model parallelism ---
        else:
            # --- Pipeline parallelism: one call runs the whole schedule ---
            # The schedule cuts the batch into micro-batches, runs every forward and
            # backward in its order, sending activations down and gradients up.
            losses = []  # (the schedule marks each micro-batch's "Forward i", "Backward i")
            if is_first:
                schedule.step(x.to(device))
            elif is_last:
                schedule.step(target=y.to(device), losses=losses)
            else:
                schedule.step()
            # Equal micro-batches: the mean of their losses is the whole batch's loss.
            loss = (torch.stack(losses).mean().detach() if is_last
                    else torch.zeros((), device=device))
            # --- end pipeline parallelism ---
        with record_function("optimizer step"):
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
            print0(log_line(step + 1, args.steps, final_loss, samples_per_s))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            # every rank, at the same steps: it sends and receives
            with meter.paused(), record_function("evaluation"):
                val_loss = evaluate(stages, val_set, rank, world_size, devices,
                                    args.batch_size, args.hidden)
            print0(eval_line(step + 1, args.steps, val_loss))
    profiler.stop()
    print0(meter.summary(final_loss, flops_per_sample=6 * num_params(model), val_loss=val_loss))

    # Reassemble the full model on rank 0: each stage holds a slice of the full state_dict.
    if world_size == 1:
        weights = {k: v.cpu() for stage_module in stages
                   for k, v in stage_module.state_dict().items()}
    elif rank == 0:
        # Plain tensor sends, not gather_object (pickled objects): rank 0 built the full
        # model too, so it knows every slice's names and shapes.
        weights = {k: v.cpu() for k, v in stages[0].state_dict().items()}
        for src in range(1, world_size):
            for name, like in cut(model, src, world_size).state_dict().items():
                received = torch.empty_like(like, device=devices[0])
                dist.recv(received, src=src)
                weights[name] = received.cpu()
    else:
        for tensor in stages[0].state_dict().values():  # the same order rank 0 expects
            dist.send(tensor.contiguous(), dst=0)
        weights = None
    return weights, final_loss, val_loss


def main(argv=None):
    args = parse_args(argv)
    rank, world_size, devices = setup(args)
    weights, _, _ = train(args, rank, world_size, devices)
    if args.save and rank == 0:
        # The same keys as SimpleModel's own state_dict: it loads with strict=True.
        save_atomic(weights, args.save)  # CPU tensors: loads anywhere (common.py)
    if world_size > 1:
        # A clean exit only: after an error we never get here, and the exception's non-zero
        # exit lets torchrun end the other stages (tearing a group down under a peer that is
        # mid-send can hang: pytorch/torchtitan#1342).
        gloo = dist.get_backend() == "gloo"
        dist.destroy_process_group()
        if gloo:
            # Lets gloo's threads drop their last tensors while Python is alive; without it a
            # worker can abort at exit with SIGABRT on torch 2.13 (docs/traps.md#sigabrt).
            time.sleep(0.2)


if __name__ == "__main__":
    main()
