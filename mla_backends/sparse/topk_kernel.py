"""The indexer's top-k as a radix select over each row's logits, the selected positions
written as pool slots (-1 for unused entries).

A radix select takes up to four passes, one per 8-bit digit of an order-preserving 32-bit key
(most significant first): a histogram of the digit over the keys that still match the
threshold's digits so far, then the digit holding the k-th largest key. Here only the first
two passes run over the whole row (programs of 2048 keys, histograms accumulated in global
memory with atomics, every program re-deriving the threshold from them); a third launch then
writes every key above the threshold's 16-bit bucket and appends the bucket's own keys, the
only ones still undecided, to a candidate list, unless the bucket holds exactly the keys
still needed; the last of a row's programs to finish that scan then finishes the digits
over the candidates alone and writes them. Three launches over T x cdiv(W, 2048) programs,
on zeroed counters (`new_counts`; the indexer zeroes them in its q prep). On random logits
a 16-bit bucket holds about W / 256 keys near the threshold or fewer, so the last two digits
cost almost nothing; a row whose keys share their leading 16 bits (near-equal logits) puts
all of them in the list, which one program then scans three times: correct, and slow only
for such rows.

History (H100, BENCHMARKS.md): one program a row streaming its keys from memory, ~3.6 ns a
key (0.48 ms at 128k keys, latency-bound; DSA third run); one program a row holding a row of
up to 32k keys in registers, all in one launch, 0.083-0.091 ms at 16k and ~0.2 ms at 32k
(DSA sixth run): on one SM the four passes' histograms (`tl.histogram`, ~1.6 keys a clock
an SM) and the scans cost more than launches save. Three passes of 11 / 11 / 10-bit digits
measured 0.056-0.058 ms at batch 1 and 0.86 ms at B64 / 128k against 0.033 and 0.235 (DSA
eighth run): a 2048-bin `tl.histogram` and its scan cost far more per program than a
256-bin one. All four passes over the whole row and a write (five launches, until the ninth
session): 0.050 / 0.233 ms at B64 16k / 128k, 2.6x SGLang's one-block-a-row CUDA top-k
(`sgl_kernel.fast_topk_v2`, which also refines only its threshold bucket's candidates).

Result contract (as `indexer.select_topk` + `positions_to_slots`, up to order): the set of the
k largest finite logits, in no particular order, then -1; rows with fewer than k finite logits
keep all of them; ties at the threshold are taken in no defined order by the launches and in
row order by the one launch (`topk_fused`), exactly k entries either way.
NaN counts as not visible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mla_backends.arith import cdiv, next_pow2
from mla_backends.batch import as_int_at_least
from mla_backends.checks import unit_stride
from mla_backends.kernels.common import interpreting

SPLIT_DONE_C = tl.constexpr(4 * 256 + 2 + 4)  # see COUNTS


@triton.jit
def _sortable(x):
    """fp32 -> uint32 whose unsigned order is the float order (-0 just below +0)."""
    bits = x.to(tl.uint32, bitcast=True)
    neg = (bits >> 31) == 1
    # Hazard: `~bits` is `bits ^ -1` in triton 3.8's interpreter, which numpy 2 refuses for a
    # uint32 (OverflowError); the XOR with an unsigned all-ones constant is the same bits
    return tl.where(neg, bits ^ 0xFFFFFFFF, bits | 0x80000000)


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
def _digit_counts(x, P: tl.constexpr, prefix, BLOCK: tl.constexpr):
    """Digit P's counts [256] of the visible keys of x [BLOCK] whose digits 0..P-1 equal
    prefix."""
    key = _sortable(x)
    match = x > float("-inf")
    if P > 0:
        match = match & ((key >> (32 - 8 * P)) == prefix)
    digit = ((key >> (24 - 8 * P)) & 255).to(tl.int32)
    return _masked_histogram(digit, match, BLOCK)


@triton.jit
def _count_digit(x, hist_row, P: tl.constexpr, prefix, BLOCK: tl.constexpr):
    """Adds `_digit_counts` into hist_row[P]."""
    h = _digit_counts(x, P, prefix, BLOCK)
    tl.atomic_add(hist_row + P * 256 + tl.arange(0, 256), h, mask=h > 0)


@triton.jit
def _bucket16(hist_row, K: tl.constexpr):
    """`_threshold` after the first two digits, and whether that settles the row: it takes
    every key, or the threshold's 16-bit bucket holds exactly the keys still needed."""
    take_all, need, prefix, total = _threshold(hist_row, K, 2)
    bucket = tl.load(hist_row + 256 + (prefix & 255).to(tl.int32))
    return take_all, need, prefix, total, (take_all != 0) | (bucket == need)


