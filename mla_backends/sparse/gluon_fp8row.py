"""Sparse absorbed MLA on Hopper in Gluon over the 656-byte FP8 rows (`fp8_row`): the Gluon
sparse kernel (`gluon_kernel.py`) with each gathered tile dequantised in shared memory.

A tile's selected rows arrive by `cp.async` as they are stored: 512 e4m3 codes into a
two-slot ring of fp8 tiles, the bf16 rope into a ring of rope tiles; the four fp32 scales a
row (one per 128 codes) are loaded into registers one tile ahead. Before the tile's MMAs the
warps turn the codes into bf16 (code x scale: exact, a 4-bit significand times a power of
two), 64 columns at a time, into one bf16 tile that both the score MMA and P @ V read; then
the bf16 kernel's steps run unchanged. Shared memory: fp8 ring 64 KB, rope ring 16 KB, the
bf16 tile 64 KB, Q 72 KB, P 8 KB.

Contract: `gluon_kernel.sparse_mla`'s with `kv` the pool layer's [slots, 656] uint8 rows
(`Fp8RowFormat()`: L 512, R 64) and bf16 queries. Hazards: a -1 entry's row stands in as
zeros (masked `cp.async` lanes zero-fill, and its scales load as 0), never the pool's bytes
(0xFF codes are NaN); the bf16 tile is written by the warps' stores (generic proxy) and read
by wgmma (async proxy): fenced, and every warp passes a barrier before the MMAs read it and
again before the next tile's dequantisation overwrites it (P @ V is waited for first).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared

from mla_backends.kernels.gluon_tiles import ROWS_8W, _barrier, _stage_q, split_layout
from mla_backends.sparse.fp8_row import Fp8RowFormat
from mla_backends.sparse.gluon_kernel import (
    BLOCK_M,
    _cp_async,
    _sparse_finish,
    _sparse_start,
    _sparse_state,
    _sparse_tile,
    _split_range,
    check_indices,
    launch,
    on_sm90,
    refusal,
)

CH = 64  # columns dequantised at a time: 16 codes a thread, little beside the accumulator
FMT = Fp8RowFormat()


@gluon.jit
def _gather_rows(
    Rows,
    Row,
    lo,
    hi,
    j,
    k8_smem,
    kr_smem,
    DQ_L: gl.constexpr,
    LR_L: gl.constexpr,
    ROW_E8: gl.constexpr,
    ROW_B: gl.constexpr,
    R_OFF: gl.constexpr,
    L: gl.constexpr,
    R: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    CH: gl.constexpr,
):
    """cp.async of tile j's codes (CH columns a buffer) and rope (indices lo + j * BLOCK_N
    ..., below hi) into slot j % STAGES, then one commit group (empty past the split)."""
    K8, _, KR = Rows
    NC: gl.constexpr = L // CH
    s = j % STAGES
    n = lo + j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, DQ_L))
    idx = gl.load(Row + n, mask=n < hi, other=-1)
    ok = idx >= 0
    slot = gl.where(ok, idx, 0).to(gl.int64)
    codes = K8 + slot[:, None] * ROW_E8 + gl.arange(0, CH, layout=gl.SliceLayout(0, DQ_L))[None, :]
    for c in gl.static_range(NC):
        _cp_async(k8_smem.index(s * NC + c), codes + c * CH, mask=ok[:, None])
    slot_r = gl.convert_layout(slot, gl.SliceLayout(1, LR_L))
    ok_r = gl.convert_layout(ok, gl.SliceLayout(1, LR_L))
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, LR_L))
    rope = KR + (slot_r * ROW_B + R_OFF)[:, None] + offs_r[None, :]
    _cp_async(kr_smem.index(s), rope, mask=ok_r[:, None])
    async_copy.commit_group()


@gluon.jit
def _scales(
    Rows,
    Row,
    lo,
    hi,
    j,
    DQ_L: gl.constexpr,
    ROW_S: gl.constexpr,
    S_OFF: gl.constexpr,
    BLOCK_N: gl.constexpr,
):
    """Tile j's four scale columns, [BLOCK_N] each in the dequantisation layout's rows
    (0 for unused entries and past the split)."""
    _, KS, _ = Rows
    n = lo + j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, DQ_L))
    idx = gl.load(Row + n, mask=n < hi, other=-1)
    ok = idx >= 0
    base = KS + gl.where(ok, idx, 0).to(gl.int64) * ROW_S + S_OFF
    s0 = gl.load(base, mask=ok, other=0.0)
    s1 = gl.load(base + 1, mask=ok, other=0.0)
    s2 = gl.load(base + 2, mask=ok, other=0.0)
    s3 = gl.load(base + 3, mask=ok, other=0.0)
    return s0, s1, s2, s3


@gluon.jit
def _dequant_tile(
    k8_smem, cur, kb_smem, sc, T: gl.constexpr, DQ_L: gl.constexpr, L: gl.constexpr,
    CH: gl.constexpr,
):  # fmt: skip
    """Columns [128 T, 128 T + 128) of kb_smem (one scale tile, `fp8_row.TILE`) = codes of
    slot cur x sc, CH columns at a time."""
    for c in gl.static_range(128 // CH):
        x = k8_smem.index(cur * (L // CH) + T * (128 // CH) + c).load(DQ_L)
        y = x.to(gl.float32) * sc[:, None]
        kb_smem.slice(T * 128 + c * CH, CH, dim=1).store(y.to(kb_smem.dtype))


@gluon.jit
def _dequant(
    k8_smem, cur, kb_smem, s0, s1, s2, s3, DQ_L: gl.constexpr, L: gl.constexpr, CH: gl.constexpr
):
    """kb_smem = codes of slot cur x their scales, fenced for the wgmma and visible to
    every warp."""
    _dequant_tile(k8_smem, cur, kb_smem, s0, 0, DQ_L, L, CH)
    _dequant_tile(k8_smem, cur, kb_smem, s1, 1, DQ_L, L, CH)
    _dequant_tile(k8_smem, cur, kb_smem, s2, 2, DQ_L, L, CH)
    _dequant_tile(k8_smem, cur, kb_smem, s3, 3, DQ_L, L, CH)
    fence_async_shared()
    _barrier()


@gluon.jit
def _sparse_fp8row_kernel(
    Q,
    Rows,
    Idx,
    stride_idx,
    topk,
    Dest,
    qk_scale_log2,
    H: gl.constexpr,
    L: gl.constexpr,
    R: gl.constexpr,
    ROW_E8: gl.constexpr,
    ROW_S: gl.constexpr,
    S_OFF: gl.constexpr,
    ROW_B: gl.constexpr,
    R_OFF: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    STAGES: gl.constexpr,
    CH: gl.constexpr,
    USE_GDC: gl.constexpr,
):
    """Grid (H / BLOCK_M, tokens, splits). Rows: (codes as e4m3, the rows as fp32, the rows
    as bf16) views of the pool layer; Q / Dest as in `gluon_kernel._sparse_gluon_kernel`."""
    gl.static_assert(gl.num_warps() == 8, "two warpgroups: launch with num_warps=8")
    gl.static_assert(L == 512, "four 128-wide scale tiles a row")
    S_L: gl.constexpr = split_layout(BLOCK_N)
    O_L: gl.constexpr = split_layout(L)
    LD_L: gl.constexpr = ROWS_8W
    DQ_L: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 2], [1, 0])  # [64, 64] e4m3
    dtype: gl.constexpr = Q[0].dtype.element_ty
    K8, _, _ = Rows

    mblk = gl.program_id(0)
    t = gl.program_id(1)
    split = gl.program_id(2)
    _sparse_start(USE_GDC)
    Row, lo, hi, n_tiles = _split_range(Idx, stride_idx, topk, t, split, NUM_SPLITS, BLOCK_N)

    k8_smem = gl.allocate_shared_memory(  # one [BLOCK_N, CH] buffer a slot and column block
        K8.dtype.element_ty,
        [STAGES * (L // CH), BLOCK_N, CH],
        gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]),
    )
    kr_smem = gl.allocate_shared_memory(
        dtype, [STAGES, BLOCK_N, R], gl.NVMMASharedLayout.get_default_for([BLOCK_N, R], dtype)
    )
    for i in gl.static_range(STAGES):
        _gather_rows(
            Rows, Row, lo, hi, i, k8_smem, kr_smem, DQ_L, LD_L, ROW_E8, ROW_B, R_OFF, L, R,
            BLOCK_N, STAGES, CH,
        )  # fmt: skip
    s0, s1, s2, s3 = _scales(Rows, Row, lo, hi, 0, DQ_L, ROW_S, S_OFF, BLOCK_N)
    q_smem, qr_smem = _stage_q(Q, t, 1, mblk, dtype, LD_L, H, L, R, BLOCK_M)
    kb_smem = gl.allocate_shared_memory(
        dtype, [BLOCK_N, L], gl.NVMMASharedLayout.get_default_for([BLOCK_N, L], dtype)
    )
    p_smem = gl.allocate_shared_memory(
        dtype, [BLOCK_M, BLOCK_N], gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    )

    m_i, l_i, acc = _sparse_state(S_L, O_L, BLOCK_M, BLOCK_N, L)
    for j in range(n_tiles):
        cur = j % STAGES
        # the next tile's scales (its rows were requested a tile ago), used a tile later
        n0, n1, n2, n3 = _scales(Rows, Row, lo, hi, j + 1, DQ_L, ROW_S, S_OFF, BLOCK_N)
        async_copy.wait_group(STAGES - 1)  # tile j's group (groups retire in order)
        _barrier()  # every thread's cp.async writes of tile j landed
        # (its fence also covers this thread's cp.async writes of the rope tile)
        _dequant(k8_smem, cur, kb_smem, s0, s1, s2, s3, DQ_L, L, CH)
        acc, m_i, l_i = _sparse_tile(
            acc, m_i, l_i, q_smem, qr_smem, kb_smem, kr_smem.index(cur), p_smem, Row, lo, hi, j,
            qk_scale_log2, S_L, O_L, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        _barrier()  # every warp is done reading slot cur, P(j) and the bf16 tile
        _gather_rows(
            Rows, Row, lo, hi, j + STAGES, k8_smem, kr_smem, DQ_L, LD_L, ROW_E8, ROW_B, R_OFF,
            L, R, BLOCK_N, STAGES, CH,
        )  # fmt: skip
        s0, s1, s2, s3 = n0, n1, n2, n3
    async_copy.wait_group(0)
    _sparse_finish(
        Dest, acc, m_i, l_i, mblk, t, split, S_L, O_L, H, L, BLOCK_M, NUM_SPLITS, USE_GDC
    )


def usable(q_nope: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor) -> bool:
    """This kernel's conditions: an SM90, and the tensors it takes (`takes`)."""
    return on_sm90(kv) and takes(q_nope, q_rope, kv)


