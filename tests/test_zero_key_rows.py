"""MHA-mode prefill rows of requests with no keys: out exactly 0 (and LSE -inf), with and
without LSE, for every backend that has an MHA path (FlashInfer leaves such rows undefined)."""

from __future__ import annotations

import pytest
from parity import WHERE, mha_backends

from mla_backends.config import MLADims
from mla_backends.testing import run_mha_case

# Kernel-legal and small enough for the interpreter; every dimension distinct.
SMALL = MLADims(
    num_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16
)
# (q_lens, kv_lens, causal): the example (rows 5-7 have no keys), and a causal batch
# where every request has as many queries as keys (the SDPA / cuDNN route of `triton`).
LAYOUTS = {
    "full-5x4-3x0": ([5, 3], [4, 0], False),
    "causal-6x6-0x0-4x4": ([6, 0, 4], [6, 0, 4], True),
    "full-2x0-7x9": ([2, 7], [0, 9], False),
}


def _cases(device: str) -> list[object]:
    """Every backend with an MHA-prefill path on `device` (tests/parity.py), marked by where
    it runs there (the triton backend on a CPU: the interpreter)."""
    return [
        pytest.param(
            r.backend,
            lay,
            lse,
            id=f"{r.backend}-{lay}-{'lse' if lse else 'nolse'}",
            marks=WHERE[r.where].marks,
        )
        for r in mha_backends(device)
        for lay in LAYOUTS
        for lse in (True, False)
    ]


@pytest.mark.parametrize("name,layout,lse", _cases("cpu"))
def test_zero_key_rows_cpu(name: str, layout: str, lse: bool) -> None:
    q_lens, kv_lens, causal = LAYOUTS[layout]
    r = run_mha_case(name, q_lens, kv_lens, causal, "float32", 4, SMALL, "cpu", return_lse=lse)
    assert r.ok, r.detail


@pytest.mark.gpu
@pytest.mark.parametrize("name,layout,lse", _cases("cuda"))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_zero_key_rows(name: str, layout: str, lse: bool, dtype: str) -> None:
    if name == "flashinfer_mla" and dtype == "float32":
        pytest.skip("flashinfer_mla takes bf16 / fp16 activations")
    q_lens, kv_lens, causal = LAYOUTS[layout]
    r = run_mha_case(name, q_lens, kv_lens, causal, dtype, 16, None, "cuda", return_lse=lse)
    assert r.ok, r.detail
