"""A user's model: the collection's previous SimpleModel, a regression MLP, with its data and its
loss. tests/test_own_model.py puts it into the scripts the way docs/questions.md ("Putting your own
model in") says: common.py's three names point here, and nothing else changes.

The scripts build `SimpleModel.from_args(args)` and wrap, shard and checkpoint `model.blocks`
one by one; so this model takes the flags it needs (--hidden, --blocks: an MLP has no heads)
and keeps its repeated layers in a ModuleDict called `blocks`.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

IN_FEATURES, OUT_FEATURES, SIZE, VAL_SIZE = 32, 8, 2048, 1000


class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class SimpleModel(nn.Module):
    def __init__(self, hidden=64, blocks=4, heads=None):  # heads: an MLP has none
        super().__init__()
        self.input = nn.Linear(IN_FEATURES, hidden)
        self.blocks = nn.ModuleDict({str(i): Block(hidden) for i in range(blocks)})
        self.output = nn.Linear(hidden, OUT_FEATURES)

    @classmethod
    def from_args(cls, args):
        return cls(args.hidden, args.blocks)

    def flops_per_sample(self):  # what the summary's TFLOP/s counts, on a GPU
        return 6 * sum(p.numel() for p in self.parameters())

    def forward(self, x):
        x = self.input(x.to(self.input.weight.dtype))  # float data in fp32: under --fp64, cast
        for block in self.blocks.values():
            x = block(x)
        return self.output(x)


def make_dataset(split="train", kind="repeat"):
    """y = a fixed random two-layer network of x, plus noise: float32, as data usually is."""
    g = torch.Generator().manual_seed(1234)
    w1 = torch.randn(IN_FEATURES, 64, generator=g) / IN_FEATURES**0.5
    w2 = torch.randn(64, OUT_FEATURES, generator=g) / 64**0.5
    x = torch.randn(SIZE if split == "train" else VAL_SIZE, IN_FEATURES, generator=g)
    y = torch.tanh(x @ w1) @ w2 + 0.01 * torch.randn(len(x), OUT_FEATURES, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def loss_fn(output, targets, reduction="mean"):
    """Mean squared error; reduction="sum" adds up over targets.numel() values, as evaluation
    needs."""
    return F.mse_loss(output, targets.to(output.dtype), reduction=reduction)

