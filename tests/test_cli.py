"""The command line: the main job, generate, info, and one-line errors with exit code 2."""

import io
import re
import sys

import pytest

from dspark.cli import main


def run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_demo_runs_and_is_exact(capsys, monkeypatch):
    """On a terminal the two streams show tqdm bars on stderr (none with --no-progress)."""
    monkeypatch.setattr(sys, "stderr", Terminal())
    rc, out, _ = run(capsys, "demo", "--max-new-tokens", "24")
    assert rc == 0, out
    assert "mean accepted length" in out and "acceptance by position" in out and "speedup" in out
    assert "EXACT" in out and "MISMATCH" not in out
    assert "spec:" in sys.stderr.getvalue() and "plain:" in sys.stderr.getvalue() and "tok" in sys.stderr.getvalue()
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert run(capsys, "demo", "--max-new-tokens", "8", "--no-progress")[0] == 0
    assert sys.stderr.getvalue() == ""


def test_generate_greedy_spec_equals_no_spec(capsys):
    """Also with the prompt in passes of 3 tokens for the speculative run (--prompt-chunk)."""
    rc1, spec, _ = run(capsys, "generate", "def main():\n", "--max-new-tokens", "20", "--prompt-chunk", "3")
    rc2, plain, _ = run(capsys, "generate", "def main():\n", "--max-new-tokens", "20", "--no-spec")
    assert rc1 == rc2 == 0 and spec == plain and spec.startswith("def main():\n")


def test_generate_verify_gain_prints_the_widths_it_chose(capsys):
    """The widths line adds up to the rounds and names only widths the run can take."""
    rc, _, err = run(capsys, "generate", "def main():\n", "--max-new-tokens", "24", "--verify", "gain",
                     "--policy", "always")
    assert rc == 0
    rounds = int(re.search(r"\((\d+) rounds\)", err).group(1))
    widths = dict(map(int, pair.split(": ")) for pair in
                  re.search(r"^verify widths\s+(.+) \(width: rounds\)$", err, re.M).group(1).split(", "))
    assert sum(widths.values()) == rounds and all(1 <= w <= 8 for w in widths)


def test_spec_stats_widths_are_each_rounds_verify():
    from dspark.stats import SpecStats
    s = SpecStats()
    for verified, accepted in ((1, 0), (4, 2), (4, 4), (7, 1), (0, 0)):
        s.record(verified, accepted)
    assert s.widths == {1: 1, 2: 1, 5: 2, 8: 1}


def test_generate_no_spec_runs_no_speculative_session(capsys, monkeypatch):
    """--no-spec pays for no speculative warm-up (no session is primed at all); without it the
    warm-up primes one before the request's own."""
    from dspark.session import DsparkSpecSession
    primed = []
    prime = DsparkSpecSession.prime.__func__
    monkeypatch.setattr(DsparkSpecSession, "prime",
                        classmethod(lambda cls, *a, **k: primed.append(1) or prime(cls, *a, **k)))
    assert run(capsys, "generate", "def f", "--max-new-tokens", "4", "--no-spec")[0] == 0
    assert primed == []
    assert run(capsys, "generate", "def f", "--max-new-tokens", "4", "--policy", "always")[0] == 0
    assert len(primed) == 2


def test_generate_warm_up_keeps_plain_steps_beside_a_rounds_verify(capsys, monkeypatch):
    """The warm-up after the first plain steps alternates a round and WARM_UP_STEPS plain steps
    (run_warm_up), so the cost model keeps each plain step over the level of a round's verify timed
    just before it, and no verify of another kind is timed: a verify run on its own costs less than
    a round's, and a plain step kept over one was priced 25-30 % high against the rounds."""
    from dspark import cli, cost
    from dspark.backends import get_backend
    be = get_backend("numpy")
    kinds = []
    record = cost.CostModel.record
    monkeypatch.setattr(cost.CostModel, "record",
                        lambda self, kind, *a, **k: kinds.append(kind) or record(self, kind, *a, **k))
    with cost.using(be, cost.CostModel()):
        assert run(capsys, "generate", "def f", "--max-new-tokens", "4", "--policy", "always")[0] == 0
    start = kinds.index("round") - 1  # the process's first round and its verify are cold, not kept
    warm_up = kinds[start: start + (cli.WARM_UP_ROUNDS - 1) * (2 + cli.WARM_UP_STEPS)]
    assert warm_up == (["verify", "round"] + ["plain"] * cli.WARM_UP_STEPS) * (cli.WARM_UP_ROUNDS - 1), kinds
    assert kinds.count("verify") == kinds.count("round"), kinds  # every verify is a round's


def test_generate_sampled_is_seeded(capsys):
    """The same seed, the same text: twice, and (the coupled sampler, the default) with and
    without speculation; the rejection sampler's text is its own, but seeded too."""
    args = ("generate", "import ", "--max-new-tokens", "16", "--temperature", "0.8", "--top-k", "20")
    a = run(capsys, *args, "--seed", "1")[1]
    b = run(capsys, *args, "--seed", "1")[1]
    assert a == b == run(capsys, *args, "--seed", "1", "--no-spec")[1]
    c = run(capsys, *args, "--seed", "1", "--sampler", "rejection")[1]
    assert c == run(capsys, *args, "--seed", "1", "--sampler", "rejection")[1]


def test_generate_unseeded_prints_the_seed_that_reproduces_the_text(capsys):
    """Sampled without --seed: a fresh seed, drawn once and printed in the summary line; given back
    (here to plain decode: the coupled sampler's text is plain sampled decode's for its seed) it
    prints the same text. Greedy prints no seed."""
    args = ("generate", "import ", "--max-new-tokens", "12", "--temperature", "1.2")
    rc, out, err = run(capsys, *args)
    seed = re.search(r", seed (\d+), ", err)
    assert rc == 0 and seed, err
    assert run(capsys, *args, "--seed", seed.group(1), "--no-spec")[1] == out
    assert ", seed " not in run(capsys, "generate", "import ", "--max-new-tokens", "4", "--no-spec")[2]


def test_info(capsys):
    rc, out, _ = run(capsys, "info")
    assert rc == 0 and "backends: numpy" in out and "argmax.cu" in out


@pytest.mark.parametrize("argv,match", [
    (("demo", "--backend", "tpu"), "--backend 'tpu': expected one of numpy, simt, cuda"),
    (("generate", "x", "--max-new-tokens", "0"), "0 must be >= 1"),
    (("generate", "x", "--max-new-tokens", "many"), "'many' is not an integer"),
    (("generate", "x", "--top-p", "0"), "--top-p=0.0: expected in (0, 1]"),
    (("generate", "x", "--temperature", "-1"), "--temperature=-1.0"),
    (("frobnicate",), "invalid choice"),
    (("generate", "x", "--prompt-chunk", "0"), "0 must be >= 1"),
    (("generate", "x", "--backend", "numpy", "--max-ctx", "100"), "--max-ctx applies to --model"),
    (("generate", "x", "--sampler", "gumbel"), "invalid choice: 'gumbel'"),
])
def test_errors_are_one_line_with_exit_code_2(capsys, argv, match):
    rc, out, err = run(capsys, *argv)
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("dspark: error: ") and match in err, err


def test_cuda_without_a_gpu_is_one_line(capsys):
    from dspark.backends import cuda_available
    if cuda_available():
        pytest.skip("a GPU works here")
    rc, _, err = run(capsys, "demo", "--backend", "cuda")
    assert rc == 2 and err.count("\n") == 1 and "no CUDA GPU" in err
