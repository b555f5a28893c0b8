"""The paged allocator: no slot handed out twice, none lost, dummy page never handed out."""

from __future__ import annotations

import random

import pytest
import torch

from mla_backends.allocator import OutOfPagesError, PagedTokenAllocator
from mla_backends.pool import ReqToTokenPool

PAGE_SIZES = [1, 16, 32, 64, 128]


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_random_alloc_free_keeps_invariants(page: int) -> None:
    rng = random.Random(page)
    num_pages = 40
    rp = ReqToTokenPool(12, 40 * 128, "cpu")
    order = list(range(1, num_pages + 1))
    rng.shuffle(order)
    alloc = PagedTokenAllocator(num_pages, page, rp, order)
    tokens: dict[int, list[int]] = {}  # row -> slots in order
    live_rows: list[int] = []
    extended: set[int] = set()  # rows that hold KV (free() refuses rows that never did)
    for _ in range(1000):
        op = rng.random()
        if op < 0.15 and live_rows:
            row = live_rows.pop(rng.randrange(len(live_rows)))
            if row in extended:
                alloc.free(row)
                extended.remove(row)
            rp.free(row)
            del tokens[row]
        elif op < 0.25 and extended:
            row = rng.choice(sorted(extended))
            keep = rng.randint(0, len(tokens[row]))
            alloc.truncate(row, keep)
            del tokens[row][keep:]
        else:
            if rp.available and (not live_rows or rng.random() < 0.3):
                live_rows += rp.alloc()
                tokens[live_rows[-1]] = []
            rows = rng.sample(live_rows, rng.randint(1, len(live_rows)))
            lens = [rng.choice([1, 1, 2, page - 1 or 1, page, page + 1, 3 * page]) for _ in rows]
            free_before = alloc.available_pages
            try:
                slots = alloc.alloc_extend(rows, lens)
            except OutOfPagesError as e:
                assert e.free == free_before and e.requested > free_before
                assert alloc.available_pages == free_before  # all-or-nothing
                continue
            start = 0
            extended.update(rows)
            for row, n in zip(rows, lens):
                tokens[row].extend(slots[start : start + n].tolist())
                start += n
        # invariants after every operation
        all_slots = [s for ts in tokens.values() for s in ts]
        assert len(all_slots) == len(set(all_slots)), "slot handed out twice"
        assert all(s >= page for s in all_slots), "dummy page handed out"
        held = {p for row in tokens for p in alloc.pages(row)}
        assert len(held) + alloc.available_pages == num_pages, "page lost"
        assert 0 not in held
        for row, ts in tokens.items():
            assert alloc.seq_len(row) == len(ts)
            assert rp.req_to_token[row, : len(ts)].tolist() == ts
            # tokens fill their pages in order
            pages = alloc.pages(row)
            assert [s // page for s in ts] == [pages[i // page] for i in range(len(ts))]
            assert [s % page for s in ts] == [i % page for i in range(len(ts))]


def test_out_of_pages_names_requested_and_free() -> None:
    rp = ReqToTokenPool(4, 1024, "cpu")
    rp.alloc(2)
    alloc = PagedTokenAllocator(4, 16, rp)
    alloc.alloc_extend([1], [40])  # 3 pages
    with pytest.raises(OutOfPagesError, match=r"requested 2 page\(s\) of 16 tokens, 1 free"):
        alloc.alloc_extend([2], [17])
    assert alloc.available_pages == 1
    slots = alloc.alloc_extend([1], [8])  # fits in the last page: no new page
    assert slots.tolist() == list(range(slots[0], slots[0] + 8))


def test_decode_takes_a_new_page_only_when_the_last_is_full() -> None:
    rp = ReqToTokenPool(2, 1024, "cpu")
    rp.alloc(1)
    alloc = PagedTokenAllocator(8, 16, rp)
    alloc.alloc_extend([1], [15])
    assert len(alloc.pages(1)) == 1
    alloc.alloc_decode([1])
    assert len(alloc.pages(1)) == 1
    alloc.alloc_decode([1])
    assert len(alloc.pages(1)) == 2


def test_bad_requests_are_refused() -> None:
    rp = ReqToTokenPool(2, 32, "cpu")
    rp.alloc(2)
    alloc = PagedTokenAllocator(8, 16, rp)
    with pytest.raises(ValueError, match="exceeds max_context_len 32"):
        alloc.alloc_extend([1], [33])
    with pytest.raises(ValueError, match="appears twice"):
        alloc.alloc_extend([1, 1], [1, 1])
    with pytest.raises(ValueError, match="not a request row"):
        alloc.alloc_extend([0], [1])
    with pytest.raises(ValueError, match="holds no KV pages"):
        alloc.free(2)
    with pytest.raises(ValueError, match="permutation"):
        PagedTokenAllocator(3, 16, rp, [0, 1, 2])
    assert alloc.available_pages == 8


def test_dummy_page_never_handed_out_even_when_exhausted() -> None:
    rp = ReqToTokenPool(1, 4096, "cpu")
    rp.alloc(1)
    alloc = PagedTokenAllocator(5, 64, rp)
    slots = alloc.alloc_extend([1], [5 * 64])
    assert slots.min() >= 64 and torch.unique(slots).numel() == 320
    with pytest.raises(OutOfPagesError):
        alloc.alloc_decode([1])


def test_a_row_holding_kv_is_not_freed_nor_handed_out_again() -> None:
    """Freeing a request row whose KV pages the allocator still holds is refused (handed out
    again, the row kept the old request's length and slots: the new request's prompt was
    appended after them and attended over the old request's KV). KV first, then the row: the
    next request on that row starts empty."""
    rp = ReqToTokenPool(2, 64, "cpu")
    alloc = PagedTokenAllocator(8, 16, rp)
    (row,) = rp.alloc(1)
    alloc.alloc_extend([row], [20])
    with pytest.raises(ValueError, match=rf"row {row} still holds KV pages; free them first"):
        rp.free(row)
    assert rp.allocated[row] and alloc.seq_len(row) == 20  # nothing changed
    alloc.free(row)
    rp.free(row)
    (again,) = rp.alloc(1)
    slots = alloc.alloc_extend([again], [5])
    assert again == row and alloc.seq_len(again) == 5
    assert torch.equal(rp.req_to_token[again, :5].long(), slots)
