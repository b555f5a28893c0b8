"""`run`: load DeepSeek-V3 (a checkpoint directory, or a random model at a named size saved to
safetensors and reloaded), serve a batch of prompts of different lengths through prefill and
greedy decode on the configured backends, report tokens/s and the largest logit difference
against the same run on the torch backend."""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch

from mla_backends.config import Config, load_config
from mla_backends.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from mla_backends.models.engine import Engine
from mla_backends.models.loader import load_model
from mla_backends.runtime import Runtime

# Largest relative logit difference from the torch backend, after every layer, per dtype.
AGREE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}
RANDOM_SIZES: dict[str, dict] = {
    "tiny": dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        rope_scaling={
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/default.yaml", help="backends, page size, pool")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="HF-layout checkpoint directory (config.json + safetensors)")
    src.add_argument(
        "--random",
        default="tiny",
        choices=sorted(RANDOM_SIZES),
        help="random weights at a named size, saved and reloaded (default)",
    )
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-new", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)


def random_model(
    raw: dict, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> DeepseekV3ForCausalLM:
    """DeepSeek-V3 from an HF config dict with random weights, built on `device`: matrices
    N(0, 0.02), vectors (gate correction biases) N(0, 0.1), norms left at 1."""
    with torch.device(device):
        model = DeepseekV3ForCausalLM(DeepseekV3Config.from_hf(raw)).to(dtype)
    gen = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not name.endswith("norm.weight"):
                t.normal_(0, 0.02 if t.dim() > 1 else 0.1, generator=gen)
    return model


def save_random(size: str, path: Path, seed: int) -> None:
    """Random weights at a named size, written as an HF-layout checkpoint."""
    from safetensors.torch import save_file

    raw = RANDOM_SIZES[size]
    model = random_model(raw, seed)
    (path / "config.json").write_text(json.dumps(raw))
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors")
    )


def _serve(
    model: DeepseekV3ForCausalLM, config: Config, prompts: list[list[int]], max_new: int
) -> tuple[list[torch.Tensor], float, list[list[int]]]:
    """Prefill all prompts, then greedy decode; (logits per step, tokens/s, generated ids)."""
    eng = Engine(model, Runtime.build(config))
    rows = eng.new_requests(len(prompts))
    t0 = time.perf_counter()
    steps = [eng.extend(rows, prompts)]
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    nxt = steps[0][ends].argmax(-1).tolist()
    out = [[t] for t in nxt]
    for _ in range(max_new - 1):
        steps.append(eng.decode(rows, nxt))
        nxt = steps[-1].argmax(-1).tolist()
        for o, t in zip(out, nxt):
            o.append(t)
    if config.torch_device.type == "cuda":
        torch.cuda.synchronize()
    tokens = sum(len(p) for p in prompts) + len(prompts) * (max_new - 1)
    return steps, tokens / (time.perf_counter() - t0), out


def run(args: argparse.Namespace) -> int:
    base = load_config(args.config)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else Path(tmp)
        if not args.model:
            save_random(args.random, path, args.seed)
        model = load_model(path, dtype=base.torch_dtype, device=base.torch_device)
    c = model.cfg
    config = dataclasses.replace(
        base,
        model=c.attention_dims,
        num_layers=c.num_hidden_layers,
        max_context_len=max(base.max_context_len, 64 + args.max_new),
    )
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [
        torch.randint(0, c.vocab_size, (n,), generator=gen).tolist()
        for n in [3 + 11 * i for i in range(args.requests)]
    ]
    steps, tps, out = _serve(model, config, prompts, args.max_new)
    ref_cfg = dataclasses.replace(config, prefill_backend="torch", decode_backend="torch")
    ref_steps, _, ref_out = _serve(model, ref_cfg, prompts, args.max_new)
    diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(steps, ref_steps))
    print(
        f"model {path if args.model else 'random:' + args.random}: {c.num_hidden_layers} "
        f"layers, {c.num_attention_heads} heads, device {config.torch_device}"
    )
    print(
        f"backends: prefill={config.prefill_backend} decode={config.decode_backend}, "
        f"page {config.page_size}, kv {config.kv_dtype}"
    )
    print(
        f"{len(prompts)} requests, prompt lengths {[len(p) for p in prompts]}, "
        f"{args.max_new} new tokens each: {tps:.1f} tokens/s"
    )
    tol = AGREE[config.dtype]
    ok = diff <= tol
    print(
        f"logits vs torch backend: max relative difference {diff:.2e} (tolerance {tol:g}): "
        f"{'agree' if ok else 'DISAGREE'}; greedy tokens "
        f"{'identical' if out == ref_out else 'differ'}"
    )
    return 0 if ok else 1
