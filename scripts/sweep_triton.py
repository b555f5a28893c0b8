"""Launch-config sweep for our Triton kernels on the GPU (decode and MHA prefill).

python3 scripts/sweep_triton.py OUT_DIR      (prints a table, writes sweep.json)
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from mla_backends.bench.fixtures import DecodeSetup, decode_setup, traffic
from mla_backends.bench.peers import time_flashmla
from mla_backends.bench.timing import bench_us
from mla_backends.kernels.mha_prefill import mha_prefill
from mla_backends.kernels.mla_attention import mla_attention

DECODE = [
    (16, 1, 64, 4096),
    (16, 1, 128, 8192),
    (16, 2, 128, 8192),
    (128, 1, 64, 4096),
    (128, 1, 128, 8192),
    (128, 2, 64, 4096),
]
CFGS = [  # block_m (None = backend default), block_n, warps, stages
    (None, 32, 4, 2),
    (None, 64, 4, 3),
    (None, 64, 8, 3),
    (None, 32, 8, 3),
    (None, 64, 4, 4),
    (None, 128, 8, 2),
]
SPLITS = [1, 2, 4]


def decode_call(
    s: DecodeSetup,
    bm: int,
    bn: int,
    w: int,
    st: int,
    splits: int,
    tma: bool = True,
    gluon: bool = False,
) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """A no-argument call of our decode kernel on setup `s` with this launch config."""
    be = s.rt.backend
    md = be.metadata
    out = torch.empty_like(s.q_nope)
    lse = torch.empty(s.q_nope.shape[:2], device="cuda", dtype=torch.float32)

    def call() -> None:
        mla_attention(
            s.q_nope,
            s.q_rope,
            s.rt.kv_pool.kv_buffer[0],
            md.table,
            md.qo_indptr,
            s.batch.seq_lens,
            64,
            be.scale,
            1.0,
            md.max_q_len,
            splits,
            out,
            lse,
            None,
            block_m=bm,
            block_n=bn,
            num_warps=w,
            num_stages=st,
            tma=tma,
            gluon=gluon,
        )

    return call, out, lse


def decode_sweep() -> list[dict]:
    rows = []
    for heads, q_len, batch, kv in DECODE:
        s = decode_setup("triton", heads, q_len, batch, kv)
        be = s.rt.backend
        be.init_forward_metadata(s.batch)
        md = be.metadata
        nbytes, flops = traffic(s)
        fm = time_flashmla(s)
        rows_q = q_len * heads
        for bm, bn, w, st in CFGS:
            bm = bm or be._block_m(rows_q, s.q_nope.dtype)
            for splits in SPLITS:
                call = decode_call(s, bm, bn, w, st, splits)[0]
                try:
                    us = bench_us(call, 10, 40)
                except Exception as e:  # out of resources etc.
                    us = float("nan")
                    print("fail", heads, bm, bn, w, st, type(e).__name__, str(e)[:80])
                rows.append(
                    dict(
                        heads=heads,
                        q_len=q_len,
                        batch=batch,
                        kv=kv,
                        bm=bm,
                        bn=bn,
                        warps=w,
                        stages=st,
                        splits=splits,
                        us=us,
                        flashmla_us=fm,
                        default_splits=md.num_splits,
                        gbps=nbytes / us / 1e3,
                        tflops=flops / us / 1e6,
                    )
                )
        best = min(
            (
                r
                for r in rows
                if r["heads"] == heads
                and r["batch"] == batch
                and r["q_len"] == q_len
                and r["us"] == r["us"]
            ),
            key=lambda r: r["us"],
        )
        print(
            f"decode H{heads} q{q_len} B{batch} kv{kv}: flashmla {fm:.1f} us; best {best['us']:.1f}"
            f" us (ratio {fm / best['us']:.2f}) bm{best['bm']} bn{best['bn']} w{best['warps']}"
            f" st{best['stages']} splits{best['splits']} (default splits {md.num_splits})"
        )
        torch.cuda.empty_cache()
    return rows


def prefill_sweep(tokens: int = 8192, heads: int = 128) -> list[dict]:
    import torch.nn.functional as F

    q = torch.randn(tokens, heads, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, heads, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(tokens, heads, 128, device="cuda", dtype=torch.bfloat16)
    ind = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)
    out = torch.empty(tokens, heads, 128, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(tokens, heads, device="cuda", dtype=torch.float32)
    flops = tokens * tokens * heads * 320
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    sdpa = bench_us(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=0.1))
    rows = []
    for bm, bn, w, st in [
        (128, 64, 8, 2),
        (128, 64, 8, 3),
        (128, 128, 8, 2),
        (64, 64, 4, 3),
        (128, 32, 8, 3),
        (64, 128, 8, 2),
        (128, 64, 4, 2),
        (64, 64, 8, 3),
    ]:
        try:
            us = bench_us(
                lambda: mha_prefill(
                    q,
                    k,
                    v,
                    ind,
                    ind,
                    tokens,
                    0.1,
                    True,
                    out,
                    lse,
                    block_m=bm,
                    block_n=bn,
                    num_warps=w,
                    num_stages=st,
                ),
                10,
                50,
            )
        except Exception as e:
            us = float("nan")
            print("fail prefill", bm, bn, w, st, type(e).__name__, str(e)[:80])
        rows.append(
            dict(
                bm=bm,
                bn=bn,
                warps=w,
                stages=st,
                us=us,
                sdpa_us=sdpa,
                tflops=flops / us / 1e6,
                sdpa_tflops=flops / sdpa / 1e6,
            )
        )
        print(
            f"prefill bm{bm} bn{bn} w{w} st{st}: {us:.0f} us {flops / us / 1e6:.0f} TFLOP/s;"
            f" sdpa {sdpa:.0f} us {flops / sdpa / 1e6:.0f} TFLOP/s"
        )
    return rows


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp")
    res = {
        "device": torch.cuda.get_device_name(),
        "decode": decode_sweep(),
        "prefill": prefill_sweep(),
    }
    (out / "sweep.json").write_text(json.dumps(res, indent=1))
