"""Importing the kernel packages: one place, clear errors that say how to install them."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import re
from types import ModuleType

from mla_backends.backends.base import Capability
from mla_backends.config import Config

INSTALL = {
    "flashinfer": "pip install flashinfer-python==0.7.2.post1 (or mla-backends[gpu])",
    "sgl_kernel": "pip install sglang-kernel==0.4.3 (or mla-backends[gpu])",
    "flash_mla": "build deepseek-ai/FlashMLA",  # or sgl_kernel's, which every caller names too
    "fla": "pip install fla-core==0.6.0 (or mla-backends[gpu])",
}


# The releases every GPU check of this project ran with (pyproject's `[gpu]`), by import name:
# (distribution, version). Another release may run, or may differ in an internal this suite
# reads (FlashInfer's planner layout, sgl_kernel's FlashMLA signatures): it gets one warning.
CHECKED = {
    "flashinfer": ("flashinfer-python", "0.7.2.post1"),
    "sgl_kernel": ("sglang-kernel", "0.4.3"),
    "fla": ("fla-core", "0.6.0"),
}
# Other distributions that install the same import name: a release under one of these is
# unchecked too (sgl-kernel: sglang-kernel's name before 0.4; flash-linear-attention: fla's).
OTHER_DISTS = {"sgl_kernel": ("sgl-kernel",), "fla": ("flash-linear-attention",)}
logger = logging.getLogger(__name__)


def _installed(package: str) -> tuple[str, str] | None:
    """(distribution, version) that installed `package` (a `CHECKED` import name), or None
    (a source tree, a bundle)."""
    for name in (CHECKED[package][0], *OTHER_DISTS.get(package, ())):
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.cache  # once a process and package
def warn_unchecked(package: str) -> None:
    """Log once a process when `package` is installed at a release other than `CHECKED`'s
    (SGLang 0.5.17, for one, pins sglang-kernel 0.4.5 and flashinfer-python 0.6.15.post1)."""
    if package not in CHECKED:
        return
    dist, checked = CHECKED[package]
    installed = _installed(package)
    if installed is None:
        return
    # Hazard: a CUDA build's local label (0.4.3+cu130) is the checked release, not another
    name, found = installed
    if (name, found.split("+")[0]) != (dist, checked):
        logger.warning(
            "%s %s is installed; mla-backends was checked with %s only (mla-backends[gpu]): "
            "if a backend over it fails or disagrees, install %s==%s",
            name, found, checked, dist, checked,
        )  # fmt: skip


def older_than(package: str, minimum: tuple[int, ...], needs: str) -> str | None:
    """Reason when `package` is installed at a release below `minimum`, whose internals this
    suite's wrapper reads (`needs` names them), else None (that release or newer, or no
    distribution metadata to tell)."""
    installed = _installed(package)
    release = re.match(r"\d+(?:\.\d+)*", installed[1]) if installed else None
    if installed is None or release is None:
        return None
    if tuple(int(x) for x in release.group().split(".")) >= minimum:
        return None
    least = ".".join(map(str, minimum))
    return f"{installed[0]} {installed[1]} is older than {least} ({needs}; {INSTALL[package]})"


def missing(*modules: str) -> str | None:
    """Reason string if none of `modules` is importable (without importing it), else None."""
    if any(importlib.util.find_spec(m.split(".")[0]) is not None for m in modules):
        return None
    hints = "; ".join(INSTALL.get(m.split(".")[0], f"install {m}") for m in modules)
    return f"package {' or '.join(modules)} is not installed ({hints})"


def require(module: str) -> ModuleType:
    try:
        found = importlib.import_module(module)
    except ImportError as e:
        hint = INSTALL.get(module.split(".")[0], f"install {module}")
        raise ImportError(f"{module} could not be imported ({e}); {hint}") from e
    warn_unchecked(module.split(".")[0])
    return found


def need_triton(device_type: str) -> str | None:
    """Reason unless Triton kernels can run on this device type: the package installed, and a
    GPU or the interpreter (on a CPU without it the first launch fails: "0 active drivers")."""
    from mla_backends.kernels.common import interpreting

    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install triton)"
    if device_type == "cpu" and not interpreting():
        return "triton on a CPU runs only under TRITON_INTERPRET=1 (tests), no GPU found"
    return None


def need_triton_sm(cap: Capability, fp8: bool, needs: str) -> str | None:
    """The one GPU reason of a Triton kernel (dense and sparse): SM80, or SM89 with FP8 KV.
    `needs` opens the SM80 sentence ("triton MLA kernels need"). Hazard: one GPU, one reason,
    and with FP8 the SM89 one (an SM80 reason sent a T4 user to an A100, there to be refused
    for FP8)."""
    if cap.sm is not None and fp8 and cap.sm < (8, 9):
        return f"FP8 KV needs SM89 or newer, found {cap.describe()}"
    if cap.sm is not None and cap.sm < (8, 0):
        return f"{needs} SM80 or newer, found {cap.describe()}"
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


def _fmt(allowed: tuple[tuple[int, int], ...]) -> str:
    return " or ".join(f"{a}{b}" for a, b in allowed)
