"""Local SGD with torch's own API, to prove diloco.py against: run by tests/test_diloco.py as
`torchrun --nproc_per_node=2 tests/local_sgd.py --inner-steps H --fp64 --save w.pt ...`.

PostLocalSGDOptimizer steps Adam, then lets PeriodicModelAverager average the weights over the
ranks when its counter c (0 at the first step, one more each step) has c >= warmup_steps and
(c - warmup_steps) % period == 0. With period H and warmup_steps H - 1 it averages after steps
H, 2H, ...; before, each rank steps alone (no DDP: nothing else communicates). That is
diloco.py with --outer-lr 1 --outer-momentum 0: outer - 1 x mean(outer - local) is
mean(local). Same data: DistributedSampler's shards, each rank's loss the mean over its own
shard's targets that count. Takes the scripts' flags it needs and ignores the rest.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import SimpleModel, loss_fn, make_dataset, seed_everything  # noqa: E402

parser = argparse.ArgumentParser()
for flag, kind in (("--steps", int), ("--batch-size", int), ("--lr", float), ("--seed", int),
                   ("--hidden", int), ("--blocks", int), ("--heads", int),
                   ("--inner-steps", int), ("--save", str)):
    parser.add_argument(flag, type=kind, required=True)
parser.add_argument("--fp64", action="store_true")
args, _ = parser.parse_known_args()

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
seed_everything(args.seed)  # the same weights on every rank, as diloco.py's broadcast makes them
model = SimpleModel(args.hidden, args.blocks, args.heads).to(
    torch.float64 if args.fp64 else torch.float32)
averager = PeriodicModelAverager(period=args.inner_steps, warmup_steps=args.inner_steps - 1)
# Adam, each rank's own state: the averager averages the weights only, as DiLoCo's outer step
optimizer = PostLocalSGDOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr), averager)

dataset = make_dataset()
sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                             seed=args.seed, drop_last=True)
loader = DataLoader(dataset, batch_size=args.batch_size // world_size, sampler=sampler,
                    drop_last=True)
for step in range(args.steps):
    epoch, index = divmod(step, len(loader))
    if index == 0:
        sampler.set_epoch(epoch)
        batches = iter(loader)
    x, y = next(batches)
    loss = loss_fn(model(x), y)  # this rank's own mean
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
if rank == 0:
    torch.save(model.state_dict(), args.save)
dist.destroy_process_group()
