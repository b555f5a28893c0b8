"""The per-rank batches of decode context parallelism (what `DCPBackend` hands the backend it
wraps; `backend.py` says why each form is exact): DECODE / TARGET_VERIFY as one DECODE row per
query token, from device ops of static shape (graph-refillable); EXTEND as one row per
(request, j mod N) group, from the host lengths."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.dcp.layout import DCPLayout


@dataclass
class DCPMetadata:
    vis: torch.Tensor  # [T] int32, device: global keys each query token may see
    valid: torch.Tensor  # [N, T] bool, device: rank k holds at least one of them (vis > k)
    local: ForwardBatch  # this rank's batch for the wrapped backend
    perm: torch.Tensor | None  # EXTEND: [T'] int64, device: the token of each local row
    # Graphs: the wrapped backend's metadata, so the graph runner's pointer check sees its
    # buffers too (Hazard: without it a moved page table under DCP went unnoticed).
    inner: object = None


@dataclass
class DCPGraphState:
    """Static buffers of the per-rank rows batch, sized for the largest captured batch (or,
    eager, for the one batch)."""

    rows: torch.Tensor  # [max_t] int32
    seq: torch.Tensor  # [max_t] int32
    pre: torch.Tensor  # [max_t] int32
    ext: torch.Tensor  # [max_t] int32, all 1
    vis: torch.Tensor  # [max_t] int32
    valid: torch.Tensor  # [N, max_t] bool
    ranks: torch.Tensor  # [N] int32: 0 .. N - 1
    offsets: torch.Tensor  # [max_t] int32: 1 - max_t .. 0 (a verify's last q, per token)

    @classmethod
    def allocate(cls, size: int, max_t: int, device: torch.device | str) -> DCPGraphState:
        i32: dict[str, Any] = {"dtype": torch.int32, "device": device}
        return cls(
            rows=torch.empty(max_t, **i32),
            seq=torch.empty(max_t, **i32),
            pre=torch.empty(max_t, **i32),
            ext=torch.ones(max_t, **i32),
            vis=torch.empty(max_t, **i32),
            valid=torch.empty(size, max_t, dtype=torch.bool, device=device),
            # Hazard: made here, outside any capture. Made inside one, a tensor's values
            # would exist only once the graph replayed (captured kernels do not run).
            ranks=torch.arange(size, **i32),
            offsets=torch.arange(1 - max_t, 1, **i32),
        )


def ranks_seeing(
    ranks: torch.Tensor, vis: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """[N, T] bool: rank k holds at least one key of each query token (vis > k); `ranks` is
    arange(N) (in decode the graph state's, `out` its static buffer)."""
    return torch.gt(vis[None, :], ranks[:, None], out=out)


def rows_metadata(
    layout: DCPLayout, batch: ForwardBatch, static: DCPGraphState | None
) -> DCPMetadata:
    """DECODE / TARGET_VERIFY: one DECODE row per query token, device ops only, written in
    place into `static` (a graph refill is then ~7 launches, not ~27: the ops are the cost
    of a decode step's host side on a rank)."""
    b = batch.batch_size
    q = batch.q_len
    t, n, c = b * q, layout.size, layout.size - 1 - layout.rank
    dev = batch.seq_lens.device
    if static is None:
        static = DCPGraphState.allocate(n, t, dev)
    rows, seq, pre, vis = static.rows[:t], static.seq[:t], static.pre[:t], static.vis[:t]
    # vis: the keys query token j of a request sees, seq_len - q + 1 + j (>= 0).
    if q == 1:
        torch.clamp(batch.seq_lens, min=0, out=vis)
        rows.copy_(batch.req_pool_indices)
        vis_cpu = batch.seq_lens_cpu.clamp(min=0)
    else:
        off = static.offsets[static.offsets.numel() - q :]
        torch.add(batch.seq_lens[:, None], off, out=vis.view(b, q)).clamp_(min=0)
        rows.view(b, q).copy_(batch.req_pool_indices[:, None])
        vis_cpu = batch.seq_lens_cpu[:, None] + torch.arange(1 - q, 1, dtype=torch.int32)
        vis_cpu = vis_cpu.clamp_(min=0).reshape(t)
    # This rank's share of each: (vis + N - 1 - rank) // N, as `layout.local_lens`.
    torch.add(vis, c, out=seq).div_(n, rounding_mode="floor")
    torch.sub(seq, 1, out=pre).clamp_(min=0)
    valid = ranks_seeing(static.ranks, vis, out=static.valid[:, :t])
    seq_cpu = layout.local_lens(vis_cpu)
    local = ForwardBatch(
        mode=ForwardMode.DECODE,
        req_pool_indices=rows,
        seq_lens=seq,
        seq_lens_cpu=seq_cpu,
        extend_prefix_lens=pre,
        extend_prefix_lens_cpu=(seq_cpu - 1).clamp_(min=0),
        extend_seq_lens=static.ext[:t],
        extend_seq_lens_cpu=torch.ones(t, dtype=torch.int32),
        out_cache_loc=batch.out_cache_loc,  # only its length is read: rows are stored
        positions=batch.positions,
    )
    return DCPMetadata(vis, valid, local, None)


def extend_metadata(layout: DCPLayout, batch: ForwardBatch) -> DCPMetadata:
    """EXTEND: one local EXTEND row per (request, j mod N) group; built on the host."""
    lay, dev = layout, batch.seq_lens.device
    sub: list[int] = []
    q_lens: list[int] = []
    kv_lens: list[int] = []
    perm: list[int] = []
    vis: list[int] = []
    start = 0
    for b, (s, n) in enumerate(
        zip(batch.seq_lens_cpu.tolist(), batch.extend_seq_lens_cpu.tolist())
    ):
        vis.extend(max(0, s - n + j + 1) for j in range(n))
        for c in range(min(n, lay.size)):
            group = [j for j in range(c, n, lay.size) if lay.local_len(s - n + j + 1) > 0]
            if group:
                sub.append(b)
                q_lens.append(len(group))
                kv_lens.append(lay.local_len(s - n + group[-1] + 1))
                perm.extend(start + j for j in group)
        start += n
    i32 = torch.int32
    seq_cpu, ext_cpu = torch.tensor(kv_lens, dtype=i32), torch.tensor(q_lens, dtype=i32)
    pre_cpu = seq_cpu - ext_cpu
    sub_t = torch.tensor(sub, dtype=torch.int64).to(dev)
    local = ForwardBatch(
        mode=ForwardMode.EXTEND,
        req_pool_indices=batch.req_pool_indices[sub_t],
        seq_lens=seq_cpu.to(dev),
        seq_lens_cpu=seq_cpu,
        extend_prefix_lens=pre_cpu.to(dev),
        extend_prefix_lens_cpu=pre_cpu,
        extend_seq_lens=ext_cpu.to(dev),
        extend_seq_lens_cpu=ext_cpu,
        out_cache_loc=torch.zeros(len(perm), dtype=torch.int64, device=dev),
        positions=torch.zeros(len(perm), dtype=torch.int64, device=dev),
    )
    vis_t = torch.tensor(vis, dtype=i32).to(dev)
    perm_t = torch.tensor(perm, dtype=torch.int64).to(dev)
    ranks = torch.arange(lay.size, device=dev, dtype=i32)
    return DCPMetadata(vis_t, ranks_seeing(ranks, vis_t), local, perm_t)
