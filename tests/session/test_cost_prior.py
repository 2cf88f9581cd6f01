"""The cost model's prior on `cuda` is the performance model's prediction for the pair
(dspark.cost_prior): the embedded pair's fingerprint finds its entry and a pair the table does not
know gets Prior(); on the CuPy contract stand-in (a `cuda`-named backend) a session of the embedded
pair is priced by the table before anything is measured, on numpy by Prior(); the prior prices the
context as the performance model does; and it is taken once, never after measurements exist."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import dspark
from dspark import cost, cost_prior, gain
from dspark.backends import contract
from dspark.cost import CostModel, Prior, cost_model
from dspark.models import load_default
from dspark.models.presets import tiny_pair
from dspark.params import SamplingParams
from dspark.session import DsparkSpecSession, SpecParams

ENTRIES = cost_prior.table()["entries"]


def entry_of(label: str) -> dict:
    return next(e for e in ENTRIES.values() if e["shape"] == label)


@pytest.fixture(scope="module")
def embedded_on_contract():
    be = contract.backend()
    trunk, drafter = load_default(be)
    return be, trunk, drafter


def test_the_embedded_pair_finds_its_entry_and_a_tiny_pair_none():
    be = dspark.get_backend("numpy")
    trunk, drafter = load_default(be)
    key = cost_prior.fingerprint(trunk.config, drafter.config)
    assert ENTRIES[key]["shape"] == "embedded pair"
    t2, d2 = tiny_pair(be)
    assert cost_prior.fingerprint(t2.config, d2.config) not in ENTRIES
    cuda_named = type("B", (), {"name": "cuda"})()
    assert cost_prior.prior_for(cuda_named, t2.config, d2.config) == Prior()
    assert isinstance(cost_prior.prior_for(cuda_named, trunk.config, drafter.config), cost_prior.TablePrior)
    assert cost_prior.prior_for(be, trunk.config, drafter.config) == Prior()  # not cuda: the CPU prior


def test_on_cuda_a_session_of_the_embedded_pair_is_priced_by_the_table(embedded_on_contract):
    be, trunk, drafter = embedded_on_contract
    prompt = np.arange(40, 140, dtype=np.int32) % 256
    s = DsparkSpecSession.prime(trunk, drafter, prompt, SpecParams(max_new_tokens=4))
    model = cost_model(be)
    assert isinstance(model.prior, cost_prior.TablePrior) and model.prior.shape == "embedded pair"
    assert model.measured() == {"rounds": 0, "plain_steps": 0}
    e = entry_of("embedded pair")
    # Before any measurement a round costs the table's ratio at its B, width and context: the
    # session's own context (under the first grid context: priced at it) and a grid context.
    for B, w, ctx in ((1, 8, s.cache.pos), (1, 8, 1024), (4, 3, 1024), (32, 2, 512)):
        b, c = e["batches"].index(B), e["contexts"].index(max(ctx, 512))
        want = e["round"][b][e["widths"].index(w)][c] / e["plain"][b][c]
        assert model.round_cost(B, w, ctx) == pytest.approx(want, rel=1e-12)
    # Between grid points: linear in width and batch.
    b1, c = e["batches"].index(2), e["contexts"].index(1024)
    r = e["round"]
    assert model.prior.round(3, 4.5, 1024) * model.prior.unit == pytest.approx(
        0.5 * (0.5 * (r[b1][2][c] + r[b1][3][c]) + 0.5 * (r[b1 + 1][2][c] + r[b1 + 1][3][c])), rel=1e-12)
    s.close()


def test_on_numpy_the_prior_stays_the_cpu_one():
    be = dspark.get_backend("numpy")
    trunk, drafter = load_default(be)
    s = DsparkSpecSession.prime(trunk, drafter, np.arange(60, dtype=np.int32), SpecParams(max_new_tokens=4))
    assert cost_model(be).prior == Prior()
    s.close()


def test_the_prior_is_taken_once_and_never_after_measurements(embedded_on_contract):
    be, trunk, _ = embedded_on_contract
    first = cost_model(be).prior
    _, other = tiny_pair(be)  # a second pair on the same backend keeps the first's prior
    assert cost_model(be).prior is first and isinstance(first, cost_prior.TablePrior)
    m = CostModel(prior=Prior())
    m.record("plain", 1, 0, 0.01)
    assert not m.adopt(first, "x") and m.prior == Prior()
    m = CostModel(prior=Prior())
    assert m.adopt(first, "x") and m.prior is first
    assert not m.adopt(Prior(), "y") and m.prior is first


def test_the_prior_prices_the_context_as_the_performance_model_does():
    """Qwen3.5-27B at 32 rows, 8 columns: a round costs 2.8 plain steps at 1k and 2.1 at 32k (the
    plain step's attention reads grow with the keys; the round's weight reads do not). The shipped
    figures are the performance model's (tests/profiling/test_cost_prior_table.py)."""
    e = entry_of("Qwen3.5-27B")
    p = cost_prior.TablePrior(e)
    model = CostModel(prior=p)
    b, w = e["batches"].index(32), e["widths"].index(8)
    costs = {}
    for ctx in (1024, 32768):
        c = e["contexts"].index(ctx)
        costs[ctx] = model.round_cost(32, 8, ctx)
        assert costs[ctx] == pytest.approx(e["round"][b][w][c] / e["plain"][b][c], rel=1e-12)
    assert costs[1024] - costs[32768] > 0.5
    # Between buckets: linear in context; past the last, the last segment's slope.
    mid = model.round_cost(32, 8, 24576)
    assert min(costs.values()) < mid < max(costs.values())
    assert p.plain(1, 65536) > p.plain(1, 32768) > p.plain(1, 512) == 1.0


