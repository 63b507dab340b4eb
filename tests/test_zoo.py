"""The bug zoo: classic mistakes, each made on purpose in a temporary copy of a script
(and of common.py, where the mistake is in the model), and each caught. The same list is the
course's exercise sheet (docs/exercises.md): break the line, run the test, read the failure.

Each mistake is an exact replacement of lines of the real script. If a script changes so that
the lines are no longer there (or are there twice), the test fails and says which: the zoo can
never quietly test nothing. Most run in float64, where a correct strategy stays within 1e-9 of
one device: every distance above that is the mistake, never rounding. Some of these mistakes
hide in fp32 (docs/exercises.md measures both).
"""

import importlib.util
import json
import sys
import types

import pytest
import torch

import common
from common import SimpleModel
from conftest import (FP64_CLIP, FP64_JOB, FP64_SEEDS, FP64_TOL, JOB, JOB_FLAGS, REPO, VAL_TOL,
                      early_results, fp64, fp64_reference, launch, load_saved, logged_losses,
                      logged_norms, logged_step_losses, max_diff, mutated, ok, ranks_cmd,
                      refused_in_one_line, run_as_only_rank, run_in_process, summary_val_loss)
from reference import reference_diloco, reference_train, reference_val_loss
from test_amp import CLIP, run_seeing_the_gradient_adam_gets
from test_tp import TiedHead

SEED = FP64_SEEDS[0]
HEADS = 4  # the TP mistakes run on 2 ranks: a head count 2 divides (tests/test_tp.py)

