"""Speculation where it pays: the cost model under a scripted clock, the gain estimate, and each
decision pinned at its boundary with a scripted cost model (never real time); then the Worker
under SpecParams(policy="gain"): greedy streams equal plain decode whatever it demotes, and a
sampled stream depends only on its seed and request.

The bugs these guard keep every greedy stream exact: a gain with its sign flipped (admit the
losers, demote the winners), hysteresis ignored (one dip demotes), a rejection-sampled mode chosen
from a timing (the text then depends on the machine's speed), a price that counts one slow round
at full weight (one outlier demotes for good), a memory of past sessions set by its first one or
shared by every namespace (one poorly drafted request switches speculation off for every later
one). Each test below fails under one."""

from types import SimpleNamespace

import numpy as np
import pytest

import dspark
from dspark import cost, gain, memory
from dspark.byte_vocab import encode
from dspark.cost import CostModel, Prior
from dspark.decode import plain_generate
from dspark.memory import Memory
from dspark.params import SamplingParams, SpecParams
from dspark.worker import GateConfig, Worker
from tests.session.test_worker import code_prompt


class ScriptedClock:
    """mark() returns the next scripted time; seconds() is b - a, or None ("not done") for the
    marks listed in `pending` until they are released."""

    def __init__(self, times=()):
        self.times, self.pending = list(times), set()

    def mark(self):
        return self.times.pop(0)

    def seconds(self, a, b):
        return None if b in self.pending else b - a


class FrozenClock(ScriptedClock):
    """A clock whose intervals never complete: the model keeps only what a test records."""

    def mark(self):
        return 0.0

    def seconds(self, a, b):
        return None


PRICED = [kr for kr in cost.RULES if kr[0] != "verify"]  # what the scripted models record
FLAT = Prior(round_fixed=1.0, round_per_column=0.0, plain_per_row=0.0, verify_per_column=0.0)  # all alike


def scripted(round_steps: float, batches=(1, 2, 3)) -> CostModel:
    """A cost model with no sharing between rows: a plain step of B rows costs B s (greedy or
    sampled), a round of B rows B x `round_steps` s at every width and accept rule, in context
    bucket 0; it never hears of a real timing."""
    m = CostModel(FrozenClock(), FLAT)
    for b in batches:
        for kind, rule in PRICED:
            m.record(kind, b, 0, (round_steps if kind == "round" else 1.0) * b, width=8, rule=rule)
    return m


# ---- the cost model ----------------------------------------------------------------------------------
def test_cost_model_measures_with_the_clock_and_keeps_robust_prices():
    """The first timed pass of a kind is cold and not kept (100 s each here); then the clock's
    intervals are the measurements, a price their trimmed mean (two: their mean)."""
    clock = ScriptedClock([0.0, 100.0, 0.0, 100.0, 10.0, 13.0, 20.0, 21.0, 30.0, 35.0])
    m = CostModel(clock)
    for kind in ("round", "plain"):
        with m.timed(kind, 1, 100):
            pass
    assert m.measured() == {"rounds": 0, "plain_steps": 0}
    with m.timed("round", 1, 100) as note:
        note["width"] = 4
    with m.timed("plain", 1, 100):
        pass
    assert m.round_cost(1, 4, 100) == pytest.approx(3.0)
    with m.timed("round", 1, 100, width=4):
        pass
    assert m.round_seconds(1, 4, 100) == pytest.approx((3.0 + 5.0) / 2)
    assert m.measured() == {"rounds": 2, "plain_steps": 1}


def test_cost_model_prices_unmeasured_keys_by_the_prior_scaled_by_measurements():
    m = CostModel(FrozenClock(), Prior(round_fixed=1.0, round_per_column=0.5, plain_per_row=0.0))
    assert m.round_cost(1, 4, 0) == pytest.approx(3.0)  # nothing measured: the prior's shape
    m.record("plain", 1, 0, 0.01)
    m.record("round", 1, 0, 0.06, width=2)  # the prior's 2 steps at 0.03 s a step
    assert m.round_cost(1, 2, 0) == pytest.approx(6.0)
    assert m.round_cost(1, 4, 0) == pytest.approx(9.0)  # the prior's 3 steps at the rounds' 0.03 s
    assert m.round_cost(1, 4, 1 << 20) == pytest.approx(9.0)  # another context bucket, same scale


def test_cost_model_reads_an_interval_only_once_it_is_done():
    clock = ScriptedClock([0.0, 0.0, 0.0, 2.0])
    clock.pending.add(2.0)
    m = CostModel(clock)
    with m.timed("plain", 1, 0):  # cold: not kept
        pass
    with m.timed("plain", 1, 0):
        pass
    assert m.measured()["plain_steps"] == 0
    clock.pending.clear()
    m.record("round", 1, 0, 4.0, width=2)  # any later measurement resolves it
    m._resolve()
    assert m.plain_seconds(1, 0) == pytest.approx(2.0)


def test_plain_steps_are_priced_at_the_verify_level_now():
    """A speculative run times no plain steps: a plain step measured before (1 s, before any
    verify) is priced at the verify passes' level now over the first level. Verifies twice as slow
    as the first (the load or the context grew) price it at 2 s, so a round of 4 s timed with a
    verify of that level costs 2 plain steps, not 4; a plain step measured at the new level is
    pooled with the old one at the level now. A model that kept the old plain seconds would
    demote a session whose rounds only grew with everything else."""
    m = CostModel(FrozenClock(), FLAT)
    m.record("plain", 1, 0, 1.0)
    assert m.plain_seconds(1, 0) == pytest.approx(1.0)  # no verify timed yet: kept in seconds
    m.record("verify", 1, 0, 3.0, width=4)  # the first level: what the plain step is measured against
    assert m.plain_seconds(1, 0) == pytest.approx(1.0)
    for _ in range(200):
        m.record("verify", 1, 0, 6.0, width=4)
    m.record("round", 1, 0, 4.0, width=4)
    assert m.plain_seconds(1, 0) == pytest.approx(2.0)
    assert m.round_cost(1, 4, 0) == pytest.approx(2.0)
    m.record("plain", 1, 0, 2.5)  # measured now: at the level now
    assert m.plain_seconds(1, 0) == pytest.approx((2.0 + 2.5) / 2)
    assert m.measured() == {"rounds": 1, "plain_steps": 2}  # a verify is neither