@triton.jit
def _split_kernel(
    Src,
    Dst,
    Cand,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_VIS: tl.constexpr,
    CB: tl.constexpr,
):
    """After the first two digit passes: every visible key above the threshold's 16-bit
    bucket as a pool slot (positions reserved with atomics, Hist[t, 1024] = written), and the
    bucket's keys too where it holds exactly the keys still needed or the row takes every key;
    otherwise the bucket's row positions appended to the row's candidates (Hist[t, 1025] =
    appended), which the row's last program to finish here settles (`_resolve`; Hist[t,
    SPLIT_DONE] counts the finished programs). Program 0 of each row writes the -1 tail."""
    t = tl.program_id(0).to(tl.int64)
    x, pos, limit, hist_row = _row_block(Src, t, BLOCK, HAS_VIS)
    # programs past the visible keys (a graph's logits are as wide as its longest context)
    # leave before reading the counts; program 0 stays for the tail
    past = tl.program_id(1) * BLOCK >= limit
    if past & (tl.program_id(1) > 0):
        return
    take_all, need, prefix, total, exact = _bucket16(hist_row, K)
    if tl.program_id(1) == 0:
        _write_tail(Dst, t, tl.minimum(total, K), K, BLOCK_K)
    if past:
        return
    count = hist_row + 4 * 256
    key = _sortable(x) >> 16
    ok = x > float("-inf")
    # scalars as blocks: scalar | block gives int32 in the interpreter
    all_keys = (pos * 0 + take_all) != 0
    settled = (pos * 0 + exact.to(tl.int32)) != 0
    eq = ok & (key == prefix) & ~all_keys
    take = (ok & ((key > prefix) | all_keys)) | (eq & settled)
    # Positions by a cumsum and one atomic a program, so that a row of one program (every
    # prefill row up to 2048 keys) comes out in the same order on every run: one atomic a key
    # was faster at B64 128k (57 us against 97, H100) but reordered prefill rows run to run,
    # and attention over another order rounds differently. Programs with nothing to write
    # (most of them, for the candidates) skip the scan and the atomic.
    if tl.sum(take.to(tl.int32), 0) > 0:
        _write_slots(take, pos, t, count, Dst)
    cand = eq & ~settled
    n_cand = tl.sum(cand.to(tl.int32), 0)
    if n_cand > 0:
        at = tl.atomic_add(count + 1, n_cand) + tl.cumsum(cand.to(tl.int32), 0) - 1
        Cands, stride_c = Cand
        tl.store(Cands + t * stride_c + at, pos, mask=cand)
    # The row's last program here settles its bucket: every other program's writes and
    # appends were issued before its arrival (barrier, then a release), and this one acquires
    # them. It saves a fourth launch and the counts' re-reading a launch costs (~8 us a call
    # on an H100 whatever the size, ninth session).
    tl.debug_barrier()
    arrived = tl.atomic_add(hist_row + SPLIT_DONE_C, 1, sem="acq_rel", scope="gpu")
    if (arrived == tl.cdiv(limit, BLOCK) - 1) & (exact == 0):
        _resolve(Src, Dst, Cand, t, need, prefix, CB)


