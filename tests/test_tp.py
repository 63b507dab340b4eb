"""tp.py: cutting every block over T ranks (tensor parallelism), and 2D (FSDP across TP groups),
trains to the same weights as one device; its checkpoints resume on another mesh; each rank
holds its share; one TP forward and backward make exactly the theory's collectives; a TP group
fed different data on its ranks would be caught; a head tied to the embedding stays one tensor
and trains as one device trains it, and a plan that would split it, or cut nothing, stops. Its
by-hand twin, from_scratch/tp.py (Megatron-LM's f and g on plain tensors), equals it in float64
and makes Megatron-LM's collectives; its mistakes are caught (the end of this file)."""

import importlib
import re
import shutil

import pytest
import torch
import torch.distributed as dist

import common
import plumbing.ranks
from common import SEQ_LEN, VOCAB, SimpleModel
from conftest import (CUDA_DEFAULTS, CUDA_JOB_FLAGS, FP32_VAL_TOL, FP64_CLIP, FP64_SEEDS, FP64_TOL,
                      JOB, JOB_FLAGS, REPO, TOL, assert_checkpoints_resume_to_the_oracle,
                      assert_fp64_run_equals_the_fp64_oracle, assert_gpu_run_equals_oracle,
                      assert_norms_are_the_oracles, early_results, fp64, fp64_reference, load_saved,
                      logged_losses, logged_norms, logged_step_losses, logged_val_losses,
                      max_diff, mutated, needs_2_gpus, needs_cuda, ok, ranks_cmd,
                      refused_in_one_line, run_as_only_rank, run_commands, run_in_process,
                      succeeded, summary_val_loss, torchrun)

SEED_A, SEED_B = FP64_SEEDS[0], FP64_SEEDS[-1]

# TP cuts whole heads, so T must divide --heads: JOB's 3 heads on TP 3 (one head per rank), and
# 4 heads (JOB's width, 24, in heads of 6) where T is 2 or 4.
HEADS = 4
HAND = "from_scratch/tp.py"  # the by-hand twin: Megatron-LM's f and g on plain tensors
# `python tp.py` starts its own 2 workers, plain TP; they accumulate 2 micro-batches per step,
# through blocks that recompute their activations (compiling is proven in single.py: on a
# 2-core CPU it costs each process seconds). The by-hand twin runs with the same flags.
SPAWN_2 = [CUDA_DEFAULTS, "--nproc=2", *fp64(SEED_B), f"--heads={HEADS}", "--accum-steps=2",
           "--activation-checkpointing"]
RUNS = {  # name: (ranks, conftest.ranks_cmd, or None for `python tp.py`; extra flags)
    # fp32, what users run: pure TP, each block cut in 3 (one head per rank), on the short job
    "3 ranks, tp 3": (3, []),
    # fp64 on odd flags. 2D: 2 TP groups of 2, FSDP across them as HSDP (2 replicas of one
    # shard: fsdp.py's --replicate), with sequence and loss parallelism inside each group, 2
    # micro-batches, and clipping (the cut layers' gradients on the 2D mesh, the rest on "dp"
    # only); its checkpoint (step 40) is continued as TP 4 with SP and loss parallelism below
    "fp64, 4 ranks, 2D 2x2 as HSDP, SP, LP, accum 2, clip, CUDA's Adam": (4, [
        CUDA_DEFAULTS, *fp64(SEED_A, clip=FP64_CLIP), f"--heads={HEADS}", "--tp=2",
        "--replicate=2", "--sequence-parallel",
        "--loss-parallel", "--accum-steps=2", "--checkpoint={folder}/2d"]),
    # fsdp.py's other two options in 2D: bf16 compute, the gathered weights kept from forward
    # to backward (also in fp64, exactly: tests/test_own_model.py's GPT through tp.py)
    "bf16, 4 ranks, 2D 2x2, reshard false": (4, [f"--heads={HEADS}", "--tp=2",
                                                 "--mixed-precision=bf16",
                                                 "--reshard-after-forward=false"]),
    "fp64, spawn 2 ranks, tp 2, accum 2, AC, CUDA's Adam": (None, SPAWN_2),
    # the by-hand twin, compared with the run above directly
    "by hand: fp64, spawn 2 ranks, tp 2, accum 2, AC, CUDA's Adam": (None, SPAWN_2, HAND),
    # and on 3 ranks, one head each, 3 micro-batches, clipped by the whole gradient's norm
    "by hand: fp64, 3 ranks, tp 3, accum 3, clip": (3, [*fp64(SEED_A, clip=FP64_CLIP),
                                                        "--accum-steps=3"], HAND),
}
FP64_RUNS = dict(zip([name for name in RUNS if "fp64" in name], [  # name: (seed, clip, heads)
    (SEED_A, FP64_CLIP, HEADS), (SEED_B, None, HEADS), (SEED_B, None, HEADS),
    (SEED_A, FP64_CLIP, JOB["heads"])]))


