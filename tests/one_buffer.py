"""SimpleModel plus one non-persistent buffer that its forward uses: the smallest model on which
a script that builds on the meta device, or chains the model's parts, can go silently wrong (a
state_dict does not carry the buffer), and that a pipeline's stages chain to its forward."""

import torch

import common


class SimpleModel(common.SimpleModel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("scale", torch.full((), 2.0), persistent=False)

    def forward(self, x, positions=None):
        x = super().forward(x, positions)
        # Only where the head is: a pipeline's later stages run this forward too, on their part.
        return self.scale * x if self.output is not None else x
