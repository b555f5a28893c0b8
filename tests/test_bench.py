"""`bench` on CPU: --help works, a tiny run with the torch backend writes its outputs, labels
its CPU rates as references (not ceilings), and runs without matplotlib."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import Cli


def test_bench_help(cli: Cli) -> None:
    proc = cli("bench", "--help")
    assert proc.returncode == 0 and "--graphs" in proc.stdout and "--kv-len" in proc.stdout


def _tiny_args(tmp_path: Path) -> list[str]:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: tiny\ndecode_backend: torch\nprefill_backend: torch\ndevice: cpu\n")
    return [
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
    ]


def test_tiny_bench_run_with_torch(cli: Cli, tmp_path: Path) -> None:
    proc = cli(*_tiny_args(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert len(result["rows"]) == 8
    assert all(r["torch_us"] > 0 and r["bytes"] > 0 and r["flops"] > 0 for r in result["rows"])
    c = result["ceilings"]
    assert c["copy_gbps"] > 0 and c["matmul_tflops"] > 0
    png = (tmp_path / "out" / "roofline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "torch" in proc.stdout
    # A CPU's copy and matmul rates bound nothing (KV in cache reads faster than a DRAM copy):
    # the report says so instead of calling them ceilings.
    assert c["is_ceiling"] is False
    assert "NOT ceilings" in proc.stdout and "% copy ref" in proc.stdout
    assert "% mm ref" in proc.stdout and "ceilings measured" not in proc.stdout


def test_bench_table_calls_gpu_rates_ceilings() -> None:
    from mla_backends.bench.report import format_table

    result = {
        "device": "NVIDIA H100 (SM90)",
        "ceilings": {"copy_gbps": 3000.0, "matmul_tflops": 700.0, "is_ceiling": True},
        "rows": [{"heads": 16, "q_len": 1, "batch": 1, "kv_len": 4096, "bytes": 3e6,
                  "flops": 1e8, "triton_us": 10.0}],
    }  # fmt: skip
    table = format_table(result)
    assert "ceilings measured at the start of this run" in table and "ref" not in table
    assert " 10%" in table  # 300 GB/s of 3000


def test_bench_without_matplotlib_writes_table_and_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mla_backends.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails, find_spec: None
    argv = [*_tiny_args(tmp_path)[:3], "--batch", "2", "--kv-len", "40"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["rows"]
    assert not (tmp_path / "out" / "roofline.png").exists()
    skipped = [line for line in out.splitlines() if "plot skipped" in line]
    assert len(skipped) == 1 and "pip install 'mla-backends[plot]'" in skipped[0], out
    assert "torch" in out  # the table
