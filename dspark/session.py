"""DsparkSpecSession: one request decoded speculatively, round by round (DESIGN section 2).

A round: draft -> propose -> verify width -> verify -> accept -> commit -> roll back -> ingest.
`spec_round` runs one round for a batch of sessions with one drafter pass and one trunk pass;
every op is row-invariant, so a session's tokens do not depend on the batch.

Host round. A greedy round waits on the device twice: once for the drafts, their confidences and
the drafter's NaN flags (one packed copy, DsparkDrafter.propose_greedy), once for the accept's
(m, next) and the verify's NaN flags (one packed copy). Every op in between takes host index
arrays (validated on the host, uploaded, never read back) and the batch's cached pointer tables
(dspark.models.batch_tables); a NaN anywhere raises NonFiniteError at one of those two points.
A sampled round does the same with its row statuses.

No snapshot. The verify reads the recurrent state and never writes it (gdn_scan commit=False);
the rollback then moves it on by exactly the kept columns: checkpoint select copies the
checkpoint after column keep - 1, replay re-scans the kept columns from it. So the state a
rollback can select is all a round keeps (the per-column checkpoints, or the scan inputs), and a
round that fails before its commit leaves every session exactly as it was, with no copy to undo.

Riders. A round may carry plain decode sequences in its trunk pass (`Riders`): each one column,
its pending token, a verify of width 1 with no drafts; its row is committed and its state moved on
by one column with the sessions', and its next token is picked as plain decode picks it. Row
invariance makes that column bitwise the decode step, so a plain stream does not depend on riding.

Invariant at every burst boundary of an unfinished session: cache.pos == prompt rows + emitted
tokens, and `last` (the anchor) is pending. That is what makes `into_demoted` exact.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from . import graphs
from .cost import cost_model
from .decode import check_prompt, first_token, pick_tokens, plain_step_rule
from .params import SamplingParams, SpecParams, seeded
from .errors import StateError
from .gain import HISTORY, position_acceptance, session_prior, width_by_gain
from .models.cache import Cache
from .models.drafter import DraftKV, DsparkDrafter
from .models.trunk import HybridTrunk
from .ops.argmax import greedy_accept, raise_on_nan
from .profile import phase
from .stats import SpecStats

_ids = itertools.count()


@dataclass
class SpecBoundaryCapture:
    """The state at the end of the prompt: enough to start the same request again without a
    prefill. `cache` holds the attention rows and the recurrent snapshot; `draft_kv` the draft-KV
    ring, built from the trunk layers `taps` (prime records them; () means the trunk's default
    tap_layers, as DrafterConfig.taps does); `boundary_logits` the trunk logits at the last
    prompt row."""
    prompt: tuple[int, ...]
    pos: int
    cache: Cache
    draft_kv: DraftKV
    boundary_logits: np.ndarray
    taps: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return (self.cache.nbytes() + sum(int(a.nbytes) for a in self.draft_kv.k + self.draft_kv.v)
                + int(self.boundary_logits.nbytes))

    def free(self) -> int:
        return self.cache.free() + self.draft_kv.free()


class DsparkSpecSession:
    """A request decoded with DSpark speculation. Public: `cache`, `rounds`, `emitted`, `stats`."""

    cache: Cache
    """The trunk cache: K/V per attention layer, recurrent state per gdn layer, and `pos`, the committed rows."""
    rounds: int
    """Rounds run so far."""
    emitted: list[int]
    """The tokens emitted so far, in order (the public stream)."""
    stats: SpecStats
    """Rounds, drafted and accepted counts, acceptance by draft position and the histogram of accepts."""

    def __init__(self, *_, **__):
        raise TypeError("use DsparkSpecSession.prime(trunk, drafter, prompt_ids, params) or .restore(...)")

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def _new(cls, trunk: HybridTrunk, drafter: DsparkDrafter, params: SpecParams) -> "DsparkSpecSession":
        if drafter.trunk is not trunk:
            raise ValueError("drafter was built for another trunk")
        if not isinstance(params, SpecParams):
            raise TypeError(f"params: expected SpecParams, got {type(params).__name__}")
        sampling = seeded(params.sampling)  # sampled without a seed: its own, drawn now
        if sampling is not params.sampling:
            params = replace(params, sampling=sampling)
        s = object.__new__(cls)
        s.id = next(_ids)
        s.trunk, s.drafter, s.be, s.params = trunk, drafter, trunk.be, params
        s.verify = verify_policy(params, drafter)
        s.owner = f"spec/{s.id}"
        s.rounds = 0
        s.emitted: list[int] = []
        s.stats = SpecStats()
        s.recent = deque(maxlen=HISTORY)  # (tokens emitted, verify width) of the last rounds: dspark.gain
        s.gain = None            # the gain at the last check (dspark.gain.demote_check)
        s.prior = None           # its prior tokens per round, fixed when first read (dspark.gain.session_prior)
        s.below = 0              # consecutive checks with the gain below 1
        s.remembered = False     # folded into the drafter's memory once it ended (dspark.gain.remember)
        s.last = -1
        s.prompt_len = 0
        s.m_prev = 1
        s.counter = 0            # rejection-sampled: the round counter n of dspark.spec_sampling, across bursts
        s._finished = None       # reason string once finished
        s._demoted = False
        s._in_round = False
        s._capture = None
        s.cache = s.kv = None
        return s

    @classmethod
    def prime(cls, trunk: HybridTrunk, drafter: DsparkDrafter, prompt_ids, params: SpecParams | None = None,
              backend=None) -> "DsparkSpecSession":
        """Prefill the prompt into a new cache and draft KV, in passes of trunk.prompt_chunk tokens
        (as plain decode prefills: the same bits whatever the passes); take the first anchor from
        the boundary logits. With params.capture, keep a SpecBoundaryCapture."""
        params = params or SpecParams()
        if backend is not None and backend is not trunk.be:
            raise ValueError(f"backend={backend.name!r}: the trunk lives on {trunk.be.name!r}")
        s = cls._new(trunk, drafter, params)
        capacity = trunk.config.max_ctx
        p = check_prompt(trunk, prompt_ids, capacity)
        try:
            s.cache = trunk.new_cache(owner=f"cache/{s.id}")
            s.kv = drafter.new_kv(f"{s.owner}/draft_kv")
            with phase("prime"):  # in passes of trunk.prompt_chunk tokens: memory bounded by the pass
                for tp in trunk.prompt_passes(s.cache, p, taps=drafter.taps):
                    drafter.ingest([s.kv], tp.taps, tp.row_indptr)
            boundary = tp.logits[-1:]
            s.last = first_token(s.be, boundary, s.cache.pos, s.params.sampling)
            s.prompt_len = int(p.size)
            if params.capture:
                s._capture = SpecBoundaryCapture(tuple(int(t) for t in p), s.cache.pos,
                                                 s.cache.copy(f"capture/{s.id}/cache"),
                                                 s.kv.copy(f"capture/{s.id}/draft_kv"), s.be.to_host(boundary)[0],
                                                 drafter.taps)
        except BaseException:
            s._release_all()
            raise
        return s

    @classmethod
    def restore(cls, trunk: HybridTrunk, drafter: DsparkDrafter, capture: SpecBoundaryCapture,
                params: SpecParams | None = None) -> "DsparkSpecSession":
        """Start a request whose prompt equals `capture.prompt` from the capture instead of a
        prefill. The output is byte-identical to a cold prime. The capture is not consumed."""
        params = params or SpecParams()
        s = cls._new(trunk, drafter, params)
        kv_shape = (len(capture.draft_kv.k), *capture.draft_kv.shape)
        want = (drafter.config.layers, drafter.config.kv_heads, drafter.ring, drafter.config.head_dim)
        taps = tuple(capture.taps or trunk.config.tap_layers)
        if taps != drafter.taps or kv_shape != want:
            raise ValueError(f"capture: its draft KV (layers, heads, ring, dim)={kv_shape} was built from trunk layers "
                             f"{taps}{'' if capture.taps else ' (capture.taps=(): the trunk default tap_layers)'}; "
                             f"this drafter taps {drafter.taps} into {want}")
        try:
            s.cache = capture.cache.copy(f"cache/{s.id}")
            s.kv = capture.draft_kv.copy(f"{s.owner}/draft_kv")
            s.last = first_token(s.be, s.be.asarray(capture.boundary_logits[None, :]), capture.pos, s.params.sampling)
            s.prompt_len = len(capture.prompt)
        except BaseException:
            s._release_all()
            raise
        return s

    # ---- the seed's surface -------------------------------------------------------------------
    def cache_max_ctx(self) -> int:
        """The cache's capacity in rows: a round that could pass it finishes the session instead."""
        return self.cache.capacity

    def finished(self) -> bool:
        """Whether the session has stopped: EOS, the token budget, or the context cap."""
        return self._finished is not None

    @property
    def finish_reason(self) -> str | None:
        return self._finished

    def pos(self) -> int:
        """Committed rows in the trunk cache: prompt rows + emitted tokens at a burst boundary."""
        return self.cache.pos

    @property
    def seed(self) -> int | None:
        """The seed of its sampled stream (given, or drawn at prime or restore); None when greedy."""
        return None if self.params.sampling.greedy else self.params.sampling.seed

    def take_prefix_capture(self) -> SpecBoundaryCapture | None:
        """The prompt-end capture, exactly once; then None. The caller owns (and frees) it."""
        if not self.params.capture:
            raise StateError("take_prefix_capture: capture is off for this session (SpecParams.capture=False)")
        cap, self._capture = self._capture, None
        return cap

    def into_demoted(self) -> tuple[Cache, int]:
        """Hand the trunk cache and the pending anchor to plain batched decode (greedy, or with the
        session's sampling: PlainBatch.join(..., sampling=params.sampling)). Frees the draft KV (and
        an untaken capture). Refuses rejection-sampled, finished, demoted and mid-round sessions
        and leaves them intact."""
        self._require_live("into_demoted")
        if not self.params.demotable:
            raise StateError("into_demoted: a session sampled by rejection cannot be demoted (its stream depends on "
                             "its own round counter); SpecParams(sampler='coupled') sessions can")
        if self._finished is not None:
            raise StateError(f"into_demoted: the session is finished ({self._finished})")
        expected = self.prompt_len + len(self.emitted)
        if self.cache.pos != expected:  # the burst-boundary invariant; never expected to fire
            raise StateError(f"into_demoted: cache.pos={self.cache.pos} but prompt + emitted = {expected}")
        self._demoted = True
        self._release_speculative()
        cache, self.cache = self.cache, None
        return cache, self.last

    # ---- rounds and bursts --------------------------------------------------------------------
    def round(self) -> list[int]:
        """One round; returns the tokens it emitted."""
        self._require_live("round")
        return spec_round([self])[0]

    def burst(self, target: int | None = None) -> list[int]:
        """Whole rounds until at least `target` tokens (default params.burst_target) were emitted,
        or the session finished. Returns the tokens emitted in this burst."""
        return spec_burst([self], target)[0]

    def _require_live(self, what: str) -> None:
        if self._demoted:
            raise StateError(f"{what}: the session was demoted; its cache belongs to the plain path now")
        if self._in_round:
            raise StateError(f"{what}: the session is mid-round")

    def check_invariant(self) -> None:
        """cache.pos == prompt rows + emitted, at a burst boundary of an unfinished session."""
        if self._finished is None and not self._demoted:
            want = self.prompt_len + len(self.emitted)
            if self.cache.pos != want:
                raise AssertionError(f"session {self.id}: cache.pos={self.cache.pos}, prompt + emitted = {want}")

    # ---- memory -------------------------------------------------------------------------------
    def _release_speculative(self) -> int:
        """Free the draft KV and an untaken capture."""
        n = 0
        if self.kv is not None:
            n += self.kv.free()
        if self._capture is not None:
            n += self._capture.free()
        self.kv = self._capture = None
        return n

    def _release_all(self) -> None:
        self._release_speculative()
        if self.cache is not None:
            self.cache.free()

    def close(self) -> None:
        """Free everything the session still owns (a finished or abandoned request)."""
        if not self._demoted:
            self._release_all()
            self.cache = None
            self._demoted = True

    def _finish(self, reason: str) -> None:
        self._finished = reason

    def _emit(self, toks: list[int]) -> list[int]:
        self.emitted.extend(toks)
        return toks


