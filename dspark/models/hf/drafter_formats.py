"""The released block-drafter formats, each a mapping of config keys and tensor names onto
DrafterConfig and dspark's drafter weights (dspark.models.drafter says what they compute).

* DeepSpec DSpark (`architectures: ["Qwen3DSparkModel"]`, and `Qwen3_6DSparkModel` /
  `Qwen3_8DSparkModel` for the Qwen3.5-architecture targets): the target's config plus block_size,
  mask_token_id, target_layer_ids (tap = hidden_states[id + 1]; -1 is the embedding),
  num_target_layers, markov_rank / markov_head_type, enable_confidence_head /
  confidence_head_with_markov. Own embed_tokens, lm_head (copies of the target's) and norm. Every
  block row is a draft (row k predicts pos+k+1). The Qwen3.6 / Qwen3.8 drafts are Qwen3 full-attention
  layers (q/k norm, no output gate, RoPE over the whole head) in a `qwen3_5_text` config copied from
  the target (deepspec/modeling/dspark/qwen3_6, qwen3_8): the keys only the target reads
  (TARGET_ONLY: its gdn layers, mtp head, mrope sections, partial RoPE) are ignored by rule and
  listed in `Plan.ignored_keys`; everything a Qwen3 layer reads is honoured or refused.
* z-lab DFlash (`model_type: qwen3` with `dflash_config`): target_layer_ids (hidden_states[id + 1]),
  mask_token_id, block_size (dflash_config or top level), num_target_layers; no embedding or LM
  head (the target's), own norm; rows 1..b-1 are the drafts (mask fill); optional
  input_embedding_scale, output_multiplier, final_logit_softcapping. DFlash2 adds grouped dynamic
  convolutions (conv_kernel_size, conv_group_size) and a candidate selector (selector_rank,
  selector_top_k). A sliding_attention layer with `is_causal: false` (DeepSpec's DFlash2 for
  Qwen3.8: every layer, sliding_window 2048) sees the keys within the window of each block row's
  own position, both ways (dflash.model._attention_mask); with is_causal unset it is causal
  (refused). A trimmed draft vocabulary (draft_vocab_size below vocab_size, in dflash_config or
  at the top level) brings its own lm_head rows and d2t (target id = j + d2t[j], EAGLE-3's and
  speculators' convention; an optional t2d is checked against it); the selector's codebooks stay
  over the target vocabulary, its candidates mapped through d2t.
* speculators (`speculators_model_type` dflash / dspark / dflash2): transformer_layer_config holds
  the Qwen3 layer config; aux_hidden_state_layer_ids index hidden_states directly (vLLM collects
  the stream entering layer id), so tap = id - 1; sample_from_anchor picks the harvest (dspark
  default True, dflash False); a draft vocabulary (draft_vocab_size < the target's) brings its own
  lm_head rows and d2t (target id = j + d2t[j]) / t2d maps; embed_tokens comes from the target.

Torch Linear weights are [out, in]; ours are [in, out] ("T" below).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import CheckpointError
from ..drafter_config import DrafterConfig
from .target import rope_of

QWEN3_LAYER = {   # ours (per layer "layers.{i}.") <- checkpoint, transform
    "norm1": ("layers.{i}.input_layernorm.weight", ""),
    "norm2": ("layers.{i}.post_attention_layernorm.weight", ""),
    "attn.wq": ("layers.{i}.self_attn.q_proj.weight", "T"),
    "attn.wk": ("layers.{i}.self_attn.k_proj.weight", "T"),
    "attn.wv": ("layers.{i}.self_attn.v_proj.weight", "T"),
    "attn.wo": ("layers.{i}.self_attn.o_proj.weight", "T"),
    "attn.q_norm": ("layers.{i}.self_attn.q_norm.weight", ""),
    "attn.k_norm": ("layers.{i}.self_attn.k_norm.weight", ""),
    "mlp.w_gate": ("layers.{i}.mlp.gate_proj.weight", "T"),
    "mlp.w_up": ("layers.{i}.mlp.up_proj.weight", "T"),
    "mlp.w_down": ("layers.{i}.mlp.down_proj.weight", "T"),
    "attn_conv.base": ("layers.{i}.attention_conv.base_kernel", ""),
    "attn_conv.proj": ("layers.{i}.attention_conv.kernel_projection.weight", "T"),
    "mlp_conv.base": ("layers.{i}.mlp_conv.base_kernel", ""),
    "mlp_conv.proj": ("layers.{i}.mlp_conv.kernel_projection.weight", "T"),
}
GLOBAL = {        # ours <- checkpoint, transform ("row": a [1, n] Linear weight as [n])
    "fc": ("fc.weight", "T"),
    "fc_norm": ("hidden_norm.weight", ""),
    "final_norm": ("norm.weight", ""),
    "embed": ("embed_tokens.weight", ""),
    "lm_head": ("lm_head.weight", "T"),
    "draft_to_target": ("d2t", "offsets"),
    "markov.w1": ("markov_head.markov_w1.weight", ""),
    "markov.w2": ("markov_head.markov_w2.weight", "T"),
    "markov.gate_w": ("markov_head.gate_proj.weight", "T"),
    "markov.gate_b": ("markov_head.gate_proj.bias", ""),
    "markov.rnn_w": ("markov_head.joint_proj.weight", "T"),
    "markov.rnn_b": ("markov_head.joint_proj.bias", ""),
    "conf.w": ("confidence_head.proj.weight", "row"),
    "conf.b": ("confidence_head.proj.bias", ""),
    "selector.pred": ("candidate_selector.predecessor_codebook", ""),
    "selector.succ": ("candidate_selector.successor_codebook", ""),
    "selector.hidden": ("candidate_selector.hidden_projection.weight", "T"),
}
# The config field that asks for each of our tensors (named in the error when one is missing).
ASKED_BY = {"markov.": "markov_rank / markov_head_type", "conf.": "enable_confidence_head / "
            "confidence_head_with_markov", "selector.": "selector_rank", "attn_conv.": "conv_kernel_size",
            "mlp_conv.": "conv_kernel_size", "lm_head": "draft_vocab_size", "draft_to_target": "draft_vocab_size",
            "fc": "target_layer_ids", "attn.q_norm": "(Qwen3 layers have q_norm)"}


@dataclass
class Plan:
    """What a checkpoint's config says, in our terms, plus what the loader checks against the target."""
    format: str
    config: DrafterConfig
    vocab_size: int                      # the drafter's (target) vocabulary
    num_target_layers: int | None        # None where the format does not record it
    tap_field: str                       # the config key the taps came from, and how they map
    tap_ids: tuple[int, ...]             # as written in the checkpoint
    from_target: tuple[str, ...] = ()    # our tensors the format takes from the target, not the file
    ignored: tuple[str, ...] = ()        # checkpoint tensors that are known and unused at inference
    aliases: dict[str, str] = field(default_factory=dict)   # stored name -> the table's name
    ignored_keys: tuple[str, ...] = ()   # config keys only the target reads, ignored by rule (TARGET_ONLY)
    architecture: str = ""               # the config's architectures entry, as written

    def source(self, ours: str) -> tuple[str, str]:
        """(checkpoint name, transform) of one of our tensors."""
        if ours.startswith("layers."):
            _, i, leaf = ours.split(".", 2)
            name, how = QWEN3_LAYER[leaf]
            return name.format(i=i), how
        return GLOBAL[ours]

    def asked_by(self, ours: str) -> str:
        leaf = ours.split(".", 2)[2] if ours.startswith("layers.") else ours
        return next((f for p, f in ASKED_BY.items() if leaf.startswith(p)), "the layer config")