@triton.jit
def _resolve(Src, Dst, Cand, t, need, prefix, CB: tl.constexpr):
    """Row t whose threshold's 16-bit bucket (`prefix`) holds more keys than the `need` still
    wanted: digits 2 and 3 over the bucket's candidates alone (CB at a time, stopping once the
    bucket is exact), then the candidates above the threshold and as many of its ties as are
    still needed, written after the keys the split wrote. Counts and candidates that other
    programs wrote are read past L1 (volatile)."""
    Logits, Vis, Hist, width, stride_l, stride_h = Src
    count = Hist + t * stride_h + 4 * 256
    n = tl.load(count + 1, volatile=True)
    Cands, stride_c = Cand
    cands = Cands + t * stride_c
    bins = tl.arange(0, 256)
    shift = (n * 0 + 16).to(tl.uint32)  # a tensor: it changes inside a runtime branch
    done = n * 0
    # the first CB candidates (on spread logits, all of them) gathered once for every pass
    x0, pos0 = _candidates(Logits + t * stride_l, cands, 0, n, CB)
    for p in tl.static_range(2, 4):
        if done == 0:
            h = tl.zeros([256], tl.int32)
            for c in range(0, n, CB):
                x, pos = _chunk(Logits + t * stride_l, cands, c, n, x0, pos0, CB)
                h += _digit_counts(x, p, prefix, CB)
            b, need = _digit_step(h, bins, need)
            prefix = (prefix << 8) | b.to(tl.uint32)
            shift -= 8
            done = (tl.sum(tl.where(bins == b, h, 0), 0) == need).to(tl.int32)
    ties = n * 0  # ties at the threshold taken by earlier chunks
    at = tl.load(count, volatile=True)  # after the keys the split wrote; the rest is this one's
    Out, R2T, Rows, stride_o, stride_r2t = Dst
    row = tl.load(Rows + t).to(tl.int64)
    for c in range(0, n, CB):
        x, pos = _chunk(Logits + t * stride_l, cands, c, n, x0, pos0, CB)
        key = _sortable(x) >> shift
        ok = x > float("-inf")
        eq = ok & (key == prefix)
        take = (ok & (key > prefix)) | (eq & (ties + tl.cumsum(eq.to(tl.int32), 0) <= need))
        slot = tl.load(R2T + row * stride_r2t + pos, mask=take, other=0)
        tl.store(Out + t * stride_o + at + tl.cumsum(take.to(tl.int32), 0) - 1, slot, mask=take)
        at += tl.sum(take.to(tl.int32), 0)
        ties += tl.sum(eq.to(tl.int32), 0)


@triton.jit
def _candidates(row_logits, cands, c, n, CB: tl.constexpr):
    """Candidates c .. c + CB of a row: (their logits, -inf past the n appended; their row
    positions)."""
    i = c + tl.arange(0, CB)
    pos = tl.load(cands + i, mask=i < n, other=0, volatile=True)  # other programs appended
    return tl.load(row_logits + pos, mask=i < n, other=float("-inf")), pos


@triton.jit
def _chunk(row_logits, cands, c, n, x0, pos0, CB: tl.constexpr):
    """`_candidates` at c, the ones already held (x0, pos0) when c is 0."""
    if c == 0:
        x, pos = x0, pos0
    else:
        x, pos = _candidates(row_logits, cands, c, n, CB)
    return x, pos


@triton.jit
def _write_slots(take, pos, t, count, Dst):
    """The pool slots of row t's keys at row positions pos where `take`, at positions of its
    output row reserved with an atomic on count[0] (written so far)."""
    _store_slots(take, _row_slots(take, pos, t, Dst), t, count, Dst)


