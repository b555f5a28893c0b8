#!/usr/bin/env python3
"""Time one DeepSeek-V3 prefill step (MHA-mode prefill in every layer) through a backend and
count FlashInfer ragged-prefill plans per step. Runs against whatever `mla_backends` is on
the path, so the same command measures two trees (a refactor's before and after) in one run:

    PYTHONPATH=.before python3 scripts/prefill_step.py --out $OUT/before.json
    python3 scripts/prefill_step.py --out $OUT/after.json

Model: DeepSeek-V3 attention dims (H heads, latent 512, rope 64, nope 128, v 128), `--layers`
layers, small dense MLPs (the step is attention-dominated), random weights. Median wall time
of `--iters` whole steps (host work included: planning is what the refactor moved; the device
is synchronized before and after each step) after `--warmup` (first calls, JIT and plan caches
excluded), each step on fresh requests: a full prefill with no cached prefix."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--backend", default="flashinfer_mla")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--lens", default="2048,1024,512,512", help="prompt lengths of the batch")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (torch backend)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()

    import mla_backends
    from mla_backends.config import Config
    from mla_backends.models.engine import Engine
    from mla_backends.models.run import random_model
    from mla_backends.runtime import Runtime

    plans = [0]
    if a.backend == "flashinfer_mla":  # count plans in FlashInfer itself: works on any tree
        import flashinfer

        wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper
        orig_plan = wrapper.plan

        def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            plans[0] += 1
            return orig_plan(self, *args, **kwargs)

        wrapper.plan = counted  # type: ignore[method-assign]
    lens = [int(x) for x in a.lens.split(",")]
    raw = dict(
        vocab_size=1024,
        hidden_size=1024,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_hidden_layers=a.layers,
        first_k_dense_replace=a.layers,
        num_attention_heads=a.heads,
        q_lora_rank=512,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        max_position_embeddings=8192,
    )
    dt = torch.bfloat16 if a.device == "cuda" else torch.float32
    model = random_model(raw, 0, a.device, dt)
    dims = model.cfg.attention_dims
    dims = dims() if callable(dims) else dims
    per_step = sum(-(-n // 64) for n in lens)
    cfg = Config(
        model=dims,
        num_layers=a.layers,
        prefill_backend=a.backend,
        decode_backend=a.backend,
        page_size=64,
        kv_dtype=str(dt).removeprefix("torch."),
        dtype=str(dt).removeprefix("torch."),
        num_pages=per_step + 8,
        max_requests=len(lens) + 1,
        max_context_len=max(lens),
        device=a.device,
    )
    eng = Engine(model, Runtime.build(cfg))
    gen = torch.Generator().manual_seed(0)
    toks = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in lens]
    times, plan_counts = [], []
    for i in range(a.warmup + a.iters):
        rows = eng.new_requests(len(lens))
        plans[0] = 0
        sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        eng.extend(rows, toks)
        sync()
        dt_us = (time.perf_counter() - t0) * 1e6
        for r in rows:
            eng.free(r)
        if i >= a.warmup:
            times.append(dt_us)
            plan_counts.append(plans[0])
    res = {
        "tree": str(Path(mla_backends.__file__).resolve().parent.parent),
        "gpu": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "backend": a.backend,
        "heads": a.heads,
        "layers": a.layers,
        "lens": lens,
        "step_us_median": statistics.median(times),
        "step_us_all": times,
        "ragged_plans_per_step": plan_counts,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "step_us_all"}))


if __name__ == "__main__":
    main()
