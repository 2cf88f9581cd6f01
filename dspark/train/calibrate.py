"""Stage 2b: refit the confidence head on sequences the drafter never trained on.

The drafter fits its ~1000 training continuations far better than new ones (own-chain accuracy
at slot 1: ~0.95 on them, ~0.8 held out), so a confidence head fitted on them is overconfident
elsewhere, and the verify width it sets is too wide. This stage continues fresh prompts from the
TRAINING files (a new seed; held-out files stay unseen), runs the frozen drafter's own chain at
sampled anchors, and refits only conf.w / conf.b by full-batch logistic regression on those slots.

Reads and rewrites <out>/drafter.npz; adds "recalibration" and a new "heldout_eval" to
<out>/drafter_log.json (the pre-refit one is kept as "heldout_eval_before_recalibration").
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import data
from .continuations import continuations
from .recipe import DRAFTER, DrafterRecipe
from .torch_model import TorchDrafter, as_arrays, as_tensors
from .train_drafter import evaluate, load_trunk

PROMPTS = 256
ANCHORS = 24
SEED = 777


@torch.no_grad()
def own_chain_slots(drafter: TorchDrafter, ids, taps, prompt_len: int, rng) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [n, d + r] = [hidden_k ; W1[own x_{k-1}]], correct [n]) over sampled anchors."""
    b = drafter.c.block
    feats, oks = [], []
    for s in range(0, ids.shape[0], 16):
        sid, st = ids[s : s + 16], taps[s : s + 16]
        pos = torch.from_numpy(rng.integers(prompt_len, ids.shape[1] - b, (sid.shape[0], ANCHORS)))
        hidden, logits = drafter.block(drafter.context_kv(st), sid, pos)
        N = pos.numel()
        hidden, logits = hidden.reshape(N, b, -1), logits.reshape(N, b, -1)
        anchor = torch.gather(sid, 1, pos).reshape(N)
        drafts, _ = drafter.chain(hidden, logits, anchor)
        target = torch.gather(sid, 1, (pos[..., None] + 1 + torch.arange(b)).flatten(1)).reshape(N, b)
        prev = torch.cat([anchor[:, None], drafts[:, :-1]], 1)
        _, e = drafter.markov(prev)
        feats.append(torch.cat([hidden, e], -1).flatten(0, 1))
        oks.append((drafts == target).float().flatten())
    return torch.cat(feats), torch.cat(oks)


def calibrate(out: Path, r: DrafterRecipe = DrafterRecipe()) -> None:
    t0 = time.time()
    trunk = load_trunk(out)
    with np.load(out / "drafter.npz") as z:
        drafter = TorchDrafter(DRAFTER, trunk, as_tensors({k: z[k] for k in z.files}))
    train_files, held = data.split()
    ids, taps = continuations(trunk, train_files, PROMPTS, r.prompt_len, r.new_tokens, SEED)
    x, y = own_chain_slots(drafter, ids, taps, r.prompt_len, np.random.default_rng(SEED))
    w = torch.cat([drafter.w["conf.w"], drafter.w["conf.b"]]).clone().requires_grad_(True)
    opt = torch.optim.LBFGS([w], lr=0.5, max_iter=200, line_search_fn="strong_wolfe")
    xb = torch.cat([x, torch.ones(x.shape[0], 1)], 1)

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(xb @ w, y) + 1e-4 * (w[:-1] ** 2).sum()
        loss.backward()
        return loss

    before = F.binary_cross_entropy_with_logits(xb @ torch.cat([drafter.w["conf.w"], drafter.w["conf.b"]]), y).item()
    opt.step(closure)
    after = F.binary_cross_entropy_with_logits(xb @ w, y).item()
    drafter.w["conf.w"], drafter.w["conf.b"] = w[:-1].detach().clone(), w[-1:].detach().clone()
    np.savez(out / "drafter.npz", **as_arrays(drafter.w))

    log = json.loads((out / "drafter_log.json").read_text())
    hids, htaps = continuations(trunk, held, 64, r.prompt_len, r.new_tokens, r.seed + 1000)  # as train_drafter
    log.setdefault("heldout_eval_before_recalibration", log["heldout_eval"])
    log["heldout_eval"] = evaluate(drafter, hids, htaps, r.prompt_len)
    log["recalibration"] = {"prompts": PROMPTS, "anchors_per_prompt": ANCHORS, "seed": SEED, "slots": int(y.numel()),
                            "slot_accuracy": round(float(y.mean()), 4), "bce_before": round(before, 4),
                            "bce_after": round(after, 4), "wall_s": round(time.time() - t0, 1)}
    (out / "drafter_log.json").write_text(json.dumps(log, indent=1))
    print(json.dumps({"recalibration": log["recalibration"], "heldout_eval": log["heldout_eval"]}, indent=1))
