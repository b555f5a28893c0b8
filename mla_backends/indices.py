"""The one index builder: every paged layout a kernel takes comes from `req_to_token` here.

- token level: `kv_indptr [B+1]`, `kv_indices [sum seq_lens]` (slots), FlashInfer page 1;
- page level: `page_indptr [B+1]`, `page_indices [sum ceil(seq/page)]` (page ids);
- dense page tables `[B, W]` with a stated tail fill (FlashMLA, CUTLASS, TRT-LLM).

Sizes the host needs (totals, widths) are passed in from the batch's CPU copies, so nothing
here reads the device: no sync, and every function can write into preallocated (static)
buffers via `out=` so CUDA-graph replay refills in place.
"""

from __future__ import annotations

import torch

from mla_backends.arith import cdiv, cumsum_indptr, round_up


def segment_ids(indptr: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of `total` flat positions: (segment index [total] int64, offset in segment)."""
    pos = torch.arange(total, device=indptr.device, dtype=torch.int64)
    seg = torch.searchsorted(indptr[1:].to(torch.int64), pos, right=True)
    return seg, pos - indptr.to(torch.int64)[seg]


def build_token_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    total_tokens: int,
    indptr_out: torch.Tensor | None = None,
    indices_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level (kv_indptr [B+1] int32, kv_indices [total_tokens] int32): the page level at
    page size 1."""
    return build_page_indices(
        req_to_token, req_pool_indices, seq_lens, 1, total_tokens, indptr_out, indices_out
    )


def build_page_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    total_pages: int,
    indptr_out: torch.Tensor | None = None,
    indices_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Page-level (page_indptr [B+1] int32, page_indices [total_pages] int32).

    Page k of a request is the page holding its token k * page_size (tokens fill pages in
    order, so that token's slot // page_size is the page id)."""
    tokens = page_size == 1  # a page is a token: no rounding, no division
    num_pages = seq_lens if tokens else cdiv(seq_lens, page_size).to(torch.int32)
    indptr = cumsum_indptr(num_pages, indptr_out)
    seg, off = segment_ids(indptr, total_pages)
    rows = req_pool_indices.to(torch.int64)[seg]
    if tokens:
        vals = req_to_token[rows, off]
    else:
        vals = torch.div(req_to_token[rows, off * page_size], page_size, rounding_mode="floor")
    if indices_out is None:
        return indptr, vals.to(torch.int32)
    indices_out[:total_pages].copy_(vals)
    return indptr, indices_out[:total_pages]


def build_page_table(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    width: int,
    fill: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense int32 page table [B, width]; entries past a request's last page hold `fill`.

    `width` comes from the host (max pages over the batch, or the static graph maximum),
    padded by the caller to whatever multiple its kernel needs (see `page_table_width`)."""
    if req_to_token.is_cuda:  # one launch instead of a chain of gathers
        from mla_backends.kernels.index import page_table

        return page_table(req_to_token, req_pool_indices, seq_lens, page_size, width, fill, out)
    b = req_pool_indices.numel()
    max_ctx = req_to_token.shape[1]
    cols = torch.arange(width, device=req_to_token.device, dtype=torch.int64)
    # Hazard: a padded width can point past req_to_token's row; clamp before the gather and
    # let the mask below replace those entries.
    tok = (cols * page_size).clamp_(max=max_ctx - 1)
    rows = req_pool_indices.to(torch.int64)[:, None]
    pages = torch.div(req_to_token[rows, tok[None, :]], page_size, rounding_mode="floor")
    used = cols[None, :] < cdiv(seq_lens.to(torch.int64), page_size)[:, None]
    table = torch.where(used, pages, torch.full_like(pages, fill)).to(torch.int32)
    if out is None:
        return table
    out[:b, :width].copy_(table)
    return out[:b, :width]


def page_table_width(max_seq_len: int, page_size: int, align: int = 1) -> int:
    """Columns a page table needs for `max_seq_len` tokens, rounded up to `align` blocks
    (TRT-LLM and CUTLASS want a multiple of 128 / page_size). Never 0: kernels reject empty."""
    return max(round_up(cdiv(max_seq_len, page_size), align), align)
