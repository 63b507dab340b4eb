"""amp.py: fp32 is the baseline exactly; bf16 and fp16 train to nearly the same loss; the
GradScaler skips bad steps and clips true gradients."""

import importlib

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from common import SimpleModel
from conftest import (CUDA_JOB_FLAGS, FP32_VAL_TOL, FP64_CLIP, FP64_SEEDS, JOB, JOB_FLAGS, TOL,
                      assert_fp64_run_equals_the_fp64_oracle, assert_gpu_run_equals_oracle,
                      assert_norms_are_the_oracles, fp64, load_saved, logged_losses, max_diff,
                      needs_cuda, ok, python, refused_in_one_line, run_in_process,
                      summary_val_loss)
from reference import reference_train

amp = importlib.import_module("amp")  # the script under test, run in this process

# Measured on CPU, torch 2.13.0, JOB (8 steps): the final loss of bf16 is 5.7e-7 and of fp16
# 2.3e-6 away from fp32's, relative (docs/proofs.md). bf16 keeps 8 mantissa bits (rounding
# error up to 0.4% per op), fp16 11 but with loss scaling in the way; errors mostly average out
# over a batch of 300 sequences. A 1% bound leaves a wide margin, and a run that does not
# train at all misses fp32's loss by more (JOB moves it from 3.66 to 3.50: 4.2%).
LOW_PRECISION_REL_TOL = 0.01
CLIP = 0.05  # small enough that clipping is active at every step of JOB


RUNS = {  # name: flags of `python amp.py`, run in this process (amp.main). Each trains JOB.
    "fp32": ["--dtype=fp32"],
    "fp32, clipped": ["--dtype=fp32", f"--clip={CLIP}"],
    "default dtype on CPU": ["--device=cpu"],
    "fp16": ["--dtype=fp16", "--device=cpu"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (stdout, saved weights)}. `python amp.py` itself is launched by test_defaults."""
    folder = tmp_path_factory.mktemp("amp")
    return {name: run_in_process("amp", flags, folder) for name, flags in RUNS.items()}


def test_fp32_with_default_flags_equals_one_device_like_every_other_script(runs, reference,
                                                                          reference_val):
    out, weights = runs["fp32"]
    assert max_diff(weights, reference[1]) < TOL
    assert summary_val_loss(out) == pytest.approx(reference_val, abs=FP32_VAL_TOL)


def test_fp32_is_exactly_the_baseline_including_clipping(runs):
    norms = []
    _, clipped, _ = reference_train(**JOB, clip=CLIP, norms=norms)
    _, unclipped, _ = reference_train(**JOB)
    assert max_diff(clipped, unclipped) > 1e-3  # the clip really changes the run
    assert min(norms) > CLIP  # it acts at every step
    out, weights = runs["fp32, clipped"]
    assert max_diff(weights, clipped) < TOL
    assert_norms_are_the_oracles(out, norms)


def test_default_dtype_on_cpu_is_bf16(runs):
    assert "amp: dtype bf16 | device cpu" in runs["default dtype on CPU"][0]


@pytest.mark.parametrize("name", ["default dtype on CPU", "fp16"])
def test_low_precision_on_cpu_trains_to_the_fp32_loss(name, runs, reference, reference_val):
    out = runs[name][0]
    losses = logged_losses(out)
    assert losses[-1] < losses[0] - 0.1  # it trains (JOB: 3.66 -> 3.50 in fp32)
    assert losses[-1] == pytest.approx(reference[2][-1], rel=LOW_PRECISION_REL_TOL)
    # evaluated under autocast too: near, not equal to, the fp32 validation loss
    assert summary_val_loss(out) == pytest.approx(reference_val, rel=LOW_PRECISION_REL_TOL)


def test_a_step_with_inf_gradients_is_skipped_and_the_scale_backs_off(monkeypatch, tmp_path):
    """fp16, 3 steps, step 2's gradient poisoned with inf (a term added after its forward, where
    train() adds the balancing loss): the scaler skips step 2 (the weights before step 3 are
    those before step 2), says so with the halved scale, and step 3 goes through."""
    before, real_balance = [], amp.balance

    def poisoned(model, args, y, *group):  # called once per step here (one micro-batch each)
        before.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        term = real_balance(model, args, y, *group)
        return term + float("inf") * next(model.parameters()).sum() if len(before) == 2 else term

    monkeypatch.setattr(amp, "balance", poisoned)
    out, final = run_in_process("amp", ["--dtype=fp16", "--device=cpu", "--steps=3"], tmp_path)
    assert "step 2: skipped, inf/NaN gradients; fp16 loss scale lowered to 32768" in out
    assert "step 1: skipped" not in out and "step 3: skipped" not in out
    assert max_diff(before[1], before[0]) > 0  # step 1 trained
    assert max_diff(before[2], before[1]) == 0.0  # step 2 left every weight as it was
    assert max_diff(final, before[2]) > 0  # and the next clean step goes through


def run_seeing_the_gradient_adam_gets(script, flags, folder):
    """run_in_process(script, flags, folder), and the norm of the gradient each optimizer.step()
    received: (stdout, saved weights, norms). tests/test_zoo.py runs its amp.py mistake so."""
    seen = []

    def look(optimizer, args, kwargs):
        grads = [p.grad.flatten() for group in optimizer.param_groups for p in group["params"]]
        seen.append(torch.linalg.vector_norm(torch.cat(grads)).item())

    hook = register_optimizer_step_pre_hook(look)  # every optimizer's, until removed
    try:
        return (*run_in_process(script, flags, folder), seen)
    finally:
        hook.remove()


def test_gradients_are_unscaled_before_clipping(tmp_path):
    """fp16 with --clip: the norm printed and clipped is the true gradient's, not 65536 times
    it (the fp32 oracle's, to fp16's rounding), and the gradient Adam receives has exactly the
    clip's norm (clipped before unscale_, it would get 1/65536 of it: tests/test_zoo.py)."""
    out, _, seen = run_seeing_the_gradient_adam_gets(
        "amp", ["--dtype=fp16", "--device=cpu", f"--clip={CLIP}"], tmp_path)
    norms = []
    reference_train(**JOB, clip=CLIP, norms=norms)
    assert min(norms) > CLIP  # so the clip acts at every step
    assert_norms_are_the_oracles(out, norms, rel=LOW_PRECISION_REL_TOL)
    assert seen == pytest.approx([CLIP] * JOB["steps"], rel=1e-4)  # clipped to the bound


