"""Shared-memory wavefronts of every kernel, counted where the kernel runs: each probe below runs an
op through simt's counting build (dspark.backends.simt_build.counting_env: every warp-wide
shared-memory access, its wavefronts with bank conflicts and without, csrc/simt/wavefronts.h) at a
small shape with the real tile shapes and head dims, and this script fits, per entry point, the
wavefronts per unit of its launch that profiling/perf_model.py scales them by:

  attention (prompt, split and serial kernels)  per CTA, per key tile walked, per split ended, per key
                                                tile and m-tile of 16 items
  linear_mma_<dt>_m<BM>, linear_fp8_<dt>_m<BM>  per CTA, per K iteration (the plan's BK)
  moe_linear_mma_<dt>_m<BM>, moe_linear_fp8_..  per working CTA, per K iteration
  gdn_chunk_state                               per CTA, per chunk walked
  every other kernel                            per byte its call moves (the benchmark's count), from
                                                profiling/bench_kernels.py's ops at PROBE sizes

It writes profiling/wavefronts.json (with a digest of every kernel source: the test that reads it
fails when a kernel changes and the counts were not taken again).

    python profiling/wavefronts.py          # builds the counting build once (a few minutes), then about as long
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dspark.ops.attention import PROMPT_ITEMS  # noqa: E402

OUT = Path(__file__).with_name("wavefronts.json")
KINDS = ("load", "store", "ldmatrix", "cp_async")


def attention_probes():
    """(label, lens, pos, hq, hkv, D, dtype, strategy): per entry, shapes that vary the units apart."""
    for d in (256, 128):
        for dt in ("bfloat16", "float32"):
            if dt == "bfloat16":  # the prompt kernel: tiles and merges per CTA apart, every CTA full (GQA 6)
                full = PROMPT_ITEMS // 6
                for lens, pos in (([3 * full], [0]), ([10 * full], [0]), ([full], [700])):
                    yield "prompt", lens, pos, 6, 1, d, dt, "prompt"
            for strategy in ("parallel", "serial"):
                for lens, pos in (([8], [100]), ([8], [600]), ([1, 1], [300, 40]), ([3], [900])):
                    yield strategy, lens, pos, 6, 1, d, dt, strategy


def run_attention(be, lens, pos, hq, hkv, d, dt):
    import ml_dtypes
    from dspark.ops.attention import attention
    dtype = np.dtype(ml_dtypes.bfloat16) if dt == "bfloat16" else np.dtype(np.float32)
    rng = np.random.default_rng(0)
    rows = sum(lens)
    r = lambda *s: rng.standard_normal(s, np.float32).astype(dtype)  # noqa: E731
    caches = [[r(hkv, p + n, d) for p, n in zip(pos, lens)] for _ in range(2)]
    q, kb, vb = r(rows, hq, d), r(rows, hkv, d), r(rows, hkv, d)
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return lambda strategy: attention(be, q, kb, vb, caches[0], caches[1], np.asarray(pos, np.int32), indptr,
                                      strategy=strategy)


def unit_totals(units: dict, ctas: int) -> dict:
    return {k: float(np.sum(np.broadcast_to(np.asarray(v, np.float64), (ctas,)))) for k, v in units.items()}


def child() -> list[dict]:
    """Runs in the counting build: every probe, one row per launch."""
    import dspark
    import perf_model as pm
    from dspark.ops import gdn_chunk as chunk_ops
    from dspark.ops import linear as linear_ops
    from dspark.ops.attention import launch_plan
    from dspark.ops.fp8 import Fp8Matrix, scale_grid
    from dspark.ops.linear import linear
    from dspark.ops.swiglu_linear import swiglu_linear
    from dspark.ops.gate_linear import attn_gate_linear
    be = dspark.get_backend("simt")
    k = be.kernels
    assert k.counts_shared_accesses, "not the counting build"
    rows_out = []

    def take(counts, units_of, probe):
        for c in counts:
            units = units_of(c)
            if units is None:
                continue
            rows_out.append({"entry": c.kernel, "probe": probe, "units": units, "mma": c.mma,
                             **{kind: list(dataclasses.astuple(c.access[kind])) for kind in KINDS}})

    for label, lens, pos, hq, hkv, d, dt, strategy in attention_probes():
        plan = launch_plan(lens, pos, hq=hq, hkv=hkv, head_dim=d, dtype=dt, strategy=strategy)
        op = run_attention(be, lens, pos, hq, hkv, d, dt)
        with k.counting() as counts:
            op(strategy)
        units = unit_totals(pm.attention_units(plan), plan.ctas)
        take(counts, lambda c: units if c.kernel == plan.kernel else None, f"{label} {lens}@{pos} d{d}")
    rng = np.random.default_rng(1)
    for bm in linear_ops.MMA_CONFIGS:   # one row tile: the 16-bit tiles over the f32 x (a prompt's copy x rounded once: below)
        for kk, split in ((256, False), (1024, False), (1024, True)):
            rows, n = bm, 256
            x = rng.standard_normal((rows, kk), np.float32)
            w = (rng.standard_normal((kk, n), np.float32) * 0.05).astype(pm.BF16)
            w8 = Fp8Matrix(rng.integers(0, 0x70, (kk, n)).astype(np.uint8), np.ones(scale_grid(kk, n), np.float32),
                           np.dtype(pm.BF16))   # FP8 weights: the stage written from registers
            for entry, label, plan_of, run in (
                    ("linear_mma", "linear", linear_ops.mma_plan, lambda: linear(be, x, w, bm=bm, split=split)),
                    ("linear_fp8", "linear_fp8", linear_ops.fp8_plan,
                     lambda: linear_ops.linear_fp8(be, x, w8, bm=bm, split=split))):
                if entry == "linear_fp8" and bm in linear_ops.FP8_STREAM and not split:
                    continue   # the FP8 decode shapes run split mode only
                p = plan_of(rows, kk, n, bm=bm, split=split)
                with k.counting() as counts:
                    run()
                iters = -(-min(p.kchunk, kk) // p.bk) if p.grid_splits > 1 else -(-kk // p.bk)
                units = {"cta": float(p.ctas), "iteration": float(p.ctas * iters)}
                take(counts, lambda c, e=entry, u=units: u if c.kernel.startswith(e) else None,
                     f"{label} m{bm} K={kk} {'split' if p.grid_splits > 1 else 'fold'}")
    rng_swiglu = np.random.default_rng(5)   # the down products' SwiGLU stage: the linear_mma probes' tiles over gate|up
    for bm in linear_ops.MMA_CONFIGS:
        for kk, split in ((256, False), (1024, False), (1024, True)):
            rows, n = bm, 256
            gate_up = rng_swiglu.standard_normal((rows, 2 * kk), np.float32)
            w = (rng_swiglu.standard_normal((kk, n), np.float32) * 0.05).astype(pm.BF16)
            w8 = Fp8Matrix(rng_swiglu.integers(0, 0x70, (kk, n)).astype(np.uint8),
                           np.ones(scale_grid(kk, n), np.float32), np.dtype(pm.BF16))
            for entry, plan_of, weights in (("linear_mma_bf16_swiglu", linear_ops.mma_plan, w),
                                            ("linear_fp8_bf16_swiglu", linear_ops.fp8_plan, w8)):
                fp8 = entry.startswith("linear_fp8")
                if fp8 and bm == 64:
                    continue   # FP8: no SwiGLU entry at 64 rows
                mode = split or fp8 and bm in linear_ops.FP8_STREAM   # the FP8 decode shapes run split mode only
                p = plan_of(rows, kk, n, bm=bm, split=mode)
                with k.counting() as counts:
                    swiglu_linear(be, gate_up, weights, bm=bm, split=mode)
                iters = -(-min(p.kchunk, kk) // p.bk) if p.grid_splits > 1 else -(-kk // p.bk)
                units = {"cta": float(p.ctas), "iteration": float(p.ctas * iters)}
                take(counts, lambda c, u=units, e=entry: u if c.kernel.startswith(e) else None,
                     f"{entry} m{bm} K={kk} {'split' if p.grid_splits > 1 else 'fold'}")
    rng_gated = np.random.default_rng(6)   # the output projection's gated stage: the same tiles over o and its gates
    for bm in linear_ops.MMA_CONFIGS:
        for kk, split in ((256, False), (1024, False), (1024, True)):
            rows, n, D = bm, 256, 128
            o = (rng_gated.standard_normal((rows, kk // D, D), np.float32)).astype(pm.BF16)
            qg = rng_gated.standard_normal((rows, 2 * kk), np.float32)
            w = (rng_gated.standard_normal((kk, n), np.float32) * 0.05).astype(pm.BF16)
            p = linear_ops.mma_plan(rows, kk, n, bm=bm, split=split)
            with k.counting() as counts:
                attn_gate_linear(be, o, w, (qg, D, 2 * D), bm=bm, split=split)
            iters = -(-min(p.kchunk, kk) // p.bk) if p.grid_splits > 1 else -(-kk // p.bk)
            units = {"cta": float(p.ctas), "iteration": float(p.ctas * iters)}
            take(counts, lambda c, u=units: u if c.kernel.startswith("linear_mma_bf16_gated") else None,
                 f"linear_mma_bf16_gated m{bm} K={kk} {'split' if p.grid_splits > 1 else 'fold'}")
    rng_wide = np.random.default_rng(4)   # prompts (two row tiles, one chunk): the 128-row tile and the wide one,
    for bm, wide in ((64, False), (128, False), (128, True)):   # over x rounded once (K on 8) and over the f32 x
        for kk in (256, 448, 252, 444):
            rows, n = 2 * bm, 512
            x = rng_wide.standard_normal((rows, kk), np.float32)
            w = (rng_wide.standard_normal((kk, n), np.float32) * 0.05).astype(pm.BF16)
            p = linear_ops.mma_plan(rows, kk, n, bm=bm, split=False, wide=wide)
            with k.counting() as counts:
                linear(be, x, w, bm=bm, split=False, wide=wide)
            units = {"cta": float(p.ctas), "iteration": float(p.ctas * -(-kk // p.bk))}
            take(counts, lambda c, u=units: u if c.kernel.startswith("linear_mma") else None,
                 f"linear {p.shape} K={kk} fold")
    rng_stream = np.random.default_rng(3)   # its own stream: the probes above see the same inputs as before
    for bm in linear_ops.FP8_STREAM:   # the FP8 decode shapes at two iterations per CTA (the loop above: four)
        rows, kk, n = bm, 128, 256
        x = rng_stream.standard_normal((rows, kk), np.float32)
        w8 = Fp8Matrix(rng_stream.integers(0, 0x70, (kk, n)).astype(np.uint8), np.ones(scale_grid(kk, n), np.float32),
                       np.dtype(pm.BF16))
        p = linear_ops.fp8_plan(rows, kk, n, bm=bm)
        with k.counting() as counts:
            linear_ops.linear_fp8(be, x, w8, bm=bm)
        units = {"cta": float(p.ctas), "iteration": float(p.ctas * -(-min(p.kchunk, kk) // p.bk))}
        take(counts, lambda c, u=units: u if c.kernel.startswith("linear_fp8") else None,
             f"linear_fp8 m{bm} K={kk} split")
    from dspark.ops import moe as moe_ops
    for rows, kk in ((8, 64), (8, 256), (8, 1024), (130, 64), (130, 256)):   # the grouped expert product
        E, top, n = 16, 4, 256
        plan = moe_ops.grouped_plan(rows, top, E, kk, n, 2)
        logits = rng.standard_normal((rows, E)).astype(np.float32)
        routing = moe_ops.route(be, logits, E, top, True, plan.tile_rows)
        g = moe_ops.group_ref(moe_ops.route_ref(logits, top, True)[0], E, plan.tile_rows)
        x = rng.standard_normal((rows, kk)).astype(np.float32)
        w = (rng.standard_normal((E, kk, n)) * 0.05).astype(pm.BF16)
        with k.counting() as counts:
            moe_ops.grouped_linear(be, x, w, routing, gather=True)
        ctas = plan.ctas(g)
        units = {"cta": float(len(ctas)), "iteration": float(pm.grouped_iterations(plan, ctas).sum())}
        take(counts, lambda c, u=units: u if c.kernel.startswith("moe_linear_mma") else None,
             f"moe grouped rows={rows} K={kk}")
    from dspark.ops.fp8 import Fp8Stack
    rng8 = np.random.default_rng(2)   # its own stream: the probes above see the same inputs as before
    for rows, kk in ((8, 128), (8, 256), (8, 1024), (130, 128), (130, 256)):   # the grouped product, FP8 experts
        E, top, n = 16, 4, 256
        plan = moe_ops.grouped_plan(rows, top, E, kk, n, 1)
        logits = rng8.standard_normal((rows, E)).astype(np.float32)
        routing = moe_ops.route(be, logits, E, top, True, plan.tile_rows)
        g = moe_ops.group_ref(moe_ops.route_ref(logits, top, True)[0], E, plan.tile_rows)
        x = rng8.standard_normal((rows, kk)).astype(np.float32)
        w8 = Fp8Stack(rng8.integers(0, 0x70, (E, kk, n)).astype(np.uint8),
                      np.ones((E, *scale_grid(kk, n)), np.float32), np.dtype(pm.BF16))
        with k.counting() as counts:
            moe_ops.grouped_linear(be, x, w8, routing, gather=True)
        ctas = plan.ctas(g)
        units = {"cta": float(len(ctas)), "iteration": float(pm.grouped_iterations(plan, ctas).sum())}
        take(counts, lambda c, u=units: u if c.kernel.startswith("moe_linear_fp8") else None,
             f"moe grouped fp8 rows={rows} K={kk}")
    import bench_kernels as bk
    for sizes in (PROBE_256, PROBE_128):
        for fam, benches in bk.FAMILIES.items():
            for bench in benches(be, sizes):
                if fam == "gdn_chunk":   # the chunk walk: per chunk; the rest per byte
                    with k.counting() as counts:
                        bench.op(be)
                    chunks = bench.shape["chunks"]
                    walk = -(-bench.shape["dv"] // chunk_ops.SLICE) * bench.shape["H"]

                    def units_of(c, chunks=chunks, walk=walk, nbytes=bench.nbytes):
                        if c.kernel.startswith("gdn_chunk_state"):
                            return {"cta": float(walk), "chunk": float(walk * chunks)}
                        return {"byte": float(nbytes) / 3}
                    take(counts, units_of, f"bench {fam} {bench.case} {bench.shape_text}")
                    continue
                with k.counting() as counts:
                    bench.op(be)
                share = float(bench.nbytes) / max(1, len(counts))
                take(counts, lambda c, share=share: None if c.kernel.startswith(PROBED) else {"byte": share},
                     f"bench {fam} {bench.case} {bench.shape_text}")
    for rows, kk, n in ((8, 256, 256), (16, 512, 256)):   # linear_f32 (f32 weights: the drafter's products)
        x, w = rng.standard_normal((rows, kk), np.float32), rng.standard_normal((kk, n), np.float32)
        plan = linear_ops.linear_plan(rows, kk, n, 4)
        with k.counting() as counts:
            linear(be, x, w)
        take(counts, lambda c, b=float(plan.bytes): {"byte": b}, f"linear_f32 {rows}x{kk}x{n}")
    return rows_out


# entries with probes of their own (their units are not bytes)
PROBED = ("attention_prompt", "attention_bf16", "attention_f16", "attention_f32", "linear_mma", "linear_fp8",
          "moe_linear_mma", "moe_linear_fp8")


def fit(rows: list[dict]) -> dict:
    """Per entry: least-squares coefficients per unit of its wavefronts, wavefronts without bank
    conflicts, cp.async and mma.sync (non-negative where the data allow), over its probes."""
    out = {}
    for entry in sorted({r["entry"] for r in rows}):
        rs = [r for r in rows if r["entry"] == entry]
        units = sorted({u for r in rs for u in r["units"]}, key=["cta", "tile", "merge", "mtile", "iteration", "chunk",
                                                                   "byte"].index)
        A = np.array([[r["units"].get(u, 0.0) for u in units] for r in rs])
        while len(units) > 1 and np.linalg.matrix_rank(A) < len(units):   # units the probes do not tell apart
            units, A = units[:-1], A[:, :-1]

        def solve(y):
            coef = np.linalg.lstsq(A, np.asarray(y, np.float64), rcond=None)[0]
            return [float(max(c, 0.0)) for c in coef]
        wf = [sum(r[kind][1] for kind in KINDS) for r in rs]
        ideal = [sum(r[kind][2] for kind in KINDS) for r in rs]
        out[entry] = {"units": units, "wavefronts": solve(wf), "ideal": solve(ideal),
                      "cp_async": solve([r["cp_async"][0] for r in rs]), "mma": solve([r["mma"] for r in rs]),
                      "probes": [r["probe"] for r in rs],
                      "counted": {kind: [int(sum(r[kind][i] for r in rs)) for i in range(3)] for kind in KINDS}}
    return out


def _probe_sizes():
    import bench_kernels as bk
    common = dict(batches=(1,), contexts=(100,), reduce_batches=(1,), plain_batches=(1,), prompt_rows=130, dk=128,
                  dv=128, gdn_heads=2, gdn_k_heads=1, gdn_layers=2, attn_layers=1, hkv=1, gqa=6)
    return (dataclasses.replace(bk.CPU, label="probe D=256", head_dim=256, **common),
            dataclasses.replace(bk.CPU, label="probe D=128", head_dim=128, **{**common, "prompt_rows": 300}))


def main(argv=None) -> int:
    if os.environ.get("DSPARK_WAVEFRONTS_CHILD"):
        global PROBE_256, PROBE_128
        PROBE_256, PROBE_128 = _probe_sizes()
        print(json.dumps(child()))
        return 0
    from dspark.backends.simt_build import counting_env
    from pricing import sources_digest
    env = counting_env()
    env["DSPARK_WAVEFRONTS_CHILD"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True)
    if r.returncode:
        print(r.stderr[-6000:], file=sys.stderr)
        return 1
    rows = json.loads(r.stdout.splitlines()[-1])
    table = {"command": "python profiling/wavefronts.py", "date": datetime.date.today().isoformat(),
             "sources": sources_digest(), "entries": fit(rows)}
    OUT.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{OUT.name}: {len(table['entries'])} entries from {len(rows)} launches")
    for e, v in table["entries"].items():
        print(f"  {e}: " + ", ".join(f"{w:.4g}/{u}" for u, w in zip(v["units"], v["wavefronts"]))
              + f" (without conflicts: " + ", ".join(f"{w:.4g}" for w in v["ideal"]) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
