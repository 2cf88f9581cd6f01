"""What a speculative round costs against a plain decode step, measured as the process runs.

A round at batch B, verify width w and context c costs `round_cost(B, w, c)` plain steps of batch
B (plain steps of one row at B = 1). Both are timed where they run (`spec_round` and
`PlainBatch.step` call `timed`): wall time on the CPU backends, CUDA events on `cuda`, read back
only once the end event has completed (no synchronisation is added to a round).

A speculative run runs no plain steps, while the machine's speed (its load, its clock) and the
context the passes attend over change, on this CPU by 1.5-2x within a fraction of a second. So
the verify pass of each round run op by op (a trunk pass at the round's context) is timed too
("verify"), and every measurement is kept over a level: a verify's seconds over the prior's
verify at its width. A round is kept over its own verify's level; a plain step over the level of
the last verify timed, which `dspark generate`'s warm-up and the worker make a round's just
before it (dspark.cli.run_warm_up alternates a round and WARM_UP_STEPS plain steps).
Everything is priced at the level now (the median of the last LEVEL_WINDOW verifies; a process's
first, cold pass does not move it), so what a round costs in plain steps is what each took beside
a round's verify of its own moment, whatever the speed did between the warm-up and the
request (a lagging level read against a round of another moment took the change for cost: on the
embedded pair it demoted a session that pays). Only a round's verify sets the level: a round's
verify pass writes a checkpoint per column and runs at its width, and the lone one-column verify
that plain steps were once paired with came out, over the prior's verify shape, at 1/1.11 of a
round's (1.10-1.13, `python profiling/round_seconds.py --levels`), so plain steps were priced 11 %
high against the rounds. A plain step right after a round takes 0.99-1.04 of the next one.
Rounds replayed from CUDA graphs do not time the verify apart: with no verify timed
the level is 1 and measurements are kept in seconds; the first verify timed divides what was kept
in seconds by its level.

A plain step's measurements set a price per (greedy or sampled, batch, context bucket). A round's
set the scale of the prior per (accept rule, batch, context bucket), pooled over widths because a
round's width varies from round to round and a per-width price would rest on a few noisy samples;
the prior's shape prices the width. A key never measured is priced by the prior at the scale of
all measurements of its kind. Every price is a Window: the trimmed mean of its last samples, so
one slow round (the machine's speed moves 1.5-2x within a second, and a round whose verify was
not slowed with it is not cancelled by the level) moves a price by at most 1/PRICE_WINDOW of its
excess, and far out it is dropped. An exponential average (weight 0.25, before) carried a round
priced 3x into the next checks: in its own arithmetic it demoted a session whose true gain was
1.25. A sustained change still moves the price within the window: past PRICE_TRIM samples, each
sample at the new price moves it by 1/PRICE_WINDOW of the change.

The prior is the shape of the cost before anything is measured: a round is a drafter pass and
fixed host work (ROUND_FIXED plain steps) plus ROUND_PER_COLUMN per verified column, measured on
the embedded pair (profiling/RESULTS.md, "Speculation where it pays"); the trunk's verify pass
alone costs 1 + VERIFY_PER_COLUMN per column beyond the first (measured: 1.18 at 8 columns on the
embedded pair, `python profiling/round_seconds.py --widths`, and 1.16-1.25 on the Qwen targets,
profiling/bench_cpu.py; a wider shape made a level taken at one width price rounds of another);
a plain step of B rows costs 1 + PLAIN_PER_ROW * (B - 1) steps of one row (weights are read once
per step). That is the prior on the CPU backends. On `cuda` the prior is the performance model's
prediction for the pair (dspark.cost_prior.TablePrior: the H200 table shipped with the package,
by batch, verify width and context, with this interface), set by dspark.cost_prior.adopt when a
drafter is built on its trunk, once per backend and never after anything is kept (`adopt`); a
pair the table does not know keeps this one. Measured rounds replace the prior's scale within a
few rounds either way.

Plain rows riding a round's trunk pass (the worker's mixed passes, dspark.session.Riders) cost
their marginal rows: `rider_seconds` is the measured slope of plain steps over batch (the prior's
slope until two batch sizes were measured), never a plain step of their own, whose weight reads the
round already pays. A round that carried riders is recorded less that price, so a round is priced
the same with or without them.

The first timed pass of each kind and rule in a process is not kept: it is cold (allocations,
first-touched pages, tables built on first use; on the embedded pair a first coupled round took
several times the next ones), and an average seeded by it would price rounds by it for many
rounds after.

Experts. A MoE trunk's pass reads the union of its rows' experts, one expert's weights once for all
its rows (dspark.ops.moe), so its cost follows D, the distinct experts per MoE layer: a verify of w
rows routed apart reads about w times a decode row's expert bytes, one whose rows share their
experts a decode row's. Every timed block collects what its MoE layers report (dspark.profile.
expert_sink): each layer's D, kept beside the block's time (`experts_log`), and on the CPU backends,
whose launches have run when they return, the wall time of the expert products. A price is then a
dense part, the prior's shapes without experts at the measured scale, plus a distinct expert's
price times D: measured (the expert products' seconds over D, over the level) where they were
timed, else the prior's `expert_step` at the dense part's scale (on `cuda`, whose prior is the
performance model's, dspark.cost_prior). A block's seconds less its expert products' (or less the
prior's share of them) are what the dense windows keep, so no expert is paid twice. D at a width
not run comes from the routing's overlap (`overlap_distinct`: each row draws its k experts from a
pool of k / p), fitted to the verify passes' counts and, apart, the plain steps' (`distinct`):
the session's own routing as it comes (a round replayed from recordings reports the counts its
router wrote on the device, read once the round has run), uniform routing (p = k / E) before any
count; E and k are
the prior's (`cuda`) or what the passes reported (the CPU backends keep Prior(): their first
passes measure what an expert costs). So a round at width w pays the experts its w rows would add,
and a plain row the experts it adds to the step (`plain_row_seconds`; PLAIN_PER_ROW is the dense
part's slope). A dense trunk has no experts, and every price is as before. The model is the
backend's: a dense pair built beside a MoE one on the same backend is priced with its experts.

The clock is injectable: anything with `mark()` and `seconds(a, b)` (None while not known yet).
Tests drive the model with a scripted clock, never with real time.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque

import numpy as np
from dataclasses import dataclass, field

from . import profile

ROUND_FIXED = 1.0        # plain steps: the drafter pass, proposal and host work of a round
ROUND_PER_COLUMN = 0.16  # plain steps per verified column (the trunk's verify is one pass over w rows)
VERIFY_PER_COLUMN = 0.025  # the trunk's verify pass alone, per column beyond the first (module doc)
PLAIN_PER_ROW = 0.25     # a plain step's extra cost per row beyond the first
PRICE_WINDOW = 16        # samples a price averages (Window): one outlier moves it by at most 1/16 of its size
PRICE_TRIM = 2           # and the ones dropped at each end beyond them
LEVEL_WINDOW = 16        # verify passes whose median is the verify level
MIN_ROW_SHARE = 0.02     # a plain row never costs less than this share of a one-row step
CONTEXT_BUCKET = 1024    # contexts below this share bucket 0; each doubling above it is a bucket
EXPERTS_LOG = 64         # passes whose distinct experts per layer the cost model keeps (CostModel.experts_log)


# Rounds of each accept rule and plain steps greedy or sampled cost differently (sampling a token
# costs more than an argmax): each has its own measurements.
RULES = (("round", "greedy"), ("round", "coupled"), ("round", "rejection"), ("plain", "greedy"), ("plain", "sampled"),
         ("verify", "greedy"))


def plain_rule(rule: str) -> str:
    """The plain step a session of accept rule `rule` would run instead."""
    return "greedy" if rule == "greedy" else "sampled"


def context_bucket(context: int) -> int:
    return int(max(0, context) // CONTEXT_BUCKET).bit_length()


@dataclass(frozen=True)
class Prior:
    """The cost shape before any measurement, in plain steps of one row. A MoE trunk's passes read
    the union of their rows' experts (`experts` of them per layer, `top_k` a row): a pass whose rows
    route to D distinct experts per MoE layer (the mean over its MoE layers) pays `expert_step` per
    expert, one expert's weights read in every MoE layer, beside the dense part (the shapes above at
    the share 1 - top_k * expert_step, so that a one-row step is 1 at D = top_k). D = None: the
    distinct experts `rows` rows reach under uniform routing (`distinct`). A dense trunk has
    expert_step 0 and every price is the shapes alone."""
    round_fixed: float = ROUND_FIXED
    round_per_column: float = ROUND_PER_COLUMN
    plain_per_row: float = PLAIN_PER_ROW
    verify_per_column: float = VERIFY_PER_COLUMN
    experts: int = 0
    top_k: int = 0
    expert_step: float = 0.0

    def distinct(self, rows: float) -> float:
        """Distinct experts per layer that `rows` rows route to, each its top_k of `experts` drawn
        uniformly: experts * (1 - (1 - top_k / experts)^rows)."""
        return uniform_distinct(self.experts, self.top_k, rows)

    def _experts(self, rows: float, D: float | None) -> float:
        return self.expert_step * (self.distinct(rows) if D is None else D) if self.expert_step else 0.0

    @property
    def dense_share(self) -> float:
        return 1.0 - self.top_k * self.expert_step

    def plain(self, batch: int, context: int, D: float | None = None) -> float:
        return self.dense_share * (1.0 + self.plain_per_row * (batch - 1)) + self._experts(batch, D)

    def round(self, batch: int, width: float, context: int, D: float | None = None) -> float:
        dense = self.dense_share * (1.0 + self.plain_per_row * (batch - 1))
        return dense * (self.round_fixed + self.round_per_column * width) + self._experts(batch * width, D)

    def verify(self, batch: int, width: float, context: int, D: float | None = None) -> float:
        """The trunk's verify pass: a plain step's pass over `width` rows a session."""
        dense = self.dense_share * (1.0 + self.plain_per_row * (batch - 1))
        return dense * (1.0 + self.verify_per_column * (width - 1.0)) + self._experts(batch * width, D)


def uniform_distinct(experts: int, top_k: int, rows: float) -> float:
    """The distinct experts `rows` rows reach, each routed to `top_k` of `experts` uniformly."""
    if not experts:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** max(rows, 0.0))


def overlap_distinct(experts: int, top_k: int, rows: float, p: float) -> float:
    """The distinct experts `rows` rows reach where each row draws its top_k from a pool of top_k / p
    experts (p = top_k / experts: uniform; p = 1: every row the same experts; p -> 0: no two rows
    share one), at most `experts`."""
    if p <= 1e-9:
        return min(float(experts), top_k * rows)
    return min(float(experts), top_k / p * (1.0 - (1.0 - p) ** max(rows, 0.0)))


def overlap_of(experts: int, top_k: int, rows: float, D: float) -> float | None:
    """The p of `overlap_distinct` at which `rows` rows reach D distinct experts (bisection: D falls
    as p grows); None where one row says nothing (D is top_k whatever the overlap)."""
    if rows < 1.5 or not top_k:
        return None
    if D >= top_k * rows - 1e-9:
        return 0.0
    if D <= top_k:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        p = (lo + hi) / 2
        lo, hi = (p, hi) if top_k / max(p, 1e-12) * (1.0 - (1.0 - p) ** rows) > D else (lo, p)
    return (lo + hi) / 2


class WallClock:
    """Host wall time: the CPU backends run synchronously, so a step's wall time is its cost."""

    def mark(self):
        return time.perf_counter()

    def seconds(self, a, b) -> float | None:
        return b - a


