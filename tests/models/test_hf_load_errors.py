"""Checkpoints load_target cannot serve get one CheckpointError naming the config key or tensor,
and nothing is allocated on the backend; what it skips by rule it reports, and what it loads it
shows (a progress bar on a terminal) and says in one line."""

import io
import json
import shutil
import sys

import numpy as np
import pytest

from dspark.models.hf import CheckpointError, load_target
from dspark.models.hf.checkpoint import Checkpoint
from dspark.models.hf.target import size_text
from tests.models.hf_models import CASES, build, require_transformers

BASE = {"qwen3": CASES[0], "qwen3_5_text": next(c for c in CASES if c.family == "qwen3_5_text"),
        "sharded": next(c for c in CASES if c.family == "qwen3_5")}


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    out = {}
    for key, case in BASE.items():
        out[key] = tmp_path_factory.mktemp(f"orig-{key}")
        build(case, out[key])
    return out


@pytest.fixture
def copy_of(originals, tmp_path):
    copies = iter(range(1000))

    def make(key):
        d = tmp_path / f"{key}-{next(copies)}"
        shutil.copytree(originals[key], d)
        return d
    return make


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def edit_tensors(d, mutate):
    """Rewrite the single model.safetensors after mutate(dict of arrays)."""
    from safetensors.numpy import save_file
    ckpt = Checkpoint(d)
    tensors = {k: np.array(ckpt.array(k)) for k in ckpt.tensors}
    mutate(tensors)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


def refused(be, d, match, **kw):
    before = be.alloc.owners()
    with pytest.raises(CheckpointError, match=match):
        load_target(d, be, **kw)
    assert be.alloc.owners() == before, "a refused load allocated on the backend"


QWEN3_CONFIG_REFUSALS = [
    (dict(model_type="qwen2_moe"), r"model_type='qwen2_moe': dspark serves qwen3, qwen3_5, qwen3_5_text, qwen3_moe"),
    (dict(model_type="llama"), r"model_type='llama': dspark serves qwen3, qwen3_5, qwen3_5_text"),
    (dict(model_type=None), r"model_type=None: dspark serves"),
    (dict(attention_bias=True), r"config attention_bias=True: dspark serves attention_bias=False only"),
    (dict(hidden_act="gelu"), r"config hidden_act='gelu': dspark serves hidden_act='silu' only"),
    (dict(use_sliding_window=True), r"config use_sliding_window=True"),
    (dict(layer_types=["full_attention", "sliding_attention", "full_attention"]),
     r"config layer_types has 'sliding_attention': dspark serves full_attention"),
    (dict(layer_types=["full_attention"]), r"layer_types has 1 entries: expected num_hidden_layers=3"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
     r"config rope_type='dynamic': dspark serves default, linear and yarn"),
    (dict(hidden_size=None), r"config.json of model_type 'qwen3' has no 'hidden_size'"),
    (dict(num_attention_heads=3), r"attn_heads=3 must be a multiple of attn_kv_heads=2"),
    (dict(head_dim=96), r"config head_dim=96: the attention kernel serves 64, 128"),
]


@pytest.mark.parametrize("changes,match", QWEN3_CONFIG_REFUSALS, ids=[next(iter(c)) for c, _ in QWEN3_CONFIG_REFUSALS])
def test_config_refusals(numpy_backend, copy_of, changes, match):
    d = copy_of("qwen3")
    edit_config(d, **changes)
    refused(numpy_backend, d, match)


def test_qwen3_5_config_refusals(numpy_backend, copy_of):
    d = copy_of("qwen3_5_text")
    edit_config(d, model_type="qwen3_5_moe")  # the multimodal MoE checkpoint nests its text config
    refused(numpy_backend, d, "config.json of model_type 'qwen3_5_moe' has no text_config")
    edit_config(d, model_type="qwen3_5_text", linear_conv_kernel_dim=3)
    refused(numpy_backend, d, "linear_conv_kernel_dim=3: the gdn kernels implement 4")
    edit_config(d, linear_conv_kernel_dim=4, linear_num_key_heads=3)
    refused(numpy_backend, d, "gdn_heads=4 must be a multiple of gdn_k_heads=3")
    edit_config(d, linear_num_key_heads=2, linear_key_head_dim=48)
    refused(numpy_backend, d, r"linear_key_head_dim=48, linear_value_head_dim=32: the gdn kernels refuse them "
                              r"\(dk=48: expected one of 16, 32, 64, 128\)")
    edit_config(d, linear_key_head_dim=128, linear_value_head_dim=256)
    refused(numpy_backend, d, "dv=256 with dk=128 needs 1024 threads per head")
    edit_config(d, linear_key_head_dim=16, linear_value_head_dim=32, model_type="qwen3_5")  # no text_config
    refused(numpy_backend, d, "has no text_config")


