"""Performance model of a speculative round on an H200: bytes, FLOPs, CTAs and waves per kernel,
each kernel's limiters, floor and expected time, the round's composition and the spec/plain speedup.

    python profiling/perf_model.py                     # the table in RESULTS.md: three shapes, B=1, 32k, 8 columns
    python profiling/perf_model.py --model qwen3.5-27b --batch 1 2 32 --context 4096 32768 --width 8 --kernels
    python profiling/perf_model.py --accepted 5.9      # the speedup at another mean accepted length
    python profiling/perf_model.py --prompt [--kernels] # time to first token, plain batched decode, memory
    python profiling/perf_model.py --fp8                # the FP8 releases beside their bf16 twins, time per token
    python profiling/perf_model.py --moe                # Qwen3.5-35B-A3B (bf16, FP8): verify widths by distinct experts
    python profiling/perf_model.py --prior-table        # write dspark/cost_prior_h200.json (the cost prior on cuda), print it

Shapes (SHAPES): the embedded pair (dspark/models/default), Qwen3-8B and Qwen3.5-27B with their
Hugging Face `config.json` numbers (Qwen/Qwen3-8B: hidden 4096, 36 layers, 32 query / 8 kv heads
of 128, MLP 12288, vocabulary 151936, untied; Qwen/Qwen3.5-27B text_config: hidden 5120, 64
layers [linear_attention x 3, full_attention] x 16, 24 query / 4 kv heads of 256 with the output
gate and partial RoPE 0.25, gdn 48 value / 16 key heads of 128, MLP 17408, vocabulary 248320,
untied), stored bf16 as on the `cuda` backend. Their drafter is not part of those configs: the
model uses a one-layer DSpark drafter of the target's widths, block 8, a 4096-row window, rank-32
Markov head (--drafter-window changes the window).

The seed's pair: Qwen3.8-27B (the Qwen3.5-27B text config above: DeepSpec's
deepspec/modeling/dspark/qwen3_8/config.py checks exactly those numbers) with each of DeepSpec's
drafters for it. "qwen3.8-27b-dflash2": the served DFlash2 (dflash2/qwen3_8/config.py): five Qwen3
layers of 32 query / 8 kv heads of 128, MLP 17408, every layer a non-causal sliding window of 2048
rows around each block row, verification block 8 (7 drafts), grouped dynamic convolutions
(kernel 2, groups of 16), the candidate selector (rank 256, top 16), taps 5/19/33/47/61; its
trimmed draft vocabulary's size is not published: 32768 rows here (DFLASH2_DRAFT_VOCAB).
"qwen3.8-27b-dspark": DeepSpec's Qwen3_8DSparkModel (the target's attention geometry, 24 / 4
heads of 256, MLP 17408, full attention over every committed row) with the same five layers,
taps and block, a vanilla rank-256 Markov head and the confidence head on [h ; W1[x]]; the
layer count and head sizes of its export are not published either.

How a kernel is priced (profiling/pricing.py; docs/performance.md): each launch's `Work`, built from
its op's own launch plan (dspark.ops.attention.launch_plan, the row-split plans of dspark.ops.argmax /
sampling, dspark.ops.linear.linear_plan and mma_plan, dspark.ops.gdn.scan_plan and scan_bytes, the
chunked gdn's, the norm, commit and select grids): per CTA its DRAM bytes, its L2 bytes, its mma.sync
(whole tiles), its f32 flops, its main loop's iterations and the units its shared-memory counts scale
by. `pricing.price` turns it into six limiters (dram, l2, smem, tensor, issue, latency), the floor
(the largest) and the expected time, from the code as compiled: residency from registers and shared
memory (`resident`: linear_f32's 126 registers hold it to 4 CTAs per SM; profiling/ptxas_report.md
lists every tile shape's count), instructions per loop iteration from the sm_90 cubin's SASS
(profiling/sass.py), the f32 mix from its PTX (`Compiled.flops_per_instruction`: -fmad=false keeps
a * b + c as two instructions), and shared-memory wavefronts, bank conflicts included, counted by
simt where the kernel runs (profiling/wavefronts.py -> wavefronts.json). A new kernel (FP8 GEMMs)
slots in by building its Work from its plan in the function that prices its op (`linear`,
`attention_kernels`, `prompt_gdn`, ...) and, if it has shared memory, a probe in wavefronts.py.
Kernel.time is the expected time; Kernel.floor and Kernel.limits the rest; every total the tables
print is given as floor and expected.

Host: each launch costs `Device.launch` of host time (the ops' host path timed by
profiling/launch_cost.py on the 2-core CPU machine, a RESULTS entry; the same assumed for a GPU
machine's host; --launch-us overrides it), dspark kernels from the plans and CuPy array ops from per-layer counts made on the
CuPy contract path (LAUNCH_GLUE), listed with the round's two synchronisations as "overhead".
Round time = GPU time + overhead (no overlap assumed). Speedup = mean accepted length x plain step
time / round time.

Device (pricing.Device): every constant names its source, a data sheet (H200 SXM: 4.8 TB/s HBM3e,
989 TFLOP/s bf16 dense, 132 SMs at 1.98 GHz, 228 KiB shared memory, 64 K registers, 2048 threads and
32 CTAs per SM, 50 MB L2) or "assumed" (the 4.3 TB/s copy bandwidth, 90 % of the data sheet's; the
790 TFLOP/s sustained wgmma rate, 80 % of it, and mma.sync at two thirds of that; the L2 bandwidth;
the latencies). No GPU has run this package: nothing here is measured on one. CuPy's elementwise ops
have no plan of ours: their bytes and flops are priced (`roofline`), their shared memory is not
counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import heapq
import json
import math
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts, also when run by `dspark bench`
from dspark.dtypes import BF16
from dspark.kernel_sources import kernel_files
from dspark.models.config import TrunkConfig, from_json
from dspark.models.drafter_config import DrafterConfig
from dspark.ops import argmax as argmax_ops
from dspark.ops import gdn as gdn_ops
from dspark.ops import gdn_chunk as chunk_ops
from dspark.ops import linear as linear_ops
from dspark.ops import norm as norm_ops
from dspark.ops import swiglu_linear as swiglu_ops
from dspark.ops import gate_linear as gate_ops
from dspark.ops import snapshot as snapshot_ops
from dspark.models.cache import cache_bytes
from dspark.ops.attention import PROMPT_ITEMS, TILE, launch_plan, prompt_acc_bytes
from dspark.ops.kv_commit import THREADS as COMMIT_THREADS
from dspark.ops.kv_commit import commit_bytes
from dspark.params import PROMPT_CHUNK
from pricing import (H200, LIMITERS, MMA_FLOPS, Compiled, Device, Priced, Work, compiled, compiled_kernels,  # noqa: F401
                     f32_mix, makespan, price, resident)
from timing import table

F32 = 4
STORAGE_SUFFIX = {4: "f32", 2: "bf16"}  # the models' weights: f32 (embedded pair) or bf16 as stored
MODES = ("plain", "eager", "graph")  # dspark.graphs: op by op, recorded passes issued by the host, CUDA graphs




# ---- shapes ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shape:
    label: str
    trunk: TrunkConfig
    drafter: DrafterConfig
    weight_bytes: int       # storage bytes per matrix element (2: bf16)
    source: str
    fp8: bool = False       # the trunk's decoder-layer linears block-scaled e4m3 (docs/models/fp8.md)
    routing: str = "uniform"  # MoE trunks: how many distinct experts a pass's rows route to (ROUTINGS)

    @property
    def weight_format(self) -> str:
        """The cost prior's weight format of the trunk (dspark.cost_prior.weight_format)."""
        return "fp8" if self.fp8 else ""

    def proj_bytes(self) -> int:
        """Bytes per element of the trunk's decoder-layer projections: 1 (FP8) or the storage's.
        The embedding, the LM head and Qwen3.5's gdn a|b stay 16-bit in the FP8 releases."""
        return 1 if self.fp8 else self.weight_bytes

    def drafter_bytes(self) -> int:
        """Bytes per element of the drafter's matrices on cuda (dspark.models.drafter.storage_dtype):
        the trunk's 16-bit type where it has one (FP8 trunks compute in bf16), else f32."""
        return 2 if self.weight_bytes == 2 else F32


def _default_configs() -> tuple[TrunkConfig, DrafterConfig]:
    d = Path(__file__).resolve().parents[1] / "dspark" / "models" / "default"
    return from_json(d / "trunk.json", TrunkConfig), from_json(d / "drafter.json", DrafterConfig)


def _drafter_for(t: TrunkConfig, window: int) -> DrafterConfig:
    return DrafterConfig(block=8, window=window, d_model=t.d_model, layers=1, heads=t.attn_heads,
                         kv_heads=t.attn_kv_heads, head_dim=t.head_dim, mlp_hidden=t.mlp_hidden, markov_rank=32)


DFLASH2_DRAFT_VOCAB = 32768   # the served DFlash2's trimmed vocabulary: assumed, not published
QWEN3_8_TAPS = (5, 19, 33, 47, 61)


def _qwen3_8_drafters(t: TrunkConfig) -> dict[str, DrafterConfig]:
    """DeepSpec's two drafters for Qwen3.8-27B (module doc): DFlash2 and DSpark."""
    common = dict(block=8, d_model=t.d_model, layers=5, mlp_hidden=17408, taps=QWEN3_8_TAPS, q_norm=True,
                  rope_theta=1e7, own_norm=True)
    return {
        "dflash2": DrafterConfig(**common, window=0, layer_windows=(2048,) * 5, window_mode="row", heads=32,
                                 kv_heads=8, head_dim=128, harvest="mask_fill", markov="selector", markov_rank=0,
                                 confidence="none", selector_rank=256, selector_top_k=16, conv_kernel=2, conv_group=16,
                                 draft_vocab=DFLASH2_DRAFT_VOCAB, own_head=True),
        "dspark": DrafterConfig(**common, window=0, heads=t.attn_heads, kv_heads=t.attn_kv_heads, head_dim=t.head_dim,
                                markov_rank=256),
    }


def shapes(drafter_window: int = 4096) -> dict[str, Shape]:
    trunk, drafter = _default_configs()
    q3 = TrunkConfig(vocab=151936, eos_id=151645, mask_id=151669, d_model=4096, mlp_hidden=12288, layers=("attn",) * 36,
                     attn_heads=32, attn_kv_heads=8, head_dim=128, rope_theta=1e6, qk_norm=True, tap_layers=(1, 17, 33),
                     max_ctx=40960, kv_dtype="bfloat16")
    q35 = TrunkConfig(vocab=248320, eos_id=248044, mask_id=248319, d_model=5120, mlp_hidden=17408,
                      layers=("gdn", "gdn", "gdn", "attn") * 16, attn_heads=24, attn_kv_heads=4, head_dim=256,
                      rope_theta=1e7, gdn_heads=48, gdn_k_heads=16, gdn_dk=128, gdn_dv=128, norm_offset=1.0,
                      qk_norm=True, attn_gate=True, rope_fraction=0.25, tap_layers=(1, 31, 61), max_ctx=262144,
                      kv_dtype="bfloat16")
    q35_moe = TrunkConfig(vocab=248320, eos_id=248044, mask_id=248319, d_model=2048, mlp_hidden=0,
                          layers=("gdn", "gdn", "gdn", "attn") * 10, attn_heads=16, attn_kv_heads=2, head_dim=256,
                          rope_theta=1e7, gdn_heads=32, gdn_k_heads=16, gdn_dk=128, gdn_dv=128, norm_offset=1.0,
                          qk_norm=True, attn_gate=True, rope_fraction=0.25, tap_layers=(1, 19, 37), max_ctx=262144,
                          kv_dtype="bfloat16", ffn=("moe",) * 40, experts=256, expert_top_k=8, expert_hidden=512,
                          shared_expert_hidden=512, expert_renorm=True)
    moe_drafter = dataclasses.replace(_drafter_for(q35_moe, drafter_window), mlp_hidden=MOE_DRAFTER_MLP)
    return {
        "embedded": Shape("embedded pair", trunk, drafter, 4, "dspark/models/default/{trunk,drafter}.json"),
        "qwen3-8b": Shape("Qwen3-8B", q3, _drafter_for(q3, drafter_window), 2, "Qwen/Qwen3-8B config.json"),
        "qwen3.5-27b": Shape("Qwen3.5-27B", q35, _drafter_for(q35, drafter_window), 2,
                             "Qwen/Qwen3.5-27B config.json (text_config)"),
        **{f"qwen3.8-27b-{name}": Shape(f"Qwen3.8-27B + {label}", q35, dc, 2, source)
           for (name, dc), (label, source) in zip(_qwen3_8_drafters(q35).items(), QWEN3_8_SOURCES)},
        # The FP8 releases (block-scaled e4m3, docs/models/fp8.md): the same configs, the decoder-layer
        # linears at 1 byte plus a scale per 128 x 128 block; the embedding, LM head and gdn a|b 16-bit.
        "qwen3.5-27b-fp8": Shape("Qwen3.5-27B-FP8", q35, _drafter_for(q35, drafter_window), 2,
                                 "Qwen/Qwen3.5-27B-FP8 (the text_config above, quantization_config fp8 e4m3 128x128)",
                                 fp8=True),
        **{f"qwen3.8-27b-fp8-{name}": Shape(f"Qwen3.8-27B-FP8 + {label}", q35, dc, 2, f"{source}; FP8 target", fp8=True)
           for (name, dc), (label, source) in zip(_qwen3_8_drafters(q35).items(), QWEN3_8_SOURCES)},
        "qwen3.5-35b-a3b": Shape("Qwen3.5-35B-A3B", q35_moe, moe_drafter, 2,
                                 "Qwen/Qwen3.5-35B-A3B config.json (text_config; drafter MLP assumed)"),
        # Its FP8 release: the experts, the shared expert and the attention / gdn linears e4m3 + 128 x 128
        # scales (moe_linear_fp8_bf16_m<BM>, linear_fp8_bf16_m<BM>); the router, the shared expert's gate,
        # gdn a|b, the embedding and the LM head 16-bit (the FP8 releases' modules_to_not_convert: assumed
        # for this one, whose config is not in this repository).
        "qwen3.5-35b-a3b-fp8": Shape("Qwen3.5-35B-A3B-FP8", q35_moe, moe_drafter, 2,
                                     "Qwen/Qwen3.5-35B-A3B-FP8 (the text_config above, quantization_config fp8 e4m3 "
                                     "128x128; drafter MLP assumed)", fp8=True),
    }


