"""The indexer's logits on Hopper in Gluon, for long contexts: each program streams many
64-key tiles of one token through a `cp.async` ring, so that a tile's keys are in flight
while the tiles before it are scored.

Why: the Triton logits kernel (`indexer_kernels._logits_kernel`) is one program a 128-key
block, each a chain of dependent steps (slots, keys, q, MMA, reduction, store) with nothing
of the next block in flight; at batch 64 and 128k context it reads the index keys at 1.7
TB/s of the H100's ~3.35 (BENCHMARKS.md, tenth session), and the logits are most of the
DeepSeek-V3.2 decode step there. Here a program loads q once and keeps STAGES - 1 tiles of
keys and scales in flight; the slots of the tile after those are loaded one tile earlier
still, so no tile waits on a dependent load.

The maths is the Triton kernel's: e4m3 codes turned into fp16 in registers (exact) and a
fp16 MMA with fp32 accumulation, keys as the MMA's rows, q [heads, D] the B operand in
shared memory; `sum_h w_h * relu(q_h . k)` over the accumulator's columns, times the key's
scale. Hazard (as there): Hopper's FP8 MMA accumulates with fewer mantissa bits than fp32,
so the codes are never fed to it directly.

Contract: `indexer_kernels.index_logits`' for e4m3 index keys at D 128 and up to 64 index
heads (q [T, Hi, 128] e4m3 codes, w [T, Hi] fp32): logits [T, width] fp32, -inf at keys
from a token's visible count on, whose slots and keys are never read. SM90 only
(`usable`); everything else takes the Triton kernel. Grid (T, programs a token); program p
of a token takes its tiles p, p + G, ... and stores -inf over the tiles past its context.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from mla_backends.arith import cdiv
from mla_backends.kernels.common import interpreting, num_sms
from mla_backends.kernels.gluon_tiles import _barrier
from mla_backends.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_args
from mla_backends.sparse.gluon_kernel import _cp_async
from mla_backends.sparse.index_k import PAGE, IndexKCache

BLOCK_N, STAGES, D = 64, 4, 128
PAGE_C = gl.constexpr(PAGE)  # slots a block of the index-K cache (`index_k.IndexKCache`)
# Programs an SM the grid aims at: ~50 KB of shared memory and ~100 registers a thread each
# (four fit), so that another program's tiles stream while one scores.
PROGRAMS_PER_SM = 4
MAX_HEADS = 64


@gluon.jit
def _issue(
    Data, Scale, k8_smem, ks_smem, slot, slot_s, n, n_s, vis, i,
    LD_L: gl.constexpr, D: gl.constexpr, BLK_E: gl.constexpr, BLK_S: gl.constexpr,
    SCALE_OFF: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """cp.async of one tile's codes and scales (keys at positions n, pool slots `slot`, in
    LD_L's rows; the same in the scales' layout: n_s, slot_s) into ring slot i % STAGES, then
    one commit group (empty past the context: masked lanes read nothing)."""
    slot = slot.to(gl.int64)
    d = gl.arange(0, D, layout=gl.SliceLayout(0, LD_L))
    codes = Data + ((slot // PAGE_C) * BLK_E + (slot % PAGE_C) * D)[:, None] + d[None, :]
    _cp_async(k8_smem.index(i % STAGES), codes, mask=(n < vis)[:, None])
    slot_s = slot_s.to(gl.int64)
    scales = Scale + (slot_s // PAGE_C) * BLK_S + SCALE_OFF + slot_s % PAGE_C
    _cp_async(ks_smem.index(i % STAGES), scales, mask=n_s < vis)
    async_copy.commit_group()


@gluon.jit
def _slots(R2TRow, n, vis):
    """Pool slots of the keys at positions n (0 past the context: never read)."""
    return gl.load(R2TRow + n, mask=n < vis, other=0)


@gluon.jit
def _count_keys(logit, ok, hist_row):
    """The top-k's pass 0 (`topk_kernel._count_digit`) in Gluon: the first digit of the keys
    where `ok` into hist_row[0:256], one histogram and an atomic a bin that has keys. Hazard:
    counting each key's leading 16 bits too (an atomic a key into the wide bins, which would
    save the top-k's wide pass as well) made the batch-1 logits ~2 us slower, as much as it
    saved (H100, twenty-second session, BENCHMARKS.md)."""
    H_L: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])  # 256 bins over 128 threads
    bits = logit.to(gl.uint32, bitcast=True)
    key = gl.where((bits >> 31) == 1, ~bits, bits | 0x80000000)  # `topk_kernel._sortable`
    h = gl.histogram((key >> 24).to(gl.int32), 256, mask=ok, layout=H_L)
    gl.atomic_add(hist_row + gl.arange(0, 256, layout=H_L), h, mask=h > 0, sem="relaxed")


@gluon.jit
def _logits_gluon_kernel(
    Q, W, Data, Scale, R2T, Rows, Vis, Out, Counts, width, stride_q_t, stride_q_h, stride_w,
    stride_r2t, stride_o, stride_c,
    HI: gl.constexpr, D: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    BLK_E: gl.constexpr, BLK_S: gl.constexpr, SCALE_OFF: gl.constexpr, STAGES: gl.constexpr,
    EARLY_KEYS: gl.constexpr, USE_GDC: gl.constexpr, COUNT: gl.constexpr = False,
):  # fmt: skip
    gl.static_assert(gl.num_warps() == 4, "one warpgroup: launch with num_warps=4")
    S_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_H, 16]
    )
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=2)
    LD_L: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])  # 16 B a thread
    SC_L: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    ROW_L: gl.constexpr = gl.SliceLayout(1, LD_L)

    t = gl.program_id(0).to(gl.int64)
    p = gl.program_id(1)
    g = gl.num_programs(1)
    if USE_GDC:  # `kernels.pdl.wait_previous`: q comes from the q-prep kernel just before
        if not EARLY_KEYS:
            gdc_wait()
    vis = gl.load(Vis + t)
    # Hazard: rows may be int32; row x max_context_len passes 2^31 at 4096 rows of a 1M
    # context. Widened once; the row's pointer (not base + int64 offset) is what stays live.
    R2TRow = R2T + gl.load(Rows + t).to(gl.int64) * stride_r2t
    mine = gl.maximum(gl.cdiv(gl.cdiv(vis, BLOCK_N) - p, g), 0)  # tiles p, p + g, ... < vis

    k8_smem = gl.allocate_shared_memory(
        gl.float8e4nv, [STAGES, BLOCK_N, D], gl.NVMMASharedLayout.get_default_for(
            [BLOCK_N, D], gl.float8e4nv)
    )  # fmt: skip
    ks_smem = gl.allocate_shared_memory(
        gl.float32, [STAGES, BLOCK_N], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    )
    # the first STAGES - 1 tiles requested before q is staged; the next one's slots loaded
    # (in both layouts: a layout conversion would cost a shared-memory round trip a tile)
    tile_n = gl.arange(0, BLOCK_N, layout=ROW_L)
    tile_s = gl.arange(0, BLOCK_N, layout=SC_L)
    for i in gl.static_range(STAGES - 1):
        n_i = (p + i * g) * BLOCK_N + tile_n
        s_i = (p + i * g) * BLOCK_N + tile_s
        _issue(Data, Scale, k8_smem, ks_smem, _slots(R2TRow, n_i, vis),
               _slots(R2TRow, s_i, vis), n_i, s_i, vis, i, LD_L, D, BLK_E, BLK_S,
               SCALE_OFF, STAGES)  # fmt: skip
    n_next = (p + (STAGES - 1) * g) * BLOCK_N + tile_n
    s_next = (p + (STAGES - 1) * g) * BLOCK_N + tile_s
    slot_next = _slots(R2TRow, n_next, vis)
    slot_s_next = _slots(R2TRow, s_next, vis)
    # Hazard: with EARLY_KEYS the reads above (visible counts, slots, keys) ran before the
    # wait; only a launch that released this one after its own wait makes that safe
    # (`index_logits(early_keys=)`). At batch 1 they are most of a program's chain.
    if USE_GDC:
        if EARLY_KEYS:
            gdc_wait()

    # q [BLOCK_H, D] as fp16 (heads past HI zero), the MMA's B operand
    h_ld = gl.arange(0, BLOCK_H, layout=ROW_L)
    d_ld = gl.arange(0, D, layout=gl.SliceLayout(0, LD_L))
    q = gl.load(
        Q + t * stride_q_t + h_ld[:, None] * stride_q_h + d_ld[None, :],
        mask=(h_ld < HI)[:, None], other=0.0,
    )  # fmt: skip
    q_smem = gl.allocate_shared_memory(
        gl.float16, [BLOCK_H, D], gl.NVMMASharedLayout.get_default_for([BLOCK_H, D], gl.float16)
    )
    q_smem.store(q.to(gl.float16))
    h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, S_L))
    w = gl.load(W + t * stride_w + h, mask=h < HI, other=0.0)
    fence_async_shared()  # q's stores, before the wgmma reads them

    out_row = Out + t * stride_o
    n_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, S_L))
    for it in range(mine):
        async_copy.wait_group(STAGES - 2)  # tile it's group (groups retire in order)
        # every thread's copies of tile it landed, and every warp is done with the slot
        # tile it - 1 read, which the request below refills
        _barrier()
        _issue(Data, Scale, k8_smem, ks_smem, slot_next, slot_s_next, n_next, s_next, vis,
               it + STAGES - 1, LD_L, D, BLK_E, BLK_S, SCALE_OFF, STAGES)  # fmt: skip
        n_next += g * BLOCK_N
        s_next += g * BLOCK_N
        slot_next = _slots(R2TRow, n_next, vis)
        slot_s_next = _slots(R2TRow, s_next, vis)
        cur = it % STAGES
        k = k8_smem.index(cur).load(A_L).to(gl.float16)
        s = warpgroup_mma(
            k, q_smem.permute((1, 0)), gl.zeros([BLOCK_N, BLOCK_H], gl.float32, S_L),
            use_acc=False,
        )  # fmt: skip
        ks = ks_smem.index(cur).load(gl.SliceLayout(1, S_L))
        logit = gl.sum(gl.maximum(s, 0.0) * w[None, :], axis=1) * ks
        n_out = (p + it * g) * BLOCK_N + n_s
        gl.store(out_row + n_out, gl.where(n_out < vis, logit, float("-inf")), mask=n_out < width)
        if COUNT:  # for a top-k told `counted` (`indexer_kernels.index_logits(counts=)`)
            ok = (n_out < vis) & (n_out < width) & (logit > float("-inf"))
            _count_keys(logit, ok, Counts + t * stride_c)
    async_copy.wait_group(0)
    # Late, as in the Triton kernel (`kernels.pdl.launch_next`). Released at the start (one
    # wave: room to spare at batch 1), the top-k's programs crowded onto the SMs with room
    # while this grid ran, several an SM, and its passes then ran 1-7 us slower at batch 1
    # and 16 (H100, seventeenth session, BENCHMARKS.md).
    if USE_GDC:
        gdc_launch_dependents()
    # the tiles past the context: -inf without a key read
    inf = gl.full([BLOCK_N], float("-inf"), gl.float32, gl.SliceLayout(1, S_L))
    for j in range(p + mine * g, gl.cdiv(width, BLOCK_N), g):
        n_out = j * BLOCK_N + n_s
        gl.store(out_row + n_out, inf, mask=n_out < width)


def usable(cache: IndexKCache, q: torch.Tensor) -> bool:
    """An SM90, e4m3 index keys and codes of D 128, up to 64 index heads (V3.2 has 64; more
    would take a 32 KB q tile and break the four-programs-an-SM wave, and is not tested)."""
    return (
        q.is_cuda
        and not interpreting()
        and torch.cuda.get_device_capability(q.device) == (9, 0)
        and cache.quantized
        and q.dtype == torch.float8_e4m3fn
        and q.dim() == 3
        and q.shape[1] <= MAX_HEADS
        and q.shape[2] == cache.head_dim == D
        and q.stride(2) == 1
    )


def programs(t: int, width: int, device: torch.device, per_sm: int = PROGRAMS_PER_SM) -> int:
    """Programs a token: as many as fit one wave of `per_sm` an SM over the T tokens (a
    second, partial wave would hold the whole grid up: B64 128k 620 against 553 us at two an
    SM, H100), at least one, at most one a tile."""
    return max(1, min(cdiv(width, BLOCK_N), per_sm * num_sms(device) // t))


def index_logits(
    cache: IndexKCache,
    layer: int,
    q: torch.Tensor,
    w: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    visible: torch.Tensor,
    width: int,
    programs_per_token: int | None = None,
    stages: int = STAGES,
    maxnreg: int | None = None,
    early_keys: bool = False,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """`indexer_kernels.index_logits`' contract where `usable`: q [T, Hi, 128] e4m3 codes,
    w [T, Hi] fp32, rows [T], visible [T] -> logits [T, width] fp32. `programs_per_token`,
    `stages` and `maxnreg` (a register cap) are the launch's knobs for sweeps
    (`scripts/bench_indexer_logits.py --configs`); the defaults measured fastest.
    `early_keys`, `counts`: `indexer_kernels.index_logits`'."""
    from mla_backends.sparse.indexer_kernels import _count_args

    if stages < 2:
        raise ValueError(f"the Gluon indexer logits need a ring of >= 2 tiles, got {stages}")
    if not usable(cache, q):
        raise ValueError(
            f"the Gluon indexer logits take SM90, e4m3 index keys and q [T, <= {MAX_HEADS}, {D}] "
            f"e4m3: got q {q.dtype} {tuple(q.shape)} on {q.device}, keys "
            f"{cache.dtype} D {cache.head_dim}"
        )
    t, hi, _ = q.shape
    out = torch.empty(t, width, dtype=torch.float32, device=q.device)
    if t == 0 or width == 0:
        return out
    buf = cache.buffers[layer]
    g = programs_per_token or programs(t, width, q.device)
    count, stride_c = _count_args(counts, t, visible)
    _logits_gluon_kernel[(t, g)](
        q, w, buf.view(torch.float8_e4m3fn), buf.view(torch.float32), req_to_token, rows,
        visible, out, count, width, q.stride(0), q.stride(1), w.stride(0),
        req_to_token.stride(0), out.stride(0), stride_c, HI=hi, D=D,
        BLOCK_H=max(16, 1 << (hi - 1).bit_length()), BLOCK_N=BLOCK_N, BLK_E=cache.block_bytes,
        BLK_S=cache.block_bytes // 4, SCALE_OFF=PAGE * D // 4, STAGES=stages,
        EARLY_KEYS=early_keys, COUNT=counts is not None, num_warps=4,
        **pdl_args(q.device),
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip
    return out
