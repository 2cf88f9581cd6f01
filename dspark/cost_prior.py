"""The cost model's prior on `cuda`: the performance model's prediction per (trunk, drafter) shape.

`cost_prior_h200.json` (package data) is written by `python profiling/perf_model.py --prior-table`:
for each shape the performance model knows, keyed by `fingerprint` of its trunk and drafter
configs, the predicted seconds on an H200 (greedy, passes replayed from CUDA graphs, the `cuda`
default) of a round, of its verify pass and of a plain step, over a grid of batch (BATCHES),
verify width (2 .. the drafter's block) and context (doublings from 512 to 32768, or up to the
last context a round reaches in the trunk's max_ctx, which is then a grid point too). A round replayed from a graph does not time its verify apart;
the verify's figure is the verify pass's kernels plus a plain step's launch and host overhead (a
trunk pass issued as one), so it prices what `timed("verify")` measures where the verify is timed
(passes issued op by op) and equals a plain step at one column, as the CPU prior's does.

`TablePrior` prices as `dspark.cost.Prior` does, in plain steps of one row at the table's
smallest context: linear in verify width and in batch between grid points and beyond them
(the end segment's slope), linear in context between grid points (attention reads grow with the
keys), constant below the first and the last segment's slope above the last.

`adopt` sets a backend's prior where the pair is first known (a drafter built on its trunk): on
`cuda` the table's entry for the pair, else (the CPU backends, or a shape not in the table)
`Prior()`. It is taken once, by the first pair built on the backend, and only while nothing is
measured: measurements are kept as ratios to the prior they were taken under. A second pair on
the same backend shares the first's prior (and its measurements: the cost model is the
backend's); the measured scale replaces the prior's within a few rounds either way.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import numpy as np

from .cost import CONTEXT_BUCKET, Prior, cost_model, uniform_distinct

TABLE = Path(__file__).resolve().parent / "cost_prior_h200.json"
BATCHES = (1, 2, 4, 8, 16, 32)
FIRST_CONTEXT = CONTEXT_BUCKET // 2  # in bucket 0; each doubling is in the next bucket (dspark.cost)
LAST_CONTEXT = 32768
TRUNK_FIELDS = ("vocab", "d_model", "mlp_hidden", "layers", "attn_heads", "attn_kv_heads", "head_dim", "gdn_heads",
                "gdn_k_heads", "gdn_dk", "gdn_dv", "attn_gate", "kv_dtype")
MOE_FIELDS = ("ffn", "experts", "expert_top_k", "expert_hidden", "shared_expert_hidden")
DRAFTER_FIELDS = ("block", "window", "layer_windows", "layers", "heads", "kv_heads", "head_dim", "mlp_hidden",
                  "markov", "markov_rank", "draft_vocab", "selector_rank", "conv_kernel")


def fingerprint_fields(trunk_config, drafter_config, weights: str = "") -> dict:
    """What prices a pass: the widths, layers and their kinds, heads, vocabulary, drafter block and
    window (None for a field a config-like object lacks: no shape of the table then matches), a
    MoE trunk's experts (MOE_FIELDS), and `weights`, the trunk's weight format where it is not its
    storage dtype ("fp8": block-scaled e4m3 linears, half the bytes a pass reads; absent otherwise,
    so 16-bit pairs keep their keys)."""
    def pick(cfg, names, prefix):
        return {f"{prefix}.{n}": (list(v) if isinstance(v := getattr(cfg, n, None), tuple) else v) for n in names}
    fields = {**pick(trunk_config, TRUNK_FIELDS, "trunk"), **pick(drafter_config, DRAFTER_FIELDS, "drafter")}
    if getattr(trunk_config, "experts", 0):  # MoE trunks only: dense pairs keep their keys
        fields.update(pick(trunk_config, MOE_FIELDS, "trunk"))
    return {**fields, "trunk.weights": weights} if weights else fields


def weight_format(trunk) -> str:
    """"fp8" for a trunk whose linears are block-scaled e4m3 (dspark.ops.fp8.Fp8Matrix), else ""."""
    from .ops.fp8 import Fp8Matrix
    from .ops.linear import ColumnRuns
    return "fp8" if any(isinstance(w, Fp8Matrix) or (isinstance(w, ColumnRuns)
                                                     and any(isinstance(m, Fp8Matrix) for m, _ in w.runs))
                        for w in trunk.w.values()) else ""


def fingerprint(trunk_config, drafter_config, weights: str = "") -> str:
    """The table's key for a (trunk, drafter) pair: a hash of `fingerprint_fields`."""
    text = json.dumps(fingerprint_fields(trunk_config, drafter_config, weights), sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def contexts_for(max_ctx: int, block: int) -> tuple[int, ...]:
    """The table's contexts for a shape: doublings of FIRST_CONTEXT up to LAST_CONTEXT, each leaving
    a block, then the last context a round reaches where that is short of LAST_CONTEXT (so a small
    shape's prior never extrapolates)."""
    last = max_ctx - block
    out, c = [], FIRST_CONTEXT
    while c <= min(LAST_CONTEXT, last):
        out.append(c)
        c *= 2
    if last < LAST_CONTEXT and (not out or out[-1] < last):
        out.append(last)
    return tuple(out)


@functools.lru_cache(maxsize=1)
def table() -> dict:
    """The shipped table: {"entries": {fingerprint: entry}, ...}."""
    return json.loads(TABLE.read_text())


def _at(xs, x: float, clamp_below: bool = False) -> tuple[int, int, float]:
    """(i, j, t): x lies at (1 - t) xs[i] + t xs[j]; t outside [0, 1] extrapolates the end segment."""
    if len(xs) == 1:
        return 0, 0, 0.0
    if clamp_below:
        x = max(x, xs[0])
    i = int(np.clip(np.searchsorted(xs, x) - 1, 0, len(xs) - 2))
    return i, i + 1, (x - xs[i]) / (xs[i + 1] - xs[i])


class TablePrior:
    """Prior's interface over one shape's entry of the table (module doc)."""

    def __init__(self, entry: dict):
        self.shape = entry["shape"]
        self.batches = np.array(entry["batches"], np.float64)
        self.widths = np.array(entry["widths"], np.float64)
        self.contexts = np.array(entry["contexts"], np.float64)
        self._plain = np.array(entry["plain"], np.float64)     # [batch, context] seconds
        self._round = np.array(entry["round"], np.float64)     # [batch, width, context] seconds
        self._verify = np.array(entry["verify"], np.float64)
        self.unit = float(self._plain[0, 0])  # a plain step of one row at the smallest context
        # A MoE trunk's entry: its experts, and what one distinct expert per layer costs (seconds,
        # in plain steps of one row here); the grid is priced at uniform routing (`distinct`).
        moe = entry.get("experts") or {}
        self.experts, self.top_k = int(moe.get("count", 0)), int(moe.get("top_k", 0))
        self.expert_step = float(moe.get("seconds", 0.0)) / self.unit

    def __repr__(self) -> str:
        return f"TablePrior({self.shape!r})"

    def _grid(self, values, batch, context, width=None) -> float:
        bi, bj, bt = _at(self.batches, float(batch))
        ci, cj, ct = _at(self.contexts, float(context), clamp_below=True)
        if width is not None:
            wi, wj, wt = _at(self.widths, float(width))
            values = values[:, wi] * (1.0 - wt) + values[:, wj] * wt
        values = values[bi] * (1.0 - bt) + values[bj] * bt
        seconds = values[ci] * (1.0 - ct) + values[cj] * ct
        return max(float(seconds), 1e-3 * self.unit) / self.unit

    def distinct(self, rows: float) -> float:
        return uniform_distinct(self.experts, self.top_k, rows)

    def _experts(self, rows: float, D: float | None) -> float:
        """The change from the table's uniform routing to D distinct experts per layer."""
        return self.expert_step * (D - self.distinct(rows)) if D is not None and self.expert_step else 0.0

    def plain(self, batch: int, context: int, D: float | None = None) -> float:
        return self._grid(self._plain, batch, context) + self._experts(batch, D)

    def round(self, batch: int, width: float, context: int, D: float | None = None) -> float:
        return self._grid(self._round, batch, context, width) + self._experts(batch * width, D)

    def verify(self, batch: int, width: float, context: int, D: float | None = None) -> float:
        return self._grid(self._verify, batch, context, width) + self._experts(batch * width, D)


def moe_prior(trunk_config) -> Prior:
    """Prior() with a MoE trunk's experts, for a MoE shape the table does not know: one distinct
    expert per layer costs its share of the weights a one-row plain step reads (the trunk's tensors
    but the embedding table, of which a step reads a row, and but the experts a row is not routed
    to), as a bandwidth-bound decode step does."""
    from .models.weights import trunk_spec
    expert = dense = 0
    for name, shape in trunk_spec(trunk_config).items():
        n = int(np.prod(shape))
        if ".moe.experts." in name:
            expert += n
        elif name != "embed" or trunk_config.tie_embeddings:  # a tied table is the LM head, read whole
            dense += n
    one = expert / trunk_config.experts  # one expert in every MoE layer
    return Prior(experts=trunk_config.experts, top_k=trunk_config.expert_top_k,
                 expert_step=one / (dense + trunk_config.expert_top_k * one))


def prior_for(be, trunk_config, drafter_config, weights: str = ""):
    """The prior for the pair on backend `be`: on `cuda` the table's entry for it, else (a shape it
    does not know) Prior(), with the trunk's experts for a MoE trunk (`moe_prior`); on the CPU
    backends Prior(), whose passes measure what an expert costs (dspark.cost, "Experts")."""
    if be.name != "cuda":
        return Prior()
    entry = table()["entries"].get(fingerprint(trunk_config, drafter_config, weights))
    if entry is not None:
        return TablePrior(entry)
    return moe_prior(trunk_config) if getattr(trunk_config, "experts", 0) else Prior()


def adopt(be, trunk_config, drafter_config, weights: str = "") -> None:
    """Set the backend's cost model prior for the pair (`weights`: weight_format of its trunk):
    once, before anything is measured (module doc)."""
    if be.name != "cuda":  # the CPU backends keep Prior()
        return
    cost_model(be).adopt(prior_for(be, trunk_config, drafter_config, weights),
                         fingerprint(trunk_config, drafter_config, weights))
