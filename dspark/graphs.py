"""The round without the host: each pass of a round recorded once per batch, then replayed by the
host launch by launch (`eager`) or as a CUDA graph (`graph`).

A speculative round is three passes (DESIGN section 2): the draft (the drafter's block pass and
the greedy proposal: drafts, confidences and NaN flags, fetched in one copy: the round's first
synchronisation), the verify (the trunk over [anchor, d_1 .. d_{W-1}] of every session and the
greedy accept: (m, next) and NaN flags, the second synchronisation) and the commit (K/V rows into
the caches, the rollback of the recurrent state, the ingest of the kept rows into the draft KV).
A coupled sampled round (dspark.spec_sampling) is the same three passes: the draft pass draws
each slot's pick with the noise of its position, the verify picks every column at the position it
predicts and walks the coupled accept. A plain batched decode step, greedy or sampled, is one pass. Each pass is recorded on the `cuda` backend the first
time its key is seen: the model code runs once (every op validated, every launch plan built), its
launches go to a list while they run, and that list is the pass from then on: the host issues it
launch by launch with the arguments checked when it was recorded, or captures it once into a CUDA
graph (CuPy's stream capture) and launches the graph.

What makes a recording valid for the next round:
* Buffers. Every output and temporary of a pass is a named buffer of a workspace
  (dspark.ops.workspace) made when the pass is first recorded, and the same memory after: one per
  pass kind and batch size, sized for the widest verify, so the verify passes of every width share
  it; freed when the last recording pointing into it goes (its batch size's sessions left).
  `workspace_bytes()` says how much is held. At Qwen3.5-27B, B = 1, it is 1.41 GiB, 92 % of it the
  verify's per-column gdn state checkpoints of rollback="checkpoint" (3 MiB a layer a column, for
  drafts + 1 columns); rollback="replay" keeps the columns' scan inputs instead: 88 MiB. It scales
  with B (profiling/RESULTS.md).
* Per-round values. Token ids, positions, row pointers, kept counts, anchors, and a sampled pass's
  pick positions (the stream counters), seeds, stream words and filter settings: one inputs block
  per pass (dspark.ops.workspace.Inputs), written by the host and uploaded in one copy before the
  pass runs; kernels read them there. No host scalar that changes from round to round is an
  argument.
* Grids. The attention grids are sized for a horizon (the next power of two above the sessions'
  positions, at least HORIZON_FLOOR, at most the cache): their CTAs past the live keys leave at once
  (dspark.ops.attention.launch_plan's `reach`). Crossing the horizon records the passes again: at
  most log2(capacity / HORIZON_FLOOR) times in a session's life, each a round priced at the eager
  host path; between crossings a grid holds at most twice the splits it needs.
* Verify width: one recording per width W in `widths` (1 .. drafts + 1); a batch verifies at its
  widest session's width, the others padded: a padded session's extra columns are computed and
  never accepted (the accept's candidate after its last column is -1, which no argmax equals, or
  dspark.ops.coupled.PAD, which no pick equals), never committed (its keep is at most its width). What a padded column costs: its share of the verify's
  attention and scan, as its GEMM rows ride in the same 16-row tile at B <= 2.
* Keys. A pass is keyed by the buffer versions of its sessions' caches and draft KVs (in batch
  order) and by what shaped it (width, horizon, rollback, a sampled pass's SamplingParams: which
  sampling phases it launches); a session that joins or leaves makes new
  keys, and freeing or replacing a session's buffers drops exactly the recordings that held them
  (dspark.models.batch_tables.forget). Nothing else can change a recording.

The round is issued on its own stream (capture needs one that is not the legacy default stream),
ordered after the work before it and before the work after it by two events per round.

Recorded rounds are bitwise the eager rounds (tests/session/test_graphs.py): the same kernels with
the same arguments, in the same order (the op-by-op coupled proposal runs the recorded one's kernels,
spec_sampling.run_coupled_propose). Layouts whose round needs array operations of the glue (the
gated and rnn Markov heads, the candidate selector, a draft vocabulary, DFlash2's convolutions) run
op by op (`supported`), and so do rejection-sampled rounds: their accept (spec_accept_f32) reads
each session's target rows packed at its own width (p[draft_indptr[b] + b + j]) and stops after its
own drafts, while a recorded verify packs every session at the widest width; recording them needs
the accept to take a per-session draft count apart from its row layout, and the drafter's q rows
written slot by slot into a workspace (today a strided copy per slot and a concatenation per
round, array operations). A plain decode step of a batch mixing greedy and sampled sequences runs
op by op too.
"""

