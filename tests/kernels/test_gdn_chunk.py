"""gdn_prompt, the chunked (WY) prompt pass: the kernels (simt, and cuda on the CuPy contract
stand-in) against their NumPy twin within REF_TOLERANCE; one pass equal to any split of it (on and
off the 64-token grid, resumed from a copy of the state as a prefix capture keeps it) bitwise; a
session alone equal to it in a batch bitwise; and the pass within CHUNK_TOLERANCE of the sequential
scan and of transformers' torch_chunk_gated_delta_rule (qwen3_5), for f32 and 16-bit operands."""

from __future__ import annotations

import numpy as np
import pytest

from dspark.backends import contract
from dspark.dtypes import BF16
from dspark.errors import CapacityError, ShapeError
from dspark.ops.gdn import conv_silu_ref, conv_windows_of, gdn_scan
from dspark.ops.gdn_chunk import CHUNK, CHUNK_TOLERANCE, REF_TOLERANCE, gdn_prompt
from tests.conftest import poison
from tests.kernels.test_gdn import make_layer
from tests.peers import peer

F32 = np.float32
DTYPES = [np.dtype(F32), np.dtype(np.float16), BF16]


class Prompt:
    """Sessions of one gdn layer on a backend: live state, conv window, chunk state and tail, and
    how many rows of their prompts each has consumed (its position)."""

    def __init__(self, be, layer, rng, B, dtype, state_scale=0.3):
        self.be, self.layer, self.dtype = be, layer, np.dtype(dtype)
        H, dk, dv, C = layer.heads, layer.dk, layer.dv, layer.C
        self.states = [be.asarray((state_scale * rng.standard_normal((H, dv, dk))).astype(F32)) for _ in range(B)]
        self.windows = [be.asarray(rng.standard_normal((C, 3)).astype(F32)) for _ in range(B)]
        self.chunk_states = [be.asarray(np.zeros((H, dv, dk), F32)) for _ in range(B)]
        self.tails = [be.asarray(np.full((CHUNK, C + 2 * H), np.nan, F32)) for _ in range(B)]
        self.pos = np.zeros(B, int)

    def copy(self):
        c = Prompt.__new__(Prompt)
        c.be, c.layer, c.dtype, c.pos = self.be, self.layer, self.dtype, self.pos.copy()
        for name in ("states", "windows", "chunk_states", "tails"):
            setattr(c, name, [self.be.asarray(self.be.to_host(x).copy()) for x in getattr(self, name)])
        return c

    def run(self, streams, ts):
        """The next ts[b] rows of each session's (mixed, a, b) stream as one launch -> out (host)."""
        be, L = self.be, self.layer
        parts = [[x[p : p + t] for x in st] for st, p, t in zip(streams, self.pos, ts)]
        mixed, a, b = (np.concatenate([p[i] for p in parts]) for i in range(3))
        indptr = np.concatenate([[0], np.cumsum(ts)]).astype(np.int32)
        out = poison(be.xp, (mixed.shape[0], L.heads, L.dv), F32)
        gdn_prompt(be, be.asarray(mixed), be.asarray(a), be.asarray(b), be.asarray(L.conv_weight), be.asarray(L.A_log),
                   be.asarray(L.dt_bias), self.states, self.windows, self.chunk_states, self.tails, indptr,
                   (self.pos % CHUNK).astype(np.int32), heads=L.heads, dk=L.dk, dv=L.dv, k_heads=L.k_heads,
                   dtype=self.dtype, out=out)
        self.pos += np.asarray(ts, int)
        return be.to_host(out)

    def host(self):
        """Everything a later pass reads: states, windows, chunk states, the tails' live rows."""
        h = self.be.to_host
        return ([h(x) for x in self.states], [h(x) for x in self.windows], [h(x) for x in self.chunk_states],
                [h(x)[: p % CHUNK] for x, p in zip(self.tails, self.pos)])


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


def assert_bitwise(x, y, what):
    for name, xs, ys in zip(("state", "conv window", "chunk state", "tail"), x, y):
        for s, (p, q) in enumerate(zip(xs, ys)):
            np.testing.assert_array_equal(bits(p), bits(q), err_msg=f"{what}: session {s} {name}")


def within(got, want, tol, what):
    scale = float(np.abs(want).max())
    err = float(np.abs(np.asarray(got, np.float64) - want).max())
    assert err <= tol * scale, f"{what}: max |diff| {err:.3g} > {tol} x max |ref| {scale:.3g}"


@pytest.fixture(params=["simt", "contract"])
def chunk_backend(request, simt):
    return simt if request.param == "simt" else contract.backend()


