"""A checkpoint's bookkeeping: saved atomically, on the CPU, with the train state that says
whether a run can continue it; one device's file gathered from ranks that each hold a slice
of the model (ep.py, pipeline.py, nd.py, cp.py --fsdp), and each rank's share of Adam's state
read back from it; one device's file read as data and checked before anything loads it.
Every script's save_checkpoint and load_checkpoint call these; what a learner must see stays
in the script (load_state_dict, the unwrap, DCP, what each rank holds).
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import common
from plumbing.ranks import fail


def to_cpu(obj):
    """A copy of `obj` (tensors, possibly inside dicts, lists and tuples) with every tensor on
    the CPU. A file of CUDA tensors does not load on a machine without a GPU unless the reader
    knows to pass map_location ("Attempting to deserialize object on a CUDA device")."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def save_atomic(obj, path):
    """torch.save of CPU copies of `obj` that never leaves a half-written file at `path`.

    Write a temporary file in the same folder, flush it to disk, then os.replace() it over
    `path` in one step: a crash at any moment leaves either the old file or the new one.
    (Same folder, because os.replace is atomic only within one filesystem.) The tensors go to
    the CPU first, so weights trained on a GPU load on a laptop with a plain torch.load.
    """
    obj = to_cpu(obj)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def read_checkpoint(args, script, mmap=False):
    """What --checkpoint holds, read as data (a dict: "model", "optimizer", "step", ...), or
    None where the file does not exist yet. One that cannot be read, that holds another
    model's weights, or that this run cannot continue (check_resumable) stops the run with one
    line naming `script` (its __file__), and is left as it was. mmap: read pages on use."""
    if not os.path.exists(args.checkpoint):
        return None

    def refuse(why):
        fail(f"{os.path.basename(script)}: error: --checkpoint {args.checkpoint}: {why}")

    try:
        # weights_only: a checkpoint is data, and unpickling arbitrary objects runs code.
        # map_location cpu: a checkpoint written on a GPU loads on any machine, and Adam's step
        # counters stay CPU scalars (on a GPU they would cost a sync per parameter per step);
        # load_state_dict then copies the weights and the moments to their device.
        state = torch.load(args.checkpoint, map_location="cpu", weights_only=True, mmap=mmap)
        # Names and shapes checked against one device's model on "meta": nothing copied
        one_device(args).load_state_dict({k: v.to("meta") for k, v in state["model"].items()})
    except Exception as e:  # truncated, not a torch file, not a dict, another model size...
        refuse(unloadable(e))  # what is wrong with it, and what to do
    check_resumable(state, args, refuse)  # the same --batch-size, --seed, --fp64, --dtype
    return state


def unloadable(error):
    """Why a checkpoint's model weights did not load (the exception torch.load or
    load_state_dict raised), and what to do, for the one-line refusal."""
    text = str(error)
    if '"module.' in text and "Unexpected key" in text:
        # ddp_model.state_dict(): the wrapper names each weight module.<name>
        return ("its weights are named module.<name>: saved from the DDP wrapper's state_dict; "
                "save model.state_dict() (the wrapped model, ddp_model.module) instead, or "
                "strip the prefix")
    if "size mismatch" in text or "Missing key" in text:
        return "saved with another model size; use its --hidden and --blocks"
    return f"cannot be read ({type(error).__name__}); move it away or point elsewhere"


def one_device(args, dtype=torch.float32):
    """The model one device trains with these flags, on "meta": every name and shape, in one
    device's order, and no storage."""
    with torch.device("meta"):
        return common.SimpleModel.from_args(args).to(dtype)


