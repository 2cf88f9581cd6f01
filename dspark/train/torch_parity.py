"""The torch side of the parity checks: the mirror's outputs for exactly what parity.numpy_trunk
and parity.numpy_block compute."""

from __future__ import annotations

import torch

from .torch_model import TorchDrafter, TorchTrunk


@torch.no_grad()
def torch_trunk(trunk: TorchTrunk, ids):
    logits, taps = trunk.forward(torch.as_tensor(ids, dtype=torch.long)[None])
    return logits[0].numpy(), taps[0].numpy()


@torch.no_grad()
def torch_block(drafter: TorchDrafter, ids, pos: int) -> dict:
    ids = torch.as_tensor(ids, dtype=torch.long)[None]
    _, taps = drafter.trunk.forward(ids)
    hidden, logits = drafter.block(drafter.context_kv(taps), ids, torch.tensor([[pos]]))
    hidden, logits = hidden[0, 0], logits[0, 0]
    b = drafter.c.block
    bias, emb = drafter.markov(ids[0, pos : pos + b])
    conf = torch.sigmoid(drafter.confidence_logit(hidden, emb))
    return {"hidden": hidden.numpy(), "logits": logits.numpy(), "markov_logits": (logits + bias).numpy(),
            "conf": conf.numpy()}
