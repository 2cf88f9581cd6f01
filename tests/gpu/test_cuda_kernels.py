"""GPU-only checks on the cuda backend: every kernel family against its NumPy reference at the
sizes the kernels are built for, and the bitwise row-invariance properties end to end on a GPU.

The per-family tests in tests/kernels/ already run their (small) cases on cuda through
`kernel_backend`; this file adds what they do not: model sizes (the benchmark trunk's attention,
Hkv = 8 with GQA 4 and D = 128 over 4k and 32k contexts; vocabulary 151936; gdn with H = 16 and
dk = dv = 128; 9 attention and 27 gdn layers), and the exactness properties through the models
with CuPy arrays: a verify column equals the decode step, a session alone equals it batched, the
two rollbacks agree, speculative output equals plain decode.

Tolerances are the per-family tests' own (their helpers are reused): attention |got - ref| <=
tol (1 + |ref|) with tol 1e-5 (f32) or 1e-2 (f16/bf16); gdn 1e-5 of the tensor's max; everything
else, and every row-invariance property, bit for bit.

Collected everywhere and skipped without a GPU (the `cuda` fixture); every test name contains
"cuda", so profiling/gpu_check.sh's `-k "cuda or gpu"` selects them.
"""

import ml_dtypes
import numpy as np
import pytest

from dspark.decode import plain_generate
from dspark.models.oracle import OracleDrafter
from dspark.models.presets import tiny_pair
from dspark.ops.argmax import argmax_rows_ref, greedy_accept, greedy_accept_ref, markov_chain, markov_chain_ref
from dspark.ops.attention import attention
from dspark.ops.kv_commit import kv_commit
from dspark.ops.snapshot import checkpoint_select, checkpoint_select_ref, snapshot_restore, snapshot_save
from dspark.ops.sampling import sample_filtered_ref
from dspark.session import DsparkSpecSession, SamplingParams, SpecParams, spec_burst
from tests.conftest import poison
from tests.kernels.test_argmax import make_logits as argmax_logits
from tests.kernels.test_argmax import make_verify_block, run_argmax
from tests.kernels.test_attention import assert_close, bits, indptr_of, make_case, on, reference, run
from tests.kernels.test_gdn import Sessions, assert_rollbacks_exact, make_layer
from tests.kernels.test_gdn import assert_close as gdn_close
from tests.kernels.test_kv_commit import caches_bits, expected, make_commit
from tests.kernels.test_kv_commit import on as commit_on
from tests.kernels.test_sampling import METHODS, accept_batch, assert_accept_matches, assert_bitwise, draw
from tests.kernels.test_sampling import make_logits as sampling_logits
from tests.kernels.test_sampling import mixed_filters, random_streams
from tests.kernels.test_snapshot import random_bits
from tests.session.test_session import oracle, prompt, run_spec

F32, F16, BF16 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
HQ, HKV, D = 32, 8, 128          # the benchmark trunk's attention (profiling/bench_kernels.py)
VOCAB = 151936
GDN_H, GDN_DK, GDN_DV = 16, 128, 128
ATTN_LAYERS, GDN_LAYERS = 9, 27


def storage_dtypes(be) -> list:
    """f32 and the trunk's 16-bit KV dtype: bf16, or f16 on a CuPy without bfloat16 arrays (asked
    of CuPy itself; the per-family tests cover all three at small sizes)."""
    from dspark.dtypes import dtype_supported
    return [F32, BF16] if dtype_supported(be.xp, BF16) else [F32, F16]


def u32(a) -> np.ndarray:
    """Bit patterns of f32 data (random bits include NaNs, which array_equal would not match)."""
    return np.ascontiguousarray(a).view(np.uint32)


