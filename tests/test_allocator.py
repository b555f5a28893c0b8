"""The paged allocator: no slot handed out twice, none lost, dummy page never handed out."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
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


@pytest.mark.parametrize("page", [1, 16, 128])
def test_random_sequences_keep_table_lengths_and_free_list_consistent(page: int) -> None:
    """Random alloc_extend / alloc_decode / truncate / free / row free sequences, misuse
    included (truncating or freeing a row that holds nothing, non-integer lengths, more pages
    than are free), against a model of the state: every refused call leaves the allocator's
    lengths, `ReqToTokenPool.filled`, the table and the free list exactly as they were."""
    rng = random.Random(page)
    num_pages, max_ctx = 6, 4 * page
    rp = ReqToTokenPool(4, max_ctx, "cpu")
    alloc = PagedTokenAllocator(num_pages, page, rp)
    lens: dict[int, int] = {}  # rows holding KV -> length
    live: list[int] = []
    for _ in range(400):
        before = (alloc.available_pages, dict(lens), rp.filled.copy(), rp.req_to_token.clone())
        op = rng.randrange(6)
        row = rng.choice(live) if live and rng.random() < 0.9 else rng.randint(0, 5)
        try:
            if op == 0 and rp.available:
                live += rp.alloc()
                continue
            if op == 1:
                rows = rng.sample(live, rng.randint(0, len(live)))
                ext = [rng.choice([0, 1, page - 1, page, page + 1]) for _ in rows]
                if rows and rng.random() < 0.2:
                    ext[-1] = 1.5  # type: ignore[call-overload]  # refused before any row
                alloc.alloc_extend(rows, ext)
                for r, n in zip(rows, ext):
                    lens[r] = lens.get(r, 0) + n
            elif op == 2:
                n = rng.randint(0, lens.get(row, 0) + 1)
                alloc.truncate(row, n)
                assert row in lens, f"truncated row {row}, which holds no KV"
                lens[row] = n
            elif op == 3:
                alloc.free(row)
                del lens[row]
            elif op == 4:
                rp.free(row)
                live.remove(row)
            else:
                alloc.alloc_decode([row])
                lens[row] = lens.get(row, 0) + 1
        except (ValueError, TypeError, MemoryError):
            after = (alloc.available_pages, dict(lens), rp.filled.copy(), rp.req_to_token)
            assert before[0] == after[0], op
            assert (before[2] == after[2]).all() and torch.equal(before[3], after[3]), op
        held = [p for r in lens for p in alloc.pages(r)]
        assert len(held) == len(set(held)) and 0 not in held
        assert len(held) + alloc.available_pages == num_pages, "page leaked or freed twice"
        assert rp.filled[0] == max_ctx, "row 0 (padding) must keep its dummy positions"
        for r in range(1, rp.size + 1):
            assert alloc.holds(r) == (r in lens) and alloc.seq_len(r) == lens.get(r, 0)
            assert rp.filled[r] == lens.get(r, 0)
            assert len(alloc.pages(r)) == -(-lens.get(r, 0) // page)
    for r in list(lens):  # everything comes back
        alloc.free(r)
    assert alloc.available_pages == num_pages


def test_truncate_refuses_a_row_holding_no_kv() -> None:
    """Truncating a row that never held KV (or was freed) used to register it as held, with
    no pages: free() then raised KeyError, ReqToTokenPool.free refused the row forever (a
    leaked request row), and truncating row 0 zeroed the padding row's length."""
    rp = ReqToTokenPool(2, 32, "cpu")
    (row,) = rp.alloc(1)
    alloc = PagedTokenAllocator(4, 16, rp)
    for r in (row, 0, 2):
        with pytest.raises(ValueError, match=rf"row {r} holds no KV pages"):
            alloc.truncate(r, 0)
        assert not alloc.holds(r)
    assert rp.filled[0] == 32
    rp.free(row)  # the row is still free to go back
    (row,) = rp.alloc(1)
    alloc.alloc_extend([row], [3])
    alloc.free(row)
    with pytest.raises(ValueError, match=rf"row {row} holds no KV pages"):
        alloc.truncate(row, 0)
    rp.free(row)


