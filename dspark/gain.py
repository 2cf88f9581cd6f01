"""Speculation as a bet per session: expected tokens per round over the round's cost in plain
steps (DESIGN section 10), and the decisions taken from it under SpecParams(policy="gain").

Expected tokens per round: the session's last HISTORY rounds (tokens emitted, the anchor
included) and the prior at the weight of PRIOR_ROUNDS rounds, pooled; a session's prior is what
its admission predicted (fixed: later sessions remembered never replace it). The prediction: the
drafter's record (its greedy floor, `DsparkDrafter.accept_floor`, for a greedy session; its
coupled sampler's acceptance at the session's temperature, `DsparkDrafter.sampled_accept`, for a
coupled one; else NEUTRAL_TOKENS), pooled with what the process's earlier sessions of the same
namespace, accept rule and temperature measured (`DsparkDrafter.acceptance`, a dspark.memory.
Memory: each session counted once when it ends, at a bounded weight beside the record, with a
bounded exploration where it says less than the record).
The prior keeps its weight because demotion is one-way and a text's first rounds are often its
least predictable (on the embedded pair, code at temperature 0.3 accepts 1.9 a round over its
first 16 rounds and 3.5 over its whole 256 tokens): a session is demoted on the evidence of many
rounds against its prior, not on its first window. At 16 rounds against 4.08, with the first
check at WINDOW rounds, that code stays speculative at rounds of up to 3.0 plain steps (its rounds
measure 2.1-2.6; a prior of 8 rounds demoted it from 2.7); HISTORY is long enough (64) that a
session's own rounds do outweigh the prior: one accepting 1.5 a round against 4.08 is demoted
after 36 rounds at 2.3 plain steps, at its first check (round 25) at 2.9.
The cost comes from the backend's cost model (dspark.cost).

A round's weight reads are shared by its rows (and a plain step's by its rows), so the gain that
decides is the batch's: the time for the same tokens with this session in plain decode (the other
sessions' round, plus this session's tokens at what one more row costs the plain batch: a whole
one-row step when there is no plain batch) over the time of the round with it. At B = 1 and no
plain batch that is the session's own gain, tokens per round over the round's cost in plain
steps; at B = 2 the second row of a round costs little, so a session accepting little can still
pay; beside a running plain batch a row of plain decode costs little, so speculation must pay
more. The same formula serves every B.

Where the worker's plain rows ride the rounds' trunk pass (mixed passes, dspark.session.Riders),
`step_rate` and `joint_split` price them at their marginal rows (CostModel.rider_seconds) in place
of a plain step, and a live session's gain beside them is the step's tokens per second with it
speculative over with it one more riding row (`session_gain` with a plain_kind).

Decisions (each returns (bool, reason)):
* `admit`: start speculative only where the predicted gain exceeds 1 + params.margin.
* `rejection_mode`: a request sampled by rejection keeps one mode for its whole life, chosen from
  the request and the prior alone: the prior tokens over the cost model's *prior* at one row,
  never a timing and never the load, so its text depends only on its seed and request.
* `demote_check`: once a session has a full window of its own rounds, a demotable session whose
  measured gain stays below 1 for params.patience consecutive checks (burst boundaries: the
  worker and `dspark generate` check after every round, each a burst boundary) is demoted; one
  check at or above 1 resets the count (the hysteresis: a dip does not demote, and demotion is
  one-way, so nothing flaps). A text's first rounds accept less than its later ones (the drafter
  has less of it to read): over the embedded pair's 24 held-out prompts, rounds 0-24 accept 4.2,
  5.3 and 5.6 a round greedy (by 8) against 6.5 over rounds 24-32 (every prompt reaches them), and
  3.4, 3.3 and 3.5 at temperature 0.3 against 4.5 (`python profiling/accept_by_round.py`). So no check
  runs on fewer than WINDOW rounds: a session is not demoted on the rounds least like its future.
"""

from __future__ import annotations

import functools

import numpy as np

from .cost import CostModel, cost_model, plain_rule
from .params import SpecParams

WINDOW = 24           # rounds a session runs before its first demotion check (module doc)
HISTORY = 64          # rounds of a session's own history that its gain reads
PRIOR_ROUNDS = 16     # the prior's weight, in rounds, beside at most HISTORY of the session's own
# Tokens per round expected of a session with no recorded floor (sampled, or a drafter without a
# record). Optimistic on purpose: it admits wherever a round costs under about 3.6 plain steps, so
# the first rounds measure the session; a demotable one that loses pays `patience` checks at most.
NEUTRAL_TOKENS = 4.0


