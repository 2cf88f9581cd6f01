"""A MoE trunk's cost counts the distinct experts its passes read (dspark.cost, "Experts"): a round
at verify width w pays each expert its w rows route to, a plain step each expert its rows route to.

The bugs these guard keep every greedy stream exact, since the cost only picks widths and modes: a
verify priced at one row's experts whatever its width, the session's own routing ignored (every pass
priced at uniform routing), a plain row that adds no experts (PLAIN_PER_ROW's old assumption: a
step's weights read once whatever its rows), the expert products' seconds counted twice (once in
the dense part), and the counts of every layer read from one buffer the last layer wrote. Each
test below fails under one."""

import contextlib

import numpy as np
import pytest

from dspark import cost, gain, profile
from dspark.backends import contract
from dspark.cost import CostModel, Prior, overlap_distinct, overlap_of, uniform_distinct
from dspark.cost_prior import TablePrior, moe_prior
from tests.session.test_gain import FrozenClock
from tests.session.test_moe_rounds import MOE, moe_trunk

E, K = 64, 4
MOE_PRIOR = Prior(experts=E, top_k=K, expert_step=0.05)  # a one-row step: 80 % dense, 20 % its 4 experts


def test_the_distinct_experts_of_uniform_overlapping_and_disjoint_routing():
    rng = np.random.default_rng()
    assert uniform_distinct(E, K, 1) == pytest.approx(K)
    assert overlap_distinct(E, K, 8, K / E) == pytest.approx(uniform_distinct(E, K, 8))
    assert overlap_distinct(E, K, 8, 1.0) == pytest.approx(K)      # every row the same experts
    assert overlap_distinct(E, K, 8, 0.0) == K * 8                  # no two rows share one
    assert overlap_distinct(E, K, 100, 0.0) == E                    # at most every expert
    for _ in range(20):  # overlap_of inverts overlap_distinct
        rows, p = int(rng.integers(2, 12)), float(rng.uniform(0.01, 0.99))
        assert overlap_of(E, K, rows, overlap_distinct(10 ** 6, K, rows, p)) == pytest.approx(p, rel=1e-6)
    assert overlap_of(E, K, 1, K) is None  # one row says nothing of the overlap


def test_the_prior_prices_a_pass_by_its_distinct_experts():
    p = MOE_PRIOR
    assert p.plain(1, 0) == pytest.approx(1.0)               # one row reads its k experts: 1 step
    assert p.plain(1, 0, 0.0) == pytest.approx(1 - K * 0.05)  # the dense part
    assert p.round(1, 8, 0, K * 8) - p.round(1, 8, 0, K) == pytest.approx(0.05 * K * 7)
    assert p.round(1, 8, 0) == pytest.approx(p.round(1, 8, 0, uniform_distinct(E, K, 8)))
    dense = Prior()
    assert dense.round(2, 5, 0) == (1 + dense.plain_per_row) * (dense.round_fixed + dense.round_per_column * 5)


def measured(overlap: float, rows: int = 8, per_expert: float = 0.0125) -> CostModel:
    """A model that timed verifies (0.8 s) and rounds (1.8 s) of `rows` rows routed at `overlap`
    (p) and plain steps of 1 and 2 rows (0.5 s a row), each plus `per_expert` s a distinct expert
    in its expert products."""
    m = CostModel(FrozenClock(), MOE_PRIOR)
    D = overlap_distinct(E, K, rows, overlap)
    for _ in range(4):
        m.record("verify", 1, 0, 0.8 + per_expert * D, width=rows, experts=[D, D], expert_seconds=per_expert * D)
        m.record("round", 1, 0, 1.8 + per_expert * D, width=rows, experts=[D, D], expert_seconds=per_expert * D)
    for b in (1, 2):
        d = overlap_distinct(E, K, b, overlap)
        m.record("plain", b, 0, 0.5 * b + per_expert * d, experts=[d, d], expert_seconds=per_expert * d)
    return m


def test_a_verify_is_priced_by_the_experts_its_session_routes_to():
    """The same timings, routed overlapping (p = 1: every row the same k experts) or disjoint (p = 0):
    a width's price grows with the experts it would add, so the wide verify costs more disjoint."""
    lap, apart = measured(1.0), measured(0.0)
    assert lap.distinct("round", 8) == pytest.approx(K) and apart.distinct("round", 8) == pytest.approx(K * 8)
    assert apart.distinct("round", 3) == pytest.approx(K * 3)  # the session's counts, at any width
    lap_step = lap.round_seconds(1, 8, 0) - lap.round_seconds(1, 2, 0)
    apart_step = apart.round_seconds(1, 8, 0) - apart.round_seconds(1, 2, 0)
    assert apart_step - lap_step == pytest.approx(0.0125 * K * 6, rel=1e-6)
    # What a distinct expert costs is measured: the expert products' seconds over the experts, at the level.
    assert apart._expert.value * apart._level_now == pytest.approx(0.0125, rel=1e-6)


