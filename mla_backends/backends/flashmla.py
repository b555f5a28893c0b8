"""The `flashmla` backend: DeepSeek's FlashMLA decode kernel (SM90, page 64, bf16 / fp16).

Uses the `flash_mla` package when importable, else `sgl_kernel.flash_mla` (sglang-kernel
0.4.3). Decode and target-verify only (uniform q_len); EXTEND goes to the prefill backend.
Page table (`block_kv_indices`) from the shared base, tail filled with the dummy page 0.

FP8 pools are refused, for precision: sgl_kernel 0.4.3's dense FP8 kernel rounds P to e4m3
for P @ V and missed the parity bound on short verify rows (5.5e-2 / 6.3e-2 on out at H16 /
H128 against 3e-2 + 3e-2 * |x|, H200, 2026-11-22; BENCHMARKS.md, "FlashMLA FP8"). Its other
hazard, a `block_table[-1]` read for requests with no keys, is recorded there too; git
history holds the FP8 path for the next kernel to try. flashinfer_mla and triton serve FP8.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import Tensor

from mla_backends.backends.base import BackendCaps, BackendContext, Capability, joined
from mla_backends.backends.kernel_packages import (
    missing,
    need_deepseek_dims,
    need_sm,
    require,
)
from mla_backends.backends.paged_table import (
    PageTableBackend,
    PageTableGraphState,
    PageTableMetadata,
)
from mla_backends.backends.registry import register_backend
from mla_backends.backends.util import joined_query, mask_empty_rows
from mla_backends.batch import ForwardBatch
from mla_backends.config import Config


def _flash_mla_module() -> ModuleType:
    try:
        return require("flash_mla")
    except ImportError:
        return require("sgl_kernel.flash_mla")


@dataclass
class FlashMLAMetadata(PageTableMetadata):
    tile: torch.Tensor  # [num_sm_parts, 8] int32, device: FlashMLA's tile schedule
    splits: torch.Tensor  # [B + 1] int32, device


@dataclass
class FlashMLAGraphState(PageTableGraphState):
    splits: torch.Tensor  # [max_bs + 1] int32, device
    tiles: dict[int, torch.Tensor] = field(default_factory=dict)  # per q_len (shape: q_len x H)


@register_backend("flashmla")
class FlashMLABackend(PageTableBackend):
    name = "flashmla"
    caps = BackendCaps(
        page_sizes=(64,),
        kv_dtypes=("bfloat16", "float16"),
        roles=("decode",),
        graphs=True,
        same_dtype=True,  # its kernel checks q.dtype == kcache.dtype; no fp32 activations
    )

    @classmethod
    def _machine_reason(cls, config: Config, cap: Capability) -> str | None:
        return joined(
            [
                missing("flash_mla", "sgl_kernel"),
                need_sm(cap, "FlashMLA", ((9, 0),)),
                need_deepseek_dims(config, "FlashMLA"),
            ]
        )

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self._fm = _flash_mla_module()

    @property
    def table_align(self) -> int:
        return 1  # FlashMLA reads whole 64-token pages; no block multiple

    def _schedule(self, kv_lens: torch.Tensor, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        # A device kernel (graph-capturable, no host sync); FlashMLA maps s_q * H query rows
        # onto one KV head.
        return self._fm.get_mla_metadata(kv_lens, q_len * self.dims.num_heads, 1)

    def _build_metadata(self, batch: ForwardBatch) -> FlashMLAMetadata:
        pt = super()._build_metadata(batch)
        tile, splits = self._schedule(batch.seq_lens, pt.q_len)
        return FlashMLAMetadata(pt.table, pt.max_seq_len, pt.q_len, tile, splits)

    def _new_graph_state(self, max_bs: int, max_num_tokens: int) -> FlashMLAGraphState:
        pt = super()._new_graph_state(max_bs, max_num_tokens)
        splits = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        return FlashMLAGraphState(pt.table, pt.width, splits)

    def _bind_graph(
        self, batch: ForwardBatch, state: PageTableGraphState, capture: bool
    ) -> FlashMLAMetadata:
        # Hazard (a peer bug): tile metadata depends on the lengths; reusing the captured one
        # degrades output after a few dozen tokens. Recomputed and refilled on every replay.
        assert isinstance(state, FlashMLAGraphState)
        pt = super()._bind_graph(batch, state, capture)
        bs = batch.batch_size
        tile, splits = self._schedule(batch.seq_lens, pt.q_len)
        static = state.tiles.setdefault(pt.q_len, torch.empty_like(tile))
        static.copy_(tile)
        state.splits[: bs + 1].copy_(splits)
        return FlashMLAMetadata(pt.table, pt.max_seq_len, pt.q_len, static, state.splits[: bs + 1])

    def _attend_absorbed(
        self, layer: int, q_nope: Tensor, q_rope: Tensor, batch: ForwardBatch, need_lse: bool
    ) -> tuple[Tensor, Tensor | None]:
        md = self._require_metadata()
        assert isinstance(md, FlashMLAMetadata)
        t, h, lat = q_nope.shape
        q = joined_query(q_nope, q_rope).view(batch.batch_size, md.q_len, h, -1)
        out, lse = self._fm.flash_mla_with_kvcache(
            q,
            self.pool.get_paged_buffer(layer),
            md.table,
            batch.seq_lens,
            lat,
            md.tile,
            md.splits,
            softmax_scale=self.scale,
            causal=True,
        )
        out = out.reshape(t, h, lat).to(q_nope.dtype)
        lse = lse.permute(0, 2, 1).reshape(t, h)
        return mask_empty_rows(out, lse, batch)
