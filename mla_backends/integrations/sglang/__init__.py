"""SGLang plug-in: `pip install .` from this checkout (not on PyPI), then
`--attention-backend mlab_triton` (or `mlab_flashmla`, `mlab_flashinfer`, `mlab_cutlass`,
`mlab_trtllm`, `mlab_torch`).

SGLang finds `register` through the entry point `[project.entry-points."sglang.srt.plugins"]`
and calls it in every process before it parses arguments. Importing this package does not
import SGLang; `register()` does. It adds, per suite backend in this build:
- an SGLang attention backend (the factory builds `adapter.MLABackendAdapter` and checks the
  server's settings against our backend there, raising our reason),
- the name to the CLI choices and to the chunked-prefix list,
- DeepSeek's absorbed-attention routing: the name joins FORWARD_ABSORB_CORE_ATTENTION_BACKENDS
  (our backends take q / k split into latent and rope parts, as our interface does) and gets
  the chunked-prefix handler (MHA-mode prefill for prompts without a cached prefix and, merged
  by LSE, for long cached prefixes; absorbed attention otherwise),
- a check after `ServerArgs.check_server_args` that refuses settings our backend cannot run
  (page size, KV dtype, GPU) in the launching process, before any worker starts,
- with `MLAB_DSA_SPARSE=triton` (or `auto`: where it is the faster one), our sparse kernel in
  SGLang's own DeepSeek-V3.2 `dsa` backend (`dsa.py`).
SGLang logs and swallows exceptions raised by plugins, so the factory checks again.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any

import torch

from mla_backends.backends.registry import available_backends

logger = logging.getLogger(__name__)

# Our backend name -> the SGLang name; a backend added to the suite later gets "mlab_<name>".
SGLANG_NAMES = {
    "flashmla": "mlab_flashmla",
    "flashinfer_mla": "mlab_flashinfer",
    "cutlass_mla": "mlab_cutlass",
    "trtllm_mla": "mlab_trtllm",
    "triton": "mlab_triton",
    "torch": "mlab_torch",
}
MIN_SGLANG = (0, 5, 17)  # init_forward_metadata_out_graph / in_graph, KVWriteLoc, plugins
TESTED_SGLANG = ("0.5.17",)
CHECK_TARGET = "sglang.srt.server_args.ServerArgs.check_server_args"


def sglang_names() -> dict[str, str]:
    """SGLang name -> our backend, for every suite backend in this build."""
    return {SGLANG_NAMES.get(n, f"mlab_{n}"): n for n in available_backends()}


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def create(runner: Any, *, sgl_name: str, decode: str) -> Any:
    """The factory SGLang calls with its ModelRunner (in the scheduler process)."""
    from mla_backends.integrations.sglang.adapter import MLABackendAdapter

    return MLABackendAdapter(runner, sgl_name, decode)


def deepseek_handler(attn: Any, forward_batch: Any, *, sgl_name: str) -> Any:
    """DeepSeek's per-batch choice between MHA-mode prefill and absorbed attention for our
    names: SGLang's own chunked-prefix policy (as for flashinfer / fa3), never MHA one-shot."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        _handle_attention_backend,
    )

    return _handle_attention_backend(attn, forward_batch, sgl_name)


def register() -> list[str]:
    """Entry point: register our backends with SGLang (idempotent). Returns the names."""
    import sglang

    version = getattr(sglang, "__version__", "0")
    if _version(version) < MIN_SGLANG:
        logger.error(
            "mla-backends needs SGLang >= %s, found %s: not registered",
            ".".join(map(str, MIN_SGLANG)),
            version,
        )
        return []
    if version not in TESTED_SGLANG:
        logger.warning("mla-backends was tested with SGLang %s, found %s", TESTED_SGLANG, version)
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )
    from sglang.srt.server_args import (
        ATTENTION_BACKEND_CHOICES,
        CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS,
        add_attention_backend_choices,
        add_chunked_prefix_cache_attention_backend,
    )

    names = sglang_names()
    first = not any(n in ATTENTION_BACKENDS for n in names)
    for sgl_name, ours in names.items():
        if sgl_name not in ATTENTION_BACKENDS:
            factory = functools.partial(create, sgl_name=sgl_name, decode=ours)
            register_attention_backend(sgl_name)(factory)
        if sgl_name not in CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS:
            add_chunked_prefix_cache_attention_backend(sgl_name)
    add_attention_backend_choices([n for n in names if n not in ATTENTION_BACKEND_CHOICES])
    _register_deepseek(names)
    if first:
        _register_args_check()
        _register_dsa()
    return list(names)


def _register_dsa() -> None:
    from mla_backends.integrations.sglang import dsa

    try:
        dsa.register_hook()
    except Exception as e:  # noqa: BLE001 - SGLang would swallow it; say why, loudly
        logger.error("mla-backends: DSA sparse attention hook not installed: %s", e)


