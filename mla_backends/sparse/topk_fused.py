"""The indexer's top-k in one launch where it fits (its counters zeroed by the caller,
`topk_kernel.new_counts`): every program holds one block of its row's logits in registers
through the radix passes and the write, and the programs of a row wait for each other's
digit counts between passes on a counter in global memory. That removes four of the five
launches of `topk_kernel`, which at batch 1 are most of its time (each pass there is a few
microseconds of work between two launch gaps). The passes stop early once the threshold's
bucket holds exactly the keys still needed: on random logits usually after three 8-bit
digits, or after two on wide counters (`topk_kernel.new_counts`, batches up to 4):
the second pass then takes key bits 23..8 as one 16-bit digit (`_wide_pass`). Each pass with
its wait costs a batch-1 row ~2.5 us on an H100; the wide one ~0.5 us more than an 8-bit one
(nineteenth session, BENCHMARKS.md). Where the logits kernel counted its keys' first digit
(`topk_slots(counted=True)`) the first pass and its wait are skipped: 1.0-1.6 us off the
batch-1 step (twenty-second session).

Hazard: a program spinning on its row's counter waits for programs of the same launch, so
every program must be resident at once: the grid is kept to one program per SM (T x blocks
<= SMs; a program of 8-16 warps and little shared memory always fits an SM), and anything
larger takes the launches. The SM count is the device's: a process given fewer (MPS thread
limits, green contexts) must run the launches (`Config.indexer_topk: launches`). The Triton
interpreter runs programs one after another and would spin forever: it never takes this path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_backends.arith import cdiv, next_pow2
from mla_backends.kernels.common import interpreting, num_sms
from mla_backends.kernels.grid_sync import arrive_and_wait
from mla_backends.kernels.pdl import launch_next, pdl_args, wait_previous
from mla_backends.sparse.topk_kernel import (
    COUNTS,
    MAX_ROW_PROGRAMS,
    MAX_ROW_PROGRAMS_C,
    TIE_SYNC_C,
    TIES_C,
    WIDE_COUNTS,
    TopkCall,
    _count_digit,
    _digit_step,
    _row_block,
    _row_slots,
    _sortable,
    _store_slots,
    _write_tail,
)

# Keys a program holds, smallest first, and its warps. A pass costs a program its histogram,
# which grows with the keys a thread holds (`tl.histogram`: 0.25-0.5 us a key a thread a
# pass on an H100), plus the counter's round trips: ~20 us a launch at 2 keys a thread, 77 us
# at 32 (scripts/bench_topk.py; BENCHMARKS.md, eleventh DSA run).
BLOCKS = (512, 1024, 2048, 4096, 8192)
WARPS = {512: 8, 1024: 8, 2048: 8, 4096: 8, 8192: 16}
# The largest block `auto` takes: with 8192-key blocks (B16 at 64k, B64 at 16k) the launches
# are faster since they refine only the threshold bucket (41 against 45 us, H100, ninth
# session, BENCHMARKS.md); an explicit `fused` still takes them.
AUTO_LARGEST = 4096
SYNC = 4 * 256 + 2  # hist row: 4 x 256 digit counts, (written, unused here), 4 pass counters
WIDE_C = tl.constexpr(COUNTS)  # a wide row's 16-bit digit counts (`topk_kernel.new_counts`)


@triton.jit
def _wide_pass(x, ok, hist_row, prefix, need, progs, BLOCK: tl.constexpr, SYNC: tl.constexpr):
    """The second pass over a 16-bit digit (key bits 23..8) of the keys sharing the
    threshold's first 8 bits (`prefix`): each adds its fine count to the row's 2^16 bins (one
    atomic a key: the keys of one 8-bit bucket spread over its 65536 bins, few to a bin) and
    its coarse count (the digit's high byte, one `tl.histogram`) to the pass-1 counts; after
    the wait the threshold's high byte from the 256 coarse counts, then its low byte from
    that byte's 256 fine ones, so no program scans 65536 bins. -> (need, prefix, done)."""
    bins = tl.arange(0, 256)
    key = _sortable(x)
    match = ok & ((key >> 24) == prefix)
    d16 = ((key >> 8) & 0xFFFF).to(tl.int32)
    _count_digit(x, hist_row, 1, prefix, BLOCK)  # the coarse counts: pass 1's digit
    fine = hist_row + WIDE_C
    tl.atomic_add(fine + d16, tl.full([BLOCK], 1, tl.int32), mask=match, sem="relaxed")
    arrive_and_wait(hist_row + SYNC + 1, progs)
    hi, need = _digit_step(tl.load(hist_row + 256 + bins, volatile=True), bins, need)
    h = tl.load(fine + hi * 256 + bins, volatile=True)
    lo, need = _digit_step(h, bins, need)
    prefix = (prefix << 16) | (hi << 8).to(tl.uint32) | lo.to(tl.uint32)
    return need, prefix, (tl.sum(tl.where(bins == lo, h, 0), 0) == need).to(tl.int32)


@triton.jit
def _topk_fused_kernel(
    Src,
    Dst,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_VIS: tl.constexpr,
    SYNC: tl.constexpr,
    USE_GDC: tl.constexpr,
    WIDE: tl.constexpr = False,
    COUNTED: tl.constexpr = False,
):
    wait_previous(USE_GDC)
    t = tl.program_id(0).to(tl.int64)
    progs = tl.num_programs(1)
    # programs past the row's visible keys hold only -inf (they count nothing) but still
    # arrive at every pass counter
    x, pos, _, hist_row = _row_block(Src, t, BLOCK, HAS_VIS)
    ok = x > float("-inf")  # the row's visible keys in this block
    # every visible key's pool slot, loaded while the passes run: the write then stores them
    # without a dependent read of the page table after its position atomic
    slot = _row_slots(ok, pos, t, Dst)
    bins = tl.arange(0, 256)
    # each pass: count, wait for the row's other programs, then read the complete counts
    # past L1 (other SMs wrote them) and carry the threshold's digits to the next pass;
    # COUNTED: pass 0's counts came with the logits (complete once their grid finished)
    if not COUNTED:
        _count_digit(x, hist_row, 0, 0, BLOCK)
        arrive_and_wait(hist_row + SYNC, progs)
    h = tl.load(hist_row + bins, volatile=True)
    total = tl.sum(h, 0)
    take_all = (total <= K).to(tl.int32)
    b, need = _digit_step(h, bins, total * 0 + K)
    prefix = b.to(tl.uint32)
    # Done once the threshold's bucket holds exactly the keys still needed (all of them are
    # taken: the digits after it change nothing), or the row takes every key. Every program
    # of a row reads the same complete counts, so all of them skip the same passes and no
    # program waits at a counter the others never reach.
    done = ((total <= K) | (tl.sum(tl.where(bins == b, h, 0), 0) == need)).to(tl.int32)
    shift = (total * 0 + 24).to(tl.uint32)  # a tensor: it changes inside a runtime branch
    if WIDE:
        # bits 23..8 as one digit: 2 passes settle most rows where 8-bit digits take 3
        if done == 0:
            need, prefix, done = _wide_pass(x, ok, hist_row, prefix, need, progs, BLOCK, SYNC)
            shift -= 16
    for p in tl.static_range(1, 4):
        if (p == 3 or not WIDE) and done == 0:  # p 1 and 2: the wide pass's bits
            _count_digit(x, hist_row, p, prefix, BLOCK)
            arrive_and_wait(hist_row + SYNC + p, progs)
            h = tl.load(hist_row + p * 256 + bins, volatile=True)
            b, need = _digit_step(h, bins, need)
            prefix = (prefix << 8) | b.to(tl.uint32)
            shift -= 8
            done = (tl.sum(tl.where(bins == b, h, 0), 0) == need).to(tl.int32)
    # The attention after this is released during the write, not at the start: released at
    # the start, its programs sat on the SMs through the passes and batch-16 steps at 32k-64k
    # were 3-7 us slower than without PDL (H100; here: 0.6-3 us faster). It is released only
    # once every program here has called this, so all of them are resident by then and the
    # counter waits above could not starve (kernels/pdl.py).
    launch_next(USE_GDC)
    # The keys above the threshold's digits so far, and of the keys sharing them as many as
    # are still needed: all of them, unless every pass ran and more keys share the whole 32
    # bits (exact ties) than are needed. Only then do the programs rank their ties: each
    # publishes its count and, after one more wait, takes its ties after the earlier
    # programs' (row order, the same set on every run). With a tie-claiming atomic in every
    # call instead (a returning round trip to L2 before the write's own atomic), the top-k
    # alone took 0.3-0.9 us longer and the batch-1 step 0.7-0.9 (H100, eighteenth session),
    # and exact ties came out in another set run to run.
    key = _sortable(x) >> shift
    # take_all as a block, not a scalar: scalar | block gives int32 in the interpreter
    all_keys = (pos * 0 + take_all) != 0
    eq = ok & (key == prefix) & ~all_keys
    rank = tl.cumsum(eq.to(tl.int32), 0) - 1
    if done == 0:
        me = tl.program_id(1)
        tl.store(hist_row + TIES_C + me, tl.sum(eq.to(tl.int32), 0))
        arrive_and_wait(hist_row + TIE_SYNC_C, progs)
        i = tl.arange(0, MAX_ROW_PROGRAMS_C)
        rank += tl.sum(tl.load(hist_row + TIES_C + i, mask=i < me, other=0, volatile=True), 0)
    take = (ok & ((key > prefix) | all_keys)) | (eq & (rank < need))
    _store_slots(take, slot, t, hist_row + 4 * 256, Dst)
    if tl.program_id(1) == 0:
        _write_tail(Dst, t, tl.minimum(total, K), K, BLOCK_K)


def block_for(t: int, width: int, device: torch.device, largest: int = BLOCKS[-1]) -> int | None:
    """The smallest block up to `largest` that keeps T x cdiv(width, block) programs within
    one per SM (and a row's within `MAX_ROW_PROGRAMS`, whose tie counts the counters hold),
    or None (too large, not a GPU, or the interpreter)."""
    if device.type != "cuda" or interpreting():
        return None
    sms = num_sms(device)
    fits = (b for b in BLOCKS if b <= largest and t * cdiv(width, b) <= sms)
    return next((b for b in fits if cdiv(width, b) <= MAX_ROW_PROGRAMS), None)


def run(call: TopkCall, block: int, num_warps: int | None = None) -> torch.Tensor:
    """The one launch in blocks of `block` keys (T x blocks <= SMs: `block_for`)."""
    (t, width), k = call.logits.shape, call.k
    if cdiv(width, block) > MAX_ROW_PROGRAMS:  # the counters hold this many tie counts a row
        raise ValueError(f"topk_fused: {width} keys in blocks of {block} exceed a row's programs")
    out, src, dst = call.kernel_args()
    _topk_fused_kernel[(t, cdiv(width, block))](
        src,
        dst,
        K=k,
        BLOCK=block,
        BLOCK_K=next_pow2(k),
        HAS_VIS=call.has_vis,
        SYNC=SYNC,
        WIDE=call.counts.shape[1] >= WIDE_COUNTS,
        COUNTED=call.counted,
        num_warps=num_warps or WARPS[block],
        **pdl_args(out.device),
    )
    return out
