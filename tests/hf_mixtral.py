"""Hugging Face's Mixtral as the scripts' model: a mixture of 4 experts, top-2, in every block,
its experts fused into one module (3-D weights); RoPE, grouped KV heads, RMSNorm. Built from a
config (random init, no download). Put in by one line at the end of common.py:
`from hf_mixtral import SimpleModel`. Dense flags only: it has no `routed()`, and so no
--experts (its own balancing loss is off, as Hugging Face's default).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import MixtralConfig, MixtralForCausalLM

from common import SEQ_LEN, VOCAB


def route(router, x):
    """Mixtral's router, in the input's dtype: Hugging Face's computes its softmax in fp32, an
    fp32 island that parts two correct --fp64 runs by ~1e-8."""
    probs = F.softmax(F.linear(x.reshape(-1, router.hidden_dim), router.weight), dim=-1)
    weights, chosen = probs.topk(router.top_k, dim=-1)
    return None, weights / weights.sum(dim=-1, keepdim=True), chosen


class SimpleModel(nn.Module):
    def __init__(self, hidden=64, blocks=4, heads=4):
        super().__init__()
        self.mixtral = MixtralForCausalLM(MixtralConfig(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=blocks, num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2), num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=SEQ_LEN, attn_implementation="sdpa",
            experts_implementation="eager"))  # the default, grouped_mm, takes no float64
        for layer in self.mixtral.model.layers:
            layer.mlp.gate.forward = route.__get__(layer.mlp.gate)
            for name, norm in [("input_layernorm", layer.input_layernorm),
                               ("post_attention_layernorm", layer.post_attention_layernorm)]:
                setattr(layer, name, nn.RMSNorm(hidden, eps=norm.variance_epsilon))  # fp32 too
        self.mixtral.model.norm = nn.RMSNorm(hidden, eps=self.mixtral.model.norm.variance_epsilon)

    @classmethod
    def from_args(cls, args):
        return cls(args.hidden, args.blocks, args.heads)

    @property
    def blocks(self):
        return dict(self.mixtral.model.layers.named_children())

    def forward(self, x):
        return self.mixtral(x).logits