def early_launches(folder):
    """RUNS, and the by-hand twin's mistakes (HAND_MISTAKES, below), each a copy in
    folder/m<i>: all queued when the tests are collected."""
    commands, _ = run_commands("tp.py", RUNS, folder)
    for i, (name, edits) in enumerate(HAND_MISTAKES.items()):
        path = mutated(HAND, edits, folder / f"m{i}", name)
        commands.append(ranks_cmd(2, path, *JOB_FLAGS, *fp64(SEED_A, steps=4),
                                  f"--heads={HEADS}", f"--save={folder / f'm{i}' / 'w.pt'}"))
    return commands, {"PYTHONPATH": str(REPO)}  # the copies live outside the repo: plumbing/


@pytest.fixture(scope="module")
def early():
    return early_results(__name__)


@pytest.fixture(scope="module")
def runs(early):
    folder, results = early
    return dict(zip(RUNS, zip(results, run_commands("tp.py", RUNS, folder)[1])))


@pytest.fixture(scope="module")
def hand_mistakes(early):
    """{name: (stdout, saved weights)} of each of the by-hand twin's mistakes."""
    folder, results = early
    return {name: (ok(result), load_saved(folder / f"m{i}" / "w.pt")) for i, (name, result)
            in enumerate(zip(HAND_MISTAKES, results[len(RUNS):]))}


def test_tp_on_3_ranks_with_one_head_each_equals_one_device_in_fp32(runs, reference,
                                                                    reference_val):
    out, weights = succeeded(runs["3 ranks, tp 3"])  # --save: a plain state_dict
    assert max_diff(weights, reference[1]) < TOL
    assert summary_val_loss(out) == pytest.approx(reference_val, abs=FP32_VAL_TOL)
    assert logged_losses(out)[-1] == pytest.approx(reference[2][-1], abs=1e-5)
    assert_norms_are_the_oracles(out, reference[3])  # shards and whole layers, one norm


def test_a_clipped_2d_run_says_nothing_that_sounds_like_a_bug(runs):
    """torch's clip_grad_norm_ sums a 2D gradient's norm over "dp", then "tp", and DTensor logs
    on every rank that this is "suboptimal" and "may give inconsistent results between ranks";
    plumbing.ranks.quiet_known_warnings says why it cannot here, and silences it. (Torch's own
    deprecation warnings, such as torch 2.10's DCP "TypedStorage is deprecated", are not ours.)"""
    result, _ = runs["fp64, 4 ranks, 2D 2x2 as HSDP, SP, LP, accum 2, clip, CUDA's Adam"]
    ok(result)
    noise = [line for line in (result.stdout + result.stderr).splitlines()
             if re.search(r"suboptimal|inconsistent results|^\[rank\d+\]:W", line)]
    assert not noise, noise


@pytest.mark.parametrize("name", FP64_RUNS)
def test_fp64_tp_sp_lp_2d_clipping_and_accumulation_equal_the_fp64_oracle(name, runs):
    seed, clip, heads = FP64_RUNS[name]
    assert_fp64_run_equals_the_fp64_oracle(succeeded(runs[name]), seed, clip=clip, heads=heads)


def test_bf16_2d_with_the_weights_kept_for_backward_trains_to_the_fp32_loss(runs):
    """fsdp.py's --mixed-precision and --reshard-after-forward in tp.py's 2D: bf16 compute, fp32
    reductions and state, on 2 x 2 ranks, ends at the fp32 oracle's loss to fsdp.py's bf16
    tolerance (1%), and trains."""
    from reference import reference_train
    losses = reference_train(**dict(JOB, heads=HEADS))[2]
    printed = logged_losses(succeeded(runs["bf16, 4 ranks, 2D 2x2, reshard false"])[0])
    assert printed[-1] < printed[0] - 0.1
    assert printed[-1] == pytest.approx(losses[-1], rel=0.01)