def _group(sessions: list[DsparkSpecSession]) -> tuple[HybridTrunk, DsparkDrafter]:
    t, d = sessions[0].trunk, sessions[0].drafter
    for s in sessions:
        if s.trunk is not t or s.drafter is not d:
            raise ValueError("sessions of one batch must share the trunk and drafter")
        s._require_live("round")
    return t, d


def verify_policy(params: SpecParams, drafter: DsparkDrafter) -> str:
    """SpecParams.verify resolved for this drafter: "auto" is its confidence head where it has one,
    the ladder otherwise."""
    if params.verify == "auto":
        return "confidence" if drafter.has_confidence else "ladder"
    if params.verify == "confidence" and not drafter.has_confidence:
        raise ValueError(f"SpecParams.verify={params.verify!r}: this drafter has no confidence head; use 'auto', "
                         "'gain', 'ladder' or 'full'")
    return params.verify


def verify_width(s: DsparkSpecSession, conf: np.ndarray, nd: int) -> int:
    """Columns to verify: every draft ("full", as dflash_generate), 1 + the confident prefix (tau),
    the width of most expected tokens per unit of cost ("gain": by the confidence head, or by the
    session's acceptance by position where the drafter has none), or the ladder; clamped to
    [2, min(nd + 1, max_verify)]."""
    cap = min(s.params.max_verify or nd + 1, nd + 1)
    if s.verify == "full":
        return cap
    if s.verify == "gain":
        if not s.drafter.has_confidence:  # DFlash: the session's own acceptance by position
            conf = position_acceptance(s.recent, nd, session_prior(s))
        return width_by_gain(cost_model(s.be), conf, cap, s.cache.pos, s.params.accept)
    if s.verify == "confidence":
        below = np.flatnonzero(conf < s.params.tau)
        return min(max(1 + (int(below[0]) if below.size else nd), 2), cap)
    return min(max(s.m_prev + 2, 3), cap)


