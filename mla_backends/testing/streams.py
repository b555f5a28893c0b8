"""Decode streams for CUDA-graph tests: batches that change size, lengths and page tables from
step to step over one poisoned pool, and the forward a graph runner captures."""

from __future__ import annotations

import random
from typing import Any

import torch

from mla_backends.arith import cdiv
from mla_backends.backends.protocol import AttentionBackend
from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.config import KV_DTYPES
from mla_backends.reference import batch_reference
from mla_backends.testing.cases import Case
from mla_backends.testing.compare import effective_query
from mla_backends.testing.pools import fill_prefix, poisoned_runtime


class DecodeStream:
    """A stream of decode / verify batches over one poisoned pool, for graph tests: requests
    with random prompt lengths, each step a random subset of them (so batch sizes, lengths
    and page tables change from step to step) grows by q_len tokens."""

    def __init__(
        self,
        case: Case,
        device: torch.device | str,
        num_requests: int = 12,
        max_prompt: int = 300,
        max_context: int = 2048,
    ) -> None:
        self.case, self.device = case, torch.device(device)
        self.rng = random.Random(case.seed)
        self.gen = torch.Generator().manual_seed(case.seed)
        pages = num_requests * cdiv(max_context, case.page_size) + 1
        self.rt = poisoned_runtime(case, pages, num_requests, max_context, self.device, self.rng)
        self.rows = self.rt.req_pool.alloc(num_requests)
        prompts = [self.rng.randint(1, max_prompt) for _ in self.rows]
        fill_prefix(self.rt, self.rows, prompts, case, self.gen, self.rng)

    def step(self, n: int) -> tuple[ForwardBatch, dict[str, torch.Tensor]]:
        d, q, act = self.case.dims, max(self.case.q_len, 1), KV_DTYPES[self.case.dtype]
        rows = self.rng.sample(self.rows, n)
        prefix = [self.rt.allocator.seq_len(r) for r in rows]
        loc = self.rt.allocator.alloc_extend(rows, [q] * n)
        mode = ForwardMode.DECODE if q == 1 else ForwardMode.TARGET_VERIFY
        batch = ForwardBatch.build(mode, rows, prefix, [q] * n, loc, self.device)
        t, h = n * q, self.case.num_heads

        def rnd(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=self.gen).to(self.device, act)

        inputs = {
            "q_nope": rnd(t, h, d.kv_lora_rank),
            "q_rope": rnd(t, h, d.qk_rope_head_dim),
            "k_nope": rnd(t, d.kv_lora_rank),
            "k_rope": rnd(t, d.qk_rope_head_dim),
        }
        return batch, inputs

    def reference(
        self, batch: ForwardBatch, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Absorbed fp64 reference over the pool as it is now (new rows already stored):
        (out [T, H, L], lse [T, H])."""
        be = self.rt.backend
        q = effective_query(be, inputs["q_nope"], inputs["q_rope"])
        return batch_reference(
            self.rt.kv_pool,
            0,
            self.rt.req_pool.req_to_token,
            batch,
            *q,
            None,
            None,
            self.rt.config.model.softmax_scale,
            expanded=False,
        )


def absorbed_forward(
    backend: AttentionBackend,
    batch: ForwardBatch,
    inputs: dict[str, torch.Tensor],
    return_lse: bool = False,
) -> Any:
    """The forward a graph runner captures in tests: store the new rows, attend, layer 0;
    out, or (out, lse) with `return_lse`."""
    q_nope, q_rope, k_nope, k_rope = (inputs[k] for k in ("q_nope", "q_rope", "k_nope", "k_rope"))
    if return_lse:
        return backend.forward_absorbed(0, q_nope, q_rope, k_nope, k_rope, batch, True)
    return backend.forward_absorbed(0, q_nope, q_rope, k_nope, k_rope, batch)
