"""Probe for issue 19 (H128): where a 64-key tile's time goes in the 64-row Gluon kernel.

The same split of work as `mla_attention_gluon` (two warpgroups, the score tile split over
keys, the output over its columns, a two-stage TMA ring), with parts taken out:

    full        the kernel's own loop (`gluon_tiles._whole_tiles`): a check of the harness
    no_refill   the first two tiles loaded once and reused: the chain of GEMMs and softmax
                with no load to wait for (wrong output, right work)
    gemms_only  no refill and no softmax (P = S cast): the two GEMMs a tile back to back
    gluon_maxnreg<N>  the kernel itself under a register cap
    no_rescale  `full` without the accumulator's rescale by exp2(m_old - m_new) (wrong output);
                _max: also without the row max (m fixed), _exp: also without exp2 (P = S - m)
    early_return, tail, both   `full` plus the kernel's early return for a row block past
                the request, its tail tile (not taken: whole tiles), or both: the kernel
                less its merge
    producer    `full` with its refills (page ids, expect, TMA) in a one-warp producer
                partition: the consumers only hand slots back
    loads<S>, loads<S>_m1   the split's tiles streamed through a ring of S slots and
                nothing else (each slot refilled as soon as its tile landed; no Q, no
                GEMMs, no output): how fast one CTA's TMA can bring 72 KB tiles in, with both
                64-row blocks of a request launched or only the first (_m1)

Timed against raw FlashMLA on one random pool (page 64, shuffled pages, bf16), CUDA-graph
replay, µs; every split a whole number of tiles. GPU only (SM90).

    python3 scripts/probe_tile_chain.py           # JSON lines on stdout
    python3 scripts/probe_tile_chain.py --only full,no_rescale   # those variants only
    python3 scripts/probe_tile_chain.py --narrow  # the narrow kernel (H16 / H32) under caps
    python3 scripts/probe_tile_chain.py --h64     # H64: the 64-row kernel or two narrow blocks
    python3 scripts/probe_tile_chain.py --loads   # each row's stream floor (loads, no compute)
    python3 scripts/probe_tile_chain.py --spin    # the stream with each slot held longer
    python3 scripts/probe_tile_chain.py --compile # its kernels for SM90 offline (no GPU)
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from typing import Any

import torch
from probe_seesaw import Setup, paged_setup  # the same pool as the seesaw probe (scripts/)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma_wait,
)

from mla_backends.bench.timing import graph_us
from mla_backends.kernels import mla_attention_gluon as glu
from mla_backends.kernels.gluon_tiles import (
    _barrier,
    _bounds,
    _issue_tile,
    _open_ring,
    _pairs,
    _pv,
    _score,
    _soften,
    _stage_q,
    _store_rows,
    _tail_tile,
    _tma_load,
    _visible,
    _whole_tiles,
)
from mla_backends.kernels.mla_attention import _merge

SCALE = 1.0 / math.sqrt(192)

MODES = {
    "full": 0,
    "no_refill": 1,
    "gemms_only": 3,
    "early_return": 4,
    "tail": 5,
    "both": 6,
    "no_rescale": 7,
    "no_rescale_max": 8,
    "no_rescale_exp": 9,
    "producer": 10,
}
PRODUCER_REGS = gl.constexpr(40)  # the producer warp's registers (`gl.warp_specialize`)
CAPS = (240, 224, 208)  # register caps on the kernel itself (it fits 208 without spilling)
SHAPES = [(64, 4096, 1), (128, 8192, 1), (16, 32768, 4), (64, 16384, 1)]


@gluon.jit
def _diag_tiles(
    acc,
    m_i,
    l_i,
    q_smem,
    qr_smem,
    p_smem,
    ring,
    lo,
    n_full,
    visible,
    qk_scale_log2,
    S_L: gl.constexpr,
    O_L: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    SOFTMAX: gl.constexpr,
):
    """`_whole_tiles`' order of issues and waits with no refill: tile j reads slot j % 2 of
    the ring's first fill."""
    k_smem, kr_smem, bars = ring
    for i in gl.static_range(2):
        mbarrier.wait(bars.index(i), 0)
    for j in range(n_full):
        cur = j % 2
        sc = _score(
            q_smem, qr_smem, k_smem.index(cur), kr_smem.index(cur), S_L, BLOCK_M, BLOCK_N, False
        )
        sc = warpgroup_mma_wait(0, deps=[sc])
        if SOFTMAX:
            acc, m_i, l_i = _soften(
                acc,
                m_i,
                l_i,
                sc,
                p_smem,
                lo + j * BLOCK_N,
                visible,
                qk_scale_log2,
                S_L,
                O_L,
                BLOCK_N,
                False,
            )
        else:
            p_smem.store(sc.to(p_smem.dtype))
            fence_async_shared()
            _barrier()
        acc = _pv(p_smem, k_smem.index(cur), acc, False, True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        _barrier()
    return acc, m_i, l_i


@gluon.jit
def _soften_no_rescale(
    acc,
    m_i,
    l_i,
    s,
    p_smem,
    start,
    visible,
    qk_scale_log2,
    S_L: gl.constexpr,
    BLOCK_N: gl.constexpr,
    WHAT: gl.constexpr,
):
    """`gluon_tiles._soften` (T False) less the accumulator's rescale (WHAT 0), also less
    the row max across the warpgroups (1: m stays 8), or less the exp2 (2: P = S - m):
    wrong output, the rest of the work."""
    n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
    s = gl.where(n[None, :] < (visible - start)[:, None], s * qk_scale_log2, float("-inf"))
    if WHAT == 1:
        m_new = gl.zeros_like(m_i) + 8.0
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    if WHAT == 2:
        p = s - m_safe[:, None]
    else:
        p = gl.exp2(s - m_safe[:, None])
    alpha_pair = _pairs(gl.zeros_like(p) + alpha[:, None], BLOCK_N)[0]
    p_even, p_odd = _pairs(p, BLOCK_N)
    l_i = l_i * alpha_pair + (p_even + p_odd)
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()
    _barrier()
    return acc, m_new, l_i


@gluon.jit
def _tiles_no_rescale(
    acc, m_i, l_i, q_smem, qr_smem, p_smem, ring, KDesc, KRDesc, Batch, b, lo, n_full, visible,
    qk_scale_log2, S_L: gl.constexpr, O_L: gl.constexpr, L: gl.constexpr, PAGE: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, WHAT: gl.constexpr,
):  # fmt: skip
    """`gluon_tiles._whole_tiles` (T False, two stages) with `_soften_no_rescale`."""
    k_smem, kr_smem, bars = ring
    if n_full > 0:
        mbarrier.wait(bars.index(0), 0)
        sc = _score(
            q_smem, qr_smem, k_smem.index(0), kr_smem.index(0), S_L, BLOCK_M, BLOCK_N, False
        )
        sc = warpgroup_mma_wait(0, deps=[sc])
        acc, m_i, l_i = _soften_no_rescale(
            acc, m_i, l_i, sc, p_smem, lo, visible, qk_scale_log2, S_L, BLOCK_N, WHAT
        )
    for j in range(n_full - 1):
        cur = j % 2
        nxt = (j + 1) % 2
        pv = _pv(p_smem, k_smem.index(cur), acc, False, True)
        mbarrier.wait(bars.index(nxt), ((j + 1) // 2) & 1)
        sc = _score(
            q_smem, qr_smem, k_smem.index(nxt), kr_smem.index(nxt), S_L, BLOCK_M, BLOCK_N, False
        )
        acc = warpgroup_mma_wait(1, deps=[pv])
        _barrier()
        _issue_tile(
            KDesc, KRDesc, Batch, k_smem, kr_smem, bars, b, lo, j + 2, n_full, L, PAGE, BLOCK_N, 2
        )
        sc = warpgroup_mma_wait(0, deps=[sc])
        start = lo + (j + 1) * BLOCK_N
        acc, m_i, l_i = _soften_no_rescale(
            acc, m_i, l_i, sc, p_smem, start, visible, qk_scale_log2, S_L, BLOCK_N, WHAT
        )
    if n_full > 0:
        acc = _pv(p_smem, k_smem.index((n_full - 1) % 2), acc, False, False)
        _barrier()
    return acc, m_i, l_i


@gluon.jit
def _diag_kernel(
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
    MODE: gl.constexpr,
):
    S_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16]
    )
    O_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, L // 2, 16]
    )
    LD_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
    dtype: gl.constexpr = KDesc.dtype
    mblk = gl.program_id(0)
    b = gl.program_id(1)
    split = gl.program_id(2)
    q_start, q_len, seq, lo, hi = _bounds(
        Batch, b, mblk, split, H, BLOCK_M, BLOCK_N, NUM_SPLITS, False
    )
    if MODE == 4 or MODE == 6:
        if mblk * BLOCK_M >= q_len * H:
            return
    n_full = gl.maximum(hi - lo, 0) // BLOCK_N
    ring = _open_ring(KDesc, KRDesc, Batch, b, lo, n_full, L, R, PAGE, BLOCK_N, 2)
    q_smem, qr_smem = _stage_q(Q, q_start, q_len, mblk, dtype, LD_L, H, L, R, BLOCK_M)
    p_smem = gl.allocate_shared_memory(
        dtype, [BLOCK_M, BLOCK_N], gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    )
    fence_async_shared()
    _barrier()
    rows_s = mblk * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_L))
    visible = _visible(rows_s, seq, q_len, H)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, S_L))
    l_i = _pairs(gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_L), BLOCK_N)[0]
    acc = gl.zeros([BLOCK_M, L], gl.float32, O_L)
    if MODE == 10:
        # the refills in a one-warp producer partition (Gluon puts a partition barrier before
        # every TMA copy and expect: here they stay in the producer's warp)
        free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(free.index(i), count=1)
        fence_async_shared()
        _barrier()
        k_smem, kr_smem, ready = ring
        acc, m_i, l_i = gl.warp_specialize(
            [
                (_consume, (acc, m_i, l_i, q_smem, qr_smem, p_smem, k_smem, kr_smem, ready, free,
                            lo, n_full, visible, qk_scale_log2, S_L, O_L, BLOCK_M, BLOCK_N)),
                (_produce, (KDesc, KRDesc, Batch, k_smem, kr_smem, ready, free, b, lo, n_full, L,
                            PAGE, BLOCK_N)),
            ],
            [1],
            [PRODUCER_REGS],
        )  # fmt: skip
    elif MODE >= 7:
        acc, m_i, l_i = _tiles_no_rescale(
            acc, m_i, l_i, q_smem, qr_smem, p_smem, ring, KDesc, KRDesc, Batch, b, lo, n_full,
            visible, qk_scale_log2, S_L, O_L, L, PAGE, BLOCK_M, BLOCK_N, MODE - 7,
        )  # fmt: skip
    elif MODE == 0 or MODE >= 4:
        acc, m_i, l_i = _whole_tiles(
            acc, m_i, l_i, q_smem, qr_smem, p_smem, ring, KDesc, KRDesc, Batch, b, lo, n_full,
            visible, qk_scale_log2, S_L, O_L, L, PAGE, BLOCK_M, BLOCK_N, 2, False,
        )  # fmt: skip
    else:
        acc, m_i, l_i = _diag_tiles(
            acc, m_i, l_i, q_smem, qr_smem, p_smem, ring, lo, n_full, visible, qk_scale_log2,
            S_L, O_L, BLOCK_M, BLOCK_N, MODE == 1,
        )  # fmt: skip
    if MODE == 5 or MODE == 6:
        q_start, q_len, seq, lo, hi = _bounds(
            Batch, b, mblk, split, H, BLOCK_M, BLOCK_N, NUM_SPLITS, True
        )
        rows_s = mblk * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_L))
        visible = _visible(rows_s, seq, q_len, H)
        start = lo + gl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _tail_tile(
            acc, m_i, l_i, q_smem, qr_smem, p_smem, ring, Pool, Batch, b, start, hi, visible,
            qk_scale_log2, LD_L, S_L, O_L, L, R, PAGE, BLOCK_M, BLOCK_N, False,
        )  # fmt: skip
    l_i = gl.convert_layout(gl.sum(l_i, 1), gl.SliceLayout(1, S_L))
    l_safe = gl.where(l_i == 0.0, 1.0, l_i)
    lse = (m_i + gl.log2(l_safe)) * 0.6931471805599453
    out = acc * gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, O_L))[:, None]
    rows_o = mblk * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, O_L))
    offs_o = gl.arange(0, L, layout=gl.SliceLayout(0, O_L))
    _store_rows(
        Dest, out, lse, rows_o, offs_o, rows_s, q_start, q_len, split, H, L, NUM_SPLITS, True, False
    )


