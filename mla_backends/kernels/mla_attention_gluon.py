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
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from mla_backends.kernels.common import interpreting
from mla_backends.kernels.mla_attention import decode_args

# Gluon names that moved: gl.thread_barrier (3.6) is gl.barrier from 3.7; TMA's
# async_copy_global_to_shared (3.6, 3.7) is async_load from 3.8 and raises from 3.9.
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

# One shape: 64 query rows over two warpgroups, 64-key tiles, two TMA stages. Shared memory:
# Q 72 KB + 2 x 72 KB of K + 8 KB of P = 224 KB of the 227 KB an H100 / H200 block can have.
BLOCK_M, BLOCK_N, STAGES = 64, 64, 2
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
def _issue_tile(
    KDesc,
    KRDesc,
    Batch,
    k_smem,
    kr_smem,
    bars,
    b,
    lo,
    j,
    n_full,
    L: gl.constexpr,
    PAGE: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):
    """TMA for whole tile j of this split into ring slot j % STAGES (skipped past n_full)."""
    Table, stride_tab, _, _ = Batch
    pred = j < n_full
    start = lo + j * BLOCK_N
    page = gl.load(Table + b * stride_tab + start // PAGE, mask=pred, other=0)
    row = page * PAGE + start % PAGE
    s = j % STAGES
    bar = bars.index(s)
    mbarrier.expect(bar, KDesc.block_type.nbytes + KRDesc.block_type.nbytes, pred)
    _tma_load(KDesc, [row, 0], bar, k_smem.index(s), pred)
    _tma_load(KRDesc, [row, L], bar, kr_smem.index(s), pred)


@gluon.jit
def _pairs(x, BLOCK_N: gl.constexpr):
    """(x[:, 0::2], x[:, 1::2]): adjacent columns sit in one thread, so no data moves."""
    return gl.split(gl.reshape(x, [x.shape[0], BLOCK_N // 2, 2]))


@gluon.jit
def _softmax_to_p(
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
    """Causal mask and online softmax of the score tile s; the accumulator rescaled, and P
    written to shared memory for the P @ V of both warpgroups."""
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    s = gl.where(n[None, :] < (visible - start)[:, None], s * qk_scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    # rows with no visible key yet keep m = -inf: exp2 against 0, never -inf - -inf
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - m_safe[:, None])
    # l is kept per pair of columns ([M, N / 2], the pair inside one thread) and summed once
    # at the end: a per-tile row sum would be a second cross-warpgroup reduction (two more
    # barriers) on every tile; per element it took 8 more registers, which spilled (3.7, 3.8).
    alpha_pair = _pairs(gl.zeros_like(p) + alpha[:, None], BLOCK_N)[0]
    p_even, p_odd = _pairs(p, BLOCK_N)
    l_i = l_i * alpha_pair + (p_even + p_odd)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
    # Hazard: each warpgroup wrote half of P and reads all of it; the other half must be
    # in shared memory (and visible to the async proxy) before either wgmma starts.
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()
    _barrier()
    return acc, m_new, l_i


@gluon.jit
def _scores_async(
    q_smem, qr_smem, k_buf, kr_buf, S_L: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr
):
    """S = Q K^T over L + R, issued (not waited): each warpgroup its half of the keys."""
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_L)
    s = warpgroup_mma(q_smem, k_buf.permute((1, 0)), s, use_acc=False, is_async=True)
    return warpgroup_mma(qr_smem, kr_buf.permute((1, 0)), s, is_async=True)


@gluon.jit
def _attend(
    acc,
    m_i,
    l_i,
    q_smem,
    qr_smem,
    k_buf,
    kr_buf,
    p_smem,
    start,
    visible,
    qk_scale_log2,
    S_L: gl.constexpr,
    O_L: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
):
    """One tile, in order (the partial tail tile, after the pipelined loop): scores,
    softmax, then P @ V (each warpgroup its half of the 512 output columns)."""
    s = _scores_async(q_smem, qr_smem, k_buf, kr_buf, S_L, BLOCK_M, BLOCK_N)
    s = warpgroup_mma_wait(0, deps=[s])
    acc, m_i, l_i = _softmax_to_p(
        acc, m_i, l_i, s, p_smem, start, visible, qk_scale_log2, S_L, O_L, BLOCK_N
    )
    acc = warpgroup_mma(p_smem, k_buf, acc)
    # Hazard: the slot and P are rewritten next; both warpgroups must be done reading them.
    _barrier()
    return acc, m_i, l_i


@gluon.jit
def _stage_q(
    Q,
    q_start,
    q_len,
    mblk,
    dtype: gl.constexpr,
    LD_L: gl.constexpr,
    H: gl.constexpr,
    L: gl.constexpr,
    R: gl.constexpr,
    BLOCK_M: gl.constexpr,
):
    """(q_smem [BLOCK_M, L], qr_smem [BLOCK_M, R]): query rows (token, head), head fastest,
    of row block mblk in shared memory; rows past the request are zero."""
    QNope, QRope, stride_qn_t, stride_qn_h, stride_qr_t, stride_qr_h = Q
    rows_ld = mblk * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LD_L))
    ok_ld = rows_ld < q_len * H
    t_ld = (q_start + rows_ld // H).to(gl.int64)
    h_ld = rows_ld % H
    offs_l = gl.arange(0, L, layout=gl.SliceLayout(0, LD_L))
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, LD_L))
    qn = gl.load(
        QNope + t_ld[:, None] * stride_qn_t + h_ld[:, None] * stride_qn_h + offs_l[None, :],
        mask=ok_ld[:, None],
        other=0.0,
    )
    q_smem = gl.allocate_shared_memory(
        dtype, [BLOCK_M, L], gl.NVMMASharedLayout.get_default_for([BLOCK_M, L], dtype), qn
    )
    qr = gl.load(
        QRope + t_ld[:, None] * stride_qr_t + h_ld[:, None] * stride_qr_h + offs_r[None, :],
        mask=ok_ld[:, None],
        other=0.0,
    )
    qr_smem = gl.allocate_shared_memory(
        dtype, [BLOCK_M, R], gl.NVMMASharedLayout.get_default_for([BLOCK_M, R], dtype), qr
    )
    return q_smem, qr_smem


@gluon.jit
def _stage_tail(
    KV,
    stride_kv,
    Batch,
    b,
    start,
    hi,
    k_buf,
    kr_buf,
    LD_L: gl.constexpr,
    L: gl.constexpr,
    R: gl.constexpr,
    PAGE: gl.constexpr,
    BLOCK_N: gl.constexpr,
):
    """Keys [start, hi) of request b, fewer than a tile, into k_buf / kr_buf through
    registers (masked loads: 0 past hi, so no stale pool row is read), fenced for the
    wgmma and visible to every warp."""
    n_ld = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD_L))
    n_ok = n_ld < hi
    Table, stride_tab, _, _ = Batch
    page = gl.load(Table + b * stride_tab + n_ld // PAGE, mask=n_ok, other=0).to(gl.int64)
    slot = page * PAGE + n_ld % PAGE
    offs_l = gl.arange(0, L, layout=gl.SliceLayout(0, LD_L))
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, LD_L))
    k = gl.load(KV + slot[:, None] * stride_kv + offs_l[None, :], mask=n_ok[:, None], other=0.0)
    k_buf.store(k)
    kr = gl.load(
        KV + slot[:, None] * stride_kv + L + offs_r[None, :], mask=n_ok[:, None], other=0.0
    )
    kr_buf.store(kr)
    fence_async_shared()
    _barrier()


