"""Triton version of the index builder (`mla_backends.indices`): same outputs, on the GPU,
writing into preallocated (static) buffers, sizes from the host, no sync."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_backends.arith import cdiv, cumsum_indptr, next_pow2

BLOCK = 128


@triton.jit
def _page_table_kernel(
    R2T,
    Rows,
    SeqLens,
    Out,
    stride_r2t,
    stride_out,
    max_ctx,
    width,
    fill,
    PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(Rows + b).to(tl.int64)
    n_pages = (tl.load(SeqLens + b) + PAGE - 1) // PAGE
    tok = tl.minimum(cols * PAGE, max_ctx - 1)
    used = cols < n_pages
    slot = tl.load(R2T + row * stride_r2t + tok, mask=used & (cols < width), other=0)
    page = tl.where(used, slot // PAGE, fill)
    tl.store(Out + b * stride_out + cols, page.to(tl.int32), mask=cols < width)


@triton.jit
def _segment_gather_kernel(
    R2T,
    Rows,
    Lens,
    Indptr,
    Out,
    stride_r2t,
    STEP: tl.constexpr,
    DIV: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Out[indptr[b] + i] = r2t[row_b, i * STEP] // DIV for i < lens[b]."""
    b = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n = tl.load(Lens + b)
    _gather_row(R2T, Rows, Out, stride_r2t, b, tl.load(Indptr + b), i, n, STEP, DIV)


@triton.jit
def _gather_row(R2T, Rows, Out, stride_r2t, b, start, i, n, STEP: tl.constexpr, DIV: tl.constexpr):
    """Out[start + i] = r2t[rows[b], i * STEP] // DIV where i < n."""
    row = tl.load(Rows + b).to(tl.int64)
    ok = i < n
    v = tl.load(R2T + row * stride_r2t + i * STEP, mask=ok, other=0)
    tl.store(Out + start + i, (v // DIV).to(tl.int32), mask=ok)


@triton.jit
def flat_pages_block(
    R2T,
    Rows,
    SeqLens,
    Out,
    stride_r2t,
    n_rows,
    b,
    blk,
    PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Out[start_b + i] = r2t[row_b, i * PAGE] // PAGE for i in block `blk` of request b's
    ceil(seq_b / PAGE) pages; start_b (the exclusive prefix sum of page counts) is summed
    here, so no indptr is needed."""
    i = blk * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, BLOCK_B)
    lens = tl.load(SeqLens + ks, mask=(ks < b) & (ks < n_rows), other=0)
    start = tl.sum((lens + PAGE - 1) // PAGE)
    n = (tl.load(SeqLens + b) + PAGE - 1) // PAGE
    _gather_row(R2T, Rows, Out, stride_r2t, b, start, i, n, PAGE, PAGE)


@triton.jit
def _flat_page_indices_kernel(
    R2T,
    Rows,
    SeqLens,
    Out,
    stride_r2t,
    n_rows,
    PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    flat_pages_block(
        R2T,
        Rows,
        SeqLens,
        Out,
        stride_r2t,
        n_rows,
        tl.program_id(0),
        tl.program_id(1),
        PAGE,
        BLOCK,
        BLOCK_B,
    )


def flat_page_indices(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    total_pages: int,
    max_pages: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Page ids of every request back to back ([total_pages] int32), in one launch: for
    planners that keep the indptr on the host (FlashInfer)."""
    b = rows.numel()
    if out is None:
        out = torch.empty(max(total_pages, 1), dtype=torch.int32, device=rows.device)
    if b and max_pages:
        grid = (b, cdiv(max_pages, BLOCK))
        _flat_page_indices_kernel[grid](
            req_to_token,
            rows,
            seq_lens,
            out,
            req_to_token.stride(0),
            b,
            PAGE=page_size,
            BLOCK=BLOCK,
            BLOCK_B=next_pow2(b),
        )
    return out[:total_pages]


def page_table(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    width: int,
    fill: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    b = rows.numel()
    if out is None:
        out = torch.empty(b, width, dtype=torch.int32, device=rows.device)
    elif out.shape[0] < b or out.shape[1] < width:  # the kernel would write past its end
        raise ValueError(f"page_table: out {list(out.shape)} cannot hold {b} rows x {width} pages")
    if b:
        grid = (b, cdiv(width, BLOCK))
        _page_table_kernel[grid](
            req_to_token,
            rows,
            seq_lens,
            out,
            req_to_token.stride(0),
            out.stride(0),
            req_to_token.shape[1],
            width,
            fill,
            PAGE=page_size,
            BLOCK=BLOCK,
        )
    return out[:b, :width]


def _segments(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    total: int,
    max_len: int,
    step: int,
    indptr_out: torch.Tensor | None,
    indices_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    indptr = cumsum_indptr(lens.to(torch.int32), indptr_out)
    out = (
        indices_out
        if indices_out is not None
        else torch.empty(max(total, 1), dtype=torch.int32, device=rows.device)
    )
    if rows.numel() and max_len:
        grid = (rows.numel(), cdiv(max_len, BLOCK))
        _segment_gather_kernel[grid](
            req_to_token,
            rows,
            lens,
            indptr,
            out,
            req_to_token.stride(0),
            STEP=step,
            DIV=step,
            BLOCK=BLOCK,
        )
    return indptr, out[:total]


def token_indices(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    total: int,
    max_len: int,
    indptr_out: torch.Tensor | None = None,
    indices_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _segments(req_to_token, rows, seq_lens, total, max_len, 1, indptr_out, indices_out)


def page_indices(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    total_pages: int,
    max_pages: int,
    indptr_out: torch.Tensor | None = None,
    indices_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    n_pages = cdiv(seq_lens, page_size)
    return _segments(
        req_to_token, rows, n_pages, total_pages, max_pages, page_size, indptr_out, indices_out
    )
