"""Start an N-process `torch.distributed` group (gloo on CPU, NCCL on GPUs) and run one
function on every rank: tests and the DCP benchmark use it, one launch for many checks
(starting processes costs seconds each)."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Worker = Callable[..., Any]  # (rank, group, *args) -> JSON-serialisable result


class RankFailed(RuntimeError):
    """A rank of a `spawn` raised: the message holds each failed rank's traceback."""


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
    hang_s = float(os.environ.get("DCP_HANG_DUMP_S", "0"))
    if hang_s > 0:  # a rank stuck that long prints every thread's stack and exits
        faulthandler.dump_traceback_later(hang_s, exit=True)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = fn(rank, dist.group.WORLD, *args)
    except BaseException:
        # Hazard: a failed rank must not wait for its peers. With NCCL, tearing the group down
        # while a peer sits in a collective blocks for ever (seen on two H100s: no traceback,
        # the launch stopped at its time limit). Save the traceback and leave at once; the
        # launcher stops the other ranks and raises it.
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # no rank tears its group down while a peer still talks to it
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
    here (`RankFailed`) with its traceback."""
    if backend == "nccl":
        os.environ.update(NCCL_SAFE_ENV)  # inherited by the spawned ranks
    with tempfile.TemporaryDirectory(prefix="dcp-") as tmp:
        store = os.path.join(tmp, "store")
        try:
            mp.start_processes(
                _entry,
                args=(nprocs, backend, store, tmp, fn, args),
                nprocs=nprocs,
                start_method="spawn",
            )
        except mp.ProcessExitedException as e:
            errs = sorted(Path(tmp).glob("rank*.err"))
            raise RankFailed("\n".join(f"{p.stem}: {p.read_text()}" for p in errs) or str(e)) from e
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(nprocs)]
