"""Plain batched decode: the demotion target and the exactness oracle.

A `PlainBatch` steps many (cache, last) pairs together, one trunk row per sequence per step.
`last` is the pending token: decided, not yet emitted, not yet in the cache (the same shape a
speculative session hands over at a burst boundary). Sequences may join and leave between steps.
A step that raises on a bad argument leaves every sequence as it was (the checks come before the
decode). A step whose decode gives some sequences non-finite logits (NaN, or +inf where sampled)
cannot: the decode committed every row. A row is bitwise what the sequence's step alone computes
(DESIGN section 3), so the step completes for the others, exactly, and finishes those with the
error (`PlainSequence.error`; their caches hold the failed row: free them), then raises
NonFiniteRowsError naming them and carrying what the step emitted. Checking the logits before a
commit would cost every step a verify and a replay of the recurrent state (0.71x plain decode's
speed on the embedded pair) for a failure that the row-invariance already confines. A step may
also take its next tokens from a speculative round that carried the batch's rows in its trunk
pass (`riders()`, `step(picks=...)`; dspark.session.Riders): the same tokens, bitwise.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from .arrays import host_array
from .cost import cost_model
from .errors import CapacityError, NonFiniteError, NonFiniteRowsError, ShapeError, StateError, row_checked
from .models.cache import Cache
from .models.trunk import HybridTrunk
from .ops.argmax import argmax_rows
from .params import SamplingParams, seeded

_ids = itertools.count()


class Tokens(list):
    """A request's tokens, and `seed`: the seed its sampled text was drawn with (given, or drawn
    when it was admitted; None when greedy). Given back in SamplingParams, it reproduces the text."""

    def __init__(self, tokens=(), seed: int | None = None):
        super().__init__(tokens)
        self.seed = seed


@dataclass
class PlainSequence:
    cache: Cache
    last: int
    max_new_tokens: int
    emitted: list[int] = field(default_factory=list)
    sampling: SamplingParams | None = None  # None or temperature 0: greedy
    finished: bool = False
    id: int = field(default_factory=lambda: next(_ids))
    error: str | None = None  # why a step finished it (its logits were not finite: PlainBatch.step)


class PlainBatch:
    """Batched decode of many sequences on one trunk, each greedy or sampled. `launches`: on cuda a
    step of a batch all greedy or all sampled is a pass recorded once per batch and replayed as a
    CUDA graph ("graph") or launch by launch by the host ("eager"), or run op by op ("plain");
    dspark.graphs."""

    def __init__(self, trunk: HybridTrunk, launches: str = "graph"):
        from .params import LAUNCHES
        if launches not in LAUNCHES:
            raise ValueError(f"launches={launches!r}: expected one of {LAUNCHES}")
        self.trunk = trunk
        self.launches = launches
        self.sequences: dict[int, PlainSequence] = {}

    def join(self, cache: Cache, last: int, max_new_tokens: int, emitted: list[int] | None = None,
             sampling: SamplingParams | None = None) -> int:
        """Add a sequence; `emitted` is what it already produced (counted against the budget).
        With a non-greedy `sampling`, the token at each position is the pick keyed by (seed, that
        position): the stream a coupled speculative session emits, so one may join at any burst
        boundary (dspark.spec_sampling)."""
        if cache.config is not self.trunk.config:
            raise ShapeError("cache was made for another trunk config")
        if sampling is not None and not sampling.greedy and sampling.seed is None:
            raise ValueError("sampling.seed is None: a sampled sequence joins with the seed its first token was picked "
                             "with (dspark.params.seeded draws one when the request is admitted)")
        self.trunk.check_tokens(np.array([last]), "last")
        if cache.pos >= cache.capacity:
            raise CapacityError(f"cache is full (pos {cache.pos} of {cache.capacity})")
        seq = PlainSequence(cache, int(last), int(max_new_tokens), list(emitted or []),
                            None if sampling is None or sampling.greedy else sampling)
        self.sequences[seq.id] = seq
        self._check_done(seq)
        return seq.id

    def leave(self, seq_id: int) -> PlainSequence:
        if seq_id not in self.sequences:
            raise StateError(f"sequence {seq_id} is not in this batch")
        return self.sequences.pop(seq_id)

    def active(self) -> list[PlainSequence]:
        return [s for s in self.sequences.values() if not s.finished]

    def step(self, only: list[int] | None = None, picks: dict[int, int] | None = None) -> dict[int, int]:
        """Emit every live sequence's pending token (or only those in `only`) and decode it to
        get the next one. Returns {sequence id: token emitted}. `picks`: the next tokens a mixed
        pass already decoded ({sequence id: token}, for exactly the sequences `riders()` named:
        dspark.session.spec_round with riders); then no decode runs here."""
        live = [s for s in self.active() if only is None or s.id in only]
        todo = [s for s in self.riders() if only is None or s.id in only]
        if picks is not None and {s.id for s in todo} != set(picks):
            raise StateError(f"picks for sequences {sorted(picks)}: expected exactly the riders "
                             f"{sorted(s.id for s in todo)}")
        failed = {}
        if todo and picks is None:
            with cost_model(self.trunk.be).timed("plain", len(todo), max(s.cache.pos for s in todo),
                                                 rule=plain_step_rule(todo)):
                tokens, bad = self._step(todo)
            picks = dict(zip((s.id for s in todo), tokens))
            failed = {s.id: f"its logits row {why}" for s, why in zip(todo, bad) if why}
        out = {}
        for s in live:
            if s.id not in failed:
                s.emitted.append(s.last)
                out[s.id] = s.last
        for s in todo:
            if s.id in failed:
                s.finished, s.error = True, failed[s.id]
            else:
                s.last = int(picks[s.id])
        decoded = {s.id for s in todo}
        for s in live:  # finished by what it emitted (or a full context), as decided before the decode
            s.finished = s.finished or s.id not in decoded
        if failed:
            raise NonFiniteRowsError(f"plain step: sequences {sorted(failed)} have non-finite logits ("
                                     f"{next(iter(failed.values()))}); they are finished, the others stepped",
                                     failed, out)
        return out

    def riders(self) -> list[PlainSequence]:
        """The sequences the next step decodes (live, and not finished by emitting their pending
        token): what rides a speculative round's trunk pass as one column each, in this order."""
        return [s for s in self.active() if not self._ends(s, s.last, 1)]

    def _step(self, todo: list[PlainSequence]) -> tuple[np.ndarray, list[str]]:
        """Decode every sequence in `todo` (each row committed) -> (its next token, and "" or why
        its logits gave none): a recorded decode step (on cuda, unless launches="plain": batches
        all greedy or all sampled) or one op by op."""
        from . import graphs
        greedy, sampled = (all(s.sampling is None for s in todo), all(s.sampling is not None for s in todo))
        if self.launches != "plain" and self.trunk.be.name == "cuda" and not graphs.patched(self.trunk) \
                and (greedy or sampled):
            with graphs.decode_graphs(self.trunk, self.launches) as runner:
                return runner.step([s.cache for s in todo], [s.last for s in todo],
                                   [s.sampling for s in todo] if sampled else None)
        tp = self.trunk.decode([s.cache for s in todo], [s.last for s in todo])
        try:
            return pick_tokens(self.trunk.be, tp.logits, todo), [""] * len(todo)
        except NonFiniteError:  # which rows: each picked alone (its row is its own, DESIGN section 3)
            return self._picks_row_by_row(tp.logits, todo)

    def _picks_row_by_row(self, logits, todo: list[PlainSequence]) -> tuple[np.ndarray, list[str]]:
        picked = [row_checked(pick_tokens, self.trunk.be, logits[i: i + 1], [s]) for i, s in enumerate(todo)]
        return np.array([t[0] if not why else 0 for t, why in picked], np.int64), [why for _, why in picked]

    def _check_done(self, s: PlainSequence) -> bool:
        """Finished on an end-of-sequence id (any of config.eos_ids), the budget, or a full context
        (no row left for the pending token)."""
        if self._ends(s, s.emitted[-1] if s.emitted else None, 0):
            s.finished = True
        return s.finished

    def _ends(self, s: PlainSequence, last_emitted, more: int) -> bool:
        """Whether `s` is finished once `more` more tokens were emitted, the last of them
        `last_emitted` (None: none yet)."""
        return (last_emitted in self.trunk.config.eos_ids or len(s.emitted) + more >= s.max_new_tokens
                or s.cache.pos >= s.cache.capacity)

    def run(self) -> None:
        while self.active():
            self.step()


