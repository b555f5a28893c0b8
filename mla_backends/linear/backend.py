"""Linear-attention backend (Gated DeltaNet, KDA) over a `LinearStatePool`.

EXTEND runs the recurrence per request from its stored state and stores the final state.
DECODE runs one step for the whole batch at once, gathering and scattering states by request
row: shapes depend only on the batch size, so it is graph-capturable, and padded rows (row 0)
read and write the dummy slot. The plain-PyTorch recurrence is the reference and the CPU
path; fla's kernels are not wired in yet (see the closing note of this issue's session).
"""

from __future__ import annotations

import torch

from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.checks import check_tensor
from mla_backends.linear.recurrence import gated_delta_rule
from mla_backends.linear.state_pool import LinearStatePool


class LinearAttentionBackend:
    name = "linear_torch"

    def __init__(self, pool: LinearStatePool, scale: float | None = None) -> None:
        self.pool = pool
        self.scale = scale
        self._batch: ForwardBatch | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode is ForwardMode.TARGET_VERIFY:
            raise NotImplementedError(
                "linear layers under TARGET_VERIFY need per-draft-token states for rollback; "
                "not built yet"
            )
        self._batch = batch

    # graph hooks: decode reads everything from the batch's static tensors
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        pass

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self.init_forward_metadata(batch)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        self.init_forward_metadata(batch)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
    ) -> torch.Tensor:
        """layer: index in the linear state pool. q, k [T, H, K], v [T, H, V], g [T, H] or
        [T, H, K], beta [T, H] -> o [T, H, V] fp32; the requests' states advance."""
        batch = self._batch
        if batch is None:
            raise RuntimeError("init_forward_metadata was not called for this batch")
        t, h, dk = q.shape
        rec = self.pool.recurrent
        check_tensor("k", k, (t, h, dk))
        check_tensor("v", v, (t, h, rec.shape[-1]))
        check_tensor("beta", beta, (t, h))
        if g.shape not in ((t, h), (t, h, dk)):
            raise ValueError(
                f"g: expected shape [{t}, {h}] (GDN) or [{t}, {h}, {dk}] (KDA), got {list(g.shape)}"
            )
        if batch.mode is ForwardMode.DECODE:
            return self._decode(layer, q, k, v, g, beta, batch.req_pool_indices.long())
        out = torch.empty(t, h, v.shape[-1], dtype=torch.float32, device=q.device)
        start = 0
        for row, n in zip(batch.req_pool_indices.tolist(), batch.extend_seq_lens_cpu.tolist()):
            sl = slice(start, start + n)
            out[sl], rec[layer, row] = gated_delta_rule(
                q[sl], k[sl], v[sl], g[sl], beta[sl], rec[layer, row], self.scale
            )
            start += n
        return out

    def _decode(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """One token per request, all requests at once (the batch is the recurrence's T=1)."""
        rec = self.pool.recurrent[layer]
        s = rec[rows]  # [B, H, K, V] (gather: a copy)
        scale = q.shape[-1] ** -0.5 if self.scale is None else self.scale
        decay = g.float().exp()
        s = s * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        err = v.float() - torch.einsum("bhkv,bhk->bhv", s, k.float())
        s = s + torch.einsum("bhk,bhv->bhkv", k.float(), beta.float()[..., None] * err)
        rec[rows] = s  # padded rows all write slot 0, the dummy
        return scale * torch.einsum("bhkv,bhk->bhv", s, q.float())
