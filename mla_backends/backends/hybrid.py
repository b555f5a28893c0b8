"""Hybrid routing: linear-attention layers (GDN / KDA) and full MLA layers in one model.

A layer-kind map (layer id -> kind and index in that kind's pool) is built once from the
model's layer list; every call translates the model's layer id into the pool index. Layers are
never mutated (a peer remaps by rewriting `layer.layer_id`). Metadata and graph hooks go to
both sides once per batch; the full side is any MLA backend chosen in YAML.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from mla_backends.backends.base import MLABackend
from mla_backends.batch import ForwardBatch
from mla_backends.linear.backend import LinearAttentionBackend
from mla_backends.pool import check_layer_index

KINDS = ("full", "linear")


@dataclass(frozen=True)
class LayerSlot:
    kind: str  # "full" | "linear"
    index: int  # index of the layer in its kind's pool


@dataclass(frozen=True)
class LinearLayerState:
    """What a linear-attention layer reads and writes besides its recurrence (which goes
    through `HybridBackend.forward_linear`): its short-conv state `[max_requests + 1, C, W - 1]`
    (row 0 the padding dummy; a view into the state pool) and, in TARGET_VERIFY, where to put
    the windows it convolved so `accept` keeps each request's accepted one."""

    conv: torch.Tensor
    stage_verify_conv: Callable[[torch.Tensor], None]  # windows [B, C, W - 1 + T]


def layer_map(kinds: Sequence[str]) -> dict[int, LayerSlot]:
    """["linear", "linear", "linear", "full", ...] -> {layer id: LayerSlot}."""
    bad = sorted(set(kinds) - set(KINDS))
    if bad:
        raise ValueError(f"layer kinds {bad} are not among {KINDS}")
    count = dict.fromkeys(KINDS, 0)
    out = {}
    for i, kind in enumerate(kinds):
        out[i] = LayerSlot(kind, count[kind])
        count[kind] += 1
    return out


def ratio_kinds(num_layers: int, linear_per_full: int) -> list[str]:
    """Kimi-Linear / Qwen3-Next layout: `linear_per_full` linear layers, then one full."""
    return ["full" if (i + 1) % (linear_per_full + 1) == 0 else "linear" for i in range(num_layers)]


class HybridBackend:
    """The `AttentionBackend` of a hybrid model: full layers to an MLA backend, linear layers
    to the linear-attention backend (`forward_linear`, `linear_state`)."""

    def __init__(
        self, full: MLABackend[Any], linear: LinearAttentionBackend, kinds: Sequence[str]
    ) -> None:
        self.full, self.linear = full, linear
        self.layers = layer_map(kinds)
        n_full = sum(s.kind == "full" for s in self.layers.values())
        n_lin = len(self.layers) - n_full
        if full.pool.num_layers != n_full:
            raise ValueError(f"MLA pool has {full.pool.num_layers} layers, the map {n_full} full")
        if linear.pool.num_layers != n_lin:
            raise ValueError(f"state pool has {linear.pool.num_layers} layers, map {n_lin} linear")
        # a request's state slot is its request row (linear.state_pool): one slot a row
        slots, rows = linear.pool.recurrent.shape[1], full.ctx.req_to_token_pool.size + 1
        if slots < rows:
            raise ValueError(
                f"state pool has {slots} slots, the request table {rows} rows (max_requests "
                f"{rows - 1} + the dummy row): build LinearStatePool with max_requests >= "
                f"{rows - 1}"
            )

    @property
    def name(self) -> str:
        return f"hybrid({self.full.name}+{self.linear.name})"

    @property
    def device(self) -> torch.device:
        """The MLA pool's device (a graph runner's default for its static buffers)."""
        return self.full.device

    @property
    def supports_graphs(self) -> bool:
        return self.full.supports_graphs  # the linear side's decode is always capturable

    @property
    def keeps_request_state(self) -> bool:
        """Whether a forward advances per-request state outside the KV pool (the linear
        layers' recurrent and conv states), which a failed step cannot roll back (Engine)."""
        return self.linear.pool.num_layers > 0

    @property
    def metadata(self) -> object:
        """The full side's metadata (what the graph runner's pointer check inspects)."""
        return self.full.metadata

    def _slot(self, layer_id: int, kind: str) -> int:
        # Hazard: the layer as a dict key: True and 1.0 hash as 1 (run as layer 1, silently)
        layer_id = check_layer_index(layer_id, len(self.layers), "the hybrid model has layers")
        slot = self.layers.get(layer_id)
        if slot is None or slot.kind != kind:
            got = None if slot is None else slot.kind
            raise ValueError(f"layer {layer_id} is {got!r}, called as a {kind!r} layer")
        return slot.index

    # ------------------------------------------------------------------ requests
    def accept(self, num_accepted: torch.Tensor) -> None:
        """After TARGET_VERIFY: linear states advance to each request's last accepted draft
        token (the MLA side needs nothing: rejected KV slots are truncated by the caller)."""
        self.linear.accept(num_accepted)

    def reset_requests(self, rows: Sequence[int]) -> None:
        """New requests start from zero recurrent and conv state (a verify pending over any
        of the rows is dropped: `LinearAttentionBackend.reset`)."""
        self.linear.reset(rows)

    # ------------------------------------------------------------------ per batch
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.full.init_forward_metadata(batch)
        self.linear.init_forward_metadata(batch)

    def check_batch(self, batch: ForwardBatch) -> None:
        self.full.check_batch(batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.full.init_cuda_graph_state(max_bs, max_num_tokens)
        self.linear.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self.full.init_forward_metadata_capture(batch)
        self.linear.init_forward_metadata_capture(batch)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        self.full.init_forward_metadata_replay(batch)
        self.linear.init_forward_metadata_replay(batch)

    def graph_refill_on_device(self, batch_size: int) -> bool:
        return False  # the linear layers' state refill is not audited for it

    @property
    def cuda_graph_seq_len_fill_value(self) -> int:
        return self.full.cuda_graph_seq_len_fill_value

    # ------------------------------------------------------------------ per layer
    # The per-layer verbs pass their arguments through unchanged: their types are
    # AttentionBackend's (backends/protocol.py).
    def forward_absorbed(self, layer_id: int, *args: Any, **kwargs: Any) -> Any:
        return self.full.forward_absorbed(self._slot(layer_id, "full"), *args, **kwargs)

    def forward_mha(self, *args: Any, **kwargs: Any) -> Any:
        return self.full.forward_mha(*args, **kwargs)

    def store_kv(
        self, layer_id: int, loc: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor
    ) -> None:
        self.full.store_kv(self._slot(layer_id, "full"), loc, k_nope, k_rope)

    def load_prefix(self, layer_id: int, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.full.load_prefix(self._slot(layer_id, "full"), batch)

    def forward_linear(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
    ) -> torch.Tensor:
        return self.linear.forward(self._slot(layer_id, "linear"), q, k, v, g, beta)

    def linear_state(self, layer_id: int) -> LinearLayerState:
        """The layer's conv state and verify staging (no attribute of the pool is reached
        into by the model: the layer gets exactly its own slice)."""
        layer = self._slot(layer_id, "linear")
        stage = partial(self.linear.stage_verify_conv, layer)
        return LinearLayerState(self.linear.pool.conv[layer], stage)
