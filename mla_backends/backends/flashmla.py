"""The `flashmla` backend: DeepSeek's FlashMLA decode kernel (SM90, page 64).

Uses the `flash_mla` package when importable, else `sgl_kernel.flash_mla` (sglang-kernel
0.4.3). Decode and target-verify only (uniform q_len); EXTEND goes to the prefill backend.
Page table (`block_kv_indices`) from the shared base, tail filled with the dummy page 0.

FP8 pools go through the dense FP8 kernel (`fwd_kvcache_mla_fp8`): q quantized per tensor on
the device, `descale_q` / `descale_k` as [1] fp32 device tensors (sgl_kernel 0.4.3 checks for
shape (1), though its docstring says (batch_size)), and tile metadata from the FP8 scheduler
(`is_fp8_kvcache=True`). Hazards, both illegal memory accesses on H200: the bf16 scheduler's
metadata with the FP8 kernel, and a request with no keys (the FP8 kernel computes its last
block as -1 and reads `block_table[-1]`; vLLM PR 35969 hit the same with padded graph rows).
So FP8 batches hand the kernel lengths raised to at least q_len, which reads the table's fill
page, and `mask_empty_rows` then writes the contract's out 0 / lse -inf for those rows.
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
    # FP8 is refused, for precision. sgl_kernel 0.4.3's dense FP8 kernel runs now that empty
    # requests are raised to q_len (module docstring), and passes the parity matrix's decode
    # rows, but misses the verify rows: 5.5e-2 / 6.3e-2 on out at H16 / H128 against a bound
    # of 3e-2 + 3e-2 * |x| (H200, 2026-11-22), in requests with 1-3 visible keys. It rounds P
    # to e4m3 for P @ V: with P rounded that way, an fp64 reference lands within 0.016-0.018
    # of the kernel at H16 where the exact one is 0.11 away (scripts/probe_flashmla_fp8.py
    # --p-fp8). The FP8 path below stays, to try the next kernel by adding the dtype here;
    # flashinfer_mla and triton serve FP8 pools within the bound.
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
        self._kv_lens: torch.Tensor | None = None  # [B] int32, the lengths the kernel reads

    @property
    def table_align(self) -> int:
        return 1  # FlashMLA reads whole 64-token pages; no block multiple

    def _kernel_lens(self, batch: ForwardBatch, q_len: int) -> torch.Tensor:
        """The KV lengths the kernel is given: FP8 raises empty requests to q_len (module
        docstring: the FP8 kernel cannot take a request with no keys). One device op."""
        if not self.pool.is_fp8:
            return batch.seq_lens
        return batch.seq_lens.clamp(min=q_len)

    def _kernel_metadata(
        self, kv_lens: torch.Tensor, q_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # A device kernel (graph-capturable, no host sync); FlashMLA maps s_q * H query rows
        # onto one KV head.
        rows = q_len * self.dims.num_heads
        if self.pool.is_fp8:
            return self._fm.get_mla_metadata(kv_lens, rows, 1, is_fp8_kvcache=True)
        return self._fm.get_mla_metadata(kv_lens, rows, 1)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        super().init_forward_metadata(batch)
        self._kv_lens = self._kernel_lens(batch, self.metadata.q_len)
        self._tile, self._splits = self._kernel_metadata(self._kv_lens, self.metadata.q_len)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        super().init_cuda_graph_state(max_bs, max_num_tokens)
        self._graph_splits = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self._graph_kv_lens = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        self._graph_tiles: dict[int, torch.Tensor] = {}  # its shape depends on q_len * H only

    def _bind_graph(self, batch: ForwardBatch) -> None:
        # Hazard (a peer bug): tile metadata depends on the lengths; reusing the captured one
        # degrades output after a few dozen tokens. Recomputed and refilled on every replay.
        super()._bind_graph(batch)
        q_len, bs = self.metadata.q_len, batch.batch_size
        kv_lens = self._kernel_lens(batch, q_len)
        if kv_lens is not batch.seq_lens:  # FP8: the captured kernel reads a static copy
            self._graph_kv_lens[:bs].copy_(kv_lens)
            kv_lens = self._graph_kv_lens[:bs]
        tile, splits = self._kernel_metadata(kv_lens, q_len)
        static = self._graph_tiles.setdefault(q_len, torch.empty_like(tile))
        static.copy_(tile)
        self._graph_splits[: bs + 1].copy_(splits)
        self._tile, self._splits, self._kv_lens = static, self._graph_splits[: bs + 1], kv_lens

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
            self._kv_lens,
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