def optimizer_share(full_state, args, held):
    """The part of one device's Adam state_dict (`full_state`, its parameters numbered in one
    device's order: one_device(args)'s) that belongs to the parameters `held` (a module's, or
    a list of names: a stage's, a rank's experts'), numbered from 0 in their order, as their
    optimizer numbers them: one device's checkpoint, resumed by ranks that hold its slices."""
    if isinstance(held, nn.Module):
        held = [name for name, _ in held.named_parameters()]
    index = {name: i for i, (name, _) in enumerate(one_device(args).named_parameters())}
    group = dict(full_state["param_groups"][0], params=list(range(len(held))))
    return {"state": {i: full_state["state"][index[name]] for i, name in enumerate(held)},
            "param_groups": [group]}


def named_adam(full_state, args, held=None):
    """One device's Adam state_dict (its parameters numbered as one_device(args)'s) keyed by
    parameter name instead, as set_optimizer_state_dict(full_state_dict=True) takes it, which
    then cuts each tensor as its parameter is cut (FSDP's shards, TP's); `held`: a module
    whose names are a slice of one device's (a pipeline stage), else every parameter."""
    index = {name: i for i, (name, _) in enumerate(one_device(args).named_parameters())}
    held = list(index) if held is None else [name for name, _ in held.named_parameters()]
    group = dict(full_state["param_groups"][0], params=held)
    return {"state": {name: full_state["state"][index[name]] for name in held},
            "param_groups": [group]}


ADAM = ("step", "exp_avg", "exp_avg_sq")  # Adam's state per parameter: a count, two moments


def gather_full_state(args, parts):
    """One device's checkpoint of a model whose pieces the ranks hold (a rank's experts, a
    pipeline's stages, their TP and FSDP shards): the state_dict of one_device(args) and its
    Adam's, numbered as one device's Adam numbers it, on rank 0's CPU; (None, None) on the
    others. A collective: every rank calls it. `parts`: the (module, optimizer) pairs this
    rank holds, named as one device's model (a stage cut from a copy, a model whose other
    experts were deleted); optimizer None: the weights only.

    Each tensor travels once, from the lowest rank that holds it (the others hold a copy, or
    shards the all-gather takes), in one device's order: rank 0 receives it through its device
    (NCCL sends GPU tensors only) into a CPU tensor before the next, so its device never holds
    more than one of another rank's tensors. A DTensor is made whole (full_tensor(): an
    all-gather over the ranks that hold it, every one of them taking part) one at a time too,
    freed before the next. Plain sends, not gather_object (pickles): rank 0 knows every name
    and shape from the flags."""
    with_adam = parts[0][1] is not None
    held = {}  # name: its weight, then Adam's tensors, as this rank holds them
    for module, optimizer in parts:
        held.update({name: [tensor] for name, tensor in module.state_dict().items()})
        for name, p in module.named_parameters() if with_adam else ():
            held[name] += [optimizer.state[p][key] for key in ADAM]
    some = next(parts[0][0].parameters())  # its device, what the tensors travel through
    device, full, rank = some.device, one_device(args, some.dtype), dist.get_rank()
    shapes, params = full.state_dict(), dict(full.named_parameters())
    # Each name's sender, the lowest rank that holds it: an all-reduce, so every rank knows
    senders = torch.tensor([rank if name in held else dist.get_world_size() for name in shapes],
                           device=device)
    dist.all_reduce(senders, op=dist.ReduceOp.MIN)
    kept = {}  # on rank 0: (name, 0) its weight, (name, 1 + i) Adam's ADAM[i]
    for (name, shape), sender in zip(shapes.items(), senders.tolist()):
        # Adam's step: a scalar in the default float dtype, as Adam makes it
        likes = [shape, torch.zeros(()), shape, shape] if with_adam and name in params else [shape]
        for j, like in enumerate(likes):
            if name in held:
                tensor = held[name][j]
                whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                if rank == 0:
                    kept[name, j] = whole.cpu()
                elif rank == sender:
                    dist.send(whole.contiguous().to(device), dst=0)
                del whole  # now, not when the next is gathered: else two are whole at once
            elif rank == 0:
                received = torch.empty_like(like, device=device)
                dist.recv(received, src=sender)
                kept[name, j] = received.cpu()
    if rank > 0:
        return None, None
    weights = {name: kept[name, 0] for name in shapes}
    if not with_adam:
        return weights, None
    group = dict(parts[0][1].state_dict()["param_groups"][0], params=list(range(len(params))))
    adam = {i: {key: kept[name, 1 + j] for j, key in enumerate(ADAM)}
            for i, name in enumerate(params)}
    return weights, {"state": adam, "param_groups": [group]}


