"""Performance model of a speculative round on an H200: bytes, FLOPs, CTAs and waves per kernel,
the predicted time of each, the round's composition and the spec/plain speedup.

    python profiling/perf_model.py                     # the table in RESULTS.md: three shapes, B=1, 32k, 8 columns
    python profiling/perf_model.py --model qwen3.5-27b --batch 1 2 32 --context 4096 32768 --width 8 --kernels
    python profiling/perf_model.py --accepted 5.9      # the speedup at another mean accepted length
    python profiling/perf_model.py --prompt [--kernels] # time to first token, plain batched decode, memory

Shapes (SHAPES): the embedded pair (dspark/models/default), Qwen3-8B and Qwen3.5-27B with their
Hugging Face `config.json` numbers (Qwen/Qwen3-8B: hidden 4096, 36 layers, 32 query / 8 kv heads
of 128, MLP 12288, vocabulary 151936, untied; Qwen/Qwen3.5-27B text_config: hidden 5120, 64
layers [linear_attention x 3, full_attention] x 16, 24 query / 4 kv heads of 256 with the output
gate and partial RoPE 0.25, gdn 48 value / 16 key heads of 128, MLP 17408, vocabulary 248320,
untied), stored bf16 as on the `cuda` backend. Their drafter is not part of those configs: the
model uses a one-layer DSpark drafter of the target's widths, block 8, a 4096-row window, rank-32
Markov head (--drafter-window changes the window).

Device (issue 16): copy bandwidth 4.3 TB/s, bf16 MMA 790 TFLOP/s, 4 us per launch, 132 SMs; and,
beyond those, from NVIDIA's H200 data sheet: f32 CUDA-core math 67 TFLOP/s (the gdn scan, the
reductions, and the GEMM kernel's f32 multiply-adds), 228 KiB shared memory, 2048
threads and 32 CTAs per SM, 50 MB L2.

Kernel time. dspark's kernels are priced from their own launch plans (dspark.ops.attention.
launch_plan, the row-split plans of dspark.ops.argmax / sampling, dspark.ops.linear.linear_plan,
dspark.ops.gdn.scan_plan and scan_bytes, the norm, commit and select grids): each CTA moves its
bytes at its SM's share of the copy bandwidth (BW / 132 / CTAs resident per SM, from threads and
shared memory; fewer CTAs than SMs get an SM each), CTAs go longest first to the slot that
frees first (the attention kernel dispatches each row's splits last-first), and the memory time is
the last slot's finish, so waves and imbalance both show; the math time is flops / (rate x the
share of SMs busy); the kernel's time is the larger. CuPy's elementwise ops
have no plan of ours: they are priced at the roofline (bytes / BW, flops / rate). The GEMMs are
dspark.ops.linear's kernel: one launch per projection, the weights at their stored width (bf16: 2
bytes) once per 16 rows, x once per column tile and the K splits' partials written and read back
(all priced at the copy bandwidth, though x and the partials mostly come from L2), f32 math on the
CUDA cores; its residency counts threads and shared memory, not its ~186 registers.

The prompt pass (--prompt) is priced from what the tensor-core kernels compile to: occupancy from
profiling/ptxas_report.md (registers, shared memory), the MMAs at the mma.sync ceiling (MMA_SYNC_SHARE
of the 790 TFLOP/s wgmma rate), bytes at the copy bandwidth (a prompt GEMM's waves read their tiles
from DRAM once, L2 keeps them), launches at the host cost: time to first token for Qwen3.5-27B at 8k
and 32k and Qwen3-8B at 8k, the plain batched decode step at B = 1, 8, 32 (4k context), the B = 1
verify/plain ratio with the GEMMs so priced, and the memory one session holds at 32k and 128k.

Launches are not in a kernel's time: each costs 4 us of host time (dspark kernels from the plans,
CuPy array ops from per-layer counts made on the CuPy contract path, LAUNCH_GLUE), listed with the
round's two synchronisations as "overhead". Predicted round time = GPU time + overhead (no
overlap assumed). Speedup = mean accepted length x plain step time / round time.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts, also when run by `dspark bench`
from dspark.dtypes import BF16
from dspark.models.config import TrunkConfig, from_json
from dspark.models.drafter_config import DrafterConfig
from dspark.ops import argmax as argmax_ops
from dspark.ops import gdn as gdn_ops
from dspark.ops import linear as linear_ops
from dspark.ops import gdn_chunk as chunk_ops
from dspark.ops import norm as norm_ops
from dspark.ops import snapshot as snapshot_ops
from dspark.models.cache import cache_bytes
from dspark.ops.attention import TILE, launch_plan
from dspark.ops.kv_commit import THREADS as COMMIT_THREADS
from dspark.ops.kv_commit import commit_bytes
from dspark.params import PROMPT_CHUNK

import ptxas_report
from timing import table

F32 = 4


@dataclasses.dataclass(frozen=True)
class Device:
    name: str = "H200"
    bw: float = 4.3e12             # copy bandwidth, bytes/s (read + write)
    mma: float = 790e12            # bf16 tensor-core FLOP/s
    f32: float = 67e12             # f32 CUDA-core FLOP/s
    launch: float = 4e-6           # host cost of one launch, s
    sync: float = 10e-6            # one device->host wait (a copy of a few bytes), s
    sms: int = 132
    smem: int = 228 * 1024
    threads: int = 2048
    ctas: int = 32
    l2: int = 50 * 10**6


H200 = Device()


# ---- shapes ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shape:
    label: str
    trunk: TrunkConfig
    drafter: DrafterConfig
    weight_bytes: int       # storage bytes per matrix element (2: bf16)
    source: str


def _default_configs() -> tuple[TrunkConfig, DrafterConfig]:
    d = Path(__file__).resolve().parents[1] / "dspark" / "models" / "default"
    return from_json(d / "trunk.json", TrunkConfig), from_json(d / "drafter.json", DrafterConfig)


def _drafter_for(t: TrunkConfig, window: int) -> DrafterConfig:
    return DrafterConfig(block=8, window=window, d_model=t.d_model, layers=1, heads=t.attn_heads,
                         kv_heads=t.attn_kv_heads, head_dim=t.head_dim, mlp_hidden=t.mlp_hidden, markov_rank=32)


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
    return {
        "embedded": Shape("embedded pair", trunk, drafter, 4, "dspark/models/default/{trunk,drafter}.json"),
        "qwen3-8b": Shape("Qwen3-8B", q3, _drafter_for(q3, drafter_window), 2, "Qwen/Qwen3-8B config.json"),
        "qwen3.5-27b": Shape("Qwen3.5-27B", q35, _drafter_for(q35, drafter_window), 2,
                             "Qwen/Qwen3.5-27B config.json (text_config)"),
    }


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
    ctas: int               # 0: not ours (cuBLAS, CuPy), priced at the roofline
    waves: int
    time: float
    launches: int
    min_bytes: int = 0      # what any implementation must move (attention: K/V, q, out once)


def resident(threads: int, smem: int, dev: Device) -> int:
    """CTAs of a kernel resident on one SM."""
    n = min(dev.ctas, dev.threads // max(threads, 1))
    return max(1, min(n, dev.smem // smem) if smem else n)


def priced(cta_bytes, flops: float, per_sm: int, dev: Device, rate: float) -> tuple[float, int]:
    """(time, waves) of a kernel whose CTAs move cta_bytes each: longest first onto SMs x per_sm
    slots, each slot streaming at BW / slots; math at `rate` over the busy share of the SMs."""
    loads = np.sort(np.asarray(cta_bytes, np.float64))[::-1]
    n = loads.size
    if n == 0:
        return 0.0, 0
    waves = math.ceil(n / (dev.sms * per_sm))
    per_sm = min(per_sm, math.ceil(n / dev.sms))  # a few CTAs spread one per SM, each with its SM's share
    slots = dev.sms * per_sm
    if n <= slots:
        finish = float(loads[0])
    else:
        heap = [0.0] * slots
        for b in loads:
            heapq.heappush(heap, heapq.heappop(heap) + float(b))
        finish = max(heap)
    busy = min(1.0, n / dev.sms)
    return max(finish / (dev.bw / slots), flops / (rate * busy)), waves


def planned(phase, name, kind, cta_bytes, flops, threads, smem, dev, rate=None, launches=1, min_bytes=0) -> Kernel:
    per_sm = resident(threads, smem, dev)
    t, waves = priced(cta_bytes, flops, per_sm, dev, dev.f32 if rate is None else rate)
    return Kernel(phase, name, kind, int(np.sum(cta_bytes)), int(flops), int(np.size(cta_bytes)), waves, t, launches,
                  min_bytes)


def roofline(phase, name, kind, nbytes, flops, dev, rate=None, launches=1) -> Kernel:
    t = max(nbytes / dev.bw, flops / (dev.f32 if rate is None else rate))
    return Kernel(phase, name, kind, int(nbytes), int(flops), 0, 0, t, launches)


def even(total: float, ctas: int) -> np.ndarray:
    return np.full(max(ctas, 0), total / max(ctas, 1))


# ---- GEMMs (dspark.ops.linear) ---------------------------------------------------------------------------
def linear(phase, name, rows, k, n, wb, dev, kind="weights") -> list[Kernel]:
    """The GEMM of [rows, K] @ [K, N] stored with wb bytes per element, from its launch plan
    (dspark.ops.linear.linear_plan): one launch, the weights at their stored width once per row
    tile, and the K-split partials written and read back by the last CTA of each column tile. f32
    weights: linear_f32, f32 math on CUDA cores; 16-bit: linear_mma, the MMAs' executed flops
    (padded tiles) at the tensor-core rate."""
    p = linear_ops.linear_plan(rows, k, n, wb)
    (run,) = p.launches
    mma = "mma_flops" in p.notes
    return [planned(phase, name, kind, even(p.bytes, run.ctas), p.notes["mma_flops" if mma else "flops"], run.threads,
                    run.shared_mem, dev, rate=dev.mma if mma else None, min_bytes=p.min_bytes)]


# ---- the trunk pass ---------------------------------------------------------------------------------------
def trunk_pass(shape: Shape, B: int, context: int, cols: int, dev: Device, *, verify: bool,
               rollback="checkpoint", gemm=None) -> list[Kernel]:
    """Every kernel of one trunk pass over `cols` columns per session at `context` committed rows:
    a verify (the state read, not written; per-column checkpoints) or a plain decode step (cols 1,
    state written, K/V committed). `gemm` prices the GEMMs (default `linear`)."""
    c, wb, out = shape.trunk, shape.weight_bytes, []
    linear_ = linear if gemm is None else gemm
    ph = "verify" if verify else "decode"
    rows, d = B * cols, c.d_model
    kv_isz = np.dtype(BF16 if c.kv_dtype == "bfloat16" else c.kv_dtype).itemsize
    attn_layers, gdn_layers = c.layers.count("attn"), c.layers.count("gdn")
    nq = c.attn_heads * c.head_dim * (2 if c.attn_gate else 1)
    nkv = c.attn_kv_heads * c.head_dim
    H, dk, dv, C = c.gdn_heads, c.gdn_dk, c.gdn_dv, c.gdn_channels

    def norm(name, n_rows, n, launches=1):
        return rmsnorm_kernel(ph, name, n_rows, n, dev, launches)

    for kind, count in (("attn", attn_layers), ("gdn", gdn_layers)):
        if not count:
            continue
        layer = [norm("rmsnorm x2", 2 * rows, d, 2)]
        if kind == "attn":
            layer += linear_(ph, "attn q|k|v", rows, d, nq + 2 * nkv, wb, dev)
            if c.qk_norm:
                layer.append(norm("q/k norm", rows * (c.attn_heads + c.attn_kv_heads), c.head_dim, 2))
            plan = launch_plan([cols] * B, [context] * B, hq=c.attn_heads, hkv=c.attn_kv_heads, head_dim=c.head_dim,
                               dtype=BF16 if kv_isz == 2 else np.float32)
            layer += attention_kernels(ph, plan, dev)
            layer += linear_(ph, "attn o", rows, c.attn_heads * c.head_dim, d, wb, dev)
        else:
            layer += linear_(ph, "gdn in", rows, d, C + H * dv + 2 * H, wb, dev)
            layer += scan_kernels(ph, c, B, rows, dev, checkpoints=verify and rollback == "checkpoint",
                                  commit=not verify)
            layer.append(norm("gdn o_norm", rows * H, dv))
            layer += linear_(ph, "gdn out", rows, H * dv, d, wb, dev)
        layer += linear_(ph, "mlp gate|up", rows, d, 2 * c.mlp_hidden, wb, dev)
        layer += linear_(ph, "mlp down", rows, c.mlp_hidden, d, wb, dev)
        out += scaled(layer, count, f"x{count} {kind} layers")
    out.append(norm("final norm", rows, d))
    out += linear_(ph, "lm head", rows, d, c.vocab, wb, dev)
    if verify:
        p = argmax_ops.greedy_accept_plan(B, rows, c.vocab)
    else:
        p = argmax_ops.argmax_plan(rows, c.vocab)
    out.append(rowsplit_kernel(ph, p, dev))
    keep = rows if not verify else B * cols  # a full accept commits every column (the worst case)
    if attn_layers:
        out.append(commit_kernel(ph, "kv_commit", B, attn_layers, keep // B, c.attn_kv_heads * c.head_dim * kv_isz, dev))
    return out


def rmsnorm_kernel(phase, name, rows, n, dev: Device, launches=1) -> Kernel:
    """rmsnorm_f32 over `rows` rows of n (in `launches` calls): a warp per row, 8 rows per CTA."""
    ctas = -(-rows // norm_ops.WARPS)
    k = planned(phase, name, "other", even(2 * F32 * rows * n + launches * F32 * n, ctas), 3 * rows * n,
                32 * norm_ops.WARPS, 0, dev)
    k.launches = launches
    return k


def scaled(kernels: list[Kernel], n: int, suffix: str) -> list[Kernel]:
    """The kernels of one layer, for n layers alike: bytes, flops, time and launches times n."""
    return [dataclasses.replace(k, name=f"{k.name} ({suffix})", bytes=k.bytes * n, flops=k.flops * n, time=k.time * n,
                                launches=k.launches * n, min_bytes=k.min_bytes * n) for k in kernels]


def attention_kernels(phase, plan, dev: Device) -> list[Kernel]:
    """The attention op's launches from its plan: the split kernel (each CTA its keys' K and V,
    its items' q, its partials or output) and, when it splits, the combine (partials from L2
    while they fit, the output to memory)."""
    isz = 2 if "bf16" in plan.kernel or "f16" in plan.kernel else 4
    kv = plan.cta_keys * 2 * plan.head_dim * isz
    rest = plan.bytes["q"] + (plan.bytes["partials_written"] if plan.combine_kernel else plan.bytes["out"])
    cta = kv + rest / max(plan.ctas, 1)
    rate = dev.mma if isz == 2 else dev.f32
    min_bytes = plan.bytes["kv"] + plan.bytes["q"] + plan.bytes["out"]
    main = planned(phase, plan.kernel, "kv", cta, plan.flops, plan.block[0], plan.shared_mem, dev, rate=rate,
                   min_bytes=min_bytes)
    if not plan.combine_kernel:
        return [main]
    partials = plan.bytes["partials_read"]
    from_memory = partials if partials > dev.l2 else 0
    ctas = plan.combine_grid[0] * plan.combine_grid[1]
    combine = planned(phase, plan.combine_kernel, "kv", even(from_memory + plan.bytes["out"], ctas), 0,
                      plan.combine_block[0], 0, dev)
    return [main, combine]


def scan_kernels(phase, c: TrunkConfig, B: int, rows: int, dev: Device, *, checkpoints: bool, commit: bool,
                 name="gdn scan") -> list[Kernel]:
    """gdn_conv + gdn_scan of trunk config c's gdn layer (gdn_kernels)."""
    return gdn_kernels(phase, c.gdn_heads, c.gdn_dk, c.gdn_dv, c.gdn_k_heads or None, B, rows, dev,
                       checkpoints=checkpoints, commit=commit, name=name)


