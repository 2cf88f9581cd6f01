"""What a process's past sessions measured: a prior for later sessions of their kind, never a
verdict (dspark.gain reads it; DsparkDrafter.acceptance holds it).

Buckets. One per (namespace, accept rule, temperature to 0.1): the worker's request namespace,
and None for requests without one, a bucket of its own that no namespaced request reaches. So a
tenant's requests move only that tenant's decisions.

A bucket is a discounted mean of its sessions' tokens per round. A session counts once, when it
ends (finished or demoted: dspark.gain.remember), at the weight of its tokens up to FULL_TOKENS:
by rounds, a poorly drafted request would weigh more than a well drafted one of the same length
(26 rounds against 9 for 64 tokens on the embedded pair), the bias that let one poor request
switch speculation off. Each session remembered discounts those before it by DECAY, so the
bucket's weight stays below 1 / (1 - DECAY) = 4 sessions and the memory follows what the
bucket's requests are now.

The prediction pools the bucket with the drafter's record (its recorded acceptance: dspark.gain.
prior_tokens) at the weight of RECORD_WEIGHT sessions, so the record keeps at least a fifth of
it: (RECORD_WEIGHT * record + sum) / (RECORD_WEIGHT + weight). On the embedded pair (record 4.72
greedy) one session at 2.5 tokens a round predicts 3.6, still speculative wherever a round costs
under 3.3 plain steps, and no single session can bring it under (4.72 + 1) / 2 = 2.9 (a round
emits at least its anchor); three at 2.5 predict 3.2 and four 3.1, and a bucket of sessions at
1.5 tends to 2.1: there a poor request starts plain, the memory working as memory.

Exploration. A bucket that predicts less than the record may have stopped speculating, and plain
sessions measure nothing: every EXPLORE_EVERY-th arrival predicted under the record is predicted
by the record alone (`arrival`), as a fresh process would, so it speculates where the record
says so, is measured, and is remembered. What that costs is bounded: one arrival in
EXPLORE_EVERY, and an explored session that loses is demoted by its own measured gain after
dspark.gain.WINDOW + patience rounds at most.
"""

from __future__ import annotations

from dataclasses import dataclass

RECORD_WEIGHT = 1.0   # the drafter's record beside the memory, in sessions
DECAY = 0.75          # each session remembered discounts the ones before it: the weight stays below 4 sessions
FULL_TOKENS = 64      # a session's weight is its tokens over this, at most 1
EXPLORE_EVERY = 8     # of the arrivals a bucket predicts under the record, this one in N is predicted by the record


@dataclass
class Bucket:
    total: float = 0.0   # discounted sum of weight x tokens per round
    weight: float = 0.0  # discounted sum of the sessions' weights
    below: int = 0       # arrivals predicted under the record since the last one explored
    explored: int = 0    # arrivals predicted by the record alone (stats)


class Memory:
    """The buckets of one drafter (`DsparkDrafter.acceptance`)."""

    def __init__(self):
        self.buckets: dict[tuple, Bucket] = {}

    def clear(self) -> None:
        self.buckets.clear()

    def predict(self, key: tuple, record: float) -> float:
        """Tokens per round expected of a session of bucket `key`: the bucket pooled with `record`."""
        b = self.buckets.get(key)
        if b is None or b.weight <= 0:
            return float(record)
        return (RECORD_WEIGHT * record + b.total) / (RECORD_WEIGHT + b.weight)

    def arrival(self, key: tuple, record: float) -> tuple[float, bool]:
        """The prediction for a request arriving in bucket `key`, and whether it explores: every
        EXPLORE_EVERY-th arrival that the bucket predicts under `record` is predicted by `record`."""
        got = self.predict(key, record)
        if got >= record:
            return got, False
        b = self.buckets[key]
        b.below += 1
        if b.below < EXPLORE_EVERY:
            return got, False
        b.below, b.explored = 0, b.explored + 1
        return float(record), True

    def remember(self, key: tuple, tokens_per_round: float, tokens: int) -> None:
        """Fold in one session of bucket `key` that emitted `tokens` at `tokens_per_round`."""
        w = min(1.0, tokens / FULL_TOKENS)
        if not w > 0:
            return
        b = self.buckets.setdefault(key, Bucket())
        b.total = DECAY * b.total + w * tokens_per_round
        b.weight = DECAY * b.weight + w
