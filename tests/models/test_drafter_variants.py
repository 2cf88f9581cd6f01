"""Every drafter layout the released formats need, as random-weight configurations of the one
drafter class on the tiny hybrid trunk (on numpy, and on the `cuda` code path over the CuPy
stand-in): speculative greedy output stays exact, SpecParams.verify
picks the width as asked ("full" verifies every draft; "auto" the confidence head where there is
one, else the ladder), proposals do not depend on the batch, sampled drafting puts no mass
outside a draft vocabulary, and save/load keeps every tensor (the vocabulary map as int32)."""

from dataclasses import replace

import numpy as np
import pytest

from dspark.decode import plain_generate
from dspark.errors import ShapeError
from dspark.models import DsparkDrafter
from dspark.models.presets import TINY_DRAFTER, TINY_TRUNK
from dspark.models.trunk import HybridTrunk
from dspark.session import DsparkSpecSession, SamplingParams, SpecParams
from dspark.spec_sampling import propose_sampled

VARIANTS = {   # the layouts of the released formats, on the tiny trunk
    "gated-conf_hidden": dict(markov="gated", confidence="hidden", q_norm=True, own_norm=True),
    "rnn-mask_fill": dict(markov="rnn", harvest="mask_fill", window=0),
    "dflash": dict(markov="none", markov_rank=0, confidence="none", harvest="mask_fill", own_norm=True,
                   embed_scale=1.5, logit_scale=0.5, logit_softcap=10.0),
    "dflash2": dict(markov="selector", markov_rank=0, confidence="none", harvest="mask_fill", conv_kernel=2,
                    conv_group=16, selector_rank=8, selector_top_k=5),
    "draft_vocab-sliding": dict(draft_vocab=100, own_head=True, layers=2, layer_windows=(3, 0)),
}


def pair(be, name, seed=0):
    trunk = HybridTrunk.random(TINY_TRUNK, seed, be)
    return trunk, DsparkDrafter.random(replace(TINY_DRAFTER, **VARIANTS[name]), trunk, seed + 1)


def prompt(seed, n):
    return np.random.default_rng(seed).integers(0, 256, n).astype(np.int32)


@pytest.fixture(scope="module")
def contract_cuda():
    """The `cuda` code path on the CuPy stand-in (dspark.backends.contract): no GPU needed."""
    from dspark.backends import contract
    return contract.backend()


@pytest.mark.parametrize("backend", ["numpy_backend", "contract_cuda"])
@pytest.mark.parametrize("name", VARIANTS)
def test_full_verify_is_exact_and_verifies_every_draft(backend, name, request):
    trunk, drafter = pair(request.getfixturevalue(backend), name)
    p = prompt(1, 20)
    s = DsparkSpecSession.prime(trunk, drafter, p, SpecParams(max_new_tokens=24, verify="full"))
    while not s.finished():
        s.burst()
    assert s.emitted == plain_generate(trunk, p, 24)
    assert s.stats.drafted == s.stats.rounds * drafter.config.drafts, "verify='full' left drafts unverified"


def test_auto_verify_follows_the_confidence_head(numpy_backend):
    trunk, with_head = pair(numpy_backend, "gated-conf_hidden")
    without = DsparkDrafter.random(replace(TINY_DRAFTER, **VARIANTS["dflash"]), trunk, 5)
    p = prompt(2, 12)
    assert DsparkSpecSession.prime(trunk, with_head, p, SpecParams()).verify == "confidence"
    s = DsparkSpecSession.prime(trunk, without, p, SpecParams())
    assert s.verify == "ladder"
    s.round()
    assert s.stats.drafted == 2   # the ladder's first width: 3 columns
    assert DsparkSpecSession.prime(trunk, without, p, SpecParams(verify="ladder", max_verify=2)).verify == "ladder"
    before = numpy_backend.alloc.owners()
    with pytest.raises(ValueError, match="verify='confidence': this drafter has no confidence head"):
        DsparkSpecSession.prime(trunk, without, p, SpecParams(verify="confidence"))
    assert numpy_backend.alloc.owners() == before


@pytest.mark.parametrize("backend,name", [("numpy_backend", "rnn-mask_fill"), ("numpy_backend", "dflash2"),
                                          ("numpy_backend", "draft_vocab-sliding"), ("simt", "draft_vocab-sliding"),
                                          ("contract_cuda", "dflash2"), ("cuda", "draft_vocab-sliding")])
