"""The reference trunk and drafter: row invariance (bitwise), backend agreement, weight files."""

import re
from dataclasses import replace

import numpy as np
import pytest

from dspark.decode import plain_generate
from dspark.errors import DTypeError, ShapeError, TokenRangeError
from dspark.models.config import TrunkConfig, from_json, to_json
from dspark.session import DsparkSpecSession, SpecParams
from dspark.models import DsparkDrafter, HybridTrunk
from dspark.ops import dense
from dspark.ops.linear import linear
from dspark.models.presets import QWEN35_CONVENTIONS, TINY_TRUNK, tiny_pair as small_pair

# every row-invariance property on the embedded trunk's conventions and on Qwen3.5's
CONVENTIONS = pytest.mark.parametrize("conventions", [{}, QWEN35_CONVENTIONS], ids=["toy", "qwen3_5"])


def prompt(rng, n, vocab=256):
    return rng.integers(0, vocab, n).astype(np.int32)


def same(be, a, b) -> bool:
    """Bitwise equality of two backend arrays."""
    return np.array_equal(be.to_host(a), be.to_host(b))


@CONVENTIONS
def test_verify_column_equals_decode_step(model_backend, rng, conventions):
    trunk, _ = small_pair(model_backend, seed=int(rng.integers(1000)), **conventions)
    p = prompt(rng, int(rng.integers(3, 70)))
    a, b = trunk.new_cache(), trunk.new_cache()
    trunk.prefill(a, p)
    trunk.prefill(b, p)
    cand = prompt(rng, 6)
    before = [model_backend.to_host(x).copy() for x in a.recurrent()]
    verify = trunk.verify([a], [cand])
    for j, tok in enumerate(cand):
        step = trunk.decode([b], [tok])
        assert same(model_backend, verify.logits[j], step.logits[0]), j
        assert same(model_backend, verify.taps[j], step.taps[0]), j
    # a verify never writes the recurrent state; selecting its last checkpoint, or replaying all
    # its columns, gives the state after the same decode steps
    assert all(np.array_equal(model_backend.to_host(x), y) for x, y in zip(a.recurrent(), before))
    replayed = trunk.new_cache()
    trunk.prefill(replayed, p)
    trunk.replay([replayed], verify, np.array([0]), np.array([len(cand)], np.int32))
    trunk.select([a], verify, [len(cand)])
    for sa, sr, sb in zip(a.recurrent(), replayed.recurrent(), b.recurrent()):
        assert same(model_backend, sa, sb) and same(model_backend, sr, sb)


@CONVENTIONS
@pytest.mark.parametrize("others", [1, 3, 7])
def test_decode_is_the_same_alone_and_batched(model_backend, rng, others, conventions):
    trunk, _ = small_pair(model_backend, seed=3, **conventions)
    lens = rng.integers(1, 60, others + 1)
    prompts = [prompt(rng, int(n)) for n in lens]
    alone, batch = trunk.new_cache(), [trunk.new_cache() for _ in prompts]
    trunk.prefill(alone, prompts[0])
    for c, p in zip(batch, prompts):
        trunk.prefill(c, p)
    order = rng.permutation(len(batch))  # the session of interest sits anywhere in the batch
    tok = prompt(rng, len(batch))
    solo = trunk.decode([alone], [tok[0]])
    both = trunk.decode([batch[i] for i in order], [tok[i] for i in order])
    row = int(np.flatnonzero(order == 0)[0])
    assert same(model_backend, solo.logits[0], both.logits[row])


@CONVENTIONS
def test_prefill_equals_token_by_token(model_backend, rng, conventions):
    """numpy prefills with the sequential gdn scan: bitwise the decode steps. The kernel backends
    run the prompt's gdn layers in chunks of 64 (dspark.ops.gdn_chunk): the logits and state within
    CHUNK_TOLERANCE of decoding token by token (K/V rows, from the attention layers' row-invariant
    products of nearby inputs, within it too); its own exactness is split invariance
    (test_prompt_passes_equal_one_pass)."""
    from dspark.ops.gdn_chunk import CHUNK_TOLERANCE
    trunk, _ = small_pair(model_backend, seed=5, **conventions)
    p = prompt(rng, 70)
    a, b = trunk.new_cache(), trunk.new_cache()
    full = model_backend.to_host(trunk.prefill(a, p).logits)
    steps = np.concatenate([model_backend.to_host(trunk.decode([b], [t]).logits) for t in p])
    assert a.pos == b.pos == 70
    if not trunk.chunked_gdn:
        assert np.array_equal(full, steps)
        for x, y in zip(a.k + a.v + a.recurrent(), b.k + b.v + b.recurrent()):
            assert same(model_backend, x, y)
        return
    tol = 20 * CHUNK_TOLERANCE[trunk.chunk_dtype]  # through four layers' norms and products
    assert np.abs(full - steps).max() <= tol * np.abs(steps).max()
    for x, y in zip(a.k + a.v + a.recurrent(), b.k + b.v + b.recurrent()):
        x, y = model_backend.to_host(x).astype(np.float32), model_backend.to_host(y).astype(np.float32)
        assert np.abs(x - y).max() <= tol * np.abs(y).max()


