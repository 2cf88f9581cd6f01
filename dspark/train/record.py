"""Stage 5: RECORD.md for dspark/models/default/, rendered from the stage logs in <out>
(trunk_log.json, drafter_log.json, export.json, evaluate.json), so the record says what ran."""

from __future__ import annotations

import json
from pathlib import Path

from ..models.config import to_json
from ..models.default import DEFAULT_DIR
from . import data
from .data import HELDOUT_BUCKETS, SKIP_DIRS
from .recipe import DRAFTER, TRUNK


def _torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("torch")
    except PackageNotFoundError:
        return "(not installed when this was rendered)"


def _table(rows, head) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(str(x) for x in r) + " |" for r in rows])


def _calibration(before: dict, after: dict | None) -> str:
    rows = {round(lo, 1): [f"{p:.3f}", f"{o:.3f}", n] for lo, p, o, n in before["calibration"]}
    head = ["c_k bin", "mean c_k", "observed accuracy", "slots"]
    if after is None:
        return _table([[f"{lo:.1f}-{lo + 0.1:.1f}", *r] for lo, r in sorted(rows.items())], head)
    later = {round(lo, 1): [f"{p:.3f}", f"{o:.3f}", n] for lo, p, o, n in after["calibration"]}
    blank = ["", "", ""]
    return _table([[f"{lo:.1f}-{lo + 0.1:.1f}", *rows.get(lo, blank), *later.get(lo, blank)]
                   for lo in sorted(set(rows) | set(later))],
                  head + ["refit: mean c_k", "refit: observed", "refit: slots"])


