"""Count the tensor ops of one decode step's metadata refill as a graph runner replays it
(`init_forward_metadata_replay` on the static batch), one process against one rank of a
two-rank DCP group (gloo, CPU), and of DCP's own per-rank rows (`dcp.metadata.rows_metadata`).
Op counts, not times: on a GPU each non-view op is a launch or a host tensor op.

    python3 scripts/probe_dcp_refill_ops.py --backend torch --batch 16 --q-len 1
"""

from __future__ import annotations

import argparse
import collections
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mla_backends.dcp.launch import spawn

VIEWS = {"view", "expand", "slice", "select", "alias", "_reshape_alias", "unsqueeze", "t"}


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict[str, Any]:
        total = sum(self.ops.values())
        views = sum(n for op, n in self.ops.items() if op in VIEWS)
        return {"ops": total, "non_view": total - views, "by_op": dict(self.ops)}


def worker(rank: int, group: Any, backend: str, b: int, q: int, kv: int) -> dict[str, Any]:
    from mla_backends.batch import ForwardBatch, ForwardMode
    from mla_backends.config import Config
    from mla_backends.dcp.metadata import rows_metadata
    from mla_backends.dcp.parity import SMALL
    from mla_backends.dcp.runtime import build_dcp_runtime
    from mla_backends.graph_runner import CudaGraphRunner, InputSpec
    from mla_backends.runtime import Runtime

    cfg = Config(
        model=SMALL, prefill_backend=backend, decode_backend=backend, page_size=16,
        kv_dtype="float32", dtype="float32", num_pages=b * (kv // 16 + 2) + 4, max_requests=b,
        max_context_len=kv + 8, device="cpu",
    )  # fmt: skip
    out: dict[str, Any] = {}
    for name, rt in (
        ("one process", Runtime.build(cfg)),
        ("DCP rank", build_dcp_runtime(cfg, group)),
    ):
        be = rt.backend
        rows = rt.req_pool.alloc(b)
        rt.allocator.alloc_extend(rows, [kv] * b)
        loc = rt.allocator.alloc_extend(rows, [q] * b)
        mode = ForwardMode.DECODE if q == 1 else ForwardMode.TARGET_VERIFY
        batch = ForwardBatch.build(mode, rows, [kv] * b, [q] * b, loc, "cpu")
        spec = {"x": InputSpec((1,), torch.float32)}
        runner = CudaGraphRunner(be, lambda *_: None, spec, [b], q, "cpu", use_graphs=False)
        runner.capture()
        runner._load(batch, {"x": torch.zeros(b * q, 1)}, b)
        static = runner._static_batch(b, batch)
        be.init_forward_metadata_replay(static)  # warm
        with Count() as c:
            be.init_forward_metadata_replay(static)
        out[name] = c.summary()
        if name == "DCP rank":
            with Count() as c:
                rows_metadata(be.layout, static, be.graph_state)
            out["  of which rows_metadata"] = c.summary()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", default="torch")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--q-len", type=int, default=1)
    p.add_argument("--kv", type=int, default=256)
    a = p.parse_args()
    got = spawn(worker, 2, "gloo", (a.backend, a.batch, a.q_len, a.kv))[0]
    for name, s in got.items():
        print(f"{name}: {s['ops']} ops, {s['non_view']} not views; {s['by_op']}")


if __name__ == "__main__":
    main()