from __future__ import annotations

import itertools
import weakref

import numpy as np

from . import profile
from .errors import row_checked
from .models.batch_tables import register_store
from .models.trunk import moved
from .ops.argmax import greedy_accept, raise_on_nan
from .ops.coupled import PAD, coupled_accept
from .ops.sampling import raise_rows, sample_filtered
from .ops.workspace import Inputs, Outputs, Workspace
from .spec_sampling import coupled_fields, coupled_proposals, fill_coupled, fill_picks, pick_fields, picks_of, \
    run_coupled_propose

MODES = ("graph", "eager", "plain")   # CUDA graphs, recorded launches issued by the host, op by op
HORIZON_FLOOR = 2048
_ids = itertools.count()


class RecordingError(RuntimeError):
    """A pass did what a recording cannot replay: waited on the device or ran array operations."""


class Recording:
    """One pass's launches as they ran: (raw kernel, grid, block, arguments, shared memory, name),
    checked when recorded, and `hold`: what their arguments point into (kept alive with them).
    `moved`: the state and K/V bytes the pass moves (dspark.profile), reported again at each run, as
    are `experts`: the MoE layers' device counts of distinct experts, which each run rewrites."""

    def __init__(self, launches: list, hold, moved=None, experts=(), routing=None, xp=None):
        self.launches, self.hold, self.graph = launches, hold, None
        self.moved = dict(moved or {})
        self.experts, self.routing, self.xp = list(experts), routing, xp

    def __len__(self) -> int:
        return len(self.launches)

    def issue(self) -> None:
        """Every launch, by the host, with its recorded arguments."""
        counting = profile.counting_now()
        for raw, g, b, args, smem, name in self.launches:
            if counting:
                profile.record("launch", name)
            raw(g, b, args, shared_mem=smem)
        self._moved(counting)

    def _moved(self, counting: bool) -> None:
        if counting:
            for kind, n in self.moved.items():
                profile.moved(kind, n)
        if profile.listening_experts():  # a counter, or the cost model's sink (dspark.cost)
            for layer, count in self.experts:
                profile.experts(layer, count, self.routing, self.xp)

    def capture(self, stream) -> None:
        """The launches as a CUDA graph (stream capture of `issue`)."""
        with stream:
            stream.begin_capture()
            try:
                for raw, g, b, args, smem, _ in self.launches:
                    raw(g, b, args, shared_mem=smem)
            finally:
                self.graph = stream.end_capture()

    def replay(self, stream) -> None:
        self.graph.launch(stream)
        self._moved(profile.counting_now())


def record(be, work, workspaces=()):
    """(Recording, result) of `work()` run once with its launches recorded. A pass that reads the
    device (a copy back, a sync) or runs array operations (device work that is not a recorded
    launch: allocations' zero-fills of the workspaces aside) cannot be recorded: RecordingError."""
    ex = be.kernels
    fills = sum(ws.fills for ws in workspaces)
    ex.recording = []
    try:
        with profile.counting() as c:
            result = work()
        launches = ex.recording
    finally:
        ex.recording = None
    ops = c.array_ops - (sum(ws.fills for ws in workspaces) - fills)
    if c.d2h or c.syncs or ops:
        raise RecordingError(f"a recorded pass made {c.d2h} device->host copies, {c.syncs} syncs and {ops} array "
                             f"operations ({dict(c.sites)}): a replay would skip them")
    return Recording(launches, result, c.bytes, c.experts, c.routing, c.xp), result


