"""One device: the plain training loop every other script in this collection is a diff against.

What it teaches
    Nothing parallel, on purpose: SimpleModel on one device (a GPU, or the CPU), Adam on global
    batches of --batch-size samples, a held-out evaluation, checkpoints it resumes from, and
    weights saved to load anywhere. Every other script adds one technique to exactly this, and
    the tests prove each ends with this loop's weights (tests/reference.py: the same, plainer).

When to use it
    The model, its gradients and Adam's state fit on one device, and one device is fast enough.
When not
    You have several devices and want them all working: ddp.py. The model does not fit:
    fsdp.py (shard it) or pipeline.py (cut it into stages).

Launch
    python single.py                    # the GPU if there is one, else the CPU
    python single.py --device cpu --steps 500 --checkpoint ckpt.pt  # resumes it if it exists
    # Does another script match one device? In float64 a correct one ends within 1e-9 of
    # this (rounding: ~1e-13, where fp32 can part by 1e-2 on a long run; docs/proofs.md):
    python single.py --fp64 --save one.pt
    Smallest hardware: any CPU.

Read next (each diff shows its technique; the README says how many lines each changes)
    diff single.py dataparallel.py   # several GPUs from one process
    diff single.py amp.py            # mixed precision
    diff single.py ddp.py            # one process per device: data parallelism
    then diff ddp.py zero.py (or fsdp.py, cp.py, ep.py), diff fsdp.py tp.py; pipeline.py, nd.py

Docs
    https://pytorch.org/tutorials/beginner/basics/optimization_tutorial.html
Tested with torch 2.10.0 (the oldest that requirements.txt admits), 2.13.0 and 2.15.0, on CPU.
"""

import itertools

import torch
from torch.profiler import record_function
from torch.utils.data import DataLoader, RandomSampler

from common import SimpleModel, loss_fn, make_dataset, seed_everything
from plumbing.balance import balance
from plumbing.checkpoints import read_checkpoint, save_atomic, train_state
from plumbing.flags import check_shared_flags, compile_and_checkpoint, shared_parser
from plumbing.meter import Meter, Profiler, eval_line, held_bytes, log_line, print0
from plumbing.model_check import check_model


def parse_args(argv=None):
    parser = shared_parser(__doc__)  # the flags every script shares (docs/usage.md)
    args = parser.parse_args(argv)
    check_shared_flags(parser, args)  # and their checks: one line that names the fix
    check_model(parser, args)  # and the model: what would train silently wrong, refused
    return args


def setup(args):
    """Pick the device."""
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", 0)
        # fp32 means fp32: TF32 off, so a GPU run matches the CPU to ~1e-6 (docs/traps.md#tf32).
        torch.set_float32_matmul_precision("highest")
    else:
        device = torch.device("cpu")
    print(f"single: device {device.type} | torch {torch.__version__}", flush=True)
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
                loss = loss_fn(model(x), y, reduction="sum") / tokens
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
                val_loss = evaluate(model, val_set, args.batch_size, device)
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
        save_atomic(model.state_dict(), args.save)  # CPU tensors: loads anywhere


def main(argv=None):
    args = parse_args(argv)
    run(args)  # in this one process (ddp.py starts one per device here)


if __name__ == "__main__":
    main()
