"""The sparse contract for rows with no valid index (out 0, lse -inf) in one launch: a program
per query token reads its index row and, only if every entry is < 0, zeroes its output rows
and sets its LSE to -inf. Batches without such rows read the indices and write nothing, where
the torch form (`sparse.reference.mask_empty`) is four kernels that rewrite the whole output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_backends.arith import next_pow2


@triton.jit
def _empty_rows_kernel(
    Idx,
    Out,
    Lse,
    stride_i,
    stride_o,
    stride_l,
    K: tl.constexpr,
    N: tl.constexpr,
    H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_LSE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    idx = tl.load(Idx + t * stride_i + k, mask=k < K, other=-1)
    if tl.max(idx, 0) < 0:
        n = tl.arange(0, BLOCK_N)
        zero = tl.zeros([BLOCK_N], Out.dtype.element_ty)
        for start in range(0, N, BLOCK_N):  # out row t: H heads x L values, contiguous
            tl.store(Out + t * stride_o + start + n, zero, mask=start + n < N)
        if HAS_LSE:
            h = tl.arange(0, BLOCK_H)
            tl.store(Lse + t * stride_l + h, tl.full([BLOCK_H], float("-inf"), tl.float32), h < H)


def fix_empty_rows(out: torch.Tensor, lse: torch.Tensor | None, indices: torch.Tensor) -> None:
    """In place: out [T, H, L] (each token's rows contiguous), lse [T, H] fp32 (heads
    contiguous) or None, indices [T, K] int32 (< 0 unused)."""
    t, h, lat = out.shape
    if t == 0:
        return
    if out.stride(2) != 1 or out.stride(1) != lat or (lse is not None and lse.stride(1) != 1):
        raise ValueError("fix_empty_rows: out needs contiguous [H, L] rows, lse contiguous heads")
    k = indices.shape[1]
    _empty_rows_kernel[(t,)](
        indices,
        out,
        out if lse is None else lse,
        indices.stride(0),
        out.stride(0),
        0 if lse is None else lse.stride(0),
        K=k,
        N=h * lat,
        H=h,
        BLOCK_K=next_pow2(k),
        BLOCK_N=min(4096, next_pow2(h * lat)),
        BLOCK_H=next_pow2(h),
        HAS_LSE=lse is not None,
        num_warps=4,
    )
