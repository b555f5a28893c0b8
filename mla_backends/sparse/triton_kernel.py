"""Sparse absorbed MLA in Triton: attention over the rows a top-k index list selects.

A program owns one query token, one block of BLOCK_M of its heads (all of them up to 64), and
one split of its index list; it gathers only the selected rows, BLOCK_N at a time, and reads
each once for the QK^T over L + R and again (from registers) for P @ V over L. Unused
entries (-1) are masked loads: their stand-in rows are never read. Two row formats:
- the pool's [slots, L + R] rows (bf16 / fp16 / fp32, or e4m3 under one per-layer scale that
  multiplies scores and output);
- the FP8 row format (`fp8_row`): e4m3 codes times their tile's fp32 scale, dequantised in
  registers to q's dtype (exact: a 4-bit significand times a power of two), rope in bf16.
With NUM_SPLITS > 1, partial (out, lse) pairs are merged by `mla_attention._merge`, or at 2-4
tokens over bf16 / fp16 rows inside the launch itself (`merges_here`, `_merge_here`).
"""

from __future__ import annotations

import os
from types import ModuleType

import torch
import triton
import triton.language as tl

from mla_backends.arith import cdiv
from mla_backends.kernels.common import interpreting, num_sms
from mla_backends.kernels.grid_sync import arrive_and_wait
from mla_backends.kernels.mla_attention import (
    LOG2E,
    _merge,
    _online_softmax,
    _split_weights,
    gluon_failed,
    gluon_module,
    split_partials,
)
from mla_backends.kernels.pdl import launch_next, pdl_args, wait_previous
from mla_backends.sparse.fp8_row import TILE, Fp8RowFormat


