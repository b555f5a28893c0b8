"""Sparse absorbed MLA on Hopper in Gluon: the `triton` sparse backend's kernel for bf16 /
fp16 pool rows at H a multiple of 64 on SM90 (`usable`); FP8 rows take its FP8-row form
(`gluon_fp8row.py`), everything else the `tl.dot` kernel (`triton_kernel.py`), which is also
the fallback if a Gluon kernel fails to build.

Why: the `tl.dot` sparse kernel lays its score dots out over eight warps in M
(`warpsPerCTA = [8, 1]`, read in its SM90 TTGIR), so both warpgroups compute the whole 64 x 64
score tile, and its 64 x 512 accumulator spills. Here the score tile is split over keys and
the output over its 512 columns (`[4, 2]`, `gluon_tiles._score` / `_pv`, as in
`kernels/mla_attention_gluon.py`), and each tile's 64 selected rows are gathered by index with
`cp.async` into a two-slot ring: tile j + 2 is requested once P @ V(j) has retired, so its
gather runs behind tile j + 1's maths. H100, same indices, one-wave split counts
(BENCHMARKS.md, fifteenth session): 1.08-1.92x the `tl.dot` kernel at every token count,
1.46-3.6x FlashMLA's sparse kernel up to 16 tokens, 0.66-0.98x from 64.

Contract: `triton_kernel.sparse_mla`'s for bf16 / fp16 pool rows (q_nope [T, H, L], q_rope
[T, H, R], kv [slots, L + R], indices [T, K] int32 with -1 unused) at L = 512, R = 64, H a
multiple of 64; partials merged by `mla_attention._merge`. Hazards: a -1 entry's row must
stand in as zeros, never a stale or NaN row (P is 0 there, but 0 x NaN is NaN): masked
`cp.async` lanes carry a source size of 0, which zero-fills (read in the PTX; the GPU test
poisons every unnamed row with NaN); and the generic-proxy writes of `cp.async` are fenced
before the wgmma reads them. One CTA an SM (229,888 B of shared memory; 210 registers with
triton 3.6, no spills), so the split rule fills one wave (`triton_backend.launch_config`).
"""

from __future__ import annotations

from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma_wait,
)

from mla_backends.kernels.common import interpreting
from mla_backends.kernels.gluon_tiles import (
    ROWS_8W,
    _barrier,
    _normalise,
    _online_rows,
    _pairs,
    _pv,
    _score,
    _stage_q,
    _store_p,
    _store_rows,
    split_layout,
)
from mla_backends.kernels.mla_attention import (
    LOG2E,
    _merge,
    dest_group,
    query_group,
    split_partials,
)
from mla_backends.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_args

# async_copy_global_to_shared (3.6) is async_load from 3.9
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
BLOCK_M, BLOCK_N, STAGES = 64, 64, 2
_DTYPES = (torch.bfloat16, torch.float16)


def check_indices(indices: torch.Tensor, t: int) -> None:
    """The index rows the Gluon sparse kernels read: int32 [T, K], contiguous along K."""
    if indices.dtype != torch.int32 or indices.dim() != 2 or indices.shape[0] != t:
        raise ValueError(f"indices must be int32 [T = {t}, K], got {tuple(indices.shape)}")
    if indices.stride(1) != 1:
        raise ValueError("indices must be contiguous along K (the kernel reads them by offset)")


def on_sm90(kv: torch.Tensor) -> bool:
    """Whether `kv` lives on an SM90 GPU exactly (wgmma; no Gluon interpreter)."""
    return (
        kv.is_cuda and not interpreting() and torch.cuda.get_device_capability(kv.device) == (9, 0)
    )


def usable(q_nope: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor) -> bool:
    """This kernel's conditions: an SM90, and the tensors it takes (`takes`)."""
    return on_sm90(kv) and takes(q_nope, q_rope, kv)


def takes(q_nope: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor) -> bool:
    """The tensors this kernel takes, on any device: bf16 / fp16 rows read by queries of the
    same dtype, L 512 and R 64 in 576-wide rows contiguous along their columns (queries too)
    whose starts `cp.async` can read 16 bytes at a time, H a multiple of 64."""
    return (
        kv.dtype in _DTYPES
        and q_nope.dtype == q_rope.dtype == kv.dtype
        and q_nope.shape[1] % BLOCK_M == 0
        and (q_nope.shape[2], q_rope.shape[2], kv.shape[1]) == (512, 64, 576)
        and q_nope.stride(2) == q_rope.stride(2) == kv.stride(1) == 1
        and (kv.stride(0) * kv.element_size()) % 16 == 0
        and kv.data_ptr() % 16 == 0
    )


