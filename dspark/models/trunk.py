"""The hybrid trunk: embedding, blocks of [RMSNorm, mixer (gdn | attn), residual, RMSNorm, FFN
(a SwiGLU MLP, or a sparse mixture of experts: dspark.models.moe), residual], final norm, LM head.
Tap layers expose hidden states for the drafter.

One model code path for every checkpoint: the embedded byte-level trunk, Qwen3 (dense attention,
q/k norms), Qwen3.5 (gdn + gated attention with partial RoPE, zero-centred norms, several
value heads per key head) and their MoE models (the FFN kind per layer) are configurations of it (TrunkConfig; dspark.models.hf maps Hugging
Face checkpoints onto it).

One ragged forward serves every use: `prefill` (one session, many rows), `decode` (many sessions,
one row each) and `verify` (many sessions, vt rows each). New K/V rows go to a block scratch and
reach the cache through one `kv_commit` launch, so verify can commit only the accepted prefix.
Every op is row-invariant, so a verify column equals the decode step at the same position bitwise.

Prompt passes (`prefill`) on the kernel backends run each gdn layer in chunks of 64 on the absolute
position grid (dspark.ops.gdn_chunk, the WY form on tensor cores for 16-bit weights): a pass that
starts inside a chunk recomputes it from the state and inputs the cache kept at its start, so a
prompt split into passes anywhere gives bitwise the state and logits of one pass. Verify and decode
keep the sequential scan; a prompt pass over a cache they moved runs the scan up to the next chunk
boundary first. Plain decode and the speculative session prefill alike, so their streams stay
equal byte for byte.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from ..dtypes import BF16
from ..errors import CapacityError, ShapeError, TokenRangeError
from ..ops.attention import attention
from ..ops.checks import Staged
from ..ops.gate_linear import attn_gate_linear
from ..ops.fp8 import E4M3
from ..ops import gdn_chunk
from ..ops.gdn import ProjLayout, gdn_layer
from ..ops.kv_commit import kv_commit
from ..ops.linear import linear
from ..ops.norm import add_rmsnorm, embed_rmsnorm, rmsnorm_gated
from ..ops.rope import Heads, Rotary, qk_prepare
from ..ops.snapshot import checkpoint_select_layers
from ..ops.swiglu_linear import swiglu_linear
from ..ops.tables import PointerTable
from ..ops.workspace import Inputs, Workspace
from ..params import PROMPT_CHUNK
from .batch_tables import TableStore
from .cache import Cache
from .config import TrunkConfig
from .moe import moe_ffn, require_expert_storage
from .weights import OFFSET_NORMS, STORAGE, check_weights, load_model, random_weights, save_model, trunk_placeholders, \
    trunk_spec, trunk_to_backend


LOGITS = ("all", "last", "none")


@dataclass
class TrunkPass:
    """The result of a ragged trunk forward."""
    logits: object                  # [rows, V] f32
    taps: object                    # [rows, n_taps * d] f32: the outputs of tap_layers, in that order
    row_indptr: np.ndarray          # [B+1] host int32
    tap_layers: tuple = ()          # the layers whose outputs `taps` holds
    k_blk: list = field(default_factory=list)      # per attn layer [rows, Hkv, D]: the verify scratch
    v_blk: list = field(default_factory=list)
    gdn_inputs: list = field(default_factory=list)  # per gdn layer its projection [rows, width], when recorded
    state_ckpt: list = field(default_factory=list)  # per gdn layer [rows, H, dv, dk], when asked
    conv_ckpt: list = field(default_factory=list)   # per gdn layer [rows, C, 3]


@dataclass
class PromptPlan:
    """How a prompt pass runs each session's gdn columns (the same for every gdn layer): the first
    `seq[b]` by the sequential scan (a cache whose chunk tail a decode or verify invalidated, up to
    the next chunk boundary), the rest in chunks resuming `tails[b]` rows into the current chunk;
    `chunk_len[b]` is the cache's chunk_len after the pass."""
    seq: np.ndarray        # int32 [B]
    tails: np.ndarray      # int32 [B]
    chunk_len: np.ndarray  # int [B]
    seq_rows: object = None    # backend index arrays of the scanned / chunked rows (None: no scanned rows)
    chunk_rows: object = None
    seq_indptr: object = None  # Staged row pointers of those rows
    chunk_indptr: object = None
    schedule: object = None    # gdn_chunk.ChunkSchedule of the chunked rows: uploaded once for every gdn layer

    @classmethod
    def of(cls, be, caches: list[Cache], lens: np.ndarray) -> "PromptPlan":
        pos = np.array([c.pos for c in caches], np.int64)
        off = pos % gdn_chunk.CHUNK
        resumes = np.array([c.chunk_len for c in caches]) == off
        seq = np.where((off == 0) | resumes, 0, np.minimum(lens, gdn_chunk.CHUNK - off)).astype(np.int32)
        tails = np.where(resumes & (off > 0) & (seq == 0), off, 0).astype(np.int32)
        end = (pos + lens) % gdn_chunk.CHUNK
        chunk_len = np.where(lens == 0, [c.chunk_len for c in caches], np.where((lens > seq) | (end == 0), end, -1))
        plan = cls(seq, tails, chunk_len)
        if seq.any():
            starts = np.concatenate([[0], np.cumsum(lens)])[:-1]
            first = np.concatenate([s + np.arange(k) for s, k in zip(starts, seq)]).astype(np.int64)
            rest = np.concatenate([s + np.arange(k, n) for s, k, n in zip(starts, seq, lens)]).astype(np.int64)
            plan.seq_rows, plan.chunk_rows = be.xp.asarray(first), be.xp.asarray(rest)
            plan.seq_indptr = Staged(be, np.concatenate([[0], np.cumsum(seq)]).astype(np.int32))
            plan.chunk_indptr = Staged(be, np.concatenate([[0], np.cumsum(lens - seq)]).astype(np.int32))
        cols = np.concatenate([[0], np.cumsum(lens - seq)]).astype(np.int32)
        plan.schedule = gdn_chunk.ChunkSchedule(be, cols, tails)
        return plan


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
        n_tails = len(caches[0].tail) if caches else 0
        self.chunk_states = [PointerTable(be, [c.chunk_state[g] for c in caches], f"chunk_states[{g}]", writable=True)
                             for g in range(n_tails)]
        self.tails = [PointerTable(be, [c.tail[g] for c in caches], f"tails[{g}]", writable=True)
                      for g in range(n_tails)]
        # Every gdn layer's states and windows, layer-major: the rollback selects them all in one launch.
        self.all_states = PointerTable(be, [c.state[g] for g in range(n_gdn) for c in caches], "states", writable=True)
        self.all_convs = PointerTable(be, [c.conv[g] for g in range(n_gdn) for c in caches], "conv_windows",
                                      writable=True)


