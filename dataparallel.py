"""DataParallel (DP): one process drives every GPU of the machine, one step at a time.

What it teaches
    The oldest and simplest way to use several GPUs: wrap the model in torch.nn.DataParallel
    and change nothing else. Each step it copies the weights to every GPU, cuts the batch into
    one slice per GPU, runs the forward passes in threads, gathers the outputs on GPU 0, and
    backward sums the gradients back onto GPU 0's (the only real) copy of the weights.
    With global batch B it equals one device with batch B: the tests prove it in float64 to
    1e-9 (on a CPU, where DataParallel is a pass-through, and on one GPU; two not yet run).

When to use it
    A quick experiment on one machine, where one line of code is all you want to change.
When not
    Anything that has to be fast or to grow: one Python process drives all GPUs (the GIL
    serializes the threads), GPU 0 gathers outputs and holds the optimizer (so it runs out of
    memory first and idles the others), and the weights are copied again every step. It cannot
    span machines. PyTorch's docs recommend DistributedDataParallel even on one machine: see
    ddp.py, and `diff single.py ddp.py` for what that takes. State kept per replica is not
    shared: a BatchNorm would normalize each GPU's slice alone (and is refused), and a
    mixture's routing counts would stay on the replicas (the dense model only).

On a CPU
    No wrapper at all: `python dataparallel.py` on a CPU runs single.py's loop and prints its
    numbers. What DataParallel does (the copies, the threads, GPU 0's gather) needs 2 GPUs.

Launch
    python dataparallel.py                   # all visible GPUs, or the CPU if there are none
    CUDA_VISIBLE_DEVICES=0,1 python dataparallel.py
    python dataparallel.py --fp64          # float64: within 1e-9 of single.py --fp64
    Smallest hardware: any CPU (the model then runs unwrapped) or one GPU.

What DataParallel adds to one device
    diff single.py dataparallel.py

Docs
    https://pytorch.org/docs/stable/generated/torch.nn.DataParallel.html
    https://pytorch.org/docs/stable/notes/cuda.html (section "Use nn.parallel.
    DistributedDataParallel instead of multiprocessing or nn.DataParallel")
Tested with torch 2.10.0 (the oldest that requirements.txt admits), 2.13.0 and 2.15.0, on CPU.
"""

import itertools

import torch
from torch.nn import DataParallel
from torch.profiler import record_function
from torch.utils.data import DataLoader, RandomSampler

from common import SimpleModel, loss_fn, make_dataset, seed_everything
from plumbing.balance import balance
from plumbing.checkpoints import read_checkpoint, save_atomic, train_state
from plumbing.flags import check_shared_flags, compile_and_checkpoint, shared_parser
from plumbing.meter import Meter, Profiler, eval_line, held_bytes, log_line, print0
from plumbing.model_check import check_model


def parse_args(argv=None):
    # replicas: a copy of the model per GPU, made again every step, which --compile does not
    # follow, and whose checkpointed forwards would run GPU 0's weights: both refused
    parser = shared_parser(__doc__, moe=False, replicas=True)  # the shared flags (docs/usage.md)
    args = parser.parse_args(argv)
    check_shared_flags(parser, args)  # and their checks: one line that names the fix
    check_model(parser, args)  # and the model: what would train silently wrong, refused
    return args


def setup(args):
    """Pick the device."""
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        # DataParallel keeps the real weights, the optimizer and the gathered outputs on the
        # first visible GPU; the other GPUs only get copies for the length of one step.
        device = torch.device("cuda", 0)
        # fp32 means fp32: TF32 off, so a GPU run matches the CPU to ~1e-6 (docs/traps.md#tf32).
        torch.set_float32_matmul_precision("highest")
    else:
        device = torch.device("cpu")
    print(f"dataparallel: {torch.cuda.device_count() if use_cuda else 'no'} GPU(s) | "
          f"device {device.type} | torch {torch.__version__}", flush=True)
    return device


