"""The `flashmla` backend: DeepSeek's FlashMLA decode kernel (SM90, page 64).

Uses the `flash_mla` package when importable, else `sgl_kernel.flash_mla` (sglang-kernel
0.4.3). Decode and target-verify only (uniform q_len); EXTEND goes to the prefill backend.
Page table (`block_kv_indices`) from the shared base, tail filled with the dummy page 0.

FP8 pools go through the dense FP8 kernel (`fwd_kvcache_mla_fp8`): q quantized per tensor on
the device, `descale_q` / `descale_k` as [1] fp32 device tensors (sgl_kernel 0.4.3 checks for
shape (1), though its docstring says (batch_size)), and tile metadata from the FP8 scheduler
(`is_fp8_kvcache=True`). Hazard: the bf16 scheduler's metadata with the FP8 kernel was an
illegal memory access (H200).
"""

from __future__ import annotations

import torch

from mla_backends.backends.base import BackendContext, Capability
from mla_backends.backends.kernel_packages import (
    missing,
    need_deepseek_dims,
    need_dtype,
    need_sm,
    require,
)
from mla_backends.backends.paged_table import PageTableBackend
from mla_backends.backends.registry import register_backend
from mla_backends.batch import ForwardBatch
from mla_backends.config import Config


def _flash_mla_module():  # type: ignore[no-untyped-def]
    try:
        return require("flash_mla")
    except ImportError:
        return require("sgl_kernel.flash_mla")


@register_backend("flashmla")
class FlashMLABackend(PageTableBackend):
    name = "flashmla"
    page_sizes = (64,)
    # FP8 is refused: sgl_kernel 0.4.3's dense FP8 kernel (fwd_kvcache_mla_fp8, with the FP8
    # tile scheduler and [1] descales, what its checks demand) runs on uniform batches
    # (scripts/probe_flashmla_fp8.py: standalone and through this backend, H16/64/128) but is
    # an illegal memory access on the parity matrix's mixed-length batches (6 requests,
    # lengths 1..1100) at H16 and H128, decode and verify (H200, 2026-11-22). The FP8 code
    # path below stays so the next sgl_kernel can be tried by adding the dtype back here; the
    # flashinfer_mla and triton backends serve FP8 pools.
    kv_dtypes = ("bfloat16", "float16")

    @classmethod
    def _supports_extra(cls, config: Config, cap: Capability, role: str) -> str | None:
        return (
            missing("flash_mla", "sgl_kernel")
            or need_sm(cap, "FlashMLA", ((9, 0),))
            or need_deepseek_dims(config, "FlashMLA")
            or need_dtype(config, "FlashMLA", ("bfloat16", "float16"))
            or (
                "FlashMLA's FP8 kernel writes bfloat16: an FP8 pool needs dtype bfloat16, "
                f"config dtype is {config.dtype}"
                if config.kv_dtype == "float8_e4m3fn" and config.dtype != "bfloat16"
                else None
            )
        )

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self._fm = _flash_mla_module()
        self._tile: torch.Tensor | None = None  # [num_sm_parts, 8] int32, device
        self._splits: torch.Tensor | None = None  # [B + 1] int32, device

    @property
    def table_align(self) -> int:
        return 1  # FlashMLA reads whole 64-token pages; no block multiple

    def _kernel_metadata(
        self, batch: ForwardBatch, q_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # A device kernel (graph-capturable, no host sync); FlashMLA maps s_q * H query rows
        # onto one KV head.
        rows = q_len * self.dims.num_heads
        if self.pool.is_fp8:
            return self._fm.get_mla_metadata(batch.seq_lens, rows, 1, is_fp8_kvcache=True)
        return self._fm.get_mla_metadata(batch.seq_lens, rows, 1)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        super().init_forward_metadata(batch)
        self._tile, self._splits = self._kernel_metadata(batch, self.metadata.q_len)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        super().init_cuda_graph_state(max_bs, max_num_tokens)
        self._graph_splits = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self._graph_tiles: dict[int, torch.Tensor] = {}  # its shape depends on q_len * H only

    def _bind_graph(self, batch: ForwardBatch) -> None:
        # Hazard (a peer bug): tile metadata depends on the lengths; reusing the captured one
        # degrades output after a few dozen tokens. Recomputed and refilled on every replay.
        super()._bind_graph(batch)
        q_len, bs = self.metadata.q_len, batch.batch_size
        tile, splits = self._kernel_metadata(batch, q_len)
        static = self._graph_tiles.setdefault(q_len, torch.empty_like(tile))
        static.copy_(tile)
        self._graph_splits[: bs + 1].copy_(splits)
        self._tile, self._splits = static, self._graph_splits[: bs + 1]

    def _attend_absorbed(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        batch: ForwardBatch,
        need_lse: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        md = self._require_metadata()
        t, h, lat = q_nope.shape
        b = batch.batch_size
        q = self.joined_query(q_nope, q_rope).view(b, md.q_len, h, -1)
        fp8 = {}
        if self.pool.is_fp8:
            q, q_scale = self.quantized_query(q)
            fp8 = dict(descale_q=q_scale.reshape(1), descale_k=self.pool.scales[layer : layer + 1])
        out, lse = self._fm.flash_mla_with_kvcache(
            q,
            self.pool.get_paged_buffer(layer),
            md.table,
            batch.seq_lens,
            lat,
            self._tile,
            self._splits,
            softmax_scale=self.scale,
            causal=True,
            **fp8,
        )
        out = out.reshape(t, h, lat).to(q_nope.dtype)
        lse = lse.permute(0, 2, 1).reshape(t, h)
        return self.mask_empty_rows(out, lse, batch)
