"""Model configurations, stored as JSON beside the weights."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

MIXERS = ("gdn", "attn")
FFNS = ("mlp", "moe")  # a dense SwiGLU MLP, or a sparse mixture of experts (dspark.models.moe)


ROPE_TYPES = ("default", "linear", "yarn")


def rope_pairs(scaling) -> tuple:
    """A config's rope_scaling as one hashable, sorted tuple of (key, value) pairs (JSON brings a
    dict or a list of [key, value] lists); its rope_type must be one of ROPE_TYPES."""
    if isinstance(scaling, dict) or (scaling and not isinstance(scaling[0], tuple)):
        items = scaling.items() if isinstance(scaling, dict) else (tuple(kv) for kv in scaling)
        scaling = tuple(sorted((str(k), v) for k, v in items))
    rope_type = dict(scaling).get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling rope_type={rope_type!r}: expected one of {ROPE_TYPES}")
    return tuple(scaling)


def extension(default):
    """A field added after the first file format: left out of the JSON while it holds its default
    (to_json), so the files written before it read and write as they were."""
    return field(default=default, metadata={"omit_default": True})


@dataclass(frozen=True)
class TrunkConfig:
    """One model code path, configured by data: the embedded byte-level trunk is the defaults, a
    Hugging Face checkpoint maps its config onto the same fields (dspark.models.hf)."""
    vocab: int = 258                 # byte-level: 256 bytes, EOS, MASK
    eos_id: int = 256                # -1: no end-of-sequence token; more in extra_eos_ids (eos_ids: all)
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
    gdn_heads: int = 2               # value heads: one [dv, dk] state each
    gdn_dk: int = 32
    gdn_dv: int = 32
    conv_kernel: int = 4
    norm_eps: float = 1e-6
    tap_layers: tuple[int, ...] = (1, 3)  # default taps: layer outputs in this order, -1 the embedding (HybridTrunk.forward)
    max_ctx: int = 2048
    kv_dtype: str = "float32"
    # Conventions of other checkpoints, as data. Each default is the embedded trunk's, and a field
    # at its default is left out of the JSON (to_json), so older files stay as they were.
    gdn_k_heads: int = extension(0)         # key heads; 0: one per value head. Value head h reads key head
                                            # h // (gdn_heads / gdn_k_heads) (Qwen3.5: 2 or 3 per key head)
    norm_offset: float = extension(0.0)     # RMSNorm scales by (norm_offset + w): 1.0 for zero-centred
                                            # weights (Qwen3.5); never applied to the gdn output norm
    qk_norm: bool = extension(False)        # RMSNorm over each q and k head before RoPE (Qwen3, Qwen3.5)
    attn_gate: bool = extension(False)      # the q projection also yields a sigmoid output gate per head:
                                            # columns [q_h (head_dim) | gate_h (head_dim)] for each head h
    rope_fraction: float = extension(1.0)   # RoPE rotates the first int(head_dim * fraction) dims of a head
    rope_scaling: tuple = extension(())     # (key, value) pairs: rope_type linear | yarn and its parameters
    tie_embeddings: bool = extension(False)  # LM head = embedding^T (no lm_head tensor)
    extra_eos_ids: tuple[int, ...] = extension(())  # more ids that end a stream, after eos_id (a checkpoint's
                                                    # eos_token_id list: Qwen's <|im_end|> and <|endoftext|>)
    # Mixture-of-experts FFNs (dspark.models.moe): the FFN kind per layer, () meaning every layer "mlp"
    # (its width mlp_hidden); a "moe" layer routes each row to expert_top_k of `experts` SwiGLU experts
    # of width expert_hidden, their weights renormalized over the k with expert_renorm, plus a shared
    # expert of width shared_expert_hidden (0: none) scaled by the sigmoid of its gate.
    ffn: tuple[str, ...] = extension(())
    experts: int = extension(0)
    expert_top_k: int = extension(0)
    expert_hidden: int = extension(0)
    shared_expert_hidden: int = extension(0)
    expert_renorm: bool = extension(False)

    def __post_init__(self):
        bad = [m for m in self.layers if m not in MIXERS]
        if bad:
            raise ValueError(f"layers has {bad[0]!r}: expected each of {MIXERS}")
        if self.attn_heads % self.attn_kv_heads:
            raise ValueError(f"attn_heads={self.attn_heads} must be a multiple of attn_kv_heads={self.attn_kv_heads}")
        if self.conv_kernel != 4:
            raise ValueError(f"conv_kernel={self.conv_kernel}: the gdn kernels implement 4")
        if not self.tap_layers or any(not -1 <= t < len(self.layers) for t in self.tap_layers):
            # the rule HybridTrunk.check_taps applies to the taps of one call
            raise ValueError(f"tap_layers={self.tap_layers}: expected one or more layer indices in "
                             f"[-1, {len(self.layers)}) (-1: the embedding)")
        if not -1 <= self.eos_id < self.vocab:
            raise ValueError(f"eos_id={self.eos_id}: expected a token id in [0, {self.vocab}) or -1 (none)")
        extra = self.extra_eos_ids
        if extra and self.eos_id < 0:
            raise ValueError(f"extra_eos_ids={extra} with eos_id=-1: the first end-of-sequence id goes in eos_id")
        if any(not 0 <= t < self.vocab for t in extra) or len({self.eos_id, *extra}) != 1 + len(extra):
            raise ValueError(f"extra_eos_ids={extra}: expected distinct token ids in [0, {self.vocab}), "
                             f"none equal to eos_id={self.eos_id}")
        if self.gdn_k_heads < 0 or self.gdn_heads % self.gdn_key_heads:
            raise ValueError(f"gdn_heads={self.gdn_heads} must be a multiple of gdn_k_heads={self.gdn_k_heads}")
        if not (0 < self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0):
            raise ValueError(f"rope_fraction={self.rope_fraction} with head_dim={self.head_dim} rotates "
                             f"{self.rope_dim} dims: expected an even count in [2, {self.head_dim}]")
        object.__setattr__(self, "rope_scaling", rope_pairs(self.rope_scaling))
        if self.ffn and (len(self.ffn) != len(self.layers) or any(f not in FFNS for f in self.ffn)):
            raise ValueError(f"ffn={self.ffn}: expected one of {FFNS} for each of the {len(self.layers)} layers")
        if "moe" in self.ffn_kinds:
            if self.experts < 1 or not 1 <= self.expert_top_k <= self.experts:
                raise ValueError(f"experts={self.experts}, expert_top_k={self.expert_top_k}: expected 1 <= "
                                 f"expert_top_k <= experts")
            if self.expert_hidden < 1 or self.shared_expert_hidden < 0:
                raise ValueError(f"expert_hidden={self.expert_hidden}, shared_expert_hidden="
                                 f"{self.shared_expert_hidden}: expected >= 1 and >= 0")

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a stream: eos_id, then extra_eos_ids; () when there is none."""
        return () if self.eos_id < 0 else (self.eos_id, *self.extra_eos_ids)

    @property
    def ffn_kinds(self) -> tuple[str, ...]:
        """The FFN kind of every layer (FFNS)."""
        return self.ffn or ("mlp",) * len(self.layers)

    @property
    def gdn_key_heads(self) -> int:
        return self.gdn_k_heads or self.gdn_heads

    @property
    def gdn_channels(self) -> int:
        return 2 * self.gdn_key_heads * self.gdn_dk + self.gdn_heads * self.gdn_dv

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.rope_fraction)

    @property
    def rope_params(self) -> dict:
        return dict(self.rope_scaling)


def to_json(cfg) -> str:
    """Every field, except those marked omit_default while they hold their default."""
    skip = {f.name for f in fields(cfg) if f.metadata.get("omit_default") and getattr(cfg, f.name) == f.default}
    return json.dumps({"kind": type(cfg).__name__, **{k: v for k, v in asdict(cfg).items() if k not in skip}},
                      indent=1)


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
