"""The indexer's top-k as a radix select over each row's logits, the selected positions
written as pool slots (-1 for unused entries).

A radix select takes four passes, one per 8-bit digit of an order-preserving 32-bit key (most
significant first): a histogram of the digit over the keys that still match the threshold's
digits so far, then the digit holding the k-th largest key. The last step writes every key
above the threshold and as many of its ties as are still needed. The row is split over
programs of 2048 keys; the histograms accumulate in global memory (atomics) and every program
of the next pass re-derives the threshold from them. Five launches (four histograms, the
write) over T x cdiv(W, 2048) programs, after the counters' fill (`new_counts`).

History (H100, BENCHMARKS.md): one program a row streaming its keys from memory, ~3.6 ns a
key (0.48 ms at 128k keys, latency-bound; DSA third run); one program a row holding a row of
up to 32k keys in registers, all in one launch, 0.083-0.091 ms at 16k and ~0.2 ms at 32k,
against 0.033-0.052 ms for these seven launches (DSA sixth run): on one SM the four passes'
histograms and the scans cost more than six launches save. Three passes of 11 / 11 / 10-bit
digits (2048-bin histograms, the -1 tail written by the write kernel: five launches) measured
0.056-0.058 ms at batch 1 and 0.86 ms at B64 / 128k against 0.033 and 0.235 (DSA eighth run):
a 2048-bin `tl.histogram` and its scan cost far more per program than a 256-bin one.

Result contract (as `indexer.select_topk` + `positions_to_slots`, up to order): the set of the
k largest finite logits, in no particular order, then -1; rows with fewer than k finite logits
keep all of them; ties at the threshold are taken in no defined order (exactly k entries).
NaN counts as not visible.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_backends.arith import cdiv, next_pow2
from mla_backends.kernels.common import interpreting


@triton.jit
def _sortable(x):
    """fp32 -> uint32 whose unsigned order is the float order (-0 just below +0)."""
    bits = x.to(tl.uint32, bitcast=True)
    neg = (bits >> 31) == 1
    return tl.where(neg, ~bits, bits | 0x80000000)


@triton.jit
def _digit_step(hist, bins, need):
    """From one digit's histogram [256]: the digit b holding the need-th largest key, and how
    many keys with digit b are still needed once every key with a larger digit is taken
    (b = -1 when fewer than need keys are counted)."""
    at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys with digit >= bin
    b = tl.max(tl.where(at_or_above >= need, bins, -1), 0)
    return b, need - tl.sum(tl.where(bins > b, hist, 0), 0)


@triton.jit
def _masked_histogram(digit, match, BLOCK: tl.constexpr):
    """Counts of `digit` [BLOCK] where `match`. No mask argument in triton 3.6: non-matching
    keys land in bin 0 and are taken back out of it."""
    bins = tl.arange(0, 256)
    h = tl.histogram(tl.where(match, digit, 0), 256)
    return h - tl.where(bins == 0, BLOCK - tl.sum(match.to(tl.int32), 0), 0)


@triton.jit
def _threshold(Hist, K: tl.constexpr, PASSES: tl.constexpr):
    """From the first PASSES digit histograms of a row: (take_all, need, prefix, total):
    whether the row has at most K visible keys; else the digits so far of the K-th largest key
    and how many keys sharing them are still to be taken; the row's visible keys."""
    bins = tl.arange(0, 256)
    h0 = tl.load(Hist + bins)
    total = tl.sum(h0, 0)
    take_all = (total <= K).to(tl.int32)
    need = total * 0 + K
    prefix = (total * 0).to(tl.uint32)
    for p in tl.static_range(PASSES):
        b, need = _digit_step(tl.load(Hist + p * 256 + bins), bins, need)
        prefix = (prefix << 8) | b.to(tl.uint32)
    return take_all, need, prefix, total


@triton.jit
def _row_limit(Vis, t, width, HAS_VIS: tl.constexpr):
    """Keys of row t that may be read: its visible count when given (logits past it are not
    read: a graph's logits are as wide as the longest context it may see), else the width."""
    if HAS_VIS:
        return tl.minimum(tl.load(Vis + t), width)
    return width


