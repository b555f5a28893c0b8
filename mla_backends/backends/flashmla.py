"""The `flashmla` backend: DeepSeek's FlashMLA decode kernel (SM90, page 64).

Uses the `flash_mla` package when importable, else `sgl_kernel.flash_mla` (sglang-kernel
0.4.3). Decode and target-verify only (uniform q_len); EXTEND goes to the prefill backend.
Page table: `[B, W]` int32 from the shared index builder, tail filled with the dummy page 0.
bf16 / fp16 pools (see `kv_dtypes` for why FP8 is refused).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_backends.backends.base import BackendContext, Capability, MLABackend
from mla_backends.backends.kernel_packages import missing, need_sm, require
from mla_backends.backends.registry import register_backend
from mla_backends.batch import ForwardBatch
from mla_backends.config import Config
from mla_backends.indices import build_page_table, page_table_width


@dataclass
class FlashMLAMetadata:
    table: torch.Tensor  # [B, W] int32, device; tail = dummy page 0
    tile_metadata: torch.Tensor  # [num_sm_parts, 8] int32, device
    num_splits: torch.Tensor  # [B + 1] int32, device
    q_len: int  # host


def _flash_mla_module():  # type: ignore[no-untyped-def]
    try:
        return require("flash_mla")
    except ImportError:
        return require("sgl_kernel.flash_mla")


@register_backend("flashmla")
class FlashMLABackend(MLABackend):
    name = "flashmla"
    page_sizes = (64,)
    # FP8: sgl_kernel 0.4.3's dense FP8 path (fwd_kvcache_mla_fp8, q quantized per tensor)
    # hit an illegal memory access on H200 with our pool (H=16, page 64); until that is
    # understood an FP8 pool is refused here (flashinfer_mla and triton serve it).
    kv_dtypes = ("bfloat16", "float16")
    roles = ("decode",)
    supports_graphs = True

    @classmethod
    def _supports_extra(cls, config: Config, cap: Capability, role: str) -> str | None:
        d = config.model
        return (
            missing("flash_mla", "sgl_kernel")
            or need_sm(cap, "FlashMLA", ((9, 0),))
            or (
                None
                if (d.kv_lora_rank, d.qk_rope_head_dim) == (512, 64)
                else f"FlashMLA is built for kv_lora_rank 512 + rope 64, config has "
                f"{d.kv_lora_rank} + {d.qk_rope_head_dim}"
            )
            or (
                None
                if config.dtype in ("bfloat16", "float16")
                else f"FlashMLA takes bf16/fp16 queries, config dtype is {config.dtype}"
            )
        )

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self._fm = _flash_mla_module()
        self.metadata: FlashMLAMetadata | None = None
        self._graph: FlashMLAMetadata | None = None

    # ------------------------------------------------------------------ metadata
    def _kernel_metadata(
        self, seq_lens: torch.Tensor, q_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # A device kernel (graph-capturable, no host sync); FlashMLA maps s_q * H query rows
        # onto one KV head.
        return self._fm.get_mla_metadata(seq_lens, q_len * self.dims.num_heads, 1)

    def _check_mode(self, batch: ForwardBatch) -> int:
        if not batch.mode.is_decode_or_verify:
            raise ValueError(
                f"flashmla serves DECODE and TARGET_VERIFY only, got {batch.mode.name}; "
                "EXTEND batches go to the configured prefill backend"
            )
        return max(batch.num_draft_tokens, 1)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        q_len = self._check_mode(batch)
        ps = self.pool.page_size
        width = page_table_width(int(batch.seq_lens_cpu.max()) if batch.batch_size else 0, ps)
        table = build_page_table(
            self.req_to_token, batch.req_pool_indices, batch.seq_lens, ps, width, 0
        )
        tile, splits = self._kernel_metadata(batch.seq_lens, q_len)
        self.metadata = FlashMLAMetadata(table, tile, splits, q_len)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        ps = self.pool.page_size
        self._graph_width = page_table_width(self.req_to_token.shape[1], ps)
        self._graph_table = torch.zeros(
            max_bs, self._graph_width, dtype=torch.int32, device=self.device
        )
        self._graph_splits = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self._graph_tiles: dict[int, torch.Tensor] = {}

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        q_len, bs = self._check_mode(batch), batch.batch_size
        tile, splits = self._kernel_metadata(batch.seq_lens, q_len)
        # tile metadata's shape depends on q_len * H only: one static buffer per q_len.
        static_tile = self._graph_tiles.setdefault(q_len, torch.empty_like(tile))
        static_tile.copy_(tile)
        self._graph_splits[: bs + 1].copy_(splits)
        table = build_page_table(
            self.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            self.pool.page_size,
            self._graph_width,
            0,
            self._graph_table,
        )
        self._graph = FlashMLAMetadata(table, static_tile, self._graph_splits[: bs + 1], q_len)
        self.metadata = self._graph

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        g = self._graph
        if g is None:
            raise RuntimeError("init_forward_metadata_replay before capture")
        # Hazard (a peer bug): tile metadata depends on the lengths; reusing the captured one
        # degrades output after a few dozen tokens. Recompute and refill in place every replay.
        tile, splits = self._kernel_metadata(batch.seq_lens, g.q_len)
        g.tile_metadata.copy_(tile)
        g.num_splits.copy_(splits)
        build_page_table(
            self.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            self.pool.page_size,
            self._graph_width,
            0,
            g.table,
        )
        self.metadata = g

    # ------------------------------------------------------------------ attention
    def _attend_absorbed(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        batch: ForwardBatch,
        need_lse: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        md = self.metadata
        if md is None:
            raise RuntimeError("init_forward_metadata was not called for this batch")
        t, h, lat = q_nope.shape
        b = batch.batch_size
        q = self.joined_query(q_nope, q_rope).view(b, md.q_len, h, -1)
        out, lse = self._fm.flash_mla_with_kvcache(
            q,
            self.pool.get_paged_buffer(layer),
            md.table,
            batch.seq_lens,
            lat,
            md.tile_metadata,
            md.num_splits,
            softmax_scale=self.scale,
            causal=True,
        )
        out = out.reshape(t, h, lat).to(q_nope.dtype)
        lse = lse.permute(0, 2, 1).reshape(t, h)
        return self.mask_empty_rows(out, lse, batch)
