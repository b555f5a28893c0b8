"""scripts/pytest_shards.py, the concurrent GPU-suite runner: how tests are dealt, how JUnit is
counted, and one real run over a throwaway test file (a failure, a skip, the --serial /
--each / --exclude routes)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _shards() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "pytest_shards", ROOT / "scripts/pytest_shards.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["pytest_shards"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    """The script over tmp_path's tests, its summary to tmp_path / "out": (run, summary)."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "scripts/pytest_shards.py"), "--out", str(out)]
    run = subprocess.run(
        [*cmd, "--cwd", str(tmp_path), *args], capture_output=True, text=True, timeout=120
    )
    return run, json.loads((out / "summary.json").read_text())


def test_deal_keeps_chunks_contiguous_and_every_id_once() -> None:
    deal = _shards().deal
    ids = [f"t::{i:02d}" for i in range(11)]
    out = deal(ids, 3, 2)
    assert out == [ids[0:2] + ids[6:8], ids[2:4] + ids[8:10], ids[4:6] + ids[10:11]]
    assert deal(ids[:3], 8, 2) == [ids[0:2], ids[2:3]]  # no empty shards


def test_a_run_counts_failures_skips_and_routes(tmp_path: Path) -> None:
    tests = tmp_path / "test_tiny.py"
    tests.write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_host_time(): pass\n"
        "def test_fails(): assert 1 == 2, 'one is not two'\n"
        "def test_heavy_a(): pass\n"
        "def test_heavy_b(): pass\n"
        "def test_dropped(): raise SystemExit(3)\n"
        "@pytest.mark.skip(reason='no GPU here')\n"
        "def test_skipped(): pass\n"
    )
    args = ["--shards", "3", "--serial", "host_time", "--each", "heavy", "--exclude", "dropped"]
    run, summary = _run(tmp_path, *args, "--", "test_tiny.py")
    assert run.returncode == 1, run.stdout + run.stderr  # one test fails
    assert summary["tests"] == 6
    assert summary["total"] == {"passed": 4, "failed": 1, "error": 0, "skipped": 1}
    assert summary["not_reported"] == 0 and summary["timed_out"] == []
    assert summary["failures"] == ["test_tiny::test_fails: AssertionError: one is not two"]
    names = {s["name"]: s["counts"] for s in summary["shards"]}
    assert names["serial"]["passed"] == 1
    assert sum(n.startswith("each-") for n in names) == 2


def test_a_shard_killed_at_the_limit_reports_what_finished(tmp_path: Path) -> None:
    """A shard killed at the time limit writes no JUnit file: what it finished comes from its
    verbose log, read by node id (ids with spaces and brackets; a test that prints an outcome
    word; an xfail counted as JUnit would), and `stopped_in` names the test it was in
    (helper 79: the ids were split on spaces and the loud test counted as failed)."""
    (tmp_path / "test_ids.py").write_text(
        "import time, pytest\n"
        "@pytest.mark.parametrize('x', ['a b', 'c[d]'], ids=['a b', 'c[d]'])\n"
        "def test_sp(x): pass\n"
        "def test_t1_loud(capsys):\n"
        "    with capsys.disabled():\n"
        "        print('FAILED once, retrying')\n"
        "def test_t2_fails(): assert 1 == 2\n"
        "@pytest.mark.xfail\n"
        "def test_t3_xf(): assert 0\n"
        "def test_zz_slow(): time.sleep(120)\n"
        "def test_zzz_after(): pass\n"
    )
    run, summary = _run(tmp_path, "--shards", "1", "--timeout", "15", "--", "test_ids.py")
    assert run.returncode == 1, run.stdout + run.stderr
    assert summary["timed_out"] == ["shard-0"]
    assert summary["stopped_in"] == ["test_ids.py::test_zz_slow"]
    assert summary["total"] == {"passed": 3, "failed": 1, "error": 0, "skipped": 1}
    assert summary["not_reported"] == 2
    assert summary["failures"] == ["test_ids.py::test_t2_fails: failed (shard killed; see its log)"]
