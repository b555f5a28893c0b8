"""`DCPBackend`: any suite backend in its decode-context-parallel form.

Every rank holds a token-interleaved share of each request's KV (`layout.py`) and runs the
wrapped backend over its own pool. A query token at global visibility V (it may see global
positions < V; V = seq_len - q_len + j + 1, bottom-right) sees on rank r the first
`local(V, r)` rows of the rank's local sequence. Each rank returns (out_r, lse_r) for every
query row; the ranks' partials are merged by log-sum-exp (`merge_states`, in `comm.py`).

Per-rank batches handed to the wrapped backend:
- DECODE and TARGET_VERIFY: one DECODE row per query token (request row repeated, seq_len
  its local visible count). Exact for every backend, since each implements the bottom-right
  rule at q_len 1, and built by device ops of static shape from the global lengths, so it
  refills graph buffers without a host sync.
- EXTEND: per request, its query tokens grouped by j mod N. Within a group consecutive
  queries are N positions apart, so their local visible counts rise by exactly one: each
  group is one ordinary bottom-right EXTEND row (q_len m, kv_len the last query's count).
  One token per group may see nothing on this rank (V <= r); it is left out (out 0, lse
  -inf). This reads each local row about N times per request instead of once per query
  token (a chunk of 8k tokens over a long prefix would read it 8k times as decode rows).
  Built on the host from the CPU lengths (EXTEND is never graph-captured).

Heads: "replicated" (every rank holds all H query heads; out and lse are all-gathered and
merged, every rank gets the whole result) or "tp" (a tensor-parallel group, each rank holds
H / N heads: q is all-gathered over heads before attention, and an all-to-all sends each
rank the partials of its own heads, which it merges: the reduce-scatter pattern).
MHA-mode prefill attends the new tokens' own k / v (not the pool), which every rank has:
it runs on each rank without communication. The latent rows are stored by their owners.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mla_backends.backends.base import BackendContext, GraphCapable, MLABackend
from mla_backends.backends.dispatch import DispatchBackend
from mla_backends.backends.paged_table import QueryQuantizer
from mla_backends.batch import ForwardBatch, ForwardMode, RaggedLayout
from mla_backends.dcp.comm import DCPGroup, merge_partials
from mla_backends.dcp.layout import DCPLayout
from mla_backends.dcp.metadata import (
    DCPGraphState,
    DCPMetadata,
    extend_metadata,
    rows_metadata,
)
from mla_backends.indices import build_token_indices

HEAD_MODES = ("replicated", "tp")


def attending(backend: MLABackend[Any] | DispatchBackend) -> tuple[MLABackend[Any], ...]:
    """The backends that attend for `backend`: a `DispatchBackend`'s (prefill, decode), which
    share one pool and dims, else the backend itself."""
    if isinstance(backend, DispatchBackend):
        return (backend.prefill, backend.decode)
    return (backend,)


class DCPBackend(GraphCapable[DCPMetadata, DCPGraphState]):
    """`inner` is a suite backend over this rank's pool with all H heads; `mha` serves
    MHA-mode prefill (in "tp" mode, a backend with this rank's H / N heads)."""

    name = "dcp"

    def __init__(
        self,
        inner: MLABackend[Any] | DispatchBackend,
        group: DCPGroup,
        heads: str = "replicated",
        mha: MLABackend[Any] | DispatchBackend | None = None,
        global_lens: np.ndarray | None = None,
    ) -> None:
        """`global_lens`: every request row's global length (`DCPTokenAllocator.filled`),
        which batches are checked against."""
        if heads not in HEAD_MODES:
            raise ValueError(f"DCP heads={heads!r} is not one of {HEAD_MODES}")
        sides = attending(inner)
        for side in sides:
            if not side.caps.lse:
                raise ValueError(f"DCP merges by LSE; backend {side.name!r} returns none")
        base = sides[-1]  # dims and context (a DispatchBackend's sides share them)
        h = base.dims.num_heads
        if heads == "tp" and h % group.size:
            raise ValueError(f"DCP heads='tp': {h} heads do not split over {group.size} ranks")
        ctx = base.ctx
        if heads == "tp":
            dims = base.dims.with_heads(h // group.size)
            ctx = BackendContext(
                dataclasses.replace(ctx.config, model=dims), ctx.kv_pool, ctx.req_to_token_pool
            )
        super().__init__(ctx)
        self.inner, self.comm, self.heads = inner, group, heads
        self.global_lens = global_lens
        self.mha = inner if mha is None else mha
        mha_heads = attending(self.mha)[0].dims.num_heads
        if mha_heads != self.dims.num_heads:
            raise ValueError(
                f"DCP MHA backend has {mha_heads} heads, this rank {self.dims.num_heads}"
            )
        self.layout = DCPLayout(group.rank, group.size)

    @property
    def supports_graphs(self) -> bool:
        return self.inner.supports_graphs

    @property
    def cuda_graph_seq_len_fill_value(self) -> int:
        # N x the inner fill: a padded decode row then gives every rank the inner fill.
        return self.layout.size * self.inner.cuda_graph_seq_len_fill_value

    # `paged_table.QueryQuantizer`, passed through: references check a kernel that takes q in
    # FP8 against the query it really attends with.
    @property
    def quantizes_query(self) -> bool:
        dec = attending(self.inner)[-1]
        return isinstance(dec, QueryQuantizer) and dec.quantizes_query

    def effective_query(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dec = attending(self.inner)[-1]
        if isinstance(dec, QueryQuantizer):
            return dec.effective_query(q_nope, q_rope)
        return q_nope, q_rope

    def check_batch(self, batch: ForwardBatch) -> None:
        """Rows allocated and every row's global length stored, then this rank's share of it:
        the batch's lengths are global, this rank's pool holds its token-interleaved share.
        Hazard: a share alone does not tell lengths apart (rank 0 holds 2 of 3 tokens and of
        4), so a wrong length was refused on some ranks and taken on others, which then
        waited in the merge's collective for ever; the global lengths refuse it on all."""
        if batch is self._checked_batch:
            return
        table, lay = self.ctx.req_to_token_pool, self.layout
        if self.global_lens is not None:
            table.check_batch(batch, self.global_lens)
        rows_cpu = batch.req_pool_indices_cpu
        if rows_cpu is None or rows_cpu.numel() == 0:
            # Hazard: a batch without CPU rows had only its shares checked, and a global length
            # just past the group's width is past rank 0's share alone (refused there, taken
            # on the others, which then wait in the merge's collective for ever)
            width = table.max_context_len
            group = f"{lay.size} ranks x {width} table columns"
            table.check_seq_lens(batch, lay.size * width, group)
        share = dataclasses.replace(
            batch,
            seq_lens_cpu=lay.local_lens(batch.seq_lens_cpu),
            extend_prefix_lens_cpu=lay.local_lens(batch.extend_prefix_lens_cpu),
        )
        table.check_batch(share)
        self._checked_batch = batch

    # ------------------------------------------------------------------ metadata
    def _build_metadata(self, batch: ForwardBatch) -> DCPMetadata | None:
        if batch.batch_size == 0:
            return None
        if batch.mode is ForwardMode.EXTEND:
            md = extend_metadata(self.layout, batch)
        else:
            md = rows_metadata(self.layout, batch, None)
        if md.local.batch_size:
            self.inner.init_forward_metadata(md.local)
        return md

    # ------------------------------------------------------------------ attention
    def store_kv(
        self, layer: int, loc: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor
    ) -> None:
        """Tokens other ranks own come with slot 0 (the dummy page): stored there, never read."""
        self.inner.store_kv(layer, loc, k_nope, k_rope)

    def _attend_absorbed(
        self, layer: int, q_nope: Tensor, q_rope: Tensor, batch: ForwardBatch, need_lse: bool
    ) -> tuple[Tensor, Tensor | None]:
        md = self.metadata
        lat = self.dims.kv_lora_rank
        if md is None:
            if batch.batch_size == 0:  # every rank runs the same (empty) batch: no collective
                t, h = q_nope.shape[:2]
                empty = torch.empty(t, h, dtype=torch.float32, device=q_nope.device)
                return q_nope.new_empty(t, h, lat), empty
            raise RuntimeError("init_forward_metadata was not called for this batch")
        if self.heads == "tp":  # one all-gather for both parts, q_nope / q_rope stay views
            q = self.comm.gather_heads(torch.cat([q_nope, q_rope], dim=-1))
            q_nope, q_rope = q[..., :lat], q[..., lat:]
        t, h = q_nope.shape[:2]
        if md.perm is None:
            out, lse = self.inner.forward_absorbed(
                layer, q_nope, q_rope, None, None, md.local, return_lse=True
            )
        else:
            out = torch.zeros(t, h, lat, dtype=q_nope.dtype, device=q_nope.device)
            lse = torch.full((t, h), float("-inf"), dtype=torch.float32, device=q_nope.device)
            if md.local.batch_size:
                o, s = self.inner.forward_absorbed(
                    layer, q_nope[md.perm], q_rope[md.perm], None, None, md.local, True
                )
                out[md.perm], lse[md.perm] = o, s
        if self.heads == "tp":
            out_k, lse_k = self.comm.scatter_heads(out), self.comm.scatter_heads(lse)
        else:
            out_k, lse_k = self.comm.all_gather(out), self.comm.all_gather(lse)
        return merge_partials(out_k, lse_k, md.valid)

    def _attend_mha(
        self, q: Tensor, k: Tensor, v: Tensor, layout: RaggedLayout, causal: bool, need_lse: bool
    ) -> tuple[Tensor, Tensor | None]:
        """MHA-mode prefill over the new tokens' own k / v: on every rank, no communication."""
        if need_lse:
            return self.mha.forward_mha(q, k, v, layout, causal, True)
        return self.mha.forward_mha(q, k, v, layout, causal), None

    def load_prefix(self, layer: int, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cached prefix of every request (chunked-prefix MHA prefill), assembled
        on every rank from all ranks' shares: one all-gather, padded to rank 0's share (the
        largest). Transient: each rank holds the whole prefix for the duration of the layer."""
        lay, dev = self.layout, batch.seq_lens.device
        pre = batch.extend_prefix_lens_cpu.tolist()
        shares = [[lay.local_len(p, k) for p in pre] for k in range(lay.size)]
        width = sum(shares[0])
        _, slots = build_token_indices(
            self.req_to_token,
            batch.req_pool_indices,
            lay.local_lens(batch.extend_prefix_lens),
            sum(shares[lay.rank]),
        )
        mine = torch.zeros(width, self.dims.kv_dim, dtype=torch.float32, device=dev)
        mine[: slots.numel()] = self.pool.load_rows(layer, slots)
        every = self.comm.all_gather(mine).reshape(lay.size * width, -1)
        # Global prefix position i of a request: rank i % N, local index i // N, after the
        # shares of the requests before it in that rank's block.
        parts, off = [], torch.zeros(lay.size, dtype=torch.int64)
        for b, p in enumerate(pre):
            i = torch.arange(p)
            k = i % lay.size
            parts.append(k * width + off[k] + i // lay.size)
            off += torch.tensor([shares[k][b] for k in range(lay.size)])
        index = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        rows = every[index.to(dev)]
        lat = self.dims.kv_lora_rank
        return rows[:, :lat], rows[:, lat:]

    # ------------------------------------------------------------------ CUDA graphs
    def _new_graph_state(self, max_bs: int, max_num_tokens: int) -> DCPGraphState:
        # One local row per query token: the wrapped backend's largest batch is max_t.
        self.inner.init_cuda_graph_state(max_num_tokens, max_num_tokens)
        return DCPGraphState.allocate(self.layout.size, max_num_tokens, self.device)

    def _bind_graph(self, batch: ForwardBatch, state: DCPGraphState, capture: bool) -> DCPMetadata:
        md = rows_metadata(self.layout, batch, state)
        if capture:
            self.inner.init_forward_metadata_capture(md.local)
        else:
            self.inner.init_forward_metadata_replay(md.local)
        md.inner = self.inner.metadata
        return md
