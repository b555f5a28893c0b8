"""The torch backend beyond its rows of the parity table (tests/parity.py): page layouts,
empty rows, the graph hooks on CPU, FP8 reads, joined queries."""

from __future__ import annotations

import pytest
import torch

from mla_backends.backends.util import joined_query
from mla_backends.batch import ForwardMode
from mla_backends.testing import (
    Case,
    build_case,
    edge_kv_lens,
    run_case,
)


def _check(case: Case) -> None:
    r = run_case(case)
    assert r.ok, f"{case.id}: {r.detail}"


@pytest.mark.parametrize("layout", ["monotonic", "shuffled", "interleaved", "mixed"])
@pytest.mark.parametrize("page", [1, 64])
def test_page_layouts(layout: str, page: int) -> None:
    for mode, q in [
        (ForwardMode.DECODE, 1),
        (ForwardMode.TARGET_VERIFY, 4),
        (ForwardMode.EXTEND, 0),
    ]:
        _check(
            Case(
                mode=mode,
                q_len=q,
                page_size=page,
                layout=layout,
                kv_lens=edge_kv_lens(page, max(q, 1), long=90),
                seed=7,
            )
        )


def test_zero_length_rows_are_zero_and_neg_inf() -> None:
    case = Case(mode=ForwardMode.DECODE, kv_lens=(0, 5, 0), dtype="float32", kv_dtype="float32")
    rt, batch = build_case(case, torch.device("cpu"))
    h, lat, r = 16, 512, 64
    args = torch.randn(3, h, lat), torch.randn(3, h, r), torch.randn(3, lat), torch.randn(3, r)
    rt.backend.init_forward_metadata(batch)
    out, lse = rt.backend.forward_absorbed(0, *args, batch, return_lse=True)
    assert torch.equal(out[[0, 2]], torch.zeros(2, h, lat))
    assert torch.isneginf(lse[[0, 2]]).all() and torch.isfinite(lse[1]).all()


def test_graph_metadata_path_matches_eager_and_keeps_buffers() -> None:
    """Capture/replay hooks on CPU: static buffers refilled in place give eager results."""
    case = Case(mode=ForwardMode.DECODE, kv_lens=(3, 40, 17), dtype="float32", kv_dtype="float32")
    rt, batch = build_case(case, torch.device("cpu"))
    be = rt.backend
    q = torch.randn(3, 16, 512), torch.randn(3, 16, 64)
    be.init_forward_metadata(batch)
    eager = be.forward_absorbed(0, *q, torch.randn(3, 512), torch.randn(3, 64), batch, True)
    assert torch.isfinite(eager[0]).all()
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    be.init_forward_metadata_capture(batch)
    ptrs = [t.data_ptr() for t in (be.metadata.kv_slots, be.metadata.visible)]
    be.init_forward_metadata_replay(batch)
    assert [t.data_ptr() for t in (be.metadata.kv_slots, be.metadata.visible)] == ptrs
    graphed = be.forward_absorbed(0, *q, None, None, batch, return_lse=True)
    torch.testing.assert_close(graphed[0], eager[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(graphed[1], eager[1], rtol=1e-6, atol=1e-6)


def test_fp8_never_dequantizes_the_whole_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    case = Case(mode=ForwardMode.DECODE, kv_dtype="float8_e4m3fn", kv_lens=(5, 60, 33))
    rt, batch = build_case(case, torch.device("cpu"))
    pool, seen = rt.kv_pool, []
    real = pool.dequantize
    monkeypatch.setattr(
        pool, "dequantize", lambda layer, rows: seen.append(rows) or real(layer, rows)
    )
    rt.backend.init_forward_metadata(batch)
    rt.backend.forward_absorbed(
        0,
        torch.randn(3, 16, 512).bfloat16(),
        torch.randn(3, 16, 64).bfloat16(),
        torch.randn(3, 512),
        torch.randn(3, 64),
        batch,
    )
    whole = pool.get_kv_buffer(0)
    assert seen and all(t.data_ptr() != whole.data_ptr() or t.numel() < whole.numel() for t in seen)
    assert all(t.shape[:-1].numel() <= 3 * 60 for t in seen)


def test_joined_query_is_a_zero_copy_view_only_for_adjacent_halves() -> None:

    buf = torch.randn(5, 16, 576)
    qn, qr = buf[..., :512], buf[..., 512:]
    j = joined_query(qn, qr)
    assert j.data_ptr() == buf.data_ptr() and torch.equal(j, buf)
    a, b = qn.contiguous(), qr.contiguous()
    j2 = joined_query(a, b)
    assert torch.equal(j2, buf) and j2.data_ptr() != a.data_ptr()
    swapped = torch.randn(5, 16, 576)  # right pointers, wrong layout: must copy
    assert torch.equal(
        joined_query(swapped[..., :512], buf[..., 512:]),
        torch.cat([swapped[..., :512], buf[..., 512:]], -1),
    )
    _check(Case(mode=ForwardMode.TARGET_VERIFY, q_len=2, kv_lens=(2, 30, 70), joined_query=True))


def test_extend_reads_no_device_value_back_per_request_or_layer() -> None:
    """The EXTEND loop indexed the request table with a device row (`rows[b]`, a 0-d tensor):
    one device-to-host read a request a layer, a sync each on a GPU. Now the batch's host
    rows (read once a batch). Counted on the CPU as the op a GPU sync goes through."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Reads.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    case = Case(mode=ForwardMode.EXTEND, kv_lens=(5, 40, 17), dtype="float32", kv_dtype="float32")
    rt, batch = build_case(case, torch.device("cpu"))
    be = rt.backend
    be.init_forward_metadata(batch)
    assert batch.rows_host == [int(r) for r in batch.req_pool_indices]  # its one read
    t, h = batch.num_tokens, 16
    args = torch.randn(t, h, 512), torch.randn(t, h, 64), torch.randn(t, 512), torch.randn(t, 64)
    with Reads():
        for _ in range(2):  # layers
            be.forward_absorbed(0, *args, batch, return_lse=True)
    assert Reads.count == 0


def test_decode_ignores_nan_rows_behind_stale_table_entries() -> None:
    """Table entries past a request's length are stale (a reused row keeps its old request's
    slots, which may hold anything, NaN included). The parity pools point them at the dummy
    slot, which a zero-length request's store makes finite again, so the backend's zeroing of
    rows past the length went untested: without it, a masked score times a NaN row is NaN in
    P @ V (mutation testing, helper 73)."""
    torch.manual_seed(0)
    case = Case(mode=ForwardMode.DECODE, kv_lens=(3, 40, 17), dtype="float32", kv_dtype="float32")
    rt, batch = build_case(case, torch.device("cpu"))
    be, pool = rt.backend, rt.backend.pool
    nan_slot = pool.num_slots - 1
    pool.kv_buffer[0][nan_slot] = float("nan")
    for row, n in zip(batch.rows_host, batch.seq_lens_cpu.tolist()):
        be.req_to_token[row, n:] = nan_slot
    h, lat, r = case.num_heads, case.dims.kv_lora_rank, case.dims.qk_rope_head_dim
    be.init_forward_metadata(batch)
    out, lse = be.forward_absorbed(
        0, torch.randn(3, h, lat), torch.randn(3, h, r), torch.randn(3, lat), torch.randn(3, r),
        batch, return_lse=True,
    )  # fmt: skip
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
