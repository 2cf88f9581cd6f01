"""The drafter's configuration and its weight table: one block drafter, configured by the
checkpoint (the embedded drafter, DeepSpec DSpark, z-lab DFlash / DFlash2, speculators).

The first fields are the embedded drafter's; the rest say how a released checkpoint differs from
it, with defaults that keep the embedded layout (to_json leaves them out at their defaults, so the
shipped drafter.json reads as before). dspark.models.drafter says what each one computes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import extension, rope_pairs

MARKOV_HEADS = ("none", "vanilla", "gated", "rnn", "selector")
CONFIDENCE_HEADS = ("none", "hidden", "markov")
HARVESTS = ("shifted", "mask_fill")
WINDOW_MODES = ("anchor", "row")     # dspark.ops.attention: from the anchor (all rows), or per row
INT_TENSORS = ("draft_to_target",)   # every other tensor is f32


@dataclass(frozen=True)
class DrafterConfig:
    block: int = 8                   # b: rows per drafter pass
    window: int = 64                 # committed rows of draft KV each block row sees (0: all of them)
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
    # ---- how released checkpoints differ ----------------------------------------------------
    taps: tuple[int, ...] = extension(())      # target layer ids (tap t: output of layer t; -1: the
                                               # embedding); (): the trunk's tap_layers
    layer_windows: tuple[int, ...] = extension(())  # per-layer window (0: all rows); (): `window` each
    window_mode: str = extension("anchor")     # a window's rows: the last `window` before the anchor, for every
                                               # block row (speculators), or |row - key| < window per row (dflash)
    rope_scaling: tuple = extension(())        # (key, value) pairs: rope_type linear | yarn and its parameters
                                               # (dspark.ops.dense.rope_frequencies), as TrunkConfig's
    q_norm: bool = extension(False)            # RMSNorm on each query head (Qwen3 layers)
    markov: str = extension("vanilla")         # none | vanilla | gated | rnn | selector (DFlash2)
    confidence: str = extension("markov")      # none | hidden: w.h_k | markov: w.[h_k ; W1[x_{k-1}]]
    draft_vocab: int = extension(0)            # rows of a reduced draft vocabulary (0: the target's)
    mask_id: int = extension(-1)               # block filler token (-1: the trunk's mask_id)
    own_embed: bool = extension(False)         # the checkpoint's own embedding, LM head and final
    own_head: bool = extension(False)          # norm; otherwise the trunk's
    own_norm: bool = extension(False)
    embed_scale: float = extension(1.0)        # block embeddings times this (DFlash)
    logit_scale: float = extension(1.0)        # logits times this, then
    logit_softcap: float = extension(0.0)      # cap * tanh(logits / cap) when > 0 (DFlash)
    conv_kernel: int = extension(0)            # DFlash2 grouped dynamic convolutions: taps (0: none)
    conv_group: int = extension(0)             # channels sharing one dynamic kernel
    selector_rank: int = extension(0)          # DFlash2 candidate selector (markov="selector")
    selector_top_k: int = extension(0)

    def __post_init__(self):
        def bad(name, want):
            raise ValueError(f"DrafterConfig.{name}={getattr(self, name)!r}: expected {want}")
        if self.harvest not in HARVESTS:
            raise ValueError(f"harvest={self.harvest!r}: expected 'shifted' or 'mask_fill'")
        if self.block < 2:
            raise ValueError(f"block={self.block}: expected at least 2")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.window < 0 or any(w < 0 for w in self.layer_windows):
            bad("window" if self.window < 0 else "layer_windows", "rows >= 0 (0: every committed row)")
        if self.layer_windows and len(self.layer_windows) != self.layers:
            bad("layer_windows", f"one window per layer ({self.layers})")
        if self.window_mode not in WINDOW_MODES:
            bad("window_mode", f"one of {WINDOW_MODES}")
        object.__setattr__(self, "rope_scaling", rope_pairs(self.rope_scaling))
        if self.markov not in MARKOV_HEADS:
            bad("markov", f"one of {MARKOV_HEADS}")
        if self.confidence not in CONFIDENCE_HEADS:
            bad("confidence", f"one of {CONFIDENCE_HEADS}")
        if (self.markov in ("none", "selector")) != (self.markov_rank == 0):
            bad("markov_rank", "0 exactly when markov is 'none' or 'selector'")
        if self.confidence == "markov" and self.markov_rank == 0:
            bad("confidence", "'none' or 'hidden' without a Markov head (its W1 feeds the confidence)")
        if (self.markov == "selector") != (self.selector_rank > 0 and self.selector_top_k > 0):
            bad("selector_rank", "selector_rank and selector_top_k > 0 exactly when markov is 'selector'")
        if (self.conv_kernel > 0) != (self.conv_group > 0):
            bad("conv_group", "conv_kernel and conv_group both > 0 (DFlash2) or both 0")
        if self.conv_kernel and (self.d_model % self.conv_group or self.conv_kernel > self.block):
            bad("conv_group", f"a divisor of d_model={self.d_model}, with conv_kernel <= block")
        if self.logit_softcap < 0 or self.draft_vocab < 0:
            bad("logit_softcap" if self.logit_softcap < 0 else "draft_vocab", ">= 0")
        if self.draft_vocab and not self.own_head:
            bad("own_head", "True with a draft vocabulary (the trunk's LM head covers the whole vocabulary)")

    @property
    def drafts(self) -> int:
        """Draft tokens per pass: b when every row is a draft, b-1 in mask-fill."""
        return self.block if self.harvest == "shifted" else self.block - 1

    def windows(self) -> tuple[int, ...]:
        """The window of each layer (0: every committed row)."""
        return self.layer_windows or (self.window,) * self.layers


def drafter_spec(c: DrafterConfig, t) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every drafter tensor, for drafter config c and trunk config t. Matrices are
    [in, out] (y = x @ W). draft_to_target (int32) maps draft-vocabulary rows to target ids."""
    d, F, r = c.d_model, c.mlp_hidden, c.markov_rank
    V = t.vocab
    Vd = c.draft_vocab or V
    taps = c.taps or t.tap_layers
    spec = {"fc": (len(taps) * t.d_model, d), "fc_norm": (d,)}
    for i in range(c.layers):
        p = f"layers.{i}."
        spec[p + "norm1"] = (d,)
        spec[p + "norm2"] = (d,)
        spec[p + "attn.wq"] = (d, c.heads * c.head_dim)
        spec[p + "attn.wk"] = (d, c.kv_heads * c.head_dim)
        spec[p + "attn.wv"] = (d, c.kv_heads * c.head_dim)
        if c.q_norm:
            spec[p + "attn.q_norm"] = (c.head_dim,)
        spec[p + "attn.k_norm"] = (c.head_dim,)
        spec[p + "attn.wo"] = (c.heads * c.head_dim, d)
        spec[p + "mlp.w_gate"] = (d, F)
        spec[p + "mlp.w_up"] = (d, F)
        spec[p + "mlp.w_down"] = (F, d)
        if c.conv_kernel:
            for conv in ("attn_conv", "mlp_conv"):
                spec[f"{p}{conv}.base"] = (2, c.conv_kernel, d)
                spec[f"{p}{conv}.proj"] = (d, 2 * c.conv_kernel * (d // c.conv_group))
    if c.own_embed:
        spec["embed"] = (V, d)
    if c.own_norm:
        spec["final_norm"] = (d,)
    if c.own_head:
        spec["lm_head"] = (d, Vd)
    if c.draft_vocab:
        spec["draft_to_target"] = (Vd,)
    if r:
        spec["markov.w1"] = (V, r)
        spec["markov.w2"] = (r, Vd)
    if c.markov == "gated":
        spec["markov.gate_w"] = (d + r, r)
        spec["markov.gate_b"] = (r,)
    elif c.markov == "rnn":
        spec["markov.rnn_w"] = (2 * r + d, 3 * r)
        spec["markov.rnn_b"] = (3 * r,)
    elif c.markov == "selector":
        spec["selector.pred"] = (V, c.selector_rank)
        spec["selector.succ"] = (V, c.selector_rank)
        spec["selector.hidden"] = (d, c.selector_rank)
    if c.confidence != "none":
        spec["conf.w"] = (d + (r if c.confidence == "markov" else 0),)
        spec["conf.b"] = (1,)
    return spec
