"""Write profiling/ptxas_report.md: registers, static shared memory, stack and spills of every
kernel entry point, for sm_80 and sm_90, from the ptxas log of the very cubin the `cuda` backend
loads (dspark.toolchain.family_cubin: NVRTC with dspark's options, cached by source, headers,
options, arch and NVRTC version), once per NVRTC major (12 and 13: CUDA 12's wheel, and the
device image's CUDA 13); and, for every tile shape of the GEMMs (the grouped expert product's too),
the attention kernels and the chunked gdn pass, the block, the shared memory its launch plan asks and the CTAs one SM holds
(`perf_model.resident`, the count the performance model prices with: the least of what
registers, shared memory, threads and the CTA slots allow; sm_80 with the A100's 164 KiB).

    python profiling/ptxas_report.py [--out profiling/ptxas_report.md] [--nvrtc 12 13]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from pathlib import Path

from dspark.kernel_sources import kernel_files
from dspark.ops import attention as attention_ops
from dspark.ops import gdn_chunk as chunk_ops
from dspark.ops import linear as linear_ops
from dspark.ops import moe as moe_ops
from dspark.toolchain import ARCHS, NVRTC_OPTIONS, Cubin, Nvrtc, default_nvrtc, family_cubin, find_nvrtc

sys.path.insert(0, str(Path(__file__).parent))
import perf_model as pm  # noqa: E402

MAJORS = (12, 13)
# the SM each arch's CTAs are counted on: an H200's, and an A100's (164 KiB of shared memory)
SMS = {"sm_80": dataclasses.replace(pm.H200, name="A100", smem=164 * 1024, arch="sm_80", sms=108), "sm_90": pm.H200}


def cubins(path: Path, nvrtc: Nvrtc | None = None) -> list[Cubin]:
    """The cubins the report describes, one per arch: the runtime's own."""
    return [family_cubin(path, arch, nvrtc or default_nvrtc()) for arch in ARCHS]


def tile_shapes() -> list[tuple[str, int, int, str]]:
    """(entry point, threads, dynamic shared memory, what it serves) of every tile shape the
    launch plans use: the GEMMs, the attention kernels, the chunked gdn pass (at dv = dk, and at
    Qwen3.5-27B's dk = dv = 128)."""
    out = [("linear_f32", linear_ops.THREADS, 0, "f32 weights, any rows")]
    for bm, (_, _, warps, _) in linear_ops.MMA_CONFIGS.items():
        for dt in ("bf16", "f16"):
            serves = f"16-bit weights, <= {bm} rows" if bm < max(linear_ops.MMA_CONFIGS) else "16-bit weights, prompts"
            out.append((f"linear_mma_{dt}_m{bm}", 32 * warps, linear_ops.mma_shared_mem(bm), serves))
            out.append((f"linear_fp8_{dt}_m{bm}", 32 * linear_ops.FP8_CONFIGS[bm][2], linear_ops.fp8_shared_mem(bm),
                        serves.replace("16-bit", f"FP8 ({dt} activations)")))
            out.append((f"linear_mma_{dt}_swiglu_m{bm}", 32 * warps, linear_ops.mma_shared_mem(bm),
                        serves.replace("16-bit weights", "MLP down, SwiGLU in the stage")))
            out.append((f"linear_mma_{dt}_gated_m{bm}", 32 * warps, linear_ops.mma_shared_mem(bm),
                        serves.replace("16-bit weights", "attention output, its gate in the stage")))
            if bm != 64:
                out.append((f"linear_fp8_{dt}_swiglu_m{bm}", 32 * linear_ops.FP8_CONFIGS[bm][2],
                             linear_ops.fp8_shared_mem(bm), serves.replace("16-bit weights", "FP8 MLP down, SwiGLU in the stage")))
    for bm, (bn, _, warps, _) in linear_ops.MMA_WIDE.items():
        for dt in ("bf16", "f16"):
            out.append((f"linear_mma_{dt}_m{bm}n{bn}", 32 * warps, linear_ops.mma_shared_mem(bm, linear_ops.MMA_WIDE),
                        "16-bit weights, prompts (the wide tile)"))
    for bm, tiles, shape in ((64, linear_ops.MMA_CONFIGS, "m64"), (128, linear_ops.MMA_CONFIGS, "m128"),
                             (128, linear_ops.MMA_WIDE, "m128n256")):
        for dt in ("bf16", "f16"):
            out.append((f"linear_mma_{dt}_a16_{shape}", 32 * tiles[bm][2], linear_ops.mma_shared_mem(bm, tiles),
                        "16-bit weights, prompts over their activations rounded once"))
    out.append(("moe_route_f32", moe_ops.ROUTE_THREADS, 0, "MoE router and grouping"))
    out.append(("moe_linear_f32", linear_ops.THREADS, 0, "grouped experts, f32"))
    for bm in moe_ops.MMA_TILES:
        for kind, what in (("mma", "bf16"), ("fp8", "FP8 (bf16 activations)")):
            for stage, down in (("", ""),) + ((("swiglu_", ", the down product over gate and up"),) if bm == 16 else ()):
                out.append((f"moe_linear_{kind}_bf16_{stage}m{bm}", 32 * linear_ops.MMA_CONFIGS[bm][2],
                            linear_ops.mma_shared_mem(bm),
                            f"grouped experts, {what}{down}, {'<= 16 rows an expert' if bm == 16 else 'prompts'}"))
    for (isz, d), _ in attention_ops.CONFIGS.items():
        dt = {4: ("f32",), 2: ("bf16", "f16")}[isz]
        for name in dt:
            out.append((f"attention_{name}_d{d}", 32 * attention_ops.WARPS, attention_ops.shared_mem_bytes(isz, d),
                        "decode, verify, drafter"))
            for mt, stages in attention_ops.SMALL_CONFIGS.get((isz, d), ()):
                out.append((f"attention_{name}_d{d}_m{mt}s{stages}", 32 * attention_ops.WARPS,
                            attention_ops.shared_mem_bytes(isz, d, mt, stages),
                            "decode, verify, drafter where the shape above does not fit"))
            if isz == 2:
                out.append((f"attention_prompt_{name}_d{d}", attention_ops.PROMPT_THREADS,
                            attention_ops.prompt_shared_mem_bytes(isz, d), "prompt passes"))
    for name in ("f32", "f16", "bf16"):
        out.append((f"attention_combine_{name}", attention_ops.COMBINE_THREADS, 0, "split-parallel merge"))
    for dk in (16, 32, 64, 128):
        for name, isz in (("f32", 4), ("f16", 2), ("bf16", 2)):
            out.append((f"gdn_chunk_prep_{name}_dk{dk}", chunk_ops.THREADS, chunk_ops.prep_shared_mem(dk, dk, isz),
                        f"prompt gdn, dv = {dk}"))
            out.append((f"gdn_chunk_state_{name}_dk{dk}", chunk_ops.THREADS, chunk_ops.state_shared_mem(dk, isz),
                        "prompt gdn"))
    return out