class PassStore:
    """Key (sessions' buffer versions, what shaped the pass) -> its Recording (and inputs block);
    every recording holding a freed or replaced buffer version is dropped with it, and then
    `dropped()` runs (the runner releases the workspaces no recording holds any more)."""

    def __init__(self, dropped=None):
        self._entries: dict[tuple, object] = {}
        self.records = 0    # recordings made (tests count reuses against it)
        self._dropped = dropped
        register_store(self)

    def entries(self):
        return self._entries.values()

    def get(self, versions: tuple, extra: tuple):
        return self._entries.get((versions, extra))

    def put(self, versions: tuple, extra: tuple, entry) -> None:
        self._entries[(versions, extra)] = entry
        self.records += 1

    def drop(self, version: int) -> None:
        self.drop_where(lambda k: version not in k[0])

    def drop_where(self, keep) -> None:
        gone = [k for k in self._entries if not keep(k)]
        for key in gone:
            del self._entries[key]
        if gone and self._dropped is not None:
            self._dropped()

    def __len__(self) -> int:
        return len(self._entries)


def horizon(top: int, capacity: int) -> int:
    """The positions a recorded pass's attention grids hold: the next power of two at or above
    `top` (the highest position + 1 its rows reach), at least HORIZON_FLOOR, at most `capacity`."""
    return int(min(capacity, max(HORIZON_FLOOR, 1 << max(0, int(top) - 1).bit_length())))


class Entry:
    """A recorded pass with its inputs block (rewritten and uploaded every round), its outputs, the
    pass's own results (what a later pass reads) and the workspaces its launches point into."""
    __slots__ = ("recording", "inputs", "outputs", "result", "workspaces")

    def __init__(self, recording, inputs, outputs, result, workspaces=()):
        self.recording, self.inputs, self.outputs, self.result = recording, inputs, outputs, result
        self.workspaces = tuple(workspaces)


class Runner:
    """Recorded passes of one model (and its drafter), run in `mode` on their own stream."""

    def __init__(self, be, mode: str):
        if mode not in MODES[:2]:
            raise ValueError(f"mode={mode!r}: expected 'graph' or 'eager'")
        self.be, self.mode, self.id = be, mode, next(_ids)
        self.store = PassStore(dropped=self._release_idle)
        self._workspaces: dict[tuple, Workspace] = {}
        self.stream = be.xp.cuda.Stream(non_blocking=True)

    def workspace(self, kind: str, sessions: int, rows: int) -> Workspace:
        """The workspace of one pass kind and batch size, made when first asked for; it lives while
        some recording points into it (`_release_idle`)."""
        key = (kind, sessions)
        if key not in self._workspaces:
            self._workspaces[key] = Workspace(self.be, rows, owner=f"graphs/{self.id}/{kind}/{sessions}")
        return self._workspaces[key]

    def workspace_bytes(self) -> int:
        """The bytes of the workspaces held now: those of the batch sizes some recording holds."""
        return sum(ws.bytes for ws in self._workspaces.values())

    def _release_idle(self) -> None:
        """Free the workspaces no recording points into any more (their batch's sessions left): a
        runner holds the batch sizes in use, not every size it ever ran."""
        held = {id(ws) for e in self.store.entries() for ws in e.workspaces}
        for key, ws in list(self._workspaces.items()):
            if id(ws) not in held:
                ws.free()
                del self._workspaces[key]

    def run(self, versions: tuple, extra: tuple, fields, fill, work, workspaces) -> Entry:
        """The pass keyed (versions, extra): fill(inputs) writes this round's values; the first time,
        work(inputs) -> (result, outputs) runs and is recorded (and captured in graph mode); after,
        the recording runs."""
        entry = self.store.get(versions, extra)
        if entry is None:
            inputs = Inputs(self.be, fields(), owner=f"graphs/{self.id}/inputs")
            fill(inputs)
            inputs.upload()
            recording, (result, outputs) = record(self.be, lambda: work(inputs), workspaces)
            entry = Entry(recording, inputs, outputs, result, workspaces)
            if self.mode == "graph":
                recording.capture(self.stream)
            self.store.put(versions, extra, entry)
            return entry
        fill(entry.inputs)
        entry.inputs.upload()
        if self.mode == "graph":
            entry.recording.replay(self.stream)
        else:
            entry.recording.issue()
        return entry

    def __enter__(self):
        """The round's work goes to this runner's stream, after everything issued before it."""
        self.stream.wait_event(self.be.xp.cuda.get_current_stream().record())
        self._stream_ctx = self.stream.__enter__()
        return self

    def __exit__(self, *exc):
        done = self.stream.record()
        self.stream.__exit__(*exc)
        self.be.xp.cuda.get_current_stream().wait_event(done)  # later work waits for the round
        return False


