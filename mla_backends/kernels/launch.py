"""Launching a compiled Triton kernel without the JIT's per-call argument binding.

`fn[grid](*args)` binds and specializes every argument, builds a cache key and looks the
kernel up on each call: 25-60 us of host time for a 20-argument kernel on our device hosts,
where the launch itself is a few. Per-batch metadata kernels sit on the decode critical path,
so `FastLaunch` keeps the compiled kernels it has seen, keyed on what Triton specializes on,
and calls the compiled launcher directly.

Hazard: a compiled kernel is only valid for the specialization it was built for (tensor
dtype and 16-byte alignment, integers equal to 1 or divisible by 16, constexpr values).
`_spec` mirrors those rules; anything it does not know goes through the JIT path.
"""

from __future__ import annotations

from typing import Any

import torch
from triton import knobs
from triton.runtime.jit import JITFunction

from mla_backends.kernels.common import interpreting


def _spec(arg: Any) -> Any:
    """What Triton 3.6 specializes a runtime argument on."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool) or arg is None:
        return (type(arg), arg)
    if isinstance(arg, int):
        return (int, arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31, 0 <= arg < 2**32)
    if isinstance(arg, float):
        return float
    return None  # unknown: never cached


class FastLaunch:
    """`FastLaunch(kernel, num_warps)(grid, *runtime_args, **constexprs)`.

    Runtime arguments are positional, in the kernel's order; constexprs by keyword. The first
    call of each specialization compiles through the JIT; later ones launch the compiled
    kernel. Under the interpreter, or with a Triton launch hook set (profilers), every call
    takes the JIT path."""

    def __init__(self, fn: JITFunction, num_warps: int = 4) -> None:
        self.fn = fn
        self.num_warps = num_warps
        self._compiled: dict[tuple, Any] = {}
        if interpreting():  # an InterpretedFunction: no compiled kernels, no params
            return
        self._n_runtime = sum(1 for p in fn.params if not p.is_constexpr)
        self._const_names = [p.name for p in fn.params if p.is_constexpr]
        if any(not p.is_constexpr for p in fn.params[self._n_runtime :]):
            raise TypeError(f"{fn.__name__}: constexpr parameters must come last for FastLaunch")

    def __call__(self, grid: tuple[int, ...], *args: Any, **consts: Any) -> None:
        if interpreting() or knobs.runtime.launch_enter_hook is not None:
            self.fn[grid](*args, **consts, num_warps=self.num_warps)
            return
        if len(args) != self._n_runtime or set(consts) != set(self._const_names):
            raise TypeError(
                f"{self.fn.__name__}: expected {self._n_runtime} runtime arguments and "
                f"constexprs {self._const_names}"
            )
        const_vals = tuple(consts[n] for n in self._const_names)
        specs = tuple(_spec(a) for a in args)
        key = (const_vals, specs)
        kernel = self._compiled.get(key) if None not in specs else None
        if kernel is None:
            kernel = self.fn[grid](*args, **consts, num_warps=self.num_warps)
            if None not in specs:
                self._compiled[key] = kernel
            return
        g = tuple(grid) + (1, 1)
        device = next(a for a in args if isinstance(a, torch.Tensor)).device
        stream = torch.cuda.current_stream(device).cuda_stream
        kernel.run(
            g[0],
            g[1],
            g[2],
            stream,
            kernel.function,
            kernel.packed_metadata,
            None,
            None,
            None,
            *args,
            *const_vals,
        )
