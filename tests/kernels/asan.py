"""Run a snippet in a child process on the AddressSanitizer build of the simt backend."""

import subprocess
import sys
import textwrap

from dspark.backends.simt_build import asan_env

PRELUDE = """
import numpy as np, dspark
be = dspark.get_backend("simt")
assert be.kernels.asan, "not the ASan build"
"""


def run_asan(script: str, families: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    """Run PRELUDE + script (with `be` the simt backend); families limits the build to those
    csrc/*.cu files so the instrumented compile stays quick."""
    env = asan_env(families=families)
    code = PRELUDE + textwrap.dedent(script)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


def assert_clean(r: subprocess.CompletedProcess) -> None:
    """The child finished and ASan reported nothing."""
    assert "AddressSanitizer" not in r.stderr, r.stderr[-4000:]
    assert r.returncode == 0, r.stderr[-4000:]
