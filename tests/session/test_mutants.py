"""The mutation runner (profiling/mutants.py): its table is well formed and names tests that
exist, a stale snippet is an error (never a kill), and one mutant is really applied to a copy
and killed. CI runs the whole table (.ci/run)."""

from dataclasses import replace

import pytest

from tests.scripts import load_script


@pytest.fixture(scope="module")
def mutants():
    return load_script("mutants")


def test_the_table_covers_the_bug_classes(mutants):
    table = mutants.load_table()
    ids = {m.id for m in table}
    assert {"drafter-context-frozen", "eos-ignored-in-block", "verify-width-fixed-at-2", "accept-any-draft-with-mass",
            "all-zero-drafter-distribution", "residual-drawn-from-p", "argmax-tie-to-the-higher-index",
            "markov-chain-missing-barrier", "kv-commit-ring-off-by-one", "accept-test-on-the-draft-stream",
            "model-every-flop-an-fma", "gpu-check-skipped-counts-as-ran", "interop-interface-before-dlpack",
            "cpu-tiles-add-each-block-at-the-end", "cpu-avx2-build-contracts-multiply-adds",
            "cpu-avx512-build-contracts-multiply-adds"} <= ids
    assert {m.cls for m in table} == {"session", "sampling", "kernel", "native", "op", "tooling"}
    for m in table:  # each snippet occurs once and each kill test exists, so a change that moves a
        # mutated line fails here, in the suite, not first in CI's mutation run
        assert mutants.stale_reason(m) is None, f"{m.id}: {mutants.stale_reason(m)}"


def test_a_stale_snippet_is_an_error_not_a_kill(mutants):
    m = mutants.load_table()[0]
    assert "occurs 0 times" in mutants.stale_reason(replace(m, original="no such line\n"))
    assert "does not exist" in mutants.stale_reason(replace(m, kill=("tests/session/test_nothing.py::test_x",)))
    assert "is not in" in mutants.stale_reason(replace(m, kill=("tests/session/test_session.py::test_nothing",)))


def test_a_mutant_is_applied_to_a_copy_and_killed(mutants, capsys):
    source = (mutants.ROOT / "dspark" / "session.py").read_text()
    assert mutants.main(["--only", "demotion-forgets-the-anchor"]) == 0
    out = capsys.readouterr().out
    assert "KILLED   demotion-forgets-the-anchor" in out and "mutants killed: 1/1" in out
    assert (mutants.ROOT / "dspark" / "session.py").read_text() == source  # never in place
