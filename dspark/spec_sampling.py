"""Sampled mode: the session-side use of dspark.ops.sampling and dspark.ops.coupled.

Every pick of the token at absolute position t, in plain sampled decode, as a session's first
anchor (prime or restore) and in a coupled round, is the Gumbel-max of the filtered row with the
noise of (seed, PICK, n = t): `pick_streams`. Plain decode and every first anchor are therefore
the same function of (seed, prefix), whatever path the request took.

Two speculative samplers (SpecParams.sampler):

* coupled (demotable): the drafter proposes slot k with the noise of its position pos + k + 1, the
  verify picks every column with its position's noise, and drafts are accepted while they equal
  the target's picks (dspark.ops.coupled). The stream is plain sampled decode's, token for token,
  so a session may move to plain decode at any burst boundary.
* rejection: lossless rejection sampling. Each session owns one round counter n
  (`session.counter`, a host integer: the kernels take it as a stream word, so it is never read
  from the device), continued across bursts: draft slot k draws from (DRAFT, n, slot k), the
  accept kernel its tests, residual and bonus from (ACCEPT / RESIDUAL / BONUS, n). The stream
  follows the target's distribution but is not plain decode's, so such a session is never demoted.

Every op is per row, so a session's stream does not depend on its batch. A sampled round waits on
the device twice, as a greedy one: the drafts, confidences and the drafter rows' statuses come
back in one copy after the chain, (m, next) and the statuses of the target rows (and of the
rejection accept) in one copy after it. Filters and stream words are built on the host and
uploaded (Staged), never read back.

A coupled proposal of a drafter whose round is kernels only (DsparkDrafter.recordable) runs as
kernels only (`run_coupled_propose`): per slot the chain's logits (dspark.ops.heads.markov_logits:
the greedy chain's bias, bit for bit) and their pick, every filter, seed and position read from
the pass's inputs block (`pick_fields`); on the host reference (no kernels) the same chain runs
on the host with its checks made once and its noise drawn in one batch (`propose_on_host`), the
same bits. So the op-by-op round and a recorded one (dspark.graphs)
run the same launches; the other layouts draw through the Chain's array operations.
"""

from __future__ import annotations

import functools

import numpy as np

from . import philox
from .ops.argmax import markov_bias_ref
from .ops.checks import Staged, host_and_device
from .ops.coupled import coupled_accept
from .ops.heads import markov_logits
from .ops.sampling import (Filters, Streams, check_streams, draw_ahead, filtered_probs, prepare_rows, raise_accept,
                           raise_rows, sample_filtered, sample_filtered_ref, speculative_accept)
from .ops.workspace import Inputs, Outputs, buffer, fixed
from .philox import Tag


def seeds_of(samplings) -> np.ndarray:
    """The seeds of `samplings` (uint64), or ValueError where one has none: a sampled request
    draws its seed when it is admitted (dspark.params.seeded), never at a pick."""
    for i, sp in enumerate(samplings):
        if sp.seed is None:
            raise ValueError(f"samplings[{i}].seed is None: a sampled request draws its seed when it is admitted "
                             "(dspark.params.seeded: Worker.submit, DsparkSpecSession.prime, plain_generate)")
    return np.array([sp.seed for sp in samplings], np.uint64)


def filters_for(samplings, rows_each=1) -> Filters:
    """Per-row filters: SamplingParams i repeated for rows_each (or rows_each[i]) rows."""
    cols = [np.repeat(np.asarray([getattr(s, f) for s in samplings]), rows_each)
            for f in ("temperature", "top_k", "top_p", "min_p")]
    return Filters.full(len(cols[0]), *cols)


def pick_streams(samplings, positions, rows_each=1) -> Streams:
    """Per-row PICK streams: SamplingParams i's seed for rows_each (or rows_each[i]) rows, row r
    drawing the token at absolute position positions[r]."""
    return Streams.full(len(positions), np.repeat(seeds_of(samplings), rows_each), positions, Tag.PICK)


def pick_at(be, logits, samplings, positions) -> np.ndarray:
    """Plain sampled picks: row i of logits [rows, V] is the filtered Gumbel-max with the noise
    of (samplings[i].seed, position positions[i]). Host tokens [rows]."""
    tok, _ = sample_filtered(be, logits, filters_for(samplings), pick_streams(samplings, positions))
    return be.to_host(tok)


