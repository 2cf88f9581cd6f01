"""The `dspark` command line (also `python -m dspark`).

    dspark demo       the embedded pair on a code prompt: speculative vs plain greedy, side by side
    dspark generate   one request: prompt, sampling options, --no-spec
    (both take --model DIR: a Hugging Face target and its tokenizer.json instead of the embedded pair,
    and with it --drafter DIR: a released drafter for that target, DeepSpec DSpark, z-lab DFlash or
    speculators)
    dspark info       backends, device, compiled kernels (--model DIR: what a checkpoint holds, FP8 included)
    dspark bench      the profiling benchmarks

Errors (a bad backend, a bad option value, no GPU for --backend cuda) are one line on stderr and
exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import numpy as np

from . import __version__, progress
from .backends import NAMES, backends, cuda_available, get_backend
from .byte_vocab import decode, encode
from .errors import DsparkError
from .params import POLICIES, PROMPT_CHUNK, SAMPLERS, VERIFY_POLICIES
from .stats import REPEAT_SPAN, RepetitionSplit, RoundTrace

DEMO_PROMPT = '''import os


def walk_python_files(root):
    """Yield the path of every .py file below root."""
'''


# Verifying a column costs little next to a round's fixed work (one drafter pass, the chain, the
# bookkeeping), so the command line verifies more of the draft than the library default tau 0.5,
# up to 8 columns (the embedded drafter's whole block: 7 drafts and the anchor).
# `profiling/bench_tau.py` measures tokens/s over both knobs.
DEMO_TAU = 0.35
DEMO_MAX_VERIFY = 8


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear line instead of argparse's usage block
        raise CliError(message)


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


def unit_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"{v} must be in [0, 1]")
    return v


def backend_of(name: str | None):
    if name is not None and name not in NAMES:
        raise CliError(f"--backend {name!r}: expected one of {', '.join(NAMES)}")
    if name == "cuda" and not cuda_available():
        raise CliError("--backend cuda: no CUDA GPU works here (CuPy with a GPU is required)")
    return get_backend(name)


# ---- info ----------------------------------------------------------------------------------------
def cmd_info(args) -> int:
    print(f"dspark {__version__}")
    avail = backends()
    print(f"backends: {', '.join(avail)} (default: {get_backend().name})")
    if cuda_available():
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        print(f"device: {props['name'].decode()} (sm_{props['major']}{props['minor']}, "
              f"{props['totalGlobalMem'] / 2**30:.0f} GiB)")
    else:
        print("device: no CUDA GPU; kernels run on the CPU through the simt backend")
    from .ops.product import native_status
    print(native_status())
    if "simt" in avail:
        be = get_backend("simt")
        sigs = be.kernels.signatures
        families = sorted({s.source for s in sigs.values()})
        print(f"compiled kernels (simt{', ASan' if be.kernels.asan else ''}): {len(sigs)} entry points "
              f"in {len(families)} families")
        for fam in families:
            print(f"  {fam}: {', '.join(sorted(n for n, s in sigs.items() if s.source == fam))}")
    if args.model:
        print_model(args.model)
    return 0


def print_model(path) -> None:
    """--model: what load_target would read (config and headers only, nothing loaded): the one-line
    report, then what a quantized checkpoint keeps quantized and what it leaves as stored."""
    from .models.hf.target import inspect_target
    report = inspect_target(path)
    print(f"model: {report.summary()}")
    if report.quantization:
        # a MoE checkpoint's experts are thousands of names: counted, not listed
        dense = [n for n in report.quantized if ".moe.experts." not in n]
        experts = f" and {report.quantized_experts} MoE expert matrices" if report.quantized_experts else ""
        print(f"  quantized ({report.quantization}): {', '.join(dense) or 'none'}{experts}")
        print(f"  left as stored: {', '.join(report.kept) or 'none'}")


# ---- generation ------------------------------------------------------------------------------------
def with_block(drafter, block: int | None):
    """The drafter with another block size (--block): the weights do not depend on it."""
    from .models import DsparkDrafter
    if block is None or block == drafter.config.block:
        return drafter
    if block < 2:
        raise CliError(f"--block {block}: expected at least 2")
    resized = DsparkDrafter(replace(drafter.config, block=block), drafter.host_weights, drafter.trunk)
    resized.source = drafter.source
    return resized


def load_pair(be, args):
    from .models import load_default
    if args.max_ctx:
        raise CliError("--max-ctx applies to --model: the embedded pair's context is its own")
    trunk, drafter = load_default(be)
    trunk.prompt_chunk = args.prompt_chunk
    return trunk, with_block(drafter, args.block)


def load_model(be, args):
    """--model: a Hugging Face target (dspark.models.hf, --max-ctx cache rows, prompts in passes
    of --prompt-chunk tokens) and its tokenizer, with a bar of its tensors reaching the device; the
    load summary (dtypes, storage, bytes on the device, tensors skipped by rule) goes to stderr."""
    from .models.hf import load_target, load_tokenizer
    from .models.hf.checkpoint import CheckpointError
    try:
        trunk = load_target(args.model, be, max_ctx=args.max_ctx, progress=progress_flag(args))
    except CheckpointError as e:
        raise CliError(str(e).replace("max_ctx=", "--max-ctx ")) from None
    trunk.prompt_chunk = args.prompt_chunk
    path = args.model
    tokenizer = load_tokenizer(path)
    print(f"dspark: loaded {trunk.source.summary()}", file=sys.stderr)
    return trunk, tokenizer


def load_released_drafter(args, trunk):
    """--drafter: a released drafter (dspark.models.hf.load_drafter) for the --model target; its
    description goes to stderr."""
    from .models.hf import load_drafter
    drafter = with_block(load_drafter(args.drafter, trunk, progress=progress_flag(args)), args.block)
    print(f"dspark: loaded {drafter.source}", file=sys.stderr)
    return drafter


def check_drafter_option(args) -> None:
    if args.drafter and not args.model:
        raise CliError("--drafter needs --model: the Hugging Face target the drafter was trained for")


def progress_flag(args) -> bool | None:
    """--no-progress: no bars; otherwise dspark.progress's rule (a bar while stderr is a terminal)."""
    return False if args.no_progress else None


