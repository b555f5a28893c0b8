"""PROTOTYPE (issue 19, not wired into any backend): the absorbed decode kernel with its two
warpgroups on alternate 64-key tiles (docs/HOPPER_NEXT_KERNEL.md).

Warpgroup w scores tiles j with j % 2 == w as one `m64n64` wgmma (the probe's 822-870 TFLOP/s
shape, not the split `m64n32` pair at 622), runs the online softmax of that tile, and hands
the running max and P to the other warpgroup through shared memory; each warpgroup keeps
half of the 512 output columns. P is written over the tile's 64 rope columns, dead once its
scores are computed (P @ V reads the latent only), so Q + two tiles fit in 216 KB.

Launched by `mla_attention_gluon.launch(..., kernel=KERNEL, extra=EXTRA)`. Limits of the
prototype: decode and verify rows as the Gluon kernel's contract, but whole
64-key tiles only (every split's key range a multiple of 64: the caller checks), and no
overlap of one tile's scores with the previous tile's P @ V beyond what the two warpgroups
give by running apart. `scripts/probe_seesaw.py` checks it against the Gluon kernel: equal
out and LSE, but 0.87-0.96x its speed on an H100 (BENCHMARKS.md, "Issue 19: a warp-
specialised prototype"); scoring the next tile early (before waiting for the other
warpgroup's P) was slower still (0.84-0.87x: it waits for that tile's load, and spills).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
)

from mla_backends.kernels.mla_attention_gluon import _bounds, _issue_tile, _store_rows

BLOCK_M, BLOCK_N = 64, 64


@gluon.jit
def _tile_scores(
    q_smem,
    qr_smem,
    k_smem,
    kr_smem,
    kv_ready,
    j,
    S_L: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
):
    """S = Q K_j^T over the latent and rope columns of tile j (slot j % 2), once it landed."""
    mbarrier.wait(kv_ready.index(j % 2), (j // 2) & 1)
    sc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_L)
    sc = warpgroup_mma(q_smem, k_smem.index(j % 2).permute((1, 0)), sc, use_acc=False)
    return warpgroup_mma(qr_smem, kr_smem.index(j % 2).permute((1, 0)), sc)


@gluon.jit
def _warpgroup(
    Batch,
    Dest,
    KDesc,
    KRDesc,
    qk_scale_log2,
    q_smem,
    qr_smem,
    k_smem,
    kr_smem,
    m_smem,
    l_smem,
    bars,
    H: gl.constexpr,
    L: gl.constexpr,
    PAGE: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    WG: gl.constexpr,
):
    HALF: gl.constexpr = L // 2
    S_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    O_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
    )
    ROW: gl.constexpr = gl.SliceLayout(1, S_L)
    kv_ready, p_ready, kv_free, l_bar = bars
    mblk = gl.program_id(0)
    b = gl.program_id(1)
    split = gl.program_id(2)
    q_start, q_len, seq, lo, hi = _bounds(
        Batch, b, mblk, split, H, BLOCK_M, BLOCK_N, NUM_SPLITS, False
    )
    n_full = gl.maximum(hi - lo, 0) // BLOCK_N
    rows_s = mblk * BLOCK_M + gl.arange(0, BLOCK_M, layout=ROW)
    visible = gl.minimum(gl.maximum(seq - q_len + rows_s // H + 1, 0), seq)
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW)
    l_i = gl.zeros([BLOCK_M], gl.float32, ROW)
    acc = gl.zeros([BLOCK_M, HALF], gl.float32, O_L)
    for j in range(n_full):
        s = j % 2
        ph = (j // 2) & 1
        if j % 2 == WG:  # this warpgroup scores tile j
            sc = _tile_scores(q_smem, qr_smem, k_smem, kr_smem, kv_ready, j, S_L, BLOCK_M, BLOCK_N)
            start = lo + j * BLOCK_N
            sc = gl.where(
                n[None, :] < (visible - start)[:, None], sc * qk_scale_log2, -float("inf")
            )
            m_new = gl.maximum(m_i, gl.max(sc, 1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(sc - m_safe[:, None])
            alpha = gl.exp2(m_i - m_safe)
            l_i = l_i * alpha + gl.sum(p, 1)
            # Hazard: P goes over this tile's rope columns, which its scores (waited) were
            # the last to read; the other warpgroup reads P and m only after p_ready.
            kr_smem.index(s).store(p.to(kr_smem.dtype))
            m_smem.index(s).store(m_new)
            fence_async_shared()
            mbarrier.arrive(p_ready.index(s), count=1)
        else:
            mbarrier.wait(p_ready.index(s), ph)
            m_new = m_smem.index(s).load(ROW)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            l_i = l_i * alpha
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        v_half = k_smem.index(s).slice(WG * HALF, HALF, dim=1)
        acc = warpgroup_mma(kr_smem.index(s), v_half, acc)
        mbarrier.arrive(kv_free.index(s), count=1)
        if j % 2 == WG:  # the scorer of tile j scores tile j + 2 too: it refills the slot
            if j + 2 < n_full:
                mbarrier.wait(kv_free.index(s), ph)
                _issue_tile(
                    KDesc, KRDesc, Batch, k_smem, kr_smem, kv_ready, b, lo, j + 2, n_full,
                    L, PAGE, BLOCK_N, 2,
                )  # fmt: skip

    # each warpgroup summed P over the tiles it scored, with the same rescaling: add them
    l_smem.index(WG).store(l_i)
    mbarrier.arrive(l_bar.index(0), count=1)
    mbarrier.wait(l_bar.index(0), 0)
    l_tot = l_smem.index(0).load(ROW) + l_smem.index(1).load(ROW)
    empty = l_tot == 0.0
    l_safe = gl.where(empty, 1.0, l_tot)
    out = acc * gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, O_L))[:, None]
    rows_o = mblk * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, O_L))
    offs_o = WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, O_L))
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    _store_rows(
        Dest, out, lse, rows_o, offs_o, rows_s, q_start, q_len, split, H, L, NUM_SPLITS, WG == 0
    )


@gluon.jit
def _seesaw_kernel(
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
):
    gl.static_assert(gl.num_warps() == 4, "the default partition is one warpgroup")
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
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, L], KDesc.layout)
    kr_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, R], KRDesc.layout)
    bar_l: gl.constexpr = mbarrier.MBarrierLayout()
    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    kv_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    l_bar = gl.allocate_shared_memory(gl.int64, [1, 1], bar_l)
    for i in gl.static_range(2):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(kv_free.index(i), count=2)
    mbarrier.init(l_bar.index(0), count=2)
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    m_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], vec)
    l_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], vec)
    fence_async_shared()
    for i in gl.static_range(2):
        _issue_tile(
            KDesc, KRDesc, Batch, k_smem, kr_smem, kv_ready, b, lo, i, n_full, L, PAGE,
            BLOCK_N, 2,
        )  # fmt: skip

    # Query rows (token, head), head fastest; rows past the request are zero.
    LD_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    QNope, QRope, stride_qn_t, stride_qn_h, stride_qr_t, stride_qr_h = Q
    rows_ld = mblk * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LD_L))
    ok_ld = rows_ld < q_len * H
    t_ld = (q_start + rows_ld // H).to(gl.int64)
    h_ld = rows_ld % H
    offs_c = gl.arange(0, 128, layout=gl.SliceLayout(0, LD_L))
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, LD_L))
    q_smem = gl.allocate_shared_memory(
        dtype, [BLOCK_M, L], gl.NVMMASharedLayout.get_default_for([BLOCK_M, L], dtype)
    )
    for c in gl.static_range(L // 128):  # 128 columns at a time: the default warps are 4
        qn = gl.load(
            QNope
            + t_ld[:, None] * stride_qn_t
            + h_ld[:, None] * stride_qn_h
            + (c * 128 + offs_c)[None, :],
            mask=ok_ld[:, None],
            other=0.0,
        )
        q_smem.slice(c * 128, 128, dim=1).store(qn)
    qr = gl.load(
        QRope + t_ld[:, None] * stride_qr_t + h_ld[:, None] * stride_qr_h + offs_r[None, :],
        mask=ok_ld[:, None],
        other=0.0,
    )
    qr_smem = gl.allocate_shared_memory(
        dtype, [BLOCK_M, R], gl.NVMMASharedLayout.get_default_for([BLOCK_M, R], dtype), qr
    )
    fence_async_shared()

    bars = (kv_ready, p_ready, kv_free, l_bar)
    gl.warp_specialize(
        [
            (
                _warpgroup,
                (Batch, Dest, KDesc, KRDesc, qk_scale_log2, q_smem, qr_smem, k_smem, kr_smem,
                 m_smem, l_smem, bars, H, L, PAGE, BLOCK_M, BLOCK_N, NUM_SPLITS, 0),
            ),
            (
                _warpgroup,
                (Batch, Dest, KDesc, KRDesc, qk_scale_log2, q_smem, qr_smem, k_smem, kr_smem,
                 m_smem, l_smem, bars, H, L, PAGE, BLOCK_M, BLOCK_N, NUM_SPLITS, 1),
            ),
        ],
        [4],
        [240],
    )  # fmt: skip


# `mla_attention_gluon.launch(..., kernel=KERNEL, extra=EXTRA)` launches it: four warps a
# partition, the default one and one worker (`gl.warp_specialize`), 240 registers a thread.
KERNEL = _seesaw_kernel
EXTRA = {"num_warps": 4, "maxnreg": 240}
