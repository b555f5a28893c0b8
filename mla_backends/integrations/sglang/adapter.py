"""SGLang's `AttentionBackend` over one of our backends (what `--attention-backend mlab_*`
builds). Imports SGLang; the package's `register()` imports this module only in the factory.

Per batch: SGLang's ForwardBatch is converted to ours once (`batches.py`) and our backend builds
its metadata once; every layer reuses both. The two DeepSeek layer shapes are told apart by
the RadixAttention layer: head_dim L + R with one KV head is absorbed attention
(`forward_absorbed`), head_dim P + R with H KV heads is MHA-mode prefill (`forward_mha`).

CUDA graphs: `init_cuda_graph_state` allocates our static batch buffers and our backend's
state. Capture (`init_forward_metadata_out_graph(in_capture=True)`) binds our backend's static
metadata to those buffers. The per-replay refill (SGLang's batch copied into our buffers, then
our backend's page table / schedule) is device work; where our backend says its refill reads
no host value (`graph_refill_on_device`), `init_forward_metadata_in_graph` records it inside
SGLang's graph and the replay-side `init_forward_metadata_out_graph` only checks the batch, so
a decode step pays no metadata launches on the host. Otherwise (a FlashInfer plan made on the
host) `init_forward_metadata_out_graph` enqueues the refill before `graph.replay()`. No step
reads a device value back.

Hazard (that host refill, `SGLANG_ENABLE_OVERLAP_PLAN_STREAM=1`): SGLang 0.5.17's spec-v2
workers call `init_forward_metadata_out_graph` for a target verify on their plan stream, and
the refill writes the graph's static buffers there while no event orders that stream after
the previous replay. What orders it is a host sync: with `needs_cpu_seq_lens` (ours is True)
the scheduler waits on the FutureMap's `publish_ready`, recorded after the previous verify's
replay, before it enqueues the next step's plan work (`overlap_utils.resolve_seq_lens_cpu`).
SGLang's own FlashInfer MLA backend relies on the same order; a release that drops that wait
would need one here. Refills recorded in the graph write nothing on the plan stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from mla_backends.backends.base import graph_state_sizes
from mla_backends.batch import ForwardBatch, ForwardMode, RaggedLayout
from mla_backends.integrations.sglang.batches import (
    BatchError,
    GraphBuffers,
    eager_batch,
    new_token_layout,
    prefix_chunk_layout,
)
from mla_backends.integrations.sglang.binding import bind
from mla_backends.integrations.sglang.layers import check_layer, flat_heads, split_absorbed
from mla_backends.integrations.sglang.settings import SettingsError, server_refusal

# Keyword arguments DeepSeek passes only to other backends (TRT-LLM fused rope, DSA top-k,
# attention sinks); refused rather than silently ignored.
_UNSUPPORTED_KWARGS = ("cos_sin_cache", "is_neox", "llama_4_scaling", "topk_indices", "sinks")
_TOKEN_KWARGS = ("q_rope", "k_rope")  # one row a token, like q


@dataclass
class AdapterMetadata:
    """What one SGLang batch becomes: our batch plus the MHA-mode layouts of an EXTEND."""

    batch: ForwardBatch
    # The KV lengths our kernels read, [B] int32 device (named so SGLang's kit checks them).
    cache_seqlens_int32: torch.Tensor
    new_tokens: RaggedLayout | None = None  # MHA-mode prefill over the new tokens
    chunks: dict[int, RaggedLayout] = field(default_factory=dict)  # chunked-prefix MHA


class MLABackendAdapter(AttentionBackend):
    def __init__(self, runner: Any, sgl_name: str, decode: str) -> None:
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        sa = getattr(runner, "server_args", None)
        msg = server_refusal(sgl_name, sa, bool(getattr(par, "dcp_enabled", False)))
        if msg is not None:
            raise SettingsError(msg)
        heads = int(runner.model_config.num_attention_heads) // int(par.attn_tp_size)
        self.binding = bind(runner, sgl_name, decode, heads)
        self.backend = self.binding.backend
        self.dims = self.binding.config.model
        # SGLang's forward context and its kit read these two back from the backend.
        self.token_to_kv_pool = runner.token_to_kv_pool
        self.req_to_token_pool = runner.req_to_token_pool
        self.data_type = runner.kv_cache_dtype
        self.kv_cache_dtype = runner.kv_cache_dtype
        # EAGLE's verify-input builder sizes its tree mask by bs * this when the batch carries
        # no seq_lens_sum (after SGLang filters or merges a running batch).
        self.max_context_len = int(runner.model_config.context_len)
        # the tensors our pool views (a hybrid model's: its full-attention pool's)
        self._source = list(self.binding.sgl_pool.kv_buffer)
        self._graph: GraphBuffers | None = None
        # captured batch size -> our metadata over the static buffers (replay re-points to it)
        self._captured: dict[int, AdapterMetadata] = {}
        self._checked: set[tuple[int, int]] = set()
        self.forward_metadata: AdapterMetadata | None = None

    # ------------------------------------------------------------------ metadata
    def _check_buffers(self) -> None:
        # Hazard: our pool holds views of SGLang's tensors; if SGLang re-created them
        # (e.g. releasing and re-allocating the KV cache) the views would read freed memory.
        bufs = self.binding.sgl_pool.kv_buffer
        if len(bufs) != len(self._source) or any(a is not b for a, b in zip(bufs, self._source)):
            raise RuntimeError(
                f"{self.binding.sgl_name}: SGLang re-created its KV buffers after the backend "
                "was built; mla-backends wraps them once and cannot follow"
            )

    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Eager batches: convert once, build our backend's metadata once."""
        if forward_batch.forward_mode.is_idle():
            self.forward_metadata = None
            return
        self._check_buffers()
        batch = eager_batch(forward_batch)
        self.backend.init_forward_metadata(batch)
        md = AdapterMetadata(batch, batch.seq_lens)
        if batch.mode is ForwardMode.EXTEND:
            md.new_tokens = new_token_layout(batch)
        self.forward_metadata = md

    def init_mha_chunk_metadata(
        self, forward_batch: Any, disable_flashinfer_ragged: bool = False
    ) -> None:
        """Chunked-prefix MHA (DeepSeek calls this once per batch): one layout per chunk.
        `disable_flashinfer_ragged`: SGLang's wrappers (HybridAttnBackend, the Kimi-Linear
        HybridLinearAttnBackend) pass it on to every backend; our layouts do not use it.
        Hazard: without it, their call raised a TypeError at a long prefix's first prefill."""
        md = self._metadata()
        md.chunks = {
            i: prefix_chunk_layout(forward_batch, md.batch, i)
            for i in range(int(forward_batch.num_prefix_chunks or 0))
        }

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        # Kept or refused as a backend's state is: captured metadata views these buffers.
        g = self._graph
        have = None if g is None else (g.rows.numel(), g.loc.numel())
        name = self.binding.sgl_name
        sizes = graph_state_sizes(name, have, bool(self._captured), max_bs, max_num_tokens)
        if sizes is not None:
            self._graph = GraphBuffers.allocate(*sizes, self.binding.kv_pool.device)
        self.backend.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        """Outside the graph, before capture (`in_capture`) and before every replay (SGLang's
        SimpleNamespace view). Replay of a size whose refill is recorded in the graph: host
        checks only."""
        if forward_batch.forward_mode.is_idle():
            self.forward_metadata = None
            return
        graph = self._graph_buffers()
        self._check_buffers()
        bs = int(forward_batch.batch_size)
        if in_capture:
            batch = graph.load(forward_batch)
            self.backend.init_forward_metadata_capture(batch)
            self.forward_metadata = self._captured[bs] = AdapterMetadata(batch, batch.seq_lens)
            return
        if self.backend.graph_refill_on_device(bs):
            graph.check(forward_batch)
            md = self._captured.get(bs)
            if md is None:
                raise RuntimeError(f"no graph captured for batch size {bs}")
            self.forward_metadata = md
            return
        self._refill(forward_batch)

    def init_forward_metadata_in_graph(self, forward_batch: Any) -> None:
        """Inside SGLang's capture (recorded; replayed with every `graph.replay()`), or called
        eagerly after out_graph by a runner without a real graph (SGLang's kit): the device
        refill, from the capture batch's tensors, which are SGLang's static graph buffers.

        Hazard (overlap scheduler): SGLang 0.5.17 records its write-after-read event for a
        DECODE replay *before* `graph.replay()` (decode_cuda_graph_runner.execute, "a
        cuda-graph forward finishes its shared req_to_token reads at this pre-replay
        snapshot"), so the scheduler may write `req_to_token` for the next batch while this
        refill reads it. Those writes land past every position this replay reads (the next
        token's slot), or in rows freed by requests that finished a step earlier, whose
        output of this step SGLang drops; every id read is a slot id SGLang wrote. Read by
        helper 76 in SGLang's source, not provoked on a GPU. `SGLANG_FORCE_COARSE_WAR_BARRIER=1`
        orders the next writes after the whole forward."""
        if forward_batch.forward_mode.is_idle() or self._graph is None:
            return
        if self.backend.graph_refill_on_device(int(forward_batch.batch_size)):
            self._refill(forward_batch)

    def _refill(self, forward_batch: Any) -> None:
        batch = self._graph_buffers().load(forward_batch)
        self.backend.init_forward_metadata_replay(batch)
        self.forward_metadata = AdapterMetadata(batch, batch.seq_lens)

    def _graph_buffers(self) -> GraphBuffers:
        if self._graph is None:
            raise RuntimeError("graph metadata before init_cuda_graph_state")
        return self._graph

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.backend.cuda_graph_seq_len_fill_value

    def update_verify_buffers_to_fill_after_draft(
        self, spec_info: Any, cuda_graph_bs: int | None
    ) -> None:
        """EAGLE with SGLANG_ENABLE_OVERLAP_PLAN_STREAM calls this after the draft: nothing to
        redo, as our verify metadata reads no draft output (chain drafts: no tree mask; our
        kernels take no positions)."""

    def _metadata(self) -> AdapterMetadata:
        if self.forward_metadata is None:
            raise RuntimeError("init_forward_metadata was not called for this batch")
        return self.forward_metadata

    # ------------------------------------------------------------------ attention
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: Any,
        forward_batch: Any,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Both of SGLang's entries: its `forward` sends DECODE batches to `forward_decode` and
        EXTEND, MIXED, SPLIT_PREFILL and TARGET_VERIFY to `forward_extend`. Ours tells the two
        DeepSeek layer shapes apart by the layer, not the mode, so one body serves all."""
        bad = sorted(n for n in _UNSUPPORTED_KWARGS if kwargs.get(n) is not None)
        if bad:
            raise BatchError(f"{self.binding.sgl_name} does not take {bad}")
        md, d = self._metadata(), self.dims
        idx = self._layer_index(layer)
        rows, n = q.shape[0], md.batch.num_tokens
        if (
            layer.tp_k_head_num == 1
            and layer.qk_head_dim == d.kv_dim
            and layer.v_head_dim == d.kv_lora_rank
        ):
            if rows > n:  # SGLang's DP padding (`batches.eager_batch`): real tokens only
                q, k = q[:n], None if k is None else k[:n]
                kwargs = {a: _head(b, n) if a in _TOKEN_KWARGS else b for a, b in kwargs.items()}
            return _pad_rows(self._absorbed(q, k, idx, md, save_kv_cache, kwargs), rows)
        if (
            layer.tp_k_head_num == d.num_heads
            and layer.qk_head_dim == d.qk_head_dim
            and layer.v_head_dim == d.v_head_dim
        ):
            out = self._mha(q[:n], k, v, md, forward_batch, save_kv_cache)
            if isinstance(out, tuple):
                return _pad_rows(out[0], rows), _pad_rows(out[1], rows)
            return _pad_rows(out, rows)
        raise BatchError(
            f"layer {layer.layer_id}: head_dim {layer.qk_head_dim}, {layer.tp_k_head_num} KV "
            f"heads, v {layer.v_head_dim} is neither the absorbed ({d.kv_dim}, 1, "
            f"{d.kv_lora_rank}) nor the MHA-mode ({d.qk_head_dim}, {d.num_heads}, "
            f"{d.v_head_dim}) shape"
        )

    # Hazard (--enable-torch-compile): SGLang wraps the model's forward in torch.compile for
    # the decode graphs' small batch sizes (torch_compile_decoration.patch_model), and
    # RadixAttention calls the backend inside that trace. Traced by Dynamo, our forward
    # path (Triton / Gluon launches with TMA descriptors and PDL, FlashInfer / FlashMLA
    # extension calls, host branches on CPU lengths, the Gluon launch's try/except that
    # turns Gluon off for the process on any exception) is compiled code no test of ours
    # ran; SGLang's own triton backend keeps its kernels out the same way
    # (triton_backend.py, torch.compiler.disable). Run eagerly, it is recorded in the CUDA
    # graph exactly as without the flag; the layers around it stay compiled.
    forward_extend = torch.compiler.disable(forward_extend)
    forward_decode = forward_extend

    def _layer_index(self, layer: Any) -> int:
        """Our pool's layer index; host checks once per layer (heads, scale, KV scale)."""
        key = (int(layer.layer_id), int(layer.qk_head_dim))
        if key not in self._checked:
            check_layer(layer, self.dims)
            self._checked.add(key)
        idx = self.binding.layer_index(key[0])
        if idx is None:
            raise BatchError(f"layer {key[0]} is outside this rank's KV pool layers")
        pool = self.token_to_kv_pool
        if getattr(pool, "layer_transfer_counter", None) is not None:
            pool.get_key_buffer(key[0])  # waits for this layer's host-to-device KV load
        return idx

    def _absorbed(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        idx: int,
        md: AdapterMetadata,
        save_kv_cache: bool,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """Absorbed attention over the pool; both call shapes (`layers.split_absorbed`)."""
        q_nope, q_rope, k_nope, k_rope = split_absorbed(q, k, kwargs, self.dims)
        if save_kv_cache and k_nope is not None and k_rope is None:
            raise BatchError(
                f"save_kv_cache with k of {k_nope.shape[-1]} columns and no k_rope: the new "
                f"rows ({self.dims.kv_dim} wide) cannot be stored; pass k_rope or whole rows"
            )
        if not save_kv_cache or k_nope is None:
            k_nope = k_rope = None  # the rows are in the pool already
        out = self.backend.forward_absorbed(idx, q_nope, q_rope, k_nope, k_rope, md.batch)
        assert isinstance(out, torch.Tensor)
        return flat_heads(out)

    def _mha(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        md: AdapterMetadata,
        fb: Any,
        save_kv_cache: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """MHA-mode prefill: causal over the new tokens, or (chunked prefix) non-causal
        against one prefix chunk. LSE when SGLang asks (`mha_return_lse`): natural log
        [T, H] fp32, what its merge_state expects, and our contract already."""
        if k is None or v is None:
            raise BatchError("MHA-mode attention needs k and v")
        if save_kv_cache:
            raise BatchError(
                "MHA-mode call with save_kv_cache=True: the expanded K cannot be cached; the "
                "model stores the latent rows itself"
            )
        d = self.dims
        q3 = q.view(-1, d.num_heads, d.qk_head_dim)
        if getattr(fb, "attn_attend_prefix_cache", False):
            chunk = int(fb.prefix_chunk_idx)
            if chunk not in md.chunks:
                md.chunks[chunk] = prefix_chunk_layout(fb, md.batch, chunk)
            layout, causal = md.chunks[chunk], False
        else:
            if md.new_tokens is None:
                raise BatchError(f"MHA-mode attention in a {md.batch.mode.name} batch")
            layout, causal = md.new_tokens, True
            k, v = k[: layout.num_kv], v[: layout.num_kv]  # the new tokens, padding cut
        if bool(getattr(fb, "mha_return_lse", False)):
            out, lse = self.backend.forward_mha(q3, k, v, layout, causal, return_lse=True)
            return out, lse.contiguous()
        out = self.backend.forward_mha(q3, k, v, layout, causal)
        assert isinstance(out, torch.Tensor)
        return flat_heads(out)


def _head(x: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if x is None else x[:n]


def _pad_rows(out: torch.Tensor, rows: int) -> torch.Tensor:
    """Output (or LSE) over the real tokens -> `rows` token rows, SGLang's padded count;
    zeros in the padding (SGLang's base backend leaves it uninitialised): no NaN or stale
    memory reaches the MoE, whose outputs for those rows SGLang drops."""
    if out.shape[0] == rows:
        return out
    full = out.new_zeros((rows, *out.shape[1:]))
    full[: out.shape[0]].copy_(out)
    return full