def gdn_kernels(phase, H: int, dk: int, dv: int, k_heads, B: int, rows: int, dev: Device, *, checkpoints: bool,
                commit: bool, name="gdn scan") -> list[Kernel]:
    """gdn_conv + gdn_scan from scan_plan and scan_bytes: one CTA per (channel block, session) and
    per (value head, session)."""
    C = gdn_ops.channels(H, dk, dv, k_heads)
    by = gdn_ops.scan_bytes(B, rows, H, dk, dv, k_heads, checkpoints=checkpoints, commit=commit)
    _, threads, smem = gdn_ops.scan_plan(H, dk, dv, k_heads)
    conv_ctas = -(-C // gdn_ops.CONV_THREADS) * B
    conv_bytes = F32 * rows * 2 * C
    conv = planned(phase, f"{name}: conv", "state", even(conv_bytes, conv_ctas), 8 * rows * C, gdn_ops.CONV_THREADS,
                   0, dev)
    scan_state = by["state"] + by["checkpoints"]
    scan = planned(phase, name, "state", even(by["columns"] - conv_bytes + scan_state, H * B),
                   rows * H * 7 * dv * dk, threads, smem, dev)
    return [conv, scan]


def rowsplit_kernel(phase, plan, dev: Device) -> Kernel:
    """A vocabulary reduction from its row-split plan (dspark.ops.rowsplit.Plan)."""
    kernels = []
    for launch in plan.launches:
        share = plan.bytes * launch.ctas / max(plan.ctas, 1)
        kernels.append(planned(phase, plan.op, "other", even(share, launch.ctas), plan.notes.get("flops", 0),
                               launch.threads, launch.shared_mem, dev))
    t = sum(k.time for k in kernels)
    return Kernel(phase, plan.op, "other", int(plan.bytes), int(plan.notes.get("flops", 0)), plan.ctas,
                  max(k.waves for k in kernels), t, len(plan.launches), plan.min_bytes)


def commit_kernel(phase, name, B, layers, keep, row_bytes, dev: Device, kind="kv") -> Kernel:
    """kv_commit_rows: grid (B, layers, 2), each CTA copies one session's kept rows of K or V."""
    return planned(phase, name, kind, even(commit_bytes(layers, B * keep, 1, row_bytes, 1), B * layers * 2), 0,
                   COMMIT_THREADS, 0, dev)


# ---- a round ----------------------------------------------------------------------------------------------
def drafter_pass(shape: Shape, B: int, context: int, dev: Device) -> list[Kernel]:
    """The drafter's block pass (b rows per session over its window), the Markov chain and the
    confidence head, and the ingest of the accepted rows (one layer of K|V and a ring commit)."""
    t, dc, wb = shape.trunk, shape.drafter, shape.weight_bytes
    rows, d, ph = B * dc.block, t.d_model, "draft"
    out = []
    for i in range(dc.layers):
        nq, nkv = dc.heads * dc.head_dim, dc.kv_heads * dc.head_dim
        out.append(rmsnorm_kernel(ph, "drafter norms", 2 * rows, d, dev, 2))
        out += linear(ph, "drafter q|k|v", rows, d, nq + 2 * nkv, F32, dev)
        out.append(rmsnorm_kernel(ph, "drafter q/k norm", rows * ((dc.heads if dc.q_norm else 0) + dc.kv_heads),
                                  dc.head_dim, dev, 2 if dc.q_norm else 1))
        window = dc.windows()[i] or context
        plan = launch_plan([dc.block] * B, [min(context, window + dc.block)] * B, hq=dc.heads, hkv=dc.kv_heads,
                           head_dim=dc.head_dim, dtype=np.float32, mode="block", window=window)
        out += attention_kernels(ph, plan, dev)
        out += linear(ph, "drafter o", rows, nq, d, F32, dev)
        out += linear(ph, "drafter gate|up", rows, d, 2 * dc.mlp_hidden, F32, dev)
        out += linear(ph, "drafter down", rows, dc.mlp_hidden, d, F32, dev)
    out.append(rmsnorm_kernel(ph, "drafter final norm", rows, d, dev))
    out += linear(ph, "drafter lm head (the trunk's)", rows, d, t.vocab, wb, dev)
    nd = dc.drafts
    out.append(rowsplit_kernel("propose", argmax_ops.markov_chain_plan(B, nd, t.vocab, dc.markov_rank), dev))
    if dc.confidence != "none":  # c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b): a GEMM of one column
        feats = d + (dc.markov_rank if dc.confidence == "markov" else 0)
        out += linear("propose", "confidence head", rows, feats, 1, F32, dev, kind="other")
    keep = dc.block  # a full accept ingests every row
    taps = len(dc.taps or t.tap_layers)
    out += linear("ingest", "drafter fc", B * keep, taps * d, d, F32, dev)
    out.append(rmsnorm_kernel("ingest", "drafter fc norm", B * keep, d, dev))
    out += linear("ingest", "drafter k|v", B * keep, d, 2 * dc.kv_heads * dc.head_dim, F32, dev)
    out.append(rmsnorm_kernel("ingest", "drafter k norm", B * keep * dc.kv_heads * dc.layers, dc.head_dim, dev,
                              dc.layers))
    out.append(commit_kernel("ingest", "kv_commit (ring)", B, dc.layers, keep, dc.kv_heads * dc.head_dim * F32, dev))
    return out


def rollback_kernels(shape: Shape, B: int, vt: int, dev: Device, rollback: str) -> list[Kernel]:
    """The state a rollback moves: select copies the kept column's checkpoint into the live state
    (one launch per gdn layer); replay re-scans the kept columns from the live state."""
    c = shape.trunk
    g = c.layers.count("gdn")
    if not g:
        return []
    if rollback == "replay":
        return scaled(scan_kernels("rollback", c, B, B * vt, dev, checkpoints=False, commit=True, name="gdn replay"),
                      g, f"x{g} gdn layers")
    k = select_kernel("rollback", B, c.gdn_heads * c.gdn_dv * c.gdn_dk, c.gdn_channels * gdn_ops.WINDOW, dev)
    return scaled([k], g, f"x{g} gdn layers")


def select_kernel(phase, B: int, state: int, window: int, dev: Device) -> Kernel:
    """checkpoint_select of one gdn layer: grid copy_grid(B, state), each session's column read and
    its live state and window written."""
    tensors, chunks = snapshot_ops.copy_grid(B, state)
    return planned(phase, "checkpoint_select", "state", even(snapshot_ops.select_bytes(B, state, window),
                                                             tensors * chunks), 0, snapshot_ops.COPY_THREADS, 0, dev)


def copy_kernel(phase, sizes, dev: Device) -> Kernel:
    """snapshot_copy_f32 over tensors of `sizes` floats: grid copy_grid(n, largest), read and write."""
    tensors, chunks = snapshot_ops.copy_grid(len(sizes), max(sizes))
    per = np.concatenate([even(2 * F32 * n, chunks) for n in sizes])
    return planned(phase, "snapshot_copy", "state", per, 0, snapshot_ops.COPY_THREADS, 0, dev)


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


# CuPy array ops per pass, counted on the CuPy contract path (tests/profiling/test_perf_model.py
# recounts them): per layer, per pass, and the round's own (draft harvest, confidence, accept,
# commit, ingest). GEMMs are dspark launches (linear_f32, linear_mma_<dt>_m<BM>), none of these.
LAUNCH_GLUE = {"attn": 26, "attn_conventions": 7, "gdn": 17, "pass": 8, "drafter_layer": 23, "round": 30}


def array_ops(shape: Shape, B: int, cols: int, *, verify: bool, round_glue: bool) -> int:
    """CuPy array ops (each a launch on a GPU) of one trunk pass (and of the rest of a round)."""
    c, dc = shape.trunk, shape.drafter
    n = LAUNCH_GLUE["pass"]
    conventions = LAUNCH_GLUE["attn_conventions"] if (c.attn_gate or c.rope_fraction < 1) else 0
    for kind in c.layers:
        n += LAUNCH_GLUE[kind] + (conventions if kind == "attn" else 0)
    if round_glue:
        n += LAUNCH_GLUE["pass"] + dc.layers * LAUNCH_GLUE["drafter_layer"] + LAUNCH_GLUE["round"]
    return n


@dataclasses.dataclass
class Round:
    shape: Shape
    B: int
    context: int
    vt: int
    kernels: list[Kernel]      # every kernel of a spec round
    plain: list[Kernel]        # every kernel of a plain decode step
    launches: int
    plain_launches: int
    syncs: int = 2

    def gpu(self, kernels=None) -> float:
        return sum(k.time for k in (self.kernels if kernels is None else kernels))

    def overhead(self) -> float:
        return self.launches * H200.launch + self.syncs * H200.sync

    def time(self) -> float:
        return self.gpu() + self.overhead()

    def plain_time(self) -> float:
        return self.gpu(self.plain) + self.plain_launches * H200.launch + H200.sync

    def composition(self) -> dict[str, float]:
        """Seconds of the round by what its kernels move; overhead = launches and syncs."""
        out = {k: sum(x.time for x in self.kernels if x.kind == k) for k in KINDS}
        out["overhead"] = self.overhead()
        return out

    def verify_pass(self) -> list[Kernel]:
        return [k for k in self.kernels if k.phase == "verify"]

    def speedup(self, accepted: float) -> float:
        return accepted * self.plain_time() / self.time()


def spec_round(shape: Shape, B: int, context: int, vt: int, dev: Device = H200,
               rollback="checkpoint") -> Round:
    """A greedy round of B sessions at `context` verifying vt columns each (a full accept: every
    column committed and ingested), and a plain decode step of the same sessions. The context is
    capped where the shape's max_ctx leaves room for the columns."""
    context = max(1, min(context, shape.trunk.max_ctx - vt))
    kernels = drafter_pass(shape, B, context, dev)
    kernels += trunk_pass(shape, B, context, vt, dev, verify=True, rollback=rollback)
    kernels += rollback_kernels(shape, B, vt, dev, rollback)
    plain = trunk_pass(shape, B, context, 1, dev, verify=False)
    ours = sum(k.launches for k in kernels if k.ctas)
    launches = ours + array_ops(shape, B, vt, verify=True, round_glue=True)
    plain_launches = sum(k.launches for k in plain if k.ctas) + array_ops(shape, B, 1, verify=False, round_glue=False)
    return Round(shape, B, context, vt, kernels, plain, launches, plain_launches)


# ---- the prompt pass, plain batched decode and memory per session ------------------------------------------
# Priced with what the tensor-core kernels compile to: occupancy from profiling/ptxas_report.md (registers,
# shared memory, threads: ptxas_report.residency), the MMAs at the mma.sync ceiling below, bytes at the copy
# bandwidth, launches at the host cost. Each price names its bound and never goes under it.
MMA_SYNC_SHARE = 2 / 3   # mma.sync's ceiling as a share of Device.mma (the dense bf16 rate wgmma reaches on an
                         # H200): about 527 TFLOP/s; the GPU check measures it (bench_kernels' linear prompt rows)


SM_CLOCK = 1.98e9        # an H200 SM's boost clock, Hz
FMA_LATENCY = 4          # cycles from an fmaf to a dependent one (Ampere, Hopper)
SOLVE_CHAIN = 120 + 32 + 48 + 64  # dependent fmaf of gdn_chunk_prep's solve: the longest diagonal column,
                                  # then M and T_IJ at block distances 1, 2, 3 (csrc/gdn_chunk.cu, chunk_solve)


def mma_sync(dev: Device) -> float:
    """FLOP/s of mma.sync m16n8k16 bf16 with f32 accumulation, the whole device."""
    return MMA_SYNC_SHARE * dev.mma


def occupancy(kernel: str, threads: int, dynamic_smem: int) -> int:
    """CTAs per SM of `kernel` (sm_90) from the ptxas report: registers and shared memory as compiled."""
    return max(1, ptxas_report.residency(kernel, threads, dynamic_smem))


def scheduled(cta_work, rate: float, per_sm: int, dev: Device) -> float:
    """Seconds for CTAs of `cta_work` units each (bytes or flops) at `rate` units/s for the whole
    device: longest first onto 132 x per_sm slots, each slot at rate / slots (waves and imbalance
    show, as in `priced`)."""
    return priced(cta_work, 0, per_sm, dataclasses.replace(dev, bw=rate), rate)[0]


def gemm(phase, name, rows, k, n, wb, dev, kind="weights") -> list[Kernel]:
    """The GEMM at any row count, occupancy priced. 16-bit weights: linear_mma from its plan
    (dspark.ops.linear.mma_plan); the MMAs' executed flops (padded tiles) at the mma.sync ceiling,
    each CTA its slot's share, waves in order. Memory: split mode (few rows) the plan's bytes per
    CTA at its slot's share of the copy bandwidth; fold mode (prompts) what each wave reads from
    DRAM, its group of kMmaGroupRows row tiles of x (f32) and the weight columns of its CTAs (L2
    keeps them while the wave runs), and the output. The larger. f32 weights: `linear`."""
    if wb != 2:
        return linear(phase, name, rows, k, n, wb, dev, kind)
    p, plan = linear_ops.mma_plan(rows, k, n), linear_ops.mma_linear_plan(rows, k, n)
    per_sm = occupancy(f"linear_mma_bf16_m{p.bm}", p.threads, p.shared_mem)
    slots = dev.sms * per_sm
    t_mma = scheduled(even(plan.notes["mma_flops"], p.ctas), mma_sync(dev), per_sm, dev)
    if p.grid_splits == 1:
        group = min(linear_ops.MMA_GROUP_ROWS, p.m_tiles)
        cols = min(p.n_tiles, -(-slots // group))
        waves = -(-p.ctas // slots)
        dram = waves * (group * p.bm * k * 4 + cols * p.bn * k * 2) + rows * n * 4
        t_mem = dram / dev.bw
    else:
        dram = plan.bytes
        t_mem = scheduled(even(dram, p.ctas), dev.bw, per_sm, dev)
    return [Kernel(phase, name, kind, int(dram), int(plan.notes["flops"]), p.ctas, -(-p.ctas // slots),
                   max(t_mma, t_mem), 1, plan.min_bytes)]


def prompt_attention(phase, hq: int, hkv: int, head_dim: int, start: int, rows: int, dev: Device) -> Kernel:
    """attention_prompt (bf16 K/V) over a pass of `rows` query rows after `start` committed ones:
    each CTA's key tiles (64 items x 64 keys x 4 D flops each, the whole tile as the MMAs run it) at
    the mma.sync ceiling, longest CTA first; the K/V of the visible keys once from DRAM (the CTAs'
    re-reads of them from L2), q and out."""
    plan = launch_plan([rows], [start], hq=hq, hkv=hkv, head_dim=head_dim, dtype=BF16)
    per_sm = occupancy(plan.kernel, plan.block[0], plan.shared_mem)
    tiles = -(-plan.cta_keys // TILE)
    t_mma = scheduled(tiles * TILE * 64 * 4 * head_dim, mma_sync(dev), per_sm, dev)
    dram = 2 * ((start + rows) * 2 * hkv + rows * hq) * head_dim + plan.bytes["out"]
    return Kernel(phase, plan.kernel, "kv", int(dram), plan.flops, plan.ctas, -(-plan.ctas // (dev.sms * per_sm)),
                  max(t_mma, dram / dev.bw), 1, int(dram))


def prompt_gdn(phase, H: int, dk: int, dv: int, k_heads, rows: int, dev: Device) -> list[Kernel]:
    """One gdn layer's prompt pass (dspark.ops.gdn_chunk): the conv (a thread per channel and 64
    columns); gdn_chunk_prep, one CTA per
    (chunk, value head), its products at the mma.sync ceiling, its inputs and scratch at the copy
    bandwidth, and its triangular solve's dependent fmaf chain (SOLVE_CHAIN) at the FMA latency per
    wave; and
    gdn_chunk_state, one CTA per (32 state rows, value head) walking the chunks in order: per chunk
    its share of the products at its slot's share of the mma.sync ceiling, waves in series."""
    C = gdn_ops.channels(H, dk, dv, k_heads)
    chunks = -(-rows // chunk_ops.CHUNK)
    conv = planned(phase, "gdn_conv_rows_f32", "state",
                   even(4 * rows * 2 * C, -(-C // chunk_ops.THREADS) * -(-rows // chunk_ops.CONV_COLS)), 8 * rows * C,
                   chunk_ops.THREADS, 0, dev)
    fl = chunk_ops.chunk_flops(H, dk, dv)
    prep_ctas = chunks * H
    per_sm = occupancy(f"gdn_chunk_prep_bf16_dk{dk}", chunk_ops.THREADS, chunk_ops.prep_shared_mem(dk, dv, 2))
    scratch = chunk_ops.scratch_bytes(chunks, H, dk, dv, 2)
    prep_bytes = 4 * rows * (C + 2 * H) + scratch  # x and the gates once (a key head's value heads share them in L2)
    waves = -(-prep_ctas // (dev.sms * per_sm))
    t_prep = max(scheduled(even(chunks * fl["prep"], prep_ctas), mma_sync(dev), per_sm, dev),
                 scheduled(even(prep_bytes, prep_ctas), dev.bw, per_sm, dev)) + waves * SOLVE_CHAIN * FMA_LATENCY / SM_CLOCK
    prep = Kernel(phase, f"gdn_chunk_prep_bf16_dk{dk}", "state", prep_bytes, chunks * fl["prep"], prep_ctas, waves,
                  t_prep, 1, prep_bytes)
    slices = -(-dv // chunk_ops.SLICE)
    walk_ctas = slices * H
    per_sm = occupancy(f"gdn_chunk_state_bf16_dk{dk}", chunk_ops.THREADS, chunk_ops.state_shared_mem(dk, 2))
    slots = dev.sms * per_sm
    waves = -(-walk_ctas // slots)
    per_chunk = fl["state"] / walk_ctas / (mma_sync(dev) / slots)
    walk_bytes = scratch + 4 * rows * H * dv + 3 * 4 * H * dv * dk
    t_walk = max(waves * chunks * per_chunk, walk_bytes / dev.bw)
    walk = Kernel(phase, f"gdn_chunk_state_bf16_dk{dk}", "state", walk_bytes, chunks * fl["state"], walk_ctas, waves,
                  t_walk, 1, walk_bytes)
    return [conv, prep, walk]


def prompt_pass(shape: Shape, start: int, rows: int, dev: Device, *, last: bool) -> list[Kernel]:
    """Every kernel of one prompt pass of `rows` tokens after `start` (one session): per layer the
    norms, the GEMMs (`gemm`), prompt attention or the chunked gdn, and the elementwise glue (CuPy
    array ops: the residual adds, RoPE, the output gate, SwiGLU, the z gate, at the copy bandwidth);
    the last pass's final norm and LM head on its last row."""
    c, wb, out, ph = shape.trunk, shape.weight_bytes, [], "prompt"
    d, F = c.d_model, c.mlp_hidden
    nq = c.attn_heads * c.head_dim * (2 if c.attn_gate else 1)
    nkv = c.attn_kv_heads * c.head_dim
    H, dk, dv, C = c.gdn_heads, c.gdn_dk, c.gdn_dv, c.gdn_channels
    for kind, count in (("attn", c.layers.count("attn")), ("gdn", c.layers.count("gdn"))):
        if not count:
            continue
        layer = [rmsnorm_kernel(ph, "rmsnorm x2", 2 * rows, d, dev, 2)]
        if kind == "attn":
            layer += gemm(ph, "attn q|k|v", rows, d, nq + 2 * nkv, wb, dev)
            if c.qk_norm:
                layer.append(rmsnorm_kernel(ph, "q/k norm", rows * (c.attn_heads + c.attn_kv_heads), c.head_dim, dev, 2))
            layer.append(roofline(ph, "rope, gate (glue)", "other", 4 * rows * 3 * (nq + 2 * nkv), 0, dev))
            layer.append(prompt_attention(ph, c.attn_heads, c.attn_kv_heads, c.head_dim, start, rows, dev))
            layer += gemm(ph, "attn o", rows, c.attn_heads * c.head_dim, d, wb, dev)
        else:
            layer += gemm(ph, "gdn in", rows, d, C + H * dv + 2 * H, wb, dev)
            layer += prompt_gdn(ph, H, dk, dv, c.gdn_k_heads or None, rows, dev)
            layer.append(rmsnorm_kernel(ph, "gdn o_norm", rows * H, dv, dev))
            layer.append(roofline(ph, "z gate (glue)", "other", 4 * rows * 3 * H * dv, 0, dev))
            layer += gemm(ph, "gdn out", rows, H * dv, d, wb, dev)
        layer += gemm(ph, "mlp gate|up", rows, d, 2 * F, wb, dev)
        layer.append(roofline(ph, "swiglu, residual adds (glue)", "other", 4 * rows * (3 * F + 6 * d), 0, dev))
        layer += gemm(ph, "mlp down", rows, F, d, wb, dev)
        out += scaled(layer, count, f"x{count} {kind} layers")
    if last:
        out.append(rmsnorm_kernel(ph, "final norm", 1, d, dev))
        out += gemm(ph, "lm head (last row)", 1, d, c.vocab, wb, dev)
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

    def ttft(self, dev: Device = H200) -> float:
        """Time to first token. A pass's launches are asynchronous: the host issues them while the
        GPU runs the ones before, so they cost GPU time only at a wait (each wait: the copy, then one
        launch's issue before the GPU has work again), and where all of them take longer than the
        GPU work (never at these sizes); the tables' uploads before any work; the final fetch."""
        host = self.launches * dev.launch
        return (self.gpu() + self.syncs * (dev.sync + dev.launch) + self.tables * dev.sync
                + max(0.0, host - self.gpu()) + dev.sync)


def prompt(shape: Shape, tokens: int, dev: Device = H200, chunk: int = PROMPT_CHUNK) -> Prompt:
    """The prompt pass of one request (dspark.models.trunk.HybridTrunk.prompt_passes). Waits per
    pass (as the code issues them): the token ids, the row pointers, the RoPE positions, the gdn
    chunk schedule, each attention layer's metadata, the last row's index; pointer tables: K and V
    per attention layer, state, conv window, chunk state and tail per gdn layer, the commit table."""
    c = shape.trunk
    attn, gdn = c.layers.count("attn"), c.layers.count("gdn")
    kernels, launches, syncs = [], 0, 0
    for start in range(0, tokens, chunk):
        rows = min(chunk, tokens - start)
        ks = prompt_pass(shape, start, rows, dev, last=start + rows >= tokens)
        kernels += ks
        launches += sum(k.launches for k in ks) + array_ops(shape, 1, rows, verify=False, round_glue=False)
        syncs += attn + 4 + (1 if gdn else 0) + (1 if start + rows >= tokens else 0)
    return Prompt(shape, tokens, chunk, kernels, launches, syncs, 2 * attn + 4 * gdn + 1)


def plain_step(shape: Shape, B: int, context: int, dev: Device = H200) -> float:
    """A plain batched decode step of B sessions at `context`, its GEMMs occupancy priced
    (`gemm`): GPU time plus launches and one sync."""
    ks = trunk_pass(shape, B, context, 1, dev, verify=False, gemm=gemm)
    launches = sum(k.launches for k in ks if k.ctas) + array_ops(shape, B, 1, verify=False, round_glue=False)
    return sum(k.time for k in ks) + launches * dev.launch + dev.sync


def verify_over_plain(shape: Shape, context: int, vt: int, dev: Device = H200) -> float:
    """The B = 1 trunk verify pass over a plain step (GPU time), both occupancy priced (`gemm`)."""
    v = sum(k.time for k in trunk_pass(shape, 1, context, vt, dev, verify=True, gemm=gemm))
    return v / sum(k.time for k in trunk_pass(shape, 1, context, 1, dev, verify=False, gemm=gemm))


def memory_row(shape: Shape, context: int, chunk: int = PROMPT_CHUNK) -> dict:
    """Bytes one session holds at `context` (dspark.models.cache.cache_bytes, bf16 K/V as the
    shape stores it, the chunk tails of the kernel backends; the drafter's ring), the prompt
    pass's largest arrays at `chunk` tokens (activations of the widest layer, the gdn scratch),
    and whether the context is within the model's max_position_embeddings (the shapes' max_ctx)."""
    c, dc = shape.trunk, shape.drafter
    cache = cache_bytes(c, context, chunk_tails="gdn" in c.layers)
    ring = dc.layers * 2 * dc.kv_heads * (min(dc.window or context, context) + dc.block) * dc.head_dim * F32
    widest = max(2 * c.mlp_hidden, c.gdn_channels + c.gdn_heads * c.gdn_dv + 2 * c.gdn_heads if "gdn" in c.layers else 0,
                 c.attn_heads * c.head_dim * 2 + 2 * c.attn_kv_heads * c.head_dim)
    taps = len(c.tap_layers) * c.d_model
    scratch = chunk_ops.scratch_bytes(-(-chunk // chunk_ops.CHUNK), c.gdn_heads, c.gdn_dk, c.gdn_dv, 2) \
        if "gdn" in c.layers else 0
    return {"kv": cache["kv"], "state": cache["state"] + cache["chunk"], "draft_kv": ring,
            "pass": F32 * chunk * (3 * c.d_model + 2 * widest + taps) + scratch,
            "fits": context <= c.max_ctx}


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
        comp = r.composition()
        total = r.time()
        verify = r.gpu(r.verify_pass())
        plain_gpu = r.gpu(r.plain)
        try:
            a = attention_row(r)
            layers = r.shape.trunk.layers.count("attn")
            per_layer = a.time / layers
            att = f"{a.min_bytes / layers / per_layer / dev.bw:.0%}"
        except LookupError:
            att = "-"
        rows.append([r.shape.label, str(r.B), str(r.context), str(r.vt), att, f"{verify / plain_gpu:.3f}",
                     us(plain_gpu), us(verify), us(total)]
                    + [f"{comp[k] / total:.0%}" for k in (*KINDS, "overhead")]
                    + [str(r.launches), f"{r.speedup(accepted):.2f}x"])
    return rows


SUMMARY_HEADERS = ["shape", "B", "context", "vt", "attn of copy", "verify/plain", "plain us", "verify us",
                   "round us", "weights", "kv", "state", "other", "overhead", "launches", "speedup"]


def kernel_rows(r: Round, dev: Device = H200) -> list[list[str]]:
    out = []
    for k in r.kernels:
        frac = f"{(k.min_bytes or k.bytes) / k.time / dev.bw:.0%}" if k.time else "-"
        out.append([k.phase, k.name, k.kind, f"{k.bytes / 1e6:,.2f}", f"{k.flops / 1e9:,.2f}",
                    str(k.ctas) if k.ctas else "-", str(k.waves) if k.ctas else "-", str(k.launches), us(k.time),
                    frac])
    return out


KERNEL_HEADERS = ["phase", "kernel", "kind", "MB", "GFLOP", "CTAs", "waves", "launches", "us", "of copy"]


TTFT_CASES = (("qwen3.5-27b", 8192), ("qwen3.5-27b", 32768), ("qwen3-8b", 8192))
PLAIN_BATCHES, PLAIN_CONTEXT = (1, 8, 32), 4096
MEMORY_CONTEXTS = (32768, 131072)


def prompt_report(table_of: dict[str, Shape], chunk: int, kernels: bool = False, dev: Device = H200) -> str:
    """The --prompt tables: time to first token, the plain batched decode step, memory per session."""
    out = [f"{dev.name}: mma.sync {mma_sync(dev) / 1e12:.0f} TFLOP/s ({MMA_SYNC_SHARE:.2f} of {dev.mma / 1e12:.0f}), "
           f"copy {dev.bw / 1e12:.1f} TB/s, f32 {dev.f32 / 1e12:.0f} TFLOP/s, launch {dev.launch * 1e6:.0f} us; "
           f"occupancy from profiling/ptxas_report.md; prompt passes of {chunk} tokens, bf16 weights and K/V", ""]
    rows, details = [], []
    for model, tokens in TTFT_CASES:
        pr = prompt(table_of[model], tokens, dev, chunk)
        gemms = sum(x.time for x in pr.kernels if x.kind == "weights")
        attn = sum(x.time for x in pr.kernels if x.name.startswith("attention_prompt"))
        gdn = sum(x.time for x in pr.kernels if x.kind == "state")
        flops = sum(x.flops for x in pr.kernels)
        rows.append([table_of[model].label, str(tokens), f"{pr.ttft(dev) * 1e3:,.0f}", f"{gemms * 1e3:,.0f}",
                     f"{attn * 1e3:,.1f}", f"{gdn * 1e3:,.1f}", f"{(pr.gpu() - gemms - attn - gdn) * 1e3:,.1f}",
                     f"{(pr.ttft(dev) - pr.gpu()) * 1e3:,.1f}", f"{pr.launches * dev.launch * 1e3:,.1f}",
                     f"{flops / 1e12:,.0f}",
                     f"{flops / pr.gpu() / mma_sync(dev):.0%}"])
        if kernels:
            details.append((f"{table_of[model].label} {tokens} tokens", pr))
    out.append("TTFT: the prompt passes' GPU time + each wait inside them (10 us + one 4 us launch) + the pointer "
               "tables' uploads + the final fetch; the launches (column: their host time) are issued while the GPU "
               "runs; TFLOP the useful flops; of mma.sync: useful flops / GPU time / the mma.sync ceiling")
    out.append(table(["shape", "prompt", "TTFT ms", "GEMMs ms", "attention ms", "gdn ms", "other ms", "waits ms",
                      "launches ms", "TFLOP", "of mma.sync"], rows))
    out.append("")
    rows = []
    for model in ("qwen3.5-27b", "qwen3-8b"):
        steps = [plain_step(table_of[model], b, PLAIN_CONTEXT, dev) for b in PLAIN_BATCHES]
        rows.append([table_of[model].label, str(PLAIN_CONTEXT)] + [us(t) for t in steps]
                    + [f"{steps[-1] / steps[0]:.2f}", f"{verify_over_plain(table_of[model], PLAIN_CONTEXT, 8, dev):.3f}"])
    out.append("plain step: GPU time + launches x 4 us + one sync, GEMMs occupancy priced (`gemm`); verify/plain: "
               "the B = 1 trunk verify of 8 columns over the plain step, GPU time")
    out.append(table(["shape", "context"] + [f"plain B={b} us" for b in PLAIN_BATCHES]
                     + [f"B={PLAIN_BATCHES[-1]} / B=1", "verify/plain B=1"], rows))
    out.append("")
    rows = []
    for model in ("qwen3.5-27b", "qwen3-8b"):
        for ctx in MEMORY_CONTEXTS:
            m = memory_row(table_of[model], ctx, chunk)
            gib = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
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
        out.append(f"\n{head}: TTFT {pr.ttft(dev) * 1e3:,.1f} ms")
        out.append(table(["phase", "kernel", "kind", "MB", "GFLOP", "CTAs", "waves", "launches", "us"],
                         [[k.phase, k.name, k.kind, f"{k.bytes / 1e6:,.1f}", f"{k.flops / 1e9:,.1f}",
                           str(k.ctas) if k.ctas else "-", str(k.waves) if k.ctas else "-", str(k.launches), us(k.time)]
                          for k in pr.kernels]))
    return "\n".join(out)


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
    ap.add_argument("--prompt", action="store_true",
                    help="instead: time to first token, the plain batched decode step, memory per session")
    ap.add_argument("--prompt-chunk", type=int, default=PROMPT_CHUNK, help="tokens per prompt pass (--prompt)")
    a = ap.parse_args(argv)
    if a.width < 1 or any(b < 1 for b in a.batch) or any(c < 1 for c in a.context) or a.prompt_chunk < 1:
        ap.error("--width, --batch, --context and --prompt-chunk must be >= 1")
    if a.prompt:
        print(prompt_report(shapes(a.drafter_window), a.prompt_chunk, a.kernels))
        return 0
    table_of = shapes(a.drafter_window)
    rounds = [spec_round(table_of[m], b, ctx, a.width, rollback=a.rollback)
              for m in a.model for b in a.batch for ctx in a.context]
    d = H200
    print(f"{d.name}: copy {d.bw / 1e12:.1f} TB/s, bf16 MMA {d.mma / 1e12:.0f} TFLOP/s, f32 {d.f32 / 1e12:.0f} TFLOP/s, "
          f"launch {d.launch * 1e6:.0f} us, sync {d.sync * 1e6:.0f} us, {d.sms} SMs; GEMMs "
          f"linear_f32 / linear_mma (weights read as stored); "
          f"rollback {a.rollback}; speedup at mean accepted length {a.accepted}")
    for m in a.model:
        print(f"  {table_of[m].label}: {table_of[m].source}")
    print(table(SUMMARY_HEADERS, summary_rows(rounds, a.accepted)))
    print("attn of copy: the verify attention kernel's K/V + q + out bytes over its predicted time, as a share of "
          "the copy bandwidth; verify/plain: the trunk verify pass over a plain decode step (GPU time); "
          "weights .. overhead: shares of the round (overhead = launches x 4 us + 2 syncs)")
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
            print(f"\n{r.shape.label} B={r.B} context={r.context} vt={r.vt}: round {us(r.time())} us, "
                  f"plain step {us(r.plain_time())} us")
            print(table(KERNEL_HEADERS, kernel_rows(r)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