# name: (script, [(lines of the real script, the mistake in their place), ...]); an edit of
# three, (file, lines, mistake), is made in that file (common.py) instead of the script.
MISTAKES = {
    "no set_epoch": ("ddp.py", [(
        "            sampler.set_epoch(epoch)\n",
        "            pass  # sampler.set_epoch(epoch), forgotten\n")]),
    "sampler seeded per rank": ("ddp.py", [(
        "seed=args.seed, drop_last=True)",
        "seed=args.seed + rank, drop_last=True)")]),
    "no_sync around backward only": ("ddp.py", [(
        "            with ddp_model.no_sync() if micro < args.accum_steps - 1 else "
        "contextlib.nullcontext():\n"
        "                with record_function(\"forward\"):\n"
        "                    loss = loss_fn(ddp_model(x), y, reduction=\"sum\") * world_size / "
        "tokens\n"
        "                    loss = loss + balance(model, args, y, dist.group.WORLD) / "
        "args.accum_steps\n",
        "            with record_function(\"forward\"):\n"
        "                loss = loss_fn(ddp_model(x), y, reduction=\"sum\") * world_size / tokens\n"
        "                loss = loss + balance(model, args, y, dist.group.WORLD) / "
        "args.accum_steps\n"
        "            with ddp_model.no_sync() if micro < args.accum_steps - 1 else "
        "contextlib.nullcontext():\n")]),
    "mean of per-rank validation means": ("ddp.py", [(
        "            logits, y = model(x.to(device))[:real], y[:real].to(device)\n",
        "            logits, y = model(x.to(device)), y.to(device)\n"), (
        "    dist.all_reduce(sums, op=dist.ReduceOp.SUM)\n"
        "    # --- end ---\n"
        "    model.train()\n"
        "    return (sums[0] / sums[1]).item()\n",
        "    mean = sums[0] / sums[1]\n"
        "    dist.all_reduce(mean, op=dist.ReduceOp.AVG)\n"
        "    # --- end ---\n"
        "    model.train()\n"
        "    return mean.item()\n")]),
    "DDP wrapper's state_dict saved": ("ddp.py", [(
        "                save_checkpoint(args, model, optimizer, step + 1)",
        "                save_checkpoint(args, ddp_model, optimizer, step + 1)")]),
    "loss not divided when accumulating": ("single.py", [(
        "                loss = loss_fn(model(x), y, reduction=\"sum\") / tokens\n",
        "                loss = loss_fn(model(x), y)  # (mistake) each micro-batch's own mean\n")]),
    "TP: attention that counts its heads": ("tp.py", [(
        "common.py",
        "        self.head_width = hidden // heads  # not a count: heads are as many as q holds "
        "(tp.py)\n",
        "        self.heads = heads\n"), (
        "common.py",
        "        q, k, v = (proj(x).view(batch, seq, -1, self.head_width).transpose(1, 2)\n",
        "        q, k, v = (proj(x).view(batch, seq, self.heads, -1).transpose(1, 2)\n")]),
    "TP: a fused qkv layer cut by columns": ("tp.py", [(
        "common.py",
        "        self.q = nn.Linear(hidden, hidden)\n",
        "        q = nn.Linear(hidden, hidden)\n"), (
        "common.py",
        "        self.k = nn.Linear(hidden, hidden, bias=False)\n"
        "        self.v = nn.Linear(hidden, hidden)\n",
        "        k = nn.Linear(hidden, hidden, bias=False)\n"
        "        v = nn.Linear(hidden, hidden)\n"
        "        # one layer for all three, holding q's, k's and v's numbers stacked by rows: one\n"
        "        # device computes exactly what the three layers compute\n"
        "        self.qkv = nn.Linear(hidden, 3 * hidden, device=\"meta\")\n"
        "        self.qkv.weight = nn.Parameter(\n"
        "            torch.cat([q.weight, k.weight, v.weight]).detach())\n"
        "        self.qkv.bias = nn.Parameter(\n"
        "            torch.cat([q.bias, 0 * q.bias, v.bias]).detach())\n"), (
        "common.py",
        "        q, k, v = (proj(x).view(batch, seq, -1, self.head_width).transpose(1, 2)\n"
        "                   for proj in (self.q, self.k, self.v))\n",
        "        q, k, v = (part.reshape(batch, seq, -1, self.head_width).transpose(1, 2)\n"
        "                   for part in self.qkv(x).chunk(3, dim=-1))\n"), (
        "common.py",
        "               \"blocks.*.attn.q\": \"colwise\", \"blocks.*.attn.k\": \"colwise\",\n"
        "               \"blocks.*.attn.v\": \"colwise\", ",
        "               \"blocks.*.attn.qkv\": \"colwise\", ")]),
    "SP: a norm left out of the plan": ("tp.py", [(
        "common.py",
        "\"blocks.*.mlp_norm\": \"norm\", \"blocks.*.up\"",
        "\"blocks.*.up\"")]),
    "TP group fed by rank": ("tp.py", [(
        "    sampler = DistributedSampler(dataset, num_replicas=dp, rank=dp_rank, "
        "shuffle=True,",
        "    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, "
        "shuffle=True,")]),
    "optimizer built before fully_shard": ("fsdp.py", [(
        "    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)\n"
        "    start_step", "    start_step"), (
        "    for block in model.blocks.values():\n"
        "        fully_shard(block, mesh=mesh, mp_policy=mp_policy,",
        "    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)\n"
        "    for block in model.blocks.values():\n"
        "        fully_shard(block, mesh=mesh, mp_policy=mp_policy,")]),
    "pipeline with scale_grads=False": ("pipeline.py", [(
        "pipe, scale_grads=True,",
        "pipe, scale_grads=False,")]),
    "clipping before unscale_": ("amp.py", [(
        "            scaler.unscale_(optimizer)\n", ""), (
        "                                                       args.clip or float(\"inf\"))\n",
        "                                                       args.clip or float(\"inf\"))\n"
        "            scaler.unscale_(optimizer)  # (mistake) after clipping\n")]),
    "FSDP clipped by the norm of the local shards": ("fsdp.py", [(
        "            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(),\n"
        "                                                       args.clip or float(\"inf\"))\n",
        "            local = [p.grad.to_local() for p in model.parameters()]\n"
        "            grad_norm = torch.nn.utils.get_total_norm(local)\n"
        "            factor = torch.clamp((args.clip or float(\"inf\")) / (grad_norm + 1e-6),"
        " max=1.0)\n"
        "            for g in local:\n"
        "                g.mul_(factor)\n"), (
        "grad_norm.full_tensor().item(),", "grad_norm.item(),")]),
    "CP: positions not offset per piece": ("cp.py", [(
        "loss_fn(ddp_model(x, positions=where, **packed), y, reduction=\"sum\")\n",
        "loss_fn(ddp_model(x, **packed), y, reduction=\"sum\")\n"), (
        "            logits = model(x, positions=positions.to(device), **docs)[:len(y)]\n",
        "            logits = model(x, **docs)[:len(y)]\n")]),
    "CP: loss averaged over a rank's own tokens": ("cp.py", [(
        "            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)\n",
        "            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG,\n"
        "                            group=mesh.get_group(\"dp\"))  # (mistake)\n")]),
    "CP x FSDP: sharded over dp only": ("nd.py", [(
        "        stages.append(parallelize(part, shards, shard_blocks=False, shard_over=\"dp_cp\"))\n",
        "        # (mistake) \"FSDP is data parallelism\"\n"
        "        stages.append(parallelize(part, mesh, shard_blocks=False, shard_over=\"dp\"))\n")]),
    "CP x FSDP: the loss normalized twice": ("nd.py", [(
        "    spread = args.microbatches * shards[\"dp_cp\"].size()  # M x D x C\n",
        "    spread = args.microbatches  # (mistake) the global count is the mean: D x C "
        "left out\n")]),
    "ND: positions not passed to the stages": ("nd.py", [(
        "        schedule.step(*inputs, **targets, positions=where.expand(len(x), -1), "
        "**on(device, docs))\n",
        "        schedule.step(*inputs, **targets, **on(device, docs))\n")]),
    "CP ring: a hop skipped where its keys are masked": ("cp.py", [(
        "        for i, (query, q_chunk, part) in enumerate(zip(queries, chunks_of(me, cp), "
        "parts)):\n",
        "        if source > me:  # \"a later rank's keys are all masked for my first chunk\"\n"
        "            continue  # ...and the exchange at the bottom of the loop goes with it\n"
        "        for i, (query, q_chunk, part) in enumerate(zip(queries, chunks_of(me, cp), "
        "parts)):\n")]),
    "EP: the balancing loss from each rank's own routing": ("ep.py", [(
        "balance(model, args, y, dist.group.WORLD)", "balance(model, args, y)")]),
    "EP: an expert's gradient averaged over its holders": ("ep.py", [(
        "            g.copy_(summed.view_as(g) / world)\n",
        "            g.copy_(summed.view_as(g) / (dist.get_world_size(group) if group "
        "else world))\n"
        )]),
    "EP: the routers' gradients not summed across the ranks": ("ep.py", [(
        "        grads = [p.grad for name, p in params if is_expert(name) == held]\n",
        "        grads = [p.grad for name, p in params  # the router with the experts: \"MoE\"\n"
        "                 if (is_expert(name) or \".router.\" in name) == held]\n")]),
    "EP: the combine weights detached": ("ep.py", [(
        "    share = weights.flatten()[order, None] * back\n",
        "    share = weights.flatten()[order, None].detach() * back\n")]),
    "ND: the norm clipped per stage": ("nd.py", [(
        "            dist.all_reduce(grad_norm, group=mesh.get_group(\"pp\"))\n", "")]),
    "ND: the micro-batches counted twice": ("nd.py", [(
        "    spread = args.microbatches * shards[\"dp_cp\"].size()  # M x D x C\n",
        "    spread = shards[\"dp_cp\"].size()  # (mistake) M left out: divided by M twice\n")]),
    "ND: a seed per rank": ("nd.py", [(
        "    if rank == 0:\n        seed_everything(args.seed)\n",
        "    if state is None:  # (mistake) every rank draws its own, from a seed of its own\n"
        "        seed_everything(args.seed + rank)\n"), (
        "broadcast_from_rank0=True, strict=False", "broadcast_from_rank0=False, strict=False")]),
    "ND: the mesh built tp first": ("nd.py", [(
        "    mesh = init_device_mesh(device.type, (args.pp, dp, args.cp, args.tp),\n"
        "                            mesh_dim_names=(\"pp\", \"dp\", \"cp\", \"tp\"))\n",
        "    mesh = init_device_mesh(device.type, (args.tp, dp, args.cp, args.pp),\n"
        "                            mesh_dim_names=(\"tp\", \"dp\", \"cp\", \"pp\"))\n"), (
        "    shards = init_device_mesh(device.type, (args.pp, dp * args.cp, args.tp),\n"
        "                              mesh_dim_names=(\"pp\", \"dp_cp\", \"tp\"))\n",
        "    shards = init_device_mesh(device.type, (args.tp, dp * args.cp, args.pp),\n"
        "                              mesh_dim_names=(\"tp\", \"dp_cp\", \"pp\"))\n")]),
    "TP: a tied weight made a DTensor module by module": ("tp.py", [(
        "plumbing/replicate.py",
        "distribute_module(module, tp_mesh, replicate_once, input_fn=replicated,",
        "distribute_module(module, tp_mesh, input_fn=replicated,"), (
        "plumbing/model_check.py",
        "           else \"splits a tied weight in two\" if len(list(model.parameters())) != tensors "
        "else None)\n",
        "           else None)  # (the count of tensors left unchecked)\n")]),
    "TP: a plan key that names no module": ("tp.py", [(
        "common.py",
        "\"blocks.*.mlp_norm\": \"norm\",",
        "\"blocks.*.ln_2\": \"norm\",  # GPT-2's name\n              ")]),
    # The count's mistakes, shown on data whose counts differ (COUNTED: their --data)
    "the mean of the ranks' means": ("ddp.py", [(
        "        dist.all_reduce(tokens)\n",
        "        tokens = tokens * world_size  # (mistake) each rank's own count, as if all alike\n")]),
    "the mean of the micro-batches' means": ("pipeline.py", [(
        "            return loss_fn(output, target, reduction=\"sum\") * args.microbatches / "
        "tokens\n",
        "            return loss_fn(output, target)  # (mistake) the micro-batch's own mean\n")]),
    "the loss divided by the accumulation steps": ("single.py", [(
        "                loss = loss_fn(model(x), y, reduction=\"sum\") / tokens\n",
        "                loss = loss_fn(model(x), y) / args.accum_steps  # (mistake)\n")]),
    "CP: divided by each rank's own tokens": ("cp.py", [(
        "        dist.all_reduce(tokens)\n",
        "        tokens = tokens * world_size  # (mistake) its own pieces' count, as if all alike\n")]),
    "CP: a packed document attending across its boundary": ("cp.py", [(
        "        may_see = may_see & (docs[:, None, :, None] == all_docs.mT)\n",
        "        pass  # (mistake) causal by position only\n")]),
    "padding counted in evaluation": ("ddp.py", [(
        "            sums[1] += (y != -100).sum()  # the targets that count: cross_entropy skips "
        "-100s\n",
        "            sums[1] += y.numel()  # (mistake) every target, padding's too\n")]),
    # DiLoCo's (diloco.py): the outer step
    "DiLoCo: the pseudo-gradient's sign flipped": ("diloco.py", [(
        "        pseudo = torch.cat([(o - p).flatten() for o, p in zip(outer.parameters(),\n",
        "        pseudo = torch.cat([(p - o).flatten() for o, p in zip(outer.parameters(),\n")]),
    "DiLoCo: the replicas not reset to the outer weights": ("diloco.py", [(
        "        for p, o in zip(model.parameters(), outer.parameters()):\n"
        "            p.copy_(o)  # the next round starts from the outer weights, on every replica\n",
        "        pass  # (mistake) each replica goes on from its own weights\n")]),
    "DiLoCo: the outer step after every inner step": ("diloco.py", [(
        "        if (step + 1) % args.inner_steps == 0:",
        "        if True:  # (mistake) every step ends a round\n        #")]),
    # Ulysses' (cp.py --cp-method ulysses)
    "Ulysses: the loss scaled by C twice": ("cp.py", [(
        "                    loss = loss * world_size / tokens\n",
        "                    loss = loss * world_size * args.cp / tokens  # (mistake) \"each "
        "rank saw 1/C\"\n")]),
    "Ulysses: the trade back with its dimensions swapped": ("cp.py", [(
        "    return AllToAll.apply(out[:, :, all_positions], group, 2, 1)  # back: my tokens, all "
        "heads\n",
        "    return AllToAll.apply(out[:, :, all_positions], group, 1, 2)  # (mistake) dims "
        "swapped\n")]),
    "Ulysses: heads dealt every C-th, joined in blocks": ("cp.py", [(
        "    pieces = torch.stack(x.chunk(dist.get_world_size(group), dim=scatter))  # piece i: "
        "rank i's\n",
        "    cp = dist.get_world_size(group)  # (mistake) piece i: every C-th from i\n"
        "    pieces = torch.stack(x.unflatten(scatter, (-1, cp)).unbind(scatter + 1))\n")]),
}
# The count's mistakes: the data each shows on (where the counts differ per rank, micro-batch,
# CP piece, and padding is there to count)
COUNTED = {"the mean of the ranks' means": "prompt",
           "the mean of the micro-batches' means": "prompt",
           "the loss divided by the accumulation steps": "prompt",
           "CP: divided by each rank's own tokens": "padded",
           "CP: a packed document attending across its boundary": "packed",
           "padding counted in evaluation": "padded"}
