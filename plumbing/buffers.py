"""Buffers of a model built on the meta device, as one device has them.

A state_dict carries the parameters and the persistent buffers only: set_model_state_dict
after to_empty() leaves every non-persistent buffer (RoPE's inv_freq in every Llama, Mistral,
Qwen and Gemma; a causal mask; a sinusoidal table) holding uninitialized memory, different
garbage on each rank, and training goes on silently wrong. fill_buffers sends rank 0's.
"""

import torch
import torch.distributed as dist
import torch.nn as nn


def fill_buffers(model, source, device, full=None):
    """Set every buffer of `model` (fsdp.py's, tp.py's: built on "meta", then to_empty; or
    nd.py's list of this rank's stages) to the one of the same name in `source`, rank 0's
    model on its CPU (None on the other ranks), on `device`: a broadcast per buffer, persistent
    ones too (the same values again). Every rank broadcasts the buffers of `full` (default
    `model`; nd.py: the whole model on "meta", which every rank has), in one order, and keeps
    those its modules hold."""
    models = [model] if isinstance(model, nn.Module) else list(model)
    for name, like in sorted((full or models[0]).named_buffers()):
        if dist.get_rank() == 0:
            value = source.get_buffer(name).to(device, like.dtype)
        else:  # the shape and dtype are the meta model's; the values come from rank 0
            value = torch.empty(like.shape, dtype=like.dtype, device=device)
        dist.broadcast(value, src=0)
        owner, _, leaf = name.rpartition(".")
        for m in models:  # as nn.Module sets a registered buffer: its persistence kept
            if name in dict(m.named_buffers()):
                setattr(m.get_submodule(owner), leaf, value)
