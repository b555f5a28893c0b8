"""Parity cases: what one batch through one backend looks like, and the matrix of them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mla_backends.batch import ForwardMode
from mla_backends.config import MLADims


@dataclass(frozen=True)
class Case:
    """One parity case. `kv_lens` are KV lengths after the step (prefix + new tokens)."""

    backend: str = "torch"
    mode: ForwardMode = ForwardMode.DECODE
    page_size: int = 16
    num_heads: int = 16
    kv_dtype: str = "bfloat16"
    dtype: str = "bfloat16"  # activation (q, out) dtype
    q_len: int = 1  # DECODE: 1; TARGET_VERIFY: draft tokens; EXTEND: 0 = random per request
    kv_lens: tuple[int, ...] = (1, 15, 16, 17, 40)
    # "monotonic": pages handed out 1, 2, ...; "shuffled": in random order (non-monotonic
    # tables); "interleaved": requests grow in turns so their pages alternate; "mixed": both.
    layout: str = "mixed"
    dims: MLADims = field(default_factory=lambda: MLADims())
    seed: int = 0
    joined_query: bool = False  # q_nope / q_rope as views of one [T, H, L + R] buffer

    @property
    def id(self) -> str:
        return (
            f"{self.backend}-{self.mode.value}-p{self.page_size}-h{self.num_heads}-"
            f"{self.kv_dtype}-{self.dtype}-q{self.q_len}-b{len(self.kv_lens)}-{self.layout}"
        )


# Activation / KV dtype pairs the parity matrix runs: "fp8" is an FP8 pool read by bf16 queries.
DTYPE_PAIRS: dict[str, tuple[str, str]] = {
    "float32": ("float32", "float32"),
    "bfloat16": ("bfloat16", "bfloat16"),
    "float16": ("float16", "float16"),
    "fp8": ("bfloat16", "float8_e4m3fn"),
}
MODES: dict[str, tuple[ForwardMode, int]] = {
    "decode": (ForwardMode.DECODE, 1),
    "verify": (ForwardMode.TARGET_VERIFY, 3),
    "extend": (ForwardMode.EXTEND, 0),
}


def edge_kv_lens(page_size: int, q_len: int = 1, long: int = 300) -> tuple[int, ...]:
    """KV lengths that break kernels: 0, 1, page - 1, page, page + 1, long. A query block of
    q_len tokens needs kv_len >= q_len, so non-zero lengths are raised to q_len."""
    raw = (0, 1, page_size - 1, page_size, page_size + 1, max(long, 2 * page_size + 37))
    return tuple(n if n == 0 else max(n, q_len) for n in raw)


def parity_cases(
    backend: str,
    page_sizes: tuple[int, ...],
    heads: tuple[int, ...] = (16, 128),
    dtypes: tuple[str, ...] = tuple(DTYPE_PAIRS),
    modes: tuple[str, ...] = tuple(MODES),
    long: int = 300,
) -> list[Case]:
    """The core parity matrix for one backend: every page size x heads x dtype x mode, each
    batch mixing the edge kv lengths on a shuffled, interleaved page layout."""
    cases = []
    for p in page_sizes:
        for h in heads:
            for dt in dtypes:
                for m in modes:
                    mode, q = MODES[m]
                    act, kv = DTYPE_PAIRS[dt]
                    cases.append(
                        Case(backend, mode, p, h, kv, act, q, edge_kv_lens(p, max(q, 1), long))
                    )
    return cases


def with_batch(case: Case, batch: int) -> Case:
    """The case with `batch` requests, cycling through its kv lengths."""
    lens = case.kv_lens
    return dataclasses.replace(case, kv_lens=tuple(lens[i % len(lens)] for i in range(batch)))