# The mixture of the EP mistakes (ep.py's default, spelled out for the oracle)
EP_MIXTURE = {"experts": 4, "top_k": 2}
EP_FLAGS = ["--experts=4", "--top-k=2"]
ND_FLAGS = ["--pp=2", "--tp=1"]

# The mistakes that need several processes, launched together (name: ranks, flags).
LAUNCHED = {
    "sampler seeded per rank": (2, fp64(SEED, steps=4)),
    # 3 ranks: 1000 held-out samples are dealt as 334 + 334 + 334, two duplicates
    "mean of per-rank validation means": (3, fp64(SEED, steps=4)),
    "TP group fed by rank": (2, [*fp64(SEED, steps=4), f"--heads={HEADS}"]),
    "TP: attention that counts its heads": (2, [*fp64(SEED, steps=4), f"--heads={HEADS}"]),
    "TP: a fused qkv layer cut by columns": (2, [*fp64(SEED, steps=2), f"--heads={HEADS}"]),
    "SP: a norm left out of the plan": (2, [*fp64(SEED, steps=4), f"--heads={HEADS}",
                                            "--sequence-parallel"]),
    "pipeline with scale_grads=False": (2, [*fp64(SEED, steps=4), "--microbatches=4"]),
    "FSDP clipped by the norm of the local shards": (2, fp64(SEED, steps=4, clip=FP64_CLIP)),
    "CP: positions not offset per piece": (2, fp64(SEED, steps=4)),
    "CP: loss averaged over a rank's own tokens": (2, [*fp64(SEED, steps=4), "--log-every=1"]),
    # nd.py's FSDP over data x context: 2 x 2, no pipeline, every step's norm printed
    **{name: (4, [*fp64(SEED, steps=4), "--pp=1", "--tp=1", "--cp=2", "--microbatches=2",
                  "--log-every=1"])
       for name in MISTAKES if name.startswith("CP x FSDP")},
    # pp 2 x cp 2: the first stage's pieces
    "ND: positions not passed to the stages": (4, [*fp64(SEED, steps=4), *ND_FLAGS, "--cp=2"]),
    **{name: (2, [*fp64(SEED, steps=4), *EP_FLAGS]) for name in MISTAKES if name.startswith("EP")},
    # the pipeline's mistakes show on 2 stages alone (--tp 1: no TP, no dp)
    "ND: the norm clipped per stage": (2, [*fp64(SEED, steps=4, clip=FP64_CLIP), *ND_FLAGS]),
    "ND: the micro-batches counted twice": (2, [*fp64(SEED, steps=4), *ND_FLAGS]),
    "ND: a seed per rank": (2, [*fp64(SEED, steps=4), *ND_FLAGS]),
    # 3 data ranks; 2 stages of 4 micro-batches; 2 CP ranks
    **{name: ({"ddp.py": 3}.get(MISTAKES[name][0], 2),
              [*fp64(SEED, steps=4), f"--data={data}",
               *(["--microbatches=4"] if MISTAKES[name][0] == "pipeline.py" else [])])
       for name, data in COUNTED.items() if MISTAKES[name][0] != "single.py"},
    # DiLoCo: 2 replicas, rounds of 3 steps, Adam inside, Nesterov outside
    **{name: (2, [*fp64(SEED, steps=6), "--inner-steps=3"]) for name in MISTAKES
       if name.startswith("DiLoCo")},
    # Ulysses: 2 ranks, 2 heads each (JOB's 3 do not cut in 2); every step's norm printed
    **{name: (2, [*fp64(SEED, steps=4), "--cp-method=ulysses", f"--heads={HEADS}",
                  "--log-every=1"]) for name in MISTAKES if name.startswith("Ulysses")},
}


