"""Every op of dspark.ops, as small cases that any array type can feed: the interop tests (torch
CPU tensors vs NumPy arrays) and the CuPy contract test (the cuda backend on the stand-in vs
simt) run the same cases.

A case builds NumPy inputs by argument name; `run_case` copies them, turns every array into the
array type under test (`conv`), calls the op, and returns the host bytes of what it returned and
of every argument it writes.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np

from dspark.ops import (activation, argmax, attention, coupled, fp8, gdn, heads, kv_commit, linear, norm, rope,
                        sampling, snapshot)
from dspark.philox import Tag

F32, I32 = np.float32, np.int32


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable          # rng -> {argument name: NumPy array, list of arrays, or dataclass of arrays}
    run: Callable            # (be, args) -> what the op returned
    writes: tuple = ()       # arguments the op writes, compared after the call
    bound: Callable | None = None  # inputs -> |got - reference| allowed per element, where 1e-4 relative is not it


def indptr(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(I32)


def _logits(rng, rows, vocab):
    return rng.standard_normal((rows, vocab)).astype(F32)


def _argmax(rng):
    return {"logits": _logits(rng, 5, 333), "out": np.full(5, -7, I32)}


def _greedy(rng):
    x = _logits(rng, 7, 50)
    cand = rng.integers(0, 50, 7).astype(I32)
    cand[1] = int(x[0].argmax())  # session 0 accepts its first draft
    return {"logits": x, "cand": cand, "col_indptr": indptr([3, 4]), "m_out": np.full(2, -7, I32),
            "next_out": np.full(2, -7, I32)}


def _markov_slot(rng):
    """Slot 1 of a sampled chain: B = 2 sessions of nd = 3 slots, slot 0's picks on the device."""
    a = _markov(rng)
    B, V = a["out"].shape[0], a["logits"].shape[1]
    return {**{k: a[k] for k in ("logits", "w1", "w2", "anchors")}, "picks": rng.integers(0, V, B).astype(I32),
            "drafts": np.full((B, 3), -7, I32), "out": np.full((B, V), np.nan, F32)}


def _markov(rng):
    B, nd, V, r = 2, 3, 40, 4
    return {"logits": _logits(rng, B * nd, V), "w1": (0.3 * rng.standard_normal((V, r))).astype(F32),
            "w2": (0.3 * rng.standard_normal((r, V))).astype(F32), "anchors": rng.integers(0, V, B).astype(I32),
            "out": np.full((B, nd), -7, I32)}


def _linear(rng):  # f16 weights (torch has no ml_dtypes bf16), ragged N, two K splits
    return {"x": rng.standard_normal((3, 600)).astype(F32),
            "w": (0.05 * rng.standard_normal((600, 130))).astype(np.float16), "out": np.full((3, 130), -7, F32)}


def _linear_bound(a):
    """The kernels round x to the weight's 16-bit type (the tensor-core GEMM), the numpy backend
    keeps it f32: they differ by that rounding, relative to |x| @ |w| (linear.MMA_TOLERANCE)."""
    w = a["w"].astype(np.float64)
    return linear.MMA_TOLERANCE[a["w"].dtype] * (np.abs(a["x"]).astype(np.float64) @ np.abs(w))


