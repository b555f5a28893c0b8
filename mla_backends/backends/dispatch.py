"""Per-phase routing: EXTEND batches go to the prefill backend, DECODE / TARGET_VERIFY to the
decode backend. The model sees one backend either way and never branches on names."""

from __future__ import annotations

import torch

from mla_backends.backends.base import MLABackend
from mla_backends.batch import ForwardBatch, RaggedLayout


class DispatchBackend(MLABackend):
    name = "dispatch"

    def __init__(self, prefill: MLABackend, decode: MLABackend) -> None:
        super().__init__(decode.ctx)
        self.prefill, self.decode = prefill, decode
        self._active: MLABackend = decode

    @property
    def supports_graphs(self) -> bool:  # type: ignore[override]
        return self.decode.supports_graphs

    def _route(self, batch: ForwardBatch) -> MLABackend:
        return self.decode if batch.mode.is_decode_or_verify else self.prefill

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._active = self._route(batch)
        self._active.init_forward_metadata(batch)

    def store_kv(
        self, layer: int, loc: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor
    ) -> None:
        self._active.store_kv(layer, loc, k_nope, k_rope)

    def _attend_absorbed(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        batch: ForwardBatch,
        need_lse: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._active._attend_absorbed(layer, q_nope, q_rope, batch, need_lse)

    def _attend_mha(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: RaggedLayout,
        causal: bool,
        need_lse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.prefill._attend_mha(q, k, v, layout, causal, need_lse)

    @property
    def provides_lse(self) -> bool:  # type: ignore[override]
        return self._active.provides_lse

    def effective_query(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._active.effective_query(q_nope, q_rope)

    @property
    def quantizes_query(self) -> bool:
        return self._active.quantizes_query

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.decode.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self._active = self.decode
        self.decode.init_forward_metadata_capture(batch)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        self._active = self.decode
        self.decode.init_forward_metadata_replay(batch)

    @property
    def cuda_graph_seq_len_fill_value(self) -> int:
        return self.decode.cuda_graph_seq_len_fill_value
