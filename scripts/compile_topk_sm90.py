"""Compile the indexer's top-k kernels for SM90 offline (no GPU: Triton ships ptxas), as the
top-k launches them at k 2048, and print one JSON line per kernel: registers, local memory and
stack frame (spills go to either), shared memory. The interpreter, which CI runs the top-k
in, never compiles them: a kernel can pass every CPU test and still fail to build.

python3 scripts/compile_topk_sm90.py

Run without TRITON_INTERPRET=1.
"""

from __future__ import annotations

import json

from triton.compiler import ASTSource

from mla_backends.kernels import offline
from mla_backends.sparse import topk_fused
from mla_backends.sparse import topk_kernel as tk

SRC = {"Src": ("*fp32", "*i32", "*i32", "i32", "i32", "i32")}  # topk_kernel.row_args
DST = {"Dst": ("*i32", "*i32", "*i64", "i32", "i32")}
CAND = {"Cand": ("*i32", "i32")}
K = 2048


def kernels() -> list[tuple[str, object, dict, dict, int]]:
    """(name, kernel, argument types, constexprs, warps) of each launch."""
    row = {"K": K, "BLOCK": 2048, "HAS_VIS": True}
    return [
        ("hist", tk._hist_kernel, SRC, {**row, "P": 1}, 4),
        ("split", tk._split_kernel, {**SRC, **DST, **CAND}, {**row, "BLOCK_K": K}, 8),
        ("resolve", tk._resolve_kernel, {**SRC, **DST, **CAND}, {"K": K, "CB": 1024}, 4),
        (
            "fused",
            topk_fused._topk_fused_kernel,
            {**SRC, **DST},
            {**row, "BLOCK": 512, "BLOCK_K": K, "SYNC": topk_fused.SYNC, "USE_GDC": True},
            8,
        ),
    ]


if __name__ == "__main__":
    for name, fn, sig, const, warps in kernels():
        src = ASTSource(
            fn=fn, signature={**sig, **dict.fromkeys(const, "constexpr")}, constexprs=const
        )
        use = offline.usage(offline.compile_sm90(src, warps))
        print(
            json.dumps({"kernel": name, **{k: use[k] for k in ("reg", "local", "stack", "shared")}})
        )
