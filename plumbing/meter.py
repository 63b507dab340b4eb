"""The log lines every script prints, rank 0's prints, the meter and the profiler."""

import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

try:
    import resource  # the peak memory of this process: Linux and macOS
except ImportError:  # Windows
    resource = None


def print0(*args):
    """print on rank 0 only (or always, in a single process)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def held_bytes(model, optimizer):
    """Bytes this rank holds for weights, gradients and Adam's two moments: the summary's
    `state`. Of a sharded tensor (a DTensor: FSDP, TP) it counts this rank's piece,
    to_local(); of ZeRO-1's optimizer the moments of this rank's share (its local Adam,
    .optim). A gradient has its weight's size (it exists from backward to zero_grad); Adam's
    step counters are scalars, left out."""
    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    weights = sum(local(p).numel() * p.element_size() for p in model.parameters())
    moments = sum(local(v).numel() * v.element_size()
                  for state in getattr(optimizer, "optim", optimizer).state.values()
                  for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return 2 * weights + moments


def peak_rss():
    """This process's peak resident memory (Python and torch included), as the summary prints
    it: ru_maxrss counts KiB on Linux and bytes on macOS; Windows has no `resource` module."""
    if resource is None:
        return "n/a (RSS: not measured on Windows)"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return f"{peak / (2**20 if sys.platform == 'darwin' else 2**10):.1f} MiB (RSS)"


class Meter:
    """Throughput of the training loop, timed the way a benchmark must be.

    CUDA kernels run asynchronously, so the clock is read only after synchronizing every GPU
    this process drives (`device`: one device, or a list of them, as model parallelism has);
    the first `warmup` steps (allocator, kernel selection, first communication) are not timed,
    unless the run is too short to have any other steps.
    """

    def __init__(self, device, warmup=3):
        devices = device if isinstance(device, (list, tuple)) else [device]
        self.gpus = sorted({d for d in devices if d.type == "cuda"}, key=str)
        self.warmup = warmup
        self.steps = self.samples = self.warm_samples = 0
        self.first_step = float("nan")
        self.start = self.last = self._now()
        self.warm_start = None

    def _now(self):
        for gpu in self.gpus:
            torch.cuda.synchronize(gpu)
        return time.perf_counter()

    @contextlib.contextmanager
    def paused(self):
        """Leave the time spent inside (evaluation, checkpoints) out of the training rates."""
        begin = self._now()
        yield
        gap = self._now() - begin
        self.start += gap
        self.last += gap
        if self.warm_start is not None:
            self.warm_start += gap

    def step(self, samples):
        """Call after each optimizer step; returns samples/s of that step."""
        now = self._now()
        rate = samples / max(now - self.last, 1e-9)
        self.last = now
        self.steps += 1
        self.samples += samples
        if self.steps == 1:
            # The first step pays for what happens once (torch.compile compiling, allocating,
            # connecting): reported apart, and never in samples/s.
            self.first_step = now - self.start
        if self.steps == self.warmup:
            self.warm_start, self.warm_samples = now, 0
        elif self.steps > self.warmup:
            self.warm_samples += samples
        return rate

    def summary(self, loss, model, val_loss, state_bytes=None):
        """The final line: steps, final loss, samples/s, step time, peak memory, `model`'s
        TFLOP/s, the first step's time, the bytes of training state each rank holds (if given),
        and the validation loss; for a mixture of experts, a line of the tokens each expert
        got over the run (balance() counts them, every rank's)."""
        if self.steps > self.warmup:
            timed, samples, elapsed = (self.steps - self.warmup, self.warm_samples,
                                       self.last - self.warm_start)
        else:
            timed, samples, elapsed = self.steps, self.samples, self.last - self.start
        rate = samples / max(elapsed, 1e-9)
        if self.gpus:
            # Summed over the GPUs this process drives. Allocated: what tensors held at the
            # peak. Reserved: what the caching allocator took from the GPU for them (the
            # figure nvidia-smi's share of this process is closer to, CUDA context aside).
            allocated = sum(torch.cuda.max_memory_allocated(gpu) for gpu in self.gpus)
            reserved = sum(torch.cuda.max_memory_reserved(gpu) for gpu in self.gpus)
            peak = (f"{allocated / 2**20:.1f} MiB allocated, {reserved / 2**20:.1f} MiB "
                    f"reserved (CUDA{f', {len(self.gpus)} GPUs' if len(self.gpus) > 1 else ''})")
        else:
            peak = peak_rss()
        line = (f"done | steps {self.steps} | final loss {loss:.6f} | {rate:.1f} samples/s"
                f" | {1e3 * elapsed / max(timed, 1):.2f} ms/step | peak mem {peak}")
        flops = getattr(model, "flops_per_sample", None)  # a model that counts its own
        if self.gpus and flops is not None:
            # The model's FLOPs, as MFU counts them (SimpleModel.flops_per_sample). `rate` is the
            # whole job's samples/s (the global batch), so this is the job's figure, not one
            # GPU's, and activation checkpointing's recomputation (about 2 more per weight per
            # token) is not in it.
            line += f" | {flops() * rate / 1e12:.2f} model TFLOP/s (job)"
        line += f" | first step {self.first_step:.2f} s"
        if state_bytes is not None:
            line += f" | state {state_bytes / 2**20:.3f} MiB/rank"
        line += f" | val loss {val_loss:.6f}"
        counts = getattr(model, "tokens_per_expert", None)
        if counts is not None:  # (blocks, experts): the busiest expert against the mean
            line += "\nexperts | tokens routed to each, per block: " + " | ".join(
                " ".join(f"{n:.0f}" for n in block) for block in counts.tolist())
            busiest = (counts.max(1).values / counts.double().mean(1)).max()
            line += f" | busiest / mean {busiest:.3f}"
        return line


class Profiler:
    """torch.profiler over a few steps after warm-up, one Chrome trace per rank.

    With `folder` None it does nothing. Otherwise steps 1-3 run unrecorded (warm-up: compile,
    allocation, first connections), step 4 warms the profiler up, steps 5-7 are recorded, and
    `folder`/trace_rank<R>.json is written: open it in https://ui.perfetto.dev or
    chrome://tracing. Recorded steps run slower (every op is timed, and its inputs' shapes
    kept), and the summary's samples/s includes them: profile and benchmark in separate runs.
    `device`: the run's device, or the list of them; GPU kernels are recorded only if one is.
    """

    def __init__(self, folder, rank, device, skip=3, warmup=1, active=3):
        self.prof = None
        if folder is None:
            return
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"trace_rank{rank}.json")
        activities = [torch.profiler.ProfilerActivity.CPU]
        devices = device if isinstance(device, (list, tuple)) else [device]
        if any(d.type == "cuda" for d in devices):
            # Only when this run uses a GPU: CUDA activity starts CUPTI and a CUDA context
            # (on GPU 0, in every rank) even for a run that never touches the GPU.
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(
            activities=activities, record_shapes=True,
            schedule=torch.profiler.schedule(skip_first=skip, wait=0, warmup=warmup,
                                             active=active, repeat=1),
            on_trace_ready=lambda prof: prof.export_chrome_trace(path))
        self.prof.start()
        print0(f"profiling steps {skip + warmup + 1}-{skip + warmup + active} into "
               f"{folder}/trace_rank*.json (those steps run slower)")

    def step(self):
        """Call once at the end of every training step."""
        if self.prof is not None:
            self.prof.step()

    def stop(self):
        if self.prof is not None:
            self.prof.stop()


def log_line(step, steps, loss, grad_norm, samples_per_s):
    """The per-step line every script prints, so their logs can be compared side by side.
    grad_norm: the whole gradient's norm, before --clip (7 significant digits)."""
    return (f"step {step:5d}/{steps} | loss {loss:.6f} | grad norm {grad_norm:.6e} | "
            f"{samples_per_s:10.1f} samples/s")


def eval_line(step, steps, val_loss):
    """The line printed after each evaluation on the held-out set."""
    return f"eval {step:5d}/{steps} | val loss {val_loss:.6f}"