# ---- argmax family at the vocabulary of Qwen3 ----------------------------------------------------
def test_cuda_argmax_family_at_vocab_151936(cuda, rng):
    be = cuda
    for dtype in storage_dtypes(be):
        x = argmax_logits(rng, 32, VOCAB, dtype, ties=True, neg_inf_rows=[31])
        np.testing.assert_array_equal(run_argmax(be, x), argmax_rows_ref(x)[0], err_msg=f"argmax_rows {dtype}")

        vts = [8] * 24 + [1, 2, 3, 5, 7, 4, 6, 8]
        x, cand, ptr = make_verify_block(rng, vts, VOCAB, dtype, accept_prob=0.9)
        m, nxt = poison(be.xp, len(vts), np.int32), poison(be.xp, len(vts), np.int32)
        greedy_accept(be, be.asarray(x), be.asarray(cand), be.asarray(ptr), m_out=m, next_out=nxt)
        m_ref, next_ref, _ = greedy_accept_ref(x, cand, ptr)
        np.testing.assert_array_equal(be.to_host(m), m_ref, err_msg=f"greedy_accept m {dtype}")
        np.testing.assert_array_equal(be.to_host(nxt), next_ref, err_msg=f"greedy_accept next {dtype}")

        B, nd, rank = 8, 7, 32
        logits = argmax_logits(rng, B * nd, VOCAB, dtype)
        w1 = (0.1 * rng.standard_normal((VOCAB, rank))).astype(np.float32)
        w2 = (0.1 * rng.standard_normal((rank, VOCAB))).astype(np.float32)
        anchors = rng.integers(0, VOCAB, B).astype(np.int32)
        out = poison(be.xp, (B, nd), np.int32)
        markov_chain(be, be.asarray(logits), be.asarray(w1), be.asarray(w2), anchors, nd, out=out)
        np.testing.assert_array_equal(be.to_host(out), markov_chain_ref(logits, w1, w2, anchors, nd)[0],
                                      err_msg=f"markov_chain {dtype}")


# ---- attention at the benchmark trunk's shape ------------------------------------------------------
# (rows per session, committed context per session): verify blocks and decode rows over 4k, a
# tile edge (4160 = 65 tiles), a 32k context, a short and an empty one.
MODEL_CAUSAL = ([8, 1, 8, 5, 1], [4096, 32760, 63, 4160, 0])
MODEL_BLOCK = ([8, 8, 1, 4], [4096, 63, 1000, 32760], 128)  # drafter blocks over a ring, window 128


@pytest.mark.parametrize("mode", ["causal", "block"])
def test_cuda_attention_matches_reference_at_model_size(cuda, rng, mode):
    if mode == "causal":
        (lens, ctxs), window = MODEL_CAUSAL, 0
    else:
        lens, ctxs, window = MODEL_BLOCK
    for dtype in storage_dtypes(cuda):
        case = make_case(rng, dtype, D, HQ, HKV, lens, ctxs, mode=mode, window=window)
        assert_close(run(cuda, case), reference(case), dtype)


def test_cuda_attention_verify_rows_equal_decode_steps_at_model_size(cuda, rng):
    """Row i of a verify block is bitwise the decode step at pos + i once rows 0..i-1 are
    committed, over contexts that cross tile edges at 4k and 32k."""
    be = cuda
    vts = [8, 8, 5, 3]
    ctxs = [4096 - 3, 32768 - 4, 1000 + int(rng.integers(0, 64)), 63]
    for dtype in storage_dtypes(be):
        case = make_case(rng, dtype, D, HQ, HKV, vts, ctxs)
        dev = on(be, case)
        verify = be.to_host(attention(be, *dev.args()))
        for i in range(max(vts)):
            live = [b for b in range(len(vts)) if i < vts[b]]
            rows = [int(case.row_indptr[b]) + i for b in live]
            q, kb, vb = (be.xp.concatenate([a[r:r + 1] for r in rows]) for a in (dev.q, dev.k_blk, dev.v_blk))
            kc, vc = [dev.k_caches[b] for b in live], [dev.v_caches[b] for b in live]
            pos = np.array([ctxs[b] + i for b in live], np.int32)
            one = indptr_of([1] * len(live))
            step = be.to_host(attention(be, q, kb, vb, kc, vc, pos, one))
            np.testing.assert_array_equal(bits(step), bits(verify[rows]), err_msg=f"{dtype} decode step {i}")
            kv_commit(be, [kb], [vb], [kc], [vc], pos, np.ones(len(live), np.int32), one)


