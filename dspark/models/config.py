"""Model configurations, stored as JSON beside the weights."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

MIXERS = ("gdn", "attn")


@dataclass(frozen=True)
class TrunkConfig:
    vocab: int = 258                 # byte-level: 256 bytes, EOS, MASK
    eos_id: int = 256
    mask_id: int = 257
    d_model: int = 128
    mlp_hidden: int = 256
    layers: tuple[str, ...] = ("gdn", "gdn", "gdn", "attn")
    # full attention
    attn_heads: int = 4
    attn_kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 10000.0
    # gated delta net
    gdn_heads: int = 2
    gdn_dk: int = 32
    gdn_dv: int = 32
    conv_kernel: int = 4
    norm_eps: float = 1e-6
    tap_layers: tuple[int, ...] = (1, 3)  # layer outputs the drafter reads
    max_ctx: int = 2048
    kv_dtype: str = "float32"

    def __post_init__(self):
        bad = [m for m in self.layers if m not in MIXERS]
        if bad:
            raise ValueError(f"layers has {bad[0]!r}: expected each of {MIXERS}")
        if self.attn_heads % self.attn_kv_heads:
            raise ValueError(f"attn_heads={self.attn_heads} must be a multiple of attn_kv_heads={self.attn_kv_heads}")
        if self.conv_kernel != 4:
            raise ValueError(f"conv_kernel={self.conv_kernel}: the gdn kernels implement 4")
        if not self.tap_layers or any(not 0 <= t < len(self.layers) for t in self.tap_layers):
            raise ValueError(f"tap_layers={self.tap_layers}: expected layer indices in [0, {len(self.layers)})")

    @property
    def gdn_channels(self) -> int:
        return self.gdn_heads * (2 * self.gdn_dk + self.gdn_dv)


@dataclass(frozen=True)
class DrafterConfig:
    block: int = 8                   # b: rows per drafter pass
    window: int = 64                 # committed rows of draft KV each block row sees
    d_model: int = 128               # must equal the trunk's (shared embedding and LM head)
    layers: int = 1
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    mlp_hidden: int = 256
    markov_rank: int = 32
    harvest: str = "shifted"         # DSpark: every row is a draft; "mask_fill": rows 1..b-1 (DFlash)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self):
        if self.harvest not in ("shifted", "mask_fill"):
            raise ValueError(f"harvest={self.harvest!r}: expected 'shifted' or 'mask_fill'")
        if self.block < 2:
            raise ValueError(f"block={self.block}: expected at least 2")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")

    @property
    def drafts(self) -> int:
        """Draft tokens per pass: b when every row is a draft, b-1 in mask-fill."""
        return self.block if self.harvest == "shifted" else self.block - 1

    @property
    def ring(self) -> int:
        """Draft-KV ring capacity: the window plus one block of newly committed rows."""
        return self.window + self.block


def to_json(cfg) -> str:
    return json.dumps({"kind": type(cfg).__name__, **asdict(cfg)}, indent=1)


def from_json(text_or_path, kind):
    raw = json.loads(Path(text_or_path).read_text() if isinstance(text_or_path, Path) else text_or_path)
    name = raw.pop("kind", kind.__name__)
    if name != kind.__name__:
        raise ValueError(f"config is a {name}, expected a {kind.__name__}")
    known = {f.name for f in fields(kind)}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"{kind.__name__} has no field(s) {sorted(unknown)}")
    for k, v in raw.items():
        if isinstance(v, list):
            raw[k] = tuple(v)
    return kind(**raw)
