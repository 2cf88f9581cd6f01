"""Kernel benchmarks: every csrc/ kernel family at sizes named after real models.

    python profiling/bench_kernels.py              # cuda when a GPU works, else the CPU sizes
    python profiling/bench_kernels.py --cpu        # tiny sizes through the simt backend (< 20 s)
    python profiling/bench_kernels.py --dry-run    # imports, one entry per family, the plan; times nothing
    python profiling/bench_kernels.py --family attention gdn_scan
    python profiling/bench_kernels.py --plans      # the reductions' launch plans at the GPU sizes

GPU sizes: Qwen3.5-27B's (profiling/perf_model.py SHAPES): 16 attention layers with 4 KV heads of
dim 256 and GQA 6 (24 query heads), bf16 KV; 48 gdn layers with 48 value heads on 16 key heads,
dk = dv = 128; d_model 5120 (the norms) and MLP 17408 (the GEMMs, bf16 weights); the vocabulary 248320; contexts 4k and 32k; verify width
vt = 8 (7 drafts); batches of 1, 2 and 32 sessions; plain batched decode's GEMMs at 1, 8 and 32 rows;
a prompt pass of 8192 rows (the GEMMs, prompt attention, the chunked gdn). The vocabulary reductions split each row
across ceil(V / 8192) CTAs, and the shape column names the split (S), the launches and the passes
over each row, from the op's own launch plan (dspark.ops.argmax / dspark.ops.sampling `*_plan`).

Measured beside the model: every row also gives the H200 floor and expected time
profiling/perf_model.py prices that call at from the same plan (no timing in the model; the floor
is the largest single limiter, docs/performance.md), measured / expected, and "MODEL ERROR" where
the measurement refutes the model: faster than the floor, or outside +-25 % of the expected time
(`model_error`; profiling/gpu_check.py fails the bench step on it). `--json FILE` writes the rows
for profiling/plots.py. On the CPU sizes the model is still the H200's: the ratio there says
nothing.

Per call: the bytes the kernel must move at least and the flops it must do, counted from the
shapes (each family's formulas are written out below, or the plan's `min_bytes`), the time of the kernel alone
(profiling/timing.py), achieved GB/s and GFLOP/s, and the fraction of the roofline: the longer of
bytes / copy bandwidth and flops / f32 GEMM rate, both measured in this run (every kernel does its
math in f32 on CUDA cores). Then ratios of rows of this same run: verify vs decode, the fused
accept vs a plain argmax, sampling vs greedy.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import re
import sys
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts, also when run by `dspark bench`
import dspark
from bench_attention import make_inputs as attention_inputs
from bench_attention import storage_dtype
from dspark.backends import cuda_available
from dspark.dtypes import BF16
from dspark.kernel_sources import kernel_files, scan
from dspark.ops.argmax import argmax_rows, greedy_accept, greedy_accept_plan, markov_chain, markov_chain_plan
from dspark.ops.argmax import argmax_plan
from dspark.ops.activation import attn_gate, sigmoid_bias, swiglu
from dspark.ops.gdn import channels, gdn_layer
from dspark.ops.heads import confidence_features, gather_rows, logit_scale, markov_logits
from dspark.ops.kv_commit import kv_commit
from dspark.ops.linear import linear, linear_plan
from dspark.ops.coupled import coupled_accept, coupled_accept_plan
from dspark.ops.sampling import (Filters, Streams, accept_plan, filtered_probs, sample_filtered, sample_plan,
                                 speculative_accept)
from dspark.ops.norm import add_rmsnorm, embed_rmsnorm, rmsnorm
from dspark.ops.rope import Heads, Rotary, qk_prepare
from dspark.ops.snapshot import checkpoint_select_layers, snapshot_save
from dspark.ops.swiglu_linear import swiglu_linear
from dspark.ops.gate_linear import attn_gate_linear
from dspark.philox import Tag
from dspark.ops.attention import launch_plan
import perf_model as pm
from timing import clock_for, device_rng, gpu_module, measure_ceilings, record, replay, seconds, table

F32 = 4  # bytes of a float32 / int32


@dataclasses.dataclass(frozen=True)
class Sizes:
    label: str
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    vt: int                 # verify width: the anchor + vt - 1 drafts
    hkv: int
    gqa: int
    head_dim: int
    kv_dtype: np.dtype
    vocab: int
    attn_layers: int
    gdn_layers: int
    gdn_heads: int
    dk: int
    dv: int
    markov_rank: int
    reduce_batches: tuple[int, ...]  # sessions for the vocabulary reductions
    gdn_k_heads: int = 0             # key heads (0: one per value head)
    d_model: int = 5120
    mlp_hidden: int = 17408
    prompt_rows: int = 8192          # rows of a prompt pass (the GEMMs, prompt attention, the chunked gdn)
    plain_batches: tuple[int, ...] = (1, 8, 32)  # plain batched decode's rows for the GEMMs
    # the MoE family at Qwen3.5-35B-A3B's layer: 256 experts, top-8, d_model 2048, experts 512 wide
    experts: int = 256
    expert_top_k: int = 8
    moe_d_model: int = 2048
    expert_hidden: int = 512

    @property
    def drafts(self) -> int:
        return self.vt - 1


GPU = Sizes("Qwen3.5-27B: 16 attention layers (Hkv=4, Hq=24, D=256, bf16 KV), 48 gdn layers (48 value heads on "
            "16 key heads, dk=dv=128), d_model 5120, V=248320", batches=(1, 2, 32), contexts=(4096, 32768), vt=8,
            hkv=4, gqa=6, head_dim=256, kv_dtype=BF16, vocab=248320, attn_layers=16, gdn_layers=48, gdn_heads=48,
            dk=128, dv=128, markov_rank=32, reduce_batches=(1, 2, 32), gdn_k_heads=16, d_model=5120,
            mlp_hidden=17408)
CPU = Sizes("tiny (simt, CPU): 2 attention layers (Hkv=2, Hq=8, D=64, bf16 KV), 3 gdn layers (H=2, dk=dv=16), "
            "V=1000", batches=(1, 3), contexts=(100,), vt=8, hkv=2, gqa=4, head_dim=64, kv_dtype=BF16, vocab=1000,
            attn_layers=2, gdn_layers=3, gdn_heads=2, dk=16, dv=16, markov_rank=8, reduce_batches=(1, 3), d_model=64,
            mlp_hidden=96, prompt_rows=130, plain_batches=(1, 3), experts=16, expert_top_k=4, moe_d_model=64,
            expert_hidden=32)


@dataclasses.dataclass
class Bench:
    """One op call on inputs made for it: what it must move and compute, and how to run it."""
    family: str
    case: str
    shape: dict
    nbytes: int
    flops: int
    kernels: tuple[str, ...]      # the entry points the op launches
    op: Callable[[object], None]  # op(backend)
    model: object = None          # the kernel(s) profiling/perf_model.py prices this call as (H200)

    @property
    def kernels_priced(self) -> list:
        return [] if self.model is None else list(self.model) if isinstance(self.model, (list, tuple)) else [self.model]

    @property
    def floor(self) -> float:
        """The model's floor for the call: its kernels' floors added (each its largest limiter)."""
        ks = self.kernels_priced
        return sum(k.floor for k in ks) if ks else float("nan")

    @property
    def predicted(self) -> float:
        """The model's expected H200 time for the call."""
        ks = self.kernels_priced
        return sum(k.time for k in ks) if ks else float("nan")

    @property
    def shape_text(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.shape.items())


