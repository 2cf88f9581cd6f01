"""profiling/perf_model.py: the model's arithmetic, never whether it meets a goal (goals are for
measured figures: docs/performance.md). Its CLI's tables are internally consistent: floors under
expected times, parts that add up; it prices the ops' own launch plans and their code as compiled
(registers in residency, the SASS's loops, simt's shared-memory counts), so every kernel's expected
time is at or above each of its limiters and its DRAM bytes; a plan built to be bound by a limiter
is priced by it; the prompt's floor is the FLOPs counted here by hand at the mma.sync ceiling, and
its expected time never goes under them at 90 % of it; the launch cost is a parameter; and the
bytes of state and K/V it predicts for a round, and the launches, are what the CuPy contract path
counts for the same round."""

from __future__ import annotations

import dataclasses
import re
import sys

import numpy as np
import pytest

from dspark import profile
from dspark.backends import contract
from dspark.dtypes import BF16
from dspark.models.presets import TINY_DRAFTER, TINY_TRUNK, tiny_pair
from dspark.ops.attention import launch_plan
from dspark.session import DsparkSpecSession, SpecParams, spec_round
from tests.profiling.test_bench import PROFILING, ok, script

sys.path.insert(0, str(PROFILING))
import perf_model as pm  # noqa: E402


def rows_of(text: str, first: str, has: str = "") -> list[list[str]]:
    """The rows of the first table whose header starts with `first` and holds `has` (cells split
    on 2+ spaces)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first) and has in line)
    out = []
    for line in lines[start + 1:]:
        if not line.strip() or line.startswith(("attn of copy", "recurrent", "floor:", "at the copy")):
            break
        out.append(re.split(r"\s{2,}", line.strip()))
    return out


def num(cell: str) -> float:
    return float(cell.rstrip("x%").replace(",", ""))


def test_cli_table_is_consistent():
    """The summary: floors under expected times (plain step, verify, round and each kind), the kinds'
    expected times and the overhead add up to the round; every kernel of a round: each limiter at
    most its floor, the floor at most its expected time, and the expected times add up to the
    round's GPU time."""
    out = ok(script("profiling/perf_model.py", "--batch", "1", "2", "--context", "4096", "32768", "--kernels")[0])
    summary = rows_of(out, "shape ")
    assert len(summary) == len(pm.shapes()) * 2 * 2
    for r in summary:
        att, ratio = r[4], num(r[5])
        cells = [num(x) for x in r[6:20]]
        plain_f, plain, verify_f, verify, round_f, round_e = cells[:6]
        kinds = list(zip(cells[6:14:2], cells[7:14:2]))
        overhead, launches = num(r[20]), int(r[21])
        for f, e in [(plain_f, plain), (verify_f, verify), (round_f, round_e), *kinds]:
            assert f <= e * 1.0005 + 0.06, r
        assert abs(sum(e for _, e in kinds) + overhead - round_e) <= 0.002 * round_e + 1, r   # the cells' rounding
        assert abs(verify / plain - ratio) <= verify / plain * (0.06 / verify + 0.06 / plain) + 0.001, r
        assert round_e >= verify and launches > 0 and (att == "-" or 0 < num(att) <= 100), r
    for block in re.split(r"\n(?=\S.* B=\d+ context=\d+ vt=\d+: round floor)", out)[1:]:
        head = block.splitlines()[0]
        total = num(re.search(r"expected ([\d,.]+) us", head).group(1))
        kernels = rows_of(block, "phase ")
        limits = [[num(x) for x in k[7:13]] for k in kernels]
        floors, expected = [num(k[13]) for k in kernels], [num(k[14]) for k in kernels]
        for k, lim, f, e in zip(kernels, limits, floors, expected):
            assert max(lim) <= f * 1.0005 + 0.06 and f <= e * 1.0005 + 0.06 and k[15] in pm.LIMITERS, k
            assert 0 <= num(k[17]) <= 100.5, k   # bytes over expected time never beat the copy bandwidth
        assert sum(expected) < total, head
        shares = re.search(r"round's kernels ([\d.]+)%.*weight products ([\d.]+)%; glue ([\d.]+)%", block)
        assert shares and all(0 < float(x) <= 100 for x in shares.groups()), head
    moves = rows_of(out, "shape ", "state MB")
    assert len(moves) == len({tuple(r[:2]) for r in summary})  # one row per shape and batch
    for m in moves:
        assert abs(sum(num(x) for x in m[3:7]) - num(m[7])) <= 0.003, m