# (value heads, key heads, dk, dv, rows per session, tails) -- tails: rows already in each session's chunk
CASES = [(2, None, 16, 16, [150], [0]), (4, 2, 16, 24, [5, 70, 0, 64], [0, 37, 3, 63]),
         (3, 3, 32, 32, [130, 1], [63, 0]), (2, 1, 64, 16, [65], [20])]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c[0]}-dk{c[2]}-dv{c[3]}-{c[4]}")
def test_kernels_match_their_twin(chunk_backend, numpy_backend, rng, dtype, case):
    """Each session resumes its chunk (tails of 0..63 rows from an earlier pass) and runs its rows;
    outputs, states, chunk states and tails as the twin computes them."""
    heads, k_heads, dk, dv, ts, tails = case
    layer = make_layer(rng, heads, dk, dv, k_heads)
    streams = [layer.stream(rng, t + n + 1) for t, n in zip(tails, ts)]
    ref = Prompt(numpy_backend, layer, rng, len(ts), dtype)
    if any(tails):
        ref.run(streams, tails)  # the earlier pass, on numpy: both sides resume from the same chunk
    got = ref.copy()
    got.be = chunk_backend
    for name in ("states", "windows", "chunk_states", "tails"):
        setattr(got, name, [chunk_backend.asarray(x) for x in getattr(got, name)])
    want, out = ref.run(streams, ts), got.run(streams, ts)
    tol = REF_TOLERANCE[np.dtype(dtype)]
    within(out, want, tol, "out")
    for name, g, r in zip(("state", "conv window", "chunk state", "tail"), got.host(), ref.host()):
        for s, (x, y) in enumerate(zip(g, r)):
            if x.size:  # a window holds inputs (exact); a tail conv outputs (expf's last bit) and gates
                within(x, y, 0 if name == "conv window" else tol, f"{name} {s}")


SPLITS = [[37, 113], [64, 86], [1, 63, 1, 85], [100, 50], [30] * 5]


@pytest.mark.parametrize("dtype", [np.dtype(F32), BF16], ids=str)
def test_one_pass_equals_any_split_and_a_resumed_capture(simt, rng, dtype):
    """A prompt of 150 rows in one pass, and in passes cut on the grid (64) and off it (1, 37, 63,
    65, 100, passes of 30): the outputs, the live state and window, the chunk state and the tail's
    rows are bitwise the same. A copy of the state taken after a pass that ends off the grid
    (a prefix capture) resumes to the same bits."""
    layer = make_layer(rng, 4, 16, 24, k_heads=2)
    stream = layer.stream(rng, 150)
    start = Prompt(simt, layer, rng, 1, dtype)
    one = start.copy()
    want = one.run([stream], [150])
    for split in SPLITS:
        p = start.copy()
        got = np.concatenate([p.run([stream], [n]) for n in split])
        np.testing.assert_array_equal(bits(got), bits(want), err_msg=f"split {split}")
        assert_bitwise(p.host(), one.host(), f"split {split}")
    p = start.copy()
    head = p.run([stream], [37])
    capture = p.copy()  # what a prefix capture keeps
    rest = capture.run([stream], [113])
    np.testing.assert_array_equal(bits(np.concatenate([head, rest])), bits(want), err_msg="resumed")
    assert_bitwise(capture.host(), one.host(), "resumed")