@CONVENTIONS
@pytest.mark.parametrize("cuts", [[70], [37, 33], [64, 6], [1, 63, 1, 5]], ids=str)
def test_prompt_passes_equal_one_pass(model_backend, rng, conventions, cuts):
    """A prompt in passes cut anywhere (on and off the 64-row chunk grid) gives the logits, taps,
    K/V and recurrent state of one pass bitwise, on every backend; so does a pass resumed from a
    copy of the cache (a prefix capture) taken where the first ends."""
    trunk, _ = small_pair(model_backend, seed=9, **conventions)
    p = prompt(rng, 70)
    one = trunk.new_cache()
    want = trunk.prefill(one, p)
    cache, parts, at = trunk.new_cache(), [], 0
    for n in cuts:
        parts.append(trunk.prefill(cache, p[at : at + n]))
        at += n
        if at == cuts[0] and len(cuts) > 1:  # resume the rest from a copy, as a restored capture does
            cache = cache.copy()
    for name in ("logits", "taps"):
        got = np.concatenate([model_backend.to_host(getattr(t, name)) for t in parts])
        assert np.array_equal(got, model_backend.to_host(getattr(want, name))), name
    assert cache.pos == one.pos and cache.chunk_len == one.chunk_len
    live = len(cache.tail) and cache.chunk_len
    for x, y in zip((*cache.k, *cache.v, *cache.recurrent(), *cache.chunk_state, *(t[:live] for t in cache.tail)),
                    (*one.k, *one.v, *one.recurrent(), *one.chunk_state, *(t[:live] for t in one.tail))):
        assert same(model_backend, x, y)


@CONVENTIONS
def test_simt_and_numpy_logits_agree(simt, numpy_backend, rng, conventions):
    p = prompt(rng, 41)
    out = []
    for be in (numpy_backend, simt):
        trunk, drafter = small_pair(be, seed=11, **conventions)
        cache = trunk.new_cache()
        tp = trunk.prefill(cache, p)
        kv = drafter.new_kv("draft/test")
        drafter.ingest([kv], tp.taps, tp.row_indptr)
        hidden, dl = drafter.block_pass([kv], [int(p[-1])])
        kv.free()
        out.append((tp.logits, dl))
    for x, y in zip(out[0], out[1]):
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-4 * float(np.abs(x).max()))


def test_drafter_block_pass_is_the_same_alone_and_batched(model_backend, rng):
    trunk, drafter = small_pair(model_backend, seed=7)
    prompts = [prompt(rng, int(n)) for n in rng.integers(1, 40, 4)]
    kvs = []
    for i, p in enumerate(prompts):
        c = trunk.new_cache()
        tp = trunk.prefill(c, p)
        kv = drafter.new_kv(f"draft/{i}")
        drafter.ingest([kv], tp.taps, tp.row_indptr)
        kvs.append(kv)
    anchors = prompt(rng, 4)
    h1, l1 = drafter.block_pass(kvs[2:3], anchors[2:3])
    h4, l4 = drafter.block_pass(kvs, anchors)
    b = drafter.config.block
    assert same(model_backend, l1, l4[2 * b : 3 * b]) and same(model_backend, h1, h4[2 * b : 3 * b])


@CONVENTIONS
@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_save_load_round_trip_is_bitwise(numpy_backend, tmp_path, rng, fmt, conventions):
    trunk, drafter = small_pair(numpy_backend, seed=13, **conventions)
    trunk.save(tmp_path, fmt=fmt)
    drafter.save(tmp_path, fmt=fmt)
    t2 = HybridTrunk.load(tmp_path, numpy_backend)
    d2 = DsparkDrafter.load(tmp_path, t2)
    p = prompt(rng, 20)
    outs = []
    for t, d in ((trunk, drafter), (t2, d2)):
        tp = t.prefill(t.new_cache(), p)
        kv = d.new_kv(f"draft/rt{len(outs)}")
        d.ingest([kv], tp.taps, tp.row_indptr)
        outs.append((tp.logits, *d.block_pass([kv], [int(p[-1])])))
        kv.free()
    for x, y in zip(*outs):
        assert np.array_equal(x, y)
    assert t2.config == trunk.config and d2.config == drafter.config


