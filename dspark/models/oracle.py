"""OracleDrafter: a DsparkDrafter whose proposals hit a known continuation at a chosen rate.

Random-weight drafters almost never agree with a random trunk, so every round would accept zero
drafts and the rollback paths for partial accepts would go unexercised. The oracle is the real
drafter (same ring, same kernels) with one change: after its block pass, the logit of the known
next token (the trunk's plain greedy stream) is raised in a slot with probability `hit_rate`,
decided by a generator seeded from (seed, pos, slot), so runs are reproducible and independent
of batching. Exactness must hold whatever the drafts are; this only makes every accepted length
from 0 to nd occur.
"""

from __future__ import annotations

import numpy as np

from .drafter import DsparkDrafter

BOOST = 1.0e4


class OracleDrafter(DsparkDrafter):
    def __init__(self, base: DsparkDrafter, hit_rate: float = 0.75, seed: int = 0):
        self.__dict__.update(base.__dict__)
        self.hit_rate, self.seed = hit_rate, seed
        self.next_stream: list[int] | None = None

    def new_kv(self, owner: str):
        """Draft KVs made from here on follow `next_stream`: the request's prompt followed by its
        plain greedy output (None: no help)."""
        kv = super().new_kv(owner)
        kv.oracle_stream = self.next_stream
        return kv

    def block_pass(self, kvs, anchors):
        hidden, logits = super().block_pass(kvs, anchors)
        b, nd = self.config.block, self.config.drafts
        first = b - nd  # shifted: row k is slot k; mask_fill: row k+1 is slot k
        host = self.be.to_host(logits).copy()
        for i, kv in enumerate(kvs):
            seq = getattr(kv, "oracle_stream", None)
            for k in range(nd if seq is not None else 0):
                target = kv.pos + k + 1  # slot k proposes the token at pos + k + 1
                rng = np.random.default_rng([self.seed, kv.pos, k])
                if target < len(seq) and rng.random() < self.hit_rate:
                    host[i * b + first + k, seq[target]] += BOOST
        return hidden, self.be.asarray(host)
