"""The `flashinfer_mla` backend: FlashInfer's MLA paged kernel (fa3 on SM90, fa2 on SM80/89)
for decode, target-verify and extend over a prefix, at the pool's page size; FlashInfer's
ragged prefill for MHA-mode prefill.

Planning without host work: FlashInfer's `BatchMLAPagedAttentionWrapper.plan()` copies indptrs
to the host (3.7 ms at batch 256) and its C++ scheduler alone takes ~90 us there. We write the
same schedule on the device instead (`kernels/fi_schedule.py`, one Triton launch, checked
against `fi_planner.py`, a port of the C++ planner), into the int workspace at the offsets the
C++ planner lays out for that cluster size. The C++ planner runs once per cluster size to get
those offsets, and for batches whose work could outgrow FlashInfer's fixed work arrays (long
extends); then it gets the CPU lengths the batch carries, and pinned staging buffers rotate so
a plan never overwrites a buffer whose host-to-device copy may still be queued.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mla_backends.arith import cdiv
from mla_backends.backends.base import (
    BackendCaps,
    BackendContext,
    Capability,
    GraphCapable,
    joined,
)
from mla_backends.backends.flashinfer_kernel import (
    FaMLAKernel,
    FaPlan,
    fa3_unusable,
    host_lengths,
    plan_key,
)
from mla_backends.backends.kernel_packages import (
    need_deepseek_dims,
    need_dtype,
    need_sm,
    require,
)
from mla_backends.backends.registry import register_backend
from mla_backends.backends.util import mask_empty_rows
from mla_backends.batch import ForwardBatch, ForwardMode, RaggedLayout
from mla_backends.config import Config


@dataclass
class FlashInferMetadata:
    plan: FaPlan  # host plan, device page ids
    on_device: bool = False  # host: the schedule was written on the device (no host plan)
    # (layout, causal) -> FlashInfer ragged-prefill wrapper planned for this batch (host
    # plan, device workspace); keyed by the layout's id, the layout kept alive beside it.
    ragged: dict[tuple[int, bool], tuple[RaggedLayout, Any]] = field(default_factory=dict)


@dataclass
class FlashInferGraphState:
    indices: torch.Tensor  # [max_bs * pages per request] int32, device: static page ids
    max_pages: int  # host: pages of the longest context a graph may see
    plans: dict[int, tuple[int, ...]] = field(default_factory=dict)  # batch size -> plan key
    on_device: dict[int, bool] = field(default_factory=dict)  # batch size -> device-planned


@register_backend("flashinfer_mla")
class FlashInferMLABackend(GraphCapable[FlashInferMetadata, FlashInferGraphState]):
    name = "flashinfer_mla"
    caps = BackendCaps(kv_dtypes=("bfloat16", "float16", "float8_e4m3fn"), graphs=True)

    @classmethod
    def _machine_reason(cls, config: Config, cap: Capability) -> str | None:
        # one GPU, one reason: with FP8 KV the SM90 one (the SM80 / 86 / 89 list beside it
        # named GPUs that refuse FP8)
        if config.kv_dtype != "float8_e4m3fn":
            sm = need_sm(cap, "FlashInfer MLA", ((8, 0), (8, 6), (8, 9), (9, 0)))
        elif cap.sm != (9, 0):
            sm = f"FlashInfer FP8 MLA needs fa3 (SM90), found {cap.describe()}"
        else:
            sm = None
        return joined(
            [
                fa3_unusable(),
                sm,
                need_deepseek_dims(config, "FlashInfer MLA"),
                need_dtype(config, "FlashInfer MLA", ("bfloat16", "float16")),
            ]
        )

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        require("flashinfer")
        from mla_backends.kernels import fi_schedule, index  # triton: only once built

        self._k_sched, self._k_index = fi_schedule, index
        cap = torch.cuda.get_device_capability(self.device)
        self._variant = "fa3" if cap == (9, 0) else "fa2"
        self._kernel: FaMLAKernel | None = None  # built (JIT) on first use
        self.ragged_plans = 0  # ragged-prefill plans made (tests: once per batch, not layer)

    @property
    def q_dtypes(self) -> tuple[torch.dtype, ...]:
        # Hazard: the generated module is built for the config's dtype, and we call it
        # directly, past the wrapper's dtype checks: another query dtype is refused here
        return (self.ctx.config.torch_dtype,)

    @property
    def kernel(self) -> FaMLAKernel:
        if self._kernel is None:
            d = self.dims
            self._kernel = FaMLAKernel(
                self.device,
                self._variant,
                self.ctx.config.torch_dtype,
                self.pool.dtype,
                d.kv_lora_rank,
                d.qk_rope_head_dim,
            )
        return self._kernel

    # ------------------------------------------------------------------ metadata
    def _build_metadata(self, batch: ForwardBatch) -> FlashInferMetadata:
        """Host lengths from the batch's CPU copies; page indices built on the device. An
        EXTEND batch without a prefix also plans its ragged prefill (every layer's MHA-mode
        prefill runs on `batch.extend_layout`); other layouts are planned on first use."""
        md = self._plan(batch, None)
        if batch.mode is ForwardMode.EXTEND and not batch.has_prefix and batch.batch_size:
            self._ragged_wrapper(md, batch.extend_layout, True)
        return md

    def _plan(
        self, batch: ForwardBatch, indices_out: torch.Tensor | None, max_pages: int | None = None
    ) -> FlashInferMetadata:
        """`max_pages` (graphs): the gather's page bound fixed at the graph's longest context,
        so a device-written plan reads no host length and may be recorded in a graph."""
        ps, d = self.pool.page_size, self.dims
        h = host_lengths(batch, ps)
        total_pages = int(h.kv_indptr[-1])
        if max_pages is None:
            max_pages = int(h.pages.max()) if h.pages.size else 0
        out = indices_out
        if out is None:
            out = torch.empty(max(total_pages, 1), dtype=torch.int32, device=self.device)
        gather = self._k_sched.PageGather(self.req_to_token, batch.req_pool_indices, out, max_pages)
        info = self.kernel.plan_on_device(batch, d.num_heads, d.kv_lora_rank, ps, gather)
        on_device = info is not None
        if info is None:  # one launch for the page ids; the indptr stays on the host
            self._k_index.flat_page_indices(
                self.req_to_token,
                batch.req_pool_indices,
                batch.seq_lens,
                ps,
                total_pages,
                max_pages,
                out,
            )
            info = self.kernel.plan(
                torch.from_numpy(h.qo_indptr),
                torch.from_numpy(h.kv_indptr),
                torch.from_numpy(h.seq),
                d.num_heads,
                d.kv_lora_rank,
                True,
            )
        kv_indices = out if indices_out is not None else out[:total_pages]
        plan = FaPlan(info, kv_indices, True, ps, self.scale)
        return FlashInferMetadata(plan, on_device=on_device)

    # ------------------------------------------------------------------ CUDA graphs
    def _new_graph_state(self, max_bs: int, max_num_tokens: int) -> FlashInferGraphState:
        pages_per_req = cdiv(self.req_to_token.shape[1], self.pool.page_size)
        indices = torch.zeros(max_bs * pages_per_req, dtype=torch.int32, device=self.device)
        return FlashInferGraphState(indices, pages_per_req)

    def graph_refill_on_device(self, batch_size: int) -> bool:
        # Only a device-written plan: the host planner's plan is a host-to-device copy of
        # host values, which a graph would replay with the capture batch's lengths.
        return self._graph is not None and self._graph.on_device.get(batch_size, False)

    def _bind_graph(
        self, batch: ForwardBatch, state: FlashInferGraphState, capture: bool
    ) -> FlashInferMetadata:
        """Plan into the same workspaces: the captured kernels read the new schedule from the
        int workspace (copied in stream order before the replay) and the new page ids from
        the static index buffer."""
        md = self._plan(batch, state.indices, state.max_pages)
        key = plan_key(md.plan.info)
        if capture:
            state.plans[batch.batch_size] = key
            state.on_device[batch.batch_size] = md.on_device
            return md
        captured = state.plans.get(batch.batch_size)
        if captured is None:
            raise RuntimeError(f"no graph captured for batch size {batch.batch_size}")
        # Hazard: the grid and the workspace offsets are baked into the captured launch. In
        # flashinfer 0.7.2 they depend only on the SM count, heads x q_len and fixed maxima,
        # so they never move; if a future planner makes them batch-dependent, fail loudly
        # instead of replaying a stale schedule.
        if key != captured:
            raise RuntimeError(
                "FlashInfer MLA plan layout changed since capture (grid or workspace offsets): "
                f"captured {captured}, now {key}"
            )
        return md

    # ------------------------------------------------------------------ attention
    def _attend_absorbed(
        self, layer: int, q_nope: Tensor, q_rope: Tensor, batch: ForwardBatch, need_lse: bool
    ) -> tuple[Tensor, Tensor | None]:
        md = self._require_metadata()
        out = torch.empty_like(q_nope)
        lse = None
        if need_lse:
            lse = torch.empty(q_nope.shape[:2], dtype=torch.float32, device=q_nope.device)
        ckv, kpe = self.pool.get_ckv_kpe(layer)  # strided views of the 576-wide rows
        self.kernel.run(md.plan, (q_nope, q_rope), (ckv, kpe), out, lse, self.pool.scale(layer))
        return mask_empty_rows(out, lse, batch)

    def _ragged_wrapper(
        self, md: FlashInferMetadata | None, layout: RaggedLayout, causal: bool
    ) -> Any:
        """FlashInfer's ragged prefill for `layout`: planned once per batch and layout (the
        batch's layouts are built once, `ForwardBatch.extend_layout`); without a batch's
        metadata (a direct call), planned for this call only."""
        key = (id(layout), causal)
        if md is not None and key in md.ragged:
            return md.ragged[key][1]
        fi = require("flashinfer")
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(self.kernel.float_ws, "NHD")
        d = self.dims
        w.plan(
            layout.qo_indptr_cpu,
            layout.kv_indptr_cpu,
            d.num_heads,
            d.num_heads,
            d.qk_head_dim,
            head_dim_vo=d.v_head_dim,
            causal=causal,
            sm_scale=self.scale,
            q_data_type=self.ctx.config.torch_dtype,
        )
        self.ragged_plans += 1
        # Kept: our model's 3 layouts (extend, prefix, new) and a 4th. Hazard: each wrapper
        # holds an 8 MiB int workspace and its pinned twin, so SGLang's chunked prefix past
        # that (one layout a chunk) re-plans those chunks each layer (host µs), not 16 MiB a chunk
        if md is not None and len(md.ragged) < 4:
            md.ragged[key] = (layout, w)
        return w

    def _attend_mha(
        self, q: Tensor, k: Tensor, v: Tensor, layout: RaggedLayout, causal: bool, need_lse: bool
    ) -> tuple[Tensor, Tensor | None]:
        w = self._ragged_wrapper(self.metadata, layout, causal)
        if need_lse:
            out, lse = w.run(q, k, v, return_lse=True, lse_base="ln")
        else:
            out, lse = w.run(q, k, v), None
        # Hazard: FlashInfer leaves the rows of requests with no keys undefined (with or without
        # LSE); the contract says out 0 / lse -inf. Decided on the host: no cost without them.
        kv_lens_cpu = layout.kv_indptr_cpu[1:] - layout.kv_indptr_cpu[:-1]
        if not bool((kv_lens_cpu == 0).any()):
            return out, lse
        kv_lens = layout.kv_indptr[1:] - layout.kv_indptr[:-1]
        q_lens = (layout.qo_indptr[1:] - layout.qo_indptr[:-1]).long()
        empty = (kv_lens == 0).repeat_interleave(q_lens, output_size=q.shape[0])
        out = out.masked_fill(empty[:, None, None], 0.0)
        return out, None if lse is None else lse.masked_fill(empty[:, None], float("-inf"))
