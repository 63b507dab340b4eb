"""What tensor parallelism leaves whole (norms, embeddings, the head), made a replicated DTensor
on the TP mesh, as tp.py and nd.py need it: beside DTensors a plain tensor stops Adam's foreach
path ("got mixed torch.Tensor and DTensor"), and clip_grad_norm_ must see one kind of tensor.
What the lesson shows is the call; this file holds what a user's model needs besides: each
parameter made a DTensor once (a head tied to its embedding stays one tensor, not two trained
apart, silently), and modules that take or return tuples of tensors."""

import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor


def replicate_the_rest(model, tp_mesh):
    """Every parameter of `model` that is not a DTensor yet becomes a replicated one on
    `tp_mesh`; the modules holding them take and give plain tensors, as before."""
    def replicated(_, inputs, mesh):
        return tuple(x if isinstance(x, DTensor) else
                     DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)

    def local(_, output, mesh):  # a tensor, or a tuple of them (a router's, say)
        return tuple(local(_, o, mesh) for o in output) if isinstance(output, tuple) else \
            output.to_local() if isinstance(output, DTensor) else output

    replicas = {}  # id of a plain parameter -> its DTensor: each made once

    def replicate_once(_, module, mesh):
        for key, p in list(module.named_parameters(recurse=False)):
            if not isinstance(p, DTensor):
                if id(p) not in replicas:  # as distribute_module's default makes it
                    replicas[id(p)] = torch.nn.Parameter(
                        distribute_tensor(p.data, mesh, [Replicate()]), p.requires_grad)
                module.register_parameter(key, replicas[id(p)])

    for module in model.modules():
        held = list(module.parameters(recurse=False))
        if held and not isinstance(held[0], DTensor):
            distribute_module(module, tp_mesh, replicate_once, input_fn=replicated,
                              output_fn=local)
