"""The shipped pair's acceptance, pinned: mean accepted length and acceptance by draft position
over the held-out prompts, against the floors recorded in dspark/models/default/RECORD.md.

Greedy output is exact whatever the drafter proposes, so a session that stops drafting well (a
drafter that no longer ingests its context, a verify width stuck at 2, taps of the wrong rows)
passes every exactness test. This one fails. Deterministic: numpy backend, greedy, no timing."""

import json
from pathlib import Path

import numpy as np

from dspark.cli import run_spec
from dspark.models import load_default
from dspark.models.default import recorded_floors
from dspark.session import SpecParams
from dspark.stats import RepetitionSplit, SpecStats

PROMPTS = Path(__file__).with_name("heldout_prompts.json")
NEW_TOKENS = 160


def heldout_prompts() -> list[np.ndarray]:
    return [np.frombuffer(bytes.fromhex(h), np.uint8).astype(np.int32) for h in json.loads(PROMPTS.read_text())["prompts"]]


def test_the_record_has_every_floor():
    floors = recorded_floors()
    assert {"mean accepted length", "mean accepted length, rounds on fresh text",
            "mean accepted length, rounds inside a repetition"} <= set(floors)
    assert [f"acceptance at draft position {k}" for k in range(1, 9)] == [k for k in floors if "position" in k]
    assert len(heldout_prompts()) == 24


def test_shipped_pair_meets_its_acceptance_floors():
    import dspark
    trunk, drafter = load_default(dspark.get_backend("numpy"))
    total, split = SpecStats(), RepetitionSplit()
    for p in heldout_prompts():
        _, _, stats, _ = run_spec(trunk, drafter, p, SpecParams(max_new_tokens=NEW_TOKENS, capture=False), split=split)
        total = total.merge(stats)
    measured = {
        "mean accepted length": total.mean_accepted_length,
        "mean accepted length, rounds on fresh text": split.fresh.mean_accepted_length,
        "mean accepted length, rounds inside a repetition": split.repeat.mean_accepted_length,
        **{f"acceptance at draft position {k + 1}": a for k, a in enumerate(total.acceptance_by_position)},
    }
    print(f"{total.summary()}; {split.summary()}")
    below = {name: (round(measured.get(name, 0.0), 3), floor) for name, floor in recorded_floors().items()
             if measured.get(name, 0.0) < floor}
    assert not below, f"below the recorded floors (measured, floor): {below}"
    assert split.fresh.rounds + split.repeat.rounds == total.rounds
