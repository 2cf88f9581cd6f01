"""moe: the router, the grouped expert product and the combine (csrc/moe.cu) on simt against their
NumPy twins (dspark.ops.moe): the routing's ids and grouping exactly, its weights up to exp's last
bit; ties to the lower expert in the kernel and in the twin; each grouped row bitwise the product
(dspark.ops.linear) of its row by its expert; a row's block output the same bits alone and in
batches of 2, 7 and 16 (numpy and simt); FP8 experts (e4m3 bytes and block scales, quantized by the
tests' FP8 recipe): the kernel bitwise its twin, each grouped row bitwise the dense linear_fp8 of its
row by its expert's matrix (simt and numpy), the same row invariance; a verify of w rows reading
each distinct expert once, counted from the plan's CTA-to-expert map against the twin's routing;
bad input refused before anything is written."""

import numpy as np
import pytest

from dspark.dtypes import BF16
from dspark.errors import DTypeError, ShapeError
from dspark.ops import moe
from dspark.ops.activation import swiglu_ref
from dspark.ops.fp8 import Fp8Stack, scale_grid
from dspark.ops.linear import FP8_ALIGN, linear, linear_mma_ref, linear_ref, mma_split_plan, split_plan
from dspark.ops.product import product_ref
from tests.conftest import poison
from tests.models.fp8_models import quantize

# (rows, experts, top_k): one row, ragged lanes (37 experts), a prompt's rows, the kernels' widest
ROUTES = [(1, 16, 4), (7, 37, 5), (33, 128, 8), (300, 16, 4), (9, 512, 32)]


def routed(be, logits, k, renorm=True, tile_rows=16):
    return moe.route(be, be.asarray(logits), logits.shape[1], k, renorm, tile_rows)


@pytest.mark.parametrize("renorm", [True, False], ids=["renorm", "plain"])
@pytest.mark.parametrize("rows,E,k", ROUTES, ids=[f"{r}x{e}k{k}" for r, e, k in ROUTES])
def test_router_matches_its_twin(simt, rng, rows, E, k, renorm):
    """Ids, pos, src, counts, offsets and the map exactly; weights within 1e-6 (exp's last bit, through
    the sum and the divisions)."""
    logits = (rng.standard_normal((rows, E)) * 3).astype(np.float32)
    tile = 16 if rows > 100 else 4
    r = routed(simt, logits, k, renorm, tile)
    ids, w = moe.route_ref(logits, k, renorm)
    g = moe.group_ref(ids, E, tile)
    assert np.array_equal(r.ids, ids)
    np.testing.assert_allclose(r.weights, w, rtol=1e-6, atol=0)
    assert np.all(np.diff(ids, axis=1) > 0), "a row's entries go in increasing expert id"
    for name in ("pos", "src", "counts", "offsets"):
        assert np.array_equal(getattr(r, name), getattr(g, name)), name
    assert list(r.stats) == [len(g.items), g.distinct]
    assert np.array_equal(r.items[: len(g.items)], g.items)
    if renorm:
        np.testing.assert_allclose(w.sum(axis=1), 1, rtol=1e-6)


def tie_rows(E):
    """Router rows whose top values tie: everything equal; three equal maxima across lanes (3, 35,
    67 share lane 3); equal values straddling the k-th place; a tie at the k-th place only."""
    rows = np.zeros((4, E), np.float32)
    rows[1, [3, 35, 67]] = 2.0
    rows[2, [1, 2]] = 3.0
    rows[2, [40, 9, 70, 5]] = 1.0
    rows[3] = np.linspace(-1, 0, E, dtype=np.float32)
    rows[3, [50, 20]] = 0.5
    rows[3, [60, 30]] = 0.25
    return rows


def test_router_ties_pick_the_lower_index(simt):
    """Equal probabilities go to the lower expert index, in the kernel and in the twin."""
    E, k = 80, 4
    logits = tie_rows(E)
    want = [[0, 1, 2, 3], [3, 35, 67, 0], [1, 2, 5, 9], [20, 30, 50, 60]]
    ids, _ = moe.route_ref(logits, k, True)
    assert [sorted(r) for r in ids.tolist()] == [sorted(r) for r in want]
    r = routed(simt, logits, k)
    assert np.array_equal(r.ids, ids)


FP8 = "fp8"  # experts(dtype=FP8): an Fp8Stack


