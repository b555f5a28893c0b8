"""Absorbed MLA attention over the paged latent cache, in Triton (decode, verify, extend).

A program owns one request, one block of BLOCK_M query rows and one KV split. Query rows are
(token, head) pairs of the request, head fastest: all heads of a request share the program,
so each split reads a latent tile once and uses it twice (QK^T over L + R, then P @ V over
L). Causality is per row: query j of n sees `seq_len - n + j + 1` keys (bottom-right).

With NUM_SPLITS > 1 each program writes a partial (out, lse) and `_merge_kernel` reduces
them with log-sum-exp; with one split the program writes the final result directly.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from mla_backends.arith import cdiv
from mla_backends.kernels import tuning
from mla_backends.kernels.common import interpreting, num_sms
from mla_backends.kernels.pdl import launch_next, pdl_args, wait_previous

logger = logging.getLogger(__name__)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
SMEM_SM90 = 232448  # bytes of shared memory one block may opt into on an H100 / H200
# The Gluon kernel (mla_attention_gluon.py) needs the Gluon API of Triton 3.6 or newer (names
# that moved since 3.6 are resolved there, once, at import).
_GLUON_API = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 6)
# Query rows a CTA of the narrow Gluon kernel (mla_attention_narrow.py), the N side of its
# MMAs: 16 covers H16 decode, 32 H16 verify and H32 decode. Wider requests fill the 64-row
# kernel's M side.
NARROW_ROWS = (16, 32)


@triton.jit
def _online_softmax(acc, m_i, l_i, s):
    """One online-softmax step on scores s (log2 domain) -> (acc, m_i, l_i, p).
    Rows with no visible key so far keep m = -inf; exp2 is taken against 0 for them so no
    -inf - -inf NaN appears. (A lazy-rescale variant that skips the [M, L] accumulator
    rescale measured slower on H200: the data-dependent branch breaks Triton's pipelining.)"""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    return acc, m_new, l_i, p


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    qa,
    qb,
    ka,
    kb,
    v,
    n,
    visible,
    qk_scale_log2,
    MASKED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One BLOCK_N tile of keys for all query rows: scores as two dots (MLA: latent L + rope
    R; MHA prefill: the qk dim split 128 + 64), key n visible to a row while n < visible
    (when MASKED), online softmax, P @ V (in MLA, V is the latent tile itself)."""
    s = tl.dot(qa, tl.trans(ka), input_precision=PRECISION)
    s = tl.dot(qb, tl.trans(kb), acc=s, input_precision=PRECISION)
    s = s * qk_scale_log2
    if MASKED:
        s = tl.where(n[None, :] < visible[:, None], s, float("-inf"))
    acc, m_i, l_i, p = _online_softmax(acc, m_i, l_i, s)
    acc = tl.dot(p.to(v.dtype), v, acc=acc, input_precision=PRECISION)
    return acc, m_i, l_i


@triton.jit
def _mla_attn_kernel(
    Q,
    Pool,
    KDesc,
    KRDesc,
    Batch,
    Dest,
    qk_scale_log2,
    out_scale,
    H: tl.constexpr,
    L: tl.constexpr,
    R: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_F16: tl.constexpr,
    PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    """The leading arguments `decode_args` builds (the Gluon kernel takes the same)."""
    QNope, QRope, stride_qn_t, stride_qn_h, stride_qr_t, stride_qr_h = Q
    KV, stride_kv = Pool
    Table, stride_tab, QoIndptr, SeqLens = Batch
    Out, Lse, PartOut, PartLse, stride_o_t, stride_o_h, stride_lse_t = Dest
    # Head blocks of one request are the fastest grid axis: they run together and share
    # each latent tile through L2 instead of reading it from HBM once per head block.
    mblk = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(QoIndptr + b)
    q_len = tl.load(QoIndptr + b + 1) - q_start
    if mblk * BLOCK_M >= q_len * H:
        return
    seq = tl.load(SeqLens + b)

    rows = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len * H
    tok = rows // H
    head = rows % H
    visible = tl.minimum(tl.maximum(seq - q_len + tok + 1, 0), seq)
    # keys any row of this block may see: [0, kv_end)
    last_tok = tl.minimum(mblk * BLOCK_M + BLOCK_M - 1, q_len * H - 1) // H
    kv_end = tl.minimum(tl.maximum(seq - q_len + last_tok + 1, 0), seq)
    chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_end)

    offs_l = tl.arange(0, L)
    offs_r = tl.arange(0, R)
    t_idx = (q_start + tok).to(tl.int64)
    qn = tl.load(
        QNope + t_idx[:, None] * stride_qn_t + head[:, None] * stride_qn_h + offs_l[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    qr = tl.load(
        QRope + t_idx[:, None] * stride_qr_t + head[:, None] * stride_qr_h + offs_r[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if DOT_F32:
        qn = qn.to(tl.float32)
        qr = qr.to(tl.float32)
    elif DOT_F16:
        # FP8 KV at 16 / 32 query rows: e4m3 -> fp16 is exact and one instruction a pair on
        # SM89+ (to bf16 it goes through fp32); P and the latent keep more bits in fp16. H100:
        # H16 10-17% faster; at 64 rows (H128) 27-40% slower, so those keep bf16 (BENCHMARKS.md,
        # "Hopper decode table"). Hazard: a query entry beyond fp16's range (|q| > 65504)
        # would turn inf here.
        qn = qn.to(tl.float16)
        qr = qr.to(tl.float16)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, L], tl.float32)
    gather_lo = lo
    if TMA:
        # Whole tiles inside one page through TMA (multi-buffered, mbarrier-tracked); every
        # key they hold is below hi <= seq, so none is stale. The partial tail tile, whose
        # rows past hi may hold anything (NaN poison included), takes the masked path below.
        gather_lo = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
        for start in range(lo, gather_lo, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            page = tl.load(Table + b * stride_tab + start // PAGE)
            row = page * PAGE + start % PAGE
            k = KDesc.load([row, 0]).to(qn.dtype)
            kr = KRDesc.load([row, L]).to(qr.dtype)
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, qn, qr, k, kr, k, n, visible, qk_scale_log2, True, PRECISION
            )
    for start in range(gather_lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        page = tl.load(Table + b * stride_tab + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        slot = page * PAGE + n % PAGE
        # Masked loads give 0 for keys past the range, so NaN-poisoned or stale rows are
        # never read, and never reach P @ V.
        k = tl.load(KV + slot[:, None] * stride_kv + offs_l[None, :], mask=n_ok[:, None], other=0.0)
        kr = tl.load(
            KV + slot[:, None] * stride_kv + L + offs_r[None, :], mask=n_ok[:, None], other=0.0
        )
        k = k.to(qn.dtype)
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, qn, qr, k, kr.to(qr.dtype), k, n, visible, qk_scale_log2, True, PRECISION
        )

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (out_scale / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    if NUM_SPLITS == 1:
        o_ptr = Out + t_idx[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_l[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
        tl.store(Lse + t_idx * stride_lse_t + head, lse, mask=row_ok)
    else:
        prow = (q_start * H + rows).to(tl.int64) * NUM_SPLITS + split
        tl.store(PartOut + prow[:, None] * L + offs_l[None, :], out, mask=row_ok[:, None])
        tl.store(PartLse + prow, lse, mask=row_ok)


@triton.jit
def _split_weights(lse, AXIS: tl.constexpr):
    """The splits' partial LSEs (natural log) along AXIS -> (m, total, lse_out): their max
    (0 where every split is empty, so exp(lse - m) stays 0 for empty splits rather than
    NaN), the sum of exp(lse - m), and the merged LSE (-inf where every split is empty).
    The weight of split s is exp(lse_s - m) / total (total 0 only where lse_out is -inf;
    divide by `tl.where(total == 0.0, 1.0, total)`). One definition for the merge kernel
    and the sparse kernel's merge inside its launch."""
    m = tl.max(lse, AXIS)
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(lse - tl.expand_dims(m, AXIS)), AXIS)
    lse_out = tl.where(total == 0.0, float("-inf"), m + tl.log(tl.where(total == 0.0, 1.0, total)))
    return m, total, lse_out


