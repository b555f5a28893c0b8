"""FlashInfer MLA schedules as plain data: a port of flashinfer 0.7.2's host planner
(`MLAPlan` in include/flashinfer/attention/scheduler.cuh) and the invariants any schedule the
kernel runs must keep. The port is the oracle for our device planner
(`kernels/fi_schedule.py`) on the CPU, and is itself checked against the C++ planner's bytes on
the GPU (tests/test_fi_schedule.py).

A schedule is a list of work items per cluster (a cluster is 1 or 2 CTAs sharing a tile of
64 * cluster_size packed query rows, packed row = token * heads + head) plus merge entries: a
work item attends its tile to keys [kv_start, kv_end) of one request and writes either the
final rows (partial = -1) or partial rows merged after a grid barrier.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from mla_backends.arith import cdiv

CTA_TILE_Q = 64
MAX_WORKS = 16384  # flashinfer 0.7.2: `max_total_num_works`, the size of every work array


def cluster_size(qo_lens: np.ndarray, num_heads: int) -> int:
    """2 CTAs per cluster when the average packed query length exceeds one CTA tile."""
    avg = int(qo_lens.sum()) * num_heads // max(qo_lens.size, 1)
    return 2 if avg > CTA_TILE_Q else 1


def kv_len_limit(total_kv: int, num_clusters: int) -> int:
    x = max(cdiv(total_kv, num_clusters), 1)
    for bound, limit in ((8, 32), (16, 64), (32, 128), (64, 192)):
        if x <= bound:
            return limit
    return cdiv(x, 256) * 256


@dataclass
class Schedule:
    """Decoded schedule. Work tuples: (q_indptr, kv_indptr, partial, q_len, kv_len, q_start,
    kv_start, kv_end); merge tuples: (start, end, partial_start, partial_end, stride)."""

    cluster: int
    num_clusters: int
    works: list[list[tuple[int, ...]]]  # per cluster, in run order
    merges: list[tuple[int, int, int, int, int]] = field(default_factory=list)

    def flat(self) -> list[tuple[int, ...]]:
        return [w for c in self.works for w in c]


def _tile_keys(
    qo_len: int, kv_len: int, t: int, n_tiles: int, tile_q: int, heads: int, causal: bool
) -> int:
    if not causal or t + 1 == n_tiles:
        return kv_len
    return max(min(kv_len - qo_len + cdiv(((t + 1) * tile_q), heads), kv_len), 0)


def plan_reference(
    qo_lens: np.ndarray,
    kv_lens: np.ndarray,
    page_size: int,
    num_heads: int,
    num_sm: int,
    causal: bool = True,
) -> Schedule:
    """flashinfer 0.7.2's MLAPlan, line for line (greedy min-heap assignment)."""
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int64)
    pages = cdiv(kv_lens.astype(np.int64), page_size)
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int64)
    cs = cluster_size(qo_lens, num_heads)
    n_clusters = num_sm // cs
    tile_q = cs * CTA_TILE_Q
    total = 0
    for q, kv in zip(qo_lens.tolist(), kv_lens.tolist()):
        n_tiles = cdiv(q * num_heads, tile_q)
        total += sum(
            _tile_keys(q, kv, t, n_tiles, tile_q, num_heads, causal) for t in range(n_tiles)
        )
    limit = kv_len_limit(total, n_clusters)
    # Greedy least-loaded cluster. libstdc++'s heap breaks cost ties in its own order, so the
    # C++ planner and this port agree on the work items and merges, not on which cluster
    # runs which item (tests compare work items as a multiset).
    heap = [(0.0, c) for c in range(n_clusters)]
    works: list[list[tuple[int, ...]]] = [[] for _ in range(n_clusters)]
    merges: list[tuple[int, int, int, int, int]] = []
    partial_nnz = 0
    for i, (q, kv) in enumerate(zip(qo_lens.tolist(), kv_lens.tolist())):
        packed = q * num_heads
        n_tiles = cdiv(packed, tile_q)
        for t in range(n_tiles - 1, -1, -1):
            rem = _tile_keys(q, kv, t, n_tiles, tile_q, num_heads, causal)
            split = rem > limit
            rts = min(tile_q, packed - t * tile_q)
            if split:
                n_chunks = max(rem * cs // limit, 1)
                rcs = cdiv(rts, n_chunks)
                base = int(qo_indptr[i]) * num_heads + t * tile_q
                for off in range(0, rts, rcs):
                    merges.append(
                        (
                            base + off,
                            base + min(off + rcs, rts),
                            partial_nnz + off,
                            partial_nnz + cdiv(rem, limit) * rts,
                            rts,
                        )
                    )
            kv_start, zero = 0, rem == 0
            while rem > 0 or zero:
                cost, c = heapq.heappop(heap)
                n = min(rem, limit)
                heapq.heappush(heap, (cost + 2 * tile_q + n, c))
                part = -1
                if split:
                    part, partial_nnz = partial_nnz, partial_nnz + rts
                works[c].append(
                    (
                        int(qo_indptr[i]),
                        int(kv_indptr[i]),
                        part,
                        q,
                        kv,
                        t * tile_q,
                        kv_start,
                        kv_start + n,
                    )
                )
                rem -= n
                kv_start += n
                if zero:
                    break
    return Schedule(cs, n_clusters, works, merges)


# Plan-info fields (MLAPlanInfo::ToVector order) this module reads.
INFO_FIELDS = (
    "num_blks_x",
    "num_blks_y",
    "q_indptr",
    "kv_indptr",
    "partial_indptr",
    "merge_start",
    "merge_end",
    "merge_partial_start",
    "merge_partial_end",
    "merge_stride",
    "q_len",
    "kv_len",
    "q_start",
    "kv_start",
    "kv_end",
    "work_indptr",
    "partial_o",
    "partial_lse",
)
WORK_FIELDS = (
    "q_indptr",
    "kv_indptr",
    "partial_indptr",
    "q_len",
    "kv_len",
    "q_start",
    "kv_start",
    "kv_end",
)
MERGE_FIELDS = (
    "merge_start",
    "merge_end",
    "merge_partial_start",
    "merge_partial_end",
    "merge_stride",
)


def info_offsets(info: list[int] | tuple[int, ...]) -> dict[str, int]:
    """Plan info -> {field: value}; int-workspace offsets are converted to int32 elements."""
    d = dict(zip(INFO_FIELDS, (int(x) for x in info)))
    for k in WORK_FIELDS + MERGE_FIELDS + ("work_indptr",):
        if d[k] % 4:
            raise ValueError(f"int workspace offset {k}={d[k]} is not 4-byte aligned")
        d[k] //= 4
    return d


def decode_workspace(ws: np.ndarray, info: list[int] | tuple[int, ...], num_sm: int) -> Schedule:
    """Read a schedule back from an int workspace (int32 view) laid out by `info`."""
    o = info_offsets(info)
    n_clusters = o["num_blks_y"]
    indptr = ws[o["work_indptr"] : o["work_indptr"] + n_clusters + 1]
    cols = [ws[o[k] : o[k] + int(indptr[-1])] for k in WORK_FIELDS]
    works = [
        [tuple(int(col[w]) for col in cols) for w in range(int(indptr[c]), int(indptr[c + 1]))]
        for c in range(n_clusters)
    ]
    mcols = [ws[o[k] : o[k] + num_sm] for k in MERGE_FIELDS]
    merges = [(a, b, c, d, e) for a, b, c, d, e in zip(*(col.tolist() for col in mcols))]
    merges = [m for m in merges if m[1] > m[0]]  # unused entries are all zero
    return Schedule(o["num_blks_x"], n_clusters, works, merges)


def check_schedule(
    s: Schedule,
    qo_lens: np.ndarray,
    kv_lens: np.ndarray,
    page_size: int,
    num_heads: int,
    num_sm: int,
    causal: bool = True,
) -> None:
    """What the kernel needs of any schedule; raises AssertionError naming the broken rule.

    1. every (request, query tile) is covered by work items whose key ranges tile exactly
       [0, keys the tile may see), in order, with the request's indptrs and lengths;
    2. a tile with more than one item writes partial rows, disjoint, inside the partial
       buffer (2 * clusters * tile rows), and is merged row by row exactly once;
    3. at most MAX_WORKS items and at most one merge entry per SM."""
    tile_q = s.cluster * CTA_TILE_Q
    assert s.cluster == cluster_size(qo_lens, num_heads), "cluster size"
    assert s.num_clusters == num_sm // s.cluster, "number of clusters"
    flat = s.flat()
    assert len(flat) <= MAX_WORKS, f"{len(flat)} work items > {MAX_WORKS}"
    assert len(s.merges) <= num_sm, f"{len(s.merges)} merge entries > {num_sm} SMs"
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)])
    kv_indptr = np.concatenate([[0], np.cumsum(cdiv(kv_lens, page_size))])
    by_tile: dict[tuple[int, int], list[tuple[int, ...]]] = {}
    for w in flat:
        by_tile.setdefault((w[0], w[5]), []).append(w)
    partial_rows: set[int] = set()
    merged_rows: dict[int, tuple[int, int, int]] = {}
    for m in s.merges:
        for r in range(m[1] - m[0]):
            assert m[0] + r not in merged_rows, f"row {m[0] + r} merged twice"
            merged_rows[m[0] + r] = (m[2] + r, m[3], m[4])
    n_tiles_total = 0
    for i, (q, kv) in enumerate(zip(qo_lens.tolist(), kv_lens.tolist())):
        packed = q * num_heads
        n_tiles = cdiv(packed, tile_q)
        for t in range(n_tiles):
            n_tiles_total += 1
            items = sorted(by_tile.get((int(qo_indptr[i]), t * tile_q), []), key=lambda w: w[6])
            keys = _tile_keys(q, kv, t, n_tiles, tile_q, num_heads, causal)
            assert items, f"request {i} tile {t}: no work item"
            assert items[0][6] == 0 and items[-1][7] == keys, f"request {i} tile {t}: key range"
            for a, b in zip(items, items[1:]):
                assert a[7] == b[6], f"request {i} tile {t}: gap or overlap in keys"
            for w in items:
                assert w[1] == kv_indptr[i] and w[3] == q and w[4] == kv, f"request {i}: fields"
            rts = min(tile_q, packed - t * tile_q)
            if len(items) == 1 and items[0][2] == -1:
                continue
            parts = [w[2] for w in items]
            assert -1 not in parts, f"request {i} tile {t}: split tile writes final rows"
            for p in parts:
                rows = set(range(p, p + rts))
                assert not rows & partial_rows, f"request {i} tile {t}: partial rows overlap"
                assert p + rts <= 2 * s.num_clusters * tile_q, "partial buffer overflow"
                partial_rows |= rows
            for r in range(rts):
                row = int(qo_indptr[i]) * num_heads + t * tile_q + r
                got = merged_rows.pop(row, None)
                assert got is not None, f"request {i} tile {t}: row {row} never merged"
                pstart, pend, stride = got
                assert stride == rts and list(range(pstart, pend, stride)) == [
                    p + r for p in sorted(parts)
                ], f"request {i} tile {t}: row {row} merges the wrong partials"
    assert not merged_rows, f"merge entries for rows no split tile has: {sorted(merged_rows)[:4]}"
    assert len(by_tile) == n_tiles_total, "work items for tiles that do not exist"


def synthetic_info(cluster: int, num_sm: int, head_dim_o: int = 512) -> list[int]:
    """The plan info flashinfer 0.7.2 lays out for a cluster size: int arrays of MAX_WORKS
    (or num_sm for merges) int32 each, 16-byte aligned, in MLAPlanInfo order; partial O
    (2 bytes per element) then partial LSE in the float workspace. For CPU tests; the GPU
    test checks it equals the real planner's."""
    off, info = 0, [cluster, num_sm // cluster]
    for name in INFO_FIELDS[2:16]:
        info.append(off)
        n = num_sm if name in MERGE_FIELDS else MAX_WORKS
        off += cdiv(n * 4, 16) * 16
    rows = 2 * (num_sm // cluster) * cluster * CTA_TILE_Q
    info += [0, cdiv(rows * 2 * head_dim_o, 16) * 16]
    return info


def int_workspace_bytes(info: list[int] | tuple[int, ...], num_sm: int) -> int:
    o = info_offsets(info)
    return 4 * max(
        o[k] + (num_sm if k in MERGE_FIELDS else MAX_WORKS)
        for k in o
        if k in WORK_FIELDS + MERGE_FIELDS + ("work_indptr",)
    )