@gluon.jit
def _bounds(
    Batch,
    b,
    mblk,
    split,
    H: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    VOLATILE: gl.constexpr,
):
    """(q_start, q_len, seq, lo, hi): the request's first query token and query count, its KV
    length, and the keys [lo, hi) this program's split reads (those its last row may see)."""
    _, _, QoIndptr, SeqLens = Batch
    q_start = gl.load(QoIndptr + b, volatile=VOLATILE)
    q_len = gl.load(QoIndptr + b + 1, volatile=VOLATILE) - q_start
    seq = gl.load(SeqLens + b, volatile=VOLATILE)
    last_tok = gl.maximum(gl.minimum(mblk * BLOCK_M + BLOCK_M - 1, q_len * H - 1), 0) // H
    kv_end = gl.minimum(gl.maximum(seq - q_len + last_tok + 1, 0), seq)
    chunk = gl.cdiv(gl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    return q_start, q_len, seq, lo, gl.minimum(lo + chunk, kv_end)


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
    S_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
    )
    O_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, L // 2, 16]
    )
    LD_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
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
            KDesc,
            KRDesc,
            Batch,
            k_smem,
            kr_smem,
            bars,
            b,
            lo,
            i,
            n_full,
            L,
            PAGE,
            BLOCK_N,
            STAGES,
        )

    q_smem, qr_smem = _stage_q(Q, q_start, q_len, mblk, dtype, LD_L, H, L, R, BLOCK_M)
    p_smem = gl.allocate_shared_memory(
        dtype, [BLOCK_M, BLOCK_N], gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    )
    fence_async_shared()
    _barrier()

    rows_s = mblk * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_L))
    visible = gl.minimum(gl.maximum(seq - q_len + rows_s // H + 1, 0), seq)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, S_L))
    l_i = _pairs(gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_L), BLOCK_N)[0]
    acc = gl.zeros([BLOCK_M, L], gl.float32, O_L)

    # P @ V of tile j and the scores of tile j + 1 go to the tensor cores back to back;
    # slot j is refilled once P @ V(j) has finished in both warpgroups.
    if n_full > 0:
        mbarrier.wait(bars.index(0), 0)
        sc = _scores_async(
            q_smem, qr_smem, k_smem.index(0), kr_smem.index(0), S_L, BLOCK_M, BLOCK_N
        )
        sc = warpgroup_mma_wait(0, deps=[sc])
        acc, m_i, l_i = _softmax_to_p(
            acc, m_i, l_i, sc, p_smem, lo, visible, qk_scale_log2, S_L, O_L, BLOCK_N
        )
    for j in range(n_full - 1):
        cur = j % STAGES
        nxt = (j + 1) % STAGES
        pv = warpgroup_mma(p_smem, k_smem.index(cur), acc, is_async=True)
        mbarrier.wait(bars.index(nxt), ((j + 1) // STAGES) & 1)
        sc = _scores_async(
            q_smem, qr_smem, k_smem.index(nxt), kr_smem.index(nxt), S_L, BLOCK_M, BLOCK_N
        )
        # Hazard: wgmma groups retire in order, and the scores may be one group or two;
        # waiting down to one outstanding retires P @ V(j) either way.
        acc = warpgroup_mma_wait(1, deps=[pv])
        _barrier()  # both warpgroups are done reading slot cur and P(j)
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
        acc, m_i, l_i = _softmax_to_p(
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
        acc = warpgroup_mma(p_smem, k_smem.index((n_full - 1) % STAGES), acc)
        _barrier()

    # Hazard: kept live across the loop above, these were spilled at 255 registers (Triton 3.7
    # and 3.8); reloaded (volatile: not merged with the first loads) and recomputed instead.
    q_start, q_len, seq, lo, hi = _bounds(
        Batch, b, mblk, split, H, BLOCK_M, BLOCK_N, NUM_SPLITS, True
    )
    rows_s = mblk * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_L))
    visible = gl.minimum(gl.maximum(seq - q_len + rows_s // H + 1, 0), seq)
    start = lo + gl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
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
        acc, m_i, l_i = _attend(
            acc,
            m_i,
            l_i,
            q_smem,
            qr_smem,
            k_smem.index(0),
            kr_smem.index(0),
            p_smem,
            start,
            visible,
            qk_scale_log2,
            S_L,
            O_L,
            BLOCK_M,
            BLOCK_N,
        )
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    l_i = gl.convert_layout(gl.sum(l_i, 1), gl.SliceLayout(1, S_L))
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    out = acc * gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, O_L))[:, None]
    rows_o = mblk * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, O_L))
    offs_o = gl.arange(0, L, layout=gl.SliceLayout(0, O_L))
    _store_rows(
        Dest, out, lse, rows_o, offs_o, rows_s, q_start, q_len, split, H, L, NUM_SPLITS, True, False
    )


