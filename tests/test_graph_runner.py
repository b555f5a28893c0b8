"""The CUDA-graph runner and its padding contract, for every graph-capable backend.

CPU (CI): the runner's padded static-buffer path without capture (`use_graphs=False`): the
backends' capture / replay hooks, padding, slicing and dummy-page writes are all exercised.
GPU: real `torch.cuda.CUDAGraph` capture, 1,000 replays over changing batches, outputs equal to
eager and within tolerance of the reference, no pointer changes, no host sync during replay,
padded rows never writing a real slot.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

import mla_backends.backends.cutlass_mla as cutlass_mod
import mla_backends.backends.trtllm_mla as trtllm_mod
from mla_backends.backends import emulation
from mla_backends.config import MLADims
from mla_backends.graph_runner import CudaGraphRunner, InputSpec
from mla_backends.testing import TOLERANCES, Case, DecodeStream, absorbed_forward

SMALL = MLADims(
    num_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16
)


def _specs(case: Case) -> dict[str, InputSpec]:
    d, dt = case.dims, getattr(torch, case.dtype)
    h = case.num_heads
    return {
        "q_nope": InputSpec((h, d.kv_lora_rank), dt),
        "q_rope": InputSpec((h, d.qk_rope_head_dim), dt),
        "k_nope": InputSpec((d.kv_lora_rank,), dt),
        "k_rope": InputSpec((d.qk_rope_head_dim,), dt),
    }


def _slots_outside(pool_buf: torch.Tensor, page: int, touched: torch.Tensor) -> torch.Tensor:
    """Bit pattern of every row except the dummy page and the slots a step legitimately
    writes (its real new tokens)."""
    keep = torch.ones(pool_buf.shape[0], dtype=torch.bool, device=pool_buf.device)
    keep[:page] = False
    keep[touched] = False
    return pool_buf.view(torch.int16 if pool_buf.element_size() == 2 else torch.int8)[keep]


def _close(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float, what: str) -> None:
    bad = (got.double() - want.double()).abs() > atol + rtol * want.double().abs()
    if bad.any():
        idx = tuple(torch.nonzero(bad)[0].tolist())
        raise AssertionError(
            f"{what}: {int(bad.sum())} elements off, first at {idx}: "
            f"{float(got[idx]):.6f} vs {float(want[idx]):.6f}"
        )


def _run(
    case: Case, device: str, steps: int, use_graphs: bool, ref_every: int, sizes=(1, 2, 4, 8)
) -> None:  # type: ignore[no-untyped-def]
    stream = DecodeStream(
        case,
        device,
        num_requests=12,
        max_prompt=200,
        max_context=200 + steps * max(case.q_len, 1) + 64,
    )
    be = stream.rt.backend
    runner = CudaGraphRunner(
        be,
        partial(absorbed_forward, be),
        _specs(case),
        sizes,
        q_len=max(case.q_len, 1),
        device=device,
        use_graphs=use_graphs,
    )
    runner.capture()
    atol, rtol, _ = TOLERANCES[case.dtype]
    buf, page = stream.rt.kv_pool.kv_buffer[0], case.page_size
    for i in range(steps):
        n = (i % 7) + 1  # 1..7 real requests: every size pads except 1, 2, 4
        batch, inputs = stream.step(n)
        before = _slots_outside(buf, page, batch.out_cache_loc).clone()
        if use_graphs:
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = runner.replay(batch, inputs, check_pointers=True).clone()
        finally:
            if use_graphs:
                torch.cuda.set_sync_debug_mode(0)
        assert torch.equal(_slots_outside(buf, page, batch.out_cache_loc), before), (
            f"step {i}: a padded row wrote a real slot"
        )
        assert torch.isfinite(got).all(), f"step {i}: non-finite output"
        # Eager may split the KV differently (split counts follow the real lengths, a graph's
        # the longest context), so equality is within the dtype's tolerance, not bitwise.
        be.init_forward_metadata(batch)
        eager = absorbed_forward(be, batch, inputs)
        _close(got, eager, atol, rtol, f"step {i} (n={n}) graph vs eager")
        if i % ref_every == 0:
            ref = stream.reference(batch, inputs)
            _close(got.double().cpu(), ref.cpu(), atol, rtol, f"step {i} vs reference")


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        cutlass_mod, "load_kernel", lambda: (emulation.cutlass_mla_decode, lambda *a: 1 << 20)
    )
    monkeypatch.setattr(
        trtllm_mod, "load_kernel", lambda: emulation.trtllm_batch_decode_with_kv_cache_mla
    )


CPU_CASES = [
    Case("torch", page_size=16, num_heads=16, kv_dtype="float32", dtype="float32"),
    Case("torch", page_size=1, num_heads=16, kv_dtype="float8_e4m3fn", dtype="bfloat16", q_len=2),
    Case("cutlass_mla", page_size=128, num_heads=16, kv_dtype="bfloat16", dtype="bfloat16"),
    Case("trtllm_mla", page_size=32, num_heads=16, kv_dtype="bfloat16", dtype="bfloat16", q_len=2),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"{c.backend}-p{c.page_size}-q{c.q_len}")
def test_padding_contract_without_capture(emulated: None, case: Case) -> None:
    _run(case, "cpu", steps=12, use_graphs=False, ref_every=3)


@pytest.mark.interp
def test_padding_contract_triton_interpreted() -> None:
    case = Case(
        "triton", page_size=16, num_heads=4, kv_dtype="float16", dtype="float16", dims=SMALL
    )
    _run(case, "cpu", steps=6, use_graphs=False, ref_every=2, sizes=(1, 2, 4, 8))


def test_runner_refuses_oversized_and_mismatched_batches(emulated: None) -> None:
    case = CPU_CASES[0]
    stream = DecodeStream(case, "cpu", num_requests=12)
    be = stream.rt.backend
    runner = CudaGraphRunner(
        be, partial(absorbed_forward, be), _specs(case), [1, 2], device="cpu", use_graphs=False
    )
    runner.capture()
    batch, inputs = stream.step(3)
    with pytest.raises(ValueError, match="exceeds the largest captured size 2"):
        runner.replay(batch, inputs)


GPU_CASES = [
    Case("torch", page_size=64, num_heads=16, kv_dtype="bfloat16", dtype="bfloat16"),
    Case("triton", page_size=64, num_heads=128, kv_dtype="bfloat16", dtype="bfloat16"),
    Case("triton", page_size=16, num_heads=16, kv_dtype="float8_e4m3fn", dtype="bfloat16", q_len=2),
    Case("flashmla", page_size=64, num_heads=128, kv_dtype="bfloat16", dtype="bfloat16"),
    Case("flashmla", page_size=64, num_heads=16, kv_dtype="bfloat16", dtype="bfloat16", q_len=2),
    Case("flashinfer_mla", page_size=1, num_heads=128, kv_dtype="bfloat16", dtype="bfloat16"),
    Case(
        "flashinfer_mla",
        page_size=16,
        num_heads=16,
        kv_dtype="float8_e4m3fn",
        dtype="bfloat16",
        q_len=2,
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", GPU_CASES, ids=lambda c: f"gpu-{c.backend}-h{c.num_heads}-{c.kv_dtype}-q{c.q_len}"
)
def test_gpu_graph_replay_1000(case: Case) -> None:
    _run(case, "cuda", steps=1000, use_graphs=True, ref_every=50)
