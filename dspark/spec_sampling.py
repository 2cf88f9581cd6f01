"""Sampled mode: the session-side use of dspark.ops.sampling.

Each sampled session owns its seed and one round counter n (in its allocator-owned `rng`
array), continued across bursts. Draws are pure functions of (seed, tag, n, slot): the first
anchor (BOUNDARY, n = 0), draft slot k (DRAFT, slot k), and inside the accept kernel the accept
tests, residual and bonus. Plain sampled decode uses DECODE with n = the sequence's draw count.
Every op is per row, so a session's stream does not depend on its batch.
"""

from __future__ import annotations

import numpy as np

from .ops.sampling import Filters, Streams, filtered_probs, sample_filtered, speculative_accept
from .philox import Tag


def filters_for(samplings, rows_each=1) -> Filters:
    """Per-row filters: SamplingParams i repeated for rows_each (or rows_each[i]) rows."""
    cols = [np.repeat(np.asarray([getattr(s, f) for s in samplings]), rows_each)
            for f in ("temperature", "top_k", "top_p", "min_p")]
    return Filters.full(len(cols[0]), *cols)


def sample_boundary(session, boundary_logits) -> int:
    """The first anchor: draw 0 of the session's BOUNDARY stream."""
    sp = session.params.sampling
    tok, _ = sample_filtered(session.be, boundary_logits, filters_for([sp]), Streams.full(1, sp.seed, 0, Tag.BOUNDARY))
    return int(session.be.to_host(tok)[0])


def propose_sampled(live, drafter, dl, dh, nd: int):
    """Draft slot by slot from the drafter's Markov-chain distributions q (over the target
    vocabulary, filtered with each session's own settings). Returns (drafts [B, nd], confidence
    [B, nd], q [B, nd, V])."""
    be, xp = drafter.be, drafter.be.xp
    B, V = len(live), drafter.trunk.config.vocab
    samplings = [s.params.sampling for s in live]
    filters = filters_for(samplings)
    seeds = [sp.seed for sp in samplings]
    counters = [int(s.rng[0]) for s in live]
    q = xp.empty((B, nd, V), np.float32)
    chain = drafter.chain(dh, dl, [s.last for s in live])
    for k in range(nd):
        dist = xp.empty((B, V), np.float32)
        tok, _ = sample_filtered(be, drafter.to_target_vocab(chain.step(k)), filters,
                                 Streams.full(B, seeds, counters, Tag.DRAFT, k), dist_out=dist)
        q[:, k] = dist
        chain.choose(k, be.to_host(tok))
    return chain.drafts, chain.conf, q


def accept_sampled(live, tp, cands, q, vts):
    """Lossless rejection sampling of each session's verified drafts against the trunk's
    filtered distributions p. Returns host (m, next) and advances each session's counter."""
    be, xp = live[0].be, live[0].be.xp
    nds = np.array(vts, np.int64) - 1
    samplings = [s.params.sampling for s in live]
    p = filtered_probs(be, tp.logits, filters_for(samplings, vts))
    drafts = np.concatenate([c[1:] for c in cands]).astype(np.int32)
    q_rows = xp.concatenate([q[i, : nds[i]] for i in range(len(live))]) if drafts.size else \
        xp.zeros((0, p.shape[1]), np.float32)
    indptr = np.concatenate([[0], np.cumsum(nds)]).astype(np.int32)
    seeds = np.array([sp.seed for sp in samplings], np.uint64)
    counters = np.array([int(s.rng[0]) for s in live], np.uint64)
    m, nxt, _ = speculative_accept(be, xp.asarray(drafts), xp.asarray(indptr), q_rows, p, seeds, counters)
    for s in live:
        s.rng[0] += 1
    return be.to_host(m), be.to_host(nxt)


def sample_plain(be, logits, seqs) -> np.ndarray:
    """Plain sampled decode: one draw per row from each sequence's DECODE stream (n = its draw
    count, which advances)."""
    samplings = [s.sampling for s in seqs]
    streams = Streams.full(len(seqs), [sp.seed for sp in samplings], [s.draws for s in seqs], Tag.DECODE)
    tok, _ = sample_filtered(be, logits, filters_for(samplings), streams)
    for s in seqs:
        s.draws += 1
    return be.to_host(tok)
