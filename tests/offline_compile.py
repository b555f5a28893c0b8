"""The offline SM90 compile scripts (`scripts/compile_*_sm90.py`) run from the tests: no GPU
needed, Triton ships ptxas. Each runs in a subprocess without TRITON_INTERPRET (under the
interpreter nothing is compiled, and Gluon's nested jit helpers cannot be called)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def compile_usage(script: str, *args: str, timeout: int = 600) -> list[dict[str, Any]]:
    """The JSON lines `scripts/<script>` prints (one per compiled kernel); its stderr's tail
    in the assertion if it fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
