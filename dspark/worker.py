"""Worker: serves many requests on one backend, speculative where it pays and the load is light.

The gate (`GateConfig`) is the outer bound: a new demotable request (greedy, or sampled with the
coupled sampler: SpecParams.demotable) may get a spec session only while `active + 1 <= low`.
Under SpecParams(policy="gain") the decision inside the gate is joint (dspark.gain.joint_split):
at each step the demotable sessions, live and arriving, sorted by expected tokens per round, the
top k speculate, k giving the whole step the most tokens per second beside the plain batch (an
arrival only where that beats all plain by 1 + margin); a live one left out for `patience` steps
in a row, once it ran WINDOW rounds, is demoted (policy "always" skips all this). During a burst, a spec session whose measured gain has stayed below 1 for `patience` checks ends
its burst there and is demoted (reason: its gain). At a burst boundary, once `active >= high`,
every live demotable spec session is demoted (reason: the gate). Demotion is one-way: the plain
batch goes on with the session's own sampling, so a demotable request's text is the same whatever
load or timing it met: that of plain decode with its seed. A request sampled by rejection keeps
one mode for its whole life, chosen from the request and the prior alone
(dspark.gain.rejection_mode), never from the gate, the load or a timing, and is never demoted;
finished ones simply finish. Every admission and demotion is logged with its reason
(GateEvent.why) and counted in `metrics()`. Every speculative session that ends (finished or
demoted) is remembered once in the drafter's memory under its request's namespace, the prior of
later arrivals there (dspark.memory: pooled with the drafter's record, with a bounded
exploration). A sampled request without a seed gets a fresh one at submit (`Request.seed`). The worker also owns prefix
publication: after each burst it drains every session's prompt-end capture into the
`PrefixStore`, and a new request whose prompt equals a published entry in its namespace restores
from it instead of priming.

One `step()`: admit arrivals (the joint decision), one burst for every spec session (batched by
accept rule: greedy, coupled, rejection), publish captures, apply the demotion gate, and report
tokens. The plain batch rides the first burst's rounds (mixed passes): each round's trunk pass
carries one column per plain sequence beside the sessions' verify columns (dspark.session.Riders:
bitwise the plain decode step, its row committed with the round's), so the weights are read once
for both and the plain batch steps once a round. With no live spec session (or with `mix=False`,
or rounds replayed from recordings, which carry no riders) the step ends with as many plain steps
as a burst target instead, passes of their own. A request that fails is retired with its error;
the others go on: a round that raises moves nothing, riders included, and each plain sequence then
steps alone; a plain step whose logits are not finite for some sequences goes on for the others
(dspark.decode.PlainBatch.step) and those are retired.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from .decode import PlainBatch, Tokens, check_prompt, first_token, plain_step_rule, prefill_anchor
from .cost import cost_model
from .gain import (WINDOW, admit, arrival_tokens, demote_check, expected_tokens, expected_width, joint_split, prior_width,
                   rejection_mode, remember)
from .errors import CapacityError, DsparkError, NonFiniteError, NonFiniteRowsError, StateError
from .models.drafter import DsparkDrafter
from .models.trunk import HybridTrunk
from .prefix_store import PrefixStore
from .params import seeded
from .session import DsparkSpecSession, Riders, SamplingParams, SpecParams, recorded, spec_burst
from .stats import SpecStats


@dataclass(frozen=True)
class GateConfig:
    """The concurrency gate: admit to speculation while active + 1 <= low; demote at a burst boundary
    once active >= high (`demote_at`)."""
    low: int = 2
    high: int = 4

    def __post_init__(self):
        for name in ("low", "high"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"GateConfig.{name}={v!r}: expected an int >= 0")

    @property
    def demote_at(self) -> int:
        """`high`, or `low + 1` when high <= low (a gate must leave room to admit)."""
        return self.high if self.high > self.low else self.low + 1


@dataclass
class Request:
    """A request as the worker keeps it: its prompt, budget, sampling and namespace, its mode and
    tokens, and why it runs as it does."""
    id: int
    prompt: np.ndarray
    max_new_tokens: int
    sampling: SamplingParams         # with its seed: the request's own, or the one drawn at submit
    namespace: str | None            # None: requests without one (their own prefix store and memory buckets)
    mode: str = "pending"            # pending -> spec | plain -> done | failed
    tokens: list[int] = field(default_factory=list)
    restored: bool = False
    demoted: bool = False
    error: str | None = None
    submitted_step: int = 0
    first_token_step: int | None = None
    done_step: int | None = None
    session: DsparkSpecSession | None = None
    plain_id: int | None = None
    why: str = ""                    # why it runs plain, speculative, or was demoted
    outside: int = 0                 # consecutive steps the joint decision left it out of speculation
    gain: float | None = None        # its last measured gain (dspark.gain), once it left speculation

    @property
    def seed(self) -> int | None:
        """The seed its sampled text was drawn with (given, or drawn at submit); None when greedy."""
        return None if self.sampling.greedy else self.sampling.seed


@dataclass(frozen=True)
class GateEvent:
    """One admission, restore, demotion, finish or failure, with the step and the reason."""
    step: int
    request: int
    what: str    # admit_spec, admit_plain, restore, demote, finish, fail
    why: str = ""  # admissions and demotions: "gate" (the load), or the gain decision's reason


class Worker:
    """Serves many requests on one trunk and drafter: speculative where it pays and the load is
    light, plain batched decode otherwise (the module's docstring says how it decides)."""

    def __init__(self, trunk: HybridTrunk, drafter: DsparkDrafter, gate: GateConfig | None = None,
                 store: PrefixStore | None = None, spec: SpecParams | None = None, on_tokens=None, mix: bool = True):
        self.trunk, self.drafter = trunk, drafter
        self.gate = gate or GateConfig()
        self.store = store
        self.spec = spec or SpecParams()
        self.on_tokens = on_tokens          # callback(request id, new tokens, finished)
        # The plain batch rides the rounds' trunk passes (module doc) unless rounds are replayed
        # from recordings, which carry no riders (dspark.session.Riders).
        self.mix = bool(mix) and not recorded(SpecParams(launches=self.spec.launches), trunk, drafter)
        self.passes = {"plain": 0, "mixed": 0}  # plain steps run as passes of their own, rounds that carried them
        self.plain = PlainBatch(trunk)
        self.requests: dict[int, Request] = {}
        self.pending: list[Request] = []
        self.events: list[GateEvent] = []
        self.stats = SpecStats()
        self.steps = 0
        self._ids = itertools.count()

    # ---- intake -------------------------------------------------------------------------------
    def submit(self, prompt_ids, max_new_tokens: int, sampling: SamplingParams | None = None,
               namespace: str | None = None) -> int:
        """Queue a request; bad input raises here and touches nothing. A sampled request without a
        seed gets a fresh one from the OS here (dspark.params.seeded: `Request.seed`, and the
        result's `seed`). `namespace`: its tenant; None, requests without one, share buckets of
        their own in the prefix store and the gain policy's memory, which no named namespace reaches."""
        if namespace is not None and not isinstance(namespace, str):
            raise TypeError(f"namespace={namespace!r}: expected a str or None, got {type(namespace).__name__}")
        if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected an int >= 1")
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling: expected SamplingParams, got {type(sampling).__name__}")
        prompt = check_prompt(self.trunk, prompt_ids, self.trunk.config.max_ctx)
        sampling = seeded(sampling)
        r = Request(next(self._ids), prompt, int(max_new_tokens), sampling, namespace, submitted_step=self.steps)
        self.requests[r.id] = r
        self.pending.append(r)
        return r.id

    def active(self) -> int:
        return sum(r.mode in ("spec", "plain") for r in self.requests.values())

    def done(self) -> bool:
        return not self.pending and not self.active()

    # ---- the scheduling step ------------------------------------------------------------------
    def step(self) -> None:
        self.steps += 1
        held = []  # demotable arrivals inside the gate: the joint decision places them
        for r in list(self.pending):
            params = self._params(r)
            if params.policy == "gain" and params.demotable and self.active() + len(held) + 1 <= self.gate.low:
                held.append((r, params))
            else:
                self._admit(r, params, *self._mode(r, params))
        self.pending.clear()
        if self.spec.policy == "gain":
            self._joint(held)
        carried = self._spec_bursts()
        self._publish()
        self._demote_gate()
        if carried is None:  # a mixed round raised: each plain sequence steps alone, the failing one is retired
            self._plain_steps(1, alone=True)
        elif not carried:
            self._plain_steps(self.spec.burst_target)

    def run(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if self.done():
                return
            self.step()
        raise StateError(f"worker did not finish within {max_steps} steps")

    # ---- admission ----------------------------------------------------------------------------
    def _mode(self, r: Request, params: SpecParams) -> tuple[bool, str]:
        """Speculative or plain, and why. Rejection-sampled: from the request and the prior alone
        (dspark.gain.rejection_mode), whatever the load. Otherwise the gate first (the load), then
        the predicted gain beside the live sessions of the same accept rule."""
        if params.accept == "rejection":
            return rejection_mode(params, self.drafter, r.prompt.size)
        if self.active() + 1 > self.gate.low:
            return False, "gate"
        group = [q.session for q in self.requests.values() if q.mode == "spec" and q.session.params.accept == params.accept]
        return admit(params, self.drafter, r.prompt.size, group, len(self.plain.active()))

    def _params(self, r: Request) -> SpecParams:
        return SpecParams(**{**self.spec.__dict__, "max_new_tokens": r.max_new_tokens, "sampling": r.sampling})

    def _joint(self, held: list[tuple[Request, SpecParams]]) -> None:
        """The joint decision (dspark.gain.joint_split): of the live demotable spec sessions and the
        arrivals `held`, sorted by expected tokens per round, the top k speculate, where k gives the
        whole step the most tokens per second beside the plain batch; arrivals outside it start
        plain, live sessions outside it for `patience` steps in a row, once they ran WINDOW rounds,
        are demoted (the hysteresis)."""
        live = [r for r in self.requests.values()
                if r.mode == "spec" and r.session.params.demotable and not r.session.finished()]
        if not live and not held:
            return
        cands = [(expected_tokens(r.session), expected_width(r.session), r.session.params.accept, False, r, None)
                 for r in live]
        notes = {}
        for r, p in held:
            tokens, notes[r.id] = arrival_tokens(p, self.drafter, r.namespace)  # counted once: it may explore
            cands.append((tokens, float(prior_width(p, self.drafter)), p.accept, True, r, p))
        cands.sort(key=lambda c: -c[0])
        plain = [r for r in self.requests.values() if r.mode == "plain"]
        ctx = int(np.mean([r.prompt.size + len(r.tokens) for r in plain + live + [r for r, _ in held]]))
        kind = "sampled" if any(not r.sampling.greedy for r in plain + [c[4] for c in cands]) else "greedy"
        k, rates = joint_split(cost_model(self.trunk.be), [c[:4] for c in cands], len(self.plain.active()), ctx, kind,
                               self.spec.margin, self.mix)
        why = (f"joint: {k} of {len(cands)} speculative beside {len(plain)} plain, {rates[k]:.3g} tokens/s "
               f"against {rates[0]:.3g} all plain and {rates[-1]:.3g} all speculative")
        for i, (tokens, _, _, new, r, p) in enumerate(cands):
            if new:
                self._admit(r, p, i < k, f"{why}; {notes[r.id]}" if notes[r.id] else why, prior=tokens)
            elif i < k or len(r.session.recent) < WINDOW:  # no demotion on fewer rounds than demote_check
                r.outside = 0
            else:
                r.outside += 1
                if r.outside >= r.session.params.patience:
                    self._demote(r, why)

    def _admit(self, r: Request, params: SpecParams, to_spec: bool, why: str, prior: float | None = None) -> None:
        """Start `r` speculative or plain; `prior`: the tokens per round its admission predicted,
        its session's prior (dspark.gain.session_prior)."""
        cap = self.store.lookup(r.namespace, r.prompt) if self.store is not None else None
        try:
            if to_spec:
                if cap is not None:
                    r.session = DsparkSpecSession.restore(self.trunk, self.drafter, cap, params)
                else:
                    r.session = DsparkSpecSession.prime(self.trunk, self.drafter, r.prompt, params)
                r.session.prior = prior
                r.mode = "spec"
            else:
                self._admit_plain(r, cap)
                r.mode = "plain"
        except DsparkError as e:
            self._fail(r, e)
            return
        r.restored = cap is not None
        r.why = why
        self._log(r, "admit_spec" if to_spec else "admit_plain", why)
        if r.restored:
            self._log(r, "restore")

    def _admit_plain(self, r: Request, cap) -> None:
        if cap is not None:
            cache = cap.cache.copy(f"cache/plain{r.id}")
            last = first_token(self.trunk.be, self.trunk.be.asarray(cap.boundary_logits[None, :]), cap.pos, r.sampling)
        else:
            cache = self.trunk.new_cache(owner=f"cache/plain{r.id}")
            try:
                last, tp = prefill_anchor(self.trunk, cache, r.prompt, r.sampling)
            except BaseException:
                cache.free()
                raise
        r.plain_id = self.plain.join(cache, last, r.max_new_tokens, sampling=r.sampling)

    # ---- speculative bursts -------------------------------------------------------------------
    def _spec_bursts(self) -> int | None:
        """One burst of each accept rule's spec sessions; the plain batch rides the first burst's
        rounds (self.mix). Returns the rounds that carried the plain batch (None: one raised)."""
        spec = [r for r in self.requests.values() if r.mode == "spec"]
        groups = [[r for r in spec if r.session.params.accept == rule] for rule in ("greedy", "coupled", "rejection")]
        carried, ride = 0, None
        for group in groups:
            if not group:
                continue
            before = {r.id: len(r.session.emitted) for r in group}
            demote: dict[int, str] = {}
            plain_rows = len(self.plain.active())
            if self.mix and ride is None:
                ride = self._rider()
                mixed = plain_step_rule(self.plain.active()) if plain_rows else None
            else:
                mixed = None  # this burst carries no plain rows: the plain batch is a pass of its own

            def stop(s, batch):
                down, why = demote_check(s, batch, plain_rows, mixed)
                if down:
                    demote[s.id] = why
                return down
            try:
                spec_burst([r.session for r in group], stop=stop, ride=ride if mixed else None)
            except DsparkError:
                # Find the culprit: run each session alone; the failing one is retired.
                for r in group:
                    try:
                        spec_burst([r.session])
                    except DsparkError as e:
                        self._fail(r, e)
            for r in group:
                if r.mode != "spec":
                    continue
                self._deliver(r, r.session.emitted[before[r.id]:], r.session.finished())
                if r.session.finished():
                    self.stats = self.stats.merge(r.session.stats)
                    r.gain = r.session.gain
                    remember(r.session, r.namespace)
                    r.session.close()
                    self._finish(r)
                elif r.session.id in demote:
                    self._demote(r, demote[r.session.id])
        return ride.carried if ride is not None else 0

    def _rider(self):
        """The `ride` callback of spec_burst (dspark.session.Riders): before a round, the plain
        sequences the next plain step decodes; after it, that step taken from the round's picks
        (nothing moved where the round did not carry them)."""
        by_plain = {r.plain_id: r for r in self.requests.values() if r.mode == "plain"}

        def ride(riders=None):
            if riders is None:
                seqs = self.plain.riders()
                if not seqs and self.plain.active():  # each ends on its pending token: a step with nothing to decode
                    self._plain_out(self.plain.step(picks={}), by_plain)
                return Riders(seqs) if seqs else None
            if riders.picks is None:  # the round raised, or ran no trunk pass: a plain step follows the bursts
                ride.carried = None
                return
            if ride.carried is not None:
                ride.carried += 1
            self.passes["mixed"] += 1
            self._plain_out(self.plain.step(picks=riders.picks), by_plain)
        ride.carried = 0
        return ride

    def _publish(self) -> None:
        if self.store is None:
            return
        for r in self.requests.values():
            s = r.session
            if s is None or s._demoted or not s.params.capture:
                continue
            cap = s.take_prefix_capture()
            if cap is None:
                continue
            try:
                self.store.publish(r.namespace, cap)
            except CapacityError:
                cap.free()  # larger than the whole budget: not published, the request goes on

    def _demote_gate(self) -> None:
        if self.active() < self.gate.demote_at:
            return
        for r in self.requests.values():
            s = r.session
            if r.mode != "spec" or not s.params.demotable or s.finished():
                continue
            self._demote(r, "gate")

    def _demote(self, r: Request, why: str) -> None:
        """Hand a live demotable spec session to the plain batch at its burst boundary."""
        s = r.session
        self.stats = self.stats.merge(s.stats)
        r.gain = s.gain
        remember(s, r.namespace)
        cache, last = s.into_demoted()
        r.plain_id = self.plain.join(cache, last, r.max_new_tokens, list(s.emitted), r.sampling)
        r.session = None
        r.mode, r.demoted, r.why = "plain", True, why
        self._log(r, "demote", why)

    # ---- plain decode -------------------------------------------------------------------------
    def _plain_steps(self, n: int, alone: bool = False) -> None:
        """`n` plain steps of the batch (`alone`: one step of each sequence by itself)."""
        by_plain = {r.plain_id: r for r in self.requests.values() if r.mode == "plain"}
        for _ in range(n):
            if not self.plain.active():
                break
            self.passes["plain"] += 1
            try:
                out = self._isolate_plain_failure(by_plain) if alone else self.plain.step()
            except NonFiniteRowsError as e:  # the step went on for the others (dspark.decode)
                out = self._retire_failed(e, by_plain)
            except DsparkError:  # raised before the decode: nothing moved
                out = self._isolate_plain_failure(by_plain)
            self._plain_out(out, by_plain)

    def _retire_failed(self, e: NonFiniteRowsError, by_plain) -> dict[int, int]:
        """Retire the sequences a plain step finished for non-finite logits; the step's tokens of the
        others."""
        for pid, why in e.failed.items():
            self.plain.leave(pid).cache.free()
            self._fail(by_plain[pid], NonFiniteError(why))
        return e.emitted

    def _plain_out(self, out: dict[int, int], by_plain: dict[int, Request]) -> None:
        """Deliver a plain step's tokens; retire the sequences it finished."""
        for pid, tok in out.items():
            self._deliver(by_plain[pid], [tok], self.plain.sequences[pid].finished)
        for pid, r in by_plain.items():
            if r.mode == "plain" and self.plain.sequences[pid].finished:
                self.plain.leave(pid).cache.free()
                self._finish(r)

    def _isolate_plain_failure(self, by_plain) -> dict[int, int]:
        out = {}
        for pid, r in by_plain.items():
            seq = self.plain.sequences.get(pid)
            if seq is None or seq.finished:
                continue
            try:
                out.update(self.plain.step(only=[pid]))
            except NonFiniteRowsError as e:
                out.update(self._retire_failed(e, by_plain))
            except DsparkError as e:
                self.plain.leave(pid).cache.free()
                self._fail(r, e)
        return out

    # ---- bookkeeping --------------------------------------------------------------------------
    def _deliver(self, r: Request, toks: list[int], finished: bool) -> None:
        if not toks and not finished:
            return
        if toks and r.first_token_step is None:
            r.first_token_step = self.steps
        r.tokens.extend(toks)
        if self.on_tokens is not None:
            self.on_tokens(r.id, list(toks), finished)

    def _finish(self, r: Request) -> None:
        r.mode, r.done_step = "done", self.steps
        self._log(r, "finish")

    def _fail(self, r: Request, e: Exception) -> None:
        if r.session is not None:
            r.session.close()
            r.session = None
        r.mode, r.error, r.done_step = "failed", f"{type(e).__name__}: {e}", self.steps
        self._log(r, "fail")

    def _log(self, r: Request, what: str, why: str = "") -> None:
        self.events.append(GateEvent(self.steps, r.id, what, why))

    def metrics(self) -> dict:
        """Counters in vLLM's speculative-decoding names where they exist (vllm:spec_decode_*),
        and the gain decisions: admissions and demotions by reason ("gate", "gain"), and each live
        or finished request's last measured gain."""
        st = self.stats
        for r in self.requests.values():
            if r.mode == "spec":
                st = st.merge(r.session.stats)
        kinds = {"admit_spec": "admitted_spec", "admit_plain": "admitted_plain", "demote": "demoted"}
        decisions = {f"dspark:spec_{v}": {} for v in kinds.values()}
        for e in self.events:
            if e.what in kinds:
                reason = "gate" if e.why == "gate" else ("policy" if e.why == "policy always" else "gain")
                d = decisions[f"dspark:spec_{kinds[e.what]}"]
                d[reason] = d.get(reason, 0) + 1
        gains = {r.id: (r.session.gain if r.mode == "spec" else r.gain) for r in self.requests.values()}
        return {"vllm:spec_decode_num_drafts": st.rounds,
                "vllm:spec_decode_num_draft_tokens": st.drafted,
                "vllm:spec_decode_num_accepted_tokens": st.accepted,
                "vllm:spec_decode_num_accepted_tokens_per_pos": list(st.accepted_at),
                **decisions,
                "dspark:plain_steps": self.passes["plain"], "dspark:mixed_rounds": self.passes["mixed"],
                "dspark:spec_gain": {k: v for k, v in gains.items() if v is not None}}

    def result(self, request_id: int) -> Tokens:
        """The request's tokens, with `.seed`: the seed its sampled text was drawn with (None when
        greedy); given back in SamplingParams it reproduces the text."""
        r = self.requests[request_id]
        if r.mode == "failed":
            raise StateError(f"request {request_id} failed: {r.error}")
        return Tokens(r.tokens, seed=r.seed)


__all__ = ["GateConfig", "GateEvent", "PrefixStore", "Request", "Worker"]
