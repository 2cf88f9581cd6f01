"""The block drafter: one model code for the embedded drafter, DeepSpec DSpark, z-lab DFlash /
DFlash2 and speculators checkpoints, configured by DrafterConfig (dspark.models.hf loads the
released formats; each is a mapping onto these names).

Context: each committed trunk row's taps (the target's hidden_states[t + 1] for each tap layer t,
concatenated) become a feature f = norm(fc(taps)). Every drafter layer projects f to K (k_norm,
RoPE at the row's absolute position: default, linear or YaRN as transformers computes it) and V and
keeps them in a ring of `window + block` rows (the draft KV), whatever the context. Context rows do NOT pass the layer's input norm, and f is the same for every layer (as
in all three references). Only committed rows are ever ingested.

Block: one parallel pass over [anchor, MASK x (b-1)] at positions pos..pos+b-1, embedded with the
trunk's embedding (or the checkpoint's own copy) times embed_scale. Each layer: h = norm1(x); q
(q_norm when the checkpoint has it, RoPE), k (k_norm, RoPE) and v of the block rows; every row
attends, without a causal mask, to the layer's window of draft KV (all committed rows when the
window is 0, as the references do) plus the whole block; x += wo(o); x += MLP(norm2(x)). A window
is the last `window` committed rows for every block row (window_mode "anchor": speculators), or
the keys within `window` of the row's own position, both ways (window_mode "row": dflash's
non-causal sliding layers, DFlash2 for Qwen3.8). DFlash2
wraps the attention and the MLP in grouped dynamic causal convolutions over the block rows. Rows
go through the final norm (the checkpoint's own for the released formats, the trunk's for the
embedded drafter) and the LM head (the trunk's, or the checkpoint's own for a reduced draft
vocabulary), times logit_scale, soft-capped when logit_softcap > 0.

Harvest: "shifted" (DeepSpec DSpark, speculators sample_from_anchor=True, the embedded drafter):
every row is a draft, row k predicts the token at pos+k+1. "mask_fill" (z-lab DFlash,
speculators sample_from_anchor=False): rows 1..b-1 are the drafts, row k predicts pos+k.

Heads (dspark.models.drafter_heads): the Markov chain over the draft slots (vanilla, gated, rnn,
or DFlash2's candidate selector) and the confidence head.
"""

from __future__ import annotations

import numpy as np

from ..cost_prior import adopt, weight_format
from ..errors import ShapeError, TokenRangeError
from ..memory import Memory
from ..ops.activation import sigmoid_bias
from ..ops.argmax import argmax_rows, markov_chain, raise_on_nan
from ..ops.attention import attention
from ..ops.heads import confidence_features, gather_rows, logit_scale
from ..ops.kv_commit import kv_commit
from ..ops.linear import linear
from ..ops.norm import add_rmsnorm, embed_rmsnorm
from ..ops.rope import Heads, Rotary, qk_prepare
from ..ops.swiglu_linear import swiglu_linear
from ..ops.tables import PointerTable
from ..ops.workspace import Inputs, Workspace, fixed

from .batch_tables import TableStore, VersionedBuffers
from .drafter_config import INT_TENSORS, DrafterConfig, drafter_spec
from .drafter_heads import Chain
from .weights import check_weights, load_model, random_weights, save_model


FUSED_PARTS = ("attn.wq", "attn.wk", "attn.wv", "mlp.w_gate", "mlp.w_up")  # kept fused on the backend
# One GEMM per layer input (weights.FUSED); the ingest projects K|V only.
DEVICE_FUSED = (("attn.wqkv", ("attn.wq", "attn.wk", "attn.wv")), ("attn.wkv", ("attn.wk", "attn.wv")),
                ("mlp.w_gate_up", ("mlp.w_gate", "mlp.w_up")))
# The matrices only `linear` reads: on cuda they take the trunk's 16-bit type (storage_dtype).
LINEAR_MATRICES = ("fc", "attn.wkv", "attn.wqkv", "attn.wo", "mlp.w_gate_up", "mlp.w_down", "lm_head")


