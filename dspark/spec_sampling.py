"""Sampled mode: the session-side use of dspark.ops.sampling.

Each sampled session owns its seed and one round counter n (`session.counter`, a host integer:
the kernels take it as a stream word, so it never has to be read from the device), continued
across bursts. Draws are pure functions of (seed, tag, n, slot): the first anchor (BOUNDARY,
n = 0), draft slot k (DRAFT, slot k), and inside the accept kernel the accept tests, residual and
bonus. Plain sampled decode uses DECODE with n = the sequence's draw count. Every op is per row,
so a session's stream does not depend on its batch.

A sampled round waits on the device twice, as a greedy one: the drafts, confidences and the
drafter rows' statuses come back in one copy after the chain, (m, next) and the statuses of the
target rows and the accept in one copy after it. Filters and stream words are built on the host
and uploaded once per round (Staged), never read back.
"""

from __future__ import annotations

import numpy as np

from .ops.checks import Staged
from .ops.sampling import (Filters, Streams, filtered_probs, raise_accept, raise_rows, sample_filtered,
                           speculative_accept)
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


def staged(be, f: Filters) -> Filters:
    """The filters uploaded once, for the several ops of a round that read them."""
    return Filters(*(Staged(be, a) for a in (f.temperature, f.top_k, f.top_p, f.min_p)))


def propose_sampled(live, drafter, dl, dh, nd: int):
    """Draft slot by slot from the drafter's Markov-chain distributions q (over the target
    vocabulary, filtered with each session's own settings). Returns (drafts [B, nd], confidence
    [B, nd]) on the host, read back in one copy with every slot's row statuses (a bad drafter row
    raises NonFiniteError there), and q [B, nd, V] on the device."""
    be, xp = drafter.be, drafter.be.xp
    B, V = len(live), drafter.trunk.config.vocab
    samplings = [s.params.sampling for s in live]
    filters = staged(be, filters_for(samplings))
    base = Streams.full(B, [sp.seed for sp in samplings], [s.counter for s in live], Tag.DRAFT)
    seeds, counters = Staged(be, base.seed), Staged(be, base.counter)
    q = xp.empty((B, nd, V), np.float32)
    status = xp.empty((nd, B), np.int32)
    chain = drafter.chain(dh, dl, [s.last for s in live])
    for k in range(nd):
        dist = xp.empty((B, V), np.float32)
        streams = Streams(seeds, counters, Streams.full(B, 0, 0, Tag.DRAFT, k).stream)
        tok, _ = sample_filtered(be, drafter.to_target_vocab(chain.step(k)), filters, streams, dist_out=dist,
                                 status_out=status[k])
        q[:, k] = dist
        chain.choose(k, tok)
    drafts, conf, status = be.fetch(chain.drafts, chain.conf, status)
    for k in range(nd):
        raise_rows(status[k], f"drafter logits (slot {k})")
    return drafts, conf, q


def accept_sampled(live, tp, cands, q, vts):
    """Lossless rejection sampling of each session's verified drafts against the trunk's
    filtered distributions p. Returns host (m, next), read back in one copy with the statuses
    of the target rows and of the accept, and advances each session's counter."""
    be, xp = live[0].be, live[0].be.xp
    B = len(live)
    nds = np.array(vts, np.int64) - 1
    samplings = [s.params.sampling for s in live]
    p_status, a_status = xp.empty(tp.logits.shape[0], xp.int32), xp.empty(B, xp.int32)
    p = filtered_probs(be, tp.logits, filters_for(samplings, vts), status_out=p_status)
    drafts = np.concatenate([c[1:] for c in cands]).astype(np.int32)
    q_rows = xp.concatenate([q[i, : nds[i]] for i in range(B)]) if drafts.size else \
        xp.zeros((0, p.shape[1]), np.float32)
    indptr = np.concatenate([[0], np.cumsum(nds)]).astype(np.int32)
    seeds = np.array([sp.seed for sp in samplings], np.uint64)
    counters = np.array([s.counter for s in live], np.uint64)
    m, nxt, _ = speculative_accept(be, drafts, indptr, q_rows, p, seeds, counters, status_out=a_status)
    m, nxt, p_status, a_status = be.fetch(m, nxt, p_status, a_status)
    raise_rows(p_status, "verify logits")
    raise_accept(a_status)
    for s in live:
        s.counter += 1
    return m, nxt


def sample_plain(be, logits, seqs) -> np.ndarray:
    """Plain sampled decode: one draw per row from each sequence's DECODE stream (n = its draw
    count, which advances)."""
    samplings = [s.sampling for s in seqs]
    streams = Streams.full(len(seqs), [sp.seed for sp in samplings], [s.draws for s in seqs], Tag.DECODE)
    tok, _ = sample_filtered(be, logits, filters_for(samplings), streams)
    for s in seqs:
        s.draws += 1
    return be.to_host(tok)
