"""Size and offset arithmetic shared by the index builder, the kernels' launchers and the
backends: ceiling division, rounding, powers of two, exclusive prefix sums.

Host-side helpers are plain Python: `triton.cdiv` / `triton.next_power_of_2` are
ConstexprFunctions in Triton 3.6, a few microseconds per call on the per-batch path."""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

T = TypeVar("T", int, torch.Tensor, np.ndarray)


def cdiv(a: T, b: int) -> T:
    """ceil(a / b) for ints, int tensors and int arrays (b > 0)."""
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def cumsum_indptr(lens: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[B] lengths -> [B+1] int32 exclusive prefix sum (on the lengths' device)."""
    if out is None:
        out = torch.empty(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    out[:1].zero_()
    out[1:].copy_(torch.cumsum(lens, 0))
    return out
