"""DeepSeek-V3.2's lightning indexer: its K cache beside the latent pool, its maths in plain
torch (the reference), and the per-layer step (store K; score; top-k; positions -> slots).

Maths (DeepSeek-V3.2-Exp `inference/model.py` Indexer with the upstream NeoX-RoPE fix):
  q = wq_b(q_lora) [T, Hi, D], k = k_norm(wk(x)) [T, D], both with NeoX (half-split) RoPE on
  their first R dims; quantised mode: Hadamard-rotated, rounded to the activation dtype and
  e4m3-quantised with one ue8m0 scale per D values (per token for k, per (token, head) for q);
  w = weights_proj(x) * Hi ** -0.5 * D ** -0.5 * q_scale [T, Hi];
  score[t, s] = k_scale[s] * sum_h w[t, h] * relu(q[t, h] . k[s]), over keys s <= pos(t);
  the top min(topk, pos(t) + 1) keys are selected.
Unquantised mode (`quantized=False`): fp32 throughout, no rotation (it cancels in q . k),
scales 1: HF transformers' `DeepseekV32Indexer`, the CPU oracle of the model maths.

Index semantics: the selection of query token t is an int32 row [topk] of pool slots of its
request's keys (positions < pos(t) + 1), -1 for unused entries, in any order; exactly
min(topk, pos(t) + 1) entries are valid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mla_backends.backends.base import graph_state_sizes
from mla_backends.backends.context import ACT_DTYPES
from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.checks import check_tensor
from mla_backends.config import TOPK_PATHS
from mla_backends.sparse.index_k import (  # re-exported: the indexer's public names
    LOGITS_BUDGET,
    PAGE,
    IndexerDims,
    IndexKCache,
    logits_reference,
    positions_to_slots,
    prepare_k,
    prepare_q,
    rope_neox,
    select_topk,
)

__all__ = [
    "LOGITS_BUDGET",
    "PAGE",
    "Indexer",
    "IndexerDims",
    "IndexerGraphState",
    "IndexerMetadata",
    "IndexKCache",
    "logits_reference",
    "positions_to_slots",
    "prepare_k",
    "prepare_q",
    "rope_neox",
    "select_topk",
    "token_rows",
]

# Tokens a batch up to which the logits kernel counts the keys' first digit for the top-k
# (`index_logits(counts=)`), which then skips its first pass and that pass's wait: 1.0-1.6
# us off a batch-1 step. Past a few tokens the histogram and atomics every 64-key tile then
# adds cost more than the pass: the indexer at B16 128k 179 -> 192 us, B64 128k 600 -> 685
# (H100, twenty-second session, BENCHMARKS.md).
COUNT_TOKENS = 4


# ----------------------------------------------------------------------------- the step
@dataclass
class IndexerMetadata:
    rows: torch.Tensor  # [T] int64, device: request row of each query token
    visible: torch.Tensor  # [T] int32, device: keys the token may see (position + 1)
    width: int  # host: logits columns (the batch's longest context, or the graph maximum)
    chunks: list[tuple[int, int]]  # host: token ranges scored together (memory)
    # host: captured in a CUDA graph, whose width is the longest context the pool takes (the
    # logits then loop over each token's visible blocks: `index_logits(loop=True)`)
    graph: bool = False


def token_rows(batch: ForwardBatch) -> torch.Tensor:
    return batch.req_pool_indices.long().repeat_interleave(
        batch.extend_seq_lens.long(), output_size=batch.num_tokens
    )


@dataclass
class IndexerGraphState:
    rows: torch.Tensor  # [max_num_tokens] int64, device: request row of each token
    visible: torch.Tensor  # [max_num_tokens] int32, device: keys each token sees
    width: int  # host: the longest context a graph may see
    captured: dict[int, IndexerMetadata] = field(default_factory=dict)  # per token count


class Indexer:
    """The indexer as a backend step: `store` (every batch, every layer) and `select` (sparse
    batches). `kernels` = "triton" (GPU, or CPU under TRITON_INTERPRET=1) or "torch"."""

    def __init__(
        self,
        dims: IndexerDims,
        cache: IndexKCache,
        req_to_token: torch.Tensor,
        kernels: str = "auto",
        topk_path: str = "auto",
    ) -> None:
        from mla_backends.backends.kernel_packages import need_triton

        if kernels == "auto":
            kernels = "triton" if need_triton(cache.device.type) is None else "torch"
        if kernels not in ("triton", "torch"):
            raise ValueError(f"indexer kernels must be 'triton' or 'torch', got {kernels!r}")
        unusable = need_triton(cache.device.type) if kernels == "triton" else None
        if unusable is not None:  # else the first store fails inside Triton
            raise ValueError(f"indexer kernels 'triton': {unusable}")
        if topk_path not in TOPK_PATHS:  # the choices of `Config.indexer_topk`
            paths = " or ".join(map(repr, TOPK_PATHS))
            raise ValueError(f"indexer topk_path must be {paths}, got {topk_path!r}")
        self.topk_path = topk_path  # "launches": never the one-launch top-k (topk_fused.py)
        if cache.quantized != dims.quantized or cache.head_dim != dims.head_dim:
            raise ValueError("IndexKCache and IndexerDims disagree on head_dim / quantisation")
        self.dims, self.cache, self.req_to_token, self.kernels = dims, cache, req_to_token, kernels
        self.metadata: IndexerMetadata | None = None
        self._graph: IndexerGraphState | None = None
        self._graph_sizes: tuple[int, int] | None = None

    # ------------------------------------------------------------------ metadata
    def _chunks(self, t: int, width: int, mode: ForwardMode) -> list[tuple[int, int]]:
        # The Triton kernels score decode and verify batches whole (8 bytes a key: the
        # counted first digit and the one-launch top-k take the batch at once). Hazard: the
        # torch path gathers each token's keys as fp32 (over 1 KB a key with its dots): a
        # decode batch of 64 at 128k held gigabytes, and a graph as wide as the pool's context.
        if t == 0 or (self.kernels == "triton" and mode is not ForwardMode.EXTEND):
            return [(0, t)]
        # triton: fp32 logits and, beside them, the top-k launches' int32 candidate list (as
        # wide as the logits); torch, a key's fp32 values: the logits, its gathered key twice
        # (the read's and the masked copy) and its dot with each head
        d = self.dims
        per_key = 2 if self.kernels == "triton" else 2 * d.head_dim + d.n_heads + 1
        per_token = 4 * max(width, 1) * per_key
        step = max(1, LOGITS_BUDGET // per_token)
        return [(s, min(s + step, t)) for s in range(0, t, step)]

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        width = int(batch.seq_lens_cpu.max()) if batch.batch_size else 0
        self.metadata = IndexerMetadata(
            token_rows(batch),
            (batch.positions + 1).to(torch.int32),
            width,
            self._chunks(batch.num_tokens, width, batch.mode),
        )

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """One static state, kept or refused as a backend's is (`graph_state_sizes`)."""
        g = self._graph
        sizes = graph_state_sizes(
            "indexer", self._graph_sizes, bool(g and g.captured), max_bs, max_num_tokens
        )
        if sizes is None:
            return
        max_num_tokens, dev = sizes[1], self.cache.device
        self._graph_sizes = sizes
        self._graph = IndexerGraphState(
            torch.zeros(max_num_tokens, dtype=torch.int64, device=dev),
            torch.ones(max_num_tokens, dtype=torch.int32, device=dev),
            self.req_to_token.shape[1],
        )

    def _graph_state(self) -> IndexerGraphState:
        if self._graph is None:
            raise RuntimeError("indexer: CUDA-graph state not allocated; init_cuda_graph_state")
        return self._graph

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        g, t = self._graph_state(), batch.num_tokens
        if t > g.rows.shape[0]:  # before `captured` keeps views too short for the batch
            raise ValueError(
                f"indexer: batch of {t} tokens exceeds the CUDA-graph state, allocated for "
                f"{g.rows.shape[0]} (init_cuda_graph_state(max_bs, max_num_tokens))"
            )
        chunks = self._chunks(t, g.width, batch.mode)
        md = IndexerMetadata(g.rows[:t], g.visible[:t], g.width, chunks, graph=True)
        g.captured[t] = md
        self._refill(md, batch)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        md = self._graph_state().captured.get(batch.num_tokens)
        if md is None:
            raise RuntimeError(f"indexer: no graph captured for {batch.num_tokens} tokens")
        self._refill(md, batch)

    def _refill(self, md: IndexerMetadata, batch: ForwardBatch) -> None:
        md.rows.copy_(token_rows(batch))
        md.visible.copy_(batch.positions + 1)
        self.metadata = md

    # ------------------------------------------------------------------ per layer
    def _require_metadata(self) -> IndexerMetadata:
        if self.metadata is None:
            raise RuntimeError("indexer: init_forward_metadata was not called for this batch")
        return self.metadata

    def _check_rope(self, cos: torch.Tensor, sin: torch.Tensor, t: int) -> None:
        """cos, sin [T, rope_dim / 2]. Hazard: the kernels take the rotated width from the
        tables, so a narrower table rotated fewer dims than the model's, silently."""
        half = self.dims.rope_dim // 2
        check_tensor("cos", cos, (t, half))
        check_tensor("sin", sin, (t, half))

    def store(
        self, layer: int, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, loc: torch.Tensor
    ) -> None:
        """k = k_norm(wk(x)) [T, D] before RoPE: RoPE, rotation, quantisation, store at loc.
        Hazard: a float `loc` was cast (bf16 rounds slot ids past 256) and the key landed in
        another token's slot; a `loc` longer than k broadcast one key into several."""
        dev = self.cache.device
        check_tensor("k", k, (-1, self.dims.head_dim), ACT_DTYPES, dev)
        check_tensor("loc", loc, (k.shape[0],), (torch.int32, torch.int64), dev)
        self._check_rope(cos, sin, k.shape[0])
        if self.kernels == "triton":
            from mla_backends.sparse.indexer_kernels import store_index_k

            store_index_k(self.cache, layer, k, cos, sin, loc)
            return
        codes, scale = prepare_k(self.dims, k, cos, sin)
        self.cache.write(layer, loc, codes, scale)

    def logits(
        self,
        layer: int,
        q: torch.Tensor,
        w: torch.Tensor,
        start: int,
        end: int,
        early_keys: bool = False,
        counts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Prepared q [T, Hi, D], w [T, Hi] of tokens [start, end) -> [end - start, width]
        fp32, -inf where a key is not visible. `early_keys`: `index_logits`' (safe only when
        the launch just before released this one after its own wait, as in `select`);
        `counts`: `index_logits`' (the Triton kernels only: the top-k's zeroed counters of
        these tokens, which the logits kernel counts into)."""
        md = self._require_metadata()
        rows, vis = md.rows[start:end], md.visible[start:end]
        if self.kernels == "triton":
            from mla_backends.sparse.indexer_kernels import index_logits

            return index_logits(
                self.cache,
                layer,
                q[start:end],
                w[start:end],
                self.req_to_token,
                rows,
                vis,
                md.width,
                loop=md.graph,
                early_keys=early_keys,
                counts=counts,
            )
        pos = torch.arange(md.width, device=q.device)
        slots = self.req_to_token[
            rows[:, None], pos[None, :].clamp(max=self.req_to_token.shape[1] - 1)
        ]
        k, ks = self.cache.read(layer, slots)
        ok = pos[None, :] < vis[:, None]
        # Hazard: keys past a token's context may be stale or NaN; zero them before the dot.
        k = torch.where(ok[..., None], k.float(), torch.zeros((), device=q.device))
        out = logits_reference(q[start:end], w[start:end], k, torch.where(ok, ks, 0.0))
        return out.masked_fill(~ok, float("-inf"))

    def select(
        self,
        layer: int,
        q: torch.Tensor,
        w: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """wq_b(q_lora) [T, Hi, D], weights_proj(x) [T, Hi] -> int32 [T, topk] pool slots."""
        self._check_rope(cos, sin, q.shape[0])
        md = self._require_metadata()
        # Hazard: the kernels size their grids from the batch and read q / w by their
        # strides: a w of fewer heads or tokens was read past its end, and the torch path
        # broadcast one token's query over the batch. Host shapes only (md.rows: [T]).
        t, d, dev = md.rows.shape[0], self.dims, self.cache.device
        check_tensor("q", q, (t, d.n_heads, d.head_dim), ACT_DTYPES, dev)
        check_tensor("w", w, (t, d.n_heads), ACT_DTYPES, dev)
        k, r2t = self.dims.topk, self.req_to_token
        score: Callable[[int, int], torch.Tensor]
        pick: Callable[[torch.Tensor, int, int], torch.Tensor]
        if self.kernels == "triton":
            from mla_backends.sparse.indexer_kernels import prepare_q_fused
            from mla_backends.sparse.topk_kernel import new_counts, topk_slots

            # the top-k's counters zeroed by the q prep: no fill kernel in front of it, and
            # none between the logits and the top-k (it would break their PDL)
            counts = new_counts(q.shape[0], q.device, zeroed=False)
            qp, wp = prepare_q_fused(self.dims, q, w, cos, sin, zero=counts)

            counted = q.shape[0] <= COUNT_TOKENS  # decode at batch 1-4: one chunk

            def score(start: int, end: int) -> torch.Tensor:
                # early_keys: the launch before each logits launch is `prepare_q_fused` or,
                # for a later chunk, the last chunk's top-k; each releases it after its own
                # wait. `counted`: the logits kernel counts the keys' first digit for the
                # top-k, which then skips that pass (`topk_slots(counted=True)`).
                part = counts[start:end] if counted else None
                return self.logits(layer, qp, wp, start, end, True, part)

            def pick(logits: torch.Tensor, start: int, end: int) -> torch.Tensor:
                rows, vis = md.rows[start:end], md.visible[start:end]
                part = counts[start:end]
                return topk_slots(logits, k, r2t, rows, vis, self.topk_path, part, counted)

        else:
            qp, wp = prepare_q(self.dims, q, w, cos, sin)

            def score(start: int, end: int) -> torch.Tensor:
                return self.logits(layer, qp, wp, start, end)

            def pick(logits: torch.Tensor, start: int, end: int) -> torch.Tensor:
                return positions_to_slots(select_topk(logits, k), r2t, md.rows[start:end])

        out = [pick(score(s, e), s, e) for s, e in md.chunks]
        return out[0] if len(out) == 1 else torch.cat(out)