@dataclass
class Riders:
    """Plain decode sequences (dspark.decode.PlainSequence, `PlainBatch.riders()`) riding a round's
    trunk pass, one column each: a verify of width 1 with no drafts, whose column is bitwise the
    decode step at that position (DESIGN section 3), committed and rolled forward by one row with
    the round's sessions. The weights are read once for both. `picks` ({sequence id: next token},
    the pick plain decode takes from that column) is set once a round carried them; it stays None
    where the round did not (no live session, or a round replayed from recordings): the caller
    then runs the plain step itself."""
    seqs: list
    picks: dict | None = None


def spec_round(sessions: list[DsparkSpecSession], riders: Riders | None = None) -> list[list[int]]:
    """One round for each unfinished session; returns the tokens each emitted (finished: []).
    `riders`: plain sequences to decode in the same trunk pass (Riders)."""
    out = {s.id: [] for s in sessions}
    live = [s for s in sessions if s._finished is None]
    if not live:
        return [out[s.id] for s in sessions]
    trunk, drafter = _group(live)
    # Guard: a session with no row left emits its anchor and finishes, exactly as plain decode.
    for s in [s for s in live if s.cache.pos >= s.cache.capacity]:
        out[s.id] = s._emit([s.last])
        s._finish("context")
    live = [s for s in live if s._finished is None]
    if live:
        for s in live:
            s._in_round = True
        try:
            with cost_model(trunk.be).timed("round", len(live), max(s.cache.pos for s in live),
                                            rule=live[0].params.accept) as note:
                emitted = _round(trunk, drafter, live, note, riders if riders is not None and riders.seqs else None)
            for s, toks in zip(live, emitted):
                out[s.id] = toks
        finally:
            for s in live:
                s._in_round = False
    return [out[s.id] for s in sessions]


