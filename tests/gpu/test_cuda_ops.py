"""Every op once on a real GPU, at small sizes, against simt: the small per-family cuda tests that
profiling/gpu_check.sh runs under compute-sanitizer (memcheck, racecheck, synccheck).

Integer outputs and the sampling family (exact integer forms and dspark's own exp/log) match simt
bit for bit; other float outputs within 1e-4 relative (device and host expf may differ in the
last bit). Skipped without a GPU, failed under DSPARK_REQUIRE_CUDA=1 (the `cuda` fixture).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.op_cases import CASES, run_case

BITWISE = {"argmax_rows", "greedy_accept", "markov_chain", "kv_commit", "kv_commit_ring", "snapshot_save",
           "snapshot_restore", "checkpoint_select", "sample_filtered", "sample_inverse_cdf", "filtered_probs",
           "speculative_accept", "philox_random"}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_cuda_op_matches_simt(case, cuda, simt, rng):
    inputs = case.build(rng)
    want = run_case(case, simt, inputs, lambda a: a, np.asarray)
    got = run_case(case, cuda, inputs, cuda.asarray, cuda.to_host)
    assert len(got) == len(want)
    for i, ((gd, gs, gb), (wd, ws, wb)) in enumerate(zip(got, want)):
        assert (gd, gs) == (wd, ws), f"{case.name} result {i}"
        if case.name in BITWISE or np.dtype(wd).kind != "f":
            assert gb == wb, f"{case.name} result {i} ({wd} {ws}) differs from simt"
        else:
            g, w = np.frombuffer(gb, wd), np.frombuffer(wb, wd)
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, equal_nan=True, err_msg=f"{case.name} result {i}")
