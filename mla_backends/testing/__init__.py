"""Parity harness shared by the tests, `verify` and the GPU check: build a poisoned pool with a
chosen page layout, run one batch through a backend, compare with the MHA-expanded oracle.

- `cases`: `Case`, the dtype pairs and modes, edge kv lengths, the parity matrix;
- `pools`: poisoned runtimes and the batch a case reads (`build_case`);
- `compare`: per-dtype `TOLERANCES`, `compare`, `run_case` (both references, out and LSE);
- `mha`: MHA-mode prefill cases (`run_mha_case`);
- `streams`: decode streams and the captured forward for CUDA-graph tests.
"""

from mla_backends.testing.cases import (
    DTYPE_PAIRS,
    MODES,
    Case,
    edge_kv_lens,
    parity_cases,
    with_batch,
)
from mla_backends.testing.compare import (
    TOLERANCES,
    Result,
    _compare,
    compare,
    effective_query,
    run_case,
)
from mla_backends.testing.mha import RAGGED_PREFILL, ragged_prefill_lens, run_mha_case
from mla_backends.testing.pools import FP8_SCALE, build_case
from mla_backends.testing.streams import DecodeStream, absorbed_forward

__all__ = [
    "DTYPE_PAIRS",
    "FP8_SCALE",
    "MODES",
    "RAGGED_PREFILL",
    "TOLERANCES",
    "Case",
    "DecodeStream",
    "Result",
    "_compare",
    "absorbed_forward",
    "build_case",
    "compare",
    "edge_kv_lens",
    "effective_query",
    "parity_cases",
    "ragged_prefill_lens",
    "run_case",
    "run_mha_case",
    "with_batch",
]