def mutant(name, folder):
    """A copy of the script with the mistake made, as `folder`/<script> (conftest.mutated)."""
    return mutated(*MISTAKES[name], folder, name)


def imported(path):
    """The mutated copy at `path`, imported as a module of its own (not the real script)."""
    spec = importlib.util.spec_from_file_location(f"mutant_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def early_launches(folder):
    """The launched mistakes, each a copy in folder/m<i>, all started when the tests are
    collected (conftest.py): they run while the tests before the zoo do."""
    commands = []
    for i, (name, (nproc, flags)) in enumerate(LAUNCHED.items()):
        path = mutant(name, folder / f"m{i}")
        commands.append(ranks_cmd(nproc, path, *JOB_FLAGS, *flags,
                                     f"--save={path.parent / 'w.pt'}"))
    return commands, {"PYTHONPATH": str(REPO)}  # the copies live outside the repo: common.py


@pytest.fixture(scope="module")
def launched():
    """{name: (stdout, the file of its saved weights)} of every launched mistake."""
    folder, results = early_results(__name__)
    return {name: (ok(result), folder / f"m{i}" / "w.pt")
            for i, (name, result) in enumerate(zip(LAUNCHED, results))}


def distance(weights, steps=FP64_JOB["steps"], heads=JOB["heads"], data="repeat", **moe):
    """Max weight difference from the fp64 oracle on SEED (FP64_JOB, or `steps` steps; with
    `moe`, the mixture's; on --data `data`); weights: a state_dict, or the file a launched
    mistake saved."""
    if not isinstance(weights, dict):
        weights = load_saved(weights)
    return max_diff(weights, fp64_reference(SEED, steps, heads=heads, data=data, **moe)[1])


def test_every_mistake_replaces_lines_the_real_script_holds_exactly_once(tmp_path):
    for name in MISTAKES:
        folder = mutant(name, tmp_path / str(abs(hash(name)))).parent
        assert any(copy.read_text() != (REPO / copy.relative_to(folder)).read_text()
                   for copy in folder.rglob("*") if copy.is_file()), name


def test_no_set_epoch_replays_epoch_0s_order_and_misses_the_oracle(tmp_path):
    """Every epoch gets epoch 0's permutation; one device draws a new one each epoch."""
    _, weights = run_as_only_rank(imported(mutant("no set_epoch", tmp_path)), fp64(SEED),
                                  tmp_path)
    assert distance(weights) > FP64_TOL


def test_a_sampler_seeded_per_rank_deals_overlapping_shards_and_misses_the_oracle(launched):
    """Each rank shuffles differently: some samples twice in an epoch, others never."""
    assert distance(launched["sampler seeded per rank"][1], steps=4) > FP64_TOL


def all_reduces_per_step(trace):
    """The gradients' all-reduces of each recorded step: from its first forward on (the step's
    count of targets, one all-reduce of an integer, comes before it)."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    counts = []
    for s in steps:
        inside = [e for e in events if s["ts"] <= e["ts"] < s["ts"] + s["dur"]]
        first = min(e["ts"] for e in inside if e["name"] == "forward")
        counts.append(sum(1 for e in inside if e["ts"] >= first
                          and e["name"] in ("gloo:all_reduce", "nccl:all_reduce")))
    return counts


def test_no_sync_around_backward_only_all_reduces_every_micro_batch(tmp_path):
    """The weights stay right (the K all-reduced averages add up to the same gradient), so no
    comparison with one device can see it: count the collectives. ddp.py all-reduces once per
    step with 3 micro-batches; the mistake, whose forward ran outside no_sync() and so armed
    DDP's hooks for every backward, 3 times. (One rank, in this process: DDP all-reduces even
    then.)"""
    flags = ["--accum-steps=3", f"--profile={tmp_path}/real"]
    run_as_only_rank("ddp", flags, tmp_path)
    assert all_reduces_per_step(tmp_path / "real" / "trace_rank0.json") == [1, 1, 1]
    module = imported(mutant("no_sync around backward only", tmp_path / "m"))
    _, weights = run_as_only_rank(module, [*fp64(SEED), "--accum-steps=3",
                                           f"--profile={tmp_path}/mutant"], tmp_path)
    assert all_reduces_per_step(tmp_path / "mutant" / "trace_rank0.json") == [3, 3, 3]
    assert distance(weights) < FP64_TOL  # why only counting catches it


def test_the_mean_of_per_rank_validation_means_misses_the_exact_held_out_loss(launched):
    """On 3 ranks the held-out set pads (1002 indices for 1000 samples): averaging the
    per-rank means counts two samples twice. Training is untouched; the number printed is
    wrong."""
    out, weights = launched["mean of per-rank validation means"]
    assert distance(weights, steps=4) < FP64_TOL
    exact = reference_val_loss(fp64_reference(SEED, 4)[1], JOB["hidden"], JOB["blocks"],
                               JOB["heads"])
    assert abs(summary_val_loss(out) - exact) > 10 * VAL_TOL


def test_the_ddp_wrappers_state_dict_does_not_load_into_simplemodel(tmp_path):
    """DDP's own state_dict names every weight "module.<name>": the checkpoint no longer loads
    strictly into the model, so single.py, or ddp.py on another world size, cannot resume it;
    the real ddp.py says why in its one line."""
    import ddp
    module = imported(mutant("DDP wrapper's state_dict saved", tmp_path / "m"))
    ckpt = tmp_path / "ckpt.pt"
    run_as_only_rank(module, [f"--checkpoint={ckpt}"], tmp_path)
    state = torch.load(ckpt, weights_only=True)["model"]
    assert all(key.startswith("module.") for key in state)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        SimpleModel(JOB["hidden"], JOB["blocks"], JOB["heads"]).load_state_dict(state)
    args = ddp.parse_args([*JOB_FLAGS, "--nproc=1", f"--checkpoint={ckpt}"])
    with pytest.raises(SystemExit, match="named module.<name>: saved from the DDP wrapper"):
        ddp.load_checkpoint(args, SimpleModel(JOB["hidden"], JOB["blocks"], JOB["heads"]), None)


def test_a_loss_not_divided_when_accumulating_misses_the_oracle(tmp_path):
    """K micro-batch gradients add up to K times the batch's. Adam is nearly scale-free, so
    the weights move only by what eps makes of it: fp64 sees it plainly (docs/exercises.md)."""
    out, weights = run_in_process(imported(mutant("loss not divided when accumulating",
                                                  tmp_path)),
                                  [*fp64(SEED), "--accum-steps=3"], tmp_path)
    assert distance(weights) > FP64_TOL
    # and the printed loss is the sum of the micro-batches' means: 3 times the batch's
    assert logged_losses(out)[0] == pytest.approx(3 * fp64_reference(SEED)[2][0], abs=1e-6)


def test_a_tp_group_fed_by_rank_computes_slices_of_different_samples(launched):
    """Each rank of a TP group computes its slice of the inner units for other samples, and the
    all-reduce adds up pieces of different samples: it trains, and only one device shows it."""
    assert distance(launched["TP group fed by rank"][1], steps=4, heads=HEADS) > FP64_TOL


def test_attention_that_counts_its_heads_splits_a_tp_slice_into_too_many(launched):
    """After TP a rank's q, k and v hold H/T heads; an attention that splits them into its
    H heads (each of 1/T the width) still fits the shapes, and runs over the wrong numbers
    (with the wrong scale). Split by the head's width, the count is what the rank holds."""
    assert distance(launched["TP: attention that counts its heads"][1], steps=4,
                    heads=HEADS) > FP64_TOL


