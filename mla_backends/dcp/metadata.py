"""The per-rank batches of decode context parallelism (what `DCPBackend` hands the backend it
wraps; `backend.py` says why each form is exact): DECODE / TARGET_VERIFY as one DECODE row per
query token, from device ops of static shape (graph-refillable); EXTEND as one row per
(request, j mod N) group, from the host lengths."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.dcp.layout import DCPLayout


@dataclass
class DCPMetadata:
    vis: torch.Tensor  # [T] int32, device: global keys each query token may see
    valid: torch.Tensor  # [N, T] bool, device: rank k holds at least one of them (vis > k)
    local: ForwardBatch  # this rank's batch for the wrapped backend
    perm: torch.Tensor | None  # EXTEND: [T'] int64, device: the token of each local row


@dataclass
class DCPGraphState:
    """Static buffers of the per-rank rows batch, sized for the largest captured batch."""

    rows: torch.Tensor  # [max_t] int32
    seq: torch.Tensor  # [max_t] int32
    pre: torch.Tensor  # [max_t] int32
    ext: torch.Tensor  # [max_t] int32, all 1
    vis: torch.Tensor  # [max_t] int32
    valid: torch.Tensor  # [N, max_t] bool


def ranks_seeing(layout: DCPLayout, vis: torch.Tensor) -> torch.Tensor:
    """[N, T] bool: rank k holds at least one key of each query token (vis > k)."""
    ranks = torch.arange(layout.size, device=vis.device, dtype=vis.dtype)
    return vis[None, :] > ranks[:, None]


def rows_metadata(
    layout: DCPLayout, batch: ForwardBatch, static: DCPGraphState | None
) -> DCPMetadata:
    """DECODE / TARGET_VERIFY: one DECODE row per query token, device ops only."""
    b = batch.batch_size
    q = 1 if batch.mode is ForwardMode.DECODE else batch.num_draft_tokens
    t = b * q
    j_cpu = torch.arange(q, dtype=torch.int32)
    j = torch.arange(q, dtype=torch.int32, device=batch.seq_lens.device)
    vis_cpu = (batch.seq_lens_cpu[:, None] - q + j_cpu[None, :] + 1).clamp(min=0).reshape(t)
    vis = (batch.seq_lens[:, None] - q + j[None, :] + 1).clamp(min=0).reshape(t)
    seq_cpu = layout.local_lens(vis_cpu)
    seq = layout.local_lens(vis)
    rows = batch.req_pool_indices[:, None].expand(b, q).reshape(t)
    pre = (seq - 1).clamp(min=0)
    ext = torch.ones_like(seq)
    valid = ranks_seeing(layout, vis)
    if static is not None:
        for name, val in (("rows", rows), ("seq", seq), ("pre", pre), ("vis", vis)):
            getattr(static, name)[:t].copy_(val)
        static.valid[:, :t].copy_(valid)
        rows, seq, pre, vis = static.rows[:t], static.seq[:t], static.pre[:t], static.vis[:t]
        ext, valid = static.ext[:t], static.valid[:, :t]
    local = ForwardBatch(
        mode=ForwardMode.DECODE,
        req_pool_indices=rows,
        seq_lens=seq,
        seq_lens_cpu=seq_cpu,
        extend_prefix_lens=pre,
        extend_prefix_lens_cpu=(seq_cpu - 1).clamp(min=0),
        extend_seq_lens=ext,
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
    return DCPMetadata(vis_t, ranks_seeing(layout, vis_t), local, perm_t)
