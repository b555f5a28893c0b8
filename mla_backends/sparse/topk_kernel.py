"""The indexer's top-k as a radix select over each row's logits, the selected positions
written as pool slots (-1 for unused entries).

A radix select takes three passes, one per digit of an order-preserving 32-bit key (most
significant first: 11, 11 and 10 bits): a histogram of the digit over the keys that still match
the threshold's digits so far, then the digit holding the k-th largest key. The last step writes
every key above the threshold and as many of its ties as are still needed, and the -1 tail.
The row is split over programs of 2048 keys; the histograms accumulate in global memory
(atomics) and every program of the next pass re-derives the threshold from them. Five
launches: one fill of the counters, three histograms, the write; the last four over
T x cdiv(W, 2048) programs. (Four 8-bit passes and a separate -1 fill took seven: at batch 1
the top-k is launch-bound, ~4.7 us a launch under a CUDA graph on an H100.)

History (H100, BENCHMARKS.md): one program a row streaming its keys from memory, ~3.6 ns a
key (0.48 ms at 128k keys, latency-bound; DSA third run); one program a row holding a row of
up to 32k keys in registers, all in one launch, 0.083-0.091 ms at 16k and ~0.2 ms at 32k,
against 0.033-0.052 ms for the seven launches of four 8-bit passes (DSA sixth run): on one
SM the four passes' histograms and the scans cost more than six launches save.

Result contract (as `indexer.select_topk` + `positions_to_slots`, up to order): the set of the
k largest finite logits, in no particular order, then -1; rows with fewer than k finite logits
keep all of them; ties at the threshold are taken in no defined order (exactly k entries).
NaN counts as not visible.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_backends.arith import cdiv
from mla_backends.kernels.common import interpreting


@triton.jit
def _sortable(x):
    """fp32 -> uint32 whose unsigned order is the float order (-0 just below +0)."""
    bits = x.to(tl.uint32, bitcast=True)
    neg = (bits >> 31) == 1
    return tl.where(neg, ~bits, bits | 0x80000000)


NBINS = 2048  # bins of every pass's histogram (the last pass's 10-bit digit uses 1024)


@triton.jit
def _digit_step(hist, bins, need):
    """From one digit's histogram [NBINS]: the digit b holding the need-th largest key, and
    how many keys with digit b are still needed once every key with a larger digit is taken
    (b = -1 when fewer than need keys are counted)."""
    at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys with digit >= bin
    b = tl.max(tl.where(at_or_above >= need, bins, -1), 0)
    return b, need - tl.sum(tl.where(bins > b, hist, 0), 0)


@triton.jit
def _digit(key, P: tl.constexpr):
    """Digit P of the key: bits 31-21, 20-10, 9-0."""
    if P == 0:
        return (key >> 21).to(tl.int32)
    elif P == 1:
        return ((key >> 10) & 2047).to(tl.int32)
    else:
        return (key & 1023).to(tl.int32)


@triton.jit
def _masked_histogram(digit, match, BLOCK: tl.constexpr, NB: tl.constexpr):
    """Counts of `digit` [BLOCK] where `match`. No mask argument in triton 3.6: non-matching
    keys land in bin 0 and are taken back out of it."""
    bins = tl.arange(0, NB)
    h = tl.histogram(tl.where(match, digit, 0), NB)
    return h - tl.where(bins == 0, BLOCK - tl.sum(match.to(tl.int32), 0), 0)


@triton.jit
def _state(Row, K: tl.constexpr, P: tl.constexpr, NB: tl.constexpr):
    """(need, prefix) after digit passes 0..P-1 (P >= 1) of one row: pass P-1's digit step on
    its histogram, from the state after pass P-2 that program 0 of the launch before stored
    (so a program reads one histogram a pass, not all of them). prefix: the digits so far of
    the K-th largest key as the key's high bits, right-aligned; need: how many keys sharing
    them are still to be taken."""
    bins = tl.arange(0, NB)
    hist = tl.load(Row + (P - 1) * NB + bins)
    if P == 1:
        need = tl.sum(hist * 0, 0) + K
        prefix = need.to(tl.uint32) * 0
    else:
        need = tl.load(Row + 3 * NB + 3 + 2 * (P - 2))
        prefix = tl.load(Row + 3 * NB + 4 + 2 * (P - 2)).to(tl.uint32, bitcast=True)
    b, need = _digit_step(hist, bins, need)
    if P == 3:
        prefix = (prefix << 10) | b.to(tl.uint32)
    else:
        prefix = (prefix << 11) | b.to(tl.uint32)
    return need, prefix


@triton.jit
def _store_state(Row, need, prefix, P: tl.constexpr, NB: tl.constexpr):
    """Program 0 of pass P's launch: the state after pass P-1 for the launches after it (and,
    at P = 1, the row's visible count), in slots nobody reads during this launch."""
    tl.store(Row + 3 * NB + 3 + 2 * (P - 1), need)
    tl.store(Row + 3 * NB + 4 + 2 * (P - 1), prefix.to(tl.int32, bitcast=True))
    if P == 1:
        tl.store(Row + 3 * NB + 2, tl.sum(tl.load(Row + tl.arange(0, NB)), 0))


