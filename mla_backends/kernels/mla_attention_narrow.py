"""Absorbed MLA decode for requests of at most 32 query rows on Hopper, in Gluon, with the
keys as the MMA's rows (bf16 / fp16 latent).

Why a third kernel: a wgmma's M side is 64 rows a warpgroup. The 64-row Gluon kernel
(`mla_attention_gluon`) puts query rows there, so an H16 decode (16 rows a request) fills a
quarter of every MMA and pays for all of it; the score GEMM alone is 64 x 64 x 576 a tile,
as much as H128's. Here the keys are the M side: S^T = K Q^T (K, the TMA tile, is the A
operand; Q^T is N = 16 or 32 wide) and O^T = V^T P^T (V^T, the same tile read transposed,
is A; P^T from shared memory is B). A 64-key tile then costs 64 x 16 x 576 + 512 x 16 x 64
MACs at H16, a quarter of the padded kernel's, and the kernel waits on HBM instead of the
tensor cores. One warpgroup a CTA: Q 18-36 KB and two 72 KB key stages.

Same contract as the other decode kernels (grid (row blocks, batch, splits), row mapping,
causality, split partials, `_merge_kernel`); the loop and its hazards are the 64-row
kernel's, with the softmax over columns: each column is one query row, its maximum a
reduction over the tile's 64 keys (four warps). GPU only (SM90); offline compile:
`scripts/compile_gluon_sm90.py bf16 narrow`.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mla_backends.kernels.mla_attention_gluon import (
    _barrier,
    _bounds,
    _issue_tile,
    _stage_q,
    _stage_tail,
    _store_rows,
)


@gluon.jit
def _scores_t(
    k_buf, kr_buf, q_smem, qr_smem, S_L: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_Q: gl.constexpr
):
    """S^T = K Q^T over L + R, issued (not waited)."""
    s = gl.zeros([BLOCK_N, BLOCK_Q], gl.float32, S_L)
    s = warpgroup_mma(k_buf, q_smem.permute((1, 0)), s, use_acc=False, is_async=True)
    return warpgroup_mma(kr_buf, qr_smem.permute((1, 0)), s, is_async=True)


@gluon.jit
def _softmax_t(
    acc,
    m_i,
    l_i,
    s,
    p_smem,
    start,
    visible,
    qk_scale_log2,
    S_L: gl.constexpr,
    O_L: gl.constexpr,
    BLOCK_N: gl.constexpr,
):
    """Causal mask and online softmax of S^T [keys, rows] down its columns; O^T rescaled and
    P^T written to shared memory as the B operand of O^T += V^T P^T."""
    n = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, S_L))
    s = gl.where(n[:, None] < visible[None, :], s * qk_scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 0))
    # columns with no visible key yet keep m = -inf: exp2 against 0, never -inf - -inf
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - m_safe[None, :])
    # l per element, summed over keys once at the end: a per-tile column sum would be a
    # second reduction across the four warps on every tile.
    l_i = l_i * alpha[None, :] + p
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, O_L))[None, :]
    # Hazard: each warp wrote 16 of P^T's 64 key rows and the wgmma reads all of them.
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()
    _barrier()
    return acc, m_new, l_i


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
    KV, stride_kv = Pool
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

    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, L], KDesc.layout)
    kr_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, R], KRDesc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    for i in gl.static_range(STAGES):
        _issue_tile(
            KDesc, KRDesc, Batch, k_smem, kr_smem, bars, b, lo, i, n_full, L, PAGE, BLOCK_N, STAGES
        )
    q_smem, qr_smem = _stage_q(Q, q_start, q_len, mblk, dtype, LD_L, H, L, R, BLOCK_M)
    # P^T [keys, rows]: rows contiguous, the B operand of O^T += V^T P^T as it is.
    p_smem = gl.allocate_shared_memory(
        dtype, [BLOCK_N, BLOCK_M], gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    )
    fence_async_shared()
    _barrier()

    rows_s = mblk * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, S_L))
    visible = gl.minimum(gl.maximum(seq - q_len + rows_s // H + 1, 0), seq)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(0, S_L))
    l_i = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, S_L)
    acc = gl.zeros([L, BLOCK_M], gl.float32, O_L)

    # As the 64-row kernel: P @ V of tile j and the scores of tile j + 1 back to back; slot
    # j refilled once O^T's wgmma on it has retired.
    if n_full > 0:
        mbarrier.wait(bars.index(0), 0)
        sc = _scores_t(k_smem.index(0), kr_smem.index(0), q_smem, qr_smem, S_L, BLOCK_N, BLOCK_M)
        sc = warpgroup_mma_wait(0, deps=[sc])
        acc, m_i, l_i = _softmax_t(
            acc, m_i, l_i, sc, p_smem, lo, visible, qk_scale_log2, S_L, O_L, BLOCK_N
        )
    for j in range(n_full - 1):
        cur = j % STAGES
        nxt = (j + 1) % STAGES
        pv = warpgroup_mma(k_smem.index(cur).permute((1, 0)), p_smem, acc, is_async=True)
        mbarrier.wait(bars.index(nxt), ((j + 1) // STAGES) & 1)
        sc = _scores_t(
            k_smem.index(nxt), kr_smem.index(nxt), q_smem, qr_smem, S_L, BLOCK_N, BLOCK_M
        )
        # Hazard: wgmma groups retire in order; waiting down to one outstanding retires
        # O^T's (tile j) whether the scores are one group or two.
        acc = warpgroup_mma_wait(1, deps=[pv])
        _barrier()  # every warp is done reading slot cur and P^T(j)
        _issue_tile(
            KDesc,
            KRDesc,
            Batch,
            k_smem,
            kr_smem,
            bars,
            b,
            lo,
            j + STAGES,
            n_full,
            L,
            PAGE,
            BLOCK_N,
            STAGES,
        )
        sc = warpgroup_mma_wait(0, deps=[sc])
        acc, m_i, l_i = _softmax_t(
            acc,
            m_i,
            l_i,
            sc,
            p_smem,
            lo + (j + 1) * BLOCK_N,
            visible,
            qk_scale_log2,
            S_L,
            O_L,
            BLOCK_N,
        )
    if n_full > 0:
        acc = warpgroup_mma(k_smem.index((n_full - 1) % STAGES).permute((1, 0)), p_smem, acc)
        _barrier()

    start = lo + n_full * BLOCK_N
    if start < hi:
        # The partial tail tile, masked (rows past hi are 0, never stale pool rows); every
        # TMA issued above has been waited on, so slot 0 is free.
        _stage_tail(
            KV,
            stride_kv,
            Batch,
            b,
            start,
            hi,
            k_smem.index(0),
            kr_smem.index(0),
            LD_L,
            L,
            R,
            PAGE,
            BLOCK_N,
        )
        sc = _scores_t(k_smem.index(0), kr_smem.index(0), q_smem, qr_smem, S_L, BLOCK_N, BLOCK_M)
        sc = warpgroup_mma_wait(0, deps=[sc])
        acc, m_i, l_i = _softmax_t(
            acc, m_i, l_i, sc, p_smem, start, visible, qk_scale_log2, S_L, O_L, BLOCK_N
        )
        acc = warpgroup_mma(k_smem.index(0).permute((1, 0)), p_smem, acc)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    l_c = gl.sum(l_i, 0)
    empty = l_c == 0.0
    l_safe = gl.where(empty, 1.0, l_c)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    out = acc * gl.convert_layout(1.0 / l_safe, gl.SliceLayout(0, O_L))[None, :]
    rows_o = mblk * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, O_L))
    offs_o = gl.arange(0, L, layout=gl.SliceLayout(1, O_L))
    _store_rows(
        Dest, out, lse, rows_o, offs_o, rows_s, q_start, q_len, split, H, L, NUM_SPLITS, True, True
    )
