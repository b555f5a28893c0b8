"""Compile our Triton / Gluon kernels for SM90 without a GPU (Triton ships ptxas) and read
what the compiled kernel uses: registers, spills, shared memory, MMA shapes. Used by
scripts/compile_gluon_sm90.py and scripts/compile_triton_sm90.py, whose tests keep the
kernels inside an H100's limits on CPU-only machines.

Run without TRITON_INTERPRET=1: under the interpreter jit functions are not compiled.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget

SM90 = GPUTarget("cuda", 90, 32)


def compile_sm90(src: Any, num_warps: int, num_stages: int = 3, maxnreg: int | None = None) -> Any:
    """triton.compile of an ASTSource (or GluonASTSource) for SM90; `maxnreg`: the register
    cap a launch passes, if any."""
    options: dict[str, Any] = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=SM90, options=options)


def aligned(
    fn: Any, signature: dict[str, Any], ints: tuple[str, ...] = ()
) -> dict[tuple[int, ...], list[list[Any]]]:
    """The `attrs` of an ASTSource / GluonASTSource that mark every pointer argument (also
    inside tuple arguments) 16-byte aligned, as the JIT specialises them at run time for
    torch's allocations, and the integer arguments named in `ints` multiples of 16 (as it
    does for such values: strides of rows of 64 or 128 elements). Without them a compile
    assumes unaligned pointers: byte-wide loads and other register counts than the kernel
    that runs (the indexer's logits kernel with q as the MMA's rows: 254 registers
    unaligned, 146-168 aligned)."""
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for name, ty in signature.items():
        i = fn.arg_names.index(name)
        parts = ty if isinstance(ty, tuple) else (ty,)
        for j, part in enumerate(parts):
            if isinstance(part, str) and (part.startswith("*") or name in ints):
                attrs[(i, j) if isinstance(ty, tuple) else (i,)] = [["tt.divisibility", 16]]
    return attrs


def usage(kernel: Any) -> dict[str, Any]:
    """Registers, stack frame and local memory (ptxas spills go to either) per thread, shared
    memory per block in bytes, the spill loads and stores in the SASS (`ldl`, `stl`: the
    stack size alone hid one ptxas spilling three times as often into the same 304 bytes,
    BENCHMARKS.md, forty-fourth session), and the MMA instruction shapes in the PTX."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(kernel.asm["cubin"])
        text, sass = (
            subprocess.run(
                [str(tool), flag, str(path)], capture_output=True, text=True, check=True
            ).stdout
            for flag in ("--dump-resource-usage", "--dump-sass")
        )
    res: dict[str, Any] = {
        k.lower(): int(v) for k, v in re.findall(r"(REG|LOCAL|STACK):(\d+)", text)
    }
    res["ldl"], res["stl"] = (
        len(re.findall(rf"\b{op}(?:\.\w+)*\s", sass)) for op in ("LDL", "STL")
    )
    ptx = kernel.asm["ptx"]
    res["wgmma"] = sorted(
        set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.", ptx))
    )
    res["mma"] = sorted(set(re.findall(r"\bmma\.sync\.aligned\.(m\d+n\d+k\d+)\.", ptx)))
    res["shared"] = kernel.metadata.shared
    return res


def decode_signature(dtype: str, k_desc: str, kr_desc: str) -> dict[str, Any]:
    """The typed signature of the decode kernels' leading arguments (`mla_attention.
    decode_args`) for a `dtype` ("bf16", "fp16", "fp32") latent pool and query; `k_desc` /
    `kr_desc` are the descriptor types (or the pointer type where TMA is off)."""
    return {
        "Q": (f"*{dtype}", f"*{dtype}", "i32", "i32", "i32", "i32"),
        "Pool": (f"*{dtype}", "i32"),
        "KDesc": k_desc,
        "KRDesc": kr_desc,
        "Batch": ("*i32", "i32", "*i32", "*i32"),
        "Dest": (f"*{dtype}", "*fp32", "*fp32", "*fp32", "i32", "i32", "i32"),
    }
