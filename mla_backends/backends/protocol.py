"""`AttentionBackend`: the attention surface a model, the engine and the graph runner call.

Every MLA backend (`base.MLABackend`), the prefill / decode dispatcher, the hybrid router and
the DCP wrapper satisfy it; an engine types its backend with it and nothing else. The
`return_lse` overloads are declared here once: implementations return `Any` and are checked
against them structurally.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol, overload

import torch

from mla_backends.batch import ForwardBatch, RaggedLayout


class AttentionBackend(Protocol):
    """The attention surface a model, the engine and the graph runner call."""

    @property
    def name(self) -> str: ...

    @property
    def supports_graphs(self) -> bool: ...

    @property
    def metadata(self) -> object:
        """This batch's metadata, for inspection (the graph runner's pointer check)."""
        ...

    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    def check_batch(self, batch: ForwardBatch) -> None: ...

    @overload
    def forward_absorbed(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        k_nope: torch.Tensor | None,
        k_rope: torch.Tensor | None,
        batch: ForwardBatch,
        return_lse: Literal[False] = False,
    ) -> torch.Tensor: ...

    @overload
    def forward_absorbed(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        k_nope: torch.Tensor | None,
        k_rope: torch.Tensor | None,
        batch: ForwardBatch,
        return_lse: Literal[True],
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    @overload
    def forward_mha(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: RaggedLayout,
        causal: bool = True,
        return_lse: Literal[False] = False,
    ) -> torch.Tensor: ...

    @overload
    def forward_mha(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: RaggedLayout,
        causal: bool,
        return_lse: Literal[True],
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def store_kv(
        self, layer: int, loc: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor
    ) -> None: ...

    def load_prefix(self, layer: int, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]: ...

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None: ...

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None: ...

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None: ...

    def graph_refill_on_device(self, batch_size: int) -> bool:
        """Whether the replay refill for this captured size reads only device tensors and
        capture-time constants, so a caller may record it inside its own graph."""
        ...

    @property
    def cuda_graph_seq_len_fill_value(self) -> int: ...

    def reset_requests(self, rows: Sequence[int]) -> None: ...

    def accept(self, num_accepted: torch.Tensor) -> None: ...
