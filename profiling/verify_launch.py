"""One verify attention launch at the benchmark trunk's shape, for Nsight Compute: a verify block
of `--rows` query rows over a `--ctx`-row context (Hq 32, Hkv 8, D 128, bf16 where CuPy has it,
else f16). One warm-up launch, then the profiled one:

    ncu --launch-skip 1 --launch-count 1 --kernel-name regex:^attention_ python profiling/verify_launch.py

`bash profiling/ncu_kernels.sh --verify OUTDIR` runs exactly that.
"""

from __future__ import annotations

import argparse

import numpy as np

import dspark
from dspark.dtypes import BF16
from dspark.ops.attention import attention


def kv_dtype(be):
    if be.name != "cuda":
        return BF16
    from dspark.dtypes import dtype_supported
    return BF16 if dtype_supported(be.xp, BF16) else np.dtype(np.float16)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default=None, help="numpy, simt or cuda (default: cuda when a GPU works)")
    ap.add_argument("--rows", type=int, default=8, help="verify columns (default 8)")
    ap.add_argument("--ctx", type=int, default=4096, help="committed context rows (default 4096)")
    ap.add_argument("--heads", type=int, nargs=3, default=(32, 8, 128), metavar=("HQ", "HKV", "D"))
    a = ap.parse_args(argv)
    be = dspark.get_backend(a.backend)
    hq, hkv, d = a.heads
    dt = kv_dtype(be)
    rng = np.random.default_rng(0)

    def dev(shape):
        return be.asarray(rng.standard_normal(shape).astype(np.float32).astype(dt))
    q, k, v = dev((a.rows, hq, d)), dev((a.rows, hkv, d)), dev((a.rows, hkv, d))
    kc, vc = dev((hkv, a.ctx + a.rows, d)), dev((hkv, a.ctx + a.rows, d))
    pos, indptr = np.array([a.ctx], np.int32), np.array([0, a.rows], np.int32)
    for _ in range(2):  # warm-up, then the launch Nsight Compute profiles
        out = attention(be, q, k, v, [kc], [vc], pos, indptr, mode="causal")
    be.synchronize()
    print(f"verify attention on {be.name}: {a.rows} rows over {a.ctx} context rows, Hq {hq}, Hkv {hkv}, D {d}, "
          f"{np.dtype(dt).name}; out {tuple(out.shape)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
