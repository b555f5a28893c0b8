"""The command line as a user meets it: from any directory, bad input gets one clear line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mla_backends

ROOT = Path(mla_backends.__file__).resolve().parent.parent


def cli(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m mla_backends ...` in `cwd`, importing this checkout whatever `cwd` holds."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    return subprocess.run(
        [sys.executable, "-m", "mla_backends", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_works_beside_a_foreign_models_package(tmp_path: Path) -> None:
    pkg = tmp_path / "models"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('the wrong models package')\n")
    proc = cli("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "verify" in proc.stdout and "run" in proc.stdout and "bench" in proc.stdout
    proc = cli("run", "--help", cwd=tmp_path)
    assert proc.returncode == 0 and "--requests" in proc.stdout, proc.stderr
