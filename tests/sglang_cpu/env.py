"""Import SGLang for the CPU tests, or say in one line why it cannot be imported."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).parent
STUBS = HERE / "stubs"
INSTALL = "python -m pip install --no-deps -r tests/sglang_cpu/requirements.txt"


def load_sglang() -> ModuleType:
    """sglang, imported with the stubs behind every real package (appended to sys.path, so
    an installed package always wins) and the transformers shim applied. Raises ImportError
    with a one-line reason."""
    if importlib.util.find_spec("sglang") is None:
        raise ImportError(f"sglang is not installed ({INSTALL})")
    if str(STUBS) not in sys.path:
        sys.path.append(str(STUBS))
    from sglang_cpu import compat

    compat.apply()
    import sglang

    return sglang