def experts(rng, E, K, N, dtype, compute=BF16):
    """E random experts [K, N]: of `dtype`, or FP8 (an Fp8Stack computing in `compute`), each
    quantized by the FP8 recipe from its [N, K] checkpoint layout (f32 scales, as our layout holds)."""
    w = (rng.standard_normal((E, K, N)) / np.sqrt(K)).astype(np.float32)
    if dtype != FP8:
        return w.astype(dtype)
    per = [quantize(np.ascontiguousarray(m.T)) for m in w]
    return Fp8Stack(np.stack([q.view(np.uint8).T for q, _ in per]), np.stack([s.T for _, s in per]),
                    np.dtype(compute))


def itemsize_of(w) -> int:
    return 1 if isinstance(w, Fp8Stack) else w.dtype.itemsize


def product_of(x, w):
    """The product (dspark.ops.linear's kernels' twins) of rows x by one expert's w [K, N]."""
    K, N = w.shape
    if w.dtype == np.float32:
        return linear_ref(x, w, split_plan(K, N)[1])
    return linear_mma_ref(x, w, mma_split_plan(K, N)[1])


# (rows, E, K, N): one row, a few, an expert with more rows than a tensor-core tile (17+: BM 128) over
# two column tiles, and K in two chunks (split mode: partials and the last CTA's fold per item)
@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "grouped"])
@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows,E,K,N", [(1, 16, 37, 70), (7, 16, 64, 40), (20, 19, 40, 264), (2, 16, 600, 24)])
def test_grouped_rows_are_the_product_by_their_expert(simt, rng, rows, E, K, N, dtype, gather):
    k = 4
    logits = rng.standard_normal((rows, E)).astype(np.float32)
    plan = moe.grouped_plan(rows, k, E, K, N, np.dtype(dtype).itemsize)
    r = routed(simt, logits, k, tile_rows=plan.tile_rows)
    x = rng.standard_normal((rows if gather else rows * k, K)).astype(np.float32)
    w = experts(rng, E, K, N, dtype)
    out = poison(np, (rows * k, N), np.float32)
    moe.grouped_linear(simt, x, w, r, gather=gather, out=out)
    g = r.grouping or moe.group_ref(r.ids, E, plan.tile_rows)
    for e in np.flatnonzero(g.counts):
        at = g.rows_of(e)
        assert np.array_equal(out[at], product_of(x[g.src[at]] if gather else x[at], w[e])), f"expert {e}"


# FP8 experts: K and N off the 128 grid and over it, rows in one tile (BM 16) and past it (BM 128), K in
# one chunk and in two (600: kchunk 384, split mode)
FP8_SHAPES = [(1, 16, 200, 136), (3, 17, 64, 40), (20, 19, 130, 264), (2, 16, 600, 24)]


def fp8_grouped(be, rng, rows, E, K, N, gather, compute):
    """(x, w, grouping, out) of one FP8 grouped product on `be` into a poisoned buffer."""
    k = 4
    plan = moe.grouped_plan(rows, k, E, K, N, 1)
    assert plan.entry == f"moe_linear_fp8_bf16_m{16 if rows <= 16 else 128}" and plan.kchunk % 128 == 0
    x = rng.standard_normal((rows if gather else rows * k, K)).astype(np.float32)
    w = experts(rng, E, K, N, FP8, compute)
    r = routed(be, rng.standard_normal((rows, E)).astype(np.float32), k, tile_rows=plan.tile_rows)
    out = poison(np, (rows * k, N), np.float32)
    moe.grouped_linear(be, x, w, r, gather=gather, out=out)
    return x, w, r.grouping or moe.group_ref(r.ids, E, plan.tile_rows), out


@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "grouped"])
@pytest.mark.parametrize("rows,E,K,N", FP8_SHAPES)
def test_fp8_grouped_product_equals_its_twin(simt, rng, rows, E, K, N, gather):
    """The kernel bitwise its twin (grouped_linear_ref: linear_fp8_ref per expert, linear_fp8's K
    chunk), every grouped row written."""
    x, w, g, out = fp8_grouped(simt, rng, rows, E, K, N, gather, BF16)
    assert np.array_equal(out, moe.grouped_linear_ref(x, w, g, gather=gather))


