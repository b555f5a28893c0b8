"""The lightning indexer's data and maths (DeepSeek-V3.2): its dimensions, its K cache beside
the latent pool, and the plain-torch reference of every step (`indexer.py` says the maths and
runs them per layer; `indexer_kernels.py` / `topk_kernel.py` are the Triton forms)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_backends.arith import cdiv
from mla_backends.config import check_int
from mla_backends.pool import LayerBuffers, slots_or_dummy
from mla_backends.sparse.quant import block_quant, hadamard

PAGE = 64  # slots per index-K block (SGLang's page-major layout)
LOGITS_BUDGET = 256 << 20  # bytes one indexer chunk's logits (and what is as wide) may hold


@dataclass(frozen=True)
class IndexerDims:
    n_heads: int = 64
    head_dim: int = 128
    rope_dim: int = 64
    topk: int = 2048
    quantized: bool = True

    def __post_init__(self) -> None:
        # Hazard: a float topk or head count passed here and failed at the first select,
        # inside torch.topk (or as a ZeroDivisionError at 0 heads), naming no field; and a
        # truthy `quantized="no"` stored quantised keys, silently.
        for name in ("n_heads", "head_dim", "rope_dim", "topk"):
            check_int("IndexerDims.", name, getattr(self, name), 1)
        if not isinstance(self.quantized, bool):
            raise TypeError(
                f"IndexerDims.quantized must be a bool, got {self.quantized!r} "
                f"({type(self.quantized).__name__})"
            )
        if self.head_dim & (self.head_dim - 1) or self.head_dim < 16:
            raise ValueError(f"index_head_dim must be a power of two >= 16, got {self.head_dim}")
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ValueError(f"indexer rope dim {self.rope_dim} must be even, <= head_dim")

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
        self.num_blocks = cdiv(num_slots, PAGE)
        self.block_bytes = PAGE * (head_dim * self.elem + 4)
        self.device = torch.device(device)
        self.buffers = LayerBuffers(  # a plain list took layer -1 as the last, silently
            torch.zeros(self.num_blocks, self.block_bytes, dtype=torch.uint8, device=self.device)
            for _ in range(num_layers)
        )
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
        loc = slots_or_dummy(loc, self.num_blocks * PAGE)  # the pool's rule for bad slots
        blk, off = torch.div(loc, PAGE, rounding_mode="floor"), loc % PAGE
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
    dots = torch.einsum("thd,tsd->ths", q.float(), k.float()).relu_()  # in place: [T, Hi, S]
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
