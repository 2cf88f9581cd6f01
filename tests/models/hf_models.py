"""Tiny random Qwen3 and Qwen3.5 models, dense and mixture-of-experts, built and saved by
transformers itself: the oracle of the Hugging Face target tests.

Each case is a transformers config plus how it is saved (dtype, shards, tied embeddings). The
weights are redrawn at unit scale (transformers' 0.02 init gives logits so flat that greedy
would ride on ties), and every norm weight is drawn away from its neutral value, so that a
forgotten zero-centring, a norm on the wrong tensor or a norm left out all change the logits.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import numpy as np

from tests.peers import peer


def require_transformers():
    """(torch, transformers); a skip outside CI, a failure under CI=true (the oracle must run)."""
    return peer("torch"), peer("transformers")


@dataclass(frozen=True)
class Case:
    name: str
    family: str                      # qwen3 | qwen3_5_text | qwen3_5 (with a vision tower) | qwen3_moe |
                                     # qwen3_5_moe_text | qwen3_5_moe (with a vision tower)
    config: dict = field(hash=False)
    dtype: str = "float32"           # dtype of the saved tensors
    shard: int | None = None         # save_pretrained(max_shard_size=...) in bytes
    seed: int = 0
    tied: bool = False               # tie_word_embeddings (qwen3_5: on the composite config only, the
                                     # flag transformers ties by; its text_config keeps False)
    fused: bool = False              # MoE: the fused 3-D expert tensors (save_original_format=False)

    def __repr__(self):
        return self.name


GDN_ATTN = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
              num_position_embeddings=16)

QWEN3 = [
    # GQA 2, untied, f32, one file
    Case("qwen3-gqa2", "qwen3", dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64)),
    # GQA 4, tied, yarn RoPE scaling (the ramp lands inside the rotated dims), sharded
    Case("qwen3-gqa4-tied-yarn-sharded", "qwen3", dict(
        vocab_size=400, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64)),
        shard=60_000, seed=1, tied=True),
    # GQA 2 at head_dim 128, bf16 weights, rope theta 1e6, an EOS id
    Case("qwen3-d128-bf16", "qwen3", dict(vocab_size=300, hidden_size=128, intermediate_size=160,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=128, rope_parameters=dict(rope_type="default", rope_theta=1e6),
                                         eos_token_id=7), dtype="bfloat16", seed=2),
]
QWEN35 = [
    # 2 value heads per key head, dv != dk, untied, f32
    Case("qwen3_5-v2k-untied", "qwen3_5_text", dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=32, layer_types=GDN_ATTN), seed=3),
    # the multimodal checkpoint (vision tower skipped), 3 value heads per key head, tied, sharded
    Case("qwen3_5-vision-v3k-tied-sharded", "qwen3_5", dict(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=128, linear_num_key_heads=1, linear_num_value_heads=3,
        linear_key_head_dim=32, linear_value_head_dim=16,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"]),
        shard=50_000, seed=4, tied=True),
    # one value head per key head, bf16, partial RoPE 0.5, GQA 4
    Case("qwen3_5-v1k-bf16", "qwen3_5_text", dict(
        vocab_size=280, hidden_size=128, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=64, linear_value_head_dim=64, partial_rotary_factor=0.5,
        rope_parameters=dict(rope_type="default", rope_theta=100000.0, partial_rotary_factor=0.5),
        layer_types=["linear_attention", "full_attention", "linear_attention"]), dtype="bfloat16", seed=5),
]
CASES = QWEN3 + QWEN35
# Qwen3.8-27B's structure scaled down (its text config: 64 layers, [linear_attention x 3,
# full_attention] x 16; 24 query / 4 kv heads of 256, partial RoPE 0.25 with mrope sections
# 11/11/10 of its 32 frequencies, theta 1e7; gdn 16 key / 48 value heads of 128): the target of the
# seed's drafters (tests/models/test_seed_pair.py).
QWEN3_8_SHAPE = dict(num_attention_heads=6, num_key_value_heads=1, head_dim=256, linear_num_key_heads=2,
                     linear_num_value_heads=6, linear_key_head_dim=32, linear_value_head_dim=32,
                     rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                          mrope_section=[11, 11, 10], mrope_interleaved=True))
QWEN3_8 = Case("qwen3_8-tiny", "qwen3_5_text", dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, max_position_embeddings=512,
    layer_types=["linear_attention"] * 3 + ["full_attention"], **QWEN3_8_SHAPE), seed=6)


def model_class(transformers, family: str):
    return {"qwen3": transformers.Qwen3ForCausalLM, "qwen3_5_text": transformers.Qwen3_5ForCausalLM,
            "qwen3_5": transformers.Qwen3_5ForConditionalGeneration, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
            "qwen3_5_moe_text": transformers.Qwen3_5MoeForCausalLM,
            "qwen3_5_moe": transformers.Qwen3_5MoeForConditionalGeneration}[family]


def hf_config(transformers, case: Case):
    flat = {"qwen3": transformers.Qwen3Config, "qwen3_5_text": transformers.Qwen3_5TextConfig,
            "qwen3_moe": transformers.Qwen3MoeConfig, "qwen3_5_moe_text": transformers.Qwen3_5MoeTextConfig}
    if case.family in flat:
        return flat[case.family](**copy.deepcopy(case.config), tie_word_embeddings=case.tied)
    composite = transformers.Qwen3_5Config if case.family == "qwen3_5" else transformers.Qwen3_5MoeConfig
    return composite(text_config=case.config, vision_config=VISION, tie_word_embeddings=case.tied)


def zero_centred(family: str) -> bool:
    """Qwen3.5's RMSNorms scale by 1 + w; Qwen3's by w."""
    return family not in ("qwen3", "qwen3_moe")


def redraw(torch, model, zero_centred: bool) -> None:
    """Unit-scale weights; norms away from neutral (Qwen3.5's RMSNorm scales by 1 + w, its gdn
    output norm and every Qwen3 norm by w)."""
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * math.log(16.0))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                plain = not zero_centred or "linear_attn.norm" in name
                p.copy_((1.0 if plain else 0.0) + 0.3 * torch.randn(p.shape, generator=g))


def build(case: Case, directory) -> None:
    """Save the case's model with transformers' save_pretrained into `directory`."""
    torch, transformers = require_transformers()
    torch.manual_seed(case.seed)
    model = model_class(transformers, case.family)(hf_config(transformers, case))
    redraw(torch, model, zero_centred(case.family))
    model = model.to(getattr(torch, case.dtype)).eval()
    kw = {"max_shard_size": case.shard} if case.shard else {}
    model.save_pretrained(directory, **kw, **({"save_original_format": False} if case.fused else {}))


def reference(case: Case, directory):
    """transformers' model read back from the saved directory, computing in f32."""
    torch, transformers = require_transformers()
    return model_class(transformers, case.family).from_pretrained(directory, dtype=torch.float32).eval()


