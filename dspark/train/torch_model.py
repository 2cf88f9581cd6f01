"""PyTorch mirrors of HybridTrunk and DsparkDrafter, for training.

Parameters live in a flat dict keyed exactly as dspark.models.weights.trunk_spec / drafter_spec,
with the same [in, out] layouts (y = x @ W), so export is a .numpy() per tensor. Every op follows
dspark/models/trunk.py and drafter.py: RMSNorm eps from the config, RoPE rotate-half at absolute
positions, GQA query head j on kv head j // (heads / kv_heads), softmax scale 1/sqrt(head_dim),
the gdn conv/SiLU/L2/gates of dspark/ops/gdn.py and its SiLU(z)-gated o_norm.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ..models.config import TrunkConfig
from ..models.drafter_config import DrafterConfig
from ..models.weights import drafter_spec, trunk_spec
from . import torch_gdn


def rmsnorm(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rope(x, positions, theta):
    """x [..., T, H, D] at positions [..., T] (broadcast), rotate-half; angles in f64 as dense.rope."""
    d = x.shape[-1]
    half = d // 2
    inv = 1.0 / (theta ** (torch.arange(half, dtype=torch.float64) * 2.0 / d))
    ang = positions.to(torch.float64)[..., None] * inv
    cos = torch.cos(ang).to(x.dtype)[..., None, :]
    sin = torch.sin(ang).to(x.dtype)[..., None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def swiglu_mlp(h, w, p):
    return (F.silu(h @ w[p + "mlp.w_gate"]) * (h @ w[p + "mlp.w_up"])) @ w[p + "mlp.w_down"]


def attend(q, k, v, mask=None, causal=False):
    """q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D] -> [B, Tq, Hq * D]. GQA by repeat_interleave:
    query head j reads kv head j // G, as the kernel's grouping."""
    G = q.shape[2] // k.shape[2]
    q, k, v = (z.transpose(1, 2) for z in (q, k, v))
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    return o.transpose(1, 2).flatten(2)


