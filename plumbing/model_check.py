"""Your model, checked before any process starts: what would train differently from one device
without an error is refused in one line (docs/course.md#putting-your-own-model-in); and, once
tp.py has cut it, what its plan did checked against what the plan says (check_cut)."""

import os
from fnmatch import fnmatch

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

import common
from plumbing.ranks import fail


def check_model(parser, args, ranks=None, cut=None):
    """Refuse (parser.error) a model this run would train silently differently from one
    device, after the model's own checks of its flags (from_args) and the dataset's size:
    BatchNorm where ranks (`ranks`: by default this run's, or DataParallel's replicas,
    parser.ranks) or micro-batches each see a part of the batch, Dropout there too; --experts
    for a model without a mixture; a tied weight in a pipeline
    (--microbatches), whose stages would each train a copy; and with --tp (tp.py, nd.py) a
    tp_plan that names a module the model lacks, an unknown kind, cuts nothing, or cuts a tied
    head over the vocabulary (--loss-parallel)."""
    try:
        with torch.device("meta"):  # shapes only, however large (as fsdp.py and tp.py build it)
            model = common.SimpleModel.from_args(args)
    except ValueError as e:  # the model's own checks of its flags (--heads, --experts...)
        parser.error(str(e))
    name = type(model).__name__
    samples = len(common.make_dataset("train"))  # the dataset's size: the data's, not a constant
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
                         "device's; set p=0 to prove it (docs/course.md#putting-your-own-model-in)")
    layout = [getattr(getattr(b, "moe", None), "experts", None) for b in model.blocks.values()]
    if "ep" in args and args.experts and not all(isinstance(e, nn.ModuleDict) for e in layout):
        parser.error(f"ep.py spreads each block's moe.experts (an nn.ModuleDict of experts) and "
                     f"replaces moe.run_experts; {name}'s blocks hold no such mixture (Hugging "
                     "Face's fused experts are one module of 3-D weights): use ddp.py or fsdp.py")
    if args.experts and not hasattr(model, "routed"):  # balance() reads the mixture's routing
        parser.error(f"--experts {args.experts}: {name} has no mixture of experts (no routed()); "
                     "drop --experts")
    holders = {}  # a parameter's names: two or more where it is tied
    for path, p in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(p), []).append(path)
    tied = [paths for paths in holders.values() if len(paths) > 1]
    if tied and "microbatches" in args:  # pipeline.py, nd.py
        parser.error(f"{' and '.join(tied[0])} are one tensor (tied): a pipeline holds them "
                     "on two stages, which would train two copies apart; untie them (a "
                     "weight of its own for each), or use ddp.py, fsdp.py or tp.py")
    # What only a forward shows; a SyncBatchNorm passed above couples the batch, as it should
    synced = any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
    probe(parser, args, name, ranks * micro > 1 and not synced, cut)
    if "tp" not in args:
        return
    plan = getattr(model, "tp_plan", None) or {}
    kinds = ("colwise", "rowwise", "shared_input", "norm", "head")  # tp.py's styles of them
    names = [path.split(".") for path, _ in model.named_modules()]
    def resolved(key):  # as parallelize_module matches it: name by name, "*" for any
        return [".".join(n) for n in names if len(n) == len(key.split("."))
                and all(map(fnmatch, n, key.split(".")))]
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
                     "(docs/course.md#putting-your-own-model-in)")
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
        fail(f"tp.py: error: {type(model).__name__}'s tp_plan {why}: docs/course.md#putting-"
             "your-own-model-in says what to write")


class Float32Ops(TorchFunctionMode):
    """Under --fp64's probe forward: the modules running when an op made a float32 tensor that
    depends on the weights."""

    def __init__(self, running):
        super().__init__()
        self.running, self.found = running, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.requires_grad \
                and self.running:  # from the weights: constants (RoPE's cos) part nothing
            self.found.append(self.running[-1])
        return out


