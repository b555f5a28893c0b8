"""From SGLang's ModelRunner to one of our backends: the runner's Config, the choice of the
prefill backend, our pool objects over SGLang's own tensors (no copy, no second pool) and the
checks on them. What SGLang's flags mean to us, and the refusals naming the flag to change,
live in `settings.py` (re-exported here). Duck-typed on the runner: this module imports
nothing from SGLang.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from mla_backends.backends.base import BackendContext, Capability
from mla_backends.backends.protocol import AttentionBackend
from mla_backends.config import Config, MLADims
from mla_backends.integrations.sglang.settings import (
    KV_FLAGS,
    SettingsError,
    model_dims,
    refusal,
    settings_config,
)
from mla_backends.pool import MLATokenToKVPool, ReqToTokenPool
from mla_backends.runtime import create_backend

__all__ = [
    "KV_FLAGS",
    "PREFILL_FALLBACK",
    "Binding",
    "SettingsError",
    "bind",
    "check_kv_scales",
    "choose_roles",
    "detect_capability",
    "model_dims",
    "refusal",
    "runner_config",
    "settings_config",
    "wrap_pools",
]

logger = logging.getLogger(__name__)

PREFILL_FALLBACK = "triton"  # for decode-only backends (FlashMLA, CUTLASS, TRT-LLM)


def detect_capability(device: torch.device) -> Capability:
    """The device's capability (tests replace this to fake another GPU)."""
    return Capability.detect(device)


def mla_pool(runner: Any) -> tuple[Any, dict[int, int] | None]:
    """SGLang's MLA pool behind the runner's `token_to_kv_pool`, and how a layer id finds its
    layer there: None for a plain `MLATokenToKVPool` (layer id - start_layer); for a hybrid
    linear-attention model (Kimi-Linear: `HybridLinearKVPool(use_mla=True)`, an
    `MLATokenToKVPool` over the full-attention layers only) its layer-id map. Hazard: the
    hybrid pool's layer ids are the model's, sparse (layer 3, 7, ...); subtracting start_layer
    would read another layer's rows or fall outside the pool."""
    pool = runner.token_to_kv_pool
    if type(pool).__name__ != "HybridLinearKVPool" or not getattr(pool, "use_mla", False):
        return pool, None
    inner = pool.full_kv_pool
    if type(inner).__name__ != "MLATokenToKVPool":
        raise SettingsError(
            f"mla-backends reads SGLang's plain MLATokenToKVPool; this hybrid model's "
            f"full-attention layers are in {type(inner).__name__} (the unified memory pool is "
            "not supported)"
        )
    return inner, {int(k): int(v) for k, v in pool.full_attention_layer_id_mapping.items()}


def runner_config(runner: Any, dims: MLADims, backend: str, device: torch.device) -> Config:
    pool, _ = mla_pool(runner)
    r2t = runner.req_to_token_pool.req_to_token
    ps = int(runner.page_size)
    return settings_config(
        page_size=ps,
        kv_cache_dtype=runner.kv_cache_dtype,
        kv_flag=str(getattr(runner, "kv_cache_dtype_str", runner.kv_cache_dtype)),
        dtype=runner.dtype,
        dims=dims,
        backend=backend,
        device=device,
        num_layers=len(pool.kv_buffer),
        num_pages=int(pool.size) // ps,
        max_requests=r2t.shape[0] - 1,
        max_context_len=r2t.shape[1],
    )


def choose_roles(sgl_name: str, decode: str, config: Config, cap: Capability) -> Config:
    """Config with the prefill backend resolved: `decode` itself, or PREFILL_FALLBACK where
    `decode` serves decode here but has no prefill path. Raises with our reasons."""
    config = dataclasses.replace(config, decode_backend=decode, prefill_backend=decode)
    msg = refusal(sgl_name, decode, config, cap, "decode")
    if msg is not None:
        raise SettingsError(msg)
    if refusal(sgl_name, decode, config, cap, "prefill") is not None:
        logger.info("%s: prefill and extend run on our %r backend", sgl_name, PREFILL_FALLBACK)
        config = dataclasses.replace(config, prefill_backend=PREFILL_FALLBACK)
        msg = refusal(sgl_name, PREFILL_FALLBACK, config, cap, "prefill")
        if msg is not None:
            raise SettingsError(msg)
    return config


def check_kv_scales(layers: Iterable[Any]) -> None:
    """Refuse per-layer KV scales other than 1.

    Hazard: SGLang's own writers (the DeepSeek MHA prefill path's `set_mla_kv_buffer`, FlashMLA
    and FlashInfer backends, the test kit) store K unscaled, while our contract is
    stored = value / scale. With a scale of 1 both agree; with any other value rows written by
    SGLang would be read off by that factor."""
    for layer in layers:
        s = getattr(layer, "k_scale_float", None)
        if s is not None and float(s) != 1.0:
            raise SettingsError(
                f"layer {getattr(layer, 'layer_id', '?')} has a KV cache scale k_scale={s}: "
                "SGLang's own KV writers ignore it (they store values unscaled), so our "
                "backends, which honour it, would read those rows off by that factor. Use a "
                "checkpoint without KV scales (k_scale 1) or --kv-cache-dtype auto"
            )


