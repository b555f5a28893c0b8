"""The split merge inside the Gluon decode kernels ("join"): once every split of a request's
row block has stored its partial (out, lse), each of those CTAs merges a 1 / NUM_SPLITS
share of the block's output and writes it, so a small batch needs no `_merge_kernel`
launch after the attention kernel (its launch, ramp and tail: 1.9-4.6 us at batch 16,
H100, BENCHMARKS.md thirteenth session).

Protocol, one int32 counter a (request, row block), zero between launches:
- arrive: a CTA barrier (every thread's partial stores issued), then one release add;
- wait: spin on acquire reads until NUM_SPLITS CTAs arrived, then a CTA barrier;
- merge the share, reading the partials past L1 (other SMs wrote them: `.cg`);
- leave: one more add; the CTA that brings the count to 2 x NUM_SPLITS resets it to 0.
  Every CTA of the block has passed its wait by then, so no one can miss the reset, and a
  captured graph replays with the counters as it found them.

Hazard: a CTA waits for CTAs of the same launch, so all of them must be resident at once.
`mla_attention.join_fits` allows the join only for grids of at most one CTA an SM (these
kernels take one SM each: 168-224 KB of shared memory). A process given fewer SMs than the
device has (MPS thread limits, green contexts) or a kernel on another stream that spins the
same way could starve the wait: MLA_JOIN=0 turns it off. The counters are per backend (one
stream): two launches sharing them concurrently would corrupt each other.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from mla_backends.kernels.gluon_tiles import _barrier

# A thread merges at most _PIECE elements at a time, and loads the partials of up to
# _CHUNK_REGS / _PIECE splits of them at once (one L2 round trip a chunk; the attention's
# accumulator is dead here). The 64-row kernel runs under a 224-register cap: whole shares
# of 32-64 elements a thread spilled there (offline SM90 compile).
_PIECE = gl.constexpr(8)
_CHUNK_REGS = gl.constexpr(64)


@gluon.jit
def _arrive_and_wait(counter, NUM_SPLITS: gl.constexpr):
    _barrier()  # every thread of this CTA issued its partial stores
    gl.atomic_add(counter, 1, sem="release", scope="gpu")
    seen = gl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    while seen < NUM_SPLITS:
        seen = gl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    _barrier()


@gluon.jit
def _join_splits(
    Dest,
    Join,
    q_start,
    q_len,
    b,
    mblk,
    split,
    H: gl.constexpr,
    L: gl.constexpr,
    BLOCK_M: gl.constexpr,
    NUM_SPLITS: gl.constexpr,
    NUM_WARPS: gl.constexpr,
):
    """After `_store_rows` wrote this CTA's partial: wait for the block's other splits, then
    merge elements [split * E, (split + 1) * E) of the block's [BLOCK_M, L] output (E =
    BLOCK_M * L / NUM_SPLITS, row-major) into out, and the LSE of the rows whose column 0
    is among them, as `mla_attention._merge_kernel` does."""
    Out, Lse, PartOut, PartLse, stride_o_t, stride_o_h, stride_lse_t = Dest
    E: gl.constexpr = BLOCK_M * L // NUM_SPLITS
    THREADS: gl.constexpr = 32 * NUM_WARPS
    PIECE: gl.constexpr = min(E, _PIECE * THREADS)
    PER: gl.constexpr = max(1, PIECE // THREADS)  # elements a thread holds
    CHUNK: gl.constexpr = min(NUM_SPLITS, _CHUNK_REGS // PER)
    J_L: gl.constexpr = gl.BlockedLayout([1, min(4, PER)], [1, 32], [1, NUM_WARPS], [1, 0])
    E_L: gl.constexpr = gl.SliceLayout(0, J_L)
    S_L: gl.constexpr = gl.SliceLayout(1, J_L)

    counter = Join + b * gl.num_programs(0) + mblk
    _arrive_and_wait(counter, NUM_SPLITS)

    for p in gl.static_range(0, E, PIECE):
        e = split * E + p + gl.arange(0, PIECE, layout=E_L)
        row = mblk * BLOCK_M + e // L
        col = e % L
        ok = row < q_len * H
        prow = (q_start * H + row).to(gl.int64) * NUM_SPLITS  # the row's first partial
        # one pass, the running maximum rescaling what is summed so far (flash-decoding's
        # merge; `_merge_kernel` takes the maximum first)
        m = gl.full([PIECE], float("-inf"), gl.float32, E_L)
        total = gl.zeros([PIECE], gl.float32, E_L)
        acc = gl.zeros([PIECE], gl.float32, E_L)
        for c in gl.static_range(0, NUM_SPLITS, CHUNK):
            at = prow[None, :] + (c + gl.arange(0, CHUNK, layout=S_L))[:, None]
            lse = gl.load(PartLse + at, mask=ok[None, :], other=float("-inf"), cache_modifier=".cg")
            part = gl.load(
                PartOut + at * L + col[None, :], mask=ok[None, :], other=0.0, cache_modifier=".cg"
            )
            m_new = gl.maximum(m, gl.max(lse, 0))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp(m - m_safe)  # 0 while m is -inf: nothing summed yet
            w = gl.exp(lse - m_safe[None, :])  # empty splits: exp(-inf) = 0
            total = total * alpha + gl.sum(w, 0)
            acc = acc * alpha + gl.sum(part * w, 0)
            m = m_new
        m_safe = gl.where(m == float("-inf"), 0.0, m)
        total_safe = gl.where(total == 0.0, 1.0, total)
        t = (q_start + row // H).to(gl.int64)
        h = row % H
        out = (acc / total_safe).to(Out.dtype.element_ty)
        gl.store(Out + t * stride_o_t + h * stride_o_h + col, out, mask=ok)
        lse_out = gl.where(total == 0.0, float("-inf"), m_safe + gl.log(total_safe))
        gl.store(Lse + t * stride_lse_t + h, lse_out, mask=ok & (col == 0))

    _barrier()
    left = gl.atomic_add(counter, 1, sem="relaxed", scope="gpu")
    if left == 2 * NUM_SPLITS - 1:
        gl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
