"""The mixture of experts (--experts, --top-k, --balance): every script that trains it ends with
one device's weights in float64, the load-balancing loss included, and every script that does
not refuses it in one line. The dense model (--experts 0, the default) is every other test's."""

import pytest
import torch

import common
from common import SimpleModel
from conftest import (FP64_CLIP, FP64_SEEDS, JOB, assert_fp64_run_equals_the_fp64_oracle, fp64,
                      load_saved, moe, refused_in_one_line, run_in_process)

SEED_A, SEED_B = FP64_SEEDS[0], FP64_SEEDS[-1]


# The scripts that train a mixture over several ranks are proven where their dense runs are,
# on flags nobody chose: ddp.py (4 ranks, 3 experts, top-1, 3 micro-batches, clipped)
# in tests/test_ddp.py, fsdp.py (HSDP 2x2 spawned, 5 experts, top-2, clipped, its checkpoint
# resumed on 2 ranks) in tests/test_fsdp.py, cp.py (2 ranks, 4 experts, top-2, 3 micro-batches,
# AC) in tests/test_cp.py, ep.py in tests/test_ep.py; single.py and amp.py below.


@pytest.mark.parametrize("script, extra", [("single", []), ("amp", ["--dtype=fp32"])])
def test_fp64_mixture_of_experts_on_one_device_equals_the_fp64_oracle(script, extra, tmp_path):
    flags, oracle = moe(3, 2, accum=2)
    run = run_in_process(script, [*fp64(SEED_B, clip=FP64_CLIP), *flags, *extra], tmp_path)
    assert_fp64_run_equals_the_fp64_oracle(run, SEED_B, clip=FP64_CLIP, **oracle)


def test_a_checkpoint_of_another_mixture_is_refused_in_one_line(tmp_path, capsys):
    """--top-k shapes no weight: the weights of a top-1 mixture would load into a top-2 one
    and train another model. The file says what it was."""
    flags, _ = moe(3, 1)
    run_in_process("single", [*flags, "--steps=1", f"--checkpoint={tmp_path / 'c.pt'}"], tmp_path)
    with pytest.raises(SystemExit) as refused:
        run_in_process("single", [*moe(3, 2)[0], "--steps=2", f"--checkpoint={tmp_path / 'c.pt'}"],
                       tmp_path)
    assert "saved with --experts 3 --top-k 1" in str(refused.value)
    assert (tmp_path / "c.pt").exists()


@pytest.mark.parametrize("script", ["dataparallel", "tp", "pipeline"])
def test_scripts_that_train_the_dense_model_only_refuse_experts_in_one_line(script, capsys):
    refused_in_one_line(script, ["--device=cpu", "--nproc=2", "--experts=4"]
                        if script != "dataparallel" else ["--device=cpu", "--experts=4"],
                        "trains the dense model only; use single.py", capsys)


@pytest.mark.parametrize("flags, message", [
    (["--experts=2", "--top-k=3"], "need 0 experts (dense), or at least --top-k of them"),
    (["--experts=-1"], "need 0 experts (dense)"),
    (["--experts=2", "--balance=nan"], "--balance nan: must be 0 or a positive"),
    (["--experts=2", "--top-k=2"], "the balancing loss is the constant 1; add --balance 0"),
])
def test_bad_mixture_flags_are_refused_in_one_line(flags, message, capsys):
    refused_in_one_line("single", ["--device=cpu", *flags], message, capsys)


def test_the_dense_model_is_unchanged_by_the_mixtures_code():
    """--experts 0 builds the blocks' `up` and `down` where they always were: the same
    parameters, names and initial weights as before the mixture existed."""
    torch.manual_seed(0)
    dense = SimpleModel(JOB["hidden"], JOB["blocks"], JOB["heads"])
    names = [name for name, _ in dense.named_parameters()]
    assert not any("moe" in name for name in names) and "blocks.0.up.weight" in names
    assert sum(p.numel() for p in SimpleModel().parameters()) == 204960


def test_the_balancing_loss_is_1_when_balanced_and_e_over_k_when_k_experts_take_every_token():
    even = torch.tensor([[[5.0, 5.0], [5.0, 5.0]]])  # 2 experts, 10 tokens, top-1
    assert common.balance_loss(even, top_k=1).item() == pytest.approx(1.0)
    lopsided = torch.tensor([[[10.0, 0.0], [10.0, 0.0]]])
    assert common.balance_loss(lopsided, top_k=1).item() == pytest.approx(2.0)
    # 4 experts, 10 tokens, top-2: two experts take every token's two slots
    top2 = torch.tensor([[[10.0, 10.0, 0.0, 0.0], [5.0, 5.0, 0.0, 0.0]]])
    assert common.balance_loss(top2, top_k=2).item() == pytest.approx(4 / 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cast", ["autocast", "16-bit weights"])
def test_the_mixtures_statistics_are_fp32_and_its_counts_exact_in_16_bits(dtype, cast):
    """Under autocast (amp.py) or with 16-bit weights (fsdp.py --mixed-precision bf16), the
    token slots each expert got are counted exactly and the router's probabilities summed in
    fp32: 4,096 tokens, top-2 of 4 experts, about 2,048 slots each (bf16 holds integers exactly
    to 256 only, fp16 to 2,048). Tokens and router weights are numbers that 16 bits hold
    exactly, and so are the router's logits: the balancing loss must be fp32's, to fp32's
    rounding (summed in bf16, it moves by about 0.5%)."""
    torch.manual_seed(0)
    moe = common.MoE(16, experts=4, top_k=2)
    with torch.no_grad():
        moe.router.weight.copy_(torch.randint(-4, 5, moe.router.weight.shape) / 8)
    tokens = torch.randint(-1, 2, (256, 16, 16)).float()
    moe(tokens)
    fp32 = summed(moe)
    if cast == "autocast":
        with torch.autocast("cpu", dtype=dtype):
            moe(tokens)
    else:
        moe.to(dtype)(tokens.to(dtype))
    routed = summed(moe)
    assert moe.routed[1].dtype == routed.dtype == torch.float32
    assert routed[0].sum().item() == 4096 * 2
    assert torch.equal(routed[0], fp32[0])
    assert common.balance_loss(routed[None], 2).item() == pytest.approx(
        common.balance_loss(fp32[None], 2).item(), rel=1e-6)


def summed(moe):
    """A mixture's routing statistics from its last forward, summed over every token."""
    slots, probs = moe.routed
    return torch.stack([slots.sum(dim=0).to(probs.dtype), probs.sum(dim=0)])


def test_every_token_reaches_its_top_k_experts_dropless(tmp_path):
    model = SimpleModel(16, 1, 2, experts=4, top_k=2).double()
    x = torch.randint(32, (8, 16))
    model(x)
    counts = model.routed()[0, 0]
    assert counts.sum().item() == 8 * 16 * 2
    saved = tmp_path / "w.pt"
    torch.save(model.state_dict(), saved)
    assert load_saved(saved, SimpleModel(16, 1, 2, experts=4, top_k=2))