def evaluate(model, dataset, batch_size, device):
    """The mean cross-entropy per token over the whole held-out set."""
    model.eval()  # SimpleModel has no dropout or BatchNorm, but the model you copy this to may
    loader = DataLoader(dataset, batch_size=batch_size)  # in order, every sample once
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # token losses, tokens
    with torch.no_grad():  # no graph, no activations kept: evaluation needs far less memory
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            # Sums, divided once at the end: the mean of per-batch means would overweight a
            # smaller last batch.
            sums[0] += loss_fn(model(x), y, reduction="sum")
            sums[1] += (y != -100).sum()  # the targets that count: cross_entropy skips -100s
    model.train()
    return (sums[0] / sums[1]).item()


def train(args, device):
    """Train; return the model, the final loss and the final validation loss."""
    # --fp64: in float64 a correct strategy ends within 1e-9 of one device, where fp32's
    # rounding, amplified by Adam, can part them (docs/drift.md). Built in fp32, then cast.
    dtype = torch.float64 if args.fp64 else torch.float32
    seed_everything(args.seed)
    model = SimpleModel.from_args(args).to(device, dtype)
    # --compile and --activation-checkpointing, per block, before any wrapper
    compile_and_checkpoint(model.blocks.values(), args)
    # --- DataParallel: wrap the model ---
    # Every forward copies the weights to each visible GPU, cuts the batch along dim 0 (B/G
    # samples each), runs the G forwards in threads and gathers the outputs on GPU 0. Backward
    # sums the replicas' gradients into the one real copy on GPU 0: the whole batch's gradient.
    # On a CPU there is nothing to wrap: the model runs as in single.py.
    dp_model = DataParallel(model) if device.type == "cuda" else model
    # --- end ---
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    start_step = load_checkpoint(args, model, optimizer) if args.checkpoint else 0

    dataset, val_set = make_dataset("train", args.data), make_dataset("val", args.data)
    # Each epoch's order is the permutation drawn from seed + epoch: the same one
    # DistributedSampler draws in ddp.py, so every script trains on the same batches.
    generator = torch.Generator()
    sampler = RandomSampler(dataset, generator=generator)
    micro_batch = args.batch_size // args.accum_steps
    loader = DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True)
    steps_per_epoch = len(loader) // args.accum_steps

    meter = Meter(device)
    profiler = Profiler(args.profile, 0, device)  # does nothing without --profile
    final_loss = val_loss = float("nan")
    for step in range(start_step, args.steps):
        epoch, index = divmod(step, steps_per_epoch)
        if index == 0 or step == start_step:
            generator.manual_seed(args.seed + epoch)
            # A resumed run skips the part of the epoch that was trained before the stop.
            micro_batches = itertools.islice(loader, index * args.accum_steps, None)
        loss_sum = torch.zeros((), device=device, dtype=dtype)
        # The step's K micro-batches, drawn first: their summed losses are divided by the targets
        # that count in all of them (cross_entropy skips -100s: a prompt's, padding), as one
        # batch's mean is. A micro-batch's mean over K would weigh a short one like a long one.
        batches = [next(micro_batches) for _ in range(args.accum_steps)]
        tokens = sum((y != -100).sum() for _, y in batches)
        for micro, (x, y) in enumerate(batches):
            x, y = x.to(device), y.to(device)
            with record_function("forward"):
                loss = loss_fn(dp_model(x), y, reduction="sum") / tokens
                loss = loss + balance(model, args, y) / args.accum_steps  # MoE: after forward
            with record_function("backward"):
                loss.backward()
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
            final_loss = loss_sum.item()
            print0(log_line(step + 1, args.steps, final_loss, grad_norm.item(),
                        samples_per_s))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            with meter.paused(), record_function("evaluation"):
                val_loss = evaluate(dp_model, val_set, args.batch_size, device)
            print0(eval_line(step + 1, args.steps, val_loss))
        if args.checkpoint and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
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
    device = setup(args)
    model, _, _ = train(args, device)
    if args.save:
        # The unwrapped model: DataParallel's state_dict names each weight "module.<name>"
        save_atomic(model.state_dict(), args.save)  # CPU tensors: loads anywhere


def main(argv=None):
    args = parse_args(argv)
    run(args)  # in this one process (ddp.py starts one per device here)


if __name__ == "__main__":
    main()
