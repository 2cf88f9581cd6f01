"""Coupled against rejection sampling: mean accepted length and tokens/s at temperatures 0.3, 0.8
and 1.0, both samplers in one run, on the embedded pair and on a transformers-built target with a
released-format drafter.

    python profiling/bench_coupled.py [--backend numpy] [--pairs embedded hf] [--tokens 128]
                                      [--seeds 2] [--prompts 6] [--temperatures 0.3 0.8 1.0]

The coupled sampler emits plain sampled decode's text for the seed (so a session can be demoted at
any burst boundary); rejection sampling accepts each draft with probability sum(min(p, q)), the
most any lossless accept can, and the coupled one only when the drafter's pick with the target's
noise is the target's own pick. The difference is the price of the coupling: this prints it.

Each (prompt, seed) runs coupled, rejection and plain sampled decode back to back, in an order
that alternates from one to the next, so a change of load on a shared machine moves all three;
tokens/s are totals over every run of a row, and "vs plain" divides by plain sampled decode's
tokens/s over the same prompts and seeds (the coupled text is plain's, token for token: MISMATCH
is printed otherwise).

* embedded: the shipped pair (trained), the first 6 held-out prompts (their last 200 bytes), the
  command line's verify width (tau 0.35, at most 8 columns).
* hf: a tiny Qwen3.5 target built and saved by transformers (tests/models/hf_models.py) with a
  DeepSpec DSpark drafter saved by its peer's code and loaded by load_drafter. Its weights are
  random, so its proposals are steered (dspark.models.oracle.TrunkDrafter): each slot's q is the
  target's own filtered distribution with its logits tilted by +-0.5, every draft verified. The
  steering runs a shadow trunk pass per slot, which would swamp the round: this pair's tokens/s
  leave the steering's seconds out. Needs torch and transformers (the test extra).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

import dspark
from dspark.cli import run_plain
from dspark.session import DsparkSpecSession, SamplingParams, SpecParams
from dspark.stats import SpecStats

ROOT = Path(__file__).resolve().parents[1]
HELDOUT = ROOT / "tests" / "session" / "heldout_prompts.json"
SAMPLERS = ("coupled", "rejection")


def embedded(be):
    """(label, trunk, drafter, prompts, SpecParams without sampling, follow)."""
    from dspark.models import load_default
    trunk, drafter = load_default(be)
    prompts = [np.frombuffer(bytes.fromhex(h), np.uint8).astype(np.int32)[-200:]
               for h in json.loads(HELDOUT.read_text())["prompts"][:6]]
    return "embedded pair", trunk, drafter, prompts, SpecParams(tau=0.35, max_verify=8, capture=False), None


def hf(be, workdir: Path, tilt: float = 0.5):
    """The tiny Qwen3.5 target and its steered DeepSpec drafter (module doc)."""
    sys.path.insert(0, str(ROOT))
    from dspark.models.hf import load_drafter, load_target
    from dspark.models.oracle import TrunkDrafter
    from tests.models import drafter_peers as peers
    from tests.models.hf_models import QWEN35, build, reference
    case = QWEN35[0]
    build(case, workdir)
    model = reference(case, workdir)
    sizes = peers.sizes_of(model)
    L = sizes.target_layers
    peer = peers.deepspec_model(7, target=model, sizes=sizes, taps=(-1, L - 2), block=8)
    peer.save_pretrained(workdir / "drafter")
    trunk = load_target(workdir, be)
    drafter = TrunkDrafter(load_drafter(workdir / "drafter", trunk), tilt=tilt, seed=7)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, trunk.config.vocab, int(n)).astype(np.int32) for n in (9, 17, 30, 48)]
    label = f"{case.name} (transformers) + DeepSpec drafter, q = p tilted +-{tilt}"
    return label, trunk, drafter, prompts, SpecParams(verify="full", capture=False), drafter.follow


def steering_seconds(drafter) -> float:
    return getattr(drafter, "steer_seconds", 0.0)


def time_steering(drafter) -> None:
    """Count the seconds the TrunkDrafter's chain step spends (its shadow trunk pass and filtered
    rows, and the real head's small product) in drafter.steer_seconds."""
    own = drafter.markov_bias
    drafter.steer_seconds = 0.0

    def markov_bias(prev):
        t0 = time.perf_counter()
        try:
            return own(prev)
        finally:
            drafter.steer_seconds += time.perf_counter() - t0
    drafter.markov_bias = markov_bias