def test_the_width_by_gain_is_wider_where_the_rows_share_experts():
    conf = np.full(7, 0.8)
    lap, apart = measured(1.0, per_expert=0.05), measured(0.0, per_expert=0.05)
    wide, narrow = gain.width_by_gain(lap, conf, 8, 0), gain.width_by_gain(apart, conf, 8, 0)
    assert wide > narrow, (wide, narrow)
    # Ignoring the experts, both would take the dense shape's width.
    dense = CostModel(FrozenClock(), Prior())
    assert gain.width_by_gain(dense, conf, 8, 0) >= wide


def test_a_plain_row_adds_the_experts_it_routes_to():
    """PLAIN_PER_ROW alone said a row costs a quarter step whatever its experts; the marginal row now
    adds the experts it brings to the step, so a plain batch routed apart gains less from a row."""
    lap, apart = measured(1.0), measured(0.0)
    extra = apart.plain_row_seconds(1, 0) - lap.plain_row_seconds(1, 0)
    assert extra == pytest.approx(0.0125 * K, rel=1e-6)
    assert apart.plain_seconds(2, 0) - lap.plain_seconds(2, 0) == pytest.approx(0.0125 * K, rel=1e-6)
    # joint_split's all-plain step of 5 rows: 4 rows' new experts more where the rows route apart.
    cands = [(2.2, 4.0, "greedy", False)] * 2
    _, r_lap = gain.joint_split(lap, cands, 3, 0)
    _, r_apart = gain.joint_split(apart, cands, 3, 0)
    assert r_lap[0] == pytest.approx(5 / lap.plain_seconds(5, 0))
    assert r_apart[0] == pytest.approx(5 / (lap.plain_seconds(5, 0) + 0.0125 * K * 4))


def test_the_dense_part_is_the_seconds_less_the_expert_products():
    """A plain step's kept price is its seconds less its expert products' (priced apart, per expert):
    counting them in both would price every expert twice."""
    m = CostModel(FrozenClock(), MOE_PRIOR)
    m.record("verify", 1, 0, 1.0, width=8, experts=[20.0], expert_seconds=0.4)
    m.record("plain", 1, 0, 0.9, experts=[float(K)], expert_seconds=0.1)
    level = m._level_now
    assert m._plain[("greedy", 1, 0)].value * level == pytest.approx(0.8)
    assert m.plain_seconds(1, 0, experts=float(K)) == pytest.approx(0.8 + K * m._expert.value * level)


def test_the_table_prior_moves_from_uniform_routing_by_each_expert():
    entry = {"shape": "moe", "batches": [1, 2], "widths": [2, 8], "contexts": [512], "plain": [[1.0], [1.2]],
             "round": [[[2.0], [3.0]], [[2.4], [3.6]]], "verify": [[[1.1], [1.5]], [[1.3], [1.8]]],
             "experts": {"count": E, "top_k": K, "seconds": 0.01}}
    t = TablePrior(entry)
    assert t.round(1, 8, 512) == pytest.approx(3.0)
    assert t.round(1, 8, 512, t.distinct(8)) == pytest.approx(3.0)
    assert t.round(1, 8, 512, K * 8) - t.round(1, 8, 512, K) == pytest.approx(0.01 * K * 7)
    assert t.verify(1, 8, 512, 0.0) == pytest.approx(1.5 - 0.01 * uniform_distinct(E, K, 8))


def test_a_moe_trunks_rounds_keep_their_experts_per_layer_beside_their_time(numpy_backend):
    """Timed on the CPU, a MoE pair's rounds report each MoE layer's distinct experts (the router's
    counts, the same the profile counts), its experts and top-k, and their expert products' seconds,
    which set the measured price of an expert: the CPU prior stays Prior()."""
    from dspark.models.oracle import bigram_drafter, greedy_continuation
    from dspark.session import DsparkSpecSession, SpecParams, spec_round
    be = numpy_backend
    trunk = moe_trunk(be)
    prompt = np.arange(5, 60, 7, dtype=np.int32)
    drafter = bigram_drafter(trunk, [np.concatenate([[prompt[-1]], greedy_continuation(trunk, prompt, 12)])], 0.8, 3)
    model = CostModel()
    moe_layers = sum(f == "moe" for f in MOE.ffn)
    with cost.using(be, model):
        s = DsparkSpecSession.prime(trunk, drafter, prompt, SpecParams(max_new_tokens=10, verify="full"))
        counted = []
        while not s.finished():
            with profile.counting() as c:
                spec_round([s])
            counted.append([n for _, n in c.distinct_experts()])
    verifies = [(n, e) for kind, _, _, _, e in model.experts_log for n in [kind] if n == "verify"]
    assert verifies and all(len(e) == moe_layers for _, e in verifies)
    assert [list(e) for _, e in verifies] == counted[-len(verifies):]  # the first, cold verify is not kept
    assert model._expert.n == len(verifies) and model._expert.value > 0
    assert model.prior == Prior() and model.routing == (MOE.experts, MOE.expert_top_k)
    assert model.round_seconds(1, 4, 40) > model.round_seconds(1, 4, 40, experts=0.0)  # its experts priced
    assert 0 < moe_prior(MOE).expert_step < 1 / MOE.expert_top_k  # a MoE shape the cuda table lacks