@triton.jit
def _row_slots(mask, pos, t, Dst):
    """The pool slots of row t's row positions pos where `mask` (0 elsewhere)."""
    _, R2T, Rows, _, stride_r2t = Dst
    row = tl.load(Rows + t).to(tl.int64)
    return tl.load(R2T + row * stride_r2t + pos, mask=mask, other=0)


@triton.jit
def _store_slots(take, slot, t, count, Dst):
    """Pool slots `slot` where `take`, at positions of row t's output reserved with an atomic
    on count[0] (written so far)."""
    Out, _, _, stride_o, _ = Dst
    at = tl.atomic_add(count, tl.sum(take.to(tl.int32), 0)) + tl.cumsum(take.to(tl.int32), 0) - 1
    tl.store(Out + t * stride_o + at, slot.to(tl.int32), mask=take)


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


# Per row: 4 x 256 digit counts (the launches fill the first two), (written, candidates
# appended by the launches), the one-launch path's four pass counters, the launches' split
# programs finished (SPLIT_DONE), the one-launch path's counter for exact ties (TIE_SYNC),
# then each of its programs' keys tied at the threshold (TIES, up to MAX_ROW_PROGRAMS; not
# read before written). Zeroed before the top-k, once for the whole batch (`new_counts`).
# Wide rows (WIDE_COUNTS) hold 2^16 more after those: the one launch's 16-bit middle digit
# (`topk_fused`), which settles a row in two passes where 8-bit digits take three.
TIE_SYNC_C = tl.constexpr(SPLIT_DONE_C.value + 1)
TIES_C = tl.constexpr(TIE_SYNC_C.value + 1)
MAX_ROW_PROGRAMS_C = tl.constexpr(256)
MAX_ROW_PROGRAMS = MAX_ROW_PROGRAMS_C.value
COUNTS = TIES_C.value + MAX_ROW_PROGRAMS
WIDE_BINS = 1 << 16
WIDE_COUNTS = COUNTS + WIDE_BINS
# Rows up to which `new_counts` gives wide counters by default: their 256 KB a row are zeroed
# on every call, which batch 1 pays for once (the pass they save is ~2.5 us there, H100,
# nineteenth session) and larger batches would pay for in every row.
WIDE_ROWS = 4


def check_rows(
    caller: str,
    t: int,
    width: int,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    visible: torch.Tensor | None,
) -> None:
    """Shapes only (no sync): a request row and a visible count for each of the T tokens, and
    a table as wide as the keys read, so no kernel reads past a request's table row (into the
    next request's slots) or past `rows`."""
    if rows.dim() != 1 or rows.shape[0] != t:
        raise ValueError(f"{caller}: rows must be [T] = [{t}], got {tuple(rows.shape)}")
    if visible is not None and (visible.dim() != 1 or visible.shape[0] != t):
        raise ValueError(f"{caller}: visible must be [T] = [{t}], got {tuple(visible.shape)}")
    if req_to_token.dim() != 2 or req_to_token.shape[1] < width:
        raise ValueError(
            f"{caller}: req_to_token must be [requests, >= {width}] (the keys read), "
            f"got {tuple(req_to_token.shape)}"
        )
    if req_to_token.stride(1) != 1:  # the kernels step a row by 1: a view gave other slots
        raise ValueError(f"{caller}: req_to_token's rows must be contiguous (stride 1)")


def check_counts(counts: torch.Tensor, rows: int, caller: str) -> None:
    """The one check of counters handed to the top-k or to the logits that count for it:
    int32 [>= rows, >= COUNTS] (`new_counts`) with contiguous rows, as every kernel indexes
    a row's counters from its start with unit stride."""
    if (
        counts.dtype != torch.int32
        or counts.dim() != 2
        or counts.shape[0] < rows
        or counts.shape[1] < COUNTS
        or counts.stride(1) != 1
    ):
        raise ValueError(
            f"{caller}: counts must be int32 [>= {rows}, >= {COUNTS}] with contiguous rows "
            f"(topk_kernel.new_counts), got {counts.dtype} {tuple(counts.shape)} "
            f"strides {counts.stride()}"
        )