@triton.jit
def _row_limit(Vis, t, width, HAS_VIS: tl.constexpr):
    """Keys of row t that may be read: its visible count when given (logits past it are not
    read: a graph's logits are as wide as the longest context it may see), else the width."""
    if HAS_VIS:
        return tl.minimum(tl.load(Vis + t), width)
    return width


@triton.jit
def _hist_kernel(
    Logits,
    Hist,
    Vis,
    width,
    stride_l,
    stride_h,
    K: tl.constexpr,
    P: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_VIS: tl.constexpr,
    NB: tl.constexpr,
):
    """Pass P: counts of digit P of the visible keys whose digits 0..P-1 match the row's
    threshold so far, added into Hist[t, P] (rows that take all their keys count too, and
    nobody reads those counts). Programs past the row's visible keys return at once."""
    t = tl.program_id(0).to(tl.int64)
    limit = _row_limit(Vis, t, width, HAS_VIS)
    if tl.program_id(1) * BLOCK >= limit:
        return  # program 0 returns only for a row with no key: its slots stay 0 (none)
    hist_row = Hist + t * stride_h
    if P > 0:
        need, prefix = _state(hist_row, K, P, NB)
        if tl.program_id(1) == 0:
            _store_state(hist_row, need, prefix, P, NB)
    pos = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(Logits + t * stride_l + pos, mask=pos < limit, other=float("-inf"))
    key = _sortable(x)
    match = x > float("-inf")
    if P == 1:
        match = match & ((key >> 21) == prefix)
    elif P == 2:
        match = match & ((key >> 10) == prefix)
    h = _masked_histogram(_digit(key, P), match, BLOCK, NB)
    tl.atomic_add(hist_row + P * NB + tl.arange(0, NB), h, mask=h > 0)


@triton.jit
def _write_kernel(
    Logits,
    Hist,
    Out,
    R2T,
    Rows,
    Vis,
    width,
    stride_l,
    stride_h,
    stride_o,
    stride_r2t,
    K: tl.constexpr,
    KP2: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_VIS: tl.constexpr,
    NB: tl.constexpr,
):
    """Every visible key above the threshold, and ties while the row still needs them, as
    pool slots at positions reserved with atomics (Hist[t, 3 NB], Hist[t, 3 NB + 1] = written,
    ties claimed); program 0 of the row writes -1 past the min(visible, K) entries the others fill
    (it runs even when the row has no visible key)."""
    t = tl.program_id(0).to(tl.int64)
    hist_row = Hist + t * stride_h
    need, prefix = _state(hist_row, K, 3, NB)
    total = tl.load(hist_row + 3 * NB + 2)  # visible keys of the row (0: none, or no pass ran)
    take_all = (total <= K).to(tl.int32)
    if tl.program_id(1) == 0:
        j = tl.arange(0, KP2)
        tail = (j >= tl.minimum(total, K)) & (j < K)
        tl.store(Out + t * stride_o + j, tl.full([KP2], -1, tl.int32), mask=tail)
    limit = _row_limit(Vis, t, width, HAS_VIS)
    if tl.program_id(1) * BLOCK >= limit:
        return
    count = hist_row + 3 * NB
    pos = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(Logits + t * stride_l + pos, mask=pos < limit, other=float("-inf"))
    key = _sortable(x)
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


def topk_slots(
    logits: torch.Tensor,
    k: int,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [T, W] fp32 (-inf where not visible), rows [T] request rows -> int32 [T, k] pool
    slots of the k largest logits (any order), -1 for unused entries. No host sync.
    `visible` [T] int32 (optional): row t reads only its first visible[t] logits, and the
    programs past them return at once (a CUDA graph's W is the longest context it may see)."""
    if logits.dtype != torch.float32 or logits.dim() != 2:
        # the radix keys are the fp32 bit patterns
        raise ValueError(
            f"topk_slots: logits must be 2-D fp32, got {logits.dtype} {logits.dim()}-D"
        )
    t, width = logits.shape
    if t == 0 or width == 0:
        return torch.full((t, k), -1, dtype=torch.int32, device=logits.device)
    out = torch.empty((t, k), dtype=torch.int32, device=logits.device)  # the write fills it
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block = 256 if interpreting() else 2048
    # per row: 3 x NBINS digit counts, (written, ties claimed), the visible count and the
    # (need, prefix) after passes 0 and 1 (`_state`); one fill zeroes them all
    hist = torch.zeros(t, 3 * NBINS + 7, dtype=torch.int32, device=logits.device)
    grid = (t, cdiv(width, block))
    has_vis = visible is not None
    vis = visible if visible is not None else rows  # not read without HAS_VIS
    for p in range(3):
        _hist_kernel[grid](
            logits,
            hist,
            vis,
            width,
            logits.stride(0),
            hist.stride(0),
            K=k,
            P=p,
            BLOCK=block,
            HAS_VIS=has_vis,
            NB=NBINS,
        )
    _write_kernel[grid](
        logits,
        hist,
        out,
        req_to_token,
        rows,
        vis,
        width,
        logits.stride(0),
        hist.stride(0),
        out.stride(0),
        req_to_token.stride(0),
        K=k,
        KP2=triton.next_power_of_2(k),
        BLOCK=block,
        HAS_VIS=has_vis,
        NB=NBINS,
        num_warps=8,
    )
    return out
