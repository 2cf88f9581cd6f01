"""The hybrid trunk: embedding, blocks of [RMSNorm, mixer (gdn | attn), residual, RMSNorm, SwiGLU
MLP, residual], final norm, LM head. Tap layers expose hidden states for the drafter.

One model code path for every checkpoint: the embedded byte-level trunk, Qwen3 (dense attention,
q/k norms) and Qwen3.5 (gdn + gated attention with partial RoPE, zero-centred norms, several
value heads per key head) are configurations of it (TrunkConfig; dspark.models.hf maps Hugging
Face checkpoints onto it).

One ragged forward serves every use: `prefill` (one session, many rows), `decode` (many sessions,
one row each) and `verify` (many sessions, vt rows each). New K/V rows go to a block scratch and
reach the cache through one `kv_commit` launch, so verify can commit only the accepted prefix.
Every op is row-invariant, so a verify column equals the decode step at the same position bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..dtypes import BF16
from ..errors import CapacityError, ShapeError, TokenRangeError
from ..ops import dense
from ..ops.attention import attention
from ..ops.checks import Staged
from ..ops.gdn import gdn_scan
from ..ops.kv_commit import kv_commit
from ..ops.linear import linear
from ..ops.norm import rmsnorm
from ..ops.snapshot import checkpoint_select
from ..ops.tables import PointerTable
from .batch_tables import TableStore
from .cache import Cache
from .config import TrunkConfig
from .weights import OFFSET_NORMS, STORAGE, check_weights, load_model, random_weights, save_model, trunk_placeholders, \
    trunk_spec, trunk_to_backend


@dataclass
class GdnInputs:
    """What one gdn layer's scan consumed in a verify pass: enough to replay any prefix."""
    mixed: object   # [cols, C]
    a: object       # [cols, H]
    b: object       # [cols, H]


@dataclass
class TrunkPass:
    """The result of a ragged trunk forward."""
    logits: object                  # [rows, V] f32
    taps: object                    # [rows, n_taps * d] f32: the outputs of tap_layers, in that order
    row_indptr: np.ndarray          # [B+1] host int32
    tap_layers: tuple = ()          # the layers whose outputs `taps` holds
    k_blk: list = field(default_factory=list)      # per attn layer [rows, Hkv, D]: the verify scratch
    v_blk: list = field(default_factory=list)
    gdn_inputs: list = field(default_factory=list)  # per gdn layer, when recorded
    state_ckpt: list = field(default_factory=list)  # per gdn layer [rows, H, dv, dk], when asked
    conv_ckpt: list = field(default_factory=list)   # per gdn layer [rows, C, 3]


class TrunkTables:
    """One batch's pointer tables: per attention layer the sessions' K and V caches, per gdn
    layer their states and conv windows, and every K/V cache for kv_commit (k then v, layer by
    layer)."""

    def __init__(self, be, caches: list[Cache]):
        n_attn = len(caches[0].k) if caches else 0
        n_gdn = len(caches[0].state) if caches else 0
        self.k = [PointerTable(be, [c.k[i] for c in caches], f"k_caches[{i}]", writable=True) for i in range(n_attn)]
        self.v = [PointerTable(be, [c.v[i] for c in caches], f"v_caches[{i}]", writable=True) for i in range(n_attn)]
        self.states = [PointerTable(be, [c.state[g] for c in caches], f"states[{g}]", writable=True)
                       for g in range(n_gdn)]
        self.convs = [PointerTable(be, [c.conv[g] for c in caches], f"conv_windows[{g}]", writable=True)
                      for g in range(n_gdn)]
        self.commit = PointerTable(be, [c.k[i] for i in range(n_attn) for c in caches]
                                   + [c.v[i] for i in range(n_attn) for c in caches], "kv caches", writable=True)


def storage(dtype) -> np.dtype:
    """The matrices' storage dtype on the backend (default float32)."""
    dtype = np.dtype(np.float32 if dtype is None else dtype)
    if dtype not in STORAGE:
        raise ValueError(f"dtype={dtype}: expected float32, float16 or bfloat16")
    return dtype


