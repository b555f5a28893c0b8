"""The `flashmla` sparse backend: FlashMLA's sparse kernels from sglang-kernel 0.4.3 (SM90).

- Standard bf16 pool, every mode: `flash_mla_sparse_fwd(q [T, Hp, 576], kv [slots, 1, 576],
  indices [T, 1, K])`; indices are rows of kv, i.e. pool slots; -1 (any i < 0) is unused.
- FP8 row pool (`fp8_row`, 656-byte rows), decode / verify: `flash_mla_with_kvcache(q
  [T, 1, Hp, 576], kv [slots / 64, 64, 1, 656], indices [T, 1, K], is_fp8_kvcache=True)`,
  one "request" per query token (as SGLang), cache_seqlens = its valid count, tile metadata
  from `get_mla_metadata(..., topk=K)` per batch (recomputed into static buffers on graph
  replay). EXTEND: the batch's rows are dequantised once per layer into a bf16 block and the
  indices remapped to it, then the prefill kernel.
Heads are zero-padded to 64 (or 128); the scale is always passed. Hazards: the prefill
kernel's LSE was base 2 with -inf for empty rows before FlashMLA 082094b and natural log with
+inf after, and sgl_kernel's docstring still says base 2, so the base is measured once at
construction; rows with no valid index are set to out 0 / lse -inf here, whatever the kernel
wrote. The decode kernel treats only -1 as unused and reads any other index: indices must be
real slots or -1 (the indexer's are).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from mla_backends.arith import round_up
from mla_backends.backends.base import Capability
from mla_backends.backends.context import dtype_word, joined
from mla_backends.backends.kernel_packages import missing, need_sm, require
from mla_backends.backends.util import joined_query
from mla_backends.batch import ForwardBatch
from mla_backends.indices import build_token_indices
from mla_backends.sparse.base import (
    SparseCaps,
    SparseContext,
    SparseGraphState,
    SparseMetadata,
    SparseMLABackend,
    register_sparse_backend,
)
from mla_backends.sparse.fp8_row import Fp8RowPool, dequant_rows


def load_kernels() -> ModuleType:
    """sgl_kernel's FlashMLA module (tests substitute `sparse.emulation.FlashMLAEmulation`)."""
    return require("sgl_kernel.flash_mla")


def padded_heads(h: int) -> int:
    return 64 if h <= 64 else 128


@dataclass
class FlashMLASparseMetadata(SparseMetadata):
    # FP8 rows, decode / verify: the FP8 sparse decode kernel's schedule
    seqlens: torch.Tensor | None = None  # [T] int32, device: valid counts, empty rows as 1
    tile: torch.Tensor | None = None  # [num_sm_parts, 8] int32, device
    splits: torch.Tensor | None = None  # [T + 1] int32, device
    # FP8 rows, EXTEND: (the batch's slots [N], slot -> row of the dequantized gather)
    extend: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class FlashMLASparseGraphState(SparseGraphState):
    seqlens: torch.Tensor  # [max_num_tokens] int32, device
    splits: torch.Tensor  # [max_num_tokens + 1] int32, device
    tiles: dict[int, torch.Tensor] = field(default_factory=dict)  # per token count