def _check_pool(runner: Any) -> None:
    pool, _ = mla_pool(runner)
    if type(pool).__name__ != "MLATokenToKVPool":
        raise SettingsError(
            f"mla-backends reads SGLang's plain MLATokenToKVPool; this server built "
            f"{type(pool).__name__} (unified memory pool, DSA / FP4 KV caches are not supported)"
        )
    mc = runner.model_config
    want = (int(mc.kv_lora_rank), int(mc.qk_rope_head_dim))
    if (pool.kv_lora_rank, pool.qk_rope_head_dim) != want:
        raise SettingsError(
            f"KV pool rows are {pool.kv_lora_rank} + {pool.qk_rope_head_dim} wide, the model "
            f"needs {want[0]} + {want[1]}"
        )
    if int(pool.page_size) != int(runner.page_size):
        raise SettingsError(f"KV pool page size {pool.page_size} != --page-size {runner.page_size}")
    if pool.dtype != runner.kv_cache_dtype:
        raise SettingsError(f"KV pool dtype {pool.dtype} != runner's {runner.kv_cache_dtype}")


def wrap_pools(runner: Any, config: Config) -> tuple[MLATokenToKVPool, ReqToTokenPool]:
    """Our pool objects over SGLang's tensors: views, never copies.

    SGLang's per-layer buffer is `[size + page_size, 1, L + R]` (uint8 storage for FP8); ours
    is `[(num_pages + 1) * page_size, L + R]`, page 0 the dummy page in both. Hazard: `size`
    need not be a multiple of the page size; SGLang's allocator hands out pages
    1..size // page_size, so the leading (size // page_size + 1) * page_size rows hold every
    slot it can give out and the view stops there."""
    pool, ps = mla_pool(runner)[0], config.page_size
    d = config.model
    rows = (int(pool.size) // ps + 1) * ps
    views = []
    for i, buf in enumerate(pool.kv_buffer):
        if (
            buf.dim() != 3
            or buf.shape[1] != 1
            or buf.shape[2] != d.kv_dim
            or not buf.is_contiguous()
        ):
            raise SettingsError(
                f"SGLang KV buffer {i} has layout {list(buf.shape)} / {buf.stride()}, expected "
                f"contiguous [slots, 1, {d.kv_dim}]"
            )
        if buf.shape[0] < rows:
            raise SettingsError(f"SGLang KV buffer {i} has {buf.shape[0]} rows, expected {rows}")
        v = buf[:rows, 0]
        views.append(v.view(pool.dtype) if v.dtype != pool.dtype else v)
    device = views[0].device
    kv = MLATokenToKVPool(
        len(views),
        rows // ps - 1,
        ps,
        d.kv_lora_rank,
        d.qk_rope_head_dim,
        config.torch_kv_dtype,
        device,
        buffers=views,
    )
    if kv.is_fp8:  # SGLang's writers store values unscaled: the scale is 1 by its contract
        for layer in range(kv.num_layers):  # (check_kv_scales refused any other)
            kv.set_scale(layer, 1.0)
    r2t = runner.req_to_token_pool.req_to_token
    if r2t.dtype != torch.int32 or r2t.dim() != 2:
        raise SettingsError(f"req_to_token is {r2t.dtype} {list(r2t.shape)}, expected int32 2-D")
    req = ReqToTokenPool(r2t.shape[0] - 1, r2t.shape[1], r2t.device, table=r2t)
    return kv, req


@dataclass
class Binding:
    """Our backend over one SGLang runner."""

    sgl_name: str
    config: Config
    kv_pool: MLATokenToKVPool
    req_pool: ReqToTokenPool
    backend: AttentionBackend
    start_layer: int
    capability: Capability
    # SGLang's MLA pool (inside a hybrid model's pool) and its layer-id map (`mla_pool`)
    sgl_pool: Any = None
    layer_map: dict[int, int] | None = None

    def layer_index(self, layer_id: int) -> int | None:
        """Our pool's layer for SGLang's layer id, None if this rank's pool has no such layer."""
        if self.layer_map is not None:
            return self.layer_map.get(layer_id)
        idx = layer_id - self.start_layer
        return idx if 0 <= idx < self.kv_pool.num_layers else None


def bind(
    runner: Any,
    sgl_name: str,
    decode: str,
    num_heads: int,
    capability: Callable[[torch.device], Capability] | None = None,
) -> Binding:
    """Check the runner's settings against our backend and build it over SGLang's buffers."""
    mc = runner.model_config
    if not getattr(runner, "use_mla_backend", False):
        raise SettingsError(
            f"--attention-backend {sgl_name} serves MLA models (DeepSeek-V2/V3/R1, Kimi-K2, "
            f"Kimi-Linear); this model's attention is {getattr(mc, 'attention_arch', '?')}"
        )
    _check_pool(runner)
    sgl_pool, layer_map = mla_pool(runner)
    device = sgl_pool.kv_buffer[0].device
    cap = (capability or detect_capability)(device)
    dims = model_dims(mc, num_heads)
    config = choose_roles(sgl_name, decode, runner_config(runner, dims, decode, device), cap)
    model = getattr(runner, "model", None)
    if model is not None and hasattr(model, "modules"):
        check_kv_scales(m for m in model.modules() if hasattr(m, "k_scale_float"))
    kv, req = wrap_pools(runner, config)
    try:
        backend = create_backend(BackendContext(config, kv, req))
    except ImportError as e:  # the kit would turn an ImportError into a skip: fail instead
        raise RuntimeError(f"--attention-backend {sgl_name}: {e}") from e
    start = int(getattr(runner.token_to_kv_pool, "start_layer", 0) or 0)
    return Binding(sgl_name, config, kv, req, backend, start, cap, sgl_pool, layer_map)