@pytest.mark.parametrize("mutate,err,match", [
    (lambda w: w.pop("layers.1.attn.wq"), ShapeError, "'layers.1.attn.wq' is missing"),
    (lambda w: w.update({"layers.0.gdn.conv": np.zeros((3, 4), np.float32)}), ShapeError,
     r"'layers.0.gdn.conv' has shape \(3, 4\)"),
    (lambda w: w.update({"lm_head": w["lm_head"].astype(np.float64)}), DTypeError,
     "'lm_head' has dtype float64, expected float32 or float16 or bfloat16"),
    (lambda w: w.update({"extra.bias": np.zeros(3, np.float32)}), ShapeError, "unexpected tensor 'extra.bias'"),
])
def test_bad_checkpoints_are_refused_naming_the_tensor(numpy_backend, tmp_path, mutate, err, match):
    trunk, _ = small_pair(numpy_backend)
    w = dict(trunk.host_weights)
    mutate(w)
    trunk.host_weights = w
    trunk.save(tmp_path)
    with pytest.raises(err, match=match):
        HybridTrunk.load(tmp_path, numpy_backend)


def test_bad_tokens_are_refused(numpy_backend):
    trunk, _ = small_pair(numpy_backend)
    c = trunk.new_cache()
    with pytest.raises(TokenRangeError, match=r"tokens\[0\]\[2\]=258 is outside the vocabulary \[0, 258\)"):
        trunk.prefill(c, np.array([1, 2, 258]))
    with pytest.raises(TokenRangeError, match="expected integer token ids"):
        trunk.prefill(c, np.array([1.0, 2.0]))
    assert c.pos == 0


def test_plain_batched_matmul_is_not_row_invariant_here_but_linear_is(numpy_backend, rng):
    """Why the numpy backend's `linear` chunks rows: this BLAS computes a lone row (GEMV) differently from the
    same row inside a batch (GEMM). If a BLAS ever happens to agree, the test still pins that
    `linear` is invariant and says which case it saw."""
    K, N = TINY_TRUNK.d_model, 1024
    w = rng.standard_normal((K, N)).astype(np.float32)
    x = rng.standard_normal((64, K)).astype(np.float32)
    plain_invariant = all(np.array_equal((x[:m] @ w)[0], (x[:1] @ w)[0]) for m in (2, 3, 8, 17, 64))
    print("plain x @ W row-invariant on this BLAS:", plain_invariant)
    full = linear(numpy_backend, x, w)
    for m in (1, 2, 3, 7, 8, 9, 17, 64):
        assert np.array_equal(linear(numpy_backend, x[:m], w), full[:m])
    for i in (0, 5, 13):
        assert np.array_equal(linear(numpy_backend, x[i : i + 1], w)[0], full[i])


def test_norm_glue_is_row_invariant(numpy_backend, rng):
    """The numpy backend's glue (the kernel backends' norm: tests/kernels/test_norm.py)."""
    from dspark.ops.norm import rmsnorm
    x = rng.standard_normal((50, 3, 64)).astype(np.float32)
    wt = rng.standard_normal(64).astype(np.float32)
    full = rmsnorm(numpy_backend, x, wt, 1e-6)
    sums = dense.halving_sum(x[..., :61])
    rope_full = dense.rope(x, np.arange(50) + 100, 10000.0)
    yarn = (("factor", 4.0), ("original_max_position_embeddings", 32), ("rope_type", "yarn"))
    partial_full = dense.rope(x, np.arange(50) + 100, 10000.0, 16, yarn)
    for i in (0, 17, 49):
        assert np.array_equal(rmsnorm(numpy_backend, x[i : i + 1], wt, 1e-6)[0], full[i])
        assert np.array_equal(dense.halving_sum(x[i : i + 1, :, :61])[0], sums[i])
        assert np.array_equal(dense.rope(x[i : i + 1], np.array([100 + i]), 10000.0)[0], rope_full[i])
        assert np.array_equal(dense.rope(x[i : i + 1], np.array([100 + i]), 10000.0, 16, yarn)[0], partial_full[i])
    np.testing.assert_array_equal(partial_full[..., 16:], x[..., 16:])  # past the rotary dims: untouched


