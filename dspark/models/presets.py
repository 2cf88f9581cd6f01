"""Named configurations: small random-weight pairs for tests, the exactness gate and CPU
benchmarks."""

from dataclasses import replace

from .config import TrunkConfig
from .drafter_config import DrafterConfig
from .drafter import DsparkDrafter
from .trunk import HybridTrunk

TINY_TRUNK = TrunkConfig(d_model=64, mlp_hidden=96, layers=("gdn", "attn", "gdn", "attn"), attn_heads=4,
                         attn_kv_heads=2, head_dim=64, gdn_heads=2, gdn_dk=16, gdn_dv=16, tap_layers=(1, 3),
                         max_ctx=256)
# Qwen3.5's conventions on the tiny trunk: 2 value heads per key head, zero-centred norms, q/k
# norms, the attention output gate, partial RoPE with YaRN scaling, tied embeddings.
QWEN35_CONVENTIONS = dict(gdn_heads=4, gdn_k_heads=2, gdn_dv=24, norm_offset=1.0, qk_norm=True, attn_gate=True,
                          rope_fraction=0.25, tie_embeddings=True,
                          rope_scaling=(("factor", 4.0), ("original_max_position_embeddings", 32), ("rope_type", "yarn")))
TINY_DRAFTER = DrafterConfig(block=4, window=16, d_model=64, layers=1, heads=2, kv_heads=1, head_dim=64,
                             mlp_hidden=96, markov_rank=8)


def tiny_pair(be, seed: int = 0, *, harvest: str = "shifted", block: int = 4, **trunk_overrides):
    """A random-weight (trunk, drafter) pair of the tiny configs on backend `be`."""
    trunk = HybridTrunk.random(replace(TINY_TRUNK, **trunk_overrides), seed, be)
    drafter = DsparkDrafter.random(replace(TINY_DRAFTER, harvest=harvest, block=block), trunk, seed + 1)
    return trunk, drafter


def random_drafter(trunk, seed: int = 0, block: int = 8) -> DsparkDrafter:
    """A random-weight DSpark drafter sized to any trunk (one layer, the trunk's d_model): what
    the exactness tests and `dspark demo --model` use when no trained drafter is given. Its
    drafts are rarely accepted, and greedy output stays exactly the trunk's anyway."""
    d = trunk.config.d_model
    head_dim = 64 if d < 1024 else 128
    heads = max(1, min(32, d // head_dim))
    return DsparkDrafter.random(DrafterConfig(block=block, window=64, d_model=d, layers=1, heads=heads, kv_heads=1,
                                              head_dim=head_dim, mlp_hidden=2 * d, markov_rank=32), trunk, seed)
