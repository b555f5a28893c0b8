"""Compile the indexer's kernels for SM90 offline (no GPU: Triton ships ptxas), as the
indexer launches them at DeepSeek-V3.2's dims (64 index heads of 128, k 2048): q prep, the
logits, the top-k's three launches and its one launch (8-bit digits, and with its 16-bit
middle digit); print one JSON line per kernel:
registers, local memory and stack frame (spills go to either), shared memory. Pointers are
marked aligned and strides multiples of 16, as the JIT specialises them at run time for
DeepSeek-V3.2's shapes. The interpreter, which CI runs these kernels in, never compiles
them: a kernel can pass every CPU test and still fail to build.

python3 scripts/compile_indexer_sm90.py [gluon]

`gluon`: the Gluon logits kernel (`sparse/indexer_gluon.py`) instead, with its wgmma shapes.

Run without TRITON_INTERPRET=1.
"""

from __future__ import annotations

import json

import triton
from triton.compiler import ASTSource

from mla_backends.kernels import offline
from mla_backends.sparse import indexer_kernels as ik
from mla_backends.sparse import topk_fused
from mla_backends.sparse import topk_kernel as tk

SRC = {"Src": ("*fp32", "*i32", "*i32", "i32", "i32", "i32")}  # topk_kernel.row_args
DST = {"Dst": ("*i32", "*i32", "*i64", "i32", "i32")}
CAND = {"Cand": ("*i32", "i32")}
K = 2048
# index K blocks of 64 slots, 128 e4m3 codes and one fp32 scale each (IndexKCache)
CACHE = {"BLK_E": 64 * 132, "BLK_S": 64 * 132 // 4, "SCALE_OFF": 64 * 128 // 4}


def kernels() -> list[tuple[str, object, dict, dict, int]]:
    """(name, kernel, argument types, constexprs, warps) of each launch; "logits_loop" is
    compiled with the register cap it launches with (`indexer_kernels.LOOP_MAXNREG`)."""
    row = {"K": K, "BLOCK": 2048, "HAS_VIS": True}
    prep_sig = {"Q": "*bf16", "W": "*fp32", "Cos": "*bf16", "Sin": "*bf16", "Out": "*fp8e4nv"}
    prep_sig |= {"WOut": "*fp32", "n_rows": "i32", "stride_q_t": "i32", "stride_q_h": "i32"}
    prep_sig |= {"stride_w": "i32", "stride_cs": "i32", "weight_scale": "fp32"}
    prep_sig |= {"Zero": "*i32", "n_zero": "i32"}
    logits_sig = {"Q": "*fp8e4nv", "W": "*fp32", "Data": "*fp8e4nv", "Scale": "*fp32"}
    logits_sig |= {"R2T": "*i32", "Rows": "*i64", "Vis": "*i32", "Out": "*fp32"}
    logits_sig |= {"Counts": "*i32", "width": "i32"}
    logits_sig |= dict.fromkeys(("stride_q_t", "stride_q_h", "stride_w", "stride_r2t"), "i32")
    logits_sig |= {"stride_o": "i32", "stride_c": "i32"}
    dots = {"DOT_F32": False, "DOT_F16": True, "USE_GDC": True}
    return [
        (
            "prep_q",
            ik._prep_q_kernel,
            prep_sig,
            {"HI": 64, "D": 128, "HALF": 32, "BLOCK_R": 16, "QUANT": True, "LOWP_DOT": True}
            | {"EXACT_FP8_ROUND": False, "ZERO_BLOCK": 1024, "USE_GDC": True},
            4,
        ),
        # the looping form counting the keys' first digit for the top-k, as the indexer
        # launches it at batch 1-4 (with the one-launch top-k told `counted`, below)
        *(
            (
                name,
                ik._logits_kernel,
                logits_sig,
                {"HI": 64, "D": 128, "BLOCK_H": 64, "BLOCK_N": 128, **CACHE, **dots}
                | {"PRECISION": "tf32", "LOOP": loop, "COUNT": count},
                4,
            )
            for name, loop, count in (
                ("logits", False, False),
                ("logits_loop", True, False),
                ("logits_loop_count", True, True),
            )
        ),
        ("hist", tk._hist_kernel, SRC, {**row, "P": 1}, 4),
        (
            "split",
            tk._split_kernel,
            {**SRC, **DST, **CAND},
            {**row, "BLOCK_K": K, "CB": tk.RESOLVE_CHUNK},
            8,
        ),
        *(
            (
                name,
                topk_fused._topk_fused_kernel,
                {**SRC, **DST},
                {**row, "BLOCK": 512, "BLOCK_K": K, "SYNC": topk_fused.SYNC, "USE_GDC": True}
                | {"WIDE": wide, "COUNTED": counted},
                8,
            )
            for name, wide, counted in (
                ("fused", False, False),
                ("fused_wide", True, False),
                ("fused_counted", False, True),
                ("fused_wide_counted", True, True),
            )
        ),
    ]


def gluon_usage(heads: int = 64, count: bool = False) -> dict:  # type: ignore[type-arg]
    """The Gluon logits kernel compiled for SM90 at DeepSeek-V3.2's dims (64 heads of 128),
    or with fewer index heads (a 16-wide MMA at 8 heads, as small configs take it); `count`:
    counting its keys for the top-k, as the indexer launches it."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from mla_backends.sparse import indexer_gluon as ig

    fn = ig._logits_gluon_kernel
    sig = {k: v for k, v in kernels()[1][2].items()}
    block_h = max(16, 1 << (heads - 1).bit_length())
    const = {"HI": heads, "D": ig.D, "BLOCK_H": block_h, "BLOCK_N": ig.BLOCK_N, **CACHE}
    const |= {"STAGES": ig.STAGES, "EARLY_KEYS": True, "USE_GDC": True}
    const |= {"COUNT": count}
    ints = tuple(n for n in sig if n.startswith("stride"))
    src = GluonASTSource(
        fn, {**sig, **dict.fromkeys(const, "constexpr")}, const, offline.aligned(fn, sig, ints)
    )
    return offline.usage(offline.compile_sm90(src, num_warps=4))


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["gluon"]:
        for heads in (64, 8):
            print(json.dumps({"kernel": f"logits_gluon_h{heads}", **gluon_usage(heads)}))
        print(json.dumps({"kernel": "logits_gluon_h64_count", **gluon_usage(64, True)}))
        raise SystemExit(0)
    for name, fn, sig, const, warps in kernels():
        src = ASTSource(
            fn=fn,
            signature={**sig, **dict.fromkeys(const, "constexpr")},
            constexprs=const,
            attrs=offline.aligned(fn, sig, tuple(n for n in sig if n.startswith("stride"))),
        )
        cap = {"maxnreg": ik.LOOP_MAXNREG} if name.startswith("logits_loop") else {}
        opts = {"num_warps": warps, "num_stages": 3, **cap}
        use = offline.usage(triton.compile(src, target=offline.SM90, options=opts))
        print(
            json.dumps({"kernel": name, **{k: use[k] for k in ("reg", "local", "stack", "shared")}})
        )
