"""Paged token allocator: hands out whole pages, a request's tokens fill its pages in order.

All bookkeeping is on the host (the scheduler's side); the only device work is one copy of the
new tokens' slots and one scatter into `req_to_token` per allocation call. Allocation is
all-or-nothing: if the pages do not suffice, nothing is taken and `OutOfPagesError` names the
numbers.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch

from mla_backends.arith import cdiv
from mla_backends.batch import as_int, as_int_at_least, as_ints
from mla_backends.pool import ReqToTokenPool


class OutOfPagesError(MemoryError):
    """`rank`: the DCP rank whose pages ran out (every rank of the group raises the same)."""

    def __init__(self, requested: int, free: int, page_size: int, rank: int | None = None) -> None:
        where = "" if rank is None else f" on DCP rank {rank}"
        super().__init__(
            f"out of KV pages{where}: requested {requested} page(s) of {page_size} tokens, "
            f"{free} free"
        )
        self.requested = requested
        self.free = free
        self.rank = rank


def truncate_from(lens: dict[int, int], row: int, new_len: int) -> int:
    """The length of `row` (in an allocator's `lens`) that a truncate to `new_len` shrinks;
    ValueError unless the row holds KV and 0 <= new_len <= that length. Hazard: truncating a
    row without KV made it look held (free() then failed, and the row leaked for good)."""
    if row not in lens:
        raise ValueError(f"row {row} holds no KV pages")
    old = lens[row]
    if not 0 <= new_len <= old:
        raise ValueError(f"row {row}: cannot truncate length {old} to {new_len}")
    return old


class PagedTokenAllocator:
    """Owns the free-page list and each request row's pages and length.

    `page_order` fixes the order pages are handed out in (default 1, 2, ...); tests pass a
    shuffled order to get non-monotonic page tables. Page 0 is the dummy page and is never
    handed out.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        req_to_token: ReqToTokenPool,
        page_order: Sequence[int] | None = None,
    ) -> None:
        # Hazard: page_size 0 was taken, then divided by zero at the first allocation
        num_pages = as_int_at_least(num_pages, "PagedTokenAllocator: num_pages", 1)
        page_size = as_int_at_least(page_size, "PagedTokenAllocator: page_size", 1)
        order = list(range(1, num_pages + 1)) if page_order is None else list(page_order)
        if sorted(order) != list(range(1, num_pages + 1)):
            raise ValueError(f"page_order must be a permutation of 1..{num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.req_to_token = req_to_token
        self._free: list[int] = order[::-1]  # pop() from the end hands out order[0] first
        self._pages: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        req_to_token.add_holder(self.holds)  # the table refuses to free a row we hold

    @property
    def available_pages(self) -> int:
        return len(self._free)

    @property
    def available_tokens(self) -> int:
        return len(self._free) * self.page_size

    def seq_len(self, row: int) -> int:
        return self._lens.get(operator.index(row), 0)  # a torch integer hashes apart: 0

    def holds(self, row: int) -> bool:
        """True if the request row has been allocated KV (even if truncated to 0 since)."""
        return operator.index(row) in self._lens

    def pages(self, row: int) -> list[int]:
        return list(self._pages.get(operator.index(row), []))

    def _pages_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.page_size)

    def alloc_extend(self, rows: Sequence[int], extend_lens: Sequence[int]) -> torch.Tensor:
        """Append `extend_lens[i]` tokens to request `rows[i]`; return their slots.

        Returns int64 `[sum(extend_lens)]` on the pool device, request-major, and writes the
        same slots into `req_to_token[row, old_len : old_len + n]`. Allocate the tokens of the
        batch that stores them, not ahead: a batch must read what its rows hold (`check_batch`).
        """
        if len(rows) != len(extend_lens):
            raise ValueError(f"rows ({len(rows)}) and extend_lens ({len(extend_lens)}) differ")
        # Hazard: checked before anything is taken; a float length failed halfway through the
        # loop below, after earlier rows had taken pages but before req_to_token was written.
        rows, extend_lens = as_ints(rows, "rows"), as_ints(extend_lens, "extend_lens")
        if len(set(rows)) != len(rows):
            raise ValueError(f"a request row appears twice in one allocation: {list(rows)}")
        max_len = self.req_to_token.max_context_len
        needed = 0
        for row, n in zip(rows, extend_lens):
            if n < 0:
                raise ValueError(f"row {row}: extend length {n} < 0")
            if not 1 <= row <= self.req_to_token.size:
                raise ValueError(f"row {row} is not a request row (1..{self.req_to_token.size})")
        self.req_to_token.check_rows(list(rows))
        for row, n in zip(rows, extend_lens):
            new_len = self.seq_len(row) + n
            if new_len > max_len:
                raise ValueError(f"row {row}: length {new_len} exceeds max_context_len {max_len}")
            needed += self._pages_for(new_len) - len(self._pages.get(row, []))
        if needed > len(self._free):
            raise OutOfPagesError(needed, len(self._free), self.page_size)

        # Slot, row and position of every new token, built on the host from the pages the
        # new tokens land in only. Hazard: converting a row's whole page list per request
        # made each decode step's host time grow with context (~17 ms a request at page 1,
        # 128k).
        ps, total = self.page_size, sum(extend_lens)
        host = np.empty((3, total), dtype=np.int64)  # slots, rows, positions
        at = 0
        for row, n in zip(rows, extend_lens):
            start = self.seq_len(row)
            pages = self._pages.setdefault(row, [])
            for _ in range(self._pages_for(start + n) - len(pages)):
                pages.append(self._free.pop())
            if n == 1:  # decode: plain ints
                host[0, at] = pages[start // ps] * ps + start % ps
                host[2, at] = start
            elif n:
                pos = np.arange(start, start + n, dtype=np.int64)
                first = start // ps
                touched = np.asarray(pages[first : cdiv(start + n, ps)], dtype=np.int64)
                host[0, at : at + n] = touched[pos // ps - first] * ps + pos % ps
                host[2, at : at + n] = pos
            host[1, at : at + n] = row
            at += n
            self._lens[row] = start + n
            self.req_to_token.filled[row] = start + n
        dev = torch.from_numpy(host).to(self.req_to_token.device)  # one copy for the three
        if total:
            self.req_to_token.req_to_token[dev[1], dev[2]] = dev[0].to(torch.int32)
        return dev[0]

    def alloc_decode(self, rows: Sequence[int]) -> torch.Tensor:
        return self.alloc_extend(rows, [1] * len(rows))

    def truncate(self, row: int, new_len: int) -> None:
        """Shrink a request to `new_len` tokens (rejected draft tokens), freeing whole pages."""
        row, new_len = as_int(row, "row"), as_int(new_len, "new_len")
        truncate_from(self._lens, row, new_len)
        pages = self._pages.get(row, [])
        keep = self._pages_for(new_len)
        self._free.extend(reversed(pages[keep:]))
        del pages[keep:]
        self._lens[row] = new_len
        self.req_to_token.filled[row] = new_len

    def free(self, row: int) -> None:
        """Return all pages of a request. Its req_to_token row is left as is (stale, unread)."""
        row = as_int(row, "row")
        if row not in self._lens:
            raise ValueError(f"row {row} holds no KV pages")
        self._free.extend(reversed(self._pages.pop(row)))
        del self._lens[row]
        self.req_to_token.filled[row] = 0
