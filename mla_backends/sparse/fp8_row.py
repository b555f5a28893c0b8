"""The FlashMLA V3.2 FP8 latent row as a pool storage format, and the pool that stores it.

One row per slot, `L + 4 * L / 128 + 2 * R` bytes (656 for L = 512, R = 64):

    [0, L)                 float8_e4m3fn codes of the latent, one 128-wide tile after another
    [L, L + 4 * L / 128)   one fp32 scale per 128-wide tile (ue8m0: a power of two)
    [.., + 2 * R)          the rope part in bf16, not quantised

One contract for scales: value = code * scale of its tile, rope = its bf16 value, and
`dequant_rows` is that definition; the torch reference, the Triton kernel (in registers) and
FlashMLA (which casts the scales to bf16, exact for powers of two) read the same values.
Scales come from `quant.block_quant` (amax per tile, clamped at 1e-4, ue8m0), so a tile never
saturates and `x / scale` is exact before the e4m3 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_backends.checks import check_tensor
from mla_backends.pool import STORE_DTYPES, LayerBuffers, slots_or_dummy
from mla_backends.sparse.quant import block_quant

TILE = 128
FLASHMLA_PAGE = 64  # FlashMLA views the rows as [num_slots / 64, 64, 1, row_bytes]


@dataclass(frozen=True)
class Fp8RowFormat:
    kv_lora_rank: int = 512
    rope_dim: int = 64

    def __post_init__(self) -> None:
        if self.kv_lora_rank % TILE:
            raise ValueError(f"FP8 rows need kv_lora_rank % {TILE} == 0, got {self.kv_lora_rank}")

    @property
    def tiles(self) -> int:
        return self.kv_lora_rank // TILE

    @property
    def scale_offset(self) -> int:
        return self.kv_lora_rank

    @property
    def rope_offset(self) -> int:
        return self.kv_lora_rank + 4 * self.tiles

    @property
    def row_bytes(self) -> int:
        return self.rope_offset + 2 * self.rope_dim


def pack_rows(fmt: Fp8RowFormat, k_nope: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    """k_nope [N, L], k_rope [N, R] -> rows [N, row_bytes] uint8."""
    n = k_nope.shape[0]
    codes, scales = block_quant(k_nope, TILE)
    rows = torch.empty(n, fmt.row_bytes, dtype=torch.uint8, device=k_nope.device)
    rows[:, : fmt.scale_offset] = codes.view(torch.uint8)
    rows[:, fmt.scale_offset : fmt.rope_offset] = scales.contiguous().view(torch.uint8)
    rows[:, fmt.rope_offset :] = k_rope.to(torch.bfloat16).contiguous().view(torch.uint8)
    return rows


def unpack_rows(
    fmt: Fp8RowFormat, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rows [N, row_bytes] -> (codes [N, L] e4m3, scales [N, L / 128] fp32, rope [N, R] bf16)."""
    codes = rows[:, : fmt.scale_offset].contiguous().view(torch.float8_e4m3fn)
    scales = rows[:, fmt.scale_offset : fmt.rope_offset].contiguous().view(torch.float32)
    rope = rows[:, fmt.rope_offset :].contiguous().view(torch.bfloat16)
    return codes, scales, rope


def dequant_rows(fmt: Fp8RowFormat, rows: torch.Tensor) -> torch.Tensor:
    """rows [N, row_bytes] -> values [N, L + R] fp32: THE dequantisation of this format."""
    codes, scales, rope = unpack_rows(fmt, rows)
    lat = (codes.float().view(-1, fmt.tiles, TILE) * scales[..., None]).flatten(1)
    return torch.cat([lat, rope.float()], dim=-1)


class Fp8RowPool:
    """Latent rows in the FP8 row format, per layer `[num_slots, row_bytes]` uint8, over the
    same slot space as `MLATokenToKVPool` (slot = page * page_size + offset, page 0 the dummy
    page), rounded up to whole 64-row FlashMLA blocks."""

    is_fp8 = True
    dtype = torch.uint8

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.fmt = Fp8RowFormat(kv_lora_rank, qk_rope_head_dim)
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.kv_dim = kv_lora_rank + qk_rope_head_dim
        self.device = torch.device(device)
        used = (num_pages + 1) * page_size
        self.num_slots = -(-used // FLASHMLA_PAGE) * FLASHMLA_PAGE
        self.kv_buffer = LayerBuffers(  # a plain list took layer -1 as the last, silently
            torch.zeros(self.num_slots, self.fmt.row_bytes, dtype=torch.uint8, device=self.device)
            for _ in range(num_layers)
        )

    def scale(self, layer: int) -> float:
        return 1.0  # scales live in the rows

    def set_mla_kv_buffer(
        self, layer: int, loc: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor
    ) -> None:
        t = loc.shape[0]
        check_tensor("loc", loc, (t,), (torch.int32, torch.int64), self.device)
        check_tensor("k_nope", k_nope, (t, self.kv_lora_rank), STORE_DTYPES, self.device)
        check_tensor("k_rope", k_rope, (t, self.qk_rope_head_dim), STORE_DTYPES, self.device)
        buf = self.kv_buffer[layer]
        if buf.is_cuda:  # one launch, the same bytes (pack_rows is ~30 torch kernels a layer)
            from mla_backends.kernels.store import store_fp8_rows

            store_fp8_rows(buf, loc, k_nope, k_rope, self.fmt)
            return
        buf[slots_or_dummy(loc, self.num_slots)] = pack_rows(self.fmt, k_nope, k_rope)

    def load_rows(self, layer: int, loc: torch.Tensor) -> torch.Tensor:
        """fp32 values [*loc.shape, L + R] of the rows at `loc`; reads only those rows."""
        rows = self.kv_buffer[layer][loc.reshape(-1).long()]
        return dequant_rows(self.fmt, rows).view(*loc.shape, self.kv_dim)

    def get_paged_buffer(self, layer: int) -> torch.Tensor:
        """FlashMLA's [num_slots / 64, 64, 1, row_bytes] float8_e4m3fn view (stride(1) = 656)."""
        buf = self.kv_buffer[layer].view(torch.float8_e4m3fn)
        return buf.view(self.num_slots // FLASHMLA_PAGE, FLASHMLA_PAGE, 1, self.fmt.row_bytes)
