"""Input validation shared by the pool and every backend: errors name the tensor and the
expected shape, dtype and device. Checks read only metadata (shape, dtype): no host sync."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ShapeError(ValueError):
    """A tensor has the wrong shape, dtype or device."""


def check_tensor(
    name: str,
    t: torch.Tensor,
    shape: Sequence[int],
    dtypes: Sequence[torch.dtype] | torch.dtype | None = None,
    device: torch.device | None = None,
) -> None:
    """Raise ShapeError unless `t` has `shape` (-1 matches any size), a dtype in `dtypes`
    and lives on `device` (type and index)."""
    if not isinstance(t, torch.Tensor):
        raise ShapeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    want = tuple(shape)
    if t.dim() != len(want) or any(w != -1 and w != s for w, s in zip(want, t.shape)):
        pretty = "[" + ", ".join("*" if w == -1 else str(w) for w in want) + "]"
        raise ShapeError(f"{name}: expected shape {pretty}, got {list(t.shape)}")
    if dtypes is not None:
        allowed = (dtypes,) if isinstance(dtypes, torch.dtype) else tuple(dtypes)
        if t.dtype not in allowed:
            raise ShapeError(
                f"{name}: expected dtype in {[str(d) for d in allowed]}, got {t.dtype}"
            )
    if device is not None and not _same_device(t.device, device):
        raise ShapeError(f"{name}: expected device {device}, got {t.device}")


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cpu":
        return True
    ia = a.index if a.index is not None else torch.cuda.current_device()
    ib = b.index if b.index is not None else torch.cuda.current_device()
    return ia == ib


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """`t` itself if its last dimension is contiguous, else a contiguous copy. Hazard: our
    kernels take a tensor's leading strides and assume the last one is 1; a view with
    another last stride (a transpose) was read at the wrong addresses, a wrong answer
    without an error. Host check only; the copy is device work (graph-capturable)."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()
