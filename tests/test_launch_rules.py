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
