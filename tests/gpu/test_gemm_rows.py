"""Does cuBLAS compute a row of x @ W the same whatever the number of rows M? dspark.ops.linear
does not rely on it: its kernel sums every output in one order fixed by (K, N), so a row's product
is the same whatever the batch (row invariance, DESIGN section 3). This test prints, for the
projection shapes of the models, which M give cuBLAS rows bitwise equal to M = 1's, and asserts
only what dspark relies on (linear is invariant on the GPU too). Skipped without a GPU; the GPU
check (profiling/gpu_check.sh) runs it."""

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