def _linear_fp8(rng):  # an edge block on both axes (K 300, N 130: scale grid 3 x 2), f16 compute
    q = rng.integers(0, 256, (300, 130)).astype(np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x38   # no e4m3 NaN patterns (refused at load)
    scale = rng.uniform(0.5, 2.0, (3, 2)).astype(F32) / 64
    return {"x": rng.standard_normal((3, 300)).astype(F32), "w": fp8.Fp8Matrix(q, scale, np.dtype(np.float16)),
            "out": np.full((3, 130), -7, F32)}


def _linear_fp8_bound(a):
    """As _linear_bound: the kernels round x to the compute type, the numpy backend keeps it f32."""
    w = np.asarray(a["w"], np.float64)
    return linear.MMA_TOLERANCE[np.dtype(np.float16)] * (np.abs(a["x"]).astype(np.float64) @ np.abs(w))


def _attention(mode):
    def build(rng):
        lens, ctx, cap, hq, hkv, d = [3, 1, 4], [5, 0, 70], 80, 4, 2, 64
        rows = sum(lens)
        return {"q": rng.standard_normal((rows, hq, d)).astype(F32),
                "k_blk": rng.standard_normal((rows, hkv, d)).astype(F32),
                "v_blk": rng.standard_normal((rows, hkv, d)).astype(F32),
                "k_caches": [rng.standard_normal((hkv, cap, d)).astype(F32) for _ in lens],
                "v_caches": [rng.standard_normal((hkv, cap, d)).astype(F32) for _ in lens],
                "pos": np.array(ctx, I32), "row_indptr": indptr(lens), "out": np.full((rows, hq, d), np.nan, F32)}
    return build


def _kv_commit(rng):
    lens, layers, hkv, d, cap = [3, 2], 2, 2, 64, 12
    rows = sum(lens)
    return {"k_blk": [rng.standard_normal((rows, hkv, d)).astype(F32) for _ in range(layers)],
            "v_blk": [rng.standard_normal((rows, hkv, d)).astype(F32) for _ in range(layers)],
            "k_caches": [[np.zeros((hkv, cap, d), F32) for _ in lens] for _ in range(layers)],
            "v_caches": [[np.zeros((hkv, cap, d), F32) for _ in lens] for _ in range(layers)],
            "pos": np.array([4, 9], I32), "keep": np.array([2, 2], I32), "row_indptr": indptr(lens)}


H, DK, DV = 2, 16, 16
C = H * (2 * DK + DV)


def _gdn(rng):
    ts = [2, 0, 3]
    cols = sum(ts)
    return {"mixed": rng.standard_normal((cols, C)).astype(F32), "a": rng.standard_normal((cols, H)).astype(F32),
            "b": rng.standard_normal((cols, H)).astype(F32), "conv_weight": rng.standard_normal((C, 4)).astype(F32),
            "A_log": np.log(rng.uniform(1, 8, H)).astype(F32), "dt_bias": rng.uniform(-3, 0, H).astype(F32),
            "states": [(0.1 * rng.standard_normal((H, DV, DK))).astype(F32) for _ in ts],
            "conv_windows": [rng.standard_normal((C, 3)).astype(F32) for _ in ts], "col_indptr": indptr(ts),
            "out": np.full((cols, H, DV), np.nan, F32), "state_ckpt": np.full((cols, H, DV, DK), np.nan, F32),
            "conv_ckpt": np.full((cols, C, 3), np.nan, F32)}


def _snapshot(rng):
    shapes = [(H, DV, DK), (C, 3), (5,)]
    return {"src": [rng.standard_normal(s).astype(F32) for s in shapes],
            "dst": [np.full(s, np.nan, F32) for s in shapes]}


def _checkpoint(rng):
    ts, keep = [3, 2, 1], [2, 0, 1]
    cols = sum(ts)
    return {"state_ckpt": rng.standard_normal((cols, H, DV, DK)).astype(F32),
            "conv_ckpt": rng.standard_normal((cols, C, 3)).astype(F32),
            "states": [np.full((H, DV, DK), np.nan, F32) for _ in ts],
            "conv_windows": [np.full((C, 3), np.nan, F32) for _ in ts], "col_indptr": indptr(ts),
            "keep": np.array(keep, I32), "snap_states": [rng.standard_normal((H, DV, DK)).astype(F32) for _ in ts],
            "snap_convs": [rng.standard_normal((C, 3)).astype(F32) for _ in ts]}


def _gdn_layer(rng):
    ts, kh = [2, 3], 1
    cols, Hv = sum(ts), 2  # two value heads on one key head: the window written back by the last reader
    Cl = kh * 2 * DK + Hv * DV
    return {"proj": rng.standard_normal((cols, Cl + Hv * DV + 2 * Hv)).astype(F32),
            "conv_weight": rng.standard_normal((Cl, 4)).astype(F32), "A_log": np.log(rng.uniform(1, 8, Hv)).astype(F32),
            "dt_bias": rng.uniform(-3, 0, Hv).astype(F32), "o_norm": rng.standard_normal(DV).astype(F32),
            "states": [(0.1 * rng.standard_normal((Hv, DV, DK))).astype(F32) for _ in ts],
            "conv_windows": [rng.standard_normal((Cl, 3)).astype(F32) for _ in ts], "col_indptr": indptr(ts),
            "col_count": np.array([1, 3], I32), "out": np.full((cols, Hv, DV), np.nan, F32)}


def _select_layers(rng):
    ts, keep, layers = [3, 2], [2, 0], 2
    cols = sum(ts)
    return {"state_ckpts": [rng.standard_normal((cols, H, DV, DK)).astype(F32) for _ in range(layers)],
            "conv_ckpts": [rng.standard_normal((cols, C, 3)).astype(F32) for _ in range(layers)],
            "states": [np.full((H, DV, DK), np.nan, F32) for _ in range(layers * len(ts))],
            "conv_windows": [np.full((C, 3), np.nan, F32) for _ in range(layers * len(ts))],
            "col_indptr": indptr(ts), "keep": np.array(keep, I32)}


def _norms(rng):
    return {"x": rng.standard_normal((5, 70)).astype(F32), "y": rng.standard_normal((5, 70)).astype(F32),
            "weight": rng.standard_normal(70).astype(F32), "out": np.full((5, 70), np.nan, F32),
            "taps": np.full((5, 140), np.nan, F32), "table": rng.standard_normal((30, 70)).astype(F32),
            "ids": rng.integers(0, 30, 5).astype(I32), "o": rng.standard_normal((5, 2, 35)).astype(F32),
            "o_weight": rng.standard_normal(35).astype(F32), "o_out": np.full((5, 2, 35), np.nan, F32)}


def _gates(rng):
    return {"gate_up": rng.standard_normal((4, 2 * 33)).astype(F32), "act": np.full((4, 33), np.nan, F32),
            "o": rng.standard_normal((4, 3, 64)).astype(F32), "q2": rng.standard_normal((4, 3 * 128)).astype(F32),
            "gated": np.full((4, 192), np.nan, F32), "c": rng.standard_normal(6).astype(F32),
            "bias": rng.standard_normal(1).astype(F32), "conf": np.full(6, np.nan, F32)}


def _rope(rng):
    from dspark.ops.rope import Heads
    heads = Heads.packed(4, 2, 64, gated=True)
    return {"src": rng.standard_normal((5, heads.width)).astype(F32), "pos": np.array([3, 40], I32),
            "row_indptr": indptr([2, 3]), "q_norm": rng.standard_normal(64).astype(F32),
            "k_norm": rng.standard_normal(64).astype(F32), "q": np.full((5, 4, 64), np.nan, F32),
            "k": np.full((5, 2, 64), np.nan, F32), "v": np.full((5, 2, 64), np.nan, F32)}


def _heads(rng):
    return {"hidden": rng.standard_normal((6, 24)).astype(F32), "w1": rng.standard_normal((30, 5)).astype(F32),
            "anchors": np.array([3, 29], I32), "drafts": rng.integers(0, 30, (2, 3)).astype(I32),
            "features": np.full((6, 29), np.nan, F32), "rows": np.array([1, 2, 4, 5], I32),
            "logits": (30 * rng.standard_normal((4, 50))).astype(F32)}


def _rope_run(be, a):
    from dspark.ops.rope import Heads, Rotary
    return rope.qk_prepare(be, a["src"], Heads.packed(4, 2, 64, gated=True), Rotary.of(16, 1e6), a["pos"],
                           a["row_indptr"], q_norm=a["q_norm"], k_norm=a["k_norm"], q=a["q"], k=a["k"], v=a["v"])


def _filters(rows):
    return sampling.Filters.full(rows, temperature=[0.9, 0.0, 1.3][:rows], top_k=[0, 0, 7][:rows],
                                 top_p=[0.95, 1.0, 0.8][:rows], min_p=[0.0, 0.0, 0.02][:rows])


def _sample(rng):
    rows, V = 3, 60
    return {"logits": _logits(rng, rows, V), "filters": _filters(rows),
            "streams": sampling.Streams.full(rows, [11, 12, 13], [0, 4, 9], Tag.DRAFT, 1),
            "token_out": np.full(rows, -7, I32), "prob_out": np.full(rows, np.nan, F32),
            "dist_out": np.full((rows, V), np.nan, F32)}


def _probs(rng):
    return {"logits": _logits(rng, 3, 60), "filters": _filters(3), "out": np.full((3, 60), np.nan, F32)}


def _dists(rng, rows, V):
    from dspark.backends import get_backend
    f = sampling.Filters.full(rows, temperature=1.0, top_p=0.9)
    return sampling.filtered_probs(get_backend("numpy"), _logits(rng, rows, V), f)


def _accept(rng):
    nds, V = [3, 0, 2], 30
    q = _dists(rng, sum(nds), V)
    p = _dists(rng, sum(nds) + len(nds), V)
    drafts = np.array([rng.choice(V, p=row / row.sum()) for row in q.astype(np.float64)], I32)
    return {"drafts": drafts, "draft_indptr": indptr(nds), "q": q, "p": p,
            "seed": np.array([5, 6, 7], np.uint64), "counter": np.array([0, 3, 1], np.uint64),
            "m_out": np.full(3, -7, I32), "next_out": np.full(3, -7, I32), "source_out": np.full(3, -7, I32)}


def _coupled(rng):
    vts, V = [3, 1, 4], 50
    cols = sum(vts)
    logits = _logits(rng, cols, V)
    f = sampling.Filters.full(cols, temperature=np.repeat([0.9, 0.0, 1.2], vts), top_k=np.repeat([0, 0, 6], vts))
    s = sampling.Streams.full(cols, np.repeat([5, 6, 7], vts), [10, 11, 12, 4, 30, 31, 32, 33], Tag.PICK)
    picks = coupled.coupled_accept_ref(logits, np.zeros(cols, I32), indptr(vts), f, s)["picks"]
    cand = np.array([1, picks[0], 2, 3, 4, picks[4], picks[5], 9], I32)  # partial, none, partial accepts
    return {"logits": logits, "cand": cand, "col_indptr": indptr(vts), "filters": f, "streams": s,
            "m_out": np.full(3, -7, I32), "next_out": np.full(3, -7, I32), "picks_out": np.full(cols, -7, I32)}


def _walk(rng):
    vts = [2, 40, 1]
    picks = rng.integers(0, 9, sum(vts)).astype(I32)
    cand = np.concatenate([[0], picks[:-1]]).astype(I32)
    cand[20] = 99  # session 1 accepts 17 drafts (its columns start at 2)
    return {"picks": picks, "cand": cand, "col_indptr": indptr(vts), "m_out": np.full(3, -7, I32),
            "next_out": np.full(3, -7, I32)}


def _philox(rng):
    n = 37
    return {"ctr": rng.integers(0, 2**32, (n, 4), dtype=np.uint32),
            "key": rng.integers(0, 2**32, (n, 2), dtype=np.uint32)}


CASES = [
    Case("argmax_rows", _argmax, lambda be, a: argmax.argmax_rows(be, a["logits"], out=a["out"]), ("out",)),
    Case("greedy_accept", _greedy, lambda be, a: argmax.greedy_accept(
        be, a["logits"], a["cand"], a["col_indptr"], m_out=a["m_out"], next_out=a["next_out"]), ("m_out", "next_out")),
    Case("markov_chain", _markov, lambda be, a: argmax.markov_chain(
        be, a["logits"], a["w1"], a["w2"], a["anchors"], 3, out=a["out"]), ("out",)),
    Case("linear", _linear, lambda be, a: linear.linear(be, a["x"], a["w"], out=a["out"]), ("out",),
         _linear_bound),
    Case("linear_fp8", _linear_fp8, lambda be, a: linear.linear_fp8(be, a["x"], a["w"], out=a["out"]), ("out",),
         _linear_fp8_bound),
    Case("attention_causal", _attention("causal"), lambda be, a: attention.attention(
        be, a["q"], a["k_blk"], a["v_blk"], a["k_caches"], a["v_caches"], a["pos"], a["row_indptr"], out=a["out"]),
         ("out",)),
    Case("attention_block", _attention("block"), lambda be, a: attention.attention(
        be, a["q"], a["k_blk"], a["v_blk"], a["k_caches"], a["v_caches"], a["pos"], a["row_indptr"], mode="block",
        window=16, out=a["out"]), ("out",)),
    Case("kv_commit", _kv_commit, lambda be, a: kv_commit.kv_commit(
        be, a["k_blk"], a["v_blk"], a["k_caches"], a["v_caches"], a["pos"], a["keep"], a["row_indptr"]),
         ("k_caches", "v_caches")),
    Case("kv_commit_ring", _kv_commit, lambda be, a: kv_commit.kv_commit(
        be, a["k_blk"], a["v_blk"], a["k_caches"], a["v_caches"], a["pos"], a["keep"], a["row_indptr"], ring=True),
         ("k_caches", "v_caches")),
    Case("gdn_scan", _gdn, lambda be, a: gdn.gdn_scan(
        be, a["mixed"], a["a"], a["b"], a["conv_weight"], a["A_log"], a["dt_bias"], a["states"], a["conv_windows"],
        a["col_indptr"], heads=H, dk=DK, dv=DV, out=a["out"], state_ckpt=a["state_ckpt"], conv_ckpt=a["conv_ckpt"]),
         ("states", "conv_windows", "out", "state_ckpt", "conv_ckpt")),
    Case("snapshot_save", _snapshot, lambda be, a: snapshot.snapshot_save(be, a["src"], a["dst"]), ("dst",)),
    Case("snapshot_restore", _snapshot, lambda be, a: snapshot.snapshot_restore(be, a["src"], a["dst"]), ("dst",)),
    Case("checkpoint_select", _checkpoint, lambda be, a: snapshot.checkpoint_select(
        be, a["state_ckpt"], a["conv_ckpt"], a["states"], a["conv_windows"], a["col_indptr"], a["keep"],
        snap_states=a["snap_states"], snap_convs=a["snap_convs"]), ("states", "conv_windows")),
    Case("sample_filtered", _sample, lambda be, a: sampling.sample_filtered(
        be, a["logits"], a["filters"], a["streams"], token_out=a["token_out"], prob_out=a["prob_out"],
        dist_out=a["dist_out"]), ("token_out", "prob_out", "dist_out")),
    Case("sample_inverse_cdf", _sample, lambda be, a: sampling.sample_filtered(
        be, a["logits"], a["filters"], a["streams"], method="inverse_cdf"), ()),
    Case("filtered_probs", _probs, lambda be, a: sampling.filtered_probs(be, a["logits"], a["filters"], out=a["out"]),
         ("out",)),
    Case("speculative_accept", _accept, lambda be, a: sampling.speculative_accept(
        be, a["drafts"], a["draft_indptr"], a["q"], a["p"], a["seed"], a["counter"], m_out=a["m_out"],
        next_out=a["next_out"], source_out=a["source_out"]), ("m_out", "next_out", "source_out")),
    Case("coupled_accept", _coupled, lambda be, a: coupled.coupled_accept(
        be, a["logits"], a["cand"], a["col_indptr"], a["filters"], a["streams"], m_out=a["m_out"],
        next_out=a["next_out"], picks_out=a["picks_out"]), ("m_out", "next_out", "picks_out")),
    Case("pick_accept", _walk, lambda be, a: coupled.pick_accept(
        be, a["picks"], a["cand"], a["col_indptr"], m_out=a["m_out"], next_out=a["next_out"]), ("m_out", "next_out")),
    Case("philox_random", _philox, lambda be, a: sampling.philox_random(be, a["ctr"], a["key"]), ()),
    Case("gdn_layer", _gdn_layer, lambda be, a: gdn.gdn_layer(
        be, a["proj"], a["conv_weight"], a["A_log"], a["dt_bias"], a["states"], a["conv_windows"], a["col_indptr"],
        heads=2, dk=DK, dv=DV, k_heads=1, o_norm=a["o_norm"], col_count=a["col_count"], out=a["out"]),
         ("states", "conv_windows", "out")),
    Case("checkpoint_select_layers", _select_layers, lambda be, a: snapshot.checkpoint_select_layers(
        be, a["state_ckpts"], a["conv_ckpts"], a["states"], a["conv_windows"], a["col_indptr"], a["keep"]),
         ("states", "conv_windows")),
    Case("add_rmsnorm", _norms, lambda be, a: norm.add_rmsnorm(be, a["x"], a["y"], a["weight"], 1e-6, out=a["out"],
                                                               tap=(a["taps"], 70)), ("x", "out", "taps")),
    Case("embed_rmsnorm", _norms, lambda be, a: norm.embed_rmsnorm(be, a["table"], a["ids"], a["weight"], 1e-6,
                                                                   x=a["x"], out=a["out"], scale=2.0), ("x", "out")),
    Case("swiglu", _gates, lambda be, a: activation.swiglu(be, a["gate_up"], out=a["act"]), ("act",)),
    Case("attn_gate", _gates, lambda be, a: activation.attn_gate(be, a["o"], (a["q2"], 64, 128), out=a["gated"]),
         ("gated",)),
    Case("rmsnorm", _norms, lambda be, a: norm.rmsnorm(be, a["x"], a["weight"], 1e-6, out=a["out"]), ("out",)),
    Case("rmsnorm_gated", _norms, lambda be, a: norm.rmsnorm_gated(be, a["o"], a["x"], a["o_weight"], 1e-6,
                                                                   out=a["o_out"], column=0), ("o_out",)),
    Case("sigmoid_bias", _gates, lambda be, a: activation.sigmoid_bias(be, a["c"], a["bias"], out=a["conf"]),
         ("conf",)),
    Case("qk_prepare", _rope, _rope_run, ("q", "k", "v")),
    Case("confidence_features", _heads, lambda be, a: heads.confidence_features(
        be, a["hidden"], a["w1"], a["anchors"], a["drafts"], out=a["features"]), ("features",)),
    Case("gather_rows", _heads, lambda be, a: heads.gather_rows(be, a["hidden"], a["rows"]), ()),
    Case("logit_scale", _heads, lambda be, a: heads.logit_scale(be, a["logits"], 0.5, 20.0), ()),
    Case("markov_logits", _markov_slot, lambda be, a: heads.markov_logits(
        be, a["logits"], a["w1"], a["w2"], a["anchors"], a["picks"], 1, 3, a["drafts"], out=a["out"]),
         ("drafts", "out")),
]
OPS = {"argmax_rows", "greedy_accept", "markov_chain", "linear", "linear_fp8", "attention", "kv_commit", "gdn_scan", "snapshot_save",
       "snapshot_restore", "checkpoint_select", "sample_filtered", "filtered_probs", "speculative_accept",
       "coupled_accept", "pick_accept", "philox_random", "gdn_layer", "checkpoint_select_layers", "add_rmsnorm",
       "embed_rmsnorm", "swiglu", "attn_gate", "sigmoid_bias", "qk_prepare", "confidence_features", "gather_rows",
       "logit_scale", "rmsnorm", "rmsnorm_gated", "markov_logits"}
# every public op of dspark.ops, covered by CASES


def convert(tree, conv):
    """Every NumPy array in `tree` (dicts, lists, dataclasses) through conv."""
    if isinstance(tree, dict):
        return {k: convert(v, conv) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [convert(v, conv) for v in tree]
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return dataclasses.replace(tree, **{f.name: convert(getattr(tree, f.name), conv)
                                            for f in dataclasses.fields(tree)})
    return conv(tree) if isinstance(tree, np.ndarray) else tree


def host_bytes(x, to_host) -> list[tuple[str, tuple, bytes]]:
    """(dtype, shape, bytes) of every array in x, in order; NaNs compare by their bits."""
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return [b for v in x for b in host_bytes(v, to_host)]
    h = np.ascontiguousarray(to_host(x))
    return [(str(h.dtype), h.shape, h.tobytes())]


def run_case(case: Case, be, inputs: dict, conv, to_host) -> list:
    """The case on backend `be` with every array converted by `conv`; host bytes of the results."""
    args = convert(copy.deepcopy(inputs), conv)
    ret = case.run(be, args)
    return host_bytes(ret, to_host) + [b for w in case.writes for b in host_bytes(args[w], to_host)]
