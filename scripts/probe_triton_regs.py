"""Why is our Triton decode kernel slow where it is? Registers, spills, shared memory and the
pipelined IR of the compiled kernel, with its time against raw FlashMLA, per launch config.

python3 scripts/probe_triton_regs.py OUT_DIR [small]     (GPU; writes probe.json and the TTGIR / PTX
of the H128 TMA configs as OUT_DIR/<shape>-<config>.ttgir)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

from mla_backends.bench.fixtures import decode_setup, traffic
from mla_backends.bench.peers import time_flashmla
from mla_backends.bench.timing import bench_us
from mla_backends.kernels.mla_attention import _mla_attn_kernel
from scripts.sweep_triton import decode_call

SHAPES = {  # (heads, q_len, batch, kv): (block_m, block_n, warps, stages, splits, tma)
    (128, 1, 64, 4096): [
        (64, 64, 8, 3, 1, False),
        (64, 64, 8, 2, 1, True),
        (64, 32, 8, 3, 1, True),
        (64, 32, 8, 4, 1, True),
    ],
    (128, 2, 64, 4096): [
        (64, 64, 8, 3, 1, False),
        (64, 64, 8, 2, 1, True),
        (64, 32, 8, 4, 1, True),
    ],
    (16, 2, 128, 8192): [
        (32, 64, 4, 2, 2, False),
        (32, 64, 4, 2, 2, True),
        (32, 32, 4, 3, 2, True),
        (32, 32, 4, 4, 2, True),
        (32, 64, 4, 3, 2, True),
    ],
    (16, 1, 256, 1024): [
        (16, 64, 4, 3, 2, False),
        (16, 64, 4, 3, 2, True),
        (16, 32, 4, 4, 1, True),
        (16, 64, 4, 2, 1, True),
        (16, 64, 4, 4, 2, True),
    ],
    (16, 1, 64, 4096): [
        (16, 64, 4, 3, 4, False),
        (16, 64, 4, 3, 4, True),
        (16, 64, 4, 4, 4, True),
    ],
}


SMALL = {  # many splits per request: the rows where TMA tiles were slower (2026-11-22)
    (16, 1, 16, 4096): [
        (16, 64, 4, 3, 16, False),
        (16, 32, 4, 4, 16, True),
        (16, 32, 4, 4, 16, False),
        (16, 32, 4, 2, 16, True),
        (16, 32, 4, 4, 4, True),
        (16, 64, 4, 3, 4, False),
    ],
    (16, 1, 1, 4096): [
        (16, 64, 4, 3, 16, False),
        (16, 32, 4, 4, 16, True),
        (16, 32, 4, 4, 16, False),
    ],
}


def compiled_kernels() -> list:  # type: ignore[type-arg]
    dev = torch.cuda.current_device()
    return list(_mla_attn_kernel.device_caches[dev][0].values())


def ir_counts(ttgir: str) -> dict[str, int]:
    pats = {
        "wgmma": r"warp_group_dot ",
        "mma_v2": r"tt\.dot ",
        "async_copy": r"async_copy_global_to_local",
        "local_alloc": r"ttg\.local_alloc",
        "tma": r"async_tma_copy",
    }
    return {k: len(re.findall(p, ttgir)) for k, p in pats.items()}


def main(out: Path, shapes: dict) -> None:  # type: ignore[type-arg]
    rows = []
    for (heads, q_len, batch, kv), cfgs in shapes.items():
        s = decode_setup("triton", heads, q_len, batch, kv)
        s.rt.backend.init_forward_metadata(s.batch)
        nbytes, flops = traffic(s)
        fm = time_flashmla(s)
        for cfg in cfgs:
            before = set(map(id, compiled_kernels()))
            call = decode_call(s, *cfg)[0]
            try:
                us = bench_us(call, 10, 40)
            except Exception as e:  # out of resources
                print(f"H{heads} q{q_len} B{batch} {cfg}: {type(e).__name__} {str(e)[:100]}")
                continue
            new = [k for k in compiled_kernels() if id(k) not in before]
            k = new[0] if new else None
            tag = f"h{heads}q{q_len}b{batch}-" + "-".join(map(str, cfg))
            info: dict = {}
            if k is not None:
                if heads == 128 and cfg[5]:  # the device tool returns few files
                    (out / f"{tag}.ttgir").write_text(k.asm["ttgir"])
                info = dict(
                    n_regs=k.n_regs,
                    n_spills=k.n_spills,
                    shared=k.metadata.shared,
                    **ir_counts(k.asm["ttgir"]),
                )
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
                **info,
            )
            rows.append(row)
            print(json.dumps(row))
        del s
        torch.cuda.empty_cache()
    (out / "probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main(
        Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp"), SMALL if "small" in sys.argv else SHAPES
    )
