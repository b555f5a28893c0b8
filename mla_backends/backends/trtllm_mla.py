"""The `trtllm_mla` backend: TRT-LLM-gen MLA decode through FlashInfer (SM100/103, page 32 or
64), decode and target-verify (q_len > 1, seq_lens include the new tokens).

FP8: the kernel wants q in the KV dtype, so q is quantized per tensor on the device
(`q_scale = amax / 448`, no host sync) and every scale is folded into the two BMM scales:
`bmm1 = sm_scale * q_scale * k_scale`, `bmm2 = v_scale` (k_scale = v_scale = the layer
scale). The workspace is zeroed once at construction, as the kernel's semaphores require.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mla_backends.backends.base import BackendCaps, BackendContext, Capability, joined
from mla_backends.backends.kernel_packages import (
    missing,
    need_deepseek_dims,
    need_dtype,
    need_sm,
    require,
)
from mla_backends.backends.paged_table import PageTableBackend
from mla_backends.backends.registry import register_backend
from mla_backends.backends.util import joined_query, mask_empty_rows
from mla_backends.batch import ForwardBatch
from mla_backends.config import Config
from mla_backends.pool import FP8_MAX

WORKSPACE_BYTES = 128 << 20


def load_kernel() -> Callable[..., Any]:
    """flashinfer's trtllm_batch_decode_with_kv_cache_mla; tests substitute the emulation."""
    return require("flashinfer.decode").trtllm_batch_decode_with_kv_cache_mla


@register_backend("trtllm_mla")
class TrtllmMLABackend(PageTableBackend):
    name = "trtllm_mla"
    caps = BackendCaps(
        page_sizes=(32, 64),
        kv_dtypes=("bfloat16", "float8_e4m3fn"),
        roles=("decode",),
        graphs=True,
    )

    @classmethod
    def _machine_reason(cls, config: Config, cap: Capability) -> str | None:
        return joined(
            [
                missing("flashinfer"),
                need_sm(cap, "TRT-LLM MLA", ((10, 0), (10, 3))),
                need_deepseek_dims(config, "TRT-LLM MLA"),
                need_dtype(config, "TRT-LLM MLA", ("bfloat16",)),
            ]
        )

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self._decode = load_kernel()
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)

    # FP8 pools: the kernel takes q in the KV dtype, quantized per tensor on the device (no
    # host sync); references check it against the query it really attends with.
    def quantized_query(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 pools: (q in the KV dtype, q_scale [] fp32 on the device)."""
        if not self.pool.is_fp8:
            return q, torch.ones((), dtype=torch.float32, device=q.device)
        q_scale = q.abs().amax().float().clamp_min(1e-12) / FP8_MAX
        return (q.float() / q_scale).to(self.pool.dtype), q_scale

    @property
    def quantizes_query(self) -> bool:
        return self.pool.is_fp8

    def effective_query(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The query values the kernel attends with (`paged_table.QueryQuantizer`)."""
        q8, q_scale = self.quantized_query(joined_query(q_nope, q_rope))
        q = q8.float() * q_scale
        return q[..., : self.dims.kv_lora_rank], q[..., self.dims.kv_lora_rank :]

    def _attend_absorbed(
        self, layer: int, q_nope: Tensor, q_rope: Tensor, batch: ForwardBatch, need_lse: bool
    ) -> tuple[Tensor, Tensor | None]:
        md = self._require_metadata()
        t, h, lat = q_nope.shape
        b = batch.batch_size
        q, q_scale = self.quantized_query(joined_query(q_nope, q_rope))
        kv_scale = self.pool.scales[layer]
        res = self._decode(
            query=q.view(b, md.q_len, h, -1),
            kv_cache=self.pool.get_paged_buffer(layer).squeeze(2),
            workspace_buffer=self._workspace,
            qk_nope_head_dim=self.dims.qk_nope_head_dim,
            kv_lora_rank=lat,
            qk_rope_head_dim=self.dims.qk_rope_head_dim,
            block_tables=md.table,
            seq_lens=batch.seq_lens,
            max_seq_len=md.max_seq_len,
            bmm1_scale=q_scale * kv_scale * self.scale,
            bmm2_scale=kv_scale,
            return_lse=need_lse,
            return_lse_base="basee",
        )
        out, lse = res if need_lse else (res, None)
        return mask_empty_rows(out.reshape(t, h, lat).to(q_nope.dtype), lse, batch)
