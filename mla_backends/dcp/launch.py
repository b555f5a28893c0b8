"""Start an N-process `torch.distributed` group (gloo on CPU, NCCL on GPUs) and run one
function on every rank: tests and the DCP benchmark use it, one launch for many checks
(starting processes costs seconds each)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Worker = Callable[..., Any]  # (rank, group, *args) -> JSON-serialisable result


# NVLink multicast (NVLS) stays off: a program using it can put a shared host's GPUs out of
# service. DCP's all-gather / all-to-all do not need it.
NCCL_SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def _entry(
    rank: int, world: int, backend: str, store: str, out_dir: str, fn: Worker, args: tuple
) -> None:
    if backend == "gloo":
        torch.set_num_threads(1)  # N processes share the CI machine's few cores
    else:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = fn(rank, dist.group.WORLD, *args)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()  # no rank tears its group down while a peer still talks to it
    finally:
        dist.destroy_process_group()
    # Hazard: gloo can leave a joinable C++ thread behind, and the interpreter's exit then
    # aborts a rank whose work is done ("terminate called without an active exception",
    # SIGABRT: seen twice in CI). The result is on disk: leave without running destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Worker, nprocs: int, backend: str = "gloo", args: tuple = ()) -> list[Any]:
    """Run `fn(rank, group, *args)` on `nprocs` fresh processes; returns their results in
    rank order. `fn` must be importable (a module-level function). A failing rank raises
    here with its traceback."""
    if backend == "nccl":
        os.environ.update(NCCL_SAFE_ENV)  # inherited by the spawned ranks
    with tempfile.TemporaryDirectory(prefix="dcp-") as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(
            _entry,
            args=(nprocs, backend, store, tmp, fn, args),
            nprocs=nprocs,
            start_method="spawn",
        )
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(nprocs)]
