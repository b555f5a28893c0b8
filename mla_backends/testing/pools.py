"""Poisoned pools: a runtime whose KV pool is NaN except for the rows a case stores, on a
chosen page layout (shuffled, interleaved), and the batch that reads them."""

from __future__ import annotations

import random

import torch

from mla_backends.arith import cdiv
from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.config import KV_DTYPES, Config
from mla_backends.runtime import Runtime
from mla_backends.testing.cases import Case

FP8_SCALE = 0.037  # non-unit on purpose: a backend that ignores the scale fails


def poisoned_runtime(
    case: Case,
    num_pages: int,
    max_requests: int,
    max_context_len: int,
    device: torch.device,
    rng: random.Random,
) -> Runtime:
    """A one-layer runtime for the case's backend whose pool is all NaN (the dummy page
    too), pages handed out in the case's layout order; FP8 pools at `FP8_SCALE`."""
    cfg = Config(
        model=case.dims.with_heads(case.num_heads),
        num_layers=1,
        prefill_backend=case.backend,
        decode_backend=case.backend,
        page_size=case.page_size,
        kv_dtype=case.kv_dtype,
        dtype=case.dtype,
        num_pages=num_pages,
        max_requests=max_requests,
        max_context_len=max_context_len,
        device=str(device),
    )
    rt = Runtime.build(cfg, _page_order(case, num_pages, rng))
    rt.kv_pool.kv_buffer[0].fill_(float("nan"))
    if rt.kv_pool.is_fp8:
        rt.kv_pool.set_scale(0, FP8_SCALE)
    return rt


def _page_order(case: Case, num_pages: int, rng: random.Random) -> list[int] | None:
    if case.layout in ("shuffled", "mixed"):
        order = list(range(1, num_pages + 1))
        rng.shuffle(order)
        return order
    return None


def _q_lens(case: Case, rng: random.Random) -> list[int]:
    if case.mode is ForwardMode.EXTEND:
        if case.q_len:
            return [min(case.q_len, n) for n in case.kv_lens]
        # Short requests are whole prompts (no prefix); long ones extend a cached prefix by a
        # few tokens (a long q block adds cost, not coverage).
        return [n if n <= case.page_size + 1 else rng.randint(1, min(n, 24)) for n in case.kv_lens]
    return [case.q_len] * len(case.kv_lens)


def fill_prefix(
    rt: Runtime,
    rows: list[int],
    prefix: list[int],
    case: Case,
    gen: torch.Generator,
    rng: random.Random,
) -> None:
    """Allocate and store the cached prefix rows; "interleaved" grows requests in turns."""
    remaining = dict(zip(rows, prefix))
    turns = case.layout in ("interleaved", "mixed")
    chunk = max(1, case.page_size // 2) if turns else max(prefix, default=1)
    while any(remaining.values()):
        grow = [r for r in rows if remaining[r]]
        lens = [min(remaining[r], rng.randint(1, chunk) if turns else chunk) for r in grow]
        slots = rt.allocator.alloc_extend(grow, lens)
        _store_random(rt, slots, case, gen)
        for r, n in zip(grow, lens):
            remaining[r] -= n


def random_rows(
    n: int, case: Case, gen: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` new latent rows (k_nope [n, L], k_rope [n, R]) in the case's activation dtype."""
    d = case.dims
    k_nope = torch.randn(n, d.kv_lora_rank, generator=gen).to(device, KV_DTYPES[case.dtype])
    k_rope = (2.0 * torch.randn(n, d.qk_rope_head_dim, generator=gen)).to(
        device, KV_DTYPES[case.dtype]
    )
    return k_nope, k_rope


def _store_random(rt: Runtime, slots: torch.Tensor, case: Case, gen: torch.Generator) -> None:
    k_nope, k_rope = random_rows(slots.numel(), case, gen, rt.kv_pool.device)
    for layer in range(rt.config.num_layers):
        rt.kv_pool.set_mla_kv_buffer(layer, slots, k_nope, k_rope)


def build_case(case: Case, device: torch.device) -> tuple[Runtime, ForwardBatch]:
    """A runtime whose pool is NaN except for the rows the case stores, and the batch."""
    rng = random.Random(case.seed)
    gen = torch.Generator().manual_seed(case.seed)
    q_lens = _q_lens(case, rng)
    prefix = [max(n - q, 0) for n, q in zip(case.kv_lens, q_lens)]
    pages = sum(cdiv((n + 1), case.page_size) for n in case.kv_lens) + 2
    max_context = max(max(case.kv_lens, default=1), 1) + 1
    rt = poisoned_runtime(case, pages, len(case.kv_lens) + 1, max_context, device, rng)
    rows = rt.req_pool.alloc(len(case.kv_lens))
    # Unused request rows point at NaN slots too (slot 0 is the dummy page, also NaN).
    fill_prefix(rt, rows, prefix, case, gen, rng)
    # A zero-length KV row (kv_len 0) in DECODE / VERIFY keeps its query but sees no keys: its
    # new row goes to the dummy page and its seq_len stays 0 (the contract: out 0, lse -inf).
    live = [r for r, n in zip(rows, case.kv_lens) if n > 0]
    live_q = [q for q, n in zip(q_lens, case.kv_lens) if n > 0]
    new_slots = rt.allocator.alloc_extend(live, live_q)
    parts, start = [], 0
    for n, q in zip(case.kv_lens, q_lens):
        if n > 0:
            parts.append(new_slots[start : start + q])
            start += q
        else:
            parts.append(torch.zeros(q, dtype=torch.int64, device=new_slots.device))
    out_loc = torch.cat(parts) if parts else new_slots
    batch = ForwardBatch.build(case.mode, rows, prefix, q_lens, out_loc, device)
    if any(n == 0 for n in case.kv_lens):
        seq = torch.tensor(list(case.kv_lens), dtype=torch.int32)
        batch.seq_lens_cpu, batch.seq_lens = seq, seq.to(device)
        # A row shorter than its queries (kv 1, q 2) then reads fewer tokens than it stored:
        # the table is told so (`check_batch` refuses a batch that reads fewer than stored).
        rt.req_pool.filled[rows] = list(case.kv_lens)
    return rt, batch
