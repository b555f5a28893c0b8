"""Gated DeltaNet decode step in Triton: one token per request, each request's fp32 state
slot [H, K, V] read and written in place (graph-safe, no gather / scatter), per-head decay.

fla 0.6.0's GDN recurrent kernel has no state-index input, and its KDA kernel (which has one)
needs the decay broadcast to [B, H, K] first: one extra kernel that cost 18 % of a batch-1
step under graphs (BENCHMARKS.md). Same maths as `linear/recurrence.py`:

    S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = scale S^T q
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gdn_decode_kernel(
    Q,
    K,
    V,
    G,
    Beta,
    State,
    Rows,
    Out,
    scale,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
):
    """Program (value block, b * H + h); q, k, v, out [B, H, *], g, beta [B, H] contiguous."""
    vb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    row = tl.load(Rows + b).to(tl.int64)
    offs_k = tl.arange(0, DK)
    offs_v = vb * BV + tl.arange(0, BV)
    q = tl.load(Q + bh * DK + offs_k).to(tl.float32)
    k = tl.load(K + bh * DK + offs_k).to(tl.float32)
    v = tl.load(V + bh * DV + offs_v).to(tl.float32)
    decay = tl.exp(tl.load(G + bh).to(tl.float32))
    beta = tl.load(Beta + bh).to(tl.float32)
    s_ptr = State + ((row * H + h) * DK + offs_k[:, None]) * DV + offs_v[None, :]
    s = tl.load(s_ptr) * decay
    err = v - tl.sum(s * k[:, None], 0)
    s = s + k[:, None] * (beta * err)[None, :]
    tl.store(s_ptr, s)
    o = tl.sum(s * q[:, None], 0) * scale
    tl.store(Out + bh * DV + offs_v, o.to(Out.dtype.element_ty))


def gdn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    layer_states: torch.Tensor,
    rows: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """q, k [B, H, K], v [B, H, V], g, beta [B, H]; layer_states [slots, H, K, V] fp32,
    updated in place at `rows` [B] -> o [B, H, V] in v's dtype. K and V powers of two.
    Hazard: rows must be distinct except the padding dummy (row 0), whose slot takes
    whatever the padded rows write."""
    b, h, dk = q.shape
    dv = v.shape[-1]
    if layer_states.dtype != torch.float32 or not layer_states.is_contiguous():
        raise ValueError("gdn_decode: layer_states must be contiguous fp32 [slots, H, K, V]")
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    out = torch.empty(b, h, dv, dtype=v.dtype, device=v.device)
    if b == 0:
        return out
    bv = min(dv, 8 if b * h <= 256 else 32)  # small batches: more programs in flight
    _gdn_decode_kernel[(triton.cdiv(dv, bv), b * h)](
        q,
        k,
        v,
        g,
        beta,
        layer_states,
        rows,
        out,
        dk**-0.5 if scale is None else scale,
        H=h,
        DK=dk,
        DV=dv,
        BV=bv,
        num_warps=4,
    )
    return out