@triton.jit
def _merge_kernel(
    PartOut,
    PartLse,
    Out,
    Lse,
    stride_o_t,
    stride_o_h,
    stride_lse_t,
    H: tl.constexpr,
    L: tl.constexpr,
    BLOCK_L: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    CHUNK: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """One (token, head) row's BLOCK_L columns: the splits' partials weighted by
    exp(lse - max), CHUNK splits at a time (`merge_blocks`: each chunk is a round trip to L2
    the next one waits for). Column blocks are programs of their own so that a batch of few
    rows still spreads its partials' reads over many SMs."""
    launch_next(USE_GDC)
    wait_previous(USE_GDC)  # the partials come from the attention kernel just before
    row = tl.program_id(0).to(tl.int64)  # token * H + head
    t = row // H
    h = row % H
    offs_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    m, total, lse_out = _split_weights(
        tl.load(PartLse + row * NUM_SPLITS + tl.arange(0, NUM_SPLITS)), 0
    )
    acc = tl.zeros([BLOCK_L], dtype=tl.float32)
    for c in tl.static_range(0, NUM_SPLITS, CHUNK):
        offs_s = c + tl.arange(0, CHUNK)
        w = tl.exp(tl.load(PartLse + row * NUM_SPLITS + offs_s) - m)
        parts = tl.load(PartOut + (row * NUM_SPLITS + offs_s)[:, None] * L + offs_l[None, :])
        acc += tl.sum(parts * w[:, None], 0)
    out = acc / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + t * stride_o_t + h * stride_o_h + offs_l, out.to(Out.dtype.element_ty))
    if tl.program_id(1) == 0:
        tl.store(Lse + t * stride_lse_t + h, lse_out)