def test_each_layer_reports_its_own_distinct_experts_on_a_gpu_backend(numpy_backend):
    """On the CuPy contract stand-in the counts stay on the device until read: each layer's in its own
    buffer, so a pass read after it ran gives every layer's count, not the last layer's for all."""
    caches, counts = {}, {}
    for name, be in (("numpy", numpy_backend), ("contract", contract.backend())):
        trunk = moe_trunk(be)
        cache = trunk.new_cache()
        trunk.prefill(cache, np.arange(3, 40, 3, dtype=np.int32))
        with profile.counting() as c:
            trunk.verify([cache], [np.array([7, 100, 3, 250, 9, 11], np.int32)])
        counts[name], caches[name] = c.distinct_experts(), cache
    assert counts["contract"] == counts["numpy"]
    assert len({n for _, n in counts["numpy"]}) > 1  # the layers' counts differ, so a shared buffer shows


def test_the_shipped_moe_entry_prices_a_verify_by_its_experts():
    """The H200 table's Qwen3.5-35B-A3B entry carries what one more distinct expert per layer adds
    to a round (python profiling/perf_model.py --prior-table): a verify of 8 rows sharing their 8
    experts is priced that many experts under uniform routing's 57 cheaper."""
    from dspark.cost_prior import table
    entry = next(e for e in table()["entries"].values() if e["shape"] == "Qwen3.5-35B-A3B")
    t = TablePrior(entry)
    assert (t.experts, t.top_k) == (256, 8) and t.expert_step > 0
    uniform = t.round(1, 8, 8192)
    shared = t.round(1, 8, 8192, 8.0)
    assert uniform - shared == pytest.approx(t.expert_step * (uniform_distinct(256, 8, 8) - 8), rel=1e-9)
    assert 0.2 < shared / uniform < 0.9  # the experts are a large share of a MoE verify's bytes


def test_rounds_replayed_from_recordings_report_their_experts_to_the_cost_model():
    """On the CuPy contract stand-in the rounds replay recorded passes (no Python runs a MoE layer
    then): each replay reports the layers' device counts, which the router rewrote, so the cost
    model keeps the same distinct experts per layer as a profile counts of the same rounds (run
    again, with no profile open), and learns the overlap from them."""
    from dspark.models.oracle import bigram_drafter, greedy_continuation
    from dspark.session import DsparkSpecSession, SpecParams, spec_round
    be = contract.backend()
    trunk = moe_trunk(be)
    prompt = np.arange(5, 60, 7, dtype=np.int32)
    drafter = bigram_drafter(trunk, [np.concatenate([[prompt[-1]], greedy_continuation(trunk, prompt, 14)])], 0.8, 3)
    params = SpecParams(max_new_tokens=12, verify="ladder", max_verify=4, launches="graph", capture=False)

    def run(counting: bool):
        model, counted, graphs = CostModel(), [], 0
        with cost.using(be, model):
            s = DsparkSpecSession.prime(trunk, drafter, prompt, params)
            while not s.finished():
                with profile.counting() if counting else contextlib.nullcontext() as c:
                    spec_round([s])
                if counting:
                    counted.append([n for _, n in c.distinct_experts()])
                    graphs += c.graphs
            s.close()
        return model, counted, graphs
    _, counted, graphs = run(True)
    model, _, _ = run(False)
    rounds = [list(e) for kind, *_, e in model.experts_log if kind == "round"]
    assert graphs > 0 and len(rounds) == len(counted) - 1 >= 2
    assert rounds == counted[1:]  # the first round is cold, not kept
    assert model._overlap["verify"].n == len(rounds) and model.routing == (MOE.experts, MOE.expert_top_k)


def test_a_pass_read_after_later_passes_keeps_its_own_experts():
    """A pass's timing is read once its end event has completed, maybe after later passes rewrote
    the layers' counts on the device (a recorded pass's buffers are the same at every replay): the
    counts are copied at the end of the timed block (ExpertSink.freeze), so the pass keeps its own
    (CuPy contract stand-in arrays; a clock whose second interval waits)."""
    from tests.session.test_gain import ScriptedClock
    xp = contract.backend().xp
    counts = [xp.asarray(np.array([5], np.int32)), xp.asarray(np.array([7], np.int32))]  # two layers' buffers
    clock = ScriptedClock([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    model = CostModel(clock)
    clock.pending.add(3.0)  # the second pass's end: not done until released
    for n in (4, 5, 6):     # the first pass is cold, not kept
        with model.timed("verify", 1, 0, width=8):
            for layer, c in enumerate(counts):
                c[...] = n + layer  # the router's write
                profile.experts(layer, c[0:1], (E, K), xp)
    assert [list(e) for *_, e in model.experts_log] == [[6, 7]]
    clock.pending.clear()
    model._resolve()
    assert [list(e) for *_, e in model.experts_log] == [[6, 7], [5, 6]]
