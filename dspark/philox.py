"""Philox4x32-10 and dspark's random streams: the vectorised NumPy twin of csrc/philox.cuh.

Every function here replays the kernel's integer and float32 steps exactly, so the numpy backend
and the kernels draw bit-identical numbers.

Stream layout (also documented in csrc/philox.cuh). A draw is a pure function of
(seed, tag, counter n, slot, index):

    key     = (seed lo, seed hi)
    counter = (n lo, n hi, tag << 24 | slot, index >> 2)        output word = index & 3

`n` is the absolute position of the token drawn (PICK) or the session's own 64-bit round counter
(the rejection sampler's tags, continued across bursts), `tag` the purpose (`Tag`), `slot` the
position inside the round (draft slot, accept test), `index` the vocabulary entry for per-token
noise and 0 for a scalar draw. For a fixed key Philox is a bijection of the counter, so draws that
differ in (tag, n, slot, index >> 2) never share a block. Rejection sampling never uses a word
twice; the coupled sampler shares a position's PICK noise between the drafter's proposal and the
target's pick on purpose (dspark.spec_sampling).
"""

from __future__ import annotations

import enum

import numpy as np

u32, u64, f32 = np.uint32, np.uint64, np.float32

M0, M1 = u64(0xD2511F53), u64(0xCD9E8D57)   # round multipliers
W0, W1 = u32(0x9E3779B9), u32(0xBB67AE85)   # Weyl key bumps
SLOT_BITS = 24
MAX_SLOT = (1 << SLOT_BITS) - 1


class Tag(enum.IntEnum):
    """Purpose of a draw (csrc/philox.cuh PhiloxTag). 0 is unused so a forgotten tag shows."""
    PICK = 1       # the Gumbel-max pick of the token at absolute position n (slot 0): plain sampled
                   # decode, every first anchor, the coupled drafter's proposal and verify pick
    DRAFT = 2      # rejection sampling: drafter slots (slot = draft slot)
    ACCEPT = 3     # rejection sampling: accept test of draft j (slot = j)
    RESIDUAL = 4   # rejection sampling: residual draw after a reject
    BONUS = 5      # rejection sampling: bonus draw after a full accept


def philox4x32(ctr, key, rounds: int = 10) -> np.ndarray:
    """Philox4x32-`rounds` of counters `ctr` uint32 [..., 4] under keys `key` uint32 [..., 2]
    (broadcast against each other) -> uint32 [..., 4]."""
    ctr = np.asarray(ctr, u32)
    key = np.asarray(key, u32)
    if ctr.shape[-1:] != (4,) or key.shape[-1:] != (2,):
        raise ValueError(f"ctr must be [..., 4] and key [..., 2] uint32, got {ctr.shape} and {key.shape}")
    c0, c1, c2, c3 = (ctr[..., i] for i in range(4))
    k0, k1 = key[..., 0], key[..., 1]
    with np.errstate(over="ignore"):
        for r in range(rounds):
            if r:
                k0, k1 = k0 + W0, k1 + W1
            p0 = c0.astype(u64) * M0
            p1 = c2.astype(u64) * M1
            hi0, lo0 = (p0 >> u64(32)).astype(u32), p0.astype(u32)
            hi1, lo1 = (p1 >> u64(32)).astype(u32), p1.astype(u32)
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return np.stack(np.broadcast_arrays(c0, c1, c2, c3), axis=-1)


# ---- streams -----------------------------------------------------------------------------------
def stream_word(tag, slot=0) -> np.ndarray:
    """tag << 24 | slot, the third counter word of a draw."""
    tag = np.asarray(tag, np.int64)
    slot = np.asarray(slot, np.int64)
    if np.any((slot < 0) | (slot > MAX_SLOT)):
        raise ValueError(f"slot must lie in [0, {MAX_SLOT}]")
    return ((tag << SLOT_BITS) | slot).astype(u32)


def seed_key(seed) -> np.ndarray:
    """The Philox key of a 64-bit session seed: uint32 [..., 2] = (lo, hi)."""
    seed = np.asarray(seed, u64)
    return np.stack([seed.astype(u32), (seed >> u64(32)).astype(u32)], axis=-1)


def draw_words(seed, counter, stream, index) -> np.ndarray:
    """The uint32 word of each draw (seed, counter n, stream word, index), all broadcast."""
    seed, n, stream, index = np.broadcast_arrays(np.asarray(seed, u64), np.asarray(counter, u64),
                                                 np.asarray(stream, u32), np.asarray(index, u32))
    ctr = np.stack([n.astype(u32), (n >> u64(32)).astype(u32), stream, index >> u32(2)], axis=-1)
    block = philox4x32(ctr, seed_key(seed))
    return np.take_along_axis(block, (index & u32(3)).astype(np.intp)[..., None], axis=-1)[..., 0]