# ---- the speculative round ----------------------------------------------------------------------------------
_ROUNDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


RECORDED_RULES = ("greedy", "coupled")   # accept rules whose rounds are recorded (SpecParams.accept)


def supported(trunk, drafter, rule: str) -> bool:
    """Whether a round of this pair can be recorded: the cuda backend, a drafter whose passes are
    kernels only, greedy or coupled sampled sessions (RECORDED_RULES), and the model's own methods
    (one replaced on the instance, as a test does to poison a pass, is not what a recording would
    replay)."""
    return trunk.be.name == "cuda" and kernels_only(drafter) and rule in RECORDED_RULES and not patched(trunk)


def kernels_only(drafter) -> bool:
    """Whether the drafter's round passes are kernels only: a recordable layout none of whose
    methods is replaced on the instance (a test's steering). Its coupled proposal then runs
    spec_sampling.run_coupled_propose op by op too (the recorded round's launches)."""
    return drafter.recordable and not patched(drafter)


def patched(obj) -> bool:
    """Whether a method of obj's class is replaced on the instance."""
    return any(callable(v) and callable(getattr(type(obj), k, None)) for k, v in vars(obj).items())


def round_graphs(drafter, mode: str) -> "RoundGraphs":
    """The pair's recorded round passes in `mode` (one set per drafter and mode)."""
    per = _ROUNDS.setdefault(drafter, {})
    if mode not in per:
        per[mode] = RoundGraphs(drafter.trunk, drafter, mode)
    return per[mode]