def test_the_model_prices_the_attention_plan_not_its_own_arithmetic():
    plan = launch_plan([8], [32768], hq=24, hkv=4, head_dim=256, dtype=BF16)
    main, combine = pm.attention_kernels("verify", plan, pm.H200)
    assert main.ctas == plan.ctas and main.min_bytes == plan.bytes["kv"] + plan.bytes["q"] + plan.bytes["out"]
    assert main.bytes == pytest.approx(plan.bytes["kv"] + plan.bytes["q"] + plan.bytes["partials_written"], rel=1e-9)
    assert combine.ctas == plan.combine_grid[0] * plan.combine_grid[1]
    assert main.waves == -(-plan.ctas // pm.H200.sms)  # 179 KiB of shared memory: one CTA per SM


TINY = pm.Shape("tiny", TINY_TRUNK, TINY_DRAFTER, 4, "dspark.models.presets")


@pytest.mark.parametrize("rollback", ["checkpoint", "replay"])
@pytest.mark.parametrize("batch, mode", [(1, "graph"), (3, "plain")])
def test_bytes_and_launches_of_a_round_are_what_the_contract_path_counts(rollback, batch, mode):
    be = contract.backend()
    trunk, drafter = tiny_pair(be, 9)
    params = SpecParams(max_new_tokens=1000, verify="full", rollback=rollback, launches=mode)
    sessions = [DsparkSpecSession.prime(trunk, drafter, np.arange(7 + 5 * i, dtype=np.int32) % 250, params)
                for i in range(batch)]
    spec_round(sessions)
    before = [(s.stats.drafted, s.stats.accepted, len(s.emitted)) for s in sessions]
    with profile.counting() as c:
        spec_round(sessions)
    vts = [s.stats.drafted - d + 1 for s, (d, _, _) in zip(sessions, before)]
    keeps = [len(s.emitted) - n for s, (_, _, n) in zip(sessions, before)]
    counted = {k: v for k, v in c.bytes.items() if v}
    assert counted == {k: v for k, v in pm.round_moves(TINY, vts, keeps, rollback).items() if v}
    assert counted["state"] and counted["kv_commit"] and (rollback == "replay" or counted["checkpoints"])
    assert c.launches == sum(k.launches for k in pm.spec_round(TINY, batch, 16, vts[0], rollback=rollback,
                                                                mode=mode).kernels if k.ctas)
    assert c.array_ops == pm.array_ops(mode, True) and c.h2d == (pm.UPLOADS["round"] if mode == "graph" else c.h2d)
    assert c.graphs == (3 if mode == "graph" else 0)
    for s in sessions:
        s.close()


def test_a_prompts_array_ops_and_waits_are_what_the_contract_path_counts():
    """perf_model.prompt's CuPy array ops (PROMPT_GLUE) and waits per pass, and its pointer tables,
    are the ones a chunked prompt (passes of 64 over 150 tokens) makes on the CuPy stand-in."""
    trunk, _ = tiny_pair(contract.backend(), 9)
    assert trunk.chunked_gdn
    cache = trunk.new_cache()
    attn, gdn = trunk.config.layers.count("attn"), trunk.config.layers.count("gdn")
    passes, ops, h2d = trunk.prompt_passes(cache, np.arange(150, dtype=np.int32) % 250, chunk=64), [], []
    while True:
        with profile.counting() as c:
            if next(passes, None) is None:
                break
        ops.append(c.array_ops)
        h2d.append(c.h2d)
    glue = pm.PROMPT_GLUE["pass"] + gdn * pm.PROMPT_GLUE["gdn"]
    assert ops == [glue, glue, glue + pm.PROMPT_GLUE["last"]]
    pr = pm.prompt(pm.Shape("tiny", trunk.config, TINY_DRAFTER, 4, "dspark.models.presets"), 150, chunk=64)
    assert sum(h2d) == pr.syncs + pr.tables


def test_prompt_table_adds_up():
    """--prompt: for each shape and prompt length, the TTFT's floor and expected time, each the
    parts' (GEMMs, attention, gdn, other) floors or expected times plus the waits; each part's floor
    under its expected time; the expected time never under the pass's FLOPs at 90 % of the
    mma.sync ceiling; the plain batched decode rows' ratios are their cells'; the memory rows add up
    and say where a context passes max_position_embeddings."""
    out = ok(script("profiling/perf_model.py", "--prompt")[0])
    ttft = {(r[0], int(r[1])): r for r in rows_of(out, "shape ", "TTFT floor ms")}
    assert set(ttft) == {("Qwen3.5-27B", 8192), ("Qwen3.5-27B", 32768), ("Qwen3-8B", 8192), ("Qwen3.5-35B-A3B", 8192)}
    for r in ttft.values():
        floor, expected = num(r[2]), num(r[3])
        parts = [(num(r[4 + 2 * i]), num(r[5 + 2 * i])) for i in range(4)]
        waits, at_90 = num(r[12]), num(r[15])
        assert abs(sum(f for f, _ in parts) + waits - floor) <= 0.002 * floor + 1, r   # the cells' rounding
        assert abs(sum(e for _, e in parts) + waits - expected) <= 0.002 * expected + 1, r
        assert all(f <= e + 0.05 for f, e in parts) and floor <= expected, r
        assert expected >= at_90 and 0 < num(r[16]) <= 90, r
    plain = {r[0]: r for r in rows_of(out, "shape ", "plain B=1")}
    q35 = plain["Qwen3.5-27B"]
    assert abs(num(q35[5]) - num(q35[4]) / num(q35[2])) <= 0.01 and num(q35[7]) >= 1.0
    mem = rows_of(out, "shape ", "K/V GiB")
    assert len(mem) == 4 and all(abs(sum(num(x) for x in r[2:5]) - num(r[5])) <= 0.02 for r in mem)
    assert [r[7] for r in mem] == ["yes", "yes", "yes", "no: max_position_embeddings 40960"]


# The FLOPs of Qwen3.5-27B's prompt pass, counted here from its config (not from the model's plans):
# per token, 2 K N for every product, over 64 layers: 16 attention layers (q and gate 24 x 256 x 2, k
# and v 4 x 256 each, the output 24 x 256 -> 5120), 48 gdn layers (in: 2 x 16 x 128 q/k + 48 x 128 v
# channels, z 48 x 128, a and b 48 each; out 48 x 128 -> 5120), and every layer's MLP (5120 -> 2 x 17408
# -> 5120); attention: 4 D per (query head, visible key) in 16 layers, row i of a pass sees i + 1 keys.
D_MODEL, MLP = 5120, 17408
ATTN_KN = D_MODEL * (24 * 256 * 2 + 2 * 4 * 256) + 24 * 256 * D_MODEL
GDN_KN = D_MODEL * (2 * 16 * 128 + 48 * 128 + 48 * 128 + 2 * 48) + 48 * 128 * D_MODEL
MLP_KN = D_MODEL * 2 * MLP + MLP * D_MODEL


def gemm_flops(tokens: int) -> int:
    return 2 * tokens * (16 * ATTN_KN + 48 * GDN_KN + 64 * MLP_KN)


def attention_flops(tokens: int) -> int:
    return 16 * 4 * 256 * 24 * tokens * (tokens + 1) // 2


@pytest.mark.parametrize("tokens", [8192, 32768])
def test_the_floor_is_the_hand_counted_flops_at_the_ceiling(tokens):
    """The GEMMs' and the attention's tensor-pipe limiter over a prompt of `tokens` (passes of 8192)
    is their FLOPs counted by hand at the mma.sync ceiling: at least that, and above it only by the
    tiles' padding (whole 128-column tiles of gdn's 16,480 outputs; attention CTAs of 64 items that
    hold 10 rows of 6 heads, whole 64-key tiles on the causal diagonal) and the last wave's quantisation (7,168 CTAs of q|k|v on 132 SMs: 54.3
    waves; attention's CTAs of unequal keys); every
    one of their floors is at least its tensor limiter."""
    dev = pm.H200
    pr = pm.prompt(pm.shapes()["qwen3.5-27b"], tokens, dev)
    gemms = [k for k in pr.kernels if k.kind == "weights" and "lm head" not in k.name]
    attn = [k for k in pr.kernels if k.name.startswith("attention_prompt")]
    for ks, flops, slack in ((gemms, gemm_flops(tokens), 0.02), (attn, attention_flops(tokens), 0.12)):
        tensor = sum(k.limits["tensor"] for k in ks)
        assert flops / dev.mma_sync <= tensor <= (1 + slack) * flops / dev.mma_sync, (tensor, flops / dev.mma_sync)
        assert all(k.floor >= k.limits["tensor"] for k in ks)
    assert sum(k.time for k in pr.kernels) >= (gemm_flops(tokens) + attention_flops(tokens)) / (0.9 * dev.mma_sync)


def test_every_tile_shape_is_resident_as_the_ptxas_report_lists_it():
    """profiling/ptxas_report.md lists, for every GEMM, attention and chunked-gdn tile shape the
    plans use, the registers as compiled and the CTAs per SM the model prices with (`resident`,
    sm_90, NVRTC 13): at least one each; a prompt's GEMM is priced at its tile's count."""
    import ptxas_report
    dev = pm.H200
    report = (PROFILING / "ptxas_report.md").read_text()
    section = report[report.index("### Residency of the tile shapes (NVRTC 13"):]
    listed = {m.group(1): (int(m.group(2)), int(m.group(3)))
              for m in re.finditer(r"^\| `(\w+)` \|[^|]*\|[^|]*\|[^|]*\|[^|]*\|[^|]*\| (\d+) \| (\d+) \|$", section, re.M)}
    for name, threads, smem, _ in ptxas_report.tile_shapes():
        code = pm.compiled(name, dev)
        n = pm.resident(threads, smem + code.static_smem, code.registers, dev)
        assert n >= 1 and listed[name] == (code.registers, n), name
    p = pm.linear_ops.mma_plan(8192, 5120, 5120)
    *_, gemm = pm.linear("prompt", "attn o", 8192, 5120, 5120, 2, dev)   # after the activations' rounding
    assert gemm.entry == f"linear_mma_bf16_a16_{p.shape}" and gemm.per_sm == listed[gemm.entry][1]


def test_an_a100_launches_every_attention_plan_it_is_given():
    """Every attention plan a device of sm_80's 163 KB a CTA takes (each storage type, head dim and
    strategy) asks for at most that much shared memory, and the report lists its entry point with at
    least one CTA per SM on sm_80 (the D = 256 tiles once asked 169 and 183 KB there)."""
    from dspark.ops.attention import CONFIGS, launch_plan
    limit = pm.linear_ops.SHARED_LIMIT[80]
    report = (PROFILING / "ptxas_report.md").read_text()
    section = report[report.index("### Residency of the tile shapes (NVRTC 13"):]
    sm80 = {m.group(1): int(m.group(2))
            for m in re.finditer(r"^\| `(\w+)` \|[^|]*\|[^|]*\|[^|]*\|[^|]*\| (\d+) \|[^|]*\|[^|]*\|$", section, re.M)}
    for (isz, d) in CONFIGS:
        dtype = np.float32 if isz == 4 else BF16
        strategies = ("serial", "parallel", "prompt") if isz == 2 else ("serial", "parallel")
        for strategy in strategies:
            p = launch_plan([80], [500], hq=12, hkv=2, head_dim=d, dtype=dtype, strategy=strategy, limit=limit)
            assert p.shared_mem <= limit and sm80[p.kernel] >= 1, (p.kernel, p.shared_mem)
            if (isz, d) != (4, 256):   # sm_86 / sm_89's 99 KB: all but f32 at D = 256 (refused by name)
                auto = launch_plan([80], [500], hq=12, hkv=2, head_dim=d, dtype=dtype, limit=pm.linear_ops.SHARED_LIMIT[89],
                                   strategy="auto" if strategy == "prompt" else strategy)
                assert auto.shared_mem <= pm.linear_ops.SHARED_LIMIT[89] and auto.kernel in sm80, auto.kernel


def test_the_seeds_pair_is_priced_with_each_drafter():
    """Qwen3.8-27B with DeepSpec's DFlash2 (five layers of 8 kv heads of 128, per-row windows of
    2048, a trimmed vocabulary under the selector) and DSpark: the DFlash2's drafter attention
    and its draft KV stay those of window + block rows at any context, the DSpark's grow with it."""
    table = pm.shapes()
    dflash2, dspark = table["qwen3.8-27b-dflash2"], table["qwen3.8-27b-dspark"]
    assert dflash2.trunk == dspark.trunk == table["qwen3.5-27b"].trunk
    dc = dflash2.drafter
    assert (dc.layers, dc.kv_heads, dc.head_dim, dc.window_mode, dc.windows(), dc.drafts) == \
        (5, 8, 128, "row", (2048,) * 5, 7)

    def drafter_attention(shape, context):
        return sum(k.bytes for k in pm.drafter_pass(shape, 1, context, pm.H200) if k.kind == "kv")

    assert drafter_attention(dflash2, 32768) == drafter_attention(dflash2, 131072)
    assert drafter_attention(dspark, 131072) > 3 * drafter_attention(dspark, 32768)
    names = [k.name for k in pm.drafter_pass(dflash2, 1, 4096, pm.H200)]
    assert "candidate selector" in names and any(n.startswith("drafter lm head (own, draft vocabulary)") for n in names)

# ---- the code as compiled: issue rate, registers, bounds --------------------------------------------------
MODEL_ROUNDS = [(m, b, ctx) for m in ("embedded", "qwen3-8b", "qwen3.5-27b", "qwen3.5-27b-fp8", "qwen3.5-35b-a3b",
                                      "qwen3.5-35b-a3b-fp8") for b in (1, 2) for ctx in (4096, 32768)]


@pytest.mark.parametrize("model, batch, context", MODEL_ROUNDS)
def test_no_kernel_beats_its_issue_or_bandwidth_bound(model, batch, context):
    """Every kernel of a spec round and of a plain step: its expected time at or above each of its
    limiters (its floor the largest), its DRAM bytes at the copy bandwidth, and its f32
    instructions at the issue rate, counted as compiled: flops / flops per f32 instruction of its
    PTX (1 where -fmad=false keeps a * b + c as mul and add, 2 for fmaf); tensor-core flops at the
    MMA rate."""
    dev = pm.H200
    r = pm.spec_round(pm.shapes()[model], batch, context, 8)
    for k in r.kernels + r.plain:
        code = pm.compiled(k.entry, dev)
        instructions = 0.0 if k.mma_flops else k.flops / code.flops_per_instruction
        assert k.f32_instr == pytest.approx(instructions, rel=1e-9), k.name
        assert k.mma_flops == (k.flops if k.mma_flops else 0), k.name
        assert set(k.limits) == set(pm.LIMITERS) and k.floor == max(k.limits.values()), k.name
        for lim, t in k.limits.items():
            assert k.time >= t * (1 - 1e-9), f"{k.name}: expected {k.time * 1e6:.2f} us under its {lim} {t * 1e6:.2f} us"
        issue = max(instructions / dev.f32_issue, k.mma_flops / dev.mma_sync)
        assert k.time >= issue * (1 - 1e-9), f"{k.name}: {k.time * 1e6:.1f} us beats its issue bound {issue * 1e6:.1f}"
        assert k.time >= k.bytes / dev.bw * (1 - 1e-9), f"{k.name}: priced under its DRAM bytes"
        assert k.limits["dram"] == pytest.approx(k.bytes / dev.bw, rel=1e-4), k.name  # bytes: whole per layer
        assert (k.issue_bound(dev), k.bandwidth_bound(dev)) == pytest.approx((issue, k.bytes / dev.bw))


def test_every_prompt_kernel_is_at_or_above_its_limiters():
    """The prompt pass's kernels (the GEMMs in fold mode, prompt attention, the chunked gdn, the
    glue): expected at or above each limiter and the DRAM bytes."""
    dev = pm.H200
    for name in ("qwen3.5-27b", "qwen3-8b", "qwen3.5-27b-fp8", "qwen3.5-35b-a3b", "qwen3.5-35b-a3b-fp8"):
        for k in pm.prompt(pm.shapes()[name], 8192, dev).kernels:
            assert all(k.time >= t * (1 - 1e-9) for t in k.limits.values()), k.name
            assert k.time >= k.bytes / dev.bw * (1 - 1e-9) and k.floor == max(k.limits.values()), k.name


def test_every_decode_and_verify_product_fills_whole_waves(monkeypatch):
    """Every 16-bit product of one 16-row tile that the bf16 pairs' rounds run (Qwen3-8B, Qwen3.5-27B,
    Qwen3.8-27B with each drafter; decode, verify and drafter rows at B = 1 and 2) fills whole waves of
    an H200's SMs: its CTAs over 132 x their waves (linear.wave_fill) at least 0.96. The K split stays
    mma_split_plan's (K, N) alone (the bits); the column tiles make up the rest (whole_wave_tiles), at
    most twice ceil(N / BN). 0.96, not 1: sixteen K chunks times 8 or 16 column tiles give 128 or 256
    CTAs, and no count up to twice as many tiles reaches a multiple of 132."""
    lo = pm.linear_ops
    seen, real = set(), lo.mma_plan

    def recording(rows, k, n, **kw):
        plan = real(rows, k, n, **kw)
        if kw.get("configs", lo.MMA_CONFIGS) is lo.MMA_CONFIGS and plan.m_tiles == 1 and plan.bm == 16:
            seen.add((rows, k, n))
        return plan

    monkeypatch.setattr(lo, "mma_plan", recording)
    for name in ("qwen3-8b", "qwen3.5-27b", "qwen3.8-27b-dflash2", "qwen3.8-27b-dspark"):
        for batch in (1, 2):
            pm.spec_round(pm.shapes()[name], batch, 8192, 8)
    assert {(1, 5120, 34816), (8, 5120, 34816), (16, 4096, 24576), (16, 5120, 2048)} <= seen and len(seen) > 40
    for rows, k, n in sorted(seen):
        p = real(rows, k, n)
        base = -(-n // p.bn)
        assert (p.splits, p.kchunk) == lo.mma_split_plan(k, n) and base <= p.n_tiles <= 2 * base, (rows, k, n)
        assert lo.wave_fill(p.ctas) >= 0.96, f"{rows} x {k} x {n}: {p.ctas} CTAs"


def test_a_kernels_mmas_add_up_to_its_flops():
    """The tensor limiter prices the MMAs a Work gives each CTA; a kernel's flops are counted apart.
    They must agree: the chunked gdn's preparation (a CTA per chunk and value head) once gave each
    CTA a whole chunk's MMAs over all 48 heads, a tensor floor 48x its flops that made it the
    prompt's largest gdn part. kernel_of refuses such a Work; the preparation's tensor limiter is
    its flops at the mma.sync rate over its waves (uniform CTAs, one per SM)."""
    dev, rows = pm.H200, 8192
    c = pm.shapes()["qwen3.5-27b"].trunk
    conv, prep, walk = pm.prompt_gdn("prompt", c.gdn_heads, c.gdn_dk, c.gdn_dv, c.gdn_k_heads, rows, dev)
    waves = -(-prep.ctas // (dev.sms * prep.per_sm))
    assert prep.per_sm == 1 and prep.limits["tensor"] == pytest.approx(
        prep.mma_flops / prep.ctas / (dev.mma_sync / dev.sms) * waves, rel=1e-9)
    flops = 2.0 * 16 * 8 * 16 * 1000
    work = pm.Work("linear_mma_bf16_m16", 128, 0, np.full(10, 1e6), mma=flops / pm.MMA_FLOPS / 10 * 48)
    with pytest.raises(ValueError, match="MMAs add up to"):
        pm.kernel_of("verify", "off by the heads", "other", work, dev, flops=flops, mma_flops=flops)
    padded = pm.kernel_of("verify", "padded", "other", dataclasses.replace(work, mma=flops / pm.MMA_FLOPS / 10 * 2),
                          dev, flops=flops, mma_flops=flops, executed=2 * flops)
    assert padded.limits["tensor"] > 0
    with pytest.raises(ValueError, match="of which"):   # executing fewer flops than its own
        pm.kernel_of("verify", "short", "other", dataclasses.replace(work, mma=flops / pm.MMA_FLOPS / 10 / 2),
                     dev, flops=flops, mma_flops=flops, executed=flops / 2)


def test_the_skinny_gemm_is_priced_at_two_instructions_per_multiply_add():
    """linear_f32 (f32 weights, CUDA cores) writes acc + x * w: under -fmad=false a mul and an add.
    At 16 rows (two sessions' verify) an f32 copy of Qwen3.5-27B's MLP up-projection issues
    2 * 16 * K * N f32 instructions: its issue bound and time may not be what the FMA rate (67
    TFLOP/s) would give. 16-bit weights run the tensor-core GEMM: its flops are MMA flops."""
    dev, rows, k, n = pm.H200, 16, 5120, 2 * 17408
    code = pm.compiled("linear_f32", dev)
    assert code.fma == 0 and code.mul_add > 0 and code.flops_per_instruction == 1.0
    (gemm,) = pm.linear("verify", "mlp gate|up", rows, k, n, 4, dev)
    assert gemm.f32_instr == 2 * rows * k * n and gemm.mma_flops == 0
    assert gemm.time >= gemm.issue_bound(dev) == 2 * rows * k * n / dev.f32_issue > 2 * rows * k * n / dev.f32
    (mma,) = pm.linear("verify", "mlp gate|up", rows, k, n, 2, dev)
    assert mma.entry == "linear_mma_bf16_m16" and mma.f32_instr == 0 and mma.mma_flops >= 2 * rows * k * n


def test_f32_mix_reads_fma_from_the_ptx(tmp_path):
    from dspark.toolchain import NVRTC_OPTIONS, default_nvrtc
    src = tmp_path / "mix.cu"
    src.write_text('extern "C" __global__ void k(const float* a, float* o) { o[0] = a[0] * a[1] + a[2]; }\n'
                   'extern "C" __global__ void f(const float* a, float* o) { o[0] = fmaf(a[0], a[1], a[2]); }\n')
    ptx = default_nvrtc().compile(src, "compute_90", NVRTC_OPTIONS, ptx=True)[0].decode()
    assert pm.f32_mix(ptx, "k") == (0, 2) and pm.f32_mix(ptx, "f") == (1, 0)
    assert pm.Compiled("k", 8, 0, 0, 2).flops_per_instruction == 1.0
    assert pm.Compiled("f", 8, 0, 1, 0).flops_per_instruction == 2.0
    with pytest.raises(LookupError, match="no entry g"):
        pm.f32_mix(ptx, "g")


def test_residency_counts_registers_threads_and_shared_memory():
    dev = pm.H200
    code = pm.compiled("linear_f32", dev)
    assert 96 < code.registers <= 128 and code.static_smem > 16 * 1024
    # 97-128 registers x 128 threads: 4,096 registers a warp, 16 warps in 65,536: 4 CTAs of 4 warps
    assert pm.resident(128, code.static_smem, code.registers, dev) == 4
    assert pm.resident(128, code.static_smem, 0, dev) == 13       # shared memory alone would allow 13
    mma = pm.compiled("linear_mma_bf16_m32", dev)                  # > 128 registers: 2 CTAs of 4 warps
    assert mma.registers > 128 and pm.resident(128, 0, mma.registers, dev) == 2
    assert pm.resident(256, 0, 32, dev) == 8 and pm.resident(32, 0, 32, dev) == 32
    with pytest.raises(ValueError, match="does not fit on an SM"):
        pm.resident(1024, 0, 255, dev)
    (gemm,) = pm.linear("verify", "mlp down", 8, 17408, 5120, 4, dev)
    assert gemm.per_sm == 4


def test_the_launch_costs_are_parameters_of_the_round():
    """The plain path pays Device.launch per launch, the eager one host_eager and CuPy's call, the
    graph one its node cost on the GPU, its round's host time and CuPy's graph launches."""
    shape, dev = pm.shapes()["qwen3.5-27b"], pm.H200
    for mode, field in (("plain", "launch"), ("eager", "host_eager"), ("graph", "graph_node")):
        base = pm.spec_round(shape, 1, 4096, 8, mode=mode)
        cheap = pm.spec_round(shape, 1, 4096, 8, dataclasses.replace(dev, **{field: 1e-6}), mode=mode)
        assert base.gpu() == cheap.gpu()
        assert base.overhead() - cheap.overhead() == pytest.approx(base.launches * (getattr(dev, field) - 1e-6)), mode
    out = ok(script("profiling/perf_model.py", "--model", "qwen3.5-27b", "--launch-us", "2.5", "--graph-node-us", "1")[0])
    assert "plain 2.5 us" in out and "1.0 us a node on the GPU" in out


def test_the_round_is_priced_in_every_mode():
    """The CLI prints every mode's round and its launch and host overhead's share, as the model
    prices them (graphs replace per-launch host costs by one round's: the cheapest there)."""
    shape = pm.shapes()["qwen3.5-27b"]
    rounds = {m: pm.spec_round(shape, 1, 32768, 8, mode=m) for m in pm.MODES}
    assert rounds["graph"].time() < rounds["eager"].time() < rounds["plain"].time()
    out = ok(script("profiling/perf_model.py", "--model", "qwen3.5-27b")[0])
    modes = rows_of(out, "shape ", "mode")
    assert [r[4] for r in modes] == list(pm.MODES)
    for r in modes:
        assert num(r[8]) == pytest.approx(100 * rounds[r[4]].overhead() / rounds[r[4]].time(), abs=0.06), r


def test_a_qwen35_27b_round_as_recorded_is_the_round_the_model_prices():
    """Issue 22: the Qwen3.5-27B round at B = 1, 32k, recorded on the null executor (the real
    shapes, no memory, nothing run): at most 600 launches, and kernel for kernel the launches
    perf_model prices for it (a fused kernel split again, or one the model forgets, fails here)."""
    from collections import Counter
    import round_counts
    passes, _ = round_counts.pass_launches()
    recorded = Counter(name for names in passes.values() for name in names)
    assert sum(recorded.values()) <= 600, {k: len(v) for k, v in passes.items()}
    priced = Counter()
    for k in pm.spec_round(pm.shapes()["qwen3.5-27b"], 1, 32768, 8, mode="graph").kernels:
        if k.ctas:
            priced[k.entry] += k.launches
    assert recorded == priced


def test_launch_cost_times_every_family_with_execution_off():
    """profiling/launch_cost.py (the source of Device.launch's default) times a call of every
    kernel family the round launches; with execution off the stand-in runs no kernel."""
    from dspark.ops.norm import rmsnorm
    be = contract.backend()
    x, w = be.asarray(np.ones((2, 64), np.float32)), be.asarray(np.ones(64, np.float32))
    out = be.xp.full((2, 64), -7, np.float32)
    with contract.executing(False), profile.counting() as c:
        rmsnorm(be, x, w, 0.0, out=out)
    assert c.launches == 1 and (be.to_host(out) == -7).all()  # launched, nothing executed
    rmsnorm(be, x, w, 0.0, out=out)
    assert (be.to_host(out) == 1).all()
    text = ok(script("profiling/launch_cost.py", "--reps", "2", timeout=300)[0])
    m = re.search(r"per launch, weighted by the round's launches: ([\d.]+) us", text)
    assert m and float(m.group(1)) > 0, text
    for family in ("linear", "norm", "attention", "gdn_scan", "snapshot", "argmax", "kv_commit", "activation", "rope"):
        assert re.search(rf"^{family}\s+\d+\s+[\d.]+\s+[1-9]\d*$", text, re.M), f"{family}\n{text}"


# ---- FP8 releases ---------------------------------------------------------------------------------------------
def test_fp8_linears_are_priced_at_one_byte_and_their_scales():
    """An FP8 release's plain step beside its bf16 twin's: each decoder-layer GEMM moves, at the
    least, its weights at 1 byte plus 4 per 128 x 128 scale block instead of 2 bytes, on the FP8
    entry; the LM head, the embedding and the gdn a|b stay 16-bit, and nothing else changes."""
    table = pm.shapes()
    fp8, bf16 = table["qwen3.5-27b-fp8"], table["qwen3.5-27b"]
    assert fp8.trunk == bf16.trunk and fp8.drafter == bf16.drafter and fp8.fp8 and not bf16.fp8
    c = fp8.trunk
    H, qkvz = c.gdn_heads, c.gdn_channels + c.gdn_heads * c.gdn_dv
    mine = pm.trunk_pass(fp8, 1, 8192, 1, pm.H200, verify=False)
    theirs = pm.trunk_pass(bf16, 1, 8192, 1, pm.H200, verify=False)
    gemms = [k for k in mine if k.entry.startswith("linear_fp8")]
    assert {k.entry for k in gemms} == {"linear_fp8_bf16_m16", "linear_fp8_bf16_swiglu_m16"}   # mlp down: SwiGLU inside
    shapes_of = {"attn q|k|v": (c.d_model, (2 * c.attn_heads + 2 * c.attn_kv_heads) * c.head_dim),
                 "attn o": (c.attn_heads * c.head_dim, c.d_model), "gdn in q|k|v|z (fp8)": (c.d_model, qkvz),
                 "gdn out": (H * c.gdn_dv, c.d_model), "mlp gate|up": (c.d_model, 2 * c.mlp_hidden),
                 "mlp down": (c.mlp_hidden, c.d_model)}
    for k in gemms:
        name, layers = re.match(r"(.+) \(x(\d+) ", k.name).groups()
        K, N = shapes_of[name]
        x = 2 * K if "swiglu" in k.entry else K   # the down product reads gate|up
        per_layer = K * N + 4 * -(-K // 128) * -(-N // 128) + 4 * (x + N)   # q, scales, x and out
        assert k.min_bytes == int(layers) * per_layer, k.name
        assert ("swiglu" in k.entry) == (name == "mlp down"), k.name
    by_name = {k.name: k for k in theirs}
    for k in mine:
        if k.name.startswith(("lm head", "embedding")):
            assert k.entry == by_name[k.name].entry and k.min_bytes == by_name[k.name].min_bytes, k.name
    ab = [k for k in mine if k.name.startswith("gdn in a|b")]
    assert len(ab) == 1 and ab[0].entry == "linear_mma_bf16_m16"
    assert ab[0].min_bytes == c.layers.count("gdn") * (2 * c.d_model * 2 * H + 4 * (c.d_model + 2 * H))
    weights = lambda ks: sum(k.min_bytes for k in ks if k.kind == "weights")  # noqa: E731
    assert 0.5 < weights(mine) / weights(theirs) < 0.6   # the LM head (2.5 GB) keeps its 2 bytes


def test_the_fp8_report_is_each_pairs_rounds_at_published_lengths():
    """`perf_model.py --fp8`: every FP8 shape at B 1, 2 and 8k, 32k beside its bf16 twin; the
    ratio is the two rounds' expected times, floors under expected times, and time per token is the
    round over each published accepted length with its source (and the embedded pair's, labelled)."""
    out = ok(script("profiling/perf_model.py", "--fp8")[0])
    rows = [x for x in rows_of(out, "shape", "fp8/bf16 round") if len(x) == len(pm.FP8_HEADERS)]
    fp8_shapes = [s for s in pm.shapes().values() if s.fp8]
    assert {(r[0], r[1], r[2]) for r in rows} == {(s.label, str(b), str(c)) for s in fp8_shapes for b in (1, 2)
                                                for c in (8192, 32768)}
    table = pm.shapes()
    r, b = pm.spec_round(table["qwen3.5-27b-fp8"], 1, 8192, 8, pm.H200), pm.spec_round(table["qwen3.5-27b"], 1, 8192, 8, pm.H200)
    row = next(x for x in rows if x[:3] == ["Qwen3.5-27B-FP8", "1", "8192"])
    assert num(row[8]) == pytest.approx(r.time() / b.time(), abs=0.006)
    assert num(row[7]) == pytest.approx(r.time() * 1e6, rel=1e-3)
    for x in rows:
        assert num(x[3]) <= num(x[4]) and num(x[6]) <= num(x[7])
    tpot = [x for x in rows_of(out, "shape", "ms/token") if len(x) == len(pm.TPOT_HEADERS)]
    sources = {(x[0], x[3]): x[5] for x in tpot}
    assert "vLLM recipes #839" in sources[("Qwen3.8-27B-FP8 + DFlash2", "2.7")]
    assert ("Qwen3.8-27B-FP8 + DSpark", "3.7") in sources
    assert all("embedded pair" in sources[(s.label, "4.97")] for s in fp8_shapes)
    for x in tpot:   # the speedup from the printed ms (each within 0.005 of its value), within their rounding
        plain, spec = num(x[6]), num(x[7])
        assert num(x[8]) <= spec and num(x[9]) == pytest.approx(
            plain / spec, abs=plain / spec * (0.005 / plain + 0.005 / spec) + 0.0051)
    x = next(x for x in tpot if x[:4] == ["Qwen3.5-27B-FP8", "1", "8192", "4.97"])
    assert num(x[7]) == pytest.approx(r.time() / 4.97 * 1e3, abs=0.006)


# ---- MoE targets ------------------------------------------------------------------------------------------------
def test_routing_models_and_their_distinct_experts():
    """uniform: E (1 - (1 - k/E)^n), one row reads its k experts; published: through 39.4 experts
    at 8 rows of a 256-expert top-8 model. Both grow with the rows, capped by the rows' entries and E."""
    s = pm.shapes()["qwen3.5-35b-a3b"]
    c = s.trunk
    assert (c.experts, c.expert_top_k, c.expert_hidden, c.shared_expert_hidden) == (256, 8, 512, 512)
    pub = dataclasses.replace(s, routing="published")
    assert pm.distinct_experts(s, 1) == pm.distinct_experts(pub, 1) == 8
    assert pm.distinct_experts(pub, 8) == 39
    assert pm.distinct_experts(s, 8) == round(256 * (1 - (1 - 8 / 256) ** 8)) == 57
    for shape in (s, pub):
        counts = [pm.distinct_experts(shape, n) for n in range(1, 65)]
        assert counts == sorted(counts) and counts[-1] <= 256


@pytest.mark.parametrize("name", ["qwen3.5-35b-a3b", "qwen3.5-35b-a3b-fp8"], ids=["bf16", "fp8"])
@pytest.mark.parametrize("routing", ["uniform", "published"])
@pytest.mark.parametrize("width", [2, 5, 8])
def test_a_moe_verify_reads_each_distinct_expert_once(routing, width, name):
    """The grouped products of a verify of `width` rows: the plan's CTA-to-expert map (for a routing
    the twin groups: dspark.ops.moe.group_ref) touches exactly the routing model's distinct experts,
    and the kernel's least bytes are those experts' weights once (FP8: a byte a weight and 4 per
    128 x 128 scale block, on the FP8 entry), its rows of x and its outputs."""
    from dspark.ops import moe as moe_ops
    s = dataclasses.replace(pm.shapes()[name], routing=routing)
    c = s.trunk
    d, E, k, I = c.d_model, c.experts, c.expert_top_k, c.expert_hidden
    wb = 1 if s.fp8 else 2
    D = pm.distinct_experts(s, width)
    ids = pm.synthetic_routing(width, k, D)
    assert all(len(set(row)) == k for row in ids.tolist())
    for K, N, gather in ((d, 2 * I, True), (I, d, False)):
        plan = moe_ops.grouped_plan(width, k, E, K, N, wb)
        g = moe_ops.group_ref(ids, E, plan.tile_rows)
        assert len({cta["expert"] for cta in plan.ctas(g)}) == g.distinct == D
        kern = pm.grouped_kernel("verify", "x", width, K, N, s, pm.H200, gather=gather)
        assert kern.entry == plan.entry == f"moe_linear_{'fp8' if s.fp8 else 'mma'}_bf16_m16"
        P = width * k
        one = K * N * wb + (4 * -(-K // 128) * -(-N // 128) if s.fp8 else 0)
        assert kern.min_bytes == D * one + 4 * (width if gather else P) * K + 4 * P * N
        assert kern.bytes >= kern.min_bytes and kern.floor <= kern.time
    assert pm.expert_bytes(s) == 3 * d * I * wb + (4 * (16 * 8 + 4 * 16) if s.fp8 else 0)
    ks = pm.trunk_pass(s, 1, 8192, width, pm.H200, verify=True)
    grouped = [kk for kk in ks if kk.entry.startswith("moe_linear_")]
    assert grouped and all(f"({D} experts)" in kk.name and kk.entry.startswith(plan.entry[:15]) for kk in grouped)


def test_fp8_moe_experts_and_shared_expert_are_priced_at_one_byte_the_router_at_two():
    """Qwen3.5-35B-A3B-FP8's plain step beside the bf16 release's: the grouped products on the FP8
    entry, their weights' least bytes half the bf16 ones' plus the scales; the shared expert on
    linear_fp8; the router and its gate (16-bit in the FP8 releases) the bf16 step's own kernel."""
    table = pm.shapes()
    fp8, bf16 = table["qwen3.5-35b-a3b-fp8"], table["qwen3.5-35b-a3b"]
    assert fp8.trunk == bf16.trunk and fp8.drafter == bf16.drafter and fp8.fp8
    mine = {k.name: k for k in pm.trunk_pass(fp8, 1, 8192, 1, pm.H200, verify=False)}
    theirs = {k.name: k for k in pm.trunk_pass(bf16, 1, 8192, 1, pm.H200, verify=False)}
    c = fp8.trunk
    shapes_of = {"gate|up": (c.d_model, 2 * c.expert_hidden), "down": (c.expert_hidden, c.d_model)}
    for name, k in mine.items():
        if name.startswith("moe experts"):   # the down product takes the SwiGLU into its stage
            stage = "swiglu_" if "down" in name else ""
            assert k.entry == f"moe_linear_fp8_bf16_{stage}m16" and theirs[name].entry == f"moe_linear_mma_bf16_{stage}m16"
            part, D, layers = re.match(r"moe experts (\S+) \((\d+) experts\) \(x(\d+) ", name).groups()
            K, N = shapes_of[part]
            saved = int(layers) * int(D) * (K * N - 4 * -(-K // 128) * -(-N // 128))   # 2 bytes a weight -> 1 + scales
            assert theirs[name].min_bytes - k.min_bytes == saved, name
        elif name.startswith("moe shared"):   # its down product takes the SwiGLU into its stage
            assert k.entry == f"linear_fp8_bf16_{'swiglu_' if 'down' in name else ''}m16", name
        elif name.startswith("moe router"):
            assert k.entry == theirs[name].entry == "linear_mma_bf16_m16" and k.min_bytes == theirs[name].min_bytes
    assert any(n.startswith("moe experts gate|up") for n in mine) and any(n.startswith("moe shared") for n in mine)


def test_the_moe_report_prices_widths_by_their_experts():
    """`perf_model.py --moe`: every routing model, B 1 and 2, 8k and 32k, widths 2..8; the expert
    bytes are the MoE layers' distinct experts' weights; a verify under the routing that reads
    fewer experts is cheaper; the gain width is the width of least time per token, recomputed."""
    out = ok(script("profiling/perf_model.py", "--moe")[0])
    rows = [x for x in rows_of(out, "weights", "experts/layer") if len(x) == len(pm.MOE_HEADERS)]
    assert {tuple(x[:5]) for x in rows} == {(f, r, str(b), str(c), str(w)) for f in ("bf16", "fp8") for r in pm.ROUTINGS
                                           for b in (1, 2) for c in (8192, 32768) for w in range(2, 9)}
    table = pm.shapes()
    shape_of = {"bf16": table["qwen3.5-35b-a3b"], "fp8": table["qwen3.5-35b-a3b-fp8"]}
    c = shape_of["bf16"].trunk
    for x in rows:
        assert num(x[6]) == pytest.approx(40 * int(x[5]) * pm.expert_bytes(shape_of[x[0]]) / 1e6, abs=0.06)
        assert num(x[7]) <= num(x[8]) and num(x[10]) <= num(x[11])
    assert pm.expert_bytes(shape_of["bf16"]) == 3 * c.d_model * c.expert_hidden * 2
    verify = {tuple(x[:5]): num(x[8]) for x in rows}
    for f in ("bf16", "fp8"):
        assert verify[(f, "published", "1", "8192", "8")] < verify[(f, "uniform", "1", "8192", "8")]
    r = pm.spec_round(dataclasses.replace(shape_of["fp8"], routing="published"), 2, 32768, 5)
    x = next(x for x in rows if x[:5] == ["fp8", "published", "2", "32768", "5"])
    assert num(x[8]) == pytest.approx(r.gpu(r.verify_pass()) * 1e6, rel=1e-3)
    assert num(x[11]) == pytest.approx(r.plain_time() * 1e6, rel=1e-3)
    widths = [x for x in rows_of(out, "curve", "gain width") if len(x) == len(pm.WIDTH_HEADERS)]
    assert len(widths) == len(pm.ACCEPTANCE_CURVES) * len(pm.ROUTINGS) * 2 * len(pm.MOE_SHAPES)
    label, mean, drafts = pm.ACCEPTANCE_CURVES[0]
    for f, s in shape_of.items():
        x = next(x for x in widths if x[0] == label and x[1] == f and x[2] == "uniform" and x[3] == "1")
        per_token = {w: pm.spec_round(s, 1, 8192, w).time() / pm.curve_tokens(mean, drafts, w) for w in range(2, 9)}
        assert int(x[5]) == min(per_token, key=per_token.get)
        assert num(x[7]) == pytest.approx(per_token[int(x[5])] * 1e3, abs=0.006)
