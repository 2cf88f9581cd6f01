"""The seed's own pair, scaled down: a Qwen3.8-27B-structured target (hf_models.QWEN3_8: the 3 gdn +
1 full attention pattern, heads of 256 with partial RoPE 0.25, gdn value heads three per key head)
saved by transformers, with DeepSpec's two drafter exports for it, built as DeepSpec builds them
(tests/models/drafter_peers.py):

* "dspark": the Qwen3.8 DSpark draft (Qwen3 full-attention layers at head dim 256 in the target's
  copied qwen3_5_text config, its target-only keys left in) with YaRN RoPE, as the seed's export;
* "dflash2": the Qwen3.8 DFlash2 (Qwen3 layers of head dim 128, every one a non-causal sliding
  window, verification block 8), dflash's own DFlash2DraftModel, a window (WINDOW) several times
  below the context so that it bites;
* "dflash2-d2t": the same with the served configuration's trimmed draft vocabulary and its d2t.

Checked: the trunk's logits against transformers'; greedy speculative == plain for each drafter;
round by round, dflash.model.dflash_generate's output, verified blocks and accepted lengths equal
dspark's under verify="full" for both DFlash2 drafters (on ExactCache, where dflash_generate is
exact on a hybrid target: test_drafter_e2e's module doc), and the DSpark draft's proposals equal
the DeepSpec peer's draft step; the block pass's hidden rows within 1e-4 of the peers' in every
round; the draft KV of a windowed drafter is a ring of window + block rows at a context several
times the window (the allocator's counts), and a prompt-end capture restores it.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from tests.peers import peer

torch = peer("torch")
peer("transformers")
peer("dflash.model")

from dspark.decode import plain_generate  # noqa: E402
from dspark.models.hf import load_drafter  # noqa: E402
from dspark.session import DsparkSpecSession, SpecParams  # noqa: E402
from tests.models import drafter_peers as peers  # noqa: E402
from tests.models.hf_models import QWEN3_8, assert_logits_close, hf_logits  # noqa: E402
from tests.models.test_drafter_e2e import (MIN_MEAN, N, assert_hidden_close, boost, oracle,  # noqa: E402
                                           run_dflash_generate, run_session, saved_world, target_taps)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 6                     # the DFlash2 layers' sliding window (Qwen3.8's: 2048)
TAPS = (0, 2)                  # not the trunk's default taps (1, 3); layer 3's output is normed in HF


@pytest.fixture(scope="module")
def seed(tmp_path_factory, numpy_backend):
    """The target (directory, transformers' model, dspark's trunk on numpy, a prompt and its plain
    greedy stream) and the three drafters, each saved by its peer's save_pretrained."""
    made = {
        "dspark": lambda model, sizes, seed: peers.deepspec_qwen35_model(seed, model.config, taps=TAPS, rope=peers.YARN,
                                                                         target=model, sizes=sizes),
        "dflash2": lambda model, sizes, seed: peers.dflash2_qwen3_8_model(seed, window=WINDOW, taps=TAPS, block=8,
                                                                          sizes=sizes),
        "dflash2-d2t": lambda model, sizes, seed: peers.dflash2_qwen3_8_model(seed, window=WINDOW, taps=TAPS, block=8,
                                                                              draft_vocab=280, sizes=sizes),
    }
    return saved_world(tmp_path_factory.mktemp(QWEN3_8.name), QWEN3_8, numpy_backend,
                       lambda layers: {name: (make, TAPS) for name, make in made.items()})


def test_the_target_is_transformers_qwen3_5(seed):
    """The Qwen3.8-structured trunk's logits within 1e-4 of transformers' (prefill and decode)."""
    steps = seed.want[:3]
    want = hf_logits(seed.model, seed.prompt, steps)
    cache = seed.trunk.new_cache(owner="test/cache")
    got = [seed.trunk.be.to_host(seed.trunk.prefill(cache, seed.prompt).logits)]
    for tok in steps:
        got.append(seed.trunk.be.to_host(seed.trunk.decode([cache], [tok]).logits)[0])
    cache.free()
    for i, (g, w) in enumerate(zip(got, want)):
        assert_logits_close(g, w, f"step {i}")


def test_the_exports_load_as_the_seed_serves_them(seed):
    """What each export is, in dspark's terms (drafter.source and config)."""
    dspark, dflash2, trimmed = (load_drafter(seed.drafters[n].path, seed.trunk) for n in seed.drafters)
    assert "DeepSpec DSpark drafter from" in dspark.source and "(Qwen3_8DSparkModel, block 4" in dspark.source
    assert "RoPE yarn" in dspark.source and " tensors (F32 " in dspark.source and " on numpy)" in dspark.source
    assert "ignored target-only config keys: linear_conv_kernel_dim" in dspark.source
    assert (dspark.config.head_dim, dflash2.config.head_dim) == (256, 128)
    assert dflash2.windows == (WINDOW, WINDOW) and dflash2.window_modes == ("row", "row")
    assert (dflash2.config.block, dflash2.config.drafts) == (8, 7)
    assert trimmed.config.draft_vocab == 280 and trimmed.config.markov == "selector"