# ---- inputs on the backend ------------------------------------------------------------------------
_RNG = np.random.default_rng(0)


def randn(be, shape, dtype=np.float32, scale=1.0):
    """Standard normal * scale, generated where the arrays live."""
    rng = device_rng(be)
    x = _RNG.standard_normal(shape, np.float32) if rng is None else rng.standard_normal(shape, dtype=np.float32)
    x = x if rng is not None or be.xp is np else be.asarray(x)
    return (x * np.float32(scale)).astype(dtype)


def uniform(be, shape):
    rng = device_rng(be)
    if rng is not None:
        return rng.random(shape, dtype=np.float32)
    return be.asarray(_RNG.random(shape, np.float32))


def indptr(counts) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)


# ---- argmax: argmax_rows, greedy_accept, markov_chain ------------------------------------------------
def plan_shape(plan, **shape) -> dict:
    """The shape keys of a reduction: its own, then the split, launches and passes of its plan."""
    return {**shape, "S": plan.splits, "launches": len(plan.launches), "passes": round(plan.passes, 2)}


def argmax_benches(be, s: Sizes) -> Iterator[Bench]:
    """Bytes: the plan's min_bytes, what the op must move at least (logit rows once, the small
    inputs and outputs); its partials and re-reads are on top (plan.bytes)."""
    V, vt, nd, r = s.vocab, s.vt, s.drafts, s.markov_rank
    for B in s.reduce_batches:
        # Decode: one f32 logits row per session; read once, write index and NaN flag.
        logits = randn(be, (B, V))
        out = be.xp.empty(B, np.int32)
        plan = argmax_plan(B, V, F32)
        yield Bench("argmax", "argmax_rows", plan_shape(plan, B=B, V=V), plan.min_bytes, 0, ("argmax_rows_f32",),
                    lambda b, x=logits, o=out: argmax_rows(b, x, out=o), predict(plan))

        # Verify: every draft accepted (the worst case: all vt columns of each session are read).
        cols = B * vt
        logits = randn(be, (cols, V))
        best = be.to_host(logits.argmax(axis=1)).astype(np.int32)
        ptr = indptr([vt] * B)
        cand = np.roll(best, 1)  # cand[c0 + j + 1] = argmax of column c0 + j: a full accept
        cand[ptr[:-1]] = 0
        cand, dptr = be.asarray(cand), be.asarray(ptr)
        m, nxt = be.xp.empty(B, np.int32), be.xp.empty(B, np.int32)
        plan = greedy_accept_plan(B, cols, V, F32)
        yield Bench("argmax", "greedy_accept", plan_shape(plan, B=B, vt=vt), plan.min_bytes, 0,
                    ("greedy_accept_f32",),
                    lambda b, x=logits, c=cand, p=dptr, m=m, n=nxt: greedy_accept(b, x, c, p, m_out=m, next_out=n),
                    predict(plan))

        # Markov chain over nd slots: slot k adds w2^T w1[x_{k-1}] (r multiply-adds per entry); the
        # slots are serial, each reads all of w2 (min_bytes counts it once: L2 holds it).
        logits = randn(be, (B * nd, V))
        w1, w2 = randn(be, (V, r), scale=0.1), randn(be, (r, V), scale=0.1)
        anchors = _RNG.integers(0, V, B).astype(np.int32)
        drafts = be.xp.empty((B, nd), np.int32)
        plan = markov_chain_plan(B, nd, V, r, F32)
        yield Bench("argmax", "markov_chain", plan_shape(plan, B=B, slots=nd, r=r), plan.min_bytes,
                    plan.notes["flops"], ("markov_chain_f32",),
                    lambda b, x=logits, w1=w1, w2=w2, a=anchors, o=drafts: markov_chain(b, x, w1, w2, a, nd, out=o),
                    predict(plan))


# ---- attention: decode (1 row) and verify (vt rows) per session ----------------------------------------
def attention_benches(be, s: Sizes) -> Iterator[Bench]:
    """Bytes and flops as profiling/bench_attention.py counts them: each session's committed K and V
    read once per kv head, the block's K/V, q and out; 4 D flops per (row, query head, visible key)."""
    for B in s.batches:
        for ctx in s.contexts:
            for case, vt in (("decode", 1), ("verify", s.vt)):
                x = attention_inputs(be, B, ctx, vt, s.hkv, s.gqa, s.head_dim, s.kv_dtype)
                plan = launch_plan([vt] * B, [ctx] * B, hq=s.hkv * s.gqa, hkv=s.hkv, head_dim=s.head_dim,
                                   dtype=s.kv_dtype)
                names = (plan.kernel,) + ((plan.combine_kernel,) if plan.combine_kernel else ())
                yield Bench("attention", case, {"B": B, "ctx": ctx, "vt": vt, "CTAs": plan.ctas}, x.bytes, x.flops,
                            names, x.op, list(pm.attention_kernels("bench", plan, pm.H200)))
    # A prompt pass of one session from position 0: the prompt kernel (16-bit K/V)
    rows, hq = s.prompt_rows, s.hkv * s.gqa
    x = attention_inputs(be, 1, 0, rows, s.hkv, s.gqa, s.head_dim, s.kv_dtype)
    plan = launch_plan([rows], [0], hq=hq, hkv=s.hkv, head_dim=s.head_dim, dtype=s.kv_dtype)
    yield Bench("attention", "prompt", {"B": 1, "ctx": 0, "vt": rows, "CTAs": plan.ctas}, x.bytes, x.flops,
                (plan.kernel,), x.op, pm.prompt_attention("bench", hq, s.hkv, s.head_dim, 0, rows, pm.H200))


# ---- kv_commit: the accepted rows of every attention layer, one launch ----------------------------------
def kv_commit_benches(be, s: Sizes) -> Iterator[Bench]:
    L, pos0, keep = s.attn_layers, s.contexts[0], s.vt  # a full accept commits all vt rows
    isz = np.dtype(s.kv_dtype).itemsize
    for B in s.batches:
        rows = B * s.vt
        blk = [[randn(be, (rows, s.hkv, s.head_dim), s.kv_dtype) for _ in range(L)] for _ in "kv"]
        caches = [[[be.xp.zeros((s.hkv, pos0 + s.vt, s.head_dim), s.kv_dtype) for _ in range(B)] for _ in range(L)]
                  for _ in "kv"]
        pos, keeps, ptr = np.full(B, pos0, np.int32), np.full(B, keep, np.int32), indptr([s.vt] * B)
        # read from the scratch and written to the cache: K and V, every layer, keep rows per session
        nbytes = 2 * 2 * L * B * keep * s.hkv * s.head_dim * isz
        yield Bench("kv_commit", "commit", {"B": B, "layers": L, "keep": keep}, nbytes, 0, ("kv_commit_rows",),
                    lambda b, k=blk[0], v=blk[1], kc=caches[0], vc=caches[1], p=pos, n=keeps, i=ptr:
                    kv_commit(b, k, v, kc, vc, p, n, i),
                    pm.commit_kernel("bench", "kv_commit", B, L, keep, s.hkv * s.head_dim * isz, pm.H200))


