"""A user's model that is not SimpleModel: a small GPT-2, with GPT-2's names (wte, wpe, ln_1,
attn.c_attn, ...), one fused qkv layer, a head tied to the token embedding, dropout, and the
TP plan its user writes for it. docs/questions.md ("Putting your own model in") uses it as the
worked example; tests/test_own_model.py puts it into single.py, ddp.py, fsdp.py and tp.py by
one line at the end of a copy of common.py (`from gpt_like import SimpleModel`: the data and the
loss stay common.py's; it counts no FLOPs, so a GPU run prints no TFLOP/s) and proves each
equal to one device in float64.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import SEQ_LEN, VOCAB


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden, heads, dropout):
        super().__init__()
        self.head_width = hidden // heads  # the count is what c_attn holds: H/T after TP
        # q, k and v of every head in one layer, laid out head by head: output features
        # [q, k, v of head 0 | q, k, v of head 1 | ...], so that tp.py's column cut (each rank
        # T contiguous blocks of them) gives every rank whole heads of all three. GPT-2's own
        # layout, [q of every head | k of every head | v of every head], cut so, would give
        # rank 0 all of q and half of k (the bug zoo's fused qkv): permute GPT-2's rows to load
        # its weights. No bias: k's would get only rounding noise for a gradient (softmax
        # ignores it), which Adam turns into steps (common.py's Attention says more).
        self.c_attn = nn.Linear(hidden, 3 * hidden, bias=False)
        self.c_proj = nn.Linear(hidden, hidden)
        self.dropout = dropout

    def forward(self, x):
        batch, seq, _ = x.shape
        qkv = self.c_attn(x).view(batch, seq, -1, 3 * self.head_width).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)  # each (batch, heads, seq, head_width)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.c_proj(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.c_fc = nn.Linear(hidden, 4 * hidden)
        self.c_proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class GPTBlock(nn.Module):
    def __init__(self, hidden, heads, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads, dropout)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class SimpleModel(nn.Module):
    """GPT-2 in miniature, under the name the scripts import."""

    # Written as docs/course.md says: every layer TP cuts, by its own name. c_attn by columns
    # (whole heads, by its layout), c_proj by rows; the MLP likewise; the norms for SP; the
    # head for --loss-parallel, which tp.py refuses here: it would cut lm_head by vocabulary
    # and leave its tied twin, wte, whole.
    tp_plan = {"blocks.*.ln_1": "norm", "blocks.*.attn.c_attn": "colwise",
               "blocks.*.attn.c_proj": "rowwise", "blocks.*.ln_2": "norm",
               "blocks.*.mlp.c_fc": "colwise", "blocks.*.mlp.c_proj": "rowwise",
               "ln_f": "norm", "lm_head": "head"}

    def __init__(self, hidden=64, blocks=4, heads=4, dropout=0.0):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, hidden)
        self.wpe = nn.Embedding(SEQ_LEN, hidden)
        self.drop = nn.Dropout(dropout)
        # A ModuleDict called `blocks`, keyed "0", "1", ...: the scripts wrap, shard and
        # recompute each of its values (GPT-2's own is a ModuleList, `h`)
        self.blocks = nn.ModuleDict({str(i): GPTBlock(hidden, heads, dropout)
                                     for i in range(blocks)})
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2's: one parameter, two uses
        for module in self.modules():  # GPT-2's initialization
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    @classmethod
    def from_args(cls, args):
        # dropout 0: its masks are each process's own random draws, so no run with it equals
        # another; prove the model without it, then train with it
        return cls(args.hidden, args.blocks, args.heads, dropout=0.0)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device)
        x = self.drop(self.wte(x) + self.wpe(positions))
        for block in self.blocks.values():
            x = block(x)
        return self.lm_head(self.ln_f(x))  # the logits: a tensor, what loss_fn takes
