"""Attention benchmark: decode (1 row) and verify (vt = 8 rows) per session over a long cache.

    python profiling/bench_attention.py          # cuda when a GPU works, else the CPU sizes
    python profiling/bench_attention.py --cpu    # tiny sizes on the simt backend (a few seconds)

Bytes per call are what the kernel must move at least: each session's committed K and V read
once per kv head (shared by every query row and GQA head of the group), plus the block's own
K/V rows, q and out. The time is the kernel alone: the op's launch is recorded once and replayed
(profiling/timing.py: on a GPU between CUDA events, L2 flushed before each repeat, median; on the
CPU time.perf_counter, median, for orientation only). On a GPU the bandwidth is also shown as a
fraction of a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts, also when run by `dspark bench`
import dspark
from dspark.backends import cuda_available
from dspark.ops.attention import attention
from timing import clock_for, copy_bandwidth, record, replay, seconds, supports

GPU_SHAPES = dict(batches=(1, 8, 32), contexts=(4096, 32768), hkv=8, gqa=4, head_dim=128, dtype=ml_dtypes.bfloat16)
CPU_SHAPES = dict(batches=(1, 4), contexts=(128, 512), hkv=2, gqa=4, head_dim=128, dtype=ml_dtypes.bfloat16)
WIDTHS = (("decode", 1), ("verify", 8))


@dataclasses.dataclass
class Inputs:
    args: tuple
    out: object
    bytes: int
    flops: int

    def op(self, be) -> None:
        attention(be, *self.args, out=self.out)


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
    # q.k and p.v: 2 flops per multiply-add each, over D, for every (row, query head, visible
    # key); row i of a session sees context + i + 1 keys.
    visible = vt * context + vt * (vt + 1) // 2
    flops = 4 * head_dim * hq * batch * visible
    return Inputs((q, k_blk, v_blk, caches[0], caches[1], pos, indptr), xp.empty_like(q), moved, flops)


def storage_dtype(xp, dtype):
    """`dtype`, or float16 on a CuPy without bfloat16 (the same bytes through the same code)."""
    return dtype if supports(xp, dtype) else np.dtype(np.float16)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="tiny sizes on the simt backend, even with a GPU")
    a = ap.parse_args(argv)
    gpu = cuda_available() and not a.cpu
    be = dspark.get_backend("cuda" if gpu else "simt")
    shapes = dict(GPU_SHAPES if gpu else CPU_SHAPES)
    clock = clock_for(be)
    if gpu:
        shapes["dtype"] = storage_dtype(be.xp, shapes["dtype"])
        copy_bw = copy_bandwidth(be.xp, clock, 1 << 30)
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
                t = clock.median(replay(record(be, inputs.op)))
                bw = inputs.bytes / t
                line = (f"{mode:7s} {batch:3d} {context:7d} {vt:3d} {inputs.bytes / 1e6:9.2f} {seconds(t):>10s} "
                        f"{bw / 1e9:8.2f}")
                print(line + (f" {bw / copy_bw:8.1%}" if gpu else ""))
                del inputs
                if gpu:
                    be.xp.get_default_memory_pool().free_all_blocks()
    if not gpu:
        print("(simt runs every CUDA thread as a CPU fiber: these times say nothing about a GPU)")


if __name__ == "__main__":
    main()
