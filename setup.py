"""Build dspark: the Python package plus dspark._simt, the csrc/ kernels compiled for the host, and
dspark._cpu, the numpy backend's native code (csrc/cpu)."""

import importlib.util
import shutil
import sys
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension
from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _kernel_sources():
    spec = importlib.util.spec_from_file_location("_ks", ROOT / "dspark" / "kernel_sources.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the file executes
    spec.loader.exec_module(mod)
    return mod


class BuildSimt(build_ext):
    """Generate the per-family registration units and the signature table, then compile."""

    def run(self):
        ks = _kernel_sources()
        gen = Path(self.build_temp) / "simt_gen"
        ks.write_json(ks.scan(ROOT / "csrc"))
        for ext in self.extensions:
            if ext.name == "dspark._simt":
                ext.sources = [str(p) for p in ks.simt_sources(gen, ROOT / "csrc")]
        super().run()
        if not self.inplace:  # a wheel carries the kernel sources for NVRTC (the cuda backend)
            shutil.copytree(ROOT / "csrc", Path(self.build_lib) / "dspark" / "_csrc", dirs_exist_ok=True)


setup(
    name="dspark",
    version="0.1.0",
    description="DSpark-style block-drafter speculative decoding kernels for hybrid language models",
    packages=find_packages(include=["dspark", "dspark.*"]),
    package_data={"dspark": ["_kernels.json", "cost_prior_h200.json", "models/default/*"]},
    python_requires=">=3.10",
    install_requires=["numpy>=1.24", "ml_dtypes>=0.3", "safetensors>=0.4", "nvtx>=0.2.10", "threadpoolctl>=3.1",
                      "tokenizers>=0.21", "tqdm>=4.66"],
    extras_require={
        "cuda12": ["cupy-cuda12x>=13.0", "nvidia-cuda-nvrtc-cu12>=12.0"],
        "cuda13": ["cupy-cuda13x>=13.6", "nvidia-cuda-nvrtc>=13.0"],  # dspark compiles its cubins with NVRTC itself
        # pybind11: the on-demand ASan build of dspark._simt; cupy-cuda12x: the CuPy contract tests (no GPU
        # needed). torch, transformers, dflash and speculators are the oracles of the real-model paths (accelerate:
        # transformers' FP8 integration, which dequantizes FP8 checkpoints on the CPU, needs it). speculators is installed apart with --no-deps (see .ci/run): its
        # own requirements pull a torchvision that breaks the import of transformers beside a CPU torch, so its
        # import-time needs are listed here instead.
        "test": ["pytest>=7.4", "pytest-xdist>=3.5", "hypothesis>=6.90", "nvidia-cuda-nvrtc-cu12>=12.0", "nvidia-cuda-nvrtc>=13.0", "scipy>=1.10",
                 "pybind11>=2.12", "cupy-cuda12x>=13.6", "torch>=2.9", "transformers>=5.15,<=5.19",
                 "tokenizers>=0.21", "accelerate>=1.0", "dflash>=0.1.0", "pydantic>=2.0", "pydantic-settings>=2.0",
                 "loguru>=0.7.2", "openai>=2.0", "hs-connectors>=0.9.0",
                 # cuobjdump and nvdisasm: the performance model reads the cubins' SASS (profiling/sass.py)
                 "nvidia-cuda-cuobjdump>=13.0", "nvidia-cuda-nvdisasm>=13.0"],
        "train": ["torch==2.13.0"],
        "plots": ["matplotlib>=3.8"],  # --plot and profiling/plots.py
        # The site (mkdocs.yml, docs/): MkDocs because the pages are Markdown (they grew out of the README),
        # its strict mode fails on a broken link or anchor, mkdocstrings' cross-references fail on an API
        # name without its entry, and one hooks file generates what must not be copied (option tables,
        # pictures). Material for MkDocs is maintained until May 2027; its successor Zensical reads the
        # same mkdocs.yml. The pictures need matplotlib, and the performance model's the test extra's NVRTC.
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings>=0.26", "mkdocstrings-python>=1.12",
                 "matplotlib>=3.8"],
    },
    ext_modules=[
        Pybind11Extension(
            "dspark._simt",
            sources=["csrc/simt/runtime.cpp"],  # replaced by BuildSimt.run
            include_dirs=["csrc"],
            # -Wno-unknown-pragmas: `#pragma unroll` is for nvcc; the host compiler rightly ignores it.
            extra_compile_args=["-O2", "-DDSPARK_SIMT", "-ffp-contract=off", "-Wno-unknown-pragmas"],
            cxx_std=17,
        ),
        # The numpy backend's native code (csrc/cpu): plain C++, AVX-512 and AVX2 builds of the product picked at
        # run time beside the baseline one; sources and flags in dspark/kernel_sources.py.
        Pybind11Extension(
            "dspark._cpu",
            sources=[f"csrc/{f}" for f in _kernel_sources().CPU_SOURCES],
            extra_compile_args=_kernel_sources().CPU_CXXFLAGS,
            cxx_std=17,
        ),
    ],
    cmdclass={"build_ext": BuildSimt},
    entry_points={"console_scripts": ["dspark=dspark.cli:main"]},
)
