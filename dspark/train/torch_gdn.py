"""The gdn mixer's recurrence in torch: one step (decode), and a chunked form for training.

Math (dspark/ops/gdn.py, gdn_scan_ref), per head with state S [dv, dk]:

    S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,    o_t = S_t q_t

`step` is that line for one token. `chunked` is the same recurrence in the WY form of the
Gated DeltaNet paper (Yang et al. 2024): within a chunk of L tokens the updates compose into one
lower-triangular solve, and across chunks the state carries as above. It differs from the step
loop only by rounding (tests/train/test_torch_mirror.py checks the two in float64), and it is
what makes training on a 2-core CPU possible: the step loop is T tiny ops per layer per batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NORM_EPS = 1e-6
CHUNK = 64


def gates(a, b, A_log, dt_bias):
    """(log alpha, beta): log alpha = -exp(A_log) * softplus(a + dt_bias) (softplus linear past 20,
    as the reference), beta = sigmoid(b)."""
    return -torch.exp(A_log) * F.softplus(a + dt_bias, threshold=20.0), torch.sigmoid(b)


def conv_silu(mixed, weight, window=None):
    """Causal depthwise conv of width 4 over time, then SiLU. mixed [B, T, C], weight [C, 4],
    window [B, C, 3] (the 3 previous inputs, oldest first; zeros at the sequence start).
    Returns (activations [B, T, C], the new window [B, C, 3])."""
    B, T, C = mixed.shape
    if window is None:
        window = mixed.new_zeros(B, C, 3)
    xs = torch.cat([window, mixed.transpose(1, 2)], dim=2)        # [B, C, T + 3]
    y = F.conv1d(xs, weight[:, None, :], groups=C)                # y_t = w0 x_{t-3} + .. + w3 x_t
    return F.silu(y.transpose(1, 2)), xs[:, :, -3:]


def qkv_heads(x, heads: int, dk: int, dv: int):
    """Split conv outputs [..., C] = [q | k | v] into heads; L2-normalise q and k, scale q."""
    hk = heads * dk
    q = x[..., :hk].unflatten(-1, (heads, dk))
    k = x[..., hk : 2 * hk].unflatten(-1, (heads, dk))
    v = x[..., 2 * hk :].unflatten(-1, (heads, dv))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + NORM_EPS) * dk ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + NORM_EPS)
    return q, k, v


def step(S, q, k, v, log_alpha, beta):
    """One token. S [B, H, dv, dk]; q, k [B, H, dk]; v [B, H, dv]; log_alpha, beta [B, H].
    Same order as the kernel: S <- alpha S; u = S k; S <- S + beta (v - u) k^T; o = S q."""
    S = S * torch.exp(log_alpha)[..., None, None]
    u = (S @ k[..., None])[..., 0]
    S = S + (beta[..., None] * (v - u))[..., None] * k[..., None, :]
    return S, (S @ q[..., None])[..., 0]


def sequential(q, k, v, log_alpha, beta, S=None):
    """The step loop over time: q, k [B, T, H, dk], v [B, T, H, dv], gates [B, T, H].
    Returns (o [B, T, H, dv], S)."""
    B, T, H, dk = q.shape
    if S is None:
        S = q.new_zeros(B, H, v.shape[-1], dk)
    out = []
    for t in range(T):
        S, o = step(S, q[:, t], k[:, t], v[:, t], log_alpha[:, t], beta[:, t])
        out.append(o)
    return torch.stack(out, 1), S


def chunked(q, k, v, log_alpha, beta, S=None, chunk: int = CHUNK):
    """The same recurrence in chunks (WY form). Shapes as `sequential`."""
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    L = chunk
    pad = (-T) % L
    if pad:  # padded tokens: alpha = 1, beta = 0, k = q = 0 leave S and the real outputs alone
        q, k, v = (F.pad(z, (0, 0, 0, 0, 0, pad)) for z in (q, k, v))
        log_alpha, beta = (F.pad(z, (0, 0, 0, pad)) for z in (log_alpha, beta))
    N = (T + pad) // L
    # [B, H, N, L, .]
    q, k, v = (z.reshape(B, N, L, H, -1).permute(0, 3, 1, 2, 4) for z in (q, k, v))
    g = log_alpha.reshape(B, N, L, H).permute(0, 3, 1, 2).cumsum(-1)   # log of prod_{s<=t} alpha_s
    beta = beta.reshape(B, N, L, H).permute(0, 3, 1, 2)
    kb = k * beta[..., None]
    decay = torch.exp((g[..., :, None] - g[..., None, :]).tril())        # exp(g_i - g_j), i >= j
    strict = torch.ones(L, L, dtype=torch.bool, device=q.device).tril(-1)
    lower = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    A = torch.where(strict, (kb @ k.transpose(-1, -2)) * decay, 0.0)
    eye = torch.eye(L, dtype=q.dtype, device=q.device)
    Tinv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False)  # (I + A)^-1
    u = Tinv @ (v * beta[..., None])                                       # [B, H, N, L, dv]
    w = Tinv @ (kb * torch.exp(g)[..., None])                              # [B, H, N, L, dk]
    qk = torch.where(lower, (q @ k.transpose(-1, -2)) * decay, 0.0)
    if S is None:
        S = q.new_zeros(B, H, dv, dk)
    outs = []
    for n in range(N):
        gn = g[:, :, n]
        v_new = u[:, :, n] - w[:, :, n] @ S.transpose(-1, -2)             # [B, H, L, dv]
        o = (q[:, :, n] * torch.exp(gn)[..., None]) @ S.transpose(-1, -2) + qk[:, :, n] @ v_new
        outs.append(o)
        kd = k[:, :, n] * torch.exp(gn[..., -1:] - gn)[..., None]
        S = S * torch.exp(gn[..., -1])[..., None, None] + v_new.transpose(-1, -2) @ kd
    o = torch.stack(outs, 2).permute(0, 2, 3, 1, 4).reshape(B, N * L, H, dv)
    return o[:, :T], S
