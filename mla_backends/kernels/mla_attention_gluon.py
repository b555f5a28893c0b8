"""Absorbed MLA attention for 64-row query blocks on Hopper, in Gluon (bf16 / fp16 latent).

Why a second kernel: with `tl.dot`, Triton lays a dot whose result feeds another dot out as
`warpsPerCTA = [8, 1]` ("chained dot", the flash-attention heuristic). At 64 query rows and
8 warps that gives each warpgroup the whole `[64, BLOCK_N]` score tile, so both compute it:
2.36 M of each warpgroup's 3.41 M MACs per tile are the 576-deep score GEMM done twice.
Gluon lets us write the layouts: the score tile is split over keys (`[4, 2]`), the output
over its 512 columns (`[4, 2]`), and P goes through shared memory to both warpgroups.

Same contract as `mla_attention._mla_attn_kernel` (grid, row mapping, causality, split
partials, `_merge_kernel`). Whole tiles inside one page come in through TMA into a ring of
`STAGES` buffers; P @ V of tile j and the scores of tile j + 1 go to the tensor cores back
to back (async wgmma). The partial tail tile is a masked register load stored into a free
buffer, so rows past `seq_len` (stale, NaN poison) never reach P @ V. GPU only (SM90):
there is no interpreter for Gluon; `scripts/compile_gluon_sm90.py` compiles it offline.
Measured: BENCHMARKS.md, "Triton backend with a Gluon kernel".
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mla_backends.kernels.common import interpreting
from mla_backends.kernels.gluon_tiles import (
    ROWS_8W,
    _barrier,
    _bounds,
    _normalise,
    _open_ring,
    _pairs,
    _stage_q,
    _store_rows,
    _tail_tile,
    _visible,
    _whole_tiles,
    split_layout,
)
from mla_backends.kernels.mla_attention import decode_args

# One shape: 64 query rows over two warpgroups, 64-key tiles, two TMA stages. Shared memory:
# Q 72 KB + 2 x 72 KB of K + 8 KB of P = 224 KB of the 227 KB an H100 / H200 block can have.
BLOCK_M, BLOCK_N, STAGES = 64, 64, 2
# Hazard: left to itself ptxas gives this kernel 250-255 registers (the tail tile's code
# sets the peak) and schedules the tile loop worse with them. Capped at 224 (no spills at
# bf16 or fp16, offline SM90) single-token decode ran 2-10 % faster at H128 on the H100, as
# fast as the kernel without its tail code; 208 gave part of it back, and q_len 2 grids ran
# 0.5-2 % slower capped, so they keep ptxas's count (BENCHMARKS.md, twelfth session).
MAXNREG = 224
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@functools.cache
def _sm(device_index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def gluon_ok(q_dtype: torch.dtype, kv: torch.Tensor, page_size: int, lat: int) -> bool:
    """SM90 exactly (wgmma), bf16 / fp16 latent read by queries of the same dtype, whole
    64-key tiles inside one page, TMA-aligned rows, the 576 = 512 + 64 latent layout."""
    return (
        kv.is_cuda
        and not interpreting()
        and _sm(kv.device.index) == (9, 0)
        and kv.dtype in _GL_DTYPES
        and q_dtype == kv.dtype
        and page_size % BLOCK_N == 0
        and kv.stride(1) == 1
        and (kv.stride(0) * kv.element_size()) % 16 == 0
        and kv.data_ptr() % 16 == 0
        and lat == 512
        and kv.shape[1] == 576
    )


@gluon.jit
def _mla_attn_gluon_kernel(
    Q,
    Pool,
    KDesc,
    KRDesc,
    Batch,
    Dest,
    qk_scale_log2,
    H: gl.constexpr,
    L: gl.constexpr,
    R: gl.constexpr,
    PAGE: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    STAGES: gl.constexpr,
):
    """The leading arguments `mla_attention.decode_args` builds."""
    gl.static_assert(gl.num_warps() == 8, "two warpgroups: launch with num_warps=8")
    S_L: gl.constexpr = split_layout(BLOCK_N)
    O_L: gl.constexpr = split_layout(L)
    LD_L: gl.constexpr = ROWS_8W
    dtype: gl.constexpr = KDesc.dtype

    mblk = gl.program_id(0)
    b = gl.program_id(1)
    split = gl.program_id(2)
    q_start, q_len, seq, lo, hi = _bounds(
        Batch, b, mblk, split, H, BLOCK_M, BLOCK_N, NUM_SPLITS, False
    )
    if mblk * BLOCK_M >= q_len * H:
        return
    n_full = gl.maximum(hi - lo, 0) // BLOCK_N
    ring = _open_ring(KDesc, KRDesc, Batch, b, lo, n_full, L, R, PAGE, BLOCK_N, STAGES)

    q_smem, qr_smem = _stage_q(Q, q_start, q_len, mblk, dtype, LD_L, H, L, R, BLOCK_M)
    p_smem = gl.allocate_shared_memory(
        dtype, [BLOCK_M, BLOCK_N], gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    )
    fence_async_shared()
    _barrier()

    rows_s = mblk * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_L))
    visible = _visible(rows_s, seq, q_len, H)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, S_L))
    l_i = _pairs(gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_L), BLOCK_N)[0]
    acc = gl.zeros([BLOCK_M, L], gl.float32, O_L)
    acc, m_i, l_i = _whole_tiles(
        acc, m_i, l_i, q_smem, qr_smem, p_smem, ring, KDesc, KRDesc, Batch, b, lo, n_full,
        visible, qk_scale_log2, S_L, O_L, L, PAGE, BLOCK_M, BLOCK_N, STAGES, False,
    )  # fmt: skip

    # Hazard: kept live across the loop above, these were spilled at 255 registers (Triton 3.7
    # and 3.8); reloaded (volatile: not merged with the first loads) and recomputed instead.
    q_start, q_len, seq, lo, hi = _bounds(
        Batch, b, mblk, split, H, BLOCK_M, BLOCK_N, NUM_SPLITS, True
    )
    rows_s = mblk * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_L))
    visible = _visible(rows_s, seq, q_len, H)
    start = lo + gl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _tail_tile(
        acc, m_i, l_i, q_smem, qr_smem, p_smem, ring, Pool, Batch, b, start, hi, visible,
        qk_scale_log2, LD_L, S_L, O_L, L, R, PAGE, BLOCK_M, BLOCK_N, False,
    )  # fmt: skip
    bars = ring[2]
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    l_sum = gl.convert_layout(gl.sum(l_i, 1), gl.SliceLayout(1, S_L))
    out, lse = _normalise(acc, m_i, l_sum, O_L, False)
    rows_o = mblk * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, O_L))
    offs_o = gl.arange(0, L, layout=gl.SliceLayout(0, O_L))
    _store_rows(
        Dest, out, lse, rows_o, offs_o, rows_s, q_start, q_len, split, H, L, NUM_SPLITS, True, False
    )


def launch_options(max_q_len: int) -> dict[str, int]:
    """The 64-row kernel's other constexprs and launch options for a grid whose requests
    have up to `max_q_len` query tokens (the register cap for single-token decode)."""
    extra = {"STAGES": STAGES, "num_warps": 8}
    if max_q_len == 1:
        extra["maxnreg"] = MAXNREG
    return extra


@functools.cache
def _smem_layout(block: tuple[int, int], dt: gl.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(list(block), dt)


def pool_descriptors(
    kv: torch.Tensor, lat: int, r: int, k_box: int | None = None
) -> tuple[TensorDescriptor, TensorDescriptor]:
    """TMA descriptors of a pool layer's [slots, lat + r] rows in BLOCK_N-key tiles: the
    latent columns in boxes of `k_box` (default: all of them) and the rope columns. Built
    per call: a cached descriptor would keep a freed pool alive."""
    dt = _GL_DTYPES[kv.dtype]
    shape, strides = [kv.shape[0], lat + r], [kv.stride(0), 1]
    k_desc, kr_desc = (
        TensorDescriptor(kv, shape, strides, [BLOCK_N, w], _smem_layout((BLOCK_N, w), dt))
        for w in (k_box or lat, r)
    )
    return k_desc, kr_desc


def launch(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv: torch.Tensor,
    table: torch.Tensor,
    qo_indptr: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    qk_scale_log2: float,
    m_blocks: int,
    num_splits: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    kernel: Any = None,
    extra: dict[str, int] | None = None,
    k_box: int | None = None,
    block_m: int = BLOCK_M,
) -> None:
    """One launch over (m_blocks, batch, num_splits) of `block_m`-row programs; arguments
    as `mla_attention`'s. Check `gluon_ok` first. `kernel` / `extra`: another Gluon kernel of
    the same contract and its other constexprs and launch options (`mla_attention_seesaw`,
    `mla_attention_narrow`), `k_box` the width of its latent TMA box (default: the whole
    latent row); with no `kernel`, `extra` defaults to `launch_options(1)`."""
    lat, r = q_nope.shape[2], q_rope.shape[2]
    k_desc, kr_desc = pool_descriptors(kv, lat, r, k_box)
    outs = (out, lse, part_out, part_lse)
    if kernel is None:
        kernel, extra = _mla_attn_gluon_kernel, extra or launch_options(1)
    kernel[(m_blocks, seq_lens.numel(), num_splits)](
        *decode_args(q_nope, q_rope, kv, (k_desc, kr_desc), table, qo_indptr, seq_lens, outs),
        qk_scale_log2,
        H=q_nope.shape[1],
        L=lat,
        R=r,
        PAGE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        NUM_SPLITS=num_splits,
        **(extra or {}),
    )
