"""CUDA's defaults, forced on the CPU: what a script's optimizer does on a GPU, proven here.

On CUDA tensors torch.optim's Adam (and clip_grad_norm_) take their foreach path by default:
one kernel over a list of tensors (torch/optim/optimizer.py, _default_to_fused_or_foreach).
On the CPU they loop over the tensors one by one. A bug that only the foreach path has (a list
mixing plain tensors and DTensors: "got mixed torch.Tensor and DTensor") would then pass every
CPU test and fail on the first GPU. force() makes the CPU count as a foreach device, so the
CPU runs take CUDA's path. (TF32, CUDA's other default that changes numbers, does not exist
on the CPU; the scripts switch it off on GPUs.)

A test launch asks for it with conftest.CUDA_DEFAULTS: this folder goes on PYTHONPATH, and
Python imports sitecustomize at start in every process, spawned workers too; the processes
tests/preloaded.py forks run this file. In the tests' own process: force(monkeypatch.setattr).
"""

import os


def force(setattr=setattr):
    import importlib
    optimizer = importlib.import_module("torch.optim.optimizer")  # torch.optim hides the name
    foreach_utils = importlib.import_module("torch.utils._foreach_utils")
    devices = foreach_utils._get_foreach_kernels_supported_devices

    def with_the_cpu():
        return [*devices(), "cpu"]
    setattr(foreach_utils, "_get_foreach_kernels_supported_devices", with_the_cpu)
    setattr(optimizer, "_get_foreach_kernels_supported_devices", with_the_cpu)


if os.environ.get("CUDA_DEFAULTS_ON_CPU") == "1":
    force()