DEEPSPEC_ARCHS = {"Qwen3DSparkModel": ("qwen3",), "Qwen3_6DSparkModel": ("qwen3_5_text",),
                  "Qwen3_8DSparkModel": ("qwen3_5_text",)}   # architecture -> the model_type of its config
# Keys of a Qwen3.5 text config that only the target reads (DeepSpec's Qwen3.6 / Qwen3.8 DSpark
# configs are the target's text config, copied): its gdn layers, its multi-token-prediction head,
# its layer pattern and output gate, its multimodal RoPE sections (top level or in
# rope_parameters). partial_rotary_factor is the target's too where the RoPE is the default one:
# Qwen3's default RoPE rotates the whole head whatever it says; a scaled RoPE reads it.
TARGET_ONLY = ("linear_", "mtp_", "full_attention_interval", "attn_output_gate", "mrope_")
# DeepSpec's own notes in those configs, checked where present: the draft it describes.
DEEPSPEC_NOTES = {"deepspec_draft_architecture": "qwen3_full_attention", "deepspec_draft_rope": "full_head"}


def detect(raw: dict) -> str:
    """The format of a config.json: 'deepspec', 'dflash' or 'speculators'."""
    archs = raw.get("architectures") or []
    if "speculators_model_type" in raw:
        return "speculators"
    if any(a in DEEPSPEC_ARCHS for a in archs):
        return "deepspec"
    if "dflash_config" in raw or any(a in ("DFlashDraftModel", "DFlash2DraftModel") for a in archs):
        return "dflash"
    if any(a.endswith("DSparkModel") for a in archs):
        raise CheckpointError(f"architectures={archs}: dspark serves DeepSpec's {', '.join(DEEPSPEC_ARCHS)} drafters")
    raise CheckpointError(f"config.json: not a block drafter dspark knows (architectures={archs}; expected "
                          f"Qwen3DSparkModel, a dflash_config, or speculators_model_type)")


