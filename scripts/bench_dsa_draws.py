"""DeepSeek-V3.2 decode step against dense decode over many query draws: issue 18's "indexer
plus sparse attention faster than dense" at small batch, where one draw is not enough.

Why: at batch 1 the step's top-k runs one radix pass more or fewer depending on the logits
(~2.5 us of a ~30 us step on an H100), so one random query a point, as `bench_sparse.py`
draws, moves the ratio by ~0.1 (BENCHMARKS.md, eighteenth session). Here every point is
timed over `--draws` fresh draws of the indexer's q and head weights and the attention's q
(same pools, same context): each draw's step (indexer + our `triton` sparse attention in one
captured graph, as a decode graph runs it) and our dense `triton` decode of the same
context, both graph-replayed back to back; then the median, the spread and each draw's
ratio, and how many radix passes the one-launch top-k takes on that draw's logits with
8-bit digits and with its 16-bit middle digit (batch <= 4), and other widths for comparison.

    python3 scripts/bench_dsa_draws.py --contexts 16384,32768 --heads 128,16 --draws 8 --out OUT
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from bench_sparse import decode_batch, dense, ints, start, timed

from mla_backends.config import MLADims
from mla_backends.kernels.common import num_sms
from mla_backends.sparse.base import SparseContext, create_sparse_backend
from mla_backends.sparse.indexer import Indexer, IndexerDims
from mla_backends.sparse.indexer_kernels import index_logits, prepare_q_fused
from mla_backends.sparse.topk_kernel import sortable_keys
from mla_backends.sparse.triton_backend import gluon_here, launch_config

# Digit widths (high to low) of the radix passes: the one-launch top-k's on COUNTS counters
# (8x4) and on wide ones (8+16+8, batches up to 4: `topk_kernel.new_counts`), and others it
# does not run, counted on the same logits to say what they would save.
DIGITS = {
    "8x4": (8, 8, 8, 8),
    "8+16+8": (8, 16, 8),
    "12+12+8": (12, 12, 8),
    "11+11+10": (11, 11, 10),
}


def radix_passes(logits: torch.Tensor, k: int, digits: tuple[int, ...] = DIGITS["8x4"]) -> int:
    """The digit passes a radix select of the k largest runs on one row, stopping once the
    threshold's bucket holds exactly the keys still needed (`topk_fused`'s rule), replayed
    in torch."""
    x = logits[torch.isfinite(logits)].float()
    if x.numel() <= k:
        return 1
    key = sortable_keys(x)
    need, match, shift = k, torch.ones_like(key, dtype=torch.bool), 32
    for p, width in enumerate(digits):
        shift -= width
        digit = (key >> shift) & ((1 << width) - 1)
        hist = torch.bincount(digit[match], minlength=1 << width)
        above = hist.flip(0).cumsum(0).flip(0)  # keys with a digit >= d
        d = int((above >= need).nonzero().max())
        need -= int(above[d] - hist[d])
        if int(hist[d]) == need:
            return p + 1
        match &= digit == d
    return len(digits)


def draw_queries(b: int, h: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """One draw of a decode step's queries: the indexer's q [B, 64, 128] and head weights,
    RoPE cos / sin, the attention's q_nope / q_rope (random, bf16 where the model's are)."""
    q_idx = torch.randn(b, 64, 128, device=dev).bfloat16()
    w = torch.randn(b, 64, device=dev)
    ang = torch.rand(b, 32, device=dev) * 6
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    q = torch.randn(b, h, 576, device=dev).bfloat16()
    return q_idx, w, cos, sin, q[..., :512], q[..., 512:]


def run_point(
    ctx: int, b: int, heads: list[int], draws: int, pools, splits: list[int]
) -> list[dict]:  # type: ignore[no-untyped-def]
    bf16, _, cache, req = pools
    dev = torch.device("cuda")
    batch = decode_batch(req, b, ctx)
    idims = IndexerDims()
    ix = Indexer(idims, cache, req.req_to_token, "triton")
    ix.init_forward_metadata(batch)
    md = ix.metadata
    assert md is not None
    out = []
    for h in heads:
        dims = MLADims(h, 512, 64, 128, 128, 40.0, 1.0)
        sctx = SparseContext(dims, bf16, req, idims.topk, torch.bfloat16)
        be = create_sparse_backend("triton", sctx)
        be.init_forward_metadata(batch)
        cfg = launch_config(h, False, b, idims.topk, num_sms(dev), gluon_here(dev))
        per_draw = []
        for _ in range(draws):
            q_idx, w, cos, sin, qn, qr = draw_queries(b, h, dev)

            def step() -> object:
                slots = ix.select(0, q_idx, w, cos, sin)
                return be.forward_sparse(0, qn, qr, slots, batch)  # noqa: B023

            qp, wp = prepare_q_fused(idims, q_idx, w, cos, sin)
            logits = index_logits(cache, 0, qp, wp, req.req_to_token, md.rows, md.visible, md.width)
            s = timed(step, True)["graph"] * 1e3
            d = dense("triton", batch, qn, qr, bf16, req, dims, True)["graph"] * 1e3
            at_splits = {}
            for n in splits:  # the sparse kernel's KV splits set by hand, the step again
                be.launch = {**cfg, "splits": n}
                at_splits[n] = timed(step, True)["graph"] * 1e3
                be.launch = None
            passes = {
                name: [radix_passes(logits[i], idims.topk, dig) for i in range(b)]
                for name, dig in DIGITS.items()
            }
            per_draw.append({"step_us": s, "dense_us": d, "dense/step": d / s, "passes": passes})
            if splits:
                per_draw[-1]["step_us_at_splits"] = at_splits
        ratios = [x["dense/step"] for x in per_draw]
        row = {
            "context": ctx, "batch": b, "heads": h, "draws": per_draw,
            "step_median_us": statistics.median(x["step_us"] for x in per_draw),
            "dense_median_us": statistics.median(x["dense_us"] for x in per_draw),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }  # fmt: skip
        if splits:
            row["step_median_us_at_splits"] = {
                n: statistics.median(x["step_us_at_splits"][n] for x in per_draw) for n in splits
            }
        out.append(row)
        print(
            f"ctx {ctx} B {b} H {h}: step {row['step_median_us']:.1f} us, dense "
            f"{row['dense_median_us']:.1f} us, dense/step median {row['ratio_median']:.3f} "
            f"(min {row['ratio_min']:.3f}, max {row['ratio_max']:.3f}); per draw "
            + " ".join(f"{x['dense/step']:.2f}/p{max(x['passes']['8x4'])}" for x in per_draw)
            + "; passes at 8+16+8 / 12+12+8: "
            + " ".join(
                f"{max(x['passes']['8+16+8'])}/{max(x['passes']['12+12+8'])}" for x in per_draw
            ),
            flush=True,
        )
        if splits:
            print("  step at KV splits:", row["step_median_us_at_splits"], flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="16384,32768")
    p.add_argument("--batch", default="1")
    p.add_argument("--heads", default="128,16")
    p.add_argument("--draws", type=int, default=8)
    p.add_argument(
        "--splits", default="", help="also the step with the sparse kernel at these KV splits"
    )
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if a.draws < 1:
        raise SystemExit(f"--draws must be >= 1, got {a.draws}")
    contexts, batches, heads, pools, out, meta = start(a, "bench_dsa_draws.py", False)
    splits = ints(a.splits)
    rows: list[dict] = []
    for ctx in contexts:
        for b in batches:
            rows += run_point(ctx, b, heads, a.draws, pools, splits)
            doc = {"meta": meta, "rows": rows}
            (out / "bench_dsa_draws.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