def new_counts(
    rows: int, device: torch.device, zeroed: bool = True, wide: bool | None = None
) -> torch.Tensor:
    """The top-k's counters [rows, COUNTS or WIDE_COUNTS] int32, zeroed (a fill kernel), or not
    zeroed for a caller that zeroes them in a kernel of its own (the indexer: in its q prep,
    `indexer_kernels.prepare_q_fused(zero=)`). Either way the zeroing must come before the
    logits: a plain launch between the logits and the top-k would break their programmatic
    dependent launch. `wide`: rows of WIDE_COUNTS (the one launch's 16-bit digit); None: up to
    WIDE_ROWS rows on a GPU (the interpreter never takes the one launch)."""
    if wide is None:
        wide = rows <= WIDE_ROWS and device.type == "cuda" and not interpreting()
    width = WIDE_COUNTS if wide else COUNTS
    if zeroed:
        return torch.zeros(rows, width, dtype=torch.int32, device=device)
    return torch.empty(rows, width, dtype=torch.int32, device=device)


def sortable_keys(x: torch.Tensor) -> torch.Tensor:
    """`_sortable` in torch: fp32 -> int64 holding the order-preserving uint32 key."""
    bits = x.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >> 31 == 1, bits ^ 0xFFFFFFFF, bits | 0x80000000)


def add_first_counts(
    logits: torch.Tensor, counts: torch.Tensor, visible: torch.Tensor | None = None
) -> None:
    """What the logits kernels add for the top-k (`index_logits(counts=)`: pass 0's
    `_count_digit`), in torch and without a host sync: for logits made by another kernel
    that a top-k told `counted` should take (and the tests' reference). Visible keys: finite
    or +inf, and before visible[t] where given."""
    t, width = logits.shape
    ok = logits > float("-inf")
    if visible is not None:
        ok &= torch.arange(width, device=logits.device)[None, :] < visible[:, None].long()
    counts[:t, :256].scatter_add_(1, sortable_keys(logits) >> 24, ok.to(torch.int32))


@dataclass(frozen=True)
class TopkCall:
    """One top-k's inputs, as every path takes them: logits [T, W] fp32, k, the pool's
    req_to_token, request rows [T], visible counts [T] (read only with `has_vis`), zeroed
    counters (`new_counts`)."""

    logits: torch.Tensor
    k: int
    req_to_token: torch.Tensor
    rows: torch.Tensor
    vis: torch.Tensor
    has_vis: bool
    counts: torch.Tensor
    counted: bool = False  # pass 0's counts already in (`index_logits(counts=)`)

    def kernel_args(self) -> tuple[torch.Tensor, tuple, tuple]:
        """A fresh output [T, k] int32 and the kernels' (Src, Dst) argument tuples:
        (logits, visible counts, digit counts, width, their row strides) and (output,
        req_to_token, request rows, their row strides)."""
        logits, hist, r2t = self.logits, self.counts, self.req_to_token
        out = torch.empty((logits.shape[0], self.k), dtype=torch.int32, device=logits.device)
        src = (logits, self.vis, hist, logits.shape[1], logits.stride(0), hist.stride(0))
        return out, src, (out, r2t, self.rows, out.stride(0), r2t.stride(0))