@gluon.jit
def _store_rows(
    Dest,
    out,
    lse,
    rows_o,
    offs_o,
    rows_s,
    q_start,
    q_len,
    split,
    H: gl.constexpr,
    L: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    WITH_LSE: gl.constexpr,
    TRANSPOSED: gl.constexpr,
):
    """This program's output columns `offs_o` of rows `rows_o` (and, WITH_LSE, the LSE of rows
    `rows_s`): into out / lse with one split, else into the split partials. `out` is
    [rows, columns], or TRANSPOSED [columns, rows]."""
    ok_o = rows_o < q_len * H
    ok_s = rows_s < q_len * H
    Out, Lse, PartOut, PartLse, stride_o_t, stride_o_h, stride_lse_t = Dest
    if NUM_SPLITS == 1:
        t_o = (q_start + rows_o // H).to(gl.int64)
        o_row = t_o * stride_o_t + (rows_o % H) * stride_o_h
        o_ptr, o_ok = _grid2(Out + o_row, offs_o, ok_o, TRANSPOSED)
        gl.store(o_ptr, out.to(Out.dtype.element_ty), mask=o_ok)
        if WITH_LSE:
            t_s = (q_start + rows_s // H).to(gl.int64)
            gl.store(Lse + t_s * stride_lse_t + rows_s % H, lse, mask=ok_s)
    else:
        prow_o = (q_start * H + rows_o).to(gl.int64) * NUM_SPLITS + split
        o_ptr, o_ok = _grid2(PartOut + prow_o * L, offs_o, ok_o, TRANSPOSED)
        gl.store(o_ptr, out, mask=o_ok)
        if WITH_LSE:
            prow_s = (q_start * H + rows_s).to(gl.int64) * NUM_SPLITS + split
            gl.store(PartLse + prow_s, lse, mask=ok_s)


@gluon.jit
def _grid2(row_ptr, cols, row_ok, TRANSPOSED: gl.constexpr):
    """(pointers, mask) of a tile: row pointers [R] plus columns [C], as [R, C] or,
    TRANSPOSED, [C, R]."""
    if TRANSPOSED:
        ptr, ok = row_ptr[None, :] + cols[:, None], row_ok[None, :]
    else:
        ptr, ok = row_ptr[:, None] + cols[None, :], row_ok[:, None]
    return ptr, ok


@functools.cache
def _smem_layout(block: tuple[int, int], dt: gl.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(list(block), dt)


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
    latent row)."""
    lat, r = q_nope.shape[2], q_rope.shape[2]
    dt = _GL_DTYPES[kv.dtype]
    shape, strides = [kv.shape[0], lat + r], [kv.stride(0), 1]
    # built per call: a cached descriptor would keep a freed pool alive
    k_desc, kr_desc = (
        TensorDescriptor(kv, shape, strides, [BLOCK_N, w], _smem_layout((BLOCK_N, w), dt))
        for w in (k_box or lat, r)
    )
    outs = (out, lse, part_out, part_lse)
    if kernel is None:
        kernel, extra = _mla_attn_gluon_kernel, {"STAGES": STAGES, "num_warps": 8}
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
