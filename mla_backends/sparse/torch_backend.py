"""The `torch` sparse backend: gathers the selected rows (and only those), fp32 maths, any
device, every mode and pool format. Token chunks bound the gathered block's memory."""

from __future__ import annotations

import torch

from mla_backends.sparse.base import SparseCaps, SparseMLABackend, register_sparse_backend
from mla_backends.sparse.reference import sparse_reference

GATHER_BUDGET = 256 << 20  # bytes of gathered fp32 rows per chunk


@register_sparse_backend("torch")
class TorchSparseBackend(SparseMLABackend):
    name = "torch"
    caps = SparseCaps(pool_kinds=("paged", "fp8_row"))
    maths: torch.dtype = torch.float32

    def _attend(
        self, layer: int, q_nope: torch.Tensor, q_rope: torch.Tensor, indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t = q_nope.shape[0]
        step = max(1, GATHER_BUDGET // (4 * self.topk * self.dims.kv_dim))
        if t <= step:  # one block: the shapes graph capture sees
            out, lse = sparse_reference(
                self.pool, layer, q_nope, q_rope, indices, self.scale, self.maths
            )
            return out.to(q_nope.dtype), lse.float()
        outs, lses = [], []
        for s in range(0, t, step):
            o, lse = sparse_reference(
                self.pool,
                layer,
                q_nope[s : s + step],
                q_rope[s : s + step],
                indices[s : s + step],
                self.scale,
                self.maths,
            )
            outs.append(o.to(q_nope.dtype))
            lses.append(lse.float())
        return torch.cat(outs), torch.cat(lses)


class ReferenceSparseBackend(TorchSparseBackend):
    """The fp64 sparse reference behind the sparse interface, so a whole DeepSeek-V3.2 model
    can run on it (`run` checks a configured sparse backend's logits against it). Never
    registered: no config can pick it."""

    name = "reference"
    maths = torch.float64
