"""dspark's numpy backend against what a CPU user would run instead: transformers on the same
checkpoint, in one process, interleaved, with the same threads.

    python profiling/bench_cpu.py [--arch qwen3_5 qwen3] [--threads 1 2] [--size 300m]
                                  [--prompt 32 512 2048] [--steps 8] [--repeats 5] [--rowmajor]

For each architecture a checkpoint of a few hundred million parameters (--size 300m; `tiny` for a
smoke run) is built with transformers' own classes from a seeded random init, its matrices redrawn
at unit scale (randn / sqrt(fan-in): greedy decoding then has no near-ties), saved in f32 into a
temporary directory and loaded by both: transformers'
AutoModelForCausalLM and dspark.models.hf.load_target on the numpy backend. Then, per thread count
(torch.set_num_threads and dspark.set_num_threads alike) and prompt length (`--prompt`, one or
more: 32 is what a chat turn's new tokens take, 512 and 2048 what a user's prompt does; at 32 the
peer's per-call costs, such as repacking its weights for the product, weigh more than dspark's,
which lays its weights out once at load), `--repeats` rounds of:

* the prompt pass over that many tokens (a fresh cache each);
* `--steps` plain greedy decode steps, each step run by one and then the other (the order flips
  every round), feeding back its own argmax; the two token streams must be identical;
* a verify pass over 8 tokens after the prompt (transformers on a copy of its cache, copied
  outside the clock; dspark's verify leaves its cache as it was).

It prints the medians and the ratio table (transformers' time / dspark's: above 1, dspark is
faster), dspark's verify over its decode step, and the load average before and after each thread
count (on a shared machine, how fair the run was). The `product` column is the part of a dspark
step spent in dspark.ops.linear (the bound item 2 of the design aims the step at).

Fallbacks: transformers' Qwen3.5 runs Gated-DeltaNet through flash-linear-attention's kernels
(`fla`) and its conv through `causal_conv1d` where they are installed, which is on a GPU: on a CPU
it runs its own torch code for both (`peer_fallbacks` says which, and the output prints it). The
Qwen3.5 rows therefore compare dspark with the peer's fallback, not with its fast path; the Qwen3
rows (dense attention, no fallback) are the like-for-like comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

VERIFY = 8
# The sizes: the model's dimensions, and per architecture its attention (and gdn) heads. 300m:
# Qwen3.5 (hybrid: three gdn layers to one gated attention layer) and Qwen3 (dense attention) of
# about 300M parameters in f32; tiny: a smoke run.
DIMS = {"300m": (32000, 1024, 3072, 16), "tiny": (320, 64, 96, 4)}  # vocab, hidden, MLP, layers
HEADS = {
    ("300m", "qwen3_5"): dict(num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=8,
                              linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64),
    ("300m", "qwen3"): dict(num_attention_heads=16, num_key_value_heads=8, head_dim=64),
    ("tiny", "qwen3_5"): dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32),
    ("tiny", "qwen3"): dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64),
}


def build_checkpoint(arch: str, size: str, directory: str, seed: int = 0) -> int:
    """Save the model with transformers' save_pretrained; returns its parameter count."""
    import torch
    import transformers
    vocab, hidden, mlp, layers = DIMS[size]
    cfg = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
               tie_word_embeddings=False, **HEADS[(size, arch)])
    torch.manual_seed(seed)
    if arch == "qwen3_5":
        cfg["layer_types"] = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**cfg))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # matrices at unit scale; the rest as transformers initialised it
        for p in model.parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    model.eval().save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


@dataclass
class Times:
    runs: dict = field(default_factory=dict)   # (who, what) -> seconds

    def add(self, who: str, what: str, seconds: float) -> None:
        self.runs.setdefault((who, what), []).append(seconds)

    def median(self, who: str, what: str) -> float:
        return float(np.median(self.runs[(who, what)]))