def outputs(model, *inputs, **kwargs):
    """Every module's outputs of one forward, {module: [output of each call]}, in the order the
    calls ended; and the forward's own output."""
    seen = {}
    hooks = [m.register_forward_hook(lambda m, _, out: seen.setdefault(m, []).append(out))
             for m in model.modules()]
    try:
        out = model(*inputs, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return seen, out


def gap(a, b):
    return (a.double() - b.double()).abs().max().item() if a.shape == b.shape else float("inf")


@torch.no_grad()
def probe(parser, args, name, split, cut):
    """Refuse in one line what the model's forward shows, run on a few training samples on the
    CPU in the run's dtype (the model the flags describe, built once more here): with
    `split` (ranks or micro-batches each see a part of the batch), a module whose output for
    some samples moves with the others (BatchNorm by any name: F.batch_norm, a batch mean); with `cut`
    (pipeline.py's, nd.py's), stages that do not chain to the model's forward; under cp.py, an
    attention that never calls the `attend` cp.py replaces. Under --fp64, a module that computes
    in float32 anyway (Hugging Face's RMSNorm, its routers) is named in one line: correct runs
    then part by ~1e-8, not ~1e-13. A forward that fails here is refused in one line too."""
    cp = "cp_method" in args and getattr(args, "cp", None) != 1
    if not (split or cut or cp or args.fp64):
        return
    # In the run's dtype; past rounding's reach: float64's, and fp32's over one forward
    dtype, tol = (torch.float64, 1e-9) if args.fp64 else (torch.float32, 1e-4)
    with torch.random.fork_rng(devices=[]):  # the CPU's generator only
        torch.manual_seed(0)
        model = common.SimpleModel.from_args(args).to(dtype)
    data = common.make_dataset("train")
    x = torch.stack([data[i][0] for i in range(4)])
    try:
        paths = {m: path for path, m in model.named_modules()}
        if args.fp64 and os.environ.get("RANK", "0") == "0":
            running, hooks = [], []
            for m in model.modules():
                hooks += [m.register_forward_pre_hook(lambda m, _: running.append(m)),
                          # a hook's value other than None replaces the output: None
                          m.register_forward_hook(lambda m, _, __: running.pop() and None)]
            with torch.enable_grad(), Float32Ops(running) as mode:
                model(x)
            for hook in hooks:
                hook.remove()
            if mode.found:
                m = mode.found[0]
                print(f"note: --fp64: {name}.{paths[m]} ({type(m).__name__}) computes in float32: "
                      "correct runs part by ~1e-8, not ~1e-13; docs/course.md#fp32-islands",
                      flush=True)
        if split:  # the first half of a batch, forwarded with and without the second
            whole, again = outputs(model, x)[0], outputs(model, x)[0]
            half = outputs(model, x[:2])[0]
            for m, calls in whole.items():
                for out, same, part in zip(calls, again[m], half.get(m, [])):
                    if not all(isinstance(t, torch.Tensor) for t in (out, same, part)):
                        continue
                    if gap(out, same) > tol:
                        parser.error(f"{name}.{paths[m]} ({type(m).__name__}) draws random numbers "
                                     "in training (dropout?): each rank and micro-batch draws its "
                                     "own; make it deterministic (p=0) to prove the run")
                    rows = (len(x), len(x) * x.shape[1]) if x.dim() > 1 else (len(x),)
                    if out.dim() and out.shape[0] in rows and 2 * part.shape[0] == out.shape[0] \
                            and len(calls) == len(half[m]) and gap(out[:len(part)], part) > tol:
                        parser.error(f"{name}.{paths[m]} ({type(m).__name__}) couples the samples "
                                     "of a batch (a sample's output moves with the others, as "
                                     "BatchNorm's does), and here ranks or micro-batches each see "
                                     "a part of it; normalize per sample (LayerNorm, GroupNorm)")
        if cut is not None:
            stages = getattr(args, "stages", None) or 2
            kwargs = {"positions": torch.arange(x.shape[1])} if "cp" in args else {}
            try:
                parts = [cut(model, i, stages) for i in range(stages)]
                held = [n for part in parts for n, _ in part.named_parameters()]
                twice = [n for n in held if held.count(n) > 1]  # not deleted: a property's blocks
                why = f"{twice[0]} stays in two stages" if twice else None
                y = x
                for part in parts if not twice else ():
                    y = part(y, **kwargs)
                if not twice and gap(y, model(x)) > tol:
                    why = f"the chain is {gap(y, model(x)):.1e} from the model's forward"
            except Exception as e:  # noqa: BLE001 -- any failure of the chain is the reason
                why = f"chaining them fails ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
            if why:
                script = os.path.basename(cut.__code__.co_filename)
                parser.error(f"{script}'s cut() makes stages of {name} by deleting "
                             f"SimpleModel's parts (embed, pos, blocks, norm, output), and {why}; "
                             "write cut() for your model "
                             "(docs/course.md#putting-your-own-model-in)")
        if cp:
            attns = [getattr(block, "attn", None) for block in model.blocks.values()]
            if not all(hasattr(a, "attend") for a in attns):
                parser.error(f"cp.py replaces each block's attn.attend(q, k, v), and {name}'s "
                             "blocks have none; use ddp.py, or give the attention an attend method")
            try:
                plain = model(x, positions=torch.arange(x.shape[1]))
                for a in attns:
                    a.attend = lambda q, k, v, f=a.attend: 2 * f(q, k, v)
                moved = gap(model(x, positions=torch.arange(x.shape[1])), plain) > 0
            except TypeError as e:
                parser.error(f"cp.py calls model(x, positions=...), and {name}'s forward "
                             f"refuses it ({str(e)[:60]}); take the tokens' positions")
            if not moved:
                parser.error(f"cp.py replaces each block's attn.attend, which {name}'s "
                             "forward never calls: each rank would attend within its own "
                             "pieces only; call it")
    except Exception as e:  # noqa: BLE001 -- any failure of the probe's forward is the reason
        parser.error(f"{name}'s forward fails on {len(x)} training samples in {dtype} on the CPU, "
                     f"where the checks run it ({type(e).__name__}: "
                     f"{(str(e).splitlines() or [''])[0][:90]}); make it run there")
