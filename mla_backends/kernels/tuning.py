"""Launch policy of our Triton kernels on a GPU: block sizes, tiles, warps, stages, KV
splits and the MHA-prefill route. Numbers come from the H200 / H100 probes
(`scripts/tune_triton.py`) and offline SM90 compiles (`kernels/offline.py`); BENCHMARKS.md
holds the measurements behind each comment."""

from __future__ import annotations

import functools
import os

import torch

from mla_backends.arith import cdiv


@functools.cache  # read once a process: asked twice a layer on the eager decode path (~0.6 us)
def narrow_on() -> bool:
    """Requests of <= 32 query rows take the keys-as-rows Gluon kernel
    (`mla_attention_narrow`) where the Gluon route is on; MLA_NARROW=0 in the environment
    the process starts with sends them to the kernels below instead (A/B runs)."""
    return os.environ.get("MLA_NARROW", "1") != "0"


@functools.cache  # read once a process, as `narrow_on`
def seesaw_on() -> bool:
    """64-row Gluon blocks of H >= 64 run the warp-specialised kernel (`seesaw_pays`);
    MLA_SEESAW=0 in the environment the process starts with gives them the lockstep kernel
    (`mla_attention_gluon`'s own) instead (A/B runs)."""
    return os.environ.get("MLA_SEESAW", "1") != "0"


# H200, one process each way, runs alternated (BENCHMARKS.md, forty-fifth session): since its
# loop no longer spills, the seesaw is 1.04-1.19x the lockstep kernel at H64 (q_len 1 and 2,
# B 16-256, kv 4k / 32k; FlashMLA ratio 0.74-0.93x -> 0.87-1.05x) and 1.07-1.15x at H128.
# Before, at H64 it was 0.89-0.94x (H100, twenty-first session). Blocks of fewer heads (H32
# q_len 2, H16 q_len 3+) keep the lockstep kernel: not measured on the seesaw.
SEESAW_MIN_HEADS = 64


def seesaw_pays(heads: int) -> bool:
    """Whether 64-row Gluon blocks of `heads` query heads run the warp-specialised kernel
    (`mla_attention_seesaw`: two warpgroups on alternate key tiles)."""
    return heads >= SEESAW_MIN_HEADS and seesaw_on()


def is_narrow(block_m: int, gluon: bool) -> bool:
    """Whether `block_m`-row programs run the narrow Gluon kernel (`block_m_for` chose it)."""
    return gluon and block_m < 64 and narrow_on()


def block_m_for(
    rows: int,
    dot_dtype: torch.dtype,
    gluon: bool,
    batch_size: int,
    max_kv: int | None = None,
    sms: int | None = None,
) -> int:
    """Query rows (token, head) per program of the absorbed kernel, for `rows` per request;
    with `max_kv` and `sms` (decode / verify grids), short grids of 33-128 rows may take the
    narrow kernel (`narrow_pays`)."""
    if dot_dtype == torch.float32:
        # fp32 dots are FMA loops, not tensor-core MMAs: 32- and 64-row blocks spilled 8-16 KB
        # a thread on SM90 (offline compile), 16 rows none.
        return 16
    if gluon and rows <= 32 and narrow_on():
        # The narrow Gluon kernel: query rows are its MMAs' N side (`NARROW_ROWS`), so a
        # 16-row request no longer pays for a 64-row MMA.
        return 16 if rows <= 16 else 32
    if (
        gluon
        and narrow_on()
        and max_kv is not None
        and sms is not None
        and narrow_pays(rows, batch_size, max_kv, sms)
    ):
        return 32
    if rows <= 16:
        # H16 decode at batch <= 16: the Gluon kernel's 64-row block (rows past 16 masked)
        # at one wave beat the 16-row tl.dot kernel at every shape of the H100 sweep
        # (`tune_triton.py splits`, graph replay vs FlashMLA: B16 kv 4k 0.94x against 0.83x,
        # B4 kv 4k 1.08x against 0.84x, B1 kv 32k 1.48x against 1.22x).
        return 64 if gluon and batch_size <= 16 else 16
    # H16 q_len 2: half a Gluon block measured 0.88x FlashMLA, the 32-row Triton
    # block 0.62x (mma.sync, 46 spills; BENCHMARKS.md, Gluon decode kernel).
    return 32 if rows <= 32 and not gluon else 64


