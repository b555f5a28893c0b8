from __future__ import annotations

import os

# The Triton interpreter must be chosen before triton is first imported (CPU CI has no GPU).
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not __import__("shutil").which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

GPU = torch.cuda.is_available()
requires_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if GPU else "cpu")
