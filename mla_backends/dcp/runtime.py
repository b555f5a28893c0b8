"""One rank's runtime in a DCP group: its own pool, request table and allocator (a
share of every request), the configured backend wrapped in `DCPBackend`.

`build_dcp_runtime(config, group)` returns an object with the fields the model engine reads
(`config`, `kv_pool`, `req_pool`, `allocator`, `backend`), so `models.engine.Engine(model,
rt)` serves the model on every rank of the group unchanged: lengths it sees are global,
slots local. Config meanings under DCP: `max_context_len` is the global (per-request) limit,
each rank's request table holds ceil(max_context_len / N) columns; `num_pages` is per rank;
`model.num_heads` is this rank's heads (all H when replicated, H / N in "tp" mode).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from mla_backends.arith import cdiv
from mla_backends.backends.base import BackendContext, MLABackend
from mla_backends.backends.dispatch import DispatchBackend
from mla_backends.config import Config, ConfigError
from mla_backends.dcp.backend import HEAD_MODES, DCPBackend
from mla_backends.dcp.comm import DCPGroup
from mla_backends.dcp.layout import DCPLayout, DCPTokenAllocator
from mla_backends.pool import MLATokenToKVPool, ReqToTokenPool
from mla_backends.runtime import Runtime, create_backend


@dataclass
class DCPRuntime:
    config: Config  # as given: global context limit, this rank's heads
    kv_pool: MLATokenToKVPool  # this rank's share
    req_pool: ReqToTokenPool  # this rank's (same request rows on every rank)
    allocator: DCPTokenAllocator
    backend: DCPBackend
    group: DCPGroup

    @property
    def layout(self) -> DCPLayout:
        return self.backend.layout


def build_dcp_runtime(
    config: Config,
    group: dist.ProcessGroup,
    heads: str | None = None,
    page_order: Sequence[int] | None = None,
) -> DCPRuntime:
    """This rank's runtime; every rank of `group` calls it with the same config. `heads`
    defaults to the config's `dcp_heads`; the group's size must be its `dcp_size` (or the
    config's `dcp_size` left at 1, for callers that size the group themselves)."""
    heads = config.dcp_heads if heads is None else heads
    if heads not in HEAD_MODES:
        raise ValueError(f"DCP heads={heads!r} is not one of {HEAD_MODES}")
    comm = DCPGroup(group)
    if config.dcp_size not in (1, comm.size):
        raise ConfigError(f"dcp_size={config.dcp_size} but the process group has {comm.size} ranks")
    n, h = comm.size, config.model.num_heads
    local = dataclasses.replace(config, max_context_len=cdiv(config.max_context_len, n), dcp_size=1)
    if heads == "tp":  # the wrapped backend attends the whole group's heads
        local = dataclasses.replace(local, model=config.model.with_heads(h * n))
    rt = Runtime.build(local, page_order)
    mha = None
    if heads == "tp":
        mha = create_backend(
            BackendContext(dataclasses.replace(local, model=config.model), rt.kv_pool, rt.req_pool)
        )
    inner = rt.backend
    if not isinstance(inner, (MLABackend, DispatchBackend)):  # Runtime.build makes one
        raise TypeError(f"DCP wraps a suite backend, not {type(inner).__name__}")
    allocator = DCPTokenAllocator(
        DCPLayout(comm.rank, comm.size), rt.allocator, config.max_context_len
    )
    backend = DCPBackend(inner, comm, heads, mha, global_lens=allocator.filled)
    return DCPRuntime(config, rt.kv_pool, rt.req_pool, allocator, backend, comm)