@pytest.mark.parametrize("mode", ["causal", "block"])
def test_cuda_attention_session_alone_equals_batched_at_model_size(cuda, rng, mode):
    """A 4k session's rows are bitwise the same alone and among 31 others of other lengths."""
    others = 31
    lens = rng.integers(1, 9, others + 1)
    ctxs = rng.integers(0, 2000, others + 1)
    ctxs[0] = 4096 + int(rng.integers(0, 64))
    order = rng.permutation(others + 1)
    dtype = storage_dtypes(cuda)[-1]  # the trunk's KV dtype: bf16 where CuPy has it
    case = make_case(rng, dtype, D, HQ, HKV, lens[order], ctxs[order], mode=mode,
                     window=128 if mode == "block" else 0)
    b = int(np.flatnonzero(order == 0)[0])
    batched = run(cuda, case)
    alone = run(cuda, case.session(b))
    r0, r1 = case.row_indptr[b], case.row_indptr[b + 1]
    np.testing.assert_array_equal(bits(alone), bits(batched[r0:r1]))


# ---- kv_commit: every attention layer of the trunk in one launch -------------------------------------
@pytest.mark.parametrize("ring", [False, True], ids=["cache", "ring"])
def test_cuda_kv_commit_at_model_size(cuda, rng, ring):
    B, vt = 6, 8
    rows = [vt] * B
    keep = [8, 0, 3, 8, 1, 5]
    if ring:  # the drafter's ring (window 64 + block 8), positions past several laps
        pos, capacity = rng.integers(0, 5000, B).tolist(), [72] * B
    else:
        pos = rng.integers(0, 300, B).tolist()
        capacity = [p + vt + int(rng.integers(0, 5)) for p in pos]
    for dtype in storage_dtypes(cuda):
        c = make_commit(rng, dtype, D, HKV, ATTN_LAYERS, rows, pos, keep, capacity, ring)
        want = caches_bits(expected(c))
        dev = commit_on(cuda, c)
        kv_commit(cuda, *dev.args(), ring=ring)
        for i, (got, exp) in enumerate(zip(caches_bits(dev, cuda), want)):
            np.testing.assert_array_equal(got, exp, err_msg=f"{dtype} cache {i}")


# ---- gdn_scan and rollback at H = 16, dk = dv = 128 ------------------------------------------------
def test_cuda_gdn_scan_matches_reference_at_model_size(cuda, numpy_backend, rng):
    layer = make_layer(rng, GDN_H, GDN_DK, GDN_DV)
    live = Sessions(cuda, layer, rng, 5)
    live.scan([3, 0, 1, 5, 2])  # sessions that have consumed different numbers of tokens
    ref = live.clone(numpy_backend)
    ts = [8, 1, 0, 8, 3]
    got = [cuda.to_host(a) for a in live.scan(ts, ckpt=True)[:3]]
    want = [numpy_backend.to_host(a) for a in ref.scan(ts, ckpt=True)[:3]]
    gdn_close(got[0], want[0], "out")
    gdn_close(got[1], want[1], "state checkpoints")
    np.testing.assert_array_equal(got[2], want[2], err_msg="conv checkpoints")
    (states, windows), (ref_states, ref_windows) = live.host(), ref.host()
    for s in range(len(ts)):
        gdn_close(states[s], ref_states[s], f"session {s} state")
        np.testing.assert_array_equal(windows[s], ref_windows[s], err_msg=f"session {s} conv window")


def test_cuda_gdn_rollback_replay_equals_checkpoint_at_model_size(cuda, rng):
    """Restore + replay and checkpoint select both give, bitwise, the state of plain decode for
    every keep in 0..8; each verify column equals its decode step."""
    layer = make_layer(rng, GDN_H, GDN_DK, GDN_DV)
    assert_rollbacks_exact(cuda, layer, rng, [8] * 9 + [3, 5], list(range(9)) + [2, 5])


