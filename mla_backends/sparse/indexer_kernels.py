"""Triton kernels of the lightning indexer: the fused K store (RoPE, Hadamard rotation, e4m3
quantisation, page-major write) and the logits over each token's paged context (one kernel
for decode, verify and prefill: a program is one query token and BLOCK_N of its keys, all
index heads in one dot). Same maths as `indexer.prepare_k` / `logits_reference`."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from mla_backends.arith import cdiv, next_pow2
from mla_backends.checks import check_tensor, unit_stride
from mla_backends.kernels.common import dot_precision, interpreting, num_sms
from mla_backends.kernels.pdl import launch_next, pdl_args, wait_previous
from mla_backends.kernels.store import _finite_abs, _pow2_ceil, _round_e4m3, _slot_or_dummy
from mla_backends.sparse.index_k import PAGE, IndexerDims, IndexKCache
from mla_backends.sparse.topk_kernel import _count_digit, check_counts, check_rows

PAGE_C = tl.constexpr(PAGE)
ZERO_SHARE = 4096  # counters a program of the q prep zeroes at most (`prepare_q_fused`)


@triton.jit
def _rope_rows(rows, r_ok, cs_row, Cos, Sin, D: tl.constexpr, HALF: tl.constexpr):
    """Rows [BLOCK, D] at pointers `rows` (activation dtype), half-split RoPE on the first
    2 * HALF dims with cos / sin of row offsets `cs_row` -> fp32 values rounded to the
    activation dtype (the reference rotates in that dtype), and that dtype's zero."""
    d = tl.arange(0, D)
    in_rope = d < 2 * HALF
    first = d < HALF
    partner = tl.where(first, d + HALF, d - HALF)
    freq = tl.where(first, d, d - HALF)
    x = tl.load(rows[:, None] + d[None, :], mask=r_ok[:, None], other=0.0)
    zero = tl.zeros([1], x.dtype)
    xf = x.to(tl.float32)
    rope_ok = r_ok[:, None] & in_rope[None, :]
    xp = tl.load(rows[:, None] + partner[None, :], mask=rope_ok, other=0.0).to(tl.float32)
    cs = cs_row[:, None] + freq[None, :]
    c = tl.load(Cos + cs, mask=rope_ok, other=1.0).to(tl.float32)
    s = tl.load(Sin + cs, mask=rope_ok, other=0.0).to(tl.float32)
    y = tl.where(first[None, :], xf * c - xp * s, xf * c + xp * s)
    return tl.where(in_rope[None, :], y, xf).to(x.dtype).to(tl.float32), zero


