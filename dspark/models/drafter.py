"""The DSpark block drafter.

Context: each committed trunk row's taps become a feature f = norm(fc(concat(taps))); every
drafter layer projects f to K (normed, RoPE at the row's position) and V and keeps them in a
ring of `window + block` rows (the draft KV). Only committed rows are ever ingested.

Block: one parallel pass over [anchor, MASK x (b-1)] at positions pos..pos+b-1. Each layer
attends bidirectionally to the window of draft KV plus the block's own K/V, then an MLP. Rows go
through the trunk's final norm and LM head (shared, as is the embedding).

Heads: a low-rank Markov head adds W2 . W1[x_{k-1}] to slot k's logits, and a confidence head
scores each slot, c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b).
"""

from __future__ import annotations

import numpy as np

from ..ops import dense
from ..ops.argmax import markov_chain
from ..ops.attention import attention
from ..ops.kv_commit import kv_commit
from .config import DrafterConfig
from .trunk import HybridTrunk
from .weights import check_weights, drafter_spec, load_model, random_weights, save_model, to_backend


class DraftKV:
    """One session's draft KV: per drafter layer a K and V ring [Hkv, window + block, D], and
    `pos`, the number of committed rows ingested so far."""

    def __init__(self, be, config: DrafterConfig, owner: str):
        c = config
        self.be, self.config, self.owner = be, c, owner
        shape = (c.kv_heads, c.ring, c.head_dim)
        self.k = [be.alloc.zeros(shape, np.float32, owner) for _ in range(c.layers)]
        self.v = [be.alloc.zeros(shape, np.float32, owner) for _ in range(c.layers)]
        self.pos = 0

    def copy(self, owner: str) -> "DraftKV":
        new = DraftKV(self.be, self.config, owner)
        for dst, src in zip(new.k + new.v, self.k + self.v):
            dst[...] = src
        new.pos = self.pos
        return new

    def free(self) -> int:
        n = self.be.alloc.free_owner(self.owner)
        self.k = self.v = []
        return n