# ---- gdn_scan: decode (t = 1) and verify (t = vt, per-column checkpoints), one layer ----------------------
def gdn_scan_benches(be, s: Sizes) -> Iterator[Bench]:
    """One gdn layer's fused launch (conv, scan, gated output norm) over a decode step's or a
    verify's columns, reading them from the layer's input projection [mixed | z | a | b]."""
    H, dk, dv, kh = s.gdn_heads, s.dk, s.dv, s.gdn_k_heads or None
    C = channels(H, dk, dv, kh)
    state, window = H * dv * dk, 3 * C  # floats per session
    conv_w, A_log = randn(be, (C, 4), scale=0.5), be.asarray(np.log(_RNG.uniform(1, 16, H)).astype(np.float32))
    dt_bias = be.asarray(np.full(H, -4.0, np.float32))  # softplus(a - 4): decays near 1, as trained models
    o_norm = randn(be, (dv,))
    width = C + H * dv + 2 * H
    for B in s.batches:
        for case, t, ckpt in (("decode", 1, False), ("verify", s.vt, True)):
            cols = B * t
            proj = randn(be, (cols, width))
            states = [randn(be, (H, dv, dk), scale=0.3) for _ in range(B)]
            windows = [randn(be, (C, 3)) for _ in range(B)]
            out = be.xp.empty((cols, H, dv), np.float32)
            sck = be.xp.empty((cols, H, dv, dk), np.float32) if ckpt else None
            cck = be.xp.empty((cols, C, 3), np.float32) if ckpt else None
            ptr = be.asarray(indptr([t] * B))
            nbytes = F32 * (cols * width                   # mixed, z, a, b
                            + 4 * C + 2 * H + dv           # conv weight, A_log, dt_bias, o_norm
                            + 2 * B * (state + window)     # state and conv window, read and written
                            + cols * H * dv                # out
                            + (cols * (state + window) if ckpt else 0))  # checkpoints after every column
            # per column: 7 dv dk per head (decay S 1, u = S k 2, S += (beta (v - u)) k^T 2,
            # o = S q 2), the width-4 causal conv, 8 per channel, the gated norm, 6 per output
            flops = cols * (H * 7 * dv * dk + 8 * C + 6 * H * dv)
            predicted = pm.gdn_kernels("bench", H, dk, dv, kh, B, cols, pm.H200, checkpoints=ckpt, commit=True)
            yield Bench("gdn_scan", case, {"B": B, "t": t, "H": H, "dk": dk, "dv": dv}, nbytes, flops,
                        (f"gdn_scan_dk{dk}_f32",),
                        lambda b, x=proj, st=states, w=windows, p=ptr, o=out, sc=sck, cc=cck:
                        gdn_layer(b, x, conv_w, A_log, dt_bias, st, w, p, heads=H, dk=dk, dv=dv, k_heads=kh,
                                  o_norm=o_norm, out=o, state_ckpt=sc, conv_ckpt=cc), predicted)


# ---- snapshot: save every recurrent tensor; checkpoint select of one layer -------------------------------
def snapshot_benches(be, s: Sizes) -> Iterator[Bench]:
    H, dk, dv, G = s.gdn_heads, s.dk, s.dv, s.gdn_layers
    C = channels(H, dk, dv, s.gdn_k_heads or None)
    state, window = H * dv * dk, 3 * C
    xp = be.xp
    for B in s.batches:
        live = [xp.zeros(shape, np.float32) for _ in range(B * G) for shape in ((H, dv, dk), (C, 3))]
        snap = [xp.empty_like(a) for a in live]
        # every state and conv window of every gdn layer and session, read and written once
        yield Bench("snapshot", "snapshot_save", {"B": B, "layers": G}, 2 * B * G * (state + window) * F32, 0,
                    ("snapshot_copy_f32",), lambda b, src=live, dst=snap: snapshot_save(b, src, dst),
                    pm.copy_kernel("bench", [state, window] * (B * G), pm.H200))
        del live, snap

        cols, keep = B * s.vt, s.vt // 2  # a partial accept
        sck = [xp.zeros((cols, H, dv, dk), np.float32) for _ in range(G)]
        cck = [xp.zeros((cols, C, 3), np.float32) for _ in range(G)]
        states = [xp.empty((H, dv, dk), np.float32) for _ in range(G * B)]
        windows = [xp.empty((C, 3), np.float32) for _ in range(G * B)]
        ptr, keeps = be.asarray(indptr([s.vt] * B)), be.asarray(np.full(B, keep, np.int32))
        # every gdn layer in one launch: the kept column's checkpoint read, the live state written
        yield Bench("snapshot", "checkpoint_select", {"B": B, "layers": G, "vt": s.vt, "keep": keep},
                    2 * G * B * (state + window) * F32, 0, ("checkpoint_select_layers_f32",),
                    lambda b, a=sck, c=cck, st=states, w=windows, p=ptr, k=keeps:
                    checkpoint_select_layers(b, a, c, st, w, p, k),
                    pm.select_kernel("bench", B, state, window, pm.H200, G))


# ---- sampling: filtered draws and the speculative accept -------------------------------------------------
SAMPLE_FILTERS = (("sample T=1", dict(temperature=1.0)),
                  ("sample top-k/p", dict(temperature=0.7, top_k=50, top_p=0.9)))


def sampling_benches(be, s: Sizes) -> Iterator[Bench]:
    """Bytes: the plan's min_bytes (the row once, settings, stream words, outputs); each phase of a
    split row reads the row again (passes)."""
    V, nd = s.vocab, s.drafts
    for B in s.reduce_batches:
        logits = randn(be, (B, V), scale=3.0)
        streams = Streams.full(B, seed=_RNG.integers(0, 2**63, B, dtype=np.uint64), counter=7, tag=Tag.PICK)
        streams = Streams(*(be.asarray(a) for a in (streams.seed, streams.counter, streams.stream)))
        token, prob = be.xp.empty(B, np.int32), be.xp.empty(B, np.float32)
        for case, settings in SAMPLE_FILTERS:
            f = Filters.full(B, **settings)
            plan = sample_plan(B, V, F32, top_k="top_k" in settings, top_p="top_p" in settings)
            f = Filters(*(be.asarray(a) for a in (f.temperature, f.top_k, f.top_p, f.min_p)))
            yield Bench("sampling", case, plan_shape(plan, B=B, V=V), plan.min_bytes, 0, ("sample_filtered_f32",),
                        lambda b, x=logits, f=f, s=streams, t=token, p=prob:
                        sample_filtered(b, x, f, s, "gumbel", t, p), predict(plan))

        # nd drafts per session against filtered distributions q (drafter) and p (target).
        q, p = uniform(be, (B * nd, V)), uniform(be, (B * (nd + 1), V))
        q /= q.sum(axis=1, keepdims=True)
        p /= p.sum(axis=1, keepdims=True)
        drafts = be.asarray(_RNG.integers(0, V, B * nd).astype(np.int32))
        dptr = be.asarray(indptr([nd] * B))
        seed, counter = be.asarray(np.arange(B, dtype=np.uint64)), be.asarray(np.full(B, 3, np.uint64))
        outs = [be.xp.empty(B, np.int32) for _ in range(3)]
        # per session: q(d_j) and p(d_j) and the draft for each test, then one target row and one
        # drafter row for the residual draw (a bonus reads only the target row)
        plan = accept_plan(B, nd, V)
        yield Bench("sampling", "spec_accept", plan_shape(plan, B=B, drafts=nd, V=V), plan.min_bytes, 0,
                    ("spec_accept_f32",),
                    lambda b, d=drafts, i=dptr, q=q, p=p, s=seed, c=counter, o=outs:
                    speculative_accept(b, d, i, q, p, s, c, *o), predict(plan))

        # A round's accept of one verify block from its logits (T = 1), by either sampler. Rejection:
        # the target's filtered rows p (written), then spec_accept; coupled: every column's
        # Gumbel-max pick with its position's noise, then the walk against the candidates.
        cols, vt = B * (nd + 1), nd + 1
        x = randn(be, (cols, V), scale=3.0)
        cand = _RNG.integers(0, V, cols).astype(np.int32)
        cptr = indptr([vt] * B)
        f = Filters.full(cols, temperature=1.0)
        f_dev = Filters(*(be.asarray(a) for a in (f.temperature, f.top_k, f.top_p, f.min_p)))
        p_rows = be.xp.empty((cols, V), np.float32)
        probs, acc = sample_plan(cols, V, F32, method=None, dist=True), accept_plan(B, nd, V)
        yield Bench("sampling", "rejection accept", {"B": B, "vt": vt, "V": V, "launches": len(probs.launches) + 1},
                    probs.min_bytes + acc.min_bytes, 0, ("sample_filtered_f32", "spec_accept_f32"),
                    lambda b, x=x, f=f_dev, pr=p_rows, d=drafts, i=dptr, q=q, s=seed, c=counter, o=outs: (
                        filtered_probs(b, x, f, out=pr), speculative_accept(b, d, i, q, pr, s, c, *o)),
                    [predict(probs), predict(acc)])
        picks = Streams.full(cols, np.repeat(np.arange(B, dtype=np.uint64), vt), np.tile(np.arange(vt) + 100, B),
                             Tag.PICK)
        plan = coupled_accept_plan(B, cols, V, F32)
        yield Bench("sampling", "coupled accept", plan_shape(plan, B=B, vt=vt, V=V), plan.min_bytes, 0,
                    ("sample_filtered_f32", "pick_accept"),
                    lambda b, x=x, c=cand, i=cptr, f=f, s=picks, o=outs: coupled_accept(b, x, c, i, f, s, *o[:2]),
                    predict(plan))