def staged(be, f: Filters) -> Filters:
    """The filters uploaded once, for the several ops of a round that read them."""
    return Filters(*(Staged(be, a) for a in (f.temperature, f.top_k, f.top_p, f.min_p)))


def pick_fields(rows: int, counters: int | None = None) -> dict:
    """The inputs-block fields of `rows` picks: each row's filters, seed and PICK stream word, and
    `counters` (default: rows) positions, the stream counters of its draws."""
    return {"temperature": (rows, np.float32), "top_k": (rows, np.int32), "top_p": (rows, np.float32),
            "min_p": (rows, np.float32), "seed": (rows, np.uint64), "counter": (counters or rows, np.uint64),
            "stream": (rows, np.uint32)}


def fill_picks(inp, samplings, positions, rows_each=1) -> None:
    """Write pick_fields (host side): SamplingParams i's filters and seed for rows_each (or
    rows_each[i]) rows, and the positions the draws pick (the counters)."""
    inp.set(**_pick_settings(tuple(samplings), rows_each if np.isscalar(rows_each) else tuple(rows_each)),
            counter=np.asarray(positions, np.uint64).reshape(-1))


@functools.lru_cache(maxsize=256)
def _pick_settings(samplings: tuple, rows_each) -> dict:
    """The per-row settings of pick_fields, which a batch keeps round after round (made once)."""
    f = filters_for(samplings, rows_each)
    return {"temperature": f.temperature, "top_k": f.top_k, "top_p": f.top_p, "min_p": f.min_p,
            "seed": np.repeat(seeds_of(samplings), rows_each),
            "stream": philox.stream_word(int(Tag.PICK), 0)}


def picks_of(inp, counter=None) -> tuple[Filters, Streams]:
    """The Filters and PICK Streams of pick_fields (device views, read by the kernels)."""
    return (Filters(inp["temperature"], inp["top_k"], inp["top_p"], inp["min_p"]),
            Streams(inp["seed"], inp["counter"] if counter is None else counter, inp["stream"]))


def coupled_fields(drafter, B: int) -> dict:
    """What a coupled proposal hands back in one copy: drafts [B nd], the drafter rows' statuses
    [nd B] (slot-major) and confidences [B nd]."""
    nd = drafter.config.drafts
    return {"drafts": (B * nd, np.int32), "status": (nd * B, np.int32),
            **({"conf": (B * nd, np.float32)} if drafter.has_confidence else {})}


def fill_coupled(inp, live, nd: int) -> None:
    """The coupled proposal's pick fields: slot k of session b picks position pos_b + k + 1
    (counter [nd B], slot-major)."""
    pos = np.array([s.cache.pos for s in live], np.int64)
    fill_picks(inp, [s.params.sampling for s in live], pos[None, :] + np.arange(1, nd + 1)[:, None])


# The host reference keeps a drafter's Markov bias w2^T w1[x] for every x where the table is at most this
# many bytes: a slot's bias is then a row lookup (the same bits: markov_bias_ref sums each row alone).
BIAS_TABLE_BYTES = 1 << 24


def bias_table(drafter, w1, w2):
    """markov_bias_ref of every token [V, V] (None above BIAS_TABLE_BYTES), kept on the drafter
    for these weights."""
    vocab = w2.shape[1]
    if vocab * vocab * 4 > BIAS_TABLE_BYTES:
        return None
    key = (id(w1), id(w2))
    got = getattr(drafter, "_bias_table", None)
    if got is None or got[0] != key:
        rows = range(0, vocab, 64)  # in pieces: the sum's temporary holds a piece's rank x V products
        got = (key, np.concatenate([markov_bias_ref(w1, w2, np.arange(a, min(a + 64, vocab))) for a in rows]))
        drafter._bias_table = got
    return got[1]


