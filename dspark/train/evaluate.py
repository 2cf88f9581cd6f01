"""Held-out acceptance of the shipped pair through the real session (numpy backend, greedy).

    python -m dspark.train.evaluate [--prompts 24] [--new 160] [--json out.json]

Prompts are cut from the held-out files (data.split) exactly as the drafter's training prompts
are cut from the training files: 128 bytes at a seeded random offset. Each is decoded greedily
by DsparkSpecSession (confidence verify width, tau 0.5) and checked against plain greedy decode
of the same trunk (speculation must not change a token). Prints SpecStats: mean accepted length
(tokens per round) and acceptance per draft position.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from .. import get_backend
from ..models.default import load_default
from ..session import DsparkSpecSession, SpecParams
from ..stats import SpecStats
from . import data


def plain_greedy(trunk, prompt, new: int) -> list[int]:
    from ..ops.argmax import argmax_rows
    be = trunk.be
    cache = trunk.new_cache(owner="evaluate/plain")
    try:
        tp = trunk.prefill(cache, prompt)
        tok = int(be.to_host(argmax_rows(be, tp.logits[-1:]))[0])
        out = [tok]
        while len(out) < new and tok not in trunk.config.eos_ids:
            tp = trunk.decode([cache], [tok])
            tok = int(be.to_host(argmax_rows(be, tp.logits))[0])
            out.append(tok)
        return out
    finally:
        cache.free()


def evaluate(prompts: int, new: int, prompt_len: int = 128, seed: int = 2024, check: int = 4) -> dict:
    trunk, drafter = load_default(get_backend("numpy"))
    _, held = data.split()
    ps = data.code_prompts(held, prompts, prompt_len, np.random.default_rng(seed))
    total, mismatches = SpecStats(), 0
    spec_s = plain_s = 0.0          # over the first `check` prompts: the same tokens both ways
    spec_tokens = plain_tokens = 0
    for i, p in enumerate(ps):
        t0 = time.time()
        s = DsparkSpecSession.prime(trunk, drafter, p.astype(np.int32), SpecParams(max_new_tokens=new, capture=False))
        while not s.finished():
            s.burst()
        if i < check:
            spec_s += time.time() - t0
            spec_tokens += len(s.emitted)
            t0 = time.time()
            plain = plain_greedy(trunk, p.astype(np.int32), new)
            plain_s += time.time() - t0
            plain_tokens += len(plain)
            mismatches += s.emitted != plain
        total = total.merge(s.stats)
        print(f"prompt {i}: {s.stats.summary()}", flush=True)
        s.close()
    return {"prompts": prompts, "new_tokens": new, "prompt_len": prompt_len, "seed": seed,
            "mean_accepted_length": round(total.mean_accepted_length, 3),
            "acceptance_by_position": [round(a, 3) for a in total.acceptance_by_position],
            "rounds": total.rounds, "drafted": total.drafted, "accepted": total.accepted,
            "accepted_histogram": total.histogram,
            "numpy_tokens_per_s": {"spec": round(spec_tokens / spec_s, 1), "plain": round(plain_tokens / plain_s, 1),
                                   "note": "prefill included, first `check` prompts, shared 2-core CPU"},
            "checked_against_plain_greedy": min(check, prompts), "mismatches": mismatches,
            "python": data.python_version()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dspark.train.evaluate")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--new", type=int, default=160)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    res = evaluate(a.prompts, a.new)
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
