"""profiling/perf_model.py: its CLI's table is internally consistent and meets issue 16's targets
for Qwen3.5-27B; it prices the ops' own launch plans and their code as compiled (registers in
residency, f32 instructions at the issue rate), so no kernel beats its issue or bandwidth bound;
the launch cost is a parameter; and the bytes of state and K/V it predicts for a round, and the
launches, are what the CuPy contract path counts for the same round."""

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
        if not line.strip() or line.startswith(("attn of copy", "recurrent")):
            break
        out.append(re.split(r"\s{2,}", line.strip()))
    return out


def num(cell: str) -> float:
    return float(cell.rstrip("x%").replace(",", ""))


def test_cli_table_is_consistent_and_meets_the_targets():
    out = ok(script("profiling/perf_model.py", "--batch", "1", "2", "--context", "4096", "32768", "--kernels")[0])
    summary = rows_of(out, "shape ")
    assert len(summary) == len(pm.shapes()) * 2 * 2
    for r in summary:
        shape, B, ctx, vt, att, ratio, plain, verify, total = r[:9]
        shares, launches = [num(x) for x in r[9:14]], int(r[14])
        assert abs(sum(shares) - 100) <= 3, r                        # the composition covers the round
        v, p = num(verify), num(plain)
        assert abs(v / p - num(ratio)) <= v / p * (0.06 / v + 0.06 / p) + 0.001, r  # the cells' rounding
        assert num(total) >= num(verify) and launches > 0, r
        assert att == "-" or 0 < num(att) <= 100, r
        if shape == "Qwen3.5-27B" and B == "1" and ctx == "32768":    # issue 16's targets
            assert num(att) >= 80 and num(ratio) <= 1.15, r
    # every round's kernels add up to its GPU time; the overhead is its launches and syncs
    for block in re.split(r"\n(?=\S.* B=\d+ context=\d+ vt=\d+: round)", out)[1:]:
        head = block.splitlines()[0]
        total = num(re.search(r"round ([\d,.]+) us", head).group(1))
        kernels = rows_of(block, "phase ")
        gpu = sum(num(k[8]) for k in kernels)
        launches = sum(int(k[7]) for k in kernels if k[5] != "-")
        assert launches > 0 and all(k[9] == "-" or num(k[9]) <= 100 for k in kernels), head
        assert gpu < total, head
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
MODEL_ROUNDS = [(m, b, ctx) for m in ("embedded", "qwen3-8b", "qwen3.5-27b") for b in (1, 2) for ctx in (4096, 32768)]


@pytest.mark.parametrize("model, batch, context", MODEL_ROUNDS)
def test_no_kernel_beats_its_issue_or_bandwidth_bound(model, batch, context):
    """Every kernel of a spec round and of a plain step takes at least its bytes at the copy
    bandwidth and its f32 instructions at the issue rate, the instructions counted as compiled:
    flops / flops per f32 instruction of its PTX (1 where -fmad=false keeps a * b + c as mul and
    add, 2 for fmaf); tensor-core flops at the MMA rate."""
    dev = pm.H200
    r = pm.spec_round(pm.shapes()[model], batch, context, 8)
    for k in r.kernels + r.plain:
        code = pm.compiled(k.entry, dev)
        instructions = 0.0 if k.mma_flops else k.flops / code.flops_per_instruction
        assert k.f32_instr == pytest.approx(instructions, rel=1e-9), k.name
        assert k.mma_flops == (k.flops if k.mma_flops else 0), k.name
        issue = max(instructions / dev.f32_issue, k.mma_flops / dev.mma)
        assert k.time >= issue * (1 - 1e-9), f"{k.name}: {k.time * 1e6:.1f} us beats its issue bound {issue * 1e6:.1f}"
        assert k.time >= k.bytes / dev.bw * (1 - 1e-9), f"{k.name}: beats the copy bandwidth"
        assert (k.issue_bound(dev), k.bandwidth_bound(dev)) == pytest.approx((issue, k.bytes / dev.bw))


def test_the_skinny_gemm_is_priced_at_two_instructions_per_multiply_add():
    """linear_bf16 writes acc + x * w: under -fmad=false a mul and an add. At 16 rows (two sessions'
    verify) Qwen3.5-27B's MLP up-projection issues 2 * 16 * K * N f32 instructions: its time may not
    be what the FMA rate (67 TFLOP/s) would give."""
    dev, rows, k, n = pm.H200, 16, 5120, 2 * 17408
    code = pm.compiled("linear_bf16", dev)
    assert code.fma == 0 and code.mul_add > 0 and code.flops_per_instruction == 1.0
    (gemm,) = pm.linear("verify", "mlp gate|up", rows, k, n, 2, dev)
    assert gemm.time >= 2 * rows * k * n / dev.f32_issue > 2 * rows * k * n / dev.f32


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
    code = pm.compiled("linear_bf16", dev)
    assert code.registers > 128 and code.static_smem > 16 * 1024
    # 186 registers x 128 threads: 6 warps' worth of 6,144 registers in 65,536 leaves 2 CTAs of 4 warps
    assert pm.resident(128, code.static_smem, code.registers, dev) == 2
    assert pm.resident(128, code.static_smem, 0, dev) == 6        # shared memory alone would allow 6
    assert pm.resident(256, 0, 32, dev) == 8 and pm.resident(32, 0, 32, dev) == 32
    with pytest.raises(ValueError, match="does not fit on an SM"):
        pm.resident(1024, 0, 255, dev)
    (gemm,) = pm.linear("verify", "mlp down", 8, 17408, 5120, 2, dev)
    assert gemm.per_sm == 2


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


def test_the_round_with_graphs_meets_its_targets():
    """Issue 22: at Qwen3.5-27B, B = 1, 32k, at most 600 launches a round, and with graphs the
    launch and host overhead is at most 10 % of the round; the CLI prints every mode's round and
    speedup."""
    shape = pm.shapes()["qwen3.5-27b"]
    rounds = {m: pm.spec_round(shape, 1, 32768, 8, mode=m) for m in pm.MODES}
    assert rounds["graph"].launches <= 600
    assert rounds["graph"].overhead() <= 0.10 * rounds["graph"].time()
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
