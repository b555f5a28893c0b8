#!/usr/bin/env python3
"""DeepSeek-V3.2's sparse attention call inside SGLang 0.5.17 on a GPU host, before and after
our plug-in's hook (`mla_backends.integrations.sglang.dsa`, docs/SGLANG_DSA.md).

    source .gpu/activate.sh; source .sgl/activate.sh
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .
    python3 scripts/sglang_dsa_gpu.py OUT [--tokens 1,16,64] [--heads 128,16] [--budget 540]

SGLang's `dsa` backend module imports `deep_gemm` at module level on CUDA (the indexer's
logits); this host has no `deep_gemm`, so a stub module stands in for it, one whose every
attribute raises (the sparse attention call never touches it; a path that did would fail
loudly), with SGLANG_ENABLE_JIT_DEEPGEMM=0 so that SGLang's DeepGEMM wrappers stay off. With
`MLAB_DSA_SPARSE` set (`--choice`: triton, or auto), SGLang's `load_plugins()` finds our
entry point and its HookRegistry replaces (wraps, for auto)
`DeepseekSparseAttnBackend._forward_flashmla_sparse`. For each (tokens, heads): SGLang's own
method (FlashMLA's sparse kernel from sgl_kernel, heads padded to 64 as SGLang does) and the
hooked one on the same inputs (q_all [T, H, 576], a bf16 pool of 32768 rows, 2048 distinct
slots a token, one token with a 300-slot list and a -1 tail), each against an fp64
reference, the hooked one also bit for bit against the call it should have made; then each
call's CUDA-graph replay time. Rows in OUT/dsa.json, a table in OUT/dsa.md, RESULT lines as
scripts/sglang_kit.py prints them.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_kit import Recorder, env_lines, load  # noqa: E402

METHOD = "_forward_flashmla_sparse"
SLOTS, TOPK, LAT, ROPE = 32768, 2048, 512, 64


def stub_deep_gemm(rec: Recorder) -> None:
    """A `deep_gemm` module for SGLang's import where the real one is missing."""
    try:
        import deep_gemm  # noqa: F401
    except ImportError:
        stub = types.ModuleType("deep_gemm")

        def missing(name: str) -> Any:
            # AttributeError: what `hasattr` and `inspect` expect of a module
            raise AttributeError(f"deep_gemm.{name}: deep_gemm is a stub on this host")

        stub.__getattr__ = missing  # type: ignore[attr-defined]
        sys.modules["deep_gemm"] = stub
        # SGLang turns DeepGEMM on wherever `import deep_gemm` succeeds (then imports its
        # submodules): off, as on a host without it
        os.environ["SGLANG_ENABLE_JIT_DEEPGEMM"] = "0"
        rec.say(
            "ENV deep_gemm not installed: a stub module stands in (every attribute raises), "
            "SGLANG_ENABLE_JIT_DEEPGEMM=0"
        )


