"""The KV store of one decode step: `layers` calls of a pool's `set_mla_kv_buffer` (the store of
every backend without a fused one: flashmla, flashinfer_mla, torch, the sparse backends),
captured in one CUDA graph and replayed (`do_bench` median, us), for the latent pool in bf16
and FP8 and for the 656-byte FP8 rows (FlashMLA sparse). Random rows and shuffled slots, and
one -1 slot a batch (the dummy-slot rule) where `--pad` is given.

    python3 scripts/bench_store.py [--layers 61] [--batch 1,8,64] [--pools P,..] [--pad] [--out F]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from mla_backends.pool import MLATokenToKVPool
from mla_backends.sparse.fp8_row import Fp8RowPool


def _pool(kind: str, layers: int, dev: torch.device) -> MLATokenToKVPool | Fp8RowPool:
    if kind == "fp8_rows":
        return Fp8RowPool(layers, 64, 64, 512, 64, dev)
    pool = MLATokenToKVPool(layers, 64, 64, 512, 64, getattr(torch, kind), device=dev)
    for layer in range(layers):
        if pool.is_fp8:
            pool.set_scale(layer, 0.05)
    return pool


def step_us(kind: str, layers: int, batch: int, pad: bool, dev: torch.device) -> float:
    pool = _pool(kind, layers, dev)
    gen = torch.Generator(device=dev).manual_seed(batch)
    loc = torch.randperm(pool.num_slots - 64, generator=gen, device=dev)[:batch] + 64
    if pad:
        loc[0] = -1
    k_nope = torch.randn(batch, 512, generator=gen, device=dev).bfloat16()
    k_rope = torch.randn(batch, 64, generator=gen, device=dev).bfloat16()

    def step() -> None:
        for layer in range(layers):
            pool.set_mla_kv_buffer(layer, loc, k_nope, k_rope)

    step()  # compiles, warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return float(triton.testing.do_bench(graph.replay, warmup=50, rep=300)) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--batch", default="1,8,64")
    p.add_argument("--pad", action="store_true")
    p.add_argument("--pools", default="bfloat16,float8_e4m3fn,fp8_rows")
    p.add_argument("--out")
    args = p.parse_args()
    dev = torch.device("cuda")
    rows = []
    for kind in args.pools.split(","):
        for b in (int(x) for x in args.batch.split(",")):
            us = step_us(kind, args.layers, b, args.pad, dev)
            rows.append({"pool": kind, "batch": b, "layers": args.layers, "step_us": us})
            print(f"{kind:14s} B{b:<4d} {args.layers} layers: {us:8.1f} us a step", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