@register_sparse_backend("flashmla")
class FlashMLASparseBackend(SparseMLABackend):
    name = "flashmla"
    caps = SparseCaps(pool_kinds=("paged", "fp8_row"))

    @classmethod
    def _machine_reason(cls, ctx: SparseContext, cap: Capability) -> str | None:
        d, reasons = ctx.dims, []
        if (d.kv_lora_rank, d.qk_rope_head_dim) != (512, 64):
            got = f"{d.kv_lora_rank} + {d.qk_rope_head_dim}"
            reasons.append(f"FlashMLA sparse is built for kv_lora_rank 512 + rope 64, got {got}")
        if d.num_heads > 128:
            reasons.append(f"FlashMLA sparse takes at most 128 heads, got {d.num_heads}")
        if ctx.dtype != torch.bfloat16:
            reasons.append(
                f"FlashMLA sparse takes bfloat16 activations, got {dtype_word(ctx.dtype)}"
            )
        if not ctx.fp8_rows and ctx.pool.dtype != torch.bfloat16:
            pool = dtype_word(ctx.pool.dtype)
            reasons.append(f"FlashMLA sparse reads a bfloat16 pool or FP8 rows, got {pool}")
        if ctx.fp8_rows and ctx.topk % 64:
            reasons.append(f"FlashMLA's FP8 sparse decode needs topk % 64 == 0, got {ctx.topk}")
        return joined([*reasons, missing("sgl_kernel"), need_sm(cap, "FlashMLA sparse", ((9, 0),))])

    @property
    def q_dtypes(self) -> tuple[torch.dtype, ...]:
        return (self.ctx.dtype,)  # the kernel is built for the context's activations

    def __init__(self, ctx: SparseContext) -> None:
        super().__init__(ctx)
        self._fm = load_kernels()
        from mla_backends.kernels import empty_rows  # triton: only once built

        self._k_empty = empty_rows
        self._hp = padded_heads(self.dims.num_heads)
        self._k = round_up(self.topk, 128)  # the prefill kernel wants topk % 128 == 0
        self._fp8 = isinstance(ctx.pool, Fp8RowPool)
        self._lse_factor = self._prefill_lse_factor()

    # ------------------------------------------------------------------ LSE convention
    def _prefill_lse_factor(self) -> float:
        """1.0 if the prefill kernel's LSE is natural log, ln 2 if base 2: one small call and
        one host read at construction (never on the decode path)."""
        gen = torch.Generator(device=self.device).manual_seed(0)
        q = torch.randn(1, 64, 576, generator=gen, device=self.device).bfloat16()
        kv = torch.randn(128, 1, 576, generator=gen, device=self.device).bfloat16()
        idx = torch.arange(128, dtype=torch.int32, device=self.device).view(1, 1, 128)
        scale = 0.1
        _, _, lse = self._fm.flash_mla_sparse_fwd(q, kv, idx, scale, d_v=512)
        want = torch.logsumexp((q[0].float() @ kv[:, 0].float().T) * scale, dim=-1)
        got = lse.reshape(-1).float()
        if torch.allclose(got, want, atol=1e-2, rtol=0):
            return 1.0
        if torch.allclose(got * math.log(2), want, atol=1e-2, rtol=0):
            return math.log(2)
        raise RuntimeError(
            f"flash_mla_sparse_fwd's LSE is neither natural log nor base 2: got "
            f"{got[:4].tolist()}, natural log {want[:4].tolist()}"
        )

    # ------------------------------------------------------------------ metadata
    def _schedule(self, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Hazard: FlashMLA's FP8 kernels misbehave on requests with no keys; an empty row is
        # given length 1 (it reads a stand-in entry) and set to 0 / -inf afterwards.
        seqlens = valid.clamp(min=1)
        tile, splits = self._fm.get_mla_metadata(
            cache_seqlens=seqlens,
            num_q_tokens_per_head_k=self._hp,
            num_heads_k=1,
            num_heads_q=self._hp,
            is_fp8_kvcache=True,
            topk=self.topk,
        )
        return seqlens, tile, splits

    def _build_metadata(self, batch: ForwardBatch) -> FlashMLASparseMetadata:
        c = self._counts(batch)
        md = FlashMLASparseMetadata(c.valid_cpu, c.valid)
        if not self._fp8:
            return md
        if batch.mode.is_decode_or_verify:
            md.seqlens, md.tile, md.splits = self._schedule(md.valid)
            return md
        total = int(batch.seq_lens_cpu.sum())
        _, slots = build_token_indices(
            self.req_to_token, batch.req_pool_indices, batch.seq_lens, total
        )
        slot_to_row = torch.full((self.pool.num_slots,), -1, dtype=torch.int32, device=self.device)
        slot_to_row[slots.long()] = torch.arange(total, dtype=torch.int32, device=self.device)
        md.extend = (slots, slot_to_row)
        return md

    def _new_graph_state(self, max_bs: int, max_num_tokens: int) -> FlashMLASparseGraphState:
        i32: dict[str, Any] = {"dtype": torch.int32, "device": self.device}
        return FlashMLASparseGraphState(
            torch.zeros(max_num_tokens, **i32),
            torch.ones(max_num_tokens, **i32),
            torch.zeros(max_num_tokens + 1, **i32),
        )

    def _bind_graph(
        self, batch: ForwardBatch, state: SparseGraphState, capture: bool
    ) -> FlashMLASparseMetadata:
        # Hazard (a peer bug): tile metadata depends on the lengths; a stale one degrades the
        # output after some tokens. Recomputed into the static buffers on every replay.
        assert isinstance(state, FlashMLASparseGraphState)
        c = super()._bind_graph(batch, state, capture)
        md = FlashMLASparseMetadata(c.valid_cpu, c.valid)
        if not self._fp8:
            return md
        t = batch.num_tokens
        seqlens, tile, splits = self._schedule(md.valid)
        state.seqlens[:t].copy_(seqlens)
        static = state.tiles.setdefault(t, torch.empty_like(tile))
        static.copy_(tile)
        state.splits[: t + 1].copy_(splits)
        md.seqlens, md.tile, md.splits = state.seqlens[:t], static, state.splits[: t + 1]
        return md

    # ------------------------------------------------------------------ attention
    def _query(self, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        t, h, lat = q_nope.shape
        if h == self._hp:  # no head padding: one copy, or none for a joined buffer
            return joined_query(q_nope, q_rope)
        q = q_nope.new_zeros(t, self._hp, lat + q_rope.shape[-1])
        q[:, :h, :lat] = q_nope
        q[:, :h, lat:] = q_rope
        return q

    def _prefill(
        self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t = q.shape[0]
        if indices.shape[1] != self._k:
            indices = torch.nn.functional.pad(indices, (0, self._k - indices.shape[1]), value=-1)
        out, _, lse = self._fm.flash_mla_sparse_fwd(
            q, kv, indices.view(t, 1, -1), self.scale, d_v=self.dims.kv_lora_rank
        )
        return out, lse * self._lse_factor

    def _attend(
        self, layer: int, q_nope: torch.Tensor, q_rope: torch.Tensor, indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t, h, lat = q_nope.shape
        q = self._query(q_nope, q_rope)
        md = self.metadata
        if not isinstance(md, FlashMLASparseMetadata):
            raise RuntimeError("init_forward_metadata was not called for this batch")
        if not self._fp8:
            kv = self.pool.kv_buffer[layer].view(-1, 1, self.dims.kv_dim)
            out, lse = self._prefill(q, kv, indices)
        elif md.extend is not None:
            slots, slot_to_row = md.extend
            assert isinstance(self.pool, Fp8RowPool)  # self._fp8
            rows = dequant_rows(self.pool.fmt, self.pool.kv_buffer[layer][slots.long()])
            remap = torch.where(indices >= 0, slot_to_row[indices.clamp(min=0).long()], -1)
            out, lse = self._prefill(q, rows.bfloat16().view(-1, 1, self.dims.kv_dim), remap)
        else:
            out, lse = self._fm.flash_mla_with_kvcache(
                q.view(t, 1, self._hp, -1),
                self.pool.get_paged_buffer(layer),
                torch.empty(t, 0, dtype=torch.int32, device=q.device),
                md.seqlens,
                lat,
                md.tile,
                md.splits,
                softmax_scale=self.scale,
                causal=False,
                is_fp8_kvcache=True,
                indices=indices.view(t, 1, -1),
            )
            out, lse = out.view(t, self._hp, lat), lse.reshape(t, self._hp)
        out, lse = out[:, :h].to(q_nope.dtype), lse[:, :h].float()
        self._k_empty.fix_empty_rows(out, lse, indices)  # one launch, writes only empty rows
        return out, lse