class RoundGraphs(Runner):
    """The draft, verify (one per width) and commit passes of a greedy or coupled speculative round."""

    def __init__(self, trunk, drafter, mode: str):
        super().__init__(trunk.be, mode)
        self.trunk, self.drafter = trunk, drafter
        self.widths = tuple(range(1, drafter.config.drafts + 2))  # the verify widths the recordings hold

    # -- draft
    def propose(self, sessions) -> tuple[np.ndarray, np.ndarray]:
        """Drafts and confidences [B, nd] (host): the draft pass and its one copy back. Coupled
        sessions draw each slot's pick at its position (spec_sampling.run_coupled_propose): their
        filters, seeds and positions are fields of the pass's inputs block ("pick.")."""
        d, B = self.drafter, len(sessions)
        kvs = [s.kv for s in sessions]
        ws = self.workspace("draft", B, B * d.config.block)
        reach = horizon(max(kv.pos for kv in kvs) + d.config.block, d.trunk.config.max_ctx + d.config.block)
        coupled, nd = sessions[0].params.coupled, d.config.drafts

        def fields():
            return {**d.block_fields(B), **({f"pick.{k}": v for k, v in pick_fields(B, nd * B).items()} if coupled
                                            else {})}

        def fill(inp):
            d.fill_block(inp, kvs, [s.last for s in sessions])
            if coupled:
                fill_coupled(inp.scope("pick."), sessions, nd)

        def work(inp):
            hidden, logits = d.run_block(d.tables(kvs), inp, B, ws, harvest=True, reach=reach)
            if coupled:
                out = Outputs(self.be, coupled_fields(d, B), ws, "draft.outputs.coupled")
                run_coupled_propose(d, hidden, logits, inp.scope("pick."), inp["anchors"], ws, out)
            else:
                out = Outputs(self.be, d.proposal_fields(B), ws, "draft.outputs")
                d.run_propose(hidden, logits, inp["anchors"], ws, out=out)
            return None, out

        entry = self.run(tuple(kv.version for kv in kvs), ("draft", reach, samplings_of(sessions)), fields, fill,
                         work, (ws,))
        got = entry.outputs.fetch()
        if coupled:
            return coupled_proposals(d, B, got)
        return d.proposals(B, got["drafts"], got["flag"], got.get("conf"))

    # -- verify
    def verify(self, sessions, cands: list, vts) -> tuple[object, np.ndarray, np.ndarray]:
        """(the verify's TrunkPass, m, next): the verify at the widest width, padded, and the
        accept (greedy, or coupled: every column's pick at the position it predicts, from the
        pass's inputs block), read back in one copy with the NaN flags or row statuses (which raise
        before anything of the sessions changed)."""
        t, B = self.trunk, len(sessions)
        W = int(max(vts))
        caches = [s.cache for s in sessions]
        rollback = sessions[0].params.rollback
        coupled = sessions[0].params.coupled
        ws = self.workspace("verify", B, B * max(self.widths))
        reach = horizon(max(c.pos for c in caches) + W, min(c.capacity for c in caches))
        taps = self.drafter.taps
        ids = np.zeros((B, W), np.int32)
        cand = np.full((B, W), PAD if coupled else -1, np.int32)  # after a session's last column: no pick's
        for b, (c, vt) in enumerate(zip(cands, vts)):
            ids[b, : len(c)] = c
            ids[b, len(c) :] = c[-1]   # padding columns: any token (never accepted nor committed)
            cand[b, :vt] = c[:vt]

        def fields():
            picks = {f"pick.{k}": v for k, v in pick_fields(B * W).items()} if coupled else {}
            return {**t.pass_fields(B, B * W), "cand": (B * W, np.int32), **picks}

        def fill(inp):
            t.fill(inp, caches, ids.reshape(-1), np.full(B, W, np.int32), keep=np.zeros(B, np.int32))
            inp.set(cand=cand.reshape(-1))
            if coupled:  # column j of a session picks the token at pos + j + 1
                fill_picks(inp.scope("pick."), [s.params.sampling for s in sessions],
                           np.array([c.pos for c in caches])[:, None] + np.arange(1, W + 1)[None, :], W)

        def work(inp):
            tp = t.run_pass(t.tables(caches), inp, B * W, commit=False, record_gdn=rollback == "replay",
                            checkpoints=rollback == "checkpoint", taps=taps, ws=ws, reach=reach)
            flags = B * W if coupled else B   # coupled: every column's row status
            out = Outputs(self.be, {"m": (B, np.int32), "next": (B, np.int32), "flag": (flags, np.int32)}, ws,
                          f"verify.outputs.{B}.{flags}")
            if coupled:
                coupled_accept(self.be, tp.logits, inp["cand"], inp["indptr"], *picks_of(inp.scope("pick.")),
                               m_out=out["m"], next_out=out["next"], status_out=out["flag"], ws=ws)
            else:
                greedy_accept(self.be, tp.logits, inp["cand"], inp["indptr"], m_out=out["m"], next_out=out["next"],
                              nan_flag=out["flag"], ws=ws)
            return tp, out

        entry = self.run(tuple(c.version for c in caches), ("verify", W, reach, rollback, samplings_of(sessions)),
                         fields, fill, work, (ws,))
        got = entry.outputs.fetch()
        if coupled:  # the statuses of the sessions' own columns, numbered as the op-by-op accept numbers them
            raise_rows(np.concatenate([got["flag"][b * W : b * W + vt] for b, vt in enumerate(vts)]), "verify logits")
        else:
            raise_on_nan(got["flag"], "verify logits", "session")
        return entry.result, got["m"].copy(), got["next"].copy()

    # -- commit
    def commit(self, sessions, tp, W: int, keep: np.ndarray, ingest: np.ndarray) -> None:
        """K/V of the kept rows into the caches, the rollback of every gdn layer and the ingest of
        `ingest[b]` kept rows into each session's draft KV: one pass, no copy back."""
        t, d, B = self.trunk, self.drafter, len(sessions)
        caches, kvs = [s.cache for s in sessions], [s.kv for s in sessions]
        rollback = sessions[0].params.rollback
        ws = self.workspace("verify", B, B * max(self.widths))
        ctx_ws = self.workspace("ingest", B, B * max(self.widths))
        indptr = np.arange(B + 1, dtype=np.int32) * W

        def fields():
            return {**t.pass_fields(B, 0), **{f"ctx.{k}": v for k, v in d.context_fields(B).items()}}

        def fill(inp):
            t.fill(inp, caches, np.zeros(0, np.int32), np.full(B, W, np.int32), keep=keep)
            inp.scope("ctx.").set(pos=[kv.pos for kv in kvs], indptr=indptr, keep=ingest, commit_capacity=d.ring)

        def work(inp):
            tables = t.tables(caches)
            t._commit(tables, tp, inp, ws)
            if rollback == "checkpoint":
                t.select(caches, tp, None, inp=inp)
            else:
                t.replay(caches, tp, None, None, ws=ws, inp=inp)
            d.run_ingest(d.tables(kvs), tp.taps, inp.scope("ctx."), ctx_ws)
            return None, None

        self.run(tuple(c.version for c in caches) + tuple(kv.version for kv in kvs), ("commit", W, rollback), fields,
                 fill, work, (ws, ctx_ws))
        moved(caches, keep)  # a replayed rollback runs no host code: the chunk tails it outdates are marked here


