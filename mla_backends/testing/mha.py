"""MHA-mode prefill cases: ragged requests through `forward_mha` against the fp64 reference."""

from __future__ import annotations

import torch

from mla_backends.batch import ForwardMode, RaggedLayout
from mla_backends.config import KV_DTYPES, Config, MLADims
from mla_backends.reference import mha
from mla_backends.runtime import Runtime
from mla_backends.testing.cases import Case
from mla_backends.testing.compare import TOLERANCES, Result, compare


def run_mha_case(
    backend: str,
    q_lens: list[int],
    kv_lens: list[int],
    causal: bool,
    dtype: str = "bfloat16",
    num_heads: int = 16,
    dims: MLADims | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    return_lse: bool = True,
) -> Result:
    """MHA-mode prefill through `backend` vs the fp64 reference, per request. Rows of requests
    with no keys must be exactly 0 (and LSE -inf), with or without `return_lse`."""
    dims = (dims or MLADims()).with_heads(num_heads)
    device = torch.device(device)
    case = Case(
        backend=backend,
        mode=ForwardMode.EXTEND,
        num_heads=num_heads,
        dtype=dtype,
        kv_lens=tuple(kv_lens),
        dims=dims,
        seed=seed,
    )
    cfg = Config(
        model=dims,
        num_layers=1,
        prefill_backend=backend,
        decode_backend=backend,
        dtype=dtype,
        kv_dtype=dtype,
        num_pages=1,
        max_requests=1,
        device=str(device),
    )
    rt = Runtime.build(cfg)
    gen = torch.Generator().manual_seed(seed)
    act = KV_DTYPES[dtype]
    layout = RaggedLayout.from_lens(q_lens, kv_lens, device)
    q = torch.randn(layout.num_q, num_heads, dims.qk_head_dim, generator=gen).to(act)
    k = torch.randn(layout.num_kv, num_heads, dims.qk_head_dim, generator=gen).to(act)
    v = torch.randn(layout.num_kv, num_heads, dims.v_head_dim, generator=gen).to(act)
    q, k, v = (x.to(device) for x in (q, k, v))
    if return_lse:
        out, lse = rt.backend.forward_mha(q, k, v, layout, causal, return_lse=True)
    else:
        out, lse = rt.backend.forward_mha(q, k, v, layout, causal), None
    refs, ref_lses = [], []
    qo, kvp = layout.qo_indptr_cpu.tolist(), layout.kv_indptr_cpu.tolist()
    for i in range(layout.batch_size):
        o, lse_i = mha(
            q[qo[i] : qo[i + 1]],
            k[kvp[i] : kvp[i + 1]],
            v[kvp[i] : kvp[i + 1]],
            dims.softmax_scale,
            causal,
        )
        refs.append(o)
        ref_lses.append(lse_i)
    atol, rtol, lse_tol = TOLERANCES[dtype]
    out_err, d1 = compare("out", out, torch.cat(refs), atol, rtol)
    lse_err, d2 = (
        (0.0, "") if lse is None else compare("lse", lse, torch.cat(ref_lses), lse_tol, 0.0)
    )
    kv_lens_t = torch.tensor(kv_lens)
    empty = (kv_lens_t == 0).repeat_interleave(torch.tensor(q_lens), output_size=layout.num_q)
    d3 = ""
    if bool(empty.any()) and bool((out.cpu()[empty] != 0).any()):
        d3 = "out: rows of requests with no keys are not exactly 0"
    detail = "; ".join(x for x in (d1, d2, d3) if x)
    return Result(case, out_err, lse_err, out_err, not detail, detail)


# Ragged MHA-prefill batches (q_lens, kv_lens): a request with no keys, one with no queries.
RAGGED_PREFILL: dict[str, tuple[list[int], list[int]]] = {
    "short": ([1, 19, 0, 5, 6], [1, 40, 3, 0, 6]),  # interpreter size
    "mid": ([1, 17, 0, 5, 33], [1, 40, 6, 0, 33]),  # around 16- and 32-row tiles
    "long": ([1, 300, 0, 77, 128], [1, 1000, 30, 0, 128]),
}


def ragged_prefill_lens(causal: bool, size: str = "long") -> tuple[list[int], list[int]]:
    """A `RAGGED_PREFILL` batch. Causal (bottom-right) needs kv_len >= q_len, so kv lengths
    are raised to the query lengths."""
    q_lens, kv_lens = RAGGED_PREFILL[size]
    if causal:
        kv_lens = [max(q, k) for q, k in zip(q_lens, kv_lens)]
    return list(q_lens), list(kv_lens)
