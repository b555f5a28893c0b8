"""MHA-mode prefill through torch's own kernels, per request: SDPA (cuDNN on Hopper) when no LSE
is asked, else the same cuDNN kernel called with `compute_log_sumexp` (natural-log LSE, for
chunk merges). Both measured faster than our Triton kernel at 8k tokens (BENCHMARKS.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mla_backends.batch import RaggedLayout


def sdpa_fits(layout: RaggedLayout, causal: bool) -> bool:
    """SDPA's is_causal is top-left aligned: it equals our bottom-right rule only when every
    request has as many queries as keys."""
    return not causal or torch.equal(layout.qo_indptr_cpu, layout.kv_indptr_cpu)


def torch_mha_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: RaggedLayout,
    causal: bool,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor | None,
) -> None:
    """Writes out [Tq, H, V] (and lse [Tq, H] when given). Requests with no keys give out 0
    and LSE -inf, as the merge expects. Hazard: the cuDNN op runs anything but bf16 as fp16
    (the caller routes fp16 / bf16 only: `tuning.mha_route`)."""
    cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention
    qo, kv = layout.qo_indptr_cpu.tolist(), layout.kv_indptr_cpu.tolist()
    for i in range(layout.batch_size):
        qs, qe, ks, ke = qo[i], qo[i + 1], kv[i], kv[i + 1]
        if qe == qs:
            continue
        if ke == ks:
            out[qs:qe].zero_()
            if lse is not None:
                lse[qs:qe] = float("-inf")
            continue
        # 4-D [1, H, S, D]: 3-D inputs fall back to the math kernel (50x slower at 8k).
        qi, ki, vi = (
            x[a:e].transpose(0, 1).unsqueeze(0)
            for x, a, e in ((q, qs, qe), (k, ks, ke), (v, ks, ke))
        )
        if lse is None:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal, scale=scale)
        else:
            o, lse_i = cudnn(qi, ki, vi, None, True, 0.0, causal, False, scale=scale)[:2]
            lse[qs:qe] = lse_i.reshape(q.shape[1], qe - qs).transpose(0, 1)
        out[qs:qe] = o[0].transpose(0, 1)
