"""FastLaunch: the compiled-kernel launch path must never reuse a kernel built for another
specialization (an integer equal to 1, a misaligned pointer, another dtype)."""

from __future__ import annotations

import time

import pytest
import torch
import triton
import triton.language as tl

from mla_backends.kernels.launch import FastLaunch, _spec

GPU = torch.cuda.is_available()


@triton.jit
def _axpy(X, Y, n, a, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(X + offs, mask=m)
    y = tl.load(Y + offs, mask=m)
    tl.store(Y + offs, (x * a + y).to(Y.dtype.element_ty), mask=m)


def test_spec_tells_apart_what_triton_specializes_on() -> None:
    buf = torch.zeros(64)
    assert _spec(buf) != _spec(buf[1:])  # 16-byte alignment
    assert _spec(buf) != _spec(buf.half())
    assert _spec(1) != _spec(2) != _spec(16)
    assert _spec(3) == _spec(5)
    assert _spec(2**31) != _spec(3)
    assert _spec(object()) is None


def test_runs_under_the_interpreter_or_compiled() -> None:
    dev = "cuda" if GPU else "cpu"
    launch = FastLaunch(_axpy, num_warps=4)
    for n, offset, dtype in (
        (1, 0, torch.float32),
        (37, 0, torch.float32),
        (64, 1, torch.float32),
        (37, 0, torch.float16),
        (5, 3, torch.float32),
        (37, 0, torch.float32),
    ):
        x = torch.randn(n + offset, device=dev, dtype=dtype)[offset:]
        y = torch.randn(n + offset, device=dev, dtype=dtype)[offset:]
        want = x.float() * 0.5 + y.float()
        launch((triton.cdiv(n, 32),), x, y, n, 0.5, BLOCK=32)
        torch.testing.assert_close(y.float(), want, atol=1e-3, rtol=1e-3)
    if GPU:  # n=37 fp32 aligned came twice: one compiled kernel, reused
        assert len(launch._compiled) == 5


def test_rejects_wrong_arguments() -> None:
    if not GPU:
        pytest.skip("needs a CUDA GPU (the interpreter takes the JIT path)")
    launch = FastLaunch(_axpy)
    x = torch.zeros(4, device="cuda")
    with pytest.raises(TypeError, match="expected 4 runtime arguments"):
        launch((1,), x, x, 4, BLOCK=32)


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_gpu_fast_launch_host_time() -> None:
    """Recorded, not asserted (host speed varies between machines)."""
    x = torch.randn(4096, device="cuda")
    y = torch.randn(4096, device="cuda")
    launch = FastLaunch(_axpy)

    def jit() -> None:
        _axpy[(128,)](x, y, 4096, 0.5, BLOCK=32)

    def fast() -> None:
        launch((128,), x, y, 4096, 0.5, BLOCK=32)

    res = {}
    for name, f in (("jit", jit), ("fast", fast)):
        for _ in range(20):
            f()
        ts = []
        for _ in range(200):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        res[name] = sorted(ts)[100] * 1e6
    torch.cuda.synchronize()
    print(f"axpy launch host time median: jit {res['jit']:.1f} us, fast {res['fast']:.1f} us")