def row_words(seed, counter, stream, vocab: int) -> np.ndarray:
    """The per-token words [rows, vocab] of one draw per row (index = vocabulary entry)."""
    seed, counter, stream = (np.asarray(a).reshape(-1) for a in (seed, counter, stream))
    quads = -(-vocab // 4)
    n = np.asarray(counter, u64)[:, None]
    ctr = np.stack(np.broadcast_arrays(n.astype(u32), (n >> u64(32)).astype(u32),
                                       np.asarray(stream, u32)[:, None], np.arange(quads, dtype=u32)[None, :]),
                   axis=-1)
    block = philox4x32(ctr, seed_key(seed)[:, None, :])
    return block.reshape(len(seed), quads * 4)[:, :vocab]


# ---- uniforms: exact integer forms -------------------------------------------------------------
TWO_M24 = f32(2.0**-24)


def uniform(x) -> np.ndarray:
    """[0, 1): (x >> 8) * 2^-24."""
    return (np.asarray(x, u32) >> u32(8)).astype(f32) * TWO_M24


def uniform_open(x) -> np.ndarray:
    """(0, 1): (2 (x >> 9) + 1) * 2^-24, so that both logs of the Gumbel transform are finite and
    -log(u) > 0 (see csrc/philox.cuh)."""
    return (((np.asarray(x, u32) >> u32(9)) << u32(1)) | u32(1)).astype(f32) * TWO_M24


# ---- bit-exact float32 log and exp (the kernels' sequences, step by step) ---------------------
def _f(bits: int) -> np.float32:
    return np.array(bits, u32).view(f32)[()]


LN2_HI, LN2_LO = _f(0x3F317180), _f(0x3717F7D1)
LG1, LG2, LG3, LG4 = _f(0x3F2AAAAA), _f(0x3ECCCE13), _f(0x3E91E9EE), _f(0x3E789E26)
LOG2E, EXP_C1, EXP_C2 = _f(0x3FB8AA3B), _f(0x3F318000), _f(0xB95E8083)
EXP_POLY = tuple(_f(b) for b in (0x39506967, 0x3AB743CE, 0x3C088908, 0x3D2AA9C1, 0x3E2AAAAA)) + (f32(0.5),)
ROUND_MAGIC = f32(12582912.0)


def log_f32(x) -> np.ndarray:
    """log(x) for positive normal float32 x, exactly as csrc/philox.cuh philox_log."""
    x = np.asarray(x, f32)
    ix = x.view(u32) + u32(0x3F800000 - 0x3F3504F3)
    k = (ix >> u32(23)).astype(np.int32) - np.int32(0x7F)
    ix = (ix & u32(0x007FFFFF)) + u32(0x3F3504F3)
    f = ix.view(f32) + f32(-1.0)
    s = f / (f32(2.0) + f)
    z = s * s
    w = z * z
    t1 = w * (LG2 + w * LG4)
    t2 = z * (LG1 + w * LG3)
    R = t2 + t1
    hfsq = (f32(0.5) * f) * f
    dk = k.astype(f32)
    r = s * (hfsq + R) + dk * LN2_LO
    r = (r + -hfsq) + f
    return r + dk * LN2_HI


def exp_f32(d) -> np.ndarray:
    """exp(d) for d <= 0, 0 below -87 (and for -inf / NaN), exactly as philox_exp."""
    d = np.asarray(d, f32)
    live = d >= f32(-87.0)
    d = np.where(live, d, f32(0.0))
    n = (d * LOG2E + ROUND_MAGIC) + -ROUND_MAGIC
    r = (d + -(n * EXP_C1)) + -(n * EXP_C2)
    p = np.full_like(r, EXP_POLY[0])
    for c in EXP_POLY[1:]:
        p = p * r + c
    y = (p * (r * r) + r) + f32(1.0)
    scale = ((n.astype(np.int32) + np.int32(127)).astype(u32) << u32(23)).view(f32)
    return np.where(live, y * scale, f32(0.0))


def gumbel(x) -> np.ndarray:
    """Gumbel(0, 1) noise -log(-log(u)) from words x, u = uniform_open(x)."""
    return -log_f32(-log_f32(uniform_open(x)))


class GumbelRows:
    """Whole rows of Gumbel noise, gumbel(row_words(seed, counter, stream, vocab)), memoised by
    (seed, counter, stream, vocab): the host reference's noise for narrow vocabularies. A coupled
    round draws the noise of one position several times (the drafter's proposal there, the
    verify's pick, the next round's proposal again), each a dozen NumPy passes over a few words
    at small sizes; the rows are a pure function of their key, so the memo changes no bit. It
    holds at most `max_bytes` of rows (the oldest go first)."""

    def __init__(self, max_bytes: int = 1 << 24):
        self.max_bytes, self.nbytes = max_bytes, 0
        self._rows: dict[tuple, np.ndarray] = {}

    def clear(self) -> None:
        """Forget every row (a benchmark's runs each start as a fresh process does)."""
        self._rows.clear()
        self.nbytes = 0

    def __call__(self, seed, counter, stream, vocab: int) -> np.ndarray:
        """float32 [rows, vocab] for per-row seed, counter and stream word arrays [rows]; missing
        rows are drawn in one batch."""
        seed, counter, stream = (np.asarray(a, dt).reshape(-1) for a, dt in ((seed, u64), (counter, u64), (stream, u32)))
        keys = list(zip(seed.tolist(), counter.tolist(), stream.tolist(), [vocab] * len(seed)))
        todo = [k for k in dict.fromkeys(keys) if k not in self._rows]
        if todo:
            s, c, t = (np.array([k[j] for k in todo], dt) for j, dt in ((0, u64), (1, u64), (2, u32)))
            self._rows.update(zip(todo, gumbel(row_words(s, c, t, vocab))))
            self.nbytes += len(todo) * vocab * 4
        out = np.stack([self._rows[k] for k in keys]) if keys else np.zeros((0, vocab), f32)
        while self.nbytes > self.max_bytes:
            self.nbytes -= self._rows.pop(next(iter(self._rows))).nbytes
        return out