def run_spec(trunk, drafter, prompt, params, progress=None, split=None, trace=None):
    """Speculative generation; returns (tokens, decode seconds, stats, prime seconds). `progress`:
    a dspark.progress bar of the tokens emitted. Rounds are also recorded into `split` (a
    dspark.stats.RepetitionSplit) and `trace` (a dspark.stats.RoundTrace) when given."""
    from .session import DsparkSpecSession
    t0 = time.perf_counter()
    s = DsparkSpecSession.prime(trunk, drafter, prompt, params)
    t1 = time.perf_counter()
    rounds = []  # (tokens emitted before the round, drafts verified, drafts accepted)
    while not s.finished():  # bursts are whole rounds: run them one by one to log each
        before = (len(s.emitted), s.stats.drafted, s.stats.accepted)
        s.round()
        rounds.append((before[0], s.stats.drafted - before[1], s.stats.accepted - before[2]))
        if progress is not None:
            progress.update(len(s.emitted) - progress.n)
    dt = time.perf_counter() - t1
    out, stats = list(s.emitted), s.stats
    s.close()
    record_rounds(prompt, out, rounds, split, trace)
    return out, dt, stats, t1 - t0


def record_rounds(prompt, out, rounds, split=None, trace=None) -> None:
    """Record a request's rounds, (tokens emitted before the round, verified, accepted) each, into
    a RepetitionSplit and a RoundTrace, where given."""
    run = RoundTrace()
    run.record_rounds([*map(int, prompt), *out], len(prompt), rounds)
    if split is not None:
        split.add(run)
    if trace is not None:
        for name in ("starts", "verified", "accepted", "repeat"):
            getattr(trace, name).extend(getattr(run, name))


