"""The default pair's configurations and training hyperparameters, in one place.

Sizes: the shipped f32 weights (trunk + drafter) must stay under 8 MB, and the whole recipe must
train in about an hour on 2 shared CPU cores (~1.5-2k trunk tokens/s). d_model 192 with one
[gdn, gdn, gdn, attn] group is the largest trunk that fits both; head dims are 64, the smallest
the attention kernels take (64, 128 and 256), and the gdn kernels take dk up to 128. The drafter
is one layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models.config import TrunkConfig
from ..models.drafter_config import DrafterConfig

TRUNK = TrunkConfig(d_model=192, mlp_hidden=416, layers=("gdn", "gdn", "gdn", "attn"), attn_heads=4,
                    attn_kv_heads=2, head_dim=64, gdn_heads=2, gdn_dk=64, gdn_dv=64, tap_layers=(1, 3),
                    max_ctx=2048)
DRAFTER = DrafterConfig(block=8, window=64, d_model=192, layers=1, heads=4, kv_heads=2, head_dim=64,
                        mlp_hidden=256, markov_rank=32)


@dataclass(frozen=True)
class TrunkRecipe:
    seq_len: int = 256
    batch: int = 16
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup: int = 60
    weight_decay: float = 0.1
    max_steps: int = 4000
    budget_s: float = 38 * 60      # cosine runs over min(max_steps, this much wall time)
    eval_every: int = 100
    seed: int = 0


@dataclass(frozen=True)
class DrafterRecipe:
    prompts: int = 3072            # corpus prompts continued greedily by the trunk
    prompt_len: int = 128
    new_tokens: int = 192
    anchors: int = 32              # anchor positions per sequence per step
    seqs: int = 16                 # sequences per step
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup: int = 40
    weight_decay: float = 0.05
    slot_decay: float = 0.85       # CE weight of slot k: decay^k (early slots decide acceptance)
    max_steps: int = 6000
    budget_s: float = 15 * 60
    seed: int = 1
