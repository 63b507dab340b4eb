"""Your model, checked before any process starts: what would train differently from one device
without an error is refused in one line (docs/questions.md#putting-your-own-model-in); and, once
tp.py has cut it, what its plan did checked against what the plan says (check_cut)."""

import os
from fnmatch import fnmatch

import torch
import torch.nn as nn

import common
from plumbing.probes import matching, probe
from plumbing.ranks import fail


# The probes build the whole model once more on the CPU of every rank: up to this size.
PROBE_BYTES = 2**30


def check_model(parser, args, ranks=None, cut=None):
    """Refuse (parser.error) a model this run would train silently differently from one
    device, after the model's own checks of its flags (from_args) and the dataset's size:
    BatchNorm where ranks (`ranks`: by default this run's, or DataParallel's replicas,
    parser.ranks) or micro-batches each see a part of the batch, Dropout there too; --experts
    for a model without a mixture; a tied weight in a pipeline
    (--microbatches), whose stages would each train a copy; with --tp (tp.py, nd.py) its
    tp_plan (check_plan); then what only a forward shows (probe)."""
    try:
        with torch.device("meta"):  # shapes only, however large (as fsdp.py and tp.py build it)
            model = common.SimpleModel.from_args(args)
    except ValueError as e:  # the model's own checks of its flags (--heads, --experts...)
        parser.error(str(e))
    name = type(model).__name__
    if getattr(args, "data", None) == "packed" and getattr(model, "bos", None) is None:
        parser.error(f"--data packed: {name} has no `bos` (the token that begins a document, "
                     "which SimpleModel's forward reads to keep documents apart), so its "
                     "attention would cross them; give it one, or use --data padded or prompt")
    try:  # the dataset's size: the data's, not a constant
        samples = len(common.make_dataset("train", getattr(args, "data", "repeat")))
    except TypeError as e:  # a make_dataset(split) of yours, from before --data
        parser.error(f"make_dataset takes (split, kind), kind being --data's ({e}); add "
                     "kind=\"repeat\" to yours (docs/questions.md#putting-your-own-model-in)")
    if args.batch_size > samples:
        parser.error(f"--batch-size {args.batch_size} is larger than the dataset ({samples} "
                     f"samples); use at most {samples}")
    if ranks is None:  # a script with --nproc runs torchrun's ranks, or --nproc of its own
        ranks = (int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else args.nproc or 1
                 ) if "nproc" in args else getattr(parser, "ranks", 1)  # DataParallel's copies
    micro = getattr(args, "accum_steps", None) or getattr(args, "microbatches", None) or 1
    if getattr(args, "tp", None) and not getattr(args, "sequence_parallel", False):
        ranks = max(1, ranks // args.tp)  # a TP group's ranks see the same whole samples
    for path, module in model.named_modules():  # _BatchNorm: every BatchNorm, Sync and Lazy too
        # SyncBatchNorm syncs over a process group: none under DataParallel (no --nproc)
        sync = isinstance(module, nn.SyncBatchNorm) and micro == 1 and "nproc" in args
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and ranks * micro > 1 and not sync:
            parser.error(f"{name}.{path} is a {type(module).__name__}: it normalizes by the "
                         "statistics of the samples it sees, and here ranks or micro-batches "
                         "each see a part of the batch; use nn.GroupNorm or nn.LayerNorm (or, on "
                         "GPUs without micro-batches, nn.SyncBatchNorm.convert_sync_batchnorm)")
        # Dropout's masks are each process's (and each micro-batch's) own draws
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p and ranks * micro > 1:
            parser.error(f"{name}.{path} is a {type(module).__name__}(p={module.p}): each rank "
                         "and micro-batch draws its own masks, so the run cannot equal one "
                         "device's; set p=0 to prove it "
                         "(docs/questions.md#putting-your-own-model-in)")
    layout = [getattr(getattr(b, "moe", None), "experts", None) for b in model.blocks.values()]
    if "ep" in args and args.experts and not all(isinstance(e, nn.ModuleDict) for e in layout):
        parser.error(f"ep.py spreads each block's moe.experts (an nn.ModuleDict of experts) and "
                     f"replaces moe.run_experts; {name}'s blocks hold no such mixture (Hugging "
                     "Face's fused experts are one module of 3-D weights): use ddp.py or fsdp.py")
    if args.experts and not hasattr(model, "routed"):  # balance() reads the mixture's routing
        parser.error(f"--experts {args.experts}: {name} has no mixture of experts (no "
                     "routed(counted)); "
                     "drop --experts")
    holders = {}  # a parameter's names: two or more where it is tied
    for path, p in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(p), []).append(path)
    tied = [paths for paths in holders.values() if len(paths) > 1]
    if tied and "microbatches" in args:  # pipeline.py, nd.py
        parser.error(f"{' and '.join(tied[0])} are one tensor (tied): a pipeline holds them "
                     "on two stages, which would train two copies apart; untie them (a "
                     "weight of its own for each), or use ddp.py, fsdp.py or tp.py")
    if "tp" in args:
        check_plan(parser, args, model, name, tied)
    # What only a forward shows; a SyncBatchNorm passed above couples the batch, as it should
    synced = any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
    size = sum(p.numel() for p in model.parameters()) * (8 if args.fp64 else 4)
    if size <= PROBE_BYTES:
        probe(parser, args, name, ranks * micro > 1 and not synced, cut)
    elif os.environ.get("RANK", "0") == "0":
        print(f"note: {name} is {size / 2**30:.1f} GiB, too large for the probe forward on the "
              "CPU (the checks of batch coupling, stages, attend, positions): run these flags "
              "once with a smaller --hidden and --blocks, which checks the same code", flush=True)