def run_one(trunk, drafter, prompt, params, follow) -> tuple[list[int], float, SpecStats]:
    s = DsparkSpecSession.prime(trunk, drafter, prompt, params)
    if follow:
        follow(s)
    steer0 = steering_seconds(drafter)
    t0 = time.perf_counter()
    while not s.finished():
        s.burst()
    dt = time.perf_counter() - t0 - (steering_seconds(drafter) - steer0)
    out, stats = list(s.emitted), s.stats
    s.close()
    return out, dt, stats


def bench(be, pair, temperatures, seeds: int, tokens: int) -> list[dict]:
    label, trunk, drafter, prompts, base, follow = pair
    rows = []
    warm = SpecParams(**{**base.__dict__, "max_new_tokens": 8, "sampling": SamplingParams(temperature=1.0)})
    for sampler in SAMPLERS:  # warm both paths
        run_one(trunk, drafter, prompts[0][:8], SpecParams(**{**warm.__dict__, "sampler": sampler}), follow)
    for T in temperatures:
        acc = {k: {"stats": SpecStats(), "tokens": 0, "seconds": 0.0} for k in (*SAMPLERS, "plain")}
        exact = True
        for i, (p, seed) in enumerate(itertools.product(prompts, range(seeds))):
            sp = SamplingParams(temperature=T, seed=seed)
            order = [*SAMPLERS, "plain"]
            for k in (order if i % 2 == 0 else order[::-1]):
                if k == "plain":
                    out, dt, _ = run_plain(trunk, p, tokens, sp)
                    acc[k]["plain_out"] = out
                else:
                    params = SpecParams(**{**base.__dict__, "max_new_tokens": tokens, "sampling": sp, "sampler": k})
                    out, dt, st = run_one(trunk, drafter, p, params, follow)
                    acc[k]["stats"] = acc[k]["stats"].merge(st)
                    acc[k]["out"] = out
                acc[k]["tokens"] += len(out)
                acc[k]["seconds"] += dt
            exact &= acc["coupled"]["out"] == acc["plain"]["plain_out"]
        plain_tps = acc["plain"]["tokens"] / acc["plain"]["seconds"]
        row = {"pair": label, "T": T, "plain_tps": plain_tps, "exact": exact}
        for k in SAMPLERS:
            st = acc[k]["stats"]
            row[k] = {"mal": st.mean_accepted_length, "by_pos": st.acceptance_by_position, "rounds": st.rounds,
                      "tps": acc[k]["tokens"] / acc[k]["seconds"]}
        rows.append(row)
        print_row(row)
    return rows


def print_row(row) -> None:
    c, r = row["coupled"], row["rejection"]
    for k in SAMPLERS:
        x = row[k]
        pos = " ".join(f"{a:.2f}" for a in x["by_pos"])
        print(f"  T={row['T']:<4} {k:9s} | mean accepted length {x['mal']:5.2f} ({x['rounds']:4d} rounds) | "
              f"{x['tps']:7.1f} tok/s, {x['tps'] / row['plain_tps']:4.2f}x plain | by position {pos}", flush=True)
    print(f"  T={row['T']:<4} coupled / rejection: accepted length {c['mal'] / r['mal']:.3f}, tokens/s "
          f"{c['tps'] / r['tps']:.3f}; plain sampled {row['plain_tps']:.1f} tok/s; coupled text "
          f"{'== plain sampled decode' if row['exact'] else 'MISMATCH'}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numpy", choices=dspark.backends())
    ap.add_argument("--pairs", nargs="+", default=["embedded", "hf"], choices=["embedded", "hf"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seeds", type=int, default=2, help="seeds per prompt")
    ap.add_argument("--prompts", type=int, default=6, help="at most this many prompts per pair")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.3, 0.8, 1.0])
    args = ap.parse_args(argv)
    be = dspark.get_backend(args.backend)
    ok = True
    t0 = time.perf_counter()
    with threadpool_limits(limits=1, user_api="blas"), tempfile.TemporaryDirectory() as tmp:
        for name in args.pairs:
            pair = embedded(be) if name == "embedded" else hf(be, Path(tmp))
            pair = (*pair[:3], pair[3][: args.prompts], *pair[4:])
            if name == "hf":
                time_steering(pair[2])
            print(f"{pair[0]} on {be.name}: {len(pair[3])} prompts x {args.seeds} seeds, {args.tokens} new tokens"
                  f"{' (tokens/s net of the steering)' if name == 'hf' else ''}", flush=True)
            ok &= all(row["exact"] for row in bench(be, pair, args.temperatures, args.seeds, args.tokens))
    print(f"{time.perf_counter() - t0:.0f}s in all; {'coupled == plain sampled decode in every run' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
