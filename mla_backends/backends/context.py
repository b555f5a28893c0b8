"""What a backend is built from and what it declares: its context (config, pools), the
capabilities it checks a config against, and the machine it finds itself on."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from mla_backends.config import KV_DTYPES, PAGE_SIZES, Config, MLADims
from mla_backends.pool import MLATokenToKVPool, ReqToTokenPool

ROLES = ("decode", "prefill")
ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def joined(reasons: Iterable[str | None]) -> str | None:
    """Every refusal reason given, "; " between them, or None when there is none. Hazard: one
    reason at a time sent a user to fix the page size first and only then told them the
    machine cannot run the backend (dense and sparse `supports` both report through this)."""
    return "; ".join(r for r in reasons if r) or None


def dtype_word(dtype: torch.dtype) -> str:
    """A dtype as the YAML and CLI spell it ("float16", not "torch.float16"): the word a user
    typed, in every refusal that quotes one."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class BackendCaps:
    """What a backend declares, checked against a config by `MLABackend.supports` before any
    machine-specific check (`_machine_reason`). Tests build their parity table from it."""

    page_sizes: tuple[int, ...] = PAGE_SIZES
    kv_dtypes: tuple[str, ...] = tuple(KV_DTYPES)
    roles: tuple[str, ...] = ROLES  # "prefill": MHA-mode prefill and absorbed extend
    graphs: bool = False  # decode / verify under CUDA graphs
    # The kernel takes q and the KV cache in one dtype (kv_dtype == dtype), so the kv_dtypes
    # are its activation dtypes too; checked with them (`MLABackend._dtype_reasons`).
    same_dtype: bool = False
    lse: bool = True  # forward_absorbed(return_lse=True) works
    # Runs compiled on a CPU; "auto" on a CPU prefers such a backend to one that runs there
    # only interpreted (Triton's interpreter, a test tool).
    cpu_native: bool = False


@dataclass(frozen=True)
class Capability:
    """What the machine offers: device type and, on CUDA, the SM version and name."""

    device_type: str
    sm: tuple[int, int] | None = None
    device_name: str = "cpu"

    @classmethod
    def detect(cls, device: torch.device) -> Capability:
        if device.type != "cuda":
            return cls(device.type)
        return cls(
            "cuda",
            torch.cuda.get_device_capability(device),
            torch.cuda.get_device_name(device),
        )

    def describe(self) -> str:
        if self.sm is None:
            return f"{self.device_type} (no GPU)"
        return f"{self.device_name} (SM{self.sm[0]}{self.sm[1]})"


@dataclass(frozen=True)
class BackendContext:
    """What every backend is built from."""

    config: Config
    kv_pool: MLATokenToKVPool
    req_to_token_pool: ReqToTokenPool

    @property
    def dims(self) -> MLADims:
        return self.config.model

    @property
    def device(self) -> torch.device:
        return self.kv_pool.device