def render(out: Path, commands: list[str], notes: list[str] = ()) -> str:
    tl = json.loads((out / "trunk_log.json").read_text())
    dl = json.loads((out / "drafter_log.json").read_text())
    ex = json.loads((out / "export.json").read_text())
    ev = json.loads((out / "evaluate.json").read_text()) if (out / "evaluate.json").exists() else None
    _, held = data.split()
    he, tr = dl["heldout_eval"], dl["train_eval"]
    he0 = dl.get("heldout_eval_before_recalibration", he)
    rc = dl.get("recalibration")
    tl_curve = ", ".join(f"{s}: {v}" for s, v in tl["heldout_loss"])
    s = ["# The default pair (dspark/models/default)\n",
         "A small hybrid trunk and its DSpark drafter, trained on a 2-core shared CPU by `dspark/train/`.",
         "Weights are f32 safetensors named and shaped as `trunk_spec` / `drafter_spec`.\n",
         "## Corpus\n",
         f"* The Python {tl['python']} standard library's own `*.py` sources (`sysconfig.get_paths()['stdlib']`), "
         f"bytes as tokens (EOS = 256 after each file). Left out: any path with a part in "
         f"{sorted(SKIP_DIRS)} or starting with `test_`.",
         f"* Held out (never trained on): every file whose `zlib.crc32(relative path) % {HELDOUT_BUCKETS} == 0` "
         f"({tl['heldout_files']} files, {tl['heldout_bytes']} bytes). Training: {tl['train_files']} files, "
         f"{tl['train_bytes']} bytes.",
         f"* Held-out files: {', '.join('`' + f + '`' for f in held)}.\n",
         "## Configs\n", "```json", to_json(TRUNK), to_json(DRAFTER), "```\n",
         f"Weights: {ex['weights_bytes']} bytes (trunk + drafter safetensors); files: "
         + ", ".join(f"{k} {v}" for k, v in ex["sizes"].items()) + ".\n",
         "## Trunk: next-byte LM\n",
         f"* AdamW (0.9, 0.95), weight decay {tl['recipe']['weight_decay']} on matrices, lr {tl['recipe']['lr']} "
         f"warmup {tl['recipe']['warmup']} then cosine to {tl['recipe']['min_lr']} over a "
         f"{tl['recipe']['budget_s'] / 60:.0f}-minute wall-clock budget; grad clip 1.0; batch {tl['recipe']['batch']} "
         f"x seq {tl['recipe']['seq_len']}; gdn by the chunked WY form (chunk 64).",
         f"* {tl['steps']} steps, {tl['tokens']} tokens, {tl['wall_s'] / 60:.1f} min, torch {_torch_version()} on 2 "
         f"shared CPU threads. The schedule follows the wall clock, so a rerun elsewhere takes another step count.",
         f"* Final train loss (EMA) {tl['final_train_ema']} nats/byte, "
         f"held-out {tl['final_heldout']} nats/byte ({tl['final_heldout'] / 0.6931:.3f} bits/byte; 4 fixed held-out "
         f"batches).",
         f"* Held-out loss by step: {tl_curve}.\n",
         "## Drafter: DSpark on the trunk's own greedy continuations\n",
         f"* {dl['recipe']['prompts']} training-file prompts of {dl['recipe']['prompt_len']} bytes, each continued "
         f"greedily by the trunk for {dl['recipe']['new_tokens']} bytes; taps from one trunk pass over "
         f"[prompt ; continuation] ({dl['continuation_s']:.0f} s). Held-out: 64 prompts from held-out files.",
         f"* Anchors in the continuation; block [anchor, MASK x 7], targets pos+k+1, Markov bias teacher-forced, "
         f"CE weight {dl['recipe']['slot_decay']}^k; confidence by BCE on detached features against the drafter's "
         f"own chain. Batch {dl['recipe']['seqs']} sequences x {dl['recipe']['anchors']} anchors; lr "
         f"{dl['recipe']['lr']} cosine over {dl['recipe']['budget_s'] / 60:.0f} min.",
         f"* {dl['steps']} steps, {dl['train_s'] / 60:.1f} min (stage total {dl['wall_s'] / 60:.1f} min); final CE "
         f"(weighted, EMA) {dl['final_ce']}, confidence BCE {dl['final_bce']}.",
         f"* Offline greedy-round replay (dspark/train/acceptance.py, tau 0.5) straight after training: held-out "
         f"mean accepted length {he0['mean_accepted_length']} (acceptance by position "
         f"{he0['acceptance_by_position']}); on 64 of its training sequences {tr['mean_accepted_length']}. "
         f"Verifying all 8 drafts every round: held-out {he['full_width_mean_accepted_length']} "
         f"({he['full_width_acceptance_by_position']}).",
         "* The drafter fits its training continuations much better than new ones, so its confidence head "
         "came out overconfident on held-out text (table below, left)." + (
             f" `python -m dspark.train calibrate` refit conf.w / conf.b alone by logistic regression on "
             f"{rc['slots']} own-chain slots of {rc['prompts']} fresh continuations of training-file prompts "
             f"(seed {rc['seed']}; the held-out files stay unseen): BCE {rc['bce_before']} -> {rc['bce_after']} on "
             f"them, {rc['wall_s']:.0f} s. The shipped head is the refit one. Replay after the refit: held-out "
             f"mean accepted length {he['mean_accepted_length']} (acceptance by position "
             f"{he['acceptance_by_position']}): fewer drafts verified per round, fewer rejected." if rc else ""),
         "",
         "Confidence calibration (held-out, every drafted slot of every round, own chain):\n",
         _calibration(he0, he if rc else None), ""]
    if ev:
        s += ["## Held-out acceptance through the real session\n",
              f"`python -m dspark.train.evaluate`: {ev['prompts']} held-out prompts of {ev['prompt_len']} bytes, "
              f"{ev['new_tokens']} new tokens each, DsparkSpecSession greedy on the numpy backend (confidence "
              f"width, tau 0.5).\n",
              f"* Mean accepted length (tokens per round) **{ev['mean_accepted_length']}** over {ev['rounds']} rounds; "
              f"acceptance by position {ev['acceptance_by_position']}; histogram of accepted drafts "
              f"{ev['accepted_histogram']}.",
              f"* Output identical to plain greedy decode on {ev['checked_against_plain_greedy'] - ev['mismatches']} "
              f"of {ev['checked_against_plain_greedy']} prompts checked.",
              f"* numpy backend tokens/s on those prompts (prefill included, shared CPU): spec "
              f"{ev['numpy_tokens_per_s']['spec']}, plain {ev['numpy_tokens_per_s']['plain']}."]
        ev0 = out / "evaluate_before_calibration.json"
        if ev0.exists():
            e0 = json.loads(ev0.read_text())
            s += [f"* With the confidence head before the refit: mean accepted length {e0['mean_accepted_length']} "
                  f"over {e0['rounds']} rounds ({e0['drafted']} drafts verified, {e0['accepted']} accepted, against "
                  f"{ev['drafted']} / {ev['accepted']} after); tokens/s spec {e0['numpy_tokens_per_s']['spec']}, "
                  f"plain {e0['numpy_tokens_per_s']['plain']}."]
        s += ["* A small byte-level trunk's greedy continuations repeat themselves (a line or a phrase, over "
              "and over) within a hundred bytes or so; the drafter predicts those loops well, which is much of "
              "the acceptance. The numbers are the real trunk's greedy output, loops included.\n"]
    s += ["## Parity\n",
          "`parity.npz`: held-out token sequences, the torch mirror's trunk logits and drafter block outputs "
          "(hidden, logits, Markov-biased logits, confidence). The NumPy forward reproduces them within "
          "|diff| <= 5e-4 + 5e-4 |ref| (tests/train/test_default.py); measured max |diff| at export: "
          + ", ".join(f"{k} {v:.2g}" for k, v in ex["parity_max_abs_diff"].items()) + ".\n",
          "## Reproduce\n", "```sh", *commands, "```", ""]
    if notes:
        s += ["## Notes\n", *(f"* {n}" for n in notes), ""]
    return "\n".join(s)


def main(argv=None) -> None:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m dspark.train.record")
    ap.add_argument("--out", type=Path, default=Path("train_out"))
    ap.add_argument("--command", action="append", default=[], help="a command line to list under Reproduce")
    ap.add_argument("--note", action="append", default=[], help="a line for the Notes section")
    a = ap.parse_args(argv)
    (DEFAULT_DIR / "RECORD.md").write_text(render(a.out, a.command, a.note))


if __name__ == "__main__":
    main()