def every_rank(state, device):
    """Every rank's `state` (nested dicts of tensors, the same names, shapes and dtypes on every
    rank: DiLoCo's replicas' weights and optimizers) on rank 0's CPU, a list in rank order;
    None on the others. A collective. Tensor by tensor through `device` (NCCL sends GPU tensors
    only), sent and received, never pickled: what a peer sends is data."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if isinstance(state, dict):
        parts = {key: every_rank(value, device) for key, value in state.items()}
        return [{key: part[r] for key, part in parts.items()} for r in range(world_size)] \
            if rank == 0 else None
    if not torch.is_tensor(state):  # param_groups' numbers: the same on every rank
        return [state] * world_size
    if rank > 0:
        dist.send(state.detach().contiguous().to(device), dst=0)
        return None
    received = [state.detach().cpu()]
    for source in range(1, world_size):
        buffer = torch.empty_like(state, device=device)
        dist.recv(buffer, src=source)
        received.append(buffer.cpu())
    return received


def train_state(args, step):
    """What a checkpoint holds besides the weights and the optimizer's state, for
    check_resumable: the step, and what the data order and the model depend on (the data
    position is a function of --seed, the step and --batch-size only)."""
    return {"step": step, "batch_size": args.batch_size, "seed": args.seed, "fp64": args.fp64,
            "hidden": args.hidden, "blocks": args.blocks, "heads": args.heads,
            "experts": args.experts, "top_k": args.top_k,
            **({"dtype": args.dtype} if "dtype" in args else {})}  # amp.py's autocast type


def check_resumable(saved, args, refuse):
    """Call refuse(why) if this run cannot continue the checkpoint whose train state is `saved`
    exactly: another model size (where it says) or head count, --batch-size or --seed (the
    data order would not continue), or the other precision (loading would cast the weights
    and Adam's moments silently, and the run would go on in another precision than it
    started in), or amp.py's other --dtype."""
    if "hidden" in saved and (saved["hidden"], saved["blocks"]) != (args.hidden, args.blocks):
        refuse(f"saved with --hidden {saved['hidden']} --blocks {saved['blocks']}; "
               "use the same model size")
    # The head count shapes no weight (q, k, v are hidden x hidden whatever it is), so the
    # weights would load and the attention would compute something else: the file says it.
    if saved.get("heads") != args.heads:
        refuse(f"saved with --heads {saved.get('heads')}; use --heads {saved.get('heads')}")
    # --top-k shapes no weight either (and a dense file has no experts: 0, 1 the defaults)
    experts, top_k = saved.get("experts", 0), saved.get("top_k", 1)
    if (experts, top_k) != (args.experts, args.top_k):
        refuse(f"saved with --experts {experts} --top-k {top_k}; use the same")
    for flag, key in (("--batch-size", "batch_size"), ("--seed", "seed")):
        if saved.get(key) != getattr(args, key):
            refuse(f"written with {flag} {saved.get(key)}, not {getattr(args, key)}: the data "
                   f"order would not continue; use {flag} {saved.get(key)}")
    # amp.py: bf16 and fp32 keep no loss scale for fp16 to go on with, nor fp16 one for them
    if "dtype" in args and saved.get("dtype") != args.dtype:
        refuse(f"written with --dtype {saved.get('dtype')}, not {args.dtype}; "
               f"use --dtype {saved.get('dtype')}")
    if saved.get("fp64", False) != args.fp64:
        refuse("written with --fp64; add --fp64 to continue it" if saved.get("fp64")
               else "written without --fp64; drop --fp64 to continue it")
