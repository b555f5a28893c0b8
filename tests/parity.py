"""The parity table: one row per backend and place it runs. A new backend adds one row.

Each row names a backend and where its cases run (`WHERE`: on a CPU, under the Triton
interpreter, on a GPU, on an SM90 / SM100 GPU, or on a CPU through the SM100 kernels'
emulations), the dims to use there and what to sweep. Page sizes, KV dtypes and modes come
from the backend's declared `caps` (`BackendCaps`), narrowed by the row where a place cannot
afford them all (the interpreter is slow). From the rows:
- `matrix`: every page size x heads x dtype x mode, each batch mixing the edge kv lengths
  (0, 1, page - 1, page, page + 1, long) on a shuffled, interleaved, NaN-poisoned pool, out
  and LSE against both references (tests/test_parity.py);
- `batch_sweep`: decode and verify at batch 1, 7 and 130;
- `mha`: MHA-mode prefill of a ragged batch, causal and full (`yarn_mha_row`: alone, at
  DeepSeek-V3's YaRN scale);
- `graphs`: decode streams through the CUDA-graph runner, out and LSE (tests/test_graph_runner.py);
- `mha_backends`: who has an MHA-prefill path where (tests/test_zero_key_rows.py).
Every case carries its place's marker (`-m gpu` picks the GPU cases) and an id that starts
with the place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest

from mla_backends.backends.base import BackendCaps
from mla_backends.backends.registry import get_backend_class
from mla_backends.config import MLADims
from mla_backends.testing import DTYPE_PAIRS, Case, parity_cases, with_batch


@dataclass(frozen=True)
class Place:
    device: str  # where the tensors live
    marks: tuple[pytest.MarkDecorator, ...]  # conftest skips what this machine cannot run


WHERE: dict[str, Place] = {
    "cpu": Place("cpu", ()),
    "interp": Place("cpu", (pytest.mark.interp,)),
    "gpu": Place("cuda", (pytest.mark.gpu,)),
    "sm90": Place("cuda", (pytest.mark.sm90,)),
    "sm100": Place("cuda", (pytest.mark.sm100,)),
    # SM100 kernels swapped for plain-PyTorch emulations of their contract (conftest's
    # `emulated`): everything our backend computes around the kernel, checked on a CPU.
    "sm100-emulation": Place("cpu", ()),
}

# Smallest shapes the Triton kernels take (tl.dot needs dims >= 16); distinct so swapped axes
# show; YaRN scaling so the softmax scale is not the plain one.
SMALL = MLADims(
    num_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    rope_scaling_factor=4.0,
    mscale_all_dim=0.7,
)


# DeepSeek-V3's YaRN (factor 40, mscale_all_dim 1): a softmax scale 1.87x the plain
# 1/sqrt(192) of the default dims. Hazard: at the default dims a kernel that drops
# `self.scale` for its own 1/sqrt(head_dim) passed every row but the interpreter's (SMALL).
YARN = MLADims(rope_scaling_factor=40.0, mscale_all_dim=1.0)


def yarn_row(backend: str, where: str, page: int) -> Row:
    """The backend's modes once at YaRN's scale: one page size, 16 heads, bf16."""
    return Row(backend, where, pages=(page,), heads=(16,), dtypes=("bfloat16",), dims=YARN,
               tag="yarn")  # fmt: skip


def yarn_mha_row(backend: str, where: str, lens: str, heads: int = 16) -> Row:
    """MHA-mode prefill alone (no matrix) at YaRN's scale, bf16, causal and full. Hazard:
    the MHA rows of the default dims pass with the plain softmax scale, so a `forward_mha`
    that drops `self.scale` failed only the interpreter's row (SMALL, 1.2x the plain scale)."""
    return Row(backend, where, matrix=False, dims=YARN, mha=MhaSweep(("bfloat16",), lens, heads),
               tag="yarn")  # fmt: skip


@dataclass(frozen=True)
class BatchSweep:
    """Decode and verify at batch 1, 7 and 130 (lengths cycling through the edge lengths)."""

    page: int
    heads: tuple[int, ...]
    dtypes: tuple[str, ...]  # DTYPE_PAIRS keys
    long: int = 300


@dataclass(frozen=True)
class MhaSweep:
    """MHA-mode prefill of a ragged batch (`RAGGED_PREFILL[lens]`), causal and full."""

    dtypes: tuple[str, ...]  # activation dtypes
    lens: str
    heads: int = 16


@dataclass(frozen=True)
class Graph:
    """One decode stream through the graph runner: real capture and replay on a GPU, the
    static-buffer path without capture elsewhere."""

    page: int
    heads: int
    dtype: str  # a DTYPE_PAIRS key
    q_len: int = 1