def propose_on_host(drafter, logits, picks, anchors, drafts, status, ws=None) -> None:
    """The coupled proposal on the host reference (no kernels), the same bits as the kernel
    layout's launches: the filters and every slot's streams checked once (sample_filtered checks
    them per call), the noise rows of every slot's position drawn in one batch (`draw_ahead`; the
    verify's picks reuse them), each slot's Markov bias a row of `bias_table`, and per slot the
    pick of sample_filtered_ref (no prob: a proposal reads none). Writes drafts [B, nd] and status
    [nd B] (slot-major); `ws` is not used."""
    be, c, nd = drafter.be, drafter.config, drafter.config.drafts
    x = np.asarray(logits, np.float32)
    B, vocab = drafts.shape[0], x.shape[1]
    x = x.reshape(B, nd, vocab)
    seed, counter, stream = picks["seed"].host, picks["counter"].host, picks["stream"].host
    f, _ = picks_of(picks)
    _, _, _, host = prepare_rows(be, x[:, 0], f)
    streams = check_streams(be, Streams(np.tile(seed, nd), counter, np.tile(stream, nd)), len(counter))
    draw_ahead(be, streams.seed, streams.counter, streams.stream, vocab)
    filters = Filters(*host)
    w1, w2 = (drafter.w["markov.w1"], drafter.w["markov.w2"]) if c.markov == "vanilla" else (None, None)
    table = bias_table(drafter, w1, w2) if w1 is not None else None
    prev = np.asarray(host_and_device(be, anchors, "anchors")[0], np.int64)
    for k in range(nd):
        row = x[:, k]
        if w1 is not None:
            safe = np.where((prev < 0) | (prev >= vocab), 0, prev)
            row = row + (table[safe] if table is not None else markov_bias_ref(w1, w2, safe))
        at = slice(k * B, (k + 1) * B)
        r = sample_filtered_ref(row, filters, Streams(streams.seed[at], streams.counter[at], streams.stream[at]),
                                "gumbel", with_prob=False)
        drafts[:, k], status[at] = r["token"], r["status"]
        prev = r["token"].astype(np.int64)


def propose_by_slots(drafter, logits, picks, anchors, drafts, status, ws=None) -> None:
    """The coupled proposal as launches (kernels; any backend): slot by slot the chain's logits
    (markov_logits, x_{k-1} read on the device) and their pick (sample_filtered) with the noise of
    the slot's position. Writes drafts [B, nd] and status [nd B] (slot-major)."""
    be, c, nd = drafter.be, drafter.config, drafter.config.drafts
    B, V = drafts.shape[0], logits.shape[1]
    slot_picks = fixed(be, ws, "coupled.slot_picks", (nd, B), np.int32)
    w1, w2 = (drafter.w["markov.w1"], drafter.w["markov.w2"]) if c.markov == "vanilla" else (None, None)
    filters, _ = picks_of(picks)
    counter = picks["counter"]
    row = buffer(be, ws, "coupled.logits", B, (V,))
    for k in range(nd):
        markov_logits(be, logits, w1, w2, anchors, slot_picks[k - 1] if k else None, k, nd, drafts, out=row)
        at = slice(k * B, (k + 1) * B)
        streams = Streams(picks["seed"], Staged.of(counter.host[at], counter.device[at]), picks["stream"])
        sample_filtered(be, row, filters, streams, token_out=slot_picks[k], status_out=status[at], ws=ws)
    markov_logits(be, logits, w1, w2, anchors, slot_picks[nd - 1], nd, nd, drafts, out=row)  # the last slot's picks


def run_coupled_propose(drafter, hidden, logits, picks, anchors, ws=None, out: Outputs | None = None) -> Outputs:
    """The coupled proposal's device work, kernels only (`propose_by_slots`; on the host reference
    `propose_on_host`, the same bits), then the confidences of the chain's drafts. `picks`: the
    pick fields (a Scope of the pass's inputs block), `anchors` Staged int32 [B]. Writes `out`
    (coupled_fields), unread."""
    be, nd = drafter.be, drafter.config.drafts
    B = np.asarray(anchors).shape[0]
    out = out or Outputs(be, coupled_fields(drafter, B))
    drafts = out["drafts"].reshape(B, nd)
    propose = propose_on_host if be.kernels is None else propose_by_slots
    propose(drafter, logits, picks, anchors, drafts, out["status"], ws)
    if drafter.has_confidence:
        drafter.slot_confidence(hidden, anchors, drafts, ws, out["conf"])
    return out


def coupled_proposals(drafter, B: int, got: dict) -> tuple[np.ndarray, np.ndarray]:
    """Host (drafts, conf) [B, nd] from a coupled proposal's copy back, or NonFiniteError naming
    the first slot and session whose drafter logits were bad."""
    nd = drafter.config.drafts
    status = got["status"].reshape(nd, B)
    for k in np.flatnonzero(status.any(axis=1))[:1]:   # the first slot holding a bad row names it
        raise_rows(status[k], f"drafter logits (slot {k})")
    conf = got["conf"].reshape(B, nd).copy() if "conf" in got else np.full((B, nd), np.nan, np.float32)
    return got["drafts"].reshape(B, nd).astype(np.int32), conf


