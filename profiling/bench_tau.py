"""Speculative tokens/s over the confidence threshold tau (and the ladder), against plain greedy
decode in the same run, on the embedded pair.

    python profiling/bench_tau.py [--backend numpy] [--tokens 256]

A lower tau verifies more of each draft: more tokens per round, a wider verify pass; a cap of
8 columns keeps the verify pass to one 8-row GEMM chunk. Where a
verify column is cheap next to a round's fixed work, the best tau is below the library's 0.5.
"""

from __future__ import annotations

import argparse
from threadpoolctl import threadpool_limits

import dspark
from dspark.byte_vocab import encode
from dspark.cli import DEMO_PROMPT, run_plain, run_spec
from dspark.models import load_default
from dspark.session import SpecParams


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numpy", choices=dspark.backends())
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args(argv)
    be = dspark.get_backend(args.backend)
    trunk, drafter = load_default(be)
    prompt = encode(DEMO_PROMPT)
    with threadpool_limits(limits=1, user_api="blas"):
        run_spec(trunk, drafter, prompt[:8], SpecParams(max_new_tokens=8))  # warm up
        run_plain(trunk, prompt[:8], 8)
        plain, t_plain, _ = run_plain(trunk, prompt, args.tokens)
        print(f"plain greedy: {len(plain) / t_plain:.1f} tokens/s on {be.name}")
        print(f"{'policy':>18} | {'mean acc len':>12} | {'drafts/round':>12} | {'tok/s':>7} | vs plain")
        policies = [("confidence", t, m) for m in (0, 8) for t in (0.7, 0.5, 0.35, 0.25, 0.1)]
        for verify, tau, max_verify in policies + [("ladder", 0.5, 0), ("ladder", 0.5, 8)]:
            out, dt, st, _ = run_spec(trunk, drafter, prompt, SpecParams(
                max_new_tokens=args.tokens, verify=verify, tau=tau, max_verify=max_verify, capture=False))
            name = (f"tau {tau}" if verify == "confidence" else "ladder") + (f" <={max_verify}" if max_verify else "")
            print(f"{name:>18} | {st.mean_accepted_length:12.2f} | {st.drafted / st.rounds:12.2f} | "
                  f"{len(out) / dt:7.1f} | {t_plain / len(plain) * len(out) / dt:.2f}x"
                  + ("" if out == plain else "  MISMATCH"))


if __name__ == "__main__":
    main()