def test_a_fused_qkv_layer_cut_by_columns_mixes_q_k_and_v_from_the_first_step(launched):
    """One layer for q, k and v (their weights stacked by rows), cut by ColwiseParallel like the
    separate ones: rank 0 gets q and half of k, rank 1 the other half and v, and chunk(3) on a
    rank's slice calls q's columns k, and k's v. Shapes fit; the first step's loss is already
    not one device's (the fused layer holds the same numbers as the three, so one device would
    compute that loss exactly)."""
    out, _ = launched["TP: a fused qkv layer cut by columns"]
    first = logged_losses(out)[0]
    # printed to 6 decimals (5e-7 of rounding); measured 2.1e-3 away (docs/exercises.md)
    assert abs(first - fp64_reference(SEED, 2, heads=HEADS)[2][0]) > 1e-4


def test_a_tied_weight_made_a_dtensor_module_by_module_trains_two_copies(tmp_path,
                                                                        monkeypatch):
    """torch's distribute_module makes each module's parameters DTensors of their own: a head
    tied to its embedding becomes two parameters, each stepping on its own gradient. It trains,
    and ends away from one device, the saved head no longer the embedding. (The count of its
    tensors after tp.py's cut, plumbing/model_check.py's check_cut, refuses it in one line:
    tests/test_tp.py; here that check is gone too.)"""
    import single
    path = mutant("TP: a tied weight made a DTensor module by module", tmp_path)
    module = imported(path)
    # The copy imports the real plumbing/: it is handed the copied files, with the mistakes
    checks = imported(path.parent / "plumbing" / "model_check.py")
    monkeypatch.setattr(module, "check_cut", checks.check_cut)
    replicate = imported(path.parent / "plumbing" / "replicate.py")
    monkeypatch.setattr(module, "replicate_the_rest", replicate.replicate_the_rest)
    for script in (common, single, module):  # the user's line at the end of common.py
        monkeypatch.setattr(script, "SimpleModel", TiedHead)
    flags = [*fp64(SEED, steps=4), f"--heads={HEADS}"]
    _, one = run_in_process("single", flags, tmp_path)
    _, weights = run_as_only_rank(module, flags, tmp_path)
    assert torch.equal(one["output.weight"], one["embed.weight"])
    assert not torch.equal(weights["output.weight"], weights["embed.weight"])
    assert max_diff(weights, one) > FP64_TOL