def init_weights(spec: dict, layers: int, seed: int) -> dict[str, torch.Tensor]:
    """GPT-style init: N(0, 1/in) matrices, residual outputs scaled by 1/sqrt(2 layers), unit
    norms, gdn decays as weights.random_weights."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in spec.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.startswith("norm") or leaf.endswith("_norm") or leaf == "final_norm":
            w = torch.ones(shape)
        elif leaf == "A_log":
            w = torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=g))
        elif leaf == "dt_bias":
            w = torch.log(torch.expm1(torch.empty(shape).uniform_(0.001, 0.1, generator=g)))
        elif leaf == "conv":
            w = torch.empty(shape).uniform_(-0.5, 0.5, generator=g)
        elif name == "embed":
            w = torch.randn(shape, generator=g)
        elif name in ("conf.w", "conf.b"):
            w = torch.zeros(shape)
        elif name == "markov.w2":
            w = torch.zeros(shape)   # the Markov head starts as a no-op on the logits
        elif len(shape) == 1:
            w = torch.randn(shape, generator=g) * 0.1
        else:
            w = torch.randn(shape, generator=g) / math.sqrt(shape[0])
            if leaf in ("wo", "w_down"):
                w = w / math.sqrt(2 * layers)
        out[name] = w.float()
    return out


def as_tensors(weights: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(v, np.float32)) for k, v in weights.items()}


def as_arrays(weights: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: np.ascontiguousarray(v.detach().cpu().float().numpy()) for k, v in weights.items()}


class TorchTrunk:
    def __init__(self, config: TrunkConfig, w: dict[str, torch.Tensor]):
        spec = trunk_spec(config)
        assert set(spec) == set(w), sorted(set(spec) ^ set(w))
        self.c, self.w = config, w

    @classmethod
    def init(cls, config: TrunkConfig, seed: int) -> "TorchTrunk":
        return cls(config, init_weights(trunk_spec(config), len(config.layers), seed))

    def params(self):
        return list(self.w.values())

    # ---- whole sequences (training, taps, parity) ----------------------------------------------
    def forward(self, ids, chunked: bool = True, state: bool = False):
        """ids [B, T] from position 0. Returns (logits [B, T, V], taps [B, T, n_taps * d]) and,
        with state=True, the per-layer decode state after the last token."""
        c, w = self.c, self.w
        B, T = ids.shape
        positions = torch.arange(T)
        x = w["embed"][ids]
        taps, st = {-1: x}, []  # layer -> its output; -1: the embedding
        for i, kind in enumerate(c.layers):
            p = f"layers.{i}."
            h = rmsnorm(x, w[p + "norm1"], c.norm_eps)
            if kind == "attn":
                q, k, v = self._qkv(h, p, positions)
                x = x + attend(q, k, v, causal=True) @ w[p + "attn.wo"]
                st.append((k, v))
            else:
                mixed = h @ w[p + "gdn.w_qkv"]
                act, window = torch_gdn.conv_silu(mixed, w[p + "gdn.conv"])
                q, k, v = torch_gdn.qkv_heads(act, c.gdn_heads, c.gdn_dk, c.gdn_dv)
                la, beta = torch_gdn.gates(h @ w[p + "gdn.w_a"], h @ w[p + "gdn.w_b"], w[p + "gdn.A_log"],
                                           w[p + "gdn.dt_bias"])
                scan = torch_gdn.chunked if chunked else torch_gdn.sequential
                o, S = scan(q, k, v, la, beta)
                x = x + self._gdn_out(o, h, p)
                st.append((S, window))
            x = x + swiglu_mlp(rmsnorm(x, w[p + "norm2"], c.norm_eps), w, p)
            taps[i] = x
        logits = rmsnorm(x, w["final_norm"], c.norm_eps) @ w["lm_head"]
        out = (logits, torch.cat([taps[i] for i in c.tap_layers], -1))  # in tap_layers' order, as the trunk
        return (*out, st) if state else out

    def _qkv(self, h, p, positions):
        c, w = self.c, self.w
        q = (h @ w[p + "attn.wq"]).unflatten(-1, (c.attn_heads, c.head_dim))
        k = (h @ w[p + "attn.wk"]).unflatten(-1, (c.attn_kv_heads, c.head_dim))
        v = (h @ w[p + "attn.wv"]).unflatten(-1, (c.attn_kv_heads, c.head_dim))
        return rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta), v

    def _gdn_out(self, o, h, p):
        """SiLU(z)-gated RMSNorm over each head's dv, then the output projection."""
        c, w = self.c, self.w
        z = (h @ w[p + "gdn.w_z"]).unflatten(-1, (c.gdn_heads, c.gdn_dv))
        o = rmsnorm(o, w[p + "gdn.o_norm"], c.norm_eps) * F.silu(z)
        return o.flatten(-2) @ w[p + "gdn.wo"]

    # ---- one token for a batch of equal-length sequences (greedy continuations) ---------------
    @torch.no_grad()
    def step(self, st, tok, pos: int):
        """tok [B] at position pos, after `forward(..., state=True)` or earlier steps; updates st
        in place. Returns (logits [B, V], taps [B, n_taps * d])."""
        c, w = self.c, self.w
        x = w["embed"][tok][:, None]                      # [B, 1, d]
        positions = torch.tensor([pos])
        taps = {-1: x}
        for i, kind in enumerate(c.layers):
            p = f"layers.{i}."
            h = rmsnorm(x, w[p + "norm1"], c.norm_eps)
            if kind == "attn":
                q, k, v = self._qkv(h, p, positions)
                kc, vc = st[i]
                kc, vc = torch.cat([kc, k], 1), torch.cat([vc, v], 1)
                st[i] = (kc, vc)
                x = x + attend(q, kc, vc) @ w[p + "attn.wo"]
            else:
                S, window = st[i]
                act, window = torch_gdn.conv_silu(h @ w[p + "gdn.w_qkv"], w[p + "gdn.conv"], window)
                q, k, v = torch_gdn.qkv_heads(act[:, 0], c.gdn_heads, c.gdn_dk, c.gdn_dv)
                la, beta = torch_gdn.gates(h[:, 0] @ w[p + "gdn.w_a"], h[:, 0] @ w[p + "gdn.w_b"],
                                           w[p + "gdn.A_log"], w[p + "gdn.dt_bias"])
                S, o = torch_gdn.step(S, q, k, v, la, beta)
                st[i] = (S, window)
                x = x + self._gdn_out(o[:, None], h, p)
            x = x + swiglu_mlp(rmsnorm(x, w[p + "norm2"], c.norm_eps), w, p)
            taps[i] = x
        logits = rmsnorm(x, w["final_norm"], c.norm_eps) @ w["lm_head"]
        return logits[:, 0], torch.cat([taps[i] for i in c.tap_layers], -1)[:, 0]

    @torch.no_grad()
    def greedy(self, prompts, new: int):
        """Greedy continuations: prompts [B, P] -> [B, P + new] (trunk argmax each step)."""
        logits, _, st = self.forward(prompts, state=True)
        seq = [prompts]
        tok = logits[:, -1].argmax(-1)
        P = prompts.shape[1]
        for j in range(new):
            seq.append(tok[:, None])
            if j + 1 < new:
                logits, _ = self.step(st, tok, P + j)
                tok = logits.argmax(-1)
        return torch.cat(seq, 1)


