"""Log-sum-exp merge of partial attentions (chunked-prefix prefill, split KV on the host)."""

from __future__ import annotations

import torch

from mla_backends.checks import check_tensor


def merge_states(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions over disjoint key sets: o [n, h, d], lse [n, h].
    A side with lse = -inf (no keys) contributes nothing; both empty gives 0 / -inf.
    Hazard: such a side's o must be finite (every backend zeroes rows without keys; 0 x NaN
    is NaN): partials a kernel leaves undefined are masked first (`dcp.comm.merge_partials`)."""
    check_tensor("o1", o1, (-1, -1, -1))
    check_tensor("o2", o2, o1.shape, o1.dtype, o1.device)
    check_tensor("lse1", lse1, o1.shape[:2], None, o1.device)
    check_tensor("lse2", lse2, o1.shape[:2], lse1.dtype, o1.device)
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.nan_to_num(torch.exp(lse1 - lse), nan=0.0)[..., None]
    w2 = torch.nan_to_num(torch.exp(lse2 - lse), nan=0.0)[..., None]
    acc = torch.promote_types(o1.dtype, torch.float32)
    return (o1.to(acc) * w1 + o2.to(acc) * w2).to(o1.dtype), lse