def test_a_tp_plan_key_that_names_no_module_is_refused_in_one_line(tmp_path, as_torchrun,
                                                                   monkeypatch, capsys):
    """A plan written with another model's names: torch's parallelize_module warns that it
    "could not be resolved" and skips it, and under SP the MLP's norm, left whole, trains on
    each rank's part of the sequence (the norm left out of the plan, above). tp.py checks
    every key against the model before any process starts."""
    copy = imported(mutant("TP: a plan key that names no module", tmp_path).with_name("common.py"))
    monkeypatch.setattr(common, "SimpleModel", copy.SimpleModel)
    as_torchrun(2)
    refused_in_one_line("tp", [f"--heads={HEADS}", "--sequence-parallel"],
                        "SimpleModel.tp_plan: 'blocks.*.ln_2' names no module of SimpleModel",
                        capsys)


def test_an_optimizer_built_before_fully_shard_trains_nothing(tmp_path):
    """It holds the parameters fully_shard replaced: no gradient ever reaches them."""
    module = imported(mutant("optimizer built before fully_shard", tmp_path / "m"))
    out, weights = run_as_only_rank(module, fp64(SEED, steps=4), tmp_path)
    assert max_diff(weights, fp64_reference(SEED, 4)[0]) == 0.0  # never moved
    assert distance(weights, steps=4) > FP64_TOL


def test_a_norm_left_out_of_the_sequence_parallel_plan_misses_the_oracle(launched):
    """Under SP the MLP's norm, left a plain LayerNorm, still runs (on this rank's part of the
    sequence), but nothing adds its gradient up over the TP group: each rank steps its copy
    with its own tokens' gradient, and the copies part from one device and from each other."""
    assert distance(launched["SP: a norm left out of the plan"][1], steps=4,
                    heads=HEADS) > FP64_TOL


def test_a_pipeline_with_scale_grads_false_misses_the_oracle(launched):
    """The last stage's loss_fn returns each micro-batch's mean; without scale_grads the
    gradient is the sum of M of them, M times the batch's (Adam hides most of it)."""
    assert distance(launched["pipeline with scale_grads=False"][1], steps=4) > FP64_TOL


def test_clipping_before_unscale_clips_the_scaled_gradient(tmp_path):
    """amp.py's own unscale test (tests/test_amp.py), applied to the mistake, one fp16 step at
    the scaler's first scale, 65536: the norm measured and printed is 65536 times the true one
    (fp32's, to fp16's rounding), and the gradient Adam receives is 65536 times too small."""
    scale, norms = 65536.0, []
    reference_train(**JOB, clip=CLIP, norms=norms)
    out, _, seen = run_seeing_the_gradient_adam_gets(
        imported(mutant("clipping before unscale_", tmp_path)),
        ["--dtype=fp16", "--device=cpu", f"--clip={CLIP}", "--steps=1"], tmp_path)
    assert logged_norms(out)[1] == pytest.approx(scale * norms[0], rel=0.01)
    assert seen == pytest.approx([CLIP / scale], rel=1e-3)





def test_fsdp_clipped_by_the_norm_of_its_local_shards_clips_each_rank_by_its_own_factor(
        launched):
    """The norm of one rank's shards is part of the whole gradient's (on 2 ranks about 1/sqrt(2)
    of it), and another on each rank: every rank scales its shards by a factor of its own, and
    the clip is too weak (pytorch/pytorch#170862). fsdp.py's clip_grad_norm_ on the DTensors
    prints the oracle's norm (tests/test_fsdp.py)."""
    out, weights = launched["FSDP clipped by the norm of the local shards"]
    _, expected, _, norms, _ = fp64_reference(SEED, 4, FP64_CLIP)
    assert logged_norms(out)[1] < 0.9 * norms[0]  # rank 0's part, printed as if the whole
    assert max_diff(load_saved(weights), expected) > FP64_TOL


def test_positions_not_offset_per_piece_miss_the_oracle(launched):
    """Each rank's tokens read the position embeddings of 0, 1, 2, ...: rank 1's pieces (the
    2nd and 3rd quarters of each sequence) are taken for the sequence's first tokens."""
    assert distance(launched["CP: positions not offset per piece"][1], steps=4) > FP64_TOL


def test_a_cp_loss_averaged_over_a_ranks_own_tokens_prints_another_loss(launched):
    """The weights are right (DDP still averages every rank's gradient) but the loss printed is
    rank 0's own tokens' mean (the first and the last quarter of each sequence), not the
    batch's: every logged step but the first is off by more than 1e-3 (the untrained model
    gives every token about ln 32), where the right one equals one device's to 1e-6."""
    out, path = launched["CP: loss averaged over a rank's own tokens"]
    assert distance(path, steps=4) < FP64_TOL
    losses = fp64_reference(SEED, 4)[2]
    printed = logged_step_losses(out)
    assert sorted(printed) == [1, 2, 3, 4]
    assert all(abs(printed[step] - losses[step - 1]) > 1e-3 for step in (2, 3, 4))


def test_fsdp_over_dp_only_under_cp_never_adds_a_cp_groups_parts_of_each_gradient(launched):
    """FSDP shards over "dp" (2 ranks) and averages each gradient there; the 2 CP ranks of a
    group, each holding the gradient of its own tokens only, never add theirs up: every rank
    steps on half its gradient's terms, silently (it trains). Over dp x cp, the same run is
    one device's (tests/test_cp.py)."""
    out, weights = launched["CP x FSDP: sharded over dp only"]
    assert logged_losses(out)[-1] < logged_losses(out)[0]
    assert distance(weights, steps=4) > FP64_TOL


def test_a_cp_loss_normalized_twice_prints_a_gradient_norm_w_times_too_small(launched):
    """Each rank's loss is its tokens' sum over the global count, without the factor D x C = 4
    that FSDP's average over the 4 ranks takes back: the gradient is 1/4 of one device's, and the first step's printed norm is
    exactly 1/4 of its. Adam is nearly blind to a gradient's scale (it divides by its running
    size; only its epsilon sees it), so it steps almost as it should: the later norms stay
    within 1e-3 of 1/4 of one device's, and the weights miss by far less than 4x."""
    out, weights = launched["CP x FSDP: the loss normalized twice"]
    norms = [n / 4 for n in fp64_reference(SEED, 4)[3]]
    printed = list(logged_norms(out).values())
    assert printed[0] == pytest.approx(norms[0], rel=1e-6)
    assert printed == pytest.approx(norms, rel=1e-3)
    assert distance(weights, steps=4) > FP64_TOL


