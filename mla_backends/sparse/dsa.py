"""DeepSeek Sparse Attention as one object a model calls: the dense MLA backend (batches the
dense/sparse rule sends dense, MHA-mode prefill among them), the lightning indexer and a sparse
backend, with metadata and CUDA-graph hooks forwarded to each once per batch.

Latent storage is either the standard pool (the dense backend and every sparse backend read
it) or the FP8 row pool (`fp8_row`, for FlashMLA's FP8 sparse decode). No dense backend reads
FP8 rows, so with them a dense batch runs the sparse backend over all visible keys
(`base.dense_indices`), which is the same attention.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mla_backends.backends.protocol import AttentionBackend
from mla_backends.batch import ForwardBatch
from mla_backends.runtime import Runtime
from mla_backends.sparse.base import (
    LatentPool,
    SparseContext,
    SparseMLABackend,
    create_sparse_backend,
    dense_indices,
    runs_dense,
)
from mla_backends.sparse.fp8_row import Fp8RowPool
from mla_backends.sparse.indexer import PAGE, Indexer, IndexerDims, IndexKCache


def _latent_pool(backend: AttentionBackend) -> object | None:
    """The latent pool a backend stores into (a dispatch backend's two sides share one), or
    None where it does not say."""
    return getattr(getattr(backend, "decode", backend), "pool", None)


class DSABackend:
    """The `AttentionBackend` of a DeepSeek-V3.2 model: the dense verbs go to the dense
    backend (dense batches, MHA-mode prefill); a sparse layer reaches `indexer` and `sparse`
    itself (`models/deepseek_v32.py`)."""

    def __init__(
        self,
        dense: AttentionBackend | None,
        indexer: Indexer,
        sparse: SparseMLABackend,
        overlap_indexer: bool = True,
    ) -> None:
        self.dense, self.indexer, self.sparse = dense, indexer, sparse
        self.topk = indexer.dims.topk
        if sparse.topk != self.topk:
            raise ValueError(f"indexer topk {self.topk} != sparse backend topk {sparse.topk}")
        # Hazard: index keys past a smaller cache were stored at the dummy slot (silently)
        # and read past its end; another request table selects another request's slots.
        cache, pool = indexer.cache, sparse.pool
        slots, layers = cache.num_blocks * PAGE, len(cache.buffers)
        if slots < pool.num_slots or layers < pool.num_layers:
            raise ValueError(
                f"the index-K cache holds {slots} slots x {layers} layers, the latent pool "
                f"{pool.num_slots} x {pool.num_layers}: size it by the pool (DSABackend.build)"
            )
        a, b = indexer.req_to_token, sparse.req_to_token
        if a.data_ptr() != b.data_ptr() or a.shape != b.shape:
            raise ValueError("the indexer and the sparse backend read different request tables")
        # Hazard: dense batches store rows through the dense backend's pool, sparse ones read
        # the sparse backend's: over two pools a request that grew past top-k attended over
        # empty rows where its dense-phase tokens should be, silently (helper 68's review)
        if dense is not None and isinstance(pool, Fp8RowPool):
            raise ValueError(
                "DSABackend: the sparse backend reads FP8 rows, which no dense backend stores; "
                "leave dense None (short requests then run on the sparse backend)"
            )
        if dense is not None and _latent_pool(dense) not in (None, pool):
            raise ValueError(
                "DSABackend: the dense backend stores into another latent pool than the "
                "sparse backend reads; build both over the runtime's pool (DSABackend.build)"
            )
        self._dense_batch = False
        # FP8 rows' dense batches: every visible key's slot per query token, built once per
        # batch (`init_forward_metadata`) for every layer, and the batch it was built for
        self._dense_slots: tuple[ForwardBatch, torch.Tensor] | None = None
        # The indexer's own stream on a GPU (`begin_select`), None: it runs inline.
        dev = indexer.cache.device
        self.side: torch.cuda.Stream | None = None
        if overlap_indexer and dev.type == "cuda":
            self.side = torch.cuda.Stream(dev)

    @classmethod
    def build(
        cls,
        runtime: Runtime,
        indexer_dims: IndexerDims,
        sparse_backend: str | type[SparseMLABackend],
        fp8_rows: bool = False,
        indexer_kernels: str = "auto",
        dense: AttentionBackend | None = None,
        topk_path: str = "auto",
        overlap_indexer: bool = True,
    ) -> DSABackend:
        """Index-K cache over the runtime pool's slots, the indexer and the sparse backend;
        with `fp8_rows` the latent rows live in an FP8 row pool of the same slot space
        (hazard: the runtime's own pool stays allocated beside it, unread: 1,152 bytes a slot
        a layer at bf16 on top of the rows' 656; a `float8_e4m3fn` runtime pool halves that).
        `dense`: the dense batches' backend (default: the runtime's; none with `fp8_rows`).
        `topk_path`: the indexer's top-k, "auto" or "launches" (`Config.indexer_topk`).
        `overlap_indexer`: on a GPU the indexer runs on its own stream beside the layer's
        projections (`begin_select`)."""
        if fp8_rows and dense is not None:
            # the dense backends read the runtime's pool, which FP8 rows leave empty
            raise ValueError(
                "DSABackend.build: fp8_rows=True keeps the latent rows in their own pool, so "
                "no dense backend can read them; leave dense unset (short requests then run "
                "on the sparse backend over all their keys)"
            )
        cfg, pool = runtime.config, runtime.kv_pool
        dims, dev = cfg.model, pool.device
        latent: LatentPool = pool
        if fp8_rows:
            latent = Fp8RowPool(
                pool.num_layers,
                pool.num_pages,
                pool.page_size,
                dims.kv_lora_rank,
                dims.qk_rope_head_dim,
                dev,
            )
        cache = IndexKCache(
            pool.num_layers, latent.num_slots, indexer_dims.head_dim, indexer_dims.quantized, dev
        )
        r2t = runtime.req_pool.req_to_token
        indexer = Indexer(indexer_dims, cache, r2t, indexer_kernels, topk_path)
        ctx = SparseContext(dims, latent, runtime.req_pool, indexer_dims.topk, cfg.torch_dtype)
        if isinstance(sparse_backend, str):
            sparse = create_sparse_backend(sparse_backend, ctx)
        else:  # a class the registry does not hold (the fp64 reference)
            sparse = sparse_backend(ctx)
        if fp8_rows:
            return cls(None, indexer, sparse, overlap_indexer)
        return cls(runtime.backend if dense is None else dense, indexer, sparse, overlap_indexer)

    @property
    def name(self) -> str:
        dense = self.dense.name if self.dense is not None else "-"
        return f"dsa({dense}+{self.sparse.name})"

    @property
    def supports_graphs(self) -> bool:
        return self.sparse.supports_graphs

    @property
    def metadata(self) -> object:
        return self.sparse.metadata

    @property
    def cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # ------------------------------------------------------------------ per batch
    def use_dense(self) -> bool:
        """This batch runs dense (the rule in `sparse.base`); False under CUDA graphs."""
        return self._dense_batch

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        dense = runs_dense(batch, self.topk)
        self._dense_slots = None
        if dense and self.dense is not None:
            self.dense.init_forward_metadata(batch)  # checks the batch against the table
        else:
            # Hazard: a batch whose rows or prefix disagree with the request table selects
            # and attends at the wrong positions, silently; the dense backends refuse it.
            self.check_batch(batch)
            self.indexer.init_forward_metadata(batch)
            self.sparse.init_forward_metadata(batch)
            if dense:  # FP8 rows: the sparse backend over every visible key (`dense_slots`)
                slots = dense_indices(self.sparse.req_to_token, batch, self.topk)
                self._dense_slots = (batch, slots)
        self._dense_batch = dense

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.indexer.init_cuda_graph_state(max_bs, max_num_tokens)
        self.sparse.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self._dense_batch, self._dense_slots = False, None
        self.indexer.init_forward_metadata_capture(batch)
        self.sparse.init_forward_metadata_capture(batch)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        self._dense_batch, self._dense_slots = False, None
        self.indexer.init_forward_metadata_replay(batch)
        self.sparse.init_forward_metadata_replay(batch)

    def graph_refill_on_device(self, batch_size: int) -> bool:
        return False  # not audited: the indexer's metadata may read host lengths

    def check_batch(self, batch: ForwardBatch) -> None:
        self.sparse.ctx.req_to_token_pool.check_batch(batch)

    def reset_requests(self, rows: Sequence[int]) -> None:
        """Nothing per request: index keys live in the pool's slots."""

    def accept(self, num_accepted: torch.Tensor) -> None:
        """Nothing to keep: the engine truncates rejected slots (latent and index keys)."""

    # ------------------------------------------------------------------ per layer
    def _dense_backend(self) -> AttentionBackend:
        if self.dense is None:
            raise RuntimeError(
                "DSA over FP8 rows has no dense backend: its dense batches run the sparse "
                "backend over every visible key (dense_slots)"
            )
        return self.dense

    # The dense verbs pass their arguments through unchanged: their types are
    # AttentionBackend's (backends/protocol.py).
    def forward_absorbed(self, layer: int, *args: Any, **kwargs: Any) -> Any:
        return self._dense_backend().forward_absorbed(layer, *args, **kwargs)

    def forward_mha(self, *args: Any, **kwargs: Any) -> Any:
        return self._dense_backend().forward_mha(*args, **kwargs)

    def store_kv(
        self, layer: int, loc: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor
    ) -> None:
        self.sparse.store_kv(layer, loc, k_nope, k_rope)

    def load_prefix(self, layer: int, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self._dense_backend().load_prefix(layer, batch)

    def begin_select(
        self,
        layer: int,
        query: Callable[[], tuple[torch.Tensor, torch.Tensor]],
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> Callable[[], torch.Tensor]:
        """Starts the indexer of `layer` (`query()` gives its q and head weights) and returns
        the call that gives its slots. With a side stream the indexer's kernels (its
        projections, q prep, logits, top-k: a chain of short latency-bound kernels) run
        there, beside what the caller enqueues before that call (the layer's q and KV
        projections); the call makes the current stream wait for them. CUDA graphs capture
        the fork and the join.

        Hazards: everything the indexer reads (its K cache with this batch's keys stored,
        the caller's inputs) must be written before this call on the current stream, and
        must stay alive until the returned call ran (a caller's locals do); the slots are
        handed to the current stream with `record_stream`."""
        if self.side is None:
            slots = self.indexer.select(layer, *query(), cos, sin)
            return lambda: slots
        main = torch.cuda.current_stream(self.side.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            slots = self.indexer.select(layer, *query(), cos, sin)

        def join() -> torch.Tensor:
            main.wait_stream(self.side)  # type: ignore[arg-type]
            slots.record_stream(main)
            return slots

        return join

    def dense_slots(self, batch: ForwardBatch) -> torch.Tensor:
        """[T, topk] int32: every visible key's slot per query token, the sparse backend's
        dense path (FP8 rows), built once for every layer by `init_forward_metadata`."""
        built = self._dense_slots
        if built is None or built[0] is not batch:
            # Hazard: another batch's slots attend over another request's keys, silently.
            raise RuntimeError(
                "DSA: no dense slots for this batch: init_forward_metadata was not called for "
                "it, or it is not a dense batch over FP8 rows"
            )
        return built[1]