def _round(trunk: HybridTrunk, drafter: DsparkDrafter, live: list[DsparkSpecSession], note: dict,
           riders: Riders | None = None) -> list[list[int]]:
    rule = live[0].params.accept
    if any(s.params.accept != rule for s in live):
        raise ValueError(f"a batch mixes accept rules {sorted({s.params.accept for s in live})} (greedy, coupled and "
                         "rejection-sampled sessions): run them in separate rounds")
    launches = live[0].params.launches
    if any(s.params.launches != launches for s in live):
        raise ValueError(f"a batch mixes launch modes {sorted({s.params.launches for s in live})}: run them in "
                         "separate rounds")
    if recorded(live[0].params, trunk, drafter):  # riders are not carried: the caller steps them (Riders)
        with graphs.round_graphs(drafter, launches) as runner:
            return _recorded_round(runner, live, note)
    return _plain_round(trunk, drafter, live, rule, note, riders)


def recorded(params: SpecParams, trunk: HybridTrunk, drafter: DsparkDrafter) -> bool:
    """Whether rounds of sessions with `params` are replayed from recordings (dspark.graphs); such
    a round carries no riders."""
    return params.launches != "plain" and graphs.supported(trunk, drafter, params.accept)


def _plain_round(trunk: HybridTrunk, drafter: DsparkDrafter, live: list[DsparkSpecSession], rule: str, note: dict,
                 riders: Riders | None = None):
    """A round op by op: every launch planned and checked as it is issued."""
    nd = drafter.config.drafts
    greedy = rule == "greedy"
    with phase("draft"):
        dh, dl = drafter.draft([s.kv for s in live], [s.last for s in live])
    with phase("propose"):  # the first wait on the device: drafts, confidences, NaN flags
        if greedy:
            drafts, conf = drafter.propose_greedy(dh, dl, [s.last for s in live])
            q = None
        else:
            from .spec_sampling import propose_sampled
            drafts, conf, q = propose_sampled(live, drafter, dl, dh, nd, graphs.kernels_only(drafter))
    vts, cands = _candidates(live, drafts, conf, nd, note)
    if riders is not None:
        note["riders"], note["rider_rule"] = len(riders.seqs), plain_step_rule(riders.seqs)
    return _finish_plain(trunk, drafter, live, vts, cands, rule, q, riders)