def smem_bytes(
    block_m: int, block_n: int, num_stages: int, tma: bool, width: int, elem: int
) -> int:
    """Shared memory `_mla_attn_kernel` takes at most, for rows `width` (L + R) wide and dot
    operands of `elem` bytes: the query tile and the key tile staged for the dots (with TMA,
    `num_stages` key tiles in flight), P for P @ V on the gather path, 1 KB of barriers and
    page ids. An upper bound of what Triton 3.6-3.9 allocate on SM90, checked against
    compiled kernels (tests/test_triton.py::test_fp32_decode_configs_fit_sm90_shared_memory);
    the gather path does not multi-buffer the key tiles there."""
    keys = block_n * (num_stages if tma else 1)
    return (block_m + keys) * width * elem + (0 if tma else block_m * block_n * 4) + 1024


def tma_ok(kv: torch.Tensor, page_size: int, block_n: int) -> bool:
    """TMA tiles need SM90+, whole tiles inside one page, and 16-byte aligned rows."""
    return (
        kv.is_cuda
        and not interpreting()
        and torch.cuda.get_device_capability(kv.device)[0] >= 9
        and page_size % block_n == 0
        and kv.stride(1) == 1
        and (kv.stride(0) * kv.element_size()) % 16 == 0
        and kv.data_ptr() % 16 == 0
    )


