"""Where a DeepSeek-V3.2 decode step's time goes, kernel by kernel: each graph of
`scripts/bench_sparse.py` (the sparse step: indexer + sparse attention; the sparse attention
alone; dense decode through our `triton` and `flashmla` backends) captured once and replayed
under the torch profiler, with L2 flushed before every replay as `do_bench` does. Reports per
graph the median span (first kernel start to last kernel end), each kernel's median duration,
the gaps between consecutive kernels, and `graph_us` (the bench's number) for the same graph.

    python scripts/profile_step.py --contexts 16384,32768 --batch 1 --heads 16,128 --out $OUT/prof
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sparse import PAGE, build_pools, decode_batch  # noqa: E402

from mla_backends.backends.base import BackendContext  # noqa: E402
from mla_backends.backends.registry import get_backend_class  # noqa: E402
from mla_backends.bench.timing import capture_graph, graph_us  # noqa: E402
from mla_backends.config import Config, MLADims  # noqa: E402
from mla_backends.sparse.base import SparseContext, create_sparse_backend  # noqa: E402
from mla_backends.sparse.indexer import Indexer, IndexerDims  # noqa: E402

FLUSH = 256 << 20  # bytes zeroed before each replay (do_bench's L2 flush)


def profile(g: torch.cuda.CUDAGraph, reps: int = 30) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprof

    flush = torch.empty(FLUSH, dtype=torch.int8, device="cuda")
    for _ in range(3):
        flush.zero_()
        g.replay()
    torch.cuda.synchronize()
    with tprof(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            g.replay()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type.name == "CUDA"),
        key=lambda e: e.time_range.start,
    )
    # Split at the flush kernels: what follows one is a replay.
    runs: list[list] = []
    for e in kernels:
        if "fill" in e.name.lower() and e.time_range.elapsed_us() > 30:
            runs.append([e])  # the flush: 256 MiB zeroed, ~100 us
        elif runs:
            runs[-1].append(e)
    per_kernel: dict[str, list[float]] = defaultdict(list)
    spans, gaps, lead = [], defaultdict(list), []
    for run in runs:
        fl, body = run[0], run[1:]
        if not body:
            continue
        lead.append(body[0].time_range.start - fl.time_range.end)
        spans.append(body[-1].time_range.end - body[0].time_range.start)
        for i, e in enumerate(body):
            per_kernel[f"{i}:{e.name[:60]}"].append(e.time_range.elapsed_us())
            if i:
                gaps[i].append(e.time_range.start - body[i - 1].time_range.end)
    med = statistics.median
    return {
        "replays": len(spans),
        "span_us": med(spans) if spans else None,
        "lead_us": med(lead) if lead else None,
        "kernels_us": {k: round(med(v), 2) for k, v in per_kernel.items()},
        "gaps_us": {i: round(med(v), 2) for i, v in gaps.items()},
    }


def sweep(sp, b, splits, qn, qr, slots, batch):  # type: ignore[no-untyped-def]
    """The sparse attention at a fixed split count (the backend's launch otherwise)."""
    sp.launch = {**sp._launch(b), "splits": splits}
    try:
        return sp.forward_sparse(0, qn, qr, slots, batch)
    finally:
        sp.launch = None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="16384,32768")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", default="16,128")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--sparse", default="triton", help="sparse backend of the step")
    p.add_argument("--splits", default="", help="also the sparse graph at these split counts")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    contexts = [int(x) for x in a.contexts.split(",")]
    heads = [int(x) for x in a.heads.split(",")]
    dev = torch.device("cuda")
    b = a.batch
    bf16, _, cache, req = build_pools(b, max(contexts), False)
    res = []
    for ctx in contexts:
        batch = decode_batch(req, b, ctx)
        ix = Indexer(IndexerDims(topk=a.topk), cache, req.req_to_token, "triton")
        ix.init_forward_metadata(batch)
        q_idx = torch.randn(b, 64, 128, device=dev).bfloat16()
        w = torch.randn(b, 64, device=dev)
        ang = torch.rand(b, 32, device=dev) * 6
        cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()

        def select() -> torch.Tensor:
            return ix.select(0, q_idx, w, cos, sin)

        slots = select()
        for h in heads:
            dims = MLADims(h, 512, 64, 128, 128, 40.0, 1.0)
            q = torch.randn(b, h, 576, device=dev).bfloat16()
            qn, qr = q[..., :512], q[..., 512:]
            sp = create_sparse_backend(a.sparse, SparseContext(dims, bf16, req, a.topk, q.dtype))
            sp.init_forward_metadata(batch)
            fns: dict[str, Callable[[], object]] = {
                "indexer": select,
                "step": lambda sp=sp: sp.forward_sparse(0, qn, qr, select(), batch),
                "sparse": lambda sp=sp: sp.forward_sparse(0, qn, qr, slots, batch),
            }
            for name in ("triton", "flashmla"):
                cfg = Config(
                    model=dims, num_layers=1, prefill_backend="triton", decode_backend=name,
                    page_size=PAGE, kv_dtype="bfloat16", dtype="bfloat16",
                    num_pages=bf16.num_pages, max_requests=req.size,
                    max_context_len=req.max_context_len, device="cuda",
                )  # fmt: skip
                be = get_backend_class(name)(BackendContext(cfg, bf16, req))
                be.init_forward_metadata(batch)
                fns[f"dense_{name}"] = lambda be=be: be.forward_absorbed(
                    0, qn, qr, None, None, batch
                )
            for s in [int(x) for x in a.splits.split(",") if x]:
                fns[f"sparse[splits={s}]"] = lambda s=s, sp=sp: sweep(
                    sp, b, s, qn, qr, slots, batch
                )
            for name, fn in fns.items():
                g = capture_graph(fn)
                row = {"context": ctx, "batch": b, "heads": h, "graph": name}
                row.update(profile(g))
                row["graph_us"] = round(graph_us(fn), 2)
                res.append(row)
                print(json.dumps(row), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_step.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