# ---- snapshot: every recurrent tensor of the trunk ---------------------------------------------------
def test_cuda_snapshot_at_model_size(cuda, rng):
    be, B = cuda, 4
    C = GDN_H * (2 * GDN_DK + GDN_DV)
    shapes = [(GDN_H, GDN_DV, GDN_DK), (C, 3)] * (B * GDN_LAYERS)
    host = [random_bits(rng, s) for s in shapes]
    live = [be.asarray(h) for h in host]
    snap = [poison(be.xp, s, np.float32) for s in shapes]
    snapshot_save(be, live, snap)
    for i, (s, h) in enumerate(zip(snap, host)):
        np.testing.assert_array_equal(u32(be.to_host(s)), u32(h), err_msg=f"saved tensor {i}")
    for a in live:
        a[...] = 0
    snapshot_restore(be, snap, live)
    for i, (a, h) in enumerate(zip(live, host)):
        np.testing.assert_array_equal(u32(be.to_host(a)), u32(h), err_msg=f"restored tensor {i}")

    # one layer's checkpoint select over a verify of 8 columns per session, keep 0..8
    vt, keep = 8, np.array([0, 8, 3, 1, 5, 7], np.int32)
    n = len(keep)
    ptr = indptr_of([vt] * n)
    sck, cck = random_bits(rng, (n * vt, GDN_H, GDN_DV, GDN_DK)), random_bits(rng, (n * vt, C, 3))
    states = [random_bits(rng, (GDN_H, GDN_DV, GDN_DK)) for _ in range(n)]
    windows = [random_bits(rng, (C, 3)) for _ in range(n)]
    snap_s = [random_bits(rng, (GDN_H, GDN_DV, GDN_DK)) for _ in range(n)]
    snap_w = [random_bits(rng, (C, 3)) for _ in range(n)]
    dev_s, dev_w = [be.asarray(a) for a in states], [be.asarray(a) for a in windows]
    checkpoint_select(be, be.asarray(sck), be.asarray(cck), dev_s, dev_w, be.asarray(ptr), be.asarray(keep),
                      snap_states=[be.asarray(a) for a in snap_s], snap_convs=[be.asarray(a) for a in snap_w])
    checkpoint_select_ref(sck, cck, states, windows, ptr, keep, snap_s, snap_w)
    for s in range(n):
        np.testing.assert_array_equal(u32(be.to_host(dev_s[s])), u32(states[s]), err_msg=f"session {s} state")
        np.testing.assert_array_equal(u32(be.to_host(dev_w[s])), u32(windows[s]), err_msg=f"session {s} window")


# ---- sampling at the vocabulary of Qwen3 -----------------------------------------------------------
def test_cuda_sampling_at_vocab_151936(cuda, rng):
    """Filtered draws and the speculative accept agree with the reference bit for bit."""
    rows = 12
    for dtype in storage_dtypes(cuda):
        x = sampling_logits(rng, rows, VOCAB, dtype)
        f, s = mixed_filters(rng, rows, VOCAB), random_streams(rng, rows)
        for method in METHODS:
            token, prob, dist = draw(cuda, x, f, s, method)
            ref = sample_filtered_ref(x, f, s, method, with_dist=True)
            assert_bitwise(token, ref["token"], f"{dtype} {method} token")
            assert_bitwise(prob, ref["prob"], f"{dtype} {method} prob")
            assert_bitwise(dist, ref["dist"], f"{dtype} {method} dist")
    assert_accept_matches(cuda, accept_batch(rng, [7] * 8 + [0, 3], VOCAB))


