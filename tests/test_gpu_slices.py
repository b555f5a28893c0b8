"""The GPU suite's slices (tests/gpu_slices.py, run by scripts/gpu_check.sh): every GPU test is
in one, and each slice's estimate on a fresh H100 stays within one device call's budget."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import PACKAGE_ROOT
from gpu_slices import BUDGET_S, SLICES

TESTS = Path(__file__).resolve().parent


def test_every_gpu_test_is_in_a_slice_within_budget() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), env.get("PYTHONPATH", "")])
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
            + args
            + [str(TESTS)],
            cwd=TESTS.parent,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for args in (["--gpu-slice", "tests-all"], ["-m", "gpu"])
    ]
    sliced, gpu = (r.communicate(timeout=600)[0] for r in runs)
    assert [r.returncode for r in runs] == [0, 0], sliced[-3000:] + gpu[-3000:]
    ids = {line for line in sliced.splitlines() if "::" in line}
    missing = {line for line in gpu.splitlines() if "::" in line} - ids
    assert not missing, f"GPU tests in no slice: {sorted(missing)[:10]}"
    rows = re.findall(r"^(tests-\d+): (\d+) tests, about (\d+) s", sliced, re.MULTILINE)
    assert [name for name, _, _ in rows] == list(SLICES), rows
    assert sum(int(n) for _, n, _ in rows) == len(ids)
    over = [(name, int(s)) for name, _, s in rows if int(s) > BUDGET_S]
    assert not over, f"slices over {BUDGET_S} s on a fresh H100 (estimated): {over}"
