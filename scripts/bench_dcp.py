"""Decode context parallelism on 2 GPUs against one: decode step time at long context, with
CUDA graphs (the NCCL collectives captured inside them), and optionally the NCCL equality
matrix first. Spawns its own ranks (one process per GPU, NCCL, NVLink multicast off).

One attention layer (store the new rows, attend, merge), DeepSeek-V3 dims, bf16, page 64:
- `single_h{H}`: one GPU, all H heads, the whole KV;
- `single_h{H/2}`: one GPU, H / 2 heads, the whole KV (a TP-2 rank without DCP: MLA's latent
  KV is the same on every TP rank, so each holds all of it);
- `dcp2_replicated`: 2 GPUs, each all H heads and half the KV, out / lse all-gathered;
- `dcp2_tp`: 2 GPUs, each H / 2 heads (q all-gathered), half the KV, partials all-to-all.
Per configuration: `step_us`, wall time of one runner replay (loading the batch, metadata
refill, graph launch) averaged over `--iters` back to back; `graph_us`, the captured graph
alone by CUDA events; on 2 GPUs the slower rank's.

    python scripts/bench_dcp.py --check --out $OUT/dcp-h200x2.json
    python scripts/bench_dcp.py --device cpu --backends torch --context 300 --heads 4 \\
        --batch 3 --small --iters 2      # the same code path on CPU (gloo, no capture)
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mla_backends.arith import cdiv
from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.config import DEEPSEEK_V3, Config
from mla_backends.dcp.launch import spawn
from mla_backends.dcp.parity import SMALL, gpu_cases, parity_worker
from mla_backends.dcp.runtime import build_dcp_runtime
from mla_backends.graph_runner import CudaGraphRunner, InputSpec
from mla_backends.runtime import Runtime
from mla_backends.testing import absorbed_forward

PREFILL_FOR = {"flashmla": "triton"}  # EXTEND (unused here) goes to a backend that has it


def _config(a: dict[str, Any], backend: str, heads: int, ctx: int, dev: str) -> Config:
    dims = (SMALL if a["small"] else DEEPSEEK_V3).with_heads(heads)
    return Config(
        model=dims,
        num_layers=1,
        prefill_backend=PREFILL_FOR.get(backend, backend),
        decode_backend=backend,
        page_size=a["page"],
        kv_dtype=a["dtype"],
        dtype=a["dtype"],
        num_pages=a["batch"] * (cdiv(ctx, a["page"]) + 1) + 2,
        max_requests=a["batch"],
        max_context_len=a["context"] + 8,
        device=dev,
    )


def _measure(rt: Any, a: dict[str, Any], heads: int, group: dist.ProcessGroup | None) -> dict:
    """Fill every request to `context - 1` tokens (random pool), then time one decode step
    of the whole batch, replayed through the captured graph."""
    dev, b, dims = rt.kv_pool.device, a["batch"], rt.config.model
    rt.kv_pool.kv_buffer[0].normal_()
    rows = rt.req_pool.alloc(b)
    rt.allocator.alloc_extend(rows, [a["context"] - 1] * b)
    loc = rt.allocator.alloc_decode(rows)
    batch = ForwardBatch.build(ForwardMode.DECODE, rows, [a["context"] - 1] * b, [1] * b, loc, dev)
    act = rt.config.torch_dtype
    specs = {
        "q_nope": InputSpec((heads, dims.kv_lora_rank), act),
        "q_rope": InputSpec((heads, dims.qk_rope_head_dim), act),
        "k_nope": InputSpec((dims.kv_lora_rank,), act),
        "k_rope": InputSpec((dims.qk_rope_head_dim,), act),
    }
    inputs = {k: torch.randn(b, *s.shape, device=dev).to(s.dtype) for k, s in specs.items()}
    graphs = dev.type == "cuda"
    runner = CudaGraphRunner(
        rt.backend, partial(absorbed_forward, rt.backend), specs, [b], 1, dev, graphs
    )
    runner.capture()

    def sync() -> None:
        if graphs:
            torch.cuda.synchronize(dev)
        if group is not None:
            dist.barrier(group)

    for _ in range(3):
        runner.replay(batch, inputs)
    sync()
    start = time.perf_counter()
    for _ in range(a["iters"]):
        runner.replay(batch, inputs)
    sync()
    out = {"step_us": (time.perf_counter() - start) / a["iters"] * 1e6}
    if graphs:
        graph = runner._graphs[b]  # the captured step alone (no host work)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sync()
        begin.record()
        for _ in range(a["iters"]):
            graph.replay()
        end.record()
        sync()
        out["graph_us"] = begin.elapsed_time(end) / a["iters"] * 1e3
    return out


def _slowest(x: dict[str, float], group: dist.ProcessGroup, dev: torch.device) -> dict:
    keys = sorted(x)
    t = torch.tensor([x[k] for k in keys], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(keys, t.tolist()))


def bench_worker(rank: int, group: dist.ProcessGroup, a: dict[str, Any]) -> dict[str, Any]:
    dev = torch.device(f"cuda:{rank}") if a["device"] == "cuda" else torch.device("cpu")
    n, h, ctx = dist.get_world_size(group), a["heads"], a["context"]
    report: dict[str, Any] = {}
    begin = time.perf_counter()

    def done(what: str, r: dict[str, Any]) -> None:  # progress: a cut-short run says how far
        if rank == 0:
            print(f"[bench_dcp {time.perf_counter() - begin:6.1f}s] {what}: {r}", flush=True)

    for be in a["backends"]:
        res: dict[str, Any] = {}
        for heads in (h, h // n):  # one GPU: rank 0 measures, the others wait
            if rank == 0:
                res[f"single_h{heads}"] = _measure(
                    Runtime.build(_config(a, be, heads, ctx, str(dev))), a, heads, None
                )
                done(f"{be} single_h{heads}", res[f"single_h{heads}"])
            dist.barrier(group)
        for mode, heads in (("replicated", h), ("tp", h // n)):
            cfg = _config(a, be, heads, cdiv(ctx, n), str(dev))
            rt = build_dcp_runtime(cfg, group, mode)
            res[f"dcp{n}_{mode}"] = _slowest(_measure(rt, a, heads, group), group, dev)
            done(f"{be} dcp{n}_{mode}", res[f"dcp{n}_{mode}"])
            del rt
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        base = res[f"single_h{h}"]["step_us"] if rank == 0 else None
        if base is not None:
            res["speedup_replicated"] = base / res[f"dcp{n}_replicated"]["step_us"]
            res["speedup_tp_vs_tp_rank"] = (
                res[f"single_h{h // n}"]["step_us"] / res[f"dcp{n}_tp"]["step_us"]
            )
        report[be] = res
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", nargs="+", default=["triton", "flashinfer_mla", "flashmla"])
    p.add_argument("--nprocs", type=int, default=2)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true", help="tiny dims (L 32, R 16): CPU smoke")
    p.add_argument("--check", action="store_true", help="run the NCCL equality matrix first")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    dist_backend = "nccl" if args.device == "cuda" else "gloo"
    doc: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    if args.device == "cuda":
        doc["device"] = torch.cuda.get_device_name(0)
    doc["torch"] = torch.__version__
    if args.check:
        cases = gpu_cases(args.nprocs)
        per_rank = spawn(parity_worker, args.nprocs, dist_backend, (cases, args.device))
        doc["check"] = [r for rank in per_rank for r in rank]
        bad = [r for r in doc["check"] if not r["ok"]]
        print(f"equality: {len(doc['check']) - len(bad)} of {len(doc['check'])} rank-cases ok")
        for r in bad:
            print(f"  FAIL {r['id']} rank {r['rank']}: {r['detail']}")
    doc["bench"] = spawn(bench_worker, args.nprocs, dist_backend, (vars(args),))[0]
    for be, res in doc["bench"].items():
        row = ", ".join(
            f"{k} {v['step_us']:.1f} us"
            + (f" (graph {v['graph_us']:.1f})" if "graph_us" in v else "")
            for k, v in res.items()
            if isinstance(v, dict)
        )
        print(f"{be}: {row}; speedup {res.get('speedup_replicated', 0):.2f}x")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