def test_bf16_storage_is_exact_widening(numpy_backend, rng):
    """linear on bf16-stored weights equals linear on their f32 values, bitwise, alone or batched."""
    from dspark.dtypes import BF16
    w = rng.standard_normal((64, 96)).astype(BF16)
    x = rng.standard_normal((11, 64)).astype(np.float32)
    full = linear(numpy_backend, x, w)
    assert np.array_equal(full, linear(numpy_backend, x, w.astype(np.float32)))
    assert np.array_equal(linear(numpy_backend, x[3:4], w)[0], full[3])


def test_default_taps_follow_the_per_call_rule(numpy_backend, rng):
    """TrunkConfig.tap_layers takes what a call's taps= takes: -1 (the embedding) too, in any
    order; a drafter without taps of its own reads those defaults, and stays exact. Outside
    [-1, L), or none, is refused by name."""
    trunk, drafter = small_pair(numpy_backend, 5, tap_layers=(3, -1))
    p = prompt(rng, 9)
    default = trunk.prefill(trunk.new_cache(), p)
    explicit = trunk.prefill(trunk.new_cache(), p, taps=(3, -1))
    d = trunk.config.d_model
    assert default.tap_layers == (3, -1) and np.array_equal(default.taps, explicit.taps)
    assert np.array_equal(default.taps[:, d:], dense.widen(trunk.w["embed"][p]))
    assert drafter.taps == (3, -1)
    s = DsparkSpecSession.prime(trunk, drafter, p, SpecParams(max_new_tokens=24, burst_target=8))
    while not s.finished():
        s.burst()
    assert s.emitted == plain_generate(trunk, p, 24)
    assert from_json(to_json(trunk.config), TrunkConfig) == trunk.config
    for bad in ((4,), (-2, 1), ()):
        with pytest.raises(ValueError, match=rf"tap_layers={re.escape(str(bad))}: expected one or more layer "
                                             r"indices in \[-1, 4\) \(-1: the embedding\)"):
            replace(TINY_TRUNK, tap_layers=bad)


def test_prompt_passes_bound_memory_and_give_one_pass(numpy_backend, rng):
    """prompt_passes: passes of at most `chunk` rows (the last pass's logits are its last row, the
    earlier ones skip the LM head), their taps and the final logits the bits of one pass, and the
    host memory of a 512-token prompt in passes of 32 a fraction of one pass's (activations scale
    with the pass, not the prompt)."""
    import tracemalloc
    trunk, _ = small_pair(numpy_backend, seed=4, max_ctx=600)
    p = prompt(rng, 512)
    one = trunk.new_cache()
    tracemalloc.start()
    want = trunk.prefill(one, p)
    whole = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    cache = trunk.new_cache()
    tracemalloc.start()
    passes = []
    for tp in trunk.prompt_passes(cache, p, chunk=32):
        passes.append((tp.taps.shape[0], tp.taps.copy(), None if tp.logits is None else tp.logits.copy()))
    chunked = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [n for n, _, _ in passes] == [32] * 16 and all(lg is None for _, _, lg in passes[:-1])
    assert np.array_equal(np.concatenate([t for _, t, _ in passes]), want.taps)
    assert np.array_equal(passes[-1][2], want.logits[-1:])
    assert chunked < whole / 4, (chunked, whole)
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="chunk="):
            next(trunk.prompt_passes(trunk.new_cache(), p, chunk=bad))


def test_a_cache_that_does_not_fit_is_refused_naming_the_numbers(numpy_backend, monkeypatch):
    """Caches are allocated whole: one the backend has no room for raises CapacityError with its
    size, its K/V share and the free memory, before anything is allocated."""
    from dspark.errors import CapacityError
    from dspark.models.cache import cache_bytes
    trunk, _ = small_pair(numpy_backend, seed=4)
    before = numpy_backend.alloc.bytes()
    need = cache_bytes(trunk.config, 1 << 20)
    monkeypatch.setattr(numpy_backend, "free_bytes", lambda: sum(need.values()) - 1)
    with pytest.raises(CapacityError, match=rf"a cache of 1048576 rows needs .* GiB \(K/V .* GiB in float32 over 2 "
                                            rf"attention layers, .*\), more than the .* GiB the numpy backend has free"):
        trunk.new_cache(capacity=1 << 20)
    assert numpy_backend.alloc.bytes() == before
    monkeypatch.setattr(numpy_backend, "free_bytes", lambda: sum(need.values()))
    trunk.new_cache(capacity=1 << 20).free()
