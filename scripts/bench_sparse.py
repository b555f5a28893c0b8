"""DeepSeek-V3.2 sparse decode (DSA) on one GPU, per layer: the indexer (q prep, paged logits,
top-k, positions -> slots) and sparse attention over its selection, against dense decode of
the same context through our `triton` dense backend, and against raw FlashMLA sparse kernels
on the same indices. Random data; one layer; contexts x batch x heads.

Attention columns (ms per layer, median of `triton.testing.do_bench` after warm-up, eager:
host launch overhead included; `graph` columns: one captured CUDA graph replayed, the GPU
time a decode graph pays):
- triton_bf16 / triton_fp8row: our sparse kernel on the bf16 pool / the 656-byte FP8 rows;
- flashmla_bf16 / flashmla_fp8row: our `flashmla` backend (prefill kernel / FP8 decode
  kernel, heads padded to 64, empty rows masked);
- flashinfer_bf16: our `flashinfer_mla` backend (fa3, page 1);
- raw_flashmla_fp8 / raw_flashmla_bf16: `flash_mla_with_kvcache(is_fp8_kvcache=True,
  indices=...)` / `flash_mla_sparse_fwd` alone, inputs and metadata prepared outside;
- dense_triton / dense_flashmla: our dense `triton` / `flashmla` backend over the whole
  context (bf16 pool).
Our backends get the query as the two column ranges of one [B, H, 576] buffer (what a model
writing both projections into one buffer passes, as the dense bench's fixtures do; the raw
kernels get that buffer joined); `flashmla_*[split_q]` repeats `flashmla` with two separate
tensors, which costs it one concatenation.
Ratios: raw_fp8 / triton_fp8row (>= 0.9 is the target: speed relative to raw FlashMLA),
dense / (indexer + best sparse) for each dense backend, and dense / best step, where a step
is the indexer and a sparse backend's attention captured in one graph (what a decode graph
runs; the sum of two separately timed graphs counts one graph launch more than dense pays).

    python scripts/bench_sparse.py --out $OUT/sparse          # about 6 minutes on an H100
    python scripts/bench_sparse.py --triton-configs --contexts 65536 --out $OUT/sweep
    python scripts/bench_sparse.py --triton-configs 16x64x4x2,16x32x4x3x64 --heads 16 \
        --batch 1 --contexts 16384 --backends triton --no-fp8-rows --out $OUT/h16
    python scripts/bench_sparse.py --contexts 32768 --batch 16 --heads 128 --out /tmp/s
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import torch

from mla_backends.arith import cdiv
from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.bench.timing import bench_us, graph_us
from mla_backends.config import Config, MLADims
from mla_backends.pool import MLATokenToKVPool, ReqToTokenPool
from mla_backends.sparse.base import SparseContext, create_sparse_backend
from mla_backends.sparse.fp8_row import Fp8RowPool, pack_rows
from mla_backends.sparse.indexer import (
    Indexer,
    IndexerDims,
    IndexKCache,
    positions_to_slots,
    prepare_q,
    select_topk,
)
from mla_backends.sparse.indexer_kernels import index_logits, prepare_q_fused
from mla_backends.sparse.topk_kernel import topk_slots

PAGE = 64
CHUNK = 1 << 19  # rows per fill chunk
# (block_m, block_n, warps, stages[, splits]) alternatives for --triton-configs (the default
# launch table is in sparse/triton_backend.py); without splits, the split rule's count.
TRITON_CONFIGS = [(64, 64, 8, 2), (64, 16, 8, 2), (32, 64, 8, 3), (32, 32, 8, 3), (16, 32, 4, 3)]
LAUNCH_KEYS = ("block_m", "block_n", "num_warps", "num_stages", "splits")


def parse_configs(text: str) -> list[tuple[int, ...]]:
    """'16x32x4x3x64,16x64x4x2' -> [(16, 32, 4, 3, 64), (16, 64, 4, 2)]."""
    out = []
    for spec in text.split(","):
        try:
            cfg = tuple(int(x) for x in spec.split("x"))
        except ValueError:
            cfg = ()
        if len(cfg) not in (4, 5) or min(cfg) < 1:
            raise SystemExit(
                f"bench_sparse: bad --triton-configs entry {spec!r} (BMxBNxWxS[xSPLITS])"
            )
        out.append(cfg)
    return out


def timed(fn: Callable[[], object], graphs: bool) -> dict[str, float]:
    out = {"eager": bench_us(fn) / 1000.0}
    if graphs:
        out["graph"] = graph_us(fn) / 1000.0
    return out


def build_pools(max_b: int, max_ctx: int, fp8_rows: bool, seed: int = 0):  # type: ignore[no-untyped-def]
    """bf16 pool (and FP8 rows of the same values), index-K cache, request table: request i
    owns max_ctx tokens on pages in random order."""
    dev = torch.device("cuda")
    torch.manual_seed(seed)
    ppr = cdiv(max_ctx, PAGE)
    pages = max_b * ppr
    bf16 = MLATokenToKVPool(1, pages, PAGE, 512, 64, torch.bfloat16, dev)
    buf = bf16.kv_buffer[0]
    for s in range(0, buf.shape[0], CHUNK):
        buf[s : s + CHUNK].normal_()
    fp8 = None
    if fp8_rows:
        fp8 = Fp8RowPool(1, pages, PAGE, 512, 64, dev)
        for s in range(0, buf.shape[0], CHUNK):
            rows = buf[s : s + CHUNK]
            fp8.kv_buffer[0][s : s + CHUNK] = pack_rows(fp8.fmt, rows[:, :512], rows[:, 512:])
    cache = IndexKCache(1, bf16.num_slots, 128, True, dev)
    data, scale = cache.data_view(cache.buffers[0]), cache.scale_view(cache.buffers[0])
    for s in range(0, data.shape[0], CHUNK // PAGE):
        blk = data[s : s + CHUNK // PAGE]
        blk.copy_(torch.randn(blk.shape, device=dev).mul_(64).to(torch.float8_e4m3fn))
    scale.copy_(torch.exp2(-torch.randint(4, 9, scale.shape, device=dev).float()))
    req = ReqToTokenPool(max_b, max_ctx + 1, dev)
    req.alloc(max_b)  # rows 1..max_b, every position filled below (`decode_batch` says how many)
    order = torch.randperm(pages, device=dev) + 1
    pos = torch.arange(max_ctx, device=dev)
    for i in range(max_b):
        mine = order[i * ppr : (i + 1) * ppr]
        req.req_to_token[i + 1, :max_ctx] = (mine[pos // PAGE] * PAGE + pos % PAGE).int()
    return bf16, fp8, cache, req


def decode_batch(req: ReqToTokenPool, b: int, ctx: int) -> ForwardBatch:
    """One decode token a request for rows 1..b over `build_pools`' table, at context `ctx`.
    The rows hold max_ctx positions; each batch reads the first ctx, so the table is told the
    rows hold ctx tokens (`check_batch` refuses a batch reading fewer than a row stores)."""
    dev = req.device
    rows = list(range(1, b + 1))
    req.filled[rows] = ctx
    loc = req.req_to_token[torch.tensor(rows, device=dev), ctx - 1].long()
    return ForwardBatch.build(ForwardMode.DECODE, rows, [ctx - 1] * b, [1] * b, loc, dev)


def run_one(
    ctx: int,
    b: int,
    heads: list[int],
    topk: int,
    pools,  # type: ignore[no-untyped-def]
    backends: list[str],
    graphs: bool,
    sweep: list[tuple[int, ...]] | None = None,
) -> list[dict]:
    bf16, fp8, cache, req = pools
    dev = torch.device("cuda")
    batch = decode_batch(req, b, ctx)

    idims = IndexerDims(topk=topk)
    ix = Indexer(idims, cache, req.req_to_token, "triton")
    ix.init_forward_metadata(batch)
    q_idx = torch.randn(b, 64, 128, device=dev).bfloat16()
    w = torch.randn(b, 64, device=dev)
    ang = torch.rand(b, 32, device=dev) * 6
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    md = ix.metadata
    qp, wp = prepare_q(idims, q_idx, w, cos, sin)
    logits = index_logits(cache, 0, qp, wp, req.req_to_token, md.rows, md.visible, md.width)
    indexer = {
        "total": timed(lambda: ix.select(0, q_idx, w, cos, sin), graphs),
        "q_prep": timed(lambda: prepare_q_fused(idims, q_idx, w, cos, sin), graphs),
        "q_prep_torch": timed(lambda: prepare_q(idims, q_idx, w, cos, sin), graphs),
        "logits": timed(
            lambda: index_logits(cache, 0, qp, wp, req.req_to_token, md.rows, md.visible, md.width),
            graphs,
        ),
        "logits_triton": timed(
            lambda: index_logits(
                *(cache, 0, qp, wp, req.req_to_token, md.rows, md.visible, md.width),
                kernel="triton",
            ),
            graphs,
        ),
        **{
            f"logits[{bn}]": timed(
                lambda bn=bn: index_logits(
                    cache, 0, qp, wp, req.req_to_token, md.rows, md.visible, md.width, bn
                ),
                graphs,
            )
            for bn in (32, 128, 256)
        },
        # under the engine's CUDA graphs the logits are as wide as the longest context the
        # pool takes (the indexer's graph state): the Triton kernel at one program a block
        # (the programs past a token's keys store -inf) and looping, as a captured graph runs
        # it; the Gluon kernel (its programs always loop) where it runs
        **{
            f"logits_graph_width{tag}": timed(
                lambda loop=loop, kernel=kernel: index_logits(
                    *(cache, 0, qp, wp, req.req_to_token, md.rows, md.visible),
                    req.req_to_token.shape[1],
                    loop=loop,
                    kernel=kernel,
                ),
                graphs,
            )
            for tag, loop, kernel in (
                ("", False, "triton"),
                ("[loop]", True, "triton"),
                ("[auto]", False, "auto"),
            )
        },
        "topk_slots": timed(lambda: topk_slots(logits, topk, req.req_to_token, md.rows), graphs),
        "topk_slots_launches": timed(
            lambda: topk_slots(logits, topk, req.req_to_token, md.rows, path="launches"), graphs
        ),
        "topk_slots_torch": timed(
            lambda: positions_to_slots(select_topk(logits, topk), req.req_to_token, md.rows),
            graphs,
        ),
    }
    # Under the engine's CUDA graphs the logits are as wide as the longest context the pool
    # takes (the indexer's graph state): the top-k over that width, with and without the
    # rows' visible counts (without: what the kernel did before it took them).
    wide = torch.full((b, req.req_to_token.shape[1]), -torch.inf, device=dev)
    wide[:, : logits.shape[1]] = logits
    vis = md.visible
    indexer["topk_graph_width"] = timed(
        lambda: topk_slots(wide, topk, req.req_to_token, md.rows, vis), graphs
    )
    indexer["topk_graph_width_unmasked"] = timed(
        lambda: topk_slots(wide, topk, req.req_to_token, md.rows), graphs
    )

    # The whole indexer as the engine's captured graphs run it: logits as wide as the pool's
    # longest context (looping over each token's visible blocks), the top-k given the
    # visible counts.
    ix.metadata = type(md)(md.rows, md.visible, req.req_to_token.shape[1], [(0, b)], graph=True)
    indexer["total_graph_width"] = timed(lambda: ix.select(0, q_idx, w, cos, sin), graphs)
    ix.metadata = md

    def select() -> torch.Tensor:
        return ix.select(0, q_idx, w, cos, sin)

    slots = select()
    out = []
    for h in heads:
        dims = MLADims(h, 512, 64, 128, 128, 40.0, 1.0)
        q = torch.randn(b, h, 576, device=dev).bfloat16()
        q_nope, q_rope = q[..., :512], q[..., 512:]  # one buffer, as a model writes it
        attn: dict[str, dict[str, float]] = {}
        steps: dict[str, dict[str, float]] = {}
        for name in backends:
            for fmt, pool in (("bf16", bf16), ("fp8row", fp8)):
                if pool is None:
                    continue
                sctx = SparseContext(dims, pool, req, topk, torch.bfloat16)
                try:
                    be = create_sparse_backend(name, sctx)
                except (ValueError, ImportError) as e:
                    print(f"  skip {name}-{fmt}: {e}")
                    continue
                be.init_forward_metadata(batch)
                fn = lambda be=be: be.forward_sparse(0, q_nope, q_rope, slots, batch)  # noqa: E731
                attn[f"{name}_{fmt}"] = timed(fn, graphs)
                if name == "flashmla":  # the same with q_nope / q_rope as two tensors
                    qn, qr = q_nope.contiguous(), q_rope.contiguous()
                    attn[f"{name}_{fmt}[split_q]"] = timed(
                        lambda be=be: be.forward_sparse(0, qn, qr, slots, batch), graphs
                    )
                # The layer's sparse step in one graph, as a decode graph runs it (indexer,
                # then attention): indexer + attention timed apart pays one launch more.
                step = lambda be=be: be.forward_sparse(0, q_nope, q_rope, select(), batch)  # noqa: E731
                steps[f"{name}_{fmt}"] = timed(step, graphs)
                if name == "triton" and sweep:  # launch alternatives, each timed alone
                    for cfg in sweep:
                        be.launch = dict(zip(LAUNCH_KEYS, cfg))
                        tag = "x".join(str(x) for x in cfg)
                        try:
                            attn[f"triton_{fmt}[{tag}]"] = timed(fn, graphs)
                        except Exception as e:  # out of shared memory, say
                            print(f"  triton {fmt} {tag}: {type(e).__name__} {str(e)[:80]}")
                    be.launch = None
                    # the default launch with its splits merged by the merge kernel (batch
                    # 2-4 at H16 merge inside the launch: `triton_kernel.merges_here`)
                    be.merge_here = False
                    attn[f"triton_{fmt}[merge kernel]"] = timed(fn, graphs)
                    steps[f"triton_{fmt}[merge kernel]"] = timed(step, graphs)
                    be.merge_here = True
        if backends:  # --indexer-only: no attention rows, peers included
            attn.update(raw_flashmla(q_nope, q_rope, slots, bf16, fp8, dims, topk, graphs))
            for name in DENSE:
                attn[f"dense_{name}"] = dense(name, batch, q_nope, q_rope, bf16, req, dims, graphs)
        row = {"context": ctx, "batch": b, "heads": h, "topk": topk, "indexer": indexer}
        row["attention"], row["step"] = attn, steps
        out.append(row)
        print(summary(row), flush=True)
    return out


def raw_flashmla(q_nope, q_rope, slots, bf16, fp8, dims, topk, graphs):  # type: ignore[no-untyped-def]
    if importlib.util.find_spec("sgl_kernel") is None:
        return {}
    from sgl_kernel.flash_mla import flash_mla_sparse_fwd, flash_mla_with_kvcache, get_mla_metadata

    b, h, _ = q_nope.shape
    hp = 64 if h <= 64 else 128
    q = q_nope.new_zeros(b, hp, 576)
    q[:, :h, :512], q[:, :h, 512:] = q_nope, q_rope
    res = {}
    kpad = cdiv(topk, 128) * 128
    idx = torch.nn.functional.pad(slots, (0, kpad - topk), value=-1).view(b, 1, kpad)
    kv = bf16.kv_buffer[0].view(-1, 1, 576)
    fn = lambda: flash_mla_sparse_fwd(q, kv, idx, dims.softmax_scale, d_v=512)  # noqa: E731
    res["raw_flashmla_bf16"] = timed(fn, graphs)
    if fp8 is not None:
        seqlens = torch.full((b,), topk, dtype=torch.int32, device=q.device)
        tile, splits = get_mla_metadata(
            cache_seqlens=seqlens,
            num_q_tokens_per_head_k=hp,
            num_heads_k=1,
            num_heads_q=hp,
            is_fp8_kvcache=True,
            topk=topk,
        )
        table = torch.empty(b, 0, dtype=torch.int32, device=q.device)
        kc = fp8.get_paged_buffer(0)
        q4, i4 = q.view(b, 1, hp, 576), slots.view(b, 1, topk)

        def fn8() -> object:
            return flash_mla_with_kvcache(
                q4, kc, table, seqlens, 512, tile, splits, softmax_scale=dims.softmax_scale,
                causal=False, is_fp8_kvcache=True, indices=i4,
            )  # fmt: skip

        res["raw_flashmla_fp8"] = timed(fn8, graphs)
    return res


# Dense decode of the same context through our dense backends (bf16 pool, page 64): `triton`
# (our kernel) and `flashmla` (our backend over FlashMLA, the faster of the two at batch 1).
DENSE = ("triton", "flashmla")


def dense(name, batch, q_nope, q_rope, bf16, req, dims, graphs):  # type: ignore[no-untyped-def]
    from mla_backends.backends.base import BackendContext
    from mla_backends.backends.registry import get_backend_class

    cfg = Config(
        model=dims, num_layers=1, prefill_backend="triton", decode_backend=name,
        page_size=PAGE, kv_dtype="bfloat16", dtype="bfloat16", num_pages=bf16.num_pages,
        max_requests=req.size, max_context_len=req.max_context_len, device="cuda",
    )  # fmt: skip
    be = get_backend_class(name)(BackendContext(cfg, bf16, req))
    be.init_forward_metadata(batch)
    return timed(lambda: be.forward_absorbed(0, q_nope, q_rope, None, None, batch), graphs)


SPARSE_OURS = ("triton_bf16", "triton_fp8row", "flashmla_bf16", "flashmla_fp8row")
SPARSE_OURS += ("flashinfer_mla_bf16",)


def ratios(row: dict, mode: str = "eager") -> dict[str, float | None]:
    a = {k: v.get(mode) for k, v in row["attention"].items()}
    ours = {k: a[k] for k in SPARSE_OURS if a.get(k) is not None}
    best = min(ours.values()) if ours else None
    idx = row["indexer"]["total"].get(mode)
    out: dict[str, float | None] = {"best_sparse": best}
    raw = a.get("raw_flashmla_fp8")
    out["raw_fp8/triton_fp8row"] = (
        raw / a["triton_fp8row"] if raw and a.get("triton_fp8row") else None
    )
    out["raw_fp8/best"] = raw / best if raw and best else None
    steps = [v.get(mode) for k, v in row.get("step", {}).items() if k in SPARSE_OURS]
    step = min((x for x in steps if x is not None), default=None)
    out["best_step"] = step
    for name in DENSE:
        d = a.get(f"dense_{name}")
        out[f"dense_{name}/(indexer+best)"] = d / (idx + best) if d and best and idx else None
        out[f"dense_{name}/step"] = d / step if d and step else None
    return out


def summary(row: dict) -> str:
    a = row["attention"]
    parts = [f"ctx {row['context']:>6} B {row['batch']:>2} H {row['heads']:>3}"]
    parts.append(f"indexer {row['indexer']['total']['eager']:.3f}")
    parts += [  # the indexer and logits alternatives, graph-replayed where timed so
        f"{k} {v.get('graph', v['eager']):.4f}"
        for k, v in row["indexer"].items()
        if k.startswith(("total", "logits"))
    ]
    parts += [f"{k} {v['eager']:.3f}" for k, v in a.items()]
    r = ratios(row)
    parts += [f"{k} {v:.2f}" for k, v in r.items() if v is not None and "/" in k]
    return " | ".join(parts)


def markdown(rows: list[dict], mode: str) -> str:
    cols = ["triton_bf16", "triton_fp8row", "flashmla_bf16", "flashmla_fp8row"]
    cols += ["flashmla_fp8row[split_q]", "flashinfer_mla_bf16", "raw_flashmla_bf16"]
    cols += ["raw_flashmla_fp8"] + [f"dense_{n}" for n in DENSE]
    cols = [c for c in cols if any(c in r["attention"] for r in rows)]
    head = ["context", "B", "H", "indexer", "(q prep", "logits", "topk)"] + cols
    head += ["raw fp8 / triton fp8row", "raw fp8 / best"]
    head += [f"dense {n} / (indexer + best)" for n in DENSE]
    head += ["best step (one graph)"] + [f"dense {n} / step" for n in DENSE]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(x: float | None, p: int = 3) -> str:
        return "-" if x is None else f"{x:.{p}f}"

    for r in rows:
        a, ix, q = r["attention"], r["indexer"], ratios(r, mode)
        cells = [str(r["context"]), str(r["batch"]), str(r["heads"])]
        cells += [
            f(ix["total"].get(mode)),
            f(ix["q_prep"].get(mode)),
            f(ix["logits"].get(mode)),
            f(ix["topk_slots"].get(mode)),
        ]
        cells += [f(a[c].get(mode)) if c in a else "-" for c in cols]
        cells += [f(q["raw_fp8/triton_fp8row"], 2), f(q["raw_fp8/best"], 3)]
        cells += [f(q[f"dense_{n}/(indexer+best)"], 2) for n in DENSE]
        cells += [f(q["best_step"])] + [f(q[f"dense_{n}/step"], 2) for n in DENSE]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_topk(rows: list[dict], mode: str) -> str:
    """Our top-k kernel against torch.topk + the slot mapping, and over a graph's width with
    and without the visible counts; the logits and the whole indexer at the context's width
    and a graph's (ms)."""
    cols = ["topk_slots", "topk_slots_launches", "topk_slots_torch", "topk_graph_width"]
    cols += ["topk_graph_width_unmasked", "logits", "logits_triton", "logits_graph_width"]
    cols += ["logits_graph_width[loop]", "logits_graph_width[auto]", "total"]
    cols += ["total_graph_width"]
    lines = ["| context | B | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 2)]
    seen = set()
    for r in rows:
        if (r["context"], r["batch"]) in seen:  # the indexer does not depend on H
            continue
        seen.add((r["context"], r["batch"]))
        ix = r["indexer"]
        cells = [f"{ix[c][mode]:.3f}" if ix.get(c, {}).get(mode) else "-" for c in cols]
        lines.append(f"| {r['context']} | {r['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def start(a: argparse.Namespace, script: str, fp8_rows: bool):  # type: ignore[no-untyped-def]
    """A run's set-up from its parsed --contexts / --batch / --heads / --out: (contexts,
    batches, heads, `build_pools` for them, the output folder, made, and the run's metadata)."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a CUDA GPU")
    contexts, batches, heads = ints(a.contexts), ints(a.batch), ints(a.heads)
    pools = build_pools(max(batches), max(contexts), fp8_rows)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    return contexts, batches, heads, pools, out, meta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="16384,32768,65536,131072")
    p.add_argument("--batch", default="1,16,64")
    p.add_argument("--heads", default="128,16")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--backends", default="triton,flashmla,flashinfer_mla")
    p.add_argument("--no-fp8-rows", action="store_true", help="skip the 656-byte row pool")
    p.add_argument("--no-graphs", action="store_true", help="eager timings only")
    p.add_argument("--indexer-only", action="store_true", help="time the indexer alone")
    p.add_argument(
        "--triton-configs",
        nargs="?",
        const="default",
        help="also time the Triton launch alternatives: the built-in list, or "
        "BMxBNxWARPSxSTAGES[xSPLITS],...",
    )
    p.add_argument("--out", required=True)
    a = p.parse_args()
    sweep = None
    if a.triton_configs:
        sweep = TRITON_CONFIGS if a.triton_configs == "default" else parse_configs(a.triton_configs)
    contexts, batches, heads, pools, out, meta = start(a, "bench_sparse.py", not a.no_fp8_rows)
    rows = []
    for ctx in contexts:
        for b in batches:
            rows += run_one(
                ctx, b, heads, a.topk, pools,
                [] if a.indexer_only else a.backends.split(","), not a.no_graphs,
                sweep,
            )  # fmt: skip
            # rewritten after each point: a run cut short by a time limit keeps its rows
            doc = {"meta": meta, "rows": rows}
            (out / "bench_sparse.json").write_text(json.dumps(doc, indent=1))
    text = f"# DSA sparse decode, one layer, ms ({meta['device']})\n\n## eager\n\n"
    text += markdown(rows, "eager")
    if not a.no_graphs:
        text += "\n\n## CUDA graph replay\n\n" + markdown(rows, "graph")
        text += "\n\n## Top-k, CUDA graph replay\n\n" + markdown_topk(rows, "graph")
    (out / "bench_sparse.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