def test_fp64_checkpoint_resumes_on_another_mesh_2d_to_tp4(runs, tmp_path):
    """The 2D run's sharded checkpoint (step 40: HSDP, each block in halves over TP, whole on
    each replica; the output layer in halves), continued to step 48 as TP 4 with SP and loss parallelism (each
    block and the output layer cut in 4 over a 1x4 mesh; 4 tokens of each sequence and 8 of
    each token's 32 logits per rank), clipping as it did, ends within 1e-9 of 48
    uninterrupted steps on one device."""
    folder = runs["3 ranks, tp 3"][1].parent
    shutil.copytree(folder / "2d", tmp_path / "on4")
    assert_checkpoints_resume_to_the_oracle(
        "tp.py", {(4, f"--heads={HEADS}", "--sequence-parallel", "--loss-parallel"):
                  tmp_path / "on4"}, tmp_path, SEED_A, FP64_CLIP, heads=HEADS)


def test_fp64_tp_on_one_rank_with_cudas_adam_equals_the_fp64_oracle(tmp_path, cuda_defaults):
    """Pure TP on one rank, the GPU test's layout, with Adam on its foreach path as on CUDA:
    every parameter, cut or not, is a DTensor (a plain tensor beside them stops foreach at
    the first step, below)."""
    run = run_as_only_rank("tp", [*fp64(SEED_B), f"--heads={HEADS}"], tmp_path)
    assert_fp64_run_equals_the_fp64_oracle(run, SEED_B, heads=HEADS)


def test_cudas_adam_stops_on_a_plain_tensor_beside_dtensors(fake_group, cuda_defaults):
    """Why every parameter is a DTensor: what tp.py did when it left the uncut layers plain,
    and what the CPU's default path (a loop, not foreach) never shows."""
    from torch.distributed.tensor import Replicate, distribute_tensor
    mesh = fake_group(1, 2)
    plain = torch.nn.Parameter(torch.ones(4))
    cut = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh["tp"], [Replicate()]))
    (plain.sum() + cut.to_local().sum()).backward()
    cut.grad = distribute_tensor(torch.ones(4), mesh["tp"], [Replicate()])
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        torch.optim.Adam([plain, cut]).step()


def state_mib(stdout):
    return float(re.search(r"\| state ([0-9.]+) MiB/rank", stdout).group(1))


def cut_by_tp(name, vocab_parallel=False):
    """Whether TP cuts this parameter: q, k, v and up (weights and biases) by output columns,
    o and down (weights) by input rows. Their biases (added once, after the all-reduce), the
    norms, the embeddings and the output layer stay whole; with loss parallelism the output
    layer is cut by vocabulary (its rows and its bias)."""
    return any(f".{layer}." in name for layer in ("q", "k", "v", "up")) or \
        name.endswith(("o.weight", "down.weight")) or \
        (vocab_parallel and name.startswith("output."))


def test_each_rank_holds_its_share_of_the_training_state(runs):
    """Weights, gradients and Adam's two moments (4 numbers per parameter: 16 bytes in fp32,
    32 in fp64): what TP cuts over T ranks (2D: D*T), the rest whole (2D: over D)."""
    model = SimpleModel(JOB["hidden"], JOB["blocks"], JOB["heads"])
    cut = sum(p.numel() for name, p in model.named_parameters() if cut_by_tp(name))
    cut_lp = sum(p.numel() for name, p in model.named_parameters() if cut_by_tp(name, True))
    every = sum(p.numel() for p in model.parameters())
    expect = {  # name: (bytes per number, parameters held)
        "3 ranks, tp 3": (4, cut / 3 + every - cut),
        # HSDP: 2 replicas of one shard, so each rank holds the TP pieces whole over "dp"
        "fp64, 4 ranks, 2D 2x2 as HSDP, SP, LP, accum 2, clip, CUDA's Adam": (
            8, cut_lp / 2 + every - cut_lp),
        "by hand: fp64, 3 ranks, tp 3, accum 3, clip": (8, cut / 3 + every - cut)}
    for name, (size, params) in expect.items():
        assert state_mib(succeeded(runs[name])[0]) == pytest.approx(4 * size * params / 2**20,
                                                                    abs=1e-3), name




