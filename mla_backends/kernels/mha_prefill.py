"""MHA-mode prefill in Triton: ragged q / kv, qk head dim P + R (192), v head dim V (128),
bottom-right causal or full, natural-log LSE for chunk merges."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_backends.arith import cdiv, next_pow2
from mla_backends.kernels.mla_attention import _attend_tile

LOG2E = 1.4426950408889634


@triton.jit
def _mha_fwd_kernel(
    Q,
    K,
    V,
    QoIndptr,
    KvIndptr,
    Out,
    Lse,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    qk_scale_log2,
    DQK: tl.constexpr,
    D1: tl.constexpr,
    D2: tl.constexpr,
    DV: tl.constexpr,
    DV_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    mblk = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(QoIndptr + b)
    q_len = tl.load(QoIndptr + b + 1) - q_start
    if mblk * BLOCK_M >= q_len:
        return
    k_start = tl.load(KvIndptr + b)
    kv_len = tl.load(KvIndptr + b + 1) - k_start

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < q_len
    # The qk dim (192) is not a power of two: split it into D1 (128) + D2 (64, padded) so no
    # work is spent on padding.
    offs_d = tl.arange(0, D1)
    offs_e = D1 + tl.arange(0, D2)
    offs_v = tl.arange(0, DV_PAD)
    q_rows = Q + (q_start + offs_m).to(tl.int64)[:, None] * stride_qt + h * stride_qh
    q = tl.load(q_rows + offs_d[None, :], mask=m_ok[:, None], other=0.0)
    q2 = tl.load(q_rows + offs_e[None, :], mask=m_ok[:, None] & (offs_e[None, :] < DQK), other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
        q2 = q2.to(tl.float32)
    if CAUSAL:
        visible = tl.minimum(tl.maximum(kv_len - q_len + offs_m + 1, 0), kv_len)
        hi = tl.maximum(tl.minimum(kv_len - q_len + mblk * BLOCK_M + BLOCK_M, kv_len), 0)
        # keys every row of the block sees, whole tiles only
        full = tl.maximum(kv_len - q_len + mblk * BLOCK_M + 1, 0) // BLOCK_N * BLOCK_N
        full = tl.minimum(full, hi // BLOCK_N * BLOCK_N)
    else:
        visible = tl.zeros([BLOCK_M], tl.int32) + kv_len
        hi = kv_len
        full = kv_len // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
    # Whole tiles every row of the block sees first (the interior of the causal triangle: no
    # per-element mask, no bounds checks), then the rest, masked.
    for masked in tl.static_range(2):
        lo = full if masked else 0
        end = hi if masked else full
        for start in range(lo, end, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            kv_rows = (k_start + n).to(tl.int64)
            k_rows = K + kv_rows[:, None] * stride_kt + h * stride_kh
            v_rows = V + kv_rows[:, None] * stride_vt + h * stride_vh
            if masked:
                n_ok = n < end
                k = tl.load(k_rows + offs_d[None, :], mask=n_ok[:, None], other=0.0)
                k2 = tl.load(
                    k_rows + offs_e[None, :],
                    mask=n_ok[:, None] & (offs_e[None, :] < DQK),
                    other=0.0,
                )
                v = tl.load(
                    v_rows + offs_v[None, :],
                    mask=n_ok[:, None] & (offs_v[None, :] < DV),
                    other=0.0,
                )
            else:
                k = tl.load(k_rows + offs_d[None, :])
                k2 = tl.load(k_rows + offs_e[None, :], mask=offs_e[None, :] < DQK, other=0.0)
                v = tl.load(v_rows + offs_v[None, :], mask=offs_v[None, :] < DV, other=0.0)
            k, k2, v = k.to(q.dtype), k2.to(q.dtype), v.to(q.dtype)
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, q2, k, k2, v, n, visible, qk_scale_log2, masked == 1, PRECISION
            )

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    rows = (q_start + offs_m).to(tl.int64)
    tl.store(
        Out + rows[:, None] * stride_ot + h * stride_oh + offs_v[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_ok[:, None] & (offs_v[None, :] < DV),
    )
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    tl.store(Lse + rows * tl.num_programs(2) + h, lse, mask=m_ok)


def mha_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    max_q_len: int,
    sm_scale: float,
    causal: bool,
    out: torch.Tensor,
    lse: torch.Tensor,
    block_m: int = 128,
    block_n: int = 64,
    num_warps: int = 8,
    num_stages: int = 2,
    dot_f32: bool = False,
) -> None:
    """q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, V] -> out [Tq, H, V], lse [Tq, H] (contiguous)."""
    b = qo_indptr.numel() - 1
    h, dqk = q.shape[1], q.shape[2]
    dv = v.shape[2]
    if b == 0 or q.shape[0] == 0:
        return
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    d1 = next_pow2(dqk) // 2 if dqk & (dqk - 1) else dqk  # largest pow2 <= dqk
    grid = (b, cdiv(max_q_len, block_m), h)
    _mha_fwd_kernel[grid](
        q,
        k,
        v,
        qo_indptr,
        kv_indptr,
        out,
        lse,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        sm_scale * LOG2E,
        DQK=dqk,
        D1=d1,
        D2=max(next_pow2(dqk - d1), 16),
        DV=dv,
        DV_PAD=next_pow2(dv),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        CAUSAL=causal,
        DOT_F32=dot_f32,
        PRECISION=precision,
        num_warps=num_warps,
        num_stages=num_stages,
    )