def _recorded_round(runner, live: list[DsparkSpecSession], note: dict) -> list[list[int]]:
    """A round of recorded passes (dspark.graphs), greedy or coupled sampled: the draft, the verify
    at the batch's widest width and the commit, each one recording replayed; the host only decides
    the verify width and the cut between the two copies back. Bitwise the plain round."""
    nd = runner.drafter.config.drafts
    with phase("draft"):  # the draft pass ends with the first wait: drafts, confidences, NaN flags
        drafts, conf = runner.propose(live)
    vts, cands = _candidates(live, drafts, conf, nd, note)
    W = max(vts)
    if any(s.cache.pos + W > s.cache.capacity for s in live):  # a padded column past a cache's end
        return _finish_plain(runner.trunk, runner.drafter, live, vts, cands, live[0].params.accept)
    with phase("verify"):  # and the accept: the second wait, (m, next) and NaN flags
        tp, m, nxt = runner.verify(live, cands, vts)
    keep = np.array([_cut(s, cands[i][: int(m[i]) + 1]) for i, s in enumerate(live)], np.int32)
    ends = np.array([_ends(s, cands[i][: keep[i]]) is not None for i, s in enumerate(live)], bool)
    with phase("commit"):  # commit, rollback and ingest (none for a session this round finishes)
        runner.commit(live, tp, W, keep, np.where(ends, 0, keep).astype(np.int32))
    emitted = []
    for i, s in enumerate(live):
        s.cache.pos += int(keep[i])
        emitted.append(_settle(s, cands[i], vts[i], int(m[i]), int(keep[i]), int(nxt[i])))
        if s._finished is None:
            s.kv.pos += int(keep[i])
    return emitted