@pytest.fixture
def fake_group():
    """A process group of `world` ranks in this process, whose collectives do nothing (torch's
    own test backend): enough to cut a model and count its collectives, no peers needed."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.distributed.device_mesh import init_device_mesh

    def mesh(dp, tp):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp * tp)
        return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    yield mesh
    dist.destroy_process_group()


@pytest.mark.parametrize("dp, tp, sp, lp", [(1, 2, False, False), (1, 4, True, True),
                                            (2, 2, True, False), (2, 2, False, True)])
def test_each_rank_holds_1_over_t_of_each_block_and_1_over_dt_in_2d(dp, tp, sp, lp, fake_group):
    import tp as tp_script
    mesh = fake_group(dp, tp)
    with torch.device("meta"):
        model = tp_script.parallelize(SimpleModel(hidden=32, blocks=2, heads=4), mesh, sp, lp)
    for name, p in model.named_parameters():
        share = p.to_local().numel() / p.numel() if hasattr(p, "to_local") else 1
        assert share == (1 / (dp * tp) if cut_by_tp(name, lp) else 1 / dp), name


class TiedHead(SimpleModel):
    """SimpleModel with its head tied to its embedding, as GPT-2's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.output.weight = self.embed.weight


class Uncut(SimpleModel):
    tp_plan = {"norm": "norm"}  # names a module, cuts none


class Skipped(SimpleModel):
    """Its plan names q, which torch skips (as it does a key it cannot resolve, with a
    warning): q is left whole."""


@pytest.mark.parametrize("model, vocab_parallel, message", [
    (TiedHead, False, None),
    (TiedHead, True, "TiedHead's tp_plan splits a tied weight in two"),
    (Uncut, False, "Uncut's tp_plan cuts nothing"),
    (Skipped, False, "Skipped's tp_plan leaves a layer it names whole")])
def test_parallelize_keeps_a_tied_weight_one_dtensor_or_stops_in_one_line(
        model, vocab_parallel, message, fake_group, monkeypatch):
    """Checked after the cut, not assumed: the head and the embedding stay one parameter (one
    DTensor, on the 2D mesh too); a plan that cut the head over the vocabulary, its twin
    whole, cut nothing at all, or left a layer it names whole, stops with the line (tp.py's
    parse_args refuses them earlier: tests/test_own_model.py)."""
    import tp as tp_script
    if model is Skipped:
        apply = tp_script.parallelize_module
        monkeypatch.setattr(tp_script, "parallelize_module", lambda module, mesh, plan: apply(
            module, mesh, {k: v for k, v in plan.items() if k != "blocks.*.attn.q"}))
    with torch.device("meta"):
        built = model(hidden=32, blocks=2, heads=4)
    if message is None:
        built = tp_script.parallelize(built, fake_group(2, 2), sequence_parallel=True)
        assert built.output.weight is built.embed.weight
        assert len(list(built.parameters())) == len(list(SimpleModel(32, 2, 4).parameters())) - 1
    else:
        with pytest.raises(SystemExit, match=message):
            tp_script.parallelize(built, fake_group(1, 2), vocab_parallel=vocab_parallel)


def test_fp64_a_tied_head_through_tp_equals_one_device(tmp_path, monkeypatch):
    """tp.py makes each parameter a DTensor once, so a tied head and embedding train as one
    device trains them: weights, every logged loss and gradient norm. Made a DTensor module by
    module (torch's distribute_module), they would be two copies trained apart (the bug zoo)."""
    import single
    import tp as tp_script
    for module in (common, single, tp_script):  # the user's line at the end of common.py
        monkeypatch.setattr(module, "SimpleModel", TiedHead)
    flags = [*fp64(SEED_A, steps=16), f"--heads={HEADS}", "--log-every=4"]  # past an epoch
    one_out, one = run_in_process("single", flags, tmp_path)
    out, weights = run_as_only_rank("tp", flags, tmp_path)
    assert max_diff(weights, one) < FP64_TOL
    assert torch.equal(weights["output.weight"], weights["embed.weight"])  # saved as one
    assert logged_step_losses(out) == pytest.approx(logged_step_losses(one_out), abs=1e-6)
    assert logged_norms(out) == pytest.approx(logged_norms(one_out), rel=1e-6)


KINDS = {"all_reduce": "all-reduce", "allreduce_": "all-reduce",  # functional and c10d names
         "all_gather_into_tensor": "all-gather", "_allgather_base_": "all-gather",
         "reduce_scatter_tensor": "reduce-scatter", "_reduce_scatter_base_": "reduce-scatter"}


