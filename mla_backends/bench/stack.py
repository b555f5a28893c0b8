"""A stack of real-size DeepSeek-V3 layers (hidden 7168, 128 heads, MLA 512 + 64, q LoRA 1536,
the real vocabulary, MoE shrunk to 8 routed experts), random weights, decoding through each
backend, eager and through whole-model CUDA graphs (`--stack-size tiny`: a small model).

Per backend and batch size: prefill B prompts (MHA mode), then
- graph vs eager on the same state: one eager decode step, the KV rolled back by one token,
  the same step replayed through the graph; largest relative logit difference;
- step time (wall clock over `--steps` steps, host work included: batch building, metadata,
  the replay), eager and graph;
- the first decode step's logits against the first backend's (a cross-backend check).
On a CPU the graph half is left out (its columns read "-")."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from mla_backends.backends.base import Capability
from mla_backends.bench.fixtures import require_runs
from mla_backends.bench.options import Options, pick
from mla_backends.bench.report import write
from mla_backends.cli import UsageError, out_of_memory
from mla_backends.config import Config
from mla_backends.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from mla_backends.models.engine import Engine
from mla_backends.models.loader import available_host_bytes
from mla_backends.models.run import RANDOM_SIZES, random_model
from mla_backends.runtime import Runtime

STACK = dict(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=4,
    num_attention_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=8,  # shrunk from 256 (and top-8 of 8 groups) to fit and load fast
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    rope_scaling={
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)
# DeepSeek-V3 layer stacks only: a V3.2 model needs the DSA backend `run` builds, not one
# dense backend (`tiny-v32` here was an AttributeError in its first layer)
SIZES = {"real": STACK, **{k: v for k, v in RANDOM_SIZES.items() if k != "tiny-v32"}}
PREFILL_FOR = {"flashmla": "flashinfer_mla"}  # FlashMLA has no prefill path


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _per_token(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """(median over tokens of the per-token relative difference, tokens above 5e-2). A few
    outlying tokens with the rest at bf16 level point at MoE routing flips (a near-tie in a
    top-k choice decided differently by bf16 rounding), not at attention."""
    a, b = a.float(), b.float()
    per = (a - b).abs().amax(-1) / b.abs().amax(-1)
    return float(per.median()), int((per > 5e-2).sum())


def _config(
    c: DeepseekV3Config,
    backend: str,
    batches: list[int],
    prompt: int,
    steps: int,
    device: torch.device,
) -> Config:
    ctx = prompt * 2 + steps + 64
    return Config(
        model=c.attention_dims,
        num_layers=c.num_hidden_layers,
        prefill_backend=PREFILL_FOR.get(backend, backend),
        decode_backend=backend,
        page_size=64,
        kv_dtype="bfloat16",
        dtype="bfloat16",
        num_pages=max(batches) * (ctx // 64 + 2) + 8,
        max_requests=max(batches) + 1,
        max_context_len=ctx,
        device=str(device),
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed_steps(
    eng: Engine, rows: list[int], steps: int, gen: torch.Generator, vocab: int
) -> float:
    toks = torch.randint(0, vocab, (steps, len(rows)), generator=gen).tolist()
    eng.decode(rows, toks[0])  # warm
    _sync(eng.device)
    t0 = time.perf_counter()
    for t in toks[1:]:
        eng.decode(rows, t)
    _sync(eng.device)
    return (time.perf_counter() - t0) / (steps - 1)


def run_backend(
    model: DeepseekV3ForCausalLM, cfg: Config, batches: list[int], prompt: int, steps: int
) -> list[dict]:
    vocab = model.cfg.vocab_size
    eng = Engine(model, Runtime.build(cfg))
    graphs = eng.device.type == "cuda"
    if graphs:
        eng.enable_graphs(batches)
    runner = eng.runner
    out = []
    for b in batches:
        gen = torch.Generator().manual_seed(b)
        lens = [prompt * 3 // 4 + (i * prompt // 2) // max(b - 1, 1) for i in range(b)]
        prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]
        rows = eng.new_requests(b)
        for i in range(0, b, 16):  # prefill in chunks of 16 requests
            eng.extend(rows[i : i + 16], prompts[i : i + 16])
        first = torch.randint(0, vocab, (b,), generator=gen).tolist()
        eng.runner = None
        eager_logits = eng.decode(rows, first)
        row: dict = dict(backend=cfg.decode_backend, batch=b, prompt_lens=[min(lens), max(lens)])
        row.update(eager_ms=None, graph_ms=None, graph_tokens_per_s=None)
        row.update(graph_vs_eager=None, graph_vs_eager_tokens=None)
        if graphs:
            for r in rows:  # roll the step back: the graph step writes the same slots
                eng.rt.allocator.truncate(r, eng.rt.allocator.seq_len(r) - 1)
            eng.runner = runner
            graph_logits = eng.decode(rows, first)
            eng.runner = None
            row["graph_vs_eager"] = _rel(graph_logits, eager_logits)
            row["graph_vs_eager_tokens"] = _per_token(graph_logits, eager_logits)
        row["eager_ms"] = _timed_steps(eng, rows, steps, gen, vocab) * 1e3
        if graphs:
            eng.runner = runner
            graph_s = _timed_steps(eng, rows, steps, gen, vocab)
            row["graph_ms"], row["graph_tokens_per_s"] = graph_s * 1e3, b / graph_s
        out.append({**row, "first_logits": eager_logits.float().cpu()})
        print(
            f"{cfg.decode_backend:15s} B={b:3d} eager {row['eager_ms']:7.2f} ms  graph "
            f"{_num(row['graph_ms'], '7.2f')} ms  graph/eager logits "
            f"{_num(row['graph_vs_eager'], '.1e')}",
            flush=True,
        )
        for r in rows:
            eng.free(r)
    return out


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _pair(x: tuple[float, int] | None, batch: int) -> str:
    return "-" if x is None else f"{x[0]:.1e}, {x[1]}/{batch}"


def table(rows: list[dict]) -> str:
    """The markdown table of stack.md (graph columns "-" where no graph ran)."""
    first = rows[0]["backend"]
    lines = [
        f"| backend | B | eager ms/step | graph ms/step | speed-up | graph tok/s | graph vs eager "
        f"(max; median, tokens > 5e-2) | vs {first} (max; median, tokens > 5e-2) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b, g = r["batch"], r["graph_ms"]
        lines.append(
            f"| {r['backend']} | {b} | {r['eager_ms']:.2f} | {_num(g, '.2f')} | "
            f"{'-' if g is None else format(r['eager_ms'] / g, '.2f') + 'x'} | "
            f"{_num(r['graph_tokens_per_s'], '.0f')} | "
            f"{_num(r['graph_vs_eager'], '.1e')}; {_pair(r['graph_vs_eager_tokens'], b)} | "
            f"{r['vs_first_backend']:.1e}; {_pair(r['vs_first_backend_tokens'], b)} |"
        )
    return "\n".join(lines)


def _require_model_fits(c: DeepseekV3Config, dev: torch.device, options: str) -> None:
    """UsageError unless the random model (built in fp32, then cast to bf16) fits the memory
    free on `dev`. Hazard: Linux overcommits, so a host build too large was killed for memory
    with no message (`out_of_memory` never saw an error)."""
    # a floor: the MLPs' fp32 parameters alone (the cast to bf16 goes a tensor at a time)
    need = c.mlp_parameters() * 4
    free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else available_host_bytes()
    if free is not None and need > free:
        raise UsageError(
            f"{options}: the model needs over {need / 2**30:.0f} GiB on {dev} (built in fp32, "
            f"then cast), {free / 2**30:.0f} GiB free; give fewer --layers"
        )


def run(opts: Options, config: Config) -> None:
    dev = config.torch_device
    cap = Capability.detect(dev)
    backends = opts.backends or [config.decode_backend]
    batches = pick(opts.batch, [1, 8, 32, 64])
    prompt, steps, layers = pick(opts.prompt, 1024), pick(opts.steps, 20), pick(opts.layers, 4)
    size = pick(opts.stack_size, "real")
    raw = dict(SIZES[size], num_hidden_layers=layers)
    model_cfg = DeepseekV3Config.from_hf(raw)
    cfgs = [_config(model_cfg, be, batches, prompt, steps, dev) for be in backends]
    for cfg in cfgs:  # before the model is built: a backend that cannot run here is one line
        require_runs(cfg.decode_backend, cfg, cap, "decode")
        require_runs(cfg.prefill_backend, cfg, cap, "prefill")
    _require_model_fits(model_cfg, dev, f"--layers {layers}, --stack-size {size}")
    fixed = {k: getattr(cfgs[0], k) for k in ("page_size", "kv_dtype", "dtype")}  # _config's
    differ = [f"{k} {getattr(config, k)}" for k, v in fixed.items() if getattr(config, k) != v]
    if differ:  # said, not silently replaced: the suite times a real model at one setting
        print(f"stack: times page {fixed['page_size']}, {fixed['kv_dtype']} pools and "
              f"{fixed['dtype']} activations; the config's {', '.join(differ)} not used "
              "(it gives the device and the default backends)")  # fmt: skip
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with out_of_memory(f"--layers {layers}, --stack-size {size}", dev):
        model = random_model(raw, seed=0, device=str(dev), dtype=torch.bfloat16)
    params = sum(t.numel() for t in model.parameters())
    took = time.perf_counter() - t0
    print(f"model: {layers} layers, {params / 1e9:.2f} B params, built in {took:.1f} s")
    rows = []
    # the pools and activations: sized by the largest batch, the prompt, the steps, the layers
    sizes = f"--batch {max(batches)}, --prompt {prompt}, --steps {steps}, --layers {layers}"
    for cfg in cfgs:
        with out_of_memory(sizes, dev):
            rows += run_backend(model, cfg, batches, prompt, steps)
        torch.cuda.empty_cache()
    base = {r["batch"]: r["first_logits"] for r in rows if r["backend"] == rows[0]["backend"]}
    for r in rows:
        first = r.pop("first_logits")
        r["vs_first_backend"] = _rel(first, base[r["batch"]])
        r["vs_first_backend_tokens"] = _per_token(first, base[r["batch"]])
    md = table(rows)
    print(md)
    meta = dict(layers=layers, params=params, prompt=prompt, steps=steps, config=raw, **fixed)
    paths = write(Path(opts.out), {"stack.json": dict(meta=meta, rows=rows), "stack.md": md + "\n"})
    print("wrote " + " and ".join(map(str, paths)))
