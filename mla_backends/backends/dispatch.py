"""Per-phase routing: EXTEND batches go to the prefill backend, DECODE / TARGET_VERIFY to the
decode backend. The model sees one `AttentionBackend` either way and never branches on names.
Both backends wrap the same pool, so rows one stores the other reads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mla_backends.backends.base import MLABackend
from mla_backends.batch import ForwardBatch


class DispatchBackend:
    def __init__(self, prefill: MLABackend[Any], decode: MLABackend[Any]) -> None:
        if prefill.pool is not decode.pool:
            raise ValueError("prefill and decode backends must share one KV pool")
        self.prefill, self.decode = prefill, decode
        self._active: MLABackend[Any] = decode

    @property
    def name(self) -> str:
        return f"dispatch(prefill={self.prefill.name}, decode={self.decode.name})"

    @property
    def device(self) -> torch.device:
        """The pool's device (both sides share the pool): where a graph runner puts its static
        buffers by default (without it, "cuda": the current GPU, or none on a CPU)."""
        return self.decode.device

    @property
    def supports_graphs(self) -> bool:
        return self.decode.supports_graphs  # only decode / verify batches are captured

    @property
    def metadata(self) -> object:
        """The active side's metadata (what the graph runner's pointer check inspects)."""
        return self._active.metadata

    # ------------------------------------------------------------------ per batch
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._active = self.decode if batch.mode.is_decode_or_verify else self.prefill
        self._active.init_forward_metadata(batch)

    def check_batch(self, batch: ForwardBatch) -> None:
        self._active.check_batch(batch)

    # ------------------------------------------------------------------ per layer
    # The per-layer verbs pass their arguments through unchanged: their types are
    # AttentionBackend's (backends/protocol.py).
    def forward_absorbed(self, layer: int, *args: Any, **kwargs: Any) -> Any:
        return self._active.forward_absorbed(layer, *args, **kwargs)

    def forward_mha(self, *args: Any, **kwargs: Any) -> Any:
        return self.prefill.forward_mha(*args, **kwargs)

    def store_kv(
        self, layer: int, loc: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor
    ) -> None:
        self._active.store_kv(layer, loc, k_nope, k_rope)

    def load_prefix(self, layer: int, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.prefill.load_prefix(layer, batch)

    # ------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.decode.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self._active = self.decode
        self.decode.init_forward_metadata_capture(batch)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        self._active = self.decode
        self.decode.init_forward_metadata_replay(batch)

    def graph_refill_on_device(self, batch_size: int) -> bool:
        return self.decode.graph_refill_on_device(batch_size)

    @property
    def cuda_graph_seq_len_fill_value(self) -> int:
        return self.decode.cuda_graph_seq_len_fill_value

    # ------------------------------------------------------------------ requests
    def reset_requests(self, rows: Sequence[int]) -> None:
        """MLA keeps no per-request state beyond the pool."""

    def accept(self, num_accepted: torch.Tensor) -> None:
        """MLA keeps no per-request state beyond the pool."""