@triton.jit
def _hist_kernel(
    Src,
    K: tl.constexpr,
    P: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_VIS: tl.constexpr,
):
    """Pass P: counts of digit P of the visible keys whose digits 0..P-1 match the row's
    threshold so far, added into Hist[t, P] (rows that take all their keys count too, and
    nobody reads those counts). Programs past the row's visible keys return at once."""
    t = tl.program_id(0).to(tl.int64)
    x, pos, limit, hist_row = _row_block(Src, t, BLOCK, HAS_VIS)
    if tl.program_id(1) * BLOCK >= limit:
        return
    _, _, prefix, _ = _threshold(hist_row, K, P)
    _count_digit(x, hist_row, P, prefix, BLOCK)


@triton.jit
def _count_digit(x, hist_row, P: tl.constexpr, prefix, BLOCK: tl.constexpr):
    """Adds digit P's counts of the visible keys of x [BLOCK] whose digits 0..P-1 equal
    prefix into hist_row[P]."""
    key = _sortable(x)
    match = x > float("-inf")
    if P > 0:
        match = match & ((key >> (32 - 8 * P)) == prefix)
    digit = ((key >> (24 - 8 * P)) & 255).to(tl.int32)
    h = _masked_histogram(digit, match, BLOCK)
    tl.atomic_add(hist_row + P * 256 + tl.arange(0, 256), h, mask=h > 0)


@triton.jit
def _write_kernel(
    Src,
    Dst,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_VIS: tl.constexpr,
):
    """Every visible key above the threshold, and ties while the row still needs them, as
    pool slots at positions reserved with atomics (Hist[t, 1024:1026] = written, ties
    claimed); program 0 of each row writes the row's -1 tail."""
    t = tl.program_id(0).to(tl.int64)
    x, pos, limit, hist_row = _row_block(Src, t, BLOCK, HAS_VIS)
    take_all, need, prefix, total = _threshold(hist_row, K, 4)
    if tl.program_id(1) == 0:
        _write_tail(Dst, t, tl.minimum(total, K), K, BLOCK_K)
    if tl.program_id(1) * BLOCK >= limit:
        return
    _write_keys(x, pos, t, hist_row + 4 * 256, Dst, take_all, need, prefix, 0)


@triton.jit
def _row_block(Src, t, BLOCK: tl.constexpr, HAS_VIS: tl.constexpr):
    """This program's block of row t: (logits, -inf past the row's visible keys; their row
    positions; the row's visible limit; the row's counts)."""
    Logits, Vis, Hist, width, stride_l, stride_h = Src
    limit = _row_limit(Vis, t, width, HAS_VIS)
    pos = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(Logits + t * stride_l + pos, mask=pos < limit, other=float("-inf"))
    return x, pos, limit, Hist + t * stride_h