@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "grouped"])
@pytest.mark.parametrize("rows,E,K,N", FP8_SHAPES)
def test_fp8_grouped_rows_are_linear_fp8_by_their_expert(simt, numpy_backend, rng, rows, E, K, N, gather):
    """Every grouped row bitwise the dense product of its row by its expert's matrix: simt's
    linear_fp8 kernel (csrc/linear_fp8.cu), and on numpy the numpy backend's linear_fp8 (the native
    product on the bytes)."""
    for be, compute in ((simt, BF16), (numpy_backend, np.float32)):
        x, w, g, out = fp8_grouped(be, rng, rows, E, K, N, gather, compute)
        for e in np.flatnonzero(g.counts):
            at = g.rows_of(e)
            dense = linear(be, x[g.src[at]] if gather else x[at], w[e])
            assert np.array_equal(out[at], dense), f"{be.name} expert {e}"


# (rows, E, K, N): one row, a few (BM 16), an expert past a tile (BM 128), K in two chunks (split mode)
SWIGLU_SHAPES = [(1, 16, 40, 70), (7, 16, 64, 40), (20, 19, 40, 264), (2, 16, 600, 24)]


@pytest.mark.parametrize("dtype", [BF16, FP8, np.float32], ids=["bf16", "fp8", "f32"])
@pytest.mark.parametrize("rows,E,K,N", SWIGLU_SHAPES)
def test_the_down_product_over_gate_up_is_swiglu_then_the_product(simt, rng, rows, E, K, N, dtype):
    """grouped_linear(swiglu=True) over the grouped rows' gate|up is bitwise `activation.swiglu` then
    the grouped product: 16-bit and FP8 experts in the tile's stage, f32 experts by the two steps;
    gates of -100 (SiLU's -0) among them."""
    from dspark.ops.activation import swiglu
    k = 4
    w = experts(rng, E, K, N, dtype)
    plan = moe.grouped_plan(rows, k, E, K, N, itemsize_of(w))
    r = routed(simt, rng.standard_normal((rows, E)).astype(np.float32), k, tile_rows=plan.tile_rows)
    gate_up = (rng.standard_normal((rows * k, 2 * K)) * 3).astype(np.float32)
    gate_up[rng.random((rows * k, 2 * K)) < 0.05] = -100.0
    want = moe.grouped_linear(simt, swiglu(simt, gate_up), w, r, gather=False, out=poison(np, (rows * k, N), np.float32))
    got = moe.grouped_linear(simt, gate_up, w, r, gather=False, swiglu=True, out=poison(np, (rows * k, N), np.float32))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_the_moe_down_product_takes_its_swiglu_in_one_launch(rng):
    """Counted on the cuda path (the contract stand-in): bf16 and FP8 experts' down product over gate|up
    is one launch at 16 rows an expert, no swiglu_f32; f32 experts and a prompt's 128-row tiles keep
    swiglu_f32 then the product. Each the two steps' bits; gather with swiglu refused."""
    from dspark import profile
    from dspark.backends import contract
    from dspark.ops.activation import swiglu
    be = contract.backend()
    E, K, N, k = 16, 64, 40, 4
    for rows, dtype, entries in ((3, BF16, ["moe_linear_mma_bf16_swiglu_m16"]),
                                 (3, FP8, ["moe_linear_fp8_bf16_swiglu_m16"]),
                                 (3, np.float32, ["moe_linear_f32", "swiglu_f32"]),
                                 (20, BF16, ["moe_linear_mma_bf16_m128", "swiglu_f32"])):
        gate_up = rng.standard_normal((rows * k, 2 * K)).astype(np.float32)
        w = experts(rng, E, K, N, dtype)
        plan = moe.grouped_plan(rows, k, E, K, N, itemsize_of(w))
        w = Fp8Stack(be.asarray(w.q), be.asarray(w.scale), w.compute) if dtype == FP8 else be.asarray(w)
        r = routed(be, rng.standard_normal((rows, E)).astype(np.float32), k, tile_rows=plan.tile_rows)
        want = be.to_host(moe.grouped_linear(be, swiglu(be, be.asarray(gate_up)), w, r, gather=False))
        with profile.counting() as c:
            got = be.to_host(moe.grouped_linear(be, be.asarray(gate_up), w, r, gather=False, swiglu=True))
        assert sorted(c.by_name.elements()) == entries, (dtype, dict(c.by_name))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), dtype
    with pytest.raises(ShapeError, match="gather: the SwiGLU product reads grouped rows"):
        moe.grouped_linear(be, be.asarray(gate_up), w, r, gather=True, swiglu=True)


