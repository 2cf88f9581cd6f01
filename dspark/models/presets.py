"""Named configurations: small random-weight pairs for tests, the exactness gate and CPU
benchmarks."""

from dataclasses import replace

from .config import DrafterConfig, TrunkConfig
from .drafter import DsparkDrafter
from .trunk import HybridTrunk

TINY_TRUNK = TrunkConfig(d_model=64, mlp_hidden=96, layers=("gdn", "attn", "gdn", "attn"), attn_heads=4,
                         attn_kv_heads=2, head_dim=64, gdn_heads=2, gdn_dk=16, gdn_dv=16, tap_layers=(1, 3),
                         max_ctx=256)
TINY_DRAFTER = DrafterConfig(block=4, window=16, d_model=64, layers=1, heads=2, kv_heads=1, head_dim=64,
                             mlp_hidden=96, markov_rank=8)


def tiny_pair(be, seed: int = 0, *, harvest: str = "shifted", block: int = 4, **trunk_overrides):
    """A random-weight (trunk, drafter) pair of the tiny configs on backend `be`."""
    trunk = HybridTrunk.random(replace(TINY_TRUNK, **trunk_overrides), seed, be)
    drafter = DsparkDrafter.random(replace(TINY_DRAFTER, harvest=harvest, block=block), trunk, seed + 1)
    return trunk, drafter
