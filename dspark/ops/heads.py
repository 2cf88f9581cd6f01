"""The drafter's glue between its block pass and its heads (kernels: csrc/heads.cu): the draft
rows of a mask-fill block, the logits' output multiplier and soft cap, the confidence head's
features [h_k ; W1[x_{k-1}]] with x_{k-1} read on the device, and one slot's logits of the sampled
Markov chain (the greedy chain's bias, bit for bit).

Copies, and one product and tanh per logit: the NumPy functions (the numpy backend's and the
oracle) agree with the kernels bit for bit for the copies, up to tanh's last bit for the cap.
"""

from __future__ import annotations

import numpy as np

from ..arrays import adopt
from ..errors import ShapeError, TokenRangeError
from .argmax import markov_bias_ref
from .checks import host_and_device, output, require_dtype, require_ndim, require_shape

F32 = np.float32
THREADS = 256  # kHeadThreads


def gather_rows(be, src, rows, out=None):
    """out[i] = src[rows[i]] for src [n, width] f32 and rows int32 [m] (host or Staged)."""
    src, out = adopt(be, src=src, out=out, writes=("out",))
    require_ndim(src, 2, "src", "[n, width]")
    require_dtype(src, F32, "src")
    host_rows, dev_rows = host_and_device(be, rows, "rows")
    require_ndim(host_rows, 1, "rows", "[m]")
    require_dtype(host_rows, np.int32, "rows")
    n, width = src.shape
    m = host_rows.shape[0]
    if np.any((host_rows < 0) | (host_rows >= n)):
        raise IndexError(f"rows: expected indices in [0, {n})")
    out = output(be, out, (m, width), F32)
    if be.kernels is None:
        out[...] = src[host_rows]
    elif m and width:
        be.kernels.get_function("gather_rows_f32")((m, -(-width // THREADS)), (THREADS,),
                                                   (be.xp.ascontiguousarray(src), dev_rows, np.int32(m),
                                                    np.int32(width), out))
    return out


def logit_scale_ref(logits, scale: float, cap: float):
    x = np.asarray(logits, F32) * F32(scale)
    return np.tanh(x / F32(cap)) * F32(cap) if cap > 0 else x


def logit_scale(be, logits, scale: float, cap: float, out=None):
    """logits * scale, then cap * tanh(. / cap) when cap > 0; f32, any shape (C-contiguous)."""
    logits, out = adopt(be, logits=logits, out=out, writes=("out",))
    require_dtype(logits, F32, "logits")
    out = output(be, out, logits.shape, F32)
    if be.kernels is None:
        out[...] = logit_scale_ref(logits, scale, cap)
    elif logits.size:
        n = int(logits.size)
        be.kernels.get_function("logit_scale_f32")((-(-n // THREADS),), (THREADS,),
                                                   (be.xp.ascontiguousarray(logits), np.int64(n), F32(scale), F32(cap),
                                                    out))
    return out


def confidence_features_ref(hidden, w1, anchors, drafts):
    """[h_k ; W1[x_{k-1}]] of every draft slot (x_{-1} the anchor); hidden alone without w1."""
    if w1 is None:
        return np.asarray(hidden, F32)
    prev = np.concatenate([np.asarray(anchors)[:, None], np.asarray(drafts)[:, :-1]], axis=1).reshape(-1)
    return np.concatenate([hidden, w1[prev]], axis=1)


def confidence_features(be, hidden, w1, anchors, drafts, out=None):
    """hidden [B * nd, d] f32 (session-major slots), w1 [V, r] f32 (None: features are h alone),
    anchors int32 [B] (host or Staged), drafts int32 [B, nd] (device: the chain's) -> [B * nd, d + r]."""
    hidden, w1, drafts, out = adopt(be, hidden=hidden, w1=w1, drafts=drafts, out=out, writes=("out",))
    require_ndim(hidden, 2, "hidden", "[B * nd, d]")
    require_dtype(hidden, F32, "hidden")
    host_anchors, dev_anchors = host_and_device(be, anchors, "anchors")
    require_ndim(drafts, 2, "drafts", "[B, nd]")
    require_dtype(drafts, np.int32, "drafts")
    B, nd = drafts.shape
    require_shape(host_anchors, (B,), "anchors")
    require_shape(hidden, (B * nd, hidden.shape[1]), "hidden")
    d, r = hidden.shape[1], 0 if w1 is None else w1.shape[1]
    if w1 is not None:
        require_dtype(w1, F32, "w1")
    out = output(be, out, (B * nd, d + r), F32)
    if be.kernels is None:
        out[...] = confidence_features_ref(hidden, w1, host_anchors, drafts)
    elif B * nd:
        be.kernels.get_function("confidence_features_f32")(
            (B * nd, -(-(d + r) // THREADS)), (THREADS,),
            (be.xp.ascontiguousarray(hidden), w1, dev_anchors, be.xp.ascontiguousarray(drafts), np.int32(B),
             np.int32(nd), np.int32(d), np.int32(r), out))
    return out


def markov_logits_ref(logits, w1, w2, anchors, picks, slot: int, nd: int) -> np.ndarray:
    """Slot `slot`'s chain logits [B, V]: its block rows plus w2^T w1[x_{slot-1}] (markov_bias_ref),
    x_{-1} = anchors, x_{slot-1} = picks (a -1 pick reads row 0); the rows alone without w1."""
    B = len(np.asarray(anchors))
    x = np.asarray(logits, F32).reshape(B, nd, -1)[:, slot]
    if w1 is None:
        return x.copy()
    prev = np.asarray(anchors if slot == 0 else picks, np.int64)
    prev = np.where((prev < 0) | (prev >= x.shape[1]), 0, prev)
    return x + markov_bias_ref(w1, w2, prev)


def markov_logits(be, logits, w1, w2, anchors, picks, slot: int, nd: int, drafts, out=None):
    """One slot of the sampled Markov chain, on the device: out [B, V] = the slot's rows of
    `logits` [B * nd, V] plus w2^T w1[x_{slot-1}] (w1 None: no Markov head, the rows alone), with
    x_{-1} = `anchors` (int32 [B], host or Staged) and x_{slot-1} = `picks` (int32 [B] on the
    device: the previous slot's draws, never read back), which it also stores into drafts[:, slot
    - 1] (int32 [B, nd]). slot = nd stores the last slot's picks and computes nothing."""
    logits, w1, w2, picks, drafts, out = adopt(be, logits=logits, w1=w1, w2=w2, picks=picks, drafts=drafts, out=out,
                                               writes=("drafts", "out"))
    require_ndim(drafts, 2, "drafts", "[B, nd]")
    require_dtype(drafts, np.int32, "drafts")
    B = drafts.shape[0]
    require_shape(drafts, (B, nd), "drafts")
    require_ndim(logits, 2, "logits", "[B * nd, V]")
    require_dtype(logits, F32, "logits")
    vocab = logits.shape[1]
    require_shape(logits, (B * nd, vocab), "logits")
    host_anchors, dev_anchors = host_and_device(be, anchors, "anchors")
    require_shape(host_anchors, (B,), "anchors")
    require_dtype(host_anchors, np.int32, "anchors")
    if np.any((host_anchors < 0) | (host_anchors >= vocab)):
        raise TokenRangeError(f"anchors: expected token ids in [0, {vocab}), got {host_anchors.tolist()}")
    if not 0 <= slot <= nd:
        raise ShapeError(f"slot={slot}: expected a slot in [0, {nd}] (nd: the last slot's picks alone)")
    if slot:
        require_shape(picks, (B,), "picks")
        require_dtype(picks, np.int32, "picks")
    r = 0
    if w1 is not None:
        require_dtype(w1, F32, "w1")
        require_dtype(w2, F32, "w2")
        r = w1.shape[1]
        require_shape(w1, (vocab, r), "w1")
        require_shape(w2, (r, vocab), "w2")
    out = output(be, out, (B, vocab), F32)
    if be.kernels is None:
        if slot:
            drafts[:, slot - 1] = picks
        if slot < nd:
            out[...] = markov_logits_ref(logits, w1, w2, host_anchors, picks, slot, nd)
    elif B:
        be.kernels.get_function("markov_logits_f32")(
            (B, max(1, -(-vocab // THREADS)) if slot < nd else 1), (THREADS,),
            (logits, w1, w2, dev_anchors, picks, np.int32(slot), np.int32(B), np.int32(nd), np.int32(vocab),
             np.int32(r), drafts, out))
    return out