# ---- the models on the GPU: row invariance and exactness ---------------------------------------------
def test_cuda_and_numpy_logits_agree(cuda, numpy_backend, rng):
    p = prompt(rng, 41)
    out = []
    for be in (numpy_backend, cuda):
        trunk, drafter = tiny_pair(be, seed=11)
        tp = trunk.prefill(trunk.new_cache(), p)
        kv = drafter.new_kv("draft/gpu/agree")
        drafter.ingest([kv], tp.taps, tp.row_indptr)
        _, dl = drafter.block_pass([kv], [int(p[-1])])
        out.append((be.to_host(tp.logits), be.to_host(dl)))
    for x, y in zip(*out):
        np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-4 * float(np.abs(x).max()))


@pytest.mark.parametrize("rollback", ["checkpoint", "replay"])
def test_cuda_batched_greedy_spec_equals_plain(cuda, rng, rollback):
    """Five sessions decoded together in spec bursts, each byte-identical to its own plain greedy
    decode; an oracle drafter makes every accepted length occur, so each rollback runs."""
    trunk, drafter = tiny_pair(cuda, int(rng.integers(1000)))
    prompts = [prompt(rng, int(n)) for n in rng.integers(1, 60, 5)]
    params = SpecParams(max_new_tokens=32, burst_target=8, rollback=rollback)
    o = OracleDrafter(drafter, hit_rate=0.7)
    plain, sessions = [], []
    for p in prompts:
        plain.append(plain_generate(trunk, p, 32))
        o.next_stream = [*p.tolist(), *plain[-1]]  # each draft KV follows its own stream
        sessions.append(DsparkSpecSession.prime(trunk, o, p, params))
    while not all(s.finished() for s in sessions):
        spec_burst([s for s in sessions if not s.finished()])
    for i, (s, want) in enumerate(zip(sessions, plain)):
        assert s.emitted == want, f"session {i}"
    assert sum(sum(s.stats.histogram[1:]) for s in sessions) > 0  # drafts were accepted: partial keeps ran


def test_cuda_rollbacks_leave_the_same_state(cuda, rng):
    """The same request with restore + replay and with checkpoint select: equal tokens and
    bitwise equal recurrent state and K/V at every burst boundary."""
    trunk, drafter = tiny_pair(cuda, 5)
    p = prompt(rng, 23)
    o = oracle(trunk, drafter, p, 40, hit_rate=0.6)
    runs = [DsparkSpecSession.prime(trunk, o, p, SpecParams(max_new_tokens=40, burst_target=6, rollback=r))
            for r in ("checkpoint", "replay")]
    while not runs[0].finished():
        for s in runs:
            spec_burst([s])
        a, b = runs
        assert a.emitted == b.emitted and a.cache.pos == b.cache.pos
        for x, y in zip(a.cache.recurrent() + a.cache.k + a.cache.v, b.cache.recurrent() + b.cache.k + b.cache.v):
            np.testing.assert_array_equal(bits(cuda.to_host(x)), bits(cuda.to_host(y)))
    assert runs[1].finished()
    assert runs[0].emitted == run_spec(trunk, o, p, SpecParams(max_new_tokens=40)).emitted


def test_cuda_sampled_stream_alone_equals_batched(cuda, rng):
    """Equal seeds give equal sampled streams on the GPU, alone or among other sessions."""
    trunk, drafter = tiny_pair(cuda, 9)
    p = prompt(rng, 17)

    def params(seed):
        return SpecParams(max_new_tokens=30, burst_target=8,
                          sampling=SamplingParams(temperature=1.0, top_p=0.95, seed=seed))

    alone = DsparkSpecSession.prime(trunk, drafter, p, params(7))
    while not alone.finished():
        spec_burst([alone])
    others = [DsparkSpecSession.prime(trunk, drafter, prompt(rng, int(n)), params(100 + i))
              for i, n in enumerate(rng.integers(1, 50, 3))]
    again = DsparkSpecSession.prime(trunk, drafter, p, params(7))
    batch = [others[0], again, *others[1:]]
    while not all(s.finished() for s in batch):
        spec_burst([s for s in batch if not s.finished()])
    assert again.emitted == alone.emitted
