"""Build the pool, request table, allocator and backend(s) from one Config."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mla_backends.allocator import PagedTokenAllocator
from mla_backends.backends.base import BackendContext, MLABackend
from mla_backends.backends.dispatch import DispatchBackend
from mla_backends.backends.protocol import AttentionBackend
from mla_backends.backends.registry import get_backend_class, resolve_backends
from mla_backends.config import Config, ConfigError
from mla_backends.pool import MLATokenToKVPool, ReqToTokenPool


def create_backend(ctx: BackendContext) -> MLABackend[Any] | DispatchBackend:
    """The configured backend(s); one object whatever the per-phase choice."""
    cfg = ctx.config
    decode = get_backend_class(cfg.decode_backend)(ctx)
    if cfg.prefill_backend == cfg.decode_backend:
        return decode
    return DispatchBackend(get_backend_class(cfg.prefill_backend)(ctx), decode)


@dataclass
class Runtime:
    config: Config
    kv_pool: MLATokenToKVPool
    req_pool: ReqToTokenPool
    allocator: PagedTokenAllocator
    backend: AttentionBackend

    @classmethod
    def build(cls, config: Config, page_order: Sequence[int] | None = None) -> Runtime:
        """One process's pool, request table, allocator and backend. With `dcp_size` > 1
        each rank of a process group builds `mla_backends.dcp.build_dcp_runtime` instead."""
        if config.dcp_size > 1:
            raise ConfigError(
                f"dcp_size={config.dcp_size}: build each rank with "
                "mla_backends.dcp.build_dcp_runtime(config, group) inside a torch.distributed "
                "process group of that size"
            )
        # "auto" resolved here too (a Config built in Python never went through load_config
        # and kept it: a KeyError); a named backend that cannot run this config here fails
        # now, with its reason, not in a kernel at the first call
        config = resolve_backends(config, "Runtime.build", roles=False)
        dev, dims = config.torch_device, config.model
        pool = MLATokenToKVPool(
            config.num_layers,
            config.num_pages,
            config.page_size,
            dims.kv_lora_rank,
            dims.qk_rope_head_dim,
            config.torch_kv_dtype,
            dev,
        )
        req_pool = ReqToTokenPool(config.max_requests, config.max_context_len, dev)
        allocator = PagedTokenAllocator(config.num_pages, config.page_size, req_pool, page_order)
        backend = create_backend(BackendContext(config, pool, req_pool))
        return cls(config, pool, req_pool, allocator, backend)
