"""Host-side launch rules of the GPU kernels, on CPU: the choices that keep a
grid-synchronising launch resident and refuse a path that cannot run, with the SM count,
the interpreter and the device pretended (no kernel runs here)."""

from __future__ import annotations

import pytest
import torch


def test_topk_fused_block_for_refuses_the_interpreter_on_a_gpu_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hazard (`kernels.grid_sync`): the interpreter runs programs one after another, so the
    one launch would spin for ever there, even on a CUDA device's tensors."""
    from mla_backends.sparse import topk_fused

    monkeypatch.setattr(topk_fused, "num_sms", lambda device: 132)
    monkeypatch.setattr(topk_fused, "interpreting", lambda: False)
    assert topk_fused.block_for(1, 4096, torch.device("cuda")) == 512  # the control: it fits
    monkeypatch.setattr(topk_fused, "interpreting", lambda: True)
    assert topk_fused.block_for(1, 4096, torch.device("cuda")) is None


def test_merges_here_counts_every_program_of_the_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hazard (`kernels.grid_sync`): head blocks are programs too; 3 x 2 x 32 = 192 programs on
    132 SMs would spin for ever, though 2 tokens x 32 splits alone fit."""
    from mla_backends.sparse import triton_kernel as sk

    gpu = torch.device("cuda")
    monkeypatch.setattr(sk, "interpreting", lambda: False)
    monkeypatch.setattr(sk, "num_sms", lambda device: 132)
    assert sk.merges_here((2, 2, 32), 16, 512, 32, gpu, True)  # 128 programs
    assert not sk.merges_here((3, 2, 32), 16, 512, 32, gpu, True)  # 192 programs
    monkeypatch.setattr(sk, "num_sms", lambda device: 128)  # the edge: one program an SM
    assert sk.merges_here((1, 4, 32), 16, 512, 32, gpu, True)
    monkeypatch.setattr(sk, "num_sms", lambda device: 127)
    assert not sk.merges_here((1, 4, 32), 16, 512, 32, gpu, True)


@pytest.mark.interp
def test_topk_slots_auto_caps_the_one_launch_blocks_and_fused_takes_the_largest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`auto` offers the one launch blocks up to AUTO_LARGEST only (the launches are faster
    past it); an explicit `fused` offers every block (BLOCKS[-1]) before it refuses."""
    from mla_backends.sparse import topk_fused
    from mla_backends.sparse.topk_kernel import topk_slots

    asked: list[int] = []
    monkeypatch.setattr(topk_fused, "block_for", lambda t, w, dev, largest: asked.append(largest))
    r2t = torch.arange(8, dtype=torch.int32).view(1, 8)
    rows = torch.zeros(1, dtype=torch.int64)
    topk_slots(torch.randn(1, 8), 4, r2t, rows, path="auto")
    with pytest.raises(ValueError, match="do not fit one launch"):
        topk_slots(torch.randn(1, 8), 4, r2t, rows, path="fused")
    assert asked == [topk_fused.AUTO_LARGEST, topk_fused.BLOCKS[-1]]


def test_merges_here_refuses_the_interpreter_on_a_gpu_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hazard (`kernels.grid_sync`): the interpreter runs programs one after another, so a
    launch that merges its splits itself would spin for ever there, even on a CUDA device."""
    from mla_backends.sparse import triton_kernel as sk

    gpu = torch.device("cuda")
    monkeypatch.setattr(sk, "num_sms", lambda device: 132)
    monkeypatch.setattr(sk, "interpreting", lambda: False)
    assert sk.merges_here((1, 4, 32), 16, 512, 32, gpu, True)  # the control: it fits
    monkeypatch.setattr(sk, "interpreting", lambda: True)
    assert not sk.merges_here((1, 4, 32), 16, 512, 32, gpu, True)


def test_attend_keeps_a_scaled_pool_off_the_gluon_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Gluon kernel takes no kv_scale: a launch marked "gluon" over a pool with a scale
    other than 1 goes to the `tl.dot` kernel (with its own "tl_splits"), never to Gluon."""
    from mla_backends.sparse import triton_kernel as sk

    gluon: list[int] = []
    tl_dot: list[tuple[float, int]] = []
    monkeypatch.setattr(sk, "_gluon_attend", lambda *a: gluon.append(a[5]) or True)
    monkeypatch.setattr(sk, "sparse_mla", lambda *a, **k: tl_dot.append((a[5], a[6])))
    q, qr, kv = torch.zeros(1, 64, 512), torch.zeros(1, 64, 64), torch.zeros(8, 576)
    idx = torch.zeros(1, 4, dtype=torch.int32)
    launch = {"block_m": 64, "block_n": 64, "num_warps": 8, "num_stages": 2}
    launch |= {"splits": 32, "gluon": 1, "tl_splits": 8}
    sk.attend(q, qr, kv, idx, 0.1, 1.0, launch)  # the control: Gluon takes it
    assert (gluon, tl_dot) == ([32], [])
    sk.attend(q, qr, kv, idx, 0.1, 2.0, launch)
    assert (gluon, tl_dot) == ([32], [(2.0, 8)])


