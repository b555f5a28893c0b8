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
from gpu_slices import SLICES, estimate, rule_of

import mla_backends

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
# Compiled GPU kernels can run here (a CUDA device and no Triton interpreter).
GPU = torch.cuda.is_available() and not INTERP
# The checkout (or site-packages) holding the package under test, whatever the test's cwd.
PACKAGE_ROOT = Path(mla_backends.__file__).resolve().parent.parent

Cli = Callable[..., subprocess.CompletedProcess]


def _machine_reasons() -> dict[str, str | None]:
    """Why this machine cannot run the tests of each marker (pyproject.toml), or None; the
    specific markers first (an sm90 test is also a gpu test)."""
    cuda = torch.cuda.is_available()
    sm = torch.cuda.get_device_capability() if cuda else None
    count = torch.cuda.device_count() if cuda else 0
    if INTERP:
        found = "found the Triton interpreter (TRITON_INTERPRET=1)"
    elif sm is None:
        found = "found no CUDA GPU"
    else:
        found = f"found {count} x {torch.cuda.get_device_name()} (SM{sm[0]}{sm[1]})"

    def need(ok: bool, what: str) -> str | None:
        return None if ok and not INTERP else f"needs {what}, {found}"

    return {
        "sm90": need(sm == (9, 0), "an SM90 GPU (H100 / H200)"),
        "sm100": need(sm in ((10, 0), (10, 3)), "an SM100 / SM103 GPU (B200 / GB200 / B300)"),
        "multigpu": need(count >= 2, "2 CUDA GPUs"),
        "gpu": need(cuda, "a CUDA GPU"),
        "interp": None if INTERP else "the Triton kernels' CPU path: needs TRITON_INTERPRET=1",
    }


REASONS = _machine_reasons()
IMPLY_GPU = ("sm90", "sm100", "multigpu")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--gpu-slice",
        metavar="NAME",
        help=f"one slice of the GPU suite (tests/gpu_slices.py): {', '.join(SLICES)} or tests-all",
    )


@pytest.hookimpl(tryfirst=True)  # before -m selects: sm90 / sm100 / multigpu tests are gpu tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        names = {m.name for m in item.iter_markers()}
        if names & set(IMPLY_GPU) and "gpu" not in names:
            item.add_marker(pytest.mark.gpu)
            names.add("gpu")
        reason = next((REASONS[n] for n in REASONS if n in names and REASONS[n]), None)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
    name = config.getoption("--gpu-slice")
    if name:
        if name not in (*SLICES, "tests-all"):
            raise pytest.UsageError(f"--gpu-slice {name}: one of {', '.join(SLICES)}, tests-all")
        keep, drop = [], []
        for item in items:
            rule = rule_of(item)
            ok = rule is not None and name in ("tests-all", rule.slice)
            (keep if ok else drop).append(item)
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> list[str]:
    if not config.getoption("--gpu-slice"):
        return []
    return [
        f"{name}: {n} tests, about {s:.0f} s on a fresh H100 ({SLICES[name]})"
        for name, (n, s) in estimate(items).items()
        if n
    ]


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUTLASS MLA and TRT-LLM MLA (SM100 kernels) with each kernel call swapped for a
    plain-PyTorch emulation of its documented contract (mla_backends/backends/emulation.py),
    which rejects what the real call rejects: the backends run on any machine."""
    import mla_backends.backends.cutlass_mla as cutlass_mod
    import mla_backends.backends.trtllm_mla as trtllm_mod
    from mla_backends.backends import emulation

    monkeypatch.setattr(
        cutlass_mod, "load_kernel", lambda: (emulation.cutlass_mla_decode, lambda *a: 1 << 20)
    )
    monkeypatch.setattr(
        trtllm_mod, "load_kernel", lambda: emulation.trtllm_batch_decode_with_kv_cache_mla
    )
    for mod in (cutlass_mod, trtllm_mod):  # the package and SM100 checks pass; dims still count
        monkeypatch.setattr(mod, "missing", lambda *modules: None)
        monkeypatch.setattr(mod, "need_sm", lambda *args: None)


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
