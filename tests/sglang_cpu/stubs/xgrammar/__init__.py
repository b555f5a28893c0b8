"""CPU-test STUB of xgrammar (not the real package): grammar-constrained decoding only; never on
the attention path."""

from _sglang_stub import install as _install

_install(__name__, version="0.2.1+stub")
