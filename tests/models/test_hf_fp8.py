"""FP8 checkpoints (block-scaled e4m3) of Qwen3 and Qwen3.5 against transformers, which loads the
same directory (its fine-grained FP8 integration dequantizes on the CPU): logits within 1e-4 on
numpy, greedy identical over 40 tokens, bf16 on simt bitwise the bf16 path of the dequantized weights; edge blocks
against an independent dequantization (ml_dtypes); the format's every refusal with nothing loaded;
the report and `dspark info --model`; the resident bytes; and the exactness contract on an FP8
target, one test per property, on numpy, simt and the CuPy contract stand-in (the session-level
ones on numpy and the stand-in: SESSION_BACKENDS)."""

import shutil

import numpy as np
import pytest

from dspark.backends import contract
from dspark.cli import main
from dspark.decode import PlainBatch, plain_generate
from dspark.dtypes import BF16
from dspark.models.hf import CheckpointError, load_target, load_tokenizer
from dspark.models.oracle import OracleDrafter, TrunkDrafter
from dspark.models.presets import random_drafter, tiny_pair
from dspark.ops.fp8 import Fp8Matrix
from dspark.ops.linear import ColumnRuns
from dspark.session import DsparkSpecSession, SamplingParams, SpecParams, spec_burst
from tests.models.fp8_models import (EDGE_FP8, FP8_CASES, QWEN3_FP8, QWEN35_FP8, dequantize,
                                     dequantized_copy, edit_config, quantize, save_tensors, tensors_of, unprefixed)
from tests.models.hf_models import assert_logits_close, hf_greedy, hf_logits, model_class, require_transformers, \
    save_tokenizer
from tests.session.coupled_runs import check_alone_and_batched

BACKENDS = ["numpy", "simt", "contract"]
# The session-level properties run on numpy and the cuda code path (the stand-in runs the simt
# kernels, behind the graphs and recorded rounds): simt's FP8 arithmetic is already bitwise the
# bf16 path's over the dequantized weights (test_bf16_on_simt_...), whose sessions the rest of the
# suite runs on simt; a simt run of each would add half a minute of emulated tensor cores.
SESSION_BACKENDS = ["numpy", "contract"]


@pytest.fixture(scope="module")
def peer_model(fp8_dir):
    """case -> transformers' model loaded from the FP8 directory at float32."""
    made = {}

    def get(case):
        if case.name not in made:
            torch, transformers = require_transformers()
            made[case.name] = model_class(transformers, case.base.family).from_pretrained(
                fp8_dir(case), dtype=torch.float32).eval()
        return made[case.name]
    return get


@pytest.fixture(scope="module")
def backends(simt, numpy_backend):
    dev = contract.backend()
    return {"numpy": numpy_backend, "simt": simt, "contract": dev}


def prompt_of(case, n=11, seed=0):
    return np.random.default_rng(case.base.seed + seed).integers(0, case.base.config["vocab_size"], n).astype(np.int32)


# ---- the recipe --------------------------------------------------------------------------------------
def test_the_recipe_gives_known_bytes_and_transformers_own():
    """A block whose amax is 448 (scale 1) gives the e4m3 bytes by hand, round to nearest even
    included (17 -> 16, 1.5 2^-9 -> 2 2^-9, 2^-10 -> 0); one of amax 2 gives 448 / 2 times each
    weight; an all-zero block gets scale 1; on a tensor of whole blocks the bytes and scales are
    transformers' own Fp8Quantize's."""
    w = np.zeros((128, 256), np.float32)
    w[0, :8] = [448.0, 17.0, 2.0**-9, 1.5 * 2.0**-9, 2.0**-10, -0.5, 1.0, -448.0]
    w[1, 128:131] = [2.0, 1.0, -0.5]
    q, inv = quantize(w)
    assert q[0, :8].view(np.uint8).tolist() == [0x7E, 0x58, 0x01, 0x02, 0x00, 0xB0, 0x38, 0xFE]
    assert q[1, 128:131].view(np.uint8).tolist() == [0x7E, 0x76, 0xEE]   # 448, 224, -112
    assert inv.tolist() == [[1.0, np.float32(1) / np.float32(224)]]
    q0, inv0 = quantize(np.zeros((130, 5), np.float32))
    assert inv0.shape == (2, 1) and (inv0 == 1).all() and not q0.view(np.uint8).any()
    torch, _ = require_transformers()
    from types import SimpleNamespace

    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    x = torch.randn(256, 384, generator=torch.Generator().manual_seed(0)) * 3
    cfg = SimpleNamespace(weight_block_size=(128, 128), scale_fmt="float")
    theirs = Fp8Quantize(SimpleNamespace(quantization_config=cfg))._quantize_one("a.weight", x)
    ours_q, ours_inv = quantize(x.numpy())
    np.testing.assert_array_equal(ours_q.view(np.uint8), theirs["a.weight"].view(torch.uint8).numpy())
    np.testing.assert_array_equal(ours_inv, theirs["a.weight_scale_inv"].numpy())