def samplings_of(sessions) -> tuple:
    """What shapes a sampled pass's launches besides its buffers: the sessions' filter settings
    (which sampling phases run); () for greedy sessions."""
    return tuple(s.params.sampling for s in sessions) if sessions[0].params.coupled else ()


# ---- plain batched decode ------------------------------------------------------------------------------------
_DECODES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def decode_graphs(trunk, mode: str) -> "DecodeGraphs":
    per = _DECODES.setdefault(trunk, {})
    if mode not in per:
        per[mode] = DecodeGraphs(trunk, mode)
    return per[mode]


class DecodeGraphs(Runner):
    """Plain batched decode steps: the trunk over each sequence's pending token, its K/V and state
    committed, the argmax (greedy) or each sequence's pick at the position its next token fills
    (sampled: filters, seeds and positions read from the inputs block) read back."""

    def __init__(self, trunk, mode: str):
        super().__init__(trunk.be, mode)
        self.trunk = trunk

    def step(self, caches, tokens, samplings=None) -> tuple[np.ndarray, list[str]]:
        """Next tokens (host) of one step, greedy or (`samplings`, one per cache) sampled, and for
        each "" or why its logits gave none (dspark.decode.PlainBatch.step); every row is committed
        and the caches' pos advance by one."""
        from .ops.argmax import argmax_rows
        t, B = self.trunk, len(caches)
        ws = self.workspace("decode", B, B)
        reach = horizon(max(c.pos for c in caches) + 1, min(c.capacity for c in caches))
        ids = t.check_tokens(np.asarray(tokens).reshape(-1), "tokens")
        sampled = samplings is not None

        def fields():
            return {**t.pass_fields(B, B), **({f"pick.{k}": v for k, v in pick_fields(B).items()} if sampled else {})}

        def fill(inp):
            t.fill(inp, caches, ids, np.ones(B, np.int32), keep=np.ones(B, np.int32))
            if sampled:  # the token after this row fills position pos + 1
                fill_picks(inp.scope("pick."), samplings, [c.pos + 1 for c in caches])

        def work(inp):
            tp = t.run_pass(t.tables(caches), inp, B, commit=True, taps=(), ws=ws, reach=reach)
            out = Outputs(self.be, {"next": (B, np.int32), "flag": (B, np.int32)}, ws, f"decode.outputs.{B}")
            if sampled:
                sample_filtered(self.be, tp.logits, *picks_of(inp.scope("pick.")), token_out=out["next"],
                                status_out=out["flag"], ws=ws)
            else:
                argmax_rows(self.be, tp.logits, out=out["next"], nan_flag=out["flag"], ws=ws)
            return tp, out

        entry = self.run(tuple(c.version for c in caches), ("decode", reach, tuple(samplings or ())), fields, fill,
                         work, (ws,))
        got = entry.outputs.fetch()
        for c in caches:
            c.pos += 1
        moved(caches, np.ones(B, np.int32))
        if not got["flag"].any():
            return got["next"].copy(), [""] * B
        check = raise_rows if sampled else raise_on_nan  # each row checked as the op-by-op step checks it
        return got["next"].copy(), [row_checked(check, [f])[1] for f in got["flag"]]
