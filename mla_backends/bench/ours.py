"""Our backends' decode calls, timed: one attention call, an eager decode step of L layers,
and the same step through a captured CUDA graph (store excluded in every case)."""

from __future__ import annotations

import torch

from mla_backends.batch import ForwardBatch
from mla_backends.bench.fixtures import DecodeSetup
from mla_backends.bench.timing import bench_us


def time_backend(s: DecodeSetup, layers: int = 0) -> float:
    """Our backend call, store excluded. layers = 0: one attention call with the metadata
    built once for the batch. layers = L: one eager decode step, the metadata built for the
    step and then L attention calls (what a graph replaces)."""
    be = s.rt.backend

    def call() -> object:
        return be.forward_absorbed(0, s.q_nope, s.q_rope, None, None, s.batch)

    if layers == 0:
        be.init_forward_metadata(s.batch)
        return bench_us(call, device=s.q_nope.device)

    def step() -> None:
        be.init_forward_metadata(s.batch)
        for _ in range(layers):
            call()

    return bench_us(step, device=s.q_nope.device)


def time_graph(s: DecodeSetup, layers: int = 1) -> float:
    """One decode step through a captured CUDA graph of `layers` attention calls, timed per
    `runner.replay`: staging the inputs, refilling the backend's metadata, the replay."""
    from mla_backends.graph_runner import CudaGraphRunner, InputSpec

    be, b = s.rt.backend, s.batch.batch_size
    specs = {
        "q_nope": InputSpec(tuple(s.q_nope.shape[1:]), s.q_nope.dtype),
        "q_rope": InputSpec(tuple(s.q_rope.shape[1:]), s.q_rope.dtype),
    }

    def fwd(batch: ForwardBatch, x: dict[str, torch.Tensor]) -> torch.Tensor:
        for _ in range(layers):
            out = be.forward_absorbed(0, x["q_nope"], x["q_rope"], None, None, batch)
        return out

    runner = CudaGraphRunner(be, fwd, specs, [b], q_len=s.q_len, device=s.q_nope.device)
    runner.capture()
    inputs = {"q_nope": s.q_nope, "q_rope": s.q_rope}
    return bench_us(lambda: runner.replay(s.batch, inputs), device=s.q_nope.device)
