"""Released drafter formats (dspark.models.hf.load_drafter) against the peers' own code.

Tiny random drafters are built with the peers' classes (dflash's DFlashDraftModel /
DFlash2DraftModel, speculators' DFlash / DSpark / DFlash2 models) or, for DeepSpec, in exactly its
layout (tests/models/drafter_peers.py mirrors deepspec/modeling/dspark/qwen3/modeling.py and
deepspec/eval/dspark/draft_ops.py, function by function), saved with their own save_pretrained,
and loaded by dspark. Both sides get the same context taps in two rounds (the second reusing the
draft KV of the first, as the peers' draft caches do) and the same anchors; the block pass's
logits, the greedy Markov-chain proposals and the confidence must match the peer's forward.
The malformed-checkpoint errors are tested on the same fixtures.

The peers (torch, transformers, dflash, speculators) belong to the test extra: under CI=true a
missing one fails instead of skipping.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest


from tests.peers import peer  # noqa: E402

torch = peer("torch")
peer("transformers")
peer("dflash")
peer("speculators")

from dspark.errors import CheckpointError, ShapeError  # noqa: E402
from dspark.models.hf import load_drafter  # noqa: E402
from tests.models import drafter_peers as peers  # noqa: E402

TOL = 1e-4                 # of the largest |logit| (hidden rows: of the largest |h|)
CONF_TOL = 1e-4            # confidences are probabilities
CTX = (7, 3)               # context rows committed before round 1, then before round 2
SEED = 20240611            # pinned: proposals are compared exactly, so no near-tie may depend on luck


class Case:
    """One fixture: how to build it with the peer's code, and its reference round."""

    def __init__(self, name, build, taps, window=None):
        self.name, self.build, self.taps, self.window = name, build, taps, window

    def __repr__(self):
        return self.name


def _deepspec(copies=True, **kw):
    return lambda target, seed, taps: (peers.deepspec_model(seed, target=target if copies else None, taps=taps, **kw),
                                       "deepspec")


def _deepspec_qwen35(copies=True, **kw):
    return lambda target, seed, taps: (peers.deepspec_qwen35_model(seed, peers.qwen3_8_text_config(), taps=taps,
                                                                   target=target if copies else None, **kw),
                                       "deepspec")


def _dflash2_qwen3_8(**kw):
    return lambda target, seed, taps: (peers.dflash2_qwen3_8_model(seed, taps=taps, **kw), "dflash")


def _dflash(**kw):
    return lambda target, seed, taps: (peers.dflash_model(seed, taps=taps, **kw), "dflash")


def _spec(kind, **kw):
    return lambda target, seed, taps: (peers.speculators_model(seed, kind, target=target, taps=taps, **kw),
                                       "speculators")


