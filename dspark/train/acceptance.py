"""Greedy rounds replayed offline on [prompt ; trunk greedy continuation] sequences.

Greedy verify accepts draft j exactly when it equals the trunk's argmax after the committed
prefix, which on these sequences is the next token of the continuation. So a round at `pos`
(anchor = token at pos, draft KV = taps of rows < pos) is: drafter block, the Markov chain,
confidence -> vt (session.verify_width, confidence policy), m = longest prefix of matching
drafts among the vt - 1 verified, emit m + 1, pos += m + 1. Same bookkeeping as SpecStats.
"""

from __future__ import annotations

import numpy as np
import torch

from ..stats import SpecStats
from .torch_model import TorchDrafter


@torch.no_grad()
def replay_rounds(drafter: TorchDrafter, ids, taps, prompt_len: int, tau: float = 0.5,
                  width: str = "confidence") -> tuple[SpecStats, np.ndarray]:
    """Rounds from pos = prompt_len until a round could run past the sequence. width "confidence"
    (tau) or "full" (verify all drafts). Returns (stats, [n, 2] (confidence, correct) per drafted
    slot of every round, own chain)."""
    b = drafter.c.block
    nd = drafter.c.drafts
    B, T = ids.shape
    ctx = drafter.context_kv(taps)
    pos = torch.full((B,), prompt_len, dtype=torch.long)
    stats = SpecStats()
    calib = []
    while True:
        live = torch.nonzero(pos + b + 1 <= T)[:, 0]
        if live.numel() == 0:
            break
        sub_ctx = [(k[live], v[live]) for k, v in ctx]
        hidden, logits = drafter.block(sub_ctx, ids[live], pos[live][:, None])
        anchor = ids[live, pos[live]]
        drafts, conf = drafter.chain(hidden[:, 0], logits[:, 0], anchor)
        conf = torch.sigmoid(conf)
        target = torch.gather(ids[live], 1, pos[live][:, None] + 1 + torch.arange(nd))
        ok = drafts == target
        calib.append(torch.stack([conf.flatten(), ok.flatten().float()], 1))
        for i, s in enumerate(live.tolist()):
            if width == "confidence":
                below = torch.nonzero(conf[i] < tau)[:, 0]
                vt = 1 + (int(below[0]) if below.numel() else nd)
                vt = min(max(vt, 2), nd + 1)
            else:
                vt = nd + 1
            m = 0
            while m < vt - 1 and ok[i, m]:
                m += 1
            stats.record(vt - 1, m)
            pos[s] += m + 1
    return stats, torch.cat(calib).numpy()


def calibration(pairs: np.ndarray, bins: int = 10) -> list[tuple[float, float, float, int]]:
    """[(bin low, mean predicted, observed accuracy, count)] over confidence bins."""
    edges = np.linspace(0, 1, bins + 1)
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (pairs[:, 0] >= lo) & ((pairs[:, 0] < hi) | (hi == 1.0))
        if sel.any():
            out.append((float(lo), float(pairs[sel, 0].mean()), float(pairs[sel, 1].mean()), int(sel.sum())))
    return out