class DsparkDrafter:
    def __init__(self, config: DrafterConfig, weights: dict[str, np.ndarray], trunk: HybridTrunk):
        if config.d_model != trunk.config.d_model:
            raise ValueError(f"drafter d_model={config.d_model} must equal the trunk's {trunk.config.d_model}")
        check_weights(weights, drafter_spec(config, trunk.config), "drafter")
        self.config, self.trunk, self.be = config, trunk, trunk.be
        self.host_weights = weights
        self.w = to_backend(self.be, weights)

    @classmethod
    def random(cls, config: DrafterConfig, trunk: HybridTrunk, seed: int) -> "DsparkDrafter":
        return cls(config, random_weights(drafter_spec(config, trunk.config), seed), trunk)

    @classmethod
    def load(cls, directory, trunk: HybridTrunk, name: str = "drafter") -> "DsparkDrafter":
        config, tensors = load_model(directory, name, DrafterConfig)
        return cls(config, tensors, trunk)

    def save(self, directory, name: str = "drafter", fmt: str = "safetensors") -> None:
        save_model(directory, name, self.config, self.host_weights, fmt)

    def new_kv(self, owner: str) -> DraftKV:
        return DraftKV(self.be, self.config, owner)

    # ---- context ------------------------------------------------------------------------------
    def _kv(self, h, layer: int, positions):
        """K (normed, RoPE) and V rows of drafter layer `layer` from hidden rows h."""
        c, w = self.config, self.w
        p = f"layers.{layer}.attn."
        rows = h.shape[0]
        k = dense.linear(h, w[p + "wk"]).reshape(rows, c.kv_heads, c.head_dim)
        k = dense.rope(dense.rmsnorm(k, w[p + "k_norm"], c.norm_eps), positions, c.rope_theta)
        v = dense.linear(h, w[p + "wv"]).reshape(rows, c.kv_heads, c.head_dim)
        return k, v

    def ingest(self, kvs: list[DraftKV], taps, row_indptr) -> None:
        """Write the committed rows' context K/V into each session's ring (one kv_commit launch
        for all layers). taps [rows, n_taps*d] are ragged by row_indptr over the sessions. Rows
        that the ring would overwrite within this call are never read again, so only each
        session's last `ring` rows are computed and written."""
        c, w = self.config, self.w
        lens = np.diff(row_indptr).astype(np.int64)
        skip = np.maximum(lens - c.ring, 0)
        take = (lens - skip).astype(np.int32)
        pos = np.array([kv.pos for kv in kvs], np.int64) + skip
        rows = np.concatenate([row_indptr[i] + skip[i] + np.arange(take[i]) for i in range(len(kvs))]) if kvs else []
        positions = np.concatenate([p + np.arange(n) for p, n in zip(pos, take)]) if kvs else np.zeros(0)
        indptr = np.concatenate([[0], np.cumsum(take)]).astype(np.int32)
        f = dense.rmsnorm(dense.linear(taps[self.be.xp.asarray(np.asarray(rows, np.int64))], w["fc"]), w["fc_norm"],
                          c.norm_eps)
        ks, vs = zip(*(self._kv(f, i, positions) for i in range(c.layers)))
        kv_commit(self.be, list(ks), list(vs), [[kv.k[i] for kv in kvs] for i in range(c.layers)],
                  [[kv.v[i] for kv in kvs] for i in range(c.layers)], pos.astype(np.int32), take, indptr, ring=True)
        for kv, n in zip(kvs, lens):
            kv.pos += int(n)

    # ---- the block pass -----------------------------------------------------------------------
    def block_pass(self, kvs: list[DraftKV], anchors) -> tuple[object, object]:
        """One parallel pass over [anchor, MASK x (b-1)] per session at positions kv.pos...
        Returns (hidden [B*b, d] after the trunk's final norm, logits [B*b, V])."""
        c, w, tw, tc = self.config, self.w, self.trunk.w, self.trunk.config
        xp, b, B = self.be.xp, c.block, len(kvs)
        ids = np.full((B, b), tc.mask_id, np.int32)
        ids[:, 0] = np.asarray(anchors, np.int32)
        pos = np.array([kv.pos for kv in kvs], np.int32)
        positions = (pos[:, None] + np.arange(b)[None, :]).reshape(-1)
        indptr = (np.arange(B + 1) * b).astype(np.int32)
        x = tw["embed"][xp.asarray(ids.reshape(-1))]
        rows = B * b
        for i in range(c.layers):
            p = f"layers.{i}."
            h = dense.rmsnorm(x, w[p + "norm1"], c.norm_eps)
            q = dense.linear(h, w[p + "attn.wq"]).reshape(rows, c.heads, c.head_dim)
            q = dense.rope(q, positions, c.rope_theta)
            k, v = self._kv(h, i, positions)
            o = attention(self.be, q, k, v, [kv.k[i] for kv in kvs], [kv.v[i] for kv in kvs], pos, indptr,
                          mode="block", window=c.window)
            x = x + dense.linear(o.reshape(rows, -1), w[p + "attn.wo"])
            h = dense.rmsnorm(x, w[p + "norm2"], c.norm_eps)
            x = x + dense.linear(dense.swiglu(dense.linear(h, w[p + "mlp.w_gate"]), dense.linear(h, w[p + "mlp.w_up"])),
                                 w[p + "mlp.w_down"])
        hidden = dense.rmsnorm(x, tw["final_norm"], tc.norm_eps)
        return hidden, dense.linear(hidden, tw["lm_head"])

    def draft(self, kvs: list[DraftKV], anchors) -> tuple[object, object]:
        """The block pass, harvested: (hidden, logits) of the draft slots only, [B*nd, ...]
        session-major; slot k predicts the token at pos+k+1."""
        hidden, logits = self.block_pass(kvs, anchors)
        rows = self.be.xp.asarray(self.draft_rows(len(kvs)))
        return hidden[rows], logits[rows]

    def propose_greedy(self, hidden, logits, anchors) -> tuple[np.ndarray, np.ndarray]:
        """The Markov chain x_k = argmax(logits_k + W2 . W1[x_{k-1}]), x_{-1} = anchor (one fused
        launch), then the confidence c_k of every slot. Returns host (drafts, conf) [B, nd]."""
        be, nd = self.be, self.config.drafts
        anchors = np.asarray(anchors, np.int32)
        drafts = be.to_host(markov_chain(be, logits, self.w["markov.w1"], self.w["markov.w2"], anchors, nd))
        prev = np.concatenate([anchors[:, None], drafts[:, :-1]], axis=1).reshape(-1)
        emb = self.w["markov.w1"][be.xp.asarray(prev)]
        return drafts, be.to_host(self.confidence(hidden, emb)).reshape(len(anchors), nd)

    def propose(self, kvs: list[DraftKV], anchors) -> tuple[np.ndarray, np.ndarray]:
        """Greedy drafts and their confidences for each session: draft, then the Markov chain."""
        return self.propose_greedy(*self.draft(kvs, anchors), anchors)

    def draft_rows(self, B: int) -> np.ndarray:
        """Indices (into the B*b block rows) of the rows that are drafts, per harvest mode:
        shifted: every row (row k predicts the token at pos+k+1); mask_fill: rows 1..b-1."""
        b = self.config.block
        first = 0 if self.config.harvest == "shifted" else 1
        return (np.arange(B)[:, None] * b + np.arange(first, b)[None, :]).reshape(-1)

    def markov_bias(self, prev_tokens):
        """W2 . W1[x_{k-1}] for a batch of previous tokens -> [n, V]; also returns W1[x]."""
        e = self.w["markov.w1"][self.be.xp.asarray(np.asarray(prev_tokens, np.int32))]
        return dense.linear(e, self.w["markov.w2"]), e

    def confidence(self, hidden, markov_embed):
        """c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b) for rows of hidden [n, d]."""
        xp = self.be.xp
        feats = xp.concatenate([hidden, markov_embed], axis=1)
        return dense.sigmoid(dense.linear(feats, self.w["conf.w"][:, None])[:, 0] + self.w["conf.b"][0])