def step_collectives(mesh, blocks, sp, lp):
    """{kind: count} of one training step of tp.py's on a fake group: forward, backward, the
    norms' SP sum, clipping and Adam's step (its foreach path, as on a GPU)."""
    import contextlib
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel
    from common import loss_fn
    import tp as tp_script
    model = tp_script.parallelize(SimpleModel(hidden=32, blocks=blocks, heads=4), mesh, sp, lp)
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randint(VOCAB, (8, SEQ_LEN))
    with CommDebugMode() as comm:
        with loss_parallel() if lp else contextlib.nullcontext():
            loss_fn(model(x), x).backward()
        tp_script.sum_partial_grads(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    counts = {}
    for op, n in comm.get_comm_counts().items():
        kind = KINDS[str(op).split(".")[-1]]
        counts[kind] = counts.get(kind, 0) + n
    return counts


@pytest.mark.parametrize("blocks", [2, 3])
@pytest.mark.parametrize("dp, sp, lp", [(1, False, False), (1, True, False), (1, True, True),
                                        (2, False, False), (2, True, True)],
                         ids=["TP", "TP+SP", "TP+SP+LP", "2D", "2D+SP+LP"])
def test_one_training_step_makes_exactly_the_theorys_collectives(dp, sp, lp, blocks,
                                                                 fake_group, cuda_defaults):
    """Per block, Megatron's four: forward all-reduces the partial sums after `o` and `down`,
    backward the gradient of the block's input before q, k, v (together) and before `up`. SP
    turns each into a reduce-scatter and an all-gather, and adds an all-gather before the
    output layer and one of the embeddings' gradient; its norms' partial gradients are added
    up once, in one all-reduce. Loss parallelism: 3 all-reduces of one number per token in the
    cross-entropy, and the output layer's input gradient reduce-scattered (with SP) or
    all-reduced. Clipping (torch's clip_grad_norm_ on the DTensors): one all-reduce of the
    squares, or in 2D two, over "dp" then "tp". Adam: none. 2D adds FSDP's all-gathers (each block
    and the root in forward, each block again in backward) and reduce-scatters (each block
    and the root); with SP, FSDP adds up each norm parameter's gradient over TP itself, one
    all-reduce each (a weight and a bias per norm, 2 norms per block and the final one)."""
    b = blocks
    theory = {  # dp, sp, lp: {kind: count}
        (1, False, False): {"all-reduce": 4 * b + 1},
        (1, True, False): {"reduce-scatter": 4 * b, "all-gather": 4 * b + 2, "all-reduce": 2},
        (1, True, True): {"reduce-scatter": 4 * b + 1, "all-gather": 4 * b + 2,
                          "all-reduce": 3 + 2},
        (2, False, False): {"all-reduce": 4 * b + 2, "all-gather": 2 * b + 1,
                            "reduce-scatter": b + 1},
        (2, True, True): {"reduce-scatter": 4 * b + 1 + b + 1,
                          "all-gather": 4 * b + 2 + 2 * b + 1,
                          "all-reduce": 3 + 2 * (2 * b + 1) + 2}}
    assert step_collectives(fake_group(dp, 2), blocks, sp, lp) == theory[dp, sp, lp]


def test_under_loss_parallelism_no_rank_holds_the_whole_logits(fake_group):
    """The output layer's logits stay cut over the vocabulary (each rank VOCAB / T of every
    token's), and the cross-entropy under loss_parallel() takes them so, forward and backward."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel
    from common import loss_fn
    import tp as tp_script
    model = tp_script.parallelize(SimpleModel(hidden=32, blocks=2, heads=4), fake_group(1, 4),
                                  sequence_parallel=True, vocab_parallel=True)
    logits = model(torch.randint(VOCAB, (8, SEQ_LEN)))
    assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)
    assert logits.to_local().shape == (8, SEQ_LEN, VOCAB // 4)
    with loss_parallel():
        loss_fn(logits, torch.randint(VOCAB, (8, SEQ_LEN))).backward()
    grad = model.output.weight.grad
    assert isinstance(grad, DTensor) and grad.to_local().shape[0] == VOCAB // 4


def test_evaluation_forwards_each_padded_batch_whole_and_counts_only_real_samples(
        fake_world, monkeypatch):
    """The 1,000 held-out samples over 3 TP groups of 2 (2D): 334 each, padded, 333 real in
    groups 1 and 2; batches of 111 leave those a last batch of one padded duplicate. Each rank
    forwards it (TP's all-reduces and FSDP's all-gathers wait for every rank) and counts none of
    it, as fsdp.py does. Rank 4 (group 2) of a world whose collectives do nothing."""
    from torch.distributed.device_mesh import init_device_mesh
    import tp as tp_script
    fake_world(6, rank=4)
    mesh = init_device_mesh("cpu", (3, 2), mesh_dim_names=("dp", "tp"))
    model = tp_script.parallelize(SimpleModel(hidden=32, blocks=2, heads=4), mesh)
    forwarded, counted = [], []
    model.register_forward_pre_hook(lambda _, args: forwarded.append(len(args[0])))
    monkeypatch.setattr(tp_script.dist, "all_reduce",
                        lambda sums, op, group: counted.append(sums[1].item()))
    tp_script.evaluate(model, common.make_dataset("val"), mesh, 3 * 111, torch.device("cpu"))
    assert forwarded == [111, 111, 111, 1]
    assert counted == [333 * SEQ_LEN]


@pytest.mark.parametrize("world, flags, message", [
    (4, ["--tp=3"], "--tp 3 must divide the world size 4"),
    (3, ["--tp=3", "--heads=4"], "--tp 3 must divide --heads 4"),
    (2, ["--heads=6"], "--heads 6 must divide --hidden 64"),
    (3, ["--hidden=48", "--heads=3", "--sequence-parallel"],
     "--sequence-parallel: --tp 3 must divide the sequence length 16"),
    (3, ["--hidden=48", "--heads=3", "--loss-parallel"],
     "--loss-parallel: --tp 3 must divide the vocabulary 32"),
    (4, ["--tp=2", "--batch-size=63"], "--batch-size 63 must be divisible by the 2 TP group(s)"),
    (6, ["--tp=2", "--replicate=2", "--batch-size=60"],
     "--replicate 2 must divide the 3 groups of --tp ranks"),
    (2, ["--mixed-precision=bf16"], "are FSDP's, and pure TP runs no FSDP: use a --tp below"),
    (2, ["--reshard-after-forward=false"], "are FSDP's, and pure TP runs no FSDP"),
])
def test_bad_mesh_is_refused_in_one_line_before_any_process_group(world, flags, message,
                                                                   as_torchrun, capsys):
    as_torchrun(world)
    refused_in_one_line("tp", flags, message, capsys)


def test_a_tp_group_that_would_span_machines_is_refused(as_torchrun, capsys, monkeypatch):
    as_torchrun(4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 2 machines of 2 ranks, TP groups of 4
    refused_in_one_line("tp", ["--tp=4"], "a TP group would span machines", capsys)


@needs_cuda
def test_tp_nccl_one_rank_on_gpu_equals_one_device(reference, tmp_path):
    result = torchrun(1, "tp.py", *CUDA_JOB_FLAGS, f"--save={tmp_path / 'w.pt'}")
    assert_gpu_run_equals_oracle(result, tmp_path / "w.pt", reference)


# The by-hand twin, from_scratch/tp.py: each layer's slice and communication written out

def by_hand():
    return importlib.import_module("from_scratch.tp")


def test_fp64_tp_by_hand_equals_tp_py_and_prints_the_same_numbers(runs):
    """The twin of tp.py's spawned run, with its flags (2 ranks, 2 micro-batches, recomputed
    blocks, CUDA's Adam): the same weights (to the bit where every operation is the one
    DTensor runs, in its order: b/T added before the all-reduce, the same gloo sums; 1e-12
    allows another order), the same printed losses, gradient norms and validation losses,
    and the same state per rank (1/T of each cut layer, the rest whole). Against the fp64
    oracle: FP64_RUNS."""
    out, weights = succeeded(runs["fp64, spawn 2 ranks, tp 2, accum 2, AC, CUDA's Adam"])
    hand_out, hand = succeeded(runs["by hand: fp64, spawn 2 ranks, tp 2, accum 2, AC, CUDA's Adam"])
    assert "tp by hand: 2 ranks" in hand_out
    diff = max_diff(hand, weights)
    print(f"by hand: max weight difference {diff:.2e} from tp.py")  # pytest -s
    assert diff <= 1e-12
    assert logged_step_losses(hand_out) == logged_step_losses(out)
    assert logged_norms(hand_out) == logged_norms(out)
    assert logged_val_losses(hand_out) == logged_val_losses(out)
    assert state_mib(hand_out) == state_mib(out)


@pytest.mark.parametrize("tp", [2, 4])
def test_by_hand_each_rank_holds_1_over_t_of_each_cut_layer_marked_with_its_dim(tp, fake_group):
    """What tp.py's plan cuts, cut alike: q, k, v and up by output rows (dim 0, their biases
    too), o and down by input columns (dim 1), each slice marked with its dim (--save gathers
    along it); the rest whole and unmarked."""
    fake_group(1, tp)
    model = by_hand().parallelize(SimpleModel(hidden=32, blocks=2, heads=4), dist.group.WORLD)
    whole = dict(SimpleModel(hidden=32, blocks=2, heads=4).named_parameters())
    for name, p in model.named_parameters():
        assert p.numel() / whole[name].numel() == (1 / tp if cut_by_tp(name) else 1), name
        assert getattr(p, "tp_dim", None) == (
            None if not cut_by_tp(name) else 1 if name.endswith("weight") and (
                ".o." in name or ".down." in name) else 0), name


@pytest.mark.parametrize("blocks", [2, 3])
def test_by_hand_each_micro_batch_makes_two_all_reduces_per_block_each_way_and_the_norm_one(
        blocks, fake_group):
    """Megatron-LM's f and g, counted as tp.py's collectives are (torch's CommDebugMode, a
    group whose collectives do nothing): per block and micro-batch, forward all-reduces the
    partial sums after `o` and `down` (g), backward the gradient of the block's input before
    attention (q, k and v together) and before `up` (f); two micro-batches make it twice.
    Clipping's norm: one all-reduce of the slices' squares; Adam: none."""
    from torch.distributed.tensor.debug import CommDebugMode
    from common import loss_fn
    hand = by_hand()
    fake_group(1, 2)
    model = hand.parallelize(SimpleModel(hidden=32, blocks=blocks, heads=4), dist.group.WORLD)
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randint(VOCAB, (8, SEQ_LEN))
    modes = []
    for _ in range(2):  # one mode each: its module tracker follows one forward and backward
        with CommDebugMode() as forward:
            loss = loss_fn(model(x), x)
        with CommDebugMode() as backward:
            loss.backward()
        modes += [forward, backward]
    with CommDebugMode() as step:
        hand.clip_grad_norm(model, 1.0, dist.group.WORLD)
        optimizer.step()
    counts = [{KINDS[str(op).split(".")[-1]]: n for op, n in mode.get_comm_counts().items()}
              for mode in [*modes, step]]
    assert counts == [{"all-reduce": 2 * blocks}] * 4 + [{"all-reduce": 1}]


@pytest.mark.parametrize("world, flags, message", [
    (4, ["--tp=2"], "--tp 2: 2D (FSDP across TP groups) is not written by hand; use tp.py --tp 2"),
    (2, ["--sequence-parallel"], "--sequence-parallel: not written by hand; use tp.py"),
    (2, ["--loss-parallel"], "--loss-parallel: not written by hand; use tp.py"),
    (2, ["--checkpoint=ckpt"], "--checkpoint: not written by hand; use tp.py"),
    (2, ["--replicate=2"], "are FSDP's, and pure TP runs no FSDP"),  # as tp.py
    (3, ["--tp=3", "--heads=4"], "--tp 3 must divide --heads 4"),  # tp.py's checks too
    (2, ["--heads=6"], "--heads 6 must divide --hidden 64"),
])
def test_by_hand_refuses_what_it_leaves_out_in_one_line(world, flags, message, as_torchrun,
                                                        capsys):
    as_torchrun(world)
    refused_in_one_line("from_scratch.tp", flags, message, capsys)


class EmbeddingCut(SimpleModel):
    tp_plan = {**SimpleModel.tp_plan, "embed": "colwise"}  # tp.py cuts it; by hand, no


def test_by_hand_a_plan_that_cuts_an_embedding_stops_in_one_line(fake_group):
    fake_group(1, 2)
    with pytest.raises(SystemExit, match="tp_plan cuts embed, a Embedding; by hand only "
                                         "nn.Linear is cut: use tp.py"):
        by_hand().parallelize(EmbeddingCut(hidden=32, blocks=2, heads=4), dist.group.WORLD)


class TiedCut(TiedHead):
    tp_plan = {**SimpleModel.tp_plan, "output": "colwise"}  # the head, tied to the embedding


class Odd(SimpleModel):
    """Its MLP 3 units wider: 4 x 32 + 3 inner units, which 2 ranks cannot halve."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for block in self.blocks.values():
            block.up = torch.nn.Linear(32, 131)
            block.down = torch.nn.Linear(131, 32)


