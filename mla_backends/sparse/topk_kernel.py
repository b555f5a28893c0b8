"""The indexer's top-k in one launch: a radix select over each row's logits, one program a row,
then the selected positions written as pool slots (-1 for unused entries).

Each program reads its row five times: four 8-bit digit histograms of an order-preserving
32-bit key (most significant first) find the k-th largest key and how many of its ties to
take, then one pass writes every key above it and the first ties in position order.

Not routed yet (`Indexer.select` uses `torch.topk`): on an H100 one program streams its row at
~3.6 ns a key, 0.065 ms at 16k keys (torch.topk 0.10) but 0.48 ms at 128k (torch.topk
0.08-0.20), whatever the batch (BENCHMARKS.md, DSA third run). The next step is splitting a
row over many programs (global histograms), which this single-program form is the oracle for.

Result contract (same as `indexer.select_topk` + `positions_to_slots`): the set of the k
largest finite logits (ties at the threshold broken by position), in no particular order,
then -1; rows with fewer than k finite logits keep all of them. NaN counts as not visible.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_backends.kernels.common import interpreting


@triton.jit
def _sortable(x):
    """fp32 -> uint32 whose unsigned order is the float order (-0 just below +0)."""
    bits = x.to(tl.uint32, bitcast=True)
    neg = (bits >> 31) == 1
    return tl.where(neg, ~bits, bits | 0x80000000)


@triton.jit
def _digit_hist(src, width, prefix, SHIFT: tl.constexpr, FIRST: tl.constexpr, BLOCK: tl.constexpr):
    """Counts [256] of digit (key >> SHIFT) & 255 over the visible keys whose higher digits
    equal `prefix` (all visible keys when FIRST)."""
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    hist = tl.zeros([256], tl.int32)
    for start in range(0, width, BLOCK):
        x = tl.load(src + start + offs, mask=start + offs < width, other=float("-inf"))
        key = _sortable(x)
        match = x > float("-inf")
        if not FIRST:
            match = match & ((key >> (SHIFT + 8)) == prefix)
        digit = ((key >> SHIFT) & 255).to(tl.int32)
        # no mask argument (triton 3.6 has none): non-matching keys land in bin 0 and are
        # taken back out of it
        h = tl.histogram(tl.where(match, digit, 0), 256)
        off_bin = BLOCK - tl.sum(match.to(tl.int32), 0)
        hist += h - tl.where(bins == 0, off_bin, 0)
    return hist


@triton.jit
def _next_digit(hist, need, prefix):
    """The digit holding the need-th largest key of this prefix; (need within it, prefix + it)."""
    bins = tl.arange(0, 256)
    at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys with digit >= bin
    b = tl.max(tl.where(at_or_above >= need, bins, -1), 0)
    need = need - tl.sum(tl.where(bins > b, hist, 0), 0)
    return need, (prefix << 8) | b.to(tl.uint32)


@triton.jit
def _topk_slots_kernel(
    Logits,
    Out,
    R2T,
    Rows,
    width,
    stride_l,
    stride_o,
    stride_r2t,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    src = Logits + t * stride_l
    # ---- radix select, most significant digit first: `prefix` = the k-th largest key's
    # digits so far, `need` = how many keys sharing them are still to be taken
    hist = _digit_hist(src, width, 0, 24, True, BLOCK)
    total = tl.sum(hist, 0)  # visible keys
    take_all = total <= K
    need = total * 0 + K
    prefix = (total * 0).to(tl.uint32)
    if not take_all:
        need, prefix = _next_digit(hist, need, prefix)
        hist = _digit_hist(src, width, prefix, 16, False, BLOCK)
        need, prefix = _next_digit(hist, need, prefix)
        hist = _digit_hist(src, width, prefix, 8, False, BLOCK)
        need, prefix = _next_digit(hist, need, prefix)
        hist = _digit_hist(src, width, prefix, 0, False, BLOCK)
        need, prefix = _next_digit(hist, need, prefix)
    # ---- write: every key above the threshold, then its first `need` ties, as pool slots
    offs = tl.arange(0, BLOCK)
    row = tl.load(Rows + t).to(tl.int64)
    dst = Out + t * stride_o
    written = total * 0
    ties = total * 0
    for start in range(0, width, BLOCK):
        pos = start + offs
        x = tl.load(src + pos, mask=pos < width, other=float("-inf"))
        key = _sortable(x)
        ok = x > float("-inf")
        eq = ok & (key == prefix)
        tie_rank = ties + tl.cumsum(eq.to(tl.int32), 0) - 1
        take = tl.where(take_all, ok, ok & ((key > prefix) | (eq & (tie_rank < need))))
        ties += tl.sum(eq.to(tl.int32), 0)
        at = written + tl.cumsum(take.to(tl.int32), 0) - 1
        slot = tl.load(R2T + row * stride_r2t + pos, mask=take, other=0)
        tl.store(dst + at, slot.to(tl.int32), mask=take)
        written += tl.sum(take.to(tl.int32), 0)
    kk = tl.arange(0, BLOCK_K)
    for start in range(0, K, BLOCK_K):
        i = start + kk
        tl.store(dst + i, tl.full([BLOCK_K], -1, tl.int32), mask=(i >= written) & (i < K))


def topk_slots(
    logits: torch.Tensor, k: int, req_to_token: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """logits [T, W] fp32 (-inf where not visible), rows [T] request rows -> int32 [T, k] pool
    slots of the k largest logits (any order), -1 for unused entries. No host sync."""
    t, width = logits.shape
    out = torch.empty(t, k, dtype=torch.int32, device=logits.device)
    if t == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block = 256 if interpreting() else 4096
    _topk_slots_kernel[(t,)](
        logits,
        out,
        req_to_token,
        rows,
        width,
        logits.stride(0),
        out.stride(0),
        req_to_token.stride(0),
        K=k,
        BLOCK=block,
        BLOCK_K=min(1024, triton.next_power_of_2(k)),
        num_warps=8,
    )
    return out