@dataclass(frozen=True)
class Row:
    backend: str
    where: str  # a WHERE key
    matrix: bool = True  # the parity matrix runs here
    pages: tuple[int, ...] | None = None  # None: every page size the backend declares
    heads: tuple[int, ...] = (16, 128)
    verify_heads: tuple[int, ...] | None = None  # other heads for verify (None: `heads`)
    dtypes: tuple[str, ...] | None = None  # DTYPE_PAIRS keys; None: all its KV dtypes allow
    long: int = 300  # the longest kv length of each batch
    dims: MLADims = field(default_factory=MLADims)
    joined_query: bool = False  # q_nope / q_rope as views of one [T, H, L + R] buffer
    batch: BatchSweep | None = None
    mha: MhaSweep | None = None
    graphs: tuple[Graph, ...] = ()
    tag: str = ""  # appended to the matrix and MHA ids: a second row of one backend at one place

    @property
    def caps(self) -> BackendCaps:
        return get_backend_class(self.backend).caps


BACKENDS: list[Row] = [
    Row(
        "torch",
        "cpu",
        pages=(1, 16, 32, 64, 128),
        batch=BatchSweep(16, (16,), ("bfloat16", "fp8"), long=70),
        mha=MhaSweep(("float32", "bfloat16", "float16"), "mid"),
        graphs=(
            Graph(16, 16, "float32"),
            Graph(1, 16, "fp8", q_len=2),
            Graph(64, 16, "bfloat16", q_len=2),
            Graph(64, 16, "float16"),
        ),
    ),
    Row("torch", "gpu", matrix=False, graphs=(Graph(64, 16, "bfloat16"),)),
    Row(
        "triton",
        "interp",
        pages=(1, 16, 32, 64),
        heads=(4,),
        verify_heads=(16,),  # 48 query rows: several 16-row blocks
        long=70,
        dims=SMALL,
        # batch 130 (past 128: a second block of requests) at page 1, contexts <= 39
        batch=BatchSweep(1, (4,), ("float16",), long=39),
        mha=MhaSweep(("float32", "float16", "bfloat16"), "short", heads=4),
        graphs=(Graph(16, 4, "float16"), Graph(16, 4, "bfloat16", q_len=2)),
    ),
    Row(
        "triton",
        "gpu",
        pages=(1, 16, 32, 64, 128),
        long=1100,
        # batch 130 at 16 heads and page 64 runs the TMA tiles of block_m 16 (batch >= 32)
        batch=BatchSweep(64, (16, 128), ("bfloat16", "fp8")),
        mha=MhaSweep(("bfloat16", "float16"), "long"),
        graphs=(Graph(64, 128, "bfloat16"), Graph(16, 16, "fp8", q_len=2)),
    ),
    Row(
        "flashinfer_mla",
        "gpu",
        pages=(1, 16, 32, 64, 128),
        long=1100,
        batch=BatchSweep(64, (128,), ("bfloat16", "fp8")),
        mha=MhaSweep(("bfloat16", "float16"), "long"),
        graphs=(Graph(1, 128, "bfloat16"), Graph(16, 16, "fp8", q_len=2)),
    ),
    Row(
        "flashmla",
        "sm90",
        long=1100,
        batch=BatchSweep(64, (128,), ("bfloat16",)),
        graphs=(Graph(64, 128, "bfloat16"), Graph(64, 16, "bfloat16", q_len=2)),
    ),
    Row("flashmla", "sm90", dtypes=("bfloat16",), joined_query=True),
    Row(
        "cutlass_mla",
        "sm100-emulation",
        long=200,
        batch=BatchSweep(128, (16,), ("bfloat16",), long=90),
        graphs=(Graph(128, 16, "bfloat16"), Graph(128, 16, "float16", q_len=2)),
    ),
    Row(
        "trtllm_mla",
        "sm100-emulation",
        long=200,
        batch=BatchSweep(64, (16,), ("bfloat16",), long=90),
        graphs=(
            Graph(32, 16, "bfloat16", q_len=2),
            Graph(64, 16, "fp8"),
            Graph(32, 16, "fp8", q_len=2),
        ),
    ),
    Row("cutlass_mla", "sm100", dtypes=("bfloat16",), long=200),
    Row("trtllm_mla", "sm100", long=200),
    yarn_row("torch", "cpu", 16),
    yarn_row("triton", "gpu", 64),
    yarn_row("flashinfer_mla", "gpu", 64),
    yarn_row("flashmla", "sm90", 64),
    yarn_row("cutlass_mla", "sm100-emulation", 128),
    yarn_row("trtllm_mla", "sm100-emulation", 64),
    # every backend with an MHA-prefill path; the interpreter's is tiny (its shapes cost)
    yarn_mha_row("torch", "cpu", "mid"),
    yarn_mha_row("triton", "interp", "short", heads=4),
    yarn_mha_row("triton", "gpu", "long"),
    yarn_mha_row("flashinfer_mla", "gpu", "long"),
]