def block(be, h, router, w_gate_up, w_down, k, shared):
    """One MoE block through the ops, for a backend whose arrays are host arrays (numpy, simt): the
    router's logits (and the shared expert's gate beside them) and the SwiGLU by their row-invariant
    NumPy twins, so that only moe.cu's kernels run; `shared` the shared expert's output."""
    E = w_gate_up.shape[0]
    src = product_ref(h, router)  # [rows, E + 1]: the router's logits, then the shared expert's gate
    plan = moe.grouped_plan(h.shape[0], k, E, h.shape[1], w_gate_up.shape[2], itemsize_of(w_gate_up))
    r = moe.route(be, src, E, k, True, plan.tile_rows)
    act = swiglu_ref(moe.grouped_linear(be, h, w_gate_up, r, gather=True))
    y = moe.grouped_linear(be, np.ascontiguousarray(act), w_down, r, gather=False)
    return moe.combine(be, y, r, shared=shared, gate=(src, E))


def batch_around(rng, row, n, lead=None):
    """n rows holding `row`: the others `row` scaled by 1 to 1.05 (every logit scaled alike, so
    routed to its experts whatever the gaps between its logits) and `row` at a random place;
    or, given `lead` (a row routed to the highest of row's experts), `lead` first, rows anywhere
    (mostly routed to others) and `row` last: the batch reaches row's experts in another order than
    row alone does (what a combine in arrival order would show)."""
    d = row.shape[0]
    if lead is None:
        at = int(rng.integers(0, n))
        scale = 1.0 + 0.05 * rng.random((n - 1, 1))
        return np.insert((row * scale).astype(np.float32), at, row, axis=0), at
    others = rng.standard_normal((n - 1, d)).astype(np.float32)
    others[0] = lead
    return np.concatenate([others, row[None]]).astype(np.float32), n - 1


@pytest.mark.parametrize("backend,dtype", [("numpy_backend", np.float32), ("simt", np.float32), ("simt", BF16),
                                           ("numpy_backend", FP8), ("simt", FP8)],
                         ids=["numpy", "simt-f32", "simt-bf16", "numpy-fp8", "simt-fp8"])
def test_a_rows_output_is_the_same_bits_alone_and_in_any_batch(request, rng, backend, dtype):
    """A row's MoE output alone equals the same row in batches of 2, 7 and 16 whose other rows are
    routed to its own experts and to others (the shared expert's gate and output included)."""
    be = request.getfixturevalue(backend)
    d, E, I, k = 48, 16, 24, 4
    router = rng.standard_normal((d, E + 1)).astype(np.float32)
    compute = np.float32 if be.kernels is None else BF16
    wgu, wd = experts(rng, E, d, 2 * I, dtype, compute), experts(rng, E, I, d, dtype, compute)
    row = rng.standard_normal((1, d)).astype(np.float32)
    alone = block(be, row, router, wgu, wd, k, np.tanh(row))  # tanh: any per-row shared output
    mine = moe.route_ref(product_ref(row, router)[:, :E], k, True)[0][0]
    # logits +5 at row's highest expert and -5 at row's others (the least-norm such row: the other experts'
    # logits stay small, so its softmax underflows nowhere and no tie picks the lowest ids): it shares one expert
    target = np.array([-5.0] * (k - 1) + [5.0])
    lead = np.linalg.lstsq(router[:, mine].T.astype(np.float64), target, rcond=None)[0].astype(np.float32)
    for n in (2, 7, 16):
        for same in (True, False):
            h, at = batch_around(rng, row[0], n, None if same else lead)
            got = block(be, h, router, wgu, wd, k, np.tanh(h))
            assert np.array_equal(got[at], alone[0]), (n, same)
            routes = moe.route_ref(product_ref(h, router)[:, :E], k, True)[0]
            shared_experts = [len(set(mine) & set(r)) for i, r in enumerate(routes) if i != at]
            assert (max(shared_experts) == k) if same else (min(shared_experts) < k), shared_experts
            if not same:
                assert mine[-1] in routes[0] and not set(mine[:-1]) <= set(routes[0]), (mine, routes[0])


@pytest.mark.parametrize("backend", ["numpy_backend", "simt"], ids=["numpy", "simt"])
def test_combine_matches_its_twin(request, rng, backend):
    """The kernel bitwise without the shared expert, with it up to the gate's exp; the numpy
    backend's expert-by-expert loop bitwise with both."""
    be = request.getfixturevalue(backend)
    rows, k, N, E = 9, 4, 50, 16
    r = routed(be, rng.standard_normal((rows, E)).astype(np.float32), k)
    y = rng.standard_normal((rows * k, N)).astype(np.float32)
    assert np.array_equal(moe.combine(be, y, r), moe.combine_ref(y, r.pos, r.weights))
    shared = rng.standard_normal((rows, N)).astype(np.float32)
    src = rng.standard_normal((rows, E + 1)).astype(np.float32)
    got = moe.combine(be, y, r, shared=shared, gate=(src, E))
    want = moe.combine_ref(y, r.pos, r.weights, shared, src[:, E])
    if be.kernels is None:
        assert np.array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("itemsize", [4, 2, 1], ids=["f32", "bf16", "fp8"])
