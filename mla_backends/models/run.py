"""`run`: load DeepSeek-V3 (a checkpoint directory, or a random model at a named size saved to
safetensors and reloaded), serve a batch of prompts of different lengths through prefill and
greedy decode on the configured backends, report tokens/s and the largest logit difference
against the same run with attention by the fp64 reference (`ReferenceBackend`), which shares
no kernel with any backend."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import tempfile
import time
from pathlib import Path

import torch

from mla_backends.arith import cdiv
from mla_backends.backends.base import BackendContext
from mla_backends.backends.protocol import AttentionBackend
from mla_backends.backends.reference_backend import ReferenceBackend
from mla_backends.backends.registry import check_device, resolve_backends
from mla_backends.cli import (
    SEED,
    UsageError,
    add_config_argument,
    existing_dir,
    int_at_least,
    out_of_memory,
)
from mla_backends.config import KV_DTYPES, Config, ConfigError, load_config
from mla_backends.models.choices import Selections
from mla_backends.models.deepseek_v3 import DeepseekV3ForCausalLM
from mla_backends.models.deepseek_v32 import DeepseekV32ForCausalLM
from mla_backends.models.engine import Engine
from mla_backends.models.loader import build_model, load_model
from mla_backends.pool import FP8_DTYPES, FP8_MAX
from mla_backends.runtime import Runtime
from mla_backends.sparse.base import SparseBackendUnavailable
from mla_backends.sparse.dsa import DSABackend
from mla_backends.sparse.torch_backend import ReferenceSparseBackend

# Largest relative logit difference from the fp64-reference-attention run, per dtype.
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
# DeepSeek-V3.2 at the tiny size: an index_topk below the prompts' lengths, so the indexer's
# selection decides what attention reads.
RANDOM_SIZES["tiny-v32"] = dict(
    RANDOM_SIZES["tiny"],
    model_type="deepseek_v32",
    index_n_heads=4,
    index_head_dim=32,
    index_topk=8,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_argument(p, " (backends, page size, pool)")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        type=existing_dir,
        help="HF-layout checkpoint directory (config.json + safetensors)",
    )
    src.add_argument(
        "--random",
        default="tiny",
        choices=sorted(RANDOM_SIZES),
        help="random weights at a named size, saved and reloaded (default)",
    )
    p.add_argument(
        "--requests",
        type=int_at_least(1),
        default=4,
        help="requests in the batch; at most what the config's pool holds (the error says)",
    )
    p.add_argument("--max-new", type=int_at_least(1), default=8, help="tokens generated each")
    p.add_argument("--seed", type=SEED, default=0)


def prompt_lengths(n: int) -> list[int]:
    return [3 + 11 * i for i in range(n)]


def max_requests(config: Config, max_new: int) -> int:
    """The most requests `run` can serve under `config`: request rows, context length and KV
    pages for prompts of `prompt_lengths` plus `max_new` tokens each."""
    n, pages = 0, 0
    while n < config.max_requests:
        total = prompt_lengths(n + 1)[-1] + max_new - 1
        pages += cdiv(total, config.page_size)
        if total > config.max_context_len or pages > config.num_pages:
            break
        n += 1
    return n


def _unused_tensors(model: DeepseekV3ForCausalLM) -> list[str]:
    """Checkpoint tensors the model did not take, but for the multi-token-prediction layers
    (numbered from num_hidden_layers on), which serving does not run."""
    n = model.cfg.num_hidden_layers
    mtp = re.compile(r"model\.layers\.(\d+)\.")
    return [t for t in model.extra_tensors if not ((m := mtp.match(t)) and int(m.group(1)) >= n)]


# KV-cache scales as quantised checkpoints name them (SGLang / vLLM / llm-compressor)
_KV_SCALE = re.compile(r"\.self_attn\.(k|v|kv)_scale$")


def _check_kv_scales(model: DeepseekV3ForCausalLM, config: Config, path: Path) -> None:
    """UsageError for an FP8 pool over a checkpoint that carries KV-cache scales: `run`
    stores FP8 KV at scale 1.0 a layer (SGLang's convention for checkpoints without them)
    and would ignore the checkpoint's, and its reference run reads the same pool, so no
    comparison would notice (the SGLang adapter refuses a k_scale other than 1 likewise)."""
    found = [t for t in model.extra_tensors if _KV_SCALE.search(t)]
    if found and KV_DTYPES[config.kv_dtype] in FP8_DTYPES:
        raise UsageError(
            f"{path}: the checkpoint carries KV-cache scales ({found[0]}, {len(found)} in "
            f"all) and kv_dtype is {config.kv_dtype}: run stores FP8 KV at scale 1.0 a layer "
            "and does not read them; use kv_dtype bfloat16"
        )


def random_model(
    raw: dict, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> DeepseekV3ForCausalLM:
    """DeepSeek-V3 from an HF config dict with random weights, built on `device`: matrices
    N(0, 0.02), vectors (gate correction biases) N(0, 0.1), norms left at 1."""
    with torch.device(device):
        model = build_model(raw).to(dtype)
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


@dataclasses.dataclass
class Served:
    steps: list[torch.Tensor]  # logits of each step: the prefill's, then each decode's
    tokens_per_s: float
    tokens: list[list[int]]  # the greedy picks of each request
    sparse: str | None  # the sparse backend that ran (V3.2), "auto" resolved


def _serve(
    model: DeepseekV3ForCausalLM,
    config: Config,
    prompts: list[list[int]],
    max_new: int,
    reference: bool = False,
    selections: Selections | None = None,
    feed: list[list[int]] | None = None,
) -> Served:
    """Prefill all prompts, then greedy decode.
    reference: attention by the fp64 `ReferenceBackend` instead of the configured backends.
    selections: the discrete choices (index selections, expert routes), recorded by the
    served run and followed by the reference run. feed: the tokens to decode from (the
    served run's), so both runs see the same inputs; its own greedy picks are still returned."""
    rt = Runtime.build(config)
    if rt.kv_pool.is_fp8:  # SGLang's convention for checkpoints without KV scales
        for layer in range(rt.kv_pool.num_layers):
            rt.kv_pool.set_scale(layer, 1.0)
    backend: AttentionBackend | None = None
    sparse_name: str | None = None
    if reference:
        backend = ReferenceBackend(BackendContext(config, rt.kv_pool, rt.req_pool))
    if isinstance(model, DeepseekV32ForCausalLM):  # indexer + sparse attention (DSA)
        sparse = ReferenceSparseBackend if reference else config.sparse_backend
        dsa = DSABackend.build(
            rt, model.cfg.indexer_dims(), sparse, dense=backend, topk_path=config.indexer_topk
        )
        if selections is not None:
            (selections.follow if reference else selections.record)(dsa.indexer)
        backend, sparse_name = dsa, dsa.sparse.name
    if selections is not None:
        selections.gates(model, follow=reference)
    eng = Engine(model, rt, backend)
    rows = eng.new_requests(len(prompts))
    t0 = time.perf_counter()
    steps = [eng.extend(rows, prompts)]
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    nxt = steps[0][ends].argmax(-1).tolist()
    out = [[t] for t in nxt]
    for step in range(max_new - 1):
        steps.append(eng.decode(rows, [f[step] for f in feed] if feed else nxt))
        nxt = steps[-1].argmax(-1).tolist()
        for o, t in zip(out, nxt):
            o.append(t)
    if config.torch_device.type == "cuda":
        torch.cuda.synchronize()
    if selections is not None:
        selections.ungate(model)
    tokens = sum(len(p) for p in prompts) + len(prompts) * (max_new - 1)
    return Served(steps, tokens / (time.perf_counter() - t0), out, sparse_name)


def _replaced_dims(base: Config, served: Config) -> str:
    """Where the model's dims (`served`) differ from the config's (`base`): `num_heads 128 ->
    16, num_layers 61 -> 2`, or empty. The run serves the model's; a reader of the config
    should not take its own for what ran."""
    pairs = [
        (f.name, getattr(base.model, f.name), getattr(served.model, f.name))
        for f in dataclasses.fields(served.model)
    ]
    pairs.append(("num_layers", base.num_layers, served.num_layers))
    return ", ".join(f"{name} {old} -> {new}" for name, old, new in pairs if old != new)


def run(args: argparse.Namespace) -> int:
    # Backends are resolved (and refused) once the checkpoint's dims replace the config's.
    base = load_config(args.config, resolve=False)
    where, src = args.config or "default config", args.config or "the shipped default"
    check_device(base, where)  # before the model is built there
    if base.dcp_size > 1:
        raise ConfigError(
            f"{where}: dcp_size={base.dcp_size}: run serves from one process; use dcp_size: 1 "
            "(decode context parallelism runs one process a rank: mla_backends.dcp)"
        )
    # The config's max_context_len stands as written: a request that outgrows it is refused
    # here, in one line, rather than the limit raised behind the user's back.
    allowed = max_requests(base, args.max_new)
    if allowed == 0:
        first = prompt_lengths(1)[0]
        total = first + args.max_new - 1
        need = (
            f"a context of {total} tokens, over max_context_len {base.max_context_len}"
            if total > base.max_context_len
            else f"{cdiv(total, base.page_size)} pages, over num_pages {base.num_pages}"
        )
        raise UsageError(
            f"--max-new {args.max_new} does not fit this config ({src}: {base.num_pages} "
            f"pages of {base.page_size} tokens, max_context_len {base.max_context_len}): one "
            f"request of {first} prompt tokens plus --max-new needs {need}"
        )
    if args.requests > allowed:
        raise UsageError(
            f"--requests {args.requests} is out of range: 1..{allowed} with this config "
            f"({src}: max_requests {base.max_requests}, "
            f"{base.num_pages} pages of {base.page_size} tokens, max_context_len "
            f"{base.max_context_len}; prompts of 3, 14, 25, ... tokens plus --max-new "
            f"{args.max_new})"
        )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else Path(tmp)
        if not args.model:
            save_random(args.random, path, args.seed)
        model = load_model(path, dtype=base.torch_dtype, device=base.torch_device)
    _check_kv_scales(model, base, path)
    c = model.cfg
    config = resolve_backends(
        dataclasses.replace(base, model=c.attention_dims, num_layers=c.num_hidden_layers),
        f"{where} with the model's dims",
    )
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [
        torch.randint(0, c.vocab_size, (n,), generator=gen).tolist()
        for n in prompt_lengths(args.requests)
    ]
    sel = Selections()
    sizes = f"{src}: num_pages {config.num_pages}, max_requests "
    sizes += f"{config.max_requests}, max_context_len {config.max_context_len}"
    try:
        with out_of_memory(sizes, config.torch_device):
            served = _serve(model, config, prompts, args.max_new, selections=sel)
            ref = _serve(model, config, prompts, args.max_new, True, sel, feed=served.tokens)
    except SparseBackendUnavailable as e:  # known only once the model's indexer dims are
        raise ConfigError(f"{where}: sparse_backend: {e}") from None
    out = served.tokens
    diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(served.steps, ref.steps))
    print(
        f"model {path if args.model else 'random:' + args.random}: {c.num_hidden_layers} "
        f"layers, {c.num_attention_heads} heads, device {config.torch_device}"
    )
    replaced = _replaced_dims(base, config)
    if replaced:
        print(f"the model's dims replace the config's ({src}): {replaced}")
    unused = _unused_tensors(model)
    if unused:
        print(f"checkpoint tensors left unused: {len(unused)}, e.g. {', '.join(unused[:3])}")
    print(
        f"backends: prefill={config.prefill_backend} decode={config.decode_backend}"
        + (f" sparse={served.sparse}" if served.sparse is not None else "")
        + f", page {config.page_size}, kv {config.kv_dtype}"
        + (
            f" at scale 1.0 a layer (values beyond +-{FP8_MAX:g} saturate)"
            if KV_DTYPES[config.kv_dtype] in FP8_DTYPES
            else ""
        )
    )
    print(
        f"{len(prompts)} request{'s' * (len(prompts) != 1)}, prompt lengths "
        f"{[len(p) for p in prompts]}, "
        f"{args.max_new} new tokens each: {served.tokens_per_s:.1f} tokens/s"
    )
    tol = AGREE[config.dtype]
    ok = diff <= tol and sel.layer0_same == sel.layer0_calls
    if sel.layer0_calls:
        print(
            f"index selections: the reference run follows the served run's; at layer 0 (same "
            f"inputs) it picked the same sets on its own in {sel.layer0_same} of "
            f"{sel.layer0_calls} calls"
        )
    if sel.routes:
        print(
            f"expert routes: the reference run follows the served run's; it would have routed "
            f"{sel.routes_differ} of {sel.routes} token-layer routes differently on its own"
        )
    print(
        f"logits vs the same model with fp64 reference attention: max relative difference "
        f"{diff:.2e} (tolerance {tol:g}): {'agree' if ok else 'DISAGREE'}; greedy tokens "
        f"{'identical' if out == ref.tokens else 'differ'} (the reference decodes the served "
        f"run's tokens)"
    )
    return 0 if ok else 1
