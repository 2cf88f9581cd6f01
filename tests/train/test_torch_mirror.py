"""The torch mirror (dspark/train/torch_model.py) against the NumPy models on random small weights,
and the chunked gdn recurrence against the step loop. torch is a peer (tests.peers)."""

import dataclasses

import numpy as np
import pytest

from tests.peers import peer  # noqa: E402

torch = peer("torch")

from dspark import get_backend  # noqa: E402
from dspark.models import DrafterConfig, DsparkDrafter, HybridTrunk, TrunkConfig  # noqa: E402
from dspark.models.weights import drafter_spec, random_weights, trunk_spec  # noqa: E402
from dspark.train import parity, torch_gdn  # noqa: E402
from dspark.train.torch_model import TorchDrafter, TorchTrunk, as_tensors  # noqa: E402
from dspark.train.torch_parity import torch_block, torch_trunk  # noqa: E402

TRUNK = TrunkConfig(d_model=64, mlp_hidden=96, layers=("gdn", "attn", "gdn", "attn"), attn_heads=4, attn_kv_heads=2,
                    head_dim=64, gdn_heads=2, gdn_dk=16, gdn_dv=32, tap_layers=(1, 3), max_ctx=256)
DRAFTER = DrafterConfig(block=4, window=16, d_model=64, layers=2, heads=2, kv_heads=1, head_dim=64, mlp_hidden=96,
                        markov_rank=8)


def pair(seed=0, trunk_config=TRUNK):
    tw = random_weights(trunk_spec(trunk_config), seed)
    dw = random_weights(drafter_spec(DRAFTER, trunk_config), seed + 1)
    dw["markov.w2"] *= 3.0       # make the Markov and confidence heads matter
    dw["conf.w"] = np.random.default_rng(seed).standard_normal(dw["conf.w"].shape).astype(np.float32) * 0.2
    trunk = HybridTrunk(trunk_config, tw, get_backend("numpy"))
    drafter = DsparkDrafter(DRAFTER, dw, trunk)
    tt = TorchTrunk(trunk_config, as_tensors(tw))
    return trunk, drafter, tt, TorchDrafter(DRAFTER, tt, as_tensors(dw))


@pytest.mark.parametrize("tap_layers", [(1, 3), (3, -1)])  # in the config's order; -1: the embedding
def test_trunk_logits_and_taps_match_numpy(tap_layers):
    trunk, _, tt, _ = pair(trunk_config=dataclasses.replace(TRUNK, tap_layers=tap_layers))
    ids = np.random.default_rng(1).integers(0, 256, 70)
    want_logits, want_taps = torch_trunk(tt, ids)
    logits, taps = parity.numpy_trunk(trunk, ids)
    assert parity.max_excess(logits, want_logits) <= 0, np.abs(logits - want_logits).max()
    assert parity.max_excess(taps, want_taps) <= 0, np.abs(taps - want_taps).max()


@pytest.mark.parametrize("pos", [1, 9, 16, 40])   # before, at and past the window of 16
def test_drafter_block_matches_numpy(pos):
    trunk, drafter, _, td = pair(3)
    ids = np.random.default_rng(pos).integers(0, 256, 48)
    want = torch_block(td, ids, pos)
    got = parity.numpy_block(trunk, drafter, ids, pos)
    for name in want:
        assert parity.max_excess(got[name], want[name]) <= 0, (name, np.abs(got[name] - want[name]).max())


def test_step_decode_matches_whole_sequence():
    _, _, tt, _ = pair(trunk_config=dataclasses.replace(TRUNK, tap_layers=(3, -1)))
    ids = torch.from_numpy(np.random.default_rng(2).integers(0, 256, (2, 30)))
    full, full_taps = tt.forward(ids)
    _, _, st = tt.forward(ids[:, :10], state=True)
    steps = [tt.step(st, ids[:, j], j) for j in range(10, 30)]
    assert torch.allclose(torch.stack([s[0] for s in steps], 1), full[:, 10:], atol=1e-4, rtol=1e-4)
    assert torch.allclose(torch.stack([s[1] for s in steps], 1), full_taps[:, 10:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("T,chunk", [(1, 8), (19, 8), (64, 16), (99, 32)])
def test_chunked_gdn_equals_step_loop(T, chunk):
    g = torch.Generator().manual_seed(T)
    B, H, dk, dv = 2, 2, 16, 8
    x = torch.randn(B, T, H * (2 * dk + dv), generator=g, dtype=torch.float64)
    q, k, v = torch_gdn.qkv_heads(x, H, dk, dv)
    la, beta = torch_gdn.gates(torch.randn(B, T, H, generator=g, dtype=torch.float64),
                               torch.randn(B, T, H, generator=g, dtype=torch.float64),
                               torch.log(torch.rand(H, generator=g, dtype=torch.float64) * 15 + 1),
                               torch.full((H,), -3.0, dtype=torch.float64))
    S0 = torch.randn(B, H, dv, dk, generator=g, dtype=torch.float64)
    o1, S1 = torch_gdn.sequential(q, k, v, la, beta, S0)
    o2, S2 = torch_gdn.chunked(q, k, v, la, beta, S0, chunk=chunk)
    assert torch.allclose(o1, o2, atol=1e-10) and torch.allclose(S1, S2, atol=1e-10)


def test_gdn_pieces_match_reference():
    """gates and conv window against dspark/ops/gdn.py's reference functions."""
    from dspark.ops import gdn
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 3)).astype(np.float32) * 10, rng.standard_normal((5, 3)).astype(np.float32)
    A_log, dt = rng.standard_normal(3).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    alpha, beta = gdn.gdn_gates_ref(a, b, A_log, dt)
    la, tb = torch_gdn.gates(*(torch.from_numpy(z) for z in (a, b, A_log, dt)))
    np.testing.assert_allclose(np.exp(la.numpy()), alpha, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(tb.numpy(), beta, rtol=1e-6)
    w = rng.standard_normal((6, 4)).astype(np.float32)
    xs = rng.standard_normal((5, 6)).astype(np.float32)
    window = np.zeros((1, 6, 3), np.float32)
    want = []
    for t in range(5):
        y, window = gdn.conv_silu_ref(window, w, xs[t][None])
        want.append(y[0])
    got, win = torch_gdn.conv_silu(torch.from_numpy(xs)[None], torch.from_numpy(w))
    np.testing.assert_allclose(got[0].numpy(), np.stack(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(win.numpy(), window, rtol=0, atol=0)
