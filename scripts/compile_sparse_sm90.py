"""Compile the `triton` sparse MLA kernel for SM90 offline (no GPU: Triton ships ptxas) at
each launch configuration of `sparse/triton_backend.py`'s LAUNCH table (DeepSeek-V3.2 dims:
latent 512, rope 64, top-k 2048; H16 and H128, bf16 rows and 656-byte FP8 rows) and print
one JSON line each: registers, local memory and stack frame (spills go to either), shared
memory. Pointers are marked aligned and strides multiples of 16, as the JIT specialises
them at run time for these shapes.

python3 scripts/compile_sparse_sm90.py [gluon | gluon-fp8]

`gluon` / `gluon-fp8`: the Gluon sparse kernel (`sparse/gluon_kernel.py`, SM90) at H128,
bf16 rows, or its FP8-row form (`sparse/gluon_fp8row.py`), instead: one JSON line with its
wgmma shapes too.

Run without TRITON_INTERPRET=1.
"""

from __future__ import annotations

import json

import triton
from triton.compiler import ASTSource

from mla_backends.kernels import offline
from mla_backends.sparse import triton_kernel as sk
from mla_backends.sparse.fp8_row import TILE, Fp8RowFormat
from mla_backends.sparse.triton_backend import LAUNCH

INTS = ("stride_qn_t", "stride_qn_h", "stride_qr_t", "stride_qr_h", "stride_kv", "stride_idx")
INTS += ("stride_o_t", "stride_o_h", "stride_lse_t", "topk")


def signature(fp8: bool) -> dict[str, str]:
    kv = "*u8" if fp8 else "*bf16"
    sig = {"QNope": "*bf16", "QRope": "*bf16", "KV": kv, "KV8": "*fp8e4nv" if fp8 else kv}
    sig |= {"KVS": "*fp32" if fp8 else kv, "KVR": "*bf16", "Idx": "*i32", "Out": "*bf16"}
    sig |= {"Lse": "*fp32", "PartOut": "*fp32", "PartLse": "*fp32", "Sync": "*i32"}
    sig |= dict.fromkeys(INTS, "i32") | {"qk_scale_log2": "fp32", "out_scale": "fp32"}
    return sig


def rows(fp8: bool) -> dict[str, int]:
    """The FP8 row constexprs `triton_kernel.sparse_mla` passes (zeros for bf16 rows)."""
    if not fp8:
        return dict(ROW_E8=0, ROW_S=0, S_OFF=0, ROW_B=0, R_OFF=0)
    f = Fp8RowFormat()
    return dict(
        ROW_E8=f.row_bytes,
        ROW_S=f.row_bytes // 4,
        S_OFF=f.scale_offset // 4,
        ROW_B=f.row_bytes // 2,
        R_OFF=f.rope_offset // 2,
    )


def gluon_usage(num_splits: int = 2, fp8: bool = False) -> dict:  # type: ignore[type-arg]
    """A Gluon sparse kernel compiled for SM90 at H128, top-k 2048: bf16 rows
    (`gluon_kernel`) or the 656-byte FP8 rows (`gluon_fp8row`)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from mla_backends.sparse import gluon_fp8row as gf
    from mla_backends.sparse import gluon_kernel as gk

    q = ("*bf16", "*bf16", "i32", "i32", "i32", "i32")
    dest = ("*bf16", "*fp32", "*fp32", "*fp32", "i32", "i32", "i32")
    const = dict(H=128, L=512, R=64, BLOCK_M=gk.BLOCK_M, BLOCK_N=gk.BLOCK_N)
    const |= dict(NUM_SPLITS=num_splits, STAGES=gk.STAGES, USE_GDC=True)
    if fp8:
        fn = gf._sparse_fp8row_kernel
        sig = {"Q": q, "Rows": ("*fp8e4nv", "*fp32", "*bf16"), "Idx": "*i32"}
        ints: tuple[str, ...] = ("stride_idx", "topk")
        const |= {k.upper(): v for k, v in rows(True).items()} | {"CH": gf.CH}
    else:
        fn = gk._sparse_gluon_kernel
        sig = {"Q": q, "KV": "*bf16", "stride_kv": "i32", "Idx": "*i32"}
        ints = ("stride_kv", "stride_idx", "topk")
    sig |= {"stride_idx": "i32", "topk": "i32", "Dest": dest, "qk_scale_log2": "fp32"}
    src = GluonASTSource(
        fn, {**sig, **dict.fromkeys(const, "constexpr")}, const, offline.aligned(fn, sig, ints)
    )
    return offline.usage(offline.compile_sm90(src, num_warps=8))


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["gluon"]:
        print(json.dumps({"launch": "gluon H128 bf16 64x64", **gluon_usage()}))
        raise SystemExit(0)
    if sys.argv[1:] == ["gluon-fp8"]:
        print(json.dumps({"launch": "gluon H128 fp8 rows 64x64", **gluon_usage(fp8=True)}))
        raise SystemExit(0)
    fn = sk._sparse_mla_kernel
    # each launch of the table, and the H16 bf16 one merging its own 32 splits (batch 2-4)
    variants = [(key, cfg, False) for key, cfg in LAUNCH.items()]
    variants.append(((16, False), LAUNCH[(16, False)], True))
    for (block, fp8), cfg, merge in variants:
        heads = 16 if block == 16 else 128
        sig = signature(fp8)
        const = dict(H=heads, L=512, R=64, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"])
        const |= dict(NUM_SPLITS=32 if merge else 2, FP8_ROW=fp8, TILE_C=TILE, DOT_F32=False)
        const |= dict(PRECISION="tf32", MERGE_HERE=merge, USE_GDC=True, **rows(fp8))
        src = ASTSource(
            fn=fn,
            signature={**sig, **dict.fromkeys(const, "constexpr")},
            constexprs=const,
            attrs=offline.aligned(fn, sig, INTS),
        )
        opts = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
        use = offline.usage(triton.compile(src, target=offline.SM90, options=opts))
        name = f"H{heads} {'fp8 rows' if fp8 else 'bf16'} {cfg['block_m']}x{cfg['block_n']}"
        name += " merged here" if merge else ""
        out = {k: use[k] for k in ("reg", "local", "stack", "shared")}
        print(json.dumps({"launch": name, "warps": cfg["num_warps"], **out}))
