"""Log-sum-exp merge of partial attentions (chunked-prefix prefill, split KV on the host)."""

from __future__ import annotations

import torch


def merge_states(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions over disjoint key sets: o [n, h, d], lse [n, h].
    A side with lse = -inf (no keys) contributes nothing; both empty gives 0 / -inf."""
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.nan_to_num(torch.exp(lse1 - lse), nan=0.0)[..., None]
    w2 = torch.nan_to_num(torch.exp(lse2 - lse), nan=0.0)[..., None]
    acc = torch.promote_types(o1.dtype, torch.float32)
    return (o1.to(acc) * w1 + o2.to(acc) * w2).to(o1.dtype), lse
