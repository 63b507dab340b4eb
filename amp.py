"""Automatic mixed precision (AMP): run the math in bf16 or fp16, keep the weights in fp32.

What it teaches
    torch.autocast runs the matrix multiplications of forward (and so of backward) in a 16-bit
    type, which tensor cores execute many times faster than fp32, while the weights, the
    optimizer state and the precision-sensitive ops stay in fp32. fp16 also needs a
    GradScaler: its narrow exponent range flushes tiny gradients to zero, so the loss is
    multiplied by a large factor before backward and the gradients divided by it before the
    optimizer sees them. bf16 has fp32's exponent range and needs no scaler.

When to use it
    Any training on a GPU with tensor cores (V100 and T4: fp16; A100/H100 and later: bf16, the
    default where the GPU runs it natively): faster, and half the activation memory (how much
    faster: not measured here, where no GPU timing has been taken).
    (V100 runs only torch's CUDA 12.6 wheels; PyPI's CUDA 13 ones start at T4: docs/gpu.md.)
When not
    On a CPU it mostly shows the API: bf16 matmuls are rarely faster there. At tiny model sizes
    (like the default here) kernel launches, not math, set the pace and AMP gains nothing.
    Where you need bit-for-bit fp32 results, use --dtype fp32 (autocast off: the baseline).

Launch
    python amp.py                     # bf16 on CPUs and on GPUs of compute capability 8.0+
                                      # (A100, H100, RTX 30xx+), else fp16 (V100, T4)
    python amp.py --dtype fp16        # with GradScaler
    python amp.py --dtype fp32        # autocast off: exactly single.py
    python amp.py --fp64              # autocast off, in float64: single.py --fp64 to 1e-9
    python amp.py --clip 1.0          # clip the gradient norm (off by default, like the
                                      # other scripts, so the same flags give the same numbers)
    Smallest hardware: any CPU (bf16 and fp16 autocast both run there), or one GPU.

What mixed precision adds to one device
    diff single.py amp.py

Docs
    https://pytorch.org/docs/stable/amp.html
    https://pytorch.org/docs/stable/notes/amp_examples.html
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
    parser.groups["hardware"].add_argument(
        "--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
        help="autocast type; auto: bf16 on CPUs and GPUs of compute capability 8.0+, else fp16")
    args = parser.parse_args(argv)
    use_cuda = check_shared_flags(parser, args)  # and their checks: one line that names the fix
    if args.fp64 and args.dtype in ("bf16", "fp16"):
        parser.error(f"--fp64 with --dtype {args.dtype}: autocast would compute in 16 bits; "
                     "use --dtype fp32 (autocast off) with --fp64")
    if args.dtype == "auto":
        # bf16 on CPUs and on compute capability 8.0 (A100) and later; not is_bf16_supported(),
        # which says yes on V100 and T4 too, where bf16 is emulated and fp16 is the fast choice.
        bf16_ok = not use_cuda or torch.cuda.get_device_capability(0)[0] >= 8
        args.dtype = "fp32" if args.fp64 else "bf16" if bf16_ok else "fp16"
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
    print(f"amp: dtype {args.dtype} | device {device.type} | torch {torch.__version__}", flush=True)
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
    # The weights stay fp32 ("master weights"): autocast casts them inside each op, on the fly.
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    # --- AMP: a GradScaler, for fp16 only ---
    # fp16's 5 exponent bits round small gradients to 0 (under 6e-8): scaling the loss lifts
    # them into range. bf16 has fp32's 8 exponent bits: no scaler (disabled, it does nothing).
    scaler = torch.amp.GradScaler(device.type, enabled=args.dtype == "fp16")
    # Under autocast matmuls run in 16 bits; the device's op lists keep some ops in fp32
    # (docs/traps.md#autocast). Forward only: backward runs each op in its forward's type.
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[args.dtype]
    autocast = torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None)
    # --- end ---
    start_step = load_checkpoint(args, model, optimizer, scaler) if args.checkpoint else 0

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
            # --- AMP: forward under autocast, backward through the scaler ---
            with record_function("forward"), autocast:
                loss = loss_fn(model(x), y, reduction="sum") / tokens
                loss = loss + balance(model, args, y) / args.accum_steps  # MoE: after forward
            with record_function("backward"):
                scaler.scale(loss).backward()  # times the scale (fp16), else loss as it is
            # --- end ---
            loss_sum += loss.detach()
        with record_function("optimizer step"):
            # --- AMP: unscale before clipping, then step and update through the scaler ---
            # The gradients are still multiplied by the scale (65536 at first): unscale_ divides
            # them (and notes any inf/NaN) before clipping, which would otherwise measure a norm
            # 65536x too large and shrink the true gradient to almost nothing.
            scaler.unscale_(optimizer)
            # --clip: scale the whole gradient, as one vector, down to this norm if it is
            # larger (0: never; the norm is still measured). Returns the norm before clipping.
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                       args.clip or float("inf"))
            scale = scaler.get_scale()  # a GPU sync: fine once a step at this size
            # Steps only without inf/NaN; update() halves the scale then, doubles it after 2000.
            scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() < scale:
                print(f"step {step + 1}: skipped, inf/NaN gradients; fp16 loss scale lowered to "
                      f"{scaler.get_scale():g}", flush=True)
            # --- end ---
            optimizer.zero_grad(set_to_none=True)
        samples_per_s = meter.step(args.batch_size)
        profiler.step()

        if step == 0 or (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            final_loss = loss_sum.item()
            print0(log_line(step + 1, args.steps, final_loss, grad_norm.item(),
                        samples_per_s))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            with meter.paused(), record_function("evaluation"), autocast:  # AMP: autocast too
                val_loss = evaluate(model, val_set, args.batch_size, device)
            print0(eval_line(step + 1, args.steps, val_loss))
        if args.checkpoint and ((step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps):
            save_checkpoint(args, model, optimizer, scaler, step + 1)
    profiler.stop()
    print0(meter.summary(final_loss, model, val_loss=val_loss,
                         state_bytes=held_bytes(model, optimizer)))
    return model, final_loss, val_loss


def save_checkpoint(args, model, optimizer, scaler, step):
    """Everything needed to continue exactly where this run is: the data position is a
    function of (seed, step, global batch) only, so those three are all it needs besides the
    weights and Adam's state."""
    save_atomic({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "scaler": scaler.state_dict(),  # fp16 resumes its learned scale
                 **train_state(args, step)}, args.checkpoint)
    print(f"checkpoint: step {step} -> {args.checkpoint}", flush=True)


def load_checkpoint(args, model, optimizer, scaler):
    """Resume from --checkpoint if it holds one: the weights, Adam's state; return the step to
    start from (0 without one). A bad one stops with one line and is left as it was."""
    state = read_checkpoint(args, __file__)  # torch.load(weights_only=True), checked; or None
    if state is None:
        return 0
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])  # puts Adam's moments on the device
    scaler.load_state_dict(state["scaler"])  # the learned scale; else fp16 restarts at 65536
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