def test_positions_not_passed_to_the_stages_embed_every_piece_at_the_start(launched):
    """Without the keyword, the first stage embeds each rank's pieces at positions 0..S/C-1:
    every piece but rank 0's first quarter is embedded at another place than its own (rank
    1's 2nd and 3rd quarters as the sequence's start). It trains, and misses one device."""
    out, weights = launched["ND: positions not passed to the stages"]
    assert logged_losses(out)[-1] < logged_losses(out)[0]
    assert distance(weights, steps=4) > FP64_TOL


def test_a_ring_that_skips_a_hop_on_some_ranks_fails_in_one_line_within_its_timeout(tmp_path):
    """Rank 0 skips the hops whose keys come from later ranks (masked for its first chunk,
    not for its second), and the exchange at the bottom of the loop with them: its neighbours'
    sends and receives go unmatched. With --timeout 2 the job ends in seconds, each rank that
    gave up saying so in one line; the test's own limit (90 s) is what a hang would meet.
    (Only this broken copy gets so short a timeout: whenever it fires, the line is the same.)"""
    path = mutant("CP ring: a hop skipped where its keys are masked", tmp_path)
    result = launch(*ranks_cmd(4, path, *JOB_FLAGS, *fp64(SEED, steps=4), "--cp-method=ring",
                               "--timeout=2"), env={"PYTHONPATH": str(REPO)})
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and all(line.startswith("cp.py: error: rank ") and
                         "a collective gave up" in line and "--timeout 2 s" in line
                         for line in lines), result.stderr



def assert_an_ep_mistake_trains_and_misses_the_oracle(launched, name):
    """An expert-parallel mistake that a loss curve does not show: it trains, and it ends away
    from one device in float64."""
    out, weights = launched[name]
    assert logged_losses(out)[-1] < logged_losses(out)[0]
    assert distance(weights, steps=4, **EP_MIXTURE) > FP64_TOL


def test_an_ep_balancing_loss_from_each_ranks_routing_misses_the_oracle(launched):
    """A product of means over this rank's tokens: not the loss of one device's micro-batch."""
    assert_an_ep_mistake_trains_and_misses_the_oracle(
        launched, "EP: the balancing loss from each rank's own routing")


def test_an_expert_gradient_averaged_over_its_holders_is_ep_times_too_large(launched):
    """Divided by the W/EP ranks that hold the expert, not by W: EP times one device's gradient
    (pytorch/pytorch#160285's 2x at EP 2, where the loss curves looked alike)."""
    assert_an_ep_mistake_trains_and_misses_the_oracle(
        launched, "EP: an expert's gradient averaged over its holders")


def test_routers_not_summed_across_the_ranks_drift_apart(launched):
    """A router is replicated on every rank; summed over "dp" only, each rank's copy steps on
    its own tokens' gradient and the copies part."""
    assert_an_ep_mistake_trains_and_misses_the_oracle(
        launched, "EP: the routers' gradients not summed across the ranks")


def test_combine_weights_detached_leave_the_router_to_the_balancing_loss(launched):
    """The router's probabilities weigh the experts' outputs; detached there, the loss no longer
    teaches the router which experts help, only the balancing loss does."""
    assert_an_ep_mistake_trains_and_misses_the_oracle(launched, "EP: the combine weights detached")


def test_a_norm_clipped_per_stage_clips_each_stage_by_a_factor_of_its_own(launched):
    """Each stage clips its own part of the gradient to the whole norm's bound: every part
    passes, the whole gradient is clipped too weakly, and rank 0 prints its stage's norm."""
    out, weights = launched["ND: the norm clipped per stage"]
    _, expected, _, norms, _ = fp64_reference(SEED, 4, FP64_CLIP)
    assert logged_norms(out)[1] < 0.99 * norms[0]  # stage 0's part, printed as the whole
    assert max_diff(load_saved(weights), expected) > FP64_TOL


def test_micro_batches_counted_twice_make_the_gradient_m_times_too_small(launched):
    """scale_grads divides the M micro-batches' gradients by M; a loss without its factor M
    makes the batch's gradient M times too small (and the printed loss M times too)."""
    out, weights = launched["ND: the micro-batches counted twice"]
    assert logged_losses(out)[0] == pytest.approx(fp64_reference(SEED, 4)[2][0] / 4, abs=1e-6)
    assert distance(weights, steps=4) > FP64_TOL


def test_a_seed_per_rank_starts_from_weights_one_device_never_had(launched):
    """One device's weights are drawn once, from --seed, and sent to every rank: a rank that
    draws its own, from a seed of its own, trains, but from another starting point (the first
    loss already differs)."""
    out, weights = launched["ND: a seed per rank"]
    assert abs(logged_losses(out)[0] - fp64_reference(SEED, 4)[2][0]) > 1e-4
    assert distance(weights, steps=4) > FP64_TOL


def test_a_mesh_built_tp_first_is_refused_in_one_line_where_tp_would_span_machines(
        tmp_path, world_of_8):
    """(tp, dp, pp) puts a TP group's ranks pp x dp apart: on 2 machines of 4 ranks, ranks 0
    and 4, so every block's all-reduces cross the network. nd.py checks the mesh it built."""
    module = imported(mutant("ND: the mesh built tp first", tmp_path))
    world_of_8(4)
    with pytest.raises(SystemExit, match=r"the TP group \[0, 4\] spans machines of 4 "
                                         r"ranks: build the mesh with \"tp\" last"):
        module.make_mesh(types.SimpleNamespace(pp=2, cp=1, tp=2), 8, torch.device("cpu"))



def missed_where_the_counts_differ(launched, name):
    """The launched mistake `name` ends away from one device trained on its data (COUNTED)."""
    _, path = launched[name]
    assert distance(path, steps=4, data=COUNTED[name]) > FP64_TOL


