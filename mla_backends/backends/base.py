"""The backend contract for MLA kernels (the verbs themselves: `protocol.AttentionBackend`).

The verbs:
- `init_forward_metadata(batch)` once per forward batch; every layer reuses what it built;
- per layer: `forward_absorbed` (decode, target-verify, extend over a cached prefix),
  `forward_mha` (MHA-mode prefill), `store_kv` (the latent rows of an MHA-mode prefill) and
  `load_prefix` (a chunked prefill's cached prefix);
- CUDA graphs: `init_cuda_graph_state(max_bs, max_num_tokens)` allocates static buffers once,
  `init_forward_metadata_capture(batch)` binds slices of them, `init_forward_metadata_replay(
  batch)` refills them in place; padded rows carry `cuda_graph_seq_len_fill_value`;
- request lifecycle: `reset_requests(rows)`, `accept(num_accepted)` (no-ops for MLA: the pool
  and allocator hold everything; hybrid models keep recurrent state).

`MLABackend` implements the verbs once (validation, the batch check, the store) and leaves
each kernel library three hooks: `_build_metadata`, `_attend_absorbed` (which applies the
empty-row contract, `util.mask_empty_rows`, unless its kernel keeps it) and, for MHA-mode
prefill, `_attend_mha`. `GraphCapable` adds the graph hooks over one
graph-state dataclass per backend. docs/NEW_BACKEND.md lists what an author writes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Generic, TypeVar

import torch
from torch import Tensor

from mla_backends.backends.context import (  # re-exported: backends import them from here
    ACT_DTYPES,
    BackendCaps,
    BackendContext,
    Capability,
    joined,
)
from mla_backends.batch import ForwardBatch, RaggedLayout
from mla_backends.checks import check_tensor, unit_stride
from mla_backends.config import Config
from mla_backends.pool import MLATokenToKVPool

M = TypeVar("M")  # a backend's metadata dataclass
S = TypeVar("S")  # a backend's CUDA-graph state dataclass


class MLABackend(ABC, Generic[M]):
    """One MLA attention backend over the paged latent pool.

    Subclasses declare `name` and `caps`, may refuse a machine in `_machine_reason`, and
    implement `_build_metadata` (per batch, once) and `_attend_absorbed` (and `_attend_mha`
    for MHA-mode prefill). Validation, the batch check and the store happen here, once."""

    name: ClassVar[str]
    caps: ClassVar[BackendCaps] = BackendCaps()

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        self.dims = ctx.dims
        self.pool = ctx.kv_pool
        self.req_to_token = ctx.req_to_token_pool.req_to_token
        self.device = ctx.device
        self.scale = ctx.dims.softmax_scale
        self.metadata: M | None = None
        self._checked_batch: ForwardBatch | None = None
        self._metadata_for: ForwardBatch | None = None  # the batch `metadata` was built for

    # ------------------------------------------------------------------ capability
    @classmethod
    def supports(cls, config: Config, cap: Capability, role: str | None) -> str | None:
        """None if this backend can serve `role` for `config` on `cap`, else every reason, "; "
        between them (role None: every check but the role's). Hazard: one reason at a time sent
        a user to fix the page size first and only then told them the machine cannot run it."""
        c = cls.caps
        if role is not None and role not in c.roles:
            return f"{cls.name} has no {role} path (it serves: {', '.join(c.roles)})"
        pages = None
        if config.page_size not in c.page_sizes:
            pages = f"{cls.name} needs page_size in {c.page_sizes}, config has {config.page_size}"
        return joined([pages, *cls._dtype_reasons(config), cls._machine_reason(config, cap)])

    @classmethod
    def _dtype_reasons(cls, config: Config) -> list[str]:
        """Why `caps` refuse the KV dtype (and, under `same_dtype`, the activation dtype), one
        reason per wrong setting. Hazard: an FP8 kv_dtype was refused twice over, outside
        kv_dtypes and as a q / KV mismatch: one cause stated as two."""
        c, kv, act = cls.caps, config.kv_dtype, config.dtype
        reasons = []
        if kv not in c.kv_dtypes:
            one = c.same_dtype and act in c.kv_dtypes
            hint = f" (q and KV in one dtype: dtype is {act!r})" if one else ""
            reasons.append(f"{cls.name} needs kv_dtype in {c.kv_dtypes}, config has {kv!r}{hint}")
        if not c.same_dtype:
            return reasons
        if act not in c.kv_dtypes:  # the KV dtypes are then the only activation dtypes
            reasons.append(
                f"{cls.name} takes {'/'.join(c.kv_dtypes)} activations, config dtype is {act} "
                "(q and KV in one dtype)"
            )
        elif kv in c.kv_dtypes and kv != act:
            # Hazard: "float16 / bfloat16" named neither key; the user typed `dtype`, `kv_dtype`
            reasons.append(
                f"{cls.name} needs q and KV in one dtype: config dtype is {act}, kv_dtype is {kv}"
            )
        return reasons

    @classmethod
    def _machine_reason(cls, config: Config, cap: Capability) -> str | None:
        """Why this machine (packages, SM version) or config cannot run the kernels, every
        reason through `joined`, or None."""
        return None

    @property
    def supports_graphs(self) -> bool:
        return self.caps.graphs

    @property
    def q_dtypes(self) -> tuple[torch.dtype, ...]:
        """Query dtypes `forward_absorbed` takes: any activation dtype here (torch math, Triton
        casts); a vendor kernel built for one (`config.torch_dtype`) narrows it."""
        return ACT_DTYPES

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Check the batch against the request table, then build everything the attention
        calls of this batch need, once (`_build_metadata`)."""
        self.check_batch(batch)
        self.metadata = self._build_metadata(batch)
        self._metadata_for = batch

    @abstractmethod
    def _build_metadata(self, batch: ForwardBatch) -> M | None:
        """This batch's metadata; None when the backend needs none for it."""

    def check_batch(self, batch: ForwardBatch) -> None:
        """RequestRowError if the batch names a request row never allocated or reads more or
        fewer tokens than a row stored (`ReqToTokenPool.check_batch`): an index past the
        stored tokens reads stale or dummy slots, a short prefix the wrong positions. Once
        per batch object, host only."""
        if batch is not self._checked_batch:
            self.ctx.req_to_token_pool.check_batch(batch)
            self._checked_batch = batch

    def _require_metadata(self) -> M:
        if self.metadata is None:
            raise RuntimeError(f"{self.name}: init_forward_metadata was not called for this batch")
        return self.metadata

    # ------------------------------------------------------------------ attention
    def forward_absorbed(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        k_nope: torch.Tensor | None,
        k_rope: torch.Tensor | None,
        batch: ForwardBatch,
        return_lse: bool = False,
    ) -> Any:  # precise types: AttentionBackend's overloads
        """Absorbed latent attention (decode, target-verify, extend over a cached prefix).

        q_nope [T, H, L] (already multiplied by w_kc), q_rope [T, H, R]; the new rows
        k_nope [T, L], k_rope [T, R] are stored at `batch.out_cache_loc` first (pass None if
        they are stored already). Returns out [T, H, L] in q's dtype, and lse [T, H] fp32
        (natural log) if asked."""
        layer = self.pool.check_layer(layer)
        self.pool.warn_if_uncalibrated(layer)
        self.check_batch(batch)
        if batch is not self._metadata_for:
            # Hazard: metadata of another batch attends over its rows, lengths and slots:
            # a wrong result, or a shape error after the new rows were stored
            raise RuntimeError(
                f"{self.name}: init_forward_metadata was not called for this batch"
                + ("" if self._metadata_for is None else " (the metadata is another batch's)")
                + "; call it once per batch, before the batch's attention calls"
            )
        d, t = self.dims, batch.num_tokens
        check_tensor("q_nope", q_nope, (t, d.num_heads, d.kv_lora_rank), self.q_dtypes, self.device)
        check_tensor(
            "q_rope", q_rope, (t, d.num_heads, d.qk_rope_head_dim), q_nope.dtype, self.device
        )
        if return_lse and not self.caps.lse:
            raise NotImplementedError(f"backend {self.name!r} returns no LSE")
        if (k_nope is None) != (k_rope is None):
            raise ValueError("k_nope and k_rope must both be given or both be None")
        q_nope, q_rope = unit_stride(q_nope), unit_stride(q_rope)
        if k_nope is not None and k_rope is not None:
            self.store_kv(layer, batch.out_cache_loc, unit_stride(k_nope), unit_stride(k_rope))
        out, lse = self._attend_absorbed(layer, q_nope, q_rope, batch, return_lse)
        return self._result(out, lse, return_lse)

    @abstractmethod
    def _attend_absorbed(
        self, layer: int, q_nope: Tensor, q_rope: Tensor, batch: ForwardBatch, need_lse: bool
    ) -> tuple[Tensor, Tensor | None]:
        """(out [T, H, L], lse [T, H] fp32 or None) over the cached rows, bottom-right causal;
        rows of requests with no keys give out 0 / lse -inf (`util.mask_empty_rows`)."""

    def forward_mha(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: RaggedLayout,
        causal: bool = True,
        return_lse: bool = False,
    ) -> Any:  # precise types: AttentionBackend's overloads
        """MHA-mode prefill over ragged requests: q [Tq, H, P+R], k [Tk, H, P+R], v [Tk, H, V]
        -> out [Tq, H, V] (and lse [Tq, H] fp32, natural log). Causal is bottom-right; rows
        of requests with no keys give out 0 / lse -inf."""
        d = self.dims
        h, dqk = d.num_heads, d.qk_head_dim
        check_tensor("q", q, (layout.num_q, h, dqk), ACT_DTYPES, self.device)
        check_tensor("k", k, (layout.num_kv, h, dqk), q.dtype, self.device)
        check_tensor("v", v, (layout.num_kv, h, d.v_head_dim), q.dtype, self.device)
        q, k, v = unit_stride(q), unit_stride(k), unit_stride(v)
        out, lse = self._attend_mha(q, k, v, layout, causal, return_lse)
        return self._result(out, lse, return_lse)

    def _result(self, out: Tensor, lse: Tensor | None, return_lse: bool) -> Any:
        """`out`, or (out, lse) when asked. Hazard: (out, None) passed the parity matrix and
        `verify` (no LSE, nothing to compare) for a backend that declares `caps.lse`; DCP's
        merge then read None."""
        if not return_lse:
            return out
        if lse is None:
            raise RuntimeError(f"backend {self.name!r} returned no LSE although it was asked")
        return out, lse

    def _attend_mha(
        self, q: Tensor, k: Tensor, v: Tensor, layout: RaggedLayout, causal: bool, need_lse: bool
    ) -> tuple[Tensor, Tensor | None]:
        """(out [Tq, H, V], lse [Tq, H] fp32 or None when not `need_lse`)."""
        raise NotImplementedError(
            f"backend {self.name!r} has no MHA-mode prefill; set prefill_backend to one that has"
        )

    def store_kv(
        self, layer: int, loc: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor
    ) -> None:
        """Write the new latent rows; backends with a fused store kernel override this."""
        self.pool.set_mla_kv_buffer(layer, loc, k_nope, k_rope)

    def load_prefix(self, layer: int, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached prefix of every request of an EXTEND batch, dequantized: latent [N, L]
        and k_rope [N, R] fp32, in `batch.prefix_layout`'s kv order (chunked-prefix MHA
        prefill expands them through kv_b_proj). Slots are built once per batch."""
        layer = self.pool.check_layer(layer)
        self.check_batch(batch)
        rows = self.pool.load_rows(layer, batch.prefix_slots(self.req_to_token))
        lat = self.dims.kv_lora_rank
        return rows[:, :lat], rows[:, lat:]

    # ------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        raise NotImplementedError(f"backend {self.name!r} does not support CUDA graphs")

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        raise NotImplementedError(f"backend {self.name!r} does not support CUDA graphs")

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        raise NotImplementedError(f"backend {self.name!r} does not support CUDA graphs")

    def graph_refill_on_device(self, batch_size: int) -> bool:
        """True where `init_forward_metadata_replay` for this captured size is device work
        only (no host lengths, no host-to-device copy of host values): an engine may then
        record the refill inside its decode graph (SGLang's `init_forward_metadata_in_graph`)
        instead of paying its launches on the host before every replay. Hazard: a refill that
        reads `seq_lens_cpu` would bake the capture batch's lengths into the graph."""
        return False

    @property
    def cuda_graph_seq_len_fill_value(self) -> int:
        """seq_len of a padded decode graph row (request row 0, dummy page); a padded row of
        q_len queries carries fill + q_len - 1, so each query sees at least fill keys."""
        return 1

    # ------------------------------------------------------------------ requests
    def reset_requests(self, rows: Sequence[int]) -> None:
        """New requests: nothing to reset (their KV lives in pages the allocator hands out)."""

    def accept(self, num_accepted: torch.Tensor) -> None:
        """After TARGET_VERIFY: nothing to keep (the engine truncates rejected KV slots)."""


def graph_state_sizes(
    name: str, have: tuple[int, int] | None, captured: bool, max_bs: int, max_num_tokens: int
) -> tuple[int, int] | None:
    """The (max_bs, max_num_tokens) to allocate one static CUDA-graph state for, or None when
    the state sized `have` covers the request and is kept. Hazard: a second runner (verify
    beside decode) must not replace buffers a captured graph reads: a larger state is
    allocated only before any capture (covering both runners), and refused after one."""
    if max_bs < 1 or max_num_tokens < 1:
        raise ValueError(
            f"{name}: CUDA-graph state needs max_bs and max_num_tokens >= 1, "
            f"got {max_bs} / {max_num_tokens}"
        )
    if have is None:
        return max_bs, max_num_tokens
    if max_bs <= have[0] and max_num_tokens <= have[1]:
        return None
    if captured:
        raise RuntimeError(
            f"{name}: CUDA-graph state for {have[0]} requests / {have[1]} tokens is already "
            f"captured; {max_bs} / {max_num_tokens} would replace its buffers under the "
            "captured graphs: build every runner before capturing"
        )
    return max(max_bs, have[0]), max(max_num_tokens, have[1])


class GraphHooks(ABC, Generic[M, S]):
    """CUDA-graph hooks over one static-state dataclass `S`, allocated once for the largest
    batch (`_new_graph_state`). Capture binds slices of it (`_bind_graph`, capture=True);
    replay refills the same buffers in place (capture=False): pointers never move."""

    name: ClassVar[str]
    metadata: M | None
    _metadata_for: ForwardBatch | None
    _graph: S | None
    _graph_sizes: tuple[int, int] | None = None  # (max_bs, max_num_tokens) of `_graph`
    _graph_captured: bool = False  # a graph was captured over `_graph`'s buffers
    # The error when a graph hook runs before `init_cuda_graph_state` ({name}: the backend's).
    _no_graph_state: ClassVar[str] = (
        "{name}: CUDA-graph state not allocated; call init_cuda_graph_state first"
    )

    @abstractmethod
    def _new_graph_state(self, max_bs: int, max_num_tokens: int) -> S:
        """Static buffers for batches up to `max_bs` requests / `max_num_tokens` tokens."""

    @abstractmethod
    def _bind_graph(self, batch: ForwardBatch, state: S, capture: bool) -> M:
        """Metadata over `state`'s buffers for `batch` (a static batch of the graph runner):
        at capture, the views the graph will read; at replay, the same views refilled."""

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        sizes = graph_state_sizes(
            self.name, self._graph_sizes, self._graph_captured, max_bs, max_num_tokens
        )
        if sizes is not None:
            self._graph = self._new_graph_state(*sizes)
            self._graph_sizes = sizes

    @property
    def graph_state(self) -> S:
        if self._graph is None:
            raise RuntimeError(self._no_graph_state.format(name=self.name))
        return self._graph

    def _sized_graph_state(self, batch: ForwardBatch) -> S:
        """`graph_state` if `batch` fits the sizes it was allocated for, else one clear error.
        Hazard: a larger batch sliced the static buffers short (a shape error deep in a
        copy), and the GPU index builder wrote page ids past the static table. Host only."""
        state = self.graph_state
        sizes = self._graph_sizes
        if sizes is not None and (batch.batch_size > sizes[0] or batch.num_tokens > sizes[1]):
            raise ValueError(
                f"{self.name}: batch of {batch.batch_size} requests / {batch.num_tokens} tokens "
                f"exceeds the CUDA-graph state, allocated for {sizes[0]} / {sizes[1]} "
                "(init_cuda_graph_state(max_bs, max_num_tokens))"
            )
        return state

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self.metadata = self._bind_graph(batch, self._sized_graph_state(batch), capture=True)
        self._metadata_for = batch
        self._graph_captured = True
        # Hazard: captured kernels may hold the FP8 scale as a host float: a later set_scale
        # would reach eager calls and stores but not the replays. The pool refuses it now.
        pool = getattr(self, "pool", None)  # MLA and sparse backends over a latent pool
        if isinstance(pool, MLATokenToKVPool):
            pool.freeze_scales(self.name)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        self.metadata = self._bind_graph(batch, self._sized_graph_state(batch), capture=False)
        self._metadata_for = batch


class GraphCapable(GraphHooks[M, S], MLABackend[M]):
    """An `MLABackend` with the CUDA-graph hooks of `GraphHooks`."""

    caps: ClassVar[BackendCaps] = BackendCaps(graphs=True)

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self._graph: S | None = None
