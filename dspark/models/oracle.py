"""Test drafters that accept: the real DsparkDrafter with its proposals steered.

Random-weight drafters almost never agree with a random trunk, so every round would accept zero
drafts: rollbacks of partial accepts, cuts at EOS and at the budget, and the sampled accept's
rejection path would go unexercised, and greedy exactness would hold whatever the session did
with its drafts. These two make most rounds accept several drafts.

* `OracleDrafter` (greedy): after the block pass, the logit of the known next token (the trunk's
  greedy stream) is raised in a slot with probability `hit_rate`, decided by a generator seeded
  from (seed, pos, slot), so runs are reproducible and independent of batching. A hit slot also
  gets confidence 1, so the confidence policy verifies it. Given `stop` (the position of the
  request's last token), the oracle knows the stream past it: every slot that targets a position
  after `stop - lead` hits, and the slot that targets `stop - lead` misses. The round that
  reaches the end therefore starts at `stop - lead` and accepts past the end, so the session
  must cut its accepted block at the EOS or at the budget (lead 0: the last token is the
  anchor; lead 1: it is an accepted draft).
* `bigram_drafter` (greedy, recordable): a real drafter whose Markov head maps a token to the token
  that follows it in a given stream (rank V: W1 the identity, W2 a boosted one-hot of the successor)
  for a `hit_rate` share of the stream's tokens. Its rounds are kernels only, so a round of it can
  be recorded (dspark.graphs) and still accept often: the tests of recorded rounds use it.
* `TrunkDrafter` (sampled): each slot's distribution q is the trunk's own distribution for that
  slot given the drafts before it (a shadow trunk pass over a copy of the session's cache),
  tilted by a fixed per-token pattern (`tilt`) or with mass `escape` moved onto the trunk's least
  likely token. The accept is lossless whatever q is; a q close to p makes most rounds accept
  several drafts, and a tilted one makes the rejection and residual paths matter.
"""

from __future__ import annotations

import numpy as np

from ..ops.argmax import argmax_rows
from .drafter import DsparkDrafter

BOOST = 1.0e4


def greedy_continuation(trunk, prompt_ids, n: int) -> list[int]:
    """The trunk's greedy continuation of the prompt, n tokens, straight past EOS: what the
    trunk would verify beyond the end of a request."""
    be = trunk.be
    cache = trunk.new_cache(owner="oracle/continuation")
    try:
        logits = trunk.prefill(cache, np.asarray(prompt_ids, np.int32)).logits[-1:]
        out = []
        for _ in range(n):
            out.append(int(be.to_host(argmax_rows(be, logits))[0]))
            if len(out) < n and cache.pos < cache.capacity:
                logits = trunk.decode([cache], [out[-1]]).logits
            elif len(out) < n:
                break
        return out
    finally:
        cache.free()


class OracleDrafter(DsparkDrafter):
    def __init__(self, base: DsparkDrafter, hit_rate: float = 0.75, seed: int = 0, lead: int = 0):
        self.__dict__.update(base.__dict__)
        self.hit_rate, self.seed, self.lead = hit_rate, seed, lead
        self.next_stream: list[int] | None = None
        self.next_stop: int | None = None
        self._trusted = None

    recordable = False  # it steers the logits on the host: a round of it cannot be recorded

    def new_kv(self, owner: str):
        """Draft KVs made from here on follow `next_stream` (the request's prompt, then the
        trunk's greedy continuation; None: no help) and end at `next_stop`."""
        kv = super().new_kv(owner)
        kv.oracle_stream, kv.oracle_stop = self.next_stream, self.next_stop
        return kv

    def steer(self, kv, k: int) -> int:
        """+1: slot k of this kv proposes the stream's token; -1: it must not; 0: left alone."""
        seq, stop = getattr(kv, "oracle_stream", None), getattr(kv, "oracle_stop", None)
        target = kv.pos + k + 1  # slot k proposes the token at pos + k + 1
        if seq is None or target >= len(seq):
            return 0
        if stop is not None and target >= stop - self.lead:
            return -1 if target == stop - self.lead else 1
        return int(np.random.default_rng([self.seed, kv.pos, k]).random() < self.hit_rate)

    def block_pass(self, kvs, anchors):
        hidden, logits = super().block_pass(kvs, anchors)
        b, nd = self.config.block, self.config.drafts
        first = b - nd  # shifted: row k is slot k; mask_fill: row k+1 is slot k
        host = self.be.to_host(logits).copy()
        row_of = self.draft_row_of_token()
        self._trusted = np.zeros((len(kvs), nd), bool)
        for i, kv in enumerate(kvs):
            for k in range(nd):
                s = self.steer(kv, k)
                j = row_of[kv.oracle_stream[kv.pos + k + 1]] if s else -1
                if j >= 0:   # a token a trimmed draft vocabulary lacks cannot be proposed: left alone
                    host[i * b + first + k, j] += s * BOOST
                self._trusted[i, k] = s > 0 and j >= 0
        return hidden, self.be.asarray(host)

    def draft_row_of_token(self) -> np.ndarray:
        """Target token id -> its row of the drafter's logits (-1: not in a trimmed draft vocabulary)."""
        V = self.trunk.config.vocab
        if self.d2t is None:
            return np.arange(V)
        rows = np.full(V, -1, np.int64)
        rows[self.d2t] = np.arange(self.d2t.size)
        return rows

    def propose_greedy(self, hidden, logits, anchors):
        drafts, conf = super().propose_greedy(hidden, logits, anchors)
        if self._trusted is not None and self._trusted.shape == conf.shape:
            conf = np.where(self._trusted, np.float32(1), conf)
        return drafts, conf


