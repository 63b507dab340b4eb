"""Diagnostics: what this machine has, and whether its ranks can talk.

    python -m plumbing.diagnostics                  what this machine has, and the launch that fits
    torchrun --nproc_per_node=2 -m plumbing.diagnostics     can the ranks talk, and how fast
    torchrun --nproc_per_node=2 -m plumbing.diagnostics --device cpu   the same over gloo
"""

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from plumbing.flags import most_workers
from plumbing.meter import print0
from plumbing.ranks import gpu_sharers, rendezvous_store


def environment_report():
    """Versions, GPUs, peer access, process-group backends, and the launch command that fits."""
    lines = [f"torch {torch.__version__} | python {sys.version.split()[0]} | "
             f"{os.cpu_count()} CPU cores | {torch.get_num_threads()} torch threads"]
    gpus = torch.cuda.device_count()
    if gpus:
        lines.append(f"CUDA {torch.version.cuda} | cuDNN {torch.backends.cudnn.version()} | "
                     f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
        for i in range(gpus):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i} {p.name} | {p.total_memory / 2**30:.1f} GiB | "
                         f"compute capability {p.major}.{p.minor} | "
                         f"bf16 {'yes' if p.major >= 8 else 'no (use fp16 + GradScaler)'}")
        for i in range(gpus):
            for j in range(i + 1, gpus):
                # Without peer access, GPU-to-GPU copies bounce through host memory.
                ok = torch.cuda.can_device_access_peer(i, j)
                lines.append(f"peer access cuda:{i} <-> cuda:{j}: {'yes' if ok else 'no'}")
    else:
        lines.append("CUDA: no GPU visible" + (" (CPU-only build of torch)"
                                               if torch.version.cuda is None else ""))
    backends = [name for name, available in (("gloo", dist.is_gloo_available()),
                                             ("nccl", dist.is_nccl_available()),
                                             ("mpi", dist.is_mpi_available()))
                if available]
    lines.append(f"process-group backends: {', '.join(backends)}")
    # What `python ddp.py` starts: as many ranks as divide its default --batch-size 64.
    nproc = most_workers(gpus, 64)
    lines.append(f"launch: torchrun --nproc_per_node={nproc} ddp.py   "
                 f"({'one rank per GPU, NCCL' if gpus else 'CPU ranks over gloo'}"
                 f"{f'; {nproc} of {gpus} GPUs divide --batch-size 64' if nproc < gpus else ''})"
                 f"; check first: torchrun --nproc_per_node={nproc} -m plumbing.diagnostics")
    return "\n".join(lines)


def communication_check(device="auto", timeout_s=60, sizes=tuple(4**k for k in range(7, 13)),
                        iters=10):
    """Under torchrun: verify an all-reduce on every rank, then measure its bandwidth.
    device "auto": NCCL on GPUs when every rank has one of its own, else gloo on the CPU."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = rendezvous_store(rank, world, timeout_s)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()) \
        if device != "cpu" and torch.cuda.is_available() else torch.device("cpu")
    use_nccl = device.type == "cuda" and gpu_sharers(store, device) == 1
    if use_nccl:
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # A peer that never arrives, or cannot be reached, ends in an error after timeout_s.
    # device_id binds NCCL to this rank's GPU (else barrier() guesses it, with a warning).
    dist.init_process_group("nccl" if use_nccl else "gloo", store=store, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if use_nccl else None)
    backend = dist.get_backend()
    x = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(x)
    expected = world * (world + 1) / 2
    if not torch.all(x == expected):
        raise SystemExit(f"rank {rank}: all-reduce gave {x.tolist()}, expected {expected}")
    dist.barrier()
    print0(f"all-reduce verified on {world} ranks ({backend}, {device.type}); barrier passed")
    print0(f"{'bytes':>12} {'time (us)':>12} {'algbw (GB/s)':>14} {'busbw (GB/s)':>14}")
    for numel in sizes:
        t = torch.ones(numel, device=device)
        for _ in range(2):  # warm-up: connection setup, buffers
            dist.all_reduce(t)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / iters
        # nccl-tests' definitions: algbw = bytes / time; busbw = algbw * 2(n-1)/n, what each
        # link carries in a ring all-reduce, comparable to the hardware's link bandwidth.
        algbw = numel * 4 / seconds / 1e9
        print0(f"{numel * 4:12d} {seconds * 1e6:12.1f} {algbw:14.3f} "
               f"{algbw * 2 * (world - 1) / world:14.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="what this machine has; under torchrun, whether its ranks can talk")
    parser.add_argument("--device", choices=["auto", "cpu"], default="auto",
                        help="under torchrun: cpu checks gloo on the CPU even where GPUs are")
    args = parser.parse_args()
    if "RANK" in os.environ:
        communication_check(args.device)
    else:
        print(environment_report())
