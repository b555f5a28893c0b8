"""DeepSeek-V3.2 indexer logits alone: the Triton kernel (`indexer_kernels.index_logits`, one
program a 128-key block; looping programs at a graph's width) against the Gluon kernel
(`sparse/indexer_gluon.py`, programs streaming 64-key tiles through a cp.async ring), on the
same random e4m3 index keys, paged in random page order, 64 index heads of 128. Checks the
Gluon logits against the Triton ones first (same -inf pattern, max difference), then times
both under CUDA-graph replay at the context's width and at the pool's width (a captured
graph's), and the Gluon kernel at other ring depths and program counts an SM (`--configs`,
stages x programs an SM, one wave of programs each). Reports the
key bytes read per second against the copy ceiling.

    python3 scripts/bench_indexer_logits.py --contexts 16384,131072 --batch 1,16,64 --out OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mla_backends.arith import cdiv
from mla_backends.bench.timing import graph_us
from mla_backends.sparse import indexer_gluon as ig
from mla_backends.sparse.index_k import PAGE, IndexKCache
from mla_backends.sparse.indexer_kernels import index_logits

CHUNK = 1 << 13  # index-K blocks filled at a time


def build(max_b: int, max_ctx: int) -> tuple[IndexKCache, torch.Tensor]:
    """Index-K cache of random e4m3 codes and power-of-two scales; request i (row i) owns
    max_ctx tokens on pages in random order."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    ppr = cdiv(max_ctx, PAGE)
    cache = IndexKCache(1, max_b * ppr * PAGE, ig.D, True, dev)
    data, scale = cache.data_view(cache.buffers[0]), cache.scale_view(cache.buffers[0])
    for s in range(0, data.shape[0], CHUNK):
        blk = data[s : s + CHUNK]
        blk.copy_(torch.randn(blk.shape, device=dev).mul_(64).to(torch.float8_e4m3fn))
    scale.copy_(torch.exp2(-torch.randint(4, 9, scale.shape, device=dev).float()))
    order = torch.randperm(max_b * ppr, device=dev)
    pos = torch.arange(max_ctx, device=dev)
    r2t = torch.empty(max_b, max_ctx, dtype=torch.int32, device=dev)
    for i in range(max_b):
        mine = order[i * ppr : (i + 1) * ppr]
        r2t[i] = (mine[pos // PAGE] * PAGE + pos % PAGE).int()
    return cache, r2t


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    """The Gluon logits against the Triton kernel's: the same -inf pattern, bit for bit, and
    the largest difference and value over the finite ones."""
    fin = torch.isfinite(want)
    return {
        "same_inf": bool(torch.equal(fin, torch.isfinite(got))),
        "bit_equal": bool(torch.equal(got, want)),
        "max_abs_diff": float((got - want)[fin].abs().max()),
        "max_abs": float(want[fin].abs().max()),
    }


def run_one(
    ctx: int, b: int, cache: IndexKCache, r2t: torch.Tensor, configs: list[tuple[int, ...]]
) -> dict:
    dev = torch.device("cuda")
    q = torch.randn(b, 64, ig.D, device=dev).mul_(64).to(torch.float8_e4m3fn)
    w = torch.randn(b, 64, device=dev)
    rows = torch.arange(b, device=dev)
    vis = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    pool_w = r2t.shape[1]
    args = (cache, 0, q, w, r2t, rows, vis)
    check = compare(ig.index_logits(*args, ctx), index_logits(*args, ctx, kernel="triton"))
    us = {
        "triton": graph_us(lambda: index_logits(*args, ctx, kernel="triton")),
        "gluon": graph_us(lambda: ig.index_logits(*args, ctx)),
        "triton_graph_width": graph_us(
            lambda: index_logits(*args, pool_w, loop=True, kernel="triton")
        ),
        "gluon_graph_width": graph_us(lambda: ig.index_logits(*args, pool_w)),
    }
    for stages, per_sm, cap in configs:
        g = ig.programs(b, ctx, dev, per_sm)
        us[f"gluon[{stages}x{per_sm}{f'r{cap}' if cap else ''}]"] = graph_us(
            lambda g=g, stages=stages, cap=cap: ig.index_logits(*args, ctx, g, stages, cap)
        )
    key_bytes = b * ctx * (ig.D + 4)
    tbs = {k: key_bytes / v / 1e6 for k, v in us.items()}
    return {"context": ctx, "batch": b, "check": check, "us": us, "key_TB_s": tbs}


def run_prefill(n: int, cache: IndexKCache, r2t: torch.Tensor) -> dict:
    """One request's prefill of n tokens (token i sees keys 0..i, the logits n wide): the
    Triton kernel against the Gluon one, whose programs then take one token each."""
    dev = torch.device("cuda")
    q = torch.randn(n, 64, ig.D, device=dev).mul_(64).to(torch.float8_e4m3fn)
    w = torch.randn(n, 64, device=dev)
    rows = torch.zeros(n, dtype=torch.long, device=dev)
    vis = torch.arange(1, n + 1, dtype=torch.int32, device=dev)
    args = (cache, 0, q, w, r2t, rows, vis, n)
    check = compare(ig.index_logits(*args), index_logits(*args, kernel="triton"))
    us = {
        "triton": graph_us(lambda: index_logits(*args, kernel="triton")),
        "gluon": graph_us(lambda: ig.index_logits(*args)),
    }
    return {"prefill": n, "check": check, "us": us}


def config(text: str) -> tuple[int, int, int]:
    """ "3x5r96" -> (stages 3, 5 programs an SM, at most 96 registers; 0: no cap)."""
    stages, rest = text.split("x")
    per_sm, _, cap = rest.partition("r")
    return int(stages), int(per_sm), int(cap or 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="16384,32768,131072")
    p.add_argument("--batch", default="1,16,64")
    p.add_argument(
        "--configs", default="6x3,8x2,4x2", help="stages x programs an SM [r register cap]"
    )
    p.add_argument("--prefill", default="", help="also one request's prefill of these lengths")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    contexts, batches = ints(a.contexts), ints(a.batch)
    cache, r2t = build(max(batches), max(contexts + ints(a.prefill)))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    rows: list[dict] = []
    for ctx in contexts:
        for b in batches:
            configs = [config(c) for c in a.configs.split(",") if c]
            r = run_one(ctx, b, cache, r2t, configs)
            rows.append(r)
            us = " ".join(f"{k} {v:.1f}" for k, v in r["us"].items())
            print(f"ctx {ctx} B {b}: {r['check']} | {us}", flush=True)
            (out / "bench_indexer_logits.json").write_text(
                json.dumps({"meta": meta, "rows": rows}, indent=1)
            )
    for n in ints(a.prefill):
        r = run_prefill(n, cache, r2t)
        rows.append(r)
        print(
            f"prefill {n}: {r['check']} | " + " ".join(f"{k} {v:.1f}" for k, v in r["us"].items())
        )
        (out / "bench_indexer_logits.json").write_text(
            json.dumps({"meta": meta, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
