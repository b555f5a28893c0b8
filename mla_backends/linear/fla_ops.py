"""The fla kernels behind the linear backend on GPU (flash-linear-attention 0.6.0).

- prefill: `chunk_kda` / `chunk_gated_delta_rule`, varlen (`cu_seqlens`), from the requests'
  gathered states, final states returned for the caller to scatter back;
- decode (KDA): `fused_recurrent_kda_fwd` with `ssm_state_indices`, reading and writing each
  request's state slot in place (no gather / scatter copies, graph-capturable). GDN decode
  runs our own kernel (`kernels/gdn_decode.py`): fla's GDN recurrent kernel takes no state
  indices, and going through the KDA kernel needs the decay broadcast over K first.

Hazard: fla's kernels take q, k, v in one dtype; the caller's fp32 q / k (after L2 norm) are
cast to v's dtype here, and outputs come back in v's dtype (no extra cast kernel: at small
batch a decode step is a few microseconds).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from mla_backends.backends.kernel_packages import require


@cache
def _fn(module: str, name: str) -> Any:
    """fla entry points, imported once (a per-call import costs host time at decode)."""
    return getattr(require(module), name)


def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens of N requests back to back: q, k [T, H, K], v [T, H, V], g [T, H] or [T, H, K],
    beta [T, H], states [N, H, K, V] fp32, cu_seqlens [N + 1] int64 (device)
    -> (o [T, H, V] in v's dtype, final states [N, H, K, V] fp32)."""
    dt = v.dtype
    if g.dim() == 3:
        fn = _fn("fla.ops.kda", "chunk_kda")
    else:
        fn = _fn("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
    o, final = fn(
        q.to(dt)[None],
        k.to(dt)[None],
        v[None],
        g.float()[None],
        beta.to(dt)[None],
        scale=scale,
        initial_state=states.contiguous(),
        output_final_state=True,
        cu_seqlens=cu_seqlens,
    )
    return o[0], final


def decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    layer_states: torch.Tensor,
    rows: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """KDA, one token per request: q, k [B, H, K], v [B, H, V], g [B, H, K], beta [B, H];
    layer_states [slots, H, K, V] fp32 (one layer of the pool) updated in place at `rows`
    [B] -> o [B, H, V] in v's dtype. Padded rows (row 0) all write the dummy slot."""
    fwd = _fn("fla.ops.kda.fused_recurrent", "fused_recurrent_kda_fwd")
    dt = v.dtype
    o, _ = fwd(
        q=q.to(dt)[:, None].contiguous(),
        k=k.to(dt)[:, None].contiguous(),
        v=v[:, None].contiguous(),
        g=g.float()[:, None].contiguous(),
        beta=beta.to(dt)[:, None].contiguous(),
        initial_state=layer_states,
        scale=q.shape[-1] ** -0.5 if scale is None else scale,
        inplace_final_state=True,
        ssm_state_indices=rows,
    )
    return o[:, 0]
