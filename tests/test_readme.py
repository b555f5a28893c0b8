"""The README's example runs, and its two set-up commands are the ones CI uses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_ci_runs_the_readme_test_command() -> None:
    commands = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    assert len(commands) >= 2
    test_cmd = commands[1].split("&&")[-1].strip()
    assert test_cmd in (ROOT / ".ci" / "run").read_text()


def test_verify_command_passes_on_default_config() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mla_backends", "verify", "--config", "configs/default.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout and "FAIL" not in proc.stdout


def test_verify_exits_nonzero_on_bad_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("page_size: 12\n")
    proc = subprocess.run(
        [sys.executable, "-m", "mla_backends", "verify", "--config", str(bad)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2 and "page_size=12" in proc.stderr
