"""Decode context parallelism (DCP): each request's cached tokens spread over the ranks of a
group, token-interleaved (`layout`); every rank attends its share with any suite backend and
the ranks merge by log-sum-exp (`backend.DCPBackend`, `comm`); `runtime.build_dcp_runtime`
gives one rank's pool, allocator and backend for the model engine; `launch.spawn` starts a
group; `parity` holds the checks the tests and the GPU script run."""

from mla_backends.dcp.backend import DCPBackend
from mla_backends.dcp.comm import DCPGroup, merge_partials
from mla_backends.dcp.layout import DCPLayout, DCPTokenAllocator
from mla_backends.dcp.runtime import DCPRuntime, build_dcp_runtime

__all__ = [
    "DCPBackend",
    "DCPGroup",
    "DCPLayout",
    "DCPRuntime",
    "DCPTokenAllocator",
    "build_dcp_runtime",
    "merge_partials",
]