@functools.cache  # per attention call on the decode path: look it up, do not recompute
def launch_config(
    block_m: int,
    page_size: int,
    batch_size: int,
    num_splits: int,
    dot_dtype: torch.dtype,
    gluon: bool,
    width: int,
    smem_limit: int | None,
) -> dict[str, int | bool]:
    """Tiles, warps and stages of the absorbed kernel on a GPU whose blocks may take
    `smem_limit` bytes of shared memory (None: no limit known), for rows `width` (L + R)
    wide. From the H200 probes (scripts/tune_triton.py). `gluon`: a Gluon kernel takes these
    rows where the page size allows it (64-row blocks on the Gluon route; 16 / 32 rows where
    the narrow kernel also is on, `is_narrow`).
    `tma` asks for TMA tiles where the page size allows them (whole tiles inside one page,
    `mla_attention.tma_ok`). The dict is shared between calls: read it, never change it."""
    cfg: dict[str, int | bool]
    if dot_dtype == torch.float32:
        # Operands are 4 bytes and the dots FMA loops: 64-key tiles beside a 64-row query
        # needed 442 KB with TMA (the H100 allows 227 KB). 16 x 16 tiles: 75 KB, no spills.
        cfg = {"block_n": 16, "num_warps": 4, "num_stages": 2, "tma": False}
    elif block_m < 64 and gluon:
        # The narrow Gluon kernel (`mla_attention_narrow`): one warpgroup, 64-key TMA tiles
        # in two stages (168 / 189 KB of shared memory at 16 / 32 rows).
        cfg = {"block_n": 64, "num_warps": 4, "num_stages": 2, "tma": True, "gluon": True}
    elif block_m >= 64:
        # The Gluon kernel where it can run (SM90, bf16 / fp16, page % 64 == 0); else
        # TMA stages beside the [64, 576] query: two 64-key stages fit in 227 KB, three
        # do not. TMA: 0.46x FlashMLA at H128 B64, gather 0.42x.
        if page_size % 64 == 0:
            cfg = {"block_n": 64, "num_warps": 8, "num_stages": 2, "tma": True, "gluon": gluon}
        else:
            cfg = {"block_n": 64, "num_warps": 8, "num_stages": 3, "tma": False}
    elif block_m == 32:  # TMA spilled here (64-186 spills): gather 0.62x, TMA 0.45-0.52x
        cfg = {"block_n": 64, "num_warps": 4, "num_stages": 2, "tma": False}
    elif page_size % 32 == 0 and batch_size >= 32 and num_splits <= 2:
        # H16 B256 kv1024 (1 split): TMA 32-key tiles 0.90-0.92x FlashMLA, gather 0.84x;
        # B128 kv8192 (2 splits): 0.85x both. At 4+ splits (B64 and below) TMA measured
        # 0.59-0.61x against the gather's 0.84-0.87x, and small eager batches cannot hide
        # the two tensor maps each TMA launch encodes on the host (B1: 84 us vs 27 us).
        cfg = {"block_n": 32, "num_warps": 4, "num_stages": 4, "tma": True}
    else:
        cfg = {"block_n": 64, "num_warps": 4, "num_stages": 3, "tma": False}
    return _fit_smem(cfg, block_m, width, dot_dtype.itemsize, smem_limit)


def _fit_smem(
    cfg: dict[str, int | bool], block_m: int, width: int, elem: int, limit: int | None
) -> dict[str, int | bool]:
    """Fewer TMA stages, then narrower key tiles, until the kernel's shared memory
    (`mla_attention.smem_bytes`) fits `limit`. The Gluon kernel sizes its own."""
    from mla_backends.kernels.mla_attention import smem_bytes

    bn, stages, tma = int(cfg["block_n"]), int(cfg["num_stages"]), bool(cfg["tma"])
    while limit is not None and smem_bytes(block_m, bn, stages, tma, width, elem) > limit:
        if tma and stages > 1:
            stages -= 1
        elif bn > 16:
            bn //= 2
        else:
            need = smem_bytes(block_m, bn, stages, tma, width, elem)
            raise ValueError(
                f"triton MLA kernel: {block_m} x {bn} tiles of {width}-wide rows need {need} "
                f"bytes of shared memory, this GPU allows {limit}"
            )
    return {**cfg, "block_n": bn, "num_stages": stages}


def mha_config(dot_dtype: torch.dtype) -> dict[str, int]:
    """Tiles, warps and stages of the MHA prefill kernel (`mha_prefill`) on a GPU."""
    if dot_dtype == torch.float32:
        # FMA dots: 128 x 64 tiles spilled 13.9 KB a thread on SM90, 16 x 16 none
        # (scripts/compile_triton_sm90.py float32 mha).
        return {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 2}
    return {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2}


def mha_route(
    dtype: torch.dtype, on_gpu: bool, sdpa_fits: bool, need_lse: bool, cudnn_lse: bool
) -> str:
    """Which kernel runs an MHA-mode prefill: "sdpa" (torch, no LSE), "cudnn" (torch's cuDNN
    attention with LSE) or "triton" (ours). `sdpa_fits`: torch's top-left causal rule equals
    ours (every request has as many queries as keys)."""
    if on_gpu and sdpa_fits and not need_lse:
        return "sdpa"
    # Hazard: torch's cuDNN attention op runs any dtype but bf16 as fp16 (MHA.cpp sets the
    # graph's io type HALF unless bf16; only SDPA's dispatcher checks dtypes, and we call the
    # op directly): fp32 q / k / v were read as fp16 bit patterns, NaN in out and LSE.
    if on_gpu and sdpa_fits and cudnn_lse and dtype in (torch.float16, torch.bfloat16):
        return "cudnn"
    return "triton"


