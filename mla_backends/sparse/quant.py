"""The quantisation maths of DeepSeek-V3.2, one definition for every writer and reader.

- `hadamard(x)`: the Sylvester-ordered Walsh-Hadamard transform over the last dim, scaled by
  n ** -0.5 (orthonormal): `fast_hadamard_transform.hadamard_transform(x, scale=n ** -0.5)`,
  the reference's `rotate_activation`, as a pure-torch butterfly computed in fp32.
- `ue8m0_scale(amax)`: the power of two >= max(amax, 1e-4) / 448 (DeepSeek's `scale_fmt
  ue8m0`), found through the float's exponent rather than `log2`, whose rounding can miss a
  binade near powers of two.
- `block_quant(x, block)`: float8_e4m3fn codes and one fp32 scale per `block` values,
  value = code * scale. Power-of-two scales make `x / scale` exact and are exact in bf16
  (FlashMLA's SM90 decode kernel casts its scales to bf16).
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
AMAX_MIN = 1e-4  # DeepSeek's act_quant clamp: an all-zero block still gets a finite scale


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """[..., n] (n a power of two) -> x @ H_n * n ** -0.5 in fp32 (H_n Sylvester, symmetric)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"hadamard: last dim {n} is not a power of two")
    y = x.float()
    h = 1
    while h < n:
        y = y.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        y = torch.stack([y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]], dim=-2)
        h *= 2
    return y.reshape(x.shape) * n**-0.5


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """H_n with entries +-1 (Sylvester order): H[i, j] = (-1) ** popcount(i & j)."""
    i = torch.arange(n)
    bits = i[:, None] & i[None, :]
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).to(dtype)


def ue8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= max(amax, 1e-4) / 448, fp32."""
    y = amax.float().clamp_min(AMAX_MIN) / E4M3_MAX
    mant, exp = torch.frexp(y)  # y = mant * 2 ** exp, mant in [0.5, 1)
    exp = torch.where(mant == 0.5, exp - 1, exp)
    return torch.ldexp(torch.ones_like(y), exp)


def block_quant(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (codes [..., n] float8_e4m3fn, scales [..., n // block] fp32). A block's
    scale comes from its finite values; a NaN stays NaN and +-inf saturates to +-448 x scale
    (the store kernels' rule: `kernels.store._finite_abs`)."""
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"block_quant: last dim {n} is not a multiple of the block {block}")
    xs = x.float().unflatten(-1, (n // block, block))
    a = xs.abs()
    s = ue8m0_scale(torch.where(a.isfinite(), a, 0.0).amax(-1))
    codes = (xs / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.flatten(-2), s


def block_dequant(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(codes [..., n], scales [..., n // block]) -> values [..., n] fp32."""
    n, nb = codes.shape[-1], scales.shape[-1]
    vals = codes.float().unflatten(-1, (nb, n // nb)) * scales.float()[..., None]
    return vals.flatten(-2)
