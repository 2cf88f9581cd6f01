"""load_drafter: a released block drafter (DeepSpec DSpark, z-lab DFlash / DFlash2, speculators)
from its Hugging Face directory, as dspark's one drafter class.

Everything is checked on the host before anything reaches the backend: the config against the
target (hidden size, vocabulary, layer count, taps, mask id, head dim), then every tensor name
(each unmatched name is an error, each missing one names the config field that asks for it) and
shape. Embedding, LM head and final norm copies equal to the target's are shared, not loaded twice.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np

from ...dtypes import to_f32
from ...errors import CheckpointError, ShapeError
from ...ops.attention import HEAD_DIMS
from ...progress import TensorProgress
from ..drafter import DsparkDrafter
from ..drafter_config import drafter_spec
from .checkpoint import Checkpoint
from .drafter_formats import Plan, plan
from .target import size_text


def check_plan(p: Plan, tc) -> None:
    """The checkpoint's config against the target's (tc: the trunk's config)."""
    c, L = p.config, len(tc.layers)
    if c.d_model != tc.d_model:
        raise CheckpointError(f"{p.format}: hidden_size={c.d_model} differs from the target's {tc.d_model}")
    if p.vocab_size != tc.vocab:
        raise CheckpointError(f"{p.format}: vocab_size={p.vocab_size} differs from the target's {tc.vocab}")
    if p.num_target_layers is not None and p.num_target_layers != L:
        raise CheckpointError(f"{p.format}: num_target_layers={p.num_target_layers} but the target has {L} layers")
    # A tap t is the output of target layer t (-1: the embedding). transformers' hidden_states[L] is
    # the final *normed* state, so DeepSpec and DFlash (hidden_states[id + 1]) cannot tap layer L-1;
    # speculators' ids follow vLLM, whose id L is the last layer's raw output.
    last = L - 1 if p.tap_field == "aux_hidden_state_layer_ids" else L - 2
    for i, (written, t) in enumerate(zip(p.tap_ids, c.taps)):
        if not -1 <= t <= last:
            raise CheckpointError(f"{p.format}: {p.tap_field}[{i}]={written} is out of range for a target of {L} "
                                  f"layers (taps {-1 + (written - t)}..{last + (written - t)})")
    if not 0 <= c.mask_id < tc.vocab:
        raise CheckpointError(f"{p.format}: mask_token_id={c.mask_id} is outside the vocabulary [0, {tc.vocab})")
    if c.head_dim not in HEAD_DIMS:
        raise CheckpointError(f"{p.format}: head_dim={c.head_dim}: the attention kernels take {HEAD_DIMS}")
    if c.draft_vocab and c.draft_vocab > tc.vocab:
        raise CheckpointError(f"{p.format}: draft_vocab_size={c.draft_vocab} exceeds the target's vocabulary "
                              f"{tc.vocab}")


def _transform(a: np.ndarray, how: str) -> np.ndarray:
    if how == "T":
        return np.ascontiguousarray(a.T)
    if how == "row":
        return a.reshape(-1)
    return a


def _shape_after(shape: tuple[int, ...], how: str) -> tuple[int, ...]:
    if how == "T" and len(shape) == 2:
        return shape[::-1]
    if how == "row" and len(shape) == 2 and shape[0] == 1:
        return shape[1:]
    return shape


def read_weights(p: Plan, ckpt: Checkpoint, tc, progress: bool | None = None) -> dict[str, np.ndarray]:
    """Our tensors from the checkpoint's: every name matched, every shape checked, then read
    (`progress`: dspark.progress's bar over them)."""
    entries = ckpt.tensors
    spec = drafter_spec(p.config, tc)
    wanted = {ours: p.source(ours) for ours in spec if ours not in p.from_target}
    names = {p.aliases.get(n, n): n for n in entries}   # canonical -> as stored
    matched = {src for src, _ in wanted.values()} | set(p.ignored)
    extra = sorted(n for c, n in names.items() if c not in matched)
    if extra:
        raise CheckpointError(f"{p.format}: tensor {extra[0]!r} matches nothing dspark's drafter has "
                              f"({len(extra)} unmatched in all)")
    for ours, (src, how) in wanted.items():
        if src not in names:
            raise CheckpointError(f"{p.format}: tensor {src!r} is missing; the config asks for it "
                                  f"({p.asked_by(ours)})")
        entry = entries[names[src]]
        got = _shape_after(entry.shape, how)
        want = spec[ours] if how != "offsets" else (p.config.draft_vocab,)
        if tuple(got) != tuple(want):
            raise ShapeError(f"{p.format}: tensor {src!r} has shape {tuple(entry.shape)}, expected "
                             f"{_shape_after(want, how)}")
    weights = {}
    with TensorProgress(entries, [names[src] for src, _ in wanted.values()], f"loading {ckpt.path.name}",
                        progress) as bar:
        for ours, (src, how) in wanted.items():
            raw = ckpt.array(names[src])
            if how == "offsets":   # d2t: target id = j + d2t[j]
                weights[ours] = (raw.astype(np.int64) + np.arange(raw.shape[0])).astype(np.int32)
            else:
                weights[ours] = _transform(to_f32(raw), how)
            bar.done(names[src])
    if p.config.draft_vocab and "t2d" in names:
        t2d = ckpt.array(names["t2d"]).astype(bool)
        d2t = weights["draft_to_target"]
        marked = t2d.shape == (tc.vocab,) and int(t2d.sum()) == p.config.draft_vocab
        if not marked or not t2d[np.clip(d2t, 0, tc.vocab - 1)].all():
            raise CheckpointError(f"{p.format}: t2d does not mark exactly the {p.config.draft_vocab} target ids of d2t")
    return weights


def _share_target_copies(p: Plan, weights: dict, trunk):
    """Drop the checkpoint's embedding or LM head where it equals the target's bit for bit
    (DeepSpec stores copies): the drafter then reads the trunk's and computes the same. The final
    norm is always the drafter's own: a target's norm weight may follow another convention (Qwen3.5
    stores 1 + w zero-centred) even where the numbers agree."""
    c = p.config
    for ours, flag in (("embed", "own_embed"), ("lm_head", "own_head")):
        if ours in weights and not (ours == "lm_head" and c.draft_vocab):
            theirs = to_f32(trunk.be.to_host(trunk.w[ours]))
            if theirs.shape == weights[ours].shape and np.array_equal(theirs, weights[ours]):
                del weights[ours]
                c = replace(c, **{flag: False})
    return c


def load_drafter(path, target, backend=None, *, progress: bool | None = None) -> DsparkDrafter:
    """The drafter in HF directory `path` (config.json + safetensors, or a hub id in the local
    cache) for trunk `target`, on the target's backend. Raises CheckpointError (or ShapeError)
    naming the field or tensor when the checkpoint does not fit the target; nothing is allocated
    then. `drafter.source` says in one line what was loaded (the format and its layout, the
    tensors' dtypes, the bytes on the backend, target-only config keys ignored). `progress`: as
    load_target's."""
    if backend is not None and backend is not target.be:
        raise ValueError(f"backend={getattr(backend, 'name', backend)!r}: the target lives on {target.be.name!r}")
    ckpt = Checkpoint(path)
    p = plan(ckpt.config)
    check_plan(p, target.config)
    weights = read_weights(p, ckpt, target.config, progress)
    config = _share_target_copies(p, weights, target)
    before = target.be.alloc.bytes("weights")
    drafter = DsparkDrafter(config, weights, target)
    dtypes = Counter(ckpt.tensors[n].dtype for n in ckpt.tensors if n not in p.ignored)
    windows = sorted({w for w in config.windows() if w})
    drafter.source = (f"{p.format} drafter from {ckpt.path} ({p.architecture + ', ' if p.architecture else ''}"
                      f"block {config.block}, {config.drafts} drafts, taps "
                      f"{drafter.taps}, Markov head {config.markov}, confidence head {config.confidence}"
                      + (f", draft vocabulary {config.draft_vocab}" if config.draft_vocab else "")
                      + (f", {config.window_mode} window {'/'.join(map(str, windows))}" if windows else "")
                      + (f", RoPE {dict(config.rope_scaling)['rope_type']}" if config.rope_scaling else "")
                      + f"; {sum(dtypes.values())} tensors ({', '.join(f'{d} {n}' for d, n in dtypes.items())}), "
                      f"{size_text(target.be.alloc.bytes('weights') - before)} on {target.be.name})"
                      + (f"; ignored target-only config keys: {', '.join(p.ignored_keys)}" if p.ignored_keys else ""))
    return drafter