# ---- transformers as the oracle -----------------------------------------------------------------------
@pytest.mark.parametrize("case", FP8_CASES, ids=repr)
def test_logits_and_greedy_match_transformers_on_numpy(fp8_dir, peer_model, numpy_backend, case):
    """Prefill and 8 decode steps within 1e-4 of the largest logit; 40 greedy tokens identical."""
    trunk, model = load_target(fp8_dir(case), numpy_backend), peer_model(case)
    assert trunk.source.quantized and all(isinstance(trunk.w[n], Fp8Matrix) for n in trunk.source.quantized)
    p = prompt_of(case)
    steps = prompt_of(case, 8, seed=1)
    want = hf_logits(model, p, steps)
    cache = trunk.new_cache()
    assert_logits_close(trunk.prefill(cache, p).logits, want[0], f"{case.name} prefill")
    for j, tok in enumerate(steps):
        assert_logits_close(trunk.decode([cache], [tok]).logits[0], want[j + 1], f"{case.name} step {j}")
    assert plain_generate(trunk, p, 40) == hf_greedy(model, p, 40)


@pytest.mark.parametrize("case", FP8_CASES, ids=repr)
def test_bf16_on_simt_is_the_bf16_product_of_the_dequantized_weights(fp8_dir, peer_model, simt, case, tmp_path):
    """simt keeps the checkpoint's bf16 (dtype=None on an FP8 checkpoint) and multiplies with bf16
    activations: bitwise the bf16 path over the weights dequantized (ml_dtypes) and rounded to bf16,
    and within 3 % of transformers' f32 logits over the first 8 rows (later rows of the random
    Qwen3.5 amplify bf16's rounding, FP8 or not, to about 15 %)."""
    d = fp8_dir(case)
    trunk = load_target(d, simt)
    assert trunk.weight_dtype == BF16 and trunk.source.stored == "bfloat16"
    dequantized_copy(d, tmp_path / "bf16", BF16)
    same = load_target(tmp_path / "bf16", simt, dtype="bfloat16")
    p = prompt_of(case)
    got = trunk.prefill(trunk.new_cache(), p).logits
    np.testing.assert_array_equal(got, same.prefill(same.new_cache(), p).logits)
    want = hf_logits(peer_model(case), p, [])[0]
    assert np.abs(got - want)[:8].max() <= 3e-2 * np.abs(want).max()
    with pytest.raises(ValueError, match="dtype=float32: FP8 weights on 'simt' multiply with 16-bit activations"):
        load_target(d, simt, dtype="float32")


