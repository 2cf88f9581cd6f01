"""The block drafter: one model code for the embedded drafter, DeepSpec DSpark, z-lab DFlash /
DFlash2 and speculators checkpoints, configured by DrafterConfig (dspark.models.hf loads the
released formats; each is a mapping onto these names).

Context: each committed trunk row's taps (the target's hidden_states[t + 1] for each tap layer t,
concatenated) become a feature f = norm(fc(taps)). Every drafter layer projects f to K (k_norm,
RoPE at the row's absolute position: default, linear or YaRN as transformers computes it) and V and
keeps them in a ring of `window + block` rows (the draft KV), whatever the context. Context rows do NOT pass the layer's input norm, and f is the same for every layer (as
in all three references). Only committed rows are ever ingested.

Block: one parallel pass over [anchor, MASK x (b-1)] at positions pos..pos+b-1, embedded with the
trunk's embedding (or the checkpoint's own copy) times embed_scale. Each layer: h = norm1(x); q
(q_norm when the checkpoint has it, RoPE), k (k_norm, RoPE) and v of the block rows; every row
attends, without a causal mask, to the layer's window of draft KV (all committed rows when the
window is 0, as the references do) plus the whole block; x += wo(o); x += MLP(norm2(x)). A window
is the last `window` committed rows for every block row (window_mode "anchor": speculators), or
the keys within `window` of the row's own position, both ways (window_mode "row": dflash's
non-causal sliding layers, DFlash2 for Qwen3.8). DFlash2
wraps the attention and the MLP in grouped dynamic causal convolutions over the block rows. Rows
go through the final norm (the checkpoint's own for the released formats, the trunk's for the
embedded drafter) and the LM head (the trunk's, or the checkpoint's own for a reduced draft
vocabulary), times logit_scale, soft-capped when logit_softcap > 0.

Harvest: "shifted" (DeepSpec DSpark, speculators sample_from_anchor=True, the embedded drafter):
every row is a draft, row k predicts the token at pos+k+1. "mask_fill" (z-lab DFlash,
speculators sample_from_anchor=False): rows 1..b-1 are the drafts, row k predicts pos+k.

Heads (dspark.models.drafter_heads): the Markov chain over the draft slots (vanilla, gated, rnn,
or DFlash2's candidate selector) and the confidence head.
"""

from __future__ import annotations

import numpy as np

from ..errors import ShapeError, TokenRangeError
from ..ops import dense
from ..ops.argmax import argmax_rows, markov_chain, raise_on_nan
from ..ops.attention import attention
from ..ops.kv_commit import kv_commit
from ..ops.linear import linear
from ..ops.norm import rmsnorm
from ..ops.tables import PointerTable

from .batch_tables import TableStore, VersionedBuffers
from .drafter_config import INT_TENSORS, DrafterConfig, drafter_spec
from .drafter_heads import Chain
from .weights import check_weights, load_model, random_weights, save_model, to_backend


FUSED_PARTS = ("attn.wq", "attn.wk", "attn.wv", "mlp.w_gate", "mlp.w_up")  # kept fused on the backend


class DraftTables:
    """One batch's pointer tables of draft-KV rings: per drafter layer the K and V rings, and
    every ring for the ingest's kv_commit (k then v, layer by layer)."""

    def __init__(self, be, kvs: list["DraftKV"], layers: int):
        self.k = [PointerTable(be, [kv.k[i] for kv in kvs], f"k_rings[{i}]", writable=True) for i in range(layers)]
        self.v = [PointerTable(be, [kv.v[i] for kv in kvs], f"v_rings[{i}]", writable=True) for i in range(layers)]
        self.commit = PointerTable(be, [kv.k[i] for i in range(layers) for kv in kvs]
                                   + [kv.v[i] for i in range(layers) for kv in kvs], "draft rings", writable=True)


class DraftKV(VersionedBuffers):
    """One session's draft KV: per drafter layer a K and V ring [Hkv, ring, D], and `pos`, the
    number of committed rows ingested so far. As dspark.models.cache.Cache, its ring lists are
    tuples and `version` changes when they are replaced or freed (the drafter's per-batch pointer
    tables are keyed by it)."""

    BUFFERS = ("k", "v")

    def __init__(self, be, shape: tuple[int, int, int], layers: int, owner: str):
        self.be, self.shape, self.owner = be, shape, owner
        self.k = [be.alloc.zeros(shape, np.float32, owner) for _ in range(layers)]
        self.v = [be.alloc.zeros(shape, np.float32, owner) for _ in range(layers)]
        self.pos = 0

    def copy(self, owner: str) -> "DraftKV":
        new = DraftKV(self.be, self.shape, len(self.k), owner)
        for dst, src in zip(new.k + new.v, self.k + self.v):
            dst[...] = src
        new.pos = self.pos
        return new

    def free(self) -> int:
        n = self.be.alloc.free_owner(self.owner)
        self.k = self.v = ()
        return n