# ---- norm: the verify's RMSNorms over d_model -----------------------------------------------------------
def norm_benches(be, s: Sizes) -> Iterator[Bench]:
    """The norms over a verify's rows (B * vt) of d_model, the weight once: rmsnorm_f32 (a row read
    and written), add_rmsnorm_f32 (the layer boundary: x and the sublayer's output read, x and the
    norm written) and embed_rmsnorm_bf16 (a bf16 embedding row read, x and the norm written)."""
    d = s.d_model
    w = randn(be, (d,))
    table = randn(be, (1024, d), BF16)
    for B in s.batches:
        rows = B * s.vt
        x, y, out = randn(be, (rows, d)), randn(be, (rows, d)), be.xp.empty((rows, d), np.float32)
        ids = np.arange(rows, dtype=np.int32) * 7 % 1024
        for case, entry, reads, run in (
                ("rmsnorm", "rmsnorm_f32", 1, lambda b, x=x, o=out: rmsnorm(b, x, w, 1e-6, out=o)),
                ("residual + norm", "add_rmsnorm_f32", 2, lambda b, x=x, y=y, o=out: add_rmsnorm(b, x, y, w, 1e-6, out=o)),
                ("embedding + norm", "embed_rmsnorm_bf16", 0.5,
                 lambda b, x=x, i=ids, o=out: embed_rmsnorm(b, table, i, w, 1e-6, x=x, out=o))):
            writes = 1 if case == "rmsnorm" else 2
            yield Bench("norm", case, {"B": B, "rows": rows, "n": d}, int(F32 * ((reads + writes) * rows * d + d)),
                        3 * rows * d, (entry,), run,
                        pm.rmsnorm_kernel("bench", case, rows, d, pm.H200) if case == "rmsnorm" else
                        pm.row_norm("bench", case, entry, rows, d, pm.H200, reads=reads, writes=writes))


# ---- the layers' gates: SwiGLU, the attention output gate, the confidence sigmoid -----------------------------
def activation_benches(be, s: Sizes) -> Iterator[Bench]:
    """Over a verify's rows: SwiGLU of the MLP (gate and up read, the product written), the
    attention output widened from bf16 and gated (Qwen3.5), and the confidence head's sigmoid."""
    F, D, hq = s.mlp_hidden, s.head_dim, s.hkv * s.gqa
    for B in s.batches:
        rows = B * s.vt
        gate_up, act = randn(be, (rows, 2 * F)), be.xp.empty((rows, F), np.float32)
        yield Bench("activation", "swiglu", {"B": B, "rows": rows, "F": F}, F32 * 3 * rows * F, 5 * rows * F,
                    ("swiglu_f32",), lambda b, g=gate_up, o=act: swiglu(b, g, out=o),
                    pm.swiglu_kernel("bench", rows, F, pm.H200))
        o, qg = randn(be, (rows, hq, D), BF16), randn(be, (rows, hq * 2 * D))
        out = be.xp.empty((rows, hq * D), np.float32)
        yield Bench("activation", "attention output gate", {"B": B, "rows": rows, "heads": hq, "D": D},
                    rows * hq * D * (2 + 2 * F32), 4 * rows * hq * D, ("attn_gate_bf16",),
                    lambda b, o=o, g=qg, out=out: attn_gate(b, o, (g, D, 2 * D), out=out),
                    pm.attn_gate_kernel("bench", rows, hq * D, 2, True, pm.H200))
        n = B * s.drafts
        x, bias, c = randn(be, (n,)), randn(be, (1,)), be.xp.empty(n, np.float32)
        yield Bench("activation", "confidence sigmoid", {"B": B, "n": n}, F32 * 2 * n, 4 * n, ("sigmoid_bias_f32",),
                    lambda b, x=x, c=c: sigmoid_bias(b, x, bias, out=c),
                    pm.elementwise("bench", "sigmoid", "sigmoid_bias_f32", n, F32 * 2 * n, 4 * n, pm.H200))


