"""The end-to-end exactness gate: greedy speculative output must equal plain greedy decode, byte
for byte, in every case; and a demotion at any burst boundary, continued inside a PlainBatch
that already holds other sequences, must not change a byte either.

    python profiling/e2e_gate.py [--backend numpy|simt|cuda] [--quick]

Prints one line per case and `ALL EXACT` only if every case matched (exit code 1 otherwise).
Cases cross prompt lengths, block sizes 4 and 8, both verify-width policies, both harvest
modes, both rollback methods, EOS and budget cuts, on small random-weight models.

The drafter is an oracle (dspark.models.oracle.OracleDrafter) that knows the trunk's greedy
stream, past the request's budget and past its EOS: rounds accept several drafts, and the round
that reaches the end accepts drafts beyond it, so the session must cut its accepted block at the
EOS or at the budget (with the last token as the anchor, lead 0, or as an accepted draft, lead
1). Each case counts the rounds whose accepted block was cut, by reason, and fails unless its
own cut (its `cut` label) happened: a gate that never cuts cannot see a session that ignores
an EOS inside an accepted block or overruns its budget.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import dataclass

import numpy as np

import dspark
from dspark.decode import PlainBatch, plain_generate, prefill_anchor
from dspark.models.oracle import OracleDrafter, greedy_continuation
from dspark.models.presets import tiny_pair
from dspark.session import DsparkSpecSession, SpecParams, spec_burst


@dataclass(frozen=True)
class Case:
    prompt_len: int
    block: int
    verify: str
    harvest: str
    rollback: str
    cut: str          # "budget" or "eos": where the stream ends, and the cut the case must make
    lead: int         # the end token is the anchor of the cut round (0) or an accepted draft (1)
    max_new: int
    seed: int

    def __str__(self):
        return (f"prompt={self.prompt_len:3d} b={self.block} verify={self.verify:10s} harvest={self.harvest:9s} "
                f"rollback={self.rollback:10s} cut={self.cut:6s} lead={self.lead} new={self.max_new}")


def cases(quick: bool) -> list[Case]:
    out = []
    grid = itertools.product([4, 8], ["confidence", "ladder"], ["shifted", "mask_fill"])
    for i, (block, verify, harvest) in enumerate(grid):
        for j, (prompt_len, cut) in enumerate([(5, "budget"), (37, "eos"), (120, "budget")]):
            if quick and j != i % 2:  # one prompt per configuration, budget and EOS cuts in turn
                continue
            rollback = ("checkpoint", "replay")[(i + j) % 2]
            out.append(Case(prompt_len, block, verify, harvest, rollback, cut, (i // 2 + j) % 2,
                            40 if cut == "budget" else 60, seed=100 * i + j))
    return out


def follow(drafter, prompt, stream, plain) -> None:
    """Sessions primed from here on follow `stream` and end where `plain` ends."""
    drafter.next_stream = stream
    drafter.next_stop = len(prompt) + len(plain) - 1


def cut_of(s) -> int:
    """Tokens a finished session accepted but did not emit: its last round's cut (the only round
    that can be cut, since a cut finishes the session)."""
    return s.stats.rounds + s.stats.accepted - len(s.emitted)


def demotion_matches(trunk, drafter, prompt, params, plain, bursts_before: int, rng, cuts) -> bool:
    """Run `bursts_before` bursts speculatively, demote, and finish inside a PlainBatch that
    already decodes 3 other sequences."""
    s = DsparkSpecSession.prime(trunk, drafter, prompt, params)
    s.take_prefix_capture().free()
    for _ in range(bursts_before):
        spec_burst([s])
        if s.finished():
            ok = s.emitted == plain
            if cut_of(s) > 0:
                cuts[s.finish_reason] += 1
            s.close()
            return ok
    emitted = list(s.emitted)
    cache, last = s.into_demoted()
    batch = PlainBatch(trunk)
    others = []
    for _ in range(3):
        c = trunk.new_cache()
        last_o, _ = prefill_anchor(trunk, c, rng.integers(0, 256, int(rng.integers(2, 30))))
        others.append((batch.join(c, last_o, 100), c))
    sid = batch.join(cache, last, params.max_new_tokens, emitted)
    while not batch.sequences[sid].finished:
        batch.step()
    ok = batch.leave(sid).emitted == plain
    cache.free()
    for _, c in others:
        c.free()
    return ok


def run_case(be, case: Case) -> tuple[bool, str]:
    rng = np.random.default_rng(case.seed)
    prompt = rng.integers(0, 256, case.prompt_len).astype(np.int32)
    trunk, drafter = tiny_pair(be, case.seed, harvest=case.harvest, block=case.block)
    # The trunk's greedy continuation, past the budget and past any EOS: what its verify accepts.
    cont = greedy_continuation(trunk, prompt, case.max_new + case.block + 1)
    if case.cut == "eos":  # a token that the stream emits mid-way becomes the EOS
        eos = cont[case.max_new // 2]
    else:  # an EOS the stream never reaches, so the budget ends it
        eos = next(t for t in [trunk.config.eos_id, *range(trunk.config.vocab)] if t not in cont[:case.max_new])
    trunk, drafter = tiny_pair(be, case.seed, harvest=case.harvest, block=case.block, eos_id=int(eos))
    plain = plain_generate(trunk, prompt, case.max_new)
    assert plain == cont[:len(plain)] and (plain[-1] == eos if case.cut == "eos" else len(plain) == case.max_new)
    params = SpecParams(max_new_tokens=case.max_new, burst_target=8, verify=case.verify, rollback=case.rollback)
    drafter = OracleDrafter(drafter, hit_rate=0.8, seed=case.seed, lead=case.lead)
    follow(drafter, prompt, [*prompt.tolist(), *cont], plain)
    cuts = {"eos": 0, "budget": 0}
    s = DsparkSpecSession.prime(trunk, drafter, prompt, params)
    s.take_prefix_capture().free()
    bursts = 0
    while not s.finished():  # spec_burst's bursts, round by round to see the last round's keep
        got = 0
        while not s.finished() and got < params.burst_target:
            last = s.round()
            got += len(last)
        s.check_invariant()
        bursts += 1
    spec_ok = s.emitted == plain
    if cut_of(s) > 0:
        cuts[s.finish_reason] += 1
    role = "anchor" if len(last) == 1 else f"draft {len(last) - 1}"
    detail = (f"mean accepted length {s.stats.mean_accepted_length:.2f}, accepted-length histogram "
              f"{s.stats.histogram}; last round: {s.finish_reason} token as {role}, {cut_of(s)} accepted tokens cut")
    s.close()
    demote_ok = all(demotion_matches(trunk, drafter, prompt, params, plain, k, rng, cuts) for k in range(bursts))
    cut_ok = cuts[case.cut] > 0
    return spec_ok and demote_ok and cut_ok, (
        f"spec {'EXACT' if spec_ok else 'DIFF'}, demotions {'EXACT' if demote_ok else 'DIFF'} at {bursts} boundaries; "
        f"cuts eos={cuts['eos']} budget={cuts['budget']}{'' if cut_ok else ' (NO ' + case.cut.upper() + ' CUT)'}; "
        f"{detail}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numpy", choices=dspark.backends())
    ap.add_argument("--quick", action="store_true", help="one prompt per configuration (8 cases: 4 budget, 4 EOS cuts)")
    args = ap.parse_args(argv)
    be = dspark.get_backend(args.backend)
    all_ok = True
    t0 = time.perf_counter()
    todo = cases(args.quick)
    for case in todo:
        ok, detail = run_case(be, case)
        all_ok &= ok
        print(f"{'EXACT' if ok else 'MISMATCH'}  {case}  {detail}", flush=True)
    print(f"{len(todo)} cases on {be.name} in {time.perf_counter() - t0:.1f}s")
    print("ALL EXACT" if all_ok else "NOT EXACT")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
