"""Speculative tokens/s over the confidence threshold tau (and the ladder), against plain greedy
decode measured in the same run, on the embedded pair.

    python profiling/bench_tau.py [--backend numpy] [--tokens 256] [--prompts demo|heldout]
                                  [--only "tau 0.35 <=8" "gain <=8" ...]

A lower tau verifies more of each draft: more tokens per round, a wider verify pass (capped at 8
columns, the drafter's whole block). Where a verify column is cheap next to a round's fixed work,
the best tau is below the library's 0.5. "gain" is SpecParams(verify="gain"): the width of most
expected tokens (from the confidence head) per unit of the cost model's round cost.

Every speculative run sits between two plain runs of the same prompts, and its ratio is taken
against their mean: spec and plain always come from this run, minutes apart at most, so a load
change on a shared machine moves both. The mean accepted length is split into rounds that start
on fresh text and rounds inside a repetition (dspark.stats.repeats_earlier): a looping
continuation is easy to draft, and the demo prompt's continuation loops.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

import dspark
from dspark.byte_vocab import encode
from dspark.cli import DEMO_PROMPT, run_plain, run_spec
from dspark.models import load_default
from dspark.session import SpecParams
from dspark.stats import RepetitionSplit, SpecStats

HELDOUT = Path(__file__).resolve().parents[1] / "tests" / "session" / "heldout_prompts.json"


def policy_name(verify: str, tau: float, max_verify: int) -> str:
    return ({"confidence": f"tau {tau}"}.get(verify, verify)) + (f" <={max_verify}" if max_verify else "")


def prompts_of(which: str) -> list[np.ndarray]:
    if which == "demo":
        return [encode(DEMO_PROMPT)]
    return [np.frombuffer(bytes.fromhex(h), np.uint8).astype(np.int32)
            for h in json.loads(HELDOUT.read_text())["prompts"][:6]]


def plain_pass(trunk, prompts, tokens) -> tuple[list, float]:
    outs, seconds = [], 0.0
    for p in prompts:
        out, dt, _ = run_plain(trunk, p, tokens)
        outs.append(out)
        seconds += dt
    return outs, seconds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numpy", choices=dspark.backends())
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompts", choices=["demo", "heldout"], default="demo",
                    help="the demo prompt, or the first 6 held-out prompts (tests/session/heldout_prompts.json)")
    ap.add_argument("--only", nargs="*", help='policies to run, by their printed name ("tau 0.35 <=8", "gain <=8")')
    args = ap.parse_args(argv)
    be = dspark.get_backend(args.backend)
    trunk, drafter = load_default(be)
    prompts = prompts_of(args.prompts)
    policies = [("confidence", t, m) for m in (0, 8) for t in (0.7, 0.5, 0.35, 0.25, 0.1)]
    policies += [("ladder", 0.5, 0), ("ladder", 0.5, 8), ("gain", 0.5, 8)]
    if args.only:
        policies = [p for p in policies if policy_name(*p) in args.only]
    with threadpool_limits(limits=1, user_api="blas"):
        run_spec(trunk, drafter, prompts[0][:8], SpecParams(max_new_tokens=8))  # warm up
        run_plain(trunk, prompts[0][:8], 8)
        t0 = time.perf_counter()
        plain, t_before = plain_pass(trunk, prompts, args.tokens)
        n_plain = sum(map(len, plain))
        print(f"{len(prompts)} prompt(s) ({args.prompts}), {args.tokens} new tokens each, {be.name}; plain greedy "
              f"{n_plain / t_before:.1f} tokens/s in the first plain pass")
        print(f"{'policy':>16} | {'mean acc len':>12} | {'fresh':>5} | {'repeat':>6} | {'drafts/round':>12} | "
              f"{'spec tok/s':>10} | {'plain tok/s':>11} | vs plain")
        for verify, tau, max_verify in policies:
            total, split, outs, t_spec = SpecStats(), RepetitionSplit(), [], 0.0
            for p in prompts:
                out, dt, st, _ = run_spec(trunk, drafter, p, SpecParams(
                    max_new_tokens=args.tokens, verify=verify, tau=tau, max_verify=max_verify, capture=False),
                    split=split)
                outs.append(out)
                total, t_spec = total.merge(st), t_spec + dt
            again, t_after = plain_pass(trunk, prompts, args.tokens)
            plain_tps = n_plain / ((t_before + t_after) / 2)  # the plain passes either side of this spec run
            spec_tps = sum(map(len, outs)) / t_spec
            name = policy_name(verify, tau, max_verify)
            print(f"{name:>16} | {total.mean_accepted_length:12.2f} | {split.fresh.mean_accepted_length:5.2f} | "
                  f"{split.repeat.mean_accepted_length:6.2f} | {total.drafted / total.rounds:12.2f} | "
                  f"{spec_tps:10.1f} | {plain_tps:11.1f} | {spec_tps / plain_tps:.2f}x"
                  + ("" if outs == plain and again == plain else "  MISMATCH"), flush=True)
            t_before = t_after
        print(f"rounds inside a repetition: the last 16 tokens up to the anchor occurred earlier; "
              f"{time.perf_counter() - t0:.0f}s in all")


if __name__ == "__main__":
    main()
