"""MLA attention backends over a paged latent KV cache (DeepSeek-class models)."""

from mla_backends.allocator import OutOfPagesError, PagedTokenAllocator
from mla_backends.backends.base import BackendContext, Capability, MLABackend
from mla_backends.backends.registry import (
    UnknownBackendError,
    available_backends,
    get_backend_class,
    register_backend,
)
from mla_backends.batch import ForwardBatch, ForwardMode, RaggedLayout
from mla_backends.checks import ShapeError
from mla_backends.config import (
    DEEPSEEK_V3,
    TINY,
    TINY_KERNEL,
    Config,
    ConfigError,
    MLADims,
    load_config,
)
from mla_backends.pool import (
    LayerIndexError,
    MLATokenToKVPool,
    ReqToTokenPool,
    RequestRowError,
    UncalibratedScaleWarning,
)
from mla_backends.runtime import Runtime, create_backend

__all__ = [
    "DEEPSEEK_V3",
    "TINY",
    "TINY_KERNEL",
    "BackendContext",
    "Capability",
    "Config",
    "ConfigError",
    "ForwardBatch",
    "ForwardMode",
    "LayerIndexError",
    "MLABackend",
    "MLADims",
    "MLATokenToKVPool",
    "OutOfPagesError",
    "PagedTokenAllocator",
    "RaggedLayout",
    "ReqToTokenPool",
    "RequestRowError",
    "Runtime",
    "ShapeError",
    "UncalibratedScaleWarning",
    "UnknownBackendError",
    "available_backends",
    "create_backend",
    "get_backend_class",
    "load_config",
    "register_backend",
]
