"""load_tokenizer against transformers' tokenizer of the same tokenizer.json, and the command line
on a Hugging Face target (--model) with and without a released drafter (--drafter)."""

import numpy as np
import pytest

from dspark.cli import main
from dspark.decode import plain_generate
from dspark.models.hf import CheckpointError, load_target, load_tokenizer
from tests.models.hf_models import CASES, build, reference, require_transformers, save_tokenizer
from tests.peers import peer

TEXTS = ["def walk(root):\n    return os.listdir(root)\n", "naïve café — 東京 🙂", "", "   spaces   ", "x" * 40]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen3 target saved by transformers, with a byte-level BPE tokenizer.json beside it."""
    d = tmp_path_factory.mktemp("qwen3-tok")
    build(CASES[0], d)
    save_tokenizer(d, TEXTS)
    return d


def test_tokenizer_matches_transformers(model_dir):
    _, transformers = require_transformers()
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    ours = load_tokenizer(model_dir)
    assert ours.vocab_size == len(theirs)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids.dtype == np.int32
        assert ids.tolist() == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids.tolist(), skip_special_tokens=True) == text
    eos = theirs.convert_tokens_to_ids("<|endoftext|>")
    assert ours.decode([*ours.encode("ab"), eos]) == "ab"  # special tokens are not text


def test_tokenizer_errors(model_dir, tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json is missing"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not a tokenizer.json the tokenizers package can read"):
        load_tokenizer(tmp_path)


def run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_generate_with_model_is_plain_greedy(capsys, model_dir, numpy_backend):
    text = "import os\n"
    rc, out, err = run(capsys, "generate", text, "--model", str(model_dir), "--backend", "numpy",
                       "--max-new-tokens", "12")
    assert rc == 0, err
    tok = load_tokenizer(model_dir)
    want = plain_generate(load_target(model_dir, numpy_backend), tok.encode(text), 12)
    assert out == text + tok.decode(want) + "\n"
    assert "loaded qwen3 from" in err and "plain: no --drafter for --model" in err


def test_demo_with_model_is_exact(capsys, model_dir):
    rc, out, err = run(capsys, "demo", "--model", str(model_dir), "--backend", "numpy", "--max-new-tokens", "16",
                       "--block", "4")
    assert rc == 0, out
    assert "with a random drafter" in out and "EXACT" in out and "MISMATCH" not in out


def test_model_errors_are_one_line(capsys, tmp_path):
    for argv, match in ((("generate", "x", "--model", str(tmp_path / "none")), "expected a model directory"),
                        (("demo", "--model", str(tmp_path)), "config.json is missing")):
        rc, _, err = run(capsys, *argv, "--backend", "numpy")
        last = err.splitlines()[-1]   # after "dspark: loaded <target>" where the target loaded
        assert rc == 2 and err.count("dspark: error: ") == 1 and last.startswith("dspark: error: ") and match in last, err


GENERATE_TEXT = "import os\n"


@pytest.fixture(scope="module")
def drafter_dirs(model_dir, tmp_path_factory, numpy_backend):
    """Drafters for the --model target, built and saved by the peers' own code: z-lab dflash's
    DFlashDraftModel (random: it accepts next to nothing) and DeepSpec's layout, tapping the
    embedding, whose Markov head was fitted to the target: W1 = 100 I and W2 the most frequent
    transition (token -> next token) of the target's greedy streams from the demo's and the
    generate test's prompts, so its chain proposes what the target will say and the command line
    shows rounds that accept."""
    torch, _ = require_transformers()
    peer("dflash")  # the z-lab peer builds one of the drafters
    from dspark.cli import DEMO_PROMPT
    from tests.models import drafter_peers as peers
    target = reference(CASES[0], model_dir)
    sizes = peers.sizes_of(target)
    trunk, tok = load_target(model_dir, numpy_backend), load_tokenizer(model_dir)
    fitted = peers.deepspec_model(1, target=target, sizes=sizes, taps=(-1, 1), block=4, markov_rank=sizes.vocab)
    counts = np.zeros((sizes.vocab, sizes.vocab))
    for text in (DEMO_PROMPT, GENERATE_TEXT):
        prompt = tok.encode(text)
        stream = [int(prompt[-1]), *plain_generate(trunk, prompt, 32)]
        np.add.at(counts, (stream[:-1], stream[1:]), 1)
    seen = counts.sum(1) > 0
    w2 = np.zeros((sizes.vocab, sizes.vocab), np.float32)   # Linear(r -> V).weight: [V, r]
    w2[counts.argmax(1)[seen], np.flatnonzero(seen)] = 1.0
    with torch.no_grad():
        fitted.markov_head.markov_w1.weight.copy_(100.0 * torch.eye(sizes.vocab))
        fitted.markov_head.markov_w2.weight.copy_(torch.from_numpy(w2))
    out = {}
    for name, model in (("deepspec", fitted), ("dflash", peers.dflash_model(2, sizes=sizes, taps=(0, 1), block=5))):
        out[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(out[name])
    return out


def accepted_length(text: str) -> float:
    return float(next(line for line in text.splitlines() if line.startswith("mean accepted length")).split()[3])


def test_generate_with_drafter_is_speculative_and_exact(capsys, model_dir, drafter_dirs, numpy_backend):
    text = GENERATE_TEXT
    tok = load_tokenizer(model_dir)
    want = plain_generate(load_target(model_dir, numpy_backend), tok.encode(text), 12)
    for name, path in drafter_dirs.items():
        rc, out, err = run(capsys, "generate", text, "--model", str(model_dir), "--drafter", str(path),
                           "--backend", "numpy", "--max-new-tokens", "12", "--verify", "full", "--policy", "always")
        assert rc == 0, err
        assert out == text + tok.decode(want) + "\n", name
        fmt = {"deepspec": "DeepSpec DSpark", "dflash": "z-lab DFlash"}[name]
        assert f"loaded {fmt} drafter from" in err and "spec, mean accepted length" in err, err
        # verify full: every draft position was verified (DeepSpec: every row of a 4-row block;
        # DFlash: rows 1..4 of a 5-row block)
        acc = next(line for line in err.splitlines() if line.startswith("acceptance by position"))
        assert len(acc.split()) == 3 + 4, acc
        if name == "deepspec":
            assert accepted_length(err) >= 2.0, err


def test_demo_with_drafter_is_exact(capsys, model_dir, drafter_dirs):
    for name, block in (("deepspec", 4), ("dflash", 5)):
        rc, out, err = run(capsys, "demo", "--model", str(model_dir), "--drafter", str(drafter_dirs[name]),
                           "--backend", "numpy", "--max-new-tokens", "24", "--verify", "ladder")
        assert rc == 0, out
        assert f"with the drafter {drafter_dirs[name]}" in out and f"block {block}" in out
        assert "acceptance by position" in out and "EXACT" in out and "MISMATCH" not in out
        if name == "deepspec":   # the fitted Markov head: rounds accept (a first-order chain, and this
            assert accepted_length(out) >= 1.5, out   # stream's tokens have several successors each)


def test_drafter_errors_are_one_line(capsys, model_dir, drafter_dirs, tmp_path):
    import json
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(drafter_dirs["dflash"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [0, 7]
    (bad / "config.json").write_text(json.dumps(cfg))
    for argv, match in ((("generate", "x", "--drafter", str(drafter_dirs["dflash"])), "--drafter needs --model"),
                        (("demo", "--model", str(model_dir), "--drafter", str(bad)), "target_layer_ids[1]=7"),
                        (("demo", "--model", str(model_dir), "--drafter", str(tmp_path / "none")),
                         "expected a model directory")):
        rc, _, err = run(capsys, *argv, "--backend", "numpy")
        last = err.splitlines()[-1]   # after "dspark: loaded <target>" where the target loaded
        assert rc == 2 and err.count("dspark: error: ") == 1 and last.startswith("dspark: error: ") and match in last, err