# ---------------------------------------------------------------------------- the axes
def modes(caps: BackendCaps) -> tuple[str, ...]:
    """decode and verify for the "decode" role, extend (absorbed, over a prefix) for
    "prefill"."""
    return (("decode", "verify") if "decode" in caps.roles else ()) + (
        ("extend",) if "prefill" in caps.roles else ()
    )


def dtypes(row: Row) -> tuple[str, ...]:
    """The DTYPE_PAIRS keys whose KV dtype the backend declares, narrowed by the row."""
    ok = [k for k, (_, kv) in DTYPE_PAIRS.items() if kv in row.caps.kv_dtypes]
    return tuple(k for k in ok if row.dtypes is None or k in row.dtypes)


def pages(row: Row) -> tuple[int, ...]:
    declared = row.caps.page_sizes
    return declared if row.pages is None else tuple(p for p in row.pages if p in declared)


def matrix(row: Row) -> list[Case]:
    cases = []
    for m in modes(row.caps) if row.matrix else ():
        heads = row.verify_heads if m == "verify" and row.verify_heads else row.heads
        for c in parity_cases(row.backend, pages(row), heads, dtypes(row), (m,), row.long):
            cases.append(dataclasses.replace(c, dims=row.dims, joined_query=row.joined_query))
    return cases


def batch_sweep(row: Row) -> list[Case]:
    b = row.batch
    if b is None:
        return []
    cases = parity_cases(row.backend, (b.page,), b.heads, b.dtypes, ("decode", "verify"), b.long)
    return [
        dataclasses.replace(with_batch(c, n), dims=row.dims) for n in (1, 7, 130) for c in cases
    ]


def graph_cases(row: Row) -> list[Case]:
    return [
        Case(
            row.backend,
            page_size=g.page,
            num_heads=g.heads,
            kv_dtype=DTYPE_PAIRS[g.dtype][1],
            dtype=DTYPE_PAIRS[g.dtype][0],
            q_len=g.q_len,
            dims=row.dims,
        )
        for g in row.graphs
    ]


# ---------------------------------------------------------------------------- parameters
def _param(row: Row, *values: Any, id: str) -> Any:  # noqa: A002 - pytest's name
    marks = WHERE[row.where].marks
    return pytest.param(row.where, *values, id=f"{row.where}-{id}", marks=marks)


def matrix_params() -> list[Any]:
    """(where, case) for tests/test_parity.py::test_parity."""
    return [
        _param(r, c, id=c.id + ("-joined" if c.joined_query else "") + (r.tag and f"-{r.tag}"))
        for r in BACKENDS
        for c in matrix(r)
    ]


def batch_params() -> list[Any]:
    return [_param(r, c, id=c.id) for r in BACKENDS for c in batch_sweep(r)]


def mha_params() -> list[Any]:
    """(where, backend, dtype, heads, dims, lens, causal)."""
    return [
        _param(
            r,
            r.backend,
            dt,
            r.mha.heads,
            r.dims,
            r.mha.lens,
            causal,
            id=f"{r.backend}-{'causal' if causal else 'full'}-{dt}-h{r.mha.heads}"
            + (r.tag and f"-{r.tag}"),
        )
        for r in BACKENDS
        if r.mha is not None
        for causal in (True, False)
        for dt in r.mha.dtypes
    ]


def graph_params(gpu: bool) -> list[Any]:
    """(where, case) of the graph tests on a GPU place (`gpu`) or elsewhere."""
    return [
        _param(r, c, id=f"{c.backend}-p{c.page_size}-h{c.num_heads}-{c.kv_dtype}-q{c.q_len}")
        for r in BACKENDS
        if (WHERE[r.where].device == "cuda") == gpu
        for c in graph_cases(r)
    ]


def mha_backends(device: str) -> list[Row]:
    """One row per backend with an MHA-prefill path that runs on `device` ("cpu" or "cuda";
    the first row of each backend there)."""
    rows: dict[str, Row] = {}
    for r in BACKENDS:
        if WHERE[r.where].device == device and "prefill" in r.caps.roles:
            rows.setdefault(r.backend, r)
    return list(rows.values())
