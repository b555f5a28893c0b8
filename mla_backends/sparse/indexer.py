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

from dataclasses import dataclass, field

import torch

from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.sparse.quant import block_quant, hadamard

PAGE = 64  # slots per index-K block (SGLang's page-major layout)
LOGITS_BUDGET = 256 << 20  # bytes of fp32 logits one EXTEND chunk may hold


@dataclass(frozen=True)
class IndexerDims:
    n_heads: int = 64
    head_dim: int = 128
    rope_dim: int = 64
    topk: int = 2048
    quantized: bool = True

    def __post_init__(self) -> None:
        if self.head_dim & (self.head_dim - 1) or self.head_dim < 16:
            raise ValueError(f"index_head_dim must be a power of two >= 16, got {self.head_dim}")
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ValueError(f"indexer rope dim {self.rope_dim} must be even, <= head_dim")
        if self.topk <= 0:
            raise ValueError(f"index_topk must be > 0, got {self.topk}")

    @property
    def weight_scale(self) -> float:
        return self.n_heads**-0.5 * self.head_dim**-0.5


class IndexKCache:
    """Per layer, uint8 `[num_blocks, PAGE * (D * e + 4)]` over the latent pool's slot space
    (slot s in block s // 64, offset o = s % 64), page-major as SGLang lays it out:
    bytes [o * D * e, (o + 1) * D * e) hold slot s's K (e4m3 codes, e = 1; or fp32 values,
    e = 4, unquantised), bytes [64 * D * e + 4 * o, + 4) its fp32 scale (1.0 unquantised).
    Value = K * scale. `data_view` / `scale_view` are the one definition every reader uses."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        head_dim: int,
        quantized: bool,
        device: torch.device | str,
    ) -> None:
        self.head_dim, self.quantized = head_dim, quantized
        self.dtype = torch.float8_e4m3fn if quantized else torch.float32
        self.elem = self.dtype.itemsize
        self.num_blocks = -(-num_slots // PAGE)
        self.block_bytes = PAGE * (head_dim * self.elem + 4)
        self.device = torch.device(device)
        self.buffers = [
            torch.zeros(self.num_blocks, self.block_bytes, dtype=torch.uint8, device=self.device)
            for _ in range(num_layers)
        ]
        for b in self.buffers:
            self.scale_view(b).fill_(1.0)

    @property
    def bytes_per_token(self) -> int:
        return (self.head_dim * self.elem + 4) * len(self.buffers)

    def data_view(self, buf: torch.Tensor) -> torch.Tensor:
        """[num_blocks, PAGE, D] in the storage dtype (a view)."""
        d = PAGE * self.head_dim * self.elem
        return buf[:, :d].view(self.dtype).view(self.num_blocks, PAGE, self.head_dim)

    def scale_view(self, buf: torch.Tensor) -> torch.Tensor:
        """[num_blocks, PAGE] fp32 (a view)."""
        return buf[:, PAGE * self.head_dim * self.elem :].view(torch.float32)

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, scale: torch.Tensor) -> None:
        """k [T, D] (codes or fp32 values), scale [T] at slots `loc` (torch path)."""
        buf = self.buffers[layer]
        blk, off = torch.div(loc.long(), PAGE, rounding_mode="floor"), loc.long() % PAGE
        self.data_view(buf)[blk, off] = k.to(self.dtype)
        self.scale_view(buf)[blk, off] = scale.float()

    def read(self, layer: int, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(K [*loc.shape, D] as stored, scale [*loc.shape] fp32) of the slots `loc`."""
        buf = self.buffers[layer]
        blk, off = torch.div(loc.long(), PAGE, rounding_mode="floor"), loc.long() % PAGE
        return self.data_view(buf)[blk, off], self.scale_view(buf)[blk, off]


# ----------------------------------------------------------------------------- reference maths
def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE on the first 2 * cos.shape[-1] dims of x [T, ..., D]; cos / sin
    [T, R / 2]. Computed in fp32, returned in x's dtype."""
    half = cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.float().view(shape), sin.float().view(shape)
    x1, x2, rest = x[..., :half].float(), x[..., half : 2 * half].float(), x[..., 2 * half :]
    rot = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
    return torch.cat([rot, rest], dim=-1)


