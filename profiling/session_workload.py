"""A short speculative-decoding workload for Nsight runs: prime N requests, then decode them
together in batched spec bursts (dspark.session.spec_burst) until each has its tokens.

    python profiling/session_workload.py --backend cuda [--requests 8] [--tokens 128]
                                         [--model default|tiny] [--temperature T] [--nvtx]

NVTX ranges (domain "dspark") mark "prime", every "burst", and each round phase inside it (draft,
propose, snapshot, verify, accept, commit, rollback, ingest). They are on when a profiler injects
NVTX (nsys and ncu set NVTX_INJECTION64_PATH) or with --nvtx (DSPARK_NVTX=1); off, they cost
nothing. One warm-up round on a throwaway request runs first (NVRTC compiles, memory pools fill),
outside the timed part and inside a "warmup" range.

Prompts: for the embedded default pair (trained on Python standard-library sources), byte windows
of the held-out files, as dspark.train.evaluate cuts them; for the random-weight tiny pair,
random bytes. Greedy by default; --temperature > 0 runs sampled sessions (filtered draws and
the lossless speculative accept), each request with its own seed. Prints the prime time, decode tokens/s and the speculation statistics (mean
accepted length = 1 + accepted / rounds, acceptance per draft position).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import dspark
from dspark import profile
from dspark.backends import NAMES
from dspark.errors import CapacityError
from dspark.session import DsparkSpecSession, SamplingParams, SpecParams, spec_burst
from dspark.stats import SpecStats

MODELS = ("default", "tiny")


def load_pair(model: str, be, seed: int):
    if model == "tiny":
        from dspark.models.presets import tiny_pair
        return tiny_pair(be, seed)
    from dspark.models import load_default
    return load_default(be)


def make_prompts(model: str, count: int, length: int, rng: np.random.Generator) -> list[np.ndarray]:
    if model == "default":
        from dspark.train import data
        _, held_out = data.split()
        return [p.astype(np.int32) for p in data.code_prompts(held_out, count, length, rng)]
    return [rng.integers(0, 256, length).astype(np.int32) for _ in range(count)]  # bytes: never EOS or MASK


def synchronize(be) -> None:
    if be.name == "cuda":
        be.xp.cuda.Device().synchronize()


def run(backend: str | None, requests: int, tokens: int, model: str = "default", prompt_len: int | None = None,
        burst: int = 32, seed: int = 0, warmup: bool = True, temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """Prime `requests` sessions and decode `tokens` new tokens each (greedy at temperature 0,
    else sampled, each request with its own seed); returns the measurements."""
    be = dspark.get_backend(backend)
    trunk, drafter = load_pair(model, be, seed)
    prompt_len = prompt_len or (128 if model == "default" else 32)
    need = prompt_len + tokens + drafter.config.block
    if need > trunk.config.max_ctx:
        raise CapacityError(f"--prompt-len {prompt_len} + --tokens {tokens} + one block ({drafter.config.block}) = "
                         f"{need} rows: more than the {model} trunk's context of {trunk.config.max_ctx}")
    prompts = make_prompts(model, requests + 1, prompt_len, np.random.default_rng(seed))

    def params(i: int) -> SpecParams:
        sampling = SamplingParams(temperature=temperature, top_p=top_p, seed=seed * 1_000_003 + i)
        return SpecParams(max_new_tokens=tokens, burst_target=burst, capture=False, sampling=sampling)

    if warmup:
        with profile.phase("warmup"):
            s = DsparkSpecSession.prime(trunk, drafter, prompts[-1], params(requests))
            s.round()
            s.close()
        synchronize(be)

    t0 = time.perf_counter()
    sessions = [DsparkSpecSession.prime(trunk, drafter, p, params(i)) for i, p in enumerate(prompts[:requests])]
    synchronize(be)
    t1 = time.perf_counter()
    bursts = 0
    while True:
        live = [s for s in sessions if not s.finished()]
        if not live:
            break
        with profile.phase("burst"):
            spec_burst(live)
        bursts += 1
    synchronize(be)
    t2 = time.perf_counter()

    stats = SpecStats()
    for s in sessions:
        stats = stats.merge(s.stats)
    emitted = sum(len(s.emitted) for s in sessions)
    for s in sessions:
        s.close()
    mode = f"sampled (T={temperature:g}, top-p {top_p:g})" if temperature else "greedy"
    return {"backend": be.name, "model": model, "mode": mode, "requests": requests, "prompt_len": prompt_len,
            "tokens": emitted, "prime_s": t1 - t0, "decode_s": t2 - t1, "bursts": bursts, "stats": stats}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=NAMES, default=None,
                    help="numpy, simt or cuda (default: cuda when a GPU works, else numpy)")
    ap.add_argument("--requests", type=int, default=8, help="sessions decoded together (default 8)")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request (default 128)")
    ap.add_argument("--model", choices=MODELS, default="default",
                    help="the embedded trained pair, or the random-weight tiny pair")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128; tiny: 32)")
    ap.add_argument("--burst", type=int, default=32, help="burst target: tokens per session per burst")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampled sessions")
    ap.add_argument("--top-p", type=float, default=1.0, help="top-p filter of sampled sessions (default off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nvtx", action="store_true", help="NVTX ranges on without a profiler (DSPARK_NVTX=1)")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false")
    a = ap.parse_args(argv)
    for name in ("requests", "tokens", "burst"):
        if getattr(a, name) < 1:
            ap.error(f"--{name}={getattr(a, name)}: expected >= 1")
    if a.nvtx:
        os.environ["DSPARK_NVTX"] = "1"
        profile.enabled.cache_clear()
    try:
        SamplingParams(temperature=a.temperature, top_p=a.top_p)
    except ValueError as e:
        ap.error(str(e))
    try:
        r = run(a.backend, a.requests, a.tokens, a.model, a.prompt_len, a.burst, a.seed, a.warmup, a.temperature,
                a.top_p)
    except CapacityError as e:
        ap.error(str(e))
    st = r["stats"]
    nvtx = "on" if profile.enabled() else "off"
    print(f"backend {r['backend']}, model {r['model']}, {r['mode']}: {r['requests']} requests x "
          f"{r['prompt_len']}-token prompts, up to {a.tokens} new tokens each, NVTX {nvtx}")
    prompt_rate = r["requests"] * r["prompt_len"] / r["prime_s"]
    print(f"prime:  {r['prime_s'] * 1e3:.1f} ms ({prompt_rate:,.0f} prompt tokens/s)")
    print(f"decode: {r['tokens']} tokens in {r['decode_s']:.3f} s = {r['tokens'] / r['decode_s']:,.1f} tokens/s "
          f"({r['bursts']} bursts, {st.rounds} session-rounds)")
    print(f"mean accepted length {st.mean_accepted_length:.2f}")
    print(st.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