CASES = [
    # DeepSpec: taps include -1 (the embedding); own embed/lm_head equal to the target's (shared)
    Case("deepspec-vanilla-conf_markov", _deepspec(markov_head_type="vanilla"), (-1, 1, 3)),
    Case("deepspec-gated-conf_hidden-own_copies", _deepspec(markov_head_type="gated", with_markov=False, copies=False),
         (0, 4)),
    Case("deepspec-rnn-no_conf", _deepspec(markov_head_type="rnn", confidence=False, block=5), (2,)),
    Case("deepspec-no_markov", _deepspec(markov_rank=0, with_markov=False), (1, 3)),
    # DeepSpec's Qwen3.8 / Qwen3.6 drafts: Qwen3 layers at the target's head dim 256 in its copied
    # qwen3_5_text config (target-only keys left in); the seed's export runs YaRN
    Case("deepspec-qwen3_8-yarn", _deepspec_qwen35(rope=peers.YARN), (-1, 1, 3)),
    Case("deepspec-qwen3_6-two_layers-own_copies", _deepspec_qwen35(arch="Qwen3_6DSparkModel", layers=2,
                                                                    markov_head_type="rnn", copies=False), (0, 4)),
    # DeepSpec's DFlash2 for Qwen3.8: head dim 128, every layer a non-causal sliding window (3: below
    # the block, so both sides of a row bite), with and without the trimmed vocabulary and its d2t
    Case("dflash2-qwen3_8-sliding", _dflash2_qwen3_8(), (1, 3)),
    Case("dflash2-qwen3_8-sliding-d2t", _dflash2_qwen3_8(draft_vocab=120), (0, 2)),
    Case("dflash", _dflash(extra={"input_embedding_scale": 1.5, "output_multiplier": 0.75,
                                  "final_logit_softcapping": 20.0}), (1, 3)),
    Case("dflash2", _dflash(v2=True), (0, 2)),
    # a per-row window of 2 on one layer, all rows on the other (is_causal false, as dflash reads it)
    Case("dflash-sliding-and-full", _dflash(layer_types=["sliding_attention", "full_attention"], sliding_window=2,
                                            use_sliding_window=True, is_causal=False), (2, 4)),
    Case("speculators-dflash", _spec("dflash"), (2, 4)),
    Case("speculators-dspark-vanilla-draft_vocab", _spec("dspark", draft_vocab=120), (2, 4)),
    Case("speculators-dspark-rnn-mask_fill-conf_hidden", _spec("dspark", markov_rank=8, markov_head_type="rnn",
                                                               sample_from_anchor=False,
                                                               confidence_head_with_markov=False), (1, 6)),
    Case("speculators-dspark-gated-sliding", _spec("dspark", markov_rank=8, markov_head_type="gated",
                                                   sliding_window_non_causal=True,
                                                   layer_cfg=peers.layer_config(
                                                       layer_types=["sliding_attention", "full_attention"],
                                                       use_sliding_window=True, sliding_window=5)), (0, 3),
         window=5),
    Case("speculators-dflash2", _spec("dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                                      selector_top_k=5), (2, 4)),
]
SIMT_CASES = {"deepspec-vanilla-conf_markov", "dflash2", "speculators-dspark-vanilla-draft_vocab",
              "deepspec-qwen3_8-yarn", "dflash2-qwen3_8-sliding-d2t"}


def taps_for(case):
    """Target layer ids as dspark counts them (speculators' aux ids are one higher)."""
    return case.taps if not case.name.startswith("speculators") else tuple(t - 1 for t in case.taps)


@pytest.fixture(scope="module")
def target():
    return peers.Target(SEED)


@pytest.fixture(scope="module")
def saved(target, tmp_path_factory):
    """name -> (peer model, format, directory saved by the peer's save_pretrained)."""
    out = {}
    for i, case in enumerate(CASES):
        model, fmt = case.build(target, SEED + i, case.taps)
        path = tmp_path_factory.mktemp(case.name)
        model.save_pretrained(path)
        out[case.name] = (model, fmt, path)
    return out


def reference_rounds(case, model, fmt, target, ctx):
    """The peer's two rounds: lists of (hidden, logits, drafts, conf)."""
    out, start, cache = [], 0, None
    if fmt == "deepspec":
        cache = peers.deepspec_cache()
    elif fmt == "dflash":
        cache = peers.dflash_cache(model)
    anchors = []
    for r, n in enumerate(CTX):
        anchor = int(ctx["anchors"][r])
        anchors.append(anchor)
        if fmt == "speculators":   # no incremental inference: all context rows so far
            taps = torch.from_numpy(ctx["taps"][: start + n])[None]
            mask = peers.sliding_mask(model, start + n, case.window) if case.window else None
            out.append(peers.speculators_round(model, taps, anchor, start + n, mask))
        else:
            taps = torch.from_numpy(ctx["taps"][start : start + n])[None]
            fn = peers.deepspec_round if fmt == "deepspec" else (
                lambda m, c, t, a, s: peers.dflash_round(m, target, c, t, a, s))
            out.append(fn(model, cache, taps, anchor, start + n))
        start += n
    return out


def context(case, seed):
    rng = np.random.default_rng(seed)
    return {"taps": rng.standard_normal((sum(CTX), len(case.taps) * peers.H)).astype(np.float32),
            "anchors": rng.integers(0, peers.V - 1, len(CTX))}


def check_round(be, drafter, kv, ref, anchor):
    hidden, logits = drafter.block_pass([kv], [anchor])
    hidden, logits = be.to_host(hidden), be.to_host(logits)
    want_h, want_l, want_drafts, want_conf = (x.numpy() if torch.is_tensor(x) else x for x in ref)
    scale_l, scale_h = np.abs(want_l).max(), np.abs(want_h).max()
    for what, got, want, scale in (("logits", logits, want_l, scale_l), ("hidden", hidden, want_h, scale_h)):
        assert np.abs(got - want).max() <= TOL * scale, f"block {what}: max |diff| {np.abs(got - want).max():.3g}"
    drafts, conf = drafter.propose_greedy(*drafter.draft([kv], [anchor]), [anchor])
    assert drafts[0].tolist() == list(want_drafts), "Markov-chain proposals differ"
    if want_conf is None:
        assert not drafter.has_confidence and np.isnan(conf).all()
    else:
        assert np.abs(conf[0] - np.asarray(want_conf)).max() <= CONF_TOL, f"confidence {conf[0]} vs {want_conf}"


def run_case(case, be, saved, target):
    model, fmt, path = saved[case.name]
    ctx = context(case, SEED)
    refs = reference_rounds(case, model, fmt, target, ctx)
    drafter = load_drafter(path, target.standin(be, taps_for(case)), be)
    kv = drafter.new_kv("test/draft_kv")
    start = 0
    for r, n in enumerate(CTX):
        drafter.ingest([kv], be.asarray(ctx["taps"][start : start + n]), np.array([0, n], np.int32))
        start += n
        check_round(be, drafter, kv, refs[r], int(ctx["anchors"][r]))
    kv.free()
    return drafter


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_format_matches_peer_numpy(case, numpy_backend, saved, target):
    drafter = run_case(case, numpy_backend, saved, target)
    cfg = drafter.config
    mask_fill = ("dflash", "dflash2", "dflash-sliding-and-full", "speculators-dflash", "speculators-dflash2",
                 "speculators-dspark-rnn-mask_fill-conf_hidden", "dflash2-qwen3_8-sliding", "dflash2-qwen3_8-sliding-d2t")
    assert cfg.harvest == ("mask_fill" if case.name in mask_fill else "shifted")


@pytest.mark.parametrize("case", [c for c in CASES if c.name in SIMT_CASES], ids=repr)
def test_format_matches_peer_simt(case, simt, saved, target):
    run_case(case, simt, saved, target)


@pytest.mark.parametrize("case", [c for c in CASES if c.name in SIMT_CASES], ids=repr)
def test_format_matches_peer_on_the_cuda_path(case, saved, target):
    """The `cuda` backend's code path, on the CuPy stand-in (dspark.backends.contract)."""
    from dspark.backends import contract
    run_case(case, contract.backend(), saved, target)


def test_deepspec_copies_of_the_target_are_shared(numpy_backend, saved, target):
    """DeepSpec stores copies of the target's embedding and LM head: equal ones are not loaded
    twice; a trained-apart one is the drafter's own."""
    shared = load_drafter(saved["deepspec-vanilla-conf_markov"][2], target.standin(numpy_backend, (-1, 1, 3)))
    own = load_drafter(saved["deepspec-gated-conf_hidden-own_copies"][2], target.standin(numpy_backend, (0, 4)))
    assert not shared.config.own_embed and not shared.config.own_head and shared.config.own_norm
    assert own.config.own_embed and own.config.own_head


# ---- malformed checkpoints: one error naming the field, nothing allocated ------------------------
def _copy(saved, name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(saved[name][2], dst)
    return dst


def _edit_tensors(path, drop=(), put=None):
    from safetensors.numpy import load_file, save_file
    w = load_file(str(path / "model.safetensors"))
    for k in drop:
        del w[k]
    w.update(put or {})
    save_file(w, str(path / "model.safetensors"))


MALFORMED = [
    # (fixture, config edits, tensor edits, expected error, words the message must contain)
    ("deepspec-vanilla-conf_markov", {"target_layer_ids": [-1, 1, 6]}, None, CheckpointError, "target_layer_ids[2]=6"),
    ("deepspec-vanilla-conf_markov", {"target_layer_ids": [-2, 1, 3]}, None, CheckpointError, "target_layer_ids[0]=-2"),
    ("deepspec-vanilla-conf_markov", {"target_layer_ids": [-1, 1, 5]}, None, CheckpointError,
     "target_layer_ids[2]=5"),   # the last layer: transformers' hidden_states[L] is normed
    ("deepspec-vanilla-conf_markov", {"mask_token_id": 300}, None, CheckpointError, "mask_token_id=300"),
    ("deepspec-vanilla-conf_markov", {"num_target_layers": 8}, None, CheckpointError, "num_target_layers=8"),
    ("deepspec-vanilla-conf_markov", {"vocab_size": 301}, None, CheckpointError, "vocab_size=301"),
    ("deepspec-vanilla-conf_markov", None, {"drop": ["markov_head.markov_w2.weight"]}, CheckpointError,
     "markov_head.markov_w2.weight"),
    ("deepspec-gated-conf_hidden-own_copies", None, {"drop": ["markov_head.gate_proj.bias"]}, CheckpointError,
     "markov_head_type"),
    ("deepspec-rnn-no_conf", None, {"put": {"confidence_head.proj.weight": np.zeros((1, 64), np.float32)}},
     CheckpointError, "confidence_head.proj.weight"),
    ("deepspec-vanilla-conf_markov", None, {"put": {"fc.weight": np.zeros((64, 128), np.float32)}}, ShapeError,
     "fc.weight"),
    ("dflash", {"dflash_config__mask_token_id": -3}, None, CheckpointError, "mask_token_id=-3"),
    ("dflash", {"head_dim": 96}, None, CheckpointError, "head_dim=96: the attention kernels take"),   # HEAD_DIMS
    ("dflash", {"dflash_config__mask_token_id": None}, None, CheckpointError, "mask_token_id is missing"),
    ("dflash", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4}, None, CheckpointError,
     "layer_types[0]='sliding_attention'"),
    ("dflash", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 5000.0, "factor": 2.0}}, None,
     CheckpointError, "rope_type='dynamic'"),
    ("dflash", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 2.0}}, None,
     CheckpointError, "rope_type='yarn' needs original_max_position_embeddings"),
    # DeepSpec's Qwen3.8 DSpark: a draft layer other than full attention, a missing DSpark field, a
    # partial RoPE under YaRN (transformers' YaRN would rotate a quarter of each head), another draft
    ("deepspec-qwen3_8-yarn", {"layer_types": ["sliding_attention"], "sliding_window": 4}, None, CheckpointError,
     "layer_types[0]='sliding_attention'"),
    ("deepspec-qwen3_8-yarn", {"layer_types": ["linear_attention"]}, None, CheckpointError,
     "layer_types[0]='linear_attention'"),
    ("deepspec-qwen3_8-yarn", {"mask_token_id": None}, None, CheckpointError, "mask_token_id is missing"),
    ("deepspec-qwen3_8-yarn", {"markov_rank": None}, None, CheckpointError, "markov_rank is missing"),
    ("deepspec-qwen3_8-yarn", {"block_size": None}, None, CheckpointError, "block_size is missing"),
    ("deepspec-qwen3_8-yarn", {"rope_parameters__partial_rotary_factor": 0.25}, None, CheckpointError,
     "partial_rotary_factor=0.25: the drafter's Qwen3 layers rotate the whole head"),
    ("deepspec-qwen3_8-yarn", {"deepspec_draft_rope": "partial_head"}, None, CheckpointError,
     "deepspec_draft_rope='partial_head'"),
    ("deepspec-qwen3_8-yarn", {"model_type": "qwen3_next"}, None, CheckpointError, "model_type='qwen3_next'"),
    ("deepspec-qwen3_8-yarn", {"num_target_layers": 64}, None, CheckpointError, "num_target_layers=64"),
    ("deepspec-qwen3_8-yarn", {"attention_bias": True}, None, CheckpointError, "attention_bias=true"),
    # DeepSpec's DFlash2 for Qwen3.8: a sliding layer whose causality is left to dflash's default
    # (causal), a window of 0, a trimmed vocabulary without its map
    ("dflash2-qwen3_8-sliding", {"is_causal": None}, None, CheckpointError,
     "layer_types[0]='sliding_attention' (causal inside the block)"),
    ("dflash2-qwen3_8-sliding", {"sliding_window": 0}, None, CheckpointError, "layer_types[0]='sliding_attention'"),
    ("dflash2-qwen3_8-sliding-d2t", None, {"drop": ["d2t"]}, CheckpointError, "'d2t' is missing"),
    ("dflash2-qwen3_8-sliding-d2t", {"dflash_config__draft_vocab_size": 121}, None, ShapeError, "lm_head.weight"),
    ("speculators-dflash", {"aux_hidden_state_layer_ids": [2, 7]}, None, CheckpointError,
     "aux_hidden_state_layer_ids[1]=7"),
    ("speculators-dflash", {"speculators_model_type": "eagle3"}, None, CheckpointError, "eagle3"),
    ("speculators-dspark-vanilla-draft_vocab", None, {"drop": ["d2t"]}, CheckpointError, "'d2t' is missing"),
]