def width_by_gain(model: CostModel, conf, cap: int, context: int, rule: str = "greedy") -> int:
    """The verify width in [2, cap] of most expected tokens per unit of round cost: a width v
    emits 1 + sum over k < v of c_1 ... c_k tokens in expectation (c_k: the probability that
    draft k is accepted once drafts 1..k-1 were: the confidence head's, or without one the
    session's own record, `position_acceptance`), and costs the cost model's round at width v."""
    c = np.cumprod(np.asarray(conf[: cap - 1], np.float64))
    widths = np.arange(2, cap + 1)
    tokens = 1.0 + np.cumsum(c)[widths - 2]
    cost = np.array([model.round_seconds(1, float(v), context, rule) for v in widths])
    return int(widths[int(np.argmax(tokens / cost))])


@functools.lru_cache(maxsize=64)
def geometric_rate(tokens: float, drafts: int) -> float:
    """The per-position acceptance r in [0, 1] at which a round of `drafts` drafts emits `tokens`
    in expectation (1 + r + r^2 + ... + r^drafts): the prior of `position_acceptance` (a session's
    prior is fixed, so each round finds it cached)."""
    target = min(max(tokens, 1.0), drafts + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(40):   # bisection: the sum grows with r
        r = (lo + hi) / 2
        lo, hi = (r, hi) if 1.0 + sum(r ** k for k in range(1, drafts + 1)) < target else (lo, r)
    return (lo + hi) / 2


def position_acceptance(recent, drafts: int, prior: float) -> np.ndarray:
    """c_k for a drafter without a confidence head: per draft position k, the fraction of the
    session's recent rounds that reached draft k (verified it, every earlier draft accepted) and
    accepted it, pooled with PRIOR_ROUNDS rounds at the geometric rate of `prior` tokens a round.
    `recent`: (tokens emitted, verify width) per round (DsparkSpecSession.recent). A position the
    session has not reached lately keeps the prior's rate, so a narrow width can widen again."""
    reached, accepted = np.zeros(drafts), np.zeros(drafts)
    if len(recent):  # counts by position: the rounds whose reach (accepted drafts) exceeds it
        tw = np.asarray(recent, np.int64).reshape(-1, 2)
        m, v = tw[:, 0] - 1, tw[:, 1] - 1       # drafts accepted, drafts verified
        reach, acc = np.minimum(m + 1, v), m
        reached = len(tw) - np.cumsum(np.bincount(np.clip(reach, 0, drafts), minlength=drafts + 1))[:drafts]
        accepted = len(tw) - np.cumsum(np.bincount(np.clip(acc, 0, drafts), minlength=drafts + 1))[:drafts]
    r = geometric_rate(prior, drafts)
    return (accepted + PRIOR_ROUNDS * r) / (reached + PRIOR_ROUNDS)


def prior_tokens(params: SpecParams, drafter) -> float:
    """The static prior: the drafter's recorded greedy floor (greedy), its recorded coupled
    acceptance at the session's temperature (coupled: linear between the recorded temperatures,
    the greedy floor at 0, the hottest row beyond it), else NEUTRAL_TOKENS."""
    floor = getattr(drafter, "accept_floor", None)
    if params.accept == "greedy":
        return float(floor) if floor else NEUTRAL_TOKENS
    table = dict(getattr(drafter, "sampled_accept", None) or {})
    if params.accept != "coupled" or not table:
        return NEUTRAL_TOKENS
    if floor:
        table.setdefault(0.0, float(floor))
    ts = sorted(table)
    return float(np.interp(params.sampling.temperature, ts, [table[t] for t in ts]))


def _kind(params: SpecParams) -> tuple:
    return params.accept, round(params.sampling.temperature, 1)


def predicted_tokens(params: SpecParams, drafter, namespace: str | None = None) -> float:
    """Tokens per round expected of a new demotable session of `namespace` (None: requests
    without one): the static prior pooled with what this process's sessions of the same
    namespace, accept rule and temperature measured with this drafter (`remember`;
    dspark.memory). Never used for a rejection-sampled request's mode (that would make its text
    depend on other requests)."""
    memory = getattr(drafter, "acceptance", None)
    record = prior_tokens(params, drafter)
    return memory.predict(memory_key(params, namespace), record) if memory is not None else record


def arrival_tokens(params: SpecParams, drafter, namespace: str | None = None) -> tuple[float, str]:
    """predicted_tokens for a request arriving now, counted as an arrival of its bucket: every
    dspark.memory.EXPLORE_EVERY-th one the memory predicts under the record is predicted by the
    record alone. Returns (tokens, "" or the note of an exploration)."""
    memory = getattr(drafter, "acceptance", None)
    record = prior_tokens(params, drafter)
    if memory is None:
        return record, ""
    got, exploring = memory.arrival(memory_key(params, namespace), record)
    return got, (f"exploring: predicted by the record ({record:.2f}) where the memory says "
                 f"{memory.predict(memory_key(params, namespace), record):.2f}" if exploring else "")


def memory_key(params: SpecParams, namespace: str | None) -> tuple:
    return (namespace, *_kind(params))


def remember(s, namespace: str | None = None) -> None:
    """Fold session `s` (ended: finished or demoted) into its drafter's memory of sessions of its
    namespace and kind, once: its tokens per round over all its rounds, at the weight of the
    tokens it emitted speculatively (dspark.memory)."""
    if getattr(s, "remembered", False) or not s.params.demotable or not s.stats.rounds:
        return
    s.remembered = True
    memory = getattr(s.drafter, "acceptance", None)
    if memory is not None:
        memory.remember(memory_key(s.params, namespace), s.stats.mean_accepted_length, len(s.emitted))


def prior_width(params: SpecParams, drafter) -> int:
    """The widest verify the session may run: the cost before its own widths are known."""
    cap = drafter.config.drafts + 1
    return min(params.max_verify or cap, cap)


def session_prior(s) -> float:
    """Session `s`'s prior: what its admission predicted (the worker sets `s.prior`: the record
    alone for an exploring arrival), else predicted_tokens of requests without a namespace when
    first read; then fixed. Sessions remembered later never change it (a prior read live would
    let an exploring session be judged by the memory it was admitted to test)."""
    if getattr(s, "prior", None) is None:
        s.prior = predicted_tokens(s.params, s.drafter)
    return s.prior


def expected_tokens(s) -> float:
    """Tokens per round expected of session `s` from its recent rounds and its prior."""
    recent = [t for t, _ in s.recent]
    return (session_prior(s) * PRIOR_ROUNDS + sum(recent)) / (PRIOR_ROUNDS + len(recent))


def expected_width(s) -> float:
    if not s.recent:
        return float(prior_width(s.params, s.drafter))
    return float(np.mean([w for _, w in s.recent]))


def batch_gain(model: CostModel, tokens: float, width: float, context: int, others: list[tuple[float, int]],
               rule: str = "greedy", plain_rows: int = 0) -> float:
    """Gain of one session of accept rule `rule` with `tokens` per round at verify `width` sharing
    rounds with `others` ((width, context) of each other session of its batch), beside a plain
    batch of `plain_rows` rows: the time for the same tokens with it in plain decode (the others'
    round, and its tokens at what one more plain row costs) over the time of the round with it."""
    b = len(others) + 1
    widths = [width] + [w for w, _ in others]
    ctx = max([context] + [c for _, c in others])
    rest = model.round_seconds(b - 1, float(np.mean(widths[1:])), ctx, rule) if others else 0.0
    pr = plain_rule(rule)
    row = model.plain_row_seconds(plain_rows, context, pr) if plain_rows else model.plain_seconds(1, context, pr)
    return (rest + tokens * row) / model.round_seconds(b, float(np.mean(widths)), ctx, rule)


def session_gain(s, group, plain_rows: int = 0, plain_kind: str | None = None) -> float:
    """The measured gain of live session `s` in its round batch `group` (s included), beside a
    plain batch of `plain_rows` rows. `plain_kind` ("greedy" or "sampled"): the plain rows ride
    the round's trunk pass (dspark.session.Riders), and the gain is the step's tokens per second
    with `s` speculative over with `s` one more riding row (step_rate, mixed)."""
    if plain_kind is not None and plain_rows:
        model, ctx = cost_model(s.be), max(o.cache.pos for o in group)
        spec = [(expected_tokens(o), expected_width(o), o.params.accept) for o in group]
        kind = "sampled" if s.params.accept != "greedy" else plain_kind
        mine = [o is s for o in group]
        without = [c for c, me in zip(spec, mine) if not me]
        return (step_rate(model, spec, plain_rows, ctx, plain_kind, True)
                / step_rate(model, without, plain_rows + 1, ctx, kind, True))
    others = [(expected_width(o), o.cache.pos) for o in group if o is not s]
    return batch_gain(cost_model(s.be), expected_tokens(s), expected_width(s), s.cache.pos, others, s.params.accept,
                      plain_rows)


def admit(params: SpecParams, drafter, context: int, group=(), plain_rows: int = 0,
          tokens: float | None = None) -> tuple[bool, str]:
    """Whether a new demotable request starts speculative beside the live sessions `group` of its
    accept rule and a plain batch of `plain_rows` rows; with the reason. `tokens`: its predicted
    tokens per round (default: predicted_tokens of requests without a namespace)."""
    if params.policy == "always":
        return True, "policy always"
    others = [(expected_width(o), o.cache.pos) for o in group]
    tokens = predicted_tokens(params, drafter) if tokens is None else tokens
    g = batch_gain(cost_model(drafter.be), tokens, prior_width(params, drafter), context, others,
                   params.accept, plain_rows)
    return verdict(g, params, "predicted gain")


def rejection_mode(params: SpecParams, drafter, context: int) -> tuple[bool, str]:
    """Speculative or plain for a request sampled by rejection, for its whole life: the request and
    the prior alone (the cost model's prior at one row, not its measurements, not the load)."""
    if params.policy == "always":
        return True, "policy always"
    prior = cost_model(drafter.be).prior
    cost = prior.round(1, prior_width(params, drafter), context) / prior.plain(1, context)
    return verdict(prior_tokens(params, drafter) / cost, params, "rejection sampling, prior gain")


def verdict(g: float, params: SpecParams, what: str) -> tuple[bool, str]:
    """Speculative only where the gain `g` exceeds 1 by the margin."""
    if g > 1.0 + params.margin:
        return True, f"{what} {g:.2f} > 1 + margin {params.margin:g}"
    return False, f"{what} {g:.2f} <= 1 + margin {params.margin:g}"


def demote_check(s, group, plain_rows: int = 0, plain_kind: str | None = None) -> tuple[bool, str]:
    """At a burst boundary of live session `s` in round batch `group` beside a plain batch of
    `plain_rows` rows (riding the round's pass where `plain_kind` is given: session_gain): update
    its gain (every session's, for the stats) and, under the gain policy, its count of consecutive
    checks below 1; demote a demotable session once that count reaches params.patience."""
    s.gain = session_gain(s, group, plain_rows, plain_kind)
    if s.params.policy == "always" or not s.params.demotable or len(s.recent) < WINDOW:
        return False, ""
    s.below = s.below + 1 if s.gain < 1.0 else 0
    if s.below >= s.params.patience:
        return True, f"measured gain {s.gain:.2f} < 1 at {s.below} burst boundaries in a row"
    return False, ""


RIDE_ORDER = ("greedy", "coupled", "rejection")  # the worker's round batches, in order; the plain rows ride the first


def step_rate(model: CostModel, spec: list[tuple[float, float, str]], plain_rows: int, context: int,
              plain_kind: str = "greedy", mixed: bool = False) -> float:
    """Tokens per second of one worker step: one round of each accept rule's speculative sessions
    `spec` ((tokens, width, rule) each) and one plain step of `plain_rows` rows (plain_kind
    "greedy" or "sampled"), each pass priced by the cost model at its batch; an empty pass costs
    nothing. `mixed`: the plain rows ride the first round's trunk pass (dspark.session.Riders)
    where there is one, priced at their marginal rows (CostModel.rider_seconds), not as a pass."""
    seconds = 0.0
    for rule in sorted({r for _, _, r in spec}, key=RIDE_ORDER.index):
        rows = [(t, w) for t, w, r in spec if r == rule]
        seconds += model.round_seconds(len(rows), float(np.mean([w for _, w in rows])), context, rule)
    if plain_rows:
        seconds += (model.rider_seconds(plain_rows, context, plain_kind) if mixed and spec
                    else model.plain_seconds(plain_rows, context, plain_kind))
    return (sum(t for t, _, _ in spec) + plain_rows) / seconds if seconds > 0 else 0.0


def joint_split(model: CostModel, cands: list[tuple[float, float, str, bool]], plain_rows: int, context: int,
                plain_kind: str = "greedy", margin: float = 0.0, mixed: bool = False) -> tuple[int, list[float]]:
    """The joint decision under concurrency: which of the demotable sessions `cands` ((tokens,
    width, rule, new) each, sorted by tokens per round, most first; `new`: an arrival, not yet
    speculative) speculate beside a plain batch of `plain_rows` rows that stay plain. Tries the top
    k for k = 0 .. n, the rest joining the plain batch, and returns (k, the step rate of each k):
    the k of most tokens per second (the fewest on a tie), where a k that admits an arrival must
    beat all plain by 1 + margin. A row joining a running plain batch costs a fraction of a step,
    a session speculating a whole round of its own: a per-session gain misses that trade. `mixed`:
    the plain rows ride the round's trunk pass (step_rate), so a k > 0 pays the round's marginal
    rows over the plain step's, not a second pass."""
    rates = [step_rate(model, [c[:3] for c in cands[:k]], plain_rows + len(cands) - k, context, plain_kind, mixed)
             for k in range(len(cands) + 1)]
    arrivals = np.cumsum([0] + [bool(c[3]) for c in cands])
    ok = [k for k in range(len(rates)) if not arrivals[k] or rates[k] > rates[0] * (1.0 + margin)]
    best = max(ok, key=lambda k: (rates[k], -k))
    return best, rates