@pytest.mark.parametrize("model, message", [
    (TiedCut, "tp_plan cuts a tied weight, which would train as two copies apart"),
    (Odd, "Linear weight of 131 features on 2 ranks; use a count that divides it")])
def test_by_hand_a_tied_weight_cut_or_a_width_t_does_not_divide_stops_in_one_line(
        model, message, fake_group):
    """A user's model, refused where the twin would train it silently apart from one device:
    a cut tied weight would become two tensors, an uneven chunk slices no rank expects."""
    fake_group(1, 2)
    with pytest.raises(SystemExit, match=message):
        by_hand().parallelize(model(hidden=32, blocks=2, heads=4), dist.group.WORLD)


@needs_cuda
def test_tp_by_hand_nccl_one_rank_on_gpu_equals_one_device(reference, tmp_path):
    result = torchrun(1, HAND, *CUDA_JOB_FLAGS, f"--save={tmp_path / 'w.pt'}")
    assert_gpu_run_equals_oracle(result, tmp_path / "w.pt", reference)


@needs_2_gpus
def test_fp64_tp_by_hand_on_two_gpus_over_nccl_equals_the_fp64_oracle(tmp_path):
    """Each block cut in 2 over NCCL, in float64 (4 heads: 2 each): f and g between GPUs."""
    result = torchrun(2, HAND, *CUDA_JOB_FLAGS, *fp64(SEED_A), f"--heads={HEADS}",
                      f"--save={tmp_path / 'w.pt'}")
    assert_fp64_run_equals_the_fp64_oracle((ok(result), load_saved(tmp_path / "w.pt")), SEED_A,
                                           heads=HEADS)


