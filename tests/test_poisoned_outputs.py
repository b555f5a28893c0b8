"""Output buffers poisoned before the call (DESIGN.md, inputs that break kernels): every
floating tensor the backends allocate through torch.empty / empty_like / Tensor.new_empty
starts as NaN, so a backend that leaves any element of its out / LSE unwritten, or merges a
split partial it never wrote, fails parity. CPU places: torch, the Triton interpreter, the
SM100 kernels' emulations (helper 78's coverage audit; the GPU-only kernels' outputs are
covered by their parity rows' NaN-poisoned pools, not by this)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from parity import SMALL

from mla_backends.batch import ForwardMode
from mla_backends.testing import Case, ragged_prefill_lens, run_case, run_mha_case


def _ids(cases: list[Case]) -> list[str]:
    return [c.id for c in cases]


@pytest.fixture
def nan_alloc(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every floating tensor made by torch.empty / empty_like / Tensor.new_empty is NaN: a
    backend that leaves any element of its out / lse (or a split partial it then reads)
    unwritten fails."""
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def poison(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.numel():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda s, *a, **k: poison(new_empty(s, *a, **k)))


def test_nan_alloc_poisons(nan_alloc: None) -> None:
    """The fixture really poisons (else the tests below prove nothing)."""
    x = torch.zeros(2)
    assert torch.isnan(torch.empty(3)).all() and torch.isnan(torch.empty_like(x)).all()
    assert torch.isnan(x.new_empty(2)).all()


POISON = [
    Case("torch", ForwardMode.DECODE, 16, 16, "bfloat16", "bfloat16", 1, (0, 1, 15, 16, 17, 80)),
    Case("torch", ForwardMode.TARGET_VERIFY, 16, 16, "float8_e4m3fn", "bfloat16", 3,
         (0, 3, 15, 16, 17, 80)),
    Case("torch", ForwardMode.EXTEND, 16, 16, "float32", "float32", 0, (0, 1, 15, 16, 17, 80)),
]  # fmt: skip
POISON_INTERP = [
    dataclasses.replace(c, backend="triton", num_heads=4, dims=SMALL)
    for c in POISON
    + [Case("triton", ForwardMode.DECODE, 1, 4, "float8_e4m3fn", "bfloat16", 1, (0, 1, 40))]
]
POISON_EMU = [
    Case("cutlass_mla", ForwardMode.DECODE, 128, 16, "bfloat16", "bfloat16", 1, (0, 1, 127, 200)),
    Case("cutlass_mla", ForwardMode.TARGET_VERIFY, 128, 16, "float16", "float16", 3,
         (0, 3, 129, 200)),
    Case("trtllm_mla", ForwardMode.DECODE, 32, 16, "float8_e4m3fn", "bfloat16", 1,
         (0, 1, 33, 100)),
    Case("trtllm_mla", ForwardMode.TARGET_VERIFY, 64, 16, "bfloat16", "bfloat16", 3,
         (0, 3, 65, 100)),
]  # fmt: skip


@pytest.mark.parametrize("case", POISON, ids=_ids(POISON))
def test_poisoned_outputs_torch(nan_alloc: None, case: Case) -> None:
    r = run_case(case)
    assert r.ok, r.detail


@pytest.mark.interp
@pytest.mark.parametrize("case", POISON_INTERP, ids=_ids(POISON_INTERP))
def test_poisoned_outputs_triton(nan_alloc: None, case: Case) -> None:
    r = run_case(case)
    assert r.ok, r.detail


@pytest.mark.parametrize("case", POISON_EMU, ids=_ids(POISON_EMU))
def test_poisoned_outputs_sm100_emulation(nan_alloc: None, emulated: None, case: Case) -> None:
    r = run_case(case)
    assert r.ok, r.detail


@pytest.mark.parametrize(
    "backend, dtype",
    [("torch", "float32"), pytest.param("triton", "float16", marks=pytest.mark.interp)],
)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_poisoned_outputs_mha_prefill(
    nan_alloc: None, backend: str, dtype: str, causal: bool
) -> None:
    q_lens, kv_lens = ragged_prefill_lens(causal, "short")
    dims = SMALL if backend == "triton" else None
    r = run_mha_case(backend, q_lens, kv_lens, causal, dtype, 4, dims)
    assert r.ok, r.detail


@pytest.mark.interp
@pytest.mark.parametrize("splits", [4])
def test_poisoned_split_partials_triton(
    nan_alloc: None, monkeypatch: pytest.MonkeyPatch, splits: int
) -> None:
    """Empty splits (kv 1 and 3 under 4 splits) must not feed NaN partials to the merge."""
    from mla_backends.kernels import tuning

    monkeypatch.setattr(tuning, "choose_num_splits", lambda *a, **k: splits)
    case = Case("triton", ForwardMode.DECODE, 16, 4, "bfloat16", "bfloat16", 1, (0, 1, 3, 45),
                dims=SMALL)  # fmt: skip
    r = run_case(case)
    assert r.ok, r.detail
