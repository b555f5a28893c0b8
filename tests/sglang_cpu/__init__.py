"""SGLang on a CPU-only machine, for the tests that need it (`tests/test_sglang_cpu.py`):
the pinned `--no-deps` requirements, stand-ins for the few CUDA / notebook / HTTP packages its
import chain touches, and a transformers compatibility shim. Not used by the package."""
