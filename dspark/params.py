"""Request parameters: sampling filters and speculation settings; a sampled request's seed."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """How a request samples: temperature, then the top-k, top-p and min-p filters, and the seed.

    temperature 0 is greedy. top_k 0, top_p 1 and min_p 0 switch those filters off. The seed keys
    every draw of the request's Philox streams (dspark.spec_sampling). `seed` None (the default):
    a sampled request draws a fresh one from the OS when it is admitted (`seeded`: Worker.submit,
    DsparkSpecSession.prime and restore, plain_generate), never here: a params object reused for
    many requests, or SpecParams' default, would give them all one seed. Greedy ignores it."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        checks = [
            ("temperature", self.temperature, self.temperature >= 0 and np.isfinite(self.temperature), ">= 0"),
            ("top_k", self.top_k, isinstance(self.top_k, (int, np.integer)) and self.top_k >= 0, "an int >= 0"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", self.min_p, 0 <= self.min_p < 1, "in [0, 1)"),
            ("seed", self.seed, self.seed is None or (isinstance(self.seed, (int, np.integer)) and not isinstance(
                self.seed, bool) and 0 <= self.seed < 2**64), "None or an int in [0, 2^64)"),
        ]
        for name, value, ok, want in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={value!r}: expected {want}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def draw_seed() -> int:
    """A fresh 64-bit seed from the OS (as HF generate, vLLM and llama.cpp draw one when none is given)."""
    return int.from_bytes(os.urandom(8), "little")


def seeded(sampling: SamplingParams | None) -> SamplingParams | None:
    """`sampling` with a seed: a sampled one without a seed gets a fresh one (draw_seed); greedy
    ones and seeded ones are returned as they are. Called once per request, when it is admitted."""
    if sampling is None or sampling.greedy or sampling.seed is not None:
        return sampling
    return replace(sampling, seed=draw_seed())


VERIFY_POLICIES = ("auto", "confidence", "ladder", "full", "gain")
PROMPT_CHUNK = 8192  # tokens per prompt pass by default (HybridTrunk.prompt_passes): activations scale with it
ROLLBACKS = ("checkpoint", "replay")
LAUNCHES = ("graph", "eager", "plain")   # dspark.graphs: how a round's passes reach the device
SAMPLERS = ("coupled", "rejection")
POLICIES = ("gain", "always")


@dataclass(frozen=True)
class SpecParams:
    """How a speculative session runs: its token budget, burst size, verify-width policy, rollback,
    prompt-end capture, sampling, launch mode on cuda, sampler and speculation policy."""

    max_new_tokens: int = 256
    burst_target: int = 32
    verify: str = "auto"         # verify width: the drafter's confidence head where it has one, else the
                                 # ladder ("auto"); "confidence", "ladder", "full" (every draft), or "gain"
                                 # (the width of most expected tokens per unit of round cost: dspark.gain)
    tau: float = 0.5
    max_verify: int = 0          # cap on vt for both policies (the ladder's cap); 0: nd + 1
    rollback: str = "checkpoint"  # per-column checkpoint select, or snapshot restore + replay
    capture: bool = True
    sampling: SamplingParams = field(default_factory=SamplingParams)
    launches: str = "graph"      # on cuda: each pass recorded once per batch and replayed as a CUDA graph
                                 # ("graph") or by the host launch by launch ("eager"), or run op by op
                                 # ("plain"); dspark.graphs (greedy and coupled rounds; rejection: op by op)
    sampler: str = "coupled"     # sampled sessions: "coupled" (plain sampled decode's stream, demotable) or
                                 # "rejection" (lossless rejection sampling); dspark.spec_sampling
    policy: str = "gain"         # where to speculate (dspark.gain): "gain" admits where the predicted gain exceeds
                                 # 1 + margin and demotes where the measured gain stays below 1 for `patience`
                                 # burst boundaries; "always" speculates wherever the concurrency gate admits
                                 # (a rejection-sampled request ignores the gate under both: dspark.gain)
    margin: float = 0.1
    patience: int = 2

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, (int, np.integer)) or self.max_new_tokens < 1:
            raise ValueError(f"SpecParams.max_new_tokens={self.max_new_tokens!r}: expected an int >= 1")
        if not isinstance(self.burst_target, (int, np.integer)) or self.burst_target < 1:
            raise ValueError(f"SpecParams.burst_target={self.burst_target!r}: expected an int >= 1")
        if self.verify not in VERIFY_POLICIES:
            raise ValueError(f"SpecParams.verify={self.verify!r}: expected one of {VERIFY_POLICIES}")
        if self.rollback not in ROLLBACKS:
            raise ValueError(f"SpecParams.rollback={self.rollback!r}: expected one of {ROLLBACKS}")
        if not isinstance(self.max_verify, (int, np.integer)) or self.max_verify == 1 or self.max_verify < 0:
            raise ValueError(f"SpecParams.max_verify={self.max_verify!r}: expected 0 (no cap) or an int >= 2")
        if not 0.0 <= self.tau <= 1.0:
            raise ValueError(f"SpecParams.tau={self.tau!r}: expected a value in [0, 1]")
        if self.launches not in LAUNCHES:
            raise ValueError(f"SpecParams.launches={self.launches!r}: expected one of {LAUNCHES}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"SpecParams.sampler={self.sampler!r}: expected one of {SAMPLERS}")
        if self.policy not in POLICIES:
            raise ValueError(f"SpecParams.policy={self.policy!r}: expected one of {POLICIES}")
        if not (isinstance(self.margin, (int, float)) and 0.0 <= self.margin < 10.0):
            raise ValueError(f"SpecParams.margin={self.margin!r}: expected a number in [0, 10)")
        if not isinstance(self.patience, (int, np.integer)) or isinstance(self.patience, bool) or self.patience < 1:
            raise ValueError(f"SpecParams.patience={self.patience!r}: expected an int >= 1")
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"SpecParams.sampling: expected SamplingParams, got {type(self.sampling).__name__}")

    @property
    def accept(self) -> str:
        """The round's accept rule: "greedy", "coupled" or "rejection" (sessions of one round share it)."""
        return "greedy" if self.sampling.greedy else self.sampler

    @property
    def coupled(self) -> bool:
        return self.accept == "coupled"

    @property
    def demotable(self) -> bool:
        """Whether the session's stream equals plain decode's (with its sampling) at every burst
        boundary, so it may be demoted there without changing a byte: greedy, or coupled sampled."""
        return self.accept != "rejection"