@gluon.jit
def _gather(
    KV,
    stride_kv,
    Idx,
    lo,
    hi,
    j,
    k_smem,
    kr_smem,
    LD_L: gl.constexpr,
    L: gl.constexpr,
    R: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):
    """cp.async of tile j's selected rows (indices lo + j * BLOCK_N ..., below hi) into slot
    j % STAGES, then one commit group (empty past the split: the groups stay one a tile)."""
    n = lo + j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD_L))
    idx = gl.load(Idx + n, mask=n < hi, other=-1)
    ok = idx >= 0
    slot = gl.where(ok, idx, 0).to(gl.int64) * stride_kv
    offs_l = gl.arange(0, L, layout=gl.SliceLayout(0, LD_L))
    offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, LD_L))
    s = j % STAGES
    # masked lanes zero-fill: an unused entry is a zero row (see the module's hazards)
    _cp_async(k_smem.index(s), KV + slot[:, None] + offs_l[None, :], mask=ok[:, None])
    _cp_async(kr_smem.index(s), KV + slot[:, None] + L + offs_r[None, :], mask=ok[:, None])
    async_copy.commit_group()


@gluon.jit
def _split_range(Idx, stride_idx, topk, t, split, NUM_SPLITS: gl.constexpr, BLOCK_N: gl.constexpr):
    """Token t's index row and this split's share of it, whole key tiles a split:
    (Row, lo, hi, n_tiles)."""
    chunk = gl.cdiv(gl.cdiv(topk, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = gl.minimum(lo + chunk, topk)
    return Idx + t.to(gl.int64) * stride_idx, lo, hi, gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)


@gluon.jit
def _sparse_state(
    S_L: gl.constexpr, O_L: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    L: gl.constexpr,
):  # fmt: skip
    """The online softmax's start: (row max -inf, P's row sums in column pairs, acc 0)."""
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, S_L))
    l_i = _pairs(gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_L), BLOCK_N)[0]
    return m_i, l_i, gl.zeros([BLOCK_M, L], gl.float32, O_L)


@gluon.jit
def _sparse_tile(
    acc, m_i, l_i, q_smem, qr_smem, k_buf, kr_buf, p_smem, Row, lo, hi, j, qk_scale_log2,
    S_L: gl.constexpr, O_L: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    """Tile j's attention once its rows are in k_buf / kr_buf: scores, entries past the
    split or -1 masked, the online softmax, P @ V (waited for: the buffers may be refilled
    once every warp has passed a barrier)."""
    sc = _score(q_smem, qr_smem, k_buf, kr_buf, S_L, BLOCK_M, BLOCK_N, False)
    n = lo + j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    ok = (n < hi) & (gl.load(Row + n, mask=n < hi, other=-1) >= 0)
    sc = warpgroup_mma_wait(0, deps=[sc])
    acc, m_i, l_i, p = _online_rows(acc, m_i, l_i, sc, ok[None, :], qk_scale_log2, O_L, BLOCK_N)
    _store_p(p, p_smem)
    acc = _pv(p_smem, k_buf, acc, False, False)
    return acc, m_i, l_i


@gluon.jit
def _sparse_start(USE_GDC: gl.constexpr):
    """The programmatic wait, before any read: the indices come from the top-k, and q may
    come from the launch just before (SGLang's, or the main stream's absorbed q), so nothing
    here is read early."""
    if USE_GDC:
        gdc_wait()


@gluon.jit
def _sparse_finish(
    Dest, acc, m_i, l_i, mblk, t, split, S_L: gl.constexpr, O_L: gl.constexpr, H: gl.constexpr,
    L: gl.constexpr, BLOCK_M: gl.constexpr, NUM_SPLITS: gl.constexpr, USE_GDC: gl.constexpr,
):  # fmt: skip
    """Row block mblk of token t: out / LSE, or this split's partials. The merge is released
    here, during the epilogue: the backend's grids are one wave (`triton_backend.
    launch_config`), so its programs take no SM a later CTA of this grid would need (the
    hardware releases it only once every CTA called this or exited, whatever the grid)."""
    if USE_GDC:
        gdc_launch_dependents()
    l_sum = gl.convert_layout(gl.sum(l_i, 1), gl.SliceLayout(1, S_L))
    out, lse = _normalise(acc, m_i, l_sum, O_L, False)
    rows_o = mblk * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, O_L))
    rows_s = mblk * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_L))
    offs_o = gl.arange(0, L, layout=gl.SliceLayout(0, O_L))
    _store_rows(Dest, out, lse, rows_o, offs_o, rows_s, t, 1, split, H, L, NUM_SPLITS, True, False)