class CudaEventClock:
    """CUDA events on the current stream; an interval is known once its end event completed."""

    def __init__(self, cupy):
        self.cupy = cupy

    def mark(self):
        e = self.cupy.cuda.Event()
        e.record()
        return e

    def seconds(self, a, b) -> float | None:
        if not b.done:
            return None
        return self.cupy.cuda.get_elapsed_time(a, b) / 1e3


class Window:
    """A robust price: the trimmed mean of the last PRICE_WINDOW + 2 PRICE_TRIM samples, the
    PRICE_TRIM highest and the PRICE_TRIM lowest dropped (fewer while the window fills: at most
    (n - 1) // 2 at each end, so 3 samples give their median). One sample raised by e moves it by
    at most e / PRICE_WINDOW once the window is full: every order statistic is monotone in every
    sample and they move by e in all, so the kept ones move by e at most, shared by PRICE_WINDOW.
    A sample far out is dropped outright, and an EMA's carry of one slow round into the next
    checks is gone: it is in the window, trimmed, until PRICE_WINDOW + 2 PRICE_TRIM later ones
    push it out."""
    __slots__ = ("samples", "n", "_value")

    def __init__(self):
        self.samples: deque = deque(maxlen=PRICE_WINDOW + 2 * PRICE_TRIM)
        self.n = 0          # samples ever added (stats)
        self._value = None  # the estimate, until the next sample

    def add(self, x: float) -> None:
        self.samples.append(float(x))
        self.n += 1
        self._value = None

    def scale(self, f: float) -> None:
        """Every sample divided by `f` (the first verify level: dspark.cost.CostModel.record)."""
        self.samples = deque((x / f for x in self.samples), maxlen=self.samples.maxlen)
        self._value = None

    @property
    def value(self) -> float:
        if self._value is None:
            s = sorted(self.samples)
            trim = min(PRICE_TRIM, (len(s) - 1) // 2)
            kept = s[trim: len(s) - trim]
            self._value = sum(kept) / len(kept)
        return self._value


@dataclass
class CostModel:
    clock: object = field(default_factory=WallClock)
    prior: Prior = field(default_factory=Prior)
    pair: str | None = None  # the fingerprint of the pair whose prior this is (dspark.cost_prior.adopt)

    def __post_init__(self):
        # Kept over the level (module doc). (rule, batch, context bucket): seconds over the prior's steps.
        self._rounds: dict[tuple, Window] = {}
        self._plain: dict[tuple, Window] = {}  # (rule, batch, context bucket): seconds (the dense part)
        self._scale: dict = {}  # (kind, rule) and kind: seconds over the prior's steps
        self._pending: list[tuple] = []
        self._warm: set = set()  # (kind, rule) timed at least once
        self._levels: deque = deque(maxlen=LEVEL_WINDOW)  # verify seconds over the prior's verify
        self._median: float | None = None  # the median of _levels, until the next verify
        self._paired: float | None = None  # the level of the verify timed since the last round
        # MoE trunks (module doc, "Experts"): a distinct expert's seconds over the level, measured
        # where the expert products are timed; the routing's overlap p (overlap_distinct) of the
        # verify passes' rows and of the plain steps'; and each pass's distinct experts per layer.
        self._expert = Window()
        self._routing: tuple[int, int] | None = None  # (experts, top_k) the passes reported, else the prior's
        self._overlap = {"verify": Window(), "plain": Window()}
        self.experts_log: deque = deque(maxlen=EXPERTS_LOG)  # (kind, batch, width, seconds, distinct per layer)

    def adopt(self, prior, pair: str) -> bool:
        """Take `prior` as the pair `pair`'s: once (the first pair known on the backend), and only
        while nothing is kept or pending (kept measurements are ratios to the prior they were taken
        under). Returns whether it was taken."""
        if self.pair is not None or self._scale or self._levels or self._pending or self._expert.n:
            return False
        self.prior, self.pair = prior, pair
        return True

    # ---- measuring -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def timed(self, kind: str, batch: int, context: int, width: float = 1.0, rule: str = "greedy"):
        """Time the block as one round ("round", of accept rule `rule`), one plain step ("plain",
        `rule` "greedy" or "sampled") or a round's verify pass ("verify", "greedy"). It yields a
        dict: a round sets "width" (its mean verify width) once it knows it, and "riders" and
        "rider_rule" when plain rows rode its trunk pass (dspark.session.Riders). A MoE trunk's
        passes inside report their distinct experts per layer (and on the CPU backends their
        expert products' seconds), kept beside the block's time."""
        note = {"width": width, "riders": 0, "rider_rule": "greedy"}
        start = self.clock.mark()
        with profile.expert_sink() as sink:
            yield note
        end = self.clock.mark()
        sink.freeze()
        if (kind, rule) not in self._warm:  # the first pass of its kind is cold (module doc)
            self._warm.add((kind, rule))
            return
        self._pending.append((kind, rule, int(batch), int(context), float(note["width"]), start, end,
                              int(note["riders"]), note["rider_rule"], sink))
        self._resolve()

    def _resolve(self) -> None:
        waiting = []
        for item in self._pending:
            kind, rule, batch, context, width, a, b, riders, rider_rule, sink = item
            sec = self.clock.seconds(a, b)
            if sec is None:
                waiting.append(item)
            else:  # the passes have run: a count on the device is read now
                if sink.routing is not None:
                    self._routing = sink.routing
                self.record(kind, batch, context, sec, width, rule, riders, rider_rule,
                            sink.distinct() if sink.layers else None, sink.seconds)
        self._pending = waiting

    def record(self, kind: str, batch: int, context: int, seconds: float, width: float = 1.0,
               rule: str = "greedy", riders: int = 0, rider_rule: str = "greedy", experts=None,
               expert_seconds: float | None = None) -> None:
        """One measured round or plain step. A round that carried `riders` plain rows (of plain
        step rule `rider_rule`) is recorded less their price (`rider_seconds`): the round's own
        cost, so that a round's price is the same whether rows rode it or not. `experts`: the
        distinct experts of each MoE layer of its passes (None: not reported); `expert_seconds`: the
        wall time of their expert products where it was measured (module doc, "Experts")."""
        if (kind, rule) not in RULES:
            raise ValueError(f"(kind, rule)={(kind, rule)!r}: expected one of {RULES}")
        if kind == "round" and riders:
            seconds -= self.rider_seconds(riders, context, rider_rule)
        if not (seconds > 0 and math.isfinite(seconds)):
            return  # a clock that did not move (or riders priced above the whole round) says nothing
        rows = batch * width + (riders if kind == "round" else 0)
        D = float(np.mean(experts)) if experts else None
        if D is not None:
            self.experts_log.append((kind, batch, width, seconds, tuple(int(n) for n in experts)))
            # A round's pass is its verify's: counted there where the verify was timed (op by op),
            # here where it was not (a round replayed from recordings).
            p = overlap_of(*self.routing, rows, D) if kind != "round" or self._paired is None else None
            if p is not None:
                self._overlap["plain" if kind == "plain" else "verify"].add(p)
        # The dense part: the seconds less the expert products' (measured, else the prior's share
        # at the pass's experts), priced by the prior's dense shapes.
        price = self._prior_of(kind, batch, width, context, D)
        measured = expert_seconds is not None and D and 0.0 <= expert_seconds < seconds
        dense_prior = self._prior_of(kind, batch, width, context, 0.0)
        dense = seconds - expert_seconds if measured else seconds if price == dense_prior else seconds * dense_prior / price
        key = (rule, batch, context_bucket(context))
        if kind == "verify":
            level = dense / dense_prior
            if not self._levels:  # the first level: what was kept in seconds is kept over it from now on
                for kept in (*self._rounds.values(), *self._plain.values(), *self._scale.values(), self._expert):
                    kept.scale(level)
            self._levels.append(level)
            self._median = None
            self._paired = level
            if measured:
                self._expert.add(expert_seconds / D / level)
            return
        if kind == "round":  # over its own verify's level where it timed one, else the level now
            level, self._paired = self._paired or self._level_now, None
            ratio = dense / (dense_prior * level)
            self._rounds.setdefault(key, Window()).add(ratio)
        else:  # over the level of the last verify: a round's, just before (module doc)
            level = self._levels[-1] if self._levels else 1.0
            ratio = dense / (dense_prior * level)
            self._plain.setdefault(key, Window()).add(dense / level)
            if measured:
                self._expert.add(expert_seconds / D / level)
        self._scale.setdefault((kind, rule), Window()).add(ratio)
        self._scale.setdefault(kind, Window()).add(ratio)

    def _prior_of(self, kind: str, batch: int, width: float, context: int, D: float | None) -> float:
        p = self.prior
        if kind == "plain":
            return p.plain(batch, context, D)
        return p.verify(batch, width, context, D) if kind == "verify" else p.round(batch, width, context, D)

    # ---- pricing ---------------------------------------------------------------------------------
    def _scale_of(self, kind: str, rule: str) -> float:
        """The prior's scale for a key never measured: the same kind and rule, else the same kind,
        else the other kind, else 1 (over the level)."""
        for key in ((kind, rule), kind, "plain" if kind == "round" else "round"):
            a = self._scale.get(key)
            if a is not None and a.n:
                return a.value
        return 1.0

    def distinct(self, kind: str, rows: float) -> float:
        """The distinct experts per MoE layer expected of a pass of `rows` rows: a round's verify
        ("round") or a plain step ("plain"), at the overlap its kind's passes measured (the session's
        own routing, as it comes), else the prior's uniform routing; 0 for a dense trunk."""
        E, k = self.routing
        if not k:
            return 0.0
        w = self._overlap["verify" if kind == "round" else "plain"]
        if not w.n:
            return uniform_distinct(E, k, rows)
        return overlap_distinct(E, k, rows, w.value)

    @property
    def routing(self) -> tuple[int, int]:
        """(experts, top_k) of the trunk's MoE layers: the prior's, else what its passes reported
        (the CPU backends' prior is Prior(), and their passes measure what an expert costs);
        (0, 0) for a dense trunk."""
        if self.prior.top_k:
            return self.prior.experts, self.prior.top_k
        return self._routing or (0, 0)

    @property
    def _priced_experts(self) -> bool:
        return bool(self.prior.expert_step or self._expert.n)

    def _expert_price(self, kind: str, rule: str) -> float:
        """A distinct expert's seconds over the level: measured, else the prior's at the kind's scale."""
        if self._expert.n:
            return self._expert.value
        return self.prior.expert_step * self._scale_of(kind, rule)

    def round_seconds(self, batch: int, width: float, context: int, rule: str = "greedy",
                      experts: float | None = None) -> float:
        """A round's seconds at `experts` distinct experts per MoE layer (None: `distinct`)."""
        m = self._rounds.get((rule, batch, context_bucket(context)))
        dense = self.prior.round(batch, width, context, 0.0) * (m.value if m else self._scale_of("round", rule))
        if not self._priced_experts:
            return dense * self._level_now
        D = self.distinct("round", batch * width) if experts is None else experts
        return (dense + self._expert_price("round", rule) * D) * self._level_now

    def plain_seconds(self, batch: int, context: int, rule: str = "greedy", experts: float | None = None) -> float:
        m = self._plain.get((rule, batch, context_bucket(context)))
        if m is not None:
            dense = m.value
        else:
            dense = self.prior.plain(batch, context, 0.0) * self._scale_of("plain", rule)
        if not self._priced_experts:
            return dense * self._level_now
        D = self.distinct("plain", batch) if experts is None else experts
        return (dense + self._expert_price("plain", rule) * D) * self._level_now

    @property
    def _level_now(self) -> float:
        """The verify level now: the median of the last LEVEL_WINDOW; 1 where no verify was timed
        (rounds replayed from CUDA graphs), whose measurements are then kept in seconds."""
        if not self._levels:
            return 1.0
        if self._median is None:  # once per verify: a gain check prices several passes
            self._median = float(np.median(self._levels))
        return self._median

    def plain_row_seconds(self, batch: int, context: int, rule: str = "greedy") -> float:
        """What one more row adds to a plain step of `batch` rows: the slope of the measured steps of
        this rule and context bucket over their batch sizes where two or more were measured (at
        least MIN_ROW_SHARE of a one-row step), else the prior's slope at the measured level; on a
        MoE trunk, plus the experts the row adds to the step's (`distinct`)."""
        cb = context_bucket(context)
        pts = sorted((b, a.value * self._level_now) for (r, b, c), a in self._plain.items()
                     if r == rule and c == cb and a.n)
        one = self.plain_seconds(1, context, rule)
        experts = 0.0
        if self._priced_experts:
            experts = (self._expert_price("plain", rule) * self._level_now
                       * (self.distinct("plain", batch + 1) - self.distinct("plain", batch)))
        if len(pts) >= 2:
            b, t = np.array(pts, float).T
            slope = float(np.polyfit(b, t, 1)[0])
            return max(slope + experts, MIN_ROW_SHARE * one)
        p = self.prior
        dense = self.plain_seconds(batch, context, rule, 0.0)
        return dense * (p.plain(batch + 1, context, 0.0) / p.plain(batch, context, 0.0) - 1.0) + experts

    def rider_seconds(self, riders: int, context: int, rule: str = "greedy") -> float:
        """What `riders` plain rows (of plain step rule `rule`) add to a round's trunk pass: the
        marginal rows of the plain batch (`plain_row_seconds`), never a pass of their own, whose
        weight reads the round already pays."""
        return riders * self.plain_row_seconds(riders, context, rule) if riders else 0.0

    def round_cost(self, batch: int, width: float, context: int, rule: str = "greedy") -> float:
        """A round's cost in plain steps of the same batch and sampling."""
        return self.round_seconds(batch, width, context, rule) / self.plain_seconds(batch, context, plain_rule(rule))

    def measured(self) -> dict:
        """Counts of measurements, for stats."""
        return {"rounds": self._scale["round"].n if "round" in self._scale else 0,
                "plain_steps": self._scale["plain"].n if "plain" in self._scale else 0}


def clock_for(be):
    """Wall time on the CPU backends; CUDA events on `cuda` (a stand-in without events: wall time)."""
    if be.name == "cuda":
        try:
            return CudaEventClock(be.xp) if callable(be.xp.cuda.Event) else WallClock()
        except (AttributeError, NotImplementedError):  # the CuPy contract stand-in models no events
            return WallClock()
    return WallClock()


def cost_model(be) -> CostModel:
    """The backend's process-wide cost model (created on first use)."""
    if be.cost is None:
        be.cost = CostModel(clock_for(be))
    return be.cost


@contextlib.contextmanager
def using(be, model: CostModel):
    """Put `model` in place of the backend's cost model for the block (tests: a scripted clock)."""
    old, be.cost = be.cost, model
    try:
        yield model
    finally:
        be.cost = old