def test_edge_blocks_equal_an_independent_dequantization(fp8_dir, numpy_backend, simt, tmp_path):
    """N and K off the 128 grid (hidden 160, MLP 200, kv 64; fused parts that end inside a block
    become column runs), bf16 scales, the multimodal names: on numpy the logits are bitwise those of
    the same checkpoint dequantized by ml_dtypes into f32; on simt (bf16) bitwise those of that
    dequantization rounded to bf16. modules_to_not_convert written without its
    model.language_model. prefix keeps the same modules as stored."""
    d = fp8_dir(EDGE_FP8)
    dequantized_copy(d, tmp_path / "f32")
    dequantized_copy(d, tmp_path / "bf16", BF16)
    p = prompt_of(EDGE_FP8)
    fp8, ref = load_target(d, numpy_backend), load_target(tmp_path / "f32", numpy_backend)
    assert fp8.source.scale_dtypes == {"BF16": len(fp8.source.quantized)} and sorted(fp8.source.kept) == [
        "layers.0.gdn.w_a", "layers.0.gdn.w_b"]
    assert isinstance(fp8.w["layers.0.mlp.w_gate_up"], ColumnRuns) and isinstance(fp8.w["layers.0.gdn.w_in"], ColumnRuns)
    w = tensors_of(d)
    gate = "model.language_model.layers.0.mlp.gate_proj.weight"
    np.testing.assert_array_equal(np.asarray(fp8.w["layers.0.mlp.w_gate"]),
                                  dequantize(w[gate], w[gate.replace("weight", "weight_scale_inv")]).T)
    for a, b in ((fp8, ref), (load_target(d, simt), load_target(tmp_path / "bf16", simt, dtype="bfloat16"))):
        ca, cb = a.new_cache(), b.new_cache()
        np.testing.assert_array_equal(a.prefill(ca, p).logits, b.prefill(cb, p).logits)
        for tok in p[:3]:
            np.testing.assert_array_equal(a.decode([ca], [tok]).logits, b.decode([cb], [tok]).logits)
    plain = tmp_path / "unprefixed"
    shutil.copytree(d, plain)
    edit_config(plain, lambda cfg: cfg["quantization_config"].update(
        modules_to_not_convert=list(unprefixed(EDGE_FP8).not_convert)))
    other = load_target(plain, numpy_backend)
    assert other.source.kept == fp8.source.kept
    np.testing.assert_array_equal(other.prefill(other.new_cache(), p).logits, fp8.prefill(fp8.new_cache(), p).logits)


# ---- the report, the command line, the memory -----------------------------------------------------
def test_report_says_what_is_quantized_and_info_prints_it(fp8_dir, numpy_backend, capsys):
    d = fp8_dir(QWEN35_FP8)
    src = load_target(d, numpy_backend).source
    assert src.quantization == "FP8 e4m3, 128x128 blocks, dynamic activations"
    assert sorted(src.kept) == ["layers.0.gdn.w_a", "layers.0.gdn.w_b", "layers.2.gdn.w_a", "layers.2.gdn.w_b",
                                "layers.3.mlp.w_down"]
    assert "layers.0.gdn.w_qkv" in src.quantized and len(src.quantized) == 25 and src.dtypes["F8_E4M3"] == 25
    assert "25 linears kept e4m3 with F32 25 block scales, 5 left unquantized" in src.summary()
    assert main(["info", "--model", str(d)]) == 0
    out = capsys.readouterr().out
    assert "model: qwen3_5_text from" in out and "25 linears kept e4m3" in out
    lines = {line.split(":")[0].strip(): line for line in out.splitlines()}
    assert "layers.0.gdn.w_qkv" in lines["quantized (FP8 e4m3, 128x128 blocks, dynamic activations)"]
    assert "layers.3.mlp.w_down" in lines["left as stored"] and "w_qkv" not in lines["left as stored"]