def _finish_plain(trunk, drafter, live, vts, cands, rule: str = "greedy", q=None,
                  riders: Riders | None = None) -> list[list[int]]:
    """Verify, accept, commit, roll back and ingest op by op, from the candidates (accept `rule`:
    SpecParams.accept). `riders`' columns follow the sessions' in the same verify pass."""
    be = trunk.be
    ride = riders.seqs if riders is not None else []
    caches = [s.cache for s in live] + [r.cache for r in ride]
    widths = list(vts) + [1] * len(ride)
    # No snapshot: the verify leaves the recurrent state as it is (module doc), so anything that
    # fails before the commit leaves every session (and rider) exactly as it was.
    with phase("verify"), cost_model(be).timed("verify", len(caches), max(c.pos for c in caches),
                                              width=float(np.mean(widths))):
        tp = trunk.verify(caches, cands + [np.array([r.last], np.int32) for r in ride],
                          checkpoints=live[0].params.rollback == "checkpoint", taps=drafter.taps)
    rows = int(tp.row_indptr[len(live)])
    picks = None
    if ride:  # before anything commits; the pick at the position the token will fill, as PlainBatch.step takes it
        picks = pick_tokens(be, tp.logits[rows:], ride, [r.cache.pos + 1 for r in ride])
        tp = replace(tp, logits=tp.logits[:rows], row_indptr=tp.row_indptr[: len(live) + 1])
    with phase("accept"):  # the second wait: (m, next) and the verify's NaN flags
        if rule == "greedy":
            flag = be.xp.empty(len(live), be.xp.int32)
            m, nxt = greedy_accept(be, tp.logits, be.asarray(np.concatenate(cands)), tp.row_indptr, nan_flag=flag)
            m, nxt, flag = be.fetch(m, nxt, flag)
            raise_on_nan(flag, "verify logits", "session")
        elif rule == "coupled":
            from .spec_sampling import accept_coupled
            m, nxt = accept_coupled(live, tp, cands, vts)
        else:
            from .spec_sampling import accept_rejection
            m, nxt = accept_rejection(live, tp, cands, q, vts)
    keep = np.array([_cut(s, cands[i][: int(m[i]) + 1]) for i, s in enumerate(live)], np.int32)
    if ride:  # a rider keeps its one column: its decode step
        keep_all = np.concatenate([keep, np.ones(len(ride), np.int32)])
        full = replace(tp, row_indptr=np.concatenate([tp.row_indptr, rows + np.arange(1, len(ride) + 1)]).astype(np.int32))
    else:
        keep_all, full = keep, tp
    with phase("commit"):
        trunk.commit_rows(caches, full, keep_all)
    with phase("rollback"):
        rollback(trunk, caches, live[0].params.rollback, full, keep_all)
    if ride:
        riders.picks = {r.id: int(t) for r, t in zip(ride, picks)}
    emitted = [_settle(s, cands[i], vts[i], int(m[i]), int(keep[i]), int(nxt[i])) for i, s in enumerate(live)]
    with phase("ingest"):
        ing = [i for i, s in enumerate(live) if s._finished is None]
        if ing:
            kept_rows = np.concatenate([tp.row_indptr[i] + np.arange(keep[i]) for i in ing])
            drafter.ingest([live[i].kv for i in ing], tp.taps[be.xp.asarray(kept_rows)],
                           np.concatenate([[0], np.cumsum(keep[ing])]).astype(np.int32))
    return emitted