def test_a_round_and_a_plain_step_are_each_kept_over_the_verify_timed_just_before():
    """The machine's speed moves while the level (a median of LEVEL_WINDOW verifies) lags: a round
    is kept over its own verify's level and a plain step over the last verify's (in the warm-up a
    round's just before it: dspark.cli.run_warm_up), so what a round costs in plain steps is what
    each took beside a verify of its moment. Here every plain step takes half its paired verify while the machine slows
    threefold; then rounds take twice their verify while it speeds up: 4 plain steps a round at
    any level. Kept over the level now instead, either side would read the speed change as cost."""
    m = CostModel(FrozenClock(), FLAT)
    for v in (2.0, 4.0, 6.0, 6.0, 6.0):
        m.record("verify", 1, 0, v, width=1)
        m.record("plain", 1, 0, v / 2)
    for v in (3.0, 2.0, 1.0, 1.0):
        m.record("verify", 1, 0, v, width=4)
        m.record("round", 1, 0, 2 * v, width=4)
    assert m.round_cost(1, 4, 0) == pytest.approx(4.0)
    assert m.round_seconds(1, 4, 0) == pytest.approx(2 * m._level_now)


def test_a_plain_step_after_a_round_is_kept_over_that_rounds_verify():
    """The warm-up and the worker run plain steps right after a round: each is kept over the level
    of the round's verify (the last verify timed, though the round consumed it as its own), so a
    speed change between rounds is not read as cost. The same rounds and steps at a constant speed
    price a round the same."""
    def model(speeds):
        m = CostModel(FrozenClock(), FLAT)
        for v in speeds:
            m.record("verify", 1, 0, v, width=4)
            m.record("round", 1, 0, 2 * v, width=4)
            m.record("plain", 1, 0, v / 2)
        return m
    steady = model([1.0] * 6).round_cost(1, 4, 0)
    assert model([1.0, 1.0, 3.0, 3.0, 3.0, 0.5]).round_cost(1, 4, 0) == pytest.approx(steady)
    # a machine slowing round after round (clocks settling): the median level lags every step, so
    # steps kept over it would read most of them high, past what the prices' trimming removes
    assert model([1.0 + i for i in range(8)]).round_cost(1, 4, 0) == pytest.approx(steady)
    assert steady == pytest.approx(4.0)


def test_a_price_is_a_trimmed_mean_that_one_outlier_moves_by_a_window_share():
    """A price (cost.Window) over noisy samples: raising any one of them by e moves it by at most
    e / PRICE_WINDOW, and a sample 100x out in place of a normal one by no more than the others'
    spread over PRICE_WINDOW (an outlier counted at full weight, in a plain mean of the window,
    would move it by 5); while the window fills, three samples give their median."""
    rng = np.random.default_rng(3)
    base = rng.lognormal(0.0, 0.2, cost.PRICE_WINDOW + 2 * cost.PRICE_TRIM)

    def price(samples):
        w = cost.Window()
        for x in samples:
            w.add(x)
        return w.value
    ref = price(base)
    for i in range(len(base)):
        for e in (0.05, 0.5, 3.0, 99.0):
            raised = base.copy()
            raised[i] += e
            assert abs(price(raised) - ref) <= e / cost.PRICE_WINDOW + 1e-12, (i, e)
    assert abs(price([*base[1:], 100.0]) - price([*base[1:], base[0]])) <= np.ptp(base) / cost.PRICE_WINDOW
    assert price([1.0, 9.0, 2.0]) == 2.0 and price([4.0]) == 4.0 and price([1.0, 3.0]) == 2.0


def test_cost_model_is_per_backend_and_injectable():
    be = dspark.get_backend("numpy")
    model = scripted(2.0)
    with cost.using(be, model):
        assert cost.cost_model(be) is model
    assert cost.cost_model(be) is not model


def test_rounds_and_plain_steps_are_timed_where_they_run():
    """spec_round and PlainBatch.step feed the backend's cost model (a scripted clock: 1 s each)."""
    from dspark.models.presets import tiny_pair
    from dspark.session import DsparkSpecSession
    be = dspark.get_backend("numpy")
    trunk, drafter = tiny_pair(be, 21)
    model = CostModel(ScriptedClock(list(np.arange(1000.0))))
    with cost.using(be, model):
        s = DsparkSpecSession.prime(trunk, drafter, [1, 2, 3], SpecParams(max_new_tokens=6, capture=False))
        while not s.finished():
            s.round()
        plain_generate(trunk, [1, 2, 3], 4)
        s.close()
    assert model.measured() == {"rounds": s.rounds - 1, "plain_steps": 3 - 1}  # the first of each kind is cold


# ---- the gain estimate and the decisions ----------------------------------------------------------------
def fake_session(tokens, width=8, pos=100, floor=None, params=None, be=None):
    drafter = SimpleNamespace(accept_floor=floor, config=SimpleNamespace(drafts=7), be=be, acceptance=Memory())
    s = SimpleNamespace(params=params or SpecParams(), drafter=drafter, cache=SimpleNamespace(pos=pos),
                        be=be, gain=None, below=0)
    s.recent = [(t, width) for t in tokens]
    return s


def test_expected_tokens_pool_the_prior_with_the_rounds():
    """The prior weighs PRIOR_ROUNDS rounds beside at most HISTORY of the session's own: a first
    window that accepts little does not outweigh it, a long history does."""
    greedy = SpecParams()
    k = gain.PRIOR_ROUNDS
    assert gain.expected_tokens(fake_session([], floor=4.5)) == 4.5  # the drafter's recorded floor
    assert gain.expected_tokens(fake_session([])) == gain.NEUTRAL_TOKENS
    sampled = SpecParams(sampling=SamplingParams(temperature=0.8))
    assert gain.expected_tokens(fake_session([], floor=4.5, params=sampled)) == gain.NEUTRAL_TOKENS  # floors are greedy
    assert gain.expected_tokens(fake_session([1], floor=4.0, params=greedy)) == pytest.approx((4.0 * k + 1) / (k + 1))
    s = fake_session([1] * gain.WINDOW, floor=4.0)
    assert gain.expected_tokens(s) == pytest.approx((4.0 * k + gain.WINDOW) / (k + gain.WINDOW))
    s = fake_session([1] * gain.HISTORY, floor=4.0)
    assert gain.expected_tokens(s) == pytest.approx((4.0 * k + gain.HISTORY) / (k + gain.HISTORY))
    assert gain.HISTORY >= 3 * k  # a long history outweighs the prior


