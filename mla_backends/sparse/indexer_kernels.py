"""Triton kernels of the lightning indexer: the fused K store (RoPE, Hadamard rotation, e4m3
quantisation, page-major write) and the logits over each token's paged context (one kernel
for decode, verify and prefill: a program is one query token and BLOCK_N of its keys, all
index heads in one dot). Same maths as `indexer.prepare_k` / `logits_reference`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_backends.arith import cdiv, next_pow2
from mla_backends.kernels.common import dot_precision, interpreting
from mla_backends.kernels.store import _round_e4m3
from mla_backends.sparse.indexer import PAGE, IndexKCache

PAGE_C = tl.constexpr(PAGE)


@triton.jit
def _pow2_ceil(x):
    """Smallest power of two >= x (x > 0, normal), exactly, through the exponent bits."""
    bits = x.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    e = tl.where((bits & 0x7FFFFF) == 0, e, e + 1)
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _store_kernel(
    K,
    Cos,
    Sin,
    Loc,
    Data,
    Scale,
    n_tokens,
    stride_k,
    stride_cs,
    D: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLK_E: tl.constexpr,
    BLK_S: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    QUANT: tl.constexpr,
    LOWP_DOT: tl.constexpr,
    EXACT_FP8_ROUND: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < n_tokens
    d = tl.arange(0, D)
    in_rope = d < 2 * HALF
    first = d < HALF
    partner = tl.where(first, d + HALF, d - HALF)
    freq = tl.where(first, d, d - HALF)
    rows = K + t.to(tl.int64)[:, None] * stride_k
    x = tl.load(rows + d[None, :], mask=t_ok[:, None], other=0.0)
    act = x.dtype
    x = x.to(tl.float32)
    rope_ok = t_ok[:, None] & in_rope[None, :]
    xp = tl.load(rows + partner[None, :], mask=rope_ok, other=0.0).to(tl.float32)
    cs = t.to(tl.int64)[:, None] * stride_cs + freq[None, :]
    c = tl.load(Cos + cs, mask=rope_ok, other=1.0).to(tl.float32)
    s = tl.load(Sin + cs, mask=rope_ok, other=0.0).to(tl.float32)
    y = tl.where(first[None, :], x * c - xp * s, x * c + xp * s)
    y = tl.where(in_rope[None, :], y, x).to(act).to(tl.float32)

    slot = tl.load(Loc + t, mask=t_ok, other=0).to(tl.int64)
    blk = slot // PAGE_C
    off = slot % PAGE_C
    scale = tl.full([BLOCK_T], 1.0, tl.float32)
    if QUANT:
        # Hadamard as a dot with the +-1 Sylvester matrix: H[i, j] = (-1) ** popcount(i & j).
        bits = d[:, None] & d[None, :]
        bits = bits ^ (bits >> 8)
        bits = bits ^ (bits >> 4)
        bits = bits ^ (bits >> 2)
        bits = bits ^ (bits >> 1)
        h = tl.where((bits & 1) == 1, -1.0, 1.0)
        if LOWP_DOT:  # +-1 and the activations are exact in their dtype: exact products
            y = tl.dot(y.to(act), h.to(act), out_dtype=tl.float32)
        else:
            y = tl.dot(y, h, input_precision="ieee")
        y = (y * (1.0 / tl.sqrt(D * 1.0))).to(act).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(y), 1), 1e-4)
        scale = _pow2_ceil(tl.math.div_rn(amax, 448.0))
        y = tl.clamp(y * (1.0 / scale)[:, None], -448.0, 448.0)
        if EXACT_FP8_ROUND:
            y = _round_e4m3(y)
    dst = Data + (blk * BLK_E + off * D)[:, None] + d[None, :]
    tl.store(dst, y.to(Data.dtype.element_ty), mask=t_ok[:, None])
    tl.store(Scale + blk * BLK_S + SCALE_OFF + off, scale, mask=t_ok)


def _flat_views(
    cache: IndexKCache, layer: int
) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    """(data view, fp32 view) of one layer's whole buffer and the element offsets: block stride
    in data elements, block stride and scale offset in fp32 elements."""
    buf = cache.buffers[layer]
    consts = {
        "BLK_E": cache.block_bytes // cache.elem,
        "BLK_S": cache.block_bytes // 4,
        "SCALE_OFF": PAGE * cache.head_dim * cache.elem // 4,
    }
    return buf.view(cache.dtype), buf.view(torch.float32), consts


def store_index_k(
    cache: IndexKCache,
    layer: int,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    loc: torch.Tensor,
) -> None:
    """k [T, D] (k_norm(wk(x)), before RoPE), cos / sin [T, R / 2], loc [T] slots."""
    t, d = k.shape
    if t == 0:
        return
    k = k.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    data, scale, consts = _flat_views(cache, layer)
    lowp = k.dtype in (torch.bfloat16, torch.float16) and not interpreting()
    block_t = 16
    _store_kernel[(cdiv(t, block_t),)](
        k,
        cos,
        sin,
        loc,
        data,
        scale,
        t,
        k.stride(0),
        cos.stride(0),
        D=d,
        HALF=cos.shape[1],
        BLOCK_T=block_t,
        QUANT=cache.quantized,
        LOWP_DOT=lowp,
        EXACT_FP8_ROUND=cache.quantized and interpreting(),
        num_warps=4,
        **consts,
    )


@triton.jit
def _logits_kernel(
    Q,
    W,
    Data,
    Scale,
    R2T,
    Rows,
    Vis,
    Out,
    width,
    stride_q_t,
    stride_q_h,
    stride_w,
    stride_r2t,
    stride_o,
    HI: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLK_E: tl.constexpr,
    BLK_S: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_BF16: tl.constexpr,
    PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    vis = tl.load(Vis + t)
    out = Out + t * stride_o + n
    if tl.program_id(1) * BLOCK_N >= vis:
        tl.store(out, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=n < width)
        return
    n_ok = n < vis
    row = tl.load(Rows + t)
    # Masked: keys past the context are never read (stale or NaN-poisoned rows stay out).
    slot = tl.load(R2T + row * stride_r2t + n, mask=n_ok, other=0).to(tl.int64)
    blk = slot // PAGE_C
    off = slot % PAGE_C
    d = tl.arange(0, D)
    k = tl.load(Data + (blk * BLK_E + off * D)[:, None] + d[None, :], mask=n_ok[:, None], other=0.0)
    ks = tl.load(Scale + blk * BLK_S + SCALE_OFF + off, mask=n_ok, other=0.0)
    h = tl.arange(0, BLOCK_H)
    h_ok = h < HI
    q = tl.load(
        Q + t * stride_q_t + h[:, None] * stride_q_h + d[None, :], mask=h_ok[:, None], other=0.0
    )
    w = tl.load(W + t * stride_w + h, mask=h_ok, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    if DOT_BF16:
        # Hazard: Hopper's FP8 MMA accumulates with fewer mantissa bits than fp32 (5.6e-4
        # absolute on logits of 3.3 seen on an H100). e4m3 codes are exact in bf16, whose MMA
        # accumulates in fp32: the logits are then the fp32 maths up to summation order.
        q = q.to(tl.bfloat16)
        k = k.to(tl.bfloat16)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_H, BLOCK_N]
    logit = tl.sum(tl.maximum(s, 0.0) * w[:, None], 0) * ks
    tl.store(out, tl.where(n_ok, logit, float("-inf")), mask=n < width)


def index_logits(
    cache: IndexKCache,
    layer: int,
    q: torch.Tensor,
    w: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    visible: torch.Tensor,
    width: int,
    block_n: int | None = None,
) -> torch.Tensor:
    """q [T, Hi, D] (e4m3 codes, or fp32 unquantised), w [T, Hi] fp32, rows [T], visible [T]
    -> logits [T, width] fp32, -inf at keys >= visible."""
    t, hi, d = q.shape
    out = torch.empty(t, width, dtype=torch.float32, device=q.device)
    if t == 0 or width == 0:
        return out
    interp = interpreting()
    if block_n is None:
        block_n = 16 if interp else 64
    data, scale, consts = _flat_views(cache, layer)
    q = q if q.stride(-1) == 1 else q.contiguous()
    _logits_kernel[(t, cdiv(width, block_n))](
        q,
        w,
        data,
        scale,
        req_to_token,
        rows,
        visible,
        out,
        width,
        q.stride(0),
        q.stride(1),
        w.stride(0),
        req_to_token.stride(0),
        out.stride(0),
        HI=hi,
        D=d,
        BLOCK_H=max(16, next_pow2(hi)),
        BLOCK_N=block_n,
        DOT_F32=interp,
        DOT_BF16=not interp and q.dtype == torch.float8_e4m3fn,
        PRECISION=dot_precision(q.dtype),
        num_warps=4,
        **consts,
    )
    return out