@pytest.mark.parametrize("fixture,config,tensors,error,words", MALFORMED,
                         ids=[f"{m[0]}:{m[4]}" for m in MALFORMED])
def test_malformed_drafter_names_the_field(fixture, config, tensors, error, words, numpy_backend, saved, target,
                                          tmp_path):
    path = _copy(saved, fixture, tmp_path)
    if config:
        peers.edit_config(path, **config)
    if tensors:
        _edit_tensors(path, **tensors)
    case = next(c for c in CASES if c.name == fixture)
    standin = target.standin(numpy_backend, taps_for(case))
    before = numpy_backend.alloc.owners()
    with pytest.raises(error) as e:
        load_drafter(path, standin, numpy_backend)
    assert words in str(e.value)
    assert numpy_backend.alloc.owners() == before, "a rejected drafter allocated on the backend"


@pytest.mark.parametrize("fixture", ["deepspec-vanilla-conf_markov", "deepspec-qwen3_8-yarn"])
def test_hidden_size_unlike_the_targets(numpy_backend, saved, target, tmp_path, fixture):
    """The drafter's hidden size against a target of another width: named before any tensor is read."""
    standin = target.standin(numpy_backend, (-1, 1, 3))
    standin.config.d_model = 96
    before = numpy_backend.alloc.owners()
    with pytest.raises(CheckpointError, match="hidden_size=64 differs from the target's 96"):
        load_drafter(saved[fixture][2], standin, numpy_backend)
    assert numpy_backend.alloc.owners() == before