@triton.jit
def _sparse_mla_kernel(
    QNope,
    QRope,
    KV,
    KV8,
    KVS,
    KVR,
    Idx,
    Out,
    Lse,
    PartOut,
    PartLse,
    Sync,
    stride_qn_t,
    stride_qn_h,
    stride_qr_t,
    stride_qr_h,
    stride_kv,
    stride_idx,
    stride_o_t,
    stride_o_h,
    stride_lse_t,
    topk,
    qk_scale_log2,
    out_scale,
    H: tl.constexpr,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    FP8_ROW: tl.constexpr,
    ROW_E8: tl.constexpr,
    ROW_S: tl.constexpr,
    S_OFF: tl.constexpr,
    ROW_B: tl.constexpr,
    R_OFF: tl.constexpr,
    TILE_C: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    MERGE_HERE: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    wait_previous(USE_GDC)  # q and the indices come from the kernels before this one
    hblk = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    heads = hblk * BLOCK_M + tl.arange(0, BLOCK_M)
    h_ok = heads < H
    offs_l = tl.arange(0, L)
    offs_r = tl.arange(0, R)
    qn = tl.load(
        QNope + t * stride_qn_t + heads[:, None] * stride_qn_h + offs_l[None, :],
        mask=h_ok[:, None],
        other=0.0,
    )
    qr = tl.load(
        QRope + t * stride_qr_t + heads[:, None] * stride_qr_h + offs_r[None, :],
        mask=h_ok[:, None],
        other=0.0,
    )
    if DOT_F32:
        qn = qn.to(tl.float32)
        qr = qr.to(tl.float32)

    chunk = tl.cdiv(tl.cdiv(topk, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, topk)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, L], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        idx = tl.load(Idx + t * stride_idx + j, mask=j < hi, other=-1)
        ok = idx >= 0
        slot = tl.where(ok, idx, 0).to(tl.int64)
        if FP8_ROW:
            k8 = tl.load(
                KV8 + slot[:, None] * ROW_E8 + offs_l[None, :], mask=ok[:, None], other=0.0
            )
            # One scale per 128-wide tile, broadcast in registers (a per-element gather of the
            # scales would stage BLOCK_N x L fp32 through shared memory).
            tiles = tl.arange(0, L // TILE_C)
            sc = tl.load(
                KVS + slot[:, None] * ROW_S + S_OFF + tiles[None, :], mask=ok[:, None], other=0.0
            )
            # Straight to q's dtype: e4m3 codes are exact in bf16 / fp16 and a power-of-two
            # scale multiplies exactly (an fp32 tile would double the registers and spill).
            k = tl.reshape(k8.to(qn.dtype), [BLOCK_N, L // TILE_C, TILE_C])
            k = tl.reshape(k * sc.to(qn.dtype)[:, :, None], [BLOCK_N, L])
            kr = tl.load(
                KVR + slot[:, None] * ROW_B + R_OFF + offs_r[None, :], mask=ok[:, None], other=0.0
            )
        else:
            k = tl.load(
                KV + slot[:, None] * stride_kv + offs_l[None, :], mask=ok[:, None], other=0.0
            )
            kr = tl.load(
                KV + slot[:, None] * stride_kv + L + offs_r[None, :], mask=ok[:, None], other=0.0
            )
        k = k.to(qn.dtype)
        kr = kr.to(qr.dtype)
        s = tl.dot(qn, tl.trans(k), input_precision=PRECISION)
        s = tl.dot(qr, tl.trans(kr), acc=s, input_precision=PRECISION)
        s = tl.where(ok[None, :], s * qk_scale_log2, float("-inf"))
        acc, m_i, l_i, p = _online_softmax(acc, m_i, l_i, s)
        acc = tl.dot(p.to(k.dtype), k, acc=acc, input_precision=PRECISION)

    # the merge kernel (or, MERGE_HERE, whatever follows) during this epilogue, not while
    # the gathers run; before the wait in `_merge_here` is safe: the next kernel is released
    # only once every program of this one called this, so all of them are resident
    launch_next(USE_GDC)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (out_scale / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    if NUM_SPLITS == 1:
        o_ptr = Out + t * stride_o_t + heads[:, None] * stride_o_h + offs_l[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=h_ok[:, None])
        tl.store(Lse + t * stride_lse_t + heads, lse, mask=h_ok)
    else:
        prow = (t * H + heads) * NUM_SPLITS + split
        tl.store(PartOut + prow[:, None] * L + offs_l[None, :], out, mask=h_ok[:, None])
        tl.store(PartLse + prow, lse, mask=h_ok)
        if MERGE_HERE:
            _merge_here(
                PartOut, PartLse, Out, Lse, Sync, t, heads, h_ok, split,
                stride_o_t, stride_o_h, stride_lse_t, H, L, NUM_SPLITS,
            )  # fmt: skip


@triton.jit
def _merge_here(
    PartOut,
    PartLse,
    Out,
    Lse,
    Sync,
    t,
    heads,
    h_ok,
    split,
    stride_o_t,
    stride_o_h,
    stride_lse_t,
    H: tl.constexpr,
    L: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """The splits' merge inside the launch (`sparse_mla(sync=)`): once every program stored
    its partials, the program of split s merges columns [s, s + 1) x L / NUM_SPLITS of its
    heads over all splits, as `mla_attention._merge_kernel` does, without the merge's launch
    and its wait. Sync: two int32, zero between launches: arrivals, then departures; the last
    program out sets both back to zero (none is still spinning then: each departs after its
    wait). Hazards: `kernels.grid_sync` (every program resident at once)."""
    n = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    arrive_and_wait(Sync, n)
    CW: tl.constexpr = L // NUM_SPLITS
    cols = split * CW + tl.arange(0, CW)
    prow = (t * H + heads)[:, None] * NUM_SPLITS + tl.arange(0, NUM_SPLITS)[None, :]
    lse = tl.load(PartLse + prow, mask=h_ok[:, None], other=float("-inf"))
    m, total, lse_out = _split_weights(lse, 1)
    w = tl.exp(lse - m[:, None])
    parts = tl.load(
        PartOut + prow[:, :, None] * L + cols[None, None, :], mask=h_ok[:, None, None], other=0.0
    )
    acc = tl.sum(parts * w[:, :, None], 1) / tl.where(total == 0.0, 1.0, total)[:, None]
    o_ptr = Out + t * stride_o_t + heads[:, None] * stride_o_h + cols[None, :]
    tl.store(o_ptr, acc.to(Out.dtype.element_ty), mask=h_ok[:, None])
    if split == 0:
        tl.store(Lse + t * stride_lse_t + heads, lse_out, mask=h_ok)
    tl.debug_barrier()  # every thread of this program read its partials
    # acq_rel: every program's last spin read is ordered before the reset it may see
    if tl.atomic_add(Sync + 1, 1, sem="acq_rel", scope="gpu") == n - 1:
        tl.store(Sync, 0)
        tl.store(Sync + 1, 0)


def sparse_mla(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    kv_scale: float,
    num_splits: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    fmt: Fp8RowFormat | None = None,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 8,
    num_stages: int = 2,
    dot_f32: bool = False,
    sync: torch.Tensor | None = None,
) -> None:
    """q_nope [T, H, L], q_rope [T, H, R], indices [T, K] int32 slots (-1 unused) ->
    out [T, H, L], lse [T, H] fp32 (natural log). kv: the pool layer's [slots, L + R] rows,
    or with `fmt` its [slots, row_bytes] uint8 FP8 rows (then kv_scale must be 1).
    sync: two zeroed int32 on q's device, owned by the caller, kept zero between calls by the
    kernel: with it the splits are merged inside the launch where `merges_here` allows.
    Hazard: two launches sharing one sync must not run at once (one stream per owner)."""
    t, h, lat = q_nope.shape
    r = q_rope.shape[2]
    if t == 0:
        return
    # Hazard: the kernel takes leading strides only; a view strided in its last dimension (a
    # column-major index table) was read as if contiguous, a wrong answer without an error
    strided = [
        name
        for name, x in (("q_nope", q_nope), ("q_rope", q_rope), ("indices", indices), ("kv", kv))
        if x.shape[-1] > 1 and x.stride(-1) != 1
    ]
    if strided:
        raise ValueError(f"sparse_mla: {strided} must be contiguous in their last dimension")
    if sync is not None and (
        sync.dtype != torch.int32 or sync.numel() < 2 or sync.device != q_nope.device
    ):
        raise ValueError(
            f"sparse_mla: sync must be 2 int32 on {q_nope.device}, got {sync.numel()} "
            f"{sync.dtype} on {sync.device}"
        )
    grid = (cdiv(h, block_m), t, num_splits)
    same_rows = fmt is None and kv.dtype == q_nope.dtype
    here = sync is not None and merges_here(
        grid, block_m, lat, num_splits, q_nope.device, same_rows
    )
    part_out, part_lse = split_partials(out, lse, num_splits)
    if fmt is not None:
        if kv_scale != 1.0:
            raise ValueError("FP8 rows carry their own scales: kv_scale must be 1")
        kv8, kvs, kvr = (
            kv.view(torch.float8_e4m3fn),
            kv.view(torch.float32),
            kv.view(torch.bfloat16),
        )
        rows = dict(
            ROW_E8=fmt.row_bytes,
            ROW_S=fmt.row_bytes // 4,
            S_OFF=fmt.scale_offset // 4,
            ROW_B=fmt.row_bytes // 2,
            R_OFF=fmt.rope_offset // 2,
        )
        stride_kv = 0
    else:
        kv8 = kvs = kvr = kv
        rows = dict(ROW_E8=0, ROW_S=0, S_OFF=0, ROW_B=0, R_OFF=0)
        stride_kv = kv.stride(0)
    precision = "ieee" if q_nope.dtype == torch.float32 else "tf32"
    _sparse_mla_kernel[grid](
        q_nope,
        q_rope,
        kv,
        kv8,
        kvs,
        kvr,
        indices,
        out,
        lse,
        part_out,
        part_lse,
        sync if here else part_lse,  # not read without MERGE_HERE
        q_nope.stride(0),
        q_nope.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        stride_kv,
        indices.stride(0),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        indices.shape[1],
        sm_scale * kv_scale * LOG2E,
        kv_scale,
        H=h,
        L=lat,
        R=r,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        FP8_ROW=fmt is not None,
        TILE_C=TILE,
        DOT_F32=dot_f32,
        PRECISION=precision,
        MERGE_HERE=here,
        num_warps=num_warps,
        num_stages=num_stages,
        **rows,
        **pdl_args(q_nope.device),
    )
    if not here:
        _merge(part_out, part_lse, out, lse, num_splits)


def merge_here_on() -> bool:
    """MLA_SPARSE_MERGE_HERE=0 in the environment the process starts with keeps every sparse
    call on the merge kernel: for processes given fewer SMs than the device has (MPS thread
    limits, green contexts), where the in-launch merge's programs could wait forever
    (`kernels.grid_sync`), and for A/B runs."""
    return os.environ.get("MLA_SPARSE_MERGE_HERE", "1") != "0"


def merges_here(
    grid: tuple[int, int, int],
    block_m: int,
    lat: int,
    num_splits: int,
    device: torch.device,
    same_rows: bool,
) -> bool:
    """Whether a launch of `grid` merges its splits itself (`_merge_here`): two or more
    tokens, more than one split, each owning a whole share of the columns, every program
    resident at once (the grid within the SMs: `kernels.grid_sync`), a merge tile of
    <= 16 x 512 fp32 (64 registers a thread at 4 warps), on a GPU (the interpreter runs
    programs one by one), over pool rows in q's dtype (`same_rows`: bf16 / fp16, the measured
    and tested form; FP8 rows and e4m3 pools keep the merge kernel). At H16 on an H100 it
    took the sparse call 0.3-1.2 us off at 2-4 tokens and added 0.4 at one, where the merge
    kernel's 128 programs read the 1 MB of partials faster than the launch's own 32
    (BENCHMARKS.md, twenty-third session)."""
    programs = grid[0] * grid[1] * grid[2]
    return (
        same_rows
        and merge_here_on()
        and grid[1] >= 2
        and num_splits > 1
        and lat % num_splits == 0
        and block_m * lat <= 16 * 512
        and device.type == "cuda"
        and not interpreting()
        and programs <= num_sms(device)
    )


def attend(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    kv_scale: float,
    launch: dict[str, int],
    fmt: Fp8RowFormat | None = None,
    sync: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_mla` into new tensors: out [T, H, L] in q's dtype and lse [T, H] fp32, with
    the tiles, warps, stages and "splits" of `launch` (`triton_backend.launch_config`); with
    "gluon" set there, the Gluon kernel where it runs (`_gluon_attend`). sync: `sparse_mla`'s
    (the `tl.dot` kernel's merge inside its launch)."""
    t, h, lat = q_nope.shape
    out = torch.empty(t, h, lat, dtype=q_nope.dtype, device=q_nope.device)
    lse = torch.empty(t, h, dtype=torch.float32, device=q_nope.device)
    cfg = dict(launch)
    splits = cfg.pop("splits")
    gluon = cfg.pop("gluon", 0) and kv_scale == 1.0
    tl_splits = cfg.pop("tl_splits", splits)
    if gluon and _gluon_attend(q_nope, q_rope, kv, indices, sm_scale, splits, out, lse, fmt):
        return out, lse
    splits = tl_splits  # the tl.dot kernel's own split rule (~two waves)
    # dot_f32 in the interpreter: its bf16 dots are wrong (DESIGN.md)
    sparse_mla(
        q_nope, q_rope, kv, indices, sm_scale, kv_scale, splits, out, lse, fmt,
        dot_f32=interpreting(), sync=sync, **cfg,
    )  # fmt: skip
    return out, lse


def _gluon_attend(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    splits: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    fmt: Fp8RowFormat | None,
) -> bool:
    """A Gluon sparse kernel's call where one takes it here (`gluon_kernel_for`); False
    leaves the call to the `tl.dot` kernel. A failure to build or launch it turns the route
    off for the process (`mla_attention.gluon_failed`) and is never a failed decode: nothing
    is written before the launch, so the fallback starts clean. Bad arguments (ValueError)
    and a full GPU memory are the caller's errors: raised, the route kept."""
    kernel = gluon_kernel_for(q_nope, q_rope, kv, fmt)
    if kernel is None:
        return False
    try:
        kernel.sparse_mla(q_nope, q_rope, kv, indices, sm_scale, splits, out, lse)
    except (ValueError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # names in triton.experimental.gluon moved again
        gluon_failed(f"{type(e).__name__}: {e}")
        return False
    return True


def gluon_kernel_for(
    q_nope: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor, fmt: Fp8RowFormat | None
) -> ModuleType | None:
    """The Gluon sparse kernel module that takes this call here, or None: the Gluon route open,
    `gluon_kernel` for bf16 / fp16 rows or `gluon_fp8row` for FP8 rows in the default
    format, and its `usable` holding. One decision for the call itself and for SGLang's
    `auto` limit. A failure to import one turns the route off (`mla_attention.gluon_failed`)."""
    if fmt is None:
        name = "mla_backends.sparse.gluon_kernel"
    elif fmt == Fp8RowFormat():
        name = "mla_backends.sparse.gluon_fp8row"
    else:
        return None
    kernel = gluon_module(kv, name)
    return kernel if kernel is not None and kernel.usable(q_nope, q_rope, kv) else None
