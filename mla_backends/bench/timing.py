"""How everything is timed: median microseconds per call with warm-up (CUDA events through
`triton.testing.do_bench` on a GPU, `perf_counter` on a CPU), CUDA-graph replays, host time,
and the copy / matmul ceilings measured at the start of the same run."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial

import torch


def bench_us(
    fn: Callable[[], object],
    warmup_ms: int = 25,
    rep_ms: int = 100,
    device: torch.device | None = None,
) -> float:
    """Median microseconds per call: CUDA events (do_bench) on a GPU, perf_counter on CPU."""
    if device is None or device.type == "cuda":
        import triton.testing

        return 1000.0 * triton.testing.do_bench(
            fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"
        )
    fn()
    times: list[float] = []
    deadline = time.perf_counter() + rep_ms / 1000.0
    while time.perf_counter() < deadline or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * sorted(times)[len(times) // 2]


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """`fn` captured in a CUDA graph, after two warm-up calls outside the capture (JIT
    compiles, allocator growth) on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def graph_us(fn: Callable[[], object]) -> float:
    """Median replay time of `fn` captured in a CUDA graph: the GPU time a serving engine's
    decode graph pays (host launch overhead removed). GPU only."""
    return bench_us(capture_graph(fn).replay, device=torch.device("cuda"))


def host_us(fn: Callable[[], object], n: int = 50) -> float:
    """Median host microseconds of `fn` (wall clock around the call, GPU work not awaited);
    a synchronize every third call keeps at most three calls in flight, as in serving."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for i in range(n):
        if i % 3 == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6


def ceilings(device: torch.device) -> dict:
    """Copy GB/s (read + write) and matmul TFLOP/s, measured now, with what they are.

    On a GPU they bound a decode kernel: a copy of 512 MiB (far past L2) and a bf16
    tensor-core matmul. On a CPU they are reference rates, not ceilings (`is_ceiling` False):
    a KV cache that fits in the CPU caches reads faster than a copy through DRAM, and the
    torch backend computes in fp32, which on a CPU without bf16 units outruns a bf16 matmul
    (a bf16-only "ceiling" can be beaten that way); the matmul rate is the best of fp32 and
    bf16, and the attention's own matmuls are smaller than it."""
    gpu = device.type == "cuda"
    n = 1 << (28 if gpu else 25)
    a = torch.randn(n, device=device, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    copy_us = bench_us(lambda: b.copy_(a), device=device)
    rates = {}
    for dtype, m in (
        [(torch.bfloat16, 8192)] if gpu else [(torch.float32, 1024), (torch.bfloat16, 512)]
    ):
        x = torch.randn(m, m, device=device, dtype=dtype)
        y = torch.randn(m, m, device=device, dtype=dtype)
        rates[dtype] = 2 * m**3 / bench_us(partial(torch.matmul, x, y), device=device) / 1e6
    best = max(rates, key=rates.__getitem__)
    mib = n * 2 >> 20
    return {
        "copy_gbps": 2 * n * 2 / copy_us / 1e3,
        "matmul_tflops": rates[best],
        "is_ceiling": gpu,
        "copy_what": f"{mib} MiB bf16 copy",
        "matmul_what": f"{str(best).removeprefix('torch.')} matmul"
        + ("" if gpu else " (best of float32 and bfloat16)"),
    }
