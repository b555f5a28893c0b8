"""Does sgl_kernel's dense FP8 FlashMLA kernel run at all on this GPU, outside our backend?

python3 scripts/probe_flashmla_fp8.py          (GPU only; one subprocess per case, since an
illegal memory access poisons the CUDA context). Fresh contiguous tensors, identity page
table, unit descales, compared with the bf16 kernel on the dequantized inputs.
"""

from __future__ import annotations

import json
import subprocess
import sys

CASES = [  # heads, q_len, batch, pages per request, causal, first request's length (or None)
    (128, 1, 2, 4, False, None),
    (64, 1, 2, 4, False, None),
    (16, 1, 2, 4, False, None),
    (128, 1, 1, 1, False, None),
    (128, 2, 2, 4, True, None),
    # mixed lengths: a request with no keys (expected to fault: vLLM PR 35969), then one key
    (128, 1, 2, 4, False, 0),
    (16, 2, 2, 4, True, 0),
    (128, 1, 2, 4, False, 1),
    (16, 2, 2, 4, True, 2),
]


def one(
    heads: int, q_len: int, batch: int, pages: int, causal: bool, first: int | None = None
) -> dict:
    import torch
    from sgl_kernel.flash_mla import flash_mla_with_kvcache, get_mla_metadata

    dev = "cuda"
    torch.manual_seed(0)
    kv = (torch.randn(batch * pages, 64, 1, 576, device=dev) / 4).to(torch.float8_e4m3fn)
    table = torch.arange(batch * pages, dtype=torch.int32, device=dev).view(batch, pages)
    seq = torch.full((batch,), pages * 64 - 5, dtype=torch.int32, device=dev)
    if first is not None:
        seq[0] = first
    q = (torch.randn(batch, q_len, heads, 576, device=dev) / 4).to(torch.float8_e4m3fn)
    one_ = torch.ones(1, device=dev)
    scale = 576**-0.5
    tile, splits = get_mla_metadata(seq, q_len * heads, 1, is_fp8_kvcache=True)
    out, lse = flash_mla_with_kvcache(
        q, kv, table, seq, 512, tile, splits, scale, causal, descale_q=one_, descale_k=one_
    )
    torch.cuda.synchronize()
    tile_b, splits_b = get_mla_metadata(seq, q_len * heads, 1)
    ref, ref_lse = flash_mla_with_kvcache(
        q.to(torch.bfloat16),
        kv.to(torch.bfloat16),
        table,
        seq,
        512,
        tile_b,
        splits_b,
        scale,
        causal,
    )
    torch.cuda.synchronize()
    keep = slice(1, None) if first == 0 else slice(None)  # an empty request has no answer
    return {
        "out_max_err": float((out[keep].float() - ref[keep].float()).abs().max()),
        "lse_max_err": float((lse[keep] - ref_lse[keep]).abs().max()),
    }


BACKEND = [  # through our backend (FP8 allowed for the probe): variant, heads, q_len, batch, kv
    ("as-is", 16, 1, 4, 512),
    ("contiguous-kcache", 16, 1, 4, 512),
    ("unit-descales", 16, 1, 4, 512),
    ("as-is", 128, 1, 4, 512),
]


def via_backend(variant: str, heads: int, q_len: int, batch: int, kv: int) -> dict:
    import torch

    from mla_backends.backends.flashmla import FlashMLABackend
    from mla_backends.benchmark import decode_setup

    FlashMLABackend.kv_dtypes = ("bfloat16", "float16", "float8_e4m3fn")
    s = decode_setup("flashmla", heads, q_len, batch, kv, kv_dtype="float8_e4m3fn")
    be = s.rt.backend
    be.init_forward_metadata(s.batch)
    if variant != "as-is":
        fm = be._fm
        real = fm.flash_mla_with_kvcache

        def patched(q, k, *args, **kw):  # type: ignore[no-untyped-def]
            if variant == "contiguous-kcache":
                k = k.contiguous()
            if variant == "unit-descales":
                kw["descale_q"] = torch.ones(1, device=q.device)
                kw["descale_k"] = torch.ones(1, device=q.device)
            print("q", q.shape, q.stride(), q.dtype, "k", k.shape, k.stride(), k.dtype)
            print("table", args[0].shape, args[0].stride(), "seq", args[1].tolist()[:4])
            print(
                {k_: (v.shape, v.dtype, v.stride()) for k_, v in kw.items() if hasattr(v, "shape")}
            )
            return real(q, k, *args, **kw)

        fm.flash_mla_with_kvcache = patched
    out = be.forward_absorbed(0, s.q_nope, s.q_rope, None, None, s.batch, return_lse=True)
    torch.cuda.synchronize()
    return {"ok": True, "out_abs_mean": float(out[0].float().abs().mean())}


