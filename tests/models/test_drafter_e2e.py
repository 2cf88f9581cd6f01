"""Released drafters end to end: a tiny Hugging Face target (qwen3, and the hybrid qwen3_5) that
transformers built and saved, a drafter of each format built and saved by its peer's own code
(DeepSpec's layout, z-lab dflash's DFlashDraftModel / DFlash2DraftModel, speculators' DFlash and
DSpark models), both loaded by dspark, speculative greedy decoding through the session.

Every drafter is sized to the target and taps layers other than the target's default taps: one
loaded target serves all of them, the session asking the trunk for each drafter's taps.

The drafters are random, so on their own they would accept nothing and a round-by-round
comparison would be vacuous. Each is wrapped in the OracleDrafter (dspark.models.oracle), which
raises the logit of the plain greedy stream's token in a slot with probability HIT, decided by
(seed, anchor position, slot); the peers' side gets the same boosts (`boost` below). Slots that
are not boosted keep the drafter's own argmax, which depends on the context taps, so a wrong tap,
position or ingested row changes the proposals.

Checked, per target and format:
* greedy speculative output equals plain greedy decode byte for byte (verify full and auto);
* every round verifies the whole block under verify="full", and the proposals of every round equal
  the peer's: dflash.model.dflash_generate itself for the z-lab formats (its output, the block it
  verifies and its accepted length, round by round), the peer's draft step (tests/models/
  drafter_peers.py) on transformers' hidden states of the committed rows for the others;
* the mean accepted length is at least MIN_MEAN, with partial accepts among the rounds.

dflash_generate crops transformers' cache after a partial accept; transformers' linear-attention
layers crop their conv window but not the recurrent state, so on a hybrid target dflash_generate
itself drifts from greedy after the first partial accept. On qwen3_5 it therefore runs against
ExactCache, the same transformers model recomputing the committed rows on every pass.
"""

from __future__ import annotations

import time
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest

from dspark.decode import plain_generate
from dspark.models.hf import load_drafter, load_target
from dspark.models.oracle import BOOST, OracleDrafter
from dspark.session import DsparkSpecSession, SpecParams
from tests.models.fp8_models import QWEN3_FP8, build_fp8
from tests.models.hf_models import QWEN3, QWEN35, build, reference


from tests.peers import peer  # noqa: E402

torch = peer("torch")
peer("transformers")
dflash_model = peer("dflash.model")
peer("speculators")

from tests.models import drafter_peers as peers  # noqa: E402

TARGETS = [QWEN3[0], QWEN35[0]]    # qwen3: 3 attention layers; qwen3_5: gdn, attn, gdn, attn
N = 24                             # new tokens per request
BLOCK = 4
HIT = 0.8                          # oracle hit rate per slot
MIN_MEAN = 2.0                     # mean accepted length (tokens per round) the boosts must reach
HIDDEN_TOL = 1e-4
SEED = 20240611


def formats(L: int):
    """format name -> (builder(target model, sizes, seed) -> peer model, taps as dspark counts them).
    The taps avoid the target's default taps, (0, L-1) or (L/2-1, L-1), on purpose."""
    return {
        "deepspec": (lambda t, s, seed: peers.deepspec_model(seed, target=t, sizes=s, taps=(-1, L - 2), block=BLOCK),
                     (-1, L - 2)),
        "dflash": (lambda t, s, seed: peers.dflash_model(seed, sizes=s, taps=(0, L - 2), block=BLOCK), (0, L - 2)),
        "dflash2": (lambda t, s, seed: peers.dflash_model(seed, v2=True, sizes=s, taps=(L - 2,), block=BLOCK),
                    (L - 2,)),
        # speculators counts aux ids one higher: id L is the last layer's raw output
        "speculators-dflash": (lambda t, s, seed: peers.speculators_model(seed, "dflash", target=t, sizes=s,
                                                                           taps=(1, L - 1), block=BLOCK), (0, L - 2)),
        "speculators-dspark": (lambda t, s, seed: peers.speculators_model(seed, "dspark", target=t, sizes=s,
                                                                           taps=(L - 1, L), block=BLOCK, markov_rank=8,
                                                                           markov_head_type="gated"), (L - 2, L - 1)),
    }


