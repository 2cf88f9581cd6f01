"""The shipped default pair: configs, sizes, and NumPy parity with the training mirror's logits
(parity.npz). Runs without torch: CI need not install it."""

import json

import numpy as np
import pytest

from dspark import get_backend
from dspark.models import DrafterConfig, TrunkConfig, load_default
from dspark.models.config import from_json, to_json
from dspark.models.default import DEFAULT_DIR
from dspark.models.weights import drafter_spec, load_tensors, trunk_spec
from dspark.train import parity

MAX_WEIGHT_BYTES = 8_000_000

@pytest.fixture(scope="module")
def pair():
    return load_default(get_backend("numpy"))


def test_configs_load_and_validate():
    t = from_json(DEFAULT_DIR / "trunk.json", TrunkConfig)
    d = from_json(DEFAULT_DIR / "drafter.json", DrafterConfig)
    # written exactly as config.to_json writes them
    assert (DEFAULT_DIR / "trunk.json").read_text() == to_json(t)
    assert (DEFAULT_DIR / "drafter.json").read_text() == to_json(d)
    assert d.d_model == t.d_model
    assert t.head_dim in (64, 128) and d.head_dim in (64, 128)
    assert json.loads((DEFAULT_DIR / "trunk.json").read_text())["kind"] == "TrunkConfig"
    for name, spec in (("trunk", trunk_spec(t)), ("drafter", drafter_spec(d, t))):
        w = load_tensors(DEFAULT_DIR / f"{name}.safetensors")
        assert {k: tuple(v.shape) for k, v in w.items()} == spec
        assert all(v.dtype == np.float32 and np.isfinite(v).all() for v in w.values())


def test_shipped_weights_fit_the_size_budget():
    total = sum((DEFAULT_DIR / f).stat().st_size for f in ("trunk.safetensors", "drafter.safetensors"))
    assert total <= MAX_WEIGHT_BYTES, f"{total} bytes of weights, budget {MAX_WEIGHT_BYTES}"


def test_record_is_shipped():
    text = (DEFAULT_DIR / "RECORD.md").read_text()
    assert "held-out" in text.lower()


def test_numpy_trunk_reproduces_parity_logits(pair):
    trunk, _ = pair
    ref = np.load(DEFAULT_DIR / "parity.npz")
    for i, ids in enumerate(ref["ids"]):
        logits, _ = parity.numpy_trunk(trunk, ids)
        want = ref["trunk_logits"][i]
        assert parity.max_excess(logits, want) <= 0, f"sequence {i}: max |diff| {np.abs(logits - want).max():.3g}"
        assert (logits.argmax(-1) == want.argmax(-1)).mean() > 0.99


def test_numpy_drafter_reproduces_parity_block(pair):
    trunk, drafter = pair
    ref = np.load(DEFAULT_DIR / "parity.npz")
    for i, ids in enumerate(ref["ids"]):
        for j, pos in enumerate(ref["anchors"][i]):
            got = parity.numpy_block(trunk, drafter, ids, int(pos))
            for name, value in got.items():
                want = ref[f"block_{name}"][i, j]
                assert parity.max_excess(value, want) <= 0, \
                    f"sequence {i} anchor {pos} {name}: max |diff| {np.abs(value - want).max():.3g}"


def test_parity_catches_a_wrong_weight():
    """Mutation: 10% on one attention output projection must break trunk parity."""
    from dspark.models import HybridTrunk
    t = from_json(DEFAULT_DIR / "trunk.json", TrunkConfig)
    w = load_tensors(DEFAULT_DIR / "trunk.safetensors")
    attn = next(i for i, kind in enumerate(t.layers) if kind == "attn")
    w[f"layers.{attn}.attn.wo"] = w[f"layers.{attn}.attn.wo"] * np.float32(1.1)
    ref = np.load(DEFAULT_DIR / "parity.npz")
    logits, _ = parity.numpy_trunk(HybridTrunk(t, w, get_backend("numpy")), ref["ids"][0])
    assert parity.max_excess(logits, ref["trunk_logits"][0]) > 0
