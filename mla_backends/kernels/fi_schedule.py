"""FlashInfer's MLA schedule written on the device: one Triton program fills the int workspace
that FlashInfer's MLA kernel reads, from the device lengths, with no host planning and no copy.

Same work items, partial rows and merge entries as flashinfer 0.7.2's host `MLAPlan` (the
port in `mla_backends/fi_schedule.py` is the oracle); only the item -> cluster assignment
differs: items, in tile-major order, are cut into contiguous runs of equal cost (cost =
2 * tile rows + keys, the planner's cost function) instead of going to the least-loaded
cluster one by one. Each cluster's load stays within one item of the average either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mla_backends.arith import cdiv, next_pow2
from mla_backends.fi_planner import CTA_TILE_Q, MAX_WORKS
from mla_backends.kernels.index import BLOCK as PAGE_BLOCK
from mla_backends.kernels.index import flat_pages_block


@dataclass
class PageGather:
    """Page ids to gather with the schedule: request rows of req_to_token, out [>= total]."""

    req_to_token: torch.Tensor  # [rows, max_ctx] int, device
    rows: torch.Tensor  # [B] int32, device
    out: torch.Tensor  # [>= total pages] int32, device
    max_pages: int  # host: most pages of one request


@triton.jit
def _item(
    QoLens,
    SeqLens,
    k,
    n_req,
    H: tl.constexpr,
    TILE: tl.constexpr,
    T: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """Item k = (request k // T, query tile T - 1 - k % T): tiles run last to first, as in
    the host planner. Returns (valid, request, tile, q_len, kv_len, keys the tile may see)."""
    i = k // T
    t = T - 1 - k % T
    in_b = i < n_req
    q = tl.load(QoLens + i, mask=in_b, other=0)
    kv = tl.load(SeqLens + i, mask=in_b, other=0)
    n_tiles = (q * H + TILE - 1) // TILE
    valid = in_b & (t < n_tiles)
    keys = kv
    if CAUSAL:
        bounded = tl.maximum(tl.minimum(kv - q + ((t + 1) * TILE + H - 1) // H, kv), 0)
        keys = tl.where(t + 1 == n_tiles, kv, bounded)
    keys = tl.where(valid, keys, 0)
    return valid, i, t, q, kv, keys


@triton.jit
def _fi_mla_metadata_kernel(
    QoLens,
    SeqLens,
    Ws,
    R2T,
    Rows,
    PageIds,
    stride_r2t,
    n_req,
    H: tl.constexpr,
    PAGE: tl.constexpr,
    CLUSTER: tl.constexpr,
    NUM_SM: tl.constexpr,
    MAX_W: tl.constexpr,
    T: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_SM: tl.constexpr,
    GATHER: tl.constexpr,
    PAGE_BLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Program (0, 0) writes the schedule; programs (1 + b, j) gather request b's page ids,
    block j, back to back into PageIds (FlashInfer's kv_indices): one launch for both."""
    pid = tl.program_id(0)
    if pid > 0:
        if GATHER:
            flat_pages_block(
                R2T,
                Rows,
                SeqLens,
                PageIds,
                stride_r2t,
                n_req,
                pid - 1,
                tl.program_id(1),
                PAGE,
                PAGE_BLOCK,
                BLOCK_B,
            )
        return
    if tl.program_id(1) > 0:
        return
    TILE: tl.constexpr = 64 * CLUSTER
    NUM_CLUSTERS: tl.constexpr = NUM_SM // CLUSTER
    # flashinfer 0.7.2's int-workspace layout (`synthetic_info`, checked against the real
    # planner's before this kernel is used): MAX_W-long work arrays and NUM_SM-long merge
    # arrays, 16-byte aligned, in MLAPlanInfo order.
    SM_PAD: tl.constexpr = (NUM_SM + 3) // 4 * 4
    O_Q_INDPTR: tl.constexpr = 0
    O_KV_INDPTR: tl.constexpr = MAX_W
    O_PARTIAL: tl.constexpr = 2 * MAX_W
    O_M_START: tl.constexpr = 3 * MAX_W
    O_M_END: tl.constexpr = O_M_START + SM_PAD
    O_MP_START: tl.constexpr = O_M_END + SM_PAD
    O_MP_END: tl.constexpr = O_MP_START + SM_PAD
    O_M_STRIDE: tl.constexpr = O_MP_END + SM_PAD
    O_Q_LEN: tl.constexpr = O_M_STRIDE + SM_PAD
    O_KV_LEN: tl.constexpr = O_Q_LEN + MAX_W
    O_Q_START: tl.constexpr = O_KV_LEN + MAX_W
    O_KV_START: tl.constexpr = O_Q_START + MAX_W
    O_KV_END: tl.constexpr = O_KV_START + MAX_W
    O_WORK_INDPTR: tl.constexpr = O_KV_END + MAX_W

    offs = tl.arange(0, BLOCK)
    n_items = n_req * T

    # pass 1: keys over all tiles -> the per-item key limit (the planner's rounding)
    total_kv = tl.zeros([], tl.int64)
    for base in range(0, n_items, BLOCK):
        _, _, _, _, _, keys = _item(QoLens, SeqLens, base + offs, n_req, H, TILE, T, CAUSAL)
        total_kv += tl.sum(keys.to(tl.int64))
    x = tl.maximum((total_kv + NUM_CLUSTERS - 1) // NUM_CLUSTERS, 1)
    limit = tl.where(
        x <= 8,
        32,
        tl.where(
            x <= 16, 64, tl.where(x <= 32, 128, tl.where(x <= 64, 192, (x + 255) // 256 * 256))
        ),
    ).to(tl.int32)
    step = 2 * TILE + limit  # cost of a full chunk

    # pass 2: cost and work items per tile column. Clusters take the items in tile-major
    # order (every request's last tile, then the tile before, ...): the query tiles of one
    # request then run at the same time on different clusters and share its latent rows in
    # L2, as under the host planner's round-robin-like greedy order (request-major order put
    # them on one cluster back to back and read the rows twice: 0.96x at H128 q_len 2).
    R: tl.constexpr = BLOCK // T
    col_cost = tl.zeros([T], tl.int64)
    col_works = tl.zeros([T], tl.int32)
    for base in range(0, n_items, BLOCK):
        valid, _, _, _, _, keys = _item(QoLens, SeqLens, base + offs, n_req, H, TILE, T, CAUSAL)
        n = tl.where(valid, tl.where(keys > limit, (keys + limit - 1) // limit, 1), 0)
        c_item = tl.where(valid, n * 2 * TILE + keys, 0).to(tl.int64)
        col_cost += tl.sum(tl.reshape(c_item, [R, T]), 0)
        col_works += tl.sum(tl.reshape(n, [R, T]), 0)
    total_cost = tl.maximum(tl.sum(col_cost, 0), 1)
    col_cost0 = tl.cumsum(col_cost, 0) - col_cost  # where each tile column starts
    col_works0 = tl.cumsum(col_works, 0) - col_works

    # pass 3: emit. Carries across blocks: per tile column works and cost; partial rows,
    # merges, q and page offsets (request-major, as the host planner numbers them).
    partials = tl.zeros([], tl.int32)
    merges = tl.zeros([], tl.int32)
    q_off = tl.zeros([], tl.int32)
    page_off = tl.zeros([], tl.int32)
    for base in range(0, n_items, BLOCK):
        k = base + offs
        valid, i, t, q, kv, keys = _item(QoLens, SeqLens, k, n_req, H, TILE, T, CAUSAL)
        split = valid & (keys > limit)
        n = tl.where(valid, tl.where(split, (keys + limit - 1) // limit, 1), 0)
        rts = tl.minimum(TILE, q * H - t * TILE)
        # the request's offsets: each request counted once, at its last item (BLOCK % T == 0)
        last = (k % T == T - 1) & (i < n_req)
        q_i = q_off + tl.cumsum(tl.where(last, q, 0), 0) - tl.where(last, q, 0)
        pages = (kv + PAGE - 1) // PAGE
        p_i = page_off + tl.cumsum(tl.where(last, pages, 0), 0) - tl.where(last, pages, 0)
        c_item = tl.where(valid, n * 2 * TILE + keys, 0).to(tl.int64)
        n2 = tl.reshape(n, [R, T])
        c2 = tl.reshape(c_item, [R, T])
        w0 = tl.reshape(col_works0[None, :] + tl.cumsum(n2, 0) - n2, [BLOCK])
        c0 = tl.reshape(col_cost0[None, :] + tl.cumsum(c2, 0) - c2, [BLOCK])
        col_works0 += tl.sum(n2, 0)
        col_cost0 += tl.sum(c2, 0)
        p_item = tl.where(split, n * rts, 0)
        p0 = partials + tl.cumsum(p_item, 0) - p_item
        n_qc = tl.maximum(keys * CLUSTER // limit, 1)
        rcs = tl.maximum((rts + n_qc - 1) // n_qc, 1)  # >= 1 on invalid lanes too
        m = tl.where(split, (rts + rcs - 1) // rcs, 0)
        m0 = merges + tl.cumsum(m, 0) - m

        for j in range(0, tl.max(n, 0)):
            ok = j < n
            w = w0 + j
            kv_start = j * limit
            kv_end = tl.minimum(kv_start + limit, keys)
            tl.store(Ws + O_Q_INDPTR + w, q_i, mask=ok)
            tl.store(Ws + O_KV_INDPTR + w, p_i, mask=ok)
            tl.store(Ws + O_PARTIAL + w, tl.where(split, p0 + j * rts, -1), mask=ok)
            tl.store(Ws + O_Q_LEN + w, q, mask=ok)
            tl.store(Ws + O_KV_LEN + w, kv, mask=ok)
            tl.store(Ws + O_Q_START + w, t * TILE, mask=ok)
            tl.store(Ws + O_KV_START + w, kv_start, mask=ok)
            tl.store(Ws + O_KV_END + w, kv_end, mask=ok)
            # Work w spans costs [lo, hi) (works are laid end to end in w order); cluster c
            # takes the works starting in [c, c + 1) * total / C. So work_indptr[c] = w + 1
            # for every c with lo * C < c * total <= hi * C: the first work of c is w + 1.
            lo = c0 + j * step
            hi = lo + 2 * TILE + (kv_end - kv_start)
            c_lo = lo * NUM_CLUSTERS // total_cost + 1
            c_hi = hi * NUM_CLUSTERS // total_cost
            for u in range(0, tl.max(tl.where(ok, c_hi - c_lo + 1, 0), 0)):
                c = c_lo + u
                tl.store(Ws + O_WORK_INDPTR + c, w + 1, mask=ok & (c <= c_hi))

        row0 = q_i * H + t * TILE
        for u in range(0, tl.max(m, 0)):
            ok = u < m
            e = m0 + u
            tl.store(Ws + O_M_START + e, row0 + u * rcs, mask=ok)
            tl.store(Ws + O_M_END + e, row0 + tl.minimum((u + 1) * rcs, rts), mask=ok)
            tl.store(Ws + O_MP_START + e, p0 + u * rcs, mask=ok)
            tl.store(Ws + O_MP_END + e, p0 + n * rts, mask=ok)
            tl.store(Ws + O_M_STRIDE + e, rts, mask=ok)

        partials += tl.sum(p_item, 0)
        merges += tl.sum(m, 0)
        q_off += tl.sum(tl.where(last, q, 0), 0)
        page_off += tl.sum(tl.where(last, pages, 0), 0)

    tl.store(Ws + O_WORK_INDPTR, 0)
    # unused merge entries must read as empty (start == end), as the host planner leaves them
    e = tl.arange(0, BLOCK_SM)
    unused = (e >= merges) & (e < NUM_SM)
    tl.store(Ws + O_M_START + e, 0, mask=unused)
    tl.store(Ws + O_M_END + e, 0, mask=unused)
    tl.store(Ws + O_MP_START + e, 0, mask=unused)
    tl.store(Ws + O_MP_END + e, 0, mask=unused)
    tl.store(Ws + O_M_STRIDE + e, 0, mask=unused)


def query_tiles(max_q_len: int, num_heads: int, cluster: int) -> int:
    """Query tiles per request the kernel loops over (a power of two)."""
    return next_pow2(max(cdiv(max_q_len * num_heads, (CTA_TILE_Q * cluster)), 1))


def work_bound(n_req: int, max_q_len: int, num_heads: int, cluster: int, n_clusters: int) -> int:
    """Most work items a batch can produce: one per tile plus, because no split is shorter
    than total keys / clusters, at most one extra per cluster."""
    return n_req * query_tiles(max_q_len, num_heads, cluster) + n_clusters


def write_schedule(
    int_ws: torch.Tensor,
    cluster: int,
    num_heads: int,
    page_size: int,
    num_sm: int,
    qo_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    max_q_len: int,
    pages: PageGather | None = None,
    causal: bool = True,
) -> None:
    """Fill FlashInfer's MLA schedule for this batch into `int_ws` (the kernel's int
    workspace, any dtype), laid out as flashinfer 0.7.2 lays it out for `cluster`
    (`synthetic_info`: the caller checks the real planner agrees), and, given `pages`, the
    page ids too, in the same launch.

    qo_lens / seq_lens: [B] int32 on the device. `max_q_len` bounds the query tiles per
    request (host value). Raises if the batch could need more work items than FlashInfer's
    fixed arrays hold."""
    n_req = seq_lens.numel()
    t = query_tiles(max_q_len, num_heads, cluster)
    bound = work_bound(n_req, max_q_len, num_heads, cluster, num_sm // cluster)
    if bound > MAX_WORKS:
        raise ValueError(
            f"batch of {n_req} requests x {t} query tiles may need {bound} FlashInfer MLA work "
            f"items; its workspace holds {MAX_WORKS}"
        )
    g = pages or PageGather(seq_lens, seq_lens, seq_lens, 0)  # unread when not gathering
    grid = (1 + (n_req if pages else 0), cdiv(max(g.max_pages, 1), PAGE_BLOCK))
    _fi_mla_metadata_kernel[grid](
        qo_lens,
        seq_lens,
        int_ws.view(torch.int32),
        g.req_to_token,
        g.rows,
        g.out,
        g.req_to_token.stride(0),
        n_req,
        H=num_heads,
        PAGE=page_size,
        CLUSTER=cluster,
        NUM_SM=num_sm,
        MAX_W=MAX_WORKS,
        T=t,
        CAUSAL=causal,
        BLOCK=max(t, 256),
        BLOCK_SM=next_pow2(num_sm),
        GATHER=pages is not None,
        PAGE_BLOCK=PAGE_BLOCK,
        BLOCK_B=next_pow2(max(n_req, 1)),
        num_warps=4,
    )
