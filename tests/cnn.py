"""A model of one's own that is no transformer: a causal 1-D CNN over the tokens, with
GroupNorm (over the channels and the whole sequence of each sample) and a sinusoidal position
table (a non-persistent buffer). Put in by one line at the end of common.py:
`from cnn import SimpleModel`.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import SEQ_LEN, VOCAB


class Block(nn.Module):
    def __init__(self, hidden, width=3):
        super().__init__()
        self.norm = nn.GroupNorm(4, hidden)  # each sample's statistics, over all its positions
        self.conv = nn.Conv1d(hidden, hidden, width, padding=width - 1)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):  # (batch, sequence, hidden)
        h = self.conv(self.norm(x.transpose(1, 2)))[..., :x.shape[1]]  # causal: the past only
        return x + self.out(F.gelu(h.transpose(1, 2)))


class SimpleModel(nn.Module):
    def __init__(self, hidden=64, blocks=4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        angle = torch.arange(SEQ_LEN)[:, None] / 100 ** (torch.arange(0, hidden, 2) / hidden)
        table = torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(1) / math.sqrt(hidden)
        self.register_buffer("table", table, persistent=False)  # made, not learned: not saved
        self.blocks = nn.ModuleDict({str(i): Block(hidden) for i in range(blocks)})
        self.head = nn.Linear(hidden, VOCAB)

    @classmethod
    def from_args(cls, args):
        return cls(args.hidden, args.blocks)

    def forward(self, x):
        x = self.embed(x) + self.table[:x.shape[1]]
        for block in self.blocks.values():
            x = block(x)
        return self.head(x)
