"""Which ptxas Triton compiles our SM90 kernels with, and a hint when it is the one measured
slower. Triton 3.6-3.8 run a CUDA 12.8 / 12.9 ptxas for SM90; 3.9 (torch 2.15's pin) runs
its CUDA 13.4 `ptxas-blackwell` for every arch from 90 on, and under it the warp-specialised
decode kernel (`mla_attention_seesaw`, H >= 128) took 1.05-1.20x as long as under 3.6, while
3.9 with the CUDA 12.9 ptxas it also ships took 0.88-0.97x (H200, graph replay, the `hopper`
small and h128 rows; BENCHMARKS.md, forty-fourth session). The narrow kernels did not move."""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path

logger = logging.getLogger(__name__)

SLOW_FROM = 13  # the CUDA major release of the ptxas measured slower for the seesaw kernel


def sm90_ptxas() -> tuple[int, str, Path | None] | None:
    """(CUDA major release, path) of the ptxas this Triton runs for SM90, and the other
    `ptxas` beside it if there is one (3.9's CUDA 12.9 one), or None where the Triton in use
    cannot say (another layout of its NVIDIA backend, no ptxas found)."""
    try:
        from triton.backends.nvidia import compiler

        version = compiler.get_ptxas_version(90)
        path = str(compiler.get_ptxas(90).path)
        other = Path(path).with_name("ptxas")
        legacy = other if other.is_file() and str(other) != path else None
    except Exception:  # a hint only: nothing here may fail the launch it is called from
        return None
    found = re.search(r"release (\d+)\.", version)
    return (int(found.group(1)), path, legacy) if found else None


@functools.cache  # once a process
def warn_slow_ptxas() -> None:
    """Log once a process, where the seesaw kernel is about to be built, when the ptxas for
    SM90 is CUDA 13 or newer, naming the other one Triton ships beside it if there is one.
    Reads the environment as Triton does at that moment (TRITON_PTXAS_BLACKWELL_PATH)."""
    found = sm90_ptxas()
    if found is None or found[0] < SLOW_FROM:
        return
    major, path, legacy = found
    logger.warning(
        "Triton compiles SM90 kernels with a CUDA %d ptxas (%s): the H >= 128 decode kernel "
        "measured 5-17 %% slower with it than with a CUDA 12.8 / 12.9 ptxas (H200; README, "
        "'GPU set-up'); TRITON_PTXAS_BLACKWELL_PATH=%s takes that one (process-wide)",
        major,
        path,
        legacy or "<a CUDA 12.8 / 12.9 ptxas>",
    )
