"""Philox4x32-10, the draw transforms and the stream layout: known answers, the kernels against
the NumPy twin bit for bit, and the accuracy of the bit-exact log and exp."""

import re

import numpy as np
import pytest

from dspark import philox
from dspark.kernel_sources import csrc_dir
from dspark.errors import DTypeError, ShapeError
from dspark.ops.sampling import philox_random
from dspark.philox import Tag

u32 = np.uint32

# Random123 kat_vectors, Philox4x32-10: (counter, key) -> output.
KAT = [
    ([0x00000000] * 4, [0x00000000] * 2, [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
]


def as_u32(rows):
    return np.array(rows, dtype=np.uint64).astype(u32)


def ulps(got, want64):
    """|got - want| in units of float32 spacing at got."""
    got = np.asarray(got, np.float32)
    return np.abs(got.astype(np.float64) - want64) / np.spacing(np.abs(got)).astype(np.float64)


def test_known_answers_numpy():
    for ctr, key, want in KAT:
        np.testing.assert_array_equal(philox.philox4x32(as_u32(ctr), as_u32(key)), as_u32(want))


def test_known_answers_kernel(any_backend):
    be = any_backend
    ctr = as_u32([c for c, _, _ in KAT])
    key = as_u32([k for _, k, _ in KAT])
    bits = philox_random(be, be.asarray(ctr), be.asarray(key))[0]
    np.testing.assert_array_equal(be.to_host(bits), as_u32([w for _, _, w in KAT]))


def test_kernel_equals_numpy_bitwise_on_a_million_counters(kernel_backend, rng):
    """Philox words and all three float transforms, bit for bit, in one launch."""
    be = kernel_backend
    n = 1_000_000
    ctr = rng.integers(0, 2**32, (n, 4), dtype=np.uint64).astype(u32)
    key = rng.integers(0, 2**32, (n, 2), dtype=np.uint64).astype(u32)
    ctr[:4] = [[0] * 4, [0xFFFFFFFF] * 4, [0xFF] * 4, [0xFFFFFF00] * 4]  # the uniforms' extremes
    got = [be.to_host(a) for a in philox_random(be, be.asarray(ctr), be.asarray(key))]
    want = philox.philox4x32(ctr, key)
    np.testing.assert_array_equal(got[0], want)
    for name, g, w in zip(("uniform", "uniform_open", "gumbel"), got[1:],
                          (philox.uniform(want), philox.uniform_open(want), philox.gumbel(want))):
        assert w.dtype == np.float32
        np.testing.assert_array_equal(g.view(u32), w.view(u32), err_msg=name)


def test_empty_batch(kernel_backend):
    be = kernel_backend
    out = philox_random(be, be.asarray(np.zeros((0, 4), u32)), be.asarray(np.zeros((0, 2), u32)))
    assert [a.shape for a in out] == [(0, 4)] * 4


def test_rounds_parameter_and_broadcasting():
    ctr = np.zeros((3, 4), u32)
    key = np.array([[1, 2]], u32)
    ten = philox.philox4x32(ctr, key)
    assert ten.shape == (3, 4) and (ten == ten[0]).all()
    assert not np.array_equal(philox.philox4x32(ctr, key, rounds=7), ten)


def test_uniform_forms_are_the_exact_integer_forms():
    x = np.array([0, 0xFF, 0x100, 0x1FF, 0x200, 0xFFFFFFFF], u32)
    np.testing.assert_array_equal(philox.uniform(x), (x >> 8).astype(np.float64) / 2**24)
    np.testing.assert_array_equal(philox.uniform_open(x), ((x >> 9) * 2.0 + 1) / 2**24)
    assert philox.uniform(u32(0xFFFFFFFF)) < 1 and philox.uniform(u32(0)) == 0
    assert 0 < philox.uniform_open(u32(0)) and philox.uniform_open(u32(0xFFFFFFFF)) < 1


def test_gumbel_is_finite_for_every_word():
    """The open uniform form never reaches log(0) or -log(1) = 0: every one of its 2^23 values
    gives a finite Gumbel, -log(u) > 0 included."""
    x = (np.arange(2**23, dtype=np.uint64) << 9).astype(u32)
    e = -philox.log_f32(philox.uniform_open(x))
    assert (e > 0).all()
    g = philox.gumbel(x)
    assert np.isfinite(g).all() and -3 < g.min() and g.max() < 17


def test_log_is_within_one_ulp(rng):
    x = np.concatenate([philox.uniform_open(rng.integers(0, 2**32, 400_000, dtype=np.uint64).astype(u32)),
                        (10.0 ** rng.uniform(-37, 38, 100_000)).astype(np.float32),
                        np.float32([2.0**-126, 1.0, 2.0, 16.6355323, np.nextafter(np.float32(1), np.float32(0))])])
    got = philox.log_f32(x)
    assert got[x == 1] == 0
    assert ulps(got, np.log(x.astype(np.float64))).max() <= 1.0


def test_exp_is_within_one_ulp_and_clamps(rng):
    d = np.concatenate([-rng.uniform(0, 87, 500_000), [0.0, -1e-30, -87.0]]).astype(np.float32)
    got = philox.exp_f32(d)
    assert got[d == 0].tolist() == [1.0] and (got <= 1).all()
    assert ulps(got, np.exp(d.astype(np.float64))).max() <= 1.0
    edge = philox.exp_f32(np.float32([-87.0001, -1e4, -np.inf, np.nan]))
    np.testing.assert_array_equal(edge, np.zeros(4, np.float32))


def test_seed_key_and_stream_word_layout():
    np.testing.assert_array_equal(philox.seed_key(np.uint64(2**32 * 7 + 5)), u32([5, 7]))
    assert philox.stream_word(Tag.ACCEPT, 9) == (3 << 24) | 9
    with pytest.raises(ValueError, match="slot must lie in"):
        philox.stream_word(Tag.DRAFT, 1 << 24)
    # draw_words is the Philox block of (n lo, n hi, stream, index >> 2), word index & 3
    seed, n, stream = np.uint64(0x0123456789ABCDEF), np.uint64(2**40 + 3), philox.stream_word(Tag.DRAFT, 2)
    block = philox.philox4x32(u32([3, 2**8, stream, 1]), philox.seed_key(seed))
    np.testing.assert_array_equal(philox.draw_words(seed, n, stream, np.arange(4, 8)), block)
    np.testing.assert_array_equal(philox.row_words([seed], [n], [stream], 10)[0],
                                  philox.draw_words(seed, n, stream, np.arange(10)))


def test_gumbel_rows_memo_is_the_rows_it_memoises():
    """The host reference's memo of noise rows (ops.sampling draws narrow rows through it) returns
    gumbel(row_words) of each key, with repeated and evicted keys: a memo returning a stale or
    another key's row would shift every coupled pick while greedy output stays exact."""
    memo = philox.GumbelRows(max_bytes=3 * 10 * 4)  # three rows of 10
    seed = np.array([1, 1, 2, 1, 1], np.uint64)
    n = np.array([5, 6, 5, 5, 7], np.uint64)
    stream = np.full(5, philox.stream_word(Tag.PICK, 0), u32)
    want = philox.gumbel(philox.row_words(seed, n, stream, 10))
    for _ in range(2):  # the second call: some rows from the memo, the evicted ones drawn again
        np.testing.assert_array_equal(memo(seed, n, stream, 10), want)
        assert memo.nbytes <= memo.max_bytes
    np.testing.assert_array_equal(memo(seed[:2], n[:2], stream[:2], 7), want[:2, :7])  # the width is in the key
    assert memo(seed[:0], n[:0], stream[:0], 10).shape == (0, 10)


def test_tags_mirror_the_kernel_header():
    text = (csrc_dir() / "philox.cuh").read_text()
    tags = {name.upper(): int(v) for name, v in re.findall(r"kTag(\w+) = (\d+)", text)}
    assert tags == {t.name: int(t) for t in Tag}
    assert int(re.search(r"kPhiloxSlotBits = (\d+)", text).group(1)) == philox.SLOT_BITS


def test_streams_of_different_tags_never_collide():
    """Every (tag, counter, slot, quad) names its own Philox block: no two draws share one, so
    no word is ever reused between purposes, rounds or slots."""
    tags = np.array([int(t) for t in Tag])
    n = np.concatenate([np.arange(2000, dtype=np.uint64), np.uint64(2**32) + np.arange(50, dtype=np.uint64),
                        np.uint64(2**64 - 1) - np.arange(50, dtype=np.uint64)])
    slots = np.arange(4)
    t, c, s = (a.ravel() for a in np.meshgrid(tags, n, slots, indexing="ij"))
    stream = philox.stream_word(t, s)
    seed = np.uint64(0x9E3779B97F4A7C15)
    words = np.stack([philox.draw_words(seed, c, stream, i) for i in range(8)], axis=1)  # two quads
    assert len(np.unique(words.view(np.dtype((np.void, 32))))) == len(words)
    assert len(np.unique(np.ascontiguousarray(words[:, :4]).view(np.dtype((np.void, 16))))) == len(words)
    # and the same draw under another seed differs
    other = philox.draw_words(seed + np.uint64(1), c, stream, 0)
    assert (other != words[:, 0]).mean() > 0.99


def test_draws_are_pure_functions_of_their_coordinates(rng):
    seed = rng.integers(0, 2**64, 100, dtype=np.uint64)
    n = rng.integers(0, 2**64, 100, dtype=np.uint64)
    stream = philox.stream_word(Tag.BONUS, 0)
    a = philox.draw_words(seed, n, stream, 5)
    perm = rng.permutation(100)
    np.testing.assert_array_equal(philox.draw_words(seed[perm], n[perm], stream, 5), a[perm])
    np.testing.assert_array_equal(philox.draw_words(seed[7], n[7], stream, 5), a[7])


def test_philox_random_rejects_bad_inputs(kernel_backend):
    be = kernel_backend
    with pytest.raises(ShapeError, match=r"ctr has shape \(4, 3\): expected \(4, 4\)"):
        philox_random(be, be.asarray(np.zeros((4, 3), u32)), be.asarray(np.zeros((4, 2), u32)))
    with pytest.raises(DTypeError, match="key has dtype int64: expected uint32"):
        philox_random(be, be.asarray(np.zeros((4, 4), u32)), be.asarray(np.zeros((4, 2), np.int64)))
    with pytest.raises(ShapeError, match=r"key has shape \(3, 2\): expected \(4, 2\)"):
        philox_random(be, be.asarray(np.zeros((4, 4), u32)), be.asarray(np.zeros((3, 2), u32)))
