"""Absorbed MLA decode for requests of at most 32 query rows on Hopper, in Gluon, with the
keys as the MMA's rows (bf16 / fp16 latent); also short grids of 33-128 rows a request, in
32-row blocks (`tuning.narrow_pays`: few tiles a CTA, where its ramp beats the 64-row
kernel's).

Why a third kernel: a wgmma's M side is 64 rows a warpgroup. The 64-row Gluon kernel
(`mla_attention_gluon`) puts query rows there, so an H16 decode (16 rows a request) fills a
quarter of every MMA and pays for all of it; the score GEMM alone is 64 x 64 x 576 a tile,
as much as H128's. Here the keys are the M side: S^T = K Q^T (K, the TMA tile, is the A
operand; Q^T is N = 16 or 32 wide) and O^T = V^T P^T (V^T, the same tile read transposed,
is A; P^T from shared memory is B). A 64-key tile then costs 64 x 16 x 576 + 512 x 16 x 64
MACs at H16, a quarter of the padded kernel's, and the kernel waits on HBM instead of the
tensor cores. One warpgroup a CTA: Q 18-36 KB and two 72 KB key stages.

Same contract as the other decode kernels (grid (row blocks, batch, splits), row mapping,
causality, split partials, `_merge_kernel`); the TMA ring, the pipelined loop and the tail
tile are the 64-row kernel's (`gluon_tiles`, with T: the softmax runs down the columns, each
one query row, its maximum a reduction over the tile's 64 keys, four warps). GPU only
(SM90); offline compile: `scripts/compile_gluon_sm90.py bf16 narrow16` (or `narrow32`).
Measured: BENCHMARKS.md, "the narrow Gluon kernel"; two warpgroups a CTA were slower.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from mla_backends.kernels.gluon_tiles import (
    _barrier,
    _bounds,
    _normalise,
    _open_ring,
    _stage_q,
    _store_rows,
    _tail_tile,
    _visible,
    _whole_tiles,
)


@gluon.jit
def _mla_attn_narrow_kernel(
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
    """The leading arguments `mla_attention.decode_args` builds; BLOCK_M query rows a CTA
    (`mla_attention.NARROW_ROWS`), the N side of its GEMMs."""
    gl.static_assert(gl.num_warps() == 4, "one warpgroup: launch with num_warps=4")
    gl.static_assert(BLOCK_M == 16 or BLOCK_M == 32, "16 or 32 query rows a CTA")
    # S^T [BLOCK_N keys, BLOCK_M rows] and O^T [L, BLOCK_M]: keys / latent columns over the
    # four warps, query rows inside each warp.
    S_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
    )
    O_L: gl.constexpr = S_L
    LD_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
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
    # P^T [keys, rows]: rows contiguous, the B operand of O^T += V^T P^T as it is.
    p_smem = gl.allocate_shared_memory(
        dtype, [BLOCK_N, BLOCK_M], gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    )
    fence_async_shared()
    _barrier()

    rows_s = mblk * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, S_L))
    visible = _visible(rows_s, seq, q_len, H)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(0, S_L))
    l_i = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, S_L)
    acc = gl.zeros([L, BLOCK_M], gl.float32, O_L)

    acc, m_i, l_i = _whole_tiles(
        acc, m_i, l_i, q_smem, qr_smem, p_smem, ring, KDesc, KRDesc, Batch, b, lo, n_full,
        visible, qk_scale_log2, S_L, O_L, L, PAGE, BLOCK_M, BLOCK_N, STAGES, True,
    )  # fmt: skip
    acc, m_i, l_i = _tail_tile(
        acc, m_i, l_i, q_smem, qr_smem, p_smem, ring, Pool, Batch, b, lo + n_full * BLOCK_N, hi,
        visible, qk_scale_log2, LD_L, S_L, O_L, L, R, PAGE, BLOCK_M, BLOCK_N, True,
    )  # fmt: skip
    bars = ring[2]
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    out, lse = _normalise(acc, m_i, gl.sum(l_i, 0), O_L, True)
    rows_o = mblk * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, O_L))
    offs_o = gl.arange(0, L, layout=gl.SliceLayout(1, O_L))
    _store_rows(
        Dest, out, lse, rows_o, offs_o, rows_s, q_start, q_len, split, H, L, NUM_SPLITS, True, True
    )


# `mla_attention_gluon.launch(..., kernel=KERNEL, extra=EXTRA, block_m=16 | 32)` launches it:
# one warpgroup, two 72 KB key stages (168 / 189 KB of shared memory at 16 / 32 rows).
KERNEL = _mla_attn_narrow_kernel
EXTRA = {"STAGES": 2, "num_warps": 4}
