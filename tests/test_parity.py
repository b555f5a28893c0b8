"""Every backend against the MHA-expanded reference, from the table in tests/parity.py: the
core parity matrix, the batch-size sweep and MHA-mode prefill (out and LSE, per-dtype
tolerances, NaN-poisoned pools, shuffled and interleaved pages, edge kv lengths)."""

from __future__ import annotations

import pytest
from parity import WHERE, batch_params, matrix_params, mha_params

from mla_backends.config import MLADims
from mla_backends.testing import Case, ragged_prefill_lens, run_case, run_mha_case


def _device(where: str, request: pytest.FixtureRequest) -> str:
    if where == "sm100-emulation":
        request.getfixturevalue("emulated")
    return WHERE[where].device


@pytest.mark.parametrize("where, case", matrix_params())
def test_parity(where: str, case: Case, request: pytest.FixtureRequest) -> None:
    r = run_case(case, _device(where, request))
    assert r.ok, f"{case.id}: {r.detail}"


@pytest.mark.parametrize("where, case", batch_params())
def test_batch_sizes(where: str, case: Case, request: pytest.FixtureRequest) -> None:
    r = run_case(case, _device(where, request))
    assert r.ok, f"{case.id}: {r.detail}"


@pytest.mark.parametrize("where, backend, dtype, heads, dims, lens, causal", mha_params())
def test_mha_prefill(
    where: str, backend: str, dtype: str, heads: int, dims: MLADims, lens: str, causal: bool
) -> None:
    """Ragged requests, one with no keys (its rows exactly 0) and one with no queries."""
    q_lens, kv_lens = ragged_prefill_lens(causal, lens)
    r = run_mha_case(backend, q_lens, kv_lens, causal, dtype, heads, dims, WHERE[where].device)
    assert r.ok, r.detail