FORMATS = list(formats(4))
Z_LAB = ("dflash", "dflash2")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory, numpy_backend):
    """case name -> the target (its directory, transformers' model, dspark's trunk on numpy, one
    prompt and its plain greedy stream) and every format's drafter, built and saved once."""
    made = {}

    def get(case):
        if case.name not in made:
            made[case.name] = saved_world(tmp_path_factory.mktemp(case.name), case, numpy_backend, formats)
        return made[case.name]
    return get


def saved_world(d, case, be, formats_of, build_target=build) -> SimpleNamespace:
    """Target `case` saved by transformers into `d` (its model, dspark's trunk on `be`, a prompt
    and its plain greedy stream) and the drafters formats_of(target layers) names (name ->
    (builder(target model, sizes, seed), taps)), each saved by its peer's save_pretrained.
    `build_target(case, d)` saves the target (an FP8 one: tests/models/fp8_models.py)."""
    build_target(case, d)
    model = reference(case, d)
    trunk = load_target(d, be)
    prompt, want = live_prompt(trunk, case.seed)
    sizes = peers.sizes_of(model)
    drafters = {}
    for i, (name, (make, taps)) in enumerate(formats_of(sizes.target_layers).items()):
        peer = make(model, sizes, SEED + i).eval()
        peer.save_pretrained(d / name)
        drafters[name] = SimpleNamespace(peer=peer, path=d / name, taps=taps)
    return SimpleNamespace(path=d, model=model, trunk=trunk, prompt=prompt, want=want, drafters=drafters)


def live_prompt(trunk, seed):
    """A prompt whose plain greedy stream runs N + BLOCK + 1 tokens without EOS, and that stream."""
    rng = np.random.default_rng(seed + 11)
    while True:
        p = rng.integers(0, trunk.config.vocab, 9).astype(np.int32)
        want = plain_generate(trunk, p, N + BLOCK + 1)
        if not set(trunk.config.eos_ids) & set(want):
            return p, want


def oracle(w, name):
    """dspark's drafter of format `name`, loaded onto the one trunk, with the oracle's boosts."""
    o = OracleDrafter(load_drafter(w.drafters[name].path, w.trunk), hit_rate=HIT, seed=SEED)
    o.next_stream = [*w.prompt.tolist(), *w.want]
    return o


def boost(logits, stream, start, first, d2t=None):
    """The OracleDrafter's change, on a peer's block logits [1, rows, V]: slot k (row first + k)
    gets BOOST on stream[start + k + 1] when the (SEED, start, k) draw is below HIT. Over a trimmed
    draft vocabulary (d2t: offsets, row j is token j + d2t[j]) the token's row gets it, if it has one."""
    logits = logits.clone()
    rows = {int(j + d2t[j]): j for j in range(len(d2t))} if d2t is not None else None
    for k in range(logits.shape[1] - first):
        t = start + k + 1
        if t < len(stream) and np.random.default_rng([SEED, start, k]).random() < HIT:
            j = stream[t] if rows is None else rows.get(stream[t])
            if j is not None:
                logits[0, first + k, j] += BOOST
    return logits


def run_session(trunk, drafter, prompt, verify, monkeypatch):
    """Greedy speculative decoding of N tokens; returns (session, rounds) with one (anchor position,
    verified block, accepted drafts, the block pass's hidden rows) per round, read off the
    drafter's and the trunk's passes."""
    rounds, passes, verify_pass, block_pass = [], [], trunk.verify, drafter.block_pass

    def logged(caches, cands, **kw):
        rounds.append((caches[0].pos, [int(t) for t in cands[0]]))
        return verify_pass(caches, cands, **kw)

    def drafted(kvs, anchors):
        hidden, logits = block_pass(kvs, anchors)
        passes.append(drafter.be.to_host(hidden)[: drafter.config.block])
        return hidden, logits
    with monkeypatch.context() as m:
        m.setattr(trunk, "verify", logged)
        m.setattr(drafter, "block_pass", drafted)
        s = DsparkSpecSession.prime(trunk, drafter, prompt, SpecParams(max_new_tokens=N, verify=verify, burst_target=5))
        accepted = []
        while not s.finished():
            before = s.stats.accepted
            s.round()
            accepted.append(s.stats.accepted - before)
    return s, [(pos, block, m, h) for (pos, block), m, h in zip(rounds, accepted, passes)]


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("case", TARGETS, ids=repr)
def test_greedy_speculative_equals_plain(world, case, name, monkeypatch):
    """Output byte-identical to plain greedy under verify full, auto and gain (a DFlash drafter, with
    no confidence head, by its acceptance by position); under full every round verifies the whole
    block; the boosts are taken (mean accepted length, partial accepts)."""
    w = world(case)
    drafter = oracle(w, name)
    assert drafter.taps == w.drafters[name].taps != w.trunk.config.tap_layers
    nd = drafter.config.drafts
    for verify in ("full", "auto", "gain"):
        s, rounds = run_session(w.trunk, drafter, w.prompt, verify, monkeypatch)
        assert s.emitted == w.want[:N], verify
        if verify == "full":
            assert all(len(block) == nd + 1 for _, block, _, _ in rounds), "verify='full' left drafts unverified"
            assert s.stats.mean_accepted_length >= MIN_MEAN, s.stats.summary()
            hist = s.stats.histogram
            assert hist[0] > 0 and sum(hist[1:nd]) > 0, f"no partial accepts: {hist}"
        s.close()