def _candidates(live, drafts, conf, nd: int, note: dict):
    """(verify widths, candidate blocks [anchor, d_1 .. d_{vt-1}]) of each session; the mean width
    goes in the cost model's `note` of the round."""
    vts = [min(verify_width(s, conf[i], nd), s.cache.capacity - s.cache.pos) for i, s in enumerate(live)]
    note["width"] = float(np.mean(vts))
    cands = [np.concatenate([[s.last], drafts[i, : vts[i] - 1]]).astype(np.int32) for i, s in enumerate(live)]
    return vts, cands


def _ends(s: DsparkSpecSession, toks) -> str | None:
    """Why emitting `toks` finishes the session (an end-of-sequence id last, or the budget), if it does."""
    if len(toks) and toks[-1] in s.trunk.config.eos_ids:
        return "eos"
    return "budget" if len(s.emitted) + len(toks) >= s.params.max_new_tokens else None


def _settle(s: DsparkSpecSession, cand, vt: int, m: int, keep: int, nxt: int) -> list[int]:
    """The host side of a session's round once its rows are committed: emit the kept tokens,
    count the round, finish on EOS or the budget, take the next anchor."""
    toks = [int(t) for t in cand[:keep]]
    reason = _ends(s, toks)
    s.stats.record(vt - 1, m)
    s.recent.append((m + 1, vt))  # dspark.gain's window
    s.rounds += 1
    s.m_prev = m
    s._emit(toks)
    if reason:
        s._finish(reason)
    s.last = nxt
    return toks


def _cut(s: DsparkSpecSession, toks: np.ndarray) -> int:
    """Rows to commit: the accepted tokens, cut after the first end-of-sequence id (any of
    config.eos_ids) and at the token budget."""
    n = len(toks)
    eos = np.flatnonzero(np.isin(toks, s.trunk.config.eos_ids))
    if eos.size:
        n = int(eos[0]) + 1
    return min(n, s.params.max_new_tokens - len(s.emitted))


def rollback(trunk: HybridTrunk, caches: list[Cache], how: str, tp, keep: np.ndarray) -> None:
    """Move each cache's recurrent state, which the verify left at the round start, on by exactly
    `keep` columns: select the checkpoint after column keep - 1, or replay the kept columns
    (`how`: SpecParams.rollback). Both are bit-exact with plain decode; each is the other's
    oracle in the tests."""
    if how == "checkpoint":
        trunk.select(caches, tp, keep)
    else:
        replay(trunk, caches, tp, tp.row_indptr[:-1], keep)


def replay(trunk: HybridTrunk, caches: list[Cache], tp, starts: np.ndarray, keep: np.ndarray) -> None:
    """Re-run each gdn layer's scan over the first keep[b] recorded columns of each session."""
    trunk.replay(caches, tp, starts, keep)


def spec_burst(sessions: list[DsparkSpecSession], target: int | None = None, stop=None, ride=None) -> list[list[int]]:
    """Rounds for a batch of sessions until each emitted `target` tokens or finished. `stop(s,
    batch)`, asked after each round of every live session, ends that session's burst early when
    true (a burst boundary: the caller demotes it there). `ride()`, asked before each round,
    returns the Riders of that round's trunk pass (or None); `ride(riders)` after it (the round
    ran, or raised) settles them."""
    got = {s.id: [] for s in sessions}
    want = {s.id: int(target or s.params.burst_target) for s in sessions}
    stopped = set()
    while True:
        todo = [s for s in sessions if s._finished is None and len(got[s.id]) < want[s.id] and s.id not in stopped]
        if not todo:
            break
        riders = ride() if ride is not None else None
        try:
            out = spec_round(todo, riders)
        finally:
            if riders is not None:
                ride(riders)
        for s, toks in zip(todo, out):
            got[s.id].extend(toks)
        if stop is not None:
            stopped |= {s.id for s in todo if s._finished is None and stop(s, todo)}
    for s in sessions:
        s.check_invariant()
    return [got[s.id] for s in sessions]


__all__ = ["DsparkSpecSession", "Riders", "SamplingParams", "SpecBoundaryCapture", "SpecParams", "spec_burst", "spec_round"]