def storage_dtype(trunk, name: str) -> np.dtype:
    """What a drafter tensor is stored as: on cuda, the matrices of LINEAR_MATRICES in the trunk's
    16-bit type when it has one (a bf16 target's drafter: half the bytes a round reads, and the
    tensor-core GEMM, its activations rounded as the target's are); f32 everywhere else, and on the
    CPU backends always (their products widen 16-bit weights exactly, so f32 costs nothing there)."""
    wide = np.dtype(getattr(trunk, "weight_dtype", np.float32))
    if trunk.be.name == "cuda" and wide.itemsize == 2 and name.endswith(LINEAR_MATRICES):
        return wide
    return np.dtype(np.float32)


def stored_name(names: tuple) -> str:
    """The name a backend tensor made of `names` goes by: its DEVICE_FUSED name, or the one name."""
    return next((f for f, parts in DEVICE_FUSED if names[0].endswith(parts[0]) and len(names) > 1), names[0])


def drafter_layout(be, c: DrafterConfig, spec: dict, make) -> dict:
    """name -> backend array (owned by 'weights'; f32, or 16-bit on cuda: storage_dtype): every
    tensor of `spec` but the int maps and the parts of DEVICE_FUSED, which are there fused, side by
    side; `make(names)` gives one."""
    w = {k: be.alloc.adopt(make((k,)), "weights") for k in spec if k not in INT_TENSORS and not k.endswith(FUSED_PARTS)}
    for i in range(c.layers):
        p = f"layers.{i}."
        for fused, parts in DEVICE_FUSED:
            w[p + fused] = be.alloc.adopt(make(tuple(p + q for q in parts)), "weights")
    return w


class DraftTables:
    """One batch's pointer tables of draft-KV rings: per drafter layer the K and V rings, and
    every ring for the ingest's kv_commit (k then v, layer by layer)."""

    def __init__(self, be, kvs: list["DraftKV"], layers: int):
        self.k = [PointerTable(be, [kv.k[i] for kv in kvs], f"k_rings[{i}]", writable=True) for i in range(layers)]
        self.v = [PointerTable(be, [kv.v[i] for kv in kvs], f"v_rings[{i}]", writable=True) for i in range(layers)]
        self.commit = PointerTable(be, [kv.k[i] for i in range(layers) for kv in kvs]
                                   + [kv.v[i] for i in range(layers) for kv in kvs], "draft rings", writable=True)


class DraftKV(VersionedBuffers):
    """One session's draft KV: per drafter layer a K and V ring [Hkv, ring, D], and `pos`, the
    number of committed rows ingested so far. As dspark.models.cache.Cache, its ring lists are
    tuples and `version` changes when they are replaced or freed (the drafter's per-batch pointer
    tables are keyed by it)."""

    BUFFERS = ("k", "v")

    def __init__(self, be, shape: tuple[int, int, int], layers: int, owner: str):
        self.be, self.shape, self.owner = be, shape, owner
        self.k = [be.alloc.zeros(shape, np.float32, owner) for _ in range(layers)]
        self.v = [be.alloc.zeros(shape, np.float32, owner) for _ in range(layers)]
        self.pos = 0

    def copy(self, owner: str) -> "DraftKV":
        new = DraftKV(self.be, self.shape, len(self.k), owner)
        for dst, src in zip(new.k + new.v, self.k + self.v):
            dst[...] = src
        new.pos = self.pos
        return new

    def free(self) -> int:
        n = self.be.alloc.free_owner(self.owner)
        self.k = self.v = ()
        return n


