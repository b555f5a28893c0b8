"""The backend registry: a dict of name -> class, filled by a decorator.

Backend modules are imported lazily (`_MODULES`), so listing names or checking a config never
imports a kernel package; each backend imports its kernel package only when constructed.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from mla_backends.backends.base import Capability, MLABackend
    from mla_backends.config import Config

# name -> module that defines (and registers) it; order is the preference order for "auto"
# (on a CPU, backends that run there compiled come first: `BackendCaps.cpu_native`).
_MODULES: dict[str, str] = {
    "flashmla": "mla_backends.backends.flashmla",
    "flashinfer_mla": "mla_backends.backends.flashinfer_mla",
    "cutlass_mla": "mla_backends.backends.cutlass_mla",
    "trtllm_mla": "mla_backends.backends.trtllm_mla",
    "triton": "mla_backends.backends.triton_backend",
    "torch": "mla_backends.backends.torch_backend",
}
_REGISTRY: dict[str, type[MLABackend]] = {}

T = TypeVar("T", bound="type[MLABackend]")
C = TypeVar("C", bound=type)


def registrar(registry: dict[str, Any], what: str, name: str) -> Callable[[C], C]:
    """A class decorator that puts its class in `registry` under `name` (once per name)."""

    def deco(cls: C) -> C:
        if name in registry and registry[name] is not cls:
            raise ValueError(f"{what} {name!r} registered twice")
        registry[name] = cls
        return cls

    return deco


class UnknownBackendError(KeyError, ValueError):
    """A backend name the registry does not know. A KeyError (a lookup by name) and a
    ValueError (a bad argument), printed as its message: a bare KeyError prints its repr,
    quotes and escapes included."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def lookup_class(
    registry: dict[str, C],
    modules: dict[str, str],
    what: str,
    name: str,
    known: Callable[[], object],
) -> C:
    """`registry[name]`, importing `modules[name]` (which registers it) first if needed."""
    if name not in registry:
        if name not in modules:
            raise UnknownBackendError(f"unknown {what} {name!r}; known: {known()}")
        importlib.import_module(modules[name])
    return registry[name]


def register_backend(name: str) -> Callable[[T], T]:
    return registrar(_REGISTRY, "backend", name)


def available_backends() -> list[str]:
    """Names that have a module in this build (in "auto" preference order)."""
    found = [n for n, m in _MODULES.items() if importlib.util.find_spec(m) is not None]
    return found + [n for n in _REGISTRY if n not in _MODULES]


def get_backend_class(name: str) -> type[MLABackend]:
    return lookup_class(_REGISTRY, _MODULES, "backend", name, available_backends)


def why_not(name: str, config: Config, cap: Capability, role: str | None) -> str | None:
    """Reason the backend cannot serve `role` for `config` on `cap`, or None (role None:
    anything but the role: page size, dtypes, dims, packages, hardware)."""
    try:
        cls = get_backend_class(name)
    except (KeyError, ImportError) as e:
        return str(e)
    if config.dcp_size > 1 and not cls.caps.lse:  # else refused only inside each rank
        n = config.dcp_size
        return f"dcp_size {n}: decode context parallelism merges by LSE; {name} returns none"
    return cls.supports(config, cap, role)


def check_device(config: Config, where: str = "<config>") -> None:
    """ConfigError unless the config's device exists on this machine (`device: cuda` on a
    CPU-only build of torch)."""
    from mla_backends.config import ConfigError

    if config.torch_device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{where}: device={config.device!r} but this machine has no usable CUDA device "
            f"(torch {torch.__version__}); use device: auto or cpu"
        )


def resolve_backends(config: Config, where: str = "<config>", roles: bool = True) -> Config:
    """Resolve "auto" and check both choices against this machine, once, at config load.
    `roles=False` (`Runtime.build`): a named backend is checked against the config and the
    machine but not against its role (a decode-only runtime may name a decode backend for
    both roles and never prefill)."""
    import dataclasses

    from mla_backends.backends.base import Capability
    from mla_backends.config import ConfigError

    check_device(config, where)
    cap = Capability.detect(config.torch_device)
    chosen: dict[str, str] = {}
    for role in ("prefill", "decode"):
        key = f"{role}_backend"
        name = getattr(config, key)
        if name == "auto":
            ok = [n for n in available_backends() if why_not(n, config, cap, role) is None]
            if cap.device_type == "cpu":
                ok.sort(key=lambda n: not get_backend_class(n).caps.cpu_native)
            if not ok:
                raise ConfigError(f"{where}: {key}=auto: no backend can run on {cap.describe()}")
            chosen[key] = ok[0]
            continue
        if name not in _MODULES and name not in _REGISTRY:
            allowed = ["auto", *_MODULES]
            raise ConfigError(f"{where}: {key}={name!r} is unknown; allowed: {allowed}")
        reason = why_not(name, config, cap, role if roles else None)
        if reason is not None:
            ok = [n for n in available_backends() if why_not(n, config, cap, role) is None]
            raise ConfigError(
                f"{where}: {key}={name!r} cannot run here: {reason}. "
                f"Backends that can serve {role} with this config on {cap.describe()}: {ok}"
            )
    return dataclasses.replace(config, **chosen)  # type: ignore[arg-type]  # backend names only
