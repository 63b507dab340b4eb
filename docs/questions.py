"""Measures the answers in docs/questions.md that the scripts cannot show themselves, on 2 CPU
ranks over gloo (a laptop is enough):

    python docs/questions.py syncbn   # BatchNorm across ranks: per-rank statistics against
                                      # global ones (what SyncBatchNorm does), their cost, and
                                      # the trap in evaluation
    python docs/questions.py join     # uneven inputs: a collective that waits, and Join
    python docs/questions.py loader   # a real dataset: workers, seeds per worker, resuming
                                      # without reading the skipped batches
    python docs/questions.py          # all three

Each prints what it measured; docs/questions.md quotes it (the tests do not run it: its timeouts
wait 3 s each).
"""

import contextlib
import datetime
import itertools
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler

WORLD = 2


def free_port():
    """A TCP port free now on 127.0.0.1, picked by the OS."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(rank, port, timeout_s=60):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=timeout_s))


def say(rank, *args):
    if rank == 0:
        print(*args, flush=True)


# --- BatchNorm across ranks ---

class AllReduceSum(torch.autograd.Function):
    """The sum over the ranks, differentiable: each rank's input feeds every rank's output, so
    backward sums the ranks' gradients the same way (what SyncBatchNorm's backward does)."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class GlobalBatchNorm(nn.BatchNorm1d):
    """What SyncBatchNorm does, written out: in training, the statistics of the whole global
    batch (sums all-reduced over the ranks, differentiably: backward all-reduces too). (The real
    one runs on GPUs only: on a CPU it raises "SyncBatchNorm expected input tensor to be on
    GPU".) In eval(), the running statistics: nothing to communicate."""

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        f = x.shape[1]
        sums = AllReduceSum.apply(torch.cat([x.sum(0), (x * x).sum(0), x.new_tensor([len(x)])]))
        mean, n = sums[:f] / sums[-1], sums[-1]
        var = sums[f:2 * f] / n - mean * mean
        with torch.no_grad():
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


def bn_model(norm):
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 32), norm(32), nn.ReLU(), nn.Linear(32, 1)).double()


def syncbn(rank, port):
    join_group(rank, port, timeout_s=3)
    torch.manual_seed(0)
    x, y = torch.randn(16, 8).double(), torch.randn(16, 1).double()  # 8 samples per rank
    one = bn_model(nn.BatchNorm1d)
    F.mse_loss(one(x), y).backward()  # one device, the whole batch
    mine = slice(8 * rank, 8 * rank + 8)
    for norm in (nn.BatchNorm1d, GlobalBatchNorm):
        model = DDP(bn_model(norm))
        F.mse_loss(model(x[mine]), y[mine]).backward()
        gap = max((p.grad - q.grad).abs().max().item()
                  for p, q in zip(model.parameters(), one.parameters()))
        running = (model.module[1].running_mean - one[1].running_mean).abs().max().item()
        steps, start = 300, time.perf_counter()
        for _ in range(steps):
            F.mse_loss(model(x[mine]), y[mine]).backward()
        dist.barrier()
        ms = 1e3 * (time.perf_counter() - start) / steps
        say(rank, f"{norm.__name__:15}: gradient {gap:.1e} and running mean {running:.1e} from "
                  f"one device's | {ms:.2f} ms per forward+backward (2 ranks, float64)")
    model = bn_model(GlobalBatchNorm)
    if rank == 0:
        model.eval()
        start = time.perf_counter()
        model(x[mine])  # running statistics: no peer needed
        say(rank, f"eval(), rank 0 alone: {1e3 * (time.perf_counter() - start):.2f} ms")
        model.train()
        start = time.perf_counter()
        try:
            model(x[mine])  # the batch statistics: a collective rank 1 never joins
            say(rank, "train(), rank 0 alone: returned (unexpected)")
        except RuntimeError as e:
            say(rank, f"train(), rank 0 alone: {type(e).__name__} after "
                      f"{time.perf_counter() - start:.1f} s (the group's 3 s timeout)")
    else:
        time.sleep(5)  # alive, but never in that collective
    os._exit(0)  # rank 0's group timed out: leave without tearing it down


# --- Join ---

