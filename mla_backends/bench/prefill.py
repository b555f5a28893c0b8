"""MHA-mode prefill, one causal request: torch SDPA and FlashInfer's raw ragged wrapper
against our backends' `forward_mha` (without and with LSE) and our Triton kernel (LSE), each
with its largest |difference| to SDPA. `prefill.json` holds `prefill`."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from mla_backends.backends.base import Capability
from mla_backends.batch import RaggedLayout
from mla_backends.bench.fixtures import (
    PrefillInputs,
    prefill_config,
    prefill_dims,
    require_runs,
)
from mla_backends.bench.options import Options, pick
from mla_backends.bench.peers import flashinfer_ragged, sdpa_prefill
from mla_backends.bench.report import prefill_lines, write
from mla_backends.bench.timing import bench_us
from mla_backends.cli import UsageError, out_of_memory
from mla_backends.config import Config
from mla_backends.runtime import Runtime

# The default prefill on a CPU: 8192 tokens at 128 heads would need a 34 GB score matrix.
CPU_TOKENS = 512


def default_tokens(device: torch.device, gpu_tokens: int) -> int:
    return gpu_tokens if device.type == "cuda" else CPU_TOKENS


def _triton_kernel(
    x: PrefillInputs, layout: RaggedLayout, out: torch.Tensor, lse: torch.Tensor
) -> Callable[[], object]:
    from mla_backends.kernels import tuning
    from mla_backends.kernels.mha_prefill import mha_prefill

    # Under the Triton interpreter (CPU): small tiles and fp32 dots, as the backend runs it.
    cfg: dict[str, Any] = {} if x.q.is_cuda else {**tuning.INTERP_MHA, "dot_f32": True}
    t, scale = x.q.shape[0], x.dims.softmax_scale
    return lambda: mha_prefill(
        x.q, x.k, x.v, layout.qo_indptr, layout.kv_indptr, t, scale, True, out, lse, **cfg
    )


def _out_of(forward_mha: Callable[..., tuple[torch.Tensor, torch.Tensor]], *args: Any) -> Any:
    """The out of a `forward_mha(..., return_lse=True)` call (the LSE path, timed)."""
    return forward_mha(*args, return_lse=True)[0]


def check_prefill_backends(backends: list[str], heads: int, device: torch.device) -> None:
    """ConfigError unless every backend runs MHA-mode prefill here, before any timing."""
    cap = Capability.detect(device)
    for name in backends:
        require_runs(name, prefill_config(name, prefill_dims(heads), device), cap, "prefill")


def prefill_table(
    backends: list[str],
    tokens: int = 8192,
    heads: int = 128,
    device: torch.device | None = None,
) -> dict:
    """Times and |differences| to SDPA, keyed `<path>_us`, `<path>_tflops`,
    `<path>_max_abs_diff_vs_sdpa`; a path that cannot run here leaves `<path>_error`."""
    dev = torch.device("cuda") if device is None else device
    # the inputs and SDPA's reference: one line naming the option, not a traceback after the
    # decode rows of grid / anchors were timed
    with out_of_memory(f"--prefill-tokens {tokens}", dev, f"give fewer (at {heads} heads)"):
        x = PrefillInputs.random(tokens, heads, dev)
        sdpa = sdpa_prefill(x)
        ref = sdpa().float()
    layout = RaggedLayout.from_lens([tokens], [tokens], dev)
    out = torch.empty(tokens, heads, 128, device=dev, dtype=torch.bfloat16)
    lse = torch.empty(tokens, heads, device=dev, dtype=torch.float32)
    res: dict = {"tokens": tokens, "heads": heads, "flops": x.flops}
    fns: dict[str, Callable[[], object]] = {"sdpa": sdpa}
    if dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        fns["triton_kernel_lse"] = _triton_kernel(x, layout, out, lse)
    try:
        fns["flashinfer_raw"] = flashinfer_ragged(x, layout)
    except Exception as e:  # a peer that cannot run here is reported, not fatal
        res["flashinfer_raw_error"] = f"{type(e).__name__}: {e}"[:200]
    for name in backends:
        be = Runtime.build(prefill_config(name, x.dims, dev)).backend
        fns[f"{name}_backend"] = partial(be.forward_mha, x.q, x.k, x.v, layout)
        fns[f"{name}_backend_lse"] = partial(_out_of, be.forward_mha, x.q, x.k, x.v, layout)
    for name, fn in fns.items():
        try:
            o = fn()
            o = out if o is None else o
            res[f"{name}_max_abs_diff_vs_sdpa"] = float((o.float() - ref).abs().max())  # type: ignore[attr-defined]
            us = bench_us(fn, device=dev)
            res[f"{name}_us"], res[f"{name}_tflops"] = us, x.flops / us / 1e6
        except Exception as e:
            res[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
    return res


def run(opts: Options, config: Config) -> None:
    dev = config.torch_device
    backends = opts.backends or [config.prefill_backend]
    heads = opts.one_heads(128)
    tokens = pick(opts.prefill_tokens, default_tokens(dev, 8192))
    if tokens == 0:
        raise UsageError("--prefill-tokens 0 leaves --suite prefill nothing to time")
    check_prefill_backends(backends, heads, dev)
    result: dict = {"device": Capability.detect(dev).describe(), "torch": torch.__version__}
    result["prefill"] = prefill_table(backends, tokens, heads, dev)
    (path,) = write(Path(opts.out), {"prefill.json": result})
    print("\n".join(prefill_lines(result["prefill"])))
    print(f"wrote {path}")
