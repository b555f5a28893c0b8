"""A thin layer over FlashInfer's generated FA MLA module (flashinfer 0.7.2.post1): plan on
the host into a pinned ring (no synchronizing staging copy), or write the schedule on the
device (`kernels/fi_schedule.py`) where the layout is ours; run over strided pool views."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mla_backends.arith import cdiv
from mla_backends.backends.kernel_packages import missing, older_than, require
from mla_backends.batch import ForwardBatch
from mla_backends.fi_planner import MAX_WORKS, cluster_size, synthetic_info

if TYPE_CHECKING:
    from mla_backends.kernels.fi_schedule import PageGather


def fa3_unusable() -> str | None:
    """Why `FaMLAKernel` cannot run here (the dense and sparse `flashinfer_mla`), else None:
    FlashInfer missing, or a release without the fa3 MLA module it imports. Hazard: 0.6.15.post1
    (SGLang 0.5.17's pin) has no `flashinfer.mla._batch_mla`, so start-up passed and the first
    batch raised ImportError."""
    return missing("flashinfer") or older_than(
        "flashinfer",
        (0, 7, 2),
        "flashinfer_mla drives FlashInfer's fa3 MLA module, flashinfer.mla._batch_mla",
    )


WORKSPACE_BYTES = 128 << 20
INT_WORKSPACE_BYTES = 8 << 20
PINNED_RING = 4


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
    pages = cdiv(seq, page_size)
    kv_indptr = np.zeros(seq.size + 1, dtype=np.int32)
    np.cumsum(pages, out=kv_indptr[1:])
    qo_indptr = np.zeros(seq.size + 1, dtype=np.int32)
    np.cumsum(batch.extend_seq_lens_cpu.numpy(), out=qo_indptr[1:])
    return HostLengths(seq, pages, kv_indptr, qo_indptr)


def plan_key(info: Any) -> tuple[int, ...]:
    """The plan's host values (grid, workspace offsets) as a comparable tuple."""
    return tuple(int(x) for x in info)


@dataclass(frozen=True)
class FaPlan:
    """A planned batch: what `FaMLAKernel.run` takes besides one layer's tensors."""

    info: Any  # host: the planner's opaque output (grid, workspace offsets)
    kv_indices: torch.Tensor  # [total pages] int32, device: page ids, CSR by request
    causal: bool
    page_size: int
    sm_scale: float


class FaMLAKernel:
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
            q_len = 1 if cluster == 1 else cdiv(65, heads)
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
        plan: FaPlan,
        q: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        out: torch.Tensor,
        lse: torch.Tensor | None,
        kv_scale: float,
    ) -> None:
        """q (nope, rope) [T, H, L] / [T, H, R]; kv (ckv, kpe) [pages, page, L] / [.., R]
        (strided views of the pool rows are fine); out [T, H, L]; lse [T, H] fp32 or None."""
        q_nope, q_pe = q
        mask = self.mask_causal if plan.causal else self.mask_none
        self.module.run(
            self.float_ws,
            self.int_ws,
            plan.info,
            q_nope,
            q_pe,
            *kv,
            plan.kv_indices,
            out,
            lse,
            mask,
            q_nope.shape[1],
            plan.page_size,
            plan.sm_scale,
            True,
            kv_scale,
            kv_scale,
            None,
        )
