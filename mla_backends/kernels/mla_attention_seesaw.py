"""Absorbed MLA decode for 64-row query blocks on Hopper with its two warpgroups on
alternate 64-key tiles (warp-specialised, the "seesaw"; docs/HOPPER_NEXT_KERNEL.md): what
the `triton` backend runs for H >= 64 on SM90 (`tuning.seesaw_pays`; the lockstep kernel,
`mla_attention_gluon`'s own, takes other 64-row blocks and MLA_SEESAW=0).

Warpgroup w scores tiles j with j % 2 == w as one `m64n64` wgmma (the probe's 822-870 TFLOP/s
shape, not the split `m64n32` pair at 622), runs the online softmax of that tile, and hands
the running max and P to the other warpgroup through shared memory; each warpgroup keeps
half of the 512 output columns. P is written over the tile's 64 rope columns, dead once its
scores are computed (P @ V reads the latent only), so Q + two tiles fit in 216 KB.

Launched by `mla_attention_gluon.launch(..., kernel=KERNEL, extra=EXTRA, k_box=K_BOX)`, the
Gluon kernel's contract (grid, rows, causality, split partials). The warpgroups' tiles run a
tile apart; each whole tile comes in three TMA pieces (latent halves, rope), each refilled
as soon as its last reader retired. A split's partial tail tile is staged from registers
after the loop (masked loads, so stale pool rows never reach P @ V). Measured against the
lockstep kernel and raw FlashMLA by `scripts/probe_seesaw.py` (`PROBE` 1: compute only;
`Trace`: SM clocks at seven points of the loop) and `bench --suite hopper` (BENCHMARKS.md).
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

from mla_backends.kernels.gluon_tiles import (
    _bounds,
    _normalise,
    _store_rows,
    _tail_rows,
    _tma_load,
    _visible,
)

BLOCK_M, BLOCK_N = 64, 64


@gluon.jit
def _opaque_zero():
    """0, from an asm statement the compiler may neither fold nor move out of a loop.
    Hazard: Q's and each slot's shared-memory views sit at constant addresses, so every
    wgmma descriptor of the loop (about 40, 64 bits each) is loop-invariant: LLVM computes them
    all above the loop and ptxas spills them (304 B of stack, 39 spill loads an iteration in
    one warpgroup with triton 3.6; 92 with 3.9's CUDA 13.4 ptxas; 8-15 % of the kernel's
    time, BENCHMARKS.md, forty-fifth session). Views indexed by this zero inside the loop
    are recomputed there from one base, a few integer adds each."""
    return gl.inline_asm_elementwise(
        "mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _score_piece(
    q_smem, k_smem, kv_ready, sc, ph, s, C: gl.constexpr, ACC: gl.constexpr,
    NP: gl.constexpr, W: gl.constexpr,
):  # fmt: skip
    """Latent piece C of slot s into the score tile, once it landed (issued, not waited)."""
    mbarrier.wait(kv_ready.index((NP + 1) * s + C), ph)
    k_c = k_smem.index(s).slice(C * W, W, dim=1).permute((1, 0))
    return warpgroup_mma(q_smem.slice(C * W, W, dim=1), k_c, sc, use_acc=ACC, is_async=True)


@gluon.jit
def _scores_own(
    q_smem, k_smem, kv_ready, j, s, S_L: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, NP: gl.constexpr, REUSE: gl.constexpr, SLOT: gl.constexpr,
):  # fmt: skip
    """S = Q K_j^T of tile j (slot j % 2 == SLOT, the scoring warpgroup's; `s`, the index
    the slot's views take, equals it: `_opaque_zero`) over the scorer's own latent half,
    issued once it landed, not waited: the scorer refilled that half itself right after its
    own P @ V, so it lands first. `_scores_rest` adds the rest.
    REUSE (the compute-only probe): the slot's first fill, never refilled, is read again."""
    ph = 0 if REUSE else (j // 2) & 1
    HP: gl.constexpr = NP // 2  # latent pieces a half
    W: gl.constexpr = k_smem.shape[2] // NP
    sc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_L)
    for k in gl.static_range(HP):
        sc = _score_piece(q_smem, k_smem, kv_ready, sc, ph, s, SLOT * HP + k, k > 0, NP, W)
    return sc


@gluon.jit
def _scores_rest(
    sc, q_smem, qr_smem, k_smem, kr_smem, kv_ready, j, s, NP: gl.constexpr,
    REUSE: gl.constexpr, SLOT: gl.constexpr,
):  # fmt: skip
    """The rest of tile j's scores, each piece issued once it landed, not waited: the rope
    and the other warpgroup's latent half, both refilled only after the other warpgroup's
    P @ V on the slot's last tile (the rope holds P), so they land last."""
    ph = 0 if REUSE else (j // 2) & 1
    HP: gl.constexpr = NP // 2
    W: gl.constexpr = k_smem.shape[2] // NP
    mbarrier.wait(kv_ready.index((NP + 1) * s + NP), ph)
    sc = warpgroup_mma(qr_smem, kr_smem.index(s).permute((1, 0)), sc, is_async=True)
    for k in gl.static_range(HP):
        sc = _score_piece(q_smem, k_smem, kv_ready, sc, ph, s, (1 - SLOT) * HP + k, True, NP, W)
    return sc


@gluon.jit
def _score_own_tile(
    m_i, l_i, visible, start, qk_scale_log2, q_smem, qr_smem, k_smem, kr_smem, kv_ready,
    m_buf, p_bar, j, S_L: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    NP: gl.constexpr, REUSE: gl.constexpr, SLOT: gl.constexpr,
):  # fmt: skip
    """Scores and softmax of our tile j (keys from `start`) with no tile of the other
    warpgroup to take between them (tile 0, the tail): (m_new, alpha, l_new), P published."""
    sc = _scores_own(q_smem, k_smem, kv_ready, j, SLOT, S_L, BLOCK_M, BLOCK_N, NP, REUSE, SLOT)
    sc = _scores_rest(sc, q_smem, qr_smem, k_smem, kr_smem, kv_ready, j, SLOT, NP, REUSE, SLOT)
    sc = warpgroup_mma_wait(0, deps=[sc])
    return _softmax_tile(
        sc,
        m_i,
        l_i,
        visible - start,
        qk_scale_log2,
        kr_smem.index(SLOT),
        m_buf,
        p_bar,
        S_L,
        BLOCK_N,
    )


@gluon.jit
def _tile_row(Batch, b, lo, j, n_full, PAGE: gl.constexpr, BLOCK_N: gl.constexpr):
    """Tile j's first pool row (its page from the table; 0 past n_full)."""
    Table, stride_tab, _, _ = Batch
    start = lo + j * BLOCK_N
    page = gl.load(Table + b * stride_tab + start // PAGE, mask=j < n_full, other=0)
    return page * PAGE + start % PAGE


@gluon.jit
def _issue_pieces(
    KDesc,
    KRDesc,
    k_smem,
    kr_smem,
    kv_ready,
    row,
    j,
    n_full,
    FIRST: gl.constexpr,
    LAST: gl.constexpr,
    NP: gl.constexpr,
    L: gl.constexpr,
):
    """TMA for pieces FIRST..LAST - 1 of tile j (first pool row `row`) into slot j % 2
    (skipped past n_full): piece c < NP a latent column range (KDesc's box), c == NP the
    rope columns."""
    W: gl.constexpr = L // NP
    pred = j < n_full
    s = j % 2
    for c in gl.static_range(FIRST, LAST):
        bar = kv_ready.index((NP + 1) * s + c)
        if c == NP:
            mbarrier.expect(bar, KRDesc.block_type.nbytes, pred)
            _tma_load(KRDesc, [row, L], bar, kr_smem.index(s), pred)
        else:
            mbarrier.expect(bar, KDesc.block_type.nbytes, pred)
            _tma_load(KDesc, [row, c * W], bar, k_smem.index(s).slice(c * W, W, dim=1), pred)


@gluon.jit
def _stage_tail(
    Pool, Batch, b, start, hi, k_buf, kr_buf, kv_ready, s: gl.constexpr, NP: gl.constexpr,
    L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    """Keys [start, hi), fewer than a tile, into slot s through registers by the warpgroup
    that scores them, then each of the slot's pieces marked landed (kv_ready) as a TMA
    would. Masked loads: 0 past hi, so no stale or NaN-poisoned pool row reaches P @ V (P is
    0 there, but 0 * NaN is NaN). The slot's last readers must have retired."""
    KV, stride_kv = Pool
    LD_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    row, ok = _tail_rows(KV, stride_kv, Batch, b, start, hi, LD_L, PAGE, BLOCK_N)
    cols = gl.arange(0, R, layout=gl.SliceLayout(0, LD_L))
    for c in gl.static_range(L // R):  # R (64) columns at a time: 16 registers a thread
        k = gl.load(row[:, None] + (c * R + cols)[None, :], mask=ok[:, None], other=0.0)
        k_buf.slice(c * R, R, dim=1).store(k)
    kr_buf.store(gl.load(row[:, None] + (L + cols)[None, :], mask=ok[:, None], other=0.0))
    fence_async_shared()  # Hazard: generic-proxy stores, read by wgmma (the async proxy)
    for c in gl.static_range(NP + 1):
        mbarrier.arrive(kv_ready.index((NP + 1) * s + c), count=1)


@gluon.jit
def _v_half(k_smem, slot, WG: gl.constexpr, HALF: gl.constexpr):
    """This warpgroup's half of the latent columns of a slot: V for P @ V."""
    return k_smem.index(slot).slice(WG * HALF, HALF, dim=1)


@gluon.jit
def _take_max(m_buf, m_i, ROW: gl.constexpr):
    """The running max the other warpgroup published, and the factor that rescales ours."""
    m_new = m_buf.load(ROW)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, gl.exp2(m_i - m_safe)


@gluon.jit
def _softmax_tile(
    sc,
    m_i,
    l_i,
    left,
    qk_scale_log2,
    p_buf,
    m_buf,
    p_bar,
    S_L: gl.constexpr,
    BLOCK_N: gl.constexpr,
):
    """Online softmax of a scored tile (keys >= `left` per row masked): P over the tile's
    rope columns and the new max published, p_bar signalled; (m_new, alpha, l_new)."""
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    sc = gl.where(n[None, :] < left[:, None], sc * qk_scale_log2, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(sc, 1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(sc - m_safe[:, None])
    alpha = gl.exp2(m_i - m_safe)
    # Hazard: P goes over this tile's rope columns, which its scores (waited) were the last
    # to read; the other warpgroup reads P and m only after p_bar.
    p_buf.store(p.to(p_buf.dtype))
    m_buf.store(m_new)
    fence_async_shared()
    mbarrier.arrive(p_bar, count=1)
    return m_new, alpha, l_i * alpha + gl.sum(p, 1)


# `Trace`: a warpgroup's first loop iterations recorded, seven events each (the loop's top,
# S(o) over our half issued, P(p) @ V issued, it retired and refilled, the rest of S(o)
# retired, P(o) out, P(o) @ V retired and refilled; `scripts/probe_seesaw.py --trace`)
TRACE_ITERS = gl.constexpr(16)
TRACE_EVENTS = gl.constexpr(7)


@gluon.jit
def _mark(Trace, b, split, mblk, i, WG: gl.constexpr, E: gl.constexpr):
    """Probe only (`Trace` given): this SM's clock at event E of loop iteration i, recorded
    for the first 4 requests' first split and head block, as Trace[b, WG, i, E]."""
    if Trace is not None:
        t = gl.inline_asm_elementwise(
            "mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1
        )
        at = ((b * 2 + WG) * TRACE_ITERS + i) * TRACE_EVENTS + E
        ok = (b < 4) & (split == 0) & (mblk == 0) & (i < TRACE_ITERS)
        gl.store(Trace + at, t, mask=ok)


@gluon.jit
def _take_other(
    acc, m_i, l_i, k_smem, kr_smem, m_smem, p_ready, p, WG: gl.constexpr, ROW: gl.constexpr,
    O_L: gl.constexpr,
):  # fmt: skip
    """The other warpgroup's tile p, once its P is published: its running max taken, our
    half of the output rescaled to it, and P(p) @ V over our half issued (not waited)."""
    s = p % 2
    mbarrier.wait(p_ready.index(s), (p // 2) & 1)
    m_i, alpha = _take_max(m_smem.index(s), m_i, ROW)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
    v = _v_half(k_smem, s, WG, k_smem.shape[2] // 2)
    return warpgroup_mma(kr_smem.index(s), v, acc, is_async=True), m_i, l_i * alpha


@gluon.jit
def _pv_own_waited(acc, alpha, k_smem, kr_smem, WG: gl.constexpr, O_L: gl.constexpr):
    """Our half of the output rescaled by alpha, plus P @ V of the tile we scored (slot WG,
    P over its rope columns), waited."""
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
    v = _v_half(k_smem, WG, WG, k_smem.shape[2] // 2)
    acc = warpgroup_mma(kr_smem.index(WG), v, acc, is_async=True)
    return warpgroup_mma_wait(0, deps=[acc])


@gluon.jit
def _own_pv(
    acc, alpha, KDesc, KRDesc, row, k_smem, kr_smem, kv_ready, kv_free, o, n_load,
    WG: gl.constexpr, NP: gl.constexpr, L: gl.constexpr, O_L: gl.constexpr,
):  # fmt: skip
    """Our half of P(o) @ V for the tile we scored, waited; then its slot refilled for tile
    o + 2: our latent half at once (our scores and P @ V were its readers), the rope
    columns (where P lives) once the other warpgroup's P(o) @ V retired too."""
    acc = _pv_own_waited(acc, alpha, k_smem, kr_smem, WG, O_L)
    mbarrier.arrive(kv_free.index(WG), count=1)
    _issue_pieces(
        KDesc, KRDesc, k_smem, kr_smem, kv_ready, row, o + 2, n_load,
        WG * (NP // 2), (WG + 1) * (NP // 2), NP, L,
    )  # fmt: skip
    mbarrier.wait(kv_free.index(WG), (o // 2) & 1, pred=o + 2 < n_load)
    _issue_pieces(KDesc, KRDesc, k_smem, kr_smem, kv_ready, row, o + 2, n_load, NP, NP + 1, NP, L)
    return acc


@gluon.jit
def _other_done(
    KDesc, KRDesc, row, k_smem, kr_smem, kv_ready, kv_free, p, n_load,
    WG: gl.constexpr, NP: gl.constexpr, L: gl.constexpr,
):  # fmt: skip
    """Our P(p) @ V over the other warpgroup's tile p retired: our latent half of its slot
    refilled for tile p + 2 (its scores, the half's other reader, retired before P(p))."""
    mbarrier.arrive(kv_free.index(p % 2), count=1)
    _issue_pieces(
        KDesc, KRDesc, k_smem, kr_smem, kv_ready, row, p + 2, n_load,
        WG * (NP // 2), (WG + 1) * (NP // 2), NP, L,
    )  # fmt: skip


@gluon.jit
def _warpgroup(
    Pool,
    Batch,
    Dest,
    KDesc,
    KRDesc,
    qk_scale_log2,
    q_all,
    qr_all,
    k_smem,
    kr_smem,
    m_smem,
    l_smem,
    bars,
    H: gl.constexpr,
    L: gl.constexpr,
    R: gl.constexpr,
    PAGE: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    WG: gl.constexpr,
    PROBE: gl.constexpr,
    Trace,
):
    HALF: gl.constexpr = L // 2
    q_smem, qr_smem = q_all.index(0), qr_all.index(0)  # outside the loop: constant views
    REUSE: gl.constexpr = PROBE == 1
    S_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    O_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16]
    )
    ROW: gl.constexpr = gl.SliceLayout(1, S_L)
    NP: gl.constexpr = L // KDesc.block_type.shape[1]  # latent pieces a tile
    kv_ready, p_ready, kv_free, l_bar = bars
    mblk = gl.program_id(0)
    b = gl.program_id(1)
    split = gl.program_id(2)
    q_start, q_len, seq, lo, hi = _bounds(
        Batch, b, mblk, split, H, BLOCK_M, BLOCK_N, NUM_SPLITS, False
    )
    n_full = gl.maximum(hi - lo, 0) // BLOCK_N
    # PROBE 1 (compute only): the two slots' first fills serve every tile, nothing refilled
    n_load = gl.minimum(n_full, 2) if REUSE else n_full
    rows_s = mblk * BLOCK_M + gl.arange(0, BLOCK_M, layout=ROW)
    visible = _visible(rows_s, seq, q_len, H)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW)
    l_i = gl.zeros([BLOCK_M], gl.float32, ROW)
    acc = gl.zeros([BLOCK_M, HALF], gl.float32, O_L)
    # Staggered tiles: warpgroup w scores tiles o = w, w + 2, ... (slot w) and multiplies
    # every tile's P by its half of V. Per own tile o, with p = o - 1 the other's tile before
    # it: S(o) over our own latent half (it lands first); wait for P(p), take its max, issue
    # P(p) @ V (ptxas waits for that part of S(o) before the rescale); wait for it and refill
    # our half of slot p % 2; the rest of S(o) (rope, the other half) once landed; softmax(o)
    # (publishing P(o) and the max); P(o) @ V, waited, and slot w refilled for o + 2. S(o)
    # runs while the other warpgroup's softmax does, and the slots are refilled a tile
    # apart, not a pair at a time.
    if WG == 0:
        if n_full > 0:  # tile 0: no tile of the other warpgroup before it
            m_i, alpha, l_i = _score_own_tile(
                m_i, l_i, visible, lo, qk_scale_log2, q_smem, qr_smem, k_smem, kr_smem,
                kv_ready, m_smem.index(0), p_ready.index(0), 0, S_L, BLOCK_M, BLOCK_N, NP,
                REUSE, 0,
            )  # fmt: skip
            row2 = _tile_row(Batch, b, lo, 2, n_load, PAGE, BLOCK_N)
            acc = _own_pv(
                acc, alpha, KDesc, KRDesc, row2, k_smem, kr_smem, kv_ready, kv_free, 0, n_load,
                WG, NP, L, O_L,
            )  # fmt: skip
    first = 1 - WG  # WG0's loop starts at its second tile
    for i in range(first, (n_full + 1 - WG) // 2):
        o = 2 * i + WG
        _mark(Trace, b, split, mblk, i, WG, 0)
        # the pool rows of the two refills ahead, read from the table before anything waits
        row_p2 = _tile_row(Batch, b, lo, o + 1, n_load, PAGE, BLOCK_N)
        row_o2 = _tile_row(Batch, b, lo, o + 2, n_load, PAGE, BLOCK_N)
        z = _opaque_zero()  # Hazard: without it every wgmma descriptor is hoisted and spilled
        q_z, qr_z, s_z = q_all.index(z), qr_all.index(z), WG + z
        sc = _scores_own(q_z, k_smem, kv_ready, o, s_z, S_L, BLOCK_M, BLOCK_N, NP, REUSE, WG)
        _mark(Trace, b, split, mblk, i, WG, 1)
        acc, m_i, l_i = _take_other(
            acc, m_i, l_i, k_smem, kr_smem, m_smem, p_ready, o - 1, WG, ROW, O_L
        )
        _mark(Trace, b, split, mblk, i, WG, 2)
        # Hazard: the rest of S(o) waits for the pieces the other warpgroup's refills gate;
        # our P(o - 1) @ V and its refill must not queue behind that wait, or each slot's
        # refill waits for the other slot's landing (the two slots chained)
        acc = warpgroup_mma_wait(0, deps=[acc])
        _other_done(
            KDesc, KRDesc, row_p2, k_smem, kr_smem, kv_ready, kv_free, o - 1, n_load, WG, NP, L
        )
        _mark(Trace, b, split, mblk, i, WG, 3)
        sc = _scores_rest(sc, q_z, qr_z, k_smem, kr_smem, kv_ready, o, s_z, NP, REUSE, WG)
        sc = warpgroup_mma_wait(0, deps=[sc])
        _mark(Trace, b, split, mblk, i, WG, 4)
        m_i, alpha, l_i = _softmax_tile(
            sc, m_i, l_i, visible - (lo + o * BLOCK_N), qk_scale_log2, kr_smem.index(WG),
            m_smem.index(WG), p_ready.index(WG), S_L, BLOCK_N,
        )  # fmt: skip
        _mark(Trace, b, split, mblk, i, WG, 5)
        acc = _own_pv(
            acc, alpha, KDesc, KRDesc, row_o2, k_smem, kr_smem, kv_ready, kv_free, o, n_load,
            WG, NP, L, O_L,
        )  # fmt: skip
        _mark(Trace, b, split, mblk, i, WG, 6)
    # the other warpgroup's last tile, if it has no own tile after it
    if (n_full > 0) & ((n_full - 1) % 2 != WG):
        acc, m_i, l_i = _take_other(
            acc, m_i, l_i, k_smem, kr_smem, m_smem, p_ready, n_full - 1, WG, ROW, O_L
        )
        acc = warpgroup_mma_wait(0, deps=[acc])
    # The split's partial tail, tile t = n_full, after the loop so the loop keeps its
    # registers: its scorer stages it from registers into slot t % 2 once both P(t - 2) @ V
    # retired, and it goes through the same steps as a whole tile (nothing refilled after).
    t = n_full
    if REUSE:  # the compute-only probe: whole tiles only, nothing staged
        pass
    elif hi - lo > t * BLOCK_N:
        if t % 2 == WG:
            mbarrier.wait(kv_free.index(WG), ((t - 2) // 2) & 1, pred=t >= 2)
            _stage_tail(
                Pool, Batch, b, lo + t * BLOCK_N, hi, k_smem.index(WG), kr_smem.index(WG),
                kv_ready, WG, NP, L, R, PAGE, BLOCK_N,
            )  # fmt: skip
            m_i, alpha, l_i = _score_own_tile(
                m_i, l_i, visible, lo + t * BLOCK_N, qk_scale_log2, q_smem, qr_smem, k_smem,
                kr_smem, kv_ready, m_smem.index(WG), p_ready.index(WG), t, S_L, BLOCK_M,
                BLOCK_N, NP, REUSE, WG,
            )  # fmt: skip
            acc = _pv_own_waited(acc, alpha, k_smem, kr_smem, WG, O_L)
        else:
            acc, m_i, l_i = _take_other(
                acc, m_i, l_i, k_smem, kr_smem, m_smem, p_ready, t, WG, ROW, O_L
            )
            acc = warpgroup_mma_wait(0, deps=[acc])

    # each warpgroup summed P over the tiles it scored, with the same rescaling: add them
    l_smem.index(WG).store(l_i)
    mbarrier.arrive(l_bar.index(0), count=1)
    mbarrier.wait(l_bar.index(0), 0)
    l_tot = l_smem.index(0).load(ROW) + l_smem.index(1).load(ROW)
    out, lse = _normalise(acc, m_i, l_tot, O_L, False)
    rows_o = mblk * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, O_L))
    offs_o = WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, O_L))
    _store_rows(
        Dest,
        out,
        lse,
        rows_o,
        offs_o,
        rows_s,
        q_start,
        q_len,
        split,
        H,
        L,
        NUM_SPLITS,
        WG == 0,
        False,
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
    PROBE: gl.constexpr = 0,
    Trace=None,
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
    NP: gl.constexpr = L // KDesc.block_type.shape[1]  # latent pieces a tile
    kv_ready = gl.allocate_shared_memory(gl.int64, [2 * (NP + 1), 1], bar_l)  # slot x piece
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    kv_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l)
    l_bar = gl.allocate_shared_memory(gl.int64, [1, 1], bar_l)
    for i in gl.static_range(2 * (NP + 1)):
        mbarrier.init(kv_ready.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(kv_free.index(i), count=2)
    mbarrier.init(l_bar.index(0), count=2)
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    m_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], vec)
    l_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], vec)
    fence_async_shared()
    for i in gl.static_range(2):
        row = _tile_row(Batch, b, lo, i, n_full, PAGE, BLOCK_N)
        _issue_pieces(KDesc, KRDesc, k_smem, kr_smem, kv_ready, row, i, n_full, 0, NP + 1, NP, L)

    # Query rows (token, head), head fastest; rows past the request are zero.
    LD_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    QNope, QRope, stride_qn_t, stride_qn_h, stride_qr_t, stride_qr_h = Q
    rows_ld = mblk * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LD_L))
    ok_ld = rows_ld < q_len * H
    t_ld = (q_start + rows_ld // H).to(gl.int64)
    h_ld = rows_ld % H
    offs_c = gl.arange(0, 128, layout=gl.SliceLayout(0, LD_L))
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, LD_L))
    # Q in a one-slot buffer: the loop takes its views at an index it cannot fold
    # (`_opaque_zero`), which a plain allocation has no way to take
    q_all = gl.allocate_shared_memory(
        dtype, [1, BLOCK_M, L], gl.NVMMASharedLayout.get_default_for([BLOCK_M, L], dtype)
    )
    q_smem = q_all.index(0)
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
    qr_all = gl.allocate_shared_memory(
        dtype, [1, BLOCK_M, R], gl.NVMMASharedLayout.get_default_for([BLOCK_M, R], dtype)
    )
    qr_all.index(0).store(qr)
    fence_async_shared()

    bars = (kv_ready, p_ready, kv_free, l_bar)
    gl.warp_specialize(
        [
            (
                _warpgroup,
                (Pool, Batch, Dest, KDesc, KRDesc, qk_scale_log2, q_all, qr_all, k_smem,
                 kr_smem, m_smem, l_smem, bars, H, L, R, PAGE, BLOCK_M, BLOCK_N, NUM_SPLITS, 0,
                 PROBE, Trace),
            ),
            (
                _warpgroup,
                (Pool, Batch, Dest, KDesc, KRDesc, qk_scale_log2, q_all, qr_all, k_smem,
                 kr_smem, m_smem, l_smem, bars, H, L, R, PAGE, BLOCK_M, BLOCK_N, NUM_SPLITS, 1,
                 PROBE, Trace),
            ),
        ],
        [4],
        [240],
    )  # fmt: skip


# `mla_attention_gluon.launch(..., kernel=KERNEL, extra=EXTRA, k_box=K_BOX)` launches it:
# four warps a partition, the default one and one worker (`gl.warp_specialize`), 240
# registers a thread, no spills with triton 3.6 (`_opaque_zero`). Hazard: the loop has no
# registers to spare: when its wgmma descriptors were still hoisted, code added inside it
# moved ~30 more spill stores into it and cost 12-19 % (BENCHMARKS.md, twenty-first
# session): keep rare paths, like the tail tile, outside it.
KERNEL = _seesaw_kernel
EXTRA = {"num_warps": 4, "maxnreg": 240}
# the latent TMA box: half a row (two pieces a tile, refilled apart); 128 and 64 (four and
# eight pieces, FlashMLA's boxes) ran 0.93-1.05x on the spill-free kernel (H200, BENCHMARKS.md,
# forty-fifth session)
K_BOX = 256