class Clocked:
    """Seconds spent inside dspark.ops.linear while open (the trunk's products)."""

    def __init__(self):
        self.seconds = 0.0

    @contextlib.contextmanager
    def around(self, module):
        original = module.linear

        def timed(*args, **kw):
            t = time.perf_counter()
            try:
                return original(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - t
        module.linear = timed
        try:
            yield self
        finally:
            module.linear = original


# transformers' fast paths for Qwen3.5's Gated-DeltaNet layers (modeling_qwen3_5.py:
# use_kernel_func_from_hub_with_fallback): the package each needs, and what runs without it
FAST_PATHS = {"qwen3_5": (("fla", "chunk_gated_delta_rule / fused_recurrent_gated_delta_rule (Gated-DeltaNet)"),
                          ("causal_conv1d", "causal_conv1d_fn / causal_conv1d_update (the gdn conv)"))}


def peer_fallbacks(arch: str) -> list[str]:
    """The fast paths transformers has for `arch` on a GPU that it replaces by its torch fallback
    here, because their package is not importable."""
    import importlib.util
    return [f"{what}: torch fallback ({package} not installed)" for package, what in FAST_PATHS.get(arch, ())
            if importlib.util.find_spec(package) is None]


def run(arch: str, size: str, threads_list, prompt_lens, steps: int, repeats: int, seed: int = 0,
        rowmajor: bool = False) -> list[dict]:
    import torch
    import transformers
    from threadpoolctl import threadpool_limits

    import dspark
    from dspark.models import trunk as trunk_module
    from dspark.models.hf import load_target

    rows = []
    with tempfile.TemporaryDirectory() as d:
        params = build_checkpoint(arch, size, d, seed)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        trunk = load_target(d, "numpy", max_ctx=max(prompt_lens) + steps + VERIFY + 8)
        if rowmajor:
            from dspark.ops.product import Panelled
            for name, w in trunk.w.items():
                if isinstance(w, Panelled):
                    trunk.w[name] = np.asarray(w)
        vocab = trunk.config.vocab
        cand = np.random.default_rng(seed + 1).integers(0, vocab, VERIFY).astype(np.int32)
        fallbacks = peer_fallbacks(arch)
        print(f"{arch}: {params / 1e6:.0f}M parameters, f32 ({params * 4 / 1e9:.2f} GB); transformers: "
              + ("; ".join(fallbacks) if fallbacks else "no fallback"), flush=True)
        for threads, prompt_len in [(t, n) for t in threads_list for n in prompt_lens]:
            prompt = np.random.default_rng(seed).integers(0, vocab, prompt_len).astype(np.int32)
            torch.set_num_threads(threads)
            dspark.set_num_threads(threads)
            load = os.getloadavg()[0]  # a shared machine: how busy it was, beside the figures
            t = Times()
            same = True
            product = Clocked()
            with torch.no_grad(), threadpool_limits(limits=threads):
                for r in range(repeats):
                    order = ("hf", "ds") if r % 2 == 0 else ("ds", "hf")
                    state = {}
                    for who in order:  # the prompt pass, a fresh cache each
                        t0 = time.perf_counter()
                        if who == "hf":
                            out = hf(torch.from_numpy(prompt.astype(np.int64))[None], use_cache=True)
                            state["hf"] = (out.past_key_values, int(out.logits[0, -1].argmax()))
                        else:
                            cache = trunk.new_cache(owner="bench/dspark")
                            with product.around(trunk_module):
                                tp = trunk.prefill(cache, prompt)
                            state["ds"] = (cache, int(np.argmax(tp.logits[-1])))
                        t.add(who, "prompt", time.perf_counter() - t0)
                    t.add("ds", "prompt_product", product.seconds)
                    product.seconds = 0.0
                    for who in order:  # a verify pass over 8 tokens after the prompt
                        if who == "hf":
                            kv = copy.deepcopy(state["hf"][0])
                            t0 = time.perf_counter()
                            hf(torch.from_numpy(cand.astype(np.int64))[None], past_key_values=kv, use_cache=True)
                        else:
                            t0 = time.perf_counter()
                            with product.around(trunk_module):
                                trunk.verify([state["ds"][0]], [cand])
                        t.add(who, "verify", time.perf_counter() - t0)
                    t.add("ds", "verify_product", product.seconds)
                    product.seconds = 0.0
                    toks = {"hf": [state["hf"][1]], "ds": [state["ds"][1]]}
                    for _ in range(steps):  # plain greedy decode, step by step
                        for who in order:
                            t0 = time.perf_counter()
                            if who == "hf":
                                kv = state["hf"][0]
                                out = hf(torch.tensor([[toks["hf"][-1]]]), past_key_values=kv, use_cache=True)
                                toks["hf"].append(int(out.logits[0, -1].argmax()))
                            else:
                                with product.around(trunk_module):
                                    tp = trunk.decode([state["ds"][0]], [toks["ds"][-1]])
                                toks["ds"].append(int(np.argmax(tp.logits[0])))
                            t.add(who, "decode", time.perf_counter() - t0)
                        t.add("ds", "decode_product", product.seconds)
                        product.seconds = 0.0
                    same = same and toks["hf"] == toks["ds"]
                    state["ds"][0].free()
            rows.append(dict(arch=arch, threads=threads, prompt=prompt_len, times=t, same=same,
                             load=(load, os.getloadavg()[0]), fallbacks=fallbacks))
    return rows


def report(rows: list[dict]) -> None:
    print()
    print("| model | threads | prompt | | transformers ms | dspark ms | dspark speed vs transformers | "
          "dspark product ms | peer |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        t, peer = row["times"], "torch fallback" if row["fallbacks"] else "its CPU path"
        head = f"| {row['arch']} | {row['threads']} | {row['prompt']} |"
        for what, label in (("decode", "plain decode, per token"), ("prompt", f"prompt pass of {row['prompt']}"),
                            ("verify", f"verify pass over {VERIFY} tokens")):
            hf, ds = t.median("hf", what), t.median("ds", what)
            prod = f"{t.median('ds', what + '_product') * 1e3:.1f}" if ("ds", what + "_product") in t.runs else ""
            print(f"{head} {label} | {hf * 1e3:.1f} | {ds * 1e3:.1f} | {hf / ds:.2f}x | {prod} | {peer} |")
        print(f"{head} verify / decode step | {t.median('hf', 'verify') / t.median('hf', 'decode'):.2f} | "
              f"{t.median('ds', 'verify') / t.median('ds', 'decode'):.2f} | | | |")
    print()
    for row in rows:
        print(f"{row['arch']}, {row['threads']} thread(s), prompt {row['prompt']}: greedy tokens identical: "
              f"{'yes' if row['same'] else 'NO'}; load average {row['load'][0]:.1f} before, {row['load'][1]:.1f} after")
    for arch in dict.fromkeys(row["arch"] for row in rows):
        fallbacks = next(row["fallbacks"] for row in rows if row["arch"] == arch)
        if fallbacks:
            print(f"{arch}: the peer runs a torch fallback for kernels it has on a GPU: {'; '.join(fallbacks)}. "
                  "These rows compare dspark with that fallback; the dense rows are the like-for-like ones.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", nargs="+", default=["qwen3_5", "qwen3"], choices=["qwen3_5", "qwen3"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--size", default="300m", choices=sorted(DIMS))
    ap.add_argument("--prompt", type=int, nargs="+", default=[32], help="prompt lengths, tokens (each its rows)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps per round")
    ap.add_argument("--repeats", type=int, default=5, help="rounds, interleaved")
    ap.add_argument("--rowmajor", action="store_true", help="dspark's matrices row-major (not panel-major)")
    args = ap.parse_args(argv)
    if any(n < 1 for n in args.prompt):
        ap.error("--prompt lengths must be >= 1")
    rows = []
    for arch in args.arch:
        rows += run(arch, args.size, args.threads, args.prompt, args.steps, args.repeats, rowmajor=args.rowmajor)
    report(rows)
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