def storage(dtype) -> np.dtype:
    """The matrices' storage dtype on the backend (default float32)."""
    dtype = np.dtype(np.float32 if dtype is None else dtype)
    if dtype not in STORAGE:
        raise ValueError(f"dtype={dtype}: expected float32, float16 or bfloat16")
    return dtype


class HybridTrunk:
    def __init__(self, config: TrunkConfig, weights: dict[str, np.ndarray], backend, dtype=None, progress=None):
        """`weights` by our names (weights.trunk_spec), f32 / f16 / bf16 host arrays. `dtype` is
        the storage dtype of the matrices on the backend (default float32); vectors stay f32.
        f32 matrices multiply in f32; 16-bit ones, on the kernel backends, take the tensor-core
        GEMM (activations rounded to their type, f32 sums: dspark.ops.linear). FP8 linears
        (dspark.ops.fp8.Fp8Host, from an FP8 checkpoint) stay e4m3 and scales on the backend; on
        the kernel backends they multiply with `dtype` activations, so `dtype` is 16-bit there
        (dspark.models.hf.load_target picks it). `progress(name)`
        hears of each tensor on the backend."""
        check_weights(weights, trunk_spec(config), "trunk", dtypes=STORAGE + (E4M3,))  # E4M3: ops.fp8.Fp8Host
        dtype = storage(dtype)
        if "moe" in config.ffn_kinds:
            require_expert_storage(backend, dtype)
        self._setup(config, backend, dtype, weights, trunk_to_backend(backend, config, weights, dtype, progress))

    def _setup(self, config: TrunkConfig, backend, dtype, host_weights, w: dict) -> None:
        self.config = config
        self.be = backend
        self.weight_dtype = dtype
        self.host_weights = host_weights
        self.source = None  # a hf.LoadReport when loaded from a Hugging Face checkpoint
        self.w = w
        self._tables = TableStore()
        # The chunked prompt pass's operands: the weights' 16-bit type (tensor cores), else f32.
        self.chunk_dtype = dtype if dtype.itemsize == 2 else np.dtype(np.float32)
        self.chunked_gdn = (backend.kernels is not None and "gdn" in config.layers
                            and gdn_chunk.supported(config.gdn_dk, config.gdn_dv, self.chunk_dtype))
        self.prompt_chunk = PROMPT_CHUNK  # tokens per prompt pass (prompt_passes)
        c = config
        self.attn_heads = Heads.packed(c.attn_heads, c.attn_kv_heads, c.head_dim, c.attn_gate)
        self.rotary = Rotary.of(c.rope_dim, c.rope_theta, c.rope_scaling)
        self.inv_freq = backend.asarray(self.rotary.inv_freq)  # uploaded once: every pass's RoPE reads it
        self.gdn_layout = ProjLayout.packed(c.gdn_heads, c.gdn_dk, c.gdn_dv, c.gdn_key_heads)
        # Where the attention cuts each session's keys (dspark.ops.attention.SplitRule; None: the default).
        # A tuning knob, fixed for the trunk's life: the bits depend on it (within rounding). Tests
        # take short splits so that a context crosses several in a few rounds.
        self.attention_split = None

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
        return Cache(self.be, self.config, capacity, owner, chunk_tails=self.chunked_gdn)

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
                checkpoints: bool = False, taps=None, prompt: bool = False, logits: str = "all") -> TrunkPass:
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
        prompt (with commit): a prompt pass, whose gdn layers run in chunks where the backend has
        the kernels (module doc). logits: "all" rows', each session's "last" row's ([B, V]: what a
        prompt pass needs, its first token), or "none" (the LM head skipped: a prompt's earlier
        passes); the products are row-invariant, so a row's logits are the same bits either way.
        """
        if logits not in LOGITS:
            raise ValueError(f"logits={logits!r}: expected one of {LOGITS}")
        tap_layers = self.check_taps(taps)
        toks = [self.check_tokens(t, f"tokens[{b}]") for b, t in enumerate(tokens)]
        lens = np.array([t.size for t in toks], np.int32)
        for b, cache in enumerate(caches):
            if cache.pos + lens[b] > cache.capacity:
                raise CapacityError(f"tokens[{b}]: {lens[b]} rows at pos {cache.pos} exceed the cache capacity "
                                    f"{cache.capacity}")
        rows = int(lens.sum())
        chunked = PromptPlan.of(self.be, caches, lens) if prompt and commit and self.chunked_gdn else None
        inp = self.pass_inputs(len(caches), rows)
        self.fill(inp, caches, np.concatenate(toks) if toks else np.zeros(0, np.int32), lens, keep=lens).upload()
        out = self.run_pass(self.tables(caches), inp, rows, commit=commit, record_gdn=record_gdn,
                            checkpoints=checkpoints, taps=tap_layers, ws=Workspace(self.be, rows), prompt=chunked,
                            logits=logits)
        if commit:
            for b, (cache, n) in enumerate(zip(caches, lens)):
                cache.pos += int(n)
                if self.chunked_gdn:  # the chunk tails describe the live state after a chunked pass only
                    cache.chunk_len = int(chunked.chunk_len[b]) if chunked is not None else cache.chunk_len if not n \
                        else -1
        return out

    def pass_inputs(self, sessions: int, rows: int) -> Inputs:
        """A pass's per-pass arrays (pass_fields), in one upload."""
        return Inputs(self.be, self.pass_fields(sessions, rows))

    def pass_fields(self, sessions: int, rows: int) -> dict:
        """The per-pass arrays of `sessions` sessions and `rows` rows: token ids, committed rows
        (pos), row pointer, cache rows (capacity), rows to commit (keep) and, for kv_commit, every
        attention layer's cache rows (commit_capacity)."""
        attn = self.config.layers.count("attn")
        return {"ids": (rows, np.int32), "pos": (sessions, np.int32), "indptr": (sessions + 1, np.int32),
                "capacity": (sessions, np.int32), "keep": (sessions, np.int32),
                "commit_capacity": (attn * sessions, np.int32)}

    def fill(self, inp: Inputs, caches: list[Cache], ids, lens, keep) -> Inputs:
        """Write one pass's arrays (host side): ids [rows], rows per session `lens` [B] (their row
        pointer), the caches' positions and capacities, and `keep` [B] rows to commit."""
        cap = np.array([cc.capacity for cc in caches], np.int32)
        return inp.set(ids=ids, pos=[cc.pos for cc in caches], indptr=np.concatenate([[0], np.cumsum(lens)]),
                       capacity=cap, keep=keep, commit_capacity=np.tile(cap, self.config.layers.count("attn")))

    def run_pass(self, tables: "TrunkTables", inp: Inputs, rows: int, *, commit: bool, record_gdn: bool = False,
                 checkpoints: bool = False, taps=None, ws: Workspace, reach: int | None = None,
                 prompt: "PromptPlan | None" = None, logits: str = "all") -> TrunkPass:
        """The device work of one forward over `rows` rows (forward's doc), reading every per-pass
        value from `inp` and writing every output and temporary into `ws`; nothing on the host
        changes (the caller advances pos). What a round's programs record: `reach` sizes the
        attention grids for the positions later rounds will have (dspark.ops.attention). A prompt
        pass (`prompt`, its PromptPlan) runs the gdn layers in chunks; it is never recorded."""
        c, be, w = self.config, self.be, self.w
        taps = self.config.tap_layers if taps is None else taps
        d, eps = c.d_model, c.norm_eps
        indptr = inp["indptr"].host.copy()
        out = TrunkPass(logits=None, taps=ws.take("taps", rows, (len(taps) * d,)), row_indptr=indptr, tap_layers=taps)
        tap_at = {layer: (out.taps, i * d) for i, layer in enumerate(taps)}
        norms = [w[f"layers.{i}.norm1"] for i in range(len(c.layers))] + [w["final_norm"]]
        x, h = ws.take("x", rows, (d,)), ws.take("h", rows, (d,))
        embed_rmsnorm(be, w["embed"], inp["ids"], norms[0], eps, x=x, out=h, tap=tap_at.get(-1), ws=ws)
        ia = ig = 0
        ffn = c.ffn_kinds
        for i, kind in enumerate(c.layers):
            p = f"layers.{i}."
            if kind == "attn":
                y = self._attention(h, p, tables, ia, inp, out, ws, reach)
                ia += 1
            else:
                y = self._gdn(h, p, tables, ig, inp, out, commit, record_gdn, checkpoints, ws, prompt)
                ig += 1
            add_rmsnorm(be, x, y, w[p + "norm2"], eps, out=h, ws=ws)
            if ffn[i] == "moe":
                y = moe_ffn(self, h, p, i, ws)
            else:
                gate_up = linear(be, h, w[p + "mlp.w_gate_up"], out=ws.take("mlp.gate_up", rows, (2 * c.mlp_hidden,)),
                                 ws=ws)
                y = swiglu_linear(be, gate_up, w[p + "mlp.w_down"], out=ws.take("sublayer", rows, (d,)), ws=ws)
            add_rmsnorm(be, x, y, norms[i + 1], eps, out=h, tap=tap_at.get(i), ws=ws)  # h: the next norm1, or the final norm
        if logits == "last":  # each session's last row (row-invariant products: the same bits as "all")
            lens = np.diff(indptr)
            h = h[be.xp.asarray(indptr[1:][lens > 0] - 1)]
        if logits != "none":
            out.logits = linear(be, h, w["lm_head"], out=ws.take("logits", h.shape[0], (c.vocab,)), ws=ws)
        if commit:
            self._commit(tables, out, inp, ws)
        return out

    def check_taps(self, taps) -> tuple[int, ...]:
        if taps is None:
            return self.config.tap_layers
        n = len(self.config.layers)
        t = tuple(int(i) for i in taps)
        if not t or any(not -1 <= i < n for i in t) or len(set(t)) != len(t):
            raise ShapeError(f"taps={tuple(taps)}: expected one or more layer indices in [-1, {n}) "
                             f"(-1: the embedding), each once")
        return t

    def _attention(self, h, p, tables, ia, inp, out, ws, reach):
        c, w, be = self.config, self.w, self.be
        rows, H, D, Hkv = h.shape[0], c.attn_heads, c.head_dim, c.attn_kv_heads
        heads = self.attn_heads
        qkv = linear(be, h, w[p + "attn.wqkv"], out=ws.take("attn.qkv", rows, (heads.width,)), ws=ws)
        kv_dtype = tables.k[ia].dtype or np.dtype(np.float32)
        # q (and the gate beside it), k and v: normed, rotated at each row's position, in the K/V dtype.
        q, k, v = qk_prepare(be, qkv, heads, self.rotary, inp["pos"], inp["indptr"],
                             q_norm=w[p + "attn.q_norm"] if c.qk_norm else None,
                             k_norm=w[p + "attn.k_norm"] if c.qk_norm else None, eps=c.norm_eps,
                             inv_freq=self.inv_freq, q=ws.take("attn.q", rows, (H, D), kv_dtype),
                             k=ws.take(f"attn.k.{ia}", rows, (Hkv, D), kv_dtype),
                             v=ws.take(f"attn.v.{ia}", rows, (Hkv, D), kv_dtype), dtype=kv_dtype)
        out.k_blk.append(k)
        out.v_blk.append(v)
        o = attention(be, q, k, v, tables.k[ia], tables.v[ia], inp["pos"], inp["indptr"], mode="causal",
                      out=ws.take("attn.o", rows, (H, D), kv_dtype), capacity=inp["capacity"], reach=reach, ws=ws,
                      split=self.attention_split)
        # per head [q (D) | gate (D)], as Qwen3.5's q_proj writes them; o widened (and gated) in the product's stage
        return attn_gate_linear(be, o, w[p + "attn.wo"], (qkv, D, 2 * D) if c.attn_gate else None,
                                out=ws.take("sublayer", rows, (c.d_model,)), ws=ws)

    def _gdn(self, h, p, tables, ig, inp, out, commit, record, checkpoints, ws, prompt=None):
        c, w = self.config, self.w
        rows, H, dv = h.shape[0], c.gdn_heads, c.gdn_dv
        # One GEMM: [qkv (C) | z (H dv) | a (H) | b (H)]; a replay reads a layer's again (its own buffer).
        proj = linear(self.be, h, w[p + "gdn.w_in"], out=ws.take(f"gdn.proj.{ig}" if record else "gdn.proj", rows,
                                                                  (self.gdn_layout.b + H,)), ws=ws)
        sck = cck = None
        if checkpoints:
            sck = ws.take(f"gdn.state_ckpt.{ig}", rows, (H, dv, c.gdn_dk))
            cck = ws.take(f"gdn.conv_ckpt.{ig}", rows, (c.gdn_channels, c.conv_kernel - 1))
            out.state_ckpt.append(sck)
            out.conv_ckpt.append(cck)
        if record:
            out.gdn_inputs.append(proj)
        if prompt is not None:
            o = self._prompt_scan(p, proj, tables, ig, inp["indptr"], prompt)
        else:
            o = self._scan(p, proj, tables.states[ig], tables.convs[ig], inp["indptr"], commit=commit, state_ckpt=sck,
                           conv_ckpt=cck, o_norm=w[p + "gdn.o_norm"], out=ws.take("gdn.o", rows, (H, dv)), ws=ws)
        return linear(self.be, o.reshape(rows, H * dv), w[p + "gdn.wo"], out=ws.take("sublayer", rows, (c.d_model,)),
                      ws=ws)

    def _scan(self, p, proj, states, convs, indptr, **kw):
        c, w = self.config, self.w
        return gdn_layer(self.be, proj, w[p + "gdn.conv"], w[p + "gdn.A_log"], w[p + "gdn.dt_bias"], states, convs, indptr,
                        heads=c.gdn_heads, dk=c.gdn_dk, dv=c.gdn_dv, k_heads=c.gdn_key_heads, layout=self.gdn_layout,
                        eps=c.norm_eps, **kw)

    def _prompt_scan(self, p, proj, tables, ig, indptr, plan: PromptPlan):
        """One gdn layer of a prompt pass: the scanned columns (plan.seq), then the chunks; then
        the gated output norm of every column."""
        c, w, xp, L = self.config, self.w, self.be.xp, self.gdn_layout
        H, dv, C = c.gdn_heads, c.gdn_dv, c.gdn_channels
        mixed = xp.ascontiguousarray(proj[:, L.mixed : L.mixed + C])
        a = xp.ascontiguousarray(proj[:, L.a : L.a + H])
        b = xp.ascontiguousarray(proj[:, L.b : L.b + H])

        def chunks(mixed, a, b, indptr):
            return gdn_chunk.gdn_prompt(self.be, mixed, a, b, w[p + "gdn.conv"], w[p + "gdn.A_log"], w[p + "gdn.dt_bias"],
                                        tables.states[ig], tables.convs[ig], tables.chunk_states[ig], tables.tails[ig],
                                        indptr, plan.schedule, heads=H, dk=c.gdn_dk, dv=dv,
                                        k_heads=c.gdn_key_heads, dtype=self.chunk_dtype)
        if plan.seq_rows is None:
            o = chunks(mixed, a, b, indptr)
        else:
            o = xp.empty((mixed.shape[0], H, dv), np.float32)
            s, r = plan.seq_rows, plan.chunk_rows
            o[s] = self._scan(p, proj[s], tables.states[ig], tables.convs[ig], plan.seq_indptr)
            o[r] = chunks(mixed[r], a[r], b[r], plan.chunk_indptr)
        return rmsnorm_gated(self.be, o, proj, w[p + "gdn.o_norm"], c.norm_eps, column=L.z)

    def replay(self, caches: list[Cache], tp: TrunkPass, starts, keep, *, ws=None, inp=None) -> None:
        """Advance each session's gdn state by the first keep[b] columns a verify recorded for
        session b (its columns start at row starts[b] of tp), from the state before the verify
        (a verify never writes it): the scan again over the recorded projections, keep[b] columns
        of each session (`inp`: a pass's Inputs whose indptr and keep say so, else made here)."""
        if inp is None:
            inp = self.pass_inputs(len(caches), 0)
            starts = np.asarray(starts, np.int64)
            bounds = np.concatenate([starts, [tp.row_indptr[-1]]]).astype(np.int32)
            inp.set(indptr=bounds, keep=np.asarray(keep, np.int32)).upload()
        tables = self.tables(caches)
        gdn_layers = [i for i, kind in enumerate(self.config.layers) if kind == "gdn"]
        for gi, (i, proj) in enumerate(zip(gdn_layers, tp.gdn_inputs)):
            self._scan(f"layers.{i}.", proj, tables.states[gi], tables.convs[gi], inp["indptr"], col_count=inp["keep"],
                       want_out=False, ws=ws)
        moved(caches, inp["keep"].host)

    def select(self, caches: list[Cache], tp: TrunkPass, keep, *, inp=None) -> None:
        """Set each session's gdn state to the checkpoint after its first keep[b] verify columns
        (keep 0: the state before the verify, which a verify never writes), every gdn layer in one
        launch (`inp`: a pass's Inputs holding indptr and keep, else made here)."""
        if not tp.state_ckpt:
            return
        if inp is None:
            inp = self.pass_inputs(len(caches), 0)
            inp.set(indptr=tp.row_indptr, keep=np.asarray(keep, np.int32)).upload()
        tables = self.tables(caches)
        checkpoint_select_layers(self.be, tp.state_ckpt, tp.conv_ckpt, tables.all_states, tables.all_convs,
                                 inp["indptr"], inp["keep"])
        moved(caches, inp["keep"].host)

    def commit_rows(self, caches: list[Cache], tp: TrunkPass, keep) -> None:
        """Copy rows [0, keep[b]) of each session's scratch into its cache (all attention layers,
        one launch) and advance pos by keep[b]."""
        keep = np.asarray(keep, np.int32)
        inp = self.pass_inputs(len(caches), 0)
        self.fill(inp, caches, np.zeros(0, np.int32), np.diff(tp.row_indptr), keep).upload()
        self._commit(self.tables(caches), tp, inp, None)
        for cc, n in zip(caches, keep):
            cc.pos += int(n)

    def _commit(self, tables, tp: TrunkPass, inp: Inputs, ws) -> None:
        """kv_commit of inp's `keep` rows of every session, every attention layer, one launch."""
        if not tp.k_blk:
            return
        n_attn, B = len(tp.k_blk), len(inp["pos"].host)
        caches = tables.commit.arrays
        blk_table = PointerTable(self.be, [*tp.k_blk, *tp.v_blk], "verify scratch")
        kv_commit(self.be, tp.k_blk, tp.v_blk, [list(caches[i * B : (i + 1) * B]) for i in range(n_attn)],
                  [list(caches[(n_attn + i) * B : (n_attn + i + 1) * B]) for i in range(n_attn)], inp["pos"],
                  inp["keep"], inp["indptr"], table=tables.commit, blk_table=blk_table, capacity=inp["commit_capacity"])

    # ---- entry points used by the session layer -----------------------------------------------
    def prefill(self, cache: Cache, tokens, taps=None) -> TrunkPass:
        """One prompt pass over all of `tokens`: every row's logits and taps (tests, tools). A
        request's prompt goes through `prompt_passes`, in bounded memory."""
        return self.forward([cache], [tokens], commit=True, taps=taps, prompt=True)

    def prompt_passes(self, cache: Cache, tokens, taps=None, chunk: int | None = None) -> Iterator[TrunkPass]:
        """The prompt in passes of at most `chunk` tokens (default self.prompt_chunk), so the
        activations and scratch are bounded by the pass, not the prompt: each pass's TrunkPass
        with its taps; the last one's logits are its last row's [1, V] (the boundary logits), the
        others' None. Split invariance makes the result the same bits as one pass. The whole
        prompt is checked against the cache before the first pass moves anything."""
        t = self.check_tokens(tokens, "tokens")
        chunk = self.prompt_chunk if chunk is None else chunk
        if not isinstance(chunk, (int, np.integer)) or isinstance(chunk, bool) or chunk < 1:
            raise ValueError(f"chunk={chunk!r}: expected a number of tokens >= 1")
        if cache.pos + t.size > cache.capacity:
            raise CapacityError(f"tokens: {t.size} rows at pos {cache.pos} exceed the cache capacity {cache.capacity}")
        for i in range(0, t.size, int(chunk)):
            last = i + chunk >= t.size
            yield self.forward([cache], [t[i : i + chunk]], commit=True, taps=taps, prompt=True,
                               logits="last" if last else "none")

    def decode(self, caches: list[Cache], tokens, taps=None) -> TrunkPass:
        """One row per session."""
        return self.forward(caches, [[t] for t in np.asarray(tokens).reshape(-1)], commit=True, taps=taps)

    def verify(self, caches: list[Cache], cand: list, *, checkpoints: bool = True, taps=None) -> TrunkPass:
        """Ragged candidate blocks; K/V stay in the scratch and the gdn state stays as it was. With
        checkpoints the state after every column is kept (`select`); the scan inputs always
        (`replay`)."""
        return self.forward(caches, cand, commit=False, record_gdn=True, checkpoints=checkpoints, taps=taps)


def moved(caches: list[Cache], keep) -> None:
    """A rollback moved the recurrent state of the sessions that kept columns: their chunk tails no
    longer describe it."""
    for cache, k in zip(caches, np.asarray(keep).reshape(-1)):
        if k:
            cache.chunk_len = -1