TENSOR_REFUSALS = [
    (lambda w: w.pop("model.layers.1.mlp.up_proj.weight"),
     r"tensor 'model.layers.1.mlp.up_proj.weight' is missing from .* \(1 missing in all\)"),
    (lambda w: w.update({"model.layers.0.self_attn.q_proj.weight": np.zeros((64, 64), np.float32)}),
     r"tensor 'model.layers.0.self_attn.q_proj.weight' has shape \(64, 64\): expected \(256, 64\)"),
    (lambda w: w.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(256, np.float32)}),
     r"unknown tensor 'model.layers.0.self_attn.q_proj.bias'"),
    (lambda w: w.update({"model.visual.blocks.0.attn.qkv.weight": np.zeros((4, 4), np.float32)}),
     r"unknown tensor 'model.visual.blocks.0.attn.qkv.weight'"),  # skipped only where a vision tower belongs
    (lambda w: w.update({"model.norm.weight": w["model.norm.weight"].astype(np.float64)}),
     r"tensor 'model.norm.weight' has dtype F64: expected F32, F16 or BF16"),
    (lambda w: w.update({"model.embed_tokens.weight": w["model.embed_tokens.weight"].astype(np.int8)}),
     r"tensor 'model.embed_tokens.weight' has dtype I8"),
    (lambda w: w.pop("model.embed_tokens.weight"), r"tensor 'model.embed_tokens.weight' is missing"),
]


@pytest.mark.parametrize("mutate,match", TENSOR_REFUSALS,
                         ids=["missing", "misshaped", "unknown", "vision-in-qwen3", "f64", "int8", "no-embedding"])
def test_tensor_refusals(numpy_backend, copy_of, mutate, match):
    d = copy_of("qwen3")
    edit_tensors(d, mutate)
    refused(numpy_backend, d, match)


