"""profiling/e2e_gate.py as a test: it must print ALL EXACT, and every case must have cut its last
round's accepted block where its label says (at the EOS or at the budget), with the end token
both as the cut round's anchor and as one of its accepted drafts."""

import re

from tests.scripts import load_script

LINE = re.compile(r"^EXACT  .* cut=(\w+) +lead=(\d) .* cuts eos=(\d+) budget=(\d+); .*last round: (\w+) token as "
                  r"(anchor|draft \d+), (\d+) accepted tokens cut$")


def check_cuts(out: str, cases: int) -> None:
    seen = set()
    rows = [LINE.match(line) for line in out.splitlines() if line.startswith(("EXACT", "MISMATCH"))]
    assert len(rows) == cases and all(rows), out
    for m in rows:
        label, lead, eos, budget, reason, role, cut = m.groups()
        assert {"eos": int(eos), "budget": int(budget)}[label] >= 1 and reason == label and int(cut) >= 1, m.group(0)
        assert (role == "anchor") == (lead == "0"), m.group(0)
        seen.add((label, role == "anchor"))
    assert seen == {(c, a) for c in ("eos", "budget") for a in (True, False)}


def test_gate_numpy_all_cases(capsys):
    gate = load_script("e2e_gate")
    assert len(gate.cases(quick=False)) >= 24
    rc = gate.main(["--backend", "numpy"])
    out = capsys.readouterr().out
    print(out)
    assert rc == 0 and out.rstrip().endswith("ALL EXACT")
    check_cuts(out, len(gate.cases(quick=False)))


def test_gate_simt_quick(capsys, simt):
    gate = load_script("e2e_gate")
    rc = gate.main(["--backend", "simt", "--quick"])
    out = capsys.readouterr().out
    print(out)
    assert rc == 0 and out.rstrip().endswith("ALL EXACT")
    check_cuts(out, len(gate.cases(quick=True)))