def test_quantized_linears_hold_half_the_bytes(fp8_dir, backends, tmp_path):
    """At dtype=bfloat16, counted on each kernel backend's allocator (owner 'weights'): the FP8
    load's bytes less those of its unquantized tensors (the same tensors of the bf16 copy) are the
    quantized linears' bytes and scales, <= 0.51 x their bf16 bytes; no owner holds a 16-bit or f32
    copy of them. The numpy backend keeps the same bytes and scales."""
    d = fp8_dir(QWEN35_FP8)
    dequantized_copy(d, tmp_path / "bf16", BF16)
    for name in ("simt", "contract", "numpy"):
        be = backends[name]
        before = be.alloc.bytes("weights")
        fp8 = load_target(d, be, dtype="bfloat16")
        mid = be.alloc.bytes("weights")
        held = [m for w in fp8.w.values() for m in (w.runs if isinstance(w, ColumnRuns) else ((w, 0),))
                for m in m[:1] if isinstance(m, Fp8Matrix) and m.q.base is None]  # each FP8 array once
        assert all(np.dtype(w.q.dtype) == np.uint8 and np.dtype(w.scale.dtype) == np.float32 for w in held)
        quantized = sum(fp8.w[n].shape[0] * fp8.w[n].shape[1] for n in fp8.source.quantized)
        if name == "numpy":  # panel-major 16-bit matrices pad differently: check the FP8 arrays alone
            assert fp8.source.device_bytes == mid - before
            assert sum(w.nbytes for w in held) <= 0.51 * 2 * quantized
            continue
        bf16 = load_target(tmp_path / "bf16", be, dtype="bfloat16")
        plain = be.alloc.bytes("weights") - mid
        resident = (mid - before) - (plain - 2 * quantized)
        assert resident == sum(w.nbytes for w in held) <= 0.51 * 2 * quantized, name
        del fp8, bf16


# ---- refusals ------------------------------------------------------------------------------------------
def set_quant(**kw):
    return lambda cfg: cfg["quantization_config"].update(kw)


def drop_quant(*keys):
    return lambda cfg: [cfg["quantization_config"].pop(k) for k in keys]


CONFIG_REFUSALS = [
    (set_quant(quant_method="gptq"), r"quant_method='gptq' \(GPTQ int4/int8\): dspark serves block-scaled FP8"),
    (set_quant(quant_method="awq"), r"quant_method='awq' \(AWQ int4\)"),
    (set_quant(quant_method="compressed-tensors"), r"quant_method='compressed-tensors'"),
    (set_quant(quant_method="modelopt", quant_algo="NVFP4"), r"quant_method='modelopt' \(ModelOpt \(NVFP4 / FP8\)\)"),
    (set_quant(quant_method="mxfp4"), r"quant_method='mxfp4' \(MXFP4\)"),
    (set_quant(quant_method="bitsandbytes"), r"quant_method='bitsandbytes'"),
    (set_quant(fmt="e5m2"), r"quantization_config.fmt='e5m2': dspark serves e4m3"),
    (set_quant(activation_scheme="static"), r"activation_scheme='static': dspark serves 'dynamic'"),
    (set_quant(scale_fmt="ue8m0"), r"scale_fmt='ue8m0': dspark serves float scales only"),
    (drop_quant("weight_block_size"), r"weight_block_size is missing: per-tensor FP8 is not served"),
    (set_quant(modules_to_convert=["model.embed_tokens"]), r"modules_to_convert=\['model.embed_tokens'\]"),
    (set_quant(weight_block_size=[64, 64]), r"weight_block_size=\[64, 64\]: the FP8 kernels take \[128, 128\]"),
]
SCALE = "model.layers.1.mlp.up_proj.weight_scale_inv"
WEIGHT = "model.layers.1.mlp.up_proj.weight"


TENSOR_REFUSALS = [
    (lambda t: t.pop(SCALE), rf"tensor '{WEIGHT}' is F8_E4M3 and its scale '{SCALE}' is missing"),
    (lambda t: t[SCALE].__setitem__((0, 0), np.inf), rf"tensor '{SCALE}'\[0, 0\]=inf: a scale must be finite and positive"),
    (lambda t: t[SCALE].__setitem__((1, 0), 0.0), rf"tensor '{SCALE}'\[1, 0\]=0.0: a scale must be finite and positive"),
    (lambda t: t[SCALE].__setitem__((0, 0), -1.0), rf"'{SCALE}'\[0, 0\]=-1.0"),
    (lambda t: t.update({"model.layers.0.linear_attn.in_proj_a.weight_scale_inv": np.ones((1, 1), np.float32)}),
     r"scales 'model.layers.0.linear_attn.in_proj_a.weight', which is stored as BF16: a 16-bit weight takes no scale"),
]