def run_request(trunk, drafter, prompt, params, trace=None):
    """One request under params.policy (dspark.gain), as the worker decides: plain where the
    predicted gain is too small (or, sampled by rejection, where the prior's is), else speculative,
    demoted to plain decode at the first round boundary where the measured gain has stayed below 1.
    Returns (tokens, decode seconds, stats or None, what ran and why); the speculative rounds are
    recorded into `trace` (a dspark.stats.RoundTrace) when one is given."""
    from .decode import PlainBatch
    from .gain import admit, demote_check, rejection_mode
    from .session import DsparkSpecSession
    decide = rejection_mode if params.accept == "rejection" else admit
    ok, why = decide(params, drafter, len(prompt))
    if not ok:
        out, dt, _ = run_plain(trunk, prompt, params.max_new_tokens, params.sampling)
        return out, dt, None, f"plain: {why}"
    s = DsparkSpecSession.prime(trunk, drafter, prompt, params)
    t0 = time.perf_counter()
    demoted = ""
    rounds = []  # (tokens emitted before the round, drafts verified, drafts accepted)
    while not s.finished():
        before = (len(s.emitted), s.stats.drafted, s.stats.accepted)
        s.round()
        rounds.append((before[0], s.stats.drafted - before[1], s.stats.accepted - before[2]))
        down, reason = demote_check(s, [s])
        if down:
            demoted = f"; demoted to plain after {s.rounds} rounds and {len(s.emitted)} tokens: {reason}"
            cache, last = s.into_demoted()
            batch = PlainBatch(trunk)
            sid = batch.join(cache, last, params.max_new_tokens, list(s.emitted), s.params.sampling)
            batch.run()
            out = batch.leave(sid).emitted
            cache.free()
            break
    else:
        out = list(s.emitted)
    dt = time.perf_counter() - t0
    s.close()
    record_rounds(prompt, out, rounds, trace=trace)
    gain = f", measured gain {s.gain:.2f}" if s.gain is not None and not demoted else ""
    return out, dt, s.stats, (f"spec, mean accepted length {s.stats.mean_accepted_length:.2f} over {len(rounds)} rounds"
                              f"{gain} (admitted: {why}){demoted}")


def run_plain(trunk, prompt, max_new, sampling=None, progress=None):
    """Plain decode (greedy or sampled); returns (tokens, decode seconds, prefill seconds)."""
    from .decode import PlainBatch, prefill_anchor
    t0 = time.perf_counter()
    cache = trunk.new_cache()
    last, _ = prefill_anchor(trunk, cache, prompt, sampling)
    batch = PlainBatch(trunk)
    sid = batch.join(cache, last, max_new, sampling=sampling)
    t1 = time.perf_counter()
    while batch.active():
        batch.step()
        if progress is not None:
            progress.update(len(batch.sequences[sid].emitted) - progress.n)
    dt = time.perf_counter() - t1
    out = batch.leave(sid).emitted
    cache.free()
    return out, dt, t1 - t0


def generate(trunk, drafter, prompt, params, no_spec: bool = False, trace=None):
    """`dspark generate` with a drafter: the warm-up and the request, as the command runs them.
    Returns (tokens, decode seconds, stats or None, what ran and why).

    `no_spec`: plain decode, warmed by plain steps only (a plain request does not pay for a
    speculative warm-up). Otherwise both paths are warmed on the prompt itself, as the demo does:
    these are also the cost model's first measurements, so they are taken at the context the
    request starts from: plain steps (the process's first, cold passes), then rounds and plain
    steps in turn (run_warm_up)."""
    run_plain(trunk, prompt, 8, params.sampling)
    if no_spec:
        out, dt, _ = run_plain(trunk, prompt, params.max_new_tokens, params.sampling)
        return out, dt, None, "plain: --no-spec"
    run_warm_up(trunk, drafter, prompt, params)
    return run_request(trunk, drafter, prompt, params, trace)


WARM_UP_ROUNDS = 6  # rounds of `dspark generate`'s warm-up (the process's first, cold, is not kept)
WARM_UP_STEPS = 3   # plain steps after each


