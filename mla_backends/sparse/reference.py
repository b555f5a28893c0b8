"""Sparse absorbed MLA in plain PyTorch: the oracle of every sparse backend.

Index names: t query tokens, k selected entries, h heads, l latent dim, r rope dim. Token t
attends to the rows its index row names (-1: unused); out = softmax(scale * (q_l . c_l +
q_r . c_r)) @ c_l over those rows, natural-log LSE, out 0 / lse -inf for a row with none.
Rows are read through the pool's own dequantisation (`load_rows`): per-layer scale for
`MLATokenToKVPool`, `fp8_row.dequant_rows` for the FP8 row format.
"""

from __future__ import annotations

import torch

from mla_backends.reference import softmax_with_lse
from mla_backends.sparse.base import LatentPool


def gather_rows(
    pool: LatentPool, layer: int, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """indices [T, K] -> (rows [T, K, L + R] fp32, zero where unused; valid [T, K] bool)."""
    valid = indices >= 0
    rows = pool.load_rows(layer, indices.clamp(min=0))
    # Hazard: an unused entry's stand-in row (slot 0) may be NaN; a masked score would still
    # give 0 * NaN in P @ V, so the rows are zeroed, not only masked.
    return torch.where(valid[..., None], rows, torch.zeros((), device=rows.device)), valid


def sparse_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_nope [T, H, L], q_rope [T, H, R], rows [T, K, L + R], valid [T, K]
    -> (out [T, H, L], lse [T, H]) in `dtype`."""
    lat = q_nope.shape[-1]
    rows = rows.to(dtype)
    scores = (
        torch.einsum("thl,tkl->thk", q_nope.to(dtype), rows[..., :lat])
        + torch.einsum("thr,tkr->thk", q_rope.to(dtype), rows[..., lat:])
    ) * scale
    probs, lse = softmax_with_lse(scores, valid[:, None, :])
    return torch.einsum("thk,tkl->thl", probs, rows[..., :lat]), lse


def sparse_reference(
    pool: LatentPool,
    layer: int,
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention of every token over the pool rows its indices name."""
    rows, valid = gather_rows(pool, layer, indices)
    return sparse_attention(q_nope, q_rope, rows, valid, scale, dtype)


def mask_empty(
    out: torch.Tensor, lse: torch.Tensor, indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract for rows with no valid index (out 0, lse -inf), whatever a kernel wrote
    there, in torch ops (the backends use `kernels.empty_rows.fix_empty_rows`, one launch)."""
    empty = (indices < 0).all(dim=-1)
    return out.masked_fill(empty[:, None, None], 0.0), lse.masked_fill(
        empty[:, None], float("-inf")
    )