def test_file_refusals(numpy_backend, copy_of, tmp_path):
    be = numpy_backend
    d = copy_of("qwen3")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    refused(be, d, r"no model.safetensors or model.safetensors.index.json \(found pytorch_model.bin: only "
                   r"safetensors are read\)")
    (d / "config.json").unlink()
    refused(be, d, "config.json is missing")
    s = copy_of("sharded")
    index = json.loads((s / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (s / shard).unlink()
    refused(be, s, f"lists shard '{shard}', which is missing")
    s2 = copy_of("sharded")
    name, file = next(iter(index["weight_map"].items()))
    other = next(f for f in index["weight_map"].values() if f != file)
    index["weight_map"][name] = other
    (s2 / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(be, s2, f"places tensor '{name}' in '{other}', which does not hold it")
    s3 = copy_of("sharded")
    (s3 / shard).write_bytes(b"\x10\x00")
    refused(be, s3, "too short for a safetensors file")
    refused(be, tmp_path / "no" / "such" / "dir", "expected a model directory")


def test_bad_dtype_argument(numpy_backend, originals):
    for bad in ("int8", "nonsense"):
        with pytest.raises(ValueError, match=f"dtype={bad!r}: expected float32, float16 or bfloat16"):
            load_target(originals["qwen3"], numpy_backend, dtype=bad)


def test_skipped_by_rule_and_reported(numpy_backend, copy_of, originals):
    """Multi-token-prediction tensors (qwen3_5*), the vision tower (qwen3_5) and a tied
    checkpoint's lm_head are skipped by rule, and the report says how many."""
    trunk = load_target(originals["sharded"], numpy_backend)
    assert trunk.source.skipped["model.visual."] > 10 and "skipped" in trunk.source.summary()
    d = copy_of("qwen3_5_text")
    edit_tensors(d, lambda w: w.update({"mtp.fc.weight": np.zeros((4, 8), np.float32),
                                        "mtp.norm.weight": np.zeros(4, np.float32)}))
    assert load_target(d, numpy_backend).source.skipped == {"mtp.": 2}
    t = copy_of("qwen3")
    edit_config(t, tie_word_embeddings=True)
    trunk = load_target(t, numpy_backend)  # lm_head.weight is in the file: ignored, as transformers ties
    assert trunk.config.tie_embeddings and trunk.source.skipped == {"lm_head.": 1}
    assert "lm_head.weight ignored" in trunk.source.summary()
    assert np.shares_memory(trunk.w["lm_head"], trunk.w["embed"])


def test_hub_ids_resolve_in_the_local_cache_only(numpy_backend, originals, tmp_path, monkeypatch):
    require_transformers()  # which brings huggingface_hub
    import huggingface_hub.constants as hub
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    refused(numpy_backend, "nobody/not-cached", r"path='nobody/not-cached': not a directory, and not in the local "
                                                r"Hugging Face cache")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tiny--qwen3"
    shutil.copytree(originals["qwen3"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    trunk = load_target("tiny/qwen3", numpy_backend)
    assert trunk.source.path == repo / "snapshots" / commit


class Terminal(io.StringIO):
    """A stderr that says it is a terminal (tqdm shows its bars on one)."""

    def isatty(self):
        return True


def test_load_shows_progress_by_shard_and_says_what_it_loaded(numpy_backend, originals, monkeypatch):
    """A load's bar (tqdm, on stderr) advances by each tensor's checkpoint bytes to the total and
    names each shard as it reads it; it shows on a terminal, not under DSPARK_PROGRESS=0 nor with
    progress=False (progress=True shows it anywhere); the one-line summary gives the dtypes read,
    the storage dtype and the bytes on the backend, as its allocator counts them."""
    import dspark.progress
    shards = sorted(p.name for p in originals["sharded"].glob("*.safetensors"))
    assert len(shards) > 1
    bars = []

    class Recorded(dspark.progress.tqdm):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.shown, self.updates, self.shards = not self.disable, [], []   # close() disables it
            bars.append(self)

        def update(self, n=1):
            self.updates.append(n)
            return super().update(n)

        def set_postfix_str(self, s="", refresh=True):
            self.shards.append(s)
            return super().set_postfix_str(s, refresh)

    monkeypatch.setattr(dspark.progress, "tqdm", Recorded)

    def load(**kw):
        bars.clear()
        err = Terminal()
        monkeypatch.setattr(sys, "stderr", err)
        before = numpy_backend.alloc.bytes("weights")
        trunk = load_target(originals["sharded"], numpy_backend, **kw)
        monkeypatch.setattr(sys, "stderr", sys.__stderr__)
        (bar,) = bars
        return trunk, bar, err.getvalue(), numpy_backend.alloc.bytes("weights") - before

    trunk, bar, shown, nbytes = load()
    assert bar.shown and "loading orig-sharded" in shown
    read = {n: i for n, i in Checkpoint(originals["sharded"]).tensors.items() if not n.startswith("model.visual.")}
    assert sum(bar.updates) == bar.total == sum(i.end - i.start for i in read.values()) and len(bar.updates) == len(read)
    assert sorted(set(bar.shards)) == sorted({i.file.name for i in read.values()})
    summary = trunk.source.summary()
    assert f"{len(read)} tensors (F32 {len(read)}) stored as float32" in summary
    assert trunk.source.device_bytes == nbytes > 0 and f"{size_text(nbytes)} on numpy" in summary
    assert not load(progress=False)[1].shown
    monkeypatch.setenv("DSPARK_PROGRESS", "0")
    assert not load()[1].shown and load(progress=True)[1].shown


def test_load_progress_stays_out_of_captured_output(numpy_backend, originals, capsys):
    load_target(originals["sharded"], numpy_backend)
    assert capsys.readouterr().err == ""
