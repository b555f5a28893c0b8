"""The indexer's top-k alone on a GPU (CUDA-graph replay, ms): the six-launch radix select
against the one-launch path at each block size and warp count that fits, and torch.topk, on
random fp32 logits of DSA's decode shapes (T rows of W keys, k 2048).

    python scripts/bench_topk.py --out $OUT/topk
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mla_backends.arith import cdiv
from mla_backends.bench.timing import graph_us
from mla_backends.kernels.common import num_sms
from mla_backends.sparse import topk_fused
from mla_backends.sparse.topk_kernel import new_counts, topk_slots


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16")
    p.add_argument("--widths", default="16384,32768,65536,131072")
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--out", type=Path, default=None)
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
            row["launches"] = graph_us(lambda: topk_slots(logits, a.k, r2t, rows, path="launches"))
            row["torch.topk"] = graph_us(lambda: torch.topk(logits, a.k, dim=-1))
            for block in (512, *topk_fused.BLOCKS):
                if t * cdiv(w, block) > num_sms(dev):
                    continue
                for warps in (1, 2, 4, 8, 16):
                    if block // (32 * warps) < 2:
                        continue

                    def fused(block: int = block, warps: int = warps) -> object:
                        return topk_fused.run(
                            logits, a.k, r2t, rows, rows, False, block, new_counts(t, dev), warps
                        )

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
