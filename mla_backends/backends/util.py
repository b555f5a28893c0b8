"""Helpers the backends share: the joined query view and the empty-row contract."""

from __future__ import annotations

import torch

from mla_backends.batch import ForwardBatch


def joined_query(q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
    """[T, H, L + R] query for kernels that take it whole (FlashMLA, TRT-LLM). Zero-copy when
    the caller passed q_nope / q_rope as the two column ranges of one [T, H, L + R] buffer
    (what a model writing both projections into one buffer gets); otherwise a copy."""
    lat = q_nope.shape[-1]
    if (
        q_rope.data_ptr() == q_nope.data_ptr() + lat * q_nope.element_size()
        and q_nope.stride() == q_rope.stride()
        and q_nope.stride(-1) == 1
        and q_nope.stride(1) == lat + q_rope.shape[-1]
        and q_nope.stride(0) == q_nope.shape[1] * q_nope.stride(1)
    ):
        return q_nope.as_strided((*q_nope.shape[:2], q_nope.stride(1)), q_nope.stride())
    return torch.cat([q_nope, q_rope], dim=-1)


def mask_empty_rows(
    out: torch.Tensor, lse: torch.Tensor | None, batch: ForwardBatch
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Contract for zero-length KV rows: out 0, lse -inf, whatever a kernel wrote there.
    Decided on the host from the CPU lengths, so batches without such rows (all decode
    steps, every padded graph batch) pay nothing."""
    if not bool((batch.seq_lens_cpu == 0).any()):
        return out, lse
    empty = (batch.seq_lens == 0).repeat_interleave(
        batch.extend_seq_lens.long(), output_size=batch.num_tokens
    )
    out = out.masked_fill(empty[:, None, None], 0.0)
    return out, None if lse is None else lse.masked_fill(empty[:, None], float("-inf"))
