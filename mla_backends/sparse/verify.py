"""Sparse backends in `verify`: every sparse backend that can run here, on every pool format
it reads, decode / verify / extend, against the fp64 sparse reference (the parity harness
of `sparse.testing`). DeepSeek dims and topk 2048 on a GPU; tiny dims on a CPU."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mla_backends.backends.context import Capability
from mla_backends.batch import ForwardMode
from mla_backends.config import MLADims
from mla_backends.sparse.base import (
    SparseBackendUnavailable,
    get_sparse_backend_class,
    sparse_backend_names,
)
from mla_backends.sparse.testing import SparseCase, context, run
from mla_backends.verify import Row

MODES = {
    "decode": (ForwardMode.DECODE, 1),
    "verify": (ForwardMode.TARGET_VERIFY, 3),
    "extend": (ForwardMode.EXTEND, 5),
}
POOLS = ("bfloat16", "fp8", "fp8_row")


def _case(
    name: str, pool: str, mode: str, device: torch.device, heads: int, seed: int
) -> SparseCase:
    """One `verify` case: DeepSeek dims and topk 2048 on a GPU, tiny dims on a CPU."""
    if device.type == "cuda":
        dims, topk, page = MLADims(heads, 512, 64, 128, 128, 40.0, 1.0), 2048, 64
        kv_lens: tuple[int, ...] = (1, 100, 2047, 2048, 2049, 5000)
    else:
        dims, topk, page, kv_lens = MLADims(heads, 128, 16, 16, 16), 32, 16, (1, 5, 31, 33, 70)
    exact = get_sparse_backend_class(name).caps.exact_counts
    fmode, q = MODES[mode]
    return SparseCase(
        name, pool, "bfloat16", fmode, q, kv_lens, topk, page, dims,
        drop=0.0 if exact else 0.2, empty_row=not exact, seed=seed,
    )  # fmt: skip


def verify_sparse(
    device: torch.device | str,
    heads: int = 16,
    seed: int = 0,
    backends: Sequence[str] | None = None,
) -> list[Row]:
    device = torch.device(device)
    rows = []
    for name in backends or sparse_backend_names():
        for pool in POOLS:
            for mode in MODES:
                try:
                    out_err, lse_err, detail = run(
                        _case(name, pool, mode, device, heads, seed), device
                    )
                except SparseBackendUnavailable:
                    continue  # `not_runnable_sparse` says why, once no pool of it runs
                rows.append(Row(f"sparse:{name}", mode, pool, out_err, lse_err, not detail, detail))
    return rows


def not_runnable_sparse(
    device: torch.device | str, heads: int = 16, backends: Sequence[str] | None = None
) -> dict[str, str]:
    """The sparse backends `verify_sparse` runs no row of here ("sparse:NAME"), each with
    its reasons over a bf16 pool (every backend reads one) at the cases' dims. Hazard:
    `verify` with `sparse_backend: flashmla` on a CPU said "NOT CHECKED: no row of it ran
    here" and named no cause."""
    device = torch.device(device)
    cap = Capability.detect(device)
    reasons: dict[str, str] = {}
    for name in backends or sparse_backend_names():
        cls = get_sparse_backend_class(name)
        cases = {pool: _case(name, pool, "decode", device, heads, 0) for pool in POOLS}
        why = {pool: cls.supports(context(c, device), cap) for pool, c in cases.items()}
        if all(why.values()):
            d, topk = cases["bfloat16"].dims, cases["bfloat16"].topk
            at = f"kv_lora_rank {d.kv_lora_rank} + rope {d.qk_rope_head_dim}, topk {topk}"
            reasons[f"sparse:{name}"] = f"{why['bfloat16']} (verify's sparse cases here: {at})"
    return reasons