@pytest.fixture(scope="module")
def refusal_tensors(fp8_dir):
    return tensors_of(fp8_dir(QWEN35_FP8))


def refused(be, d, match, **kw):
    before = be.alloc.owners()
    with pytest.raises(CheckpointError, match=match):
        load_target(d, be, **kw)
    assert be.alloc.owners() == before, "a refused load allocated on the backend"


def test_every_refusal_names_its_key_or_tensor_and_loads_nothing(fp8_dir, refusal_tensors, numpy_backend, simt,
                                                                 tmp_path):
    src = fp8_dir(QWEN35_FP8)
    copies = iter(range(1000))

    def copy():
        d = tmp_path / f"c{next(copies)}"
        shutil.copytree(src, d)
        return d
    for change, match in CONFIG_REFUSALS:
        d = copy()
        edit_config(d, change)
        refused(numpy_backend, d, match)
    d = copy()
    edit_config(d, lambda cfg: cfg.pop("quantization_config"))
    refused(numpy_backend, d, "is F8_E4M3 but config.json has no quantization_config")
    for mutate, match in TENSOR_REFUSALS + [
        (lambda t: t.update({SCALE: np.ones((3, 1), np.float32)}), rf"tensor '{SCALE}' has shape \(3, 1\): expected "
                                                                    rf"\(2, 1\), one scale per 128x128 block"),
        (lambda t: t.update({SCALE: t[SCALE].astype(np.float16)}), rf"tensor '{SCALE}' has dtype F16: expected F32 or BF16"),
        (lambda t: t.update({"model.embed_tokens.weight": quantize(t["model.embed_tokens.weight"].astype(np.float32))[0]}),
         r"tensor 'model.embed_tokens.weight' is F8_E4M3: dspark serves FP8 for decoder-layer linears only"),
    ]:
        d = copy()
        tensors = {k: v.copy() for k, v in refusal_tensors.items()}
        mutate(tensors)
        save_tensors(d, tensors)
        refused(numpy_backend, d, match)
    # a listed module stored as F8: in_proj_a quantized although modules_to_not_convert names it
    d = copy()
    tensors = dict(refusal_tensors)
    a = "model.layers.2.linear_attn.in_proj_a.weight"
    tensors[a], tensors[a.replace("weight", "weight_scale_inv")] = quantize(tensors[a].astype(np.float32))
    save_tensors(d, tensors)
    refused(numpy_backend, d, rf"tensor '{a}' is F8_E4M3, but quantization_config.modules_to_not_convert lists "
                              r"'in_proj_a'")
    # NaN bytes inside a weight: found when the weight is read, what was loaded before it freed
    for be in (numpy_backend, simt):
        d = copy()
        tensors = dict(refusal_tensors)
        q = tensors[WEIGHT].copy()
        q.view(np.uint8)[3, 5], q.view(np.uint8)[7, 1] = 0x7F, 0xFF
        tensors[WEIGHT] = q
        save_tensors(d, tensors)
        refused(be, d, rf"tensor '{WEIGHT}' holds 2 e4m3 NaN bytes \(0x7F / 0xFF\)")


# ---- the command line ---------------------------------------------------------------------------------
def test_generate_on_an_fp8_directory(fp8_dir, numpy_backend, simt, capsys, tmp_path):
    """`dspark generate --model DIR` on an FP8 checkpoint, numpy and simt: plain greedy decode's text."""
    d = tmp_path / "with-tokenizer"
    shutil.copytree(fp8_dir(QWEN35_FP8), d)
    save_tokenizer(d, ["def walk(root):\n    return os.listdir(root)\n"])
    tok = load_tokenizer(d)
    for name, be in (("numpy", numpy_backend), ("simt", simt)):
        rc = main(["generate", "import os\n", "--model", str(d), "--backend", name, "--max-new-tokens", "6",
                   "--no-progress"])
        out = capsys.readouterr()
        assert rc == 0, out.err
        want = plain_generate(load_target(d, be), tok.encode("import os\n"), 6)
        assert out.out == "import os\n" + tok.decode(want) + "\n" and "FP8 e4m3" in out.err


