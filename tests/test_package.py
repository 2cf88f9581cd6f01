"""The package's top-level surface: `dspark.backends()` lists the backends, and `dspark.backends`
is still the package, so its submodules import under any spelling."""

import importlib
import subprocess
import sys

import dspark


def test_backends_lists_what_is_available():
    names = dspark.backends()
    assert names[0] == "numpy" and set(names) <= {"numpy", "simt", "cuda"}
    assert dspark.backends.get_backend("numpy").name == "numpy"


def test_backend_submodules_import_as_aliases():
    # `import a.b.c as x` resolves through attribute lookups on `a`: a function named `backends`
    # on `dspark` would make this fail. A fresh interpreter, so no earlier import helps.
    code = "import dspark.backends.launch as launch, dspark.backends.allocator as alloc; print(launch.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "dspark.backends.launch"
    assert importlib.import_module("dspark.backends.allocator").Allocator is dspark.backends.Allocator
