"""The counting build of simt counts each warp-wide shared-memory access's wavefronts as the
hardware serves them (csrc/simt/wavefronts.h): 32 banks of 4-byte words, one word per bank per
wavefront, a word read by many lanes a broadcast, 8- and 16-byte accesses in half- and
quarter-warp phases, ldmatrix a phase per 8x8 matrix. Each case below is counted by hand; the
kernels are csrc/selftest.cu's selftest_bank_read_* and selftest_ldmatrix_rows, one warp each, and
the counting leaves their results as the plain build computes them. The plain build counts
nothing and says so."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dspark.backends.simt_build import counting_env

# (kernel, floats per lane, stride in elements) -> the load's wavefronts, counted by hand. Lane l
# reads element l * stride; its words are w = width l stride .. + width - 1, bank w % 32.
CASES = {
    # 4 bytes: one phase of 32 lanes
    ("b4", 1, 1): 1,    # lane l in bank l: conflict-free
    ("b4", 1, 0): 1,    # every lane the same word: a broadcast
    ("b4", 1, 2): 2,    # words 2 l: lanes l and l + 16 share bank 2 l % 32 with different words: 2-way
    ("b4", 1, 8): 8,    # words 8 l: banks 0, 8, 16, 24, eight words each: 8-way
    ("b4", 1, 32): 32,  # every lane in bank 0
    # 8 bytes: two phases (lanes 0-15, 16-31) of 128 bytes
    ("b8", 2, 1): 2,    # each phase 128 contiguous bytes: one wavefront each
    ("b8", 2, 2): 4,    # words 4 l, 4 l + 1: lanes l and l + 8 of a phase collide: 2 each
    ("b8", 2, 8): 16,   # words 16 l: banks 0-1 and 16-17, eight words each per phase
    # 16 bytes: four phases of 8 lanes
    ("b16", 4, 1): 4,
    ("b16", 4, 2): 8,   # words 8 l .. 8 l + 3: lanes l and l + 4 of a phase collide
    ("b16", 4, 8): 32,  # words 32 l: every lane of a phase in banks 0-3
    # a static __shared__ array, 4 bytes
    ("static", 1, 1): 1,
    ("static", 1, 2): 2,
    ("static", 1, 8): 8,
    # ldmatrix_x4, rows of 16 bytes `stride` floats apart: four matrices of 8 rows, a phase each
    ("ldmatrix", 4, 4): 4,    # each matrix's rows contiguous: 128 bytes, one wavefront
    ("ldmatrix", 4, 8): 8,    # rows 32 bytes apart: rows r and r + 4 share banks: 2 each
    ("ldmatrix", 4, 32): 32,  # rows 128 bytes apart: all eight in banks 0-3
}

CHILD = """
import json
import numpy as np
import dspark

be = dspark.get_backend("simt")
k = be.kernels
assert k.counts_shared_accesses, "not the counting build"
x = np.arange(4096, dtype=np.float32) * 0.5
rows = []
for kernel, width, stride in CASES:
    out = np.full(32 * width, np.nan, np.float32)
    if kernel == "static":
        fn, args, smem = "selftest_bank_read_static", (x, out, np.int32(stride)), 0
    elif kernel == "ldmatrix":
        fn, args, smem = "selftest_ldmatrix_rows", (x, out, np.int32(4096), np.int32(stride)), 4 * 4096
    else:
        fn, args, smem = f"selftest_bank_read_{kernel}", (x, out, np.int32(4096), np.int32(stride)), 4 * 4096
    with k.counting() as counts:
        k.get_function(fn)((1,), (32,), args, shared_mem=smem)
    (c,) = counts
    rows.append({"case": [kernel, width, stride], "kernel": c.kernel, "mma": c.mma,
                 "access": {kind: list(vars(a).values()) for kind, a in c.access.items()},
                 "out": out.view(np.uint32).tolist()})
    k.get_function(fn)((1,), (32,), args, shared_mem=smem)  # not counted: nothing is recorded
    with k.counting() as none:
        pass
    assert none == [], none
print(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def counted() -> dict:
    code = f"CASES = {list(CASES)!r}\n" + textwrap.dedent(CHILD)
    r = subprocess.run([sys.executable, "-c", code], env=counting_env(families=["selftest"]), capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return {tuple(row["case"]): row for row in json.loads(r.stdout.splitlines()[-1])}


@pytest.mark.parametrize("case", list(CASES), ids=lambda c: "-".join(map(str, c)))
def test_wavefronts_are_the_hand_counted_ones(counted, case):
    row = counted[case]
    kind = "ldmatrix" if case[0] == "ldmatrix" else "load"
    requests, wavefronts, ideal = row["access"][kind]
    assert (requests, wavefronts) == (1, CASES[case]), row["access"]
    assert ideal == {1: 1, 2: 2, 4: 4}[case[1]], row["access"]   # the phases, had nothing conflicted
    fills = 1024 if case[0] == "static" else 4096
    assert row["access"]["store"] == [fills // 32] * 3   # lane l stores l, l + 32, ..: conflict-free
    assert row["mma"] == 0 and row["access"]["cp_async"] == [0, 0, 0]


@pytest.mark.parametrize("case", [c for c in CASES if c[0] != "ldmatrix"], ids=lambda c: "-".join(map(str, c)))
def test_counting_leaves_the_results_alone(counted, case):
    kernel, width, stride = case
    x = np.arange(4096, dtype=np.float32) * 0.5
    idx = (np.arange(32) * stride) % 1024 if kernel == "static" else np.arange(32) * stride
    want = np.stack([x[width * i: width * i + width] for i in idx]).ravel() if kernel != "static" else x[idx]
    np.testing.assert_array_equal(np.array(counted[case]["out"], np.uint32).view(np.float32), want)


def test_the_plain_build_refuses_to_count(simt):
    assert not simt.kernels.counts_shared_accesses
    with pytest.raises(RuntimeError, match="does not count shared-memory accesses"):
        with simt.kernels.counting():
            pass
