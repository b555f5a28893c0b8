"""Which rank stores which token: token-interleaved. Global position p of a request lives on
rank p % N at local index p // N.

Why by token, not by page:
- every request is split evenly at every length (shares differ by at most one token), so a
  batch of short requests still spreads its reads over all ranks; with page interleaving a
  request shorter than one page sits wholly on rank 0, and rank 0 does all the work until
  requests pass N pages;
- decode's new token rotates over the ranks, so stores (and page growth) spread evenly;
- the local length is one closed form of the global length,
  `local(s, r) = max(0, ceil((s - r) / N)) = (s + N - 1 - r) // N` (s >= 0), cheap on the
  device under CUDA graphs; with pages it is a page-level function of s and the page size.
- local indices are in position order, so the keys a query at global visibility V may see
  (global positions < V) are a prefix of the rank's local sequence, of length local(V, r):
  every per-rank attention is an ordinary causal attention over a paged local sequence.

Each rank owns a pool, a ReqToTokenPool and a PagedTokenAllocator of its own. Request rows
are handed out identically on every rank and every rank knows all global lengths, so each
rank computes its own allocation without communication, and every rank can also account for
every other rank's pages: an allocation that does not fit on one rank fails on all ranks
alike (a rank raising alone would leave the others waiting in the next collective).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mla_backends.allocator import OutOfPagesError, PagedTokenAllocator, truncate_from
from mla_backends.arith import cdiv
from mla_backends.batch import as_int, as_ints


@dataclass(frozen=True)
class DCPLayout:
    """Rank `rank` of `size` in a token-interleaved decode-context-parallel group."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"DCP rank {self.rank} of size {self.size} is not a valid rank")

    def local_len(self, n: int, rank: int | None = None) -> int:
        """Tokens among global positions [0, n) stored on `rank` (default: this rank)."""
        r = self.rank if rank is None else rank
        return max(0, n + self.size - 1 - r) // self.size

    def local_lens(self, lens: torch.Tensor) -> torch.Tensor:
        """Device form of `local_len` for lengths >= 0 (no clamp needed, no host sync)."""
        return torch.div(lens + (self.size - 1 - self.rank), self.size, rounding_mode="floor")

    def owned(self, positions: torch.Tensor) -> torch.Tensor:
        """[T] bool: which global positions this rank stores."""
        return positions % self.size == self.rank


