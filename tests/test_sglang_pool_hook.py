"""The pool hook the SGLang adapter needs (no SGLang required): our pool objects wrap an
engine's existing tensors without copying, and refuse tensors that do not match."""

from __future__ import annotations

import pytest
import torch

from mla_backends.checks import ShapeError
from mla_backends.pool import MLATokenToKVPool, ReqToTokenPool


def test_kv_pool_wraps_buffers_without_copy() -> None:
    engine = [torch.zeros(5 * 16, 1, 48, dtype=torch.uint8) for _ in range(2)]  # FP8 storage
    views = [b[:, 0].view(torch.float8_e4m3fn) for b in engine]
    pool = MLATokenToKVPool(2, 4, 16, 32, 16, torch.float8_e4m3fn, "cpu", buffers=views)
    assert [b.data_ptr() for b in pool.kv_buffer] == [b.data_ptr() for b in engine]
    loc = torch.tensor([17, 40])
    pool.set_mla_kv_buffer(1, loc, torch.full((2, 32), 2.0), torch.full((2, 16), -1.0))
    got = engine[1][loc, 0].view(torch.float8_e4m3fn).float()
    assert got[:, :32].eq(2.0).all() and got[:, 32:].eq(-1.0).all()


@pytest.mark.parametrize(
    ("buffers", "match"),
    [
        ([torch.zeros(80, 48, dtype=torch.bfloat16)], "1 buffers given for 2 layers"),
        ([torch.zeros(64, 48, dtype=torch.bfloat16)] * 2, r"expected shape \[80, 48\]"),
        ([torch.zeros(80, 48, dtype=torch.float16)] * 2, "expected dtype"),
        ([torch.zeros(48, 80, dtype=torch.bfloat16).t()] * 2, "rows must be contiguous"),
    ],
    ids=["layers", "rows", "dtype", "strided"],
)
def test_kv_pool_refuses_mismatched_buffers(buffers: list[torch.Tensor], match: str) -> None:
    with pytest.raises((ValueError, ShapeError), match=match):
        MLATokenToKVPool(2, 4, 16, 32, 16, torch.bfloat16, "cpu", buffers=buffers)


def test_req_pool_wraps_table() -> None:
    table = torch.zeros(5, 64, dtype=torch.int32)
    req = ReqToTokenPool(4, 64, "cpu", table=table)
    assert req.req_to_token is table
    with pytest.raises(ShapeError, match="expected dtype"):
        ReqToTokenPool(4, 64, "cpu", table=table.long())
