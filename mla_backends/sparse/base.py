"""Sparse MLA attention: the contract every sparse backend implements, its registry, and the
dense/sparse rule.

`forward_sparse(layer, q_nope [T, H, L], q_rope [T, H, R], indices [T, topk] int32, batch)`
-> out [T, H, L] in q's dtype (+ lse [T, H] fp32, natural log). Row t of `indices` holds pool
slots (any order, duplicate-free) and -1 for unused entries; token t attends exactly to the
rows those slots hold. A row with no valid slot gives out 0 and lse -inf. The new latent rows
are stored first (`store_kv`), as the selection may include the token's own slot.
Hazard: every entry must be -1 or a slot of the pool. Nothing checks it on the device (a
check would cost a host sync a call): the `torch` backend raises IndexError on a CPU for a
slot past the pool and reads every negative entry as unused (so it hides a -2 that the
kernels would not), the kernels (ours, FlashMLA's, FlashInfer's) read whatever lies at that
address. The indexer's
top-k writes only slots of the request's table row (`topk_kernel.check_rows`).

Valid counts: an indexer row holds exactly min(topk, pos(t) + 1) valid slots; backends that
plan on the host from counts (`flashinfer_mla`) rely on that and say so
(`exact_counts = True`); the others take any number.

Dense/sparse rule (`runs_dense`): an eager batch in which every query sees at most topk keys
(max seq_len <= topk, from the CPU lengths) runs dense attention: the top-k would select every
visible key, so dense attention is the sparse result, and the indexer's scoring is skipped
(its K is still stored). Otherwise the batch is sparse, and a short request's rows simply hold
all of its visible keys. Captured CUDA graphs always take the sparse path (fixed shapes);
with <= topk keys it equals the dense one.

The class mirrors `backends.base.MLABackend`: declared `caps`, `_machine_reason`, metadata
built once per batch (`_build_metadata`, a `SparseMetadata` dataclass), CUDA-graph state in
one dataclass allocated once (`_new_graph_state`) and refilled in place (`_bind_graph`), through
the same graph hooks (`backends.base.GraphHooks`).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch

from mla_backends.backends.base import Capability, GraphHooks
from mla_backends.backends.context import joined
from mla_backends.backends.registry import lookup_class, registrar
from mla_backends.batch import ForwardBatch
from mla_backends.checks import check_tensor, unit_stride
from mla_backends.config import MLADims
from mla_backends.pool import MLATokenToKVPool, ReqToTokenPool
from mla_backends.sparse.fp8_row import Fp8RowPool

LatentPool = MLATokenToKVPool | Fp8RowPool


@dataclass(frozen=True)
class SparseContext:
    """What every sparse backend is built from."""

    dims: MLADims
    pool: LatentPool
    req_to_token_pool: ReqToTokenPool
    topk: int
    dtype: torch.dtype  # activations (q, out)

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def fp8_rows(self) -> bool:
        return isinstance(self.pool, Fp8RowPool)


def visible_counts_cpu(batch: ForwardBatch) -> torch.Tensor:
    """[T] int32 on the host: keys each query token sees (position + 1), from CPU lengths."""
    pre, ext = batch.extend_prefix_lens_cpu.long(), batch.extend_seq_lens_cpu.long()
    if batch.num_tokens == 0:
        return torch.zeros(0, dtype=torch.int32)
    start = torch.repeat_interleave(pre - torch.cumsum(ext, 0) + ext, ext)
    return (start + torch.arange(batch.num_tokens) + 1).to(torch.int32)


def runs_dense(batch: ForwardBatch, topk: int) -> bool:
    """The dense/sparse rule (module docstring): every query sees <= topk keys."""
    return batch.batch_size == 0 or int(batch.seq_lens_cpu.max()) <= topk


def dense_indices(
    req_to_token: torch.Tensor, batch: ForwardBatch, topk: int, width: int | None = None
) -> torch.Tensor:
    """[T, width or topk] int32: the slots of every key each query sees, -1 after; for
    batches where `runs_dense` holds (a query seeing more than `width` keys is cut)."""
    width = topk if width is None else width
    rows = batch.req_pool_indices.long().repeat_interleave(
        batch.extend_seq_lens.long(), output_size=batch.num_tokens
    )
    pos = torch.arange(width, device=req_to_token.device)
    vis = (batch.positions + 1)[:, None]
    cols = pos[None, :].clamp(max=req_to_token.shape[1] - 1)
    slots = req_to_token[rows[:, None], cols].to(torch.int32)
    return torch.where(pos[None, :] < vis, slots, torch.full_like(slots, -1))


@dataclass(frozen=True)
class SparseCaps:
    """What a sparse backend declares, checked by `supports` before `_machine_reason`."""

    pool_kinds: tuple[str, ...] = ("paged",)  # "paged": MLATokenToKVPool; "fp8_row"
    graphs: bool = True
    # Plans on the host from valid counts: relies on rows holding exactly min(topk, pos + 1)
    # valid slots (what the indexer writes).
    exact_counts: bool = False


@dataclass
class SparseMetadata:
    valid_cpu: torch.Tensor  # [T] int32, host: min(topk, keys visible)
    valid: torch.Tensor  # [T] int32, device: the same


@dataclass
class SparseGraphState:
    valid: torch.Tensor  # [max_num_tokens] int32, device: every capture reads leading rows


class SparseMLABackend(GraphHooks[SparseMetadata, SparseGraphState]):
    name: ClassVar[str]
    caps: ClassVar[SparseCaps] = SparseCaps()
    _no_graph_state: ClassVar[str] = (
        "sparse {name}: CUDA-graph state not allocated; call init_cuda_graph_state"
    )

    def __init__(self, ctx: SparseContext) -> None:
        self.ctx, self.dims, self.pool = ctx, ctx.dims, ctx.pool
        self.req_to_token = ctx.req_to_token_pool.req_to_token
        self.device, self.topk, self.scale = ctx.device, ctx.topk, ctx.dims.softmax_scale
        self.metadata: SparseMetadata | None = None
        self._metadata_for: ForwardBatch | None = None
        self._graph: SparseGraphState | None = None

    @classmethod
    def supports(cls, ctx: SparseContext, cap: Capability) -> str | None:
        """None if this backend runs with `ctx` on `cap`, else every reason, "; " between
        them (`joined`, as `MLABackend.supports`)."""
        kind = "fp8_row" if ctx.fp8_rows else "paged"
        pool = None
        if kind not in cls.caps.pool_kinds:
            pool = f"sparse backend {cls.name} reads pools {cls.caps.pool_kinds}, not {kind!r}"
        return joined([pool, cls._machine_reason(ctx, cap)])

    @classmethod
    def _machine_reason(cls, ctx: SparseContext, cap: Capability) -> str | None:
        """Why this machine (packages, SM version) or context cannot run the kernels: every
        reason (`joined`), or None."""
        return None

    @property
    def supports_graphs(self) -> bool:
        return self.caps.graphs

    # ------------------------------------------------------------------ metadata
    def _counts(self, batch: ForwardBatch) -> SparseMetadata:
        # Both copies built where they live: no host-to-device copy (graph replay syncs never).
        valid_cpu = visible_counts_cpu(batch).clamp(max=self.topk)
        valid = (batch.positions + 1).clamp(max=self.topk).to(torch.int32)
        return SparseMetadata(valid_cpu, valid)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.metadata = self._build_metadata(batch)
        self._metadata_for = batch

    def _build_metadata(self, batch: ForwardBatch) -> SparseMetadata:
        """This batch's metadata, once for every layer."""
        return self._counts(batch)

    # ------------------------------------------------------------------ CUDA graphs
    def _new_graph_state(self, max_bs: int, max_num_tokens: int) -> SparseGraphState:
        """Static buffers for up to `max_num_tokens` query tokens, allocated once."""
        return SparseGraphState(torch.zeros(max_num_tokens, dtype=torch.int32, device=self.device))

    def _bind_graph(
        self, batch: ForwardBatch, state: SparseGraphState, capture: bool
    ) -> SparseMetadata:
        """Metadata over the state's buffers, refilled in place (same pointers every replay)."""
        md, t = self._counts(batch), batch.num_tokens
        state.valid[:t].copy_(md.valid)
        return SparseMetadata(md.valid_cpu, state.valid[:t])

    # ------------------------------------------------------------------ attention
    def store_kv(
        self, layer: int, loc: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor
    ) -> None:
        self.pool.set_mla_kv_buffer(layer, loc, k_nope, k_rope)

    @property
    def q_dtypes(self) -> tuple[torch.dtype, ...]:
        """Query dtypes `forward_sparse` takes: any activation dtype (torch math, Triton
        casts); a vendor kernel built for the context's dtype narrows it (a query of another
        dtype failed inside the kernel's wrapper, naming no argument)."""
        return (torch.float32, torch.bfloat16, torch.float16)

    def forward_sparse(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        indices: torch.Tensor,
        batch: ForwardBatch,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if batch is not self._metadata_for:
            # Hazard: another batch's metadata (the indexer's request rows beside it, a
            # FlashInfer plan, a FlashMLA schedule) attends over its rows: a wrong result.
            raise RuntimeError(
                f"sparse {self.name}: init_forward_metadata was not called for this batch"
            )
        d, t = self.dims, batch.num_tokens
        check_tensor("q_nope", q_nope, (t, d.num_heads, d.kv_lora_rank), self.q_dtypes, self.device)
        check_tensor(
            "q_rope", q_rope, (t, d.num_heads, d.qk_rope_head_dim), q_nope.dtype, self.device
        )
        check_tensor("indices", indices, (t, self.topk), torch.int32, self.device)
        q_nope, q_rope, indices = unit_stride(q_nope), unit_stride(q_rope), unit_stride(indices)
        out, lse = self._attend(layer, q_nope, q_rope, indices)  # LSE is always computed
        return (out, lse) if return_lse else out

    @abstractmethod
    def _attend(
        self, layer: int, q_nope: torch.Tensor, q_rope: torch.Tensor, indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [T, H, L], lse [T, H] fp32, natural log)."""


# ----------------------------------------------------------------------------- registry
_MODULES: dict[str, str] = {
    "flashmla": "mla_backends.sparse.flashmla",
    "flashinfer_mla": "mla_backends.sparse.flashinfer_mla",
    "triton": "mla_backends.sparse.triton_backend",
    "torch": "mla_backends.sparse.torch_backend",
}
_REGISTRY: dict[str, type[SparseMLABackend]] = {}
T = TypeVar("T", bound="type[SparseMLABackend]")


def register_sparse_backend(name: str) -> Callable[[T], T]:
    return registrar(_REGISTRY, "sparse backend", name)


def sparse_backend_names() -> list[str]:
    """Every sparse backend name: the built-in ones (in "auto" order), then those registered
    from outside (a plug-in's backend is checked by `verify` as the built-in ones are)."""
    return [*_MODULES, *(n for n in _REGISTRY if n not in _MODULES)]


def get_sparse_backend_class(name: str) -> type[SparseMLABackend]:
    return lookup_class(_REGISTRY, _MODULES, "sparse backend", name, sparse_backend_names)


class SparseBackendUnavailable(ValueError):
    """The named sparse backend cannot run with this context on this machine."""


def create_sparse_backend(name: str, ctx: SparseContext) -> SparseMLABackend:
    """The named backend ("auto": the first in `_MODULES` order that runs here; on a CPU the
    torch backend, which runs there compiled), or a clear error naming why it cannot run."""
    known = sparse_backend_names()
    if name != "auto" and name not in known:
        # before the registry's own error: the allowed names here include "auto"
        raise ValueError(f"sparse backend {name!r} is unknown; allowed: {['auto', *known]}")
    cap = Capability.detect(ctx.device)
    if name == "auto":
        order = list(_MODULES) if ctx.device.type == "cuda" else ["torch"]
        for n in order:
            if get_sparse_backend_class(n).supports(ctx, cap) is None:
                name = n
                break
        else:
            raise SparseBackendUnavailable(f"no sparse backend can run on {cap.describe()}")
    cls = get_sparse_backend_class(name)
    reason = cls.supports(ctx, cap)
    if reason is not None:
        # as the dense refusal does: what would run instead, so the next try is not a guess
        ok = [n for n in known if get_sparse_backend_class(n).supports(ctx, cap) is None]
        raise SparseBackendUnavailable(
            f"sparse backend {name!r} cannot run here: {reason}. "
            f"Sparse backends that can run with this config on {cap.describe()}: {ok}"
        )
    return cls(ctx)
