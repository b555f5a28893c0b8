"""The pieces the Gluon decode kernels share (`mla_attention_gluon`, the 64-row kernel;
`mla_attention_narrow`, keys as the MMA's rows; `mla_attention_seesaw`, the prototype): the
TMA ring of key tiles, the pipelined loop over whole tiles, the masked tail tile, the query
staging, the split bounds and the stores. Helpers that differ between the two layouts take
`T`: False for S = Q K^T with query rows on the MMA's M side (64-row kernel), True for
S^T = K Q^T with the keys there (narrow kernel). GPU only (SM90); the kernels' files say
how to compile them offline.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# Gluon names that moved: gl.thread_barrier (3.6) is gl.barrier from 3.7; TMA's
# async_copy_global_to_shared (3.6, 3.7) is async_load from 3.8 and raises from 3.9.
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.constexpr_function
def split_layout(width: int) -> gl.NVMMADistributedLayout:
    """The two-warpgroup MMA layout of the 64-row kernels (the dense 64-row kernel, the Gluon
    sparse kernels): a [64, width] tile split over its columns, `width / 2` each
    (`warps_per_cta=[4, 2]`): the score tile over its keys, the output over its columns."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, width // 2, 16]
    )


# 16-byte loads of bf16 / fp16 rows by the 64-row kernels' eight warps (`_stage_q`, gathers)
ROWS_8W = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0]))


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
def _visible(rows, seq, q_len, H: gl.constexpr):
    """How many of the request's `seq` keys each query row (token, head) may see: its
    token's causal limit (the last token sees all of them)."""
    return gl.minimum(gl.maximum(seq - q_len + rows // H + 1, 0), seq)


@gluon.jit
def _open_ring(
    KDesc,
    KRDesc,
    Batch,
    b,
    lo,
    n_full,
    L: gl.constexpr,
    R: gl.constexpr,
    PAGE: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):
    """(k_smem, kr_smem, bars): a ring of STAGES key tiles in shared memory, latent and rope
    apart, with one mbarrier a slot, and the TMA of the split's first STAGES tiles issued."""
    dtype: gl.constexpr = KDesc.dtype
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
    return k_smem, kr_smem, bars


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
def _pairs(x, BLOCK_N: gl.constexpr):
    """(x[:, 0::2], x[:, 1::2]): adjacent columns sit in one thread, so no data moves."""
    return gl.split(gl.reshape(x, [x.shape[0], BLOCK_N // 2, 2]))


@gluon.jit
def _score(
    q_smem,
    qr_smem,
    k_buf,
    kr_buf,
    S_L: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    T: gl.constexpr,
):
    """One tile's scores over L + R, issued (not waited): S = Q K^T (the 64-row kernel: each
    warpgroup its half of the keys), or T S^T = K Q^T."""
    if T:
        a, ar, b, br = k_buf, kr_buf, q_smem, qr_smem
        s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, S_L)
    else:
        a, ar, b, br = q_smem, qr_smem, k_buf, kr_buf
        s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_L)
    s = warpgroup_mma(a, b.permute((1, 0)), s, use_acc=False, is_async=True)
    return warpgroup_mma(ar, br.permute((1, 0)), s, is_async=True)


@gluon.jit
def _soften(
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
    T: gl.constexpr,
):
    """Causal mask and online softmax of one score tile; the accumulator rescaled, and P
    written to shared memory for P @ V (T: S^T [keys, rows], the softmax down its columns,
    P^T the B operand of O^T += V^T P^T)."""
    if T:
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
    else:
        n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
        keep = n[None, :] < (visible - start)[:, None]
        acc, m_new, l_i, p = _online_rows(acc, m_i, l_i, s, keep, qk_scale_log2, O_L, BLOCK_N)
    _store_p(p, p_smem)
    return acc, m_new, l_i


@gluon.jit
def _online_rows(acc, m_i, l_i, s, keep, qk_scale_log2, O_L: gl.constexpr, BLOCK_N: gl.constexpr):
    """Online softmax of a [rows, keys] score tile, scores where `keep` is false masked out:
    (acc rescaled, the new row max, l, P). Also the Gluon sparse kernels' step (mask a key)."""
    s = gl.where(keep, s * qk_scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    # rows with no visible key yet keep m = -inf: exp2 against 0, never -inf - -inf
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s - m_safe[:, None])
    # l is kept per pair of columns ([M, N / 2], the pair inside one thread) and summed
    # once at the end: a per-tile row sum would be a second cross-warpgroup reduction
    # (two more barriers) on every tile; per element it took 8 more registers, which
    # spilled (3.7, 3.8).
    alpha_pair = _pairs(gl.zeros_like(p) + alpha[:, None], BLOCK_N)[0]
    p_even, p_odd = _pairs(p, BLOCK_N)
    l_i = l_i * alpha_pair + (p_even + p_odd)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
    return acc, m_new, l_i, p


@gluon.jit
def _store_p(p, p_smem):
    """P into shared memory for the P @ V wgmma."""
    # Hazard: each warp (T) or warpgroup wrote part of P and the wgmma reads all of it; the
    # rest must be in shared memory (and visible to the async proxy) before any wgmma starts.
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()
    _barrier()


@gluon.jit
def _pv(p_smem, k_buf, acc, T: gl.constexpr, ASYNC: gl.constexpr):
    """acc += P V over the tile's latent columns, or T O^T += V^T P^T."""
    if T:
        acc = warpgroup_mma(k_buf.permute((1, 0)), p_smem, acc, is_async=ASYNC)
    else:
        acc = warpgroup_mma(p_smem, k_buf, acc, is_async=ASYNC)
    return acc


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
    T: gl.constexpr,
):
    """One tile, in order (the partial tail tile, after the pipelined loop): scores,
    softmax, then P @ V."""
    s = _score(q_smem, qr_smem, k_buf, kr_buf, S_L, BLOCK_M, BLOCK_N, T)
    s = warpgroup_mma_wait(0, deps=[s])
    acc, m_i, l_i = _soften(
        acc, m_i, l_i, s, p_smem, start, visible, qk_scale_log2, S_L, O_L, BLOCK_N, T
    )
    acc = _pv(p_smem, k_buf, acc, T, False)
    # Hazard: the slot and P are rewritten next; every warp must be done reading them.
    _barrier()
    return acc, m_i, l_i


@gluon.jit
def _whole_tiles(
    acc,
    m_i,
    l_i,
    q_smem,
    qr_smem,
    p_smem,
    ring,
    KDesc,
    KRDesc,
    Batch,
    b,
    lo,
    n_full,
    visible,
    qk_scale_log2,
    S_L: gl.constexpr,
    O_L: gl.constexpr,
    L: gl.constexpr,
    PAGE: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    T: gl.constexpr,
):
    """The split's n_full whole tiles through the ring (`_open_ring`): P @ V of tile j and
    the scores of tile j + 1 go to the tensor cores back to back; slot j is refilled once
    P @ V(j) has retired in every warp."""
    k_smem, kr_smem, bars = ring
    if n_full > 0:
        mbarrier.wait(bars.index(0), 0)
        sc = _score(q_smem, qr_smem, k_smem.index(0), kr_smem.index(0), S_L, BLOCK_M, BLOCK_N, T)
        sc = warpgroup_mma_wait(0, deps=[sc])
        acc, m_i, l_i = _soften(
            acc, m_i, l_i, sc, p_smem, lo, visible, qk_scale_log2, S_L, O_L, BLOCK_N, T
        )
    for j in range(n_full - 1):
        cur = j % STAGES
        nxt = (j + 1) % STAGES
        pv = _pv(p_smem, k_smem.index(cur), acc, T, True)
        mbarrier.wait(bars.index(nxt), ((j + 1) // STAGES) & 1)
        sc = _score(
            q_smem, qr_smem, k_smem.index(nxt), kr_smem.index(nxt), S_L, BLOCK_M, BLOCK_N, T
        )
        # Hazard: wgmma groups retire in order, and the scores may be one group or two;
        # waiting down to one outstanding retires P @ V(j) either way.
        acc = warpgroup_mma_wait(1, deps=[pv])
        _barrier()  # every warp is done reading slot cur and P(j)
        _issue_tile(
            KDesc, KRDesc, Batch, k_smem, kr_smem, bars, b, lo, j + STAGES, n_full, L, PAGE,
            BLOCK_N, STAGES,
        )  # fmt: skip
        sc = warpgroup_mma_wait(0, deps=[sc])
        start = lo + (j + 1) * BLOCK_N
        acc, m_i, l_i = _soften(
            acc, m_i, l_i, sc, p_smem, start, visible, qk_scale_log2, S_L, O_L, BLOCK_N, T
        )
    if n_full > 0:
        acc = _pv(p_smem, k_smem.index((n_full - 1) % STAGES), acc, T, False)
        _barrier()
    return acc, m_i, l_i


@gluon.jit
def _tail_tile(
    acc,
    m_i,
    l_i,
    q_smem,
    qr_smem,
    p_smem,
    ring,
    Pool,
    Batch,
    b,
    start,
    hi,
    visible,
    qk_scale_log2,
    LD_L: gl.constexpr,
    S_L: gl.constexpr,
    O_L: gl.constexpr,
    L: gl.constexpr,
    R: gl.constexpr,
    PAGE: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    T: gl.constexpr,
):
    """Keys [start, hi), fewer than a tile, after the whole tiles (none if start >= hi);
    every TMA of the ring has been waited on, so slot 0 is free."""
    k_smem, kr_smem, _ = ring
    if start < hi:
        KV, stride_kv = Pool
        k_buf, kr_buf = k_smem.index(0), kr_smem.index(0)
        _stage_tail(KV, stride_kv, Batch, b, start, hi, k_buf, kr_buf, LD_L, L, R, PAGE, BLOCK_N)
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q_smem, qr_smem, k_buf, kr_buf, p_smem, start, visible, qk_scale_log2,
            S_L, O_L, BLOCK_M, BLOCK_N, T,
        )  # fmt: skip
    return acc, m_i, l_i


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
    row, n_ok = _tail_rows(KV, stride_kv, Batch, b, start, hi, LD_L, PAGE, BLOCK_N)
    offs_l = gl.arange(0, L, layout=gl.SliceLayout(0, LD_L))
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, LD_L))
    k_buf.store(gl.load(row[:, None] + offs_l[None, :], mask=n_ok[:, None], other=0.0))
    kr_buf.store(gl.load(row[:, None] + (L + offs_r)[None, :], mask=n_ok[:, None], other=0.0))
    fence_async_shared()
    _barrier()


@gluon.jit
def _tail_rows(
    KV, stride_kv, Batch, b, start, hi, LD_L: gl.constexpr, PAGE: gl.constexpr,
    BLOCK_N: gl.constexpr,
):  # fmt: skip
    """(pool row pointers, in range) of keys start .. start + BLOCK_N - 1 of request b, as
    LD_L's rows: a partial tail tile's masked loads (keys >= hi point at row 0, unread)."""
    n = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD_L))
    ok = n < hi
    Table, stride_tab, _, _ = Batch
    page = gl.load(Table + b * stride_tab + n // PAGE, mask=ok, other=0).to(gl.int64)
    return KV + (page * PAGE + n % PAGE) * stride_kv, ok


@gluon.jit
def _normalise(acc, m_i, l_sum, O_L: gl.constexpr, T: gl.constexpr):
    """(out, lse) of a finished row block: acc / l and the natural-log LSE, from P's row sums
    l_sum (T: acc is O^T, rows along its columns); a row with no visible key (l = 0) gives
    out 0 and LSE -inf, never a 0 / 0."""
    empty = l_sum == 0.0
    l_safe = gl.where(empty, 1.0, l_sum)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
    if T:
        out = acc * gl.convert_layout(1.0 / l_safe, gl.SliceLayout(0, O_L))[None, :]
    else:
        out = acc * gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, O_L))[:, None]
    return out, lse


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
