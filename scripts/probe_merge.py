"""Probe: the split merge (`kernels.mla_attention._merge_kernel`) alone, at the split grids the
decode and sparse paths make, over its launch parameters.

Why: in profiles of batch-1 / small-batch decode the merge kernel is a large share of a step
(H16 B1 kv 16k dense: 5.4 us for 4 MB of partials, 0.75 TB/s out of L2; the DSA step's
sparse merge ~3.5 us for 1 MB), far under what 128 programs reading L2 should take. Each
program reads its column block's partials CHUNK splits at a time; if those chunks' loads are
not in flight together, the kernel is a chain of L2 round trips, and larger chunks, more
column blocks (more programs) or fewer warps would show it.

Each shape's partials are random (lse too, with some -inf splits), every variant checked
against the default launch (equal to fp32 rounding), then timed in graph replay (median,
warm-up first). Prints one JSON line a shape and variant.

    python3 scripts/probe_merge.py [--shapes T:H:SPLITS,...]
"""

from __future__ import annotations

import argparse
import json

import torch

from mla_backends.bench.timing import graph_us
from mla_backends.kernels.common import num_sms
from mla_backends.kernels.mla_attention import _merge_kernel, merge_blocks
from mla_backends.kernels.pdl import pdl_args

# (tokens, heads, splits): dense H16 B1 kv 16k, B1 kv 4k, B2 (narrow kernel), the DSA sparse
# merge at B1 H16, dense H16 B16 kv 4k, H128 B4 kv 32k, the DSA sparse merge at B1 H128,
# dense H128 B1
SHAPES = "1:16:128,1:16:64,2:16:64,1:16:32,16:16:8,4:128:16,1:128:32,1:128:64"


def rule_blocks(t: int, h: int, lat: int, sms: int) -> int:
    """`mla_attention._merge`'s column blocks before the twenty-third session, which read 16
    splits a chunk: the baseline ("rule" in the output) every variant is checked against;
    "now" marks the launch `mla_attention.merge_blocks` makes today."""
    blocks = max(1, min(sms // (t * h), lat // 64))
    return 1 << (blocks.bit_length() - 1)


def launch(part_out, part_lse, out, lse, splits: int, blocks: int, chunk: int, warps: int):  # type: ignore[no-untyped-def]
    t, h, lat = out.shape
    _merge_kernel[(t * h, blocks)](
        part_out, part_lse, out, lse, out.stride(0), out.stride(1), lse.stride(0),
        H=h, L=lat, BLOCK_L=lat // blocks, NUM_SPLITS=splits, CHUNK=chunk, num_warps=warps,
        **pdl_args(out.device),
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES)
    a = p.parse_args()
    dev = torch.device("cuda")
    sms = num_sms(dev)
    lat = 512
    for spec in a.shapes.split(","):
        t, h, splits = (int(x) for x in spec.split(":"))
        g = torch.Generator(device=dev).manual_seed(t * 1000 + h + splits)
        rows = t * h * splits
        part_out = torch.randn(rows, lat, device=dev, generator=g)
        part_lse = torch.randn(rows, device=dev, generator=g) * 3
        part_lse[torch.rand(rows, device=dev, generator=g) < 0.1] = float("-inf")
        out = torch.empty(t, h, lat, dtype=torch.bfloat16, device=dev)
        lse = torch.empty(t, h, device=dev)
        base = rule_blocks(t, h, lat, sms)
        ref_out, ref_lse = out.clone(), lse.clone()
        launch(part_out, part_lse, ref_out, ref_lse, splits, base, min(splits, 16), 4)
        variants = []
        for blocks in (base, base * 2, base * 4):
            if lat // blocks < 16:
                continue
            for chunk in sorted({min(splits, c) for c in (16, 32, 64, 128)}):
                if chunk * (lat // blocks) > 8192:
                    continue
                for warps in (4, 2):
                    variants.append((blocks, chunk, warps))
        gbytes = rows * (lat + 1) * 4 / 1e3  # partials read, KB -> us gives GB/s
        for blocks, chunk, warps in variants:
            o, s = out.clone(), lse.clone()
            launch(part_out, part_lse, o, s, splits, blocks, chunk, warps)
            torch.testing.assert_close(o, ref_out, atol=1e-2, rtol=1e-2)
            torch.testing.assert_close(s, ref_lse, atol=1e-5, rtol=1e-5)
            us = graph_us(
                lambda o=o, s=s, b=blocks, c=chunk, w=warps: launch(
                    part_out, part_lse, o, s, splits, b, c, w
                )
            )
            row = {"t": t, "h": h, "splits": splits, "blocks": blocks, "chunk": chunk}
            now = (blocks, chunk) == merge_blocks(t * h, lat, splits, sms) and warps == 4
            row |= {"warps": warps, "rule": (blocks, chunk, warps) == (base, min(splits, 16), 4)}
            row |= {"now": now}
            print(json.dumps(row | {"us": round(us, 2), "GB/s": round(gbytes / us, 1)}), flush=True)


if __name__ == "__main__":
    main()
