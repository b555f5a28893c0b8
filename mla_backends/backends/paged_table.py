"""Shared base for decode kernels that take a dense page table `[B, W]` (FlashMLA, CUTLASS,
TRT-LLM): the table from the shared index builder, its width padded to the kernel's block
multiple, and the CUDA-graph state (one static table for the largest batch, refilled in place
on replay)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch

from mla_backends.backends.base import BackendCaps, GraphCapable
from mla_backends.batch import ForwardBatch
from mla_backends.indices import build_page_table, page_table_width


@dataclass
class PageTableMetadata:
    table: torch.Tensor  # [B, W] int32, device; tail entries = `table_fill`
    max_seq_len: int  # host: longest KV length the kernel may be asked to schedule
    q_len: int  # host: query tokens per request (1 decode, n verify)


@dataclass
class PageTableGraphState:
    table: torch.Tensor  # [max_bs, width] int32, device: every captured size reads rows [:bs]
    width: int  # host: pages per row for the longest context


@runtime_checkable
class QueryQuantizer(Protocol):
    """A backend whose kernel attends with a quantized query (FP8 q for an FP8 pool):
    references check it against the query it really uses."""

    @property
    def quantizes_query(self) -> bool: ...

    def effective_query(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class PageTableBackend(GraphCapable[PageTableMetadata, PageTableGraphState]):
    caps: ClassVar[BackendCaps] = BackendCaps(roles=("decode",), graphs=True)
    table_fill: ClassVar[int] = 0  # the dummy page: always a valid page to point at

    @property
    def q_dtypes(self) -> tuple[torch.dtype, ...]:
        # Hazard: the kernels take q in one dtype (the config's; TRT-LLM quantizes it for FP8):
        # another failed inside the kernel call, after the new rows were stored
        return (self.ctx.config.torch_dtype,)

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
        return batch.q_len

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

    def _build_metadata(self, batch: ForwardBatch) -> PageTableMetadata:
        q_len, max_seq = self._q_len(batch), batch.max_kv_len
        width = page_table_width(max_seq, self.pool.page_size, self.table_align)
        return PageTableMetadata(self._table(batch, width, None), max(max_seq, 1), q_len)

    def _new_graph_state(self, max_bs: int, max_num_tokens: int) -> PageTableGraphState:
        width = page_table_width(self.req_to_token.shape[1], self.pool.page_size, self.table_align)
        table = torch.full((max_bs, width), self.table_fill, dtype=torch.int32, device=self.device)
        return PageTableGraphState(table, width)

    def graph_refill_on_device(self, batch_size: int) -> bool:
        return True  # the page table (and FlashMLA's tile schedule) come from device lengths

    def _bind_graph(
        self, batch: ForwardBatch, state: PageTableGraphState, capture: bool
    ) -> PageTableMetadata:
        """Every captured size reads rows [:bs] of the one static table: refilling it in
        place serves all graphs. Scheduled for the longest context the graph may see."""
        q_len, bs = self._q_len(batch), batch.batch_size
        self._table(batch, state.width, state.table)
        return PageTableMetadata(state.table[:bs], self.req_to_token.shape[1], q_len)