def run_warm_up(trunk, drafter, prompt, params) -> None:
    """The cost model's first measurements of both paths, on the request's prompt: a speculative
    session's rounds, each followed by WARM_UP_STEPS plain steps of a plain sequence of the same
    prompt and sampling. Each plain step is kept over the level of the round's verify just before
    it (dspark.cost), so both sides of what a round costs in plain steps are taken at one moment of
    the machine's speed, and the level is a round's verify, as every later one."""
    from .decode import PlainBatch, prefill_anchor
    from .session import DsparkSpecSession
    budget = WARM_UP_ROUNDS * (drafter.config.drafts + 1)
    s = DsparkSpecSession.prime(trunk, drafter, prompt, replace(params, max_new_tokens=budget))
    cache = trunk.new_cache()
    last, _ = prefill_anchor(trunk, cache, prompt, params.sampling)
    batch = PlainBatch(trunk)
    sid = batch.join(cache, last, WARM_UP_ROUNDS * WARM_UP_STEPS + 1, sampling=params.sampling)  # the anchor counts
    try:
        for _ in range(WARM_UP_ROUNDS):
            if s.finished():
                break
            s.round()
            for _ in range(WARM_UP_STEPS):
                if batch.riders():  # a step that decodes
                    batch.step()
    finally:
        batch.leave(sid)
        cache.free()
        s.close()


def body(trunk, out: list[int]) -> list[int]:
    """The tokens to print as text: an end-of-sequence id that ended the stream (any of
    config.eos_ids) is not text, whether or not the tokenizer calls it special."""
    return out[:-1] if out and out[-1] in trunk.config.eos_ids else out


def ending(trunk, out: list[int], max_new: int) -> str:
    """Why a stream stopped, for the summary line."""
    if out and out[-1] in trunk.config.eos_ids:
        return f"end-of-sequence id {out[-1]}"
    return "token budget" if len(out) >= max_new else "context full"


def plot_check(args) -> None:
    """--plot needs matplotlib: say so before anything is loaded."""
    if args.plot:
        from .plots import pyplot
        pyplot()


def plot_written(args, stats, trace, title: str) -> None:
    from .plots import plot_run
    plot_run(args.plot, stats, trace, title)
    print(f"dspark: plot written to {args.plot}", file=sys.stderr)


def cmd_demo(args) -> int:
    from .session import SpecParams
    check_drafter_option(args)
    plot_check(args)
    be = backend_of(args.backend)
    if args.model:
        trunk, tokenizer = load_model(be, args)
        if args.drafter:
            drafter = load_released_drafter(args, trunk)
            what = f"{args.model} with the drafter {args.drafter}"
        else:  # no trained drafter given: a random one, so the demo still shows exactness
            from .models.presets import random_drafter
            drafter = random_drafter(trunk, block=args.block or 8)
            what = f"{args.model} with a random drafter"
        text, prompt = tokenizer.decode, tokenizer.encode(DEMO_PROMPT)
    else:
        trunk, drafter = load_pair(be, args)
        what, text, prompt = "embedded pair", decode, encode(DEMO_PROMPT)
    print(f"dspark demo: {what} on backend {be.name}, block {drafter.config.block}, "
          f"{args.max_new_tokens} new tokens, greedy, verify {args.verify} (tau {args.tau}, at most "
          f"{args.max_verify or drafter.config.drafts + 1} columns)")
    params = SpecParams(max_new_tokens=args.max_new_tokens, verify=args.verify, tau=args.tau,
                        max_verify=args.max_verify, capture=False)
    run_spec(trunk, drafter, prompt[:8], replace(params, max_new_tokens=8))  # warm both paths
    run_plain(trunk, prompt[:8], 8)
    split, trace = RepetitionSplit(), RoundTrace()
    with progress.bar(args.max_new_tokens, "spec", "tok", progress_flag(args)) as shown:
        spec, t_spec, stats, t_prime = run_spec(trunk, drafter, prompt, params, shown, split, trace)
    with progress.bar(args.max_new_tokens, "plain", "tok", progress_flag(args)) as shown:
        plain, t_plain, t_prefill = run_plain(trunk, prompt, args.max_new_tokens, progress=shown)
    print("---- prompt + speculative output " + "-" * 40)
    print(DEMO_PROMPT + text(body(trunk, spec)))
    print("-" * 73)
    print_acceptance(stats, sys.stdout, split)
    spec_tps, plain_tps = len(spec) / t_spec, len(plain) / t_plain
    print(f"speculative            {spec_tps:8.1f} tokens/s   (prime {t_prime * 1e3:.0f} ms)")
    print(f"plain greedy           {plain_tps:8.1f} tokens/s   (prefill {t_prefill * 1e3:.0f} ms)")
    print(f"speedup                {spec_tps / plain_tps:8.2f}x")
    if args.plot:
        plot_written(args, stats, trace, f"dspark demo: {what}, backend {be.name}, {len(spec)} tokens")
    exact = spec == plain
    print("EXACT: speculative output is byte-identical to plain greedy decode" if exact else
          "MISMATCH: speculative output differs from plain greedy decode")
    return 0 if exact else 1