def test_the_mean_of_the_ranks_means_misses_the_oracle(launched):
    """Each rank divides by its own count, and DDP averages: a rank with few targets that
    count weighs as much as one with many."""
    missed_where_the_counts_differ(launched, "the mean of the ranks' means")


def test_the_mean_of_the_micro_batches_means_misses_the_oracle(launched):
    """Each pipeline micro-batch's own mean, the M of them averaged by scale_grads."""
    missed_where_the_counts_differ(launched, "the mean of the micro-batches' means")


def test_cp_divided_by_a_ranks_piece_count_misses_the_oracle(launched):
    """Each CP rank divides by the targets of its own pieces; padding falls on some only."""
    missed_where_the_counts_differ(launched, "CP: divided by each rank's own tokens")


def test_cp_attending_across_its_boundary_misses_the_oracle(launched):
    """The all-gather masks by position only: a packed document reads the one before it."""
    missed_where_the_counts_differ(launched,
                                   "CP: a packed document attending across its boundary")


def test_the_loss_divided_by_the_accumulation_steps_misses_the_oracle(tmp_path):
    """Each micro-batch's own mean over K: right only when every micro-batch counts as many
    targets. Here they differ, and the weights end away from one device."""
    name = "the loss divided by the accumulation steps"
    _, weights = run_in_process(imported(mutant(name, tmp_path)),
                                [*fp64(SEED, steps=4), "--accum-steps=3",
                                 f"--data={COUNTED[name]}"], tmp_path)
    assert distance(weights, steps=4, data=COUNTED[name]) > FP64_TOL


def test_padding_counted_in_evaluation_misses_the_exact_held_out_loss(launched):
    """The weights are right; the validation loss divides by every target, padding's too."""
    name = "padding counted in evaluation"
    out, path = launched[name]
    assert distance(path, steps=4, data="padded") < FP64_TOL
    exact = reference_val_loss(fp64_reference(SEED, 4, data="padded")[1], JOB["hidden"],
                               JOB["blocks"], JOB["heads"],
                               data=common.make_dataset("val", "padded"))
    assert abs(summary_val_loss(out) - exact) > 100 * VAL_TOL


def diloco_oracle(steps=6):
    """reference_diloco's (final outer weights, losses) for the DiLoCo mistakes' flags: 2
    replicas, rounds of 3 steps, diloco.py's default outer lr and momentum, on SEED."""
    _, final, losses = reference_diloco(
        steps, FP64_JOB["batch_size"], FP64_JOB["lr"], SEED, JOB["hidden"], JOB["blocks"],
        JOB["heads"], ranks=2, inner_steps=3, outer_lr=0.7, outer_momentum=0.9, fp64=True)
    return final, losses


def test_a_diloco_pseudo_gradient_of_the_wrong_sign_steps_the_outer_weights_away(launched):
    """local - outer, not outer - local: the outer step undoes what the replicas learned (and
    momentum carries it on); the outer weights end worse on the held-out set than the right
    loop's."""
    out, path = launched["DiLoCo: the pseudo-gradient's sign flipped"]
    expected, _ = diloco_oracle()
    assert max_diff(load_saved(path), expected) > FP64_TOL
    exact = reference_val_loss(expected, JOB["hidden"], JOB["blocks"], JOB["heads"])
    assert summary_val_loss(out) > exact + 100 * VAL_TOL


def test_diloco_replicas_not_reset_to_the_outer_weights_drift_apart(launched):
    """Each replica goes on from its own weights: the next pseudo-gradient counts the rounds
    before again, and the outer weights miss the plain loop's."""
    _, path = launched["DiLoCo: the replicas not reset to the outer weights"]
    assert max_diff(load_saved(path), diloco_oracle()[0]) > FP64_TOL


def test_a_diloco_outer_step_after_every_inner_step_misses_the_oracle(launched):
    """Every step ends a round: H = 1 whatever --inner-steps says (and H times the bytes).
    The first round's loss is the same; the weights are not the plain loop's."""
    out, path = launched["DiLoCo: the outer step after every inner step"]
    expected, losses = diloco_oracle()
    assert logged_losses(out)[0] == pytest.approx(losses[0], abs=1e-6)
    assert max_diff(load_saved(path), expected) > FP64_TOL


def test_a_ulysses_loss_scaled_by_c_twice_prints_c_times_the_gradient_norm(launched):
    """DDP averages over every rank and the loss is already multiplied by their number: C
    more ("each rank saw 1/C of the tokens") makes every gradient C = 2 times one device's.
    Adam divides most of the scale away (only its epsilon sees it), so the weights stay near
    and the later norms near twice the oracle's; the first step's norm is exactly twice its
    (the weights still the same), and the loss printed twice."""
    out, _ = launched["Ulysses: the loss scaled by C twice"]
    _, _, losses, norms, _ = fp64_reference(SEED, 4, heads=HEADS)
    printed = logged_norms(out)
    assert sorted(printed) == [1, 2, 3, 4]
    assert printed[1] == pytest.approx(2 * norms[0], rel=1e-6)
    assert all(printed[step] == pytest.approx(2 * norms[step - 1], rel=1e-3) for step in printed)
    assert logged_step_losses(out)[1] == pytest.approx(2 * losses[0], abs=1e-5)


def test_a_ulysses_trade_back_with_its_dimensions_swapped_trains_silently_wrong(launched):
    """Cutting the output's heads and joining its tokens gives a tensor of the same size: the
    attention's reshape takes it without a word, and every rank's tokens read other tokens'
    outputs. It trains (the loss falls) and misses the oracle from the first step."""
    out, path = launched["Ulysses: the trade back with its dimensions swapped"]
    assert logged_losses(out)[-1] < logged_losses(out)[0]
    assert distance(path, steps=4, heads=HEADS) > 1e-3


def test_ulysses_heads_dealt_every_c_th_and_joined_in_blocks_miss_the_oracle(launched):
    """Dealt strided, joined contiguous: q, k and v still meet head for head (each traded
    alike), but the trade back deals tokens every C-th, and the heads come back in another
    order; o reads the wrong heads at the wrong tokens."""
    _, path = launched["Ulysses: heads dealt every C-th, joined in blocks"]
    assert distance(path, steps=4, heads=HEADS) > 1e-3


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