class TorchDrafter:
    """The drafter over whole sequences of frozen trunk taps: any number of anchors per sequence
    in one pass, each seeing exactly what the session's block_pass would (the last `window`
    committed rows' draft KV, plus the block)."""

    def __init__(self, config: DrafterConfig, trunk: TorchTrunk, w: dict[str, torch.Tensor]):
        spec = drafter_spec(config, trunk.c)
        assert set(spec) == set(w), sorted(set(spec) ^ set(w))
        self.c, self.trunk, self.w = config, trunk, w

    @classmethod
    def init(cls, config: DrafterConfig, trunk: TorchTrunk, seed: int) -> "TorchDrafter":
        return cls(config, trunk, init_weights(drafter_spec(config, trunk.c), config.layers, seed))

    def params(self):
        return list(self.w.values())

    def context_kv(self, taps):
        """taps [B, T, n_taps * d] -> per layer (K [B, T, Hkv, D] normed + RoPE at 0..T-1, V)."""
        c, w = self.c, self.w
        f = rmsnorm(taps @ w["fc"], w["fc_norm"], c.norm_eps)
        return [self._kv(f, i, torch.arange(taps.shape[1])) for i in range(c.layers)]

    def _kv(self, h, i, positions):
        c, w = self.c, self.w
        p = f"layers.{i}.attn."
        k = (h @ w[p + "wk"]).unflatten(-1, (c.kv_heads, c.head_dim))
        k = rope(rmsnorm(k, w[p + "k_norm"], c.norm_eps), positions, c.rope_theta)
        return k, (h @ w[p + "wv"]).unflatten(-1, (c.kv_heads, c.head_dim))

    def block(self, ctx, ids, pos):
        """ctx from context_kv over sequences [B, T]; ids [B, T] tokens; pos [B, A] anchor
        positions. Returns (hidden [B, A, b, d] after the trunk's final norm, logits [B, A, b, V])."""
        c, w, tw, tc = self.c, self.w, self.trunk.w, self.trunk.c
        B, A = pos.shape
        b, W = c.block, c.window
        blk = torch.full((B, A, b), tc.mask_id, dtype=torch.long)
        blk[:, :, 0] = torch.gather(ids, 1, pos)
        positions = pos[..., None] + torch.arange(b)                       # [B, A, b]
        slots = pos[..., None] - W + torch.arange(W)                       # [B, A, W]: rows pos-W..pos-1
        visible = torch.cat([slots >= 0, torch.ones(B, A, b, dtype=torch.bool)], -1)  # [B, A, W + b]
        gather = slots.clamp(min=0).reshape(B, A * W)
        x = tw["embed"][blk].reshape(B * A, b, -1)
        for i in range(c.layers):
            p = f"layers.{i}."
            h = rmsnorm(x, w[p + "norm1"], c.norm_eps)
            q = rope((h @ w[p + "attn.wq"]).unflatten(-1, (c.heads, c.head_dim)), positions.reshape(B * A, b),
                     c.rope_theta)
            k, v = self._kv(h, i, positions.reshape(B * A, b))
            K, V = ctx[i]
            idx = gather[..., None, None].expand(B, A * W, c.kv_heads, c.head_dim)
            kc = torch.gather(K, 1, idx).reshape(B * A, W, c.kv_heads, c.head_dim)
            vc = torch.gather(V, 1, idx).reshape(B * A, W, c.kv_heads, c.head_dim)
            mask = visible.reshape(B * A, 1, 1, W + b)
            o = attend(q, torch.cat([kc, k], 1), torch.cat([vc, v], 1), mask=mask)
            x = x + o @ w[p + "attn.wo"]
            x = x + swiglu_mlp(rmsnorm(x, w[p + "norm2"], c.norm_eps), w, p)
        hidden = rmsnorm(x, tw["final_norm"], tc.norm_eps)
        return hidden.reshape(B, A, b, -1), (hidden @ tw["lm_head"]).reshape(B, A, b, -1)

    def markov(self, prev):
        """(W2 . W1[prev], W1[prev]) for token ids prev [...]."""
        e = self.w["markov.w1"][prev]
        return e @ self.w["markov.w2"], e

    def confidence_logit(self, hidden, emb):
        return torch.cat([hidden, emb], -1) @ self.w["conf.w"] + self.w["conf.b"][0]

    def chain(self, hidden, logits, anchor):
        """The session's greedy proposal (propose_greedy): x_k = argmax(logits_k + markov(x_{k-1})),
        x_{-1} = anchor. hidden/logits [N, b, .], anchor [N]. Returns (drafts [N, b], confidence
        logits [N, b])."""
        prev, drafts, conf = anchor, [], []
        for kk in range(logits.shape[1]):
            bias, e = self.markov(prev)
            prev = (logits[:, kk] + bias).argmax(-1)
            drafts.append(prev)
            conf.append(self.confidence_logit(hidden[:, kk], e))
        return torch.stack(drafts, 1), torch.stack(conf, 1)
