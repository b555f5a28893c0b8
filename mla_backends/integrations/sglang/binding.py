"""From SGLang's ModelRunner to one of our backends: the Config, our pool objects over SGLang's
own tensors (no copy, no second pool), and the capability checks, whose reasons name the SGLang
flag to change. Duck-typed on the runner: this module imports nothing from SGLang.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from mla_backends.backends.base import BackendContext, Capability
from mla_backends.backends.protocol import AttentionBackend
from mla_backends.backends.registry import why_not
from mla_backends.config import ACT_DTYPES, KV_DTYPES, PAGE_SIZES, Config, MLADims
from mla_backends.pool import MLATokenToKVPool, ReqToTokenPool
from mla_backends.runtime import create_backend

logger = logging.getLogger(__name__)

# What SGLang's user passes to get each of our KV dtypes.
KV_FLAGS = {
    "bfloat16": "--kv-cache-dtype bf16",
    "float16": "--kv-cache-dtype auto with --dtype float16",
    "float32": "--kv-cache-dtype auto with --dtype float32",
    "float8_e4m3fn": "--kv-cache-dtype fp8_e4m3",
}
PREFILL_FALLBACK = "triton"  # for decode-only backends (FlashMLA, CUTLASS, TRT-LLM)


class SettingsError(ValueError):
    """SGLang was started with settings our backend cannot serve; the message names the flag.

    A ValueError on purpose: SGLang's test kit turns AssertionError / ImportError raised by a
    backend factory into a skipped test, and the server must fail loudly instead."""


def detect_capability(device: torch.device) -> Capability:
    """The device's capability (tests replace this to fake another GPU)."""
    return Capability.detect(device)


def _dtype_name(dtype: torch.dtype, table: dict[str, torch.dtype]) -> str | None:
    return next((k for k, v in table.items() if v == dtype), None)


def model_dims(model_config: Any, num_heads: int) -> MLADims:
    """Our dims for SGLang's model config, with our softmax scale equal to SGLang's.

    Hazard: SGLang hands over the final scale (`model_config.scaling`, YaRN mscale^2 already
    applied by its own formula); our dims carry it as (P + R)^-0.5 * mscale^2. The mscale is
    expressed with mscale_all_dim = 1 and the YaRN factor that gives it, so whatever formula
    SGLang used, the scale the kernels get is SGLang's (checked to 1e-9 relative)."""
    mc = model_config
    dims = MLADims(
        num_heads=num_heads,
        kv_lora_rank=int(mc.kv_lora_rank),
        qk_rope_head_dim=int(mc.qk_rope_head_dim),
        qk_nope_head_dim=int(mc.qk_nope_head_dim),
        v_head_dim=int(mc.v_head_dim),
    )
    want = float(mc.scaling)
    ratio = want / dims.softmax_scale
    if ratio < 1.0 - 1e-9:
        raise SettingsError(
            f"the model's softmax scale {want:.6g} is below (qk_nope + qk_rope)^-0.5 = "
            f"{dims.softmax_scale:.6g}; mla-backends cannot express it"
        )
    if ratio > 1.0 + 1e-9:
        mscale = math.sqrt(ratio)
        dims = dataclasses.replace(
            dims, rope_scaling_factor=math.exp(10.0 * (mscale - 1.0)), mscale_all_dim=1.0
        )
    if not math.isclose(dims.softmax_scale, want, rel_tol=1e-9):
        raise SettingsError(f"softmax scale {dims.softmax_scale!r} != model's {want!r}")
    return dims


def settings_config(
    *,
    page_size: int,
    kv_cache_dtype: torch.dtype | None,
    kv_flag: str,
    dtype: torch.dtype,
    dims: MLADims,
    backend: str,
    device: torch.device,
    num_layers: int = 1,
    num_pages: int = 1,
    max_requests: int = 1,
    max_context_len: int = 1,
) -> Config:
    """Our Config for SGLang's settings; a setting it cannot express raises naming the flag."""
    if page_size not in PAGE_SIZES:
        raise SettingsError(f"--page-size {page_size}: mla-backends takes page sizes {PAGE_SIZES}")
    kv = None if kv_cache_dtype is None else _dtype_name(kv_cache_dtype, KV_DTYPES)
    if kv is None:
        raise SettingsError(
            f"--kv-cache-dtype {kv_flag} ({kv_cache_dtype}) is not supported by mla-backends; "
            "use auto, bf16 or fp8_e4m3"
        )
    act = _dtype_name(dtype, ACT_DTYPES)
    if act is None:
        raise SettingsError(f"model dtype {dtype}: use --dtype bfloat16 or float16")
    return Config(
        model=dims,
        num_layers=num_layers,
        prefill_backend=backend,
        decode_backend=backend,
        page_size=page_size,
        kv_dtype=kv,
        dtype=act,
        num_pages=max(num_pages, 1),
        max_requests=max(max_requests, 1),
        max_context_len=max(max_context_len, 1),
        device=str(device),
    )


def runner_config(runner: Any, dims: MLADims, backend: str, device: torch.device) -> Config:
    pool = runner.token_to_kv_pool
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


def _alternatives(
    name: str, config: Config, cap: Capability, role: str
) -> tuple[list[int], list[str]]:
    """Page sizes and KV dtypes with which our backend would run here, the rest unchanged."""
    pages = [
        p
        for p in PAGE_SIZES
        if why_not(name, dataclasses.replace(config, page_size=p), cap, role) is None
    ]
    kvs = [
        k
        for k in KV_DTYPES
        if why_not(name, dataclasses.replace(config, kv_dtype=k), cap, role) is None
    ]
    return pages, kvs


def refusal(sgl_name: str, name: str, config: Config, cap: Capability, role: str) -> str | None:
    """Why our backend `name` cannot serve `role` under these settings, in SGLang's terms, or
    None. The reason is our backend's own (its `supports`), plus the flag that would fix it."""
    reason = why_not(name, config, cap, role)
    if reason is None:
        return None
    msg = f"--attention-backend {sgl_name}: our {name!r} backend cannot serve {role}: {reason}"
    pages, kvs = _alternatives(name, config, cap, role)
    if config.page_size not in pages and pages:
        msg += f". Start SGLang with --page-size {pages[0]} (it takes {pages})"
    elif config.kv_dtype not in kvs and kvs:
        msg += f". Start SGLang with {' or '.join(KV_FLAGS[k] for k in kvs)}"
    return (
        msg
        + f" [settings: --page-size {config.page_size}, {KV_FLAGS[config.kv_dtype]}, "
        + (f"--dtype {config.dtype}, device {cap.describe()}]")
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
    pool = runner.token_to_kv_pool
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
    pool, ps = runner.token_to_kv_pool, config.page_size
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
    device = runner.token_to_kv_pool.kv_buffer[0].device
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
    return Binding(sgl_name, config, kv, req, backend, start, cap)
