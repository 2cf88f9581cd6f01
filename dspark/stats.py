"""Speculation statistics, per session and aggregated; and rounds split by whether they start on
fresh text or inside a repetition."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# A round is "inside a repetition" when the last REPEAT_SPAN tokens of its context, ending with
# its anchor, already occurred earlier in that context: the text is repeating itself, and a
# drafter that has seen the loop predicts it far better than fresh text.
REPEAT_SPAN = 16


@dataclass
class SpecStats:
    """Speculation counts of a session (or of many, merged): rounds, drafts verified and accepted,
    per draft position, and the histogram of accepted drafts per round."""

    rounds: int = 0
    drafted: int = 0     # drafts sent to verify (vt - 1 per round)
    accepted: int = 0    # drafts accepted (m per round)
    verified_at: list[int] = field(default_factory=list)  # [k]: rounds that verified draft k+1
    accepted_at: list[int] = field(default_factory=list)  # [k]: rounds that accepted draft k+1
    histogram: list[int] = field(default_factory=list)    # [m]: rounds that accepted m drafts

    def record(self, verified: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += verified
        self.accepted += accepted
        for lst, n in ((self.verified_at, verified), (self.accepted_at, verified), (self.histogram, accepted + 1)):
            if len(lst) < n:
                lst.extend([0] * (n - len(lst)))
        for k in range(verified):
            self.verified_at[k] += 1
        for k in range(accepted):
            self.accepted_at[k] += 1
        self.histogram[accepted] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per round: 1 + accepted / rounds (the anchor always counts)."""
        return 1.0 + self.accepted / self.rounds if self.rounds else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """[k]: fraction of the rounds that verified draft k+1 which accepted it."""
        return [a / v if v else 0.0 for a, v in zip(self.accepted_at, self.verified_at)]

    @property
    def widths(self) -> dict[int, int]:
        """{verify width (anchor + drafts): rounds that verified that many columns}, from verified_at."""
        counts = [self.rounds, *self.verified_at, 0]
        return {v + 1: counts[v] - counts[v + 1] for v in range(len(counts) - 1) if counts[v] > counts[v + 1]}

    def merge(self, other: "SpecStats") -> "SpecStats":
        out = SpecStats(self.rounds + other.rounds, self.drafted + other.drafted, self.accepted + other.accepted)
        for name in ("verified_at", "accepted_at", "histogram"):
            a, b = getattr(self, name), getattr(other, name)
            n = max(len(a), len(b))
            setattr(out, name, [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)])
        return out

    def summary(self) -> str:
        pos = " ".join(f"{p:.2f}" for p in self.acceptance_by_position)
        return (f"rounds {self.rounds}, drafted {self.drafted}, accepted {self.accepted}, "
                f"mean accepted length {self.mean_accepted_length:.2f}, acceptance by position [{pos}]")


def repeats_earlier(context, span: int = REPEAT_SPAN) -> bool:
    """Whether the last `span` tokens of `context` (prompt, emitted tokens, then the round's
    anchor) also occur at an earlier start in it (occurrences may overlap the suffix)."""
    c = np.asarray(context, np.int64)
    if c.size <= span:
        return False
    windows = np.lib.stride_tricks.sliding_window_view(c[:-1], span)
    return bool((windows == c[-span:]).all(axis=1).any())


@dataclass
class RoundTrace:
    """The rounds of one request along its text: where each started (tokens emitted before it),
    the drafts it verified and accepted, and whether its context repeats itself
    (`repeats_earlier`). What `--plot` draws, and the source of a `RepetitionSplit`."""
    starts: list[int] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    repeat: list[bool] = field(default_factory=list)

    def record(self, context, start: int, verified: int, accepted: int) -> None:
        """`context`: the prompt, the tokens emitted before the round and its anchor."""
        self.starts.append(int(start))
        self.verified.append(int(verified))
        self.accepted.append(int(accepted))
        self.repeat.append(repeats_earlier(context))

    def record_rounds(self, stream, start: int, rounds) -> None:
        """`rounds`: (tokens emitted before the round, verified, accepted) of each round of one
        request whose prompt and output are `stream`, the output starting at `start`."""
        for before, verified, accepted in rounds:
            self.record(stream[: start + before + 1], before, verified, accepted)

    @property
    def tokens(self) -> list[int]:
        """Tokens each round emitted: its accepted drafts and its anchor."""
        return [a + 1 for a in self.accepted]

    def stats(self, repeat: bool | None = None) -> SpecStats:
        """SpecStats of the rounds (of those inside a repetition, or on fresh text, if `repeat`)."""
        out = SpecStats()
        for v, a, r in zip(self.verified, self.accepted, self.repeat):
            if repeat is None or r == repeat:
                out.record(v, a)
        return out


@dataclass
class RepetitionSplit:
    """SpecStats of the rounds that start on fresh text and of those inside a repetition
    (`repeats_earlier` of the round's context)."""
    fresh: SpecStats = field(default_factory=SpecStats)
    repeat: SpecStats = field(default_factory=SpecStats)

    def record(self, context, verified: int, accepted: int) -> None:
        (self.repeat if repeats_earlier(context) else self.fresh).record(verified, accepted)

    def record_rounds(self, stream, start: int, rounds) -> None:
        """`rounds`: (tokens emitted before the round, verified, accepted) of each round of one
        request whose prompt and output are `stream`, the output starting at `start`."""
        trace = RoundTrace()
        trace.record_rounds(stream, start, rounds)
        self.add(trace)

    def add(self, trace: RoundTrace) -> None:
        self.fresh = self.fresh.merge(trace.stats(repeat=False))
        self.repeat = self.repeat.merge(trace.stats(repeat=True))

    def merge(self, other: "RepetitionSplit") -> "RepetitionSplit":
        return RepetitionSplit(self.fresh.merge(other.fresh), self.repeat.merge(other.repeat))

    def summary(self) -> str:
        return (f"fresh text: {self.fresh.rounds} rounds, mean accepted length {self.fresh.mean_accepted_length:.2f}; "
                f"inside a repetition: {self.repeat.rounds} rounds, mean accepted length "
                f"{self.repeat.mean_accepted_length:.2f}")
