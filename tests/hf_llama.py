"""Hugging Face's Llama as the scripts' model: RoPE (a non-persistent buffer, inv_freq), grouped
KV heads (half as many as the query heads), RMSNorm, SwiGLU; built from a config (random init,
no download). Put in by one line at the end of common.py: `from hf_llama import SimpleModel`.
"""

import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM

from common import SEQ_LEN, VOCAB


class SimpleModel(nn.Module):
    tied = False  # Llama 3.2 1B and 3B tie the head to the embedding: Tied, below
    # Hugging Face's base_model_tp_plan, prefixed with where the layers sit in this model; the
    # norms named so that --sequence-parallel cuts the sequence there, the head for --loss-parallel.
    tp_plan = {"llama.model.layers.*.input_layernorm": "norm",
               "llama.model.layers.*.post_attention_layernorm": "norm",
               **{f"llama.model.layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"},
               "llama.model.layers.*.self_attn.o_proj": "rowwise",
               "llama.model.layers.*.mlp.gate_proj": "colwise",
               "llama.model.layers.*.mlp.up_proj": "colwise",
               "llama.model.layers.*.mlp.down_proj": "rowwise",
               "llama.model.norm": "norm", "llama.lm_head": "head"}

    def __init__(self, hidden=64, blocks=4, heads=4):
        super().__init__()
        self.llama = LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=4 * hidden,
            num_hidden_layers=blocks, num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2), max_position_embeddings=SEQ_LEN,
            tie_word_embeddings=self.tied, attn_implementation="sdpa"))
        # Its RMSNorm computes in fp32 whatever the weights' dtype: under --fp64 an fp32 island
        # that parts two correct runs by ~1e-8. torch's nn.RMSNorm computes in the input's dtype;
        # same name (weight), same eps, so Hugging Face's weights load into it.
        for path, norm in list(self.llama.named_modules()):
            if type(norm).__name__ == "LlamaRMSNorm":
                parent, _, name = path.rpartition(".")
                setattr(self.llama.get_submodule(parent), name,
                        nn.RMSNorm(hidden, eps=norm.variance_epsilon))

    @classmethod
    def from_args(cls, args):
        return cls(args.hidden, args.blocks, args.heads)

    @property
    def blocks(self):  # registered once, in llama.model.layers (a ModuleList keyed "0", "1", ...)
        return dict(self.llama.model.layers.named_children())

    def forward(self, x):
        return self.llama(x).logits


class Tied(SimpleModel):  # the head is the token embedding (Llama 3.2 1B and 3B)
    tied = True
