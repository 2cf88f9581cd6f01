"""The numpy backend's FP8 product (dspark.ops.product.product_fp8) beside its bf16 product on the
same shape, interleaved in one run: what reading e4m3 bytes and dequantizing them costs on the CPU.

    python profiling/bench_fp8_product.py [--k 1024] [--n 8192] [--rows 1 8 32] [--repeats 9]

One thread; the median of `--repeats` calls of each, taken in turn (fp8, bf16, fp8, ...), CPU time
of the calling thread. Prints per row count: ms of each and fp8 / bf16.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from dspark.dtypes import BF16
from dspark.ops import fp8
from dspark.ops import product as prod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    k, n = args.k, args.n
    q = rng.integers(0, 0x7E, (k, n)).astype(np.uint8)
    s = rng.uniform(1e-3, 1e-2, fp8.scale_grid(k, n)).astype(np.float32)
    w = fp8.dequantize(q, s, BF16)
    print(f"K {k}, N {n}, one thread ({prod.native_status()})")
    for rows in args.rows:
        x = rng.standard_normal((rows, k)).astype(np.float32)
        out = np.empty((rows, n), np.float32)
        times = {"fp8": [], "bf16": []}
        for _ in range(args.repeats):
            for name, run in (("fp8", lambda: prod.product_fp8(x, q, s, out, threads=1)),
                              ("bf16", lambda: prod.product(x, w, out, threads=1))):
                t = time.thread_time()
                run()
                times[name].append(time.thread_time() - t)
        a, b = (float(np.median(times[m])) * 1e3 for m in ("fp8", "bf16"))
        print(f"rows {rows:3d}: fp8 {a:8.2f} ms, bf16 {b:8.2f} ms, fp8 / bf16 {a / b:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
