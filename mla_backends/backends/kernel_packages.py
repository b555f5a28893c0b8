"""Importing the kernel packages: one place, clear errors that say how to install them."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from mla_backends.backends.base import Capability
from mla_backends.config import Config

INSTALL = {
    "flashinfer": "pip install flashinfer-python==0.7.2.post1 (or mla-backends[gpu])",
    "sgl_kernel": "pip install sglang-kernel==0.4.3 (or mla-backends[gpu])",
    "flash_mla": "build deepseek-ai/FlashMLA",  # or sgl_kernel's, which every caller names too
    "fla": "pip install fla-core==0.6.0 (or mla-backends[gpu])",
}


def missing(*modules: str) -> str | None:
    """Reason string if none of `modules` is importable (without importing it), else None."""
    if any(importlib.util.find_spec(m.split(".")[0]) is not None for m in modules):
        return None
    hints = "; ".join(INSTALL.get(m.split(".")[0], f"install {m}") for m in modules)
    return f"package {' or '.join(modules)} is not installed ({hints})"


def require(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        hint = INSTALL.get(module.split(".")[0], f"install {module}")
        raise ImportError(f"{module} could not be imported ({e}); {hint}") from e


def need_triton(device_type: str) -> str | None:
    """Reason unless Triton kernels can run on this device type: the package installed, and a
    GPU or the interpreter (on a CPU without it the first launch fails: "0 active drivers")."""
    from mla_backends.kernels.common import interpreting

    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install triton)"
    if device_type == "cpu" and not interpreting():
        return "triton on a CPU runs only under TRITON_INTERPRET=1 (tests), no GPU found"
    return None


def need_sm(cap: Capability, name: str, allowed: tuple[tuple[int, int], ...]) -> str | None:
    """Reason unless the device is a CUDA GPU of one of the `allowed` SM versions."""
    if cap.sm is None:
        return f"{name} needs a CUDA GPU with SM {_fmt(allowed)}, found {cap.describe()}"
    if cap.sm not in allowed:
        return f"{name} needs SM {_fmt(allowed)}, found {cap.describe()}"
    return None


def need_deepseek_dims(config: Config, name: str) -> str | None:
    """The vendor kernels are compiled for kv_lora_rank 512 + rope 64 only."""
    d = config.model
    if (d.kv_lora_rank, d.qk_rope_head_dim) == (512, 64):
        return None
    return (
        f"{name} is built for kv_lora_rank 512 + rope 64, config has "
        f"{d.kv_lora_rank} + {d.qk_rope_head_dim}"
    )


def need_dtype(config: Config, name: str, allowed: tuple[str, ...]) -> str | None:
    if config.dtype in allowed:
        return None
    return f"{name} takes {'/'.join(allowed)} activations, config dtype is {config.dtype}"


def need_same_dtype(config: Config, name: str) -> str | None:
    """Kernels that take q and the KV cache in one dtype (no FP8 path here)."""
    if config.dtype == config.kv_dtype:
        return None
    return f"{name} needs q and KV in one dtype: {config.dtype} / {config.kv_dtype}"


def _fmt(allowed: tuple[tuple[int, int], ...]) -> str:
    return " or ".join(f"{a}{b}" for a, b in allowed)
