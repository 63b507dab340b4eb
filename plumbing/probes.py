"""The probe forward: the model the flags describe, run once on the CPU before any process
starts, shows what names cannot (plumbing/model_check.py calls it): a module that couples the
samples of a batch or draws random numbers, stages that do not chain to the model's forward,
an attention that never calls `attend`, a module between the TP regions that mixes positions,
and under --fp64 a module that computes in float32 anyway."""

import os
from fnmatch import fnmatch

import torch
from torch.overrides import TorchFunctionMode

import common


def matching(model, key):
    """The paths of model's modules a tp_plan key names, as parallelize_module matches them:
    name by name, "*" for any one name."""
    return [path for path, _ in model.named_modules() if path.count(".") == key.count(".")
            and all(map(fnmatch, path.split("."), key.split(".")))]


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


def between_regions(parser, model, name, paths, x, tol):
    """--sequence-parallel: between the TP regions (the norms, the residual sums, whatever else
    a block runs outside the layers its tp_plan cuts) each rank holds 1/T of the sequence. Each
    module there is run on the two halves of the sequence it saw, and refused if its output
    for a position moves with the other half's (a causal convolution, a norm over time). Ops
    a block's forward calls outside any module are not seen."""
    plan = getattr(model, "tp_plan", None) or {}
    regions = {model.get_submodule(path) for key, kind in plan.items()
               if kind in ("colwise", "rowwise", "shared_input") for path in matching(model, key)}
    inside = {m for region in regions for m in region.modules()}
    holding = {m for m in model.modules() if not regions.isdisjoint(m.modules())}
    norms = [model.get_submodule(path) for key, kind in plan.items() if kind == "norm"
             for path in matching(model, key)]
    between = [m for block in model.blocks.values() for m in block.modules()
               if m not in inside and m not in holding] + norms
    calls = {}
    hooks = [m.register_forward_hook(lambda m, a, kw, out: calls.setdefault(m, []).append(
        (a, kw, out)), with_kwargs=True) for m in set(between)]
    try:
        model(x)
    finally:
        for hook in hooks:
            hook.remove()
    seq = x.shape[1]
    def half(t, i):  # a tensor's half of the sequence (dim 1), the rest as it is
        return t.narrow(1, i * (seq // 2), seq // 2) if isinstance(t, torch.Tensor) \
            and t.dim() > 1 and t.shape[1] == seq else t
    for m, seen in calls.items():
        for a, kw, out in seen:
            if not (isinstance(out, torch.Tensor) and out.dim() > 1 and out.shape[1] == seq):
                continue
            try:
                halves = torch.cat([m(*[half(t, i) for t in a],
                                      **{k: half(t, i) for k, t in kw.items()}) for i in (0, 1)], 1)
            except Exception:  # noqa: BLE001 -- not runnable on halves: no evidence either way
                continue
            if gap(halves, out) > tol:
                parser.error(f"--sequence-parallel: {name}.{paths[m]} ({type(m).__name__}) runs "
                             "between the TP regions, where each rank holds 1/T of the "
                             "sequence, and mixes positions (its output for a token moves with "
                             "the others'); drop --sequence-parallel, or put it in a region the "
                             "tp_plan cuts")


@torch.no_grad()
def probe(parser, args, name, split, cut):
    """Refuse in one line what the model's forward shows, run on a few training samples on the
    CPU in the run's dtype (the model the flags describe, built once more here): with `split`
    (ranks or micro-batches each see a part of the batch), a module whose output for some
    samples moves with the others (BatchNorm by any name: F.batch_norm, a batch mean); with
    `cut` (pipeline.py's, nd.py's), stages that do not chain to the model's forward; under
    cp.py, an attention that never calls the `attend` cp.py replaces; with
    --sequence-parallel, a module between the TP regions that mixes positions
    (between_regions); with --cp-method ulysses, heads that --cp (over --tp) does not cut into
    whole ones (ulysses_heads). Under --fp64, a module that computes in float32 anyway (Hugging
    Face's RMSNorm, its routers) is named in one line: correct runs then part by ~1e-8, not
    ~1e-13.
    A forward that fails here is refused in one line too."""
    cp = "cp_method" in args and getattr(args, "cp", None) != 1
    if not (split or cut or cp or args.fp64 or getattr(args, "sequence_parallel", False)):
        return
    # In the run's dtype; past rounding's reach: float64's, and fp32's over one forward
    dtype, tol = (torch.float64, 1e-9) if args.fp64 else (torch.float32, 1e-4)
    with torch.random.fork_rng(devices=[]):  # the CPU's generator only
        torch.manual_seed(0)
        model = common.SimpleModel.from_args(args).to(dtype)
    data = common.make_dataset("train", getattr(args, "data", "repeat"))
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
                      "correct runs part by ~1e-8, not ~1e-13; docs/questions.md#fp32-islands",
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
        if getattr(args, "sequence_parallel", False):
            between_regions(parser, model, name, paths, x, tol)
        if cut is not None:
            stages = getattr(args, "stages", None) or 2
            kwargs = {"positions": torch.arange(x.shape[1])} if "cp" in args else {}
            if getattr(model, "bos", None) is not None:  # packed: every stage takes them
                kwargs["docs"] = common.documents(x, model.bos)
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
                             "(docs/questions.md#putting-your-own-model-in)")
        if cp:
            attns = [getattr(block, "attn", None) for block in model.blocks.values()]
            if not all(hasattr(a, "attend") for a in attns):
                parser.error(f"cp.py replaces each block's attn.attend(q, k, v), and {name}'s "
                             "blocks have none; use ddp.py, or give the attention an attend method")
            try:
                plain, heads = model(x, positions=torch.arange(x.shape[1])), set()
                for a in attns:
                    a.attend = lambda q, k, v, *docs, f=a.attend: heads.add(
                        (q.shape[1], k.shape[1])) or 2 * f(q, k, v, *docs)
                moved = gap(model(x, positions=torch.arange(x.shape[1])), plain) > 0
            except TypeError as e:
                parser.error(f"cp.py calls model(x, positions=...), and {name}'s forward "
                             f"refuses it ({str(e)[:60]}); take the tokens' positions")
            if not moved:
                parser.error(f"cp.py replaces each block's attn.attend, which {name}'s "
                             "forward never calls: each rank would attend within its own "
                             "pieces only; call it")
            if args.cp_method == "ulysses":  # each rank all of the sequence, 1/C of the heads
                ulysses_heads(parser, args, name, heads)
    except Exception as e:  # noqa: BLE001 -- any failure of the probe's forward is the reason
        parser.error(f"{name}'s forward fails on {len(x)} training samples in {dtype} on the CPU, "
                     f"where the checks run it ({type(e).__name__}: "
                     f"{(str(e).splitlines() or [''])[0][:90]}); make it run there")


def ulysses_heads(parser, args, name, heads):
    """--cp-method ulysses: refuse query heads (per TP rank) that --cp does not divide, and
    key/value heads (GQA) that it neither divides nor is a multiple of (copies, one per rank)."""
    tp = getattr(args, "tp", 1)
    for q, kv in heads:
        over = f" over --tp {tp}" if tp > 1 else ""
        grouped = f" that {kv // tp} divides or is divided by" if kv != q else ""
        if q % (tp * args.cp) or (kv // tp) % args.cp and args.cp % (kv // tp):
            parser.error(f"--cp-method ulysses: each rank attends whole heads, and {name}'s "
                         f"{q} query and {kv} key/value heads{over} do not cut evenly into "
                         f"--cp {args.cp}; use a --cp dividing {q // tp}{grouped}, or "
                         "--cp-method ring")
