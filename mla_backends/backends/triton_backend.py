"""The `triton` backend: our own kernels (mla_backends/kernels), every mode, page sizes 1-128,
FP8 KV dequantized in registers. Runs on any CUDA GPU with Triton, and on CPU under
TRITON_INTERPRET=1 (tests only). Launch choices live in `kernels/tuning.py`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mla_backends.arith import cumsum_indptr
from mla_backends.backends.base import (
    BackendCaps,
    BackendContext,
    Capability,
    GraphCapable,
    joined,
)
from mla_backends.backends.kernel_packages import need_triton, need_triton_sm
from mla_backends.backends.registry import register_backend
from mla_backends.batch import ForwardBatch, RaggedLayout
from mla_backends.config import TINY, Config, ConfigError
from mla_backends.indices import build_page_table, page_table_width

logger = logging.getLogger(__name__)


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


@dataclass
class TritonMetadata:
    qo_indptr: torch.Tensor  # [B + 1] int32, device
    table: torch.Tensor  # [B, W] int32, device: page ids, tail = dummy page 0 (never read)
    max_q_len: int  # host
    num_splits: int  # host
    workspace: tuple[torch.Tensor, torch.Tensor] | None  # split partials (out, lse), device
    block_m: int  # host: query rows a program (`tuning.block_m_for`, chosen with the splits)


@dataclass
class TritonGraphState:
    qo_indptr: torch.Tensor  # [max_bs + 1] int32, device
    table: torch.Tensor  # [max_bs, width] int32, device
    width: int  # host: pages per row for the longest context
    workspace: tuple[torch.Tensor, torch.Tensor]  # split partials of any captured size, device
    # per captured (batch, q_len): views of the buffers above (every size reads leading rows)
    captured: dict[tuple[int, int], TritonMetadata] = field(default_factory=dict)


@register_backend("triton")
class TritonBackend(GraphCapable[TritonMetadata, TritonGraphState]):
    name = "triton"
    caps = BackendCaps(graphs=True)

    @classmethod
    def _machine_reason(cls, config: Config, cap: Capability) -> str | None:
        fp8 = config.kv_dtype == "float8_e4m3fn"
        reasons = [
            need_triton(cap.device_type),
            need_triton_sm(cap, fp8, "triton MLA kernels need"),
        ]
        d = config.model
        if not (_pow2(d.kv_lora_rank) and _pow2(d.qk_rope_head_dim)):
            # Hazard: a YAML file without `model:` gets Config's `tiny` (R 8), not the shipped
            # default's `tiny-kernel`: say so, or the widths look like the user's own
            hint = (
                " (model tiny, the default without `model:`; tiny-kernel runs)" if d == TINY else ""
            )
            reasons.append(
                f"triton MLA kernels need kv_lora_rank and qk_rope_head_dim to be powers of "
                f"two >= 16, got {d.kv_lora_rank} and {d.qk_rope_head_dim}{hint}"
            )
        return joined(reasons)

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        unusable = need_triton(self.device.type)
        if unusable is not None:
            # Hazard: built straight from the registry (Runtime.build refuses it first), every
            # launch would fail inside Triton ("0 active drivers")
            raise ConfigError(f"triton backend: {unusable}; use the torch backend")
        from mla_backends.kernels import common, mha_prefill, mla_attention, store, tuning

        self._k_attn, self._k_mha, self._k_store = mla_attention, mha_prefill, store
        self._tune = tuning
        self._interp = common.interpreting()
        self._sms = common.num_sms(self.device)
        self._smem_limit = common.max_shared_mem(self.device)
        kv = self.pool.kv_buffer[0]
        lat = self.dims.kv_lora_rank
        self._gluon = mla_attention.gluon_usable(kv.dtype, kv, self.pool.page_size, lat)
        self._cudnn_lse = hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")

    # ------------------------------------------------------------------ tuning
    def _gluon_on(self) -> bool:
        # The first failure to build the Gluon kernel turns it off for the process.
        return self._gluon and self._k_attn.gluon_error() is None

    def _block_m(
        self, rows: int, dot_dtype: torch.dtype, batch_size: int, max_kv: int | None = None
    ) -> int:
        """Rows a program; `max_kv` (decode / verify grids) lets short grids of 33-128 rows
        take the narrow kernel (`tuning.narrow_pays`)."""
        sms = None if max_kv is None else self._sms
        return self._tune.block_m_for(rows, dot_dtype, self._gluon_on(), batch_size, max_kv, sms)

    def _launch_cfg(
        self, block_m: int, batch_size: int, num_splits: int, dot_dtype: torch.dtype
    ) -> dict[str, Any]:
        if self._interp:
            return self._tune.INTERP_DECODE
        gluon = self._gluon_on() and (block_m >= 64 or self._tune.is_narrow(block_m, True))
        return self._tune.launch_config(
            block_m,
            self.pool.page_size,
            batch_size,
            num_splits,
            dot_dtype,
            gluon,
            self.pool.kv_dim,
            self._smem_limit,
        )

    def _grid(self, batch_size: int, max_q: int, max_kv: int) -> tuple[int, int]:
        """(rows a program, KV splits) of a decode / verify grid of batch_size x head blocks
        (`block_m_for`, `split_policy`)."""
        rows = max_q * self.dims.num_heads
        bm = self._block_m(rows, self.ctx.config.torch_dtype, batch_size, max_kv)
        narrow = self._tune.is_narrow(bm, self._gluon_on())
        return bm, self._tune.decode_splits(batch_size, rows, bm, max_kv, self._sms, narrow)

    # ------------------------------------------------------------------ metadata
    def _fill(
        self, batch: ForwardBatch, width: int, static: TritonMetadata | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(qo_indptr, page table) for `batch`, written into `static`'s buffers if given."""
        qo = cumsum_indptr(batch.extend_seq_lens, None if static is None else static.qo_indptr)
        table = build_page_table(
            self.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            self.pool.page_size,
            width,
            0,
            None if static is None else static.table,
        )
        return qo, table

    def _build_metadata(self, batch: ForwardBatch) -> TritonMetadata | None:
        if batch.batch_size == 0:
            return None
        max_q, max_kv = batch.max_q_len, batch.max_kv_len
        qo, table = self._fill(batch, page_table_width(max_kv, self.pool.page_size), None)
        splits = 1
        h, dtype = self.dims.num_heads, self.ctx.config.torch_dtype
        if batch.mode.is_decode_or_verify:
            bm, splits = self._grid(batch.batch_size, max_q, max_kv)
        else:
            bm = self._block_m(max_q * h, dtype, batch.batch_size)
        ws = None
        if splits > 1:
            rows = batch.num_tokens * h * splits
            ws = self._workspace(rows)
        return TritonMetadata(qo, table, max_q, splits, ws, bm)

    def _workspace(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        lat, dev = self.dims.kv_lora_rank, self.device
        return (
            torch.empty(rows, lat, dtype=torch.float32, device=dev),
            torch.empty(rows, dtype=torch.float32, device=dev),
        )

    def _new_graph_state(self, max_bs: int, max_num_tokens: int) -> TritonGraphState:
        width = page_table_width(self.req_to_token.shape[1], self.pool.page_size)
        i32: dict[str, Any] = {"dtype": torch.int32, "device": self.device}
        return TritonGraphState(
            torch.zeros(max_bs + 1, **i32),
            torch.zeros(max_bs, width, **i32),
            width,
            self._workspace(
                min(
                    max_num_tokens * self.dims.num_heads * self._tune.MAX_SPLITS,
                    self._tune.split_rows_bound(self._sms),
                )
            ),
        )

    def graph_refill_on_device(self, batch_size: int) -> bool:
        return True  # indptr and page table from device lengths; splits fixed at capture

    def _bind_graph(
        self, batch: ForwardBatch, state: TritonGraphState, capture: bool
    ) -> TritonMetadata:
        bs, max_q = batch.batch_size, batch.q_len
        key = (bs, max_q)
        if capture:
            # Rows a program and splits are fixed per captured size, for the longest context
            # the graph may see.
            bm, splits = self._grid(bs, max_q, self.req_to_token.shape[1])
            rows = batch.num_tokens * self.dims.num_heads * splits
            if splits > 1 and rows > state.workspace[1].numel():
                # tuning.split_rows_bound is wrong if this is reached
                raise RuntimeError(
                    f"triton graph capture: {splits} splits of {batch.num_tokens} tokens need "
                    f"{rows} partial rows, the graph workspace holds {state.workspace[1].numel()}"
                )
            ws = (state.workspace[0][:rows], state.workspace[1][:rows]) if splits > 1 else None
            state.captured[key] = TritonMetadata(
                state.qo_indptr[: bs + 1], state.table[:bs], max_q, splits, ws, bm
            )
        static = state.captured.get(key)
        if static is None:
            raise RuntimeError(f"no graph captured for (batch, q_len) = {key}")
        self._fill(batch, state.width, static)  # same pointers, new contents
        return static

    # ------------------------------------------------------------------ attention
    def store_kv(
        self, layer: int, loc: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor
    ) -> None:
        layer = self.pool.check_store(layer, loc, k_nope, k_rope)  # as `set_mla_kv_buffer`
        self._k_store.store_latent_rows(
            self.pool.kv_buffer[layer],
            self.pool.scales[layer],
            loc,
            k_nope,
            k_rope,
            self.pool.is_fp8,
        )

    def _attend_absorbed(
        self, layer: int, q_nope: Tensor, q_rope: Tensor, batch: ForwardBatch, need_lse: bool
    ) -> tuple[Tensor, Tensor | None]:
        t, h, _ = q_nope.shape
        out = torch.empty_like(q_nope)
        lse = torch.empty(t, h, dtype=torch.float32, device=q_nope.device)
        if batch.batch_size == 0:
            return out, lse
        md = self._require_metadata()
        block_m = md.block_m  # chosen with the splits, for the config's dtype
        if q_nope.dtype != self.ctx.config.torch_dtype:
            block_m = self._block_m(md.max_q_len * h, q_nope.dtype, batch.batch_size)
        self._k_attn.mla_attention(
            q_nope,
            q_rope,
            self.pool.kv_buffer[layer],
            md.table,
            md.qo_indptr,
            batch.seq_lens,
            self.pool.page_size,
            self.scale,
            self.pool.scale(layer),
            md.max_q_len,
            md.num_splits,
            out,
            lse,
            md.workspace,
            block_m=block_m,
            dot_f32=self._interp,
            **self._launch_cfg(block_m, batch.batch_size, md.num_splits, q_nope.dtype),
        )
        return out, lse

    def _attend_mha(
        self, q: Tensor, k: Tensor, v: Tensor, layout: RaggedLayout, causal: bool, need_lse: bool
    ) -> tuple[Tensor, Tensor | None]:
        from mla_backends.kernels.torch_prefill import sdpa_fits, torch_mha_prefill

        out = torch.empty(*q.shape[:2], v.shape[-1], dtype=q.dtype, device=q.device)
        fits = sdpa_fits(layout, causal)
        route = self._tune.mha_route(q.dtype, q.is_cuda, fits, need_lse, self._cudnn_lse)
        if route == "sdpa":
            torch_mha_prefill(q, k, v, layout, causal, self.scale, out, None)
            return out, None
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        if route == "cudnn":
            try:
                torch_mha_prefill(q, k, v, layout, causal, self.scale, out, lse)
                return out, lse
            except RuntimeError as e:  # this cuDNN / torch cannot: our kernel, from now on
                self._cudnn_lse = False
                logger.warning("cuDNN attention with LSE unavailable (%s); using Triton", e)
        cfg = self._tune.INTERP_MHA if self._interp else self._tune.mha_config(q.dtype)
        self._k_mha.mha_prefill(
            q,
            k,
            v,
            layout.qo_indptr,
            layout.kv_indptr,
            layout.max_q_len,
            self.scale,
            causal,
            out,
            lse,
            dot_f32=self._interp,
            **cfg,
        )
        return out, lse
