"""Sparse MLA kernels alone on the same indices: our `tl.dot` sparse kernel
(`triton_kernel.py`), the Gluon sparse kernel (`sparse/gluon_kernel.py`) and raw FlashMLA's
sparse kernel (`flash_mla_sparse_fwd`, bf16 rows, heads padded to 64 below 64), T query tokens
x H heads, top-k random distinct slots of a 128k-row bf16 pool. Each of ours takes the split
count the `triton` sparse backend would give it (`launch_config`: about two waves for `tl.dot`,
one for Gluon). Median µs (`bench_us`, eager) and graph replay (`graph_us`); before timing,
Gluon's out / LSE are compared with the `tl.dot` kernel's (max abs difference printed, a
mismatch fails the run).

    python scripts/bench_sparse_kernels.py --out $OUT/sparse-kernels
    python scripts/bench_sparse_kernels.py --tokens 1,64 --heads 128 --out /tmp/k
    python scripts/bench_sparse_kernels.py --gluon-splits 1,2,4,8,16,32 --tokens 1,4 --out /tmp/s
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from mla_backends.arith import cdiv
from mla_backends.bench.timing import bench_us, graph_us
from mla_backends.kernels.common import num_sms
from mla_backends.sparse import gluon_kernel, triton_kernel
from mla_backends.sparse.triton_backend import launch_config

SLOTS, L, R = 1 << 17, 512, 64


def gluon_splits(heads: int, tokens: int, topk: int, sms: int) -> int:
    """The split count the `triton` sparse backend gives the Gluon kernel (one wave)."""
    return launch_config(heads, False, tokens, topk, sms, gluon=True)["splits"]


def distinct_slots(tokens: int, topk: int, gen: torch.Generator) -> torch.Tensor:
    """[tokens, topk] int32 distinct random slots a token: the top-k of uniform noise, 256
    tokens at a time (a whole [tokens, 128k] noise tensor is 2 GiB at 4096 tokens)."""
    chunks = [256] * (tokens // 256) + ([tokens % 256] if tokens % 256 else [])
    rand = (torch.rand(n, SLOTS, generator=gen, device=gen.device) for n in chunks)
    return torch.cat([r.topk(topk).indices for r in rand]).to(torch.int32)


def one(tokens: int, heads: int, topk: int, graphs: bool, gen: torch.Generator) -> dict:
    dev, sms = torch.device("cuda"), num_sms(torch.device("cuda"))
    kv = torch.randn(SLOTS, L + R, generator=gen, device=dev).bfloat16()
    q = torch.randn(tokens, heads, L + R, generator=gen, device=dev).bfloat16()
    idx = distinct_slots(tokens, topk, gen)
    scale = (L + R) ** -0.5
    qn, qr = q[..., :L], q[..., L:]
    outs = {k: torch.empty(tokens, heads, L, device=dev, dtype=torch.bfloat16) for k in "tg"}
    lses = {k: torch.empty(tokens, heads, device=dev) for k in "tg"}
    cfg = launch_config(heads, False, tokens, topk, sms)
    gs = gluon_splits(heads, tokens, topk, sms)
    fns: dict[str, Callable[[], object]] = {
        "triton": lambda: triton_kernel.sparse_mla(
            qn,
            qr,
            kv,
            idx,
            scale,
            1.0,
            cfg["splits"],
            outs["t"],
            lses["t"],
            block_m=cfg["block_m"],
            block_n=cfg["block_n"],
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        ),  # fmt: skip
        "gluon": lambda: gluon_kernel.sparse_mla(qn, qr, kv, idx, scale, gs, outs["g"], lses["g"]),
    }
    if importlib.util.find_spec("sgl_kernel") is not None:
        from sgl_kernel.flash_mla import flash_mla_sparse_fwd

        hp = 64 if heads <= 64 else 128
        qp = q.new_zeros(tokens, hp, L + R)
        qp[:, :heads] = q
        kpad = cdiv(topk, 128) * 128
        ip = torch.nn.functional.pad(idx, (0, kpad - topk), value=-1).view(tokens, 1, kpad)
        kv3 = kv.view(SLOTS, 1, L + R)
        fns["raw_flashmla"] = lambda: flash_mla_sparse_fwd(qp, kv3, ip, scale, d_v=L)
    fns["triton"](), fns["gluon"]()
    torch.cuda.synchronize()
    d_out = float((outs["g"].float() - outs["t"].float()).abs().max())
    d_lse = float((lses["g"] - lses["t"]).abs().max())
    if not (d_out <= 2e-2 and d_lse <= 1e-3):
        raise SystemExit(f"T {tokens} H {heads}: gluon vs triton out {d_out:.3g} lse {d_lse:.3g}")
    splits = {"triton": cfg["splits"], "gluon": gs}
    row: dict = {"tokens": tokens, "heads": heads, "topk": topk, "splits": splits}
    row["diff"] = {"out": d_out, "lse": d_lse}
    row["eager_us"] = {k: bench_us(f) for k, f in fns.items()}
    if graphs:
        row["graph_us"] = {k: graph_us(f) for k, f in fns.items()}
    return row


def sweep(tokens: int, heads: int, topk: int, splits: list[int], gen: torch.Generator) -> dict:
    """Graph replay of the Gluon kernel at each split count, and the count the rule picks."""
    dev = torch.device("cuda")
    kv = torch.randn(SLOTS, L + R, generator=gen, device=dev).bfloat16()
    q = torch.randn(tokens, heads, L + R, generator=gen, device=dev).bfloat16()
    idx = distinct_slots(tokens, topk, gen)
    out = torch.empty(tokens, heads, L, device=dev, dtype=torch.bfloat16)
    lse = torch.empty(tokens, heads, device=dev)
    qn, qr, scale = q[..., :L], q[..., L:], (L + R) ** -0.5
    us = {
        s: graph_us(partial(gluon_kernel.sparse_mla, qn, qr, kv, idx, scale, s, out, lse))
        for s in splits
    }
    rule = gluon_splits(heads, tokens, topk, num_sms(dev))
    return {"tokens": tokens, "heads": heads, "rule": rule, "graph_us": us}


def table(rows: list[dict], mode: str) -> str:
    head = "| T | H | triton | gluon | raw FlashMLA | gluon / triton | FlashMLA / gluon |"
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        us = r[mode]
        t, g, f = us["triton"], us["gluon"], us.get("raw_flashmla")
        fr = f"{f / g:.2f}" if f else "-"
        fs = f"{f:.1f}" if f else "-"
        lines.append(
            f"| {r['tokens']} | {r['heads']} | {t:.1f} | {g:.1f} | {fs} | {t / g:.2f}x | {fr} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,4,16,64,256,1024,4096")
    p.add_argument("--heads", default="128,64")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--gluon-splits", help="sweep the Gluon kernel's split counts instead")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    if a.gluon_splits:
        counts = [int(x) for x in a.gluon_splits.split(",")]
        for h in (int(x) for x in a.heads.split(",")):
            for t in (int(x) for x in a.tokens.split(",")):
                rows.append(sweep(t, h, a.topk, counts, gen))
                print(json.dumps(rows[-1]), flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))
        return
    for h in (int(x) for x in a.heads.split(",")):
        for t in (int(x) for x in a.tokens.split(",")):
            rows.append(one(t, h, a.topk, not a.no_graphs, gen))
            print(json.dumps(rows[-1]), flush=True)
    text = "\n\n".join(f"{m}:\n" + table(rows, m) for m in ("eager_us", "graph_us") if m in rows[0])
    print(text)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    out.with_suffix(".md").write_text(text + "\n")


if __name__ == "__main__":
    main()
