"""CPU-test STUB of openai (not the real package): sglang 0.5.17 imports openai.types.* at module
level (server_args -> function_call_parser); the attention path never uses it."""

from _sglang_stub import install as _install

_install(__name__, version="2.6.1+stub")
