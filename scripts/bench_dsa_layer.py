"""One real-size DeepSeek attention layer decoding at long context on a GPU: DeepSeek-V3.2's
(`MLAttentionV32`: its projections, the indexer, sparse attention over the top 2048) against
the same layer run as DeepSeek-V3's (the same projections, dense attention over the whole
context through our `triton` or `flashmla` backend), each captured in one CUDA graph and
replayed (`graph_us`, L2 flushed before each replay). The V3.2 layer runs with its indexer
inline and on its own stream beside the layer's q / KV projections (`DSABackend.begin_select`).

Random weights (hidden 7168, q LoRA 1536, latent 512 + 64, indexer 64 x 128), random pools
(`scripts/bench_sparse.py`'s), one decode token a request, bf16.

    python scripts/bench_dsa_layer.py --contexts 16384,32768,65536 --batch 1 --out $OUT/layer
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sparse import PAGE, build_pools, decode_batch  # noqa: E402

from mla_backends.backends.base import BackendContext  # noqa: E402
from mla_backends.backends.registry import get_backend_class  # noqa: E402
from mla_backends.bench.stack import STACK  # noqa: E402
from mla_backends.bench.timing import graph_us  # noqa: E402
from mla_backends.config import Config, MLADims  # noqa: E402
from mla_backends.models.deepseek_v3 import MLAttention, rope_tables  # noqa: E402
from mla_backends.models.deepseek_v32 import DeepseekV32Config, MLAttentionV32  # noqa: E402
from mla_backends.sparse.base import SparseContext, create_sparse_backend  # noqa: E402
from mla_backends.sparse.dsa import DSABackend  # noqa: E402
from mla_backends.sparse.indexer import Indexer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="16384,32768,65536")
    p.add_argument("--batch", default="1")
    p.add_argument("--heads", default="128,16")
    p.add_argument("--sparse", default="triton", help="sparse backend")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_dsa_layer.py needs a CUDA GPU")
    dev = torch.device("cuda")
    contexts = [int(x) for x in a.contexts.split(",")]
    batches = [int(x) for x in a.batch.split(",")]
    bf16, _, cache, req = build_pools(max(batches), max(contexts), False)
    rows_out = []
    for h in [int(x) for x in a.heads.split(",")]:
        cfg = DeepseekV32Config(**{**STACK, "num_hidden_layers": 1, "num_attention_heads": h})
        torch.manual_seed(h)
        attn = MLAttentionV32(cfg, 0, None).to(dev, torch.bfloat16).eval()
        inv_freq, scale = rope_tables(cfg)
        dims = MLADims(h, 512, 64, 128, 128, 40.0, 1.0)
        for ctx in contexts:
            for b in batches:
                batch = decode_batch(req, b, ctx)
                x = torch.randn(b, cfg.hidden_size, device=dev).bfloat16()
                ang = torch.full((b, 1), float(ctx - 1), device=dev) * inv_freq.to(dev)[None]
                cos, sin = (ang.cos() * scale).bfloat16(), (ang.sin() * scale).bfloat16()
                dense = {}
                for name in ("triton", "flashmla"):
                    conf = Config(
                        model=dims, num_layers=1, prefill_backend="triton",
                        decode_backend=name, page_size=PAGE, kv_dtype="bfloat16",
                        dtype="bfloat16", num_pages=bf16.num_pages, max_requests=req.size,
                        max_context_len=req.max_context_len, device="cuda",
                    )  # fmt: skip
                    be = get_backend_class(name)(BackendContext(conf, bf16, req))
                    be.init_forward_metadata(batch)
                    dense[name] = be
                idx = Indexer(cfg.indexer_dims(), cache, req.req_to_token, "triton")
                sctx = SparseContext(dims, bf16, req, cfg.index_topk, torch.bfloat16)
                sp = create_sparse_backend(a.sparse, sctx)
                dsa = {
                    overlap: DSABackend(dense["triton"], idx, sp, overlap)
                    for overlap in (False, True)
                }
                for d in dsa.values():
                    d.init_forward_metadata(batch)
                row: dict = {"heads": h, "context": ctx, "batch": b}
                with torch.no_grad():
                    for name, be in dense.items():
                        row[f"v3_dense_{name}"] = graph_us(
                            lambda be=be: MLAttention.forward(attn, x, cos, sin, batch, be)
                        )
                    for overlap, d in dsa.items():
                        key = "v32_overlapped" if overlap else "v32_inline"
                        row[key] = graph_us(lambda d=d: attn(x, cos, sin, batch, d))
                    # the same output either way (same kernels, another stream)
                    o1, o2 = (
                        attn(x, cos, sin, batch, dsa[False]),
                        attn(x, cos, sin, batch, dsa[True]),
                    )
                    row["overlap_max_abs_diff"] = float((o1.float() - o2.float()).abs().max())
                best_dense = min(row["v3_dense_triton"], row["v3_dense_flashmla"])
                row["best_dense/v32_overlapped"] = best_dense / row["v32_overlapped"]
                row["best_dense/v32_inline"] = best_dense / row["v32_inline"]
                rows_out.append(row)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                  for k, v in row.items()}), flush=True)  # fmt: skip
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    (out / "bench_dsa_layer.json").write_text(
        json.dumps({"meta": meta, "rows": rows_out}, indent=1)
    )


if __name__ == "__main__":
    main()
