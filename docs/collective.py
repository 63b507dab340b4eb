"""Lesson 0 of docs/course.md: the four calls under every script here, and nothing else.

    torchrun --nproc_per_node=2 docs/collective.py

Each rank prints the sum it received: [3.0, 3.0, 3.0, 3.0] on both (rank 0 gave 1s, rank 1 2s).
"""

import datetime
import os

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])  # torchrun gives each process its rank (and the rendezvous)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # 1. join
x = torch.full((4,), float(rank + 1))
dist.all_reduce(x)            # 2. a collective: every rank ends with the sum, 1 + 2 = 3
dist.barrier()                # 3. nobody goes on until everybody is here
print(f"rank {rank}: {x.tolist()}", flush=True)
dist.destroy_process_group()  # 4. leave