def join(rank, port):
    join_group(rank, port, timeout_s=3)
    batches = [5, 3][rank]  # rank 1 runs out of data first
    for use_join in (True, False):
        torch.manual_seed(0)
        model = DDP(nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        start = time.perf_counter()
        try:
            # Join: a rank that has run out shadows the others' all-reduces (with zeros) until
            # all are done, so nobody waits for a peer that is gone.
            with Join([model]) if use_join else contextlib.nullcontext():
                for _ in range(batches):
                    F.mse_loss(model(torch.ones(2, 4)), torch.zeros(2, 1)).backward()
                    optimizer.step()
                    optimizer.zero_grad()
        except RuntimeError:
            say(rank, f"without Join: rank 0's 4th step waits in its all-reduce, then fails "
                      f"after {time.perf_counter() - start:.1f} s (the group's 3 s timeout)")
            break
        if not use_join:
            time.sleep(4)  # rank 1, done: alive, but never in rank 0's 4th all-reduce
            break
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        gathered = [torch.zeros_like(weights) for _ in range(WORLD)]
        dist.all_gather(gathered, weights)
        say(rank, f"with Join: rank 0 ran 5 steps, rank 1 ran 3, both done in "
                  f"{time.perf_counter() - start:.2f} s, the replicas "
                  f"{(gathered[0] - gathered[1]).abs().max().item():.1e} apart")
    os._exit(0)  # rank 0's group timed out: leave without tearing it down


# --- A real dataset ---

class OnDisk(Dataset):
    """Samples read from a memory-mapped file, with some work per sample (decoding, say)."""

    def __init__(self, path, n, features=32, augment=True):
        self.path, self.n, self.features, self.augment = path, n, features, augment
        self.data = None  # opened in each worker: a file handle does not survive fork/pickle

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.data is None:
            self.data = torch.from_file(self.path, size=self.n * self.features,
                                        dtype=torch.float32).view(self.n, self.features)
        x = self.data[i].clone()
        for _ in range(200):  # the per-sample work a real pipeline does (decode, augment)
            x = torch.tanh(x)
        return x + 0.01 * torch.randn(self.features) if self.augment else x  # random noise


class FromPosition(Sampler):
    """The epoch's order (seeded, the same on every run) from position `start` on: a resume
    that skips indices instead of reading and dropping the batches before it."""

    def __init__(self, n, seed, start=0):
        self.n, self.seed, self.start = n, seed, start

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed))
        return iter(order[self.start:].tolist())

    def __len__(self):
        return self.n - self.start


def worker_seed(worker_id):
    # Only shows the seeds: the DataLoader seeds each worker's torch, random and numpy from its
    # generator (base seed + worker id) itself, so they differ between workers and repeat
    # from run to run with no worker_init_fn.
    import random
    import numpy
    info = torch.utils.data.get_worker_info()
    print(f"  worker {worker_id}: torch seed {info.seed}, first random.random() "
          f"{random.random():.6f}, first numpy.random.rand() {numpy.random.rand():.6f}",
          flush=True)


def loader():
    n, batch = 4096, 64
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "data.bin")
        torch.randn(n * 32).numpy().tofile(path)
        data = OnDisk(path, n)
        for workers in (0, 1, 2):
            dl = DataLoader(data, batch_size=batch, sampler=FromPosition(n, seed=0),
                            num_workers=workers, persistent_workers=workers > 0,
                            generator=torch.Generator().manual_seed(0))
            start = time.perf_counter()
            for _ in dl:
                pass
            rate = n / (time.perf_counter() - start)
            print(f"num_workers {workers}: {rate:.0f} samples/s (one epoch, {os.cpu_count()} "
                  f"cores)", flush=True)
        print("seeds per worker, two runs with the same generator seed:", flush=True)
        for _ in range(2):
            dl = DataLoader(data, batch_size=batch, num_workers=2, worker_init_fn=worker_seed,
                            generator=torch.Generator().manual_seed(0))
            next(iter(dl))
        skip = 48  # resume at batch 48 of 64
        data = OnDisk(path, n, augment=False)  # no random noise: the batches can be compared
        dl = DataLoader(data, batch_size=batch, sampler=FromPosition(n, seed=0))
        start = time.perf_counter()
        first = next(itertools.islice(iter(dl), skip, None))
        by_reading = time.perf_counter() - start
        dl = DataLoader(data, batch_size=batch,
                        sampler=FromPosition(n, seed=0, start=skip * batch))
        start = time.perf_counter()
        same = next(iter(dl))
        by_index = time.perf_counter() - start
        print(f"resume at batch {skip}: islice reads and drops {skip} batches, {by_reading:.2f} s; "
              f"the sampler from position {skip * batch}, {by_index:.3f} s; the same batch: "
              f"{torch.equal(first, same)}", flush=True)


def spawned(rank, name, port):
    {"syncbn": syncbn, "join": join}[name](rank, port)


def main(names):
    for name in names or ["syncbn", "join", "loader"]:
        print(f"== {name}", flush=True)
        if name == "loader":
            loader()
        else:
            mp.spawn(spawned, args=(name, free_port()), nprocs=WORLD)


if __name__ == "__main__":
    main(sys.argv[1:])
