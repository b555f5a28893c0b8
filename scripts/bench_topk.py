"""The indexer's top-k alone on a GPU (CUDA-graph replay, µs): the launches' radix select
against the one-launch path at each block size and warp count that fits, and torch.topk, on
random fp32 logits of DSA's decode shapes (T rows of W keys, k 2048). Where sgl_kernel is
installed, SGLang's own DSA top-k is timed beside them as a peer: `fast_topk_v2` (row
positions) and `fast_topk_transform_fused` (positions mapped to pool slots through a page
table of page size 1, as ours), after a check that both pick our set.

    python scripts/bench_topk.py --out $OUT/topk
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_step import profile  # noqa: E402

from mla_backends.arith import cdiv
from mla_backends.bench.timing import capture_graph, graph_us
from mla_backends.kernels.common import num_sms
from mla_backends.sparse import topk_fused, topk_kernel
from mla_backends.sparse.topk_kernel import new_counts, topk_slots


def sgl_peers(logits: torch.Tensor, k: int, r2t: torch.Tensor) -> dict[str, float]:
    """SGLang's top-k kernels (sgl_kernel) on the same logits, {} where not installed. Each
    must select the same set as `topk_slots` (random logits: no ties) before it is timed."""
    try:
        import sgl_kernel
    except ImportError:
        return {}
    t, w = logits.shape
    dev = logits.device
    lengths = torch.full((t,), w, dtype=torch.int32, device=dev)
    table = r2t.expand(t, w).contiguous()  # page size 1: row b's slots
    cu_q = torch.arange(t + 1, dtype=torch.int32, device=dev)
    rows = torch.zeros(t, dtype=torch.int64, device=dev)
    ours = topk_slots(logits, k, r2t, rows).sort(-1).values
    pos = sgl_kernel.fast_topk_v2(logits, lengths, k)
    slots = sgl_kernel.fast_topk_transform_fused(logits, lengths, table, cu_q, k)
    if not torch.equal(r2t[0, pos.long()].sort(-1).values, ours):
        raise SystemExit(f"fast_topk_v2 picked another set at T {t} W {w}")
    if not torch.equal(slots.sort(-1).values, ours):
        raise SystemExit(f"fast_topk_transform_fused picked another set at T {t} W {w}")
    return {
        "sgl.fast_topk_v2": graph_us(lambda: sgl_kernel.fast_topk_v2(logits, lengths, k)),
        "sgl.transform_fused": graph_us(
            lambda: sgl_kernel.fast_topk_transform_fused(logits, lengths, table, cu_q, k)
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16")
    p.add_argument("--widths", default="16384,32768,65536,131072")
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--launch-blocks",
        default="",
        help="the launches at HIST:SPLIT block sizes too, e.g. 4096:4096,2048:8192",
    )
    p.add_argument(
        "--profile", action="store_true", help="the launches' kernels under the torch profiler"
    )
    a = p.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    results = []
    for t in map(int, a.rows.split(",")):
        for w in map(int, a.widths.split(",")):
            logits = torch.randn(t, w, generator=g, device=dev)
            r2t = torch.randperm(w, generator=g, device=dev).to(torch.int32).view(1, w)
            rows = torch.zeros(t, dtype=torch.int64, device=dev)
            row: dict[str, float] = {}

            def call() -> topk_kernel.TopkCall:  # fresh zeroed counters each replay
                return topk_kernel.TopkCall(logits, a.k, r2t, rows, rows, False, new_counts(t, dev))

            launches = lambda: topk_slots(logits, a.k, r2t, rows, path="launches")  # noqa: E731
            row["launches"] = graph_us(launches)
            if a.profile:
                prof = profile(capture_graph(launches))
                print(f"T {t:>2} W {w:>6} launches, profiler spans (us): {prof['kernels_us']}")
            row["torch.topk"] = graph_us(lambda: torch.topk(logits, a.k, dim=-1))
            row.update(sgl_peers(logits, a.k, r2t))
            for sizes in filter(None, a.launch_blocks.split(",")):
                hb, sb = map(int, sizes.split(":"))

                def sized(hb: int = hb, sb: int = sb) -> object:
                    return topk_kernel.launches(call(), hb, sb)

                row[f"launches[{hb}:{sb}]"] = graph_us(sized)
            for block in (512, *topk_fused.BLOCKS):
                if t * cdiv(w, block) > num_sms(dev):
                    continue
                for warps in (1, 2, 4, 8, 16):
                    if block // (32 * warps) < 2:
                        continue

                    def fused(block: int = block, warps: int = warps) -> object:
                        return topk_fused.run(call(), block, warps)

                    row[f"fused[{block}x{warps}w]"] = graph_us(fused)
            best = min((k for k in row if k.startswith("fused")), key=row.get, default=None)
            print(f"T {t:>2} W {w:>6}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()))
            print(f"  best fused {best}: {row.get(best) if best else None}", flush=True)
            results.append({"rows": t, "width": w, "us": row})
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        (a.out / "bench_topk.json").write_text(json.dumps({"meta": meta, "rows": results}))


if __name__ == "__main__":
    main()
