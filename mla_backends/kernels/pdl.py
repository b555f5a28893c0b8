"""Programmatic dependent launch (PDL, SM90+): a kernel launched with it may be scheduled
while the kernel before it on the stream is still running, and waits at `wait_previous`
until that kernel has finished and its writes are visible. In a chain of short kernels (the
DeepSeek-V3.2 decode step at batch 1: q prep, logits, top-k, sparse attention, merge) that
hides each kernel's launch behind the one before it. CUDA graphs keep the dependency.

Hazards:
- Everything a kernel reads that an earlier kernel may have written (its inputs, metadata a
  graph refilled) is read after `wait_previous`; only address arithmetic goes before it.
  One exception, by contract: the indexer's Gluon logits (`index_logits(early_keys=True)`)
  read keys, slots and visible counts before their wait. That holds only because the launch
  just before them (the q prep, or the last prefill chunk's top-k) calls `launch_next`
  after its own `wait_previous`: every kernel before that one has then finished.
- A kernel released early does not get SMs of its own: its programs take whatever room the
  running kernel leaves, several on one SM if need be. The logits kernel releasing the
  one-launch top-k at its start made the top-k's passes 1-7 us slower (seventeenth session).
- `launch_next` lets the next kernel's programs take SM resources while this one runs; a
  kernel whose programs wait for each other (the one-launch top-k) calls it only once every
  one of its programs runs (any program calling it does: the hardware releases the next
  kernel only when all programs of this one have called it or exited).
"""

from __future__ import annotations

import os
from functools import cache

import torch
import triton
import triton.language as tl

from mla_backends.kernels.common import interpreting

try:  # Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAVE_GDC = True
except ImportError:  # pragma: no cover - older Triton: every launch is a plain one
    gdc_launch_dependents = gdc_wait = None
    HAVE_GDC = False


@triton.jit
def wait_previous(USE_GDC: tl.constexpr):
    """Blocks until the previous kernel on the stream finished (no-op without PDL)."""
    if USE_GDC:
        gdc_wait()


@triton.jit
def launch_next(USE_GDC: tl.constexpr):
    """Lets the next kernel on the stream be scheduled (no-op without PDL)."""
    if USE_GDC:
        gdc_launch_dependents()


@cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: an SM90+ GPU, a Triton with the
    grid-dependency ops, never in the interpreter, and not turned off (MLA_PDL=0 in the
    environment the process starts with)."""
    if device.type != "cuda" or interpreting() or not HAVE_GDC or not _pdl_env():
        return False
    return _sm90(device.index if device.index is not None else torch.cuda.current_device())


@cache  # read once a process: asked at every launch (pdl_args)
def _pdl_env() -> bool:
    return os.environ.get("MLA_PDL", "1") != "0"


def pdl_args(device: torch.device) -> dict[str, bool]:
    """Keyword arguments of a Triton launch: the kernel's USE_GDC and, with it, launch_pdl."""
    on = use_pdl(device)
    return {"USE_GDC": True, "launch_pdl": True} if on else {"USE_GDC": False}
