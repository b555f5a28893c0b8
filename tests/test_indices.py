"""The index builder equals a plain Python gather on every page layout."""

from __future__ import annotations

import pytest
import torch

from mla_backends.batch import ForwardMode
from mla_backends.indices import (
    build_page_indices,
    build_page_table,
    build_token_indices,
    page_table_width,
)
from mla_backends.testing import Case, build_case, edge_kv_lens

LAYOUTS = ["monotonic", "shuffled", "interleaved", "mixed"]


def _layout(page: int, layout: str):  # type: ignore[no-untyped-def]
    lens = edge_kv_lens(page, long=150) + (3 * page + 2, 0, 7)
    case = Case(mode=ForwardMode.DECODE, page_size=page, kv_lens=lens, layout=layout, seed=page)
    rt, batch = build_case(case, torch.device("cpu"))
    return rt.req_pool.req_to_token, batch


def _python_pages(r2t: torch.Tensor, row: int, n: int, page: int) -> list[int]:
    return [int(r2t[row, i * page]) // page for i in range(-(-n // page))]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page", [1, 16, 32, 64, 128])
def test_builder_equals_python_gather(page: int, layout: str) -> None:
    r2t, batch = _layout(page, layout)
    rows, lens = batch.req_pool_indices.tolist(), batch.seq_lens_cpu.tolist()

    indptr, idx = build_token_indices(r2t, batch.req_pool_indices, batch.seq_lens, sum(lens))
    want = [int(r2t[r, i]) for r, n in zip(rows, lens) for i in range(n)]
    assert idx.dtype == torch.int32 and idx.tolist() == want
    assert indptr.tolist() == [sum(lens[:i]) for i in range(len(lens) + 1)]

    pages = [_python_pages(r2t, r, n, page) for r, n in zip(rows, lens)]
    total = sum(len(p) for p in pages)
    pindptr, pidx = build_page_indices(r2t, batch.req_pool_indices, batch.seq_lens, page, total)
    assert pidx.tolist() == [p for ps in pages for p in ps]
    assert pindptr.tolist() == [sum(len(p) for p in pages[:i]) for i in range(len(pages) + 1)]
    assert 0 not in pidx.tolist()  # the dummy page never appears in a real request
    # each page id really holds the request's tokens in order
    for r, n, ps in zip(rows, lens, pages):
        assert [ps[i // page] * page + i % page for i in range(n)] == r2t[r, :n].tolist()

    for fill, align in [(0, 1), (-1, 1), (0, max(1, 128 // page))]:
        width = page_table_width(max(lens), page, align)
        assert width % align == 0
        table = build_page_table(r2t, batch.req_pool_indices, batch.seq_lens, page, width, fill)
        assert table.shape == (len(rows), width) and table.dtype == torch.int32
        for b, ps in enumerate(pages):
            assert table[b].tolist() == ps + [fill] * (width - len(ps))


def test_builder_writes_static_buffers_in_place() -> None:
    r2t, batch = _layout(16, "mixed")
    lens = batch.seq_lens_cpu.tolist()
    indptr_buf = torch.full((64,), -7, dtype=torch.int32)
    idx_buf = torch.full((4096,), -7, dtype=torch.int32)
    table_buf = torch.full((64, 64), -7, dtype=torch.int32)
    ptrs = (indptr_buf.data_ptr(), idx_buf.data_ptr(), table_buf.data_ptr())
    b = batch.batch_size
    indptr, idx = build_token_indices(
        r2t, batch.req_pool_indices, batch.seq_lens, sum(lens), indptr_buf[: b + 1], idx_buf
    )
    width = page_table_width(max(lens), 16)
    table = build_page_table(
        r2t, batch.req_pool_indices, batch.seq_lens, 16, width, 0, out=table_buf
    )
    assert (indptr_buf.data_ptr(), idx_buf.data_ptr(), table_buf.data_ptr()) == ptrs
    assert idx.data_ptr() == idx_buf.data_ptr() and table.data_ptr() == table_buf.data_ptr()
    fresh = build_token_indices(r2t, batch.req_pool_indices, batch.seq_lens, sum(lens))
    assert torch.equal(indptr, fresh[0]) and torch.equal(idx, fresh[1])
    assert (idx_buf[sum(lens) :] == -7).all()  # nothing written past the batch


def test_page_table_width_is_never_zero_and_aligned() -> None:
    assert page_table_width(0, 64) == 1
    assert page_table_width(0, 32, align=4) == 4
    assert page_table_width(129, 32, align=4) == 8
    assert page_table_width(128, 128) == 1


def test_index_builders_return_int32_from_an_int64_request_table() -> None:
    """M09 (indices.py:89 `vals.to(torch.int32)` -> `vals`): the documented int32 indices
    whatever the table's integer dtype (the mutant returned int64 from an int64 table)."""

    r2t = torch.arange(2 * 64, dtype=torch.int64).view(2, 64) + 64
    rows, lens = torch.tensor([1, 0]), torch.tensor([5, 33], dtype=torch.int32)
    _, tok = build_token_indices(r2t, rows, lens, 38)
    _, pag = build_page_indices(r2t, rows, lens, 16, 1 + 3)
    assert tok.dtype == torch.int32 and pag.dtype == torch.int32
    assert tok.tolist() == list(range(128, 133)) + list(range(64, 97))
    assert pag.tolist() == [8, 4, 5, 6]


def test_prefix_slots_are_each_requests_prefix_built_once_per_batch() -> None:
    """Chunked-prefix prefill reads `prefix_slots` in every layer: the request-major slots of
    each cached prefix, built on the first call and the same tensor after (not once a layer)."""
    from mla_backends.batch import ForwardBatch

    r2t = torch.arange(3 * 8, dtype=torch.int32).view(3, 8) + 100
    loc = torch.zeros(4, dtype=torch.int64)
    batch = ForwardBatch.build(ForwardMode.EXTEND, [2, 0, 1], [3, 0, 2], [1, 2, 1], loc, "cpu")
    slots = batch.prefix_slots(r2t)
    assert slots.tolist() == [116, 117, 118, 108, 109]
    assert batch.prefix_slots(r2t) is slots


def test_arith_helpers_at_their_edges() -> None:
    """next_pow2 of 0 and of negatives is 1 (the docstring's max(n, 1); `(n - 1).bit_length()`
    alone gives 2 at 0); the indptr is int32 whatever the lengths' dtype (the kernels read
    int32), 0 first."""
    from mla_backends.arith import cumsum_indptr, next_pow2

    assert [next_pow2(n) for n in (-3, 0, 1, 2, 3, 8, 9)] == [1, 1, 1, 2, 4, 8, 16]
    indptr = cumsum_indptr(torch.tensor([3, 0, 5], dtype=torch.int64))
    assert indptr.dtype == torch.int32 and indptr.tolist() == [0, 3, 3, 8]
    assert cumsum_indptr(torch.zeros(0, dtype=torch.int64)).tolist() == [0]
