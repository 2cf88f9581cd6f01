"""load_tokenizer against transformers' tokenizer of the same tokenizer.json, and the command line
on a Hugging Face target (--model)."""

import numpy as np
import pytest

from dspark.cli import main
from dspark.decode import plain_generate
from dspark.models.hf import CheckpointError, load_target, load_tokenizer
from tests.models.hf_models import CASES, build, require_transformers

TEXTS = ["def walk(root):\n    return os.listdir(root)\n", "naïve café — 東京 🙂", "", "   spaces   ", "x" * 40]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen3 target saved by transformers, with a byte-level BPE tokenizer.json beside it."""
    _, transformers = require_transformers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    d = tmp_path_factory.mktemp("qwen3-tok")
    build(CASES[0], d)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 20 + ["import os\nimport sys\n"] * 20, trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(d)
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
    assert "loaded qwen3 from" in err and "plain: no drafter for --model" in err


def test_demo_with_model_is_exact(capsys, model_dir):
    rc, out, err = run(capsys, "demo", "--model", str(model_dir), "--backend", "numpy", "--max-new-tokens", "16",
                       "--block", "4")
    assert rc == 0, out
    assert "with a random drafter" in out and "EXACT" in out and "MISMATCH" not in out


def test_model_errors_are_one_line(capsys, tmp_path):
    for argv, match in ((("generate", "x", "--model", str(tmp_path / "none")), "expected a model directory"),
                        (("demo", "--model", str(tmp_path)), "config.json is missing")):
        rc, _, err = run(capsys, *argv, "--backend", "numpy")
        assert rc == 2 and err.count("\n") == 1 and err.startswith("dspark: error: ") and match in err, err