# ---- exactness on an FP8 target ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp8_trunks(fp8_dir, backends):
    made = {}

    def get(name):
        if name not in made:
            made[name] = load_target(fp8_dir(QWEN35_FP8), backends[name], max_ctx=96)
        return made[name]
    return get


def logits(trunk, tp):
    return trunk.be.to_host(tp.logits)


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_column_equals_the_decode_step(fp8_trunks, backend):
    trunk = fp8_trunks(backend)
    p, toks = prompt_of(QWEN35_FP8, 9), prompt_of(QWEN35_FP8, 4, seed=2)
    a, b = trunk.new_cache(), trunk.new_cache()
    trunk.prefill(a, p)
    trunk.prefill(b, p)
    steps = [logits(trunk, trunk.decode([a], [t]))[0] for t in toks]
    ver = logits(trunk, trunk.verify([b], [toks]))
    np.testing.assert_array_equal(ver, np.stack(steps))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_session_alone_equals_it_in_a_batch(fp8_trunks, backend):
    trunk = fp8_trunks(backend)
    prompts = [prompt_of(QWEN35_FP8, n, seed=n) for n in (3, 9, 14)]
    caches = [trunk.new_cache() for _ in prompts]
    for c, p in zip(caches, prompts):
        trunk.prefill(c, p)
    toks = [int(p[-1]) for p in prompts]
    together = logits(trunk, trunk.decode(caches, toks))
    alone = [trunk.new_cache() for _ in prompts]
    for i, (c, p) in enumerate(zip(alone, prompts)):
        trunk.prefill(c, p)
        np.testing.assert_array_equal(logits(trunk, trunk.decode([c], [toks[i]]))[0], together[i])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prompt_split_anywhere_equals_one_pass(fp8_trunks, backend):
    trunk = fp8_trunks(backend)
    p = prompt_of(QWEN35_FP8, 66, seed=3)
    one = trunk.new_cache()
    want = logits(trunk, trunk.prefill(one, p))[-1]
    nxt = logits(trunk, trunk.decode([one], [5]))
    for chunk in (1, 40):
        c = trunk.new_cache()
        if chunk == 1:  # three single-token passes, then the rest in one
            list(trunk.prompt_passes(c, p[:3], chunk=1))
            *_, last = trunk.prompt_passes(c, p[3:], chunk=len(p))
        else:  # 40 + 26: the second pass crosses the 64-row chunk grid of the gdn prompt pass
            *_, last = trunk.prompt_passes(c, p, chunk=chunk)
        np.testing.assert_array_equal(logits(trunk, last)[0], want, err_msg=f"chunk {chunk}")
        np.testing.assert_array_equal(logits(trunk, trunk.decode([c], [5])), nxt, err_msg=f"chunk {chunk}")


def live_prompt(trunk, n, seed):
    rng = np.random.default_rng(seed)
    while True:
        p = rng.integers(0, trunk.config.vocab, 7).astype(np.int32)
        want = plain_generate(trunk, p, n)
        if len(want) == n:
            return p, want


@pytest.mark.parametrize("backend", SESSION_BACKENDS)
def test_rollback_and_demotion_are_bitwise(fp8_trunks, backend):
    """Both rollbacks leave each gdn state bitwise the plain decode's after the same tokens, and a
    session demoted after its first burst finishes plain decode's stream."""
    trunk = fp8_trunks(backend)
    be, n = trunk.be, 6
    p, want = live_prompt(trunk, n, 5)
    plain = trunk.new_cache()
    trunk.prefill(plain, p)
    for rollback in ("checkpoint", "replay"):
        drafter = OracleDrafter(random_drafter(trunk, 5, block=4), hit_rate=0.6, seed=5)
        drafter.next_stream = [*p.tolist(), *want]
        s = DsparkSpecSession.prime(trunk, drafter, p, SpecParams(max_new_tokens=n, burst_target=3, rollback=rollback))
        s.burst()
        emitted = list(s.emitted)
        ref = trunk.new_cache()
        trunk.prefill(ref, p)
        for t in emitted:  # at a burst boundary: pos = prompt + emitted, the anchor pending
            trunk.decode([ref], [t])
        assert s.cache.pos == ref.pos
        for g, (x, y) in enumerate(zip(s.cache.state, ref.state)):
            np.testing.assert_array_equal(be.to_host(x), be.to_host(y), err_msg=f"{rollback}, gdn layer {g}")
        cache, last = s.into_demoted()
        batch = PlainBatch(trunk)
        sid = batch.join(cache, last, n, emitted)
        batch.run()
        assert batch.leave(sid).emitted == want, rollback
        cache.free()
        ref.free()


