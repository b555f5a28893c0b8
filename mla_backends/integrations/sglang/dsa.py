"""DeepSeek-V3.2 (DSA) in SGLang: our sparse MLA kernel behind SGLang's own `dsa` backend.

SGLang's `dsa` attention backend keeps its indexer, metadata, CUDA-graph state and MTP; this
module replaces only its sparse attention call on bf16 / fp16 latent pools,
`DeepseekSparseAttnBackend._forward_flashmla_sparse` (taken with `--dsa-prefill-backend
flashmla_sparse` / `--dsa-decode-backend flashmla_sparse`), by our `triton` sparse backend's
kernels (`sparse/gluon_kernel.py` on SM90 at H a multiple of 64, `sparse/triton_kernel.py`
elsewhere: they gather only the selected rows, take any head count, and need no FlashMLA
Hopper kernel). Opt in with `MLAB_DSA_SPARSE=triton` (always ours) or `auto` (ours
up to `auto_rows` query rows a call, where it is the faster one; SGLang's FlashMLA call above)
in the server's environment; `register` (the plug-in's entry point) then installs it through
SGLang's HookRegistry.

The contract, from SGLang 0.5.17's source: q_all [T, H, L + R] (latent then rope),
kv_cache the layer's pool rows (L + R wide, any leading shape), page_table_1 [T, K] int32
pool slots with -1 for unused entries, out [T, H, v_head_dim = L]; `topk_length` (the valid
entries a row) is not needed, as every unused entry is -1. Checked against SGLang's own
method signature and our reference on CPU (tests/test_sglang_dsa.py), and on an H100 inside
SGLang 0.5.17 through the entry point, against fp64 and SGLang's FlashMLA call
(scripts/sglang_dsa_gpu.py, `deep_gemm` stubbed for the import); no server run: SGLang's
indexer needs `deep_gemm`, which the GPU hosts of this project lack (docs/SGLANG_DSA.md).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch

from mla_backends.checks import unit_stride

logger = logging.getLogger(__name__)

TARGET = (
    "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend._forward_flashmla_sparse"
)
ENV = "MLAB_DSA_SPARSE"
CHOICES = ("triton", "auto")
# `auto`: our kernel while tokens x heads stays at or below `auto_rows`, SGLang's own FlashMLA
# sparse call above it (FlashMLA's is a prefill kernel: its ~60 us floor pays off once many
# query rows share it). H100, graph replay, top-k 2048 (BENCHMARKS.md, fifteenth session):
# through the Gluon kernel (H a multiple of 64, SM90) ours 1.38-3.69x up to 2048 rows (H128 x
# 16, H64 x 32 tokens), 0.96-0.99x at 3072-4096; through the `tl.dot` kernel (H16) 1.17-4.49x
# up to 1024 rows (64 tokens), 0.72x at 1536. Measured on the H100 only.
AUTO_ROWS_GLUON = 2048
AUTO_ROWS = 1024


def auto_rows(q_all: torch.Tensor, kv_cache: torch.Tensor, v_head_dim: int) -> int:
    """Query rows (tokens x heads) a call up to which `auto` takes ours: more where the call
    will take the Gluon kernel (`triton_kernel.gluon_kernel_for`, the call's own decision)."""
    from mla_backends.sparse.triton_kernel import gluon_kernel_for

    if q_all.dim() != 3:
        return AUTO_ROWS
    q_nope, q_rope = q_all[..., :v_head_dim], q_all[..., v_head_dim:]
    kv = kv_cache.view(-1, kv_cache.shape[-1])
    gluon = gluon_kernel_for(q_nope, q_rope, kv, None) is not None
    return AUTO_ROWS_GLUON if gluon else AUTO_ROWS


@functools.lru_cache(maxsize=16)
def _device_facts(device: torch.device) -> tuple[int, bool]:
    """SMs of `device` and whether it is an SM90 outside the interpreter (`sm90_gpu`): asked
    once a device, as the `triton` sparse backend asks them once."""
    from mla_backends.kernels.common import num_sms
    from mla_backends.sparse.triton_backend import sm90_gpu

    return num_sms(device), sm90_gpu(device)


def _launch(device: torch.device, heads: int, tokens: int, topk: int) -> dict[str, int]:
    """`launch_config` of a call (bf16 / fp16 pools), with the Gluon route's state now."""
    from mla_backends.kernels.mla_attention import gluon_error
    from mla_backends.sparse.triton_backend import launch_config

    sms, sm90 = _device_facts(device)
    return launch_config(heads, False, tokens, topk, sms, sm90 and gluon_error() is None)


def forward_sparse(
    backend: Any,
    q_all: torch.Tensor,
    kv_cache: torch.Tensor,
    v_head_dim: int,
    page_table_1: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
) -> torch.Tensor:
    """SGLang's `_forward_flashmla_sparse` (same arguments, `backend` its `self`) through our
    `triton` sparse kernel: attention of each query token over the pool rows its row of
    page_table_1 names -> [T, H, v_head_dim] in q_all's dtype."""
    from mla_backends.sparse import triton_kernel

    if q_all.dim() != 3:
        raise ValueError(f"q_all must be [tokens, heads, L + R], got {tuple(q_all.shape)}")
    t, h, width = q_all.shape
    if not 0 < v_head_dim < width:
        raise ValueError(f"v_head_dim {v_head_dim} must be below q_all's width {width}")
    if kv_cache.shape[-1] != width or kv_cache.dtype != q_all.dtype:
        raise ValueError(
            f"kv_cache rows must be {width} wide and {q_all.dtype} like q_all (bf16 / fp16 "
            f"pools; FP8 pools go through SGLang's own path), got {tuple(kv_cache.shape)} "
            f"{kv_cache.dtype}"
        )
    if page_table_1.dim() != 2 or page_table_1.shape[0] != t:
        raise ValueError(
            f"page_table_1 must be [tokens = {t}, topk], got {tuple(page_table_1.shape)}"
        )
    # no-ops for SGLang's contiguous int32 table and query (the kernel reads rows by offset)
    indices = unit_stride(page_table_1.to(torch.int32))
    launch = _launch(q_all.device, h, t, indices.shape[1])
    kv = kv_cache.view(-1, width)  # the pool itself: a copy would be the whole layer
    q_all = unit_stride(q_all)
    q_nope, q_rope = q_all[..., :v_head_dim], q_all[..., v_head_dim:]
    return triton_kernel.attend(q_nope, q_rope, kv, indices, sm_scale, 1.0, launch)[0]


# Hazard (--enable-torch-compile): SGLang compiles the model's forward for its small decode
# graphs, and its `dsa` backend calls this inside that trace; Dynamo would trace our kernel
# launches (Gluon's, with PDL and a try/except that turns Gluon off for the process). Run
# eagerly, as the adapter's `forward_extend` is.
forward_sparse = torch.compiler.disable(forward_sparse)


def auto_sparse(
    original: Any,
    backend: Any,
    q_all: torch.Tensor,
    kv_cache: torch.Tensor,
    v_head_dim: int,
    page_table_1: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
) -> torch.Tensor:
    """SGLang's `_forward_flashmla_sparse` wrapped (`MLAB_DSA_SPARSE=auto`): `forward_sparse`
    for calls of at most `auto_rows` query rows (tokens x heads), SGLang's own method above.
    Shapes, dtypes and the pool's layout only: the same choice at capture and replay of a
    graph, no host sync."""
    rows = q_all.shape[0] * q_all.shape[1] if q_all.dim() == 3 else None
    if rows is not None and rows <= auto_rows(q_all, kv_cache, v_head_dim):
        return forward_sparse(
            backend, q_all, kv_cache, v_head_dim, page_table_1, sm_scale, topk_length
        )
    return original(backend, q_all, kv_cache, v_head_dim, page_table_1, sm_scale, topk_length)


def register_hook() -> str | None:
    """Install our sparse call in SGLang's `dsa` backend when the environment asks for it:
    `MLAB_DSA_SPARSE=triton` replaces SGLang's FlashMLA sparse call with `forward_sparse`,
    `auto` wraps it (`auto_sparse`); returns the choice, or None."""
    choice = os.environ.get(ENV, "").strip()
    if not choice:
        return None
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={choice!r} is not one of {list(CHOICES)} (or unset)")
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    # REPLACE sets the class attribute: SGLang's calls pass the backend as `backend`; AROUND
    # passes SGLang's own method first
    if choice == "triton":
        HookRegistry.register(TARGET, forward_sparse, HookType.REPLACE)
    else:
        HookRegistry.register(TARGET, auto_sparse, HookType.AROUND)
    logger.info("mla-backends: DSA sparse attention through our kernel (%s)", choice)
    return choice
