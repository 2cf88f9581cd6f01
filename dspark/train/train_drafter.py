"""Stage 2: the DSpark drafter, trained on the frozen trunk's own greedy continuations.

Per step: `seqs` sequences, `anchors` anchor positions each, drawn where the whole block's
targets are continuation tokens (pos in [prompt_len, T - b - 1]). Block row k's target is the
token at pos+k+1; its logits get the Markov bias of the true previous token (teacher forcing,
x_{-1} = the anchor). Cross-entropy weighted decay^k, because a later slot only counts when every
earlier one was accepted. The confidence head learns, by BCE on detached features, whether slot
k of the drafter's OWN chain (what propose_greedy will run) equals the target, so c_k is a
calibrated probability for the verify width. The trunk's embedding, final norm and LM head are
shared and stay frozen.

Reads <out>/trunk.npz; writes <out>/drafter.json, drafter.npz, drafter_log.json.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..models.config import to_json
from . import data
from .acceptance import calibration, replay_rounds
from .continuations import continuations
from .recipe import DRAFTER, TRUNK, DrafterRecipe
from .schedule import Schedule, adamw
from .torch_model import TorchDrafter, TorchTrunk, as_arrays, as_tensors


def load_trunk(out: Path) -> TorchTrunk:
    with np.load(out / "trunk.npz") as z:
        return TorchTrunk(TRUNK, as_tensors({k: z[k] for k in z.files}))


def losses(drafter: TorchDrafter, ids, taps, pos, weights):
    """(weighted CE, confidence BCE, own-chain slot accuracy [b]) for anchors pos [B, A]."""
    b = drafter.c.block
    hidden, logits = drafter.block(drafter.context_kv(taps), ids, pos)
    rows = pos[..., None] + torch.arange(b + 1)                       # tokens at pos .. pos+b
    toks = torch.gather(ids, 1, rows.flatten(1)).reshape(rows.shape)
    prev, target = toks[..., :-1], toks[..., 1:]
    bias, _ = drafter.markov(prev)
    ce = F.cross_entropy((logits + bias).flatten(0, 2), target.flatten(), reduction="none").reshape(target.shape)
    ce = (ce * weights).sum(-1).mean() / weights.sum()
    N = pos.numel()
    with torch.no_grad():
        drafts, _ = drafter.chain(hidden.reshape(N, b, -1), logits.reshape(N, b, -1), prev.reshape(N, b)[:, 0])
        shifted = torch.cat([prev.reshape(N, b)[:, :1], drafts[:, :-1]], 1)   # own chain's x_{k-1}
        ok = (drafts == target.reshape(N, b)).float()
    _, e = drafter.markov(shifted)
    conf = drafter.confidence_logit(hidden.reshape(N, b, -1).detach(), e.detach())
    bce = F.binary_cross_entropy_with_logits(conf, ok)
    return ce, bce, ok.mean(0)


def evaluate(drafter: TorchDrafter, ids, taps, prompt_len: int) -> dict:
    conf_stats, pairs = replay_rounds(drafter, ids, taps, prompt_len)
    full_stats, _ = replay_rounds(drafter, ids, taps, prompt_len, width="full")
    return {"mean_accepted_length": round(conf_stats.mean_accepted_length, 3),
            "acceptance_by_position": [round(a, 3) for a in conf_stats.acceptance_by_position],
            "full_width_mean_accepted_length": round(full_stats.mean_accepted_length, 3),
            "full_width_acceptance_by_position": [round(a, 3) for a in full_stats.acceptance_by_position],
            "calibration": [[round(x, 3) if isinstance(x, float) else x for x in row] for row in calibration(pairs)]}


def train(out: Path, r: DrafterRecipe = DrafterRecipe()) -> TorchDrafter:
    t_start = time.time()
    trunk = load_trunk(out)
    train_files, held = data.split()
    ids, taps = continuations(trunk, train_files, r.prompts, r.prompt_len, r.new_tokens, r.seed)
    hids, htaps = continuations(trunk, held, 64, r.prompt_len, r.new_tokens, r.seed + 1000)
    gen_s = time.time() - t_start
    print(f"continuations: train {tuple(ids.shape)} held-out {tuple(hids.shape)} in {gen_s:.0f}s", flush=True)
    torch.manual_seed(r.seed)
    drafter = TorchDrafter.init(DRAFTER, trunk, r.seed)
    for p in drafter.params():
        p.requires_grad_(True)
    opt = adamw(drafter.params(), r.lr, r.weight_decay)
    sched = Schedule(r.lr, r.min_lr, r.warmup, r.max_steps, r.budget_s)
    rng = np.random.default_rng(r.seed)
    b, T = DRAFTER.block, ids.shape[1]
    weights = r.slot_decay ** torch.arange(b, dtype=torch.float32)
    log = {"recipe": dataclasses.asdict(r), "continuation_s": round(gen_s, 1), "ce": [], "bce": [], "evals": []}
    t0, step, ema = time.time(), 0, None
    while not sched.done(step):
        for g in opt.param_groups:
            g["lr"] = sched.rate(step)
        seq = torch.from_numpy(rng.integers(0, ids.shape[0], r.seqs))
        pos = torch.from_numpy(rng.integers(r.prompt_len, T - b, (r.seqs, r.anchors)))
        ce, bce, acc = losses(drafter, ids[seq], taps[seq], pos, weights)
        opt.zero_grad(set_to_none=True)
        (ce + bce).backward()
        torch.nn.utils.clip_grad_norm_(drafter.params(), 1.0)
        opt.step()
        step += 1
        cur = np.array([ce.item(), bce.item()])
        ema = cur if ema is None else 0.98 * ema + 0.02 * cur
        if step % 25 == 0:
            log["ce"].append([step, round(float(ema[0]), 4)])
            log["bce"].append([step, round(float(ema[1]), 4)])
            print(f"step {step} ce {ema[0]:.4f} bce {ema[1]:.4f} acc {' '.join(f'{a:.2f}' for a in acc.tolist())} "
                  f"lr {sched.rate(step):.2e} {time.time() - t0:.0f}s", flush=True)
        if step % 500 == 0:
            ev = evaluate(drafter, hids[:16], htaps[:16], r.prompt_len)
            log["evals"].append([step, ev["mean_accepted_length"]])
            print(f"step {step} held-out (16 seqs) mean accepted length {ev['mean_accepted_length']}", flush=True)
            save(drafter, out, log)
    log.update(steps=step, train_s=round(time.time() - t0, 1), final_ce=round(float(ema[0]), 4),
               final_bce=round(float(ema[1]), 4))
    log["train_eval"] = evaluate(drafter, ids[:64], taps[:64], r.prompt_len)
    log["heldout_eval"] = evaluate(drafter, hids, htaps, r.prompt_len)
    log["wall_s"] = round(time.time() - t_start, 1)
    print(json.dumps({k: log[k] for k in ("steps", "final_ce", "final_bce", "heldout_eval")}, indent=1), flush=True)
    save(drafter, out, log)
    return drafter


def save(drafter: TorchDrafter, out: Path, log: dict) -> None:
    (out / "drafter.json").write_text(to_json(drafter.c))
    np.savez(out / "drafter.npz", **as_arrays(drafter.w))
    (out / "drafter_log.json").write_text(json.dumps(log, indent=1))
