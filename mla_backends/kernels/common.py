"""Helpers shared by the Triton kernels."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU tests): `tl.dot` on bf16 is wrong there, so kernels
    cast dot operands to fp32 when this is set."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    # Hazard: tl.dot on fp32 defaults to tf32 on GPUs (1e-3 error); fp32 means ieee here.
    return "ieee" if dtype == torch.float32 else "tf32"


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def max_shared_mem(device: torch.device) -> int | None:
    """Bytes of shared memory one block may opt into on this GPU, as Triton checks it (its
    OutOfResources limit); None off a GPU."""
    if device.type != "cuda":
        return None
    import triton

    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
