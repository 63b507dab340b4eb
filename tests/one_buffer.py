"""SimpleModel plus one non-persistent buffer that its forward uses: the smallest model on which
a script that builds on the meta device, or chains the model's parts, can go silently wrong (a
state_dict does not carry the buffer; the pipeline's stages must not apply it twice)."""

import torch

import common


class SimpleModel(common.SimpleModel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("scale", torch.full((), 2.0), persistent=False)

    def forward(self, x, positions=None):
        return self.scale * super().forward(x, positions)