class TrunkDrafter(DsparkDrafter):
    """Sampled-mode drafter whose q is the trunk's own distribution, perturbed (module doc).

    `follow(session)` before its first round: the drafter reads the session's trunk cache and
    filters through its draft KV. The acceptance probability of each slot, sum(min(p, q)) over
    the filtered rows the accept sees, is logged per round on the draft KV (`kv.alphas`). Only
    the sampled propose path (Markov bias per slot, in slot order) is steered: with greedy
    sessions this drafter proposes nonsense, which is still exact."""

    def __init__(self, base: DsparkDrafter, tilt: float = 0.0, escape: float = 0.0, seed: int = 0):
        self.__dict__.update(base.__dict__)
        self.tilt, self.escape = float(tilt), float(escape)
        vocab = self.trunk.config.vocab
        self.pattern = np.random.default_rng(seed).choice([-1.0, 1.0], vocab).astype(np.float32)
        self._round = None

    recordable = False  # its q comes from a shadow trunk pass on the host

    def follow(self, session) -> None:
        session.kv.trunk_cache = session.cache
        session.kv.sampling = session.params.sampling
        session.kv.alphas = []

    def draft(self, kvs, anchors):
        hidden, logits = super().draft(kvs, anchors)
        shadows = [kv.trunk_cache.copy(f"oracle/shadow/{i}") for i, kv in enumerate(kvs)]
        self._round = {"kvs": kvs, "shadows": shadows, "slot": 0}
        for kv in kvs:
            kv.alphas.append([])
        return hidden, logits * 0  # q comes from markov_bias alone

    def markov_bias(self, prev_tokens):
        from ..ops.sampling import filtered_probs
        from ..spec_sampling import filters_for
        _, emb = super().markov_bias(prev_tokens)  # the confidence head's input stays the real one
        r, be = self._round, self.be
        if r is None:
            raise RuntimeError("TrunkDrafter.markov_bias outside a sampled propose")
        live = [i for i, c in enumerate(r["shadows"]) if c.pos < c.capacity]
        x = np.zeros((len(r["shadows"]), self.trunk.config.vocab), np.float32)
        if live:  # a test drafter: it reads the chain's tokens back (a sync per slot)
            tp = self.trunk.decode([r["shadows"][i] for i in live], be.to_host(prev_tokens)[live])
            x[live] = be.to_host(tp.logits)
        samplings = [kv.sampling for kv in r["kvs"]]
        filters = filters_for(samplings)
        p = be.to_host(filtered_probs(be, be.asarray(x), filters)).astype(np.float64)
        # The tilt stays inside p's support, so q's filters keep exactly p's tokens.
        y = np.where(p > 0, x + np.float32(self.tilt) * self.pattern, x - np.float32(BOOST)).astype(np.float32)
        if self.escape:
            y = self._escape(y, np.array([sp.temperature for sp in samplings], np.float64))
        q = be.to_host(filtered_probs(be, be.asarray(y), filters)).astype(np.float64)
        for i, kv in enumerate(r["kvs"]):
            kv.alphas[-1].append(float(np.minimum(p[i], q[i]).sum()))
        r["slot"] += 1
        if r["slot"] == self.config.drafts:
            for c in r["shadows"]:
                c.free()
            self._round = None
        return be.asarray(y), emb

    def _escape(self, y: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Raise each row's least likely token z until it holds `escape` of the mass at the
        row's temperature t (no other filter: every token stays in p's support)."""
        t = t[:, None]
        y = y.astype(np.float64)
        z = y.argmin(axis=1)
        rows = np.arange(len(y))
        top = y.max(axis=1)
        w = np.exp((y - top[:, None]) / t)
        w[rows, z] = 0
        share = self.escape / (1 - self.escape) * w.sum(axis=1)
        y[rows, z] = top + t[:, 0] * np.log(share)
        return y.astype(np.float32)


def bigram_drafter(trunk, streams, hit_rate: float = 0.8, seed: int = 0, config=None) -> DsparkDrafter:
    """A random-weight drafter (default: the tiny preset's, block 4) whose vanilla Markov head, of
    rank V, proposes after token x the token that first follows x in `streams` (each a request's
    last prompt token and its greedy continuation), for a seeded `hit_rate` share of the tokens;
    after the others, whatever its block pass says."""
    from dataclasses import replace
    from .drafter_config import drafter_spec
    from .presets import TINY_DRAFTER
    from .weights import random_weights
    V = trunk.config.vocab
    c = replace(config or replace(TINY_DRAFTER, d_model=trunk.config.d_model), markov="vanilla", markov_rank=V)
    w = random_weights(drafter_spec(c, trunk.config), seed)
    rng = np.random.default_rng(seed)
    succ = {}
    for stream in streams:
        for a, b in zip(stream[:-1], stream[1:]):
            succ.setdefault(int(a), int(b))
    w["markov.w1"] = np.eye(V, dtype=np.float32)
    w["markov.w2"] = np.zeros((V, V), np.float32)
    for a, b in succ.items():
        if rng.random() < hit_rate:
            w["markov.w2"][a, b] = BOOST
    return DsparkDrafter(c, w, trunk)