def test_on_cuda_rejection_mode_reads_the_table_prior_never_a_timing(embedded_on_contract):
    """A rejection-sampled request's mode is the prior tokens over the table's round at one row,
    whatever was measured: its margin moves it exactly at that gain."""
    be, _, drafter = embedded_on_contract
    prior = cost_model(be).prior
    assert isinstance(prior, cost_prior.TablePrior)
    p = SpecParams(sampler="rejection", sampling=SamplingParams(temperature=0.8), max_verify=8)
    g = gain.prior_tokens(p, drafter) / (prior.round(1, 8, 1024) / prior.plain(1, 1024))
    assert abs(prior.round(1, 8, 1024) / prior.plain(1, 1024) - Prior().round(1, 8, 0)) > 1e-3  # not the CPU prior
    for steps in (0.1, 100.0):  # rounds measured cheap or dear: the same decisions
        m = CostModel(prior=prior)
        for _ in range(3):
            m.record("round", 1, 1024, steps, width=8, rule="rejection")
            m.record("plain", 1, 1024, 1.0, rule="sampled")
        with cost.using(be, m):
            assert gain.rejection_mode(replace(p, margin=g - 1 + 1e-6), drafter, 1024)[0] is False
            assert gain.rejection_mode(replace(p, margin=g - 1 - 1e-6), drafter, 1024)[0] is True


def test_an_fp8_release_finds_its_own_entry():
    """Qwen3.5-27B and its FP8 release share every config field: the weight format alone tells
    their entries apart (each the performance model's prediction: test_cost_prior_table.py)."""
    fp8 = next(k for k, e in ENTRIES.items() if e["shape"] == "Qwen3.5-27B-FP8")
    bf16 = next(k for k, e in ENTRIES.items() if e["shape"] == "Qwen3.5-27B")
    assert fp8 != bf16 and ENTRIES[fp8]["fields"] == {**ENTRIES[bf16]["fields"], "trunk.weights": "fp8"}
    assert "trunk.weights" not in ENTRIES[bf16]["fields"]