@gluon.jit
def _sparse_gluon_kernel(
    Q,
    KV,
    stride_kv,
    Idx,
    stride_idx,
    topk,
    Dest,
    qk_scale_log2,
    H: gl.constexpr,
    L: gl.constexpr,
    R: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    STAGES: gl.constexpr,
    USE_GDC: gl.constexpr,
):
    """Grid (H / BLOCK_M, tokens, splits). Q: `mla_attention.decode_args`' query group; Dest:
    its output group (out, lse, partials, strides)."""
    gl.static_assert(gl.num_warps() == 8, "two warpgroups: launch with num_warps=8")
    S_L: gl.constexpr = split_layout(BLOCK_N)
    O_L: gl.constexpr = split_layout(L)
    LD_L: gl.constexpr = ROWS_8W
    dtype: gl.constexpr = Q[0].dtype.element_ty

    mblk = gl.program_id(0)
    t = gl.program_id(1)
    split = gl.program_id(2)
    _sparse_start(USE_GDC)
    Row, lo, hi, n_tiles = _split_range(Idx, stride_idx, topk, t, split, NUM_SPLITS, BLOCK_N)

    k_smem = gl.allocate_shared_memory(
        dtype, [STAGES, BLOCK_N, L], gl.NVMMASharedLayout.get_default_for([BLOCK_N, L], dtype)
    )
    kr_smem = gl.allocate_shared_memory(
        dtype, [STAGES, BLOCK_N, R], gl.NVMMASharedLayout.get_default_for([BLOCK_N, R], dtype)
    )
    for i in gl.static_range(STAGES):
        _gather(KV, stride_kv, Row, lo, hi, i, k_smem, kr_smem, LD_L, L, R, BLOCK_N, STAGES)
    q_smem, qr_smem = _stage_q(Q, t, 1, mblk, dtype, LD_L, H, L, R, BLOCK_M)
    p_smem = gl.allocate_shared_memory(
        dtype, [BLOCK_M, BLOCK_N], gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    )

    m_i, l_i, acc = _sparse_state(S_L, O_L, BLOCK_M, BLOCK_N, L)
    for j in range(n_tiles):
        cur = j % STAGES
        async_copy.wait_group(STAGES - 1)  # tile j's group (groups retire in order)
        fence_async_shared()  # this thread's cp.async writes, before the wgmma reads them
        _barrier()  # ... and every other thread's
        acc, m_i, l_i = _sparse_tile(
            acc, m_i, l_i, q_smem, qr_smem, k_smem.index(cur), kr_smem.index(cur), p_smem, Row,
            lo, hi, j, qk_scale_log2, S_L, O_L, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        _barrier()  # every warp is done reading slot cur and P(j)
        _gather(
            KV, stride_kv, Row, lo, hi, j + STAGES, k_smem, kr_smem, LD_L, L, R, BLOCK_N, STAGES
        )
    async_copy.wait_group(0)
    _sparse_finish(
        Dest, acc, m_i, l_i, mblk, t, split, S_L, O_L, H, L, BLOCK_M, NUM_SPLITS, USE_GDC
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
    """`triton_kernel.sparse_mla`'s contract for bf16 / fp16 pool rows, H a multiple of 64,
    L 512 and R 64: q_nope [T, H, L], q_rope [T, H, R], kv [slots, L + R], indices [T, K]
    int32 (-1 unused) -> out [T, H, L], lse [T, H]. SM90 only."""
    check_indices(indices, q_nope.shape[0])
    if not usable(q_nope, q_rope, kv):
        raise refusal(
            "the Gluon sparse kernel takes SM90, bf16 / fp16 rows in q's dtype, H % 64 == 0, "
            "L 512, R 64, contiguous 16-byte-aligned rows",
            q_nope, q_rope, kv,
        )  # fmt: skip
    launch(_sparse_gluon_kernel, (kv, kv.stride(0)), q_nope, q_rope, indices, sm_scale,
           num_splits, out, lse)  # fmt: skip


def refusal(takes: str, q_nope: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor) -> ValueError:
    """A Gluon sparse kernel's refusal: what it takes, and what it got."""
    return ValueError(
        f"{takes}: got H {q_nope.shape[1]}, q {q_nope.dtype} {tuple(q_nope.shape)} / "
        f"{tuple(q_rope.shape)}, kv {kv.dtype} {tuple(kv.shape)} on {kv.device}"
    )


def launch(
    kernel: Any,
    rows: tuple[object, ...],
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    num_splits: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    **consts: int,
) -> None:
    """One Gluon sparse kernel over grid (H / BLOCK_M, T, splits), its pool arguments `rows`
    between the query group and the index rows, then the split merge."""
    t, h, lat = q_nope.shape
    if t == 0:
        return
    part_out, part_lse = split_partials(out, lse, num_splits)
    q, dest = query_group(q_nope, q_rope), dest_group((out, lse, part_out, part_lse))
    kernel[(h // BLOCK_M, t, num_splits)](
        q, *rows, indices, indices.stride(0), indices.shape[1], dest, sm_scale * LOG2E,
        H=h, L=lat, R=q_rope.shape[2], BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        NUM_SPLITS=num_splits, STAGES=STAGES, num_warps=8, **consts, **pdl_args(q_nope.device),
    )  # fmt: skip
    _merge(part_out, part_lse, out, lse, num_splits)
