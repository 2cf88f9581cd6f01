"""Every op once on a real GPU, at small sizes, against the numpy backend (the NumPy references):
the small per-family cuda tests that profiling/gpu_check.py runs under compute-sanitizer
(memcheck, racecheck, synccheck). They need only the cuda backend, not the simt build.

Integer outputs and the sampling family (exact integer forms and dspark's own exp/log) match the
reference bit for bit; other float outputs within 1e-4 relative (device expf and the reference's
order of a sum may differ in the last bits), the GEMM of 16-bit weights within the rounding of its
activations to the weight's type (the tensor-core GEMM's, which the numpy backend does not do). Skipped without a GPU, failed under
DSPARK_REQUIRE_CUDA=1 (the `cuda` fixture). The same comparison runs here on the CuPy contract
stand-in (its kernels execute on simt), so the references and tolerances are checked in CI.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.op_cases import CASES, run_case

BITWISE = {"argmax_rows", "greedy_accept", "markov_chain", "kv_commit", "kv_commit_ring", "snapshot_save",
           "snapshot_restore", "checkpoint_select", "sample_filtered", "sample_inverse_cdf", "filtered_probs",
           "speculative_accept", "philox_random"}


def assert_matches_the_reference(case, device, reference, rng) -> None:
    inputs = case.build(rng)
    want = run_case(case, reference, inputs, lambda a: a, np.asarray)
    got = run_case(case, device, inputs, device.asarray, device.to_host)
    assert len(got) == len(want) and got, case.name
    for i, ((gd, gs, gb), (wd, ws, wb)) in enumerate(zip(got, want)):
        assert (gd, gs) == (wd, ws), f"{case.name} result {i}"
        if case.name in BITWISE or np.dtype(wd).kind != "f":
            assert gb == wb, f"{case.name} result {i} ({wd} {ws}) differs from the reference"
        else:
            g, w = np.frombuffer(gb, wd), np.frombuffer(wb, wd)
            if case.bound is not None:
                assert np.all(np.abs(g - w) <= case.bound(inputs).ravel()), f"{case.name} result {i}"
                continue
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, equal_nan=True, err_msg=f"{case.name} result {i}")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_cuda_op_matches_the_reference(case, cuda, numpy_backend, rng):
    assert_matches_the_reference(case, cuda, numpy_backend, rng)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_comparison_on_the_contract_stand_in(case, numpy_backend, rng):
    from dspark.backends import contract
    assert_matches_the_reference(case, contract.backend(), numpy_backend, rng)