def ctas_per_sm(threads: int, smem: int, regs: int, arch: str) -> int:
    """perf_model.resident on arch's SM, 0 where one CTA does not fit."""
    try:
        return pm.resident(threads, smem, regs, SMS[arch])
    except ValueError:
        return 0


def table(nvrtc: Nvrtc) -> list[str]:
    lines = [
        f"## NVRTC {nvrtc.version[0]}.{nvrtc.version[1]}",
        "",
        "| file | kernel | " + " | ".join(f"{a} regs | {a} smem | {a} stack | {a} spills" for a in ARCHS) + " |",
        "|---|---|" + "---|" * (4 * len(ARCHS)),
    ]
    resources = {}
    for path in kernel_files():
        per_arch = [c.resources() for c in cubins(path, nvrtc)]
        for name in sorted(per_arch[0]):
            cells = []
            for arch, rep in zip(ARCHS, per_arch):
                r = rep[name]
                resources[name, arch] = r
                cells += [str(r.registers), str(r.smem), str(r.stack), f"{r.spill_stores}/{r.spill_loads}"]
            lines.append(f"| {path.name} | `{name}` | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"### Residency of the tile shapes (NVRTC {nvrtc.version[0]}.{nvrtc.version[1]})",
        "",
        "Every GEMM, attention and chunked-gdn tile shape the launch plans use: threads per CTA, the dynamic "
        "shared memory the plan asks (static shared memory above), registers per thread, and the CTAs one SM "
        "holds (`perf_model.resident`: registers in units of 256 per warp from 64 Ki, shared memory plus 1 KiB "
        "per CTA from 164 KiB on sm_80 (A100) and 228 KiB on sm_90, 2048 threads, 32 CTAs; 0: does not launch).",
        "",
        "| kernel | serves | threads | dynamic smem | " + " | ".join(f"{a} regs | {a} CTAs/SM" for a in ARCHS) + " |",
        "|---|---|---|---|" + "---|" * (2 * len(ARCHS)),
    ]
    for name, threads, smem, serves in tile_shapes():
        cells = []
        for arch in ARCHS:
            r = resources[name, arch]
            cells += [str(r.registers), str(ctas_per_sm(threads, r.smem + smem, r.registers, arch))]
        lines.append(f"| `{name}` | {serves} | {threads} | {smem} | " + " | ".join(cells) + " |")
    return lines + [""]


def report(majors=MAJORS) -> str:
    found = [find_nvrtc(m) for m in majors]
    lines = [
        "# ptxas report",
        "",
        f"Generated by `python profiling/ptxas_report.py` on {datetime.date.today()} with NVRTC "
        f"{' and '.join(f'{n.version[0]}.{n.version[1]}' for n in found)} and dspark's options "
        f"`{' '.join(NVRTC_OPTIONS)}`: the cubins the `cuda` backend loads (`dspark.toolchain.family_cubin`), one "
        "table per NVRTC major (the device image's CuPy is built for CUDA 13). Registers per thread, static "
        "shared memory, stack frame and spill bytes (stores/loads) per entry point, then the CTAs per SM of "
        "every tile shape the launch plans use. The compile tests fail on any spill.",
        "",
    ]
    for nv in found:
        lines += table(nv)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("ptxas_report.md"))
    ap.add_argument("--nvrtc", nargs="+", type=int, default=list(MAJORS), metavar="MAJOR")
    args = ap.parse_args()
    args.out.write_text(report(args.nvrtc))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
