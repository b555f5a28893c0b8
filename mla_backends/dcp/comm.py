"""The collectives DCP needs, over a `torch.distributed` process group (gloo on CPU, NCCL on
GPUs), and the merge of the ranks' partial attentions by log-sum-exp.

Only fixed-shape collectives (all-gather, all-to-all): NCCL captures them in CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mla_backends.merge import merge_states

# torch 2.13 renamed all_gather_into_tensor (same arguments; the old name warns FutureWarning
# on every rank); older torch has only the old name.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class DCPGroup:
    """A process group seen as DCP ranks 0..N-1 (ranks in group order)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [*s] on every rank -> [N, *s], rank-major."""
        x = x.contiguous().view(1, *x.shape)  # gloo wants [N * d0, ...]: gather [1, ...] rows
        out = torch.empty(self.size, *x.shape[1:], dtype=x.dtype, device=x.device)
        _ALL_GATHER(out, x, group=self.group)
        return out

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, *s]: x[k] goes to rank k; returns [N, *s] whose [k] came from rank k."""
        x = x.contiguous()  # before empty_like, which would copy a transposed x's strides
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=self.group)
        return out

    def gather_heads(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H / N, *s] (this rank's heads) -> [T, H, *s], heads in rank order."""
        g = self.all_gather(x)  # [N, T, H / N, *s]
        return g.transpose(0, 1).reshape(x.shape[0], -1, *x.shape[2:])

    def scatter_heads(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, *s] -> [N, T, H / N, *s]: every rank's slice of rank k's heads."""
        t, h = x.shape[:2]
        chunks = x.reshape(t, self.size, h // self.size, *x.shape[2:]).transpose(0, 1)
        return self.all_to_all(chunks)


def merge_partials(
    out: torch.Tensor, lse: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge N partial attentions over disjoint key sets with `merge_states`, in fp32.

    out [N, T, H, L], lse [N, T, H], valid [N, T] bool (partial k saw at least one key).
    Invalid partials are taken as out 0 / lse -inf whatever a kernel wrote there (some return
    undefined values for rows without keys unless told on the host, which a captured graph
    cannot be), so a rank with no share contributes exactly nothing and a row no rank saw
    gives out 0 / lse -inf. Every rank folds in the same order: replicated results agree
    bit for bit across ranks. Returns (out [T, H, L] in out's dtype, lse [T, H] fp32)."""
    o = torch.where(valid[..., None, None], out.float(), 0.0)
    m = torch.where(valid[..., None], lse.float(), float("-inf"))
    acc_o, acc_lse = o[0], m[0]
    for k in range(1, out.shape[0]):
        acc_o, acc_lse = merge_states(acc_o, acc_lse, o[k], m[k])
    return acc_o.to(out.dtype), acc_lse