@triton.jit
def _write_tail(Dst, t, taken, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """-1 at row t's positions from `taken` (min(K, visible keys)) on: the keys' positions
    are reserved below it, so no write overlaps."""
    Out, _, _, stride_o, _ = Dst
    i = tl.arange(0, BLOCK_K)
    unused = tl.full([BLOCK_K], -1, tl.int32)
    tl.store(Out + t * stride_o + i, unused, mask=(i >= taken) & (i < K))


@triton.jit
def _write_keys(x, pos, t, count, Dst, take_all, need, prefix, shift):
    """The keys of x [BLOCK] (at row positions pos) that row t takes given its threshold (the
    leading 32 - shift bits of the need-th key still to take: `prefix`), as pool slots at
    positions of its output row reserved with atomics (count[0:2] = written, ties claimed)."""
    Out, R2T, Rows, stride_o, stride_r2t = Dst
    key = _sortable(x) >> shift
    ok = x > float("-inf")
    # take_all as a block, not a scalar: scalar | block gives int32 in the interpreter
    all_keys = (pos * 0 + take_all) != 0
    gt = ok & ((key > prefix) | all_keys)
    eq = ok & (key == prefix) & ~all_keys
    n_eq = tl.sum(eq.to(tl.int32), 0)
    tie0 = tl.atomic_add(count + 1, n_eq)  # ties claimed before this program
    tie_rank = tie0 + tl.cumsum(eq.to(tl.int32), 0) - 1
    take = gt | (eq & (tie_rank < need))
    n_take = tl.sum(take.to(tl.int32), 0)
    base = tl.atomic_add(count, n_take)
    at = base + tl.cumsum(take.to(tl.int32), 0) - 1
    row = tl.load(Rows + t).to(tl.int64)
    slot = tl.load(R2T + row * stride_r2t + pos, mask=take, other=0)
    tl.store(Out + t * stride_o + at, slot.to(tl.int32), mask=take)


# Per row: 4 x 256 digit counts, (written, ties claimed), then the one-launch path's four
# pass counters. Zeroed before the top-k; one fill for the whole batch.
COUNTS = 4 * 256 + 2 + 4


def new_counts(rows: int, device: torch.device) -> torch.Tensor:
    """The top-k's zeroed counters [rows, COUNTS] int32. A decode step allocates them before
    its first indexer kernel, so that the fill does not sit between the logits and the
    top-k (a plain launch there would break their programmatic dependent launch)."""
    return torch.zeros(rows, COUNTS, dtype=torch.int32, device=device)


def row_args(
    logits: torch.Tensor,
    vis: torch.Tensor,
    hist: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
) -> tuple[tuple, tuple]:
    """The kernels' (Src, Dst) argument tuples: (logits, visible counts, digit counts, width,
    their row strides) and (output, req_to_token, request rows, their row strides)."""
    src = (logits, vis, hist, logits.shape[1], logits.stride(0), hist.stride(0))
    return src, (out, req_to_token, rows, out.stride(0), req_to_token.stride(0))


def topk_slots(
    logits: torch.Tensor,
    k: int,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    visible: torch.Tensor | None = None,
    path: str = "auto",
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [T, W] fp32 (-inf where not visible), rows [T] request rows -> int32 [T, k] pool
    slots of the k largest logits (any order), -1 for unused entries. No host sync.
    `visible` [T] int32 (optional): row t reads only its first visible[t] logits, and the
    programs past them return at once (a CUDA graph's W is the longest context it may see).
    `path`: "launches" (five launches, any size), "fused" (one launch, small T x W on a GPU,
    `sparse.topk_fused`), or "auto" (fused where it fits); either after the counters' fill.
    `counts`: zeroed counters from `new_counts` (allocated here when not given)."""
    if logits.dtype != torch.float32 or logits.dim() != 2:
        # the radix keys are the fp32 bit patterns
        raise ValueError(
            f"topk_slots: logits must be 2-D fp32, got {logits.dtype} {logits.dim()}-D"
        )
    if path not in ("auto", "launches", "fused"):
        raise ValueError(f"topk_slots: path must be auto, launches or fused, got {path!r}")
    t, width = logits.shape
    if t == 0 or width == 0:
        return torch.full((t, k), -1, dtype=torch.int32, device=logits.device)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if counts is None:
        counts = new_counts(t, logits.device)
    elif counts.dtype != torch.int32 or counts.shape[0] < t or counts.shape[1] < COUNTS:
        raise ValueError(f"topk_slots: counts must be int32 [>= {t}, >= {COUNTS}] (new_counts)")
    has_vis = visible is not None
    vis = visible if visible is not None else rows  # not read without HAS_VIS
    if path != "launches":
        from mla_backends.sparse import topk_fused

        block = topk_fused.block_for(t, width, logits.device)
        if block is not None:
            return topk_fused.run(logits, k, req_to_token, rows, vis, has_vis, block, counts)
        if path == "fused":
            raise ValueError(
                f"topk_slots: {t} rows of {width} logits do not fit one launch on this device"
            )
    out = torch.empty((t, k), dtype=torch.int32, device=logits.device)
    block = 256 if interpreting() else 2048
    src, dst = row_args(logits, vis, counts, out, req_to_token, rows)
    grid = (t, cdiv(width, block))
    for p in range(4):
        _hist_kernel[grid](src, K=k, P=p, BLOCK=block, HAS_VIS=has_vis)
    _write_kernel[grid](
        src, dst, K=k, BLOCK=block, BLOCK_K=next_pow2(k), HAS_VIS=has_vis, num_warps=8
    )
    return out
