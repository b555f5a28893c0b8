"""Compile the Gluon decode kernel for SM90 offline (no GPU: Triton ships ptxas) and print
what the compiled kernel uses, as JSON: registers, local memory and stack frame (spills go
to either), shared memory, and the wgmma shapes in its PTX.

python3 scripts/compile_gluon_sm90.py [bf16|fp16] \\
    [gluon|gluon_q2|seesaw|seesaw_compute|narrow16|narrow32]

Run without TRITON_INTERPRET=1: under the interpreter the nested @gluon.jit helpers become
interpreted functions the compiler cannot call.
"""

from __future__ import annotations

import json
import sys

import torch
import triton
from triton.experimental.gluon._runtime import GluonASTSource

from mla_backends.kernels import mla_attention_gluon as mg
from mla_backends.kernels import offline


def compile_sm90(dtype: str = "bf16", num_splits: int = 2, kernel: str = "gluon"):  # type: ignore[no-untyped-def]
    """The kernel as the backend launches it at DeepSeek dims (H128, page 64); `kernel`
    "gluon" / "gluon_q2": the 64-row kernel with the launch options of single-token decode
    (a register cap) / of q_len 2 grids (`mla_attention_gluon.launch_options`); "seesaw":
    the warp-specialised prototype (`mla_attention_seesaw`, 4 warps + 4), "seesaw_compute" the
    same with nothing refilled (its `PROBE` 1); "narrow16" /
    "narrow32": the keys-as-rows kernel (`mla_attention_narrow`) for 16 / 32 query rows a
    CTA (H16 / H32)."""
    gl_dt = mg._GL_DTYPES[torch.bfloat16 if dtype == "bf16" else torch.float16]
    k_box = 256 if kernel.startswith("seesaw") else 512  # the prototype loads half-row pieces
    descs = {
        name: f"tensordesc<{dtype}[{mg.BLOCK_N}, {w}],{mg._smem_layout((mg.BLOCK_N, w), gl_dt)!r}>"
        for name, w in (("KDesc", k_box), ("KRDesc", 64))
    }
    sig = offline.decode_signature(dtype, descs["KDesc"], descs["KRDesc"])
    sig["qk_scale_log2"] = "fp32"
    const = dict(H=128, L=512, R=64, PAGE=64, BLOCK_M=mg.BLOCK_M, BLOCK_N=mg.BLOCK_N)
    const.update(NUM_SPLITS=num_splits)
    if kernel.startswith("seesaw"):
        from mla_backends.kernels import mla_attention_seesaw as ms

        # every constexpr given: one left out reaches the partitions as None, not its default
        const.update(PROBE=int(kernel == "seesaw_compute"), Trace=None)
        sig.update({k: "constexpr" for k in const})
        src = GluonASTSource(ms._seesaw_kernel, sig, const, offline.aligned(ms._seesaw_kernel, sig))
        return triton.compile(src, target=offline.SM90, options=ms.EXTRA)
    const.update(STAGES=mg.STAGES)
    kernel_fn, warps = mg._mla_attn_gluon_kernel, 8
    cap = mg.launch_options(2 if kernel == "gluon_q2" else 1).get("maxnreg")
    if kernel.startswith("narrow"):
        from mla_backends.kernels import mla_attention_narrow as mn

        rows = int(kernel[len("narrow") :])
        const.update(H=rows, BLOCK_M=rows, STAGES=mn.EXTRA["STAGES"])
        kernel_fn, warps, cap = mn.KERNEL, mn.EXTRA["num_warps"], None
    sig.update({k: "constexpr" for k in const})
    src = GluonASTSource(kernel_fn, sig, const, offline.aligned(kernel_fn, sig))
    return offline.compile_sm90(src, num_warps=warps, maxnreg=cap)


def usage(dtype: str = "bf16", kernel: str = "gluon") -> dict:  # type: ignore[type-arg]
    return offline.usage(compile_sm90(dtype, kernel=kernel))


if __name__ == "__main__":
    args = sys.argv[1:] + ["bf16", "gluon"][len(sys.argv) - 1 :]
    print(json.dumps(usage(args[0], args[1])))
