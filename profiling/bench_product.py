"""The numpy backend's product alone (dspark.ops.product, csrc/cpu/product.h): what a verify's 8
rows and a prompt pass's 32 cost beside one row, per instruction set, in one run.

    python profiling/bench_product.py [--k 1024] [--n 16384] [--rows 1 2 8 9 32] [--isa avx512 avx2]
                                      [--repeats 11]

One thread, f32 weights. A call's time is the CPU time of the calling thread (the product runs
there when threads=1), so the other processes on a shared machine cost it cache and bandwidth but
not the time they hold the core; the median of `--repeats` calls, each on the next of four copies
of w (4 x 64 MB at the default size: no call finds the last one's weights in cache). Two shapes:
`memory`, w of K x N in memory (a decode step's products are this shape's one-row case), and
`cache`, w of 256 x 1024 (1 MB, in L2): the tiles' arithmetic alone, against the issue bound
printed beside it (16 f32 multiply-adds a cycle, a multiply and an add each, at the clock the
kernel reports in /proc/cpuinfo). Prints per row count: ms, weights streamed (GB/s),
multiply-adds (G/s), and the time over one row's.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def clock_ghz() -> float | None:
    """The first core's clock as the kernel reports it (None where it does not)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return float(line.split(":")[1]) / 1e3
    except OSError:
        pass
    return None


def timed(product, x, ws, isa: str, repeats: int) -> float:
    out = np.empty((x.shape[0], ws[0].shape[1]), np.float32)
    product(x, ws[0], out, threads=1, isa=isa)  # warm: the scratch, the code
    seconds = []
    for i in range(repeats):
        w = ws[(i + 1) % len(ws)]
        t = time.thread_time()
        product(x, w, out, threads=1, isa=isa)
        seconds.append(time.thread_time() - t)
    return float(np.median(seconds))


def run(k: int, n: int, rows_list, isas, repeats: int, copies: int) -> None:
    from dspark.ops import product as prod
    if not prod.NATIVE:
        raise SystemExit("dspark._cpu is not built (pip install -e . or python setup.py build_ext --inplace)")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((max(rows_list), max(k, 256))).astype(np.float32)
    shapes = {"memory": (k, n, copies), "cache": (256, 1024, 1)}
    ghz = clock_ghz()
    for name, (kk, nn, c) in shapes.items():
        ws = [rng.standard_normal((kk, nn)).astype(np.float32) for _ in range(c)]
        bound = f", issue bound {16 * ghz:.1f} G multiply-adds/s at {ghz:.2f} GHz" if ghz else ""
        print(f"\n{name}: w f32 {kk} x {nn} ({kk * nn * 4 / 2**20:.0f} MB){' x ' + str(c) + ' copies' if c > 1 else ''}"
              f"{bound}")
        print(f"{'isa':8s} {'rows':>4s} {'ms':>8s} {'GB/s':>7s} {'GMA/s':>7s} {'/ 1 row':>8s}")
        for isa in isas:
            one = None
            for rows in rows_list:
                s = timed(prod.product, np.ascontiguousarray(x[:rows, :kk]), ws, isa, repeats)
                one = one or (s if rows == 1 else None)
                rel = f"{s / one:8.2f}" if one else f"{'':8s}"
                print(f"{isa:8s} {rows:4d} {s * 1e3:8.3f} {kk * nn * 4 / s / 1e9:7.1f} {rows * kk * nn / s / 1e9:7.1f} {rel}")


def main(argv=None) -> int:
    from dspark.ops import product as prod
    have = list(prod._cpu.isas) if prod.NATIVE else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 9, 32])
    ap.add_argument("--isa", nargs="+", default=[i for i in have if i != "base"] or have, choices=have or None)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--copies", type=int, default=4, help="copies of w the calls take in turn")
    args = ap.parse_args(argv)
    run(args.k, args.n, sorted(set(args.rows)), args.isa, args.repeats, args.copies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
