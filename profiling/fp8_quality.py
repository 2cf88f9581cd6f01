"""FP8 against the 16-bit model it was quantized from: KL divergence and top-1 agreement of the
next-token distributions over a few hundred positions, on the numpy backend (f32 math).

    python profiling/fp8_quality.py [--prompts 4] [--tokens 128]

Two models, each quantized by transformers' own recipe (tests/models/fp8_models.py: 128 x 128
blocks, scale 448 / amax, e4m3 round to nearest even):
* the embedded trunk (trained on Python sources: the one model here whose logits mean something),
  its matrices quantized in our layout, over the held-out code prompts the acceptance floors use
  (tests/session/heldout_prompts.json), teacher-forced;
* the tiny Qwen3.5 of the FP8 tests (random weights saved by transformers as bf16, then its FP8
  directory), over random token prompts, teacher-forced.
KL(p16 || p8) in nats per position (mean and largest), and how often the argmax agrees.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dspark  # noqa: E402
from dspark.models.default import DEFAULT_DIR  # noqa: E402
from dspark.models.trunk import HybridTrunk  # noqa: E402
from dspark.models.weights import load_model  # noqa: E402
from dspark.models.config import TrunkConfig  # noqa: E402
from dspark.ops.fp8 import Fp8Host  # noqa: E402
from tests.models.fp8_models import QWEN35_FP8, build_fp8, quantize  # noqa: E402


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def compare(wide, narrow) -> tuple[float, float, float]:
    """(mean KL, largest KL, top-1 agreement) of rows of logits [n, V]."""
    lp, lq = log_softmax(wide), log_softmax(narrow)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    return float(kl.mean()), float(kl.max()), float((wide.argmax(-1) == narrow.argmax(-1)).mean())


def logits_of(trunk, prompts):
    return np.concatenate([trunk.prefill(trunk.new_cache(), p).logits for p in prompts])


# The linears the family's FP8 releases quantize (gdn's a and b, the embedding and the LM head stay 16-bit).
QUANTIZED = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "gdn.w_qkv", "gdn.w_z", "gdn.wo", "mlp.w_gate", "mlp.w_up",
             "mlp.w_down")


def quantized_embedded(be):
    """(the embedded trunk, the same with its QUANTIZED matrices FP8, how many)."""
    config, w = load_model(DEFAULT_DIR, "trunk", TrunkConfig)
    out = dict(w)
    for name, a in w.items():
        if name.startswith("layers.") and name.endswith(QUANTIZED):
            q, inv = quantize(np.asarray(a, np.float32).T)   # [N, K], as a checkpoint stores it
            out[name] = Fp8Host(q.T, inv.T, name)
    return HybridTrunk(config, w, be), HybridTrunk(config, out, be), sum(isinstance(v, Fp8Host) for v in out.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args(argv)
    be = dspark.get_backend("numpy")
    held = json.loads((ROOT / "tests/session/heldout_prompts.json").read_text())["prompts"]
    prompts = [np.frombuffer(bytes.fromhex(h), np.uint8).astype(np.int32)[: args.tokens] for h in held[: args.prompts]]
    wide, narrow, n = quantized_embedded(be)
    mean, worst, top1 = compare(logits_of(wide, prompts), logits_of(narrow, prompts))
    positions = sum(len(p) for p in prompts)
    print(f"embedded trunk (trained), {n} matrices FP8, {positions} positions of held-out code: "
          f"KL mean {mean:.2e} nats, max {worst:.2e}; top-1 agreement {top1:.4f}")
    from dspark.models.hf import load_target
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "fp8"
        build_fp8(QWEN35_FP8, d)
        base = Path(tmp) / "bf16"
        from tests.models.hf_models import build
        build(QWEN35_FP8.base, base)
        rng = np.random.default_rng(0)
        vocab = QWEN35_FP8.base.config["vocab_size"]
        rand = [rng.integers(0, vocab, args.tokens).astype(np.int32) for _ in range(args.prompts)]
        fp8 = load_target(d, be, progress=False)
        mean, worst, top1 = compare(logits_of(load_target(base, be, progress=False), rand), logits_of(fp8, rand))
        print(f"tiny Qwen3.5 (random, bf16 -> FP8), {len(fp8.source.quantized)} linears FP8, "
              f"{args.prompts * args.tokens} positions: KL mean {mean:.2e} nats, max {worst:.2e}; "
              f"top-1 agreement {top1:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