# The by-hand twin's mistakes (docs/exercises.md): each made in a copy of from_scratch/tp.py
# (and of common.py), launched early, 2 ranks, fp64, 4 steps
HAND_MISTAKES = {  # name: [(lines of the real file, the mistake in their place)]
    "TP by hand: the row-parallel bias's gradient divided by T": [(
        "        bias = bias.detach() / group.size() + (bias - bias.detach())\n",
        "        bias = bias / group.size()\n")],
    "TP by hand: the heads not divided": [(
        "common.py",
        "        self.head_width = hidden // heads  # not a count: heads are as many as q holds "
        "(tp.py)\n",
        "        self.heads = heads\n"), (
        "common.py",
        "        q, k, v = (proj(x).view(batch, seq, -1, self.head_width).transpose(1, 2)\n",
        "        q, k, v = (proj(x).view(batch, seq, self.heads, -1).transpose(1, 2)\n")],
}


def hand_distance(weights):
    diff = max_diff(weights, fp64_reference(SEED_A, 4, heads=HEADS)[1])
    print(f"max weight difference {diff:.2e} from the fp64 oracle")  # pytest -s
    return diff


def test_by_hand_a_row_parallel_bias_written_b_over_t_trains_and_misses_the_oracle(
        hand_mistakes):
    """`bias / T` on each rank, summed by g: the forward is right (b), and autograd divides
    b's gradient by T too, so o's and down's biases get half their gradient here. It trains,
    every printed loss one device's to its 6 decimals; the printed gradient norm is not, and
    the weights are not."""
    out, weights = hand_mistakes["TP by hand: the row-parallel bias's gradient divided by T"]
    _, _, losses, norms, _ = fp64_reference(SEED_A, 4, heads=HEADS)
    assert logged_step_losses(out) == {step: pytest.approx(losses[step - 1], abs=1e-6)
                                       for step in (1, 4)}
    assert logged_norms(out)[1] != pytest.approx(norms[0], rel=1e-6)
    assert hand_distance(weights) > FP64_TOL


def test_by_hand_attention_that_counts_its_heads_splits_a_slice_into_too_many(hand_mistakes):
    """A rank's q, k and v hold H/T heads; attention that splits them into H (each 1/T wide)
    fits the shapes and computes something else. Split by a head's width, it counts H/T."""
    _, weights = hand_mistakes["TP by hand: the heads not divided"]
    assert hand_distance(weights) > FP64_TOL
