"""Hugging Face targets against transformers itself (tiny random Qwen3 and Qwen3.5 models that
transformers built and saved): the logits of a prefill and 16 decode steps on numpy and simt,
greedy generation, taps, the storage dtype; and speculative decoding on them stays exact (solo,
batched, demoted at a burst boundary, both rollback methods), greedy and coupled sampled."""

import json
import re

import numpy as np
import pytest

from dspark.decode import PlainBatch, plain_generate
from dspark.dtypes import BF16
from dspark.errors import ShapeError
from dspark.models.hf import load_target
from dspark.models.oracle import OracleDrafter, TrunkDrafter
from dspark.models.presets import random_drafter
from dspark.session import DsparkSpecSession, SamplingParams, SpecParams, spec_burst
from tests.models.hf_models import CASES, QWEN3, QWEN35, assert_logits_close, build, hf_greedy, hf_logits, reference
from tests.session.coupled_runs import check_alone_and_batched, check_demotion_at_every_boundary

STEPS = 16
GREEDY = 48


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> (directory, transformers' model read back from it), each built once."""
    made = {}

    def get(case):
        if case.name not in made:
            d = tmp_path_factory.mktemp(case.name)
            build(case, d)
            made[case.name] = (d, reference(case, d))
        return made[case.name]
    return get


def prompt_of(case, n=11):
    return np.random.default_rng(case.seed).integers(0, case.config["vocab_size"], n).astype(np.int32)


@pytest.mark.parametrize("backend", ["numpy", "simt"])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_logits_match_transformers(saved, request, case, backend):
    """Prefill, then 16 decode steps through each side's own cache (transformers: its chunked
    gdn for the prompt, the recurrent one per step), within 1e-4 of the largest logit."""
    be = request.getfixturevalue("numpy_backend" if backend == "numpy" else "simt")
    d, model = saved(case)
    p = prompt_of(case)
    steps = np.random.default_rng(case.seed + 100).integers(0, case.config["vocab_size"], STEPS)
    want = hf_logits(model, p, steps)
    trunk = load_target(d, be)
    cache = trunk.new_cache()
    assert_logits_close(be.to_host(trunk.prefill(cache, p).logits), want[0], f"{case.name} prefill")
    for j, tok in enumerate(steps):
        got = be.to_host(trunk.decode([cache], [tok]).logits)[0]
        assert_logits_close(got, want[j + 1], f"{case.name} decode step {j}")


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_greedy_matches_transformers_generate(saved, numpy_backend, case):
    d, model = saved(case)
    p = prompt_of(case)
    want = hf_greedy(model, p, GREEDY)
    assert plain_generate(load_target(d, numpy_backend), p, GREEDY) == want


def test_checkpoints_are_what_the_cases_claim(saved, numpy_backend):
    """The cases cover what they say: shards, bf16 files, tying, skipped vision tensors, grouped
    value heads, the Qwen3.5 conventions."""
    for case in CASES:
        d, _ = saved(case)
        trunk = load_target(d, numpy_backend)
        c, src = trunk.config, trunk.source
        if case.shard:
            shards = set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values())
            assert len(shards) > 1, case.name
        assert set(src.dtypes) == {"BF16" if case.dtype == "bfloat16" else "F32"}, case.name
        assert c.tie_embeddings == case.tied, case.name
        assert ("lm_head" in trunk.host_weights) != c.tie_embeddings
        assert (src.skipped.get("model.visual.", 0) > 0) == (case.family == "qwen3_5"), case.name
        hybrid = case.family != "qwen3"
        assert (c.norm_offset, c.attn_gate, c.qk_norm) == ((1.0, True, True) if hybrid else (0.0, False, True))
        if hybrid:
            t = case.config
            assert (c.gdn_heads, c.gdn_key_heads) == (t["linear_num_value_heads"], t["linear_num_key_heads"])
    ratios = {c.config["linear_num_value_heads"] // c.config["linear_num_key_heads"] for c in QWEN35}
    assert ratios == {1, 2, 3}


def test_storage_dtype_changes_memory_not_logits(saved, numpy_backend):
    """A bf16 checkpoint stored as bf16 on the backend gives bitwise the logits of f32 storage
    (widening is exact), in half the weight bytes."""
    case = next(c for c in CASES if c.dtype == "bfloat16" and c.family != "qwen3")
    d, _ = saved(case)
    be = numpy_backend
    f32 = load_target(d, be)
    bf16 = load_target(d, be, dtype="bfloat16")
    assert f32.weight_dtype == np.float32 and bf16.weight_dtype == BF16
    assert bf16.w["layers.0.gdn.w_qkv"].dtype == BF16 and bf16.w["layers.0.gdn.A_log"].dtype == np.float32
    assert bf16.w["embed"].nbytes * 2 == f32.w["embed"].nbytes
    p = prompt_of(case)
    ca, cb = f32.new_cache(), bf16.new_cache()
    assert np.array_equal(f32.prefill(ca, p).logits, bf16.prefill(cb, p).logits)
    for tok in p[:4]:
        assert np.array_equal(f32.decode([ca], [tok]).logits, bf16.decode([cb], [tok]).logits)


def test_bf16_kv_cache(saved, numpy_backend):
    """kv_dtype=bfloat16 halves the cache and stays close to transformers' f32 logits."""
    case = QWEN35[0]
    d, model = saved(case)
    trunk = load_target(d, numpy_backend, kv_dtype="bfloat16")
    cache = trunk.new_cache()
    assert cache.k[0].dtype == BF16
    p = prompt_of(case)
    got, want = trunk.prefill(cache, p).logits, hf_logits(model, p, [])[0]
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()
    with pytest.raises(ValueError, match="kv_dtype='int8'"):
        load_target(d, numpy_backend, kv_dtype="int8")


def test_taps_are_transformers_hidden_states(saved, numpy_backend):
    """trunk taps (layers i, in the order asked; -1 the embedding) are transformers'
    hidden_states[i + 1]; a layer outside [-1, L) is refused by name."""
    import torch
    case = QWEN35[1]
    d, model = saved(case)
    p = prompt_of(case)
    with torch.no_grad():
        hs = model(torch.tensor(p[None]), output_hidden_states=True).hidden_states
    trunk = load_target(d, numpy_backend)
    layers = (2, -1, 0)
    got = trunk.prefill(trunk.new_cache(), p, taps=layers)
    assert got.tap_layers == layers
    want = np.concatenate([hs[i + 1][0].numpy() for i in layers], axis=1)
    np.testing.assert_allclose(got.taps, want, rtol=0, atol=1e-4 * np.abs(want).max())
    default = trunk.prefill(trunk.new_cache(), p)
    assert default.tap_layers == trunk.config.tap_layers
    cache = trunk.new_cache()
    for bad in ((0, 4), (-2,), ()):
        with pytest.raises(ShapeError, match=rf"taps={re.escape(str(bad))}: expected one or more layer indices"):
            trunk.prefill(cache, p, taps=bad)
    assert cache.pos == 0


# ---- speculative decoding on real targets ---------------------------------------------------
def oracle_for(trunk, seed, streams=None, hit_rate=0.7):
    """A random drafter sized to the target, made to hit the plain stream at `hit_rate` so that
    partial accepts of every length occur (exactness must hold whatever it proposes)."""
    o = OracleDrafter(random_drafter(trunk, seed, block=4), hit_rate=hit_rate, seed=seed)
    o.next_stream = streams
    return o


def live_prompts(case, trunk, n, count):
    """Prompts whose plain greedy stream runs the whole budget (no early EOS), and the streams."""
    out, rng = [], np.random.default_rng(case.seed + 7)
    while len(out) < count:
        p = rng.integers(0, trunk.config.vocab, int(rng.integers(3, 24))).astype(np.int32)
        want = plain_generate(trunk, p, n)
        if len(want) == n and not set(trunk.config.eos_ids) & set(want):
            out.append((p, want))
    return out


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_speculative_greedy_equals_plain(saved, numpy_backend, case):
    d, _ = saved(case)
    trunk = load_target(d, numpy_backend)
    ((p, want),) = live_prompts(case, trunk, 40, 1)
    for rollback in ("checkpoint", "replay"):
        drafter = oracle_for(trunk, case.seed, [*p.tolist(), *want])
        s = DsparkSpecSession.prime(trunk, drafter, p, SpecParams(max_new_tokens=40, burst_target=6,
                                                                  rollback=rollback))
        while not s.finished():
            s.burst()
        assert s.emitted == want, rollback
        assert sum(s.stats.histogram[1:]) > 0 and s.stats.histogram[0] > 0  # rejections and partial accepts
        s.close()
    # the bare random drafter: (almost) nothing accepted, output still exact
    s = DsparkSpecSession.prime(trunk, random_drafter(trunk, case.seed, block=4), p, SpecParams(max_new_tokens=12))
    while not s.finished():
        s.burst()
    assert s.emitted == want[:12]


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_batched_sessions_and_demotion_stay_exact(saved, numpy_backend, case):
    """Three sessions share every verify; after the first burst one is demoted to plain batched
    decode. Each stream equals its plain greedy decode (= the session alone, previous test)."""
    d, _ = saved(case)
    trunk = load_target(d, numpy_backend)
    n = 30
    live = live_prompts(case, trunk, n, 3)
    drafter = oracle_for(trunk, case.seed + 1, hit_rate=0.6)
    sessions = []
    for p, want in live:
        drafter.next_stream = [*p.tolist(), *want]  # each draft KV follows its own stream
        sessions.append(DsparkSpecSession.prime(trunk, drafter, p, SpecParams(max_new_tokens=n, burst_target=5)))
    spec_burst(sessions)
    first = sessions[0]
    assert not first.finished() and first.cache.pos == len(live[0][0]) + len(first.emitted)
    cache, last = first.into_demoted()
    batch = PlainBatch(trunk)
    sid = batch.join(cache, last, n, first.emitted)
    rest = sessions[1:]
    while not all(s.finished() for s in rest):
        spec_burst(rest)
        batch.step()
    batch.run()
    assert batch.leave(sid).emitted == live[0][1]
    assert [s.emitted for s in rest] == [want for _, want in live[1:]]
    cache.free()


@pytest.mark.parametrize("case,backend", [(QWEN3[0], "numpy"), (QWEN35[0], "numpy"), (QWEN35[0], "simt")],
                         ids=["qwen3-numpy", "qwen3_5-numpy", "qwen3_5-simt"])
def test_coupled_sampled_equals_plain_sampled(saved, request, case, backend):
    """Coupled sampled speculation on transformers-built targets: three requests with their own
    filters and seeds emit plain sampled decode's stream alone (bursts of 1, 5 and 9 tokens) and
    batched, and one of them with a demotion at every burst boundary of its run. The drafter is
    the target's own distribution, tilted (TrunkDrafter around a random drafter sized to it): some
    drafts accepted, others not."""
    d, _ = saved(case)
    trunk = load_target(d, request.getfixturevalue("numpy_backend" if backend == "numpy" else "simt"))
    drafter = TrunkDrafter(random_drafter(trunk, case.seed, block=4), tilt=0.5, seed=case.seed)
    rng = np.random.default_rng(case.seed + 3)
    samplings = [SamplingParams(temperature=0.8, top_k=40, seed=1), SamplingParams(temperature=0.5, top_p=0.9, seed=2),
                 SamplingParams(temperature=1.0, min_p=0.02, seed=3)]
    reqs = [(rng.integers(0, trunk.config.vocab, int(n)).astype(np.int32), sp) for n, sp in zip((5, 13, 21), samplings)]
    n = 20
    total = check_alone_and_batched(trunk, drafter, reqs, n, bursts=(1, 5, 9))
    print(total.summary())
    assert sum(total.histogram[1:]) > 0 and total.histogram[0] > 0, total.summary()  # accepts and rejections
    assert check_demotion_at_every_boundary(trunk, drafter, reqs[0], [reqs[1]], n) >= 2


def test_cuda_code_path_stores_bf16_and_equals_simt(saved, simt):
    """The cuda backend's code path on the CuPy contract stand-in (no GPU needed): dtype=None keeps
    a bf16 checkpoint bf16 on the device, where the GEMM is the tensor-core one (activations
    rounded to bf16): its logits are bitwise simt's with bf16 storage, and within the activations'
    rounding of f32 storage (the CPU default, which matches transformers to 1e-4)."""
    from dspark.backends import contract
    dev = contract.backend()
    case = next(c for c in CASES if c.dtype == "bfloat16" and c.family != "qwen3")
    d, _ = saved(case)
    on_dev, on_simt, f32 = load_target(d, dev), load_target(d, simt, dtype="bfloat16"), load_target(d, simt)
    assert on_dev.weight_dtype == BF16 and on_simt.weight_dtype == BF16 and f32.weight_dtype == np.float32
    p = prompt_of(case)
    a, b, c = on_dev.new_cache(), on_simt.new_cache(), f32.new_cache()
    got = dev.to_host(on_dev.prefill(a, p).logits)
    assert np.array_equal(got, on_simt.prefill(b, p).logits)
    wide = f32.prefill(c, p).logits
    assert np.abs(got - wide).max() <= 2e-2 * np.abs(wide).max()
    for tok in p[:3]:
        assert np.array_equal(dev.to_host(on_dev.decode([a], [tok]).logits), on_simt.decode([b], [tok]).logits)


# ---- prompt passes on the kernels: chunked gdn, the tensor-core GEMM ------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", [CASES[0], QWEN35[0]], ids=repr)
def test_prompt_passes_keep_speculation_exact_on_the_kernels(saved, simt, case, dtype):
    """On simt, f32 and bf16 weights (bf16: the tensor-core GEMM; Qwen3.5: the chunked gdn prompt
    pass), prompts of 1, 63, 64, 65 and 201 tokens: plain decode prefills each in one pass, the
    speculative sessions in passes of 50 tokens (off the 64-token grid), batched five at a time;
    after the first burst one session is demoted to plain batched decode and the 201-token one is
    restored from its prefix capture (its prompt ends inside a chunk) into a new session. Every
    stream equals plain decode's."""
    d, _ = saved(case)
    trunk = load_target(d, simt, dtype=dtype)
    assert trunk.chunked_gdn == ("gdn" in trunk.config.layers)
    rng, n = np.random.default_rng(case.seed + 11), 10
    prompts = [rng.integers(0, trunk.config.vocab, m).astype(np.int32) for m in (1, 63, 64, 65, 201)]
    wants = [plain_generate(trunk, p, n) for p in prompts]
    trunk.prompt_chunk = 50
    drafter = oracle_for(trunk, case.seed + 2, hit_rate=0.6)
    sessions = []
    for p, want in zip(prompts, wants):
        drafter.next_stream = [*p.tolist(), *want]
        sessions.append(DsparkSpecSession.prime(trunk, drafter, p, SpecParams(max_new_tokens=n, burst_target=4)))
    capture = sessions[4].take_prefix_capture()
    assert capture.pos == 201 and capture.cache.chunk_len == (201 % 64 if trunk.chunked_gdn else 0)
    restored = DsparkSpecSession.restore(trunk, drafter, capture, SpecParams(max_new_tokens=n, burst_target=4))
    spec_burst(sessions)
    batch = PlainBatch(trunk)
    demoted = sessions.pop(1)
    if demoted.finished():
        got_demoted = demoted.emitted
    else:
        cache, last = demoted.into_demoted()
        sid = batch.join(cache, last, n, demoted.emitted)
        batch.run()
        got_demoted = batch.leave(sid).emitted
        cache.free()
    live = sessions + [restored]
    while not all(s.finished() for s in live):
        spec_burst([s for s in live if not s.finished()])
    assert got_demoted == wants[1]
    assert [s.emitted for s in live] == [wants[i] for i in (0, 2, 3, 4, 4)]
    for s in live:
        s.close()
    capture.free()


def test_max_ctx_up_to_max_position_embeddings(saved, numpy_backend):
    """max_ctx may reach the model's max_position_embeddings (256 in this case) and no further."""
    from dspark.models.hf import CheckpointError
    case = next(c for c in CASES if "max_position_embeddings" in c.config)
    d, _ = saved(case)
    assert load_target(d, numpy_backend, max_ctx=256).new_cache().capacity == 256
    with pytest.raises(CheckpointError, match="max_ctx=257: expected 1 to the model's max_position_embeddings=256"):
        load_target(d, numpy_backend, max_ctx=257)


def test_numpy_backend_matrices_are_panel_major_and_change_no_bit(saved, numpy_backend):
    """On the numpy backend the loader lays the trunk's matrices out panel-major (Panelled, one
    copy), each fused part still reads as its columns, and the logits are bitwise those of the same
    trunk with its matrices row-major."""
    from dspark.models.weights import PRODUCT_MATRICES
    from dspark.ops import product as prod
    case = next(c for c in CASES if c.family != "qwen3")
    d, _ = saved(case)
    panelled, rowmajor = load_target(d, numpy_backend), load_target(d, numpy_backend)
    laid = [n for n, w in panelled.w.items() if isinstance(w, prod.Panelled)]
    assert laid and all(any(n == m or n.endswith("." + m) for m in PRODUCT_MATRICES) for n in laid)
    assert "layers.0.gdn.w_in" in laid and "layers.0.mlp.w_down" in laid
    qkv = panelled.w["layers.0.gdn.w_qkv"]
    assert np.array_equal(np.asarray(qkv), np.asarray(panelled.w["layers.0.gdn.w_in"])[:, : qkv.shape[1]])
    for n in laid:
        rowmajor.w[n] = np.asarray(panelled.w[n])
    p = prompt_of(case)
    ca, cb = panelled.new_cache(), rowmajor.new_cache()
    assert np.array_equal(panelled.prefill(ca, p).logits, rowmajor.prefill(cb, p).logits)
    for tok in p[:3]:
        assert np.array_equal(panelled.decode([ca], [tok]).logits, rowmajor.decode([cb], [tok]).logits)
    cand = np.asarray(p[:5], np.int32)
    assert np.array_equal(panelled.verify([ca], [cand]).logits, rowmajor.verify([cb], [cand]).logits)
