"""Configuration: YAML at the edge, frozen dataclasses inside.

`load_config(path)` is the only place YAML is read. Unknown keys, bad names and backend
choices that cannot run here fail at load, naming the file, the key and the allowed values.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

PAGE_SIZES = (1, 16, 32, 64, 128)
KV_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
ACT_DTYPES = {k: v for k, v in KV_DTYPES.items() if k != "float8_e4m3fn"}


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the file, key and allowed values."""


@dataclass(frozen=True)
class MLADims:
    """Attention dimensions of one MLA layer (per tensor-parallel rank).

    num_heads H, kv_lora_rank L, qk_rope_head_dim R, qk_nope_head_dim P, v_head_dim V.
    A cached row is D = L + R wide. NoPE MLA (Kimi-Linear) keeps R = 64 and simply does not
    rotate that part, so every kernel still sees a 576-wide row.
    """

    num_heads: int = 128
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    rope_scaling_factor: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"MLADims.{name} must be > 0, got {getattr(self, name)}")
        if self.qk_rope_head_dim < 0:
            raise ConfigError(f"MLADims.qk_rope_head_dim must be >= 0, got {self.qk_rope_head_dim}")
        if self.rope_scaling_factor < 1.0:
            raise ConfigError(
                f"MLADims.rope_scaling_factor must be >= 1, got {self.rope_scaling_factor}"
            )

    @property
    def kv_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mscale(self) -> float:
        """YaRN attention-magnitude correction; 1.0 when no rope scaling applies."""
        if self.rope_scaling_factor <= 1.0 or self.mscale_all_dim == 0.0:
            return 1.0
        return 0.1 * self.mscale_all_dim * math.log(self.rope_scaling_factor) + 1.0

    @property
    def softmax_scale(self) -> float:
        # Hazard: the scale is over the *MHA* head dim (P + R = 192), not the latent width
        # (576, FlashMLA's default), and YaRN multiplies it by mscale squared.
        return self.qk_head_dim**-0.5 * self.mscale**2

    def with_heads(self, num_heads: int) -> MLADims:
        return dataclasses.replace(self, num_heads=num_heads)


DEEPSEEK_V3 = MLADims(
    num_heads=128,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    rope_scaling_factor=40.0,
    mscale_all_dim=1.0,
)
# Tiny shapes for CPU tests and the default config: every dimension distinct so a swapped
# axis cannot go unnoticed.
TINY = MLADims(
    num_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    rope_scaling_factor=4.0,
    mscale_all_dim=0.707,
)
NAMED_DIMS: dict[str, MLADims] = {"deepseek-v3": DEEPSEEK_V3, "tiny": TINY}


@dataclass(frozen=True)
class Config:
    """Everything a serving engine needs to build the pool and the attention backends.

    `prefill_backend` / `decode_backend` may be "auto": resolved once in `load_config` /
    `resolve_backends` from declared capabilities, never per call.
    """

    model: MLADims = field(default_factory=lambda: TINY)
    num_layers: int = 2
    prefill_backend: str = "auto"
    decode_backend: str = "auto"
    page_size: int = 16
    kv_dtype: str = "bfloat16"
    dtype: str = "bfloat16"
    num_pages: int = 256
    max_requests: int = 64
    max_context_len: int = 2048
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.page_size not in PAGE_SIZES:
            raise ConfigError(f"page_size={self.page_size} is not one of {PAGE_SIZES}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype={self.kv_dtype!r} is not one of {sorted(KV_DTYPES)}")
        if self.dtype not in ACT_DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not one of {sorted(ACT_DTYPES)}")
        for name in ("num_layers", "num_pages", "max_requests", "max_context_len"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if any(bs <= 0 for bs in self.cuda_graph_batch_sizes):
            raise ConfigError(
                f"cuda_graph_batch_sizes must be positive: {self.cuda_graph_batch_sizes}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device={self.device!r} is not one of auto, cpu, cuda, cuda:N")

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.kv_dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        return ACT_DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def _model_from_yaml(value: Any, where: str) -> MLADims:
    if isinstance(value, str):
        if value not in NAMED_DIMS:
            raise ConfigError(f"{where}: model={value!r} is not one of {sorted(NAMED_DIMS)}")
        return NAMED_DIMS[value]
    if isinstance(value, dict):
        value = dict(value)
        base = NAMED_DIMS[value.pop("base", "deepseek-v3")]
        allowed = {f.name for f in dataclasses.fields(MLADims)}
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise ConfigError(
                f"{where}: unknown key(s) model.{unknown}; allowed: {sorted(allowed)}"
            )
        return dataclasses.replace(base, **value)
    raise ConfigError(f"{where}: model must be a name {sorted(NAMED_DIMS)} or a mapping of dims")


def config_from_dict(raw: dict[str, Any], where: str = "<dict>") -> Config:
    """Build and validate a Config; resolves "auto" backends for the machine this runs on."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: top level must be a mapping, got {type(raw).__name__}")
    allowed = {f.name for f in dataclasses.fields(Config)}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    raw = dict(raw)
    if "model" in raw:
        raw["model"] = _model_from_yaml(raw["model"], where)
    if "cuda_graph_batch_sizes" in raw:
        raw["cuda_graph_batch_sizes"] = tuple(raw["cuda_graph_batch_sizes"])
    try:
        cfg = Config(**raw)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None
    from mla_backends.backends.registry import resolve_backends

    return resolve_backends(cfg, where)


def load_config(path: str | Path) -> Config:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return config_from_dict(raw or {}, str(path))
