"""CPU-test STUB of IPython (not the real package): sglang.utils imports IPython.display for
notebook helpers only."""

from _sglang_stub import install as _install

_install(__name__)