def inputs(tokens: int, heads: int, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    dev = torch.device("cuda")
    pool = torch.randn(SLOTS, 1, LAT + ROPE, generator=gen).bfloat16().to(dev)
    idx = torch.stack([torch.randperm(SLOTS, generator=gen)[:TOPK] for _ in range(tokens)])
    idx = idx.to(torch.int32)
    if tokens > 1:
        idx[1, 300:] = -1  # a short context: its list ends in -1
    q_all = torch.randn(tokens, heads, LAT + ROPE, generator=gen).bfloat16().to(dev)
    return {"q_all": q_all, "pool": pool, "idx": idx.to(dev), "scale": (LAT + ROPE) ** -0.5}


def reference(x: dict[str, Any]) -> torch.Tensor:
    """fp64 attention of each token over the pool rows its list names (-1: none)."""
    valid = x["idx"] >= 0
    rows = x["pool"][x["idx"].clamp(min=0).long(), 0].double()  # [T, K, L + R]
    s = torch.einsum("thd,tkd->thk", x["q_all"].double(), rows) * x["scale"]
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("thk,tkd->thd", torch.softmax(s, -1), rows[..., :LAT])


def run(rec: Recorder, args: argparse.Namespace, original: Any) -> None:
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

    from mla_backends.bench.timing import graph_us
    from mla_backends.integrations.sglang import dsa
    from mla_backends.testing import TOLERANCES

    hooked = getattr(DeepseekSparseAttnBackend, METHOD)
    if hooked is original:
        raise SystemExit(f"the plug-in did not replace {METHOD} (is {dsa.ENV} set?)")
    rec.say(f"ENV {METHOD} replaced through the entry point: {hooked!r}")
    backend = object.__new__(DeepseekSparseAttnBackend)
    backend.device_sm_major = torch.cuda.get_device_capability()[0]  # read by SGLang's method
    atol, rtol, _ = TOLERANCES["bfloat16"]
    rows: list[dict[str, Any]] = []
    for h in args.heads:
        for t in args.tokens:

            def one(t: int = t, h: int = h) -> dict[str, Any]:
                x = inputs(t, h)
                want = reference(x)
                call = (x["q_all"], x["pool"], LAT, x["idx"], x["scale"], None)
                theirs = original(backend, *call)
                ours = backend._forward_flashmla_sparse(*call)
                assert ours.shape == (t, h, LAT) and ours.dtype == torch.bfloat16
                # the method SGLang calls now is our kernel (auto: above its limit, SGLang's)
                limit = dsa.auto_rows(x["q_all"], x["pool"], LAT)
                ours_here = args.choice == "triton" or t * h <= limit
                want_call = dsa.forward_sparse if ours_here else original
                assert torch.equal(ours, want_call(backend, *call))
                err = {
                    k: float((v.double() - want).abs().max())
                    for k, v in (("ours", ours), ("sglang", theirs))
                }
                torch.testing.assert_close(ours.double(), want, atol=atol, rtol=rtol)
                row = {
                    "tokens": t,
                    "heads": h,
                    "hooked_runs": "ours" if ours_here else "sglang",
                    "ours_us": graph_us(lambda: backend._forward_flashmla_sparse(*call)),
                    "sglang_us": graph_us(lambda: original(backend, *call)),
                    "ours_max_err": err["ours"],
                    "sglang_max_err": err["sglang"],
                    "ours_vs_sglang": float((ours.float() - theirs.float()).abs().max()),
                }
                row["sglang_over_ours"] = row["sglang_us"] / row["ours_us"]
                rows.append(row)
                return {
                    "detail": f"ours {row['ours_us']:.1f} us, SGLang (FlashMLA sparse) "
                    f"{row['sglang_us']:.1f} us ({row['sglang_over_ours']:.2f}x); max err vs "
                    f"fp64 ours {err['ours']:.3g}, SGLang's {err['sglang']:.3g}",
                    **row,
                }

            rec.run(f"dsa sparse t{t} h{h}", one, min_left=30)
    table = [
        "| tokens | H | hooked call runs | hooked (us) | SGLang's call (us) | SGLang / hooked | "
        "max err hooked | max err SGLang | max hooked - SGLang |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    table += [
        f"| {r['tokens']} | {r['heads']} | {r['hooked_runs']} | {r['ours_us']:.1f} | "
        f"{r['sglang_us']:.1f} | "
        f"{r['sglang_over_ours']:.2f} | {r['ours_max_err']:.3g} | {r['sglang_max_err']:.3g} | "
        f"{r['ours_vs_sglang']:.3g} |"
        for r in rows
    ]
    text = (
        f"SGLang's `{METHOD}` (FlashMLA sparse, sgl_kernel) and the method as hooked "
        f"(MLAB_DSA_SPARSE={args.choice}), top-k "
        f"{TOPK} of a {SLOTS}-row bf16 pool, CUDA-graph replay.\n\n" + "\n".join(table) + "\n"
    )
    (args.out / "dsa.md").write_text(text)
    rec.say(text)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out", type=Path)
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    ap.add_argument("--tokens", type=ints, default=[1, 16, 64])
    ap.add_argument("--heads", type=ints, default=[128, 16])
    ap.add_argument("--budget", type=float, default=540.0)
    ap.add_argument("--choice", choices=["triton", "auto"], default="triton")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rec = Recorder("dsa", args.out, args.budget)
    env_lines(rec)
    stub_deep_gemm(rec)
    try:
        import sglprobe_compat  # noqa: F401 - the .sgl bundle's shim, before `import sglang`
    except ImportError:
        pass
    from sglang_cpu.env import load_sglang

    load_sglang()  # the transformers shim and stubs, as `load` applies them (idempotent)
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

    original = getattr(DeepseekSparseAttnBackend, METHOD)  # SGLang's, before the plug-in
    os.environ["MLAB_DSA_SPARSE"] = args.choice
    load(rec)  # the entry point's register() installs the hook; load_plugins applies it
    run(rec, args, original)
    return rec.summary()


if __name__ == "__main__":
    sys.exit(main())
