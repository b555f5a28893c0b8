"""The gated delta rule in plain PyTorch (fp32): the reference and the CPU path.

Per head, with state S [K, V], per token t (g in log space, beta in (0, 1)):

    S   = decay_t * S                    GDN: decay_t = exp(g_t) (a scalar per head)
                                         KDA: decay_t = diag(exp(g_t)) (one per key channel)
    S   = S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = scale * S^T q_t

as in fla's naive recurrences (the state is decayed before the delta read). Index names:
t tokens, h heads, k key dim, v value dim.
"""

from __future__ import annotations

import torch


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: q, k [T, H, K], v [T, H, V], g [T, H] (GDN) or [T, H, K] (KDA),
    beta [T, H], state [H, K, V] -> (o [T, H, V] fp32, final state [H, K, V] fp32)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = state.float().clone()
    q, k, v, beta = q.float(), k.float(), v.float(), beta.float()
    decay = g.float().exp()
    out = torch.empty(*v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[0]):
        d = decay[t]
        s = s * (d[:, None, None] if d.dim() == 1 else d[:, :, None])
        err = v[t] - torch.einsum("hkv,hk->hv", s, k[t])
        s = s + torch.einsum("hk,hv->hkv", k[t], beta[t][:, None] * err)
        out[t] = scale * torch.einsum("hkv,hk->hv", s, q[t])
    return out, s
