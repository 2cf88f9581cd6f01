"""Attention benchmark: decode (1 row) and verify (vt = 8 rows) per session over a long cache.

    python profiling/bench_attention.py          # cuda when a GPU works, else the CPU sizes
    python profiling/bench_attention.py --cpu    # tiny sizes on the simt backend (a few seconds)

Bytes per call are what the kernel must move at least: each session's committed K and V read
once per kv head (shared by every query row and GQA head of the group), plus the block's own
K/V rows, q and out. On a GPU the time is the kernel alone (the op's launch is recorded once and
replayed between CUDA events, L2 flushed before each repeat; median), and the bandwidth is also
shown as a fraction of a measured device-to-device copy. On the CPU the time is the whole op
call (time.perf_counter, median), for orientation only.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import ml_dtypes
import numpy as np

import dspark
from dspark.backends import cuda_available
from dspark.ops.attention import attention

GPU_SHAPES = dict(batches=(1, 8, 32), contexts=(4096, 32768), hkv=8, gqa=4, head_dim=128, dtype=ml_dtypes.bfloat16)
CPU_SHAPES = dict(batches=(1, 4), contexts=(128, 512), hkv=2, gqa=4, head_dim=128, dtype=ml_dtypes.bfloat16)
WIDTHS = (("decode", 1), ("verify", 8))


@dataclasses.dataclass
class Inputs:
    args: tuple
    out: object
    bytes: int


def make_inputs(be, batch, context, vt, hkv, gqa, head_dim, dtype, seed=0) -> Inputs:
    xp, rng = be.xp, np.random.default_rng(seed)
    rows, hq = batch * vt, hkv * gqa

    def randn(*shape):  # generated on the device when there is one: 4 GB of caches at B=32, 32k
        if xp is np:
            return rng.standard_normal(shape, np.float32).astype(dtype)
        return xp.random.standard_normal(shape, dtype=np.float32).astype(dtype)

    caches = [[randn(hkv, context + vt, head_dim) for _ in range(batch)] for _ in range(2)]
    q, k_blk, v_blk = randn(rows, hq, head_dim), randn(rows, hkv, head_dim), randn(rows, hkv, head_dim)
    pos = np.full(batch, context, np.int32)
    indptr = (np.arange(batch + 1) * vt).astype(np.int32)
    isz = np.dtype(dtype).itemsize
    moved = isz * (2 * batch * hkv * context * head_dim      # K and V of the cache, once per kv head
                   + 2 * rows * hkv * head_dim                # the block's own K and V
                   + 2 * rows * hq * head_dim)                # q and out
    return Inputs((q, k_blk, v_blk, caches[0], caches[1], pos, indptr), xp.empty_like(q), moved)


class Recorder:
    """Wraps an executor: runs each launch and keeps it, so it can be replayed without the op's
    host-side validation and uploads."""

    def __init__(self, kernels):
        self.kernels, self.launches = kernels, []

    def get_function(self, name):
        fn = self.kernels.get_function(name)

        def launch(grid, block, args, shared_mem=0):
            self.launches.append((fn, grid, block, args, shared_mem))
            fn(grid, block, args, shared_mem=shared_mem)
        return launch


def copy_bandwidth(cp, nbytes=1 << 30, reps=10) -> float:
    """Device-to-device copy, bytes read + written per second (median)."""
    src, dst = cp.ones(nbytes // 4, cp.float32), cp.empty(nbytes // 4, cp.float32)
    times = []
    for i in range(reps + 2):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        cp.copyto(dst, src)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e-3)
    return 2 * nbytes / float(np.median(times))


def time_gpu(cp, be, inputs, reps=20) -> float:
    """Median kernel time in seconds: the op's launch replayed between events, L2 flushed first."""
    rec = Recorder(be.kernels)
    attention(dataclasses.replace(be, kernels=rec), *inputs.args, out=inputs.out)
    (fn, grid, block, args, smem), = rec.launches
    flush = cp.empty(256 << 20, cp.uint8)  # larger than any L2
    times = []
    for i in range(reps + 3):
        flush.fill(i)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn(grid, block, args, shared_mem=smem)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e-3)
    return float(np.median(times))


def time_cpu(be, inputs, reps=3) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        attention(be, *inputs.args, out=inputs.out)
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="tiny sizes on the simt backend, even with a GPU")
    a = ap.parse_args(argv)
    gpu = cuda_available() and not a.cpu
    be = dspark.get_backend("cuda" if gpu else "simt")
    shapes = GPU_SHAPES if gpu else CPU_SHAPES
    cp = None
    if gpu:
        import cupy as cp
        try:
            cp.zeros(1, np.float32).astype(shapes["dtype"])
        except Exception:  # a CuPy without bfloat16: f16 moves the same bytes through the same code
            shapes = dict(shapes, dtype=np.float16)
        copy_bw = copy_bandwidth(cp)
        print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s")
    dt = np.dtype(shapes["dtype"]).name
    print(f"backend {be.name}: Hkv={shapes['hkv']} Hq={shapes['hkv'] * shapes['gqa']} D={shapes['head_dim']} {dt}")
    print(f"{'mode':7s} {'B':>3s} {'context':>7s} {'vt':>3s} {'MB moved':>9s} {'time':>10s} {'GB/s':>8s}"
          + (f" {'of copy':>8s}" if gpu else ""))
    for batch in shapes["batches"]:
        for context in shapes["contexts"]:
            for mode, vt in WIDTHS:
                inputs = make_inputs(be, batch, context, vt, shapes["hkv"], shapes["gqa"], shapes["head_dim"],
                                     shapes["dtype"])
                t = time_gpu(cp, be, inputs) if gpu else time_cpu(be, inputs)
                bw = inputs.bytes / t
                shown = f"{t * 1e6:8.1f}us" if gpu else f"{t * 1e3:8.1f}ms"
                line = f"{mode:7s} {batch:3d} {context:7d} {vt:3d} {inputs.bytes / 1e6:9.2f} {shown} {bw / 1e9:8.2f}"
                print(line + (f" {bw / copy_bw:8.1%}" if gpu else ""))
                del inputs
                if gpu:
                    cp.get_default_memory_pool().free_all_blocks()
    if not gpu:
        print("(simt runs every CUDA thread as a CPU fiber: these times say nothing about a GPU)")


if __name__ == "__main__":
    main()
