"""Probe for issue 19's prototype (`kernels/mla_attention_seesaw.py`): the same decode call
through the Gluon kernel and the seesaw prototype on one random paged pool (page 64,
shuffled pages, H128, bf16), output and LSE compared, then timed against each other and
raw FlashMLA (CUDA-graph replay, µs). Whole 64-key tiles only (the prototype's limit).

    python3 scripts/probe_seesaw.py            # H100 / H200; JSON on stdout
"""

from __future__ import annotations

import json
import math

import torch

from mla_backends.bench.timing import graph_us
from mla_backends.kernels import mla_attention_gluon as glu
from mla_backends.kernels import mla_attention_seesaw as see
from mla_backends.kernels.mla_attention import _merge

SHAPES = [(64, 4096, 1), (128, 8192, 1), (256, 1024, 1), (16, 32768, 4), (64, 16384, 1)]


def run_shape(b: int, kv: int, splits: int) -> dict[str, float]:
    dev, h, page = torch.device("cuda"), 128, 64
    g = torch.Generator(device=dev).manual_seed(b + kv)
    per = kv // page
    n_pages = b * per + 1
    pool = torch.randn(n_pages * page, 576, generator=g, device=dev).bfloat16()
    table = (torch.randperm(n_pages - 1, generator=g, device=dev) + 1).int().view(b, per)
    qn = torch.randn(b, h, 512, generator=g, device=dev).bfloat16()
    qr = torch.randn(b, h, 64, generator=g, device=dev).bfloat16()
    qo = torch.arange(b + 1, device=dev, dtype=torch.int32)
    lens = torch.full((b,), kv, device=dev, dtype=torch.int32)
    scale = 1.0 / math.sqrt(192)
    outs = {}
    for name, mod in (("gluon", glu), ("seesaw", see)):
        out = torch.empty(b, h, 512, device=dev, dtype=torch.bfloat16)
        lse = torch.empty(b, h, device=dev)
        po = torch.empty(b * h * splits, 512, device=dev)
        pl = torch.empty(b * h * splits, device=dev)

        def call(mod=mod, out=out, lse=lse, po=po, pl=pl) -> None:  # type: ignore[no-untyped-def]
            args = (qn, qr, pool, table, qo, lens, page, scale * math.log2(math.e), 2, splits)
            mod.launch(*args, out, lse, po, pl)
            _merge(po, pl, out, lse, splits)

        call()
        torch.cuda.synchronize()
        outs[name] = (out.float(), lse.clone(), graph_us(call))
    (o1, l1, t1), (o2, l2, t2) = outs["gluon"], outs["seesaw"]
    res = {
        "gluon_us": t1,
        "seesaw_us": t2,
        "seesaw_speedup": t1 / t2,
        "out_max_abs_diff": float((o1 - o2).abs().max()),
        "lse_max_abs_diff": float((l1 - l2).abs().max()),
    }
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


def main() -> None:
    rows = []
    for b, kv, splits in SHAPES:
        r = {"batch": b, "kv": kv, "splits": splits, **run_shape(b, kv, splits)}
        print(json.dumps(r), flush=True)
        rows.append(r)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    print(json.dumps({"meta": meta, "rows": rows}))


if __name__ == "__main__":
    main()
