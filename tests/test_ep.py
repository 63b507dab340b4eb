"""ep.py: the experts spread over the ranks, tokens sent to them by all-to-all, trains to one
device's weights (single.py with the same mixture) in float64, the tokens each expert got
included; its checkpoint resumes on another EP degree and in single.py. Ready for a GPU: one
read to the host per block, and no atomic adds, so two fp32 runs end bit-identical."""

import shutil

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import ep
from common import VOCAB, SimpleModel, loss_fn
from conftest import (CUDA_JOB_FLAGS, FP64_CLIP, FP64_JOB, FP64_SEEDS, JOB, JOB_FLAGS,
                      assert_fp64_run_equals_the_fp64_oracle, early_runs, fp64, launch,
                      launched_runs, load_saved, logged_norms, logged_step_losses,
                      moe, needs_2_gpus, needs_cuda, ok, ranks_cmd, refused_in_one_line,
                      run_as_only_rank, run_in_process, succeeded, torchrun)

SEED_A, SEED_B = FP64_SEEDS[0], FP64_SEEDS[-1]

# name: (ranks, flags, seed, clip, the oracle's mixture). fp64 on flags nobody chose: EP 2, a
# grid of 2 "dp" groups x EP 2, an odd expert count per rank (3), k = 1 and 2, accumulation,
# clipping, and a checkpoint that EP 4 (one expert per rank) and single.py continue.
MIXTURES = {
    "ep 2, 4 experts, top-2, accum 3, clip": (2, ["--ep=2"], SEED_A, FP64_CLIP, moe(4, 2, 3)),
    "dp 2 x ep 2, 6 experts, top-1, accum 3, clip": (4, ["--ep=2"], SEED_B, FP64_CLIP,
                                                     moe(6, 1, 3)),
}
RUNS = {name: (ranks, [*flags, *fp64(seed, clip=clip), *mixture[0],
                       *(["--checkpoint={folder}/ep.pt"] if name.startswith("ep 2") else [])])
        for name, (ranks, flags, seed, clip, mixture) in MIXTURES.items()}

early_launches = early_runs("ep.py", RUNS)  # queued when the tests are collected


@pytest.fixture(scope="module")
def runs():
    return launched_runs(__name__, "ep.py", RUNS)


@pytest.mark.parametrize("name", MIXTURES)
def test_fp64_expert_parallel_run_equals_the_fp64_oracle(name, runs):
    _, _, seed, clip, (_, oracle) = MIXTURES[name]
    assert_fp64_run_equals_the_fp64_oracle(succeeded(runs[name]), seed, clip=clip, **oracle)


def test_fp64_checkpoint_from_ep_2_resumes_on_ep_4_and_in_single_py(runs, tmp_path):
    """The file rank 0 wrote after FP64_JOB on EP 2 (every expert gathered): 4 ranks holding
    one expert each continue it 4 steps, and so does single.py; both end at the oracle's
    weights after FP64_JOB + 4 steps."""
    name = "ep 2, 4 experts, top-2, accum 3, clip"
    _, _, seed, clip, (flags, oracle) = MIXTURES[name]
    succeeded(runs[name])
    source = runs[name][1].parent / "ep.pt"  # its --checkpoint, beside its --save
    steps = FP64_JOB["steps"] + 4
    for script in ("ep", "single"):
        shutil.copy(source, tmp_path / f"{script}.pt")
        args = [*fp64(seed, steps=steps, clip=clip), *flags,
                f"--checkpoint={tmp_path}/{script}.pt"]
        if script == "single":
            run = run_in_process("single", args, tmp_path)
        else:
            saved = tmp_path / "ep4.pt"
            result = launch(*ranks_cmd(4, "ep.py", *JOB_FLAGS, *args, f"--save={saved}"))
            run = ok(result), load_saved(saved)
        assert "resumed from" in run[0]
        assert_fp64_run_equals_the_fp64_oracle(run, seed, steps=steps, clip=clip, **oracle)


