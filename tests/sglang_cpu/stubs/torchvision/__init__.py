"""CPU-test STUB of torchvision (not the real package): imported unconditionally by
sglang/srt/utils/common.py; the PyPI wheel pulls a CUDA torch."""

from _sglang_stub import install as _install

_install(__name__, version="0.28.0+stub")
