"""Where the DeepSeek-V3.2 batch-1 decode step's time goes after the indexer: the step's
graph against the same graph cut short (the indexer alone; the indexer and one trivial
dependent kernel that reads its slots), the sparse attention alone on fixed slots, and dense
`triton` decode of the same context. The indexer is cut the same way (its q prep alone; q prep
and logits). Says what fusing the sparse attention into the top-k's
launch could save at most (issue 18's batch-1 16k H16 point) before anyone builds it.

    python3 scripts/probe_dsa_chain.py --contexts 16384 --heads 16,128 --draws 4 --out OUT
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl
from bench_dsa_draws import draw_queries
from bench_sparse import decode_batch, dense, start, timed

from mla_backends.config import MLADims
from mla_backends.kernels.pdl import pdl_args, wait_previous
from mla_backends.sparse.base import SparseContext, create_sparse_backend
from mla_backends.sparse.indexer import Indexer, IndexerDims
from mla_backends.sparse.indexer_kernels import prepare_q_fused
from mla_backends.sparse.topk_kernel import new_counts


@triton.jit
def _read_slots(Slots, Out, N: tl.constexpr, USE_GDC: tl.constexpr):
    # the least a dependent launch after the top-k can do: wait, read its slots, store
    wait_previous(USE_GDC)
    i = tl.arange(0, N)
    tl.store(Out + tl.program_id(0), tl.sum(tl.load(Slots + i), 0))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="16384")
    p.add_argument("--batch", default="1")
    p.add_argument("--heads", default="16,128")
    p.add_argument("--draws", type=int, default=4)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    contexts, batches, heads, pools, out, meta = start(a, "probe_dsa_chain.py", False)
    bf16, _, cache, req = pools
    dev = torch.device("cuda")
    rows = []
    for ctx in contexts:
        for b in batches:
            batch = decode_batch(req, b, ctx)
            idims = IndexerDims()
            ix = Indexer(idims, cache, req.req_to_token, "triton")
            ix.init_forward_metadata(batch)
            sink = torch.zeros(32, dtype=torch.int32, device=dev)
            for h in heads:
                dims = MLADims(h, 512, 64, 128, 128, 40.0, 1.0)
                be = create_sparse_backend(
                    "triton", SparseContext(dims, bf16, req, idims.topk, torch.bfloat16)
                )
                be.init_forward_metadata(batch)
                got: dict[str, list[float]] = {}
                for _ in range(a.draws):
                    q_idx, w, cos, sin, qn, qr = draw_queries(b, h, dev)
                    fixed = ix.select(0, q_idx, w, cos, sin).clone()

                    def step() -> object:
                        return be.forward_sparse(0, qn, qr, ix.select(0, q_idx, w, cos, sin), batch)  # noqa: B023

                    counts = new_counts(b, dev, zeroed=False)

                    def prep() -> object:  # as `Indexer.select` runs it (batch <= 4)
                        return prepare_q_fused(idims, q_idx, w, cos, sin, zero=counts)  # noqa: B023

                    def prep_logits() -> object:
                        qp, wp = prepare_q_fused(idims, q_idx, w, cos, sin, zero=counts)  # noqa: B023
                        return ix.logits(0, qp, wp, 0, b, True, counts)  # noqa: B023

                    def select() -> object:
                        return ix.select(0, q_idx, w, cos, sin)  # noqa: B023

                    def select_read() -> object:
                        s = ix.select(0, q_idx, w, cos, sin)  # noqa: B023
                        _read_slots[(32,)](s, sink, N=s.numel(), **pdl_args(dev))
                        return s

                    def floor() -> object:  # one trivial kernel: the graph's own cost
                        return _read_slots[(32,)](fixed, sink, N=fixed.numel(), **pdl_args(dev))  # noqa: B023

                    def attend() -> object:
                        return be.forward_sparse(0, qn, qr, fixed, batch)  # noqa: B023

                    for name, fn in (("step", step), ("prep", prep), ("prep+logits", prep_logits),
                                     ("select", select), ("select+read", select_read),
                                     ("attention", attend), ("floor", floor)):  # fmt: skip
                        got.setdefault(name, []).append(timed(fn, True)["graph"] * 1e3)
                    d = dense("triton", batch, qn, qr, bf16, req, dims, True)["graph"] * 1e3
                    got.setdefault("dense", []).append(d)
                row = {"context": ctx, "batch": b, "heads": h}
                row.update({k: statistics.median(v) for k, v in got.items()})
                row["draws"] = got
                rows.append(row)
                print(
                    f"ctx {ctx} B {b} H {h}: "
                    + ", ".join(f"{k} {row[k]:.2f}" for k in got)
                    + f"; step - select {row['step'] - row['select']:.2f}, "
                    f"read - select {row['select+read'] - row['select']:.2f} us",
                    flush=True,
                )
                (out / "probe_dsa_chain.json").write_text(
                    json.dumps({"meta": meta, "rows": rows}, indent=1)
                )


if __name__ == "__main__":
    main()