MOE_DRAFTER_MLP = 6144  # the one-layer model drafter's MLP on a MoE target (3 x d_model): assumed


QWEN3_8_SOURCES = (("DFlash2", "DeepSpec dflash2/qwen3_8/config.py (draft vocabulary assumed)"),
                   ("DSpark", "DeepSpec dspark/qwen3_8/config.py (layers and Markov head assumed)"))


# ---- kernels -----------------------------------------------------------------------------------------------
KINDS = ("weights", "kv", "state", "other")


@dataclasses.dataclass
class Kernel:
    """One kernel (or a CuPy op) of a pass: what it moves and computes, its CTAs, and its time."""
    phase: str
    name: str
    kind: str               # weights | kv | state | other: the round composition it counts towards
    bytes: int
    flops: int
    ctas: int
    waves: int
    time: float
    launches: int
    min_bytes: int = 0      # what any implementation must move (attention: K/V, q, out once)
    entry: str = ""         # the entry point launched ("" for CuPy's own kernels)
    f32_instr: float = 0.0  # f32 lane-instructions issued: flops / flops per instruction as compiled
    mma_flops: float = 0.0  # flops on the tensor cores
    per_sm: int = 0         # CTAs resident per SM
    limits: dict = dataclasses.field(default_factory=dict)  # limiter -> seconds alone (pricing.LIMITERS)
    wavefronts: float = 0.0           # shared-memory wavefronts, bank conflicts included
    ideal_wavefronts: float = 0.0     # without bank conflicts
    smem_counted: bool = True         # the entry's shared-memory accesses were counted by simt

    @property
    def floor(self) -> float:
        """The largest single limiter: what the kernel can never beat."""
        return max(self.limits.values()) if self.limits else self.time

    @property
    def bound(self) -> str:
        return max(self.limits, key=self.limits.get) if self.limits else "-"

    def bandwidth_bound(self, dev: "Device") -> float:
        return self.bytes / dev.bw

    def issue_bound(self, dev: "Device") -> float:
        return max(self.f32_instr / dev.f32_issue, self.mma_flops / dev.mma_sync)


def kernel_of(phase, name, kind, work: Work, dev: Device, *, flops, mma_flops=0.0, launches=1, min_bytes=0,
              executed: float | None = None) -> Kernel:
    """A dspark kernel priced from its launch's Work (pricing.price): its time is the expected one.
    `mma_flops`: the launch's tensor-core flops; `executed`: those its MMAs run, padding included
    (attention's m-tiles of 16 items; default mma_flops). The Work's per-CTA MMAs must add up to
    `executed`, which the tensor limiter prices: a per-CTA count off by the grid's other dimension
    (a head count, say) fails here, not in a figure."""
    executed = mma_flops if executed is None else executed
    counted = float(np.sum(np.broadcast_to(np.asarray(work.mma, np.float64), (np.size(work.dram),)))) * MMA_FLOPS
    if not (math.isclose(counted, executed, rel_tol=1e-6, abs_tol=1.0) and executed >= mma_flops * (1 - 1e-9)):
        raise ValueError(f"{name}: the CTAs' MMAs add up to {counted:.4g} flops; the launch executes {executed:.4g}, "
                         f"of which {mma_flops:.4g} its own")
    p = price(work, dev)
    return Kernel(phase, name, kind, int(np.sum(work.dram)), int(flops), int(np.size(work.dram)), p.waves, p.expected,
                  launches, min_bytes, work.entry, p.f32_instr, float(mma_flops), p.per_sm, p.limits, p.wavefronts,
                  p.ideal_wavefronts, p.smem_counted)


def planned(phase, name, kind, cta_bytes, flops, threads, smem, dev, entry: str, *, mma=False, launches=1,
            min_bytes=0, units=None, iterations=0.0, l2=None) -> Kernel:
    """A dspark kernel from its plan (CTAs' DRAM bytes, flops, threads, dynamic shared memory;
    optionally its L2 bytes per CTA, main-loop iterations per CTA and the units its shared-memory
    counts scale by) and its entry point as compiled; `mma`: its flops are the MMAs' (whole tiles),
    else f32 flops on CUDA cores."""
    cta_bytes = np.asarray(cta_bytes, np.float64).ravel()
    ctas = max(cta_bytes.size, 1)
    units = {"cta": 1.0, "byte": cta_bytes, **(units or {})}
    work = Work(entry, threads, smem, cta_bytes, l2=l2, mma=flops / MMA_FLOPS / ctas if mma else 0.0,
                f32_flops=0.0 if mma else flops / ctas, iterations=iterations, units=units)
    return kernel_of(phase, name, kind, work, dev, flops=flops, mma_flops=flops if mma else 0.0, launches=launches,
                     min_bytes=min_bytes)


def roofline(phase, name, kind, nbytes, flops, dev, launches=1) -> Kernel:
    """A CuPy array op (no plan of ours): its bytes at the copy bandwidth and its flops at one per
    f32 instruction (CuPy's elementwise code contracts nothing we can see); expected: the larger,
    plus a DRAM round trip (its launch's first loads wait for it)."""
    limits = {"dram": nbytes / dev.bw, "l2": 0.0, "smem": 0.0, "tensor": 0.0, "issue": flops / dev.f32_issue,
              "latency": dev.dram_latency}
    t = max(limits["dram"], limits["issue"]) + dev.dram_latency
    return Kernel(phase, name, kind, int(nbytes), int(flops), 0, 0, t, launches, f32_instr=float(flops), limits=limits,
                  smem_counted=False)


def even(total: float, ctas: int) -> np.ndarray:
    return np.full(max(ctas, 0), total / max(ctas, 1))