def test_the_tokens_each_expert_got_are_printed_and_add_up_to_every_tokens_k_slots(runs):
    """The summary's last line counts the tokens routed to each expert over the run, every
    rank's: each token's k slots once. (That they are one device's counts, token for token,
    every fp64 proof checks: assert_fp64_run_equals_the_fp64_oracle.)"""
    out = succeeded(runs["ep 2, 4 experts, top-2, accum 3, clip"])[0]
    line = next(line for line in out.splitlines() if line.startswith("experts |"))
    per_block = line.split(": ")[1].split(" | ")[:JOB["blocks"]]
    tokens = FP64_JOB["steps"] * FP64_JOB["batch_size"] * 16 * 2  # top-2: each token twice
    assert all(sum(map(int, block.split())) == tokens for block in per_block)


@pytest.mark.parametrize("flags, message", [
    (["--nproc=2", "--experts=3"], "--ep 2 must divide --experts 3"),
    (["--nproc=2", "--experts=0"], "--ep 2 must divide --experts 0"),
    (["--nproc=4", "--ep=3"], "--ep 3 must divide the world size 4"),
])
def test_a_bad_expert_layout_is_refused_in_one_line(flags, message, capsys):
    refused_in_one_line("ep", ["--device=cpu", *flags], message, capsys)


aten = torch.ops.aten


class Recorder(TorchDispatchMode):
    """Records, by name, the ops run under it that cost a GPU most, seen on the CPU where they
    cost nothing. `reads`: those that read a tensor's values back to the host, each a wait for
    all the work queued before it on a GPU: item (int(), bool() too), nonzero (torch.where
    with a condition alone), bincount (its largest value sizes its output), repeat_interleave
    without output_size (its length), unique, masked_select, equal, and Tensor.tolist, which on
    the CPU reads memory without an op (`monkeypatch`: patched to be seen). `repeated_adds`:
    those that add into places an index gives, where the index repeats a place: index_add and
    scatter_add (index_select's and gather's backward), scatter_reduce, index_reduce, which on
    a GPU add with atomics, in the order the threads arrive, so fp32 sums differ run to run;
    and index_put with accumulate (indexing's backward), which CUDA orders by a sort. In
    floating point only: integer adds are exact in any order."""

    READS = {aten._local_scalar_dense, aten.nonzero, aten.bincount, aten._unique2,
             aten.unique_consecutive, aten.unique_dim, aten.masked_select, aten.equal}
    ADDS = {aten.index_add, aten.index_add_, aten.index_put, aten.index_put_,
            aten._index_put_impl_, aten.scatter_add, aten.scatter_add_, aten.scatter_reduce,
            aten.scatter_reduce_, aten.index_reduce, aten.index_reduce_}

    def __init__(self, monkeypatch):
        super().__init__()
        self.reads, self.repeated_adds, self.on = [], [], False
        tolist = torch.Tensor.tolist

        def counted(tensor):
            if self.on:
                self.reads.append("tolist")
            return tolist(tensor)
        monkeypatch.setattr(torch.Tensor, "tolist", counted)

    def __enter__(self):
        self.on = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.on = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in self.READS or (func is aten.repeat_interleave.Tensor
                                    and kwargs.get("output_size") is None):
            self.reads.append(packet.__name__)
        name = packet.__name__.strip("_").removesuffix("_impl")  # index_put_, _index_put_impl_
        # (in integers, atomics add exactly in any order: common.MoE's counts)
        if packet in self.ADDS and args[0].is_floating_point() and self.repeats(name, args,
                                                                                 kwargs):
            self.repeated_adds.append(name)
        return func(*args, **kwargs)

    @staticmethod
    def repeats(name, args, kwargs):
        """Whether the op adds twice into one place."""
        if name == "index_put":
            indices = [i for i in args[1] if i is not None]
            if not (args[3] if len(args) > 3 else kwargs.get("accumulate", False)) or any(
                    i.dtype == torch.bool for i in indices):
                return False  # a copy into the places, not an add; a mask repeats no place
            places = torch.stack(torch.broadcast_tensors(*indices)).flatten(1)
            return places.unique(dim=1).shape[1] < places.shape[1]
        dim, index = args[1], args[2]
        if name in ("index_add", "index_reduce"):
            return index.unique().numel() < index.numel()
        along = index.movedim(dim, -1).sort(dim=-1).values  # scatter: places along `dim`
        return bool((along[..., 1:] == along[..., :-1]).any())