@pytest.mark.parametrize("name", ["dspark", "dflash2", "dflash2-d2t"])
def test_greedy_speculative_equals_plain(seed, name, monkeypatch):
    """Byte-identical to plain greedy under verify full and auto; the boosts are taken."""
    drafter = oracle(seed, name)
    for verify in ("full", "auto"):
        s, rounds = run_session(seed.trunk, drafter, seed.prompt, verify, monkeypatch)
        assert s.emitted == seed.want[:N], verify
        if verify == "full":
            assert s.stats.mean_accepted_length >= MIN_MEAN, s.stats.summary()
            assert any(0 < m < drafter.config.drafts for _, _, m, _ in rounds), "no partial accepts"
        s.close()


@pytest.mark.parametrize("name", ["dflash2", "dflash2-d2t"])
def test_rounds_equal_dflash_generate(seed, name, monkeypatch):
    """dflash_generate (its own loop, its own per-row sliding mask) and dspark under verify="full":
    the same output, the same verified block and accepted count in every round, the draft rows'
    hidden states within 1e-4, at a context several times the window."""
    theirs, accepted, blocks, hidden = run_dflash_generate(seed, name, N + 9, monkeypatch)
    s, rounds = run_session(seed.trunk, oracle(seed, name), seed.prompt, "full", monkeypatch)
    assert s.emitted == theirs[:N] == seed.want[:N]
    assert rounds[-1][0] >= 4 * WINDOW
    for r, (start, block, m, h) in enumerate(rounds):
        assert_hidden_close(h[1:], hidden[r], f"round {r} at {start}")
        assert (block, m) == (blocks[r], accepted[r]), f"round {r} at {start}: verified {block}, accepted {m}; " \
                                                      f"dflash_generate {blocks[r]}, {accepted[r]}"


def test_dspark_rounds_equal_the_deepspec_draft_step(seed, monkeypatch):
    """The Qwen3.8 DSpark draft (YaRN) under verify="full": each round's proposals equal DeepSpec's
    draft step (drafter_peers.deepspec_round) on transformers' hidden states of the committed
    rows, its hidden rows within 1e-4."""
    d = seed.drafters["dspark"]
    s, rounds = run_session(seed.trunk, oracle(seed, "dspark"), seed.prompt, "full", monkeypatch)
    stream, seq = [*seed.prompt.tolist(), *seed.want], [*seed.prompt.tolist(), *s.emitted]
    ctx = target_taps(seed.model, seq, d.taps)
    cache, seen = peers.deepspec_cache(), 0
    for r, (start, block, _, hidden) in enumerate(rounds):
        ref = peers.deepspec_round(d.peer, cache, ctx[seen:start][None], block[0], start,
                                   partial(boost, stream=stream, start=start, first=0))
        seen = start
        assert_hidden_close(hidden, ref[0], f"round {r} at {start}")
        assert block[1:] == ref[2], f"round {r} at {start}: proposals {block[1:]}, DeepSpec's {ref[2]}"


def test_windowed_draft_kv_is_a_ring_of_window_plus_block_rows(seed, numpy_backend):
    """At contexts of 5 and 9 windows (prompt and all), a windowed drafter's draft KV holds window
    + block rows per layer, K and V, whatever the context, as the allocator counts it; a
    full-attention drafter's holds the trunk's whole context. The session is still exact."""
    windowed, full = (load_drafter(seed.drafters[n].path, seed.trunk) for n in ("dflash2", "dspark"))
    c = windowed.config
    ring_bytes = 2 * c.layers * c.kv_heads * (WINDOW + c.block) * c.head_dim * 4
    for prompt_len in (5 * WINDOW, 9 * WINDOW):
        prompt = np.resize(seed.prompt, prompt_len)
        s = DsparkSpecSession.prime(seed.trunk, windowed, prompt, SpecParams(max_new_tokens=8, verify="full"))
        assert numpy_backend.alloc.bytes(f"{s.owner}/draft_kv") == ring_bytes
        while not s.finished():
            s.burst()
        assert s.emitted == plain_generate(seed.trunk, prompt, 8)
        assert numpy_backend.alloc.bytes(f"{s.owner}/draft_kv") == ring_bytes
        s.close()
    s = DsparkSpecSession.prime(seed.trunk, full, seed.prompt, SpecParams(max_new_tokens=1))
    f = full.config
    assert numpy_backend.alloc.bytes(f"{s.owner}/draft_kv") == \
        2 * f.layers * f.kv_heads * (seed.trunk.config.max_ctx + f.block) * f.head_dim * 4
    s.close()


def test_capture_restores_a_wrapped_ring(seed, numpy_backend):
    """A prompt-end capture of a windowed drafter's ring (the prompt wrapped it twice) restores a
    session byte for byte, proposals and acceptance included."""
    drafter = load_drafter(seed.drafters["dflash2"].path, seed.trunk)
    prompt = np.resize(seed.prompt, 5 * WINDOW)
    params = SpecParams(max_new_tokens=16, verify="full")
    cold = DsparkSpecSession.prime(seed.trunk, drafter, prompt, params)
    cap = cold.take_prefix_capture()
    warm = DsparkSpecSession.restore(seed.trunk, drafter, cap, params)
    for s in (cold, warm):
        while not s.finished():
            s.burst()
    assert cold.emitted == warm.emitted == plain_generate(seed.trunk, prompt, 16)
    assert cold.stats.histogram == warm.stats.histogram and cold.stats.drafted == warm.stats.drafted
    for s in (cold, warm):
        s.close()
    cap.free()
