"""A prompt-end capture records the trunk layers its draft KV was built from; one built by hand
without them (taps=()) means the trunk's default taps, as a drafter config does, so restore
accepts it for a drafter of those taps and refuses it for any other, by name."""

from dataclasses import replace

import numpy as np
import pytest

from dspark.decode import plain_generate
from dspark.models import DsparkDrafter
from dspark.models.presets import TINY_DRAFTER, tiny_pair
from dspark.session import DsparkSpecSession, SpecBoundaryCapture, SpecParams


def by_hand(cap: SpecBoundaryCapture, **kw) -> SpecBoundaryCapture:
    return SpecBoundaryCapture(cap.prompt, cap.pos, cap.cache, cap.draft_kv, cap.boundary_logits, **kw)


def captured(trunk, drafter, p):
    s = DsparkSpecSession.prime(trunk, drafter, p, SpecParams(max_new_tokens=4))
    cap = s.take_prefix_capture()
    s.close()
    return cap


def test_a_capture_without_taps_means_the_trunks_default_taps(numpy_backend):
    trunk, drafter = tiny_pair(numpy_backend, 6)
    other = DsparkDrafter.random(replace(TINY_DRAFTER, taps=(0, 3)), trunk, 9)
    assert drafter.taps == trunk.config.tap_layers == (1, 3) and other.taps == (0, 3)
    p = np.random.default_rng(6).integers(0, 256, 13).astype(np.int32)
    cap = captured(trunk, drafter, p)
    assert cap.taps == (1, 3) and by_hand(cap).taps == ()
    s = DsparkSpecSession.restore(trunk, drafter, by_hand(cap), SpecParams(max_new_tokens=20))
    while not s.finished():
        s.burst()
    assert s.emitted == plain_generate(trunk, p, 20)
    s.close()
    with pytest.raises(ValueError, match=r"built from trunk layers \(1, 3\) \(capture.taps=\(\): the trunk default "
                                         r"tap_layers\); this drafter taps \(0, 3\)"):
        DsparkSpecSession.restore(trunk, other, by_hand(cap))
    # named explicitly, the taps are the capture's own
    mine = captured(trunk, other, p)
    warm, cold = DsparkSpecSession.restore(trunk, other, by_hand(mine, taps=(0, 3))), DsparkSpecSession.prime(trunk, other, p)
    assert warm.last == cold.last and warm.kv.pos == cold.kv.pos
    warm.close(), cold.close()
    with pytest.raises(ValueError, match=r"built from trunk layers \(0, 3\); this drafter taps \(1, 3\)"):
        DsparkSpecSession.restore(trunk, drafter, by_hand(mine, taps=(0, 3)))
    for c in (cap, mine):
        c.free()
