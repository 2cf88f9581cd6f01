"""Mixture-of-experts config.json files onto the trunk's fields (dspark.models.hf.moe), as
transformers reads them: which layers are sparse, whether the top-k is renormalized, the shared
expert; the refusals name the key. Config only: no checkpoint, no torch."""

import pytest

from dspark.models.hf import CheckpointError
from dspark.models.hf.target import config_of

QWEN3_MOE = dict(model_type="qwen3_moe", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_local_experts=16, num_experts_per_tok=4,
                 moe_intermediate_size=32)
QWEN3_5_MOE = dict(model_type="qwen3_5_moe_text", vocab_size=300, hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_experts=16, num_experts_per_tok=4,
                   moe_intermediate_size=32, shared_expert_intermediate_size=48,
                   layer_types=["linear_attention", "full_attention"])


def test_qwen3_moe_sparse_layers_and_renormalization():
    c = config_of(QWEN3_MOE)
    assert (c.ffn_kinds, c.experts, c.expert_top_k, c.expert_hidden) == (("moe",) * 4, 16, 4, 32)
    assert (c.expert_renorm, c.shared_expert_hidden, c.mlp_hidden, c.norm_offset) == (False, 0, 96, 0.0)
    assert config_of({**QWEN3_MOE, "norm_topk_prob": True}).expert_renorm
    assert config_of({**QWEN3_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [1]}).ffn_kinds == \
        ("mlp", "mlp", "mlp", "moe")
    assert config_of({**QWEN3_MOE, "num_local_experts": 0}).ffn_kinds == ("mlp",) * 4  # transformers: all dense
    assert config_of({**QWEN3_MOE, "num_experts": 8, "num_local_experts": 8}).experts == 8  # either key


def test_qwen3_5_moe_every_layer_sparse_always_renormalized():
    for config in (QWEN3_5_MOE, {**QWEN3_5_MOE, "norm_topk_prob": False},
                   {"model_type": "qwen3_5_moe", "text_config": {**QWEN3_5_MOE, "model_type": "qwen3_5_moe_text"}}):
        c = config_of(config)
        assert (c.ffn_kinds, c.expert_renorm, c.shared_expert_hidden) == (("moe", "moe"), True, 48)
        assert (c.layers, c.norm_offset, c.attn_gate) == (("gdn", "attn"), 1.0, True)


@pytest.mark.parametrize("changes,match", [
    ({"num_experts_per_tok": 0}, r"config num_experts_per_tok=0: expected 1 to num_local_experts=16"),
    ({"num_local_experts": 600}, r"config num_local_experts=600: expected 1 to 512"),
    ({"num_experts_per_tok": 33, "num_local_experts": 64}, r"num_experts_per_tok=33: expected 1 to "
                                                           r"num_local_experts=64 \(and at most 32"),
    ({"mlp_only_layers": [-1]}, r"config mlp_only_layers has -1: expected layer indices in \[0, 4\)"),
    ({"moe_intermediate_size": 0}, r"config moe_intermediate_size=0: expected >= 1"),
], ids=["top-k", "experts", "top-k-kernel", "mlp-only", "width"])
def test_refusals_name_the_key(changes, match):
    with pytest.raises(CheckpointError, match=match):
        config_of({**QWEN3_MOE, **changes})
