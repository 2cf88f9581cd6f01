"""Does cuBLAS compute a row of x @ W the same whatever the number of rows M? dspark.ops.linear
does not rely on it: its kernel sums every output in one order fixed by (K, N), so a row's product
is the same whatever the batch (row invariance, DESIGN section 3). This test prints, for the
projection shapes of the models, which M give cuBLAS rows bitwise equal to M = 1's, and asserts
only what dspark relies on (linear is invariant on the GPU too, f32 and bf16 weights). Skipped
without a GPU; the GPU check (profiling/gpu_check.sh) runs it."""

import numpy as np
import pytest

from dspark.ops.linear import linear

SHAPES = [(192, 1344), (4096, 6144), (5120, 12288), (5120, 17408), (8192, 5120)]  # (K, N): q|k|v, gate|up ...
MS = (1, 2, 3, 8, 9, 16, 17, 64, 256)


@pytest.mark.parametrize("k,n", SHAPES)
def test_rows_of_x_at_w_across_m_on_cublas(cuda, k, n):
    cp = cuda.xp
    rng = np.random.default_rng(k + n)
    w = cp.asarray(rng.standard_normal((k, n), np.float32) / np.float32(np.sqrt(k)))
    x = cp.asarray(rng.standard_normal((max(MS), k), np.float32))
    lone = (x[:1] @ w).get()[0]
    plain = {m: bool(np.array_equal((x[:m] @ w).get()[0], lone)) for m in MS}
    alone = linear(cuda, x[:1], w).get()[0]
    ours = {m: bool(np.array_equal(linear(cuda, x[:m], w).get()[0], alone)) for m in MS}
    varying = [m for m, same in plain.items() if not same]
    print(f"K={k} N={n}: plain x @ W row 0 equals M=1's for M in {[m for m, s in plain.items() if s]}; "
          f"differs for {varying or 'none'}")
    assert all(ours.values()), f"linear is not row-invariant on this GPU: {ours}"


@pytest.mark.parametrize("k,n", SHAPES)
def test_tensor_core_rows_are_the_same_for_any_row_count(cuda, k, n):
    """The tensor-core GEMM (bf16 weights) on the hardware MMA: row 0 of launches of 1 to 2048 rows
    (every tile shape, split and fold mode) is bitwise the row alone, and the rows agree with the
    NumPy reference of the same rounding within one MMA's bound per k-step (simt/tensor_core.h:
    18 * 2^-23 of the absolute sum)."""
    from dspark.backends.cuda import dtype_supported
    from dspark.dtypes import BF16
    from dspark.ops.linear import linear_mma_ref, mma_split_plan
    cp = cuda.xp
    if not dtype_supported(cp, BF16):
        pytest.skip(f"CuPy {cp.__version__} has no bfloat16 arrays")
    rng = np.random.default_rng(k * n)
    w_host = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(BF16)
    x_host = rng.standard_normal((2048, k)).astype(np.float32)
    w, x = cp.asarray(w_host), cp.asarray(x_host)
    alone = linear(cuda, x[:1], w).get()[0]
    same = {m: bool(np.array_equal(linear(cuda, x[:m], w).get()[0], alone)) for m in (1, 2, 7, 16, 17, 64, 300, 2048)}
    assert all(same.values()), f"the tensor-core GEMM is not row-invariant on this GPU: {same}"
    ref = linear_mma_ref(x_host[:2], w_host, mma_split_plan(k, n)[1])
    bound = 18 * 2.0**-23 * -(-k // 16) * (np.abs(x_host[:2].astype(BF16).astype(np.float64))
                                          @ np.abs(w_host.astype(np.float64)))
    assert np.all(np.abs(linear(cuda, x[:2], w).get() - ref) <= bound + 1e-30)