class DsparkDrafter:
    def __init__(self, config: DrafterConfig, weights: dict[str, np.ndarray], trunk):
        c, tc = config, trunk.config
        if c.d_model != tc.d_model:
            raise ValueError(f"drafter d_model={c.d_model} must equal the trunk's {tc.d_model}")
        # The session asks the trunk for these layers on every pass, whatever its default taps.
        taps = tuple(c.taps or tc.tap_layers)
        if any(not -1 <= t < len(tc.layers) for t in taps):
            raise ShapeError(f"drafter taps={taps}: expected layer indices of the trunk in [-1, {len(tc.layers)}) "
                             f"(-1: the embedding)")
        self.mask_id = c.mask_id if c.mask_id >= 0 else tc.mask_id
        if not 0 <= self.mask_id < tc.vocab:
            raise TokenRangeError(f"drafter mask_id={self.mask_id} is outside the vocabulary [0, {tc.vocab})")
        check_weights(weights, drafter_spec(c, tc), "drafter", dtype_of={n: (np.int32,) for n in INT_TENSORS})
        if c.draft_vocab:
            d2t = weights["draft_to_target"]
            if np.any((d2t < 0) | (d2t >= tc.vocab)):
                raise TokenRangeError(f"drafter draft_to_target has ids outside the vocabulary [0, {tc.vocab})")
        self.config, self.trunk, self.be = c, trunk, trunk.be
        self.taps = taps
        self.source = None  # a description when loaded from a released checkpoint (dspark.models.hf)
        self.accept_floor = None  # greedy mean accepted length its record guarantees (the gain's prior), if any
        self.acceptance = {}      # (accept rule, temperature): tokens per round this process's sessions measured
        # Window 0 means every committed row, as the references attend: the ring then holds the
        # whole context the trunk's cache can, seen from the anchor. A sliding layer's window is
        # measured as the checkpoint's format says (c.window_mode).
        self.windows = tuple(w or tc.max_ctx for w in c.windows())
        self.window_modes = tuple(c.window_mode if w else "anchor" for w in c.windows())
        self.ring = max(self.windows) + c.block
        self.host_weights = weights
        self.w = to_backend(self.be, {k: v for k, v in weights.items()
                                      if k not in INT_TENSORS and not k.endswith(FUSED_PARTS)})
        for i in range(c.layers):  # one GEMM per layer input (weights.FUSED); ingest projects K|V only
            p = f"layers.{i}."
            for fused, parts in (("attn.wqkv", ("attn.wq", "attn.wk", "attn.wv")), ("attn.wkv", ("attn.wk", "attn.wv")),
                                 ("mlp.w_gate_up", ("mlp.w_gate", "mlp.w_up"))):
                self.w[p + fused] = self.be.alloc.adopt(
                    self.be.xp.asarray(np.concatenate([weights[p + q] for q in parts], axis=1)), "weights")
        self.d2t = weights["draft_to_target"] if c.draft_vocab else None  # host: draft row -> target id
        self.d2t_dev = self.be.asarray(self.d2t) if c.draft_vocab else None
        self._tables = TableStore()
        self.embed = self.w["embed"] if c.own_embed else trunk.w["embed"]
        self.final_norm = self.w["final_norm"] if c.own_norm else trunk.w["final_norm"]
        self.final_eps = c.norm_eps if c.own_norm else tc.norm_eps
        self.lm_head = self.w["lm_head"] if c.own_head else trunk.w["lm_head"]

    @classmethod
    def random(cls, config: DrafterConfig, trunk, seed: int) -> "DsparkDrafter":
        w = random_weights(drafter_spec(config, trunk.config), seed)
        if config.draft_vocab:
            rng = np.random.default_rng(seed)
            ids = rng.choice(trunk.config.vocab, config.draft_vocab, replace=False)
            w["draft_to_target"] = np.sort(ids).astype(np.int32)
        return cls(config, w, trunk)

    @classmethod
    def load(cls, directory, trunk, name: str = "drafter") -> "DsparkDrafter":
        config, tensors = load_model(directory, name, DrafterConfig)
        return cls(config, tensors, trunk)

    def save(self, directory, name: str = "drafter", fmt: str = "safetensors") -> None:
        save_model(directory, name, self.config, self.host_weights, fmt)

    def new_kv(self, owner: str) -> DraftKV:
        c = self.config
        return DraftKV(self.be, (c.kv_heads, self.ring, c.head_dim), c.layers, owner)

    @property
    def has_confidence(self) -> bool:
        return self.config.confidence != "none"

    # ---- context ------------------------------------------------------------------------------
    def tables(self, kvs: list[DraftKV]) -> DraftTables:
        """The pointer tables of this batch of draft KVs, made once per batch (batch_tables)."""
        return self._tables.get(tuple(kv.version for kv in kvs), lambda: DraftTables(self.be, kvs, self.config.layers))

    def _kv(self, kv_rows, layer: int, rope):
        """K (normed, RoPE from the pass's `rope` table) and V of drafter layer `layer` from its
        K|V projection [rows, 2 Hkv D]."""
        c, w = self.config, self.w
        rows, n = kv_rows.shape[0], c.kv_heads * c.head_dim
        k = kv_rows[:, :n].reshape(rows, c.kv_heads, c.head_dim)
        k = dense.rope(rmsnorm(self.be, k, w[f"layers.{layer}.attn.k_norm"], c.norm_eps), None, c.rope_theta,
                       table=rope)
        v = kv_rows[:, n:].reshape(rows, c.kv_heads, c.head_dim)
        return k, v

    def ingest(self, kvs: list[DraftKV], taps, row_indptr) -> None:
        """Write the committed rows' context K/V into each session's ring (one kv_commit launch
        for all layers). taps [rows, n_taps*d] are ragged by row_indptr over the sessions. Rows
        that the ring would overwrite within this call are never read again, so only each
        session's last `ring` rows are computed and written."""
        c, w = self.config, self.w
        lens = np.diff(row_indptr).astype(np.int64)
        skip = np.maximum(lens - self.ring, 0)
        take = (lens - skip).astype(np.int32)
        pos = np.array([kv.pos for kv in kvs], np.int64) + skip
        rows = np.concatenate([row_indptr[i] + skip[i] + np.arange(take[i]) for i in range(len(kvs))]) if kvs else []
        positions = np.concatenate([p + np.arange(n) for p, n in zip(pos, take)]) if kvs else np.zeros(0)
        indptr = np.concatenate([[0], np.cumsum(take)]).astype(np.int32)
        kept = taps[self.be.xp.asarray(np.asarray(rows, np.int64))]
        f = rmsnorm(self.be, linear(self.be, kept, w["fc"]), w["fc_norm"], c.norm_eps)
        rope = dense.rope_table(self.be.xp, positions, c.rope_theta, c.head_dim, c.rope_scaling)
        ks, vs = zip(*(self._kv(linear(self.be, f, w[f"layers.{i}.attn.wkv"]), i, rope) for i in range(c.layers)))
        kv_commit(self.be, list(ks), list(vs), [[kv.k[i] for kv in kvs] for i in range(c.layers)],
                  [[kv.v[i] for kv in kvs] for i in range(c.layers)], pos.astype(np.int32), take, indptr, ring=True,
                  table=self.tables(kvs).commit)
        for kv, n in zip(kvs, lens):
            kv.pos += int(n)

    # ---- the block pass -----------------------------------------------------------------------
    def block_pass(self, kvs: list[DraftKV], anchors) -> tuple[object, object]:
        """One parallel pass over [anchor, MASK x (b-1)] per session at positions kv.pos...
        Returns (hidden [B*b, d] after the final norm, logits [B*b, V or draft_vocab])."""
        c, w = self.config, self.w
        xp, b, B = self.be.xp, c.block, len(kvs)
        ids = np.full((B, b), self.mask_id, np.int32)
        ids[:, 0] = np.asarray(anchors, np.int32)
        pos = np.array([kv.pos for kv in kvs], np.int32)
        positions = (pos[:, None] + np.arange(b)[None, :]).reshape(-1)
        indptr = (np.arange(B + 1) * b).astype(np.int32)
        x = self.embed[xp.asarray(ids.reshape(-1))]
        if c.embed_scale != 1.0:
            x = x * np.float32(c.embed_scale)
        rows = B * b
        tables = self.tables(kvs)
        rope = dense.rope_table(xp, positions, c.rope_theta, c.head_dim, c.rope_scaling)  # one for every layer
        nq = c.heads * c.head_dim
        for i in range(c.layers):
            p = f"layers.{i}."
            h = rmsnorm(self.be, x, w[p + "norm1"], c.norm_eps)
            if c.conv_kernel:
                h, out_kernel = self._conv_prepare(h, p + "attn_conv.", B)
            qkv = linear(self.be, h, w[p + "attn.wqkv"])  # one GEMM: [q | k | v]
            q = qkv[:, :nq].reshape(rows, c.heads, c.head_dim)
            if c.q_norm:
                q = rmsnorm(self.be, q, w[p + "attn.q_norm"], c.norm_eps)
            q = dense.rope(q, None, c.rope_theta, table=rope)
            k, v = self._kv(qkv[:, nq:], i, rope)
            o = attention(self.be, q, k, v, tables.k[i], tables.v[i], pos, indptr, mode="block",
                          window=self.windows[i], window_mode=self.window_modes[i])
            if c.conv_kernel:
                x = x + self._conv(linear(self.be, o.reshape(rows, -1), w[p + "attn.wo"]), out_kernel,
                                   w[p + "attn_conv.base"][1], B)
            else:
                x = x + linear(self.be, o.reshape(rows, -1), w[p + "attn.wo"])
            h = rmsnorm(self.be, x, w[p + "norm2"], c.norm_eps)
            if c.conv_kernel:
                h, out_kernel = self._conv_prepare(h, p + "mlp_conv.", B)
            gate_up = linear(self.be, h, w[p + "mlp.w_gate_up"])
            F = gate_up.shape[1] // 2
            m = linear(self.be, dense.swiglu(gate_up[:, :F], gate_up[:, F:]), w[p + "mlp.w_down"])
            x = x + (self._conv(m, out_kernel, w[p + "mlp_conv.base"][1], B) if c.conv_kernel else m)
        hidden = rmsnorm(self.be, x, self.final_norm, self.final_eps)
        logits = linear(self.be, hidden, self.lm_head)
        if c.logit_scale != 1.0:
            logits = logits * np.float32(c.logit_scale)
        if c.logit_softcap > 0:
            cap = np.float32(c.logit_softcap)
            logits = xp.tanh(logits / cap) * cap
        return hidden, logits

    def _conv_prepare(self, h, p: str, B: int):
        """DFlash2: the input-side convolution of a sublayer, and the output side's dynamic kernel
        (both from one projection of the sublayer's input)."""
        c = self.config
        dyn = linear(self.be, h, self.w[p + "proj"]).reshape(B, c.block, 2, c.conv_kernel, c.d_model // c.conv_group)
        return self._conv(h, dyn[:, :, 0], self.w[p + "base"][0], B), dyn[:, :, 1]

    def _conv(self, x, dyn, base, B: int):
        """Grouped dynamic causal convolution over each session's block rows (DFlash2):
        out_t = sum_o (base[o] + dyn_t[o, g]) * x_{t-o} per channel group g, x before the block = 0,
        accumulated over o in increasing order as the reference does."""
        c, xp = self.config, self.be.xp
        G = c.d_model // c.conv_group
        xs = x.reshape(B, c.block, G, c.conv_group)
        out = xp.zeros_like(xs)
        for o in range(c.conv_kernel):
            shifted = xs if o == 0 else xp.concatenate([xp.zeros_like(xs[:, :o]), xs[:, :-o]], axis=1)
            out = out + base[o].reshape(G, c.conv_group) * shifted
            out = out + dyn[:, :, o, :, None] * shifted
        return out.reshape(B * c.block, c.d_model)

    def draft(self, kvs: list[DraftKV], anchors) -> tuple[object, object]:
        """The block pass, harvested: (hidden, logits) of the draft slots only, [B*nd, ...]
        session-major; slot k predicts the token at pos+k+1."""
        hidden, logits = self.block_pass(kvs, anchors)
        rows = self.be.xp.asarray(self.draft_rows(len(kvs)))
        return hidden[rows], logits[rows]

    def draft_rows(self, B: int) -> np.ndarray:
        """Indices (into the B*b block rows) of the rows that are drafts, per harvest mode:
        shifted: every row (row k predicts the token at pos+k+1); mask_fill: rows 1..b-1."""
        b = self.config.block
        first = 0 if self.config.harvest == "shifted" else 1
        return (np.arange(B)[:, None] * b + np.arange(first, b)[None, :]).reshape(-1)

    # ---- proposals ----------------------------------------------------------------------------
    def chain(self, hidden, logits, anchors) -> Chain:
        """The Markov chain over the draft slots of one round (dspark.models.drafter_heads)."""
        return Chain(self, hidden, logits, anchors)

    def propose_greedy(self, hidden, logits, anchors) -> tuple[np.ndarray, np.ndarray]:
        """x_k = argmax of slot k's Markov-chain logits, x_{-1} = anchor, and the confidence c_k
        of every slot (NaN without a confidence head). Returns host (drafts, conf) [B, nd].

        Every layout runs on the device from the anchors to the last slot (the vanilla head as
        one fused kernel, the others slot by slot with the previous token never leaving the
        device), and drafts, confidences and NaN flags come back in ONE device->host copy: the
        round's first synchronisation. A NaN in any slot's logits raises NonFiniteError there,
        before anything of the session has changed."""
        c, be, xp, nd = self.config, self.be, self.be.xp, self.config.drafts
        anchors = np.asarray(anchors, np.int32)
        B = anchors.shape[0]
        conf = None
        if c.markov == "vanilla" and not c.draft_vocab:  # the fused chain: one launch
            flag = xp.empty(B, xp.int32)
            drafts = markov_chain(be, logits, self.w["markov.w1"], self.w["markov.w2"], anchors, nd, nan_flag=flag)
            if self.has_confidence:
                prev = xp.concatenate([xp.asarray(anchors)[:, None], drafts[:, :-1]], axis=1).reshape(-1)
                conf = self.confidence(hidden, self.w["markov.w1"][prev])
        elif c.markov == "none":  # no chain: every slot's argmax in one launch
            flag = xp.empty(B * nd, xp.int32)
            ids = argmax_rows(be, logits, nan_flag=flag)
            drafts = self.d2t_dev[ids] if self.d2t_dev is not None else ids
            if self.has_confidence:
                conf = self.confidence(hidden, None)
        else:
            chain = self.chain(hidden, logits, anchors)
            for k in range(nd):
                chain.choose_greedy(k)
            drafts, flag, conf = chain.drafts, chain.nan, chain.conf if self.has_confidence else None
        got = be.fetch(drafts, flag, *(() if conf is None else (conf,)))
        # flags per session ([B]), per row ([B * nd], session-major) or per slot ([nd, B], the chain)
        nan = got[1] if got[1].ndim == 2 else got[1].reshape(B, -1).T
        raise_on_nan(nan.any(axis=0), "drafter logits", "session")
        drafts = got[0].reshape(B, nd).astype(np.int32)
        conf = got[2].reshape(B, nd) if conf is not None else np.full((B, nd), np.nan, np.float32)
        return drafts, conf

    def propose(self, kvs: list[DraftKV], anchors) -> tuple[np.ndarray, np.ndarray]:
        """Greedy drafts and their confidences for each session: draft, then the Markov chain."""
        return self.propose_greedy(*self.draft(kvs, anchors), anchors)

    def markov_bias(self, prev_tokens):
        """The vanilla head's W2 . W1[x_{k-1}] for a batch of previous tokens (host or device)
        -> [n, V]; also returns W1[x]."""
        xp = self.be.xp
        prev = prev_tokens if isinstance(prev_tokens, xp.ndarray) else xp.asarray(np.asarray(prev_tokens, np.int32))
        e = self.w["markov.w1"][prev]
        return linear(self.be, e, self.w["markov.w2"]), e

    def confidence(self, hidden, markov_embed):
        """c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b) ("markov"), or sigmoid(w . h_k + b)
        ("hidden"), for rows of hidden [n, d]."""
        xp = self.be.xp
        feats = xp.concatenate([hidden, markov_embed], axis=1) if self.config.confidence == "markov" else hidden
        return dense.sigmoid(linear(self.be, feats, self.w["conf.w"][:, None])[:, 0] + self.w["conf.b"][0])

    def to_target_vocab(self, logits):
        """Draft-vocabulary logits [n, draft_vocab] as target-vocabulary logits [n, V] (-inf on
        tokens the draft vocabulary lacks); the identity without a draft vocabulary."""
        if self.d2t is None:
            return logits
        xp = self.be.xp
        out = xp.full((logits.shape[0], self.trunk.config.vocab), -np.inf, np.float32)
        out[:, self.d2t_dev] = logits
        return out