def test_coupled_prior_is_the_drafters_record_at_its_temperature():
    """The embedded drafter's recorded coupled acceptance (RECORD.md) is the prior of a coupled
    session: read at its temperature, linear between rows, the greedy floor at 0; greedy sessions
    read the floor, rejection-sampled ones the neutral prior. A prior taken at the wrong
    temperature would admit the hot sessions it should run plain."""
    from dspark.models.default import recorded_sampled_acceptance
    table = recorded_sampled_acceptance()
    assert table and min(table) > 0 and all(a > b for a, b in zip([table[t] for t in sorted(table)],
                                                                  [table[t] for t in sorted(table)][1:]))
    drafter = SimpleNamespace(accept_floor=4.7, sampled_accept={0.3: 4.0, 0.8: 2.5, 1.0: 2.0})

    def prior(t, sampler="coupled"):
        return gain.prior_tokens(SpecParams(sampling=SamplingParams(temperature=t), sampler=sampler), drafter)

    assert prior(0.3) == pytest.approx(4.0) and prior(1.0) == pytest.approx(2.0)
    assert prior(0.55) == pytest.approx(3.25) and prior(0.15) == pytest.approx((4.7 + 4.0) / 2)
    assert prior(1.5) == pytest.approx(2.0)  # beyond the hottest row: that row
    assert prior(0.0) == pytest.approx(4.7)  # greedy: the floor
    assert prior(0.8, "rejection") == gain.NEUTRAL_TOKENS
    assert gain.prior_tokens(SpecParams(sampling=SamplingParams(temperature=0.8)),
                             SimpleNamespace(accept_floor=4.7)) == gain.NEUTRAL_TOKENS  # no record


def test_admission_is_pinned_at_one_plus_margin():
    """Neutral prior: admitted iff NEUTRAL_TOKENS / round cost > 1 + margin."""
    be = dspark.get_backend("numpy")
    drafter = SimpleNamespace(accept_floor=None, config=SimpleNamespace(drafts=7), be=be, acceptance=Memory())
    params = SpecParams(margin=0.2)
    edge = gain.NEUTRAL_TOKENS / 1.2
    for steps, want in ((edge - 1e-6, True), (edge + 1e-6, False), (0.5, True), (10.0, False)):
        with cost.using(be, scripted(steps)):
            ok, why = gain.admit(params, drafter, 50)
        assert ok is want, (steps, why)
        assert ("predicted gain" in why) and (">" in why if want else "<=" in why)
    with cost.using(be, scripted(10.0)):
        assert gain.admit(SpecParams(policy="always"), drafter, 50) == (True, "policy always")


def test_the_batch_gain_decides_at_two_rows():
    """At B = 2 a round of both rows costs little more than one of one row: a session with 1.5
    tokens per round stays (its own gain, 1.5 / 2, would demote it); at B = 3 the same formula."""
    m = CostModel(FrozenClock())
    m.record("plain", 1, 0, 1.0)
    m.record("round", 1, 0, 2.0, width=4)
    m.record("round", 2, 0, 2.2, width=4)
    g = gain.batch_gain(m, 1.5, 4, 0, [(4, 0)])
    assert g == pytest.approx((2.0 + 1.5) / 2.2)
    assert gain.batch_gain(m, 1.5, 4, 0, []) == pytest.approx(0.75)
    m.record("round", 3, 0, 6.0, width=4)
    assert gain.batch_gain(m, 1.5, 4, 0, [(4, 0), (4, 0)]) == pytest.approx((2.2 + 1.5) / 6.0)  # every B alike


def test_beside_a_plain_batch_a_row_costs_its_measured_slope():
    """With plain steps measured at 1 and 3 rows (1.0 s, 1.5 s: 0.25 s a row), a session beside a
    plain batch is priced at 0.25 s a token in plain decode, not a whole step."""
    m = CostModel(FrozenClock())
    m.record("plain", 1, 0, 1.0)
    m.record("plain", 3, 0, 1.5)
    m.record("round", 1, 0, 2.0, width=4)
    assert m.plain_row_seconds(2, 0) == pytest.approx(0.25)
    assert gain.batch_gain(m, 4.0, 4, 0, [], plain_rows=2) == pytest.approx(4.0 * 0.25 / 2.0)
    assert gain.batch_gain(m, 4.0, 4, 0, []) == pytest.approx(4.0 / 2.0)  # no plain batch: a whole step
    m.record("plain", 2, 0, 0.9)  # noise making the slope negative: floored at a share of a step
    assert m.plain_row_seconds(2, 0) >= cost.MIN_ROW_SHARE * 1.0
    fresh = CostModel(FrozenClock(), Prior(plain_per_row=0.5))
    fresh.record("plain", 2, 0, 3.0)  # one batch measured: the prior's slope at the measured level
    assert fresh.plain_row_seconds(2, 0) == pytest.approx(3.0 * (2.0 / 1.5 - 1.0))