def p_in_fp8(heads: int = 16, q_len: int = 3, kv_len: int = 3) -> dict:
    """Is the FP8 kernel's error on short contexts its P @ V in FP8? Compares the kernel with
    an fp64 reference, and with the same reference with P = exp(s - max) rounded to e4m3."""
    import torch
    from sgl_kernel.flash_mla import flash_mla_with_kvcache, get_mla_metadata

    dev = "cuda"
    torch.manual_seed(1)
    pages = -(-kv_len // 64)
    kv8 = (torch.randn(pages, 64, 1, 576, device=dev) * 2).to(torch.float8_e4m3fn)
    q8 = (torch.randn(1, q_len, heads, 576, device=dev) * 2).to(torch.float8_e4m3fn)
    table = torch.arange(pages, dtype=torch.int32, device=dev)[None]
    seq = torch.full((1,), kv_len, dtype=torch.int32, device=dev)
    one_ = torch.ones(1, device=dev)
    scale = 576**-0.5
    tile, splits = get_mla_metadata(seq, q_len * heads, 1, is_fp8_kvcache=True)
    out, _ = flash_mla_with_kvcache(
        q8, kv8, table, seq, 512, tile, splits, scale, True, descale_q=one_, descale_k=one_
    )
    q = q8[0].double().reshape(q_len * heads, 576)
    k = kv8[:, :, 0].reshape(-1, 576)[:kv_len].double()
    s_ = q @ k.T * scale
    vis = kv_len - q_len + 1 + torch.arange(q_len, device=dev).repeat_interleave(heads)
    s_ = s_.masked_fill(torch.arange(kv_len, device=dev)[None, :] >= vis[:, None], float("-inf"))
    p = torch.exp(s_ - s_.amax(1, keepdim=True))
    ref = (p @ k[:, :512]) / p.sum(1, keepdim=True)
    p8 = p.to(torch.float8_e4m3fn).double()
    sim = (p8 @ k[:, :512]) / p.sum(1, keepdim=True)
    got = out[0].double().reshape(q_len * heads, 512)
    return {
        "kernel_vs_exact_max_err": float((got - ref).abs().max()),
        "kernel_vs_p_in_e4m3_max_err": float((got - sim).abs().max()),
        "p_in_e4m3_vs_exact_max_err": float((sim - ref).abs().max()),
    }


def main() -> None:
    if sys.argv[1:] == ["--p-fp8"]:
        for args in ((16, 3, 3), (128, 3, 3), (16, 1, 2), (16, 1, 64), (128, 1, 1100)):
            print(args, json.dumps(p_in_fp8(*args)))
        return
    if len(sys.argv) > 2:
        print(json.dumps(via_backend(*json.loads(sys.argv[2]))))
        return
    if len(sys.argv) > 1:
        print(json.dumps(one(*json.loads(sys.argv[1]))))
        return
    for case in BACKEND:
        p = subprocess.run(
            [sys.executable, __file__, "-", json.dumps(case)], capture_output=True, text=True
        )
        err = [x for x in p.stderr.splitlines() if "Error" in x or "error" in x][-1:]
        print(f"backend {case}: rc {p.returncode} {p.stdout.strip()[-600:]} {err}")
    for case in CASES:
        p = subprocess.run(
            [sys.executable, __file__, json.dumps(case)], capture_output=True, text=True
        )
        last = (p.stdout.strip().splitlines() or [""])[-1]
        err = [x for x in p.stderr.splitlines() if "Error" in x or "error" in x][-1:]
        print(
            f"H{case[0]} q{case[1]} B{case[2]} pages{case[3]} causal={case[4]} "
            f"first_len={case[5]}: "
            f"rc {p.returncode} {last if p.returncode == 0 else err}"
        )


if __name__ == "__main__":
    main()