class HybridTrunk:
    def __init__(self, config: TrunkConfig, weights: dict[str, np.ndarray], backend, dtype=None, progress=None):
        """`weights` by our names (weights.trunk_spec), f32 / f16 / bf16 host arrays. `dtype` is
        the storage dtype of the matrices on the backend (default float32); vectors stay f32 and
        all math is f32 (dspark.ops.linear). `progress(name)` hears of each tensor on the backend."""
        check_weights(weights, trunk_spec(config), "trunk", dtypes=STORAGE)
        dtype = storage(dtype)
        self._setup(config, backend, dtype, weights, trunk_to_backend(backend, config, weights, dtype, progress))

    def _setup(self, config: TrunkConfig, backend, dtype, host_weights, w: dict) -> None:
        self.config = config
        self.be = backend
        self.weight_dtype = dtype
        self.host_weights = host_weights
        self.source = None  # a hf.LoadReport when loaded from a Hugging Face checkpoint
        self.w = w
        self._tables = TableStore()

    # ---- construction and files ---------------------------------------------------------------
    @classmethod
    def random(cls, config: TrunkConfig, seed: int, backend=None) -> "HybridTrunk":
        """Random weights for tests, on `backend` (default: dspark.get_backend())."""
        if backend is None:
            from ..backends import get_backend
            backend = get_backend()
        weights = random_weights(trunk_spec(config), seed)
        for name in weights:
            if config.norm_offset and name.rsplit(".", 1)[-1] in OFFSET_NORMS:
                weights[name] -= np.float32(config.norm_offset)  # stored zero-centred, same effective norms
        return cls(config, weights, backend)

    @classmethod
    def placeholder(cls, config: TrunkConfig, backend, dtype=None) -> "HybridTrunk":
        """A trunk whose weights have the right shapes, dtypes and layout but no values (no host
        copy, nothing read): what profiling/host_round.py times the host path of a round with, at
        Qwen3.5-27B's real shapes on the CuPy stand-in's null memory."""
        t = object.__new__(cls)
        dtype = storage(dtype)
        t._setup(config, backend, dtype, None, trunk_placeholders(backend, config, dtype))
        return t

    @classmethod
    def load(cls, directory, backend, name: str = "trunk") -> "HybridTrunk":
        config, tensors = load_model(directory, name, TrunkConfig)
        return cls(config, tensors, backend)

    def save(self, directory, name: str = "trunk", fmt: str = "safetensors") -> None:
        # bf16 (a Hugging Face checkpoint's) is written widened: NumPy's file writers have no bf16
        save_model(directory, name, self.config,
                   {k: np.asarray(v, np.float32 if v.dtype == BF16 else v.dtype) for k, v in self.host_weights.items()},
                   fmt)

    def new_cache(self, capacity: int | None = None, owner: str | None = None) -> Cache:
        return Cache(self.be, self.config, capacity, owner)

    # ---- validation ---------------------------------------------------------------------------
    def check_tokens(self, tokens, what: str) -> np.ndarray:
        t = np.asarray(tokens)
        if t.ndim != 1:
            raise ShapeError(f"{what} has shape {t.shape}: expected a 1-D sequence of token ids")
        if t.size and t.dtype.kind not in "iu":
            raise TokenRangeError(f"{what} has dtype {t.dtype}: expected integer token ids")
        bad = np.flatnonzero((t < 0) | (t >= self.config.vocab))
        if bad.size:
            i = int(bad[0])
            raise TokenRangeError(f"{what}[{i}]={int(t[i])} is outside the vocabulary [0, {self.config.vocab})")
        return t.astype(np.int32)

    # ---- pointer tables, per batch ------------------------------------------------------------
    def tables(self, caches: list[Cache]) -> "TrunkTables":
        """The pointer tables of this batch of caches, made once per batch (batch_tables)."""
        return self._tables.get(tuple(c.version for c in caches), lambda: TrunkTables(self.be, caches))

    # ---- the forward --------------------------------------------------------------------------
    def forward(self, caches: list[Cache], tokens: list, *, commit: bool, record_gdn: bool = False,
                checkpoints: bool = False, taps=None) -> TrunkPass:
        """Run `tokens[b]` at positions caches[b].pos.. for every session b.

        commit=True copies every new K/V row into the caches, advances pos and the gdn state
        (prefill, decode). commit=False (verify) leaves the caches alone: the K/V rows stay in the
        returned scratch for `commit_rows`, and the gdn scans read the live state without writing
        it; the round's rollback then moves it on by exactly the kept columns (`select` from the
        per-column checkpoints, or `replay` of the recorded scan inputs), so a round that fails
        before then leaves every cache as it was. record_gdn keeps the scan inputs for replay,
        checkpoints keeps the state after each column.
        taps: the layers whose outputs (hidden_states[layer + 1] in transformers' terms; -1 is the
        embedding, hidden_states[0]) make TrunkPass.taps, in that order; default config.tap_layers.
        The session passes its drafter's, so one loaded target serves any drafter.
        """
        c, be, w = self.config, self.be, self.w
        xp = be.xp
        tap_layers = self.check_taps(taps)
        toks = [self.check_tokens(t, f"tokens[{b}]") for b, t in enumerate(tokens)]
        lens = np.array([t.size for t in toks], np.int32)
        for b, cache in enumerate(caches):
            if cache.pos + lens[b] > cache.capacity:
                raise CapacityError(f"tokens[{b}]: {lens[b]} rows at pos {cache.pos} exceed the cache capacity "
                                    f"{cache.capacity}")
        indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        pos = np.array([cache.pos for cache in caches], np.int32)
        positions = np.concatenate([p + np.arange(n) for p, n in zip(pos, lens)]).astype(np.int64) if len(lens) else np.zeros(0, np.int64)
        ids = xp.asarray(np.concatenate(toks) if toks else np.zeros(0, np.int32))
        staged = Staged(be, indptr)  # validated on the host, uploaded once for every gdn layer
        tables = self.tables(caches)
        rope = dense.rope_table(xp, xp.asarray(positions), c.rope_theta, c.rope_dim, c.rope_scaling) \
            if "attn" in c.layers else None  # one table for every attention layer's q and k
        x = dense.widen(w["embed"][ids])
        out = TrunkPass(logits=None, taps=None, row_indptr=indptr, tap_layers=tap_layers)
        taps_of = {-1: x}
        ia = ig = 0
        for i, kind in enumerate(c.layers):
            p = f"layers.{i}."
            h = rmsnorm(be, x, w[p + "norm1"], c.norm_eps)
            if kind == "attn":
                x = x + self._attention(h, p, caches, tables, ia, pos, indptr, rope, out)
                ia += 1
            else:
                x = x + self._gdn(h, p, tables, ig, staged, out, commit, record_gdn, checkpoints)
                ig += 1
            h = rmsnorm(be, x, w[p + "norm2"], c.norm_eps)
            gate_up = linear(self.be, h, w[p + "mlp.w_gate_up"])
            F = gate_up.shape[1] // 2
            x = x + linear(self.be, dense.swiglu(gate_up[:, :F], gate_up[:, F:]), w[p + "mlp.w_down"])
            if i in tap_layers:
                taps_of[i] = x
        out.taps = xp.concatenate([taps_of[i] for i in tap_layers], axis=1)
        out.logits = linear(self.be, rmsnorm(be, x, w["final_norm"], c.norm_eps), w["lm_head"])
        if commit:
            self.commit_rows(caches, out, lens)
        return out

    def check_taps(self, taps) -> tuple[int, ...]:
        if taps is None:
            return self.config.tap_layers
        n = len(self.config.layers)
        t = tuple(int(i) for i in taps)
        if not t or any(not -1 <= i < n for i in t):
            raise ShapeError(f"taps={tuple(taps)}: expected one or more layer indices in [-1, {n}) "
                             f"(-1: the embedding)")
        return t

    def _attention(self, h, p, caches, tables, ia, pos, indptr, rope, out):
        c, w, be = self.config, self.w, self.be
        rows, H, D, Hkv = h.shape[0], c.attn_heads, c.head_dim, c.attn_kv_heads
        qkv = linear(self.be, h, w[p + "attn.wqkv"])  # one GEMM: [q (and gate) | k | v]
        nq = H * D * (2 if c.attn_gate else 1)
        q, k, v = qkv[:, :nq], qkv[:, nq : nq + Hkv * D], qkv[:, nq + Hkv * D :]
        gate = None
        if c.attn_gate:  # per head [q (D) | gate (D)], as transformers' Qwen3.5 chunks q_proj's output
            q = q.reshape(rows, H, 2 * D)
            q, gate = q[..., :D], q[..., D:].reshape(rows, H * D)
        q = q.reshape(rows, H, D)
        k = k.reshape(rows, Hkv, D)
        v = v.reshape(rows, Hkv, D)
        if c.qk_norm:
            q = rmsnorm(be, q, w[p + "attn.q_norm"], c.norm_eps)
            k = rmsnorm(be, k, w[p + "attn.k_norm"], c.norm_eps)
        q = dense.rope(q, None, c.rope_theta, c.rope_dim, c.rope_scaling, table=rope)
        k = dense.rope(k, None, c.rope_theta, c.rope_dim, c.rope_scaling, table=rope)
        kv_dtype = caches[0].k[ia].dtype if caches else np.float32
        q, k, v = (a.astype(kv_dtype) for a in (q, k, v))
        out.k_blk.append(k)
        out.v_blk.append(v)
        o = attention(be, q, k, v, tables.k[ia], tables.v[ia], pos, indptr, mode="causal")
        o = o.reshape(rows, -1).astype(np.float32)
        if gate is not None:
            o = o * dense.sigmoid(gate)
        return linear(self.be, o, w[p + "attn.wo"])

    def _gdn(self, h, p, tables, ig, staged, out, commit, record, checkpoints):
        c, w, xp = self.config, self.w, self.be.xp
        rows, H, dv, C = h.shape[0], c.gdn_heads, c.gdn_dv, c.gdn_channels
        proj = linear(self.be, h, w[p + "gdn.w_in"])  # one GEMM: [qkv (C) | z (H dv) | a (H) | b (H)]
        mixed = xp.ascontiguousarray(proj[:, :C])
        z = proj[:, C : C + H * dv].reshape(rows, H, dv)
        a = xp.ascontiguousarray(proj[:, C + H * dv : C + H * dv + H])
        b = xp.ascontiguousarray(proj[:, C + H * dv + H :])
        sck = cck = None
        if checkpoints:
            sck = xp.empty((rows, H, dv, c.gdn_dk), np.float32)
            cck = xp.empty((rows, C, c.conv_kernel - 1), np.float32)
            out.state_ckpt.append(sck)
            out.conv_ckpt.append(cck)
        if record:
            out.gdn_inputs.append(GdnInputs(mixed, a, b))
        o = self._scan(p, mixed, a, b, tables.states[ig], tables.convs[ig], staged, commit=commit, state_ckpt=sck,
                       conv_ckpt=cck)
        o = rmsnorm(self.be, o, w[p + "gdn.o_norm"], c.norm_eps) * dense.silu(z)
        return linear(self.be, o.reshape(rows, H * dv), w[p + "gdn.wo"])

    def _scan(self, p, mixed, a, b, states, convs, indptr, **kw):
        c, w = self.config, self.w
        return gdn_scan(self.be, mixed, a, b, w[p + "gdn.conv"], w[p + "gdn.A_log"], w[p + "gdn.dt_bias"], states,
                        convs, indptr, heads=c.gdn_heads, dk=c.gdn_dk, dv=c.gdn_dv, k_heads=c.gdn_key_heads, **kw)

    def replay(self, caches: list[Cache], tp: TrunkPass, starts, keep) -> None:
        """Advance each session's gdn state by the first keep[b] columns a verify recorded for
        session b (its columns start at row starts[b] of tp), from the state before the verify
        (a verify never writes it)."""
        rows = self.be.xp.asarray(np.concatenate([s + np.arange(k) for s, k in zip(starts, keep)]).astype(np.int64))
        staged = Staged(self.be, np.concatenate([[0], np.cumsum(keep)]).astype(np.int32))
        tables = self.tables(caches)
        gdn_layers = [i for i, kind in enumerate(self.config.layers) if kind == "gdn"]
        for gi, (i, inp) in enumerate(zip(gdn_layers, tp.gdn_inputs)):
            self._scan(f"layers.{i}.", inp.mixed[rows], inp.a[rows], inp.b[rows], tables.states[gi],
                       tables.convs[gi], staged)

    def select(self, caches: list[Cache], tp: TrunkPass, keep) -> None:
        """Set each session's gdn state to the checkpoint after its first keep[b] verify columns
        (keep 0: the state before the verify, which a verify never writes)."""
        tables = self.tables(caches)
        indptr, keep = Staged(self.be, tp.row_indptr), Staged(self.be, np.asarray(keep, np.int32))
        for g in range(len(tp.state_ckpt)):
            checkpoint_select(self.be, tp.state_ckpt[g], tp.conv_ckpt[g], tables.states[g], tables.convs[g], indptr,
                              keep, committed=False)

    def commit_rows(self, caches: list[Cache], tp: TrunkPass, keep) -> None:
        """Copy rows [0, keep[b]) of each session's scratch into its cache (all attention layers,
        one launch) and advance pos by keep[b]."""
        keep = np.asarray(keep, np.int32)
        pos = np.array([cc.pos for cc in caches], np.int32)
        if tp.k_blk:
            kv_commit(self.be, tp.k_blk, tp.v_blk, [[cc.k[i] for cc in caches] for i in range(len(tp.k_blk))],
                      [[cc.v[i] for cc in caches] for i in range(len(tp.v_blk))], pos, keep, tp.row_indptr,
                      table=self.tables(caches).commit)
        for cc, n in zip(caches, keep):
            cc.pos += int(n)

    # ---- entry points used by the session layer -----------------------------------------------
    def prefill(self, cache: Cache, tokens, taps=None) -> TrunkPass:
        return self.forward([cache], [tokens], commit=True, taps=taps)

    def decode(self, caches: list[Cache], tokens, taps=None) -> TrunkPass:
        """One row per session."""
        return self.forward(caches, [[t] for t in np.asarray(tokens).reshape(-1)], commit=True, taps=taps)

    def verify(self, caches: list[Cache], cand: list, *, checkpoints: bool = True, taps=None) -> TrunkPass:
        """Ragged candidate blocks; K/V stay in the scratch and the gdn state stays as it was. With
        checkpoints the state after every column is kept (`select`); the scan inputs always
        (`replay`)."""
        return self.forward(caches, cand, commit=False, record_gdn=True, checkpoints=checkpoints, taps=taps)