def test_demotion_needs_patience_boundaries_below_one():
    be = dspark.get_backend("numpy")
    s = fake_session([2] * gain.WINDOW, width=4, be=be, params=SpecParams(patience=2), floor=2.0)
    with cost.using(be, scripted(2.0 + 1e-6)):  # gain just below 1
        assert gain.demote_check(s, [s]) == (False, "")  # one dip: kept
        down, why = gain.demote_check(s, [s])
        assert down and "measured gain 1.00 < 1 at 2 burst boundaries" in why
    s.below = 0
    with cost.using(be, scripted(2.0 + 1e-6)):
        assert not gain.demote_check(s, [s])[0]
    with cost.using(be, scripted(2.0)):  # gain exactly 1: not below, and the count starts again
        assert not gain.demote_check(s, [s])[0] and s.below == 0
    with cost.using(be, scripted(2.0 + 1e-6)):
        assert not gain.demote_check(s, [s])[0]
    with cost.using(be, scripted(1.0)):  # gain 2: never demoted
        assert not any(gain.demote_check(s, [s])[0] for _ in range(5))
    assert s.gain == pytest.approx(2.0)


# Tokens a round of the embedded pair on the demo's code prompt at temperature 0.3 (seed 1), its first
# 40 rounds: 1.9 a round over the first 16, 3.5 over all 73 of its 256 tokens.
CODE_AT_0_3 = [4, 2, 5, 1, 3, 2, 1, 1, 1, 1, 1, 1, 2, 1, 3, 2, 3, 2, 4, 1, 2, 8, 3, 4, 6, 6, 8, 2, 4, 4, 1, 8, 2, 8, 1,
               6, 8, 7, 2, 3]


def checks_until_demoted(rounds, prior: float, round_steps: float):
    """demote_check after each round of a session with `rounds` and the greedy floor `prior`, rounds
    priced at `round_steps` plain steps: the number of rounds at its demotion, or None."""
    be = dspark.get_backend("numpy")
    s = fake_session([], floor=prior, be=be)
    with cost.using(be, scripted(round_steps)):
        for n, t in enumerate(rounds, 1):
            s.recent.append((t, 8))
            if gain.demote_check(s, [s])[0]:
                return n
    return None


