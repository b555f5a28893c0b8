"""The `flashinfer_mla` sparse backend: FlashInfer's fa3 MLA kernel (SM90) with page size 1,
as vLLM's FLASHINFER_MLA_SPARSE_SM90: every query token is one "request" whose page table is
its selected slots, compacted (valid first), and whose kv_len is its valid count;
`causal=False` (the selection is already causal).

FlashInfer has no "unused" marker, so it needs the valid counts on the host to plan: this
backend relies on the indexer's counts, exactly min(topk, pos + 1) per token
(`exact_counts`), computed from the batch's CPU lengths. One plan per batch (host work and an
asynchronous copy, no sync: the thin layer of `backends/flashinfer_mla.py`); per layer the
index rows are compacted and gathered into the CSR index array with fixed-size device ops,
so decode graphs capture it. Graph replay re-plans into the same workspaces and checks that
the grid and workspace offsets did not move. Standard pool only (bf16 / fp16, or e4m3 under
the per-layer scale); LSE natural log; rows with no key set to 0 / -inf here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mla_backends.backends.base import Capability
from mla_backends.backends.context import dtype_word, joined
from mla_backends.backends.flashinfer_kernel import FaPlan, fa3_unusable
from mla_backends.backends.kernel_packages import need_sm
from mla_backends.batch import ForwardBatch
from mla_backends.sparse.base import (
    SparseCaps,
    SparseContext,
    SparseGraphState,
    SparseMetadata,
    SparseMLABackend,
    register_sparse_backend,
)

# Query tokens (FlashInfer "requests") per plan; EXTEND batches are chunked. FlashInfer 0.7.2
# holds at most MAX_WORKS (16384) work items: one per 64-head tile per token plus one per
# cluster (`kernels/fi_schedule.work_bound`), so 4096 tokens fit at 128 heads.
MAX_PLAN_TOKENS = 4096


def load_kernel(
    device: torch.device, q_dtype: torch.dtype, kv_dtype: torch.dtype, lat: int, rope: int
) -> Any:
    """The fa3 MLA kernel behind `backends/flashinfer_mla.py` (tests substitute
    `sparse.emulation.FaMLAEmulation`): `plan(...)` fills its one int workspace, `run(...)`
    reads it, so a plan holds until the next one."""
    from mla_backends.backends.flashinfer_kernel import FaMLAKernel

    return FaMLAKernel(device, "fa3", q_dtype, kv_dtype, lat, rope)


@dataclass
class _Chunk:
    start: int  # host: first query token
    end: int  # host
    plan_info: Any  # None: planned right before its run (the int workspace holds one plan)
    src: torch.Tensor  # [(end - start) * topk] int64, device: CSR position -> row-major entry


@dataclass
class FlashInferSparseMetadata(SparseMetadata):
    chunks: list[_Chunk] = field(default_factory=list)  # host plans over the query tokens


@dataclass
class FlashInferSparseGraphState(SparseGraphState):
    src: torch.Tensor  # [max_num_tokens * topk] int64, device
    plans: dict[int, tuple[int, ...]] = field(default_factory=dict)  # tokens -> plan key


@register_sparse_backend("flashinfer_mla")
class FlashInferSparseBackend(SparseMLABackend):
    name = "flashinfer_mla"
    caps = SparseCaps(exact_counts=True)

    @classmethod
    def _machine_reason(cls, ctx: SparseContext, cap: Capability) -> str | None:
        d, reasons = ctx.dims, []
        if (d.kv_lora_rank, d.qk_rope_head_dim) != (512, 64):
            got = f"{d.kv_lora_rank} + {d.qk_rope_head_dim}"
            reasons.append(f"FlashInfer MLA is built for kv_lora_rank 512 + rope 64, got {got}")
        if ctx.dtype not in (torch.bfloat16, torch.float16):
            reasons.append(
                f"FlashInfer MLA takes bfloat16 / float16 activations, got {dtype_word(ctx.dtype)}"
            )
        if ctx.pool.dtype == torch.float32:
            reasons.append("FlashInfer MLA reads bfloat16 / float16 / e4m3 pools, not float32")
        return joined([*reasons, fa3_unusable(), need_sm(cap, "FlashInfer fa3 MLA", ((9, 0),))])

    @property
    def q_dtypes(self) -> tuple[torch.dtype, ...]:
        return (self.ctx.dtype,)  # the kernel is built for the context's activations

    def __init__(self, ctx: SparseContext) -> None:
        super().__init__(ctx)
        d = self.dims
        self._kernel = load_kernel(
            self.device, ctx.dtype, self.pool.dtype, d.kv_lora_rank, d.qk_rope_head_dim
        )
        from mla_backends.kernels import empty_rows  # triton: only once built

        self._k_empty = empty_rows

    # ------------------------------------------------------------------ metadata
    def _src(self, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For valid counts [n] (device): (kv_indptr [n + 1] int32, src [n * topk] int64):
        CSR position p < total reads entry src[p] of the compacted [n, topk] rows; positions
        past the total read entry 0 (never used). Fixed shapes, no sync."""
        n, k = valid.numel(), self.topk
        indptr = torch.zeros(n + 1, dtype=torch.int64, device=self.device)
        indptr[1:] = torch.cumsum(valid.long(), 0)
        pos = torch.arange(n * k, device=self.device)
        seg = torch.searchsorted(indptr[1:], pos, right=True).clamp(max=max(n - 1, 0))
        off = (pos - indptr[seg]).clamp(0, k - 1)
        return indptr, torch.where(pos < indptr[-1], seg * k + off, torch.zeros_like(pos))

    def _plan_chunk(self, valid_cpu: torch.Tensor, start: int, end: int) -> Any:
        """Host work and one asynchronous copy into the kernel's int workspace (no sync)."""
        lens = valid_cpu[start:end].to(torch.int32)
        kv_indptr = torch.zeros(end - start + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(lens, 0)
        qo_indptr = torch.arange(end - start + 1, dtype=torch.int32)
        h, lat = self.dims.num_heads, self.dims.kv_lora_rank
        return self._kernel.plan(qo_indptr, kv_indptr, lens, h, lat, False)

    def _plan(self, batch: ForwardBatch, md: SparseMetadata) -> list[_Chunk]:
        t = batch.num_tokens
        bounds = [(s, min(s + MAX_PLAN_TOKENS, t)) for s in range(0, t, MAX_PLAN_TOKENS)]
        # One chunk (every decode / verify batch): planned now, once for all layers. Several
        # (long EXTEND): each planned right before its run, since a plan overwrites the last.
        one = len(bounds) == 1
        return [
            _Chunk(
                s,
                e,
                self._plan_chunk(md.valid_cpu, s, e) if one else None,
                self._src(md.valid[s:e])[1],
            )
            for s, e in bounds
        ]

    def _build_metadata(self, batch: ForwardBatch) -> FlashInferSparseMetadata:
        c = self._counts(batch)
        chunks = self._plan(batch, c) if batch.num_tokens else []
        return FlashInferSparseMetadata(c.valid_cpu, c.valid, chunks)

    def _new_graph_state(self, max_bs: int, max_num_tokens: int) -> FlashInferSparseGraphState:
        base = super()._new_graph_state(max_bs, max_num_tokens)
        src = torch.zeros(max_num_tokens * self.topk, dtype=torch.int64, device=self.device)
        return FlashInferSparseGraphState(base.valid, src)

    def _bind_graph(
        self, batch: ForwardBatch, state: SparseGraphState, capture: bool
    ) -> FlashInferSparseMetadata:
        assert isinstance(state, FlashInferSparseGraphState)
        t = batch.num_tokens
        if t > MAX_PLAN_TOKENS:
            raise ValueError(f"graphs of more than {MAX_PLAN_TOKENS} tokens are not supported")
        c = super()._bind_graph(batch, state, capture)
        [chunk] = self._plan(batch, c)
        key = tuple(int(x) for x in chunk.plan_info)
        if capture:
            state.plans[t] = key
        elif state.plans.get(t) != key:
            # Hazard: the grid and workspace offsets are baked into the captured launch.
            raise RuntimeError(
                "FlashInfer sparse plan layout changed since capture: "
                f"{state.plans.get(t)} -> {key}"
            )
        state.src[: t * self.topk].copy_(chunk.src)
        chunk.src = state.src[: t * self.topk]
        return FlashInferSparseMetadata(c.valid_cpu, c.valid, [chunk])

    # ------------------------------------------------------------------ attention
    def _attend(
        self, layer: int, q_nope: torch.Tensor, q_rope: torch.Tensor, indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t, h, lat = q_nope.shape
        # contiguous, whatever q's strides: fix_empty_rows writes each token's H x L block
        out = torch.empty(t, h, lat, dtype=q_nope.dtype, device=q_nope.device)
        lse = torch.empty(t, h, dtype=torch.float32, device=q_nope.device)
        rows = self.pool.kv_buffer[layer].view(-1, 1, self.dims.kv_dim)
        ckv, kpe = rows[..., :lat], rows[..., lat:]  # strided views: page size 1
        # Valid entries first, order kept (a stable sort on the "unused" flag).
        order = torch.argsort((indices < 0).to(torch.int8), dim=1, stable=True)
        compact = torch.gather(indices, 1, order)
        md = self.metadata
        if not isinstance(md, FlashInferSparseMetadata):
            raise RuntimeError("init_forward_metadata was not called for this batch")
        for c in md.chunks:
            flat = compact[c.start : c.end].reshape(-1)
            kv_indices = flat[c.src]
            info = c.plan_info
            if info is None:
                info = self._plan_chunk(md.valid_cpu, c.start, c.end)
            self._kernel.run(
                FaPlan(info, kv_indices, False, 1, self.scale),
                (q_nope[c.start : c.end], q_rope[c.start : c.end]),
                (ckv, kpe),
                out[c.start : c.end],
                lse[c.start : c.end],
                self.pool.scale(layer),
            )
        self._k_empty.fix_empty_rows(out, lse, indices)  # one launch, writes only empty rows
        return out, lse
