"""The `flashinfer_mla` backend: FlashInfer's MLA paged kernel (fa3 on SM90, fa2 on SM80/89)
for decode, target-verify and extend over a prefix, at the pool's page size; FlashInfer's
ragged prefill for MHA-mode prefill.

Planning without host work: FlashInfer's `BatchMLAPagedAttentionWrapper.plan()` copies
indptrs to the host (3.7 ms at batch 256) and its C++ scheduler alone takes ~90 us there. We
write the same schedule on the device instead (`kernels/fi_schedule.py`, one Triton launch,
checked against a port of the C++ planner), into the int workspace at the offsets the C++
planner lays out for that cluster size. The C++ planner runs once per cluster size to get
those offsets, and for batches whose work could outgrow FlashInfer's fixed work arrays
(long extends); then it gets the CPU lengths the batch carries, and pinned staging buffers
rotate so a plan never overwrites a buffer whose host-to-device copy may still be queued.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mla_backends.backends.base import BackendContext, Capability, MLABackend
from mla_backends.backends.kernel_packages import (
    missing,
    need_deepseek_dims,
    need_dtype,
    need_sm,
    require,
)
from mla_backends.backends.registry import register_backend
from mla_backends.batch import ForwardBatch, RaggedLayout
from mla_backends.config import Config
from mla_backends.fi_schedule import MAX_WORKS, cluster_size, synthetic_info
from mla_backends.indices import build_page_indices

if TYPE_CHECKING:
    from mla_backends.kernels.fi_schedule import PageGather

WORKSPACE_BYTES = 128 << 20
INT_WORKSPACE_BYTES = 8 << 20
PINNED_RING = 4


@dataclass
class FlashInferMetadata:
    plan_info: Any  # opaque host object from the kernel's plan
    kv_indices: torch.Tensor  # [total pages] int32, device
    causal: bool


@dataclass
class HostLengths:
    """The planner's host inputs, int32 numpy (views of the batch's CPU copies where possible)."""

    seq: np.ndarray  # [B] KV lengths
    pages: np.ndarray  # [B] pages per request
    kv_indptr: np.ndarray  # [B + 1] over pages
    qo_indptr: np.ndarray  # [B + 1] over query tokens


def host_lengths(batch: ForwardBatch, page_size: int) -> HostLengths:
    """From the batch's CPU copies, in numpy: a few small torch CPU ops cost ~30 us here at
    batch 256, a noticeable share of a decode step's metadata."""
    seq = batch.seq_lens_cpu.numpy().astype(np.int32, copy=False)
    pages = (seq + (page_size - 1)) // page_size
    kv_indptr = np.zeros(seq.size + 1, dtype=np.int32)
    np.cumsum(pages, out=kv_indptr[1:])
    qo_indptr = np.zeros(seq.size + 1, dtype=np.int32)
    np.cumsum(batch.extend_seq_lens_cpu.numpy(), out=qo_indptr[1:])
    return HostLengths(seq, pages, kv_indptr, qo_indptr)


def _plan_key(info: Any) -> tuple[int, ...]:
    """The plan's host values (grid, workspace offsets) as a comparable tuple."""
    return tuple(int(x) for x in info)