def mla_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv: torch.Tensor,
    table: torch.Tensor,
    qo_indptr: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    sm_scale: float,
    kv_scale: float,
    max_q_len: int,
    num_splits: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    dot_f32: bool = False,
    tma: bool = True,
    gluon: bool = False,
) -> None:
    """q_nope [T, H, L], q_rope [T, H, R], kv [slots, L + R], table [B, W] page ids,
    qo_indptr [B + 1], seq_lens [B] (KV length incl. new tokens) -> out [T, H, L], lse [T, H].

    `max_q_len` and `num_splits` come from the host (never read off the device). FP8 KV:
    `kv_scale` multiplies scores and output, so rows are dequantized in registers only.
    workspace: (part_out [T * H * num_splits, L] fp32, part_lse [T * H * num_splits] fp32).
    tma: load whole page-aligned tiles through TMA where the GPU and page size allow it.
    gluon: take a Gluon kernel where `gluon_ok`: 64-row blocks (`mla_attention_seesaw` for
    H >= 64, `tuning.seesaw_pays`, else `mla_attention_gluon`), or
    with `block_m` 16 / 32 the narrow kernel (`mla_attention_narrow`); block_n / warps /
    stages then apply only to the fallback, which also takes the call (and every later one)
    if the Gluon kernel fails to build here (`gluon_error`)."""
    for name, v in (("num_splits", num_splits), ("block_m", block_m), ("block_n", block_n)):
        if v < 1 or v & (v - 1):  # tl.arange and the merge's split axis need powers of two
            raise ValueError(f"mla_attention: {name} must be a power of two >= 1, got {v}")
    t, h, lat = q_nope.shape
    r = q_rope.shape[2]
    b = seq_lens.numel()
    if t == 0 or b == 0:
        return
    m_blocks = cdiv(max_q_len * h, block_m)
    if num_splits > 1 and workspace is not None:
        part_out, part_lse = workspace
    else:
        part_out, part_lse = split_partials(out, lse, num_splits)
    if gluon and kv_scale == 1.0 and gluon_usable(q_nope.dtype, kv, page_size, lat):
        from mla_backends.kernels import mla_attention_gluon as mg

        rows = mg.BLOCK_M
        kernel: Any = None
        extra = mg.launch_options(max_q_len)
        k_box: int | None = None
        try:
            if block_m in NARROW_ROWS:
                from mla_backends.kernels import mla_attention_narrow as mn

                rows, kernel, extra = block_m, mn.KERNEL, mn.EXTRA
            elif tuning.seesaw_pays(h):
                from mla_backends.kernels import mla_attention_seesaw as ms

                kernel, extra, k_box = ms.KERNEL, ms.EXTRA, ms.K_BOX
            mg.launch(
                q_nope,
                q_rope,
                kv,
                table,
                qo_indptr,
                seq_lens,
                page_size,
                sm_scale * LOG2E,
                cdiv(max_q_len * h, rows),
                num_splits,
                out,
                lse,
                part_out,
                part_lse,
                kernel=kernel,
                extra=extra,
                k_box=k_box,
                block_m=rows,
            )
        except Exception as e:  # import, first-use compile: a failure there never fails a decode
            gluon_failed(f"{type(e).__name__}: {e}")
        else:
            _merge(part_out, part_lse, out, lse, num_splits)
            return
    outs = (out, lse, part_out, part_lse)
    precision = "ieee" if q_nope.dtype == torch.float32 else "tf32"
    use_tma = tma and tma_ok(kv, page_size, block_n)
    k_desc: object = kv
    kr_desc: object = kv
    if use_tma:  # built per call: a cached descriptor would keep a freed pool alive
        shape, strides = [kv.shape[0], lat + r], [kv.stride(0), 1]
        k_desc = TensorDescriptor(kv, shape, strides, [block_n, lat])
        kr_desc = TensorDescriptor(kv, shape, strides, [block_n, r])
    _mla_attn_kernel[(m_blocks, b, num_splits)](
        *decode_args(q_nope, q_rope, kv, (k_desc, kr_desc), table, qo_indptr, seq_lens, outs),
        sm_scale * kv_scale * LOG2E,
        kv_scale,
        H=h,
        L=lat,
        R=r,
        PAGE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        DOT_F32=dot_f32,
        DOT_F16=not dot_f32 and kv.dtype == torch.float8_e4m3fn and block_m < 64,
        PRECISION=precision,
        TMA=use_tma,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    _merge(part_out, part_lse, out, lse, num_splits)


def decode_args(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv: torch.Tensor,
    descs: tuple[object, object],
    table: torch.Tensor,
    qo_indptr: torch.Tensor,
    seq_lens: torch.Tensor,
    outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[object, ...]:
    """The arguments both decode kernels take first (`_mla_attn_kernel` and the Gluon
    kernel): groups of tensors and their strides as tuples, the two descriptors alone.

    - Q: (q_nope, q_rope, their token and head strides)
    - Pool: (kv, its row stride); then the latent and rope TMA descriptors (or kv twice)
    - Batch: (table, its row stride, qo_indptr, seq_lens)
    - Dest: (out, lse, part_out, part_lse, out's token and head strides, lse's token stride)

    Hazard: the kernels unpack these by position; change them here and in both kernels.
    Triton 3.6's launcher cannot pass a descriptor inside a tuple (an assertion in its
    driver), so the descriptors stay top-level arguments."""
    batch = (table, table.stride(0), qo_indptr, seq_lens)
    return query_group(q_nope, q_rope), (kv, kv.stride(0)), *descs, batch, dest_group(outs)


def query_group(q_nope: torch.Tensor, q_rope: torch.Tensor) -> tuple[object, ...]:
    """`decode_args`' Q group: (q_nope, q_rope, their token and head strides)."""
    return q_nope, q_rope, q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1)


def dest_group(
    outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[object, ...]:
    """`decode_args`' Dest group: (out, lse, part_out, part_lse, out's token and head strides,
    lse's token stride), as `gluon_tiles._store_rows` unpacks it."""
    out, lse = outs[0], outs[1]
    return (*outs, out.stride(0), out.stride(1), lse.stride(0))


def split_partials(
    out: torch.Tensor, lse: torch.Tensor, num_splits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(part_out [T * H * num_splits, L] fp32, part_lse [T * H * num_splits] fp32) for a split
    grid whose out is [T, H, L]; with one split, out and lse themselves (never written)."""
    if num_splits == 1:
        return out, lse
    t, h, lat = out.shape
    rows = t * h * num_splits
    return (
        torch.empty(rows, lat, dtype=torch.float32, device=out.device),
        torch.empty(rows, dtype=torch.float32, device=out.device),
    )


def _merge(
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    num_splits: int,
) -> None:
    if num_splits == 1:
        return
    t, h, lat = out.shape
    blocks, chunk = merge_blocks(t * h, lat, num_splits, num_sms(out.device))
    _merge_kernel[(t * h, blocks)](
        part_out,
        part_lse,
        out,
        lse,
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        H=h,
        L=lat,
        BLOCK_L=lat // blocks,
        NUM_SPLITS=num_splits,
        CHUNK=chunk,
        num_warps=4,
        **pdl_args(out.device),
    )


def merge_blocks(rows: int, lat: int, num_splits: int, sms: int) -> tuple[int, int]:
    """(column blocks, splits a chunk) of the merge of `rows` output rows. Blocks: up to about
    one program an SM, >= 64 columns each (at batch 1 H16 the 16 rows alone leave most SMs
    idle); chunk: as many splits as keep a program's chunk x columns tile <= 8192 fp32 (64
    registers a thread), each chunk a round trip to L2 the next one waits for. Where rows
    fill the SMs that is 16 splits a chunk, as before; at H16 batch 1 / 2 every split in one
    chunk: the merge alone (graph replay with its launch) B1 12.3 -> 8.6 us at 128 splits,
    9.7 -> 8.4 at 64, B2 12.2 -> 10.3 (H100, twenty-third session, `scripts/probe_merge.py`;
    BENCHMARKS.md has the step graphs). More programs than SMs (2-8 column blocks at H128
    batch 1) was faster alone and slower in the step's graph, where the merge's programs,
    launched early, wait beside the attention kernel's."""
    blocks = max(1, min(sms // max(rows, 1), lat // 64))
    blocks = 1 << (blocks.bit_length() - 1)
    chunk = min(num_splits, max(1, 8192 // (lat // blocks)))
    return blocks, 1 << (chunk.bit_length() - 1)


@dataclass
class GluonRoute:
    """Process-wide: why the Gluon kernel cannot run here (None while it can). Set by the
    first failure to import, compile or launch it (a Triton whose Gluon API moved again);
    from then on every call takes the `tl.dot` kernel."""

    error: str | None = None


_gluon_route = GluonRoute()


def gluon_error() -> str | None:
    """Why the Gluon route is off for this process, or None."""
    return _gluon_route.error


def gluon_failed(reason: str) -> None:
    """Turn the Gluon route off for this process (dense and sparse kernels alike: a Triton
    whose Gluon API moved breaks them all), logging why once."""
    if _gluon_route.error is None:
        _gluon_route.error = reason
        logger.warning(
            "Gluon kernels unavailable with triton %s, the tl.dot kernels take their "
            "calls from now on: %s",
            triton.__version__,
            reason,
        )


def gluon_route_open(kv: torch.Tensor) -> bool:
    """Whether any Gluon kernel may run on `kv`'s device now: a GPU (no Gluon interpreter), a
    Triton with the Gluon API, and no earlier failure to build one (`gluon_error`)."""
    return kv.is_cuda and not interpreting() and _GLUON_API and _gluon_route.error is None


def gluon_module(kv: torch.Tensor, name: str) -> ModuleType | None:
    """The Gluon kernel module `name` where a Gluon kernel may run on `kv`'s device
    (`gluon_route_open`), else None, without importing Gluon where it cannot run; a failure
    to import it turns the route off (`gluon_failed`). Every Gluon route asks this first."""
    if not gluon_route_open(kv):
        return None
    try:
        return importlib.import_module(name)
    except Exception as e:  # no triton.experimental.gluon, or names in it moved again
        gluon_failed(f"{type(e).__name__}: {e}")
        return None


def gluon_usable(q_dtype: torch.dtype, kv: torch.Tensor, page_size: int, lat: int) -> bool:
    """The Gluon kernel's conditions, without importing Gluon where it cannot run."""
    mg = gluon_module(kv, "mla_backends.kernels.mla_attention_gluon")
    return mg is not None and mg.gluon_ok(q_dtype, kv, page_size, lat)