def test_a_session_alone_equals_it_in_a_batch(simt, rng):
    """Sessions of other lengths and tails around it change nothing in its bits."""
    layer = make_layer(rng, 2, 32, 16)
    streams = [layer.stream(rng, 200) for _ in range(4)]
    batch = Prompt(simt, layer, rng, 4, BF16)
    batch.run(streams, [37, 5, 64, 0])
    alone = [batch.copy() for _ in range(4)]
    out = batch.run(streams, [90, 130, 1, 70])
    starts = np.cumsum([0, 90, 130, 1])
    for b, n in enumerate((90, 130, 1, 70)):
        solo = alone[b]
        ts = [n if i == b else 0 for i in range(4)]
        np.testing.assert_array_equal(bits(solo.run(streams, ts)), bits(out[starts[b] : starts[b] + n]))
        assert_bitwise([x[b : b + 1] for x in solo.host()], [x[b : b + 1] for x in batch.host()], f"session {b}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_within_tolerance_of_the_sequential_scan(simt, numpy_backend, rng, dtype):
    """200 rows from a nonzero state: the chunked pass against the token-by-token scan (what decode
    and verify run), outputs and the final state within CHUNK_TOLERANCE; strong decays included."""
    layer = make_layer(rng, 6, 32, 24, k_heads=3)
    stream = layer.stream(rng, 200)
    p = Prompt(simt, layer, rng, 1, dtype)
    s0, w0 = numpy_backend.to_host(p.states[0]).copy(), numpy_backend.to_host(p.windows[0]).copy()
    got = p.run([stream], [200])
    st, win = [s0.copy()], [w0.copy()]
    seq = gdn_scan(numpy_backend, *stream, layer.conv_weight, layer.A_log, layer.dt_bias, st, win,
                   np.array([0, 200], np.int32), heads=layer.heads, dk=layer.dk, dv=layer.dv, k_heads=layer.k_heads)
    tol = CHUNK_TOLERANCE[np.dtype(dtype)]
    within(got, seq, tol, "out")
    within(simt.to_host(p.states[0]), st[0], tol, "state")
    np.testing.assert_array_equal(simt.to_host(p.windows[0]), win[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_within_tolerance_of_transformers_chunked_reference(simt, rng, dtype):
    """transformers' qwen3_5 torch_chunk_gated_delta_rule (its prompt path) on the same conv outputs,
    gates and initial state: outputs and final state within CHUNK_TOLERANCE."""
    torch = peer("torch")
    modeling = peer("transformers.models.qwen3_5.modeling_qwen3_5")
    layer = make_layer(rng, 4, 32, 32, k_heads=2)
    H, Hk, dk, dv = layer.heads, layer.k_heads, layer.dk, layer.dv
    mixed, a, b = layer.stream(rng, 150)
    p = Prompt(simt, layer, rng, 1, dtype)
    s0, w0 = simt.to_host(p.states[0]).copy(), simt.to_host(p.windows[0]).copy()
    got = p.run([(mixed, a, b)], [150])
    x, _ = conv_silu_ref(conv_windows_of(w0[None], mixed, np.array([0, 150])), layer.conv_weight, mixed)
    q = np.repeat(x[:, : Hk * dk].reshape(150, Hk, dk), H // Hk, axis=1)
    k = np.repeat(x[:, Hk * dk : 2 * Hk * dk].reshape(150, Hk, dk), H // Hk, axis=1)
    v = x[:, 2 * Hk * dk :].reshape(150, H, dv)
    t = lambda arr: torch.from_numpy(np.ascontiguousarray(arr))[None]  # noqa: E731
    g = -torch.exp(torch.from_numpy(layer.A_log)) * torch.nn.functional.softplus(torch.from_numpy(a + layer.dt_bias))
    out, state = modeling.torch_chunk_gated_delta_rule(
        t(q), t(k), t(v), g[None], torch.sigmoid(torch.from_numpy(b))[None], chunk_size=64,
        initial_state=torch.from_numpy(s0.transpose(0, 2, 1).copy())[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    tol = CHUNK_TOLERANCE[np.dtype(dtype)]
    within(got, out[0].numpy(), tol, "out")
    within(simt.to_host(p.states[0]), state[0].numpy().transpose(0, 2, 1), tol, "state")


def test_randomised_schedule(simt, rng):
    """Threads in a random order between barriers, cp.async copies landing at random points up to
    their waits (the state walk prefetches the next chunk): the same bits."""
    layer = make_layer(rng, 2, 16, 16)
    stream = layer.stream(rng, 140)
    start = Prompt(simt, layer, rng, 1, BF16)
    start.run([stream], [10])
    a, b = start.copy(), start.copy()
    want = a.run([stream], [130])
    with simt.kernels.schedule(seed=int(rng.integers(1, 2**31))):
        got = b.run([stream], [130])
    np.testing.assert_array_equal(bits(got), bits(want))
    assert_bitwise(b.host(), a.host(), "random schedule")


def test_bad_input_is_refused_and_changes_nothing(simt, rng):
    layer = make_layer(rng, 2, 16, 16)
    stream = layer.stream(rng, 10)
    p = Prompt(simt, layer, rng, 1, F32)
    before = p.host()
    L = layer
    args = (simt.asarray(stream[0]), simt.asarray(stream[1]), simt.asarray(stream[2]), L.conv_weight, L.A_log,
            L.dt_bias, p.states, p.windows, p.chunk_states, p.tails, np.array([0, 10], np.int32))
    with pytest.raises(CapacityError, match=r"tail_lens=\[64\]: expected ints in \[0, 64\)"):
        gdn_prompt(simt, *args, np.array([64], np.int32), heads=2, dk=16, dv=16)
    with pytest.raises(ShapeError, match="dk=24"):
        gdn_prompt(simt, *args, np.array([0], np.int32), heads=2, dk=24, dv=16)
    with pytest.raises(ShapeError, match=r"tails\[0\] has shape"):
        gdn_prompt(simt, *args[:9], [simt.asarray(np.zeros((CHUNK, 5), F32))], args[10], np.array([0], np.int32),
                   heads=2, dk=16, dv=16)
    assert_bitwise(p.host(), before, "refused")