def test_proposals_do_not_depend_on_the_batch(backend, name, request):
    """The chain's per-slot ops (rnn state, selector top-k, vocabulary map) are per row: a session
    proposes the same drafts and confidences alone and in a batch (sampled streams rely on it)."""
    be = request.getfixturevalue(backend)
    trunk, drafter = pair(be, name, seed=3)
    kvs = [drafter.new_kv(f"t/kv{i}") for i in range(3)]
    for i, kv in enumerate(kvs):
        cache = trunk.new_cache(owner=f"t/cache{i}")
        tp = trunk.prefill(cache, prompt(10 + i, 5 + 4 * i))
        drafter.ingest([kv], tp.taps, tp.row_indptr)
        cache.free()
    anchors = [7, 99, 200]
    d3, c3 = drafter.propose(kvs, anchors)
    d1, c1 = drafter.propose(kvs[1:2], anchors[1:2])
    np.testing.assert_array_equal(d3[1], d1[0])
    np.testing.assert_array_equal(c3[1], c1[0])
    if drafter.d2t is not None:
        assert np.isin(d3, drafter.d2t).all()
    for kv in kvs:
        kv.free()


@pytest.mark.parametrize("sampler", ["coupled", "rejection"])
@pytest.mark.parametrize("backend", ["numpy_backend", "contract_cuda"])
def test_sampled_drafts_stay_in_the_draft_vocabulary(backend, request, sampler):
    be = request.getfixturevalue(backend)
    trunk, drafter = pair(be, "draft_vocab-sliding", seed=4)
    p = prompt(5, 9)
    s = DsparkSpecSession.prime(trunk, drafter, p, SpecParams(sampling=SamplingParams(temperature=1.0, seed=7),
                                                              sampler=sampler))
    dh, dl = drafter.draft([s.kv], [s.last])
    drafts, _, q = propose_sampled([s], drafter, dl, dh, drafter.config.drafts)
    assert np.isin(drafts, drafter.d2t).all()
    if sampler == "rejection":  # q, the drafter's distributions the accept reads
        q = be.to_host(q)
        outside = np.setdiff1d(np.arange(trunk.config.vocab), drafter.d2t)
        assert q[..., outside].max() == 0 and np.allclose(q.sum(-1), 1, atol=1e-5)
    else:
        assert q is None
    s.close()


@pytest.mark.parametrize("name", VARIANTS)
def test_save_and_load_keep_every_tensor(numpy_backend, name, tmp_path):
    trunk, drafter = pair(numpy_backend, name)
    drafter.save(tmp_path)
    again = DsparkDrafter.load(tmp_path, trunk)
    assert again.config == drafter.config
    for k, v in drafter.host_weights.items():
        np.testing.assert_array_equal(again.host_weights[k], v)
        assert again.host_weights[k].dtype == v.dtype


def test_one_trunk_serves_drafters_of_any_taps(numpy_backend):
    """The session asks the trunk for its drafter's taps (-1: the embedding) whatever the trunk's
    default: prime's draft KV is bitwise what ingesting a prefill with those taps gives, and the
    output stays exact. Taps outside the trunk are refused by name."""
    trunk = HybridTrunk.random(TINY_TRUNK, 0, numpy_backend)
    p = prompt(6, 11)
    want = plain_generate(trunk, p, 16)
    for taps in ((-1, 2), (0,), (3, 1, 2)):
        drafter = DsparkDrafter.random(replace(TINY_DRAFTER, taps=taps), trunk, 1)
        s = DsparkSpecSession.prime(trunk, drafter, p, SpecParams(max_new_tokens=16, verify="full"))
        kv, cache = drafter.new_kv("t/kv"), trunk.new_cache(owner="t/cache")
        tp = trunk.prefill(cache, p, taps=taps)
        drafter.ingest([kv], tp.taps, tp.row_indptr)
        for a, b in zip(s.kv.k + s.kv.v, kv.k + kv.v):
            np.testing.assert_array_equal(a, b)
        while not s.finished():
            s.burst()
        assert s.emitted == want, taps
        s.close()
        kv.free()
        cache.free()
    with pytest.raises(ShapeError, match=r"drafter taps=\(4,\): expected layer indices of the trunk in \[-1, 4\)"):
        DsparkDrafter.random(replace(TINY_DRAFTER, taps=(4,)), trunk, 1)
