"""The `trtllm_mla` backend: TRT-LLM-gen MLA decode through FlashInfer (SM100/103, page 32 or
64), decode and target-verify (q_len > 1, seq_lens include the new tokens).

FP8: the kernel wants q in the KV dtype, so q is quantized per tensor on the device
(`q_scale = amax / 448`, no host sync) and every scale is folded into the two BMM scales:
`bmm1 = sm_scale * q_scale * k_scale`, `bmm2 = v_scale` (k_scale = v_scale = the layer
scale). The workspace is zeroed once at construction, as the kernel's semaphores require.
"""

from __future__ import annotations

from collections.abc import Callable

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

WORKSPACE_BYTES = 128 << 20


def load_kernel() -> Callable[..., object]:
    """flashinfer's trtllm_batch_decode_with_kv_cache_mla; tests substitute the emulation."""
    return require("flashinfer.decode").trtllm_batch_decode_with_kv_cache_mla


@register_backend("trtllm_mla")
class TrtllmMLABackend(PageTableBackend):
    name = "trtllm_mla"
    page_sizes = (32, 64)
    kv_dtypes = ("bfloat16", "float8_e4m3fn")

    @classmethod
    def _supports_extra(cls, config: Config, cap: Capability, role: str) -> str | None:
        return (
            missing("flashinfer")
            or need_sm(cap, "TRT-LLM MLA", ((10, 0), (10, 3)))
            or need_deepseek_dims(config, "TRT-LLM MLA")
            or need_dtype(config, "TRT-LLM MLA", ("bfloat16",))
        )

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self._decode = load_kernel()
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)

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
        q, q_scale = self.quantized_query(self.joined_query(q_nope, q_rope))
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
        return self.mask_empty_rows(out.reshape(t, h, lat).to(q_nope.dtype), lse, batch)
