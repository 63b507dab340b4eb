"""tp.py: cutting every block over T ranks (tensor parallelism), and 2D (FSDP across TP groups),
trains to the same weights as one device; its checkpoints resume on another mesh; each rank
holds its share; one TP forward and backward make exactly the theory's collectives; a TP group
fed different data on its ranks would be caught."""

import argparse
import re
import shutil

import pytest
import torch
import torch.distributed as dist

from common import SimpleModel
from conftest import (CUDA_JOB_FLAGS, JOB, JOB_FLAGS, REPO, TOL, VAL_TOL,
                      assert_checkpoints_resume_to_the_oracle, assert_gpu_run_equals_oracle,
                      finish, launch_runs, logged_losses, max_diff, needs_cuda,
                      refused_in_one_line, start, succeeded, summary_val_loss, torchrun,
                      torchrun_cmd)

RUNS = {  # name: (ranks under torchrun, or None for `python tp.py`; extra flags)
    # pure TP; also writes sharded checkpoints, continued on 4 ranks below
    "torchrun 2 ranks, tp 2": (2, ["--checkpoint={folder}/tp2", "--checkpoint-every=4"]),
    # 2D: 2 TP groups of 2, FSDP across them, with activation checkpointing; its checkpoint
    # is continued as TP 2 below
    "torchrun 4 ranks, 2D 2x2": (4, ["--tp=2", "--checkpoint={folder}/2d", "--checkpoint-every=4",
                                     "--activation-checkpointing"]),
    # `python tp.py` starts its own 2 workers; they accumulate 2 micro-batches per step,
    # through compiled blocks that recompute their activations in backward
    "spawn 2 ranks, tp 2, accum 2, compile + AC": (None, ["--nproc=2", "--accum-steps=2",
                                                          "--compile",
                                                          "--activation-checkpointing"]),
}


# The trap the data sharding avoids, as a wrapper that deals the batch by rank instead of by
# TP group (run beside RUNS, and checked by the last equivalence test below).
FED_BY_RANK = """import sys
sys.path.insert(0, {repo!r})
import torch.distributed as dist
import tp
real = tp.DistributedSampler
def by_rank(dataset, num_replicas, rank, **kw):  # the bug: the global rank, not the group
    return real(dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank(), **kw)
tp.DistributedSampler = by_rank
tp.main()
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp")
    wrapper = folder / "fed_by_rank.py"
    wrapper.write_text(FED_BY_RANK.format(repo=str(REPO)))
    fed = start(*torchrun_cmd(2, wrapper, *JOB_FLAGS, f"--save={folder}/fed.pt"))
    try:
        results = launch_runs("tp.py", RUNS, folder)
    finally:
        results_fed = finish(fed, timeout=150)
    return {**results, "fed by rank": (results_fed, folder / "fed.pt")}


# TP on 4 ranks: see the resume test, which continues the 2-rank checkpoint on 4 ranks.
@pytest.mark.parametrize("name", RUNS)  # (compiled: held to COMPILE_TOL, the same bound)
def test_tp_and_2d_equal_one_device(name, runs, reference, reference_val):
    out, weights = succeeded(runs[name])  # --save: a plain state_dict, loaded strictly
    assert max_diff(weights, reference[1]) < TOL
    assert summary_val_loss(out) == pytest.approx(reference_val, abs=VAL_TOL)
    assert logged_losses(out)[-1] == pytest.approx(reference[2][-1], abs=1e-5)


def test_checkpoint_resumes_on_another_mesh_2d_to_tp2_and_tp2_to_tp4(runs, tmp_path):
    """Each run's sharded checkpoint (step 8), continued to step 12 on another mesh, ends
    with the weights of 12 uninterrupted steps on one device."""
    folder = runs["torchrun 2 ranks, tp 2"][1].parent
    shutil.copytree(folder / "2d", tmp_path / "on2")   # 2x2 -> TP 2 (2 ranks)
    shutil.copytree(folder / "tp2", tmp_path / "on4")  # TP 2 -> TP 4 (4 ranks)
    assert_checkpoints_resume_to_the_oracle(
        "tp.py", {2: tmp_path / "on2", 4: tmp_path / "on4"}, tmp_path, TOL)


def state_mib(stdout):
    return float(re.search(r"\| state ([0-9.]+) MiB/rank", stdout).group(1))


def test_each_rank_holds_its_share_of_the_training_state(runs):
    """Weights, gradients and Adam's two moments (16 bytes per parameter): a block's over T
    ranks (2D: D*T), and, in pure TP, the input and output layers whole."""
    model = SimpleModel(hidden=JOB["hidden"], blocks=JOB["blocks"])
    block = sum(p.numel() for p in model.blocks.parameters())
    down_bias = JOB["blocks"] * JOB["hidden"]  # RowwiseParallel keeps it whole on each rank
    io = sum(p.numel() for p in model.parameters()) - block
    expect = {"torchrun 2 ranks, tp 2": (block - down_bias) / 2 + down_bias + io,
              "torchrun 4 ranks, 2D 2x2": (block - down_bias) / 4 + (down_bias + io) / 2}
    for name, params in expect.items():
        assert state_mib(succeeded(runs[name])[0]) == pytest.approx(16 * params / 2**20,
                                                                    abs=1e-3), name


PLAIN = argparse.Namespace(activation_checkpointing=False, compile=False)  # tp.py's defaults


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


@pytest.mark.parametrize("dp, tp", [(1, 2), (1, 4), (2, 2)])
def test_each_rank_holds_1_over_t_of_each_block_and_1_over_dt_in_2d(dp, tp, fake_group):
    import tp as tp_script
    mesh = fake_group(dp, tp)
    with torch.device("meta"):
        model = tp_script.parallelize(SimpleModel(hidden=32, blocks=2), mesh, PLAIN)
    for name, p in model.named_parameters():
        share = p.to_local().numel() / p.numel() if hasattr(p, "to_local") else 1
        if ".up." in name or name.endswith("down.weight"):
            assert share == 1 / (dp * tp), name
        else:  # down.bias (added once, after the all-reduce), input, output: not cut by TP
            assert share == 1 / dp, name


def test_one_forward_and_backward_make_two_all_reduces_per_block(fake_group):
    """Megatron's count: forward all-reduces each block's partial sums once (after `down`),
    backward the gradient of each block's input once (before `up`); nothing else."""
    from torch.distributed.tensor.debug import CommDebugMode
    import tp as tp_script
    blocks = 3
    model = tp_script.parallelize(SimpleModel(hidden=32, blocks=blocks), fake_group(1, 2), PLAIN)
    x = torch.randn(8, 32, requires_grad=True)
    with CommDebugMode() as comm:
        out = model(x)
        forward = dict(comm.get_comm_counts())
        out.sum().backward()
    counts = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    assert sum(forward.values()) == blocks
    assert counts == {"all_reduce": 2 * blocks}


def test_a_tp_group_fed_different_data_on_its_ranks_misses_the_one_device_weights(
        runs, reference):
    """Deal the batch by rank instead of by TP group and each rank computes its slice of
    other samples; the run still trains, and only a comparison with one device shows it (here:
    far outside the tests' bound)."""
    assert max_diff(succeeded(runs["fed by rank"])[1], reference[1]) > 1000 * TOL


@pytest.mark.parametrize("world, flags, message", [
    (4, ["--tp=3"], "--tp 3 must divide the world size 4"),
    (3, ["--tp=3", "--hidden=10"], "--tp 3 must divide each block's inner width 4 x --hidden = 40"),
    (4, ["--tp=2", "--batch-size=63"], "--batch-size 63 must be divisible by the 2 TP group(s)"),
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
