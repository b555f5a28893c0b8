"""Applied before `import sglang`: SGLang 0.5.17 was pinned to transformers 5.12.1 and
re-registers configs (e.g. 'qwen3_asr') that newer transformers ship; `AutoConfig.register`
then raises ValueError. The shim defaults `exist_ok=True` so SGLang's registration replaces
the built-in one. From ../shared/sglang/src/sglprobe_compat.py (the SGLang probe)."""

from __future__ import annotations

import functools
from typing import Any

APPLIED: list[str] = []


def _default_exist_ok(cls: Any, attr: str = "register") -> None:
    orig = getattr(cls, attr)
    if getattr(orig, "_mlab_patched", False):
        return

    @functools.wraps(orig)
    def register(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("exist_ok", True)
        try:
            return orig(*args, **kwargs)
        except TypeError:
            kwargs.pop("exist_ok", None)
            return orig(*args, **kwargs)

    register._mlab_patched = True  # type: ignore[attr-defined]
    setattr(cls, attr, staticmethod(register))
    APPLIED.append(f"{cls.__name__}.{attr}(exist_ok=True)")


def apply() -> list[str]:
    import transformers

    for name in ("AutoConfig", "AutoProcessor", "AutoTokenizer", "AutoImageProcessor"):
        cls = getattr(transformers, name, None)
        if cls is not None and hasattr(cls, "register"):
            _default_exist_ok(cls)
    return APPLIED
