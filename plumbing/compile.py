"""Whether torch.compile can work on this machine, told in one line before any process starts
(check_shared_flags asks it for --compile), and which torch this is."""

import os
import shutil
import sysconfig

import torch


def torch_older_than(major, minor):
    """Whether this torch is older than major.minor."""
    return tuple(int(v) for v in torch.__version__.split(".")[:2]) < (major, minor)


def compile_problem(use_cuda, fp64=False):
    """Why --compile cannot work on this machine, as a one-line error, or None if it can.

    torch.compile fails late and at length (a compiler's traceback from inside the first
    step, in every process) where it could be told at once what is missing.
    """
    try:  # on a Python it does not support, torch.compile says so at once
        torch.compile(lambda: None)
    except RuntimeError as e:
        return f"--compile: {e}; use a Python that torch.compile supports, or drop --compile"
    if not use_cuda:
        if shutil.which(os.environ.get("CXX", "g++")) is None:
            return ("--compile on the CPU: inductor compiles C++ and finds no compiler "
                    "(g++, or $CXX); install one (apt-get install g++) or drop --compile")
        # Before 2.13 the compiled causal attention's backward fails in float64 ("expected
        # scalar type Double but found Float"; docs/torch-versions.md says which versions).
        if fp64 and torch_older_than(2, 13):
            return (f"--compile with --fp64 on the CPU: torch {torch.__version__}'s compiled "
                    "attention fails in backward in float64 (pytorch/pytorch#185539); use "
                    "torch 2.13 or later, or drop one of the two flags")
        return None
    # On a GPU inductor writes Triton kernels, and Triton builds each kernel's launcher as a
    # small C extension module: with $CC, else gcc, else clang, against Python.h.
    if shutil.which(os.environ.get("CC", "")) is None and shutil.which("gcc") is None \
            and shutil.which("clang") is None:
        return ("--compile on a GPU: Triton builds its kernel launchers with a C compiler and "
                "finds none ($CC, gcc or clang); install one (apt-get install gcc) or drop "
                "--compile")
    if not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        return ("--compile on a GPU: Triton builds its kernel launchers against Python's "
                "headers and finds no Python.h; install them (apt-get install python3-dev) "
                "or drop --compile")
    return None