# The most KV splits of one decode grid. Small batches need many to fill the GPU: at 16,
# B1 / kv 32k put 16-32 programs on 132 SMs (H16 0.42x, H128 0.56x FlashMLA, graph replay,
# BENCHMARKS.md "Hopper decode table").
MAX_SPLITS = 128


def split_policy(block_m: int, rows: int, narrow: bool = False) -> tuple[int, int]:
    """(waves, min keys per split) of a decode grid of `block_m`-row programs for `rows` query
    rows a request. 16- and 32-row blocks are bandwidth-bound: two waves, >= 256 keys (H200
    launch-config sweep; one wave measured 0.73-0.76x FlashMLA at H16 B4-B16 on the H100
    against 0.83-1.01x). 64-row blocks: one wave, >= 256 keys, or >= 64 when a request has
    at most 16 rows (H16 in a Gluon block, B1 kv 4k: 64 splits 1.59x FlashMLA, 16 splits
    1.31x; H100 sweep, `tune_triton.py splits`). `narrow`: the narrow Gluon kernel, one CTA
    an SM like the 64-row one, so its policy (H100 sweep of 1-128 splits at H16 / H32, B1-64:
    the best power of two at every shape; BENCHMARKS.md, "the narrow Gluon kernel")."""
    if block_m >= 64 or narrow:
        return 1, (64 if rows <= 16 else 256)
    return 2, 256


def choose_num_splits(
    programs: int,
    max_kv_len: int,
    sms: int,
    waves: int,
    min_keys: int = 256,
    max_splits: int = MAX_SPLITS,
) -> int:
    """Split KV until the grid covers the GPU `waves` times, keeping >= `min_keys` keys per
    split (`split_policy` gives both). A power of two (the merge kernel's arange needs one)."""
    want = max(1, round(waves * sms / max(programs, 1)))
    want = min(want, max(1, max_kv_len // min_keys), max_splits)
    return 1 << (want.bit_length() - 1)


def decode_splits(
    batch_size: int, rows: int, block_m: int, max_kv_len: int, sms: int, narrow: bool = False
) -> int:
    """KV splits of a decode / verify grid: `batch_size` requests of `rows` query rows each, in
    programs of `block_m` rows (`split_policy`, then `choose_num_splits`)."""
    waves, min_keys = split_policy(block_m, rows, narrow)
    programs = batch_size * cdiv(rows, block_m)
    return choose_num_splits(programs, max_kv_len, sms, waves, min_keys)


# The most 64-key tiles a CTA of the narrow kernel may stream when it takes 33-128 rows a
# request in 32-row blocks (each block streams the request's tiles again, from L2): H100,
# graph replay against the 64-row kernel in one process (BENCHMARKS.md, fourteenth session):
# 4-8 tiles a CTA 7-18 % faster (H128 B1 kv 2k-16k, B2 / B4 kv 4k; H64 B1 kv 4k / 32k, B4
# kv 4k), 16 tiles -3 % to +8 % (H128 B1 kv 32k +5 %, B8 kv 4k +8 %, H64 B16 kv 4k -3 %),
# more tiles 21-42 % slower.
NARROW_MAX_TILES = 8


def narrow_pays(rows: int, batch_size: int, max_kv: int, sms: int) -> bool:
    """Whether a decode grid of `batch_size` requests of 33-128 query rows runs faster in the
    narrow kernel's 32-row blocks than in 64-row blocks: one wave of CTAs (the measured
    grids), each streaming at most NARROW_MAX_TILES tiles."""
    if not 32 < rows <= 128:
        return False
    splits = decode_splits(batch_size, rows, 32, max_kv, sms, narrow=True)
    ctas = batch_size * cdiv(rows, 32) * splits
    return ctas <= sms and cdiv(cdiv(max_kv, splits), 64) <= NARROW_MAX_TILES


def split_rows_bound(sms: int) -> int:
    """An upper bound on rows x splits (the partials one split grid writes) over every grid
    `choose_num_splits` makes, whatever the batch: sizes a CUDA graph's workspace. P programs
    of bm rows, w waves, S SMs: splitting needs want = round(w S / P) >= 2, so P <= w S / 1.5,
    and splits <= w S / P + 1/2; rows <= P bm, so rows x splits <= bm w S + bm P / 2 <=
    4/3 bm w S, where bm w <= 64 (`split_policy`: 64-row blocks and narrow ones at one
    wave, 16 or 32 rows at most two)."""
    return cdiv(4 * 64 * sms, 3)


# The interpreter (CPU tests) wants tiny tiles: every tile is a numpy loop there.
INTERP_DECODE = {"block_n": 16, "num_warps": 4, "num_stages": 1, "tma": False}
INTERP_MHA = {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}
