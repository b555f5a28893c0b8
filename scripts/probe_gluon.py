"""The Gluon 64-row decode kernel against our Triton kernel and raw FlashMLA, same inputs, same
run: time per call and the largest |difference| of out and LSE to the Triton kernel.

python3 scripts/probe_gluon.py OUT_DIR      (GPU, SM90; writes probe-gluon.json)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from mla_backends.bench.fixtures import decode_setup, traffic
from mla_backends.bench.peers import time_flashmla
from mla_backends.bench.timing import bench_us
from scripts.sweep_triton import decode_call

# (heads, q_len, batch, kv): [(block_m, block_n, warps, stages, splits, tma, gluon)]
OLD, GLUON = (64, 64, 8, 2, 1, True, False), (64, 64, 8, 2, 1, True, True)
SHAPES = {
    (128, 1, 64, 4096): [OLD, GLUON],
    (128, 1, 128, 8192): [OLD, GLUON],
    (128, 2, 64, 4096): [OLD, GLUON],
    (128, 1, 256, 1024): [OLD, GLUON],
    (128, 1, 16, 4096): [GLUON, (64, 64, 8, 2, 2, True, True), (64, 64, 8, 2, 4, True, True)],
    (16, 2, 128, 8192): [(32, 64, 4, 2, 2, False, False), GLUON],
}


def main(out_dir: Path) -> None:
    rows = []
    for (heads, q_len, batch, kv), cfgs in SHAPES.items():
        s = decode_setup("triton", heads, q_len, batch, kv)
        s.rt.backend.init_forward_metadata(s.batch)
        nbytes, flops = traffic(s)
        fm = time_flashmla(s)
        # the reference: the gather kernel as it ran before TMA tiles and Gluon
        ref_call, ref_out, ref_lse = decode_call(
            s,
            64 if heads * q_len > 32 else 16,
            64,
            8 if heads * q_len > 32 else 4,
            2,
            1,
            False,
            False,
        )
        ref_call()
        for cfg in cfgs:
            call, o, lse = decode_call(s, *cfg)
            try:
                call()
                torch.cuda.synchronize()
                us = bench_us(call, 10, 40)
            except Exception as e:  # out of resources, launch failure
                print(f"H{heads} q{q_len} B{batch} {cfg}: {type(e).__name__} {str(e)[:300]}")
                rows.append(
                    dict(heads=heads, q_len=q_len, batch=batch, kv=kv, cfg=cfg, error=str(e)[:300])
                )
                continue
            row = dict(
                heads=heads,
                q_len=q_len,
                batch=batch,
                kv=kv,
                cfg=cfg,
                us=us,
                flashmla_us=fm,
                ratio=fm / us,
                gbps=nbytes / us / 1e3,
                tflops=flops / us / 1e6,
                out_diff=(o.float() - ref_out.float()).abs().max().item(),
                lse_diff=(lse - ref_lse).abs().max().item(),
                nan=bool(torch.isnan(o).any().item()),
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
        del s
        torch.cuda.empty_cache()
    (out_dir / "probe-gluon.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp"))
