"""Hugging Face's GPT-2 as the scripts' model: Conv1D layers, one fused qkv layer, a head tied to
the token embedding; built from a config (random init, no download). Put in by one line at the
end of common.py: `from hf_gpt2 import SimpleModel`.
"""

import torch.nn as nn
from transformers import GPT2Config, GPT2LMHeadModel

from common import SEQ_LEN, VOCAB


class SimpleModel(nn.Module):
    def __init__(self, hidden=64, blocks=4, heads=4):
        super().__init__()
        self.gpt = GPT2LMHeadModel(GPT2Config(  # dropout off: each rank's masks are its own
            vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=hidden, n_layer=blocks, n_head=heads,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa"))

    @classmethod
    def from_args(cls, args):
        return cls(args.hidden, args.blocks, args.heads)

    @property
    def blocks(self):  # registered once, in gpt.transformer.h (a ModuleList keyed "0", "1", ...)
        return dict(self.gpt.transformer.h.named_children())

    def forward(self, x):
        return self.gpt(x).logits
