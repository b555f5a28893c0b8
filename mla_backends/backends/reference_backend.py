"""`ReferenceBackend`: the fp64 references (`mla_backends.reference`) behind the backend
interface, so a whole model can run on them (`run` checks a backend's logits against it)."""

from __future__ import annotations

import torch
from torch import Tensor

from mla_backends.backends.base import MLABackend
from mla_backends.batch import ForwardBatch, RaggedLayout
from mla_backends.reference import batch_reference, mha


class ReferenceBackend(MLABackend):
    """The fp64 references as a backend: absorbed attention by `batch_reference` (the
    `absorbed` form over the pool's stored rows), MHA-mode prefill by `mha`, one request at a
    time, with host syncs: slow, for checking. Never registered, so no config can pick it."""

    name = "reference"

    def _build_metadata(self, batch: ForwardBatch) -> None:
        return None  # everything is read per call from the batch

    def _attend_absorbed(
        self, layer: int, q_nope: Tensor, q_rope: Tensor, batch: ForwardBatch, need_lse: bool
    ) -> tuple[Tensor, Tensor | None]:
        out, lse = batch_reference(
            self.pool,
            layer,
            self.req_to_token,
            batch,
            q_nope,
            q_rope,
            None,
            None,
            self.scale,
            expanded=False,
        )
        return out.to(q_nope.dtype), lse.float()

    def _attend_mha(
        self, q: Tensor, k: Tensor, v: Tensor, layout: RaggedLayout, causal: bool, need_lse: bool
    ) -> tuple[Tensor, Tensor | None]:
        qo, kv = layout.qo_indptr_cpu.tolist(), layout.kv_indptr_cpu.tolist()
        outs, lses = [], []
        for i in range(layout.batch_size):
            o, lse = mha(
                q[qo[i] : qo[i + 1]], k[kv[i] : kv[i + 1]], v[kv[i] : kv[i + 1]], self.scale, causal
            )
            outs.append(o)
            lses.append(lse)
        if not outs:
            return q.new_zeros(0, q.shape[1], v.shape[-1]), q.new_zeros(0, q.shape[1]).float()
        return torch.cat(outs).to(q.dtype), torch.cat(lses).float()