def get(raw: dict, key: str, where: str = "", default=...):
    if key in raw and raw[key] is not None:
        return raw[key]
    if default is ...:
        raise CheckpointError(f"config.json: {where}{key} is missing")
    return default


def target_only(raw: dict) -> tuple[dict, tuple[str, ...]]:
    """(the config without the keys only the target reads, their names): TARGET_ONLY's rule."""
    rope = dict(raw.get("rope_parameters") or {})
    default = (rope.get("rope_type") or rope.get("type") or "default") == "default"

    def only_target(key):
        return key.startswith(TARGET_ONLY) or (key == "partial_rotary_factor" and default)
    kept = {k: v for k, v in raw.items() if not only_target(k)}
    ignored = [k for k in raw if only_target(k)]
    if rope:
        kept["rope_parameters"] = {k: v for k, v in rope.items() if not only_target(k)}
        ignored += [f"rope_parameters.{k}" for k in rope if only_target(k)]
    return kept, tuple(ignored)


def draft_rope(tl: dict, where: str) -> tuple[float, tuple]:
    """(theta, scaling pairs) of the drafter's RoPE: default, linear or yarn, computed as
    transformers computes them (dspark.models.hf.target.rope_of reads them the same way), over
    the whole head of a Qwen3 layer."""
    rope = tl.get("rope_parameters") or {}
    if "sliding_attention" in rope or "full_attention" in rope:
        raise CheckpointError(f"config.json: {where}rope_parameters per layer type: expected one rope for all layers")
    try:
        theta, fraction, scaling = rope_of("qwen3", tl)
    except CheckpointError as e:
        raise CheckpointError(f"config.json: {where}{str(e).removeprefix('config ')}") from None
    if fraction != 1.0:   # transformers' scaled RoPEs rotate that share, Qwen3's layers the whole head
        raise CheckpointError(f"config.json: {where}partial_rotary_factor={fraction}: the drafter's Qwen3 layers "
                              f"rotate the whole head")
    return theta, scaling