def check_plan(parser, args, model, name, tied):
    """tp.py, nd.py: refuse a tp_plan that names a module the model lacks, an unknown kind,
    cuts nothing, cuts a tied head over the vocabulary (--loss-parallel), or whose --tp does not
    divide a Hugging Face config's key/value heads."""
    plan = getattr(model, "tp_plan", None) or {}
    kinds = ("colwise", "rowwise", "shared_input", "norm", "head")  # tp.py's styles of them
    resolved = lambda key: matching(model, key)  # noqa: E731
    for key, kind in plan.items():
        if kind not in kinds:
            parser.error(f"{name}.tp_plan[{key!r}] = {kind!r}: a kind tp.py does not know; "
                         f"use one of {', '.join(kinds)}")
        if not resolved(key):
            parser.error(f"{name}.tp_plan: {key!r} names no module of {name} (torch would "
                         "skip it with a warning); write the names model.named_modules() "
                         "gives, with * for a block's key")
        layers = [model.get_submodule(path) for path in resolved(key)]
        other = next((m for m in layers if not isinstance(m, (nn.Linear, nn.Embedding))), None)
        if kind in ("colwise", "rowwise") and other is not None:
            parser.error(f"{name}.tp_plan: {key!r} is a {type(other).__name__}, and TP cuts "
                         "nn.Linear and nn.Embedding only; make it an nn.Linear (a Conv1D's "
                         "weight is a Linear's, transposed)")
    if getattr(args, "sequence_parallel", False) and not list(model.blocks.values()):
        parser.error(f"--sequence-parallel: tp.py gives the first of {name}.blocks its part of "
                     "the sequence, and it has none; return the repeated layers as `blocks`")
    if getattr(args, "loss_parallel", False) and "head" not in plan.values():
        parser.error(f"--loss-parallel: {name}.tp_plan names no \"head\" (the output layer) "
                     "to cut over the vocabulary; add it, or drop --loss-parallel")
    for m in model.modules():  # a Hugging Face config's grouped KV heads: T must divide them
        kv = getattr(getattr(m, "config", None), "num_key_value_heads", None)
        if isinstance(kv, int) and kv % args.tp:
            parser.error(f"--tp {args.tp} must divide {name}'s {kv} key/value heads (each rank "
                         "computes whole heads of q, k and v); use --tp dividing it")
    if not {"colwise", "rowwise"} & set(plan.values()):
        parser.error(f"{name}.tp_plan cuts nothing (no colwise or rowwise layer): every rank "
                     "would hold and compute the whole model; write one "
                     "(docs/questions.md#putting-your-own-model-in)")
    heads = {m for key, kind in plan.items() if kind == "head" for m in resolved(key)}
    for paths in tied if getattr(args, "loss_parallel", False) else ():
        if any(path.rsplit(".", 1)[0] in heads for path in paths):
            parser.error(f"--loss-parallel: {' and '.join(paths)} are one tensor (tied), and "
                         "loss parallelism would cut the head's over the vocabulary, the "
                         "other's left whole; drop --loss-parallel, or untie them")


def check_cut(model, tensors):
    """After tp.py's cut, stop in one line (fail) unless the weight of every layer the model's
    tp_plan cuts is cut, something is, and the model still holds `tensors` tensors (its count
    before the cut, a tied weight once): a tie made two copies would train them apart."""
    # Keys matched as torch matches them: "*" stands for one name, not a dotted path.
    cut = [p.placements[0].is_shard() for name, p in model.named_parameters() if any(
        fnmatch(name, f"{key}.weight") and name.count(".") == key.count(".") + 1
        for key, kind in model.tp_plan.items() if kind.endswith("wise"))]
    why = ("cuts nothing" if not any(cut) else "leaves a layer it names whole" if not all(cut)
           else "splits a tied weight in two" if len(list(model.parameters())) != tensors else None)
    if why:
        fail(f"tp.py: error: {type(model).__name__}'s tp_plan {why}: docs/questions.md#putting-"
             "your-own-model-in says what to write")
