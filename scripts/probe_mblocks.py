"""Probe (issue 19): the H128 decode kernels with one of the two 64-head blocks launched
(m_blocks=1: half the CTAs, the same work per CTA) against both: per-CTA-bound or shared-
resource-bound. python3 scripts/probe_mblocks.py on an H100."""

import json

import torch

from mla_backends.bench.timing import graph_us
from mla_backends.kernels import mla_attention_gluon as glu
from mla_backends.kernels import mla_attention_seesaw as see

dev = torch.device("cuda")
h = 128
page = 64
res = {}
for b, kv in ((64, 4096), (128, 8192)):
    g = torch.Generator(device=dev).manual_seed(0)
    per = kv // page
    n_pages = b * per + 1
    pool = torch.randn(n_pages * page, 576, generator=g, device=dev).bfloat16()
    table = (torch.randperm(n_pages - 1, generator=g, device=dev) + 1).int().view(b, per)
    qn = torch.randn(b, h, 512, generator=g, device=dev).bfloat16()
    qr = torch.randn(b, h, 64, generator=g, device=dev).bfloat16()
    qo = torch.arange(b + 1, device=dev, dtype=torch.int32)
    lens = torch.full((b,), kv, device=dev, dtype=torch.int32)
    out = torch.empty(b, h, 512, device=dev, dtype=torch.bfloat16)
    lse = torch.empty(b, h, device=dev)
    po = torch.empty(1, 512, device=dev)
    pl = torch.empty(1, device=dev)
    for name, mod in (("gluon", glu), ("seesaw", see)):
        for mb in (1, 2):
            t = graph_us(
                lambda: mod.launch(
                    qn, qr, pool, table, qo, lens, page, 0.1, mb, 1, out, lse, po, pl
                )
            )
            res[f"B{b} kv{kv} {name} m_blocks={mb}"] = round(t, 1)
            print(f"B{b} kv{kv} {name} m_blocks={mb}: {t:.1f} us", flush=True)
print(json.dumps(res))