@pytest.mark.parametrize("backend", SESSION_BACKENDS)
def test_greedy_speculative_equals_plain(fp8_trunks, backend):
    trunk = fp8_trunks(backend)
    p, want = live_prompt(trunk, 8, 6)
    drafter = OracleDrafter(random_drafter(trunk, 6, block=4), hit_rate=0.7, seed=6)
    drafter.next_stream = [*p.tolist(), *want]
    s = DsparkSpecSession.prime(trunk, drafter, p, SpecParams(max_new_tokens=8, burst_target=4))
    while not s.finished():
        s.burst()
    assert s.emitted == want and s.stats.accepted > 0
    s.close()


@pytest.mark.parametrize("backend", SESSION_BACKENDS)
def test_coupled_sampled_equals_plain_sampled(fp8_trunks, backend):
    trunk = fp8_trunks(backend)
    drafter = TrunkDrafter(random_drafter(trunk, 7, block=4), tilt=0.5, seed=7)
    reqs = [(prompt_of(QWEN35_FP8, 5, seed=8), SamplingParams(temperature=0.8, top_k=40, seed=1)),
            (prompt_of(QWEN35_FP8, 4, seed=9), SamplingParams(temperature=0.6, top_p=0.9, seed=2))]
    total = check_alone_and_batched(trunk, drafter, reqs, 4, bursts=(2, 3))
    assert total.accepted > 0


def test_drafters_take_the_targets_16_bit_type_on_cuda_only(fp8_trunks):
    """On cuda (the stand-in) a drafter's matrices are the bf16 target's bf16, its vectors and
    heads f32; on numpy and simt every tensor stays f32 (the CPU products widen exactly)."""
    for name in BACKENDS:
        d = random_drafter(fp8_trunks(name), 1, block=4)
        want = BF16 if name == "contract" else np.dtype(np.float32)
        assert {d.w[k].dtype for k in ("fc", "layers.0.attn.wqkv", "layers.0.attn.wkv", "layers.0.mlp.w_down")} \
            == {want}, name
        assert {d.w[k].dtype for k in ("layers.0.norm1", "markov.w1", "conf.w")} == {np.dtype(np.float32)}, name


def test_an_fp8_pair_is_priced_by_its_own_cost_prior_key(fp8_trunks, monkeypatch):
    """The cost prior (dspark.cost_prior) keys an FP8 trunk apart from the bf16 one of the same
    configs: half the weight bytes, another table entry. The drafter hands the trunk's weight
    format to adopt; a bf16 trunk's key is the one it always had."""
    from dspark import cost_prior
    from dspark.models import drafter as drafter_module
    seen = []
    monkeypatch.setattr(drafter_module, "adopt", lambda be, tc, dc, weights="": seen.append(weights))
    trunk = fp8_trunks("contract")
    assert cost_prior.weight_format(trunk) == "fp8"
    random_drafter(trunk, 1, block=4)
    assert seen == ["fp8"]
    assert cost_prior.weight_format(tiny_pair(trunk.be)[0]) == ""
    dc = random_drafter(trunk, 1, block=4).config
    assert cost_prior.fingerprint(trunk.config, dc, "fp8") != cost_prior.fingerprint(trunk.config, dc)
