"""The `dspark` command line (also `python -m dspark`)."""

from __future__ import annotations

import argparse
import sys

from . import __version__
from .backends import backends, cuda_available, get_backend
from .errors import DsparkError


def cmd_info(args) -> int:
    print(f"dspark {__version__}")
    avail = backends()
    print(f"backends: {', '.join(avail)} (default: {get_backend().name})")
    if cuda_available():
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        print(f"device: {props['name'].decode()} (sm_{props['major']}{props['minor']}, "
              f"{props['totalGlobalMem'] / 2**30:.0f} GiB)")
    else:
        print("device: no CUDA GPU; kernels run on the CPU through the simt backend")
    if "simt" in avail:
        be = get_backend("simt")
        names = sorted(be.kernels.signatures)
        families = sorted({s.source for s in be.kernels.signatures.values()})
        print(f"compiled kernels (simt{', ASan' if be.kernels.asan else ''}): {len(names)} entry points "
              f"in {len(families)} families: {', '.join(families)}")
        for fam in families:
            entries = [n for n in names if be.kernels.signatures[n].source == fam]
            print(f"  {fam}: {', '.join(entries)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dspark", description="DSpark speculative decoding on hybrid models")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="backends, device, compiled kernels").set_defaults(run=cmd_info)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        return args.run(args)
    except DsparkError as e:
        print(f"dspark: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