class DCPTokenAllocator:
    """The allocator the engine sees on one rank: lengths are global, slots are local.

    `alloc_extend` returns, for every new token (request-major, like PagedTokenAllocator),
    the local slot if this rank owns the token's position and slot 0 (the dummy page, where
    padded writes go) otherwise, so `store_kv` runs unchanged on every rank."""

    def __init__(
        self, layout: DCPLayout, local: PagedTokenAllocator, max_context_len: int | None = None
    ) -> None:
        """`max_context_len`: the group's per-request limit (the config's); None: what the
        ranks' tables hold. Hazard: each rank's table is ceil(M / N) wide, so N of them hold up
        to N - 1 tokens more than M; the config's M is the limit, as in one process."""
        self.layout, self.local = layout, local
        self.page_size = local.page_size
        self.num_pages = local.num_pages
        self.req_to_token = local.req_to_token
        if local.available_pages != local.num_pages:
            raise ValueError("DCPTokenAllocator needs a fresh local allocator (no pages in use)")
        # Rank 0 holds the most tokens of every request: its table bounds the group's.
        held = layout.size * local.req_to_token.max_context_len
        self.max_context_len = held if max_context_len is None else min(max_context_len, held)
        self._lens: dict[int, int] = {}
        # every row's global length, as ReqToTokenPool.filled holds a rank's share: batches are
        # checked against it alike on every rank (row 0, the padding row, reads any length)
        self.filled = np.zeros_like(local.req_to_token.filled)
        self.filled[0] = np.iinfo(self.filled.dtype).max
        self._used = [0] * layout.size  # pages in use on every rank of the group

    # ----------------------------------------------------------------- accounting
    def seq_len(self, row: int) -> int:
        return self._lens.get(operator.index(row), 0)  # a torch integer hashes apart: 0

    def holds(self, row: int) -> bool:
        return operator.index(row) in self._lens

    @property
    def available_pages(self) -> int:
        """Pages free on this rank."""
        return self.local.available_pages

    def _pages(self, n: int, rank: int) -> int:
        return cdiv(self.layout.local_len(n, rank), self.page_size)

    def _page_delta(self, old: int, new: int) -> list[int]:
        return [self._pages(new, k) - self._pages(old, k) for k in range(self.layout.size)]

    # ----------------------------------------------------------------- allocation
    def alloc_extend(self, rows: Sequence[int], extend_lens: Sequence[int]) -> torch.Tensor:
        """Append `extend_lens[i]` tokens to request `rows[i]` (global lengths); returns int64
        [sum(extend_lens)] slots on this rank, 0 for the tokens other ranks own."""
        if len(rows) != len(extend_lens):
            raise ValueError(f"rows ({len(rows)}) and extend_lens ({len(extend_lens)}) differ")
        rows, extend_lens = as_ints(rows, "rows"), as_ints(extend_lens, "extend_lens")
        if len(set(rows)) != len(rows):  # the page counts below would count it twice
            raise ValueError(f"a request row appears twice in one allocation: {list(rows)}")
        lay = self.layout
        need = [0] * lay.size
        for row, n in zip(rows, extend_lens):
            if n < 0:
                raise ValueError(f"row {row}: extend length {n} < 0")
            if self.seq_len(row) + n > self.max_context_len:
                raise ValueError(
                    f"row {row}: length {self.seq_len(row) + n} exceeds the group's context "
                    f"limit {self.max_context_len} (max_context_len; {lay.size} ranks x "
                    f"{self.req_to_token.max_context_len} table columns)"
                )
            for k, d in enumerate(self._page_delta(self.seq_len(row), self.seq_len(row) + n)):
                need[k] += d
        for k in range(lay.size):
            free = self.num_pages - self._used[k]
            if need[k] > free:  # raised on every rank alike: see the module docstring
                raise OutOfPagesError(need[k], free, self.page_size, k)
        local_n = [
            lay.local_len(self.seq_len(r) + n) - lay.local_len(self.seq_len(r))
            for r, n in zip(rows, extend_lens)
        ]
        slots = self.local.alloc_extend(rows, local_n)
        owned: list[int] = []
        start = 0
        for row, n in zip(rows, extend_lens):
            g = self.seq_len(row)
            owned.extend(start + p - g for p in range(g, g + n) if p % lay.size == lay.rank)
            start += n
            self._lens[row] = self.filled[row] = g + n
        for k in range(lay.size):
            self._used[k] += need[k]
        out = torch.zeros(start, dtype=torch.int64, device=slots.device)
        if owned:
            out[torch.tensor(owned, dtype=torch.int64, device=slots.device)] = slots
        return out

    def alloc_decode(self, rows: Sequence[int]) -> torch.Tensor:
        return self.alloc_extend(rows, [1] * len(rows))

    def truncate(self, row: int, new_len: int) -> None:
        """Shrink a request to `new_len` global tokens (rejected draft tokens)."""
        row, new_len = as_int(row, "row"), as_int(new_len, "new_len")
        old = truncate_from(self._lens, row, new_len)
        self.local.truncate(row, self.layout.local_len(new_len))
        for k, d in enumerate(self._page_delta(old, new_len)):
            self._used[k] += d
        self._lens[row] = self.filled[row] = new_len

    def free(self, row: int) -> None:
        row = as_int(row, "row")
        if row not in self._lens:
            raise ValueError(f"row {row} holds no KV pages")
        self.local.free(row)  # first: if it raises, nothing here has changed
        for k, d in enumerate(self._page_delta(self._lens.pop(row), 0)):
            self._used[k] += d
        self.filled[row] = 0
