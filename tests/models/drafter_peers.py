"""The peers' side of the drafter-format oracle tests: tiny random drafters built and saved by
the peers' own code (dflash's DFlashDraftModel / DFlash2DraftModel, speculators' DFlash, DSpark
and DFlash2 models), a DeepSpec-layout fixture (Qwen3DSparkModel below, which mirrors DeepSpec's
Qwen3DSparkModel, and its Qwen3_6 / Qwen3_8 subclasses in a copied Qwen3.5 text config), the
DFlash2 of DeepSpec's Qwen3.8 export (dflash's own DFlash2DraftModel in the config DeepSpec
builds, and TrimmedDFlash2 for its trimmed vocabulary), and each peer's forward for one draft
round on given context taps.

A "round" follows the peer's own inference loop: the context rows committed since the last round
(their concatenated taps) and the anchor at position `start` = all context rows so far; the
block is [anchor, MASK x (b-1)] at positions start..start+b-1. Each reference returns the block
pass's hidden rows (after the drafter's final norm) and logits for every block row, the greedy
Markov-chain proposals and the confidence of every draft slot.

The builders size a drafter to a target (Sizes): the tiny stand-in of the format tests by default,
or a real transformers target (sizes_of) for the end-to-end tests; "target" is anything with
get_input_embeddings() and lm_head, the stand-in or a transformers causal LM.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache, Qwen3_5TextConfig, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (Qwen3MLP, Qwen3PreTrainedModel, Qwen3RMSNorm,
                                                      Qwen3RotaryEmbedding, eager_attention_forward, rotate_half)

from tests.models.hf_models import QWEN3_8_SHAPE

H, V, MASK = 64, 300, 299          # the stand-in target's hidden size, vocabulary, mask token
TARGET_LAYERS = 6


@dataclass(frozen=True)
class Sizes:
    """What a drafter takes from its target: hidden size, vocabulary, layer count; and its mask id."""
    hidden: int = H
    vocab: int = V
    mask: int = MASK
    target_layers: int = TARGET_LAYERS


TINY = Sizes()


def sizes_of(model) -> Sizes:
    """The Sizes of a transformers causal LM (mask: its last token id)."""
    c = model.config.get_text_config()
    return Sizes(c.hidden_size, c.vocab_size, c.vocab_size - 1, c.num_hidden_layers)


def layer_config(layers: int = 2, sizes: Sizes = TINY, **extra) -> Qwen3Config:
    """A tiny Qwen3 decoder config for the drafter layers (head dim 64: the attention kernels'),
    non-default rope theta and eps so a loader that ignores them fails."""
    cfg = Qwen3Config(vocab_size=sizes.vocab, hidden_size=sizes.hidden, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                      rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, **extra)
    cfg._attn_implementation = "eager"
    return cfg


def randomize(model: nn.Module, seed: int) -> None:
    """Every parameter random and O(1)-scaled (norm gains near 1), so that a wrong mapping shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.ndim == 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "embed" in name or "codebook" in name or "markov_w1" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


class Target(nn.Module):
    """The target's embedding, final norm and LM head (what the drafters share with it)."""

    def __init__(self, seed: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, H)
        self.norm = Qwen3RMSNorm(H, eps=1e-6)
        self.lm_head = nn.Linear(H, V, bias=False)
        randomize(self, seed)

    def get_input_embeddings(self):
        return self.embed_tokens

    def standin(self, be, tap_layers):
        """dspark's view of this target: the fields a drafter reads (no trunk layers needed)."""
        cfg = SimpleNamespace(d_model=H, vocab=V, eos_id=0, mask_id=MASK, norm_eps=1e-6, max_ctx=64,
                              layers=("attn",) * TARGET_LAYERS, tap_layers=tuple(tap_layers))
        w = {"embed": self.embed_tokens.weight, "final_norm": self.norm.weight, "lm_head": self.lm_head.weight.T}
        return SimpleNamespace(config=cfg, be=be, w={k: be.asarray(np.ascontiguousarray(v.detach().numpy()))
                                                     for k, v in w.items()})


def block_ids(anchor: int, b: int, mask: int = MASK) -> torch.Tensor:
    ids = torch.full((1, b), mask, dtype=torch.long)
    ids[0, 0] = anchor
    return ids


# ---- DeepSpec: a fixture in exactly Qwen3DSparkModel's layout ------------------------------------
class DeepSpecAttention(nn.Module):
    """Mirrors deepspec/modeling/dspark/qwen3/modeling.py Qwen3DSparkAttention: q from the block
    rows (q_norm), k/v of [context features ; block rows] (k_norm on both), RoPE at absolute
    positions, the cache updated with both, no mask (non-causal, no window)."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx, self.head_dim, H = layer_idx, config.head_dim, config.hidden_size
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling, self.attention_dropout, self.training = self.head_dim ** -0.5, 0.0, False
        self.q_proj = nn.Linear(H, config.num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, config.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, config.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, H, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states, target_hidden_states, position_embeddings, past_key_values):
        bsz, q_len = hidden_states.shape[:-1]
        ctx_len = target_hidden_states.shape[1]
        q = self.q_norm(self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim)).transpose(1, 2)
        k = torch.cat([self.k_proj(target_hidden_states), self.k_proj(hidden_states)], 1).view(
            bsz, ctx_len + q_len, -1, self.head_dim)
        v = torch.cat([self.v_proj(target_hidden_states), self.v_proj(hidden_states)], 1).view(
            bsz, ctx_len + q_len, -1, self.head_dim)
        k, v = self.k_norm(k).transpose(1, 2), v.transpose(1, 2)
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)   # apply_rotary_pos_emb
        q = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
        k = k * cos + rotate_half(k) * sin
        k, v = past_key_values.update(k, v, self.layer_idx)
        out, _ = eager_attention_forward(self, q, k, v, None, scaling=self.scaling)
        return self.o_proj(out.reshape(bsz, q_len, -1))


class DeepSpecLayer(nn.Module):
    """Mirrors Qwen3DSparkDecoderLayer: the context features bypass input_layernorm."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = DeepSpecAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, target_hidden_states, hidden_states, position_embeddings, past_key_values):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), target_hidden_states,
                                           position_embeddings, past_key_values)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3DSparkModel(Qwen3PreTrainedModel):
    """DeepSpec's Qwen3DSparkModel, tensor for tensor (embed_tokens, layers, norm, fc, hidden_norm,
    lm_head, markov_head.{markov_w1, markov_w2, gate_proj, joint_proj}, confidence_head.proj), with
    its eval-time forward. The class name is DeepSpec's so that save_pretrained writes its
    architectures entry."""

    def __init__(self, config):
        super().__init__(config)
        H, V = config.hidden_size, config.vocab_size
        self.layers = nn.ModuleList([DeepSpecLayer(config, i) for i in range(config.num_hidden_layers)])
        self.embed_tokens = nn.Embedding(V, H)
        self.norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(config.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(H, V, bias=False)
        r, kind = config.markov_rank, getattr(config, "markov_head_type", None)
        self.markov_head = None
        if r:   # markov_head.build_markov_head
            self.markov_head = nn.Module()
            self.markov_head.markov_w1 = nn.Embedding(V, r)
            self.markov_head.markov_w2 = nn.Linear(r, V, bias=False)
            if kind == "gated":
                self.markov_head.gate_proj = nn.Linear(H + r, r)
            elif kind == "rnn":
                self.markov_head.joint_proj = nn.Linear(2 * r + H, 3 * r)
        self.confidence_head = None
        if config.enable_confidence_head:   # AcceptRatePredictor
            self.confidence_head = nn.Module()
            self.confidence_head.proj = nn.Linear(H + (r if config.confidence_head_with_markov else 0), 1)
        self.post_init()

    def backbone(self, target_hidden_states, noise_embedding, position_ids, past_key_values):
        """Mirrors Qwen3DSparkModel._forward_backbone."""
        ctx = self.hidden_norm(self.fc(target_hidden_states))
        pe = self.rotary_emb(noise_embedding, position_ids)
        h = noise_embedding
        for layer in self.layers:
            h = layer(ctx, h, pe, past_key_values)
        return self.norm(h)

    def step_bias(self, prev, h, state):
        """Mirrors VanillaMarkov / GatedMarkovHead / RNNHead.apply_step_logits (RNNHead._rnn_step)."""
        m, kind = self.markov_head, self.config.markov_head_type
        e = m.markov_w1(prev)
        if kind == "vanilla":
            return m.markov_w2(e), state
        if kind == "gated":
            return m.markov_w2(torch.sigmoid(m.gate_proj(torch.cat([h, e], -1))) * e), state
        g, c, o = m.joint_proj(torch.cat([state, e, h], -1)).chunk(3, dim=-1)
        g = torch.sigmoid(g)
        return m.markov_w2(torch.tanh(o)), g * state + (1.0 - g) * torch.tanh(c)


@torch.no_grad()
def deepspec_round(model, cache, ctx_taps, anchor, start, edit=None):
    """Mirrors deepspec/eval/dspark: forward_dspark_draft_block (the draft cache holds the context
    K/V; the block's are cropped off after), then build_dspark_proposal at temperature 0:
    sample_draft_tokens (markov sample_block_tokens) and predict_confidence_step (sigmoid of its
    logits, as _confident_prefix_length compares)."""
    b = model.config.block_size
    ids = block_ids(anchor, b, model.config.mask_token_id)
    past = cache.get_seq_length()
    hidden = model.backbone(ctx_taps, model.embed_tokens(ids), torch.arange(past, start + b)[None], cache)
    cache.crop(start)
    logits = model.lm_head(hidden)
    if edit is not None:   # a test's change to the block logits (the oracle's boosts)
        logits = edit(logits)
    prev, state, drafts, conf = ids[:, 0], torch.zeros(1, model.config.markov_rank), [], []
    for k in range(b):
        step = logits[:, k]
        if model.markov_head is not None:
            bias, state = model.step_bias(prev, hidden[:, k], state)
            step = step + bias
        if model.confidence_head is not None:
            feats = hidden[:, k]
            if model.config.confidence_head_with_markov:
                feats = torch.cat([feats, model.markov_head.markov_w1(prev)], -1)
            conf.append(torch.sigmoid(model.confidence_head.proj(feats)[:, 0]).item())
        prev = step.argmax(-1)
        drafts.append(int(prev))
    return hidden[0], logits[0], drafts, conf or None


def deepspec_model(seed, *, markov_rank=8, markov_head_type="vanilla", confidence=True, with_markov=True,
                   taps=(-1, 1, 3), block=4, target=None, sizes: Sizes = TINY):
    cfg = layer_config(sizes=sizes, architectures=["Qwen3DSparkModel"])
    cfg.update(dict(num_target_layers=sizes.target_layers, block_size=block, mask_token_id=sizes.mask,
                    target_layer_ids=list(taps),
                    num_anchors=64, enable_confidence_head=confidence, markov_rank=markov_rank,
                    tie_word_embeddings=False))
    if confidence:
        cfg.confidence_head_with_markov = with_markov
    if markov_rank:
        cfg.markov_head_type = markov_head_type
    m = Qwen3DSparkModel(cfg).eval()
    randomize(m, seed)
    if target is not None:   # initialize_embeddings_and_head: copies of the target's
        with torch.no_grad():
            m.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
            m.lm_head.weight.copy_(target.lm_head.weight)
    return m


# ---- DeepSpec's Qwen3.6 / Qwen3.8 DSpark: the Qwen3 draft in the target's Qwen3.5 text config ----
def qwen3_8_text_config(sizes: Sizes = TINY) -> Qwen3_5TextConfig:
    """A Qwen3.5 text config of Qwen3.8-27B's structure scaled down (hf_models.QWEN3_8_SHAPE: the
    3 gdn + 1 full attention pattern, heads of 256 at GQA 6, partial RoPE 0.25 with mrope sections,
    gdn value heads three per key head) at these sizes."""
    return Qwen3_5TextConfig(vocab_size=sizes.vocab, hidden_size=sizes.hidden, intermediate_size=96,
                             num_hidden_layers=sizes.target_layers, max_position_embeddings=512,
                             **copy.deepcopy(QWEN3_8_SHAPE))


# YaRN in the drafter, as the seed's DSpark export runs it (factor 4 over 128 of qwen3_8_text_config's 512)
YARN = {"rope_type": "yarn", "rope_theta": 1e7, "factor": 4.0, "original_max_position_embeddings": 128}


class Qwen3_6DSparkModel(Qwen3DSparkModel):
    """deepspec/modeling/dspark/qwen3_6/modeling.py: the Qwen3 DSpark draft, config_class
    Qwen3_5TextConfig."""
    config_class = Qwen3_5TextConfig


class Qwen3_8DSparkModel(Qwen3_6DSparkModel):
    """deepspec/modeling/dspark/qwen3_8/modeling.py."""


def deepspec_qwen35_model(seed, target_config, *, arch="Qwen3_8DSparkModel", layers=1, taps=(-1, 1, 3), block=4,
                          markov_rank=8, markov_head_type="gated", confidence=True, with_markov=True, rope=None,
                          target=None, sizes: Sizes = TINY):
    """A Qwen3.6 / Qwen3.8 DSpark draft, its config built as DeepSpec builds it: qwen3/config.py
    build_draft_config (a deep copy of the target's text config, the draft layers all
    full_attention, the DSpark fields), then qwen3_8/config.py's resets (default RoPE at theta
    1e7 over the whole head, or `rope` where given: the seed's export runs YaRN; its notes). The
    target-only keys (linear_*, the mrope sections) stay in, as DeepSpec leaves them."""
    cfg = copy.deepcopy(target_config)
    cfg.architectures = [arch]
    cfg.update(dict(num_target_layers=target_config.num_hidden_layers, num_hidden_layers=layers, block_size=block,
                    tie_word_embeddings=False, layer_types=["full_attention"] * layers, mask_token_id=sizes.mask,
                    target_layer_ids=list(taps), num_anchors=64, enable_confidence_head=confidence,
                    markov_rank=markov_rank, rms_norm_eps=1e-5))
    if confidence:
        cfg.confidence_head_with_markov = with_markov
    if markov_rank:
        cfg.markov_head_type = markov_head_type
    if arch == "Qwen3_8DSparkModel":
        cfg.rope_parameters = dict(rope or {"rope_type": "default", "rope_theta": 1e7})
        cfg.partial_rotary_factor = 1.0
        cfg.update(dict(deepspec_target_family="qwen3_8", deepspec_draft_architecture="qwen3_full_attention",
                        deepspec_draft_rope="full_head", deepspec_target_model_type="qwen3_5_text",
                        target_context_layout="native_head_tail"))
    cfg._attn_implementation = "eager"
    m = (Qwen3_8DSparkModel if arch == "Qwen3_8DSparkModel" else Qwen3_6DSparkModel)(cfg).eval()
    randomize(m, seed)
    if target is not None:   # initialize_embeddings_and_head
        with torch.no_grad():
            m.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
            m.lm_head.weight.copy_(target.lm_head.weight)
    return m


# ---- DeepSpec's DFlash2 for Qwen3.8 --------------------------------------------------------------
class TrimmedDFlash2(nn.Module):
    """Mixin: a DFlash2 drafter over a trimmed draft vocabulary. Its own lm_head [draft_vocab, H]
    gives the draft logits and d2t (EAGLE-3's offsets: target id = j + d2t[j]) maps a draft row
    to its target token; t2d marks the kept target ids. The candidate selector (dflash's
    CandidateSelector.select, followed step by step) takes the top-k of the draft logits and
    scores each candidate by its target id, the codebooks staying over the target vocabulary."""

    def compute_logits(self, hidden, output_head):
        return super().compute_logits(hidden, self.lm_head)

    def propose(self, hidden, anchor_ids, output_head, temperature):
        sel = self.candidate_selector
        unary, cand = torch.topk(self.compute_logits(hidden, None), sel.top_k, dim=-1, sorted=False)
        cand = cand + self.d2t[cand]
        code, predecessor, path = sel.hidden_projection(hidden), anchor_ids, []
        for position in range(hidden.shape[1]):
            scores = unary[:, position] + torch.einsum("br,bkr->bk", sel.predecessor_codebook(predecessor)
                                                       * code[:, position], sel.successor_codebook(cand[:, position]))
            predecessor = cand[:, position].gather(-1, torch.argmax(scores, dim=-1)[:, None])[:, 0]
            path.append(predecessor)
        return torch.stack(path, dim=1), cand, None


def dflash2_qwen3_8_model(seed, *, layers=2, window=3, taps=(1, 3), block=4, draft_vocab=None, sizes: Sizes = TINY):
    """The DFlash2 of DeepSpec's Qwen3.8 export, its config built as deepspec/modeling/dflash2/
    qwen3_8/config.py build_draft_config builds it (scaled down: 32:8 heads of 128 -> 4:1, five
    layers -> `layers`, sliding_window 2048 -> `window`, verification block 8 -> `block`): Qwen3
    layers, every one sliding_attention with is_causal false, RoPE theta 1e7, the dflash_config,
    and DeepSpec's training-only fields at the top level (block_size there is the draft count).
    dflash's own DFlash2DraftModel is the model; with `draft_vocab`, TrimmedDFlash2 over it."""
    from dflash.model import DFlash2DraftModel
    cfg = Qwen3Config(vocab_size=sizes.vocab, hidden_size=sizes.hidden, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=128, max_position_embeddings=512,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
                      rope_parameters={"rope_theta": 1e7, "rope_type": "default"}, sliding_window=window,
                      use_sliding_window=True, layer_types=["sliding_attention"] * layers, is_causal=False)
    cfg._attn_implementation = "eager"
    cfg.architectures = ["DFlash2DraftModel"]
    cfg.dflash_config = {"block_size": block, "conv_group_size": 16, "conv_kernel_size": 2, "mask_token_id": sizes.mask,
                         "selector_rank": 8, "selector_top_k": 5, "target_layer_ids": list(taps)}
    if draft_vocab:
        cfg.dflash_config["draft_vocab_size"] = draft_vocab
    cfg.num_target_layers = sizes.target_layers
    cfg.max_window_layers = layers
    cfg.update(dict(block_size=block - 1, verification_block_size=block, proposal_hidden_offset=1,
                    target_layer_ids=list(taps), mask_token_id=sizes.mask, num_anchors=64, conv_group_size=16,
                    conv_kernel_size=2, selector_rank=8, selector_top_k=5, enable_confidence_head=False, markov_rank=0))
    if not draft_vocab:
        m = DFlash2DraftModel(cfg).eval()
        randomize(m, seed)
        return m
    # named as DeepSpec's export names it (checkpoint_architecture_name), which save_pretrained writes
    m = type("DFlash2DraftModel", (TrimmedDFlash2, DFlash2DraftModel), {})(cfg).eval()
    m.lm_head = nn.Linear(sizes.hidden, draft_vocab, bias=False)
    keep = torch.randperm(sizes.vocab, generator=torch.Generator().manual_seed(seed + 1))[:draft_vocab].sort().values
    m.register_buffer("d2t", keep - torch.arange(draft_vocab))
    t2d = torch.zeros(sizes.vocab, dtype=torch.bool)
    t2d[keep] = True
    m.register_buffer("t2d", t2d)
    randomize(m, seed)
    return m


# ---- z-lab dflash ----------------------------------------------------------------------------
def dflash_model(seed, *, v2=False, taps=(1, 3), block=4, extra=None, sizes: Sizes = TINY, **layers):
    """z-lab's DFlashDraftModel / DFlash2DraftModel; `layers`: more Qwen3 layer config (layer_types,
    sliding_window, is_causal)."""
    from dflash.model import DFlash2DraftModel, DFlashDraftModel
    cfg = layer_config(sizes=sizes, num_target_layers=sizes.target_layers, block_size=block, **layers)
    cfg.dflash_config = {"target_layer_ids": list(taps), "mask_token_id": sizes.mask, **(extra or {})}
    if v2:
        cfg.dflash_config.update(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=5)
        cfg.architectures = ["DFlash2DraftModel"]
    m = (DFlash2DraftModel if v2 else DFlashDraftModel)(cfg).eval()
    randomize(m, seed)
    return m


@torch.no_grad()
def dflash_round(model, target, cache, ctx_taps, anchor, start):
    """dflash.model.dflash_generate's draft step: noise = the target's embedding of the block
    (times input_embedding_scale), the drafter over the new context rows with its cache, cropped
    to `start`; rows 1..b-1 are the drafts, argmax of compute_logits (DFlash2: propose, the
    candidate selector)."""
    from dflash.model import DFlash2DraftModel, _crop_to, _draft_value, _raw_input_embeddings
    b = model.block_size
    ids = block_ids(anchor, b, model.mask_token_id)
    noise = _raw_input_embeddings(target, ids, float(_draft_value(model.config, "input_embedding_scale", 1.0)))
    hidden = model(target_hidden=ctx_taps, noise_embedding=noise,
                   position_ids=torch.arange(start - ctx_taps.shape[1], start + b)[None], past_key_values=cache,
                   use_cache=True)
    _crop_to(cache, start)
    logits = model.compute_logits(hidden, target.lm_head)
    if isinstance(model, DFlash2DraftModel):
        drafts = model.propose(hidden[:, 1:], ids[:, 0], target.lm_head, 0.0)[0]
    else:
        drafts = logits[:, 1:].argmax(-1)
    return hidden[0], logits[0], [int(t) for t in drafts[0]], None


def deepspec_cache():
    """DeepSpec's draft cache (Qwen3DSparkEvaluator._init_context)."""
    return DynamicCache()


def dflash_cache(model):
    from dflash.model import _make_cache
    return _make_cache(model.config)


# ---- speculators ------------------------------------------------------------------------------
def speculators_model(seed, kind, *, taps=(2, 4), block=4, draft_vocab=None, target=None, layer_cfg=None,
                      sizes: Sizes = TINY, **fields):
    """speculators' DFlash / DSpark / DFlash2 draft model, built as from_training_args does but
    without a verifier on disk: the embedding (and the LM head of a full-vocabulary draft) are the
    target's, loaded here as load_verifier_weights would."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    cls, ccls = {"dflash": (DFlashDraftModel, DFlashSpeculatorConfig),
                 "dspark": (DSparkDraftModel, DSparkSpeculatorConfig),
                 "dflash2": (DFlash2DraftModel, DFlash2SpeculatorConfig)}[kind]
    sc = SpeculatorsConfig(algorithm=kind, proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block)],
                           default_proposal_method="greedy",
                           verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]))
    V = sizes.vocab
    draft_vocab = draft_vocab or V
    cfg = ccls(transformer_layer_config=layer_cfg or layer_config(sizes=sizes), draft_vocab_size=draft_vocab,
               block_size=block, aux_hidden_state_layer_ids=list(taps), mask_token_id=sizes.mask,
               speculators_config=sc, **fields)
    m = cls(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    if draft_vocab != V:
        keep = torch.randperm(V, generator=g)[:draft_vocab].sort().values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[keep] = True
        m.load_vocab_mappings(t2d, keep - torch.arange(draft_vocab))   # d2t holds offsets
    randomize(m, seed)
    with torch.no_grad():
        m.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        head = target.lm_head.weight if draft_vocab == V else target.lm_head.weight[m.t2d]
        if draft_vocab != V:   # a trained reduced head: make it differ from the target's rows
            head = head + 0.1 * torch.randn(head.shape, generator=g)
        m.lm_head.weight.copy_(head)
    return m


@torch.no_grad()
def speculators_round(model, ctx_taps, anchor, start, window_mask=None, edit=None):
    """speculators' _backbone_forward for one anchored block (its inference runs in vLLM): the
    block [anchor, MASK...] embedded, fc + hidden_norm of all context rows so far, the layers
    with no mask (full attention is non-causal), norm, lm_head; then DSpark's Markov block_bias
    along the chain's own tokens (prev of the first slot = the anchor; with sample_from_anchor
    False slot k is row k+1), the confidence head on [hidden ; W1[prev]], and DFlash2's candidate
    selector. Returns drafts as target ids (d2t offsets applied). `edit`, where given, changes the
    block logits before the proposals (in deepspec_round too)."""
    cfg = model.config
    b = cfg.block_size
    ids = block_ids(anchor, b, cfg.mask_token_id)
    x = model.embed_tokens(ids)
    ctx = model.hidden_norm(model.fc(ctx_taps))
    positions = torch.arange(0, start + b)[None]
    pe = model.rotary_emb(x, positions)
    for i, layer in enumerate(model.layers):
        mask = window_mask if i in model.sliding_window_indices else None
        x = layer(hidden_states=x, target_hidden=ctx, attention_mask=mask, position_ids=positions,
                  position_embeddings=pe, use_cache=False)
    hidden = model.norm(x)
    logits = model.lm_head(hidden)
    if edit is not None:
        logits = edit(logits)
    first = 0 if cfg.sample_from_anchor else 1
    h, l = hidden[:, first:], logits[:, first:]
    to_target = (lambda j: j + int(model.d2t[j])) if model.d2t is not None else (lambda j: j)
    prev, drafts, conf = [anchor], [], []
    markov = getattr(model, "markov_head", None)
    selector = getattr(model, "candidate_selector", None)
    for k in range(h.shape[1]):
        p = torch.tensor([prev])
        step = l[:, k]
        if markov is not None:
            step = step + markov.block_bias(prev_token_ids=p, hidden_states=h[:, : k + 1])[:, k]
        if getattr(model, "confidence_head", None) is not None:
            feats = h[:, k]
            if cfg.confidence_head_with_markov:
                feats = torch.cat([feats, markov.prev_embeddings(p[:, k])], -1)
            conf.append(torch.sigmoid(model.confidence_head(feats)).item())
        if selector is not None:
            cand, scores = selector.select(step[:, None], h[:, k : k + 1], p[:, k : k + 1])
            tok = int(cand[0, 0, scores[0, 0].argmax()])
        else:
            tok = to_target(int(step.argmax(-1)))
        prev.append(tok)
        drafts.append(tok)
    return hidden[0], logits[0], drafts, conf or None


def sliding_mask(model, start: int, window: int):
    """speculators' own anchored-block mask (dflash/attention.py create_anchor_block_mask_mod) for
    one block at anchor `start`, as the float mask eager attention takes."""
    from speculators.models.dflash.attention import create_anchor_block_mask_mod
    b = model.config.block_size
    mod, q_len, kv_len = create_anchor_block_mask_mod(
        document_ids=torch.zeros(start + b, dtype=torch.long), total_seq_len=start,
        anchor_positions=torch.tensor([start]), block_size=b, sliding_window=window,
        sliding_window_non_causal=model.config.sliding_window_non_causal)
    q = torch.arange(q_len)[:, None]
    kv = torch.arange(kv_len)[None, :]
    visible = mod(torch.tensor(0), torch.tensor(0), q, kv)
    # the context part of the K/V is exactly the `start` rows we pass (total_seq_len = start)
    return torch.where(visible, 0.0, float("-inf"))[None, None]


def save_speculators(model, path) -> None:
    model.save_pretrained(path)


def edit_config(path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        node = cfg
        *outer, leaf = key.split("__")
        for part in outer:
            node = node[part]
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    (path / "config.json").write_text(json.dumps(cfg))