def test_sparse_splits_are_a_power_of_two_whatever_the_wave_ratio() -> None:
    """The merge kernels' arange over the splits needs a power of two: 10 programs on 132 SMs
    want 26 splits for two waves and get 16."""
    from mla_backends.sparse.triton_backend import choose_splits

    assert choose_splits(10, 2048, 132, 64, 64) == 16
    for programs in range(1, 300):
        for one_wave in (False, True):
            n = choose_splits(programs, 2048, 132, 64, 64, one_wave=one_wave)
            assert n & (n - 1) == 0, (programs, one_wave, n)


def test_gluon_sparse_kernel_takes_only_aligned_rows_and_contiguous_queries() -> None:
    """`cp.async` reads 16 bytes at a time from the pool's start and the kernel reads the
    queries' columns as contiguous: a pool starting 2 bytes off, or queries strided along
    their columns, are left to the `tl.dot` kernel."""
    pytest.importorskip("triton.experimental.gluon")
    from mla_backends.sparse import gluon_kernel as gk

    q, qr = torch.zeros(2, 64, 512).bfloat16(), torch.zeros(2, 64, 64).bfloat16()
    flat = torch.zeros(8 * 576 + 8, dtype=torch.bfloat16)
    assert gk.takes(q, qr, flat[8:].view(8, 576))  # the control: 16 bytes in
    assert not gk.takes(q, qr, flat[1:4609].view(8, 576))  # 2 bytes in
    q_t = torch.zeros(512, 64, 2).bfloat16().permute(2, 1, 0)  # [2, 64, 512], column stride 128
    qr_t = torch.zeros(64, 64, 2).bfloat16().permute(2, 1, 0)
    assert not gk.takes(q_t, qr, flat[8:].view(8, 576))
    assert not gk.takes(q, qr_t, flat[8:].view(8, 576))


def test_merge_blocks_are_powers_of_two_of_at_least_64_columns() -> None:
    """The merge kernel's BLOCK_L = L / blocks is an arange: a power of two dividing L. 40 rows
    on 132 SMs want 3 column blocks and get 2."""
    from mla_backends.kernels.mla_attention import merge_blocks

    assert merge_blocks(40, 512, 4, 132) == (2, 4)
    for rows in range(1, 200):
        for lat in (256, 512):
            blocks, chunk = merge_blocks(rows, lat, 64, 132)
            assert blocks & (blocks - 1) == 0 and lat // blocks >= 64, (rows, lat, blocks)
            assert chunk & (chunk - 1) == 0 and chunk * (lat // blocks) <= 8192, (rows, chunk)


@pytest.mark.interp
def test_page_table_refuses_an_out_buffer_too_narrow() -> None:
    """The index builder writes b rows x width pages into `out`: one narrower than width
    would be written past its rows' ends (into the next row), silently."""
    from mla_backends.kernels import index

    r2t = torch.arange(2 * 64, dtype=torch.int32).view(2, 64)
    rows, seq = torch.tensor([1, 1, 1], dtype=torch.int32), torch.tensor([5, 9, 20])
    out = torch.full((3, 8), -7, dtype=torch.int32)
    index.page_table(r2t, rows, seq, 16, 2, 0, out[:, :2])  # the control: it fits
    with pytest.raises(ValueError, match=r"page_table: out \[3, 1\] cannot hold 3 rows x 2"):
        index.page_table(r2t, rows, seq, 16, 2, 0, out[:, :1])
