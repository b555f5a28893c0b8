"""Linear-layer decode (one KDA / GDN layer, one token per request) through our backend
against the raw fla kernel call on the same inputs, and the state traffic against the copy
ceiling measured in the same run.

- ours: `LinearAttentionBackend.forward` on a DECODE batch (metadata built once), states
  read and written in place in the pool at the requests' rows;
- raw KDA: `fused_recurrent_kda_fwd` with `ssm_state_indices` on the same pool (what our
  backend calls, minus our layer);
- raw GDN: `fused_recurrent_gated_delta_rule` on states already gathered into a contiguous
  [B, H, K, V] tensor (the plain fla API: no indices; gathering would cost extra).

Timed eagerly (`do_bench`: host launch overhead included, which dominates at small batch)
and as one captured CUDA graph each (GPU time, as a decode graph pays it). State traffic:
B x H x K x V x 4 bytes read and written; GB/s = 2 x that / graph time. On a CPU only our
backend's eager time is taken (torch kernels); raw fla and graphs need a CUDA GPU."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import torch

from mla_backends.backends.kernel_packages import require
from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.bench.options import Options, pick
from mla_backends.bench.report import write
from mla_backends.bench.timing import bench_us, ceilings, graph_us
from mla_backends.cli import out_of_memory
from mla_backends.config import Config
from mla_backends.linear.backend import LinearAttentionBackend
from mla_backends.linear.state_pool import LinearStatePool


def _raw_fla(
    kind: str, pool: LinearStatePool, rows: torch.Tensor, d: int, *qkvgb: torch.Tensor
) -> Callable[[], object]:
    """The raw fla call on the same inputs (GPU, fla installed)."""
    q, k, v, g, beta = (x[:, None] for x in qkvgb)
    if kind == "kda":
        kda = require("fla.ops.kda.fused_recurrent").fused_recurrent_kda_fwd
        args = dict(
            q=q, k=k, v=v, g=g, beta=beta, initial_state=pool.recurrent[0], scale=d**-0.5,
            inplace_final_state=True, ssm_state_indices=rows,
        )  # fmt: skip
        return lambda: kda(**args)
    gdn = require("fla.ops.gated_delta_rule").fused_recurrent_gated_delta_rule
    s0 = pool.recurrent[0][rows.long()].contiguous()
    return lambda: gdn(q, k, v, g, beta, initial_state=s0, output_final_state=True)


def one(
    kind: str, b: int, h: int, d: int, dtype: torch.dtype, copy_gbps: float, dev: torch.device
) -> dict:
    gpu = dev.type == "cuda"
    pool = LinearStatePool(1, b + 8, h, d, d, 16, 4, dev)
    pool.recurrent.normal_(0, 0.1)
    be = LinearAttentionBackend(pool, kernels="fla" if gpu else "torch")
    rows = torch.randperm(b + 8)[:b] + 1  # scattered slots, never the dummy
    batch = ForwardBatch.build(
        ForwardMode.DECODE,
        rows.tolist(),
        [100] * b,
        [1] * b,
        torch.zeros(b, dtype=torch.long, device=dev),
        dev,
    )
    q = torch.nn.functional.normalize(torch.randn(b, h, d, device=dev), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(b, h, d, device=dev), dim=-1).to(dtype)
    v = torch.randn(b, h, d, device=dev, dtype=dtype)
    g = -torch.rand(b, h, d if kind == "kda" else 1, device=dev).squeeze(-1) * 0.3
    beta = torch.rand(b, h, device=dev, dtype=dtype)
    be.init_forward_metadata(batch)
    ours_fn = lambda: be.forward(0, q, k, v, g, beta)  # noqa: E731
    ours = bench_us(ours_fn, device=dev)
    row = dict(kind=kind, batch=b, heads=h, head_dim=d, dtype=str(dtype).split(".")[-1])
    if not gpu:
        return dict(row, ours_us=ours)
    ours_g = graph_us(ours_fn)
    raw_fn = _raw_fla(kind, pool, batch.req_pool_indices, d, q, k, v, g, beta)
    raw = bench_us(raw_fn, device=dev)
    raw_g = graph_us(raw_fn)
    gbps = 2 * b * h * d * d * 4 / ours_g / 1e3
    return dict(
        row, ours_us=ours, raw_us=raw, ours_vs_raw=raw / ours, ours_graph_us=ours_g,
        raw_graph_us=raw_g, graph_ours_vs_raw=raw_g / ours_g, state_gbps=gbps,
        frac_copy=gbps / copy_gbps,
    )  # fmt: skip


def table(rows: list[dict], ceil: dict, heads: list[int], d: int) -> str:
    """The markdown table of linear.md; a CPU row has our eager time only ("-" elsewhere)."""
    what = "ceiling" if ceil.get("is_ceiling", True) else "reference (CPU: not a ceiling)"
    lines = [
        f"copy {what} {ceil['copy_gbps']:.0f} GB/s; H={','.join(map(str, heads))}, K=V={d}, "
        "bf16 q/k/v, fp32 state",
        "| kind | B | eager: ours µs | raw fla µs | speed vs raw | graph: ours µs | raw fla µs "
        "| speed vs raw | state GB/s (graph) | of copy ceiling |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "raw_us" not in r:
            lines.append(f"| {r['kind']} | {r['batch']} | {r['ours_us']:.1f} |" + " - |" * 7)
            continue
        lines.append(
            f"| {r['kind']} | {r['batch']} | {r['ours_us']:.1f} | {r['raw_us']:.1f} | "
            f"{r['ours_vs_raw']:.2f}x | {r['ours_graph_us']:.1f} | {r['raw_graph_us']:.1f} | "
            f"{r['graph_ours_vs_raw']:.2f}x | {r['state_gbps']:.0f} | {r['frac_copy']:.0%} |"
        )
    return "\n".join(lines)


def run(opts: Options, config: Config) -> None:
    dev = config.torch_device
    batches, heads = pick(opts.batch, [1, 16, 64, 256]), pick(opts.heads, [32])
    d = pick(opts.head_dim, 128)
    if dev.type == "cuda":  # before any timing: raw fla is half of every row
        require("fla")
    else:
        print(f"raw fla and CUDA graphs not run: they need a CUDA GPU (this run is on {dev})")
    ceil = ceilings(dev)
    rows = []
    for kind, h, b in itertools.product(("kda", "gdn"), heads, batches):
        with out_of_memory(f"--batch {b}, --heads {h}, --head-dim {d}", dev):
            rows.append(one(kind, b, h, d, torch.bfloat16, ceil["copy_gbps"], dev))
    md = table(rows, ceil, heads, d)
    print(md)
    files = {"linear.json": dict(ceilings=ceil, rows=rows), "linear.md": md + "\n"}
    print("wrote " + " and ".join(map(str, write(Path(opts.out), files))))