# ---- rope: an attention layer's q, k, v made ready (norms, RoPE, the K/V dtype) -----------------------------
def rope_benches(be, s: Sizes) -> Iterator[Bench]:
    """qk_prepare over a verify's rows of Qwen3.5's attention projection: [q and gate | k | v] read,
    q and k normed and rotated over a quarter of each head, q, k, v written in bf16."""
    D, hkv, hq = s.head_dim, s.hkv, s.hkv * s.gqa
    heads = Heads.packed(hq, hkv, D, gated=True)
    rotary = Rotary.of(D // 4, 1e7)
    qn, kn = randn(be, (D,)), randn(be, (D,))
    for B in s.batches:
        rows = B * s.vt
        src = randn(be, (rows, heads.width))
        q, k, v = (be.xp.empty((rows, n, D), BF16) for n in (hq, hkv, hkv))
        pos, ptr = np.full(B, 4096, np.int32), indptr([s.vt] * B)
        k_out = pm.qk_prepare_kernel("bench", rows, hq, hkv, D, heads.width, rotary.rot, 2, pm.H200, q_norm=True,
                                     k_norm=True)
        yield Bench("rope", "q/k norm + rope", {"B": B, "rows": rows, "hq": hq, "hkv": hkv, "D": D}, k_out.bytes,
                    k_out.flops, ("qk_prepare_bf16",),
                    lambda b, x=src, q=q, k=k, v=v, p=pos, r=ptr: qk_prepare(b, x, heads, rotary, p, r, q_norm=qn,
                                                                            k_norm=kn, q=q, k=k, v=v, dtype=BF16),
                    k_out)


# ---- heads: the drafter's glue before its Markov chain and confidence head -----------------------------------
def heads_benches(be, s: Sizes) -> Iterator[Bench]:
    """The drafter's draft rows of a mask-fill block (gathered before its LM head), the
    confidence features [h ; W1[x]], one slot's chain logits of a sampled proposal and the logits'
    soft cap, over B * nd slots."""
    d, r, nd, V = s.d_model, s.markov_rank, s.drafts, s.vocab
    w1 = randn(be, (V, r))
    for B in s.batches:
        n = B * nd
        h, rows = randn(be, (B * s.vt, d)), (np.arange(n, dtype=np.int32) // nd) * s.vt + np.arange(n) % nd + 1
        rows = rows.astype(np.int32) % (B * s.vt)
        out = be.xp.empty((n, d), np.float32)
        yield Bench("heads", "draft rows", {"B": B, "rows": n, "d": d}, F32 * 2 * n * d, 0, ("gather_rows_f32",),
                    lambda b, h=h, r=rows, o=out: gather_rows(b, h, r, out=o),
                    pm.elementwise("bench", "gather", "gather_rows_f32", n * d, F32 * 2 * n * d, 0, pm.H200))
        hid, drafts = randn(be, (n, d)), be.asarray(np.arange(n, dtype=np.int32).reshape(B, nd) % V)
        anchors, feats = np.zeros(B, np.int32), be.xp.empty((n, d + r), np.float32)
        yield Bench("heads", "confidence features", {"B": B, "rows": n, "d": d, "r": r}, F32 * 2 * n * (d + r), 0,
                    ("confidence_features_f32",),
                    lambda b, h=hid, a=anchors, x=drafts, o=feats: confidence_features(b, h, w1, a, x, out=o),
                    pm.elementwise("bench", "features", "confidence_features_f32", n * (d + r), F32 * 2 * n * (d + r), 0,
                                   pm.H200))
        w2, slot_logits, picks = randn(be, (r, V)), randn(be, (n, V)), be.asarray(np.arange(B, dtype=np.int32) % V)
        row, drafts_out = be.xp.empty((B, V), np.float32), be.xp.empty((B, nd), np.int32)
        bias_bytes = F32 * (2 * B * V + r * V)   # a slot's rows in, its chain logits out, w2 once (from L2 after)
        yield Bench("heads", "sampled chain slot logits", {"B": B, "V": V, "r": r}, bias_bytes, 2 * B * r * V,
                    ("markov_logits_f32",),
                    lambda b, x=slot_logits, w=w2, a=anchors, p=picks, o=row, dr=drafts_out:
                    markov_logits(b, x, w1, w, a, p, 1, nd, dr, out=o),
                    pm.elementwise("bench", "slot logits", "markov_logits_f32", B * V, bias_bytes, 2 * B * r * V,
                                   pm.H200))
        logits = randn(be, (n, V))
        yield Bench("heads", "logit scale + cap", {"B": B, "rows": n, "V": V}, F32 * 2 * n * V, 3 * n * V,
                    ("logit_scale_f32",), lambda b, x=logits: logit_scale(b, x, 0.5, 30.0, out=x),
                    pm.elementwise("bench", "scale", "logit_scale_f32", n * V, F32 * 2 * n * V, 3 * n * V, pm.H200))


# ---- linear: the MLP's GEMMs, bf16 weights as stored ---------------------------------------------------
def linear_benches(be, s: Sizes) -> Iterator[Bench]:
    """The tensor-core GEMM (linear_mma_bf16_<shape>, the tile shape its plan picks) for the MLP's two
    projections (gate|up fused, down) over plain batched decode's rows (B), a verify's (B * vt) and
    a prompt pass's: bytes from the plan's min_bytes (the weights once, x, out), 2 rows K N flops;
    predicted time and occupancy as perf_model.linear prices them."""
    yield from gemm_benches(be, s, "linear", "linear_mma", 2,
                            lambda k, n: randn(be, (k, n), BF16, scale=float(1 / np.sqrt(k))))
    yield from swiglu_linear_benches(be, s)
    yield from gate_linear_benches(be, s)


def gemm_benches(be, s: Sizes, family: str, entry: str, wb: int, weights) -> Iterator[Bench]:
    """linear_benches' cases for weights of wb bytes an element made by `weights(K, N)`, launched
    as `entry`_bf16_m<BM>."""
    d, f = s.d_model, s.mlp_hidden
    for proj, k, n in (("gate|up", d, 2 * f), ("down", f, d)):
        w = weights(k, n)
        cases = [("decode", B, B) for B in s.plain_batches] + [("verify", B, B * s.vt) for B in s.batches]
        for case, B, rows in cases + [("prompt", 1, s.prompt_rows)]:
            x, out = randn(be, (rows, k)), be.xp.empty((rows, n), np.float32)
            plan = linear_plan(rows, k, n, wb)
            model = pm.linear("bench", proj, rows, k, n, wb, pm.H200)   # a 16-bit prompt: the rounding and the GEMM
            yield Bench(family, case, {"proj": proj, "B": B, "rows": rows, "K": k, "N": n, "S": plan.splits},
                        plan.min_bytes, 2 * rows * k * n, tuple(sorted(m.entry for m in model)),
                        lambda b, x=x, w=w, o=out: linear(b, x, w, out=o), model)


def swiglu_linear_benches(be, s: Sizes) -> Iterator[Bench]:
    """The MLP's down product over its gate|up product (dspark.ops.swiglu_linear: linear_mma_bf16_swiglu_<shape>,
    or round_swiglu_bf16 and the a16 tiles for a prompt) over linear_benches' rows: bytes the down product's
    min_bytes with gate|up for x (twice the activations), predicted as perf_model.linear(swiglu=True) prices it;
    beside linear's down rows, what taking SwiGLU into the product costs it."""
    d, f = s.d_model, s.mlp_hidden
    w = randn(be, (f, d), BF16, scale=float(1 / np.sqrt(f)))
    cases = [("decode", B, B) for B in s.plain_batches] + [("verify", B, B * s.vt) for B in s.batches]
    for case, B, rows in cases + [("prompt", 1, s.prompt_rows)]:
        gate_up, out = randn(be, (rows, 2 * f)), be.xp.empty((rows, d), np.float32)
        plan = linear_plan(rows, f, d, 2)
        model = pm.linear("bench", "down", rows, f, d, 2, pm.H200, swiglu=True)
        yield Bench("linear", f"{case} (SwiGLU)", {"proj": "down", "B": B, "rows": rows, "K": f, "N": d, "S": plan.splits},
                    plan.min_bytes + F32 * rows * f, 2 * rows * f * d, tuple(sorted(m.entry for m in model)),
                    lambda b, g=gate_up, o=out: swiglu_linear(b, g, w, out=o), model)


def gate_linear_benches(be, s: Sizes) -> Iterator[Bench]:
    """An attention's output projection over its bf16 output and gates (dspark.ops.gate_linear:
    linear_mma_bf16_gated_<shape>; a prompt's round_gate and the a16 tiles) over a decode's and a
    verify's rows: bytes the product's min_bytes with o (2 bytes) and its gates (4) for x, predicted as
    perf_model.linear(gate=...) prices it."""
    hq, D, d = s.hkv * s.gqa, s.head_dim, s.d_model
    k = hq * D
    w = randn(be, (k, d), BF16, scale=float(1 / np.sqrt(k)))
    cases = [("decode", B, B) for B in s.plain_batches] + [("verify", B, B * s.vt) for B in s.batches]
    for case, B, rows in cases:
        o, qg, out = randn(be, (rows, hq, D), BF16), randn(be, (rows, 2 * k)), be.xp.empty((rows, d), np.float32)
        plan = linear_plan(rows, k, d, 2)
        model = pm.linear("bench", "attn o", rows, k, d, 2, pm.H200, gate=(2, True, D))
        yield Bench("linear", f"{case} (gated)", {"proj": "attn o", "B": B, "rows": rows, "K": k, "N": d,
                                                  "S": plan.splits},
                    plan.min_bytes + 2 * rows * k, 2 * rows * k * d, tuple(sorted(m.entry for m in model)),
                    lambda b, o=o, g=qg, out=out: attn_gate_linear(b, o, w, (g, D, 2 * D), out=out), model)


# ---- linear_fp8: the same GEMMs on FP8 weights (e4m3 and a scale per 128 x 128 block) ---------------------
def linear_fp8_benches(be, s: Sizes) -> Iterator[Bench]:
    """linear_fp8_bf16_m<BM> (fp8_plan's tile shape) for the MLP's two projections over the rows of
    linear_benches: bytes from fp8_linear_plan's min_bytes (the weights once at 1 byte plus 4 per
    scale, x, out), 2 rows K N flops; predicted as perf_model.linear prices FP8 weights (wb 1)."""
    from dspark.ops.fp8 import Fp8Matrix, scale_grid

    def weights(k, n):
        q = _RNG.integers(0, 256, (k, n), dtype=np.uint8)
        q[(q & 0x7F) == 0x7F] = 0x38   # no NaN patterns (the loader refuses them)
        return Fp8Matrix(be.asarray(q), be.asarray(_RNG.uniform(0.5, 2.0, scale_grid(k, n)).astype(np.float32) / 256),
                         np.dtype(BF16))
    return gemm_benches(be, s, "linear_fp8", "linear_fp8", 1, weights)


# ---- moe: a mixture-of-experts layer's router, grouped product and combine ---------------------------------
def moe_benches(be, s: Sizes) -> Iterator[Bench]:
    """One MoE layer (experts, top-k, d_model and expert width of the Sizes: Qwen3.5-35B-A3B's on the
    GPU) over a verify's rows (B * vt) and a prompt pass's: the router (logits read; ids, weights,
    grouped rows and the map written), the grouped gate|up product (bf16, and FP8 experts: e4m3 bytes
    and a scale per 128 x 128 block; bytes: each distinct expert's weights once, counted from the
    plan's CTA map for the routing drawn, the rows gathered, the outputs) and the combine (k outputs
    a row read, the row written). No prediction: the performance model prices the grouped product for
    a routing model's expert count (perf_model.grouped_kernel), not for the routing drawn here."""
    from dspark.ops.fp8 import Fp8Stack, scale_grid
    from dspark.ops.moe import combine, group_ref, grouped_linear, grouped_plan, route, route_ref
    E, k, d, I = s.experts, s.expert_top_k, s.moe_d_model, s.expert_hidden
    w = randn(be, (E, d, 2 * I), BF16, scale=float(1 / np.sqrt(d)))
    rng8 = np.random.default_rng(8)   # its own stream: the other benches draw what they drew before
    q = rng8.integers(0, 256, (E, d, 2 * I), dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x38   # no NaN patterns (the loader refuses them)
    w8 = Fp8Stack(be.asarray(q), be.asarray(rng8.uniform(0.5, 2.0, (E, *scale_grid(d, 2 * I))).astype(np.float32) / 256),
                  np.dtype(BF16))
    for case, B, rows in [("verify", B, B * s.vt) for B in s.batches] + [("prompt", 1, s.prompt_rows)]:
        P, logits = rows * k, randn(be, (rows, E))
        plan = grouped_plan(rows, k, E, d, 2 * I, 2)
        g = group_ref(route_ref(be.to_host(logits), k, True)[0], E, plan.tile_rows)
        r = route(be, logits, E, k, True, plan.tile_rows)
        shape = {"B": B, "rows": rows, "E": E, "k": k}
        yield Bench("moe", f"{case} router", shape, F32 * (rows * E + 3 * P + P), 6 * rows * E, ("moe_route_f32",),
                    lambda b, x=logits, t=plan.tile_rows: route(b, x, E, k, True, t))
        x, out = randn(be, (rows, d)), be.xp.empty((P, 2 * I), np.float32)
        yield Bench("moe", f"{case} grouped gate|up", {**shape, "distinct": g.distinct, "K": d, "N": 2 * I},
                    sum(plan.expert_bytes(g).values()) + F32 * (rows * d + P * 2 * I), 2 * P * d * 2 * I,
                    (plan.entry,), lambda b, x=x, r=r, o=out: grouped_linear(b, x, w, r, gather=True, out=o))
        plan8 = grouped_plan(rows, k, E, d, 2 * I, 1)   # the same tiles and map: the routing serves both
        yield Bench("moe", f"{case} grouped gate|up fp8", {**shape, "distinct": g.distinct, "K": d, "N": 2 * I},
                    sum(plan8.expert_bytes(g).values()) + F32 * (rows * d + P * 2 * I), 2 * P * d * 2 * I,
                    (plan8.entry,), lambda b, x=x, r=r, o=out: grouped_linear(b, x, w8, r, gather=True, out=o))
        y, o = randn(be, (P, d)), be.xp.empty((rows, d), np.float32)
        yield Bench("moe", f"{case} combine", {**shape, "d": d}, F32 * (P * d + 2 * P + rows * d), 2 * P * d,
                    ("moe_combine_f32",), lambda b, y=y, r=r, o=o: combine(b, y, r, out=o))


# ---- gdn_chunk: one gdn layer's prompt pass in chunks of 64 ------------------------------------------------
def gdn_chunk_benches(be, s: Sizes) -> Iterator[Bench]:
    """A prompt pass of prompt_rows rows of one session through one gdn layer (bf16 operands): the
    conv, gdn_chunk_prep, gdn_chunk_state. Bytes: the inputs, the conv's outputs written and read,
    the chunk scratch written and read, the state read and written, the output; flops: the chunk
    products as the MMAs run them (dspark.ops.gdn_chunk.chunk_flops)."""
    from dspark.ops.gdn_chunk import CHUNK, chunk_flops, gdn_prompt, scratch_bytes
    H, dk, dv, kh = s.gdn_heads, s.dk, s.dv, s.gdn_k_heads or None
    C, rows = channels(H, dk, dv, kh), s.prompt_rows
    chunks = -(-rows // CHUNK)
    conv_w, A_log = randn(be, (C, 4), scale=0.5), be.asarray(np.log(_RNG.uniform(1, 16, H)).astype(np.float32))
    dt_bias = be.asarray(np.full(H, -4.0, np.float32))
    mixed, a, b_gate = randn(be, (rows, C)), randn(be, (rows, H)), randn(be, (rows, H), scale=2.0)
    states, chunk_states = [randn(be, (H, dv, dk), scale=0.3)], [be.xp.zeros((H, dv, dk), np.float32)]
    windows, tails = [randn(be, (C, 3))], [be.xp.zeros((CHUNK, C + 2 * H), np.float32)]
    out = be.xp.empty((rows, H, dv), np.float32)
    ptr = indptr([rows])
    fl = chunk_flops(H, dk, dv)
    nbytes = F32 * (rows * (C + 2 * H) + 2 * rows * C + 3 * H * dv * dk + rows * H * dv) \
        + 2 * scratch_bytes(chunks, H, dk, dv, 2)
    yield Bench("gdn_chunk", "prompt", {"rows": rows, "H": H, "dk": dk, "dv": dv, "chunks": chunks}, nbytes,
                chunks * (fl["prep"] + fl["state"]),
                ("gdn_conv_rows_f32", f"gdn_chunk_prep_bf16_dk{dk}", f"gdn_chunk_state_bf16_dk{dk}"),
                lambda b, x=(mixed, a, b_gate): gdn_prompt(b, *x, conv_w, A_log, dt_bias, states, windows, chunk_states,
                                                           tails, ptr, np.zeros(1, np.int32), heads=H, dk=dk, dv=dv,
                                                           k_heads=kh, dtype=BF16, out=out),
                list(pm.prompt_gdn("bench", H, dk, dv, kh, rows, pm.H200)))


def predict(plan) -> "pm.Kernel":
    """The kernel perf_model prices a row-split reduction's plan as."""
    return pm.rowsplit_kernel("bench", plan, pm.H200)


def reduction_plans(s: Sizes) -> list[tuple]:
    """The vocabulary reductions' launch plans at sizes `s`, from the plans alone (nothing runs):
    the bytes they must move, the bytes their launches move (every pass, partials), CTAs,
    launches and passes over each row."""
    V, vt, nd, r = s.vocab, s.vt, s.drafts, s.markov_rank
    rows = []
    for B in s.reduce_batches:
        for case, plan in (("argmax_rows", argmax_plan(B, V, F32)),
                           ("greedy_accept", greedy_accept_plan(B, B * vt, V, F32)),
                           ("markov_chain", markov_chain_plan(B, nd, V, r, F32)),
                           ("sample T=1", sample_plan(B, V, F32)),
                           ("sample top-k/p", sample_plan(B, V, F32, top_k=True, top_p=True)),
                           ("spec_accept", accept_plan(B, nd, V)),
                           ("coupled accept", coupled_accept_plan(B, B * (nd + 1), V, F32))):
            rows.append((case, f"B={B}", f"{V}", str(plan.splits), amount(plan.min_bytes / 1e6),
                         amount(plan.bytes / 1e6), str(plan.ctas), str(len(plan.launches)), f"{plan.passes:.2f}"))
    return rows


FAMILIES: dict[str, Callable[[object, Sizes], Iterator[Bench]]] = {
    "argmax": argmax_benches,
    "attention": attention_benches,
    "kv_commit": kv_commit_benches,
    "gdn_scan": gdn_scan_benches,
    "snapshot": snapshot_benches,
    "sampling": sampling_benches,
    "norm": norm_benches,
    "linear": linear_benches,
    "linear_fp8": linear_fp8_benches,
    "gdn_chunk": gdn_chunk_benches,
    "moe": moe_benches,
    "activation": activation_benches,
    "rope": rope_benches,
    "heads": heads_benches,
}
NOT_BENCHMARKED = {"selftest", "fp8"}  # the simt runtime's own checks; the e4m3 decode alone (csrc/fp8.cu: its
# test kernel; the FP8 products decode inline, linear_fp8)

# Ratios of two rows of one run, paired by the shape keys given.
RATIOS = (
    ("verify / decode", ("attention", "verify"), ("attention", "decode"), ("B", "ctx")),
    ("linear verify / decode", ("linear", "verify"), ("linear", "decode"), ("proj", "B")),
    ("SwiGLU down / down", ("linear", "verify (SwiGLU)"), ("linear", "verify"), ("proj", "B")),
    ("fp8 / bf16 GEMM", ("linear_fp8", "decode"), ("linear", "decode"), ("proj", "B")),
    ("verify+checkpoints / decode", ("gdn_scan", "verify"), ("gdn_scan", "decode"), ("B",)),
    ("greedy_accept / argmax_rows", ("argmax", "greedy_accept"), ("argmax", "argmax_rows"), ("B",)),
    ("markov_chain / argmax_rows", ("argmax", "markov_chain"), ("argmax", "argmax_rows"), ("B",)),
    ("sample top-k/p / argmax_rows", ("sampling", "sample top-k/p"), ("argmax", "argmax_rows"), ("B",)),
    ("spec_accept / greedy_accept", ("sampling", "spec_accept"), ("argmax", "greedy_accept"), ("B",)),
    ("coupled / rejection accept", ("sampling", "coupled accept"), ("sampling", "rejection accept"), ("B",)),
    ("snapshot_save / checkpoint_select", ("snapshot", "snapshot_save"), ("snapshot", "checkpoint_select"), ("B",)),
)


@dataclasses.dataclass
class Result:
    bench: Bench
    time: float


def amount(x: float) -> str:
    """3-4 significant digits without exponents; "-" for nothing."""
    if x == 0:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:.2f}" if x >= 1 else f"{x:.3g}"


# ---- checks shared by --dry-run and a real run ------------------------------------------------------------
def family_problems() -> list[str]:
    """Every csrc/*.cu family has a benchmark entry, and no entry names a family that is gone."""
    families = {f.stem for f in kernel_files()} - NOT_BENCHMARKED
    out = [f"csrc/{f}.cu has no benchmark entry in FAMILIES" for f in sorted(families - set(FAMILIES))]
    out += [f"FAMILIES[{f!r}] has no csrc/{f}.cu" for f in sorted(set(FAMILIES) - families)]
    return out


def ncu_regexes() -> list[str]:
    """profiling/ncu_kernels.sh's --kernel-name regexes, in order: the --verify one, the session one."""
    script = Path(__file__).with_name("ncu_kernels.sh")
    return re.findall(r"--kernel-name\s+'regex:([^']*)'", script.read_text()) if script.is_file() else []


def ncu_misses(entries) -> list[str]:
    """Entry points that profiling/ncu_kernels.sh's session regex (every kernel) would not profile."""
    found = ncu_regexes()
    if not found:
        return []
    pattern = re.compile(found[-1])
    return sorted(e for e in entries if not e.startswith(("selftest", "attention_mma_probe", "attention_cp_async", "fp8_decode"))
                  and not pattern.search(e))


def dry_run(families: list[str]) -> int:
    """Imports, the family table, declared kernel names against csrc/, and the plan at the CPU
    sizes on the numpy backend (inputs are made, nothing is launched or timed)."""
    problems = family_problems()
    entries = scan()
    be = dspark.get_backend("numpy")
    rows = []
    for fam in families:
        for bench in FAMILIES[fam](be, CPU):
            problems += [f"{fam} {bench.case}: no kernel {k} in csrc/" for k in bench.kernels if k not in entries]
            rows.append((fam, bench.case, bench.shape_text, amount(bench.nbytes / 1e6), amount(bench.flops / 1e6),
                         seconds(bench.floor), seconds(bench.predicted), " ".join(bench.kernels)))
    print(f"dry run: {len(rows)} benchmarks in {len(families)} families at the CPU sizes ({CPU.label})")
    print(table(("family", "case", "shape", "MB", "MFLOP", "H200 floor", "H200 expected", "kernels"), rows))
    missed = ncu_misses(entries)
    if missed:
        print(f"note: profiling/ncu_kernels.sh's --kernel-name regex skips {', '.join(missed)}")
    for p in problems:
        print(f"error: {p}")
    return 1 if problems else 0


# ---- a real run ------------------------------------------------------------------------------------------
def run_family(be, sizes: Sizes, fam: str, clock, ceilings) -> list[Result]:
    results, rows, notes = [], [], []
    built = getattr(be.kernels, "signatures", None)
    cp = gpu_module(be)
    for bench in FAMILIES[fam](be, sizes):
        missing = [k for k in bench.kernels if built is not None and k not in built]
        if missing:
            rows.append((bench.case, bench.shape_text, "-", "-", "-", "-", "-", "not built", "-", "-", "-"))
            notes.append(f"note: {fam} {bench.case}: skipped, {', '.join(missing)} not in this build")
            continue
        launches = record(be, bench.op)
        launched = tuple(sorted({launch.name for launch in launches}))
        if launched != tuple(sorted(bench.kernels)):
            raise RuntimeError(f"{fam} {bench.case}: the op launched {launched}, the benchmark counts {bench.kernels}")
        t = clock.median(replay(launches))
        roof, bound = ceilings.roofline(bench.nbytes, bench.flops)
        error = model_error(t, bench.floor, bench.predicted)
        rows.append((bench.case, bench.shape_text, amount(bench.nbytes / 1e6), amount(bench.flops / 1e6), seconds(t),
                     amount(bench.nbytes / t / 1e9), amount(bench.flops / t / 1e9), bound, f"{roof / t:.1%}",
                     seconds(bench.floor), seconds(bench.predicted),
                     f"{t / bench.predicted:.2f}x" if bench.predicted > 0 else "-", "MODEL ERROR" if error else "ok"))
        results.append(Result(bench, t))
        del launches, bench
        if cp is not None:
            cp.get_default_memory_pool().free_all_blocks()
    print(f"\n== {fam}")
    print(table(("case", "shape", "MB", "MFLOP", "time", "GB/s", "GFLOP/s", "bound", "of roof", "floor", "expected",
                 "measured/expected", "model"), rows))
    print("\n".join(notes), end="\n" if notes else "", flush=True)
    return results


TOLERANCE = 0.25  # measured within +-25 % of the expected time, and never faster than the floor


def model_error(measured: float, floor: float, expected: float, tolerance: float = TOLERANCE) -> str:
    """Why a measured time refutes the model ("" when it does not): faster than its floor, or outside
    +-tolerance of its expected time. profiling/gpu_check.py reports these as FAILED."""
    if not (expected > 0 and floor >= 0):
        return ""
    if measured < floor:
        return f"faster than its floor ({seconds(measured)} < {seconds(floor)})"
    if abs(measured - expected) > tolerance * expected:
        return f"{measured / expected:.2f}x its expected time ({seconds(measured)} against {seconds(expected)})"
    return ""


def json_rows(results: list[Result], device: str, date: str) -> list[dict]:
    """Each measured call as profiling/plots.py reads it (docs/gpu-check.md: the JSON layout)."""
    return [{"family": r.bench.family, "case": r.bench.case, "kernel": " ".join(r.bench.kernels),
             "shape": r.bench.shape, "measured_s": r.time, "floor_s": r.bench.floor, "expected_s": r.bench.predicted,
             "device": device, "date": date} for r in results]


def ratio_rows(results: list[Result]) -> list[tuple]:
    rows = []
    for label, num, den, keys in RATIOS:
        nums = [r for r in results if (r.bench.family, r.bench.case) == num]
        dens = [r for r in results if (r.bench.family, r.bench.case) == den]
        for n in nums:
            for d in dens:
                if all(n.bench.shape.get(k) == d.bench.shape.get(k) for k in keys):
                    shape = " ".join(f"{k}={n.bench.shape[k]}" for k in keys)
                    rows.append((label, shape, f"{n.time / d.time:.2f}x", f"{n.bench.nbytes / d.bench.nbytes:.2f}x"))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="tiny sizes on the simt backend, even with a GPU")
    ap.add_argument("--dry-run", action="store_true", help="check imports, entries and the plan; time nothing")
    ap.add_argument("--plans", action="store_true", help="the reductions' launch plans at the GPU sizes; run nothing")
    ap.add_argument("--family", nargs="+", choices=sorted(FAMILIES), default=list(FAMILIES))
    ap.add_argument("--reps", type=int, default=None, help="timed repeats per call (default 20 GPU, 3 CPU)")
    ap.add_argument("--json", type=Path, default=None, metavar="FILE",
                    help="also write every measured row (kernel, shape, measured, floor and expected seconds, device, "
                         "date) as JSON, for profiling/plots.py (keep them in profiling/results/)")
    a = ap.parse_args(argv)
    if a.plans:
        print(f"launch plans of the vocabulary reductions (f32 rows): {GPU.label}")
        print(table(("case", "batch", "V", "S", "min MB", "plan MB", "CTAs", "launches", "passes"),
                    reduction_plans(GPU)))
        return 0
    if a.dry_run:
        return dry_run(a.family)
    for p in family_problems():  # --dry-run (and its test) fail on these; a real run still times the rest
        print(f"warning: {p}")
    gpu = cuda_available() and not a.cpu
    be = dspark.get_backend("cuda" if gpu else "simt")
    sizes = dataclasses.replace(GPU, kv_dtype=storage_dtype(be.xp, GPU.kv_dtype)) if gpu else CPU
    clock = clock_for(be, a.reps)
    ceilings = measure_ceilings(be, clock)
    device = "CPU (simt)"
    if gpu:
        name = be.xp.cuda.runtime.getDeviceProperties(be.xp.cuda.Device().id)["name"]
        device = name.decode() if isinstance(name, bytes) else name
        print(f"device: {device}")
    print(f"backend {be.name}, {clock.name} clock: {sizes.label}")
    print("\n".join(ceilings.lines()))
    print("roofline: max(bytes / copy bandwidth, flops / GEMM float32); bound = the ceiling that sets it")
    results = []
    for fam in a.family:
        results += run_family(be, sizes, fam, clock, ceilings)
    errors = [(r, model_error(r.time, r.bench.floor, r.bench.predicted)) for r in results] if gpu else []
    for r, why in errors:
        if why:
            print(f"model error: {r.bench.family} {r.bench.case} ({' '.join(r.bench.kernels)}, {r.bench.shape_text}): {why}")
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        date = datetime.date.today().isoformat()
        a.json.write_text(json.dumps({"command": "python profiling/bench_kernels.py " + " ".join(argv or sys.argv[1:]),
                                      "device": device, "date": date, "backend": be.name,
                                      "rows": json_rows(results, device, date)}, indent=1) + "\n")
        print(f"wrote {a.json}: {len(results)} rows")
    rows = ratio_rows(results)
    if rows:
        print("\n== ratios (this run)")
        print(table(("ratio", "shape", "time", "bytes"), rows))
    if not gpu:
        print("\n(simt runs every CUDA thread as a CPU fiber: these times say nothing about a GPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