def test_a_non_integer_length_is_refused_before_any_row_takes_pages() -> None:
    """A float length in the second row used to fail halfway: the first row had taken its
    pages and its length, but its req_to_token entries were never written (it would read the
    dummy slot 0 for its tokens)."""
    rp = ReqToTokenPool(2, 64, "cpu")
    rows = rp.alloc(2)
    alloc = PagedTokenAllocator(4, 16, rp)
    with pytest.raises(TypeError, match=r"extend_lens must be integers, got \[3, 2.5\]"):
        alloc.alloc_extend(rows, [3, 2.5])  # type: ignore[list-item]
    assert alloc.available_pages == 4 and not any(alloc.holds(r) for r in rows)
    assert rp.filled[rows].tolist() == [0, 0]
    slots = alloc.alloc_extend(rows, [torch.tensor(3), np.int64(2)])  # integers of any kind
    assert alloc.seq_len(rows[0]) == 3 and type(alloc.seq_len(rows[0])) is int
    assert torch.equal(rp.req_to_token[rows[0], :3].long(), slots[:3])


def test_an_allocations_tensor_work_does_not_grow_with_batch_or_context() -> None:
    """A decode step's allocation runs the same few tensor ops at batch 2 over 100 tokens as
    at batch 16 over 20k, page 1. Hazard: each request's whole page list became a tensor on
    every call, so the step's host time grew with context (272 ms at batch 16, 128k)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Count.n += 1
            return func(*args, **(kwargs or {}))

    ops = []
    for b, ctx in ((2, 100), (16, 20000)):
        rp = ReqToTokenPool(b, ctx + 8, "cpu")
        alloc = PagedTokenAllocator(b * (ctx + 8), 1, rp)
        rows = rp.alloc(b)
        alloc.alloc_extend(rows, [ctx] * b)
        Count.n = 0
        with Count():
            slots = alloc.alloc_decode(rows)
        ops.append(Count.n)
        want = [alloc.pages(r)[ctx] for r in rows]  # page 1: the slot is the new page
        assert slots.tolist() == want
        assert rp.req_to_token[rows, ctx].tolist() == want
    assert ops[0] == ops[1] <= 8, ops


def _allocators() -> list[tuple[str, ReqToTokenPool, object]]:
    """A plain allocator and both ranks of a DCP 2 allocator, each over its own table,
    rows 1 and 2 holding 5 and 30 tokens."""
    from mla_backends.dcp import DCPLayout, DCPTokenAllocator

    out: list[tuple[str, ReqToTokenPool, object]] = []
    for name in ("plain", "dcp-0", "dcp-1"):
        table = ReqToTokenPool(3, 64, "cpu")
        table.alloc(2)
        alloc: object = PagedTokenAllocator(8, 16, table)
        if name != "plain":
            alloc = DCPTokenAllocator(DCPLayout(int(name[-1]), 2), alloc)  # type: ignore[arg-type]
        out.append((name, table, alloc))
    for _, _, a in out:
        a.alloc_extend([1, 2], [5, 30])  # type: ignore[attr-defined]
    return out


def _host_state(table: ReqToTokenPool, alloc: object) -> tuple:
    inner = getattr(alloc, "local", alloc)
    return (
        table.filled.tolist(), table.allocated.tolist(), list(table._free_rows),
        sorted(table._used_rows), getattr(alloc, "filled", table.filled).tolist(),
        {r: inner.seq_len(r) for r in (1, 2)}, list(inner._free),
    )  # fmt: skip


@pytest.mark.parametrize("bad", [True, 1.0, "1"], ids=["bool", "float", "str"])
def test_free_and_truncate_refuse_a_row_that_is_not_an_integer(bad: object) -> None:
    """The free and truncate paths took the row as given: `free(True)` freed row 1 and then
    set every row's stored length to 0 (numpy's `filled[True] = 0`), so a batch reading 0 of
    row 2's 30 tokens passed the table's check; `free(1.0)` released row 1's pages, then
    failed before its length was cleared, and a batch over its old slots (another request's
    now) passed; DCP's `truncate(True, 3)` set every row's length to 3 (helper 65's fuzzing).
    Refused before anything changes, as every other row argument is."""
    for name, table, alloc in _allocators():
        calls: list[tuple[Any, tuple]] = [(alloc.free, (bad,)), (alloc.truncate, (bad, 3))]  # type: ignore[attr-defined]
        if name == "plain":
            calls.append((table.free, (bad,)))
        for fn, args in calls:
            before = _host_state(table, alloc)
            with pytest.raises(TypeError, match=r"row must be an integer"):
                fn(*args)
            assert _host_state(table, alloc) == before, (name, fn.__name__)


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_free_and_truncate_take_numpy_and_torch_integer_rows(kind: str) -> None:
    """As every other row argument: a torch integer was refused by the free paths as a row
    holding nothing (it hashes apart from the int), and a numpy one went back on the free
    list, to be handed out as a numpy integer."""
    wrap = torch.tensor if kind == "torch" else np.int64
    for name, table, alloc in _allocators():
        alloc.truncate(wrap(2), 17)  # type: ignore[attr-defined]
        assert alloc.seq_len(2) == 17, name  # type: ignore[attr-defined]
        for r in (1, 2):
            alloc.free(wrap(r))  # type: ignore[attr-defined]
        if name == "plain":
            table.free(wrap(1))  # type: ignore[arg-type]
            assert all(type(r) is int for r in table.alloc(1)), name


def test_truncate_takes_an_integer_length() -> None:
    """`truncate(row, True)` cut the row to 1 token, silently, in both allocators; a float
    length was a TypeError that named no argument (helper 67's sweep)."""
    for name, table, alloc in _allocators():
        for bad in (True, torch.tensor(True), 3.0):
            before = _host_state(table, alloc)
            with pytest.raises(TypeError, match=r"new_len must be an integer"):
                alloc.truncate(2, bad)  # type: ignore[attr-defined]
            assert _host_state(table, alloc) == before, name
        alloc.truncate(2, torch.tensor(17))  # type: ignore[attr-defined]
        assert alloc.seq_len(2) == 17, name  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "sizes, want",
    [
        ((8, 0), "page_size must be an integer >= 1, got 0"),
        ((0, 16), "num_pages must be an integer >= 1, got 0"),
        ((8, 16.0), "page_size must be an integer >= 1, got 16.0"),
    ],
    ids=["page-0", "pages-0", "page-float"],
)
def test_allocator_constructor_refuses_a_bad_size(sizes: tuple, want: str) -> None:
    """page_size 0 was taken, then the first allocation divided by zero. The refusal names
    the one size that is wrong."""
    with pytest.raises(ValueError, match=rf"^PagedTokenAllocator: {want}$"):
        PagedTokenAllocator(*sizes, ReqToTokenPool(4, 64, "cpu"))


def test_pages_go_out_in_page_order_and_come_back_to_be_handed_out_again_in_place() -> None:
    """Default order is 1, 2, ...; a given `page_order` hands out its first page first. Pages
    given back by truncate or free are the next handed out, in the row's order: a rejected
    draft re-extended (or the next request on a freed row) gets the same page table back."""
    rp = ReqToTokenPool(2, 64, "cpu")
    rows = rp.alloc(2)
    alloc = PagedTokenAllocator(6, 4, rp)
    alloc.alloc_extend([rows[0]], [12])
    assert alloc.pages(rows[0]) == [1, 2, 3]
    alloc.truncate(rows[0], 3)
    alloc.alloc_extend([rows[0]], [9])
    assert alloc.pages(rows[0]) == [1, 2, 3]
    alloc.free(rows[0])
    alloc.alloc_extend([rows[1]], [12])
    assert alloc.pages(rows[1]) == [1, 2, 3]
    shuffled = PagedTokenAllocator(4, 4, ReqToTokenPool(1, 64, "cpu"), [3, 1, 4, 2])
    shuffled.req_to_token.alloc(1)
    shuffled.alloc_extend([1], [9])
    assert shuffled.pages(1) == [3, 1, 4]


def test_a_negative_extend_length_is_refused_with_nothing_taken() -> None:
    """-1 for a row holding 20 tokens passed as 0 pages needed; the host arrays were then
    built for -1 tokens (a numpy error, not one naming the row and its length)."""
    for name, table, alloc in _allocators():
        before = _host_state(table, alloc)
        with pytest.raises(ValueError, match=r"row 2: extend length -1 < 0"):
            alloc.alloc_extend([1, 2], [2, -1])  # type: ignore[attr-defined]
        assert _host_state(table, alloc) == before, name


def test_a_row_may_fill_its_table_row_exactly() -> None:
    """max_context_len tokens fit (the limit is inclusive); one more is refused."""
    rp = ReqToTokenPool(1, 32, "cpu")
    (row,) = rp.alloc(1)
    alloc = PagedTokenAllocator(4, 16, rp)
    alloc.alloc_extend([row], [31])
    alloc.alloc_decode([row])
    assert alloc.seq_len(row) == 32 and rp.req_to_token[row].min() > 0
    with pytest.raises(ValueError, match="length 33 exceeds max_context_len 32"):
        alloc.alloc_decode([row])


def test_accounting_takes_a_torch_integer_row() -> None:
    """seq_len / holds / pages of `torch.tensor(row)`: a torch integer hashes apart from the
    int, so a plain dict lookup reported an empty row (length 0, no pages, not held)."""
    for name, _, alloc in _allocators():
        r = torch.tensor(2)
        assert alloc.seq_len(r) == 30 and alloc.holds(r), name  # type: ignore[attr-defined]
    plain = _allocators()[0][2]
    assert plain.pages(torch.tensor(2)) == plain.pages(2) != []  # type: ignore[attr-defined]