def plain_step_rule(seqs: list[PlainSequence]) -> str:
    """The cost model's rule of a plain step of `seqs`: "greedy" when all are, else "sampled"."""
    return "greedy" if all(s.sampling is None for s in seqs) else "sampled"


def pick_tokens(be, logits, seqs: list[PlainSequence], positions=None) -> np.ndarray:
    """The next token of each sequence from its logits row: argmax, or the sampled pick keyed by
    the sequence's seed and the position the token will fill (`positions`; default its cache
    position, after the step that made the logits committed its row)."""
    greedy = [i for i, s in enumerate(seqs) if s.sampling is None]
    out = np.zeros(len(seqs), np.int64)
    if greedy:
        rows = logits if len(greedy) == len(seqs) else logits[be.xp.asarray(greedy)]
        out[greedy] = be.to_host(argmax_rows(be, rows))
    sampled = [i for i in range(len(seqs)) if seqs[i].sampling is not None]
    if sampled:
        from .spec_sampling import pick_at
        at = [s.cache.pos for s in seqs] if positions is None else list(positions)
        out[sampled] = pick_at(be, logits[be.xp.asarray(sampled)], [seqs[i].sampling for i in sampled],
                               [at[i] for i in sampled])
    return out


def prefill_anchor(trunk: HybridTrunk, cache: Cache, prompt_ids, sampling: SamplingParams | None = None):
    """Prefill the prompt in passes of trunk.prompt_chunk tokens (as a speculative session primes:
    the same bits whatever the passes); return the first pending token (argmax of the boundary
    logits, or the sampled pick at the first position after the prompt) and the last pass (its
    logits: the boundary row)."""
    for tp in trunk.prompt_passes(cache, prompt_ids):
        pass
    return first_token(trunk.be, tp.logits[-1:], cache.pos, sampling), tp