def topk_slots(
    logits: torch.Tensor,
    k: int,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    visible: torch.Tensor | None = None,
    path: str = "auto",
    counts: torch.Tensor | None = None,
    counted: bool = False,
) -> torch.Tensor:
    """logits [T, W] fp32 (-inf where not visible), rows [T] request rows -> int32 [T, k] pool
    slots of the k largest logits (any order), -1 for unused entries. No host sync.
    `visible` [T] int32 (optional): row t reads only its first visible[t] logits, and the
    programs past them return at once (a CUDA graph's W is the longest context it may see).
    `path`: "launches" (three launches, any size), "fused" (one launch, small T x W on a GPU,
    `sparse.topk_fused`), or "auto" (fused where it fits in blocks of up to
    `topk_fused.AUTO_LARGEST` keys, the faster one there); either on zeroed counters.
    `counts`: zeroed counters from `new_counts` (allocated here when not given); wide
    ones let the one launch take its 16-bit middle digit. `counted`: the logits kernel
    already added its keys' first digit counts to them (`index_logits(counts=)`;
    `add_first_counts` for logits made elsewhere), so every path skips its
    first pass: one wait fewer in the one launch, one launch fewer in the launches. Told
    `counted` over counters that hold anything else, the sets are wrong."""
    if logits.dtype != torch.float32 or logits.dim() != 2:
        # the radix keys are the fp32 bit patterns
        raise ValueError(
            f"topk_slots: logits must be 2-D fp32, got {logits.dtype} {logits.dim()}-D"
        )
    if path not in ("auto", "launches", "fused"):
        raise ValueError(f"topk_slots: path must be auto, launches or fused, got {path!r}")
    k = as_int_at_least(k, "topk_slots: k", 1)
    t, width = logits.shape
    check_rows("topk_slots", t, width, req_to_token, rows, visible)
    if t == 0 or width == 0:
        return torch.full((t, k), -1, dtype=torch.int32, device=logits.device)
    logits = unit_stride(logits)
    if counts is None:
        if counted:
            raise ValueError("topk_slots: counted needs the counters the logits counted into")
        counts = new_counts(t, logits.device)
    else:
        check_counts(counts, t, "topk_slots")
    has_vis = visible is not None
    vis = visible if visible is not None else rows  # not read without HAS_VIS
    call = TopkCall(logits, k, req_to_token, rows, vis, has_vis, counts, counted)
    if path != "launches":
        from mla_backends.sparse import topk_fused

        largest = topk_fused.AUTO_LARGEST if path == "auto" else topk_fused.BLOCKS[-1]
        block = topk_fused.block_for(t, width, logits.device, largest)
        if block is not None:
            return topk_fused.run(call, block)
        if path == "fused":
            raise ValueError(
                f"topk_slots: {t} rows of {width} logits do not fit one launch on this device"
            )
    return launches(call)


# Keys a program of the launches' histogram passes and split holds (and its warps): the
# interpreter's small blocks keep CPU tests to a few programs a row.
HIST_BLOCK, SPLIT_BLOCK = 2048, 2048
# Candidates a chunk of `_resolve`, one a thread of the split's 256: a spread row's bucket
# holds about W / 256 keys or fewer, one chunk up to 64k keys a row, two at 128k.
RESOLVE_CHUNK = 256


def launches(
    call: TopkCall, hist_block: int = HIST_BLOCK, split_block: int = SPLIT_BLOCK
) -> torch.Tensor:
    """The three launches (`topk_slots` path "launches")."""
    (t, width), k, has_vis = call.logits.shape, call.k, call.has_vis
    if interpreting():
        hist_block = split_block = 256
    out, src, dst = call.kernel_args()
    # a row's undecided keys: as many as its keys at worst (near-equal logits)
    cand = torch.empty((t, width), dtype=torch.int32, device=out.device)
    grid = (t, cdiv(width, hist_block))
    for p in range(1 if call.counted else 0, 2):
        _hist_kernel[grid](
            src, K=k, P=p, BLOCK=hist_block, HAS_VIS=has_vis, num_warps=max(4, hist_block // 512)
        )
    consts = {"K": k, "BLOCK": split_block, "BLOCK_K": next_pow2(k), "HAS_VIS": has_vis}
    _split_kernel[(t, cdiv(width, split_block))](
        src, dst, (cand, cand.stride(0)), **consts, CB=RESOLVE_CHUNK,
        num_warps=max(8, split_block // 512),
    )  # fmt: skip
    return out
