"""CPU-test STUB of sgl_kernel (not the real package): CUDA-only; imported by the kit's CUDA-graph
runner module (dual_chunk attention) only."""

from _sglang_stub import install as _install

_install(__name__, version="0.4.5+stub")