def test_the_recorder_sees_each_host_read_and_each_repeated_add(monkeypatch):
    """Each kind of read counted once, repeat_interleave with output_size not at all; an add
    over a repeated index counted, over a permutation not; and one device's mixture (common.py's
    run_experts: a torch.where per expert) reads once per expert."""
    x = torch.tensor([1, 0, 2])
    with Recorder(monkeypatch) as recorded:
        x.tolist(), x.sum().item(), torch.where(x > 0), torch.bincount(x), int(x[0])
        x.repeat_interleave(x), x.repeat_interleave(x, output_size=3)
        torch.zeros(3).index_add(0, torch.tensor([2, 0, 1]), torch.ones(3))  # a permutation
        torch.zeros(3).index_add_(0, torch.tensor([2, 0, 2]), torch.ones(3))  # in place too
        rows = torch.ones(3, 2, requires_grad=True)
        rows[torch.tensor([1, 1])].sum().backward()  # backward: index_put, accumulating
        torch.zeros(2, 3).scatter_add(1, torch.tensor([[0, 0, 1], [0, 1, 2]]), torch.ones(2, 3))
    assert recorded.reads == ["tolist", "_local_scalar_dense", "nonzero", "bincount",
                              "_local_scalar_dense", "repeat_interleave"]
    assert recorded.repeated_adds == ["index_add", "index_put", "scatter_add"]
    torch.manual_seed(0)
    moe_ = SimpleModel(JOB["hidden"], 1, JOB["heads"], experts=4, top_k=3).blocks["0"].moe
    tokens = torch.randn(64, JOB["hidden"])
    weights, chosen = moe_.router(tokens).softmax(-1).topk(3)
    with Recorder(monkeypatch) as recorded:
        moe_.run_experts(tokens, weights, chosen)
    assert recorded.reads == ["nonzero"] * 4


@pytest.fixture
def ep_model():
    """JOB's model with a mixture of 4 experts, top-3 (each token's 3 slots share a combine),
    cut as ep.py cuts it, in a process group of one in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = SimpleModel(JOB["hidden"], JOB["blocks"], JOB["heads"], experts=4, top_k=3)
        ep.hold_experts(model, init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "ep")))
        yield model
    finally:
        dist.destroy_process_group()


def test_ep_reads_the_host_once_per_block_and_adds_over_no_repeated_index(ep_model,
                                                                           monkeypatch):
    """Per block and forward, EP reads to the host once: the counts that size the all-to-all
    (.tolist()); backward none. Nothing in forward or backward adds twice into one place by an
    index (on a GPU, atomic adds: two fp32 runs would part). The rest of the forward (the
    router, the routing statistics counted in integers) reads nothing."""
    recorded, per_block = Recorder(monkeypatch), []
    for block in ep_model.blocks.values():
        def counted(*args, run=block.moe.run_experts):
            before = len(recorded.reads)
            out = run(*args)
            per_block.append(recorded.reads[before:])
            return out
        block.moe.run_experts = counted
    with recorded:
        loss = ep_model(torch.randint(VOCAB, (8, 16))).sum()
    assert per_block == [["tolist"]] * JOB["blocks"]
    assert recorded.reads == ["tolist"] * JOB["blocks"]
    recorded.reads.clear()
    with recorded:
        loss.backward()
    assert recorded.reads == []
    assert recorded.repeated_adds == []  # forward's and backward's


def assert_two_deterministic_runs_end_bit_identical(flags, tmp_path):
    """Two runs of ep.py with `flags` (one rank, in this process) under
    torch.use_deterministic_algorithms(True): the same bits, every logged loss and norm too."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for i in range(2):
            (tmp_path / str(i)).mkdir()
            runs.append(run_as_only_rank("ep", flags, tmp_path / str(i)))
    finally:
        torch.use_deterministic_algorithms(was)
    (out_a, weights_a), (out_b, weights_b) = runs
    assert all(torch.equal(weights_a[name], weights_b[name]) for name in weights_a)
    assert logged_step_losses(out_a) == logged_step_losses(out_b)
    assert logged_norms(out_a) == logged_norms(out_b)