def test_qwen3_5_text_drafts_ignore_the_targets_keys_by_rule(numpy_backend, saved, target):
    """DeepSpec's Qwen3.6 / Qwen3.8 drafts keep the target's text config: the keys only the target
    reads (its gdn layers, mrope sections, the default RoPE's partial factor) are ignored by rule
    and named in drafter.source; the draft's own RoPE is honoured (YaRN) over the whole head."""
    q38 = load_drafter(saved["deepspec-qwen3_8-yarn"][2], target.standin(numpy_backend, (-1, 1, 3)))
    q36 = load_drafter(saved["deepspec-qwen3_6-two_layers-own_copies"][2], target.standin(numpy_backend, (0, 4)))
    linear = ["linear_conv_kernel_dim", "linear_key_head_dim", "linear_num_key_heads", "linear_num_value_heads",
              "linear_value_head_dim"]
    assert q38.source.endswith("ignored target-only config keys: " + ", ".join(linear))
    assert q36.source.endswith("ignored target-only config keys: " + ", ".join(
        linear + ["partial_rotary_factor", "rope_parameters.mrope_interleaved", "rope_parameters.mrope_section",
                  "rope_parameters.partial_rotary_factor"]))
    assert dict(q38.config.rope_scaling)["rope_type"] == "yarn" and q36.config.rope_scaling == ()
    assert q38.config.rope_theta == q36.config.rope_theta == 1e7 and q38.config.head_dim == 256


