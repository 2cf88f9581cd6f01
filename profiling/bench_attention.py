"""Attention benchmark: decode (1 row) and verify (vt = 8 rows) per session over a long cache, at
the shapes speculation runs: B = 1, 2 and 32 sessions, contexts 4k and 32k.

    python profiling/bench_attention.py          # cuda when a GPU works, else the CPU sizes
    python profiling/bench_attention.py --cpu    # tiny sizes on the simt backend (a few seconds)
    python profiling/bench_attention.py --plan   # the GPU sizes' launch plans: bytes and CTAs, nothing run

Shapes on a GPU: Qwen3.5-27B's full-attention layers (Hq 24, Hkv 4, D 256) and Qwen3-8B's (Hq 32,
Hkv 8, D 128), bf16 K/V. Bytes per call are what the launch plan moves (dspark.ops.attention.
launch_plan): each session's committed K and V once per kv head (every query row and GQA head of a
CTA shares its tiles), the block's K/V rows, q once per CTA, out, and, when the plan splits the keys
across CTAs, the f32 partials written by the split kernel and read back by the combine ("partials"
column: the share of the bytes they add). "min MB" is what any kernel must move: K/V, q and out once.
The time is the kernels alone: the op's launches are recorded once and replayed (profiling/timing.py:
on a GPU between CUDA events, L2 flushed before each repeat, median; on the CPU time.perf_counter,
median, for orientation only). On a GPU the bandwidth of the minimal bytes is also shown as a
fraction of a device-to-device copy measured in the same run, and beside it the H200 time
profiling/perf_model.py predicts from the same plan, with measured / predicted.
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
from dspark.ops.attention import attention, launch_plan
import perf_model as pm
from timing import clock_for, copy_bandwidth, device_rng, record, replay, seconds, supports, table

BF16 = np.dtype(ml_dtypes.bfloat16)
GPU_MODELS = {"Qwen3.5-27B": dict(hkv=4, gqa=6, head_dim=256), "Qwen3-8B": dict(hkv=8, gqa=4, head_dim=128)}
CPU_MODELS = {"tiny (simt)": dict(hkv=1, gqa=4, head_dim=128)}
GPU_SIZES = dict(batches=(1, 2, 32), contexts=(4096, 32768))
CPU_SIZES = dict(batches=(1, 2), contexts=(128, 512))
WIDTHS = (("decode", 1), ("verify", 8))


@dataclasses.dataclass
class Inputs:
    args: tuple
    out: object
    bytes: int     # the least any kernel moves: K/V once per kv head, the block rows, q and out
    flops: int

    def op(self, be) -> None:
        attention(be, *self.args, out=self.out)


def make_inputs(be, batch, context, vt, hkv, gqa, head_dim, dtype, seed=0) -> Inputs:
    xp, rng, device = be.xp, np.random.default_rng(seed), device_rng(be)
    rows, hq = batch * vt, hkv * gqa

    def randn(*shape):  # generated on the device when there is one: 4 GB of caches at B=32, 32k
        if device is None:
            return be.asarray(rng.standard_normal(shape, np.float32).astype(dtype))
        return device.standard_normal(shape, dtype=np.float32).astype(dtype)

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


def calls(sizes):
    """(batch, context, mode, vt) of every call the benchmark makes at `sizes`."""
    for batch in sizes["batches"]:
        for context in sizes["contexts"]:
            for mode, vt in WIDTHS:
                yield batch, context, mode, vt


def print_plans() -> None:
    """The launch plans at the GPU sizes: what each call moves and how many CTAs share it."""
    for model, shape in GPU_MODELS.items():
        hkv, gqa, d = shape["hkv"], shape["gqa"], shape["head_dim"]
        print(f"\n{model}: Hq={hkv * gqa} Hkv={hkv} D={d} bf16 (launch plans, nothing run)")
        rows = []
        for batch, context, mode, vt in calls(GPU_SIZES):
            p = launch_plan([vt] * batch, [context] * batch, hq=hkv * gqa, hkv=hkv, head_dim=d, dtype=BF16)
            partials = (p.bytes["partials_written"] + p.bytes["partials_read"]) / p.total_bytes
            rows.append([mode, batch, context, vt, f"{p.strategy} x{p.launches}", p.ctas, p.max_splits,
                         int(p.cta_keys.max()), f"{p.total_bytes / 1e6:.1f}", f"{partials:.1%}",
                         f"{p.shared_mem // 1024}K", seconds(predicted(p))])
        print(table(["mode", "B", "context", "vt", "plan", "CTAs", "splits", "max keys", "MB", "partials", "smem",
                     "H200 model"], rows))


def predicted(plan) -> float:
    """The H200 time of the op's launches (split kernel and combine), from profiling/perf_model.py."""
    return sum(k.time for k in pm.attention_kernels("bench", plan, pm.H200))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="tiny sizes on the simt backend, even with a GPU")
    ap.add_argument("--plan", action="store_true", help="print the GPU sizes' launch plans; run nothing")
    a = ap.parse_args(argv)
    if a.plan:
        print_plans()
        return
    gpu = cuda_available() and not a.cpu
    be = dspark.get_backend("cuda" if gpu else "simt")
    models, sizes = (GPU_MODELS, GPU_SIZES) if gpu else (CPU_MODELS, CPU_SIZES)
    clock = clock_for(be)
    dtype = storage_dtype(be.xp, BF16) if gpu else BF16
    if gpu:
        copy_bw = copy_bandwidth(be.xp, clock, 1 << 30)
        print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s")
    for model, shape in models.items():
        hkv, gqa, d = shape["hkv"], shape["gqa"], shape["head_dim"]
        print(f"\n{model}: backend {be.name}, Hq={hkv * gqa} Hkv={hkv} D={d} {dtype.name}")
        rows = []
        for batch, context, mode, vt in calls(sizes):
            inputs = make_inputs(be, batch, context, vt, hkv, gqa, d, dtype)
            p = launch_plan([vt] * batch, [context] * batch, hq=hkv * gqa, hkv=hkv, head_dim=d, dtype=dtype)
            t = clock.median(replay(record(be, inputs.op)))
            partials = (p.bytes["partials_written"] + p.bytes["partials_read"]) / p.total_bytes
            row = [mode, batch, context, vt, f"{p.strategy} x{p.launches}", p.ctas, f"{p.total_bytes / 1e6:.2f}",
                   f"{partials:.1%}", f"{inputs.bytes / 1e6:.2f}", seconds(t), f"{p.total_bytes / t / 1e9:.2f}",
                   seconds(predicted(p)), f"{t / predicted(p):.2f}x"]
            if gpu:
                row.append(f"{inputs.bytes / t / copy_bw:.1%}")
            rows.append(row)
            del inputs
            if gpu:
                be.xp.get_default_memory_pool().free_all_blocks()
        headers = ["mode", "B", "context", "vt", "plan", "CTAs", "MB", "partials", "min MB", "time", "GB/s",
                   "predicted", "measured/predicted"]
        print(table(headers + (["of copy"] if gpu else []), rows))
    if not gpu:
        print("(simt runs every CUDA thread as a CPU fiber: these times say nothing about a GPU)")


if __name__ == "__main__":
    main()
