"""The raw peer kernels, called directly on the same inputs as our backends: FlashMLA
(sgl_kernel) and FlashInfer's MLA wrapper (fa3) for decode; torch SDPA and FlashInfer's ragged
wrapper for MHA-mode prefill. Kernel packages are imported inside the calls: a missing one is
an ImportError saying how to install it, recorded as that peer's one-line error."""

from __future__ import annotations

from collections.abc import Callable

import torch

from mla_backends.arith import cdiv
from mla_backends.backends.kernel_packages import require
from mla_backends.backends.util import joined_query
from mla_backends.batch import RaggedLayout
from mla_backends.bench.fixtures import DecodeSetup, PrefillInputs
from mla_backends.bench.timing import bench_us

# our backend -> the raw kernel it is compared with
RAW_PEER = {
    "triton": "raw_flashmla",
    "flashmla": "raw_flashmla",
    "flashinfer_mla": "raw_flashinfer_fa3",
}


def _need_cuda(device: torch.device) -> None:
    if device.type != "cuda":
        raise RuntimeError(f"needs a CUDA GPU (this run is on {device.type})")


def flashmla_call(s: DecodeSetup) -> Callable[[], object]:
    """The raw FlashMLA call (sgl_kernel) on the same pool, page table and queries, its
    scheduler metadata computed once (as a serving engine does per batch)."""
    _need_cuda(s.q_nope.device)
    fm = require("sgl_kernel.flash_mla")

    from mla_backends.indices import build_page_table, page_table_width

    pool, b = s.rt.kv_pool, s.batch.batch_size
    table = build_page_table(
        s.rt.req_pool.req_to_token,
        s.batch.req_pool_indices,
        s.batch.seq_lens,
        pool.page_size,
        page_table_width(s.kv_len, pool.page_size),
        0,
    )
    q = joined_query(s.q_nope, s.q_rope).view(b, s.q_len, s.heads, 576)
    seqlens = s.batch.seq_lens
    md, splits = fm.get_mla_metadata(seqlens, s.q_len * s.heads, 1)
    kcache = pool.get_paged_buffer(0)
    scale = s.rt.config.model.softmax_scale
    return lambda: fm.flash_mla_with_kvcache(
        q, kcache, table, seqlens, 512, md, splits, softmax_scale=scale, causal=True
    )


def flashinfer_call(s: DecodeSetup) -> Callable[[], object]:
    """The raw FlashInfer MLA wrapper (fa3), planned once, on the same pool (bf16, fp16 or
    FP8 rows) and queries."""
    dev = s.q_nope.device
    _need_cuda(dev)
    flashinfer = require("flashinfer")

    from mla_backends.indices import build_page_indices

    pool, b, ps = s.rt.kv_pool, s.batch.batch_size, s.rt.kv_pool.page_size
    n_pages = b * cdiv(s.kv_len, ps)
    indptr, indices = build_page_indices(
        s.rt.req_pool.req_to_token, s.batch.req_pool_indices, s.batch.seq_lens, ps, n_pages
    )
    qo = torch.arange(0, b + 1, device=dev, dtype=torch.int32) * s.q_len
    ws = torch.empty(128 << 20, dtype=torch.int8, device=dev)
    w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend="fa3")
    w.plan(
        qo_indptr=qo,
        kv_indptr=indptr,
        kv_indices=indices,
        kv_len_arr=s.batch.seq_lens,
        num_heads=s.heads,
        head_dim_ckv=512,
        head_dim_kpe=64,
        page_size=ps,
        causal=True,
        sm_scale=s.rt.config.model.softmax_scale,
        q_data_type=torch.bfloat16,
        kv_data_type=pool.dtype,
    )
    ckv, kpe = pool.get_ckv_kpe(0)
    # FP8 rows: FlashInfer 0.7 refuses a run without the dequant scales (ours: one per layer)
    scales = {"ckv_scale": pool.scale(0), "kpe_scale": pool.scale(0)} if pool.is_fp8 else {}
    return lambda: w.run(q_nope=s.q_nope, q_pe=s.q_rope, ckv_cache=ckv, kpe_cache=kpe, **scales)


def time_flashmla(s: DecodeSetup) -> float:
    """Eager median of the raw FlashMLA call."""
    return bench_us(flashmla_call(s))


def time_flashinfer(s: DecodeSetup) -> float:
    """Eager median of the raw FlashInfer fa3 call."""
    return bench_us(flashinfer_call(s))


PEER_CALLS: dict[str, Callable[[DecodeSetup], Callable[[], object]]] = {
    "raw_flashmla": flashmla_call,
    "raw_flashinfer_fa3": flashinfer_call,
}
DECODE_PEERS: dict[str, Callable[[DecodeSetup], float]] = {
    "raw_flashmla": time_flashmla,
    "raw_flashinfer_fa3": time_flashinfer,
}


def sdpa_prefill(x: PrefillInputs) -> Callable[[], torch.Tensor]:
    """torch SDPA over the one causal request: out [T, H, 128]."""
    import torch.nn.functional as F

    qt, kt, vt = (t.transpose(0, 1).unsqueeze(0) for t in (x.q, x.k, x.v))
    scale = x.dims.softmax_scale
    return lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)[
        0
    ].transpose(0, 1)


def flashinfer_ragged(x: PrefillInputs, layout: RaggedLayout) -> Callable[[], object]:
    """FlashInfer's raw ragged prefill wrapper, planned once (GPU, flashinfer installed)."""
    _need_cuda(x.q.device)
    flashinfer = require("flashinfer")
    heads = x.q.shape[1]
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=x.q.device)
    raw = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    raw.plan(
        layout.qo_indptr_cpu,
        layout.kv_indptr_cpu,
        heads,
        heads,
        192,
        head_dim_vo=128,
        causal=True,
        sm_scale=x.dims.softmax_scale,
        q_data_type=torch.bfloat16,
    )
    return lambda: raw.run(x.q, x.k, x.v)