@gluon.jit
def _produce(
    KDesc, KRDesc, Batch, k_smem, kr_smem, ready, free, b, lo, n_full, L: gl.constexpr,
    PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    """The producer warp: TMA for whole tiles 2 .. n_full - 1 of the split, each into its
    slot once the consumers handed it back (tiles 0 and 1 went out before the fork); the
    tile's page id is loaded before the wait, so its round trip overlaps it."""
    Table, stride_tab, _, _ = Batch
    for j in range(2, n_full):
        s = j % 2
        start = lo + j * BLOCK_N
        page = gl.load(Table + b * stride_tab + start // PAGE)
        mbarrier.wait(free.index(s), ((j - 2) // 2) & 1)
        row = page * PAGE + start % PAGE
        mbarrier.expect(ready.index(s), KDesc.block_type.nbytes + KRDesc.block_type.nbytes)
        _tma_load(KDesc, [row, 0], ready.index(s), k_smem.index(s))
        _tma_load(KRDesc, [row, L], ready.index(s), kr_smem.index(s))


@gluon.jit
def _consume(
    acc, m_i, l_i, q_smem, qr_smem, p_smem, k_smem, kr_smem, ready, free, lo, n_full, visible,
    qk_scale_log2, S_L: gl.constexpr, O_L: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
):  # fmt: skip
    """`gluon_tiles._whole_tiles` (T False, two stages) with the refills left to the producer
    warp: slot j % 2 is handed back (`free`) once P @ V(j) retired in every warp."""
    if n_full > 0:
        mbarrier.wait(ready.index(0), 0)
        sc = _score(
            q_smem, qr_smem, k_smem.index(0), kr_smem.index(0), S_L, BLOCK_M, BLOCK_N, False
        )
        sc = warpgroup_mma_wait(0, deps=[sc])
        acc, m_i, l_i = _soften(
            acc, m_i, l_i, sc, p_smem, lo, visible, qk_scale_log2, S_L, O_L, BLOCK_N, False
        )
    for j in range(n_full - 1):
        cur = j % 2
        nxt = (j + 1) % 2
        pv = _pv(p_smem, k_smem.index(cur), acc, False, True)
        mbarrier.wait(ready.index(nxt), ((j + 1) // 2) & 1)
        sc = _score(
            q_smem, qr_smem, k_smem.index(nxt), kr_smem.index(nxt), S_L, BLOCK_M, BLOCK_N, False
        )
        acc = warpgroup_mma_wait(1, deps=[pv])
        _barrier()  # every warp is done reading slot cur and P(j)
        mbarrier.arrive(free.index(cur), count=1)
        sc = warpgroup_mma_wait(0, deps=[sc])
        start = lo + (j + 1) * BLOCK_N
        acc, m_i, l_i = _soften(
            acc, m_i, l_i, sc, p_smem, start, visible, qk_scale_log2, S_L, O_L, BLOCK_N, False
        )
    if n_full > 0:
        acc = _pv(p_smem, k_smem.index((n_full - 1) % 2), acc, False, False)
        _barrier()
    return acc, m_i, l_i


@dataclass
class Probe:
    """One random decode batch (`probe_seesaw.paged_setup`: page 64, shuffled pages) with its
    output buffers: `call` builds a launch of a Gluon kernel on it (and the split merge),
    `flashmla_us` times raw FlashMLA on the same pool, table and queries."""

    st: Setup
    out: torch.Tensor
    lse: torch.Tensor

    @classmethod
    def make(cls, h: int, b: int, kv: int, seed: int) -> Probe:
        st = paged_setup(b, kv, seed, h=h)
        out = torch.empty(b, h, 512, device=st.pool.device, dtype=torch.bfloat16)
        return cls(st, out, torch.empty(b, h, device=st.pool.device))

    def call(
        self,
        kern: Any,
        extra: Any,
        m_blocks: int,
        splits: int,
        block_m: int = 64,
        k_box: int | None = None,
        merge: bool = True,
    ) -> Any:
        st, (b, h) = self.st, self.lse.shape
        po = torch.empty(b * h * splits, 512, device=st.pool.device)
        pl = torch.empty(b * h * splits, device=st.pool.device)
        args = (st.qn, st.qr, st.pool, st.table, st.qo, st.lens, 64, SCALE * math.log2(math.e))

        def run() -> None:
            glu.launch(
                *args, m_blocks, splits, self.out, self.lse, po, pl, kern, extra, k_box, block_m
            )
            if splits > 1 and merge:
                _merge(po, pl, self.out, self.lse, splits)

        return run

    def flashmla_us(self) -> float:
        from sgl_kernel.flash_mla import flash_mla_with_kvcache, get_mla_metadata

        st, (b, h) = self.st, self.lse.shape
        q = torch.cat([st.qn, st.qr], -1).view(b, 1, h, 576)
        tile, nsp = get_mla_metadata(st.lens, h, 1)
        kc = st.pool.view(-1, 64, 1, 576)

        def fm() -> object:
            return flash_mla_with_kvcache(
                q, kc, st.table, st.lens, 512, tile, nsp, SCALE, causal=True
            )

        return round(graph_us(fm), 1)


def run_shape(b: int, kv: int, splits: int) -> dict[str, float]:
    """H128: the kernel, under register caps and with parts taken out (`MODES`)."""
    pr = Probe.make(128, b, kv, b + kv)
    res: dict[str, float] = {"batch": b, "kv": kv, "splits": splits}
    ref = None
    variants = {"gluon": (None, None)}
    for cap in CAPS:
        variants[f"gluon_maxnreg{cap}"] = (
            glu._mla_attn_gluon_kernel,
            {"STAGES": 2, "maxnreg": cap},
        )
    variants.update({name: (_diag_kernel, {"MODE": mode}) for name, mode in MODES.items()})
    for st in (2, 3):
        variants[f"loads{st}"] = variants[f"loads{st}_m1"] = (_loads_kernel, {"STAGES": st})
    only = _only()
    variants = {k: v for k, v in variants.items() if k == "gluon" or not only or k in only}
    for name, (kern, extra) in variants.items():
        m_blocks = 1 if name.endswith("_m1") else 2
        call = pr.call(kern, None if extra is None else {**extra, "num_warps": 8}, m_blocks, splits)
        call()
        torch.cuda.synchronize()
        if name == "gluon":
            ref = pr.out.float().clone()
        elif name in ("full", "producer"):
            res[f"{name}_max_abs_diff"] = float((pr.out.float() - ref).abs().max())
        res[f"{name}_us"] = round(graph_us(call), 1)
    res["flashmla_us"] = pr.flashmla_us()
    res["tiles_a_cta"] = kv // 64 // splits
    return res


def run_narrow(h: int, b: int, kv: int, splits: int) -> dict[str, float]:
    """The narrow kernel (H16 / H32) under register caps, with FlashMLA, as `run_shape`."""
    from mla_backends.kernels import mla_attention_narrow as mn

    pr = Probe.make(h, b, kv, b + kv + h)
    res: dict[str, float] = {"heads": h, "batch": b, "kv": kv, "splits": splits}
    for cap in (None, *CAPS):
        extra = {**mn.EXTRA, **({"maxnreg": cap} if cap else {})}
        call = pr.call(mn.KERNEL, extra, 1, splits, block_m=h)
        call()
        res[f"narrow_maxnreg{cap}_us"] = round(graph_us(call), 1)
    res["flashmla_us"] = pr.flashmla_us()
    return res


def run_h64(b: int, kv: int, splits: int) -> dict[str, float]:
    """H64 through the 64-row kernel (one row block, `splits`) against the narrow kernel in
    two 32-row blocks (the second reads the request's tiles from L2) at half and the same
    splits, with FlashMLA."""
    from mla_backends.kernels import mla_attention_narrow as mn

    pr = Probe.make(64, b, kv, b + kv + 64)
    res: dict[str, float] = {"heads": 64, "batch": b, "kv": kv, "splits": splits}
    ref = None
    runs = [("rows64", None, None, 1, 64, splits)]
    for sp in sorted({max(1, splits // 2), splits}):
        runs.append((f"narrow32_splits{sp}", mn.KERNEL, mn.EXTRA, 2, 32, sp))
    for name, kern, extra, mb, bm, sp in runs:
        call = pr.call(kern, extra, mb, sp, block_m=bm)
        call()
        torch.cuda.synchronize()
        if ref is None:
            ref = pr.out.float().clone()
        else:
            res[f"{name}_max_abs_diff"] = float((pr.out.float() - ref).abs().max())
        res[f"{name}_us"] = round(graph_us(call), 1)
    res["flashmla_us"] = pr.flashmla_us()
    return res


def run_loads(h: int, b: int, kv: int, splits: int) -> dict[str, float]:
    """`--loads`: the stream floor of a shape (`_loads_kernel`, two slots, the policy's
    splits, the latent part in one copy or in 256- / 64-column TMA boxes, and
    `_strided_loads_kernel`; `_flat_loads_kernel` over 128 or 132 CTAs; no merge) against
    the kernel the backend takes there (narrow for H16 / H32, else the 64-row kernel; with
    its merge and without) and FlashMLA."""
    from mla_backends.kernels import mla_attention_narrow as mn

    pr = Probe.make(h, b, kv, b + kv + h)
    res: dict[str, float] = {"heads": h, "batch": b, "kv": kv, "splits": splits}
    block_m = h if h <= 32 else 64
    m_blocks = max(1, h // 64)
    kern, extra = (mn.KERNEL, mn.EXTRA) if h <= 32 else (None, None)
    for merge in (True, False):
        call = pr.call(kern, extra, m_blocks, splits, block_m=block_m, merge=merge)
        call()
        res["kernel_us" if merge else "kernel_no_merge_us"] = round(graph_us(call), 1)
    loads = [("loads2", _loads_kernel, None), ("strided_loads2", _strided_loads_kernel, None)]
    loads += [(f"loads2_box{box}", _loads_kernel, box) for box in (256, 64)]
    for name, kern, box in loads:
        extra = {"STAGES": 2, "num_warps": 4}
        call = pr.call(kern, extra, m_blocks, splits, block_m, box, merge=False)
        call()
        res[f"{name}_no_merge_us"] = round(graph_us(call), 1)
    for ctas in (128, 132):  # one request's tiles in each of 128 / across 132 CTAs
        res[f"flat_loads2_ctas{ctas}_us"] = flat_loads_us(pr, ctas)
    res["flashmla_us"] = pr.flashmla_us()
    res["stream_us"] = round(b * kv * 576 * 2 / 2.63e6, 1)  # at the B64 kv 4k loads' rate
    return res


LOADS_SHAPES = [(16, 16, 4096, 8), (32, 16, 4096, 8), (64, 16, 4096, 8), (16, 64, 4096, 2),
                (128, 64, 4096, 1), (128, 16, 4096, 4), (128, 4, 32768, 16)]  # fmt: skip


def run_spin(b: int, kv: int, splits: int) -> dict[str, float]:
    """`--spin`: `_loads_kernel` (H16 rows, no merge) with 2 or 3 slots and a slot held for
    SPIN dependent FMAs a tile: how the stream of a split grid slows as each tile's slot is
    held longer, with a ring of two tiles (every kernel here) or three."""
    pr = Probe.make(16, b, kv, b + kv)
    res: dict[str, float] = {"batch": b, "kv": kv, "splits": splits}
    for stages in (2, 3):
        for spin in SPINS:
            extra = {"STAGES": stages, "SPIN": spin, "num_warps": 4}
            call = pr.call(_loads_kernel, extra, 1, splits, 16, merge=False)
            call()
            res[f"stages{stages}_spin{spin}_us"] = round(graph_us(call), 1)
    return res


SPINS = (0, 256, 512, 1024, 2048)
SPIN_SHAPES = [(1, 4096, 1), (16, 4096, 8), (64, 4096, 2)]
H64_SHAPES = [(16, 4096, 8), (64, 4096, 2), (16, 32768, 8), (64, 32768, 2), (256, 4096, 1)]
NARROW_SHAPES = [(16, 16, 4096, 8), (32, 16, 4096, 8), (32, 64, 4096, 2), (16, 64, 4096, 2)]


@gluon.jit
def _empty_ring(KDesc, KRDesc, L: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """(k_smem, kr_smem, bars): `gluon_tiles._open_ring`'s slots and barriers with nothing
    issued; the latent slots in the whole row's layout, whatever KDesc's box."""
    dtype: gl.constexpr = KDesc.dtype
    k_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, L], dtype)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, L], k_l)
    kr_smem = gl.allocate_shared_memory(
        dtype, [STAGES, BLOCK_N, KRDesc.block_type.shape[1]], KRDesc.layout
    )
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    return k_smem, kr_smem, bars


@gluon.jit
def _issue_row(
    KDesc, KRDesc, ring, row, ok, i, L: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """TMA of the 64-key tile at pool row `row` into slot i % STAGES when `ok`: the latent
    part in KDesc's boxes (L // box copies), then the rope."""
    k_smem, kr_smem, bars = ring
    W: gl.constexpr = KDesc.block_type.shape[1]
    s = i % STAGES
    bar = bars.index(s)
    mbarrier.expect(bar, (L // W) * KDesc.block_type.nbytes + KRDesc.block_type.nbytes, ok)
    for c in gl.static_range(L // W):
        _tma_load(KDesc, [row, c * W], bar, k_smem.index(s).slice(c * W, W, dim=1), ok)
    _tma_load(KRDesc, [row, L], bar, kr_smem.index(s), ok)


@gluon.jit
def _issue_boxes(
    KDesc, KRDesc, Batch, ring, b, lo, j, n_full, L: gl.constexpr, PAGE: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """`gluon_tiles._issue_tile` through `_issue_row` (KDesc's boxes)."""
    Table, stride_tab, _, _ = Batch
    pred = j < n_full
    start = lo + j * BLOCK_N
    page = gl.load(Table + b * stride_tab + start // PAGE, mask=pred, other=0)
    _issue_row(KDesc, KRDesc, ring, page * PAGE + start % PAGE, pred, j, L, STAGES)


@gluon.jit
def _loads_kernel(
    Q, Pool, KDesc, KRDesc, Batch, Dest, qk_scale_log2, H: gl.constexpr, L: gl.constexpr,
    R: gl.constexpr, PAGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_SPLITS: gl.constexpr, STAGES: gl.constexpr, SPIN: gl.constexpr = 0,
):  # fmt: skip
    """The split's whole tiles through a ring of STAGES slots, each refilled with the tile
    STAGES ahead as soon as its tile landed: the CTA's TMA rate alone (writes nothing);
    the latent part in KDesc's boxes (`launch(k_box=...)`). SPIN: a chain of that many
    dependent FMAs between a tile's arrival and its slot's refill, standing in for the
    time a kernel holds a slot to compute on it."""
    mblk = gl.program_id(0)
    b = gl.program_id(1)
    split = gl.program_id(2)
    _, _, _, lo, hi = _bounds(Batch, b, mblk, split, H, BLOCK_M, BLOCK_N, NUM_SPLITS, False)
    n_full = gl.maximum(hi - lo, 0) // BLOCK_N
    ring = _empty_ring(KDesc, KRDesc, L, BLOCK_N, STAGES)
    for i in gl.static_range(STAGES):
        _issue_boxes(KDesc, KRDesc, Batch, ring, b, lo, i, n_full, L, PAGE, BLOCK_N, STAGES)
    x = qk_scale_log2 * 0.0
    for j in range(n_full):
        mbarrier.wait(ring[2].index(j % STAGES), (j // STAGES) & 1)
        for _ in range(SPIN):
            x = x * 0.999 + 1.0
        _barrier()
        _issue_boxes(
            KDesc, KRDesc, Batch, ring, b, lo, j + STAGES, n_full, L, PAGE, BLOCK_N, STAGES
        )
    if SPIN > 0:  # keeps the chain (x tends to 1000, never stored)
        gl.store(Batch[0], x.to(gl.int32), mask=x == 12345.0)


@gluon.jit
def _flat_loads_kernel(
    KDesc, KRDesc, Table, stride_tab, n_tiles, per_req, L: gl.constexpr, PAGE: gl.constexpr,
    STAGES: gl.constexpr,
):  # fmt: skip
    """`_loads_kernel` over FlashMLA's kind of grid: the batch's tiles as one flat list, CTA
    c streaming its contiguous share [c T / P, (c + 1) T / P) across request boundaries."""
    c = gl.program_id(0)
    progs = gl.num_programs(0)
    lo = c * n_tiles // progs
    n = (c + 1) * n_tiles // progs - lo
    ring = _empty_ring(KDesc, KRDesc, L, PAGE, STAGES)
    for j in range(-STAGES, n):  # the first STAGES issues, then a refill per tile landed
        if j >= 0:
            mbarrier.wait(ring[2].index(j % STAGES), (j // STAGES) & 1)
            _barrier()
        i = j + STAGES
        t = lo + i
        page = gl.load(Table + (t // per_req) * stride_tab + t % per_req, mask=i < n, other=0)
        _issue_row(KDesc, KRDesc, ring, page * PAGE, i < n, i, L, STAGES)


@gluon.jit
def _strided_loads_kernel(
    Q, Pool, KDesc, KRDesc, Batch, Dest, qk_scale_log2, H: gl.constexpr, L: gl.constexpr,
    R: gl.constexpr, PAGE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    NUM_SPLITS: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """`_loads_kernel` with split s taking tiles s, s + NUM_SPLITS, ... of its request: the
    page ids of its first two tiles depend only on (request, split), so they load beside
    the request's length instead of after it (one dependent round trip fewer before the
    first TMA). Decode only (one query token)."""
    gl.static_assert(STAGES == 2, "two slots")
    b = gl.program_id(1)
    split = gl.program_id(2)
    Table, stride_tab, _, SeqLens = Batch
    row_b = Table + b * stride_tab  # page ids past the request are read (within the row),
    last = stride_tab - 1  # never used
    ring = _empty_ring(KDesc, KRDesc, L, BLOCK_N, STAGES)
    t1 = split + NUM_SPLITS
    page0 = gl.load(row_b + gl.minimum(split * BLOCK_N // PAGE, last))
    page1 = gl.load(row_b + gl.minimum(t1 * BLOCK_N // PAGE, last))
    seq = gl.load(SeqLens + b)
    n = gl.maximum(seq // BLOCK_N - split + NUM_SPLITS - 1, 0) // NUM_SPLITS
    _issue_row(KDesc, KRDesc, ring, page0 * PAGE + split * BLOCK_N % PAGE, 0 < n, 0, L, 2)
    _issue_row(KDesc, KRDesc, ring, page1 * PAGE + t1 * BLOCK_N % PAGE, 1 < n, 1, L, 2)
    for j in range(n):
        mbarrier.wait(ring[2].index(j % 2), (j // 2) & 1)
        _barrier()
        tile = split + (j + 2) * NUM_SPLITS
        ok = j + 2 < n
        page = gl.load(row_b + tile * BLOCK_N // PAGE, mask=ok, other=0)
        _issue_row(KDesc, KRDesc, ring, page * PAGE + tile * BLOCK_N % PAGE, ok, j + 2, L, 2)


def flat_loads_us(pr: Probe, ctas: int) -> float:
    """`_flat_loads_kernel` on the probe's pool (page 64, every request as long) over `ctas`
    CTAs, graph replay µs."""
    pool, table = pr.st.pool, pr.st.table
    k_desc, kr_desc = glu.pool_descriptors(pool, 512, 64)

    def run() -> None:
        _flat_loads_kernel[(ctas,)](
            k_desc, kr_desc, table, table.stride(0), table.numel(), table.shape[1], L=512,
            PAGE=64, STAGES=2, num_warps=4,
        )  # fmt: skip

    run()
    return round(graph_us(run), 1)


def _only() -> set[str]:
    """`--only a,b`: the variants to run (the kernel itself always runs first)."""
    args = sys.argv[1:]
    return set(args[args.index("--only") + 1].split(",")) if "--only" in args else set()


def compile_offline() -> None:
    """`--compile`: the probe's kernels for SM90 without a GPU (H128, bf16, page 64, one
    split), one JSON line of registers / spills / shared memory each (`kernels.offline`)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from mla_backends.kernels import offline

    dt = glu._GL_DTYPES[torch.bfloat16]
    desc = {w: f"tensordesc<bf16[64, {w}],{glu._smem_layout((64, w), dt)!r}>" for w in (512, 64)}
    kernels = {  # name: (kernel, constexprs, latent TMA box)
        "full": (_diag_kernel, {"MODE": 0}, 512),
        "producer": (_diag_kernel, {"MODE": MODES["producer"]}, 512),
        "loads": (_loads_kernel, {"STAGES": 2, "SPIN": 0}, 64),
    }
    for name, (fn, extra, box) in kernels.items():
        sig = offline.decode_signature("bf16", desc[box], desc[64])
        const = dict(H=128, L=512, R=64, PAGE=64, BLOCK_M=64, BLOCK_N=64, NUM_SPLITS=1, **extra)
        sig.update({"qk_scale_log2": "fp32", **{k: "constexpr" for k in const}})
        src = GluonASTSource(fn, sig, const, offline.aligned(fn, sig))
        print(json.dumps({"kernel": name, **offline.usage(offline.compile_sm90(src, 8))}))


def main() -> None:
    if "--compile" in sys.argv:
        compile_offline()
        return
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}))
    runs: dict[str, tuple[Any, list[tuple[int, ...]]]] = {
        "--spin": (run_spin, SPIN_SHAPES),
        "--loads": (run_loads, LOADS_SHAPES),
        "--h64": (run_h64, H64_SHAPES),
        "--narrow": (run_narrow, NARROW_SHAPES),
    }
    run, shapes = next((v for k, v in runs.items() if k in sys.argv), (run_shape, SHAPES))
    for shape in shapes:
        print(json.dumps(run(*shape)), flush=True)


if __name__ == "__main__":
    main()