def propose_sampled(live, drafter, dl, dh, nd: int, kernels: bool = False):
    """Draft slot by slot from the drafter's Markov chain, each slot a filtered draw from the
    chain's logits mapped to the target vocabulary, filtered with each session's own settings:
    coupled, slot k is the Gumbel-max pick with the noise of position pos + k + 1 (the target's
    noise there); rejection, a draw from (DRAFT, n, slot k) whose distribution q the accept needs.
    Returns (drafts [B, nd], confidence [B, nd]) on the host, read back in one copy with every
    slot's row statuses (a bad drafter row raises NonFiniteError there), and q [B, nd, V] on the
    device (None when coupled)."""
    be, xp = drafter.be, drafter.be.xp
    B, V = len(live), drafter.trunk.config.vocab
    coupled = live[0].params.coupled
    if coupled and kernels:  # dspark.graphs.kernels_only(drafter): the recorded rounds' proposal, op by op
        inp = Inputs(be, {"anchors": (B, np.int32), **pick_fields(B, nd * B)})
        inp.set(anchors=[s.last for s in live])
        fill_coupled(inp, live, nd)
        out = run_coupled_propose(drafter, dh, dl, inp.upload(), inp["anchors"])
        return (*coupled_proposals(drafter, B, out.fetch()), None)
    samplings = [s.params.sampling for s in live]
    filters = staged(be, filters_for(samplings))
    if coupled:
        pos = np.array([s.cache.pos for s in live], np.int64)
        seeds, q = Staged(be, seeds_of(samplings)), None
        pick = Staged(be, pick_streams(samplings, pos).stream)
        ahead = np.arange(1, nd + 1)  # the round's positions: its proposals and its verify's picks
        draw_ahead(be, np.repeat(seeds.host, nd), (pos[:, None] + ahead).reshape(-1).astype(np.uint64),
                   np.repeat(pick.host, nd), V)
    else:
        base = Streams.full(B, seeds_of(samplings), [s.counter for s in live], Tag.DRAFT)
        seeds, counters = Staged(be, base.seed), Staged(be, base.counter)
        q = xp.empty((B, nd, V), np.float32)
    status = xp.empty((nd, B), np.int32)
    chain = drafter.chain(dh, dl, [s.last for s in live])
    for k in range(nd):
        logits = drafter.to_target_vocab(chain.step(k))
        if coupled:
            streams = Streams(seeds, (pos + k + 1).astype(np.uint64), pick)
            tok, _ = sample_filtered(be, logits, filters, streams, status_out=status[k])
        else:
            dist = xp.empty((B, V), np.float32)
            streams = Streams(seeds, counters, Streams.full(B, 0, 0, Tag.DRAFT, k).stream)
            tok, _ = sample_filtered(be, logits, filters, streams, dist_out=dist, status_out=status[k])
            q[:, k] = dist
        chain.choose(k, tok)
    drafts, conf, status = be.fetch(chain.drafts, chain.conf, status)
    for k in range(nd):
        raise_rows(status[k], f"drafter logits (slot {k})")
    return drafts, conf, q


def accept_coupled(live, tp, cands, vts):
    """The coupled accept: each verify column's target pick with the noise of the position it
    predicts, drafts accepted while they equal them. Returns host (m, next), read back in one copy
    with the target rows' statuses."""
    be, xp = live[0].be, live[0].be.xp
    samplings = [s.params.sampling for s in live]
    positions = np.concatenate([s.cache.pos + 1 + np.arange(vt) for s, vt in zip(live, vts)])
    status = xp.empty(tp.logits.shape[0], xp.int32)
    m, nxt = coupled_accept(be, tp.logits, np.concatenate(cands).astype(np.int32), tp.row_indptr,
                            filters_for(samplings, vts), pick_streams(samplings, positions, vts), status_out=status)
    m, nxt, status = be.fetch(m, nxt, status)
    raise_rows(status, "verify logits")
    return m, nxt


def accept_rejection(live, tp, cands, q, vts):
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
    seeds = seeds_of(samplings)
    counters = np.array([s.counter for s in live], np.uint64)
    m, nxt, _ = speculative_accept(be, drafts, indptr, q_rows, p, seeds, counters, status_out=a_status)
    m, nxt, p_status, a_status = be.fetch(m, nxt, p_status, a_status)
    raise_rows(p_status, "verify logits")
    raise_accept(a_status)
    for s in live:
        s.counter += 1
    return m, nxt