# ---- GEMMs (dspark.ops.linear) ---------------------------------------------------------------------------
def linear(phase, name, rows, k, n, wb, dev, kind="weights", swiglu: bool = False, gate=None) -> list[Kernel]:
    """The GEMM of [rows, K] @ [K, N] stored with wb bytes per element, from its launch plan
    (dspark.ops.linear.linear_plan), one launch. f32 weights: linear_f32, the weights once per
    16-row tile, the K-split partials written and read back by the last CTA of each column tile,
    f32 instructions as compiled. 16-bit weights: linear_mma_bf16_m<BM> (mma_plan's tile shape),
    its MMAs' executed flops (whole tiles) at the mma.sync ceiling; a few rows (split mode) move the
    weights once per row tile, the partials, and x once (L2 keeps it for the other column tiles),
    each CTA at its slot's share;
    a prompt (fold mode, `prompt_gemm`) reads each wave's tiles from DRAM once. FP8 weights (wb 1):
    linear_fp8_bf16_m<BM>, the same tiles and modes (fp8_plan: its K chunk a multiple of the
    128-row scale block), the weights at 1 byte each plus 4 per scale (fp8_linear_plan), priced
    as compiled (its registers, its SASS loop: the in-register decode is in it).
    `swiglu`: an MLP's down product over its gate|up product (dspark.ops.swiglu_linear): 16-bit and FP8
    weights take the SwiGLU into the activation stage (linear_mma_bf16_swiglu_<shape>,
    linear_fp8_bf16_swiglu_<shape>: both halves read, twice the x bytes) or a 16-bit prompt's rounding
    (round_swiglu_bf16: gate|up read, the bf16 activations written); elsewhere (f32 weights, the wide f32
    tile, FP8 at 64 rows) swiglu_f32 runs before the product.
    `gate`: (o's bytes an element, gated, head_dim) of an attention's output projection over its output o
    (dspark.ops.gate_linear): 16-bit weights over o of their type take o's widening and its gate into the
    stage (linear_mma_bf16_gated_<shape>: o and its gates read for x) or a prompt's rounding
    (round_gate_bf16: o and its gates read, the bf16 activations written); elsewhere attn_gate_<t> runs
    first."""
    if gate is not None and not (wb == 2 and gate[0] == 2
                                 and gate_ops.fusion(linear_ops.mma_plan(rows, k, n), k, gate[2])):
        return [attn_gate_kernel(phase, rows, k, gate[0], gate[1], dev)] + linear(phase, name, rows, k, n, wb, dev, kind)
    how = swiglu and wb in (1, 2) and swiglu_ops.fusion(
        (linear_ops.fp8_plan if wb == 1 else linear_ops.mma_plan)(rows, k, n), k, fp8=wb == 1)
    if swiglu and not how:
        return [swiglu_kernel(phase, rows, k, dev)] + linear(phase, name, rows, k, n, wb, dev, kind)
    # bytes of x read per product input: f32; gate and up where the stage takes SwiGLU; o and its gate
    xb = 2 * F32 if how else gate[0] + (F32 if gate[1] else 0) if gate else F32
    if wb in (1, 2):   # 1: FP8 (e4m3 and a scale per 128 x 128 block), bf16 activations: linear_fp8_bf16_m<BM>
        if wb == 1:
            p, plan = linear_ops.fp8_plan(rows, k, n), linear_ops.fp8_linear_plan(rows, k, n)
            entry = f"linear_fp8_bf16_{'swiglu_' if how else ''}{p.shape}"
        else:
            p, plan = linear_ops.mma_plan(rows, k, n), linear_ops.mma_linear_plan(rows, k, n)
            entry = f"linear_mma_bf16_{'swiglu_' if how == 'stage' else 'gated_' if gate else ''}{p.shape}"
        if p.grid_splits == 1 and p.m_tiles > 1:
            if wb == 2 and linear_ops.a16(p, k):   # the activations rounded once, the tiles copy them as bf16
                rounding = (elementwise(phase, f"{name} SwiGLU to bf16", "round_swiglu_bf16", -(-rows * k // 4),
                                        10 * rows * k, 5 * rows * k, dev, linear_ops.ROUND_THREADS) if how else
                            elementwise(phase, f"{name} gate to bf16", "round_gate_bf16", -(-rows * k // 4),
                                        (4 + (F32 if gate[1] else 0)) * rows * k, (4 if gate[1] else 0) * rows * k,
                                        dev, linear_ops.ROUND_THREADS) if gate else
                            elementwise(phase, f"{name} x to bf16", "round_activations_bf16", -(-rows * k // 4),
                                        6 * rows * k, rows * k, dev, linear_ops.ROUND_THREADS))
                return [dataclasses.replace(rounding, kind=kind),
                        prompt_gemm(phase, name, kind, p, plan, rows, k, n, f"linear_mma_bf16_a16_{p.shape}", dev, wb,
                                    x_bytes=2)]
            return [prompt_gemm(phase, name, kind, p, plan, rows, k, n, entry, dev, wb, x_bytes=xb)]
        # x ([rows, K] f32, at most 128 x 17408 x 4 = 8.9 MB; twice that as gate|up) stays in L2 across the
        # column tiles: DRAM sees it once, not once per column tile as the plan's bytes (what the CTAs
        # load, through L2) count it
        loaded = plan.bytes + (xb - F32) * p.n_tiles * rows * k
        dram = loaded - (p.n_tiles - 1) * xb * rows * k
        iters = -(-min(p.kchunk, k) // p.bk)
        work = Work(entry, p.threads, p.shared_mem, even(dram, p.ctas), l2=even(loaded, p.ctas),
                    mma=plan.notes["mma_flops"] / MMA_FLOPS / p.ctas, iterations=iters,
                    units={"cta": 1.0, "iteration": float(iters)})
        return [kernel_of(phase, name, kind, work, dev, flops=plan.notes["mma_flops"],
                          mma_flops=plan.notes["mma_flops"], min_bytes=plan.min_bytes + (xb - F32) * rows * k)]
    p = linear_ops.linear_plan(rows, k, n, wb)
    (run,) = p.launches
    # the plan's shared memory is the kernel's static array (launched with none dynamic): compiled() has it
    return [planned(phase, name, kind, even(p.bytes, run.ctas), p.notes["flops"], run.threads, 0, dev,
                    f"linear_{STORAGE_SUFFIX[wb]}", min_bytes=p.min_bytes)]


def prompt_gemm(phase, name, kind, p, plan, rows, k, n, entry, dev: Device, wb: int = 2, x_bytes: int = 4) -> Kernel:
    """A tensor-core GEMM in fold mode (many rows): every CTA walks all of K (ceil(K / BK) iterations)
    and loads its row tile of x (f32, or bf16 rounded beforehand: x_bytes) and its column tile of the
    weights (wb bytes each; FP8: with the scales of its blocks) through L2; DRAM: each wave reads its
    group of kMmaGroupRows row tiles of x and the weight columns of its CTAs once (L2 keeps them while
    it runs), and the output is written."""
    code = compiled(entry, dev)
    per_sm = resident(p.threads, p.shared_mem + code.static_smem, code.registers, dev)
    slots = dev.sms * per_sm
    waves = -(-p.ctas // slots)
    group = min(linear_ops.MMA_GROUP_ROWS, p.m_tiles)
    col_bytes = p.bn * k * wb + (4 * -(-k // linear_ops.FP8_BLOCK) * -(-p.bn // linear_ops.FP8_BLOCK) if wb == 1 else 0)
    dram = waves * (group * p.bm * k * x_bytes + min(p.n_tiles, -(-slots // group)) * col_bytes) + rows * n * 4
    flops = plan.notes["mma_flops"]
    iters = -(-k // p.bk)
    work = Work(entry, p.threads, p.shared_mem, even(dram, p.ctas),
                l2=np.full(p.ctas, float(p.bm * k * x_bytes + col_bytes + p.bm * p.bn * 4)), mma=flops / MMA_FLOPS / p.ctas,
                iterations=iters, units={"cta": 1.0, "iteration": float(iters)})
    return kernel_of(phase, name, kind, work, dev, flops=flops, mma_flops=flops, min_bytes=plan.min_bytes)


# ---- the trunk pass ---------------------------------------------------------------------------------------
def kv_itemsize(c: TrunkConfig) -> int:
    return np.dtype(BF16 if c.kv_dtype == "bfloat16" else c.kv_dtype).itemsize


def layers(shape: Shape, ph: str, rows: int, dev: Device, attention, gdn) -> list[Kernel]:
    """The embedding and its norm, then each layer as dspark.models.trunk.run_pass issues it: its
    products (linear), the q/k norm + RoPE between them, the output gate and SwiGLU inside the products
    that take them (linear's `gate` and `swiglu`: their own kernels where those do not), the residual
    add + next RMSNorm twice; the mixer's own kernels from `attention()` (the
    attention kernels) and `gdn()` (between the gdn's two products)."""
    c, wb, pb, out = shape.trunk, shape.weight_bytes, shape.proj_bytes(), []
    d, kv_isz = c.d_model, kv_itemsize(c)
    nq = c.attn_heads * c.head_dim * (2 if c.attn_gate else 1)
    nkv = c.attn_kv_heads * c.head_dim
    H, dv, C = c.gdn_heads, c.gdn_dv, c.gdn_channels
    taps = len(c.tap_layers)
    out.append(row_norm(ph, "embedding + norm", f"embed_rmsnorm_{STORAGE_SUFFIX[wb]}", rows, d, dev,
                        reads=wb / F32, writes=2 + (1 if -1 in c.tap_layers else 0)))
    pairs = list(zip(c.layers, c.ffn_kinds))
    for kind, ffn in (("attn", "mlp"), ("attn", "moe"), ("gdn", "mlp"), ("gdn", "moe")):
        count = pairs.count((kind, ffn))
        if not count:
            continue
        if kind == "attn":
            layer = linear(ph, "attn q|k|v", rows, d, nq + 2 * nkv, pb, dev)
            layer.append(qk_prepare_kernel(ph, rows, c.attn_heads, c.attn_kv_heads, c.head_dim, nq + 2 * nkv,
                                           c.rope_dim, kv_isz, dev, q_norm=c.qk_norm, k_norm=c.qk_norm))
            layer += attention()
            layer += linear(ph, "attn o", rows, c.attn_heads * c.head_dim, d, pb, dev,
                            gate=(kv_isz, c.attn_gate, c.head_dim) if c.attn_gate or kv_isz != F32 else None)
        else:
            layer = gdn_in(ph, rows, d, C + H * dv, 2 * H, shape, dev)
            layer += gdn()
            layer += linear(ph, "gdn out", rows, H * dv, d, pb, dev)
        layer.append(row_norm(ph, "residual + norm", "add_rmsnorm_f32", rows, d, dev, reads=2, writes=2))
        if ffn == "moe":
            layer += moe_kernels(shape, ph, rows, dev)
        else:
            layer += linear(ph, "mlp gate|up", rows, d, 2 * c.mlp_hidden, pb, dev)
            layer += linear(ph, "mlp down", rows, c.mlp_hidden, d, pb, dev, swiglu=True)
        layer.append(row_norm(ph, "residual + norm", "add_rmsnorm_f32", rows, d, dev, reads=2,
                              writes=2 + taps / len(c.layers)))
        out += scaled(layer, count, f"x{count} {kind}{' moe' if ffn == 'moe' else ''} layers")
    return out


# How many distinct experts the rows of a pass route to, per MoE layer: named models, each with its source.
def _uniform(rows: int, experts: int, k: int) -> float:
    return experts * (1.0 - (1.0 - k / experts) ** rows)


def _published(rows: int, experts: int, k: int) -> float:
    alpha = math.log(PUBLISHED_DISTINCT_AT_8 / 8) / math.log(8)   # k n^alpha through (1, k) and (8, 39.4)
    return k * rows ** alpha   # distinct_experts caps it


PUBLISHED_DISTINCT_AT_8 = 39.4   # a 256-expert top-8 model: 8 verify rows read about 39.4 experts (the MoE plan)
ROUTINGS = {
    "uniform": (_uniform, "each row's top-k uniform over the experts, rows independent"),
    "published": (_published, "k n^a through the published 39.4 distinct experts at 8 rows (256 experts, top-8, "
                              "as quoted in the MoE plan)"),
}


def distinct_experts(shape: Shape, rows: int) -> int:
    """Distinct experts `rows` routed rows read in one MoE layer under the shape's routing model
    (at least top-k, at most the rows' entries and the experts)."""
    c = shape.trunk
    d = ROUTINGS[shape.routing][0](rows, c.experts, c.expert_top_k)
    return int(min(c.experts, rows * c.expert_top_k, max(c.expert_top_k, round(d))))


def synthetic_routing(rows: int, k: int, distinct: int) -> np.ndarray:
    """Routed ids [rows, k] with exactly `distinct` experts (>= k), spread evenly: row r takes
    experts (r k + j) mod distinct, each row's k apart."""
    return ((np.arange(rows)[:, None] * k + np.arange(k)[None, :]) % distinct).astype(np.int32)


def grouped_iterations(plan, ctas: list[dict]) -> np.ndarray:
    """K steps (the tile shape's BK) each working CTA of a grouped product walks: all of K, or its chunk."""
    bk = linear_ops.MMA_CONFIGS[plan.tile_rows][1]
    return np.array([-(-(plan.K if plan.grid_splits == 1 else min(plan.kchunk, plan.K - c["split"] * plan.kchunk))
                       // bk) for c in ctas], np.float64)


def grouped_kernel(ph, name, rows, K, N, shape: Shape, dev: Device, *, gather: bool, swiglu: bool = False) -> Kernel:
    """One grouped expert product (dspark.ops.moe.grouped_linear, moe_linear_mma_bf16_m<BM>; FP8
    experts moe_linear_fp8_bf16_m<BM>, linear_fp8's K chunk; `swiglu`: the down product over the
    gate|up rows, moe_linear_<kind>_bf16_swiglu_m<BM>, both halves read) over the rows' P = rows k entries: the
    plan's CTA map for a routing of distinct_experts experts, each CTA's DRAM bytes its expert's
    weights of its K chunk and column tile (read once a launch for all of that expert's rows in the
    tile; FP8: a byte each and the f32 scales of its blocks) and its rows of x, its MMAs over whole
    tiles (its flops, as the dense GEMM's are counted), priced as compiled (FP8: the in-register
    decode in its SASS loop, as linear_fp8's); K-split partials written and read back. min_bytes:
    the distinct experts' weights once, x, out."""
    from dspark.ops import moe as moe_ops
    c = shape.trunk
    k, E = c.expert_top_k, c.experts
    plan = moe_ops.grouped_plan(rows, k, E, K, N, shape.proj_bytes())
    g = moe_ops.group_ref(synthetic_routing(rows, k, distinct_experts(shape, rows)), E, plan.tile_rows)
    ctas = plan.ctas(g)
    part = 2 * 4 * plan.tile_rows if plan.grid_splits > 1 else 0
    halves = 2 if swiglu else 1
    dram = np.array([cta["w_bytes"] + halves * cta["x_bytes"] + cta["rows"] * min(plan.cols, N) * 4
                     + part * min(plan.cols, N) for cta in ctas], np.float64)
    iters = grouped_iterations(plan, ctas)
    mma_flops = 2.0 * plan.tile_rows * plan.cols * linear_ops.MMA_CONFIGS[plan.tile_rows][1] * iters
    work = Work(plan.entry_of(swiglu), plan.threads, plan.shared_mem, dram, mma=mma_flops / MMA_FLOPS, iterations=iters,
                units={"cta": 1.0, "iteration": iters})
    P = rows * k
    w_once = sum(plan.expert_bytes(g).values())
    return kernel_of(ph, f"{name} ({g.distinct} experts)", "weights", work, dev, flops=float(mma_flops.sum()),
                     mma_flops=float(mma_flops.sum()),
                     min_bytes=w_once + 4 * halves * (rows if gather else P) * K + 4 * P * N)


def moe_kernels(shape: Shape, ph, rows, dev: Device) -> list[Kernel]:
    """A sparse MoE FFN as dspark.models.moe.moe_ffn issues it: the router (and the shared expert's
    gate) as one GEMM, moe_route_f32 (a warp per row: the logits read, ids, weights and the grouping
    written), the grouped gate|up product over the rows' experts, the grouped down product with the
    SwiGLU in its 16-row stage (f32 experts and a prompt's 128-row tiles: swiglu_f32 over the grouped
    rows, then the product), the shared
    expert (gate|up, then down with SwiGLU inside), and moe_combine_f32. In an FP8 trunk the experts and
    the shared expert are e4m3 (proj_bytes), the router and its gate 16-bit."""
    from dspark.ops import moe as moe_ops
    c, wb, pb = shape.trunk, shape.weight_bytes, shape.proj_bytes()
    d, E, k, I, Is = c.d_model, c.experts, c.expert_top_k, c.expert_hidden, c.shared_expert_hidden
    P = rows * k
    out = linear(ph, "moe router" + (" | shared gate" if Is else ""), rows, d, E + (1 if Is else 0), wb, dev)
    out.append(planned(ph, "moe route", "other", even(F32 * (rows * E + 4 * P), -(-rows // moe_ops.ROUTE_WARPS)),
                       6 * rows * E, moe_ops.ROUTE_THREADS, 0, dev, "moe_route_f32"))
    out.append(grouped_kernel(ph, "moe experts gate|up", rows, d, 2 * I, shape, dev, gather=True))
    fused = moe_ops.swiglu_fused(moe_ops.grouped_plan(rows, k, E, I, d, shape.proj_bytes()).tile_rows, shape.proj_bytes())
    if not fused:
        out.append(swiglu_kernel(ph, P, I, dev))
    out.append(grouped_kernel(ph, "moe experts down", rows, I, d, shape, dev, gather=False, swiglu=fused))
    if Is:
        out += linear(ph, "moe shared gate|up", rows, d, 2 * Is, pb, dev)
        out += linear(ph, "moe shared down", rows, Is, d, pb, dev, swiglu=True)
    out.append(elementwise(ph, "moe combine", "moe_combine_f32", rows * d,
                           F32 * (P * d + 2 * P + rows * d * (3 if Is else 1)), 2 * P * d, dev,
                           threads=moe_ops.COMBINE_THREADS))
    return out


def gdn_in(ph, rows, d, qkvz: int, ab: int, shape: Shape, dev: Device) -> list[Kernel]:
    """The gdn input projection [d, qkvz + ab]: one GEMM; in an FP8 trunk two runs of columns
    (dspark.ops.linear.ColumnRuns: q|k|v|z in e4m3, a|b left 16-bit), each its GEMM into scratch
    and a linear_place_columns launch placing it (a thread per element, read and written)."""
    if not shape.fp8:
        return linear(ph, "gdn in", rows, d, qkvz + ab, shape.weight_bytes, dev)
    out = linear(ph, "gdn in q|k|v|z (fp8)", rows, d, qkvz, 1, dev)
    out += linear(ph, "gdn in a|b (16-bit)", rows, d, ab, shape.weight_bytes, dev)
    out += [elementwise(ph, "gdn in runs placed", "linear_place_columns", rows * w, 2 * F32 * rows * w, 0, dev)
            for w in (qkvz, ab)]
    return out


def trunk_pass(shape: Shape, B: int, context: int, cols: int, dev: Device, *, verify: bool,
               rollback="checkpoint", reach: int | None = None) -> list[Kernel]:
    """Every kernel of one trunk pass over `cols` columns per session at `context` committed rows:
    a verify (the state read, not written; per-column checkpoints) or a plain decode step (cols 1,
    state written, K/V committed): `layers` with the attention's plan and the gdn conv + scan +
    gated norm in one kernel, the LM head and the accept or argmax. `reach`: the attention grid
    sized for a recorded pass's horizon (dspark.graphs)."""
    c, wb = shape.trunk, shape.weight_bytes
    ph = "verify" if verify else "decode"
    rows, d, kv_isz = B * cols, c.d_model, kv_itemsize(c)
    attn_layers = c.layers.count("attn")

    def attention():
        plan = launch_plan([cols] * B, [context] * B, hq=c.attn_heads, hkv=c.attn_kv_heads, head_dim=c.head_dim,
                           dtype=BF16 if kv_isz == 2 else np.float32, reach=reach)
        return attention_kernels(ph, plan, dev)

    def gdn():
        return scan_kernels(ph, c, B, rows, dev, checkpoints=verify and rollback == "checkpoint", commit=not verify)
    out = layers(shape, ph, rows, dev, attention, gdn)
    out += linear(ph, "lm head", rows, d, c.vocab, wb, dev)
    if verify:
        p = argmax_ops.greedy_accept_plan(B, rows, c.vocab)
    else:
        p = argmax_ops.argmax_plan(rows, c.vocab)
    out.append(rowsplit_kernel(ph, p, dev))
    keep = rows if not verify else B * cols  # a full accept commits every column (the worst case)
    if attn_layers:
        out.append(commit_kernel("commit" if verify else ph, "kv_commit", B, attn_layers, keep // B,
                                 c.attn_kv_heads * c.head_dim * kv_isz, dev))
    return out


def row_norm(phase, name, entry, rows, n, dev: Device, *, reads: float, writes: float) -> Kernel:
    """A row step of csrc/norm.cu (add_rmsnorm_f32, embed_rmsnorm_<dt>) over `rows` rows of n: the new
    x from `reads` rows of n f32 (a 16-bit embedding row counts half) and `writes` rows written (x,
    the norm, a tap's share). Grid (rows, norm.row_chunks(n)): each CTA its chunk's bytes, every load
    in flight at once (one DRAM round trip); the row's last CTA also reads the row back from L2
    (staged for the sum, a piece of ROW_PIECE at a time, and read again for the norm where the row
    is more than one piece), the weight from L2, and writes the norm, after a chain: the ticket's
    and its pieces' L2 round trips, and warp 0's n / 32 dependent adds."""
    chunks = norm_ops.row_chunks(n)
    cols = np.minimum(norm_ops.ROW_CHUNK, n - norm_ops.ROW_CHUNK * np.arange(chunks))
    cta = np.tile(F32 * cols * (reads + writes - 1), rows)       # the add: all but the norm's write
    tail = np.zeros((rows, chunks))
    tail[:, -1] = 1.0                                           # one CTA a row (which one arrives last is moot)
    tail = tail.ravel()
    dram = cta + tail * F32 * n
    dram[-1] += F32 * n                                         # the weight, from DRAM once
    pieces = -(-n // norm_ops.ROW_PIECE)
    trips = 1 + pieces * (1 if pieces == 1 else 2)                # the ticket; the pieces staged (and reread)
    l2 = dram + tail * F32 * n * (3 if pieces > 1 else 2)
    chain = tail * (trips * dev.l2_latency + -(-n // 32) * FMA_LATENCY / dev.clock)
    work = Work(entry, norm_ops.ROW_THREADS, 0, dram, l2=l2, f32_flops=tail * 3.0 * n, chain=chain)
    return kernel_of(phase, name, "other", work, dev, flops=3 * rows * n)


def rmsnorm_kernel(phase, name, rows, n, dev: Device, launches=1) -> Kernel:
    """rmsnorm_f32 over `rows` rows of n (in `launches` calls): a warp a row, its bytes and flops."""
    k = planned(phase, name, "other", even(F32 * rows * n * 2 + launches * F32 * n, rows), 3 * rows * n,
                32 * norm_ops.WARPS, 0, dev, "rmsnorm_f32")
    k.launches = launches
    return k


def gated_norm_kernel(phase, name, tokens, heads, n, dev: Device) -> Kernel:
    """rmsnorm_gated_f32 over tokens x heads rows of n (dspark.ops.norm.rmsnorm_gated): a warp a row,
    o and its gates read (the gates where the projection holds them), the output written; the norm's 3
    flops an entry and SiLU's gate (an exp, an add, a division, two products)."""
    rows = tokens * heads
    return planned(phase, name, "other", even(F32 * rows * n * 3 + F32 * n, rows), 8 * rows * n,
                   32 * norm_ops.WARPS, 0, dev, "rmsnorm_gated_f32")


def elementwise(phase, name, entry, outputs: int, nbytes: float, flops: float, dev: Device, threads=256) -> Kernel:
    """A kernel of one thread per output (csrc/activation.cu, csrc/heads.cu)."""
    return planned(phase, name, "other", even(nbytes, -(-outputs // threads)), flops, threads, 0, dev, entry)


def swiglu_kernel(phase, rows, F, dev: Device) -> Kernel:
    """swiglu_f32: gate and up read, SiLU(gate) * up written; exp, a division and three products
    per output."""
    return elementwise(phase, "swiglu", "swiglu_f32", rows * F, F32 * 3 * rows * F, 5 * rows * F, dev)


def attn_gate_kernel(phase, rows, width, isz, gated: bool, dev: Device) -> Kernel:
    """attn_gate_<dt>: the attention output widened (and gated: the gate read, a sigmoid)."""
    return elementwise(phase, "attention output gate" if gated else "attention output widened",
                       f"attn_gate_{STORAGE_SUFFIX[isz]}", rows * width,
                       rows * width * (isz + F32 + (F32 if gated else 0)), (4 if gated else 0) * rows * width, dev)


def qk_prepare_kernel(phase, rows, hq, hkv, D, width, rot, isz, dev: Device, *, q_norm: bool, k_norm: bool,
                      with_q: bool = True) -> Kernel:
    """qk_prepare_<dt>: a warp per (row, head): the heads read from the projection, q and k normed
    and rotated, every head written in the K/V dtype; grid (rows, ceil(heads / 8))."""
    heads = (hq if with_q else 0) + 2 * hkv
    normed = ((hq if q_norm and with_q else 0) + (hkv if k_norm else 0)) * D
    rotated = ((hq if with_q else 0) + hkv) * rot
    nbytes = rows * (heads * D * F32 + heads * D * isz)
    flops = rows * (3 * normed + 3 * rotated)
    return planned(phase, "q/k norm + rope", "other", even(nbytes, rows * -(-(hq + 2 * hkv) // 8)), flops, 256, 0,
                   dev, f"qk_prepare_{STORAGE_SUFFIX[isz]}")


def scaled(kernels: list[Kernel], n: int, suffix: str) -> list[Kernel]:
    """The kernels of one layer, for n layers alike: bytes, flops, limiters, time and launches times n."""
    return [dataclasses.replace(k, name=f"{k.name} ({suffix})", bytes=k.bytes * n, flops=k.flops * n, time=k.time * n,
                                launches=k.launches * n, min_bytes=k.min_bytes * n, f32_instr=k.f32_instr * n,
                                mma_flops=k.mma_flops * n, limits={lim: v * n for lim, v in k.limits.items()},
                                wavefronts=k.wavefronts * n, ideal_wavefronts=k.ideal_wavefronts * n) for k in kernels]


def attention_units(plan) -> dict[str, np.ndarray]:
    """Per working CTA of an attention plan, the units its shared-memory counts scale by: key tiles
    walked; splits ended (merged into its running result, or written as partials): a
    split-parallel CTA ends one, a serial or prompt CTA every split of its keys, counted from
    position 0 (exact in causal mode; the block modes' CTAs start later: an upper bound there); and
    key tiles times the m-tiles of 16 items its MMAs run (a decode's few items take one)."""
    keys = np.maximum(plan.cta_keys, 1)
    merges = np.ones(keys.size) if plan.slots else plan.split.index(keys - 1) + 1.0
    tiles = -(-keys // TILE).astype(np.float64)
    isz = 4 if plan.kernel.startswith("attention_f32") else 2
    items = plan.bytes["q"] / (plan.head_dim * isz) / max(plan.ctas, 1)   # (row, head) pairs a CTA holds, mean
    return {"cta": 1.0, "tile": tiles, "merge": np.asarray(merges, np.float64),
            "mtile": tiles * max(1, -(-int(round(items)) // 16))}


def attention_kernels(phase, plan, dev: Device) -> list[Kernel]:
    """The attention op's launches from its plan: the split kernel (each CTA its keys' K and V,
    its items' q, its partials or output; its key tiles the main loop's iterations; 16-bit K/V:
    the MMAs of whole m-tiles of 16 items per tile, f32: the flops on CUDA cores) and, when it
    splits, the combine (partials from L2 while they fit, the output to memory)."""
    isz = 2 if "bf16" in plan.kernel or "f16" in plan.kernel else 4
    kv = plan.cta_keys * 2 * plan.head_dim * isz
    rest = plan.bytes["q"] + (plan.bytes["partials_written"] if plan.combine_kernel else plan.bytes["out"])
    cta = kv + rest / max(plan.ctas, 1)
    min_bytes = plan.bytes["kv"] + plan.bytes["q"] + plan.bytes["out"]
    units = attention_units(plan)
    per_cta = plan.flops / max(plan.ctas, 1)
    if isz == 2:  # each tile's MMAs run whole m-tiles of 16 items (CTAs of fewer items pad them)
        items = max(1.0, plan.bytes["q"] / (plan.head_dim * isz) / max(plan.ctas, 1))  # (row, head) pairs a CTA holds
        mma = per_cta * (16 * -(-items // 16) / items) / MMA_FLOPS
        work = Work(plan.kernel, plan.block[0], plan.shared_mem, cta, mma=mma, iterations=units["tile"], units=units)
        main = kernel_of(phase, plan.kernel, "kv", work, dev, flops=plan.flops, mma_flops=plan.flops,
                         min_bytes=min_bytes, executed=mma * MMA_FLOPS * plan.ctas)
    else:
        work = Work(plan.kernel, plan.block[0], plan.shared_mem, cta, f32_flops=per_cta, iterations=units["tile"],
                    units=units)
        main = kernel_of(phase, plan.kernel, "kv", work, dev, flops=plan.flops, min_bytes=min_bytes)
    if plan.idle_ctas:  # CTAs with no key (a grid sized past the live keys): a wave of exits each
        idle = -(-plan.idle_ctas // (dev.sms * main.per_sm)) * dev.idle_wave
        main.time += idle
        main.limits["latency"] += idle
    if not plan.combine_kernel:
        return [main]
    partials = plan.bytes["partials_read"]
    from_memory = partials if partials > dev.l2 else 0
    ctas = plan.combine_grid[0] * plan.combine_grid[1]
    combine = planned(phase, plan.combine_kernel, "kv", even(from_memory + plan.bytes["out"], ctas), 0,
                      plan.combine_block[0], 0, dev, plan.combine_kernel, l2=even(partials + plan.bytes["out"], ctas))
    return [main, combine]


def scan_kernels(phase, c: TrunkConfig, B: int, rows: int, dev: Device, *, checkpoints: bool, commit: bool,
                 name="gdn scan", gated: bool = True) -> list[Kernel]:
    """The fused gdn_scan of trunk config c's gdn layer (gdn_kernels)."""
    return gdn_kernels(phase, c.gdn_heads, c.gdn_dk, c.gdn_dv, c.gdn_k_heads or None, B, rows, dev,
                       checkpoints=checkpoints, commit=commit, name=name, gated=gated)


def gdn_kernels(phase, H: int, dk: int, dv: int, k_heads, B: int, rows: int, dev: Device, *, checkpoints: bool,
                commit: bool, name="gdn scan", gated: bool = True) -> list[Kernel]:
    """gdn_scan_dk<dk>_f32 from scan_plan and scan_bytes: one CTA per (value head, slice of its state
    rows, session), the conv of its channels and the scan of its rows; (gated) the output norm by
    the last slice of each head, over o read back (its bytes counted once more)."""
    C = gdn_ops.channels(H, dk, dv, k_heads)
    by = gdn_ops.scan_bytes(B, rows, H, dk, dv, k_heads, checkpoints=checkpoints, commit=commit, gated=gated)
    entry, threads, smem, slice_rows = gdn_ops.scan_plan(H, dk, dv, k_heads)
    ctas = H * -(-dv // slice_rows) * B
    norm = 2 * 4 * rows * H * dv if gated else 0   # o written, read back and rewritten by the norm
    flops = rows * (H * 7 * dv * dk + 8 * C + (6 * H * dv if gated else 0))
    return [planned(phase, name, "state", even(by["columns"] + by["state"] + by["checkpoints"] + norm, ctas), flops,
                    threads, smem, dev, entry)]


def rowsplit_kernel(phase, plan, dev: Device) -> Kernel:
    """A vocabulary reduction from its row-split plan (dspark.ops.rowsplit.Plan)."""
    kernels = []
    flops = plan.notes.get("flops", 0)
    entries = compiled_kernels(dev.arch, dev.nvrtc)[1]
    for launch in plan.launches:  # f32 logits: the LM head's output; an integer walk has no dtype suffix
        entry = launch.kernel if launch.kernel in entries else f"{launch.kernel}_f32"
        share = plan.bytes * launch.ctas / max(plan.ctas, 1)
        kernels.append(planned(phase, plan.op, "other", even(share, launch.ctas), flops * launch.ctas / plan.ctas,
                               launch.threads, launch.shared_mem, dev, entry))
    t = sum(k.time for k in kernels)
    # its launches run one after another: each limiter (and the floor) of the reduction is theirs added
    limits = {lim: sum(k.limits[lim] for k in kernels) for lim in LIMITERS}
    return Kernel(phase, plan.op, "other", int(plan.bytes), int(flops), plan.ctas, max(k.waves for k in kernels), t,
                  len(plan.launches), plan.min_bytes, kernels[0].entry, sum(k.f32_instr for k in kernels), 0.0,
                  min(k.per_sm for k in kernels), limits, sum(k.wavefronts for k in kernels),
                  sum(k.ideal_wavefronts for k in kernels), all(k.smem_counted for k in kernels))


def commit_kernel(phase, name, B, layers, keep, row_bytes, dev: Device, kind="kv") -> Kernel:
    """kv_commit_rows: grid (B, layers, 2), each CTA copies one session's kept rows of K or V."""
    return planned(phase, name, kind, even(commit_bytes(layers, B * keep, 1, row_bytes, 1), B * layers * 2), 0,
                   COMMIT_THREADS, 0, dev, "kv_commit_rows")


# ---- a round ----------------------------------------------------------------------------------------------
def drafter_pass(shape: Shape, B: int, context: int, dev: Device, reach: int | None = None) -> list[Kernel]:
    """The drafter's block pass (b rows per session over its window), the Markov chain and the
    confidence head, and the ingest of the accepted rows (per layer its K|V, normed and rotated,
    and one ring commit): dspark.models.drafter's run_block, run_propose and run_ingest."""
    t, dc, wb, db = shape.trunk, shape.drafter, shape.weight_bytes, shape.drafter_bytes()
    rows, d, ph = B * dc.block, t.d_model, "draft"
    nq, nkv = dc.heads * dc.head_dim, dc.kv_heads * dc.head_dim
    out = [row_norm(ph, "drafter embedding + norm", f"embed_rmsnorm_{STORAGE_SUFFIX[F32 if dc.own_embed else wb]}", rows,
                    d, dev, reads=(F32 if dc.own_embed else wb) / F32, writes=2)]
    for i in range(dc.layers):
        out += linear(ph, "drafter q|k|v", rows, d, nq + 2 * nkv, db, dev)
        out.append(qk_prepare_kernel(ph, rows, dc.heads, dc.kv_heads, dc.head_dim, nq + 2 * nkv, dc.head_dim, F32, dev,
                                     q_norm=dc.q_norm, k_norm=True))
        window = dc.windows()[i] or context
        plan = launch_plan([dc.block] * B, [min(context, window + dc.block)] * B, hq=dc.heads, hkv=dc.kv_heads,
                           head_dim=dc.head_dim, dtype=np.float32, mode="block", window=window,
                           window_mode=dc.window_mode if dc.windows()[i] else "anchor", reach=reach)
        out += attention_kernels(ph, plan, dev)
        out += linear(ph, "drafter o", rows, nq, d, db, dev)
        if dc.conv_kernel:   # DFlash2: each sublayer's dynamic kernels, one projection per side
            out += scaled(linear(ph, "drafter conv kernels", rows, d, 2 * dc.conv_kernel * (d // dc.conv_group), F32,
                                 dev), 2, "two sides")
        out.append(row_norm(ph, "drafter residual + norm", "add_rmsnorm_f32", rows, d, dev, reads=2, writes=2))
        out += linear(ph, "drafter gate|up", rows, d, 2 * dc.mlp_hidden, db, dev)
        out += linear(ph, "drafter down", rows, dc.mlp_hidden, d, db, dev, swiglu=True)
        out.append(row_norm(ph, "drafter residual + norm", "add_rmsnorm_f32", rows, d, dev, reads=2, writes=2))
    nd = dc.drafts
    if dc.harvest != "shifted":  # the draft rows of each block, before the LM head
        out.append(elementwise(ph, "draft rows", "gather_rows_f32", B * nd * d, 2 * F32 * B * nd * d, 0, dev))
    vd = dc.draft_vocab or t.vocab
    out += linear(ph, "drafter lm head" + (" (own, draft vocabulary)" if dc.own_head else " (the trunk's)"), B * nd, d,
                  vd, db if dc.own_head else wb, dev)
    if dc.logit_scale != 1.0 or dc.logit_softcap > 0:
        out.append(elementwise(ph, "logit scale", "logit_scale_f32", B * nd * vd, 2 * F32 * B * nd * vd,
                               3 * B * nd * vd, dev))
    if dc.markov == "selector":   # per slot: the top-k of its logits (a sort), rescored; no plan of ours
        out.append(roofline("propose", "candidate selector", "other", B * nd * vd * 4 * 2, 0, dev, launches=nd * 4))
    else:
        out.append(rowsplit_kernel("propose", argmax_ops.markov_chain_plan(B, nd, vd, dc.markov_rank), dev))
    if dc.confidence != "none":  # c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b): features, a GEMM of one column
        feats = d + (dc.markov_rank if dc.confidence == "markov" else 0)
        if dc.confidence == "markov":
            out.append(elementwise("propose", "confidence features", "confidence_features_f32", B * nd * feats,
                                   2 * F32 * B * nd * feats, 0, dev))
        out += linear("propose", "confidence head", B * nd, feats, 1, F32, dev, kind="other")
        out.append(elementwise("propose", "confidence sigmoid", "sigmoid_bias_f32", B * nd, 2 * F32 * B * nd,
                               4 * B * nd, dev))
    keep = dc.block  # a full accept ingests every row
    taps = len(dc.taps or t.tap_layers)
    out += linear("ingest", "drafter fc", B * keep, taps * d, d, db, dev)
    out.append(row_norm("ingest", "drafter fc norm", "add_rmsnorm_f32", B * keep, d, dev, reads=1, writes=1))
    for _ in range(dc.layers):
        out += linear("ingest", "drafter k|v", B * keep, d, 2 * nkv, db, dev)
        out.append(qk_prepare_kernel("ingest", B * keep, 0, dc.kv_heads, dc.head_dim, 2 * nkv, dc.head_dim, F32, dev,
                                     q_norm=False, k_norm=True, with_q=False))
    out.append(commit_kernel("ingest", "kv_commit (ring)", B, dc.layers, keep, dc.kv_heads * dc.head_dim * F32, dev))
    return out


def rollback_kernels(shape: Shape, B: int, vt: int, dev: Device, rollback: str) -> list[Kernel]:
    """The state a rollback moves: select copies the kept column's checkpoint of every gdn layer
    into the live state (one launch); replay re-scans the kept columns from the live state."""
    c = shape.trunk
    g = c.layers.count("gdn")
    if not g:
        return []
    if rollback == "replay":
        return scaled(scan_kernels("rollback", c, B, B * vt, dev, checkpoints=False, commit=True, name="gdn replay",
                                   gated=False), g, f"x{g} gdn layers")
    return [select_kernel("rollback", B, c.gdn_heads * c.gdn_dv * c.gdn_dk, c.gdn_channels * gdn_ops.WINDOW, dev, g)]


def select_kernel(phase, B: int, state: int, window: int, dev: Device, layers: int = 1) -> Kernel:
    """checkpoint_select_layers_f32 of `layers` gdn layers: grid copy_grid(layers B, state), each
    session's kept column read and its live state and window written, in one launch."""
    tensors, chunks = snapshot_ops.copy_grid(layers * B, state)
    return planned(phase, "checkpoint_select", "state",
                   even(layers * snapshot_ops.select_bytes(B, state, window), tensors * chunks), 0,
                   snapshot_ops.COPY_THREADS, 0, dev, "checkpoint_select_layers_f32")


def copy_kernel(phase, sizes, dev: Device) -> Kernel:
    """snapshot_copy_f32 over tensors of `sizes` floats: grid copy_grid(n, largest), read and write."""
    tensors, chunks = snapshot_ops.copy_grid(len(sizes), max(sizes))
    per = np.concatenate([even(2 * F32 * n, chunks) for n in sizes])
    return planned(phase, "snapshot_copy", "state", per, 0, snapshot_ops.COPY_THREADS, 0, dev, "snapshot_copy_f32")


def round_moves(shape: Shape, vts, keeps, rollback: str = "checkpoint", ingest=None) -> dict[str, int]:
    """Bytes of recurrent state and K/V one round moves, by the kinds the ops report on every
    backend (dspark.profile.BYTE_KINDS), for sessions verifying vts[b] columns and keeping keeps[b]
    (the drafter ingests `ingest[b]` rows, default keeps). The CuPy-contract run of a round counts
    the same numbers (tests/profiling/test_perf_model.py)."""
    c, dc = shape.trunk, shape.drafter
    vts, keeps = np.asarray(vts), np.asarray(keeps)
    ingest = keeps if ingest is None else np.asarray(ingest)
    g, a = c.layers.count("gdn"), c.layers.count("attn")
    kv_isz = np.dtype(BF16 if c.kv_dtype == "bfloat16" else c.kv_dtype).itemsize
    out = dict.fromkeys(("state", "checkpoints", "rollback", "kv_commit"), 0)
    if g:
        verify = gdn_ops.scan_bytes(int(np.count_nonzero(vts)), int(vts.sum()), c.gdn_heads, c.gdn_dk, c.gdn_dv,
                                    c.gdn_k_heads or None, checkpoints=rollback == "checkpoint", commit=False)
        out["state"] += g * verify["state"]
        out["checkpoints"] += g * verify["checkpoints"]
        if rollback == "checkpoint":
            state = c.gdn_heads * c.gdn_dv * c.gdn_dk
            out["rollback"] += g * snapshot_ops.select_bytes(int(np.count_nonzero(keeps)), state,
                                                             c.gdn_channels * gdn_ops.WINDOW)
        else:
            replay = gdn_ops.scan_bytes(int(np.count_nonzero(keeps)), int(keeps.sum()), c.gdn_heads, c.gdn_dk,
                                        c.gdn_dv, c.gdn_k_heads or None, commit=True)
            out["state"] += g * replay["state"]
    if a:
        out["kv_commit"] += commit_bytes(a, int(keeps.sum()), c.attn_kv_heads, c.head_dim, kv_isz)
    ring = min(dc.block + (dc.windows()[0] or c.max_ctx), 10**9)
    out["kv_commit"] += commit_bytes(dc.layers, int(np.minimum(ingest, ring).sum()), dc.kv_heads, dc.head_dim, F32)
    return out


# CuPy array ops of the plain path (op by op), counted on the CuPy contract path
# (tests/profiling/test_perf_model.py recounts them): a round's and a plain decode step's, whatever
# the layers (the layers' glue is kernels: dspark.ops.norm, activation, rope, heads). Recorded
# passes (launches "eager" or "graph") have none. Each unrecorded pass zeroes its workspace's row
# tickets once (the products' and the row norms'). A prompt pass's (never recorded): per gdn layer
# (the chunked gdn's inputs made contiguous: three copies) and the last pass's last-row gather
# (PROMPT_GLUE).
LAUNCH_GLUE = {"round": 19, "step": 6}
UPLOADS = {"round": 3, "step": 1}   # a recorded round's inputs blocks (draft, verify, commit); a step's
PROMPT_GLUE = {"gdn": 3, "pass": 5, "last": 2}


def array_ops(mode: str, spec: bool) -> int:
    """CuPy array ops (each a launch on a GPU) of a spec round or a plain step, beside its kernels."""
    return LAUNCH_GLUE["round" if spec else "step"] if mode == "plain" else 0


@dataclasses.dataclass
class Round:
    """A speculative round and a plain decode step of the same sessions, as `mode` issues them:
    plain (every launch planned and checked by the host: Device.launch each), eager (the passes'
    recordings issued by the host: Device.host_eager + CuPy's call each, an upload per pass) or
    graph (each pass one graph launch: the round's host time Device.host_graph_round, CuPy's graph
    launches and uploads, and on the GPU Device.graph_node per kernel node). Each waits on the
    device twice (a step once)."""
    shape: Shape
    B: int
    context: int
    vt: int
    kernels: list[Kernel]      # every kernel of a spec round
    plain: list[Kernel]        # every kernel of a plain decode step
    launches: int              # kernel launches of the round (graph nodes in graph mode) and array ops
    plain_launches: int
    dev: Device = H200
    syncs: int = 2
    mode: str = "graph"

    def gpu(self, kernels=None) -> float:
        """Expected GPU time: the kernels' expected times added."""
        return sum(k.time for k in (self.kernels if kernels is None else kernels))

    def gpu_floor(self, kernels=None) -> float:
        """The kernels' floors added: what the GPU time can never go under."""
        return sum(k.floor for k in (self.kernels if kernels is None else kernels))

    def floor(self) -> float:
        """The round's floor: its kernels' floors and its launch and host overhead."""
        return self.gpu_floor() + self.overhead()

    def _overhead(self, launches: int, syncs: int, spec: bool) -> float:
        dev, passes = self.dev, UPLOADS["round" if spec else "step"]
        if self.mode == "plain":
            return launches * dev.launch + syncs * dev.sync
        uploads = passes * dev.cupy_copy + syncs * dev.sync
        if self.mode == "eager":
            return launches * (dev.host_eager + dev.cupy_launch) + uploads
        host = dev.host_graph_round * (1 if spec else 1 / UPLOADS["round"])  # a step: one pass of three
        return host + passes * dev.graph_launch + uploads + launches * dev.graph_node

    def overhead(self) -> float:
        """Launch and host time of the round beside its kernels (no overlap assumed)."""
        return self._overhead(self.launches, self.syncs, True)

    def time(self) -> float:
        return self.gpu() + self.overhead()

    def plain_time(self) -> float:
        return self.gpu(self.plain) + self._overhead(self.plain_launches, 1, False)

    def composition(self) -> dict[str, float]:
        """Seconds of the round by what its kernels move; overhead = launches, host and syncs."""
        out = {k: sum(x.time for x in self.kernels if x.kind == k) for k in KINDS}
        out["overhead"] = self.overhead()
        return out

    def verify_pass(self) -> list[Kernel]:
        return [k for k in self.kernels if k.phase == "verify"]

    def speedup(self, accepted: float) -> float:
        return accepted * self.plain_time() / self.time()


def spec_round(shape: Shape, B: int, context: int, vt: int, dev: Device = H200,
               rollback="checkpoint", mode: str = "graph") -> Round:
    """A greedy round of B sessions at `context` verifying vt columns each (a full accept: every
    column committed and ingested), and a plain decode step of the same sessions, issued as
    `mode` (Round). The context is capped where the shape's max_ctx leaves room for the columns;
    recorded passes size their attention grids for the horizon (dspark.graphs.horizon)."""
    from dspark.graphs import horizon
    context = max(1, min(context, shape.trunk.max_ctx - vt))
    recorded = mode != "plain"
    reach = horizon(context + vt, shape.trunk.max_ctx) if recorded else None
    draft_reach = horizon(context + shape.drafter.block, shape.trunk.max_ctx + shape.drafter.block) if recorded else None
    kernels = drafter_pass(shape, B, context, dev, reach=draft_reach)
    kernels += trunk_pass(shape, B, context, vt, dev, verify=True, rollback=rollback, reach=reach)
    kernels += rollback_kernels(shape, B, vt, dev, rollback)
    plain = trunk_pass(shape, B, context, 1, dev, verify=False,
                       reach=horizon(context + 1, shape.trunk.max_ctx) if recorded else None)
    launches = sum(k.launches for k in kernels if k.ctas) + array_ops(mode, True)
    plain_launches = sum(k.launches for k in plain if k.ctas) + array_ops(mode, False)
    return Round(shape, B, context, vt, kernels, plain, launches, plain_launches, dev, mode=mode)


# ---- the prompt pass, plain batched decode and memory per session ------------------------------------------
# Priced from the kernels as compiled, as the round is: occupancy from their registers and shared
# memory (`resident`), the MMAs at the mma.sync ceiling, bytes at the copy bandwidth, launches at the
# measured host cost. Each price names its bound and never goes under it.
FMA_LATENCY = 4          # assumed: cycles from an fmaf to a dependent one (Ampere, Hopper microbenchmarks)
SOLVE_CHAIN = 120 + 32 + 48 + 64  # dependent fmaf of gdn_chunk_prep's solve: the longest diagonal column,
                                  # then M and T_IJ at block distances 1, 2, 3 (csrc/gdn_chunk.cu, chunk_solve)


def prompt_attention(phase, hq: int, hkv: int, head_dim: int, start: int, rows: int, dev: Device) -> Kernel:
    """attention_prompt (bf16 K/V) over a pass of `rows` query rows after `start` committed ones:
    each CTA walks the key tiles up to its last row's (its main loop's iterations), every tile's
    MMAs over PROMPT_ITEMS (128) items x 64 keys x D (the whole tile as the MMAs run it); DRAM: the K/V of the
    visible keys once, q and out (the CTAs' re-reads of K/V come from L2: the plan's bytes). The
    merged outputs (f32, prompt_acc_bytes) go through L2: each CTA zeroes its items' rows, reads
    and writes them at each split's end and reads them at the store; DRAM takes them once, written
    back."""
    plan = launch_plan([rows], [start], hq=hq, hkv=hkv, head_dim=head_dim, dtype=BF16)
    units = attention_units(plan)
    cta_flops = units["tile"] * TILE * PROMPT_ITEMS * 4 * head_dim
    acc = prompt_acc_bytes(rows, hq, head_dim)
    dram = 2 * ((start + rows) * 2 * hkv + rows * hq) * head_dim + plan.bytes["out"] + acc
    l2 = (plan.cta_keys * 2 * head_dim * 2 + (plan.bytes["q"] + plan.bytes["out"]) / max(plan.ctas, 1)
          + acc / max(plan.ctas, 1) * (2 + 2 * units["merge"]))
    work = Work(plan.kernel, plan.block[0], plan.shared_mem, even(dram, plan.ctas), l2=l2, mma=cta_flops / MMA_FLOPS,
                iterations=units["tile"], units=units)
    return kernel_of(phase, plan.kernel, "kv", work, dev, flops=int(cta_flops.sum()), mma_flops=float(cta_flops.sum()),
                     min_bytes=int(dram - acc))


def prompt_gdn(phase, H: int, dk: int, dv: int, k_heads, rows: int, dev: Device) -> list[Kernel]:
    """One gdn layer's prompt pass (dspark.ops.gdn_chunk): the conv (a thread per channel and 64
    columns); gdn_chunk_prep, one CTA per (chunk, value head), its products on the tensor cores,
    its inputs (x and the gates once: a key head's value heads share them in L2) and scratch, and
    its triangular solve's dependent fmaf chain (SOLVE_CHAIN at the FMA latency: a latency where
    nothing overlaps it); and gdn_chunk_state, one CTA per (32 state rows, value head) walking the
    chunks in order (its main loop's iterations), each chunk its share of the products."""
    C = gdn_ops.channels(H, dk, dv, k_heads)
    chunks = -(-rows // chunk_ops.CHUNK)
    conv = planned(phase, "gdn_conv_rows_f32", "state",
                   even(4 * rows * 2 * C, -(-C // chunk_ops.THREADS) * -(-rows // chunk_ops.CONV_COLS)), 8 * rows * C,
                   chunk_ops.THREADS, 0, dev, "gdn_conv_rows_f32")
    fl = chunk_ops.chunk_flops(H, dk, dv)
    scratch = chunk_ops.scratch_bytes(chunks, H, dk, dv, 2)
    entry = f"gdn_chunk_prep_bf16_dk{dk}"
    prep_ctas = chunks * H
    prep_bytes = 4 * rows * (C + 2 * H) + scratch
    work = Work(entry, chunk_ops.THREADS, chunk_ops.prep_shared_mem(dk, dv, 2), even(prep_bytes, prep_ctas),
                mma=fl["prep"] / H / MMA_FLOPS, chain=SOLVE_CHAIN * FMA_LATENCY / dev.clock,
                units={"cta": 1.0, "byte": even(prep_bytes, prep_ctas)})
    prep = kernel_of(phase, entry, "state", work, dev, flops=chunks * fl["prep"], mma_flops=float(chunks * fl["prep"]),
                     min_bytes=prep_bytes)
    entry = f"gdn_chunk_state_bf16_dk{dk}"
    walk_ctas = -(-dv // chunk_ops.SLICE) * H
    walk_bytes = scratch + 4 * rows * H * dv + 3 * 4 * H * dv * dk
    work = Work(entry, chunk_ops.THREADS, chunk_ops.state_shared_mem(dk, 2), even(walk_bytes, walk_ctas),
                mma=chunks * fl["state"] / walk_ctas / MMA_FLOPS, iterations=float(chunks),
                units={"cta": 1.0, "chunk": float(chunks)})
    walk = kernel_of(phase, entry, "state", work, dev, flops=chunks * fl["state"], mma_flops=float(chunks * fl["state"]),
                     min_bytes=walk_bytes)
    return [conv, prep, walk]


def prompt_pass(shape: Shape, start: int, rows: int, dev: Device, *, last: bool) -> list[Kernel]:
    """Every kernel of one prompt pass of `rows` tokens after `start` (one session), as
    dspark.models.trunk.run_pass issues it with a PromptPlan: `layers` with prompt attention, and
    the chunked gdn with its inputs made contiguous (CuPy copies at the copy bandwidth) and its gated
    output norm (rmsnorm_gated_f32); the K/V rows committed; the last pass's LM head on its last row."""
    c, wb, ph = shape.trunk, shape.weight_bytes, "prompt"
    H, dv, C = c.gdn_heads, c.gdn_dv, c.gdn_channels
    attn_layers = c.layers.count("attn")

    def attention():
        return [prompt_attention(ph, c.attn_heads, c.attn_kv_heads, c.head_dim, start, rows, dev)]

    def gdn():
        return [roofline(ph, "gdn inputs contiguous (glue)", "other", 2 * F32 * rows * (C + 2 * H), 0, dev),
                *prompt_gdn(ph, H, c.gdn_dk, dv, c.gdn_k_heads or None, rows, dev),
                gated_norm_kernel(ph, "gdn gated o_norm", rows, H, dv, dev)]
    out = layers(shape, ph, rows, dev, attention, gdn)
    if attn_layers:
        out.append(commit_kernel(ph, "kv_commit", 1, attn_layers, rows,
                                 c.attn_kv_heads * c.head_dim * kv_itemsize(c), dev))
    if last:
        out.append(roofline(ph, "last row (glue)", "other", F32 * c.d_model, 0, dev))
        out += linear(ph, "lm head (last row)", 1, c.d_model, c.vocab, wb, dev)
    return out


@dataclasses.dataclass
class Prompt:
    """A prompt of `tokens` in passes of `chunk`: every pass's kernels, the launches they take, the
    host-device waits inside the passes (`syncs`: small uploads from pageable memory, each waits for
    the work before it) and the pointer tables uploaded before the first pass (`tables`)."""
    shape: Shape
    tokens: int
    chunk: int
    kernels: list[Kernel]
    launches: int
    syncs: int
    tables: int

    def gpu(self) -> float:
        return sum(k.time for k in self.kernels)

    def gpu_floor(self) -> float:
        return sum(k.floor for k in self.kernels)

    def waits(self, dev: Device = H200) -> float:
        """Each wait inside the passes (the copy, then one launch's issue before the GPU has work
        again), the tables' uploads before any work, the final fetch."""
        return self.syncs * (dev.sync + dev.launch) + self.tables * dev.sync + dev.sync

    def ttft(self, dev: Device = H200, floor: bool = False) -> float:
        """Time to first token (expected, or its floor from the kernels' floors). A pass's launches
        are asynchronous: the host issues them while the GPU runs the ones before, so they cost GPU
        time only at a wait (`waits`), and where all of them take longer than the GPU work."""
        gpu = self.gpu_floor() if floor else self.gpu()
        return gpu + self.waits(dev) + max(0.0, self.launches * dev.launch - gpu)


def prompt(shape: Shape, tokens: int, dev: Device = H200, chunk: int = PROMPT_CHUNK) -> Prompt:
    """The prompt pass of one request (dspark.models.trunk.HybridTrunk.prompt_passes), op by op (a
    prompt pass is never recorded). Waits per pass (as the code issues them, counted on the CuPy
    contract path): the pass's inputs block, the gdn chunk schedule, the K/V scratch table of the
    commit, the last row's index; pointer tables: K and V per attention layer, state, conv window,
    chunk state and tail per gdn layer, the commit table and the rollback's two."""
    c = shape.trunk
    attn, gdn = c.layers.count("attn"), c.layers.count("gdn")
    kernels, launches, syncs = [], 0, 0
    for start in range(0, tokens, chunk):
        rows = min(chunk, tokens - start)
        last = start + rows >= tokens
        ks = prompt_pass(shape, start, rows, dev, last=last)
        kernels += ks
        launches += sum(k.launches for k in ks if k.ctas) + PROMPT_GLUE["pass"] + gdn * PROMPT_GLUE["gdn"] \
            + (PROMPT_GLUE["last"] if last else 0)
        syncs += 1 + (1 if gdn else 0) + (1 if attn else 0) + (1 if last else 0)
    return Prompt(shape, tokens, chunk, kernels, launches, syncs, 2 * attn + 4 * gdn + 3)


def plain_step(shape: Shape, B: int, context: int, dev: Device = H200, mode: str = "graph") -> tuple[float, float]:
    """A plain batched decode step of B sessions at `context`, issued as `mode` (Round): (GPU time,
    GPU time + its launch and host overhead and one sync)."""
    from dspark.graphs import horizon
    recorded = mode != "plain"
    ks = trunk_pass(shape, B, context, 1, dev, verify=False,
                    reach=horizon(context + 1, shape.trunk.max_ctx) if recorded else None)
    launches = sum(k.launches for k in ks if k.ctas) + array_ops(mode, False)
    r = Round(shape, B, context, 1, [], ks, 0, launches, dev, mode=mode)
    return r.gpu(ks), r.plain_time()


# ---- the cost model's prior on `cuda` (dspark.cost_prior) ----------------------------------------------------
PRIOR_DIGITS = 5  # significant digits of the table's seconds


def prior_entry(shape: Shape, batches=None, widths=None, contexts=None, dev: Device = H200) -> dict:
    """The table's entry for `shape` (dspark.cost_prior: the grid, or the part of it asked for): the
    seconds of a greedy round, of its verify pass (its kernels and a plain step's launch and host
    overhead) and of a plain step, passes replayed from CUDA graphs."""
    from dspark.cost_prior import BATCHES, contexts_for, fingerprint, fingerprint_fields
    t, d = shape.trunk, shape.drafter
    batches = list(batches or BATCHES)
    widths = list(widths or range(2, d.block + 1))
    contexts = list(contexts or contexts_for(t.max_ctx, d.block))

    def rounded(x: float) -> float:
        return float(f"{x:.{PRIOR_DIGITS}g}")
    plain, rounds, verify = [], [], []
    for B in batches:
        steps = [plain_step(shape, B, c, dev, mode="graph") for c in contexts]
        plain.append([rounded(total) for _, total in steps])
        rounds.append([]), verify.append([])
        for w in widths:
            rs = [spec_round(shape, B, c, w, dev, mode="graph") for c in contexts]
            rounds[-1].append([rounded(r.time()) for r in rs])
            verify[-1].append([rounded(r.gpu(r.verify_pass()) + total - gpu) for r, (gpu, total) in zip(rs, steps)])
    fmt = shape.weight_format
    entry = {"shape": shape.label, "fingerprint": fingerprint(t, d, fmt), "fields": fingerprint_fields(t, d, fmt),
             "batches": batches, "widths": widths, "contexts": contexts, "plain": plain, "round": rounds,
             "verify": verify}
    if t.experts:
        entry["experts"] = {"count": t.experts, "top_k": t.expert_top_k,
                            "seconds": rounded(expert_seconds(shape, widths[-1], contexts[0], dev))}
    return entry


def expert_seconds(shape: Shape, width: int, context: int, dev: Device = H200) -> float:
    """What one more distinct expert per MoE layer adds to a round (the table prices its grid at
    uniform routing; dspark.cost_prior.TablePrior moves from it by this per expert): the round at
    `width` under uniform and under the published routing, over their distinct experts' difference."""
    other = dataclasses.replace(shape, routing="published" if shape.routing == "uniform" else "uniform")
    a, b = (spec_round(s, 1, context, width, dev, mode="graph").time() for s in (shape, other))
    return (a - b) / (distinct_experts(shape, width) - distinct_experts(other, width))


def prior_table(table_of: dict[str, Shape], dev: Device = H200) -> dict:
    """dspark/cost_prior_h200.json: every shape's entry, keyed by its fingerprint."""
    entries = {}
    for s in table_of.values():
        e = prior_entry(s, dev=dev)
        entries[e.pop("fingerprint")] = e
    return {"device": dev.name, "mode": "graph", "command": "python profiling/perf_model.py --prior-table",
            "units": "seconds", "entries": entries}


def prior_report(tab: dict) -> str:
    """Each entry's round and verify in plain steps of the same batch, at B = 1 and 32, the widest verify."""
    from dspark.cost_prior import TablePrior
    rows = []
    for e in tab["entries"].values():
        p, w = TablePrior(e), e["widths"][-1]
        for B in (1, 32):
            for c in (e["contexts"][0], 1024, e["contexts"][-1]):
                rows.append([e["shape"], str(B), str(w), str(c), f"{p.plain(B, c):.2f}",
                             f"{p.round(B, w, c) / p.plain(B, c):.2f}", f"{p.verify(B, w, c) / p.plain(B, c):.2f}"])
    return table(["shape", "B", "width", "context", "plain (1-row steps at the first)", "round / plain", "verify / plain"],
                 [r for i, r in enumerate(rows) if r not in rows[:i]])


def memory_row(shape: Shape, context: int, chunk: int = PROMPT_CHUNK) -> dict:
    """Bytes one session holds at `context` (dspark.models.cache.cache_bytes, bf16 K/V as the
    shape stores it, the chunk tails of the kernel backends; the drafter's ring), the prompt
    pass's largest arrays at `chunk` tokens (activations of the widest layer, the gdn scratch, the
    16-bit copies of the products' activations, the prompt attention's merged outputs in f32),
    and whether the context is within the model's max_position_embeddings (the shapes' max_ctx)."""
    c, dc = shape.trunk, shape.drafter
    cache = cache_bytes(c, context, chunk_tails="gdn" in c.layers)
    ring = dc.layers * 2 * dc.kv_heads * (min(max(w or context for w in dc.windows()), context) + dc.block) \
        * dc.head_dim * F32
    widest = max(2 * c.mlp_hidden, c.gdn_channels + c.gdn_heads * c.gdn_dv + 2 * c.gdn_heads if "gdn" in c.layers else 0,
                 c.attn_heads * c.head_dim * 2 + 2 * c.attn_kv_heads * c.head_dim)
    taps = len(c.tap_layers) * c.d_model
    scratch = chunk_ops.scratch_bytes(-(-chunk // chunk_ops.CHUNK), c.gdn_heads, c.gdn_dk, c.gdn_dv, 2) \
        if "gdn" in c.layers else 0
    # the 16-bit products' activations rounded once (dspark.ops.linear.a16): one copy per distinct K, bf16
    # (an FP8 trunk's decoder linears take their f32 activations: its gdn a|b alone, over d_model)
    ks = {c.d_model} if shape.fp8 else {c.d_model, c.attn_heads * c.head_dim if "attn" in c.layers else 0,
                                        c.gdn_heads * c.gdn_dv if "gdn" in c.layers else 0, c.mlp_hidden}
    x16 = 2 * chunk * sum(k for k in ks if k and k % 8 == 0) if shape.weight_bytes == 2 else 0
    acc = prompt_acc_bytes(chunk, c.attn_heads, c.head_dim) if "attn" in c.layers else 0
    return {"kv": cache["kv"], "state": cache["state"] + cache["chunk"], "draft_kv": ring,
            "pass": F32 * chunk * (3 * c.d_model + 2 * widest + taps) + scratch + x16 + acc,
            "fits": context <= c.max_ctx}


TTFT_CASES = (("qwen3.5-27b", 8192), ("qwen3.5-27b", 32768), ("qwen3-8b", 8192), ("qwen3.5-35b-a3b", 8192))
PLAIN_BATCHES, PLAIN_CONTEXT = (1, 8, 32), 4096
MEMORY_CONTEXTS = (32768, 131072)


def prompt_report(table_of: dict[str, Shape], chunk: int, kernels: bool = False, dev: Device = H200,
                  mode: str = "graph") -> str:
    """The --prompt tables: time to first token, the plain batched decode step, memory per session."""
    gib = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
    out = [f"{dev.name} (assumed rates: pricing.Device): mma.sync {dev.mma_sync / 1e12:.0f} TFLOP/s "
           f"({dev.mma_sync_share:.2f} of {dev.mma / 1e12:.0f}; data sheet {dev.mma_peak / 1e12:.0f}), copy "
           f"{dev.bw / 1e12:.1f} TB/s (data sheet {dev.dram_peak / 1e12:.1f}), L2 {dev.l2_bw / 1e12:.1f} TB/s, "
           f"f32 issue {dev.f32_issue / 1e12:.1f} T instr/s, launch "
           f"{dev.launch * 1e6:.1f} us host, sync {dev.sync * 1e6:.0f} us; code as compiled for {dev.arch} by "
           f"{compiled_kernels(dev.arch, dev.nvrtc)[0]}; prompt passes of {chunk} tokens, bf16 weights and K/V", ""]
    rows, details = [], []
    for model, tokens in TTFT_CASES:
        pr = prompt(table_of[model], tokens, dev, chunk)
        parts = prompt_parts(pr)
        flops = sum(x.flops for x in pr.kernels)
        at_90 = flops / (0.9 * dev.mma_sync)
        row = [table_of[model].label, str(tokens), f"{pr.ttft(dev, floor=True) * 1e3:,.0f}", f"{pr.ttft(dev) * 1e3:,.0f}"]
        for ks in parts.values():
            row += [f"{sum(k.floor for k in ks) * 1e3:,.1f}", f"{sum(k.time for k in ks) * 1e3:,.1f}"]
        row += [f"{pr.waits(dev) * 1e3:,.1f}", f"{pr.launches * dev.launch * 1e3:,.0f}", f"{flops / 1e12:,.0f}",
                f"{at_90 * 1e3:,.0f}", f"{flops / pr.gpu() / dev.mma_sync:.0%}"]
        rows.append(row)
        if kernels:
            details.append((f"{table_of[model].label} {tokens} tokens", pr))
    out.append("TTFT: the prompt passes' GPU time + each wait inside them (a sync + one launch's host cost) + the "
               "pointer tables' uploads + the final fetch; the launches (column: their host time) are issued while the "
               "GPU runs. floor: the kernels' floors (each its largest limiter) added; expected: their expected times "
               "(docs/performance.md). TFLOP as the kernels execute them; at 90 %: that many FLOPs at 90 % of the "
               "mma.sync ceiling, under which the expected time never goes; of mma.sync: TFLOP / expected GPU time / "
               "the ceiling")
    out.append(table(["shape", "prompt", "TTFT floor ms", "TTFT expected ms"]
                     + [f"{part} {w} ms" for part in PROMPT_PARTS for w in ("floor", "expected")]
                     + ["waits ms", "launches ms", "TFLOP", "at 90 % ms", "of mma.sync"], rows))
    out.append("")
    rows = []
    for model in ("qwen3.5-27b", "qwen3-8b"):
        steps = [plain_step(table_of[model], b, PLAIN_CONTEXT, dev, mode) for b in PLAIN_BATCHES]
        v = sum(k.time for k in trunk_pass(table_of[model], 1, PLAIN_CONTEXT, 8, dev, verify=True))
        rows.append([table_of[model].label, str(PLAIN_CONTEXT)] + [us(g) for g, _ in steps]
                    + [f"{steps[-1][0] / steps[0][0]:.2f}", f"{steps[-1][1] / steps[0][1]:.2f}",
                       f"{v / steps[0][0]:.3f}"])
    out.append(f"plain step: GPU time (GEMMs occupancy priced); B=32 / B=1 of the GPU time, and with each step's "
               f"launch and host overhead as {mode} issues it and a sync; verify/plain: the B = 1 trunk verify of 8 columns over the "
               "plain step, GPU time")
    out.append(table(["shape", "context"] + [f"plain B={b} us" for b in PLAIN_BATCHES]
                     + [f"B={PLAIN_BATCHES[-1]} / B=1", "with launches", "verify/plain B=1"], rows))
    out.append("")
    rows = []
    for model in ("qwen3.5-27b", "qwen3-8b"):
        for ctx in MEMORY_CONTEXTS:
            m = memory_row(table_of[model], ctx, chunk)
            total = m["kv"] + m["state"] + m["draft_kv"]
            rows.append([table_of[model].label, str(ctx), gib(m["kv"]), gib(m["state"]), gib(m["draft_kv"]),
                         gib(total), gib(m["pass"]),
                         "yes" if m["fits"] else f"no: max_position_embeddings {table_of[model].trunk.max_ctx}"])
    out.append("session: the trunk cache (K/V bf16 at full capacity, gdn states, conv windows, chunk states and tails) "
               "and a DSpark drafter's draft-KV ring; pass: the prompt pass's largest arrays at the chunk size "
               "(activations of the widest layer, taps, the chunked gdn scratch)")
    out.append(table(["shape", "context", "K/V GiB", "gdn state GiB", "draft KV GiB", "session GiB", "pass GiB",
                      "served"], rows))
    for head, pr in details:
        out.append(f"\n{head}: TTFT floor {pr.ttft(dev, floor=True) * 1e3:,.1f} ms, expected {pr.ttft(dev) * 1e3:,.1f} ms")
        out.append(table(LIMIT_HEADERS, limit_rows(pr.kernels, dev)))
    return "\n".join(out)


PROMPT_PARTS = ("GEMMs", "attention", "gdn", "other")


def prompt_parts(pr: "Prompt") -> dict[str, list[Kernel]]:
    """A prompt's kernels by part: the GEMMs (weights), prompt attention, the chunked gdn (state) and
    the rest (norms, RoPE, gates, glue, the K/V commit)."""
    out = {p: [] for p in PROMPT_PARTS}
    for k in pr.kernels:
        part = "GEMMs" if k.kind == "weights" else "attention" if k.name.startswith("attention_prompt") \
            else "gdn" if k.kind == "state" else "other"
        out[part].append(k)
    return out


LIMIT_HEADERS = ["phase", "kernel", "MB", "GFLOP", "CTAs", "CTAs/SM", "launches", *(f"{lim} us" for lim in LIMITERS),
                 "floor us", "expected us", "bound", "smem conflicts", "of copy"]


def limit_rows(kernels: list[Kernel], dev: Device) -> list[list[str]]:
    """Every kernel's limiters (seconds each alone), floor, expected time, the limiter that sets the
    floor, its shared-memory wavefronts over those it would take without bank conflicts ("-": not
    counted by simt), and its bytes over its expected time as a share of the copy bandwidth."""
    rows = []
    for k in kernels:
        conflicts = (f"{k.wavefronts / k.ideal_wavefronts:.2f}x" if k.ideal_wavefronts else "none") \
            if k.smem_counted else "-"
        rows.append([k.phase, k.name, f"{k.bytes / 1e6:,.2f}", f"{k.flops / 1e9:,.2f}", str(k.ctas) if k.ctas else "-",
                     str(k.per_sm) if k.ctas else "-", str(k.launches),
                     *(us(k.limits.get(lim, 0.0)) for lim in LIMITERS), us(k.floor), us(k.time), k.bound, conflicts,
                     f"{copy_share([k], dev):.0%}"])
    return rows


def copy_share(kernels: list[Kernel], dev: Device) -> float:
    """The kernels' bytes over their expected time, as a share of the copy bandwidth."""
    t = sum(k.time for k in kernels)
    return sum(k.bytes for k in kernels) / dev.bw / t if t else 0.0


GLUE = ("norm", "swiglu", "gate", "rope", "markov_chain", "confidence", "combine", "kv_commit", "greedy_accept")


def share_summary(r: Round) -> str:
    """The round's kernels at the copy bandwidth: all of them, the products over weights, and the glue
    (norms, gates, RoPE, the Markov chain, the small reductions and copies) apart."""
    glue = [k for k in r.kernels if k.kind != "weights" and any(g in k.name for g in GLUE)]
    return (f"at the copy bandwidth (bytes over expected time): the round's kernels {copy_share(r.kernels, r.dev):.1%} "
            f"({sum(k.bytes for k in r.kernels) / 1e9:.2f} GB in {r.gpu() * 1e3:.2f} ms, the bytes' floor "
            f"{sum(k.bytes for k in r.kernels) / r.dev.bw * 1e3:.2f} ms); weight products "
            f"{copy_share([k for k in r.kernels if k.kind == 'weights'], r.dev):.1%}; glue {copy_share(glue, r.dev):.1%} "
            f"({len(glue)} kernels, {sum(k.launches for k in glue)} launches)")


# ---- printing ---------------------------------------------------------------------------------------------
def us(t: float) -> str:
    return f"{t * 1e6:,.1f}" if t < 1e-3 else f"{t * 1e6:,.0f}"


def attention_row(r: Round) -> Kernel:
    """The verify pass's attention split kernel of one layer."""
    for k in r.kernels:
        if k.phase == "verify" and k.name.startswith("attention_") and "combine" not in k.name:
            return k
    raise LookupError("no attention layer")


def summary_rows(rounds: list[Round], accepted: float, dev: Device = H200) -> list[list[str]]:
    rows = []
    for r in rounds:
        verify, plain = r.verify_pass(), r.plain
        try:
            a = attention_row(r)
            att = f"{a.min_bytes / a.time / dev.bw:.0%}"
        except LookupError:
            att = "-"
        row = [r.shape.label, str(r.B), str(r.context), str(r.vt), att, f"{r.gpu(verify) / r.gpu(plain):.3f}",
               us(r.gpu_floor(plain)), us(r.gpu(plain)), us(r.gpu_floor(verify)), us(r.gpu(verify)), us(r.floor()),
               us(r.time())]
        for kind in KINDS:
            ks = [k for k in r.kernels if k.kind == kind]
            row += [us(r.gpu_floor(ks)), us(r.gpu(ks))]
        rows.append(row + [us(r.overhead()), str(r.launches), f"{r.speedup(accepted):.2f}x"])
    return rows


SUMMARY_HEADERS = ["shape", "B", "context", "vt", "attn of copy", "verify/plain", "plain floor us", "plain us",
                   "verify floor us", "verify us", "round floor us", "round us",
                   *(f"{kind} {w}" for kind in KINDS for w in ("floor us", "us")), "overhead us", "launches", "speedup"]


def kernel_rows(r: Round) -> list[list[str]]:
    """Every kernel of the round: its limiters, floor and expected time (limit_rows)."""
    return limit_rows(r.kernels, r.dev)


MODE_HEADERS = ["shape", "B", "context", "launches", "mode", "step us", "step overhead", "round us", "round overhead",
                "speedup"]


def mode_rows(cases, a, dev: Device) -> list[list[str]]:
    """Each case's plain decode step and speculative round in every mode: time, the share of it that
    is launch and host overhead, and the speedup at --accepted."""
    rows = []
    for shape, B, ctx in cases:
        for mode in MODES:
            r = spec_round(shape, B, ctx, a.width, dev, rollback=a.rollback, mode=mode)
            step_over = r.plain_time() - r.gpu(r.plain)
            rows.append([shape.label, str(B), str(r.context), str(r.launches), mode, us(r.plain_time()),
                         f"{step_over / r.plain_time():.1%}", us(r.time()), f"{r.overhead() / r.time():.1%}",
                         f"{r.speedup(a.accepted):.2f}x"])
    return rows


KERNEL_HEADERS = LIMIT_HEADERS

# Published mean accepted lengths (tokens a round commits) for the FP8 pairs: each with its source.
# None is a target; the embedded pair's is ours, measured on a different pair, and labelled so.
PUBLISHED_ACCEPTED = {
    "dflash2": ((2.7, 8, "DFlash2 k=7 at 64k, vLLM recipes #839"),),
    "dspark": ((3.7, 6, "DSpark v2 k=5, as quoted in the FP8 plan (no public source found)"),),
}
EMBEDDED_ACCEPTED = (4.97, 8, "the embedded pair's greedy mean (not this pair's: labelled)")
FP8_HEADERS = ["shape", "B", "context", "plain floor us", "plain us", "verify/plain", "round floor us", "round us",
               "fp8/bf16 round", "(floors)", "fp8 GEMMs us", "their floor"]
TPOT_HEADERS = ["shape", "B", "context", "accepted", "vt", "source", "plain ms/token", "spec ms/token",
                "spec floor ms/token", "speedup"]


MOE_HEADERS = ["weights", "routing", "B", "context", "vt", "experts/layer", "expert MB", "verify floor us",
               "verify us", "verify/plain", "plain floor us", "plain us"]
# Named acceptance curves for the width table: a geometric per-position rate through each mean
# accepted length (tokens a round commits, at its drafts), each with its source; none is this pair's.
ACCEPTANCE_CURVES = (
    ("DFlash2 k=7, 2.7 (vLLM recipes #839; Qwen3.8-27B)", 2.7, 7),
    ("DSpark v2 k=5, 3.7 (as quoted in the FP8 plan)", 3.7, 5),
    ("embedded pair, 4.97 (ours, greedy)", 4.97, 7),
)
WIDTH_HEADERS = ["curve", "weights", "routing", "B", "context", "gain width", "tokens/round", "ms/token",
                 "width 8 ms/token", "plain ms/token"]
MOE_SHAPES = ("qwen3.5-35b-a3b", "qwen3.5-35b-a3b-fp8")   # --moe: the bf16 release and its FP8 one


def curve_tokens(mean: float, drafts: int, width: int) -> float:
    """Expected tokens of a round of `width` columns under the geometric curve through `mean`."""
    from dspark.gain import geometric_rate
    r = geometric_rate(mean, drafts)
    return 1.0 + sum(r ** k for k in range(1, width))


def expert_bytes(shape: Shape) -> int:
    """One expert's weight bytes (gate|up and down) as the grouped products read them: 2 bytes a
    weight (bf16), or 1 and the f32 scales of its 128 x 128 blocks (FP8)."""
    from dspark.ops.fp8 import scale_grid
    c = shape.trunk
    d, I, b = c.d_model, c.expert_hidden, shape.proj_bytes()
    scales = sum(int(np.prod(scale_grid(K, N))) for K, N in ((d, 2 * I), (I, d))) if shape.fp8 else 0
    return 3 * d * I * b + 4 * scales


def moe_report(table_of: dict[str, Shape], dev: Device, batches=(1, 2), contexts=(8192, 32768)) -> str:
    """Qwen3.5-35B-A3B, bf16 and FP8 (MOE_SHAPES), under each routing model (ROUTINGS): the plain
    step and the verify at each width 2..8, with the distinct experts per layer its rows read and
    those experts' bytes over the verify; then, per named acceptance curve and routing model, the
    width of most tokens per unit of round time (as verify="gain" chooses it), its time per token,
    and width 8's beside it."""
    base = table_of[MOE_SHAPES[0]]
    c = base.trunk
    moe_layers = c.ffn_kinds.count("moe")
    rows, widths = [], []
    for name in MOE_SHAPES:
        weights = "fp8" if table_of[name].fp8 else "bf16"
        for routing in ROUTINGS:
            shape = dataclasses.replace(table_of[name], routing=routing)
            for B in batches:
                for ctx in contexts:
                    rounds = {w: spec_round(shape, B, ctx, w, dev) for w in range(2, 9)}
                    plain = rounds[8].plain_time()
                    for w, r in rounds.items():
                        D = distinct_experts(shape, B * w)
                        verify = r.verify_pass()
                        rows.append([weights, routing, str(B), str(r.context), str(w), str(D),
                                     f"{moe_layers * D * expert_bytes(shape) / 1e6:,.1f}", us(r.gpu_floor(verify)),
                                     us(r.gpu(verify)), f"{r.gpu(verify) / r.gpu(r.plain):.2f}",
                                     us(r.gpu_floor(r.plain)), us(plain)])
            for label, mean, drafts in ACCEPTANCE_CURVES:
                for B in batches:
                    ctx = contexts[0]
                    rounds = {w: spec_round(shape, B, ctx, w, dev) for w in range(2, 9)}
                    per_token = {w: r.time() / curve_tokens(mean, drafts, w) for w, r in rounds.items()}
                    best = min(per_token, key=per_token.get)
                    widths.append([label, weights, routing, str(B), str(rounds[best].context), str(best),
                                   f"{curve_tokens(mean, drafts, best):.2f}", f"{per_token[best] * 1e3:.2f}",
                                   f"{per_token[8] * 1e3:.2f}", f"{rounds[8].plain_time() * 1e3:.2f}"])
    routings = "; ".join(f"{name}: {src}" for name, (_, src) in ROUTINGS.items())
    return "\n".join([
        f"{base.label} on {dev.name} ({base.source}): {moe_layers} MoE layers of {c.experts} experts, top-{c.expert_top_k}, "
        f"{c.expert_hidden} wide, and a shared expert; bf16, and its FP8 release ({table_of[MOE_SHAPES[1]].source}: "
        f"experts moe_linear_fp8_bf16_m<BM>, priced as compiled); rounds greedy, passes replayed from CUDA graphs",
        f"routing models: {routings}",
        table(MOE_HEADERS, rows),
        "experts/layer: distinct experts the verify's rows read in each MoE layer; expert MB: their weights over the "
        "verify (read once each, dspark.ops.moe.grouped_plan's CTA map; FP8: a byte a weight and the f32 block "
        "scales); verify/plain: the verify pass over a plain step (expected GPU time); plain floor us and plain us: "
        "a plain decode step's GPU floor and its expected time with the host's",
        "",
        table(WIDTH_HEADERS, widths),
        "gain width: the width of least time per token under the curve (what verify=\"gain\" chooses from the "
        "same curve and these costs); the curves are geometric per position through published mean accepted "
        "lengths of other pairs, and ours: none is this pair's, none a target"])


def sass_path(entry: str) -> str:
    """Instructions a warp issues per iteration on its main loop's path, or "-" without cuobjdump."""
    import sass
    try:
        return str(sass.issue(entry).path)
    except FileNotFoundError:
        return "-"


def fp8_pairs(table_of: dict[str, Shape]) -> list[tuple[str, str]]:
    """(FP8 shape, its bf16 twin) for every FP8 shape the model knows."""
    return [(name, name.replace("-fp8", "")) for name, s in table_of.items() if s.fp8]


def fp8_report(table_of: dict[str, Shape], dev: Device, batches=(1, 2), contexts=(8192, 32768)) -> str:
    """The FP8 releases beside their bf16 twins (issue: half the weight bytes): a plain step, verify
    over plain and the round (8 columns), each as floor and expected; the FP8 round over the bf16
    round of the same shape, and what bounds the FP8 GEMMs from below (their largest limiter,
    summed over the round); then time per output token at the published accepted lengths."""
    rows, tpot = [], []
    for fp8, bf16 in fp8_pairs(table_of):
        s, t = table_of[fp8], table_of[bf16]
        for B in batches:
            for ctx in contexts:
                r, b = spec_round(s, B, ctx, 8, dev), spec_round(t, B, ctx, 8, dev)
                gemms = [k for k in r.kernels if k.entry.startswith(("linear_fp8", "moe_linear_fp8"))]
                floors = {lim: sum(k.limits[lim] for k in gemms) for lim in LIMITERS}
                bound = max(floors, key=floors.get)
                rows.append([s.label, str(B), str(r.context), us(r.gpu_floor(r.plain)), us(r.plain_time()),
                             f"{r.gpu(r.verify_pass()) / r.gpu(r.plain):.3f}", us(r.floor()), us(r.time()),
                             f"{r.time() / b.time():.2f}", f"{r.floor() / b.floor():.2f}",
                             f"{sum(k.time for k in gemms) * 1e6:,.0f} us", f"{bound} {floors[bound] * 1e6:,.0f} us"])
                drafter = next((k for k in PUBLISHED_ACCEPTED if fp8.endswith(k)), None)
                for acc, vt, source in PUBLISHED_ACCEPTED.get(drafter, ()) + (EMBEDDED_ACCEPTED,):
                    rt = r if vt == 8 else spec_round(s, B, ctx, vt, dev)
                    tpot.append([s.label, str(B), str(rt.context), f"{acc:g}", str(vt), source,
                                 f"{rt.plain_time() * 1e3:.2f}", f"{rt.time() / acc * 1e3:.2f}",
                                 f"{rt.floor() / acc * 1e3:.2f}", f"{rt.speedup(acc):.2f}x"])
    return "\n".join([
        f"FP8 releases on {dev.name}: decoder-layer linears e4m3 + a scale per 128 x 128 block (linear_fp8_bf16_m<BM>, "
        f"priced as compiled); embedding, LM head, gdn a|b and the drafter 16-bit; passes replayed from CUDA graphs",
        table(FP8_HEADERS, rows),
        "fp8/bf16 round: the FP8 round's expected time over the bf16 twin's (same configs, same drafter); (floors): "
        "their floors' ratio; fp8 GEMMs: the FP8 GEMMs' (and FP8 experts' grouped products') expected time in the "
        "round and their floor (the largest limiter, summed)",
        "the main loop as compiled, per warp and iteration (profiling/sass.py; an iteration's rows of K in "
        "brackets): " + ", ".join(f"{e} {sass_path(e)} [{plan(16 if e.endswith('m16') else 128, 5120, 5120, bm=bm).bk}]"
                                  for e, plan, bm in (("linear_mma_bf16_m16", linear_ops.mma_plan, 16),
                                                      ("linear_fp8_bf16_m16", linear_ops.fp8_plan, 16),
                                                      ("linear_fp8_bf16_m128", linear_ops.fp8_plan, 128)))
        + " instructions on its path: the in-register e4m3 decode, scale and bf16 rounding is what the FP8 "
        "GEMMs' expected time is made of where it exceeds their DRAM floor",
        "",
        table(TPOT_HEADERS, tpot),
        "ms/token: a round's time over the accepted length (spec), a plain step (plain); accepted lengths are "
        "published figures or the embedded pair's, never targets"])



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", choices=list(shapes()), default=list(shapes()))
    ap.add_argument("--batch", nargs="+", type=int, default=[1])
    ap.add_argument("--context", nargs="+", type=int, default=[32768])
    ap.add_argument("--width", type=int, default=8, help="verify columns per session (anchor + drafts)")
    ap.add_argument("--accepted", type=float, default=4.97, help="mean accepted length for the speedup")
    ap.add_argument("--rollback", choices=("checkpoint", "replay"), default="checkpoint")
    ap.add_argument("--drafter-window", type=int, default=4096)
    ap.add_argument("--kernels", action="store_true", help="also every kernel of each round")
    ap.add_argument("--launch-us", type=float, default=None,
                    help=f"host cost of one launch of the plain path, us (default {H200.launch * 1e6:.1f}: "
                         "profiling/launch_cost.py)")
    ap.add_argument("--launches", choices=MODES, default="graph",
                    help="how the summary's rounds reach the device (dspark.graphs; default: graph)")
    ap.add_argument("--graph-node-us", type=float, default=None,
                    help=f"GPU time per node of a replayed graph, us (default {H200.graph_node * 1e6:.1f})")
    ap.add_argument("--prompt", action="store_true",
                    help="instead: time to first token, the plain batched decode step, memory per session")
    ap.add_argument("--prompt-chunk", type=int, default=PROMPT_CHUNK, help="tokens per prompt pass (--prompt)")
    ap.add_argument("--fp8", action="store_true",
                    help="instead: the FP8 releases beside their bf16 twins at B 1, 2 and 8k, 32k, and time per token "
                         "at published accepted lengths")
    ap.add_argument("--moe", action="store_true",
                    help="instead: Qwen3.5-35B-A3B's (bf16 and FP8) plain step and verify at widths 2..8 under each "
                         "routing model, and the width each acceptance curve chooses")
    ap.add_argument("--prior-table", action="store_true",
                    help="instead: write the cost model's prior on cuda (dspark/cost_prior_h200.json, every shape) "
                         "and print its round and verify in plain steps")
    a = ap.parse_args(argv)
    if a.width < 1 or any(b < 1 for b in a.batch) or any(c < 1 for c in a.context) or a.prompt_chunk < 1:
        ap.error("--width, --batch, --context and --prompt-chunk must be >= 1")
    if any(x is not None and x < 0 for x in (a.launch_us, a.graph_node_us)):
        ap.error("--launch-us and --graph-node-us must be >= 0")
    d = H200
    if a.launch_us is not None:
        d = dataclasses.replace(d, launch=a.launch_us * 1e-6)
    if a.graph_node_us is not None:
        d = dataclasses.replace(d, graph_node=a.graph_node_us * 1e-6)
    if a.prior_table:
        from dspark.cost_prior import TABLE
        tab = prior_table(shapes(a.drafter_window), d)
        TABLE.write_text(json.dumps(tab, separators=(",", ":")) + "\n")
        print(f"{TABLE.name}: {len(tab['entries'])} shapes, {TABLE.stat().st_size / 1e3:.0f} kB; predictions of the "
              f"performance model ({d.name}, rounds greedy, passes replayed from CUDA graphs)")
        print(prior_report(tab))
        return 0
    if a.prompt:
        print(prompt_report(shapes(a.drafter_window), a.prompt_chunk, a.kernels, d, a.launches))
        return 0
    if a.fp8:
        print(fp8_report(shapes(a.drafter_window), d))
        return 0
    if a.moe:
        print(moe_report(shapes(a.drafter_window), d))
        return 0
    table_of = shapes(a.drafter_window)
    cases = [(table_of[m], b, ctx) for m in a.model for b in a.batch for ctx in a.context]
    rounds = [spec_round(sh, b, ctx, a.width, d, rollback=a.rollback, mode=a.launches) for sh, b, ctx in cases]
    print(f"{d.name} (assumed rates: pricing.Device): copy {d.bw / 1e12:.1f} TB/s (data sheet {d.dram_peak / 1e12:.1f}), "
          f"L2 {d.l2_bw / 1e12:.1f} TB/s, bf16 MMA {d.mma / 1e12:.0f} TFLOP/s (data sheet {d.mma_peak / 1e12:.0f}), f32 issue "
          f"{d.f32_issue / 1e12:.1f} T instr/s ({d.f32 / 1e12:.0f} TFLOP/s as FMAs), sync {d.sync * 1e6:.0f} us, "
          f"{d.sms} SMs; code as compiled for {d.arch} by {compiled_kernels(d.arch, d.nvrtc)[0]}; GEMMs linear_f32 / "
          f"linear_mma (weights read as stored); rollback {a.rollback}; speedup at mean accepted length {a.accepted}")
    print(f"host per launch: plain {d.launch * 1e6:.1f} us (profiling/launch_cost.py), eager {d.host_eager * 1e6:.1f} us "
          f"+ CuPy {d.cupy_launch * 1e6:.0f} us; graph: {d.host_graph_round * 1e6:.0f} us a round "
          f"(profiling/host_round.py) + CuPy {d.graph_launch * 1e6:.0f} us a graph launch, {d.graph_node * 1e6:.1f} us a "
          f"node on the GPU; uploads {d.cupy_copy * 1e6:.0f} us; the summary's rounds: {a.launches}")
    for m in a.model:
        dc = table_of[m].drafter
        ring = max(w or table_of[m].trunk.max_ctx for w in dc.windows()) + dc.block
        print(f"  {table_of[m].label}: {table_of[m].source}; draft KV {ring} rows, "
              f"{2 * dc.layers * dc.kv_heads * ring * dc.head_dim * F32 / 1e6:,.1f} MB per session (f32)")
    print(table(SUMMARY_HEADERS, summary_rows(rounds, a.accepted, d)))
    print("floor: the kernels' floors (each its largest limiter) added; us: expected (docs/performance.md); attn of "
          "copy: the verify attention kernel's K/V + q + out bytes over its expected time, as a share of the copy "
          "bandwidth; verify/plain: the trunk verify pass over a plain decode step (expected GPU time); weights .. "
          f"other: the round's kernels by what they move; overhead: launches and host as `{a.launches}` issues them, "
          "2 syncs")
    print("\nlaunch and host overhead by how the passes reach the device (plain decode step and speculative round):")
    print(table(MODE_HEADERS, mode_rows(cases, a, d)))
    print("\nrecurrent state and K/V moved per round (a full accept; the kinds dspark.profile counts):")
    moves = []
    for r in rounds:
        m = round_moves(r.shape, [r.vt] * r.B, [r.vt] * r.B, a.rollback)
        row = [r.shape.label, str(r.B), str(r.vt)] + [f"{m[k] / 1e6:,.3f}" for k in m] + [f"{sum(m.values()) / 1e6:,.3f}"]
        if row not in moves:  # the same at every context
            moves.append(row)
    print(table(["shape", "B", "vt", "state MB", "checkpoints MB", "rollback MB", "kv_commit MB", "total MB"], moves))
    if a.kernels:
        for r in rounds:
            print(f"\n{r.shape.label} B={r.B} context={r.context} vt={r.vt}: round floor {us(r.floor())} us, "
                  f"expected {us(r.time())} us, plain step {us(r.plain_time())} us")
            print(table(KERNEL_HEADERS, kernel_rows(r)))
            print(share_summary(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