def test_fp32_ep_under_deterministic_algorithms_repeats_itself_bit_for_bit(tmp_path):
    """torch.use_deterministic_algorithms(True), which raises where an op has no deterministic
    implementation (on a GPU; the CPU has no atomics, so here it shows only that ep.py runs
    under it): two fp32 runs of JOB with 4 experts, top-3, end with the same bits, every
    logged loss and norm too. The proof that nothing adds with atomics is the Recorder's
    (test_ep_reads_the_host_once_per_block_and_adds_over_no_repeated_index)."""
    assert_two_deterministic_runs_end_bit_identical(["--experts=4", "--top-k=3", "--steps=4"],
                                                    tmp_path)


@needs_cuda
def test_eps_gradients_on_a_gpu_repeat_bit_for_bit_without_deterministic_algorithms():
    """No atomic adds in the dispatch and combine: JOB's model with 4 experts, top-3 (each
    token's 3 slots summed in slot order), cut as ep.py cuts it (NCCL, one rank, in this
    process): three fp32 forwards and backwards of one batch give the same bits, every
    gradient but the token embedding's. That one is every script's: nn.Embedding's CUDA
    backward sums a token's rows in no fixed order unless torch.use_deterministic_algorithms
    (the next test), so two whole runs part, EP or not (docs/moe.md)."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device)
    try:
        torch.manual_seed(0)
        model = SimpleModel(JOB["hidden"], JOB["blocks"], JOB["heads"], experts=4, top_k=3)
        ep.hold_experts(model, init_device_mesh("cuda", (1, 1), mesh_dim_names=("dp", "ep")))
        model.to(device)
        x, y = torch.randint(VOCAB, (2, JOB["batch_size"], 16), device=device)
        grads = []
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    finally:
        dist.destroy_process_group()
    parted = {name for g in grads[1:] for name in g if not torch.equal(g[name], grads[0][name])}
    assert parted <= {"embed.weight"}, sorted(parted)


@needs_cuda
def test_two_fp32_ep_runs_on_one_gpu_under_deterministic_algorithms_end_bit_identical(
        tmp_path, monkeypatch):
    """torch.use_deterministic_algorithms(True) on a GPU, where it raises for every op without
    a deterministic kernel: ep.py runs under it (one rank, in this process), and two fp32 runs
    of JOB with 4 experts, top-3, end with the same bits, every logged loss and norm too."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what cuBLAS needs for it
    assert_two_deterministic_runs_end_bit_identical(
        ["--experts=4", "--top-k=3", "--device=cuda"], tmp_path)


@needs_cuda
def test_fp64_ep_over_nccl_on_one_gpu_equals_the_fp64_oracle(tmp_path):
    """NCCL's all-to-all with uneven splits, in float64: one rank, every expert its own."""
    flags, oracle = moe(4, 2, 3)
    result = torchrun(1, "ep.py", *CUDA_JOB_FLAGS, *fp64(SEED_A), *flags,
                      f"--save={tmp_path / 'w.pt'}")
    assert_fp64_run_equals_the_fp64_oracle((ok(result), load_saved(tmp_path / "w.pt")), SEED_A,
                                           **oracle)


@needs_2_gpus
def test_fp64_ep_over_nccl_on_two_gpus_equals_the_fp64_oracle(tmp_path):
    flags, oracle = moe(4, 2, 3)
    result = torchrun(2, "ep.py", *CUDA_JOB_FLAGS, *fp64(SEED_B), *flags,
                      f"--save={tmp_path / 'w.pt'}")
    assert_fp64_run_equals_the_fp64_oracle((ok(result), load_saved(tmp_path / "w.pt")), SEED_B,
                                           **oracle)
