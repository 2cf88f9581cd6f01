"""Tokens a round emits by the round's index in its session, over the embedded pair's held-out
prompts: whether a text's first rounds predict its later ones (dspark.gain.WINDOW).

    python profiling/accept_by_round.py [--backend numpy] [--temperature 0.3]
        [--max-new-tokens 256] [--prompts 24]

The first `--prompts` of the 24 held-out prompts (tests/session/heldout_prompts.json), each a
session of `dspark generate`'s default options (greedy, or the coupled sampler at
`--temperature` with seed = the prompt's index + 1), policy "always" so that every session runs
to its budget. Printed: the mean over prompts of each prompt's mean tokens a round in rounds 0-8,
8-16, 16-24, 24-32, 32-48, 48-64 and 64 on, over the prompts that ran that far (past round 32
these are the prompts that accept less, so compare rounds 0-24 with 24-32, where every prompt
is); then the spread of whole-text means across prompts against the spread of one round within a
prompt (the weight a prior deserves), and how the first 16 rounds correlate with the rest. No
timing: the figures are the same on every run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "profiling"))

import dspark  # noqa: E402
from bench_policy import heldout, params_of  # noqa: E402
from dspark.byte_vocab import encode  # noqa: E402
from dspark.models import load_default  # noqa: E402
from dspark.params import SamplingParams  # noqa: E402
from dspark.session import DsparkSpecSession  # noqa: E402

SPANS = ((0, 8), (8, 16), (16, 24), (24, 32), (32, 48), (48, 64), (64, None))


def tokens_by_round(trunk, drafter, prompt, params) -> list[int]:
    s = DsparkSpecSession.prime(trunk, drafter, prompt, params)
    out = []
    while not s.finished():
        n = len(s.emitted)
        s.round()
        out.append(len(s.emitted) - n)
    s.close()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default=None)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else the coupled sampler")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=24, choices=range(2, 25), metavar="2..24")
    args = ap.parse_args(argv)
    trunk, drafter = load_default(dspark.get_backend(args.backend))
    runs = []
    with threadpool_limits(limits=1, user_api="blas"):
        for i in range(args.prompts):
            sampling = SamplingParams(temperature=args.temperature, seed=i + 1) if args.temperature else SamplingParams()
            params = params_of(sampling, "always", args.max_new_tokens)
            runs.append(tokens_by_round(trunk, drafter, encode(heldout(i)), params))
    what = f"temperature {args.temperature:g}, coupled" if args.temperature else "greedy"
    print(f"tokens a round by round index, {what}, {args.prompts} held-out prompts, {args.max_new_tokens} new tokens")
    for lo, hi in SPANS:
        means = [np.mean(r[lo:hi]) for r in runs if len(r) > lo]
        if means:
            print(f"  rounds {lo:3d}-{'' if hi is None else hi:<3}: {np.mean(means):.2f} a round ({len(means)} prompts)")
    whole = np.array([np.mean(r) for r in runs])
    print(f"whole-text mean: {whole.mean():.2f}, spread across prompts (std) {whole.std():.2f}; "
          f"one round within a prompt (std) {np.mean([np.std(r) for r in runs]):.2f}")
    if min(map(len, runs)) > 16:
        first = [np.mean(r[:16]) for r in runs]
        rest = [np.mean(r[16:]) for r in runs]
        print(f"first 16 rounds against the rest, correlation across prompts: {np.corrcoef(first, rest)[0, 1]:.2f}")


if __name__ == "__main__":
    main()