def qwen3_layers(tl: dict, where: str, sliding: str = "refuse", model_types=("qwen3",)) -> dict:
    """DrafterConfig fields from a Qwen3 decoder config (the layer stack of every format; a
    DeepSpec Qwen3.6 / 3.8 draft's is a qwen3_5_text config without its TARGET_ONLY keys).
    sliding: how the format masks a sliding_attention layer. "refuse": dspark cannot serve it
    (z-lab DFlash masks it causally per query row unless is_causal is false). "row": z-lab DFlash
    with is_causal false: the keys within the window of each block row, both ways.
    "non_causal" / "causal": speculators' anchor-relative window (context rows [anchor - window,
    anchor)) with a bidirectional / causal block; without a sliding_window its mask is a full
    layer's."""
    if tl.get("model_type", "qwen3") not in model_types:
        raise CheckpointError(f"config.json: {where}model_type={tl['model_type']!r}: the drafter layers must be "
                              f"{' or '.join(model_types)} layers")
    if tl.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json: {where}hidden_act={tl['hidden_act']!r}: expected 'silu'")
    if tl.get("attention_bias"):
        raise CheckpointError(f"config.json: {where}attention_bias=true: dspark's drafter layers have no biases")
    if tl.get("is_causal"):
        raise CheckpointError(f"config.json: {where}is_causal=true: dspark's block attention is bidirectional")
    layers = int(get(tl, "num_hidden_layers", where))
    d = int(get(tl, "hidden_size", where))
    heads = int(get(tl, "num_attention_heads", where))
    theta, scaling = draft_rope(tl, where)
    layer_types = tl.get("layer_types") or [
        "sliding_attention" if tl.get("use_sliding_window") and i >= tl.get("max_window_layers", layers)
        else "full_attention" for i in range(layers)]
    windows = []
    for i, kind in enumerate(layer_types):
        window = tl.get("sliding_window") if kind == "sliding_attention" else None
        if kind == "full_attention" or (kind == "sliding_attention" and sliding != "refuse" and window is None):
            windows.append(0)
        elif kind == "sliding_attention" and sliding in ("non_causal", "row") and int(window) >= 1:
            windows.append(int(window))
        else:
            raise CheckpointError(f"config.json: {where}layer_types[{i}]={kind!r}"
                                  f"{' (causal inside the block)' if kind == 'sliding_attention' else ''}: dspark's "
                                  f"drafter attends bidirectionally inside the block, to all context rows, an "
                                  f"anchor-relative window or a window of at least 1 around each row")
    return dict(d_model=d, layers=layers, heads=heads, kv_heads=int(tl.get("num_key_value_heads") or heads),
                head_dim=int(tl.get("head_dim") or d // heads), mlp_hidden=int(get(tl, "intermediate_size", where)),
                norm_eps=float(tl.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
                window=0, layer_windows=tuple(windows) if any(windows) else (), q_norm=True,
                window_mode="row" if sliding == "row" else "anchor")


def heads(markov_rank: int, markov_type: str, confidence: bool, with_markov: bool) -> dict:
    """DrafterConfig fields of the DSpark Markov and confidence heads."""
    if markov_rank and markov_type not in ("vanilla", "gated", "rnn"):
        raise CheckpointError(f"config.json: markov_head_type={markov_type!r}: expected vanilla, gated or rnn")
    if confidence and with_markov and not markov_rank:
        raise CheckpointError("config.json: confidence_head_with_markov=true needs markov_rank > 0")
    return dict(markov_rank=markov_rank, markov=markov_type if markov_rank else "none",
                confidence=("markov" if with_markov else "hidden") if confidence else "none")


def build(fields: dict, where: str) -> DrafterConfig:
    try:
        return DrafterConfig(**fields)
    except ValueError as e:
        raise CheckpointError(f"config.json{' ' + where if where else ''}: {e}") from None


def deepspec(raw: dict) -> Plan:
    """DeepSpec's Qwen3DSparkModel (deepspec/modeling/dspark/qwen3/config.py build_draft_config) and
    its Qwen3_6DSparkModel / Qwen3_8DSparkModel (dspark/qwen3_6, qwen3_8: that draft in a copy of
    the Qwen3.5 target's text config; Qwen3.8's resets the RoPE to the default, theta 1e7, over
    the whole head)."""
    arch = next(a for a in raw.get("architectures") or [] if a in DEEPSPEC_ARCHS)
    raw, ignored = target_only(raw) if "qwen3_5_text" in DEEPSPEC_ARCHS[arch] else (raw, ())
    for key, want in DEEPSPEC_NOTES.items():
        if raw.get(key, want) != want:
            raise CheckpointError(f"config.json: {key}={raw[key]!r}: dspark serves the {want} draft")
    f = qwen3_layers(raw, "", model_types=DEEPSPEC_ARCHS[arch])
    rank = int(get(raw, "markov_rank"))
    conf = bool(get(raw, "enable_confidence_head"))
    f.update(heads(rank, str(get(raw, "markov_head_type")).lower() if rank else "none", conf,
                   bool(get(raw, "confidence_head_with_markov")) if conf else False))
    taps = tuple(int(t) for t in get(raw, "target_layer_ids"))
    f.update(block=int(get(raw, "block_size")), mask_id=int(get(raw, "mask_token_id")), taps=taps,
             harvest="shifted", own_embed=True, own_head=True, own_norm=True)
    return Plan("DeepSpec DSpark", build(f, ""), int(get(raw, "vocab_size")),
                int(get(raw, "num_target_layers")), "target_layer_ids", taps, ignored_keys=ignored)


def dflash(raw: dict) -> Plan:
    """z-lab's DFlashDraftModel / DFlash2DraftModel (dflash/model.py: _draft_value reads
    dflash_config first, then the top level)."""
    dc = raw.get("dflash_config") or {}

    def value(name, default=...):
        return dc[name] if dc.get(name) is not None else get(raw, name, "dflash_config.", default)

    # dflash.model.Qwen3DFlashAttention: is_causal unset makes a sliding layer causal.
    f = qwen3_layers(raw, "", "row" if raw.get("is_causal") is False else "refuse")
    layers = f["layers"]
    num_target = int(get(raw, "num_target_layers"))
    taps = value("target_layer_ids", None)
    if taps is None:   # dflash.model.build_target_layer_ids
        taps = [num_target // 2] if layers == 1 else \
            [round(1 + i * (num_target - 4) / (layers - 1)) for i in range(layers)]
    taps = tuple(int(t) for t in taps)
    softcap = value("final_logit_softcapping", None)
    f.update(block=int(value("block_size", 16)), mask_id=int(value("mask_token_id")), taps=taps,
             harvest="mask_fill", markov="none", markov_rank=0, confidence="none", own_norm=True,
             embed_scale=float(value("input_embedding_scale", 1.0)), logit_scale=float(value("output_multiplier", 1.0)),
             logit_softcap=float(softcap) if softcap is not None and float(softcap) > 0 else 0.0)
    name = "z-lab DFlash"
    aliases = {}
    vocab = int(get(raw, "vocab_size"))
    draft_vocab = int(value("draft_vocab_size", vocab))
    if draft_vocab != vocab:   # a trimmed draft vocabulary: its own LM head rows and d2t
        f.update(draft_vocab=draft_vocab, own_head=True)
    if "DFlash2DraftModel" in (raw.get("architectures") or []) or value("conv_kernel_size", None) is not None:
        name = "z-lab DFlash2"
        f.update(conv_kernel=int(value("conv_kernel_size")), conv_group=int(value("conv_group_size")),
                 markov="selector", selector_rank=int(value("selector_rank")),
                 selector_top_k=int(value("selector_top_k")))
        # DFlash2DraftModel's codebooks are nn.Embedding (saved with ".weight"); released files
        # omit the suffix (its from_pretrained key_mapping): either is accepted
        aliases = {f"candidate_selector.{n}.weight": f"candidate_selector.{n}"
                   for n in ("predecessor_codebook", "successor_codebook")}
    return Plan(name, build(f, ""), vocab, num_target, "target_layer_ids", taps,
                from_target=("embed",) if draft_vocab != vocab else ("embed", "lm_head"), aliases=aliases,
                ignored=("t2d",) if draft_vocab != vocab else ())


SPECULATORS_DEFAULTS = {   # pydantic defaults of speculators' DFlash / DSpark / DFlash2 configs
    "dflash": dict(sample_from_anchor=False, sliding_window_non_causal=False),
    "dspark": dict(sample_from_anchor=True, sliding_window_non_causal=False, markov_rank=256,
                   markov_head_type="vanilla", enable_confidence_head=True, confidence_head_with_markov=True),
    "dflash2": dict(sample_from_anchor=False, sliding_window_non_causal=True, conv_kernel_size=2, conv_group_size=16,
                    selector_rank=256, selector_top_k=16),
}


def speculators(raw: dict) -> Plan:
    """speculators' DFlashDraftModel, DSparkDraftModel and DFlash2DraftModel (speculators/models/)."""
    kind = raw["speculators_model_type"]
    if kind not in SPECULATORS_DEFAULTS:
        raise CheckpointError(f"config.json: speculators_model_type={kind!r}: dspark serves the block drafters "
                              f"{sorted(SPECULATORS_DEFAULTS)}")

    def value(name):
        return raw[name] if raw.get(name) is not None else SPECULATORS_DEFAULTS[kind].get(name)

    tl = get(raw, "transformer_layer_config")
    f = qwen3_layers(tl, "transformer_layer_config.",
                     "non_causal" if value("sliding_window_non_causal") else "causal")
    target_hidden = raw.get("target_hidden_size")
    if target_hidden is not None and int(target_hidden) != f["d_model"]:
        raise CheckpointError(f"config.json: target_hidden_size={target_hidden} differs from the drafter's hidden_size="
                              f"{f['d_model']}: dspark shares the target's embedding, which needs them equal")
    vocab = int(get(tl, "vocab_size", "transformer_layer_config."))
    draft_vocab = int(get(raw, "draft_vocab_size"))
    aux = tuple(int(a) for a in get(raw, "aux_hidden_state_layer_ids"))
    f.update(block=int(get(raw, "block_size")), mask_id=int(get(raw, "mask_token_id")), taps=tuple(a - 1 for a in aux),
             harvest="shifted" if value("sample_from_anchor") else "mask_fill", own_norm=True,
             draft_vocab=draft_vocab if draft_vocab != vocab else 0, own_head=draft_vocab != vocab)
    if kind == "dspark":
        conf = bool(value("enable_confidence_head"))
        f.update(heads(int(value("markov_rank")), str(value("markov_head_type")), conf,
                       bool(value("confidence_head_with_markov")) if conf else False))
    else:
        f.update(markov="none", markov_rank=0, confidence="none")
    if kind == "dflash2":
        f.update(conv_kernel=int(value("conv_kernel_size")), conv_group=int(value("conv_group_size")),
                 markov="selector", selector_rank=int(value("selector_rank")),
                 selector_top_k=int(value("selector_top_k")))
    return Plan(f"speculators {kind}", build(f, ""), vocab, None, "aux_hidden_state_layer_ids", aux,
                from_target=("embed",) + (() if f["own_head"] else ("lm_head",)),
                ignored=("t2d", "verifier_lm_head.weight", "verifier_norm.weight", "embed_tokens.weight")
                + (() if f["own_head"] else ("lm_head.weight",)))


READERS = {"deepspec": deepspec, "dflash": dflash, "speculators": speculators}


def plan(raw: dict) -> Plan:
    """The Plan of a drafter's config.json (a dict)."""
    p = READERS[detect(raw)](raw)
    p.architecture = ",".join(raw.get("architectures") or [])
    return p