def test_unknown_tensor_is_an_error(numpy_backend, saved, target, tmp_path):
    path = _copy(saved, "dflash", tmp_path)
    _edit_tensors(path, put={"layers.0.self_attn.g_proj.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(CheckpointError, match="'layers.0.self_attn.g_proj.weight' matches nothing"):
        load_drafter(path, target.standin(numpy_backend, (1, 3)), numpy_backend)


def test_bf16_sharded_checkpoint_loads_exactly(numpy_backend, saved, target, tmp_path):
    """Released drafters are bf16 and may be sharded (model.safetensors.index.json): every tensor
    arrives as the exact f32 widening of the stored bf16."""
    model = saved["dflash"][0]
    bf16 = type(model)(model.config).to(torch.bfloat16)
    bf16.load_state_dict(model.state_dict())
    bf16.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    drafter = load_drafter(tmp_path, target.standin(numpy_backend, (1, 3)), numpy_backend)
    np.testing.assert_array_equal(drafter.host_weights["fc"], bf16.fc.weight.detach().float().numpy().T)
    np.testing.assert_array_equal(drafter.host_weights["layers.1.attn.k_norm"],
                                  bf16.layers[1].self_attn.k_norm.weight.detach().float().numpy())


def test_format_detection_reads_the_peers_configs(saved):
    from dspark.models.hf.drafter_formats import detect
    for name, (_, fmt, path) in saved.items():
        assert detect(json.loads((path / "config.json").read_text())) == fmt, name