class DsparkDrafter:
    def __init__(self, config: DrafterConfig, weights: dict[str, np.ndarray], trunk):
        c, tc = config, trunk.config
        check_weights(weights, drafter_spec(c, tc), "drafter", dtype_of={n: (np.int32,) for n in INT_TENSORS})
        if c.draft_vocab:
            d2t = weights["draft_to_target"]
            if np.any((d2t < 0) | (d2t >= tc.vocab)):
                raise TokenRangeError(f"drafter draft_to_target has ids outside the vocabulary [0, {tc.vocab})")

        def upload(names):
            host = weights[names[0]] if len(names) == 1 else np.concatenate([weights[q] for q in names], axis=1)
            return trunk.be.xp.asarray(np.asarray(host, np.float32).astype(storage_dtype(trunk, stored_name(names))))  # RNE
        self._setup(c, trunk, weights, drafter_layout(trunk.be, c, drafter_spec(c, tc), upload),
                    weights["draft_to_target"] if c.draft_vocab else None)

    @classmethod
    def placeholder(cls, config: DrafterConfig, trunk) -> "DsparkDrafter":
        """A drafter whose weights have the right shapes and layout but no values (as
        HybridTrunk.placeholder: for host-cost benchmarks on the CuPy stand-in's null memory)."""
        d = object.__new__(cls)
        spec = drafter_spec(config, trunk.config)

        def empty(names):
            first = spec[names[0]]
            shape = first if len(names) == 1 else (first[0], sum(spec[q][1] for q in names))
            return trunk.be.xp.zeros(shape, storage_dtype(trunk, stored_name(names)))  # as a load stores it
        d2t = np.arange(config.draft_vocab, dtype=np.int32) if config.draft_vocab else None
        d._setup(config, trunk, None, drafter_layout(trunk.be, config, spec, empty), d2t)
        return d

    def _setup(self, c: DrafterConfig, trunk, host_weights, w: dict, d2t) -> None:
        tc = trunk.config
        if c.d_model != tc.d_model:
            raise ValueError(f"drafter d_model={c.d_model} must equal the trunk's {tc.d_model}")
        # The session asks the trunk for these layers on every pass, whatever its default taps.
        taps = tuple(c.taps or tc.tap_layers)
        if any(not -1 <= t < len(tc.layers) for t in taps):
            raise ShapeError(f"drafter taps={taps}: expected layer indices of the trunk in [-1, {len(tc.layers)}) "
                             f"(-1: the embedding)")
        self.mask_id = c.mask_id if c.mask_id >= 0 else tc.mask_id
        if not 0 <= self.mask_id < tc.vocab:
            raise TokenRangeError(f"drafter mask_id={self.mask_id} is outside the vocabulary [0, {tc.vocab})")
        self.config, self.trunk, self.be = c, trunk, trunk.be
        adopt(trunk.be, tc, c, weight_format(trunk))  # the pair is known: its cost prior (dspark.cost_prior)
        self.taps = taps
        self.source = None  # a description when loaded from a released checkpoint (dspark.models.hf)
        self.accept_floor = None  # greedy mean accepted length its record guarantees (the gain's prior), if any
        self.sampled_accept = {}  # temperature: the coupled sampler's recorded mean accepted length (a prior)
        self.acceptance = Memory()  # what this process's sessions measured, by namespace and kind (dspark.memory)
        # Window 0 means every committed row, as the references attend: the ring then holds the
        # whole context the trunk's cache can, seen from the anchor. A sliding layer's window is
        # measured as the checkpoint's format says (c.window_mode).
        self.windows = tuple(w or tc.max_ctx for w in c.windows())
        self.window_modes = tuple(c.window_mode if w else "anchor" for w in c.windows())
        self.ring = max(self.windows) + c.block
        self.host_weights = host_weights
        self.w = w
        self.d2t = d2t  # host: draft row -> target id
        self.d2t_dev = self.be.asarray(d2t) if c.draft_vocab else None
        self._tables = TableStore()
        self.embed = self.w["embed"] if c.own_embed else trunk.w["embed"]
        self.final_norm = self.w["final_norm"] if c.own_norm else trunk.w["final_norm"]
        self.final_eps = c.norm_eps if c.own_norm else tc.norm_eps
        self.lm_head = self.w["lm_head"] if c.own_head else trunk.w["lm_head"]
        nkv = c.kv_heads * c.head_dim
        self.block_heads = Heads.packed(c.heads, c.kv_heads, c.head_dim)
        self.context_heads = Heads(0, c.kv_heads, c.head_dim, 0, c.head_dim, 0, nkv)  # the ingest's K|V rows
        self.rotary = Rotary.of(c.head_dim, c.rope_theta, c.rope_scaling)
        self.inv_freq = self.be.asarray(self.rotary.inv_freq)

    @classmethod
    def random(cls, config: DrafterConfig, trunk, seed: int) -> "DsparkDrafter":
        w = random_weights(drafter_spec(config, trunk.config), seed)
        if config.draft_vocab:
            rng = np.random.default_rng(seed)
            ids = rng.choice(trunk.config.vocab, config.draft_vocab, replace=False)
            w["draft_to_target"] = np.sort(ids).astype(np.int32)
        return cls(config, w, trunk)

    @classmethod
    def load(cls, directory, trunk, name: str = "drafter") -> "DsparkDrafter":
        config, tensors = load_model(directory, name, DrafterConfig)
        return cls(config, tensors, trunk)

    def save(self, directory, name: str = "drafter", fmt: str = "safetensors") -> None:
        save_model(directory, name, self.config, self.host_weights, fmt)

    def new_kv(self, owner: str) -> DraftKV:
        c = self.config
        return DraftKV(self.be, (c.kv_heads, self.ring, c.head_dim), c.layers, owner)

    @property
    def has_confidence(self) -> bool:
        return self.config.confidence != "none"

    # ---- context ------------------------------------------------------------------------------
    def tables(self, kvs: list[DraftKV]) -> DraftTables:
        """The pointer tables of this batch of draft KVs, made once per batch (batch_tables)."""
        return self._tables.get(tuple(kv.version for kv in kvs), lambda: DraftTables(self.be, kvs, self.config.layers))

    def context_fields(self, sessions: int) -> dict:
        """The ingest's per-pass arrays: tap rows' session pointer (indptr), the ring positions of
        their first rows (pos), rows to write (keep, each at most the session's rows) and the rings'
        rows (commit_capacity, per layer and session)."""
        return {"pos": (sessions, np.int32), "indptr": (sessions + 1, np.int32), "keep": (sessions, np.int32),
                "commit_capacity": (self.config.layers * sessions, np.int32)}

    def ingest(self, kvs: list[DraftKV], taps, row_indptr) -> None:
        """Write the committed rows' context K/V into each session's ring (one kv_commit launch
        for all layers). taps [rows, n_taps*d] are ragged by row_indptr over the sessions. Rows
        that the ring would overwrite within this call are never read again, so only each
        session's last `ring` rows are computed and written."""
        lens = np.diff(row_indptr).astype(np.int64)
        skip = np.maximum(lens - self.ring, 0)
        take = (lens - skip).astype(np.int32)
        rows = np.concatenate([row_indptr[i] + skip[i] + np.arange(take[i]) for i in range(len(kvs))]) if kvs else []
        kept = taps if not skip.any() else taps[self.be.xp.asarray(np.asarray(rows, np.int64))]
        inp = Inputs(self.be, self.context_fields(len(kvs)))
        inp.set(pos=np.array([kv.pos for kv in kvs], np.int64) + skip, indptr=np.concatenate([[0], np.cumsum(take)]),
                keep=take, commit_capacity=self.ring).upload()
        self.run_ingest(self.tables(kvs), kept, inp, Workspace(self.be, int(take.sum())))
        for kv, n in zip(kvs, lens):
            kv.pos += int(n)

    def run_ingest(self, tables: "DraftTables", taps, inp: Inputs, ws: Workspace) -> None:
        """The ingest's device work: f = norm(fc(taps)) of every row, then per layer its K (normed,
        rotated at the row's position) and V into the ring, `keep` rows of each session."""
        c, w, be = self.config, self.w, self.be
        rows, nkv = taps.shape[0], c.kv_heads * c.head_dim
        f = linear(be, taps, w["fc"], out=ws.take("ctx.fc", rows, (c.d_model,)), ws=ws)
        add_rmsnorm(be, f, None, w["fc_norm"], c.norm_eps, out=f, ws=ws)
        ks, vs = [], []
        for i in range(c.layers):
            kv_rows = linear(be, f, w[f"layers.{i}.attn.wkv"], out=ws.take("ctx.kv", rows, (2 * nkv,)), ws=ws)
            _, k, v = qk_prepare(be, kv_rows, self.context_heads, self.rotary, inp["pos"], inp["indptr"],
                                 k_norm=w[f"layers.{i}.attn.k_norm"], eps=c.norm_eps, inv_freq=self.inv_freq,
                                 k=ws.take(f"ctx.k.{i}", rows, (c.kv_heads, c.head_dim)),
                                 v=ws.take(f"ctx.v.{i}", rows, (c.kv_heads, c.head_dim)), with_q=False)
            ks.append(k)
            vs.append(v)
        rings = tables.commit.arrays
        B = len(inp["pos"].host)
        kv_commit(be, ks, vs, [list(rings[i * B : (i + 1) * B]) for i in range(c.layers)],
                  [list(rings[(c.layers + i) * B : (c.layers + i + 1) * B]) for i in range(c.layers)], inp["pos"],
                  inp["keep"], inp["indptr"], ring=True, table=tables.commit,
                  blk_table=PointerTable(be, [*ks, *vs], "context K/V"), capacity=inp["commit_capacity"])

    # ---- the block pass -----------------------------------------------------------------------
    def block_fields(self, sessions: int) -> dict:
        """The block pass's per-pass arrays: ids [B b] ([anchor, MASK x (b-1)] per session), the
        sessions' ingested rows (pos), row pointer, ring rows (capacity), anchors [B] and the draft
        rows of the block (harvest)."""
        c = self.config
        return {"ids": (sessions * c.block, np.int32), "pos": (sessions, np.int32), "indptr": (sessions + 1, np.int32),
                "capacity": (sessions, np.int32), "anchors": (sessions, np.int32),
                "draft_rows": (sessions * c.drafts, np.int32)}

    def fill_block(self, inp: Inputs, kvs: list["DraftKV"], anchors) -> Inputs:
        """Write one block pass's arrays (host side)."""
        b, B = self.config.block, len(kvs)
        anchors = np.asarray(anchors, np.int32).reshape(-1)
        ids = np.full((B, b), self.mask_id, np.int32)
        ids[:, 0] = anchors
        return inp.set(ids=ids.reshape(-1), pos=[kv.pos for kv in kvs], indptr=np.arange(B + 1) * b,
                       capacity=self.ring, anchors=anchors, draft_rows=self.draft_rows(B))

    def block_pass(self, kvs: list[DraftKV], anchors) -> tuple[object, object]:
        """One parallel pass over [anchor, MASK x (b-1)] per session at positions kv.pos...
        Returns (hidden [B*b, d] after the final norm, logits [B*b, V or draft_vocab])."""
        inp = self.fill_block(Inputs(self.be, self.block_fields(len(kvs))), kvs, anchors).upload()
        return self.run_block(self.tables(kvs), inp, len(kvs), Workspace(self.be, len(kvs) * self.config.block))

    def run_block(self, tables: "DraftTables", inp: Inputs, B: int, ws: Workspace, *, harvest: bool = False,
                  reach: int | None = None) -> tuple[object, object]:
        """The block pass's device work, every per-pass value read from `inp`, every buffer from
        `ws` (what a round's program records; `reach` sizes the attention grids). With `harvest`
        only the draft rows go through the LM head: (hidden, logits) [B nd, .] session-major."""
        c, w, be = self.config, self.w, self.be
        rows, d = B * c.block, c.d_model
        norms = [w[f"layers.{i}.norm1"] for i in range(c.layers)] + [self.final_norm]
        eps = [c.norm_eps] * c.layers + [self.final_eps]
        x, h = ws.take("x", rows, (d,)), ws.take("h", rows, (d,))
        embed_rmsnorm(be, self.embed, inp["ids"], norms[0], eps[0], x=x, out=h, scale=c.embed_scale, ws=ws)
        for i in range(c.layers):
            p = f"layers.{i}."
            a = h
            if c.conv_kernel:
                a, out_kernel = self._conv_prepare(h, p + "attn_conv.", B)
            qkv = linear(be, a, w[p + "attn.wqkv"], out=ws.take("attn.qkv", rows, (self.block_heads.width,)), ws=ws)
            q, k, v = qk_prepare(be, qkv, self.block_heads, self.rotary, inp["pos"], inp["indptr"],
                                 q_norm=w[p + "attn.q_norm"] if c.q_norm else None, k_norm=w[p + "attn.k_norm"],
                                 eps=c.norm_eps, inv_freq=self.inv_freq,
                                 q=ws.take("attn.q", rows, (c.heads, c.head_dim)),
                                 k=ws.take("attn.k", rows, (c.kv_heads, c.head_dim)),
                                 v=ws.take("attn.v", rows, (c.kv_heads, c.head_dim)))
            o = attention(be, q, k, v, tables.k[i], tables.v[i], inp["pos"], inp["indptr"], mode="block",
                          window=self.windows[i], window_mode=self.window_modes[i],
                          out=ws.take("attn.o", rows, (c.heads, c.head_dim)), capacity=inp["capacity"], reach=reach,
                          ws=ws)
            y = linear(be, o.reshape(rows, -1), w[p + "attn.wo"], out=ws.take("sublayer", rows, (d,)), ws=ws)
            if c.conv_kernel:
                y = self._conv(y, out_kernel, w[p + "attn_conv.base"][1], B)
            add_rmsnorm(be, x, y, w[p + "norm2"], c.norm_eps, out=h, ws=ws)
            a = h
            if c.conv_kernel:
                a, out_kernel = self._conv_prepare(h, p + "mlp_conv.", B)
            gate_up = linear(be, a, w[p + "mlp.w_gate_up"], out=ws.take("mlp.gate_up", rows, (2 * c.mlp_hidden,)), ws=ws)
            y = swiglu_linear(be, gate_up, w[p + "mlp.w_down"], out=ws.take("sublayer", rows, (d,)), ws=ws)
            if c.conv_kernel:
                y = self._conv(y, out_kernel, w[p + "mlp_conv.base"][1], B)
            add_rmsnorm(be, x, y, norms[i + 1], eps[i + 1], out=h, ws=ws)  # the next norm1, or the final norm
        hidden = h
        if harvest and c.harvest != "shifted":
            hidden = gather_rows(be, h, inp["draft_rows"], out=ws.take("hidden", B * c.drafts, (d,)))
        n = hidden.shape[0]
        logits = linear(be, hidden, self.lm_head, out=ws.take("logits", n, (self.lm_head.shape[1],)), ws=ws)
        if c.logit_scale != 1.0 or c.logit_softcap > 0:
            logits = logit_scale(be, logits, c.logit_scale, c.logit_softcap, out=logits)
        return hidden, logits

    def _conv_prepare(self, h, p: str, B: int):
        """DFlash2: the input-side convolution of a sublayer, and the output side's dynamic kernel
        (both from one projection of the sublayer's input)."""
        c = self.config
        dyn = linear(self.be, h, self.w[p + "proj"]).reshape(B, c.block, 2, c.conv_kernel, c.d_model // c.conv_group)
        return self._conv(h, dyn[:, :, 0], self.w[p + "base"][0], B), dyn[:, :, 1]

    def _conv(self, x, dyn, base, B: int):
        """Grouped dynamic causal convolution over each session's block rows (DFlash2):
        out_t = sum_o (base[o] + dyn_t[o, g]) * x_{t-o} per channel group g, x before the block = 0,
        accumulated over o in increasing order as the reference does."""
        c, xp = self.config, self.be.xp
        G = c.d_model // c.conv_group
        xs = x.reshape(B, c.block, G, c.conv_group)
        out = xp.zeros_like(xs)
        for o in range(c.conv_kernel):
            shifted = xs if o == 0 else xp.concatenate([xp.zeros_like(xs[:, :o]), xs[:, :-o]], axis=1)
            out = out + base[o].reshape(G, c.conv_group) * shifted
            out = out + dyn[:, :, o, :, None] * shifted
        return out.reshape(B * c.block, c.d_model)

    def draft(self, kvs: list[DraftKV], anchors) -> tuple[object, object]:
        """The block pass, harvested: (hidden, logits) of the draft slots only, [B*nd, ...]
        session-major; slot k predicts the token at pos+k+1."""
        hidden, logits = self.block_pass(kvs, anchors)
        if self.config.harvest == "shifted":  # every row is a draft
            return hidden, logits
        rows = self.be.xp.asarray(self.draft_rows(len(kvs)))
        return hidden[rows], logits[rows]

    def draft_rows(self, B: int) -> np.ndarray:
        """Indices (into the B*b block rows) of the rows that are drafts, per harvest mode:
        shifted: every row (row k predicts the token at pos+k+1); mask_fill: rows 1..b-1."""
        b = self.config.block
        first = 0 if self.config.harvest == "shifted" else 1
        return (np.arange(B)[:, None] * b + np.arange(first, b)[None, :]).reshape(-1)

    # ---- proposals ----------------------------------------------------------------------------
    def chain(self, hidden, logits, anchors) -> Chain:
        """The Markov chain over the draft slots of one round (dspark.models.drafter_heads)."""
        return Chain(self, hidden, logits, anchors)

    def propose_greedy(self, hidden, logits, anchors) -> tuple[np.ndarray, np.ndarray]:
        """x_k = argmax of slot k's Markov-chain logits, x_{-1} = anchor, and the confidence c_k
        of every slot (NaN without a confidence head). Returns host (drafts, conf) [B, nd].

        Every layout runs on the device from the anchors to the last slot (the vanilla head as
        one fused kernel, the others slot by slot with the previous token never leaving the
        device), and drafts, confidences and NaN flags come back in ONE device->host copy: the
        round's first synchronisation. A NaN in any slot's logits raises NonFiniteError there,
        before anything of the session has changed."""
        anchors = np.asarray(anchors, np.int32)
        drafts, flag, conf = self.run_propose(hidden, logits, anchors)
        got = self.be.fetch(drafts, flag, *(() if conf is None else (conf,)))  # the round's first sync
        return self.proposals(anchors.shape[0], got[0], got[1], got[2] if conf is not None else None)

    def proposals(self, B: int, drafts, flag, conf) -> tuple[np.ndarray, np.ndarray]:
        """Host (drafts, conf) [B, nd] from what the proposal's one copy brought back, or
        NonFiniteError naming the first session whose drafter logits held a NaN."""
        nd = self.config.drafts
        # flags per session ([B]), per row ([B * nd], session-major) or per slot ([nd, B], the chain)
        nan = flag if flag.ndim == 2 else flag.reshape(B, -1).T
        raise_on_nan(nan.any(axis=0), "drafter logits", "session")
        drafts = drafts.reshape(B, nd).astype(np.int32)
        conf = conf.reshape(B, nd) if conf is not None else np.full((B, nd), np.nan, np.float32)
        return drafts, conf

    def proposal_fields(self, B: int) -> dict:
        """What a recorded proposal hands back in one copy: drafts, NaN flags, confidences."""
        nd = self.config.drafts
        fields = {"drafts": (B * nd, np.int32), "flag": (B if self.config.markov == "vanilla" else B * nd, np.int32)}
        if self.has_confidence:
            fields["conf"] = (B * nd, np.float32)
        return fields

    @property
    def recordable(self) -> bool:
        """Whether its round passes are kernels only (what a program can record): the vanilla or no
        Markov head, no draft vocabulary, no DFlash2 convolutions."""
        c = self.config
        return c.markov in ("vanilla", "none") and not c.draft_vocab and not c.conv_kernel

    def run_propose(self, hidden, logits, anchors, ws=None, out=None):
        """The greedy proposal's device work: (drafts [B, nd] int32, NaN flags, confidences [B nd]
        f32 or None), none of it read back. anchors: host or Staged int32 [B]. `out`: the
        Outputs (proposal_fields) they are written to, so one copy reads them all."""
        c, be, xp, nd = self.config, self.be, self.be.xp, self.config.drafts
        B = np.asarray(anchors).shape[0]
        conf = None

        def dest(name, shape, dtype):
            return out[name].reshape(shape) if out is not None else fixed(be, ws, f"propose.{name}", shape, dtype)
        if c.markov == "vanilla" and not c.draft_vocab:  # the fused chain: one launch per slot at most
            flag = dest("flag", (B,), np.int32)
            drafts = markov_chain(be, logits, self.w["markov.w1"], self.w["markov.w2"], anchors, nd,
                                  out=dest("drafts", (B, nd), np.int32), nan_flag=flag, ws=ws)
            if self.has_confidence:
                conf = self.slot_confidence(hidden, anchors, drafts, ws, None if out is None else out["conf"])
        elif c.markov == "none":  # no chain: every slot's argmax in one launch
            flag = dest("flag", (B * nd,), np.int32)
            ids = argmax_rows(be, logits, out=dest("drafts", (B * nd,), np.int32), nan_flag=flag, ws=ws)
            drafts = self.d2t_dev[ids] if self.d2t_dev is not None else ids
            if self.has_confidence:
                conf = self.slot_confidence(hidden, anchors, drafts.reshape(B, nd), ws,
                                            None if out is None else out["conf"])
        else:
            chain = self.chain(hidden, logits, np.asarray(anchors))
            for k in range(nd):
                chain.choose_greedy(k)
            drafts, flag, conf = chain.drafts, chain.nan, chain.conf if self.has_confidence else None
        return drafts, flag, conf

    def slot_confidence(self, hidden, anchors, drafts, ws=None, out=None):
        """c_k of every slot [B nd] from the chain's drafts on the device (features, one GEMM of one
        column, the sigmoid), into `out` when given."""
        be, c = self.be, self.config
        n = hidden.shape[0]
        feats = hidden
        if c.confidence == "markov":
            r = self.w["markov.w1"].shape[1]
            feats = confidence_features(be, hidden, self.w["markov.w1"], anchors, drafts,
                                        out=fixed(be, ws, "conf.features", (n, c.d_model + r)))
        lin = linear(be, feats, self.w["conf.w"][:, None], out=fixed(be, ws, "conf.linear", (n, 1)), ws=ws)
        return sigmoid_bias(be, lin[:, 0], self.w["conf.b"], out=fixed(be, ws, "conf", (n,)) if out is None else out)

    def propose(self, kvs: list[DraftKV], anchors) -> tuple[np.ndarray, np.ndarray]:
        """Greedy drafts and their confidences for each session: draft, then the Markov chain."""
        return self.propose_greedy(*self.draft(kvs, anchors), anchors)

    def markov_bias(self, prev_tokens):
        """The vanilla head's W2 . W1[x_{k-1}] for a batch of previous tokens (host or device)
        -> [n, V]; also returns W1[x]."""
        xp = self.be.xp
        prev = prev_tokens if isinstance(prev_tokens, xp.ndarray) else xp.asarray(np.asarray(prev_tokens, np.int32))
        e = self.w["markov.w1"][prev]
        return linear(self.be, e, self.w["markov.w2"]), e

    def confidence(self, hidden, markov_embed):
        """c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b) ("markov"), or sigmoid(w . h_k + b)
        ("hidden"), for rows of hidden [n, d]."""
        xp = self.be.xp
        feats = xp.concatenate([hidden, markov_embed], axis=1) if self.config.confidence == "markov" else hidden
        return sigmoid_bias(self.be, linear(self.be, feats, self.w["conf.w"][:, None])[:, 0], self.w["conf.b"])

    def to_target_vocab(self, logits):
        """Draft-vocabulary logits [n, draft_vocab] as target-vocabulary logits [n, V] (-inf on
        tokens the draft vocabulary lacks); the identity without a draft vocabulary."""
        if self.d2t is None:
            return logits
        xp = self.be.xp
        out = xp.full((logits.shape[0], self.trunk.config.vocab), -np.inf, np.float32)
        out[:, self.d2t_dev] = logits
        return out