def takes(q_nope: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor) -> bool:
    """The tensors this kernel takes, on any device: bf16 queries (the rope is stored in
    bf16), H a multiple of 64, `Fp8RowFormat()` rows (L 512, R 64) contiguous, 16-byte
    aligned."""
    return (
        kv.dtype == torch.uint8
        and q_nope.dtype == q_rope.dtype == torch.bfloat16
        and q_nope.shape[1] % BLOCK_M == 0
        and (q_nope.shape[2], q_rope.shape[2]) == (FMT.kv_lora_rank, FMT.rope_dim)
        and kv.dim() == 2
        and kv.shape[1] == FMT.row_bytes
        and q_nope.stride(2) == q_rope.stride(2) == kv.stride(1) == 1
        and kv.stride(0) == FMT.row_bytes
        and kv.data_ptr() % 16 == 0
    )


def sparse_mla(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    num_splits: int,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """q_nope [T, H, 512], q_rope [T, H, 64] bf16, kv [slots, 656] uint8 FP8 rows, indices
    [T, K] int32 (-1 unused) -> out [T, H, 512], lse [T, H]. SM90 only."""
    check_indices(indices, q_nope.shape[0])
    if not usable(q_nope, q_rope, kv):
        raise refusal(
            "the Gluon FP8-row sparse kernel takes SM90, bf16 queries, H % 64 == 0 and "
            f"contiguous [slots, {FMT.row_bytes}] uint8 rows",
            q_nope, q_rope, kv,
        )  # fmt: skip
    rows = (kv.view(torch.float8_e4m3fn), kv.view(torch.float32), kv.view(torch.bfloat16))
    launch(
        _sparse_fp8row_kernel, (rows,), q_nope, q_rope, indices, sm_scale, num_splits, out, lse,
        ROW_E8=FMT.row_bytes, ROW_S=FMT.row_bytes // 4, S_OFF=FMT.scale_offset // 4,
        ROW_B=FMT.row_bytes // 2, R_OFF=FMT.rope_offset // 2, CH=CH,
    )  # fmt: skip
