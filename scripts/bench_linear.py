"""Linear-layer decode (one KDA / GDN layer, one token per request) through our backend
against the raw fla kernel call on the same inputs, and the state traffic against the copy
ceiling measured in the same run. GPU only.

- ours: `LinearAttentionBackend.forward` on a DECODE batch (metadata built once), states
  read and written in place in the pool at the requests' rows;
- raw KDA: `fused_recurrent_kda_fwd` with `ssm_state_indices` on the same pool (what our
  backend calls, minus our layer);
- raw GDN: `fused_recurrent_gated_delta_rule` on states already gathered into a contiguous
  [B, H, K, V] tensor (the plain fla API: no indices; gathering would cost extra).

Timed eagerly (`do_bench`: host launch overhead included, which dominates at small batch)
and as one captured CUDA graph each (GPU time, as a decode graph pays it). State traffic:
B x H x K x V x 4 bytes read and written; GB/s = 2 x that / graph time.

    python scripts/bench_linear.py --out $OUT/linear
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.bench.timing import bench_us, ceilings
from mla_backends.linear.backend import LinearAttentionBackend
from mla_backends.linear.state_pool import LinearStatePool


def graph_us(fn) -> float:  # type: ignore[no-untyped-def]
    """Median replay time of `fn` captured in a CUDA graph: the GPU time a serving engine's
    decode graph pays (host launch overhead removed, as for both sides)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return bench_us(g.replay, device=torch.device("cuda"))


def one(kind: str, b: int, h: int, d: int, dtype: torch.dtype, copy_gbps: float) -> dict:
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    dev = "cuda"
    pool = LinearStatePool(1, b + 8, h, d, d, 16, 4, dev)
    pool.recurrent.normal_(0, 0.1)
    be = LinearAttentionBackend(pool, kernels="fla")
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
    ours = bench_us(ours_fn, device=torch.device(dev))
    ours_g = graph_us(ours_fn)
    rows_dev = batch.req_pool_indices
    if kind == "kda":
        args = dict(
            q=q[:, None], k=k[:, None], v=v[:, None], g=g[:, None], beta=beta[:, None],
            initial_state=pool.recurrent[0], scale=d**-0.5, inplace_final_state=True,
            ssm_state_indices=rows_dev,
        )  # fmt: skip
        raw_fn = lambda: fused_recurrent_kda_fwd(**args)  # noqa: E731
    else:
        s0 = pool.recurrent[0][rows_dev.long()].contiguous()
        raw_fn = lambda: fused_recurrent_gated_delta_rule(  # noqa: E731
            q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
            initial_state=s0, output_final_state=True,
        )  # fmt: skip
    raw = bench_us(raw_fn, device=torch.device(dev))
    raw_g = graph_us(raw_fn)
    state_bytes = 2 * b * h * d * d * 4
    gbps = state_bytes / ours_g / 1e3
    return dict(
        kind=kind, batch=b, heads=h, head_dim=d, dtype=str(dtype).split(".")[-1],
        ours_us=ours, raw_us=raw, ours_vs_raw=raw / ours, ours_graph_us=ours_g,
        raw_graph_us=raw_g, graph_ours_vs_raw=raw_g / ours_g, state_gbps=gbps,
        frac_copy=gbps / copy_gbps,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", default="1,16,64,256")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", default="linear-out")
    a = p.parse_args()
    ceil = ceilings(torch.device("cuda"))
    rows = []
    for kind in ("kda", "gdn"):
        for b in (int(x) for x in a.batch.split(",")):
            rows.append(one(kind, b, a.heads, a.head_dim, torch.bfloat16, ceil["copy_gbps"]))
    lines = [
        f"copy ceiling {ceil['copy_gbps']:.0f} GB/s; H={a.heads}, K=V={a.head_dim}, bf16 q/k/v, "
        "fp32 state",
        "| kind | B | eager: ours µs | raw fla µs | speed vs raw | graph: ours µs | raw fla µs "
        "| speed vs raw | state GB/s (graph) | of copy ceiling |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kind']} | {r['batch']} | {r['ours_us']:.1f} | {r['raw_us']:.1f} | "
            f"{r['ours_vs_raw']:.2f}x | {r['ours_graph_us']:.1f} | {r['raw_graph_us']:.1f} | "
            f"{r['graph_ours_vs_raw']:.2f}x | {r['state_gbps']:.0f} | {r['frac_copy']:.0%} |"
        )
    print("\n".join(lines))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "linear.json").write_text(json.dumps(dict(ceilings=ceil, rows=rows), indent=1))
    (out / "linear.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