def first_token(be, boundary_logits, pos: int, sampling: SamplingParams | None = None) -> int:
    """The token after a prompt of `pos` tokens from its boundary logits [1, V]: the argmax, or
    the sampled pick at position `pos`, as plain decode, prime and restore all take it."""
    if sampling is None or sampling.greedy:
        return int(be.to_host(argmax_rows(be, boundary_logits))[0])
    from .spec_sampling import pick_at
    return int(pick_at(be, boundary_logits, [sampling], [pos])[0])


def check_prompt(trunk: HybridTrunk, prompt_ids, capacity: int) -> np.ndarray:
    p = trunk.check_tokens(host_array(trunk.be, prompt_ids, "prompt_ids"), "prompt_ids")  # any framework's array
    if p.size == 0:
        raise ShapeError("prompt_ids is empty: expected at least one token")
    if p.size >= capacity:
        raise CapacityError(f"prompt_ids has {p.size} tokens: the context holds {capacity} (and one more for "
                            "the first generated token)")
    return p


def plain_generate(trunk: HybridTrunk, prompt_ids, max_new_tokens: int, backend=None,
                   sampling: SamplingParams | None = None, launches: str = "graph") -> Tokens:
    """Plain decode of one request, greedy (the oracle the speculative path must match byte for
    byte) or with `sampling` (the stream a coupled speculative session must match; without a seed,
    a fresh one is drawn: the result's `seed`). `launches`: PlainBatch's (how each step reaches
    the device on cuda)."""
    if backend is not None and backend is not trunk.be:
        raise ValueError("backend must be the trunk's backend (load the trunk on it)")
    sampling = seeded(sampling)
    seed = None if sampling is None or sampling.greedy else sampling.seed
    cache = trunk.new_cache()
    try:
        p = check_prompt(trunk, prompt_ids, cache.capacity)
        if max_new_tokens <= 0:
            return Tokens(seed=seed)
        last, _ = prefill_anchor(trunk, cache, p, sampling)
        batch = PlainBatch(trunk, launches)
        sid = batch.join(cache, last, max_new_tokens, sampling=sampling)
        batch.run()
        return Tokens(batch.leave(sid).emitted, seed)
    finally:
        cache.free()
