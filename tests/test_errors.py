"""Bad input to a backend gets a clear error naming the tensor, never a wrong answer."""

from __future__ import annotations

import pytest
import torch

from mla_backends.batch import ForwardBatch, ForwardMode, RaggedLayout
from mla_backends.checks import ShapeError
from mla_backends.testing import Case, build_case


@pytest.fixture
def setup():  # type: ignore[no-untyped-def]
    return build_case(Case(mode=ForwardMode.DECODE, kv_lens=(5, 9)), torch.device("cpu"))


def _q(t: int = 2, h: int = 16, lat: int = 512, r: int = 64, dtype=torch.bfloat16):  # type: ignore[no-untyped-def]
    return torch.randn(t, h, lat).to(dtype), torch.randn(t, h, r).to(dtype)


@pytest.mark.parametrize(
    "q, pattern",
    [
        (_q(h=8), r"q_nope: expected shape \[2, 16, 512\], got \[2, 8, 512\]"),
        (_q(t=3), r"q_nope: expected shape \[2, 16, 512\], got \[3, 16, 512\]"),
        (_q(lat=576), r"q_nope: expected shape \[2, 16, 512\], got \[2, 16, 576\]"),
        (_q(r=32), r"q_rope: expected shape \[2, 16, 64\], got \[2, 16, 32\]"),
        (_q(dtype=torch.int32), r"q_nope: expected dtype in .*got torch.int32"),
    ],
)
def test_absorbed_rejects_bad_q(setup, q, pattern) -> None:  # type: ignore[no-untyped-def]
    rt, batch = setup
    rt.backend.init_forward_metadata(batch)
    with pytest.raises(ShapeError, match=pattern):
        rt.backend.forward_absorbed(0, *q, None, None, batch)


def test_absorbed_rejects_mixed_q_dtypes_and_half_given_rows(setup) -> None:  # type: ignore[no-untyped-def]
    rt, batch = setup
    qn, qr = _q()
    with pytest.raises(ShapeError, match=r"q_rope: expected dtype in \['torch.bfloat16'\]"):
        rt.backend.forward_absorbed(0, qn, qr.float(), None, None, batch)
    with pytest.raises(ValueError, match="both be given or both be None"):
        rt.backend.forward_absorbed(0, qn, qr, torch.zeros(2, 512), None, batch)
    with pytest.raises(ShapeError, match=r"k_nope: expected shape \[2, 512\]"):
        rt.backend.forward_absorbed(0, qn, qr, torch.zeros(2, 64), torch.zeros(2, 64), batch)


def test_mha_rejects_bad_shapes(setup) -> None:  # type: ignore[no-untyped-def]
    rt, _ = setup
    layout = RaggedLayout.from_lens([3, 2], [3, 2], "cpu")
    q, k, v = torch.randn(5, 16, 192), torch.randn(5, 16, 192), torch.randn(5, 16, 128)
    with pytest.raises(ShapeError, match=r"v: expected shape \[5, 16, 128\], got \[5, 16, 192\]"):
        rt.backend.forward_mha(q, k, k, layout)
    with pytest.raises(ShapeError, match=r"q: expected shape \[5, 16, 192\], got \[4, 16, 192\]"):
        rt.backend.forward_mha(q[:4], k, v, layout)


def test_batch_build_rejects_inconsistent_modes() -> None:
    loc = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="DECODE needs one new token per request"):
        ForwardBatch.build(ForwardMode.DECODE, [1, 2], [0, 0], [2, 1], loc, "cpu")
    with pytest.raises(ValueError, match="TARGET_VERIFY needs equal q_len"):
        ForwardBatch.build(ForwardMode.TARGET_VERIFY, [1, 2], [4, 4], [2, 1], loc, "cpu")
    with pytest.raises(ValueError, match="out_cache_loc has 3 slots, batch has 4 tokens"):
        ForwardBatch.build(ForwardMode.EXTEND, [1, 2], [0, 0], [2, 2], loc, "cpu")


def test_metadata_must_be_built_first(setup) -> None:  # type: ignore[no-untyped-def]
    rt, batch = setup
    with pytest.raises(RuntimeError, match="init_forward_metadata was not called"):
        rt.backend.forward_absorbed(0, *_q(), None, None, batch)
