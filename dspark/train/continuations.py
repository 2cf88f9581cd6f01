"""The drafter's data: the trunk's own greedy continuations of corpus prompts, and its taps.

At inference the drafter is only ever asked for what the trunk would say greedily next, from
taps of rows the trunk has committed. So the training sequences are [prompt ; trunk greedy
continuation], and the taps come from one causal trunk pass over them: row t's taps see rows
<= t only, so they equal the taps the session ingests when it commits row t.
"""

from __future__ import annotations

import numpy as np
import torch

from . import data
from .torch_model import TorchTrunk


@torch.no_grad()
def continuations(trunk: TorchTrunk, files: list[str], count: int, prompt_len: int, new: int, seed: int,
                  chunk: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [count, prompt_len + new] int64, taps [count, prompt_len + new, n_taps * d] f32)."""
    prompts = torch.from_numpy(data.code_prompts(files, count, prompt_len, np.random.default_rng(seed)))
    ids, taps = [], []
    for s in range(0, count, chunk):
        seq = trunk.greedy(prompts[s : s + chunk], new)
        ids.append(seq)
        taps.append(trunk.forward(seq)[1])
    return torch.cat(ids), torch.cat(taps)