def print_acceptance(stats, file, split=None) -> None:
    """Mean accepted length (also apart for fresh text and repetitions when `split` is given, a
    dspark.stats.RepetitionSplit), acceptance by draft position, and the verify widths the rounds
    ran (what `--verify gain` or the confidence head chose)."""
    acc = " ".join(f"{a:.2f}" for a in stats.acceptance_by_position)
    print(f"mean accepted length   {stats.mean_accepted_length:.2f} tokens per round ({stats.rounds} rounds)",
          file=file)
    if split is not None:
        for name, part in (("on fresh text", split.fresh), ("inside a repetition", split.repeat)):
            print(f"  {name:20s} {part.mean_accepted_length:.2f} ({part.rounds} rounds)", file=file)
        print(f"  (a round is inside a repetition when the last {REPEAT_SPAN} tokens up to its anchor occurred "
              "earlier)", file=file)
    print(f"acceptance by position {acc}", file=file)
    print("verify widths          " + ", ".join(f"{w}: {n}" for w, n in sorted(stats.widths.items()))
          + " (width: rounds)", file=file)


def cmd_generate(args) -> int:
    from .params import SamplingParams, seeded
    from .session import SpecParams
    check_drafter_option(args)
    plot_check(args)
    be = backend_of(args.backend)
    try:  # sampled without --seed: a fresh seed from the OS, drawn once here for every run below, and printed
        sampling = seeded(SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                         min_p=args.min_p, seed=args.seed))
    except ValueError as e:
        raise CliError(str(e).replace("SamplingParams.", "--").replace("_", "-")) from None
    if args.model:  # speculative with --drafter, else plain decode
        trunk, tokenizer = load_model(be, args)
        drafter = load_released_drafter(args, trunk) if args.drafter else None
        text, prompt = tokenizer.decode, tokenizer.encode(args.prompt)
    else:
        trunk, drafter = load_pair(be, args)
        text, prompt = decode, encode(args.prompt)
    params = SpecParams(max_new_tokens=args.max_new_tokens, verify=args.verify, tau=args.tau,
                        max_verify=args.max_verify, capture=False, sampling=sampling, sampler=args.sampler,
                        policy=args.policy)
    trace = RoundTrace()
    if drafter is None:
        out, dt, _ = run_plain(trunk, prompt, args.max_new_tokens, sampling)
        stats, note = None, "plain: no --drafter for --model"
    else:
        out, dt, stats, note = generate(trunk, drafter, prompt, params, no_spec=args.no_spec, trace=trace)
    print(args.prompt + text(body(trunk, out)))
    seed = "" if sampling.greedy else f"seed {sampling.seed}, "
    print(f"[{len(out)} tokens in {dt:.2f}s, {len(out) / dt:.1f} tokens/s, {seed}{note}; stopped: "
          f"{ending(trunk, out, args.max_new_tokens)}]", file=sys.stderr)
    if stats is not None:
        print_acceptance(stats, sys.stderr)
    if args.plot:
        from .stats import SpecStats
        plot_written(args, stats or SpecStats(), trace, f"dspark generate: {len(out)} tokens, {note.split(',')[0]}")
    return 0


