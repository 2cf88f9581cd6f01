"""Stage 1: the trunk, a next-byte LM on the stdlib corpus (data.py), held-out files excluded.

Writes <out>/trunk.json, <out>/trunk.npz (weights, checkpointed every eval) and
<out>/trunk_log.json (losses, steps, wall time).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..models.config import to_json
from . import data
from .recipe import TRUNK, TrunkRecipe
from .schedule import Schedule, adamw
from .torch_model import TorchTrunk, as_arrays


def lm_loss(trunk: TorchTrunk, batch: torch.Tensor) -> torch.Tensor:
    logits, _ = trunk.forward(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


@torch.no_grad()
def heldout_loss(trunk: TorchTrunk, batches: list[torch.Tensor]) -> float:
    return float(np.mean([lm_loss(trunk, b).item() for b in batches]))


def save(trunk: TorchTrunk, out: Path, log: dict) -> None:
    (out / "trunk.json").write_text(to_json(trunk.c))
    np.savez(out / "trunk.npz", **as_arrays(trunk.w))
    (out / "trunk_log.json").write_text(json.dumps(log, indent=1))


def train(out: Path, r: TrunkRecipe = TrunkRecipe()) -> TorchTrunk:
    out.mkdir(parents=True, exist_ok=True)
    train_files, held = data.split()
    stream = data.byte_stream(train_files)
    held_stream = data.byte_stream(held)
    rng = np.random.default_rng(r.seed)
    held_rng = np.random.default_rng(12345)
    held_batches = [torch.from_numpy(data.random_windows(held_stream, r.batch, r.seq_len + 1, held_rng))
                    for _ in range(4)]
    torch.manual_seed(r.seed)
    trunk = TorchTrunk.init(TRUNK, r.seed)
    for p in trunk.params():
        p.requires_grad_(True)
    opt = adamw(trunk.params(), r.lr, r.weight_decay)
    sched = Schedule(r.lr, r.min_lr, r.warmup, r.max_steps, r.budget_s)
    log = {"recipe": r.__dict__, "python": data.python_version(), "train_files": len(train_files),
           "heldout_files": len(held), "train_bytes": int(stream.size), "heldout_bytes": int(held_stream.size),
           "train_loss": [], "heldout_loss": []}
    t0, step, ema = time.time(), 0, None
    while not sched.done(step):
        for g in opt.param_groups:
            g["lr"] = sched.rate(step)
        batch = torch.from_numpy(data.random_windows(stream, r.batch, r.seq_len + 1, rng))
        loss = lm_loss(trunk, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trunk.params(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 10 == 0:
            log["train_loss"].append([step, round(ema, 4)])
            print(f"step {step} loss {loss.item():.4f} ema {ema:.4f} lr {sched.rate(step):.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)
        if step % r.eval_every == 0:
            h = heldout_loss(trunk, held_batches)
            log["heldout_loss"].append([step, round(h, 4)])
            log.update(steps=step, wall_s=round(time.time() - t0, 1), tokens=step * r.batch * r.seq_len)
            print(f"step {step} heldout {h:.4f}", flush=True)
            save(trunk, out, log)
    h = heldout_loss(trunk, held_batches)
    log["heldout_loss"].append([step, round(h, 4)])
    log.update(steps=step, wall_s=round(time.time() - t0, 1), tokens=step * r.batch * r.seq_len,
               final_train_ema=round(ema, 4), final_heldout=round(h, 4))
    print(f"done: {step} steps, heldout {h:.4f}, {time.time() - t0:.0f}s", flush=True)
    save(trunk, out, log)
    return trunk