class _FaMLAKernel:
    """Thin layer over FlashInfer's generated FA MLA module (flashinfer 0.7.2.post1)."""

    def __init__(
        self,
        device: torch.device,
        variant: str,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype,
        lat: int,
        rope: int,
    ) -> None:
        from mla_backends.kernels import fi_schedule  # triton: only once a kernel can run

        self._sched = fi_schedule
        fa = require("flashinfer.mla._batch_mla._backends._fa_common")
        self.mask_causal = require("flashinfer.utils").MaskMode.CAUSAL.value
        self.mask_none = require("flashinfer.utils").MaskMode.NON_CAUSAL.value
        self.module = fa.get_batch_mla_module(
            variant, q_dtype, kv_dtype, q_dtype, torch.int32, lat, rope, False
        )
        self.float_ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.int_ws = torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.pinned = [
            torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, pin_memory=True)
            for _ in range(PINNED_RING)
        ]
        self.events: list[torch.cuda.Event | None] = [None] * PINNED_RING
        self.turn = 0
        self.num_sm = torch.cuda.get_device_properties(device).multi_processor_count
        self.layouts: dict[int, Any] = {}  # cluster size -> plan info (None: not our layout)

    def layout_ok(self, heads: int, head_dim: int, cluster: int) -> Any | None:
        """The plan info for a cluster size, from one host plan of a one-request batch, if its
        offsets are the layout `fi_schedule` writes (flashinfer 0.7.2's); else None and the
        host planner keeps planning (another flashinfer version)."""
        if cluster not in self.layouts:
            q_len = 1 if cluster == 1 else -(-65 // heads)
            info = self.plan(
                torch.tensor([0, q_len], dtype=torch.int32),
                torch.tensor([0, 1], dtype=torch.int32),
                torch.tensor([q_len], dtype=torch.int32),
                heads,
                head_dim,
                True,
            )
            ok = [int(x) for x in info] == synthetic_info(cluster, self.num_sm, head_dim)
            self.layouts[cluster] = info if ok else None
        return self.layouts[cluster]

    def plan_on_device(
        self,
        batch: ForwardBatch,
        heads: int,
        head_dim: int,
        page_size: int,
        pages: PageGather,
    ) -> Any | None:
        """Write this batch's schedule and page ids on the device (one launch); None where
        the host planner must run (a layout that is not ours, or more possible work items
        than FlashInfer's arrays hold)."""
        q = batch.extend_seq_lens_cpu.numpy()
        cluster = cluster_size(q, heads)
        max_q = int(q.max()) if q.size else 0
        bound = self._sched.work_bound(q.size, max_q, heads, cluster, self.num_sm // cluster)
        if max_q == 0 or bound > MAX_WORKS:
            return None
        info = self.layout_ok(heads, head_dim, cluster)
        if info is not None:
            self._sched.write_schedule(
                self.int_ws,
                cluster,
                heads,
                page_size,
                self.num_sm,
                batch.extend_seq_lens,
                batch.seq_lens,
                max_q,
                pages,
            )
        return info

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_lens: torch.Tensor,
        num_heads: int,
        head_dim: int,
        causal: bool,
    ) -> Any:
        """All three tensors are int32 on the CPU. Host work plus one async copy: no sync."""
        i = self.turn % PINNED_RING
        self.turn += 1
        ev = self.events[i]
        if ev is not None and not ev.query():
            ev.synchronize()  # the copy that used this pinned buffer 4 plans ago: ~never waits
        args = (
            self.float_ws,
            self.int_ws,
            self.pinned[i],
            qo_indptr,
            kv_indptr,
            kv_lens,
            num_heads,
            head_dim,
            causal,
        )
        raw = getattr(self.module, "_module", None)
        if raw is None:  # not the 0.7.2 module layout: its own staging (may synchronize)
            info, _ = self.module.plan_with_staged_workspace_bytes(*args)
        else:
            # The C++ planner only fills our pinned buffer; FlashInfer's Python adapter then
            # copies it through a freshly allocated pinned tensor, which can synchronize the
            # device. We copy from the ring buffer instead: asynchronous, no allocation.
            info, staged = raw.plan(*args)
            staged = int(staged)
            self.int_ws[:staged].copy_(self.pinned[i][:staged], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self.events[i] = ev
        return info

    def run(
        self,
        md: FlashInferMetadata,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        ckv: torch.Tensor,
        kpe: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        page_size: int,
        sm_scale: float,
        kv_scale: float,
    ) -> None:
        mask = self.mask_causal if md.causal else self.mask_none
        self.module.run(
            self.float_ws,
            self.int_ws,
            md.plan_info,
            q_nope,
            q_pe,
            ckv,
            kpe,
            md.kv_indices,
            out,
            lse,
            mask,
            q_nope.shape[1],
            page_size,
            sm_scale,
            True,
            kv_scale,
            kv_scale,
            None,
        )


@register_backend("flashinfer_mla")
class FlashInferMLABackend(MLABackend):
    name = "flashinfer_mla"
    supports_graphs = True
    kv_dtypes = ("bfloat16", "float16", "float8_e4m3fn")

    @classmethod
    def _supports_extra(cls, config: Config, cap: Capability, role: str) -> str | None:
        return (
            missing("flashinfer")
            or need_sm(cap, "FlashInfer MLA", ((8, 0), (8, 6), (8, 9), (9, 0)))
            or need_deepseek_dims(config, "FlashInfer MLA")
            or need_dtype(config, "FlashInfer MLA", ("bfloat16", "float16"))
            or (
                None
                if config.kv_dtype != "float8_e4m3fn" or cap.sm == (9, 0)
                else f"FlashInfer FP8 MLA needs fa3 (SM90), found {cap.describe()}"
            )
        )

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        require("flashinfer")
        from mla_backends.kernels import fi_schedule, index  # triton: only once built

        self._k_sched, self._k_index = fi_schedule, index
        cap = torch.cuda.get_device_capability(self.device)
        self._variant = "fa3" if cap == (9, 0) else "fa2"
        self._kernel: _FaMLAKernel | None = None  # built (JIT) on first use
        self.metadata: FlashInferMetadata | None = None
        self._ragged: dict[int, Any] = {}

    @property
    def kernel(self) -> _FaMLAKernel:
        if self._kernel is None:
            d = self.dims
            self._kernel = _FaMLAKernel(
                self.device,
                self._variant,
                self.ctx.config.torch_dtype,
                self.pool.dtype,
                d.kv_lora_rank,
                d.qk_rope_head_dim,
            )
        return self._kernel

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Host lengths from the batch's CPU copies; page indices built on the device."""
        self.metadata = self._plan(batch, None)

    def _plan(self, batch: ForwardBatch, indices_out: torch.Tensor | None) -> FlashInferMetadata:
        ps, d = self.pool.page_size, self.dims
        h = host_lengths(batch, ps)
        total_pages = int(h.kv_indptr[-1])
        max_pages = int(h.pages.max()) if h.pages.size else 0
        out = indices_out
        if out is None:
            out = torch.empty(max(total_pages, 1), dtype=torch.int32, device=self.device)
        info = None
        if self.device.type == "cuda":
            gather = self._k_sched.PageGather(
                self.req_to_token, batch.req_pool_indices, out, max_pages
            )
            info = self.kernel.plan_on_device(batch, d.num_heads, d.kv_lora_rank, ps, gather)
        if info is None:
            if self.device.type == "cuda":  # one launch; the indptr stays on the host
                self._k_index.flat_page_indices(
                    self.req_to_token,
                    batch.req_pool_indices,
                    batch.seq_lens,
                    ps,
                    total_pages,
                    max_pages,
                    out,
                )
            else:
                build_page_indices(
                    self.req_to_token,
                    batch.req_pool_indices,
                    batch.seq_lens,
                    ps,
                    total_pages,
                    indices_out=out,
                )
            info = self.kernel.plan(
                torch.from_numpy(h.qo_indptr),
                torch.from_numpy(h.kv_indptr),
                torch.from_numpy(h.seq),
                d.num_heads,
                d.kv_lora_rank,
                True,
            )
        return FlashInferMetadata(info, out if indices_out is not None else out[:total_pages], True)

    # ------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        pages_per_req = -(-self.req_to_token.shape[1] // self.pool.page_size)
        self._graph_indices = torch.zeros(
            max_bs * pages_per_req, dtype=torch.int32, device=self.device
        )
        self._graph_plans: dict[int, tuple[int, ...]] = {}

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        if not hasattr(self, "_graph_indices"):
            raise RuntimeError("init_forward_metadata_capture before init_cuda_graph_state")
        self.metadata = self._plan(batch, self._graph_indices)
        self._graph_plans[batch.batch_size] = _plan_key(self.metadata.plan_info)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        """Re-plan into the same workspaces: the captured kernels read the new schedule from
        the int workspace (copied in stream order before the replay) and the new page ids
        from the static index buffer."""
        captured = self._graph_plans.get(batch.batch_size)
        if captured is None:
            raise RuntimeError(f"no graph captured for batch size {batch.batch_size}")
        self.metadata = self._plan(batch, self._graph_indices)
        # Hazard: the grid and the workspace offsets are baked into the captured launch. In
        # flashinfer 0.7.2 they depend only on the SM count, heads x q_len and fixed maxima,
        # so they never move; if a future planner makes them batch-dependent, fail loudly
        # instead of replaying a stale schedule.
        if _plan_key(self.metadata.plan_info) != captured:
            raise RuntimeError(
                "FlashInfer MLA plan layout changed since capture (grid or workspace offsets): "
                f"captured {captured}, now {_plan_key(self.metadata.plan_info)}"
            )

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
        out = torch.empty_like(q_nope)
        lse = None
        if need_lse:
            lse = torch.empty(q_nope.shape[:2], dtype=torch.float32, device=q_nope.device)
        ckv, kpe = self.pool.get_ckv_kpe(layer)  # strided views of the 576-wide rows
        self.kernel.run(
            md,
            q_nope,
            q_rope,
            ckv,
            kpe,
            out,
            lse,
            self.pool.page_size,
            self.scale,
            self.pool.scale(layer),
        )
        return self.mask_empty_rows(out, lse, batch)

    def _ragged_wrapper(self, layout: RaggedLayout, causal: bool) -> Any:
        """FlashInfer's ragged prefill, planned once per layout (metadata built once)."""
        key = (id(layout), causal)
        if key not in self._ragged:
            fi = require("flashinfer")
            ws = self.kernel.float_ws
            w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
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
            if len(self._ragged) >= 4:  # a batch uses one or two layouts (prefix chunks)
                self._ragged.clear()
            self._ragged[key] = (w, layout)  # keeping the layout alive keeps its id unique
        return self._ragged[key][0]

    def _attend_mha(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: RaggedLayout,
        causal: bool,
        need_lse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = self._ragged_wrapper(layout, causal)
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
