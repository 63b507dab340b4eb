"""dataparallel.py trains to the same weights as one device."""

import pytest

from conftest import (CUDA_JOB_FLAGS, FP32_VAL_TOL, FP64_CLIP, FP64_SEEDS, TOL,
                      assert_fp64_run_equals_the_fp64_oracle, assert_gpu_run_equals_oracle,
                      assert_norms_are_the_oracles, fp64, logged_losses, max_diff,
                      needs_cuda, python, run_in_process, summary_numbers, summary_val_loss)



def test_dataparallel_on_cpu_with_accumulation_equals_one_device(reference, reference_val,
                                                                  tmp_path):
    # in this process (dataparallel.main); `python dataparallel.py` is launched by test_defaults
    out, weights = run_in_process("dataparallel", ["--device=cpu", "--accum-steps=2"], tmp_path)
    assert "no GPU" in out  # it says once that DataParallel has nothing to spread over
    assert max_diff(weights, reference[1]) < TOL
    assert_norms_are_the_oracles(out, reference[3])
    losses = logged_losses(out)
    assert losses[-1] < losses[0] - 0.1  # it trains (JOB: 3.66 -> 3.50 in fp32)
    assert all(x > 0 for x in summary_numbers(out))
    assert summary_val_loss(out) == pytest.approx(reference_val, abs=FP32_VAL_TOL)


FP64_CASES = [(FP64_SEEDS[0], None), (FP64_SEEDS[-1], FP64_CLIP)]


@pytest.mark.parametrize("seed, clip", FP64_CASES)
def test_fp64_dataparallel_with_accumulation_and_clipping_equals_the_fp64_oracle_on_any_seed(
        seed, clip, tmp_path):
    run = run_in_process("dataparallel", ["--device=cpu", *fp64(seed, clip=clip),
                                          "--accum-steps=3"], tmp_path)
    assert_fp64_run_equals_the_fp64_oracle(run, seed, clip=clip)


@needs_cuda
def test_dataparallel_on_cuda_equals_one_device(reference, tmp_path):
    result = python("dataparallel.py", *CUDA_JOB_FLAGS, f"--save={tmp_path / 'w.pt'}")
    assert_gpu_run_equals_oracle(result, tmp_path / "w.pt", reference)
