"""`bench` on CPU: --help works, and a tiny run with the torch backend writes its outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mla_backends", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_bench_help() -> None:
    proc = _cli("bench", "--help")
    assert proc.returncode == 0 and "--graphs" in proc.stdout and "--kv-len" in proc.stdout


def test_tiny_bench_run_with_torch(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: tiny\ndecode_backend: torch\nprefill_backend: torch\ndevice: cpu\n")
    proc = _cli(
        "bench",
        "--config",
        str(cfg),
        "--batch",
        "1,3",
        "--kv-len",
        "40,100",
        "--q-len",
        "1,2",
        "--out",
        str(tmp_path / "out"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert len(result["rows"]) == 8
    assert all(r["torch_us"] > 0 and r["bytes"] > 0 and r["flops"] > 0 for r in result["rows"])
    assert result["ceilings"]["copy_gbps"] > 0 and result["ceilings"]["matmul_tflops"] > 0
    png = (tmp_path / "out" / "roofline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "% copy" in proc.stdout and "torch" in proc.stdout
