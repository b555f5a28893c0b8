"""`verify` of a config with `dcp_size` > 1: its backends over `dcp_size` ranks (gloo
processes on a CPU, one NCCL process a GPU), each case against one process holding the whole
KV and against the fp64 reference (`parity.run_dcp_case`), at the config's dims, page size,
dtypes and head split."""

from __future__ import annotations

import os
from typing import Any

import torch

from mla_backends.batch import ForwardMode
from mla_backends.config import Config
from mla_backends.dcp.launch import spawn
from mla_backends.dcp.parity import DCPCase, edge_lens, parity_worker

# (row mode, forward mode, query tokens: verify's draft count, 0 = extend's own per request)
MODES = (
    ("decode", ForwardMode.DECODE, 1),
    ("verify", ForwardMode.TARGET_VERIFY, 2),
    ("extend", ForwardMode.EXTEND, 0),
)


def label(config: Config) -> str:
    """How `verify` names the config's DCP rows: `dcp2:triton`."""
    return f"dcp{config.dcp_size}:{config.decode_backend}"


def unrunnable(config: Config) -> str | None:
    """Why the config's DCP cannot be checked on this machine, or None."""
    n = config.dcp_size
    if config.torch_device.type == "cuda" and (found := torch.cuda.device_count()) < n:
        return f"dcp_size {n} needs {n} GPUs (one NCCL rank each), found {found}"
    if config.torch_device.type == "cpu" and n > 2 * (cpus := os.cpu_count() or 1):
        return f"dcp_size {n} would start {n} gloo processes, over twice this machine's {cpus} CPUs"
    return None


def dcp_cases(config: Config, seed: int = 0) -> list[DCPCase]:
    """Decode, verify and extend (extend through the config's prefill backend), then a
    decode stream through the graph runner (captured graphs on a GPU, its static buffers
    eagerly on a CPU), at the group's heads: H per rank, times dcp_size under "tp"."""
    n, m = config.dcp_size, config.model
    group_heads = m.num_heads * n if config.dcp_heads == "tp" else m.num_heads
    common: dict[str, Any] = {
        "page_size": config.page_size,
        "num_heads": group_heads,
        "heads": config.dcp_heads,
        "kv_lens": edge_lens(n, config.page_size),
        "dtype": config.dtype,
        "kv_dtype": config.kv_dtype,
        "dims": m,
        "prefill_backend": config.prefill_backend,
        "seed": seed,
    }
    be = config.decode_backend
    cases = [DCPCase(be, mode, q, **common) for _, mode, q in MODES]
    return [*cases, DCPCase(be, ForwardMode.DECODE, 1, graphs=True, steps=3, **common)]


def verify_dcp(config: Config, seed: int = 0) -> list[dict[str, Any]]:
    """Every case of `dcp_cases` on `dcp_size` fresh ranks; one result a case, each rank's
    worst error and every rank's failure joined ([] where `unrunnable`)."""
    if unrunnable(config) is not None:
        return []
    cases = dcp_cases(config, seed)
    dev = config.torch_device.type  # "cuda": each rank takes its own GPU
    per_rank = spawn(
        parity_worker, config.dcp_size, "nccl" if dev == "cuda" else "gloo", (cases, dev)
    )
    merged = []
    for i, case in enumerate(cases):
        results = [rank[i] for rank in per_rank]
        errors = [r["errors"] for r in results]
        merged.append(
            {
                "case": case,
                "ok": all(r["ok"] for r in results),
                "out_err": max(_worst(e, "out") for e in errors),
                "lse_err": max(_worst(e, "lse") for e in errors),
                "detail": "; ".join(
                    f"rank {r['rank']}: {r['detail']}" for r in results if r["detail"]
                ),
            }
        )
    return merged


def _worst(errors: dict[str, float], kind: str) -> float:
    """The largest error of `kind` ("out" or "lse") among a rank's checks."""
    return max((v for k, v in errors.items() if kind in k.split()), default=0.0)


def mode_name(case: DCPCase) -> str:
    """A row's mode: `decode-tp`, `verify-replicated`, `decode-graph-tp`."""
    mode = next(name for name, m, _ in MODES if m is case.mode)
    return f"{mode}{'-graph' if case.graphs else ''}-{case.heads}"
