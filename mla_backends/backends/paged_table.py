"""Shared base for decode kernels that take a dense page table `[B, W]` (CUTLASS, TRT-LLM):
the table from the shared index builder, its width padded to the kernel's block multiple, and
the CUDA-graph state (one static table for the largest batch, refilled in place on replay)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from mla_backends.backends.base import BackendContext, MLABackend
from mla_backends.batch import ForwardBatch
from mla_backends.indices import build_page_table, page_table_width
from mla_backends.pool import FP8_MAX


@dataclass
class PageTableMetadata:
    table: torch.Tensor  # [B, W] int32, device; tail entries = `table_fill`
    max_seq_len: int  # host: longest KV length the kernel may be asked to schedule
    q_len: int  # host: query tokens per request (1 decode, n verify)


class PageTableBackend(MLABackend):
    roles = ("decode",)
    supports_graphs = True
    table_fill: ClassVar[int] = 0  # the dummy page: always a valid page to point at

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.metadata: PageTableMetadata | None = None

    @property
    def table_align(self) -> int:
        """Blocks per row must be a multiple of this (128 / page_size for these kernels)."""
        return max(1, 128 // self.pool.page_size)

    def _q_len(self, batch: ForwardBatch) -> int:
        if not batch.mode.is_decode_or_verify:
            raise ValueError(
                f"{self.name} serves DECODE and TARGET_VERIFY only, got {batch.mode.name}; "
                "EXTEND batches go to the configured prefill backend"
            )
        return max(batch.num_draft_tokens, 1)

    def _table(self, batch: ForwardBatch, width: int, out: torch.Tensor | None) -> torch.Tensor:
        return build_page_table(
            self.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            self.pool.page_size,
            width,
            self.table_fill,
            out,
        )

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        q_len = self._q_len(batch)
        max_seq = int(batch.seq_lens_cpu.max()) if batch.batch_size else 0
        width = page_table_width(max_seq, self.pool.page_size, self.table_align)
        self.metadata = PageTableMetadata(self._table(batch, width, None), max(max_seq, 1), q_len)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        max_ctx = self.req_to_token.shape[1]
        self._graph_width = page_table_width(max_ctx, self.pool.page_size, self.table_align)
        self._graph_table = torch.full(
            (max_bs, self._graph_width), self.table_fill, dtype=torch.int32, device=self.device
        )

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self._bind_graph(batch)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        if not hasattr(self, "_graph_table"):
            raise RuntimeError("init_forward_metadata_replay before init_cuda_graph_state")
        self._bind_graph(batch)

    def _bind_graph(self, batch: ForwardBatch) -> None:
        """Every captured size reads rows [:bs] of the one static table: refilling it in
        place serves all graphs. Scheduled for the longest context the graph may see."""
        q_len, bs = self._q_len(batch), batch.batch_size
        self._table(batch, self._graph_width, self._graph_table)
        self.metadata = PageTableMetadata(self._graph_table[:bs], self.req_to_token.shape[1], q_len)

    # FP8 pools: these kernels (TRT-LLM, FlashMLA's dense FP8 path) take q in the KV dtype.
    # It is quantized per tensor on the device (no host sync); references check the kernel
    # against the query it really attends with (`effective_query`).
    def quantized_query(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 pools: (q in the KV dtype, q_scale [] fp32 on the device)."""
        if not self.pool.is_fp8:
            return q, torch.ones((), dtype=torch.float32, device=q.device)
        q_scale = q.abs().amax().float().clamp_min(1e-12) / FP8_MAX
        return (q.float() / q_scale).to(self.pool.dtype), q_scale

    def effective_query(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q8, q_scale = self.quantized_query(self.joined_query(q_nope, q_rope))
        q = q8.float() * q_scale
        return q[..., : self.dims.kv_lora_rank], q[..., self.dims.kv_lora_rank :]

    @property
    def quantizes_query(self) -> bool:
        return self.pool.is_fp8

    def _require_metadata(self) -> PageTableMetadata:
        if self.metadata is None:
            raise RuntimeError("init_forward_metadata was not called for this batch")
        return self.metadata