def test_fp16_checkpoint_resumes_with_its_scaler_to_the_uninterrupted_weights(tmp_path, capsys):
    """In-process (amp.main), since the uninterrupted run must use the same thread count."""
    flags = [*JOB_FLAGS, "--dtype=fp16", "--device=cpu"]
    ckpt = tmp_path / "ckpt.pt"
    amp.main([*flags, f"--save={tmp_path / 'straight.pt'}"])
    amp.main([*flags, "--steps=3", f"--checkpoint={ckpt}"])
    state = torch.load(ckpt, weights_only=True)
    assert state["step"] == 3 and state["scaler"]["scale"] > 0
    amp.main([*flags, f"--checkpoint={ckpt}", f"--save={tmp_path / 'resumed.pt'}"])
    assert "resumed from" in capsys.readouterr().out
    assert max_diff(load_saved(tmp_path / "resumed.pt"), load_saved(tmp_path / "straight.pt")) == 0


def test_fp64_with_16_bit_autocast_is_refused_in_one_line(capsys):
    """Every script shares --fp64; amp.py runs it with autocast off, and refuses it beside a
    16-bit type, which would lower the precision it asks for."""
    for dtype in ("bf16", "fp16"):
        refused_in_one_line("amp", ["--fp64", f"--dtype={dtype}"], f"--fp64 with --dtype {dtype}: "
                            "autocast would compute in 16 bits; use --dtype fp32", capsys)


def test_fp64_clipped_and_accumulated_through_the_scaler_path_equals_the_fp64_oracle(tmp_path):
    """--fp64 picks autocast off (fp32's path: the disabled GradScaler, unscale_, clipping and
    the scaler's step): in float64 it is the oracle to ~1e-12, not only to fp32's 1e-6."""
    seed = FP64_SEEDS[1]
    run = run_in_process("amp", [*fp64(seed, clip=FP64_CLIP), "--accum-steps=3"], tmp_path)
    assert "amp: dtype fp32" in run[0]
    assert_fp64_run_equals_the_fp64_oracle(run, seed, clip=FP64_CLIP)


def test_checkpoint_of_another_dtype_is_refused_in_one_line_and_left_as_it_was(tmp_path):
    """A bf16 run keeps no scaler state; resumed as fp16 it would stop in a traceback."""
    ckpt = tmp_path / "ckpt.pt"
    amp.main([*JOB_FLAGS, "--steps=2", "--dtype=bf16", f"--checkpoint={ckpt}"])
    before = ckpt.read_bytes()
    args = amp.parse_args([*JOB_FLAGS, "--dtype=fp16", f"--checkpoint={ckpt}"])
    model = SimpleModel(JOB["hidden"], JOB["blocks"], JOB["heads"])
    with pytest.raises(SystemExit, match="written with --dtype bf16, not fp16; use --dtype bf16"):
        amp.load_checkpoint(args, model, None, None)
    assert ckpt.read_bytes() == before


@needs_cuda
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_on_cuda_trains_to_the_fp32_loss(dtype, reference):
    out = ok(python("amp.py", *CUDA_JOB_FLAGS, f"--dtype={dtype}"))
    losses = logged_losses(out)
    assert losses[-1] < losses[0] - 0.1  # it trains (JOB: 3.66 -> 3.50 in fp32)
    assert losses[-1] == pytest.approx(reference[2][-1], rel=LOW_PRECISION_REL_TOL)


@needs_cuda
def test_fp32_on_cuda_equals_one_device(reference, tmp_path):
    result = python("amp.py", *CUDA_JOB_FLAGS, "--dtype=fp32", "--clip=0",
                    f"--save={tmp_path / 'w.pt'}")
    assert_gpu_run_equals_oracle(result, tmp_path / "w.pt", reference)
