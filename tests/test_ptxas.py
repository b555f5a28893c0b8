"""The one-line hint when Triton compiles SM90 kernels with a CUDA 13 ptxas (triton 3.9's
default there), under which the warp-specialised decode kernel measured 5-17 % slower
(`kernels/ptxas.py`; BENCHMARKS.md, forty-fourth session). Triton's ptxas lookup is
replaced, so these run on a CPU whatever Triton is installed."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from triton.backends.nvidia import compiler

from mla_backends.kernels import ptxas


@dataclass
class Tool:
    path: str


@pytest.fixture
def fresh() -> Iterator[None]:
    ptxas.warn_slow_ptxas.cache_clear()
    yield
    ptxas.warn_slow_ptxas.cache_clear()  # the real answer for whatever runs next


def _use(monkeypatch: pytest.MonkeyPatch, release: str, path: Path) -> None:
    version = f"ptxas\nCuda compilation tools, release {release}, V{release}.1"
    monkeypatch.setattr(compiler, "get_ptxas_version", lambda arch=80: version)
    monkeypatch.setattr(compiler, "get_ptxas", lambda arch: Tool(str(path)))


def _hints(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == ptxas.__name__]


def test_a_cuda13_ptxas_is_named_once_with_the_cuda12_one_beside_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture, fresh: None
) -> None:
    (tmp_path / "ptxas").write_text("")  # what triton 3.9 ships beside its ptxas-blackwell
    _use(monkeypatch, "13.4", tmp_path / "ptxas-blackwell")
    with caplog.at_level(logging.WARNING, logger=ptxas.__name__):
        ptxas.warn_slow_ptxas()
        ptxas.warn_slow_ptxas()
    (hint,) = _hints(caplog)
    assert "CUDA 13 ptxas" in hint and str(tmp_path / "ptxas-blackwell") in hint
    assert f"TRITON_PTXAS_BLACKWELL_PATH={tmp_path / 'ptxas'} " in hint


def test_with_no_other_ptxas_the_hint_names_none(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture, fresh: None
) -> None:
    _use(monkeypatch, "13.4", tmp_path / "ptxas-blackwell")
    with caplog.at_level(logging.WARNING, logger=ptxas.__name__):
        ptxas.warn_slow_ptxas()
    (hint,) = _hints(caplog)
    assert "TRITON_PTXAS_BLACKWELL_PATH=<a CUDA 12.8 / 12.9 ptxas>" in hint


@pytest.mark.parametrize("release", ["12.8", "12.9"])
def test_a_cuda12_ptxas_gives_no_hint(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    fresh: None,
    release: str,
) -> None:
    """Triton 3.6-3.8 for SM90, or 3.9 pointed at its CUDA 12.9 ptxas."""
    _use(monkeypatch, release, tmp_path / "ptxas")
    assert ptxas.sm90_ptxas() == (12, str(tmp_path / "ptxas"), None)
    with caplog.at_level(logging.WARNING, logger=ptxas.__name__):
        ptxas.warn_slow_ptxas()
    assert _hints(caplog) == []


def test_a_triton_that_cannot_say_gives_no_hint_and_no_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fresh: None
) -> None:
    """It runs inside the decode launch, where an exception would close the Gluon route."""

    def missing(arch: int = 80) -> str:
        raise RuntimeError("Cannot find ptxas-blackwell")

    monkeypatch.setattr(compiler, "get_ptxas_version", missing)
    assert ptxas.sm90_ptxas() is None
    with caplog.at_level(logging.WARNING, logger=ptxas.__name__):
        ptxas.warn_slow_ptxas()
    assert _hints(caplog) == []
