"""profiling/e2e_gate.py as a test: it must print ALL EXACT."""

import importlib.util
import sys
from pathlib import Path

GATE = Path(__file__).resolve().parents[2] / "profiling" / "e2e_gate.py"


def load_gate():
    spec = importlib.util.spec_from_file_location("e2e_gate", GATE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


def test_gate_numpy_all_cases(capsys):
    gate = load_gate()
    assert len(gate.cases(quick=False)) >= 24
    rc = gate.main(["--backend", "numpy"])
    out = capsys.readouterr().out
    print(out)
    assert rc == 0 and out.rstrip().endswith("ALL EXACT")
    assert out.count("EXACT  prompt=") >= 24


def test_gate_simt_quick(capsys, simt):
    rc = load_gate().main(["--backend", "simt", "--quick"])
    out = capsys.readouterr().out
    print(out)
    assert rc == 0 and out.rstrip().endswith("ALL EXACT")
