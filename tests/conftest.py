from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

# The Triton interpreter must be chosen before triton is first imported (CPU CI has no GPU).
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not __import__("shutil").which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

import mla_backends

GPU = torch.cuda.is_available()
requires_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
# The checkout (or site-packages) holding the package under test, whatever the test's cwd.
PACKAGE_ROOT = Path(mla_backends.__file__).resolve().parent.parent

Cli = Callable[..., subprocess.CompletedProcess]


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if GPU else "cpu")


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    """`python -m mla_backends ARGS` in an empty folder (or `cwd=`), importing the package
    under test: what a user runs from anywhere."""
    empty = tmp_path / "cwd"
    empty.mkdir()

    def run(
        *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: int = 600
    ) -> subprocess.CompletedProcess:
        base = dict(os.environ if env is None else env)
        base["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), base.get("PYTHONPATH", "")])
        return subprocess.run(
            [sys.executable, "-m", "mla_backends", *args],
            cwd=cwd or empty,
            env=base,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run
