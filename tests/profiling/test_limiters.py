"""profiling/pricing.py: a launch built to be bound by one limiter is priced by it, at the amount
this test works out by hand from the plan; the floor is the largest limiter and the expected time
never below it. The inputs the limiters read are checked against their sources: the SASS loops
issue the MMAs the plans count, simt's counts (profiling/wavefronts.json) are current with the
kernel sources and count the plans' mma.sync, and its bank conflicts show where the kernels have
them (the prompt attention's merge into its D-float rows)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.profiling.test_bench import PROFILING

sys.path.insert(0, str(PROFILING))
import pricing  # noqa: E402
import sass  # noqa: E402

DEV = pricing.H200


def priced(entry: str, **work) -> pricing.Priced:
    threads = work.pop("threads", 128)
    smem = work.pop("smem", 0)
    return pricing.price(pricing.Work(entry, threads, smem, **work), DEV)


def test_a_copy_of_many_bytes_is_bound_by_dram():
    ctas = 4096
    p = priced("snapshot_copy_f32", threads=256, dram=np.full(ctas, 1e6))
    assert p.bound == "dram" and p.floor == pytest.approx(ctas * 1e6 / DEV.bw)
    assert p.expected >= p.floor


def test_two_ctas_on_one_sm_share_what_it_can_pull():
    """A DRAM-bound launch of a few more CTAs than SMs (Qwen3.5-27B's mlp gate|up at B = 1: 136)
    runs as one resident wave: its memory side is its bytes at the copy bandwidth, or those of the
    SM holding two CTAs at what one SM can pull, whichever is longer. At the assumed 100 GB/s the
    whole rate binds; where one SM pulled 40 GB/s, the SMs holding two would."""
    import dataclasses
    b = 2.6e6
    for sm_bw, n in ((DEV.sm_bw, 136), (40e9, 136), (40e9, DEV.sms)):
        dev = dataclasses.replace(DEV, sm_bw=sm_bw)
        p = pricing.price(pricing.Work("snapshot_copy_f32", 256, 0, np.full(n, b)), dev)
        per_sm = -(-n // dev.sms) * b / sm_bw
        assert p.expected >= max(n * b / dev.bw, per_sm) * (1 - 1e-9), (sm_bw, n)
        assert p.expected <= max(n * b / dev.bw, per_sm) + 2 * dev.dram_latency, (sm_bw, n)
    assert 2 * b / 40e9 > 136 * b / DEV.bw > 2 * b / DEV.sm_bw   # the case above that the SMs bind


def test_bytes_reread_from_l2_bind_at_the_l2_rate():
    ctas = 4096
    p = priced("snapshot_copy_f32", threads=256, dram=np.full(ctas, 1e4), l2=np.full(ctas, 1e6))
    assert p.bound == "l2" and p.floor == pytest.approx(ctas * 1e6 / DEV.l2_bw)
    assert p.limits["dram"] == pytest.approx(ctas * 1e4 / DEV.bw) and p.expected >= p.floor


def test_mmas_bind_at_the_mma_sync_ceiling():
    """One CTA of 8 warps per SM (the prompt attention at D = 256: 254 registers a thread),
    10,000 mma.sync each: 132 CTAs take one CTA's MMAs at one SM's share of the ceiling."""
    entry = "attention_prompt_bf16_d256"
    code = pricing.compiled(entry, DEV)
    from dspark.ops.attention import PROMPT_THREADS, prompt_shared_mem_bytes
    smem = prompt_shared_mem_bytes(2, 256)
    assert pricing.resident(PROMPT_THREADS, smem + code.static_smem, code.registers, DEV) == 1
    p = priced(entry, threads=PROMPT_THREADS, smem=smem, dram=np.full(132, 1e3), mma=1e4)
    assert p.bound == "tensor" and p.floor == pytest.approx(1e4 * 4096 * 132 / DEV.mma_sync)
    assert p.expected >= p.floor


def test_shared_memory_wavefronts_bind_at_one_per_sm_clock():
    """The prompt attention's counts per key tile (simt, profiling/wavefronts.json) over 1,000 tiles
    a CTA, its MMAs left out: the wavefronts at one per SM clock."""
    entry = "attention_prompt_bf16_d256"
    e = pricing.counted_entry(entry)
    per_tile = e["wavefronts"][e["units"].index("tile")]
    per_cta = e["wavefronts"][e["units"].index("cta")]
    from dspark.ops.attention import PROMPT_THREADS, prompt_shared_mem_bytes
    p = priced(entry, threads=PROMPT_THREADS, smem=prompt_shared_mem_bytes(2, 256), dram=np.full(132, 1e3),
               units={"cta": 1.0, "tile": 1000.0, "merge": 0.0})
    want = (per_cta + 1000 * per_tile) / DEV.clock   # one CTA per SM
    assert p.bound == "smem" and p.floor == pytest.approx(want, rel=1e-9)
    assert p.wavefronts == pytest.approx(132 * (per_cta + 1000 * per_tile)) and p.expected >= p.floor


def test_instructions_bind_at_four_per_sm_clock():
    """The f32 split attention's key-tile loop as its SASS issues it (the shortest path through an
    iteration: a floor), 10,000 iterations a CTA of 8 warps, as many CTAs as the SMs hold at once
    (so no barrier drains: other CTAs overlap them): warps x iterations x that path at four per SM
    clock, shared by the CTAs of an SM."""
    from dspark.ops.attention import shared_mem_bytes
    entry = "attention_f32_d64"
    s = sass.issue(entry)
    code = pricing.compiled(entry, DEV)
    smem = shared_mem_bytes(4, 64)
    per_sm = pricing.resident(256, smem + code.static_smem, code.registers, DEV)
    assert s.anchor == "fp32" and s.mmas == 0 and per_sm > 1
    p = priced(entry, threads=256, smem=smem, dram=np.full(132 * per_sm, 1e3), iterations=1e4)
    want = 8 * 1e4 * s.floor_path / (DEV.issue_per_sm * DEV.clock / per_sm)
    assert p.bound == "issue" and p.floor == pytest.approx(want, rel=1e-6) and p.expected >= p.floor


def test_a_lone_small_kernel_is_bound_by_its_latency():
    p = priced("rmsnorm_f32", threads=256, dram=np.full(1, 64.0))
    assert p.bound == "latency" and p.floor == pytest.approx(DEV.dram_latency) and p.expected >= p.floor


def test_where_nothing_overlaps_the_limiters_add():
    """One CTA per SM with loads that are not asynchronous (no cp.async in its loop): its SM side and
    its memory side add in the expected time; with many CTAs per SM they overlap."""
    alone = priced("snapshot_copy_f32", threads=1024, dram=np.full(132, 1e6), f32_flops=3e8)
    many = priced("snapshot_copy_f32", threads=256, dram=np.full(132 * 8, 1e6 / 8), f32_flops=3e8 / 8)
    assert alone.expected >= alone.limits["dram"] + alone.limits["issue"]
    assert many.expected < many.limits["dram"] + many.limits["issue"]


def test_the_sass_loops_issue_the_mmas_the_plans_count():
    """An iteration of the prompt attention's key-tile loop issues D / 16 x 8 (q.k) + 4 x D / 8 (p.v)
    HMMA per warp; one of linear_mma's K loop MT x NT x BK / 16 (m128: 4 x 4 x 2). Both as the plan
    counts them, so the loop found is the one the model iterates."""
    for d in (128, 256):
        s = sass.issue(f"attention_prompt_bf16_d{d}")
        main = [lp for lp in sass.loops(sass.entry_sass(s.entry)) if lp.issued["mma"]]
        assert max(lp.issued["mma"] for lp in main) == d // 16 * 8 + 4 * d // 8
        assert s.barriers == 4 and s.floor_path <= s.path <= s.static
    lm = max(sass.loops(sass.entry_sass("linear_mma_bf16_m128")), key=lambda lp: lp.issued["mma"])
    assert lm.issued["mma"] == 4 * 4 * 2


def test_the_counts_are_current_and_count_the_plans_mmas():
    """profiling/wavefronts.json was counted from today's kernel sources (rerun profiling/wavefronts.py
    when this fails), and simt counted, per key tile of a prompt attention CTA, about the 8 warps x
    (D / 2 + D / 2) mma.sync the model prices (the fit over its probes: warps whose rows end on the
    diagonal skip their last tile's MMAs, so the coefficient is within a few % of it)."""
    table = pricing.wavefront_table()
    assert table["sources"] == pricing.sources_digest(), "kernel sources changed: python profiling/wavefronts.py"
    for d in (128, 256):
        e = table["entries"][f"attention_prompt_bf16_d{d}"]
        assert e["mma"][e["units"].index("tile")] == pytest.approx(8 * d, rel=0.05)


def test_the_prompt_attentions_shared_memory_is_its_tiles_alone():
    """Its merged outputs live in global memory (part_acc), so simt counts no plain shared-memory
    load or store in it: its wavefronts are the tiles' cp.async copies in and their ldmatrix reads,
    none of them conflicted (the K/V and q rows' 16-byte pad)."""
    e = pricing.counted_entry("attention_prompt_bf16_d256")
    c = e["counted"]
    assert c["store"][1] == c["load"][1] == 0 and c["ldmatrix"][1] > 0 and c["cp_async"][1] > 0
    assert c["ldmatrix"][1] == c["ldmatrix"][2] and c["cp_async"][1] == c["cp_async"][2]