def prepare_k(
    dims: IndexerDims, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """k_norm(wk(x)) [T, D] -> (K to store [T, D], scale [T] fp32)."""
    k = rope_neox(k, cos, sin)
    if not dims.quantized:
        return k.float(), torch.ones(k.shape[0], dtype=torch.float32, device=k.device)
    # The reference rotates and quantises activations in their own dtype (bf16 on GPUs).
    codes, scale = block_quant(hadamard(k).to(k.dtype), dims.head_dim)
    return codes, scale[:, 0]


def prepare_q(
    dims: IndexerDims, q: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """wq_b(q_lora) [T, Hi, D], weights_proj(x) [T, Hi] -> (q [T, Hi, D] codes or fp32,
    head weights [T, Hi] fp32 with Hi ** -0.5 * D ** -0.5 and the q scales folded in)."""
    q = rope_neox(q, cos, sin)
    w = w.float() * dims.weight_scale
    if not dims.quantized:
        return q.float(), w
    codes, scale = block_quant(hadamard(q).to(q.dtype), dims.head_dim)
    return codes, w * scale[..., 0]


def logits_reference(
    q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor
) -> torch.Tensor:
    """q [T, Hi, D], w [T, Hi], k [T, S, D] (each token's candidate keys), k_scale [T, S]
    -> [T, S] fp32 = k_scale * sum_h w_h * relu(q_h . k)."""
    dots = torch.einsum("thd,tsd->ths", q.float(), k.float()).relu()
    return torch.einsum("th,ths->ts", w.float(), dots) * k_scale.float()


def select_topk(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """logits [T, W] (-inf where a key is not visible) -> int32 [T, topk] positions, -1 for
    unused entries. No host sync; a static width keeps it graph-capturable."""
    t, width = logits.shape
    k = min(topk, width)
    val, idx = logits.topk(k, dim=-1, sorted=False)
    idx = torch.where(val == float("-inf"), torch.full_like(idx, -1), idx).to(torch.int32)
    if k < topk:
        idx = torch.nn.functional.pad(idx, (0, topk - k), value=-1)
    return idx


def positions_to_slots(
    idx: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """idx [T, K] request-local positions (-1 unused), rows [T] request rows -> int32 pool
    slots, -1 kept."""
    slots = req_to_token[rows.long()[:, None], idx.clamp(min=0).long()]
    return torch.where(idx >= 0, slots.to(torch.int32), torch.full_like(idx, -1))


# ----------------------------------------------------------------------------- the step
@dataclass
class IndexerMetadata:
    rows: torch.Tensor  # [T] int64, device: request row of each query token
    visible: torch.Tensor  # [T] int32, device: keys the token may see (position + 1)
    width: int  # host: logits columns (the batch's longest context, or the graph maximum)
    chunks: list[tuple[int, int]]  # host: token ranges scored together (EXTEND: memory)


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
    ) -> None:
        from mla_backends.kernels.common import interpreting

        if kernels == "auto":
            kernels = "triton" if cache.device.type == "cuda" or interpreting() else "torch"
        if kernels not in ("triton", "torch"):
            raise ValueError(f"indexer kernels must be 'triton' or 'torch', got {kernels!r}")
        if cache.quantized != dims.quantized or cache.head_dim != dims.head_dim:
            raise ValueError("IndexKCache and IndexerDims disagree on head_dim / quantisation")
        self.dims, self.cache, self.req_to_token, self.kernels = dims, cache, req_to_token, kernels
        self.metadata: IndexerMetadata | None = None
        self._graph: IndexerGraphState | None = None

    # ------------------------------------------------------------------ metadata
    def _chunks(self, t: int, width: int, mode: ForwardMode) -> list[tuple[int, int]]:
        if mode is not ForwardMode.EXTEND or t == 0:
            return [(0, t)]
        per_token = 4 * max(width, 1) * (1 if self.kernels == "triton" else self.dims.head_dim + 1)
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
        dev = self.cache.device
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
        md = IndexerMetadata(g.rows[:t], g.visible[:t], g.width, [(0, t)])
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
    def store(
        self, layer: int, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, loc: torch.Tensor
    ) -> None:
        """k = k_norm(wk(x)) [T, D] before RoPE: RoPE, rotation, quantisation, store at loc."""
        if self.kernels == "triton":
            from mla_backends.sparse.indexer_kernels import store_index_k

            store_index_k(self.cache, layer, k, cos, sin, loc)
            return
        codes, scale = prepare_k(self.dims, k, cos, sin)
        self.cache.write(layer, loc, codes, scale)

    def logits(
        self, layer: int, q: torch.Tensor, w: torch.Tensor, start: int, end: int
    ) -> torch.Tensor:
        """Prepared q [T, Hi, D], w [T, Hi] of tokens [start, end) -> [end - start, width]
        fp32, -inf where a key is not visible."""
        md = self.metadata
        assert md is not None
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
        md = self.metadata
        if md is None:
            raise RuntimeError("indexer: init_forward_metadata was not called for this batch")
        if self.kernels == "triton":
            from mla_backends.sparse.indexer_kernels import prepare_q_fused

            qp, wp = prepare_q_fused(self.dims, q, w, cos, sin)
        else:
            qp, wp = prepare_q(self.dims, q, w, cos, sin)
        out = []
        for start, end in md.chunks:
            logits, rows = self.logits(layer, qp, wp, start, end), md.rows[start:end]
            if self.kernels == "triton":
                from mla_backends.sparse.topk_kernel import topk_slots

                out.append(topk_slots(logits, self.dims.topk, self.req_to_token, rows))
                continue
            pos = select_topk(logits, self.dims.topk)
            out.append(positions_to_slots(pos, self.req_to_token, rows))
        return out[0] if len(out) == 1 else torch.cat(out)