# ---- round by round against the peers ----------------------------------------------------------
def assert_hidden_close(got, want, what):
    """The block pass's hidden rows (after the drafter's final norm) within HIDDEN_TOL of the
    largest |h|: the context taps come from dspark's trunk on one side and transformers' on the
    other, which agree to about 1e-5."""
    want = want.detach().numpy() if torch.is_tensor(want) else want
    err, scale = float(np.abs(got - want).max()), float(np.abs(want).max())
    assert err <= HIDDEN_TOL * scale, f"{what}: block hidden rows differ by {err:.3g} (max |h| {scale:.3g})"


def target_taps(model, seq, taps):
    """[len(seq), n_taps * H]: tap t is the output of target layer t (-1: the embedding), i.e.
    transformers' hidden_states[t + 1], except the last layer's, whose hidden_states entry is the
    final-normed state: that one is read off the layer itself."""
    layers = model.model.layers
    last = {}
    hook = layers[-1].register_forward_hook(lambda mod, args, out: last.update(h=out[0] if isinstance(out, tuple)
                                                                               else out))
    try:
        with torch.no_grad():
            hs = model(torch.tensor([list(seq)]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return torch.cat([last["h"] if t == len(layers) - 1 else hs[t + 1] for t in taps], -1)[0]


@pytest.mark.parametrize("name", [f for f in FORMATS if f not in Z_LAB])
@pytest.mark.parametrize("case", TARGETS, ids=repr)
def test_rounds_equal_the_peers_draft_step(world, case, name, monkeypatch):
    """Under verify="full", each round's proposals equal the peer's draft step (DeepSpec's
    forward_dspark_draft_block + build_dspark_proposal; speculators' backbone + Markov chain) fed
    with transformers' hidden states of the committed rows and the same anchor."""
    check_rounds_equal_the_peers_draft_step(world(case), name, monkeypatch)


def check_rounds_equal_the_peers_draft_step(w, name, monkeypatch):
    d = w.drafters[name]
    s, rounds = run_session(w.trunk, oracle(w, name), w.prompt, "full", monkeypatch)
    stream = [*w.prompt.tolist(), *w.want]
    seq = [*w.prompt.tolist(), *s.emitted]
    ctx = target_taps(w.model, seq, d.taps)
    cache, seen = peers.deepspec_cache(), 0
    for r, (start, block, _, hidden) in enumerate(rounds):
        anchor = block[0]
        assert anchor == seq[start], f"round {r}: the anchor is not the committed stream's token at {start}"
        if name == "deepspec":   # every block row is a draft
            edit = partial(boost, stream=stream, start=start, first=0)
            ref = peers.deepspec_round(d.peer, cache, ctx[seen:start][None], anchor, start, edit)
            seen = start
        else:
            edit = partial(boost, stream=stream, start=start, first=0 if d.peer.config.sample_from_anchor else 1)
            ref = peers.speculators_round(d.peer, ctx[:start][None], anchor, start, edit=edit)
        assert_hidden_close(hidden, ref[0], f"round {r} at {start}")
        want = ref[2]
        assert block[1:] == want, f"round {r} at {start}: proposals {block[1:]}, the peer's {want}"


class ExactCache(torch.nn.Module):
    """A transformers target whose every pass recomputes all rows up to the pass's last position
    (the token at each position is the last one a pass put there), so a crop is exact for gdn
    layers too. dflash_generate's own cache of it is inert (NoCache)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config, self.lm_head, self.tokens = model, model.config, model.lm_head, []

    @property
    def device(self):
        return self.model.device

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def forward(self, input_ids, position_ids, logits_to_keep=0, output_hidden_states=False, **_):
        pos = position_ids[0].tolist()
        for p, t in zip(pos, input_ids[0].tolist()):
            self.tokens[p:p + 1] = [t]
        out = self.model(torch.tensor([self.tokens[: pos[-1] + 1]]), output_hidden_states=output_hidden_states)
        rows = slice(pos[0], pos[-1] + 1)
        logits = out.logits[:, rows][:, -logits_to_keep:] if logits_to_keep else out.logits[:, rows]
        hidden = tuple(h[:, rows] for h in out.hidden_states) if output_hidden_states else None
        return SimpleNamespace(logits=logits, hidden_states=hidden)


class NoCache:
    def get_seq_length(self):
        return 0

    def crop(self, n):
        pass


def run_dflash_generate(w, name, n, monkeypatch):
    """dflash.model.dflash_generate, greedy, with the oracle's boosts on its draft logits. Returns
    (new tokens, accepted drafts per round, the block each round verified, the draft rows' hidden
    states of each round)."""
    model, stream = w.drafters[name].peer, [*w.prompt.tolist(), *w.want]
    target = w.model if w.model.config.model_type == "qwen3" else ExactCache(w.model)
    where, blocks, hidden = {}, [], []
    draft_pass, draft_logits, target_pass = model.forward, model.compute_logits, target.forward

    def drafted(**kw):   # the block starts at the anchor's position
        where["start"] = int(kw["position_ids"][0, -kw["noise_embedding"].shape[1]])
        return draft_pass(**kw)

    def verified(input_ids, **kw):
        blocks.append(input_ids[0].tolist())
        return target_pass(input_ids, **kw)
    make_cache = dflash_model._make_cache
    monkeypatch.setattr(model, "forward", drafted)
    def logits(h, head):   # h: the draft rows 1..b-1 after the drafter's norm
        hidden.append(h[0])
        return boost(draft_logits(h, head), stream, where["start"], 0, getattr(model, "d2t", None))
    monkeypatch.setattr(model, "compute_logits", logits)
    monkeypatch.setattr(target, "forward", verified)
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)   # return_stats times with CUDA otherwise
    monkeypatch.setattr(dflash_model, "_make_cache", lambda cfg: NoCache() if isinstance(target, ExactCache) and
                        cfg is target.config else make_cache(cfg))
    out = dflash_model.dflash_generate(model, target, torch.tensor(w.prompt[None].astype(np.int64)), n, None,
                                       return_stats=True)
    monkeypatch.undo()
    return out.output_ids[0, len(w.prompt):].tolist(), [a - 1 for a in out.acceptance_lengths], blocks[1:], hidden


@pytest.mark.parametrize("name", Z_LAB)
@pytest.mark.parametrize("case", TARGETS, ids=repr)
def test_rounds_equal_dflash_generate(world, case, name, monkeypatch):
    """Output equal to dflash_generate's; under verify="full" (dflash_generate verifies every
    draft) each round verifies the same block and accepts the same number of drafts. dflash_generate
    runs BLOCK + 1 tokens further so that its blocks do not shrink at the budget while ours run."""
    check_rounds_equal_dflash_generate(world(case), name, monkeypatch)


def check_rounds_equal_dflash_generate(w, name, monkeypatch):
    """The z-lab drafter `name` of world w: dspark's session (verify="full") and dflash_generate emit
    the same tokens, verify the same block and accept as many drafts, round by round."""
    theirs, accepted, blocks, hidden = run_dflash_generate(w, name, N + BLOCK + 1, monkeypatch)
    s, rounds = run_session(w.trunk, oracle(w, name), w.prompt, "full", monkeypatch)
    assert s.emitted == theirs[:N] == w.want[:N]
    assert len(rounds) <= len(accepted)
    for r, (start, block, m, h) in enumerate(rounds):
        assert_hidden_close(h[1:], hidden[r], f"round {r} at {start}")
        assert (block, m) == (blocks[r], accepted[r]), f"round {r} at {start}: verified {block}, accepted {m}; " \
                                                      f"dflash_generate {blocks[r]}, {accepted[r]}"
    assert 1 + np.mean(accepted[: len(rounds)]) >= MIN_MEAN


def test_restore_takes_captures_of_the_same_taps_only(world, numpy_backend):
    """A prompt-end capture (its draft KV built from one drafter's taps) restores a session of that
    drafter byte for byte; a drafter tapping other layers refuses it, naming both, and allocates
    nothing."""
    w = world(TARGETS[1])
    dflash, deepspec = (load_drafter(w.drafters[n].path, w.trunk) for n in ("dflash", "deepspec"))
    params = SpecParams(max_new_tokens=12, verify="full")
    cold = DsparkSpecSession.prime(w.trunk, dflash, w.prompt, params)
    cap = cold.take_prefix_capture()
    assert cap.taps == dflash.taps
    warm = DsparkSpecSession.restore(w.trunk, dflash, cap, params)
    for s in (cold, warm):
        while not s.finished():
            s.burst()
    assert cold.emitted == warm.emitted == w.want[:12]
    assert cold.stats.histogram == warm.stats.histogram
    before = numpy_backend.alloc.owners()
    with pytest.raises(ValueError, match=r"built from trunk layers \(0, 2\); this drafter taps \(-1, 2\)"):
        DsparkSpecSession.restore(w.trunk, deepspec, cap, params)
    assert numpy_backend.alloc.owners() == before
    for s in (cold, warm):
        s.close()
    cap.free()


@pytest.mark.parametrize("name", ["deepspec", "dflash2"])
def test_simt_rounds_equal_numpy(world, simt, name, monkeypatch):
    """The same sessions with the kernels on simt: every round verifies the same block and
    accepts as many drafts as on numpy (checked against the peers above), output exact."""
    w = world(TARGETS[1])
    trunk = load_target(w.path, simt)
    drafter = OracleDrafter(load_drafter(w.drafters[name].path, trunk), hit_rate=HIT, seed=SEED)
    drafter.next_stream = [*w.prompt.tolist(), *w.want]
    s, rounds = run_session(trunk, drafter, w.prompt, "full", monkeypatch)
    s_np, rounds_np = run_session(w.trunk, oracle(w, name), w.prompt, "full", monkeypatch)
    assert s.emitted == s_np.emitted == w.want[:N]
    assert [r[:3] for r in rounds] == [r[:3] for r in rounds_np]
    for r, (a, b) in enumerate(zip(rounds, rounds_np)):
        assert_hidden_close(a[3], b[3], f"round {r}")


# ---- an FP8 target -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp8_world(tmp_path_factory, numpy_backend):
    """QWEN3_FP8 (tests/models/fp8_models.py) saved by transformers and quantized by the recipe,
    transformers' model read back from that FP8 directory (dequantized by its FP8 integration),
    with a DFlash and a DSpark (DeepSpec) drafter sized to it."""
    def only(L):
        return {k: v for k, v in formats(L).items() if k in ("dflash", "deepspec")}
    return saved_world(tmp_path_factory.mktemp("qwen3-fp8"), QWEN3_FP8.base, numpy_backend, only,
                       build_target=lambda case, d: build_fp8(QWEN3_FP8, d))


@pytest.mark.parametrize("name", ["dflash", "deepspec"])
def test_an_fp8_target_accepts_what_the_peers_loop_accepts(fp8_world, name, monkeypatch):
    """On the FP8 target (its linears e4m3 + scales on numpy), round by round: DFlash verifies and
    accepts what dflash_generate does on transformers' FP8 model; DSpark proposes what DeepSpec's
    draft step does on transformers' hidden states; both emit plain greedy decode's stream."""
    assert fp8_world.trunk.source.quantized
    if name == "dflash":
        check_rounds_equal_dflash_generate(fp8_world, name, monkeypatch)
    else:
        check_rounds_equal_the_peers_draft_step(fp8_world, name, monkeypatch)
