"""Several end-of-sequence ids (Qwen's eos_token_id is a list: <|im_end|> and <|endoftext|>).

The ids are read where transformers' generate() reads them, and a stream stops on any of them in
transformers, in plain decode, in the speculative session (its accepted block is cut at the id)
and on the command line. Each tiny model's list is chosen from its own greedy stream: the first
id never occurs in it and the second occurs mid-way, so honouring only the first id runs to the
budget instead.
"""

import json
import re

import numpy as np
import pytest

from dspark.cli import main
from dspark.decode import PlainBatch, plain_generate
from dspark.models.config import TrunkConfig
from dspark.models.hf import CheckpointError, load_target
from dspark.models.hf.target import eos_ids_of
from dspark.models.oracle import OracleDrafter, greedy_continuation
from dspark.models.presets import random_drafter
from dspark.session import DsparkSpecSession, SpecParams
from tests.models.hf_models import QWEN3, QWEN35, build, hf_greedy, reference

N = 40          # budget of every stream here
STOP_AT = 12    # the second eos id first occurs in the stream at about this index


def prompt_of(case):
    return np.random.default_rng(case.seed + 11).integers(0, case.config["vocab_size"], 7).astype(np.int32)


def pick_ids(stream: list[int], vocab: int) -> tuple[int, int, int]:
    """(never, second, earlier): an id absent from the stream, the first id that first occurs at
    index >= STOP_AT, and one that first occurs before it."""
    first = {}
    for i, t in enumerate(stream):
        first.setdefault(t, i)
    second = next(t for t in stream[STOP_AT:] if first[t] >= STOP_AT)
    earlier = next(t for t in stream[2:] if first[t] < first[second])
    never = next(t for t in range(vocab) if t not in first)
    return never, second, earlier


def edit_json(path, **changes):
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


@pytest.fixture(scope="module", params=["generation_config", "config_only"])
def two_eos(request, tmp_path_factory):
    """(directory, prompt, transformers' greedy stream, the eos ids) for a qwen3 target whose
    generation_config.json lists [never, second] while its config.json names an earlier token
    (transformers reads only generation_config.json), and a qwen3_5 target without
    generation_config.json whose text_config lists them (the composite's top level has none)."""
    case = QWEN3[0] if request.param == "generation_config" else QWEN35[0]
    d = tmp_path_factory.mktemp(f"eos-{request.param}")
    build(case, d)
    p = prompt_of(case)
    free = hf_greedy(reference(case, d), p, N)  # no eos id yet: the whole budget
    assert len(free) == N
    never, second, earlier = pick_ids(free, case.config["vocab_size"])
    if request.param == "generation_config":
        edit_json(d / "generation_config.json", eos_token_id=[never, second])
        edit_json(d / "config.json", eos_token_id=earlier)
    else:
        (d / "generation_config.json").unlink()
        edit_json(d / "config.json", eos_token_id=[never, second])
    want = hf_greedy(reference(case, d), p, N)
    assert want == free[: free.index(second) + 1] and len(want) < N  # transformers stops on the second id
    return d, p, want, (never, second)


def test_eos_ids_are_read_where_transformers_reads_them(two_eos, numpy_backend):
    d, _, _, ids = two_eos
    c = load_target(d, numpy_backend).config
    assert (c.eos_id, c.extra_eos_ids, c.eos_ids) == (ids[0], ids[1:], ids)


def test_plain_decode_stops_on_any_eos_id(two_eos, request):
    """plain_generate (PlainBatch's finishing check) equals transformers' generate(do_sample=False),
    which stops on the second id; on numpy and on the simt kernels."""
    d, p, want, _ = two_eos
    for name in ("numpy_backend", "simt"):
        assert plain_generate(load_target(d, request.getfixturevalue(name)), p, N) == want, name


@pytest.mark.parametrize("lead", [0, 1])
def test_speculative_cut_and_finish_on_any_eos_id(two_eos, numpy_backend, lead):
    """An oracle drafter proposes the stream past its end, so the round that reaches the second
    id accepts beyond it (lead 0: the id is the round's anchor; 1: an accepted draft) and the
    session must cut the block there and finish with reason "eos"."""
    d, p, want, _ = two_eos
    trunk = load_target(d, numpy_backend)
    drafter = OracleDrafter(random_drafter(trunk, 3, block=4), hit_rate=0.8, seed=3, lead=lead)
    drafter.next_stream = [*p.tolist(), *greedy_continuation(trunk, p, N + 8)]
    drafter.next_stop = len(p) + len(want) - 1
    s = DsparkSpecSession.prime(trunk, drafter, p, SpecParams(max_new_tokens=N, burst_target=4))
    while not s.finished():
        s.burst()
    assert s.emitted == want and s.finish_reason == "eos"
    assert s.stats.accepted > 0 and s.cache.pos == len(p) + len(want)  # committed up to the id
    s.close()


