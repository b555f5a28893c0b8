"""Helpers shared by the Triton kernels."""

from __future__ import annotations

import os

import torch
import triton


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (CPU tests): `tl.dot` on bf16 is wrong there, so kernels
    cast dot operands to fp32 when this is set."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def dot_precision(dtype: torch.dtype) -> str:
    # Hazard: tl.dot on fp32 defaults to tf32 on GPUs (1e-3 error); fp32 means ieee here.
    return "ieee" if dtype == torch.float32 else "tf32"


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
