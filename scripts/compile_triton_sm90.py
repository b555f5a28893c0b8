"""Compile the absorbed decode kernel (`_mla_attn_kernel`) for SM90 offline with the launch
configs the triton backend picks, and print one JSON line per compiled config: the shapes it
serves, registers, spills, shared memory, and the backend's estimate of that shared memory
(`mla_attention.smem_bytes`, which it keeps under the limit).

python3 scripts/compile_triton_sm90.py DTYPE [gluon-off] [heads=16,128] [pages=1,16,64,128]
python3 scripts/compile_triton_sm90.py DTYPE mha     (the MHA prefill kernel, causal and full)

DTYPE is the activation (dot operand) dtype: float32, bfloat16 or float16. Shapes: DeepSeek
dims (L 512, R 64), q_len 1, 2, 4, batch 1 / 64 / 256, 1 / 2 / 16 KV splits. Rows that the
Gluon kernel takes are skipped (scripts/compile_gluon_sm90.py covers it) unless `gluon-off`
asks for the tl.dot kernel that replaces it when it cannot build. Each config is compiled
with NUM_SPLITS=2 (the split-partial store); H and PAGE are compiled as the rows give them.
Run without TRITON_INTERPRET=1.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

Shape = tuple[int, int, int, int, int]  # heads, q_len, page, batch, splits
L, R = 512, 64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TL_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def picks(
    dtype: str, gluon: bool, heads: tuple[int, ...], pages: tuple[int, ...]
) -> dict[str, tuple[dict[str, Any], list[Shape]]]:
    """Distinct (H, page, block_m, config) the backend launches, with the shapes behind each."""
    from mla_backends.kernels.mla_attention import SMEM_SM90
    from mla_backends.kernels.tuning import block_m_for, launch_config

    dt = DTYPES[dtype]
    gluon = gluon and dt != torch.float32  # as `gluon_ok`: bf16 / fp16 pools only
    out: dict[str, tuple[dict[str, Any], list[Shape]]] = {}
    for h in heads:
        for q in (1, 2, 4):
            for page in pages:
                for batch in (1, 64, 256):
                    for splits in (1, 2, 16):
                        bm = block_m_for(q * h, dt, gluon, batch)
                        cfg = launch_config(bm, page, batch, splits, dt, gluon, L + R, SMEM_SM90)
                        if cfg.pop("gluon", False):
                            continue
                        job = {"heads": h, "page": page, "block_m": bm, **cfg}
                        key = json.dumps(job, sort_keys=True)
                        out.setdefault(key, (job, []))[1].append((h, q, page, batch, splits))
    return out


def compile_one(dtype: str, job: dict[str, Any]) -> dict[str, Any]:
    from triton.compiler import ASTSource

    from mla_backends.kernels import offline
    from mla_backends.kernels.mla_attention import _mla_attn_kernel, smem_bytes

    t, bm, bn, tma = TL_DTYPES[dtype], job["block_m"], job["block_n"], job["tma"]
    k_desc = f"tensordesc<{t}[{bn}, {L}]>" if tma else f"*{t}"
    kr_desc = f"tensordesc<{t}[{bn}, {R}]>" if tma else f"*{t}"
    sig = {**offline.decode_signature(t, k_desc, kr_desc), "qk_scale_log2": "fp32"}
    sig["out_scale"] = "fp32"
    const = dict(H=job["heads"], L=L, R=R, PAGE=job["page"], BLOCK_M=bm, BLOCK_N=bn)
    const.update(NUM_SPLITS=2, DOT_F32=False, DOT_F16=False, TMA=tma)
    const.update(PRECISION="ieee" if dtype == "float32" else "tf32")
    sig.update({k: "constexpr" for k in const})
    src = ASTSource(_mla_attn_kernel, sig, const, offline.aligned(_mla_attn_kernel, sig))
    kernel = offline.compile_sm90(src, job["num_warps"], job["num_stages"])
    elem = DTYPES[dtype].itemsize
    estimate = smem_bytes(bm, bn, job["num_stages"], tma, L + R, elem)
    return {**job, **offline.usage(kernel), "estimate": estimate}


def compile_mha(dtype: str, causal: bool) -> dict[str, Any]:
    """`_mha_fwd_kernel` with the backend's config (`mha_config`), DeepSeek dims."""
    from triton.compiler import ASTSource

    from mla_backends.kernels import offline
    from mla_backends.kernels.mha_prefill import _mha_fwd_kernel
    from mla_backends.kernels.tuning import mha_config

    t, cfg = TL_DTYPES[dtype], mha_config(DTYPES[dtype])
    ints = "stride_qt stride_qh stride_kt stride_kh stride_vt stride_vh stride_ot stride_oh"
    sig = {"Q": f"*{t}", "K": f"*{t}", "V": f"*{t}", "QoIndptr": "*i32", "KvIndptr": "*i32"}
    sig.update({"Out": f"*{t}", "Lse": "*fp32", **{n: "i32" for n in ints.split()}})
    sig["qk_scale_log2"] = "fp32"
    const = dict(DQK=192, D1=128, D2=64, DV=128, DV_PAD=128, BLOCK_M=cfg["block_m"])
    const.update(BLOCK_N=cfg["block_n"], CAUSAL=causal, DOT_F32=False)
    const.update(PRECISION="ieee" if dtype == "float32" else "tf32")
    sig.update({k: "constexpr" for k in const})
    src = ASTSource(_mha_fwd_kernel, sig, const, offline.aligned(_mha_fwd_kernel, sig))
    kernel = offline.compile_sm90(src, cfg["num_warps"], cfg["num_stages"])
    return {"kernel": "mha", "causal": causal, **cfg, **offline.usage(kernel)}


def main(argv: list[str]) -> None:
    dtype = argv[0] if argv else "float32"
    if "mha" in argv:
        for causal in (True, False):
            print(json.dumps(compile_mha(dtype, causal)), flush=True)
        return
    opts = dict(a.split("=", 1) for a in argv[1:] if "=" in a)
    heads = tuple(int(x) for x in opts.get("heads", "16,128").split(","))
    pages = tuple(int(x) for x in opts.get("pages", "1,16,64,128").split(","))
    jobs = picks(dtype, "gluon-off" not in argv, heads, pages)
    # Two workers: CI has two cores, and each compile is single-threaded.
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(2, mp_context=ctx) as pool:
        futures = [(pool.submit(compile_one, dtype, job), shapes) for job, shapes in jobs.values()]
        for fut, shapes in futures:
            print(json.dumps({**fut.result(), "shapes": shapes}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