def cmd_bench(args) -> int:
    import runpy
    from pathlib import Path
    script = Path(__file__).resolve().parent.parent / "profiling" / f"bench_{args.which}.py"
    if not script.is_file():
        raise CliError(f"bench {args.which}: {script} not found (the benchmarks live in a source checkout)")
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="dspark", description="DSpark speculative decoding on hybrid models")
    ap.add_argument("--version", action="version", version=f"dspark {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=Parser)
    info = sub.add_parser("info", help="backends, device, compiled kernels; --model DIR: what a checkpoint holds")
    info.add_argument("--model", default=None, metavar="DIR",
                      help="a Hugging Face target: its one-line load report and what it quantizes (nothing loaded)")
    info.set_defaults(run=cmd_info)

    def common(p):
        p.add_argument("--backend", default=None, help=f"one of {', '.join(NAMES)} (default: cuda if a GPU works, "
                                                      "else numpy)")
        p.add_argument("--model", default=None, metavar="DIR",
                       help="a Hugging Face target (qwen3, qwen3_5): a directory or a hub id in the local cache")
        p.add_argument("--drafter", default=None, metavar="DIR",
                       help="a released drafter for --model (DeepSpec DSpark, z-lab DFlash / DFlash2, speculators): "
                            "a directory or a hub id in the local cache")
        p.add_argument("--max-new-tokens", type=positive_int, default=256)
        p.add_argument("--max-ctx", type=positive_int, default=None,
                       help="cache rows per session for --model (default min(max_position_embeddings, 4096), "
                            "at most max_position_embeddings)")
        p.add_argument("--prompt-chunk", type=positive_int, default=PROMPT_CHUNK,
                       help=f"tokens per prompt pass: memory is bounded by the pass (default {PROMPT_CHUNK})")
        p.add_argument("--block", type=positive_int, default=None,
                       help="drafter block size (default: the drafter's own)")
        p.add_argument("--verify", choices=VERIFY_POLICIES, default="auto",
                       help="verify width: the drafter's confidence head where it has one, else the ladder "
                            "(auto); confidence, ladder, full (every draft), or gain (most expected tokens per "
                            "unit of round cost, from the confidence head or the session's acceptance by position)")
        p.add_argument("--tau", type=unit_float, default=DEMO_TAU,
                       help=f"confidence threshold for the verify width (default {DEMO_TAU})")
        p.add_argument("--max-verify", type=int, default=DEMO_MAX_VERIFY,
                       help=f"most columns per verify (default {DEMO_MAX_VERIFY}; 0: block + 1)")
        p.add_argument("--threads", type=positive_int, default=None,
                       help="threads of the numpy backend's native code (default: DSPARK_NUM_THREADS, else the "
                            "cores this process may use); results do not depend on it")
        p.add_argument("--plot", default=None, metavar="FILE",
                       help="draw acceptance by draft position and tokens per round along the text into FILE "
                            "(.png, .svg, .pdf; needs matplotlib: the plots extra)")
        p.add_argument("--no-progress", action="store_true",
                       help="no progress bars (loads, the demo's streams); they show only on a terminal anyway, "
                            "and DSPARK_PROGRESS=0 turns them off too")

    demo = sub.add_parser("demo", help="speculative vs plain greedy on the embedded pair")
    common(demo)
    demo.set_defaults(run=cmd_demo)
    gen = sub.add_parser("generate", help="generate from a prompt")
    gen.add_argument("prompt")
    common(gen)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None,
                     help="the seed of a sampled request's noise: the same seed, the same text (default: a fresh "
                          "64-bit seed from the OS, printed in the summary line; greedy ignores it)")
    gen.add_argument("--sampler", choices=SAMPLERS, default="coupled",
                     help="sampled speculation: coupled (the text of plain sampled decode with the seed, token for "
                          "token) or rejection (lossless rejection sampling)")
    gen.add_argument("--no-spec", action="store_true", help="plain decode, no speculation")
    gen.add_argument("--policy", choices=POLICIES, default="gain",
                     help="gain (default): speculate only where the predicted gain exceeds 1 + 0.1, and demote to "
                          "plain decode once the measured gain stays below 1; always: speculate to the end")
    gen.set_defaults(run=cmd_generate)
    bench = sub.add_parser("bench", help="run a profiling benchmark")
    bench.add_argument("which", choices=["kernels", "attention", "worker"])
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    bench.set_defaults(run=cmd_bench)
    return ap


def main(argv=None) -> int:
    from threadpoolctl import threadpool_limits
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "threads", None):
            from .ops.product import set_num_threads
            set_num_threads(args.threads)
        # What BLAS still multiplies is small: one BLAS thread is fastest, and measured rates do
        # not swing with whatever else the machine runs (the numpy backend's products are native).
        with threadpool_limits(limits=1, user_api="blas"):
            return args.run(args)
    except (CliError, DsparkError) as e:
        print(f"dspark: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