@triton.jit
def _rotate_quant(y, zero, D: tl.constexpr, LOWP_DOT: tl.constexpr, EXACT_FP8_ROUND: tl.constexpr):
    """fp32 rows [BLOCK, D] (values of the activation dtype of `zero`) -> (e4m3 values as
    fp32, power-of-two scale per row): Hadamard rotation rounded to the activation dtype,
    then one block of D per row, as `quant.block_quant(hadamard(x).to(act), D)`."""
    d = tl.arange(0, D)
    # Hadamard as a dot with the +-1 Sylvester matrix: H[i, j] = (-1) ** popcount(i & j).
    bits = d[:, None] & d[None, :]
    bits = bits ^ (bits >> 8)
    bits = bits ^ (bits >> 4)
    bits = bits ^ (bits >> 2)
    bits = bits ^ (bits >> 1)
    h = tl.where((bits & 1) == 1, -1.0, 1.0)
    act = zero.dtype
    if LOWP_DOT:  # +-1 and the activations are exact in their dtype: exact products
        y = tl.dot(y.to(act), h.to(act), out_dtype=tl.float32)
    else:
        y = tl.dot(y, h, input_precision="ieee")
    y = (y * (1.0 / tl.sqrt(D * 1.0))).to(act).to(tl.float32)
    amax = tl.maximum(tl.max(_finite_abs(y), 1), 1e-4)
    scale = _pow2_ceil(tl.math.div_rn(amax, 448.0))
    y = tl.clamp(y * (1.0 / scale)[:, None], -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    if EXACT_FP8_ROUND:
        y = _round_e4m3(y)
    return y, scale


@triton.jit
def _store_kernel(
    K,
    Cos,
    Sin,
    Loc,
    Data,
    Scale,
    n_tokens,
    num_slots,
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
    t64 = t.to(tl.int64)
    y, zero = _rope_rows(K + t64 * stride_k, t_ok, t64 * stride_cs, Cos, Sin, D, HALF)
    slot = _slot_or_dummy(tl.load(Loc + t, mask=t_ok, other=0).to(tl.int64), num_slots)
    blk = slot // PAGE_C
    off = slot % PAGE_C
    scale = tl.full([BLOCK_T], 1.0, tl.float32)
    if QUANT:
        y, scale = _rotate_quant(y, zero, D, LOWP_DOT, EXACT_FP8_ROUND)
    d = tl.arange(0, D)
    dst = Data + (blk * BLK_E + off * D)[:, None] + d[None, :]
    tl.store(dst, y.to(Data.dtype.element_ty), mask=t_ok[:, None])
    tl.store(Scale + blk * BLK_S + SCALE_OFF + off, scale, mask=t_ok)


@triton.jit
def _prep_q_kernel(
    Q,
    W,
    Cos,
    Sin,
    Out,
    WOut,
    n_rows,
    stride_q_t,
    stride_q_h,
    stride_w,
    stride_cs,
    weight_scale,
    Zero,
    n_zero,
    HI: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    QUANT: tl.constexpr,
    LOWP_DOT: tl.constexpr,
    EXACT_FP8_ROUND: tl.constexpr,
    ZERO_BLOCK: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """One program: BLOCK_R (token, head) rows of q, row r = token * HI + head (none past
    n_rows: the grid may hold more programs, for the zeroing); and its share of the n_zero
    int32 at Zero (the top-k's counters, `zero=`) set to 0."""
    wait_previous(USE_GDC)
    # Released after the wait, not before: every kernel before this one has then finished,
    # so the logits kernel may read the index keys, slots and visible counts before its own
    # wait (`index_logits(early_keys=True)`, the indexer's call).
    launch_next(USE_GDC)
    # Zeroed after the wait: the counters' memory may be a buffer an earlier kernel still
    # used. The top-k reads them two launches later: its wait covers the logits kernel, whose
    # own wait covers this one.
    share = tl.cdiv(n_zero, tl.num_programs(0))
    end = tl.minimum(n_zero, (tl.program_id(0) + 1) * share)
    for z in range(tl.program_id(0) * share, end, ZERO_BLOCK):
        i = z + tl.arange(0, ZERO_BLOCK)
        tl.store(Zero + i, tl.zeros([ZERO_BLOCK], tl.int32), mask=i < end)
    if tl.program_id(0) * BLOCK_R < n_rows:
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = r < n_rows
        t = (r // HI).to(tl.int64)
        h = r % HI
        rows = Q + t * stride_q_t + h * stride_q_h
        y, zero = _rope_rows(rows, r_ok, t * stride_cs, Cos, Sin, D, HALF)
        w = tl.load(W + t * stride_w + h, mask=r_ok, other=0.0).to(tl.float32) * weight_scale
        if QUANT:
            y, scale = _rotate_quant(y, zero, D, LOWP_DOT, EXACT_FP8_ROUND)
            w = w * scale
        d = tl.arange(0, D)
        r64 = r.to(tl.int64)
        out = Out + r64[:, None] * D + d[None, :]
        tl.store(out, y.to(Out.dtype.element_ty), mask=r_ok[:, None])
        tl.store(WOut + r64, w, mask=r_ok)


def prepare_q_fused(
    dims: IndexerDims,
    q: torch.Tensor,
    w: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    zero: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`indexer.prepare_q` in one launch (it is ~10 small torch kernels, 0.1 ms of a decode
    step on an H100): q [T, Hi, D], w [T, Hi], cos / sin [T, R / 2] -> (q [T, Hi, D] e4m3
    codes or fp32, head weights [T, Hi] fp32 with the scales folded in). `zero`: a contiguous
    int32 tensor set to 0 by the same launch (the top-k's counters: a decode step then has no
    fill kernel of its own in front of its indexer, ~1 us at batch 1 on an H100)."""
    if zero is not None and (zero.dtype != torch.int32 or not zero.is_contiguous()):
        raise ValueError(
            f"prepare_q_fused: zero must be contiguous int32, got {zero.dtype} "
            f"{'contiguous' if zero.is_contiguous() else 'strided'}"
        )
    check_tensor("q", q, (-1, -1, dims.head_dim))
    t, hi, d = q.shape
    if w.shape != (t, hi):  # the kernel reads w by its strides: a short one past its end
        raise ValueError(f"prepare_q_fused: w must be [T, Hi] = [{t}, {hi}], got {list(w.shape)}")
    out = torch.empty(t, hi, d, dtype=torch.float8_e4m3fn if dims.quantized else torch.float32,
                      device=q.device)  # fmt: skip
    w_out = torch.empty(t, hi, dtype=torch.float32, device=q.device)
    if t == 0:
        if zero is not None:
            zero.zero_()
        return out, w_out
    q = unit_stride(q)
    cos, sin = cos.contiguous(), sin.contiguous()
    block_r = 16
    n_zero = 0 if zero is None else zero.numel()
    # at most ZERO_SHARE counters a program: the top-k's wide counters (256 KB a row at batch
    # 1, `topk_kernel.new_counts`) over the 4 programs of a batch-1 q would keep each storing
    # 64 KB, at one SM's share of bandwidth, while the logits wait for this launch to end
    grid = max(cdiv(t * hi, block_r), cdiv(n_zero, ZERO_SHARE))
    _prep_q_kernel[(grid,)](
        q,
        w,
        cos,
        sin,
        out,
        w_out,
        t * hi,
        q.stride(0),
        q.stride(1),
        w.stride(0),
        cos.stride(0),
        dims.weight_scale,
        w_out.view(torch.int32) if zero is None else zero,  # not written at n_zero 0
        n_zero,
        HI=hi,
        D=d,
        HALF=cos.shape[1],
        BLOCK_R=block_r,
        QUANT=dims.quantized,
        LOWP_DOT=q.dtype in (torch.bfloat16, torch.float16) and not interpreting(),
        EXACT_FP8_ROUND=dims.quantized and interpreting(),
        ZERO_BLOCK=1024,
        num_warps=4,
        **pdl_args(q.device),
    )
    return out, w_out


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
    """k [T, D] (k_norm(wk(x)), before RoPE), cos / sin [T, R / 2], loc [T] slots (outside
    the cache: the dummy slot 0, as the latent pool's stores)."""
    t, d = k.shape
    bad_rope = cos.dim() != 2 or cos.shape != sin.shape or 2 * cos.shape[1] > d
    if d != cache.head_dim or bad_rope or cos.shape[0] != t or loc.shape != (t,):
        raise ValueError(
            f"store_index_k: k [T, {cache.head_dim}] (the cache's head_dim), cos / sin [T, R / 2] "
            f"and loc [T], got k {tuple(k.shape)}, cos {tuple(cos.shape)}, sin "
            f"{tuple(sin.shape)}, loc {tuple(loc.shape)}"
        )
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
        cache.num_blocks * PAGE,
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
    Counts,
    width,
    stride_q_t,
    stride_q_h,
    stride_w,
    stride_r2t,
    stride_o,
    stride_c,
    HI: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLK_E: tl.constexpr,
    BLK_S: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_F16: tl.constexpr,
    PRECISION: tl.constexpr,
    LOOP: tl.constexpr,
    USE_GDC: tl.constexpr,
    COUNT: tl.constexpr = False,
):
    """Program (t, j): block j of token t; with LOOP, blocks j, j + G, ... (G = programs along
    axis 1), the next block's slots loaded while one is scored, then -inf stored over the
    blocks past the token's visible keys without a key read. Blocks past the visible keys
    hold -inf either way. COUNT: each block's keys counted for the top-k as well (its
    pass 0, `topk_kernel._count_digit`, into Counts[t])."""
    wait_previous(USE_GDC)
    t = tl.program_id(0).to(tl.int64)
    vis = tl.load(Vis + t)
    if LOOP:
        # Hazard: rows may be int32 (a request index): widened before the multiply, or row x
        # max_context_len past 2^31 wraps (4096 rows of a 1M context read row 0's slots).
        r2t_row = R2T + tl.load(Rows + t).to(tl.int64) * stride_r2t
        g = tl.num_programs(1)
        visible_blocks = tl.cdiv(vis, BLOCK_N)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        slot = tl.load(r2t_row + n, mask=n < vis, other=0)
        for j in tl.range(tl.program_id(1), visible_blocks, g, num_stages=1):
            n = j * BLOCK_N + tl.arange(0, BLOCK_N)
            # the next block's slots in flight while this one is scored
            n_next = n + g * BLOCK_N
            slot_next = tl.load(r2t_row + n_next, mask=n_next < vis, other=0)
            logit = _block_logits(Q, W, Data, Scale, t, slot, n, vis, stride_q_t, stride_q_h,
                                  stride_w, HI, D, BLOCK_H, BLK_E, BLK_S, SCALE_OFF, DOT_F32,
                                  DOT_F16, PRECISION)  # fmt: skip
            tl.store(Out + t * stride_o + n, logit, mask=n < width)
            if COUNT:  # the top-k's pass 0, over the keys stored
                stored = tl.where(n < width, logit, float("-inf"))
                _count_digit(stored, Counts + t * stride_c, 0, 0, BLOCK_N)
            slot = slot_next
        past = tl.program_id(1) + tl.maximum(tl.cdiv(visible_blocks - tl.program_id(1), g), 0) * g
        for j in tl.range(past, tl.cdiv(width, BLOCK_N), g, num_stages=1):
            n = j * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(Out + t * stride_o + n, tl.full([BLOCK_N], float("-inf"), tl.float32),
                     mask=n < width)  # fmt: skip
    else:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        out = Out + t * stride_o + n
        if tl.program_id(1) * BLOCK_N >= vis:
            tl.store(out, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=n < width)
            launch_next(USE_GDC)
            return
        row = tl.load(Rows + t).to(tl.int64)  # int32 rows: see the LOOP branch
        # Masked: keys past the context are never read (stale or NaN-poisoned rows stay out).
        slot = tl.load(R2T + row * stride_r2t + n, mask=n < vis, other=0)
        logit = _block_logits(Q, W, Data, Scale, t, slot, n, vis, stride_q_t, stride_q_h,
                              stride_w, HI, D, BLOCK_H, BLK_E, BLK_S, SCALE_OFF, DOT_F32,
                              DOT_F16, PRECISION)  # fmt: skip
        tl.store(out, logit, mask=n < width)
        if COUNT:  # the top-k's pass 0, over the keys stored
            stored = tl.where(n < width, logit, float("-inf"))
            _count_digit(stored, Counts + t * stride_c, 0, 0, BLOCK_N)
    # Late, not at the start: at long contexts this grid runs in waves, and the top-k's
    # programs released early would sit on the SMs the later waves need.
    launch_next(USE_GDC)


@triton.jit
def _block_logits(
    Q,
    W,
    Data,
    Scale,
    t,
    slot,
    n,
    vis,
    stride_q_t,
    stride_q_h,
    stride_w,
    HI: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLK_E: tl.constexpr,
    BLK_S: tl.constexpr,
    SCALE_OFF: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_F16: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Token t's logits at key positions n [BLOCK_N] (their pool slots: `slot`), -inf from vis
    on."""
    n_ok = n < vis
    slot = slot.to(tl.int64)
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
    if DOT_F16:
        # Hazard: Hopper's FP8 MMA accumulates with fewer mantissa bits than fp32 (5.6e-4
        # absolute on logits of 3.3 seen on an H100). e4m3 codes are exact in fp16, whose MMA
        # accumulates in fp32: the logits are then the fp32 maths up to summation order.
        # fp16, not bf16: Hopper converts e4m3 pairs to fp16 in one instruction (bf16 cost
        # the logits 30-40 % on an H100).
        q = q.to(tl.float16)
        k = k.to(tl.float16)
    # Keys as the MMA's rows, [BLOCK_N, BLOCK_H]: the converted K tile is the A operand,
    # taken from registers, and only q goes through shared memory. With q as the rows the K
    # tile was staged through shared memory on every program: 13-21 % slower at batch 16-64
    # (H100, BENCHMARKS.md, tenth session).
    s = tl.dot(k, tl.trans(q), input_precision=PRECISION)
    logit = tl.sum(tl.maximum(s, 0.0) * w[None, :], 1) * ks
    return tl.where(n_ok, logit, float("-inf"))


# A CUDA graph's logits are as wide as the longest context its pool takes; with one program
# a 128-key block most programs then only store -inf (B64 at 16k in a 128k pool: 57344 of
# 65536), each holding an SM's slot a while: the logits took 163 us there against 96 at the
# context's width. Looping programs, LOOP_PROGRAMS an SM in all, took 109 (H100, BENCHMARKS.md,
# tenth session); at the context's width they were 2-5 % slower at B64 and 3 % faster at B16.
LOOP_PROGRAMS = 12
LOOP_MAXNREG = 168


def loop_programs(t: int, device: torch.device) -> int:
    """Programs a token of the looping logits kernel: LOOP_PROGRAMS an SM over the T tokens
    (two in the interpreter, so that CPU tests loop)."""
    if interpreting() or device.type != "cuda":
        return 2
    return cdiv(LOOP_PROGRAMS * num_sms(device), t)


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
    loop: bool = False,
    kernel: str = "auto",
    early_keys: bool = False,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hi, D] (e4m3 codes, or fp32 unquantised), w [T, Hi] fp32, rows [T], visible [T]
    -> logits [T, width] fp32, -inf at keys >= visible. `kernel`: "auto" (the Gluon kernel,
    `sparse/indexer_gluon.py`, where it takes the call: SM90, e4m3 keys of D 128, up to 64
    index heads; else the Triton kernel below), "triton" or "gluon" (raises where it cannot
    run or fails to build). Triton kernel only: `block_n` (keys a program; given, "auto"
    takes the Triton kernel) and `loop`: a few programs a token, each looping over its blocks
    (`loop_programs`), for a width far above the visible keys (a CUDA graph's); else one
    program a block. The Gluon kernel's programs always loop. `early_keys`: the Gluon kernel
    starts streaming the keys before its programmatic wait for q, which is safe only when the
    launch just before this one released it after its own wait and wrote none of the keys,
    slots or visible counts (in `Indexer.select`: the q prep, `prepare_q_fused`, or for a
    later prefill chunk the last chunk's top-k). `counts`: the top-k's zeroed counters
    (`topk_kernel.new_counts`), into which either kernel adds its keys' first digit counts
    (the top-k's pass 0) for a top-k told `counted`; zeroed before this launch (the
    indexer's q prep does it)."""
    if kernel not in ("auto", "triton", "gluon"):
        raise ValueError(f"index_logits: kernel must be auto, triton or gluon, got {kernel!r}")
    if q.dim() != 3 or q.shape[2] != cache.head_dim or w.shape != q.shape[:2]:
        raise ValueError(
            f"index_logits: q [T, Hi, {cache.head_dim}] (the cache's head_dim) and w [T, Hi], "
            f"got q {tuple(q.shape)}, w {tuple(w.shape)}"
        )
    check_rows("index_logits", q.shape[0], width, req_to_token, rows, visible)
    count, stride_c = _count_args(counts, q.shape[0], visible)
    if kernel == "gluon" and block_n is not None:
        raise ValueError("index_logits: block_n is the Triton kernel's; kernel='gluon' takes none")
    if kernel == "gluon" or (kernel == "auto" and block_n is None):
        args = (cache, layer, q, w, req_to_token, rows, visible, width)
        out = _gluon_logits(args, kernel, early_keys, counts)
        if out is not None:
            return out
    t, hi, d = q.shape
    out = torch.empty(t, width, dtype=torch.float32, device=q.device)
    if t == 0 or width == 0:
        return out
    interp = interpreting()
    if block_n is None:
        # 128 keys a program: on an H100 (fp16 MMA, keys as the rows) 0.174 ms at 128k B16
        # against 0.184 at 64 keys and 0.244 at 256 with 8 warps (benchmarks/
        # sparse-indexer-logits-keys-m-h100-s10.json)
        block_n = 16 if interp else 128
    data, scale, consts = _flat_views(cache, layer)
    q = q if q.stride(-1) == 1 else q.contiguous()
    blocks = cdiv(width, block_n)
    programs = min(blocks, loop_programs(t, q.device)) if loop else blocks
    looping = programs < blocks  # one program a block when a token's blocks are few
    _logits_kernel[(t, programs)](
        q,
        w,
        data,
        scale,
        req_to_token,
        rows,
        visible,
        out,
        count,
        width,
        q.stride(0),
        q.stride(1),
        w.stride(0),
        req_to_token.stride(0),
        out.stride(0),
        stride_c,
        HI=hi,
        D=d,
        BLOCK_H=max(16, next_pow2(hi)),
        BLOCK_N=block_n,
        COUNT=counts is not None,
        DOT_F32=interp,
        DOT_F16=not interp and q.dtype == torch.float8_e4m3fn,
        PRECISION=dot_precision(q.dtype),
        LOOP=looping,
        num_warps=4,
        **consts,
        **pdl_args(q.device),
        # the looping kernel compiles to ~190 registers a thread, two programs an SM; capped
        # at 168 (~100 B of spills) three fit, as for one program a block (160)
        **({"maxnreg": LOOP_MAXNREG} if looping and not interp else {}),
    )
    return out


def _count_args(
    counts: torch.Tensor | None, t: int, dummy: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """(counters, row stride) for the logits kernels' counting; with no counters a dummy
    int32 pointer (never read: the kernels count only when given counters)."""
    if counts is None:
        return dummy, 0
    check_counts(counts, t, "index_logits")
    return counts, counts.stride(0)


def _gluon_logits(
    args: tuple[Any, ...], kernel: str, early_keys: bool, counts: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The Gluon kernel's logits where it takes the call (the Gluon route open, `indexer_gluon
    .usable`), else None (`kernel` "gluon": a ValueError instead). A failure to build or launch
    it turns the Gluon route off for the process (`mla_attention.gluon_failed`) and the Triton
    kernel takes the call; bad arguments (ValueError) and a full GPU memory raise. `args`:
    `index_logits`' first eight arguments."""
    from mla_backends.kernels.mla_attention import gluon_error, gluon_failed, gluon_module

    cache, q = args[0], args[2]
    ig = gluon_module(q, "mla_backends.sparse.indexer_gluon")
    if ig is None or not ig.usable(cache, q):
        if kernel == "gluon":
            why = gluon_error()
            raise ValueError(
                f"index_logits: the Gluon kernel is off in this process ({why})"
                if why
                else "index_logits: the Gluon kernel takes e4m3 index keys of D 128 and up "
                f"to 64 heads on an SM90: got q {q.dtype} {tuple(q.shape)} on {q.device}"
            )
        return None
    try:
        return ig.index_logits(*args, early_keys=early_keys, counts=counts)
    except (ValueError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # a compile or launch failure: the Triton kernel takes the call
        gluon_failed(f"{type(e).__name__}: {e}")
        if kernel == "gluon":
            raise RuntimeError(f"index_logits: the Gluon kernel failed: {e}") from e
        return None