def test_demoted_session_stops_on_any_eos_id(two_eos, numpy_backend):
    """Demoted before the second id: PlainBatch finishes the stream there."""
    d, p, want, _ = two_eos
    trunk = load_target(d, numpy_backend)
    s = DsparkSpecSession.prime(trunk, random_drafter(trunk, 4, block=4), p, SpecParams(max_new_tokens=N))
    s.burst(4)
    assert not s.finished() and len(s.emitted) < len(want)
    cache, last = s.into_demoted()
    batch = PlainBatch(trunk)
    sid = batch.join(cache, last, N, s.emitted)
    batch.run()
    assert batch.leave(sid).emitted == want
    cache.free()


def test_cli_stops_on_any_eos_id(two_eos, numpy_backend, capsys, monkeypatch):
    """generate --model: the text ends before the id (it is not text, special or not) and the
    summary says why the stream stopped."""
    from dspark.cli import body
    d, p, want, ids = two_eos
    trunk = load_target(d, numpy_backend)
    assert body(trunk, want) == want[:-1] and body(trunk, want[:-1]) == want[:-1]

    class Ids:  # the tokenizer: ids as text, so that every id, the stop id too, would show
        encode = staticmethod(lambda text: p)
        decode = staticmethod(lambda out: " ".join(map(str, out)))

    monkeypatch.setattr("dspark.cli.load_model", lambda be, path, progress=None: (load_target(path, be), Ids))
    rc = main(["generate", "x", "--model", str(d), "--backend", "numpy", "--max-new-tokens", str(N)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out == "x" + " ".join(map(str, want[:-1])) + "\n"
    assert f"stopped: end-of-sequence id {ids[1]}" in err, err


def test_eos_ids_of_follows_transformers():
    """generation_config.json wins whole (no key there: no stop id, as transformers), then the top
    level of config.json, then its text_config; one id or a list; duplicates once."""
    cfg = {"eos_token_id": 5, "text_config": {"eos_token_id": [6, 7]}}
    assert eos_ids_of(cfg, {"eos_token_id": [8, 9, 8]}, 10) == (8, 9)
    assert eos_ids_of(cfg, {}, 10) == ()
    assert eos_ids_of(cfg, None, 10) == (5,)
    assert eos_ids_of({"eos_token_id": None, "text_config": {"eos_token_id": [6, 7]}}, None, 10) == (6, 7)
    assert eos_ids_of({}, None, 10) == ()


@pytest.mark.parametrize("gen, match", [({"eos_token_id": [3, 10]}, r"generation_config.json eos_token_id=\[3, 10\]: "
                                                                    r"10 is not a token id in \[0, 10\)"),
                                        ({"eos_token_id": "</s>"}, "'</s>' is not a token id"),
                                        ({"eos_token_id": [-1]}, "-1 is not a token id")])
def test_bad_eos_ids_are_refused(gen, match):
    with pytest.raises(CheckpointError, match=match):
        eos_ids_of({}, gen, 10)


def test_bad_eos_ids_in_trunk_config():
    assert TrunkConfig().eos_ids == (256,) and TrunkConfig(eos_id=-1).eos_ids == ()
    assert TrunkConfig(extra_eos_ids=(3, 4)).eos_ids == (256, 3, 4)
    for kw, match in (({"extra_eos_ids": (3, 256)}, "none equal to eos_id=256"),
                      ({"extra_eos_ids": (300,)}, r"distinct token ids in \[0, 258\)"),
                      ({"eos_id": -1, "extra_eos_ids": (3,)}, "the first end-of-sequence id goes in eos_id"),
                      ({"eos_id": 258}, r"eos_id=258: expected a token id in \[0, 258\) or -1")):
        with pytest.raises(ValueError, match=match):
            TrunkConfig(**kw)


def test_extra_eos_ids_round_trip_json_and_leave_old_files_alone():
    from dspark.models.config import from_json, to_json
    assert "extra_eos_ids" not in to_json(TrunkConfig())  # the embedded pair's JSON is unchanged
    c = TrunkConfig(extra_eos_ids=(3, 4))
    assert from_json(to_json(c), TrunkConfig) == c



def test_load_target_refuses_a_bad_eos_id_before_allocating(two_eos, tmp_path, numpy_backend):
    """Where the ids are read (generation_config.json, else config.json), an id outside the
    vocabulary is refused by name, and nothing is allocated."""
    import shutil
    d, bad = two_eos[0], tmp_path / "bad"
    shutil.copytree(d, bad)
    vocab = load_target(d, numpy_backend).config.vocab
    where, named = (("generation_config.json", "generation_config.json") if (d / "generation_config.json").exists()
                    else ("config.json", "config"))
    edit_json(bad / where, eos_token_id=[1, vocab])
    before = numpy_backend.alloc.owners()
    with pytest.raises(CheckpointError, match=rf"^{re.escape(named)} eos_token_id=\[1, {vocab}\]: {vocab} is not a "
                                              rf"token id in \[0, {vocab}\)$"):
        load_target(bad, numpy_backend)
    assert numpy_backend.alloc.owners() == before
