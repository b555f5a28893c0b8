"""Sparse backends in `verify`: every sparse backend that can run here, on every pool format
it reads, decode / verify / extend, against the fp64 sparse reference (the parity harness
of `sparse.testing`). DeepSeek dims and topk 2048 on a GPU; tiny dims on a CPU."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mla_backends.batch import ForwardMode
from mla_backends.config import MLADims
from mla_backends.sparse.base import (
    SparseBackendUnavailable,
    get_sparse_backend_class,
    sparse_backend_names,
)
from mla_backends.sparse.testing import SparseCase, run
from mla_backends.verify import Row

MODES = {
    "decode": (ForwardMode.DECODE, 1),
    "verify": (ForwardMode.TARGET_VERIFY, 3),
    "extend": (ForwardMode.EXTEND, 5),
}
POOLS = ("bfloat16", "fp8", "fp8_row")


def verify_sparse(
    device: torch.device | str,
    heads: int = 16,
    seed: int = 0,
    backends: Sequence[str] | None = None,
) -> list[Row]:
    device = torch.device(device)
    gpu = device.type == "cuda"
    if gpu:
        dims, topk, page = MLADims(heads, 512, 64, 128, 128, 40.0, 1.0), 2048, 64
        kv_lens: tuple[int, ...] = (1, 100, 2047, 2048, 2049, 5000)
    else:
        dims, topk, page, kv_lens = MLADims(heads, 128, 16, 16, 16), 32, 16, (1, 5, 31, 33, 70)
    rows = []
    for name in backends or sparse_backend_names():
        exact = get_sparse_backend_class(name).caps.exact_counts
        for pool in POOLS:
            for mode_name, (mode, q) in MODES.items():
                case = SparseCase(
                    name, pool, "bfloat16", mode, q, kv_lens, topk, page, dims,
                    drop=0.0 if exact else 0.2, empty_row=not exact, seed=seed,
                )  # fmt: skip
                try:
                    out_err, lse_err, detail = run(case, device)
                except SparseBackendUnavailable:
                    continue
                rows.append(
                    Row(f"sparse:{name}", mode_name, pool, out_err, lse_err, not detail, detail)
                )
    return rows
