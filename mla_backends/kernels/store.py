"""Fused latent-row store: concat(k_nope, k_rope) -> pool rows, quantized under the layer scale."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from mla_backends.arith import cdiv, next_pow2
from mla_backends.checks import unit_stride
from mla_backends.kernels.common import interpreting

if TYPE_CHECKING:
    from mla_backends.sparse.fp8_row import Fp8RowFormat


@triton.jit
def _pow2_ceil(x):
    """Smallest power of two >= x (x > 0, normal), exactly, through the exponent bits (the
    ue8m0 scale rule, `sparse.quant.ue8m0_scale`, in a kernel)."""
    bits = x.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    e = tl.where((bits & 0x7FFFFF) == 0, e, e + 1)
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _finite_abs(x):
    """|x| where finite, else 0: a tile's scale comes from its finite values (`quant.
    block_quant`'s rule). Hazard: an inf in the amax made the tile's scale inf (its finite
    values then read back NaN) where the torch form's was 1.0."""
    a = tl.abs(x)
    return tl.where(a < float("inf"), a, 0.0)  # NaN fails the test too


@triton.jit
def _round_e4m3(x):
    """Round fp32 to the nearest float8_e4m3fn value (ties to even), staying in fp32.
    Only used under the Triton interpreter, whose own fp8 cast mis-rounds (124.0 -> 64.0);
    GPUs convert with cvt.rn (the same rounding), so the cast that follows is then exact."""
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)  # subnormals share the smallest normal's step
    step = tl.exp2((e - 3).to(tl.float32))
    y = x / step
    f = tl.floor(y)
    d = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    r = tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, tl.where(odd, f + 1.0, f)))
    return r * step


@triton.jit
def _slot_or_dummy(slot, num_slots):
    """The pool's rule for a slot outside [0, num_slots) (vLLM's -1 padding among them): the
    dummy slot 0, never another request's row (`pool.slots_or_dummy`, its torch form)."""
    return tl.where((slot >= 0) & (slot < num_slots), slot, 0)


@triton.jit
def _store_kernel(
    KNope,
    KRope,
    Loc,
    Buf,
    Scale,
    num_slots,
    stride_kn,
    stride_kr,
    stride_buf,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    IS_FP8: tl.constexpr,
    EXACT_FP8_ROUND: tl.constexpr,
):
    t = tl.program_id(0)
    slot = _slot_or_dummy(tl.load(Loc + t).to(tl.int64), num_slots)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    kn = tl.load(KNope + t * stride_kn + offs_l, mask=offs_l < L).to(tl.float32)
    kr = tl.load(KRope + t * stride_kr + offs_r, mask=offs_r < R).to(tl.float32)
    if IS_FP8:
        inv = 1.0 / tl.load(Scale)
        # e4m3fn has no inf: out-of-range values would become NaN, so saturate first. A NaN
        # stays NaN, as `pool.quantize` keeps it (clamp's default does not promise that: the
        # Triton interpreter turned it into -448; the H200 kept it).
        kn = tl.clamp(kn * inv, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
        kr = tl.clamp(kr * inv, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
        if EXACT_FP8_ROUND:
            kn = _round_e4m3(kn)
            kr = _round_e4m3(kr)
    dst = Buf + slot * stride_buf
    tl.store(dst + offs_l, kn.to(Buf.dtype.element_ty), mask=offs_l < L)
    tl.store(dst + L + offs_r, kr.to(Buf.dtype.element_ty), mask=offs_r < R)


def store_latent_rows(
    buf: torch.Tensor,
    scale: torch.Tensor,
    loc: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    is_fp8: bool,
) -> None:
    """buf [slots, L + R]; scale [] fp32 (device); loc [T] (slots outside the pool write the
    dummy slot 0); k_nope [T, L]; k_rope [T, R]."""
    t, lat = k_nope.shape
    r = k_rope.shape[1]
    if t == 0:
        return
    k_nope, k_rope = unit_stride(k_nope), unit_stride(k_rope)
    # Hazard: the kernel reads loc[t] at Loc + t; a strided view (a column of a table) stored
    # every row at the wrong slot, silently. A copy only when strided (device work).
    loc = loc.contiguous()
    _store_kernel[(t,)](
        k_nope,
        k_rope,
        loc,
        buf,
        scale,
        buf.shape[0],
        k_nope.stride(0),
        k_rope.stride(0),
        buf.stride(0),
        L=lat,
        R=r,
        BLOCK_L=next_pow2(lat),
        BLOCK_R=next_pow2(max(r, 1)),
        IS_FP8=is_fp8,
        EXACT_FP8_ROUND=is_fp8 and interpreting(),
    )


@triton.jit
def _safe_slots_kernel(Loc, Out, n, num_slots, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(Loc + i, mask=i < n, other=0).to(tl.int64)
    tl.store(Out + i, _slot_or_dummy(slot, num_slots), mask=i < n)


def safe_slots(loc: torch.Tensor, num_slots: int) -> torch.Tensor:
    """int64 [T]: `loc` with every slot outside [0, num_slots) sent to the dummy slot 0, in
    one launch (the torch form, `pool.slots_or_dummy`, is five small kernels: ~6 us a layer
    of a CUDA-graph decode step on an H100, twenty-fourth session)."""
    out = torch.empty(loc.shape[0], dtype=torch.int64, device=loc.device)
    if loc.shape[0]:
        block = 1024
        loc = loc.contiguous()  # the kernel reads Loc + i (see `store_latent_rows`)
        _safe_slots_kernel[(cdiv(loc.shape[0], block),)](loc, out, loc.shape[0], num_slots, block)
    return out


@triton.jit
def _fp8_row_store_kernel(
    KNope,
    KRope,
    Loc,
    Codes,
    Scales,
    Rope,
    num_slots,
    stride_kn,
    stride_kr,
    L: tl.constexpr,
    R: tl.constexpr,
    TILE: tl.constexpr,
    ROW_E8: tl.constexpr,
    ROW_S: tl.constexpr,
    S_OFF: tl.constexpr,
    ROW_B: tl.constexpr,
    R_OFF: tl.constexpr,
    EXACT_FP8_ROUND: tl.constexpr,
):
    """One token's FP8 row (`sparse.fp8_row`): per 128-wide tile the ue8m0 scale (the
    smallest power of two >= max(amax, 1e-4) / 448, from the fp32 bits: `quant.ue8m0_scale`),
    the e4m3 codes of x / scale (exact division), then the rope in bf16; Codes / Scales / Rope
    are the same rows viewed as e4m3 / fp32 / bf16."""
    t = tl.program_id(0)
    slot = _slot_or_dummy(tl.load(Loc + t).to(tl.int64), num_slots)
    tiles = tl.arange(0, L // TILE)
    x = tl.load(KNope + t * stride_kn + tiles[:, None] * TILE + tl.arange(0, TILE)[None, :])
    x = x.to(tl.float32)
    scale = _pow2_ceil(tl.maximum(tl.max(_finite_abs(x), 1), 1e-4) / 448.0)  # >= 2.2e-7
    q = tl.clamp(x / scale[:, None], -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    if EXACT_FP8_ROUND:
        q = _round_e4m3(q)
    row = slot * ROW_E8
    cols = tiles[:, None] * TILE + tl.arange(0, TILE)[None, :]
    tl.store(Codes + row + cols, q.to(Codes.dtype.element_ty))
    tl.store(Scales + slot * ROW_S + S_OFF + tiles, scale)
    offs_r = tl.arange(0, R)
    rope = tl.load(KRope + t * stride_kr + offs_r).to(tl.float32)
    tl.store(Rope + slot * ROW_B + R_OFF + offs_r, rope.to(Rope.dtype.element_ty))


def store_fp8_rows(
    buf: torch.Tensor,
    loc: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
    fmt: Fp8RowFormat,
) -> None:
    """buf [slots, fmt.row_bytes] uint8; loc [T] (slots outside the pool write the dummy slot
    0); k_nope [T, L]; k_rope [T, R]: `sparse.fp8_row.pack_rows` and the scatter in one launch,
    the same bytes."""
    t = k_nope.shape[0]
    if t == 0:
        return
    k_nope, k_rope = unit_stride(k_nope), unit_stride(k_rope)
    loc = loc.contiguous()  # the kernel reads Loc + t (see `store_latent_rows`)
    rb = fmt.row_bytes
    _fp8_row_store_kernel[(t,)](
        k_nope,
        k_rope,
        loc,
        buf.view(torch.float8_e4m3fn),
        buf.view(torch.float32),
        buf.view(torch.bfloat16),
        buf.shape[0],
        k_nope.stride(0),
        k_rope.stride(0),
        L=fmt.kv_lora_rank,
        R=fmt.rope_dim,
        TILE=128,
        ROW_E8=rb,
        ROW_S=rb // 4,
        S_OFF=fmt.scale_offset // 4,
        ROW_B=rb // 2,
        R_OFF=fmt.rope_offset // 2,
        EXACT_FP8_ROUND=interpreting(),
        num_warps=4,
    )