@pytest.mark.parametrize("w", [1, 4, 8, 16])
def test_a_verify_reads_each_distinct_expert_once(simt, rng, w, itemsize):
    """Counted from the plan's CTA-to-expert map for the twin's routing of w verify rows: every
    distinct expert's weights are read once in all (the union of the rows' experts; FP8: its bytes
    and its f32 block scales), and the router kernel's map is that map."""
    E, k, K, N = 64, 8, 256, 192
    logits = rng.standard_normal((w, E)).astype(np.float32)
    plan = moe.grouped_plan(w, k, E, K, N, itemsize)
    ids, _ = moe.route_ref(logits, k, True)
    g = moe.group_ref(ids, E, plan.tile_rows)
    per_expert = plan.expert_bytes(g)
    one = K * N * itemsize + (4 * np.prod(scale_grid(K, N)) if itemsize == 1 else 0)
    assert set(per_expert) == set(np.unique(ids).tolist())
    assert all(b == one for b in per_expert.values()), per_expert
    assert sum(c["w_bytes"] for c in plan.ctas(g)) == g.distinct * one
    assert len(g.items) <= plan.items
    r = routed(simt, logits, k, tile_rows=plan.tile_rows)
    assert np.array_equal(r.items[: int(r.stats[0])], g.items) and int(r.stats[1]) == g.distinct


def test_bad_input_is_refused_before_anything_is_written(simt, rng):
    rows, E, k = 5, 16, 4
    logits = rng.standard_normal((rows, E)).astype(np.float32)
    with pytest.raises(ShapeError, match=r"top_k=17: expected 1 to min\(experts=16, 32\)"):
        moe.route(simt, logits, E, 17, True, 16)
    with pytest.raises(ShapeError, match="experts=20: expected 1 to min"):
        moe.route(simt, logits, 20, k, True, 16)
    r = routed(simt, logits, k)
    x, w = rng.standard_normal((rows, 32)).astype(np.float32), experts(rng, E, 32, 24, np.float32)
    out = poison(np, (rows * k, 24), np.float32)
    before = out.copy()
    with pytest.raises(ShapeError, match="w has 8 experts: the routing has 16"):
        moe.grouped_linear(simt, x, w[:8], r, gather=True, out=out)
    with pytest.raises(ShapeError, match=r"x has shape \(5, 32\): expected \(20, 32\) \(the grouped rows\)"):
        moe.grouped_linear(simt, x, w, r, gather=False, out=out)
    with pytest.raises(DTypeError, match="the grouped product's kernels take float32 or bfloat16"):
        moe.grouped_linear(simt, x, w.astype(np.float16), r, gather=True, out=out)
    fp8 = experts(rng, E, 32, 24, FP8, np.float16)
    with pytest.raises(DTypeError, match="w.compute is float16: the FP8 experts' kernels multiply with bfloat16"):
        moe.grouped_linear(simt, x, fp8, r, gather=True, out=out)
    with pytest.raises(ShapeError, match=r"w.scale has shape \(16, 1, 2\)"):
        moe.grouped_linear(simt, x, Fp8Stack(fp8.q, np.ones((E, 1, 2), np.float32), BF16), r, gather=True, out=out)
    assert np.array_equal(out, before, equal_nan=True)


def test_the_plan_splits_k_by_k_and_n_alone():
    """The grouped product's K split is the product's (from K and N), whatever the rows; a K of two
    chunks runs one CTA per chunk while the worst-case CTAs are few."""
    for itemsize in (4, 2, 1):
        plans = [moe.grouped_plan(rows, 8, 64, 600, 24, itemsize) for rows in (1, 5, 16, 17, 300)]
        assert len({(p.splits, p.kchunk) for p in plans}) == 1 and plans[0].splits == 2
        assert plans[0].grid_splits == 2
    fp8 = moe.grouped_plan(3, 8, 64, 600, 24, 1)  # FP8: linear_fp8's chunk, whole scale blocks
    assert fp8.kchunk == mma_split_plan(600, 24, FP8_ALIGN)[1] and fp8.kchunk % 128 == 0
