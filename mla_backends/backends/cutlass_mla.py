"""The `cutlass_mla` backend: sgl_kernel's CUTLASS MLA decode (SM100 only, page 128).

Decode only in the kernel; target-verify runs as q_len single-token rows per request, each
with its own causal length (`seq_len - q_len + j + 1`) over the same page-table row. The
kernel returns no LSE. `num_kv_splits` is fixed at 1: split-KV > 1 hangs under CUDA graphs
(a peer bug). Heads below 128 are padded by the kernel's wrapper. The workspace is sized once,
for the largest batch and context the pool allows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from mla_backends.backends.base import BackendCaps, BackendContext, Capability, joined
from mla_backends.backends.kernel_packages import (
    missing,
    need_deepseek_dims,
    need_sm,
    require,
)
from mla_backends.backends.paged_table import PageTableBackend
from mla_backends.backends.registry import register_backend
from mla_backends.backends.util import mask_empty_rows
from mla_backends.batch import ForwardBatch
from mla_backends.config import Config

NUM_KV_SPLITS = 1
MAX_VERIFY_TOKENS = 8  # workspace rows: max_requests x this (verify runs one row per token)


def load_kernel() -> tuple[Callable[..., torch.Tensor], Callable[..., int]]:
    """(cutlass_mla_decode, cutlass_mla_get_workspace_size); tests substitute the emulation."""
    sk = require("sgl_kernel")
    return sk.cutlass_mla_decode, sk.cutlass_mla_get_workspace_size


@register_backend("cutlass_mla")
class CutlassMLABackend(PageTableBackend):
    name = "cutlass_mla"
    # sglang-kernel 0.4.3 asserts fp16/bf16 ("TODO: support fp8"): FP8 pools are refused.
    caps = BackendCaps(
        page_sizes=(128,),
        kv_dtypes=("bfloat16", "float16"),
        roles=("decode",),
        graphs=True,
        lse=False,
        same_dtype=True,
    )

    @classmethod
    def _machine_reason(cls, config: Config, cap: Capability) -> str | None:
        heads = config.model.num_heads
        return joined(
            [
                missing("sgl_kernel"),
                need_sm(cap, "CUTLASS MLA", ((10, 0),)),
                need_deepseek_dims(config, "CUTLASS MLA"),
                None if heads <= 128 else f"CUTLASS MLA takes <= 128 heads, got {heads}",
            ]
        )

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self._decode, workspace_size = load_kernel()
        cfg = ctx.config
        self._max_rows = cfg.max_requests * MAX_VERIFY_TOKENS
        nbytes = workspace_size(cfg.max_context_len, self._max_rows, 0, NUM_KV_SPLITS)
        self._workspace = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _attend_absorbed(
        self, layer: int, q_nope: Tensor, q_rope: Tensor, batch: ForwardBatch, need_lse: bool
    ) -> tuple[Tensor, Tensor | None]:
        if need_lse:
            raise NotImplementedError("cutlass_mla returns no LSE (sgl_kernel 0.4.3)")
        md = self._require_metadata()
        if batch.num_tokens > self._max_rows:
            raise ValueError(
                f"cutlass_mla workspace holds {self._max_rows} rows "
                f"(max_requests x {MAX_VERIFY_TOKENS}), batch has {batch.num_tokens}"
            )
        kv = self.pool.get_paged_buffer(layer).squeeze(2)  # [pages + 1, 128, 576], a view
        table, seq_lens = md.table, batch.seq_lens
        if md.q_len > 1:  # verify: one row per draft token, causal length per row
            n = md.q_len
            table = table.repeat_interleave(n, dim=0)
            j = torch.arange(n, device=seq_lens.device, dtype=seq_lens.dtype)
            seq_lens = (seq_lens[:, None] - n + 1 + j[None, :]).clamp_(min=0).reshape(-1)
        out = self._decode(
            q_nope, q_rope, kv, seq_lens, table, self._workspace, self.scale, NUM_KV_SPLITS
        )
        return mask_empty_rows(out, None, batch)[0], None