def test_a_text_that_starts_slow_is_not_demoted_on_its_first_rounds():
    """Code at temperature 0.3 accepts 1.9 a round over its first 16 rounds and 3.5 over its whole
    text: against its prior (4.08, the record at 0.3) it stays speculative at rounds of up to 3.0
    plain steps (it measures 2.3-2.6), as a slower start or a noisier cost must not demote a
    session that pays 1.6x over its text. The prior does not make demotion impossible: a session
    that accepts 1.5 a round against the same prior is demoted within HISTORY rounds at 2.3, and as
    soon as its window is full where rounds cost more. A prior of 8 rounds (the weight before)
    demoted the code at 2.7, a first check at 8 rounds at 3.0 (its 21st round)."""
    assert checks_until_demoted(CODE_AT_0_3, 4.08, 3.0) is None
    slow = checks_until_demoted([1, 2] * (gain.HISTORY // 2), 4.08, 2.3)
    assert slow is not None and slow < gain.HISTORY
    assert checks_until_demoted([1, 2] * 20, 4.08, 2.9) == gain.WINDOW + 1


def timed_checks(tokens: float, round_seconds, plain_seconds: float = 1.0):
    """A session of `tokens` a round (its prior the same: its expected tokens are exactly that)
    whose rounds the cost model times through a scripted clock, round n taking round_seconds[n - 1]
    s, after a warm-up of plain steps of `plain_seconds` (the first pass of each kind is cold, not
    kept). demote_check after every round. Returns (the round of its demotion or None, its gains)."""
    be = dspark.get_backend("numpy")
    windows = cost.PRICE_WINDOW + 2 * cost.PRICE_TRIM
    durations = [plain_seconds] * (1 + windows) + [round_seconds[0]] + list(round_seconds)
    marks = []
    for i, d in enumerate(durations):
        marks += [10.0 * i, 10.0 * i + d]
    model = CostModel(ScriptedClock(marks), FLAT)
    s = fake_session([], floor=tokens, be=be)
    gains = []
    with cost.using(be, model):
        for _ in range(1 + windows):
            with model.timed("plain", 1, 100):
                pass
        with model.timed("round", 1, 100, width=8):  # cold
            pass
        for n in range(1, len(round_seconds) + 1):
            with model.timed("round", 1, 100, width=8):
                pass
            s.recent.append((tokens, 8))
            down, _ = gain.demote_check(s, [s])
            gains.append(s.gain)
            if down:
                return n, gains
    return None, gains


def test_one_slow_round_does_not_demote_and_a_slowdown_does():
    """A session of true gain 1.25 (2.5 tokens a round, rounds 2 s, plain steps 1 s), timed through
    the cost model's clock: one round of 3x and one of 5x (a slow spell of the machine the round's
    verify did not see) leave it speculative, its gain never under 1.2 (an exponential average of
    weight 0.25 priced them at 3 and 4.75 s: gains 0.83 and 0.53, demoted at once; a plain mean of
    the window at 2.6 s for 20 rounds: 0.96). Its rounds slowed 2x against the plain steps for good
    demote it within PRICE_WINDOW rounds. A session of gain 0.8 (rounds 2.5 s, jittered 10 %, two
    of them 5x fast) is demoted by round WINDOW + patience."""
    steady = [2.0] * 64
    spiked = steady[:30] + [6.0, 10.0] + steady[32:]
    down, gains = timed_checks(2.5, spiked)
    assert down is None and min(gains) >= 1.2, min(gains)
    down, _ = timed_checks(2.5, steady[:40] + [4.0] * 40)
    assert down is not None and 40 < down <= 40 + cost.PRICE_WINDOW, down
    rng = np.random.default_rng(1)
    losing = list(2.5 * rng.uniform(0.9, 1.1, 40))
    losing[5] = losing[17] = 0.5
    down, gains = timed_checks(2.0, losing)
    assert down is not None and down <= gain.WINDOW + SpecParams().patience, (down, gains)


def test_demotion_waits_for_its_own_rounds_and_spares_rejection_and_always():
    be = dspark.get_backend("numpy")
    with cost.using(be, scripted(100.0)):
        few = fake_session([1] * (gain.WINDOW - 1), be=be, params=SpecParams(patience=1))
        assert gain.demote_check(few, [few]) == (False, "")
        rej = fake_session([1] * 8, be=be, params=SpecParams(patience=1, sampler="rejection",
                                                               sampling=SamplingParams(temperature=0.8)))
        assert gain.demote_check(rej, [rej]) == (False, "")
        always = fake_session([1] * 8, be=be, params=SpecParams(patience=1, policy="always"))
        assert gain.demote_check(always, [always]) == (False, "")


def test_rejection_mode_comes_from_the_request_and_the_prior_alone():
    """Whatever the measured costs, the same request gets the same mode; the margin (a request
    setting) moves it at the prior's gain."""
    be = dspark.get_backend("numpy")
    drafter = SimpleNamespace(accept_floor=4.7, config=SimpleNamespace(drafts=7), be=be, acceptance=Memory())
    for _ in range(5):  # what other requests measured: never read for the mode
        drafter.acceptance.remember((None, "rejection", 0.8), 0.5, 64)
    p = SpecParams(sampler="rejection", sampling=SamplingParams(temperature=0.8), max_verify=8)
    prior_gain = gain.NEUTRAL_TOKENS / FLAT.round(1, 8, 0)
    modes = set()
    for steps in (0.1, 1.0, 100.0):
        with cost.using(be, scripted(steps)):
            modes.add(gain.rejection_mode(p, drafter, 50))
    assert len(modes) == 1 and next(iter(modes))[0] is True
    with cost.using(be, scripted(0.1)):
        assert gain.rejection_mode(SpecParams(**{**p.__dict__, "margin": prior_gain - 1 + 1e-6}), drafter, 50)[0] is False
        assert gain.rejection_mode(SpecParams(**{**p.__dict__, "margin": prior_gain - 1 - 1e-6}), drafter, 50)[0] is True


def ended(params, drafter, tokens_per_round: float, tokens: int = 64):
    """A session that ended after `tokens` at `tokens_per_round` (what gain.remember reads)."""
    stats = SimpleNamespace(rounds=max(1, round(tokens / tokens_per_round)), mean_accepted_length=tokens_per_round)
    return SimpleNamespace(params=params, drafter=drafter, stats=stats, emitted=[0] * tokens, remembered=False)


def test_the_memory_is_a_prior_pooled_with_the_record():
    """What earlier sessions measured is pooled with the drafter's record at RECORD_WEIGHT
    sessions: one session at 1 token a round against a record of 4 predicts 2.5, counted once
    however often it is remembered; many weigh at most 1 / (1 - DECAY) sessions, so the record
    keeps a fifth; later sessions outweigh earlier ones (a memory set by its first session would
    stay at 1.6 after good ones); a short session weighs its tokens' share. Other namespaces, no
    namespace, other temperatures: their own buckets."""
    p, hot = SpecParams(), SpecParams(sampling=SamplingParams(temperature=1.0, seed=1))
    drafter = fake_session([], floor=4.0).drafter
    s = ended(p, drafter, 1.0)
    gain.remember(s, "a")
    gain.remember(s, "a")
    assert gain.predicted_tokens(p, drafter, "a") == pytest.approx((4.0 + 1.0) / 2)
    assert gain.predicted_tokens(p, drafter) == gain.predicted_tokens(p, drafter, "b") == 4.0
    assert gain.predicted_tokens(hot, drafter, "a") == gain.NEUTRAL_TOKENS
    for _ in range(60):
        gain.remember(ended(p, drafter, 1.0), "a")
    bound = memory.RECORD_WEIGHT + 1 / (1 - memory.DECAY)
    assert gain.predicted_tokens(p, drafter, "a") == pytest.approx((4.0 * memory.RECORD_WEIGHT + bound - 1) / bound)
    for _ in range(3):
        gain.remember(ended(p, drafter, 6.0), "a")
    assert gain.predicted_tokens(p, drafter, "a") > 3.5
    gain.remember(ended(p, drafter, 1.0, tokens=16), "c")
    assert gain.predicted_tokens(p, drafter, "c") == pytest.approx((4.0 + 0.25) / 1.25)
    rej = SpecParams(sampler="rejection", sampling=SamplingParams(temperature=0.8, seed=1))
    gain.remember(ended(rej, drafter, 1.0), "a")  # a rejection-sampled request's mode never reads it
    assert gain.predicted_tokens(rej, drafter, "a") == gain.NEUTRAL_TOKENS


def test_the_memory_remembers_and_explores():
    """Hot coupled sessions at 1.1 tokens a round against the neutral prior (4), rounds at 2 plain
    steps: after one, a further one is still admitted (2.55 > 2.2); after three it starts plain
    (1.98), in that namespace only; of the arrivals predicted under the record there, every
    EXPLORE_EVERY-th is predicted by the record alone and admitted. A memory deleted admits them all."""
    be = dspark.get_backend("numpy")
    hot = SpecParams(sampling=SamplingParams(temperature=1.0, seed=1))
    drafter = fake_session([], be=be).drafter

    def admitted(ns):
        return gain.admit(hot, drafter, 50, tokens=gain.predicted_tokens(hot, drafter, ns))[0]
    with cost.using(be, scripted(2.0)):
        gain.remember(ended(hot, drafter, 1.1), "a")
        assert admitted("a")
        for _ in range(2):
            gain.remember(ended(hot, drafter, 1.1), "a")
        assert not admitted("a") and admitted("b") and admitted(None)
        arrivals = [gain.arrival_tokens(hot, drafter, "a") for _ in range(2 * memory.EXPLORE_EVERY)]
        explored = [i for i, (_, note) in enumerate(arrivals) if note]
        assert explored == [memory.EXPLORE_EVERY - 1, 2 * memory.EXPLORE_EVERY - 1], arrivals
        tokens, note = arrivals[explored[0]]
        assert tokens == gain.NEUTRAL_TOKENS and note.startswith("exploring: predicted by the record (4.00)")
        assert gain.admit(hot, drafter, 50, tokens=tokens)[0]
        assert gain.arrival_tokens(hot, drafter, "b") == (gain.NEUTRAL_TOKENS, "")  # nothing to explore


def test_a_sessions_prior_is_what_its_admission_predicted():
    """The worker fixes a session's prior at what its admission predicted: an exploring one keeps
    the record while the memory says 1.6, so its own rounds, not the memory it was admitted to
    test, decide it; a prior read when first used stays fixed as later sessions are remembered
    (they would count its kind twice)."""
    be = dspark.get_backend("numpy")
    k, w = gain.PRIOR_ROUNDS, gain.WINDOW
    s = fake_session([1] * w, be=be, params=SpecParams(patience=3), floor=4.0)
    for _ in range(20):
        gain.remember(ended(s.params, s.drafter, 1.0), None)
    s.prior = 4.0
    assert gain.expected_tokens(s) == pytest.approx((4.0 * k + w) / (k + w))
    fresh = fake_session([1] * w, be=be, floor=4.0)
    fresh.drafter = s.drafter
    first = gain.expected_tokens(fresh)
    for _ in range(3):
        gain.remember(ended(s.params, s.drafter, 6.0), None)
    assert gain.expected_tokens(fresh) == first and fresh.prior < 2.0


def shared(round_per_row: float, plain_per_row: float, batches=(1, 2, 3, 4)) -> CostModel:
    """A scripted cost model whose plain steps share their weight reads: a plain step of B rows
    costs 1 + plain_per_row (B - 1) s, a round of B rows round_per_row x B s (every rule)."""
    m = CostModel(FrozenClock(), FLAT)
    for b in batches:
        for kind, rule in PRICED:
            m.record(kind, b, 0, round_per_row * b if kind == "round" else 1.0 + plain_per_row * (b - 1), width=8,
                     rule=rule)
    return m


def test_joint_split_moves_a_session_into_a_running_plain_batch():
    """Rounds at 2 s a row, plain rows 0.1 s beyond the first: beside 2 plain rows, a session
    with t tokens a round speculates iff (t + 2) / (2 + 1.1) > 3 / 1.2, i.e. t > 5.75, though its
    own gain t / 2 is far above 1 either side. A joint decision that leaves the running plain
    batch out of the step (its rows neither emit nor cost) keeps it speculative at 5.7."""
    m = shared(2.0, 0.1)
    edge = 3 / 1.2 * 3.1 - 2
    for t, want in ((edge - 0.05, 0), (edge + 0.05, 1)):
        k, rates = gain.joint_split(m, [(t, 8.0, "greedy", False)], 2, 0)
        assert k == want, (t, rates)
        assert rates[0] == pytest.approx(3 / 1.2) and rates[1] == pytest.approx((t + 2) / 3.1)
    # with no plain batch an empty plain step is free: both speculate at 5 tokens (10 / 4 > 2 / 1.1)
    assert gain.joint_split(m, [(5.0, 8.0, "greedy", False)] * 2, 0, 0)[0] == 2
    # a second rule runs its own round: its cost adds to the step
    assert gain.step_rate(m, [(5.0, 8.0, "greedy"), (5.0, 8.0, "coupled")], 0, 0) == pytest.approx(10 / 4)


def test_joint_split_admits_an_arrival_only_past_the_margin():
    m = shared(2.0, 0.1)
    for t, want in ((2.0 * 1.1 - 1e-6, 0), (2.0 * 1.1 + 1e-6, 1)):  # alone: t / 2 against 1 / 1
        assert gain.joint_split(m, [(t, 8.0, "greedy", True)], 0, 0, margin=0.1)[0] == want
    # a live session past the same point is kept without the margin (it already speculates)
    assert gain.joint_split(m, [(2.0 * 1.05, 8.0, "greedy", False)], 0, 0, margin=0.1)[0] == 1


def test_worker_under_concurrency_decides_jointly(shipped):
    """Three greedy requests at once, rounds at 2 s a row, plain rows 0.1 s beyond the first: each
    alone would speculate (4.72 / 2 > 1.1). With the plain rows a pass of their own (mix=False)
    the plain batch wins (3 / 1.2 against at most 14.16 / 6), so all three start plain; with them
    riding the round's pass one speculates ((4.72 + 2) / 2.2 against 3 / 1.2); all by the joint
    decision; a lone request still speculates. Every stream is plain decode's."""
    trunk, drafter = shipped
    rng = np.random.default_rng(9)
    reqs = [(code_prompt(trunk, rng, 40 + 10 * i), 16, None) for i in range(3)]
    for mix, want in ((False, ["admit_plain"] * 3), (True, ["admit_spec", "admit_plain", "admit_plain"])):
        w, ids = run_worker(trunk, drafter, reqs, shared(2.0, 0.1), mix=mix)
        admits = [(e.what, e.why.split(" ")[0]) for e in w.events if e.what.startswith("admit")]
        assert admits == [(a, "joint:") for a in want], w.events
        for rid, (p, n, _) in zip(ids, reqs):
            assert w.result(rid) == plain_generate(trunk, p, n)
    w, ids = run_worker(trunk, drafter, reqs[:1], shared(2.0, 0.1))
    assert [e.what for e in w.events if e.what.startswith("admit")] == ["admit_spec"]
    assert w.result(ids[0]) == plain_generate(trunk, *reqs[0][:2])


def test_verify_width_by_gain_maximises_tokens_per_cost():
    """Confidences 0.9, 0.9, 0.1, 0.9: widths 2..5 expect 1.9, 2.71, 2.79, 2.86 tokens; at 0.16
    plain steps a column (plus 1) they cost 1.32, 1.48, 1.64, 1.80: width 3 wins. Free columns
    take every draft; dear ones take the fewest."""
    conf = np.array([0.9, 0.9, 0.1, 0.9, 0.9], np.float32)
    m = CostModel(FrozenClock())
    assert gain.width_by_gain(m, conf, 5, 0) == 3
    assert gain.width_by_gain(CostModel(FrozenClock(), Prior(round_per_column=0.0)), conf, 5, 0) == 5
    assert gain.width_by_gain(CostModel(FrozenClock(), Prior(round_per_column=5.0)), conf, 5, 0) == 2
    assert gain.width_by_gain(m, conf, 2, 0) == 2


def test_verify_by_gain_runs_exact_and_needs_a_confidence_head(shipped):
    from dspark.models.presets import tiny_pair
    from dspark.session import DsparkSpecSession
    trunk, drafter = shipped
    p = code_prompt(trunk, np.random.default_rng(8), 60)
    s = DsparkSpecSession.prime(trunk, drafter, p, SpecParams(max_new_tokens=40, verify="gain", capture=False))
    while not s.finished():
        s.round()
    s.close()
    assert s.emitted == plain_generate(trunk, p, 40)
    assert len(s.stats.verified_at) > 2 and s.stats.verified_at[1] > 0  # wider than 2 where confident
    t2, d2 = tiny_pair(trunk.be, 21)
    if not d2.has_confidence:
        with pytest.raises(ValueError, match="verify='confidence': this drafter has no confidence head"):
            DsparkSpecSession.prime(t2, d2, [1, 2, 3], SpecParams(verify="confidence"))


def test_position_acceptance_counts_the_rounds_that_reached_each_draft():
    """Rounds (tokens, width) (3, 5), (1, 3), (5, 5) of 4 drafts: they reached drafts 1..4 in 3, 2,
    2, 1 rounds and accepted them in 2, 2, 1, 1; pooled with 16 rounds at the prior's rate (0.5:
    1.9375 tokens a round of 4 drafts). Not the share of rounds that verified a draft (3, 3, 2, 2),
    which counts a draft behind a rejected one as rejected."""
    assert gain.geometric_rate(1.9375, 4) == pytest.approx(0.5, abs=1e-9)
    assert gain.geometric_rate(1.0, 4) == pytest.approx(0.0, abs=1e-9)
    assert gain.geometric_rate(9.0, 4) == pytest.approx(1.0, abs=1e-9)
    got = gain.position_acceptance([(3, 5), (1, 3), (5, 5)], 4, 1.9375)
    np.testing.assert_allclose(got, [(2 + 8) / 19, (2 + 8) / 18, (1 + 8) / 18, (1 + 8) / 17], rtol=1e-9)
    np.testing.assert_allclose(gain.position_acceptance([], 4, 1.9375), [0.5] * 4, rtol=1e-9)


@pytest.mark.parametrize("hit_rate, wide", [(0.97, True), (0.05, False)])
def test_verify_by_gain_without_a_confidence_head_reads_the_sessions_acceptance(hit_rate, wide):
    """A drafter without a confidence head (DFlash's kind) verifies by gain from its own rounds:
    drafts that land take the widest verify, drafts that miss the narrowest, once the session's
    record outweighs the prior; the text is plain decode's either way."""
    from dataclasses import replace as dc_replace
    from dspark.models.drafter import DsparkDrafter
    from dspark.models.oracle import OracleDrafter
    from dspark.models.presets import tiny_pair
    from dspark.session import DsparkSpecSession
    be = dspark.get_backend("numpy")
    trunk, base = tiny_pair(be, 21)
    plain = DsparkDrafter.random(dc_replace(base.config, confidence="none"), trunk, 3)
    assert not plain.has_confidence
    drafter = OracleDrafter(plain, hit_rate=hit_rate, seed=4)
    p = [5, 9, 13, 2, 7, 11]
    want = plain_generate(trunk, p, 120)
    drafter.next_stream = list(p) + want
    with cost.using(be, CostModel(FrozenClock(), Prior(round_per_column=0.3))):
        s = DsparkSpecSession.prime(trunk, drafter, p, SpecParams(max_new_tokens=120, verify="gain", capture=False))
        widths = []
        while not s.finished():
            s.round()
            widths.append(s.recent[-1][1])
        s.close()
    assert s.emitted == want
    late = widths[len(widths) // 2:]
    cap = drafter.config.drafts + 1
    assert (np.mean(late) > cap - 1) if wide else (np.mean(late) < 2.5), widths


def test_spec_params_policy_checks():
    for bad in (dict(policy="maybe"), dict(margin=-0.1), dict(patience=0), dict(patience=True)):
        with pytest.raises(ValueError, match="SpecParams"):
            SpecParams(**bad)


# ---- the Worker under the gain policy -------------------------------------------------------------------
@pytest.fixture(scope="module")
def shipped():
    from dspark.models import load_default
    return load_default(dspark.get_backend("numpy"))


def run_worker(trunk, drafter, requests, model, low=4, mix=True):
    be = trunk.be
    drafter.acceptance.clear()  # what earlier tests' sessions measured
    with cost.using(be, model):
        w = Worker(trunk, drafter, GateConfig(low=low, high=low + 4), spec=SpecParams(burst_target=8), mix=mix)
        ids = [w.submit(p, n, s) for p, n, s in requests]
        w.run()
    return w, ids


def test_worker_demotes_the_losers_and_streams_stay_plain_decode(shipped, monkeypatch):
    """Rounds of one row priced at 3 plain steps (6 at two rows): the code prompt (about 5 tokens
    a round) stays speculative; so do random bytes, greedy, which accept 1-2 a round for 16 rounds
    and then 9 (the trunk falls into a repetition): no check runs before WINDOW rounds, and a
    first check at 8 rounds demoted them. Random bytes coupled sampled at temperature 1.5
    (admitted on a record that promises 6 a round there) are demoted at a burst boundary. Every
    stream equals plain decode with its sampling. Alone, the sampled one (1.5 a round) is demoted
    by its measured gain once its own rounds outweigh the record's (PRIOR_ROUNDS)."""
    trunk, drafter = shipped
    rng = np.random.default_rng(5)
    hot = SamplingParams(temperature=1.5, seed=11)
    monkeypatch.setattr(drafter, "sampled_accept", {1.5: 6.0})
    long = 2 * gain.WINDOW + 32  # past the first check, at 1-2 tokens a round
    reqs = [(code_prompt(trunk, rng, 80), 40, None), (rng.integers(0, 256, 20).astype(np.int32), long, None),
            (rng.integers(0, 256, 20).astype(np.int32), long, hot)]
    w, ids = run_worker(trunk, drafter, reqs, scripted(3.0))
    for rid, (p, n, s) in zip(ids, reqs):
        assert w.result(rid) == plain_generate(trunk, p, n, sampling=s)
    demoted = {e.request: e.why for e in w.events if e.what == "demote"}
    assert set(demoted) == {ids[2]}, w.events
    assert all("measured gain" in why or why.startswith("joint:") for why in demoted.values())
    met = w.metrics()
    assert met["dspark:spec_demoted"] == {"gain": 1} and met["dspark:spec_admitted_spec"] == {"gain": 3}
    assert met["vllm:spec_decode_num_drafts"] > 0 and set(met["dspark:spec_gain"]) == set(ids)
    gains = met["dspark:spec_gain"]
    assert gains[ids[2]] < min(gains[ids[0]], gains[ids[1]]) and min(gains[ids[0]], gains[ids[1]]) >= 1
    alone = (reqs[2][0], 80, hot)
    w, (rid,) = run_worker(trunk, drafter, [alone], scripted(3.0))
    assert w.result(rid) == plain_generate(trunk, alone[0], 80, sampling=hot)
    (why,) = [e.why for e in w.events if e.what == "demote"]
    assert why.startswith("measured gain") and w.metrics()["dspark:spec_gain"][rid] < 1


def test_worker_admits_plain_where_rounds_cost_too_much(shipped):
    trunk, drafter = shipped
    rng = np.random.default_rng(6)
    reqs = [(code_prompt(trunk, rng, 60), 20, None)]
    w, ids = run_worker(trunk, drafter, reqs, scripted(4.72 / 1.1 + 0.01))  # the floor 4.72 over the cost <= 1.1
    assert [(e.what, e.why.split(" ")[0]) for e in w.events if e.what.startswith("admit")] == [("admit_plain", "joint:")]
    assert w.result(ids[0]) == plain_generate(trunk, *reqs[0][:2])


def test_rejection_sampled_text_depends_only_on_seed_and_request(shipped):
    """The same rejection-sampled request under cheap and dear measured rounds and under a full gate
    (where a greedy request goes plain) emits the same text: its mode never read a timing or the
    load."""
    trunk, drafter = shipped
    rng = np.random.default_rng(7)
    p = code_prompt(trunk, rng, 60)
    rej = SamplingParams(temperature=0.8, top_p=0.95, seed=5)
    spec = SpecParams(burst_target=8, sampler="rejection")
    texts, modes = [], []
    drafter.acceptance.clear()
    for model, low in ((scripted(0.5), 4), (scripted(50.0), 4), (scripted(50.0), 0)):
        with cost.using(trunk.be, model):
            w = Worker(trunk, drafter, GateConfig(low=low, high=low + 4), spec=spec)
            rid = w.submit(p, 24, rej)
            w.run()
        texts.append(w.result(rid))
        modes.append([e.what for e in w.events if e.what.startswith("admit")])
    assert texts[0] == texts[1] == texts[2]
    assert modes == [["admit_spec"]] * 3


# ---- the Worker's memory of past sessions (dspark.memory) ---------------------------------------------
NUMBERS = "x = [0.9134, 0.2207, 0.7781, 0.0452, 0.6619, 0.3308, "  # the embedded pair drafts ~2.5 a round


def one_at_a_time(trunk, drafter, reqs, model):
    """Each (prompt, max_new, namespace) sent when the last one is done, greedy, to one worker
    under `model`; returns the worker, the ids and each request's admission (what, why)."""
    with cost.using(trunk.be, model):
        w = Worker(trunk, drafter, GateConfig(low=4, high=8), spec=SpecParams(burst_target=8))
        ids = []
        for p, n, ns in reqs:
            ids.append(w.submit(p, n, namespace=ns))
            w.run()
    admits = {e.request: (e.what, e.why) for e in w.events if e.what.startswith("admit")}
    return w, ids, [admits[i] for i in ids]


def test_one_poorly_drafted_request_does_not_switch_speculation_off(shipped):
    """A greedy request on a list of numbers (about 2.5 tokens a round), then three on code (5 or
    more), one at a time, rounds at 3.1 plain steps: the code runs speculative (with the memory
    set by its first session, 2.5, every one ran plain), and so it does with the numbers in
    another namespace. Every stream is plain decode's."""
    trunk, drafter = shipped
    rng = np.random.default_rng(11)
    good = [(code_prompt(trunk, rng, n), 48) for n in (60, 70, 80)]
    poor = (encode(NUMBERS), 64)
    want = [plain_generate(trunk, p, n) for p, n in [poor] + good]
    for poor_ns in (None, "other"):
        drafter.acceptance.clear()
        reqs = [(*poor, poor_ns)] + [(p, n, None) for p, n in good]
        w, ids, admits = one_at_a_time(trunk, drafter, reqs, scripted(3.1))
        assert [a for a, _ in admits] == ["admit_spec"] * 4, admits
        assert [w.result(i) for i in ids] == want
        if poor_ns is not None:  # remembered, in its own namespace
            assert gain.predicted_tokens(SpecParams(), drafter, poor_ns) < 3.7


def test_the_worker_remembers_per_namespace_and_explores(shipped, monkeypatch):
    """Poorly drafted requests in namespace "a", one at a time, rounds at 3.1 plain steps: after
    two, a third there starts plain (the memory still remembers: deleted, it would admit it on the
    record); the same request in "b" and without a namespace starts speculative (their buckets are
    their own); with EXPLORE_EVERY at 3, the next in "a" explores: speculative, admitted on the
    record. Every stream is plain decode's."""
    trunk, drafter = shipped
    monkeypatch.setattr(memory, "EXPLORE_EVERY", 3)
    drafter.acceptance.clear()
    p, n = encode(NUMBERS), 64
    reqs = [(p, n, ns) for ns in ("a", "a", "a", "b", None, "a")]
    w, ids, admits = one_at_a_time(trunk, drafter, reqs, scripted(3.1))
    assert [a for a, _ in admits] == ["admit_spec", "admit_spec", "admit_plain", "admit_spec", "admit_spec",
                                      "admit_spec"], admits
    assert "exploring: predicted by the record" in admits[-1][1] and "exploring" not in " ".join(w for _, w in admits[:-1])
    want = plain_generate(trunk, p, n)
    assert all(w.result(i) == want for i in ids)