def hf_logits(model, prompt, steps) -> list[np.ndarray]:
    """[prefill logits [T, V]] + one [V] per decode step, through transformers' own cache."""
    import torch
    with torch.no_grad():
        out = model(torch.tensor(np.asarray(prompt)[None]), use_cache=True)
        logits, cache = [out.logits[0].numpy()], out.past_key_values
        for tok in steps:
            out = model(torch.tensor([[int(tok)]]), past_key_values=cache, use_cache=True)
            logits.append(out.logits[0, -1].numpy())
            cache = out.past_key_values
    return logits


def hf_greedy(model, prompt, n) -> list[int]:
    import torch
    with torch.no_grad():
        out = model.generate(torch.tensor(np.asarray(prompt)[None]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def assert_logits_close(got, want, what):
    """Within 1e-4 of the largest |logit|."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = float(np.abs(want).max())
    err = float(np.abs(got - want).max())
    assert err <= 1e-4 * scale, f"{what}: max |diff| {err:.3g} > 1e-4 x max |logit| {scale:.3g}"


def save_tokenizer(d, texts) -> None:
    """A byte-level BPE tokenizer.json of 300 ids (<|endoftext|> the special one) trained on `texts`
    and a little code, saved into `d` by transformers."""
    _, transformers = require_transformers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts) * 20 + ["import os\nimport sys\n"] * 20, trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(d)

# Mixture-of-experts targets: 16 experts, top-4, both model types in both expert layouts (per expert,
# save_pretrained's default; fused 3-D, save_original_format=False).
MOE_SHAPE = dict(vocab_size=300, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                 num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32)
QWEN3_MOE = [
    # renormalized top-k, a dense layer among the sparse ones (mlp_only_layers), per-expert tensors
    Case("qwen3_moe-renorm-mlp-only", "qwen3_moe", dict(MOE_SHAPE, num_hidden_layers=3, intermediate_size=96,
                                                        norm_topk_prob=True, mlp_only_layers=[1]), seed=20),
    # plain top-k probabilities (norm_topk_prob False), every other layer sparse, fused tensors, bf16
    Case("qwen3_moe-sparse-step-fused-bf16", "qwen3_moe", dict(MOE_SHAPE, num_hidden_layers=4, intermediate_size=80,
                                                               norm_topk_prob=False, decoder_sparse_step=2),
         dtype="bfloat16", seed=21, fused=True),
]
QWEN35_MOE = [
    # every layer sparse with its gated shared expert, fused tensors
    Case("qwen3_5_moe-text-fused", "qwen3_5_moe_text", dict(
        MOE_SHAPE, num_hidden_layers=4, shared_expert_intermediate_size=48, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, layer_types=GDN_ATTN),
        seed=22, fused=True),
    # the multimodal checkpoint (vision tower skipped), per-expert tensors, bf16
    Case("qwen3_5_moe-vision-bf16", "qwen3_5_moe", dict(
        MOE_SHAPE, num_hidden_layers=3, shared_expert_intermediate_size=40, linear_num_key_heads=1,
        linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
        layer_types=["linear_attention", "linear_attention", "full_attention"]), dtype="bfloat16", seed=23),
]
MOE_CASES = QWEN3_MOE + QWEN35_MOE