def _register_deepseek(names: dict[str, str]) -> None:
    try:
        from sglang.srt.models.deepseek_common.attention_backend_handler import (
            AttentionBackendRegistry,
        )
        from sglang.srt.models.deepseek_common.utils import FORWARD_ABSORB_CORE_ATTENTION_BACKENDS
    except Exception as e:  # noqa: BLE001 - e.g. a trimmed install: DeepSeek then uses its
        # default routing (the triton handler, joined q / k), which the adapter also serves
        logger.warning("mla-backends: DeepSeek attention routing not registered: %s", e)
        return
    for sgl_name in names:
        handler = functools.partial(deepseek_handler, sgl_name=sgl_name)
        AttentionBackendRegistry.register(sgl_name, handler)
        if sgl_name not in FORWARD_ABSORB_CORE_ATTENTION_BACKENDS:
            FORWARD_ABSORB_CORE_ATTENTION_BACKENDS.append(sgl_name)


def _register_args_check() -> None:
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except Exception as e:  # noqa: BLE001 - the factory repeats every check
        logger.warning("mla-backends: no start-up settings check (%s); the factory checks", e)
        return
    HookRegistry.register(CHECK_TARGET, check_server_args_hook, HookType.AFTER)


def _kv_dtype(flag: str, model_dtype: torch.dtype) -> torch.dtype | None:
    """SGLang's --kv-cache-dtype -> the pool's torch dtype (None: not one we take)."""
    table = {
        "auto": model_dtype,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp8_e4m3": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2,
    }
    return table.get(flag)


def _is_dsa(model_config: Any) -> bool:
    """SGLang's own test: the config names an indexer (`is_deepseek_dsa`)."""
    try:
        from sglang.srt.configs.model_config import is_deepseek_dsa
    except ImportError:  # another SGLang: the factory's pool check still refuses it
        return False
    return bool(is_deepseek_dsa(getattr(model_config, "hf_config", None)))


def _attn_tp_size(sa: Any) -> int:
    """The ranks a layer's heads are split over, as SGLang's `compute_dp_attention_world_info`
    derives the workers' `attn_tp_size`. Hazard: tp_size alone counted fewer heads a rank than
    the workers build under --enable-dp-attention, so a head limit that they refuse after
    loading the weights passed here."""
    from mla_backends.integrations.sglang.settings import int_flag

    dp = int_flag(sa, "dp_size") if getattr(sa, "enable_dp_attention", False) else 1
    return max(int_flag(sa, "tp_size") // dp // int_flag(sa, "attn_cp_size"), 1)


def check_server_args_hook(result: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """After `ServerArgs.check_server_args` (launching process): refuse settings our chosen
    backends cannot run, with our reason, before a worker starts. Only the model's dims and
    the server flags are known here; the factory repeats the full check."""
    from mla_backends.integrations.sglang import binding, settings

    names = sglang_names()
    sa = server_args
    chosen = {
        getattr(sa, f, None)
        for f in ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
    }
    ours = sorted(n for n in chosen if n in names)
    if not ours:
        return
    msg = settings.server_refusal(ours[0], sa, settings.int_flag(sa, "dcp_size") > 1)
    if msg is not None:
        raise settings.SettingsError(msg)
    mc = sa.get_model_config()
    arch = getattr(getattr(mc, "attention_arch", None), "name", None)
    if arch != "MLA":
        raise settings.SettingsError(
            f"--attention-backend {ours[0]} serves MLA models (DeepSeek-V2/V3/R1, Kimi-K2, "
            f"Kimi-Linear); this model's attention is {arch}"
        )
    if _is_dsa(mc):  # refused here, not after every worker loaded the weights (pool check)
        raise settings.SettingsError(
            f"--attention-backend {ours[0]}: this is a DeepSeek-V3.2 (DSA) model; serve it "
            "with --attention-backend dsa and MLAB_DSA_SPARSE=triton (or auto) for our sparse "
            "kernel (README, SGLang section)"
        )
    model_dtype = getattr(mc, "dtype", torch.bfloat16)
    if getattr(sa, "device", "cuda") == "cuda" and torch.cuda.is_available():
        device = torch.device("cuda", int(getattr(sa, "base_gpu_id", 0) or 0))
    else:
        device = torch.device("cpu")
    cap = binding.detect_capability(device)
    heads = int(mc.num_attention_heads) // _attn_tp_size(sa)
    dims = settings.model_dims(mc, max(heads, 1))
    for sgl_name in ours:
        config = settings.settings_config(
            page_size=int(sa.page_size or 1),
            kv_cache_dtype=_kv_dtype(str(sa.kv_cache_dtype), model_dtype),
            kv_flag=str(sa.kv_cache_dtype),
            dtype=model_dtype,
            dims=dims,
            backend=names[sgl_name],
            device=device,
        )
        binding.choose_roles(sgl_name, names[sgl_name], config, cap)
