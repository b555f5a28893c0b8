"""Probe for issue 19's prototype (`kernels/mla_attention_seesaw.py`): the same decode call
through the Gluon kernel and the seesaw prototype on one random paged pool (page 64,
shuffled pages, H128, bf16), output and LSE compared, then timed against each other and
raw FlashMLA (CUDA-graph replay, µs). The last shape ends its splits inside a tile.

    python3 scripts/probe_seesaw.py            # H100 / H200; JSON on stdout
    python3 scripts/probe_seesaw.py --compute  # also with nothing refilled (compute only)
    python3 scripts/probe_seesaw.py --trace    # each warpgroup's loop in SM clocks
    python3 scripts/probe_seesaw.py --mblocks  # one of H128's two head blocks against both
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass

import torch

from mla_backends.arith import cdiv
from mla_backends.bench.timing import graph_us
from mla_backends.kernels import mla_attention_gluon as glu
from mla_backends.kernels import mla_attention_seesaw as see
from mla_backends.kernels.mla_attention import _merge

# SEESAW_K_BOX: the prototype's latent TMA box (columns a piece), default its K_BOX
K_BOX = int(os.environ.get("SEESAW_K_BOX", see.K_BOX))
KERNELS = {"gluon": (None, None, None), "seesaw": (see.KERNEL, see.EXTRA, K_BOX)}
# --compute: also the prototype with nothing refilled (the two first tiles read again): its
# time is the compute chain alone, without the loads (PROBE 1)
VARIANTS = {"seesaw_compute": (see.KERNEL, {**see.EXTRA, "PROBE": 1}, K_BOX)}
# the last rows: 65 tiles a split, an odd count (warpgroup 0 scores the last tile); two
# splits of 33 tiles and of 31 plus a partial tail of 4 keys
SHAPES = [
    (64, 4096, 1),
    (128, 8192, 1),
    (256, 1024, 1),
    (16, 32768, 4),
    (64, 16384, 1),
    (32, 4160, 1),
    (48, 4100, 2),
]


@dataclass
class Setup:
    """One random decode batch: H128 queries over a paged bf16 pool (page 64, shuffled)."""

    pool: torch.Tensor
    table: torch.Tensor
    qn: torch.Tensor
    qr: torch.Tensor
    qo: torch.Tensor
    lens: torch.Tensor


def paged_setup(b: int, kv: int, seed: int, h: int = 128, page: int = 64) -> Setup:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    n_pages = b * cdiv(kv, page) + 1
    return Setup(
        torch.randn(n_pages * page, 576, generator=g, device=dev).bfloat16(),
        (torch.randperm(n_pages - 1, generator=g, device=dev) + 1).int().view(b, -1),
        torch.randn(b, h, 512, generator=g, device=dev).bfloat16(),
        torch.randn(b, h, 64, generator=g, device=dev).bfloat16(),
        torch.arange(b + 1, device=dev, dtype=torch.int32),
        torch.full((b,), kv, device=dev, dtype=torch.int32),
    )


def run_shape(b: int, kv: int, splits: int, compute: bool = False) -> dict[str, float]:
    dev, h, page = torch.device("cuda"), 128, 64
    st = paged_setup(b, kv, b + kv)
    pool, table, qn, qr, qo, lens = st.pool, st.table, st.qn, st.qr, st.qo, st.lens
    scale = 1.0 / math.sqrt(192)
    outs = {}
    kernels = {**KERNELS, **VARIANTS} if compute else KERNELS
    for name, kern in kernels.items():
        # NaN first: a kernel that stores nothing must not pass as one that matched (the
        # allocator hands back the last kernel's freed output)
        out = torch.full((b, h, 512), float("nan"), device=dev, dtype=torch.bfloat16)
        lse = torch.full((b, h), float("nan"), device=dev)
        po = torch.empty(b * h * splits, 512, device=dev)
        pl = torch.empty(b * h * splits, device=dev)

        def call(kern=kern, out=out, lse=lse, po=po, pl=pl) -> None:  # type: ignore[no-untyped-def]
            args = (qn, qr, pool, table, qo, lens, page, scale * math.log2(math.e), 2, splits)
            glu.launch(*args, out, lse, po, pl, *kern)
            _merge(po, pl, out, lse, splits)

        call()
        torch.cuda.synchronize()
        outs[name] = (out.float(), lse.clone(), graph_us(call))
    (o1, l1, t1), (o2, l2, t2) = outs["gluon"], outs["seesaw"]
    res = {
        "gluon_us": t1,
        "seesaw_us": t2,
        "seesaw_speedup": t1 / t2,
        "out_max_abs_diff": float((o1 - o2).abs().nan_to_num(float("inf")).max()),
        "lse_max_abs_diff": float((l1 - l2).abs().nan_to_num(float("inf")).max()),
    }
    for name in VARIANTS if compute else ():
        res[f"{name}_us"] = outs[name][2]
    try:
        from sgl_kernel.flash_mla import flash_mla_with_kvcache, get_mla_metadata

        q = torch.cat([qn, qr], -1).view(b, 1, h, 576)
        kc = pool.view(-1, page, 1, 576)
        tile, nsp = get_mla_metadata(lens, h, 1)

        def fm() -> object:
            return flash_mla_with_kvcache(q, kc, table, lens, 512, tile, nsp, scale, causal=True)

        res["flashmla_us"] = graph_us(fm)
        res["flashmla_over_gluon"] = res["flashmla_us"] / t1
        res["flashmla_over_seesaw"] = res["flashmla_us"] / t2
    except ImportError:
        pass
    return res


def mblocks() -> dict[str, float]:
    """One of H128's two 64-head blocks launched (half the CTAs, the same work a CTA)
    against both: a kernel bound per CTA takes the same time; one bound by HBM or L2
    shared between CTAs takes less with half of them."""
    res = {}
    for b, kv in ((64, 4096), (128, 8192)):
        st = paged_setup(b, kv, 0)
        dev = st.pool.device
        out = torch.empty(b, 128, 512, device=dev, dtype=torch.bfloat16)
        lse = torch.empty(b, 128, device=dev)
        po, pl = torch.empty(1, 512, device=dev), torch.empty(1, device=dev)
        for name, kern in KERNELS.items():
            for mb in (1, 2):
                args = (st.qn, st.qr, st.pool, st.table, st.qo, st.lens, 64, 0.1, mb, 1)
                t = graph_us(lambda k=kern, a=args: glu.launch(*a, out, lse, po, pl, *k))
                res[f"B{b} kv{kv} {name} m_blocks={mb}"] = round(t, 1)
                print(f"B{b} kv{kv} {name} m_blocks={mb}: {t:.1f} us", flush=True)
    return res


# the loop's events (`mla_attention_seesaw._mark`)
EVENTS = (
    "e0 top",
    "e1 S(o) own half issued (landed)",
    "e2 P(p)@V issued",
    "e3 P(p)@V done, refilled",
    "e4 rest of S(o) done",
    "e5 P(o) out",
    "e6 P(o)@V done, refilled",
)


def trace(b: int, kv: int, probe: int) -> dict[str, object]:
    """The prototype's loop traced in SM clocks (`Trace`: the first 4 requests' first head
    block): per warpgroup, the mean clocks from each event to the next over iterations 2-13
    (of `TRACE_ITERS`), and a loop iteration (two tiles). probe 1: nothing refilled (compute
    only)."""
    st = paged_setup(b, kv, 0)
    dev = st.pool.device
    out = torch.empty(b, 128, 512, device=dev, dtype=torch.bfloat16)
    lse = torch.empty(b, 128, device=dev)
    po, pl = torch.empty(1, 512, device=dev), torch.empty(1, device=dev)
    tr = torch.zeros(
        4, 2, int(see.TRACE_ITERS), int(see.TRACE_EVENTS), device=dev, dtype=torch.int64
    )
    extra = {**see.EXTRA, "PROBE": probe, "Trace": tr}
    args = (st.qn, st.qr, st.pool, st.table, st.qo, st.lens, 64, 0.1, 2, 1)
    for _ in range(3):  # warm: the last launch's clocks are read
        glu.launch(*args, out, lse, po, pl, see.KERNEL, extra, K_BOX)
    torch.cuda.synchronize()
    t = tr.cpu().double()
    # iterations 2 .. n - 3 (warm, and each with a next one recorded) and their next ones
    n = int(see.TRACE_ITERS)
    cur, nxt_it = slice(2, n - 2), slice(3, n - 1)
    res: dict[str, object] = {}
    for wg in (0, 1):
        w = t[:, wg, cur]  # [req, iter, event]
        steps = [float((w[:, :, e + 1] - w[:, :, e]).mean()) for e in range(len(EVENTS) - 1)]
        nxt = float((t[:, wg, nxt_it, 0] - w[:, :, -1]).mean())
        period = float((t[:, wg, nxt_it, 0] - w[:, :, 0]).mean())
        res[f"wg{wg}"] = {
            **{f"{EVENTS[e]} -> {EVENTS[e + 1]}": round(steps[e]) for e in range(len(steps))},
            f"{EVENTS[-1]} -> next {EVENTS[0]}": round(nxt),
            "iteration (2 tiles)": round(period),
        }
    # from one warpgroup publishing P to the other's P @ V on it retired (its event 3: WG0's
    # of iteration i + 1 for WG1's P(2i + 1), WG1's of iteration i for WG0's P(2i))
    res["wg1 P out -> wg0 e3"] = round(float((t[:, 0, nxt_it, 3] - t[:, 1, cur, 5]).mean()))
    res["wg0 P out -> wg1 e3"] = round(float((t[:, 1, cur, 3] - t[:, 0, cur, 5]).mean()))
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mblocks", action="store_true", help="one head block against both")
    p.add_argument("--compute", action="store_true", help="also time the compute chain alone")
    p.add_argument("--trace", action="store_true", help="the loop's events in SM clocks")
    p.add_argument("--rows", type=int, default=len(SHAPES), help="only the first N shapes")
    args = p.parse_args()
    if args.rows < 1:
        p.error(f"--rows must be at least 1, got {args.rows}")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.trace:
        for probe in (0, 1):
            r = {"compute_only": probe == 1, **trace(64, 4096, probe)}
            print(json.dumps(r), flush=True)
        return
    if args.mblocks:
        print(json.dumps({"meta": meta, "mblocks": mblocks()}))
        return
    rows = []
    for b, kv, splits in SHAPES[: args.rows]:
        r = {"batch": b, "kv": kv, "splits": splits, **run_shape(b, kv, splits, args.compute)}
        print(json.dumps(r), flush=True)
        rows.append(r)
    print(json.dumps({"meta": meta, "rows": rows}))


if __name__ == "__main__":
    main()
