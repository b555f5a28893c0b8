"""`bench`: decode / verify timings (eager, through CUDA graphs, and the raw peer kernels) for
the backends of a config over a grid, plus MHA-mode prefill on a GPU, against the copy and
matmul ceilings measured at the start of the same run. Writes a table (stdout), `bench.json`
and a roofline plot `roofline.png` under `--out`."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
from pathlib import Path

import torch

from mla_backends.backends.base import Capability
from mla_backends.backends.registry import available_backends, get_backend_class
from mla_backends.benchmark import (
    RAW_PEER,
    ceilings,
    decode_setup,
    prefill_table,
    time_backend,
    time_flashinfer,
    time_flashmla,
    time_graph,
    traffic,
)
from mla_backends.cli import UsageError, add_config_argument, int_at_least, int_list
from mla_backends.config import Config, ConfigError, load_config

RAW = {"raw_flashmla": time_flashmla, "raw_flashinfer_fa3": time_flashinfer}
# Grid defaults per device: a GPU gets serving sizes, a CPU sizes that finish in seconds.
DEFAULT_GRID = {"cuda": ("1,8,64", "1024,4096"), "cpu": ("1,8", "256,1024")}


def backend_list(text: str) -> list[str]:
    """A comma list of backend names the registry knows (whether they run here is checked
    against the config, at run time)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = available_backends()
    for n in names:
        if n not in known:
            raise argparse.ArgumentTypeError(f"unknown backend {n!r}; known: {', '.join(known)}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_argument(p)
    p.add_argument(
        "--backends",
        type=backend_list,
        default=[],
        help="comma list (default: the config's decode backend); each must be able to run here",
    )
    p.add_argument(
        "--batch",
        type=int_list(1),
        default=None,
        help=f"batch sizes, comma list (default: {DEFAULT_GRID['cuda'][0]} on a GPU, "
        f"{DEFAULT_GRID['cpu'][0]} on a CPU)",
    )
    p.add_argument(
        "--kv-len",
        type=int_list(1),
        default=None,
        help=f"KV lengths, comma list (default: {DEFAULT_GRID['cuda'][1]} on a GPU, "
        f"{DEFAULT_GRID['cpu'][1]} on a CPU)",
    )
    p.add_argument(
        "--heads", type=int_list(1), default=None, help="query heads (default: the config's)"
    )
    p.add_argument("--q-len", type=int_list(1), default=[1], help="1 = decode, >1 = target-verify")
    p.add_argument(
        "--graphs",
        action="store_true",
        help="also time whole decode steps, eager vs one CUDA graph (see --layers)",
    )
    p.add_argument(
        "--layers",
        type=int_at_least(1),
        default=8,
        help="attention layers per decode step for --graphs (eager step: metadata "
        "+ L calls; graph step: input staging + metadata refill + one replay)",
    )
    p.add_argument("--raw", action="store_true", help="add raw FlashMLA / FlashInfer rows")
    p.add_argument(
        "--prefill-tokens",
        type=int_at_least(0),
        default=0,
        help="GPU: also time one causal MHA-mode prefill of this many tokens",
    )
    p.add_argument("--out", default="bench-out", help="folder for bench.json, roofline.png")


def _backend_config(config: Config, name: str, cap: Capability, heads: list[int]) -> Config:
    """The config with `name` as decode backend, at a page size it takes for every head count
    of the grid; a ConfigError naming the backend and the reason if there is none."""
    cls = get_backend_class(name)
    reason = None
    for page in (config.page_size, *cls.caps.page_sizes):
        cfg = dataclasses.replace(config, page_size=page, decode_backend=name)
        reasons = [
            cls.supports(dataclasses.replace(cfg, model=cfg.model.with_heads(h)), cap, "decode")
            for h in heads
        ]
        reason = next((r for r in reasons if r is not None), None)
        if reason is None:
            return cfg
    raise ConfigError(f"--backends: {name!r} cannot run here: {reason}")


def run(args: argparse.Namespace) -> dict:
    config = load_config(args.config)
    dev = config.torch_device
    cap = Capability.detect(dev)
    names = args.backends or [config.decode_backend]
    batches, kv_lens = DEFAULT_GRID["cuda" if dev.type == "cuda" else "cpu"]
    batch_sizes = args.batch or int_list(1)(batches)
    kv_sizes = args.kv_len or int_list(1)(kv_lens)
    heads = args.heads or [config.model.num_heads]
    if min(kv_sizes) < max(args.q_len):
        raise UsageError(
            f"--kv-len {min(kv_sizes)} is shorter than --q-len {max(args.q_len)}: every KV "
            "length must hold the step's query tokens"
        )
    cfgs = {n: _backend_config(config, n, cap, heads) for n in names}
    grid = list(itertools.product(heads, args.q_len, batch_sizes, kv_sizes))
    graphs = args.graphs and dev.type == "cuda"
    raws = [r for r in RAW if args.raw and dev.type == "cuda"]
    result: dict = {
        "device": cap.describe(),
        "torch": torch.__version__,
        "config": args.config or "default (shipped)",
        "ceilings": ceilings(dev),
        "rows": [],
    }
    progress = _progress(len(grid) * len(names))
    for h, q, b, kv in grid:
        row: dict = {"heads": h, "q_len": q, "batch": b, "kv_len": kv}
        for name, cfg in cfgs.items():
            s = decode_setup(
                name,
                h,
                q,
                b,
                kv,
                cfg.page_size,
                cfg.kv_dtype,
                dims=cfg.model,
                device=str(dev),
                dtype=cfg.dtype,
            )
            row["bytes"], row["flops"] = traffic(s)
            row[f"{name}_us"] = time_backend(s)
            if graphs and get_backend_class(name).caps.graphs:
                # whole decode steps of --layers calls: bytes and FLOPs scale with L
                row[f"{name}_step_eager_us"] = time_backend(s, args.layers) / args.layers
                row[f"{name}_step_graph_us"] = time_graph(s, args.layers) / args.layers
            for raw in raws:
                if f"{raw}_us" not in row and RAW_PEER.get(name) == raw:
                    row[f"{raw}_us"] = RAW[raw](s)
            del s
            progress(f"H{h} q{q} B{b} kv{kv} {name}")
        result["rows"].append(row)
    if args.prefill_tokens and dev.type == "cuda":
        pre = [n for n in names if get_backend_class(n).supports(cfgs[n], cap, "prefill") is None]
        result["prefill"] = prefill_table(pre, args.prefill_tokens, heads[0])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    print(format_table(result))
    if importlib.util.find_spec("matplotlib") is None:
        print(
            f"wrote {out / 'bench.json'}; roofline plot skipped: matplotlib is not installed "
            "(pip install 'mla-backends[plot]')"
        )
    else:
        plot_roofline(result, out / "roofline.png")
        print(f"wrote {out / 'bench.json'} and {out / 'roofline.png'}")
    return result


def _progress(total: int):  # type: ignore[no-untyped-def]
    try:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="case")

        def step(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update(1)
            if bar.n == total:
                bar.close()
    except ImportError:
        done = [0]

        def step(label: str) -> None:
            done[0] += 1
            print(f"[{done[0]}/{total}] {label}", flush=True)

    return step


def _timings(row: dict) -> list[tuple[str, float]]:
    return [(k[:-3], v) for k, v in row.items() if k.endswith("_us") and v == v]


def _ceiling_words(c: dict) -> tuple[str, str]:
    """(what the two rates are, column suffix): ceilings on a GPU, references on a CPU."""
    # Files written before the CPU references were labelled carry no `is_ceiling`: GPU runs.
    if c.get("is_ceiling", True):
        return "ceilings measured at the start of this run", ""
    return (
        "reference rates measured at the start of this run, NOT ceilings: KV that fits in "
        "the CPU caches reads faster than this copy, so the % columns can pass 100",
        " ref",
    )


def format_table(result: dict) -> str:
    c = result["ceilings"]
    words, ref = _ceiling_words(c)
    lines = [
        f"{result['device']}: copy {c['copy_gbps']:.1f} GB/s "
        f"({c.get('copy_what', 'bf16 copy')}), {c['matmul_tflops']:.3g} TFLOP/s "
        f"({c.get('matmul_what', 'bf16 matmul')}); {words}",
        f"{'H':>4}{'q':>3}{'B':>5}{'kv':>7}  {'path':<28}{'us':>10}{'GB/s':>9}"
        f"{'% copy' + ref:>11}{'TFLOP/s':>9}{'% mm' + ref:>9}",
    ]
    for r in result["rows"]:
        for name, us in _timings(r):
            gbps, tflops = r["bytes"] / us / 1e3, r["flops"] / us / 1e6
            lines.append(
                f"{r['heads']:>4}{r['q_len']:>3}{r['batch']:>5}{r['kv_len']:>7}  "
                f"{name:<28}{us:>10.1f}{gbps:>9.2f}{100 * gbps / c['copy_gbps']:>10.0f}%"
                f"{tflops:>9.4f}{100 * tflops / c['matmul_tflops']:>8.0f}%"
            )
    return "\n".join(lines)


def plot_roofline(result: dict, path: Path) -> None:
    """Achieved TFLOP/s against arithmetic intensity, with both ceilings drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = result["ceilings"]
    kind = "ceiling" if c.get("is_ceiling", True) else "reference (not a ceiling)"
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ai_all = [r["flops"] / r["bytes"] for r in result["rows"]]
    lo, hi = min(ai_all) / 2, max(ai_all) * 4
    xs = [lo * (hi / lo) ** (i / 99) for i in range(100)]
    bw = [c["copy_gbps"] * x / 1e3 for x in xs]
    ax.plot(xs, bw, "b--", lw=1, label=f"copy {kind} {c['copy_gbps']:.3g} GB/s")
    ax.axhline(
        c["matmul_tflops"],
        color="r",
        ls="--",
        lw=1,
        label=f"{c.get('matmul_what', 'bf16 matmul')} {kind} {c['matmul_tflops']:.3g} TFLOP/s",
    )
    if c.get("is_ceiling", True):
        ax.plot(xs, [min(b, c["matmul_tflops"]) for b in bw], "k-", lw=2, label="roofline")
    markers = itertools.cycle("osD^v<>ph*")
    names = sorted({n for r in result["rows"] for n, _ in _timings(r)})
    for name, m in zip(names, markers):
        pts = [
            (r["flops"] / r["bytes"], r["flops"] / r[f"{name}_us"] / 1e6)
            for r in result["rows"]
            if f"{name}_us" in r
        ]
        ax.scatter(*zip(*pts), marker=m, label=name, alpha=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte of KV cache + q + out)")
    ax.set_ylabel("achieved TFLOP/s")
    title = f"MLA decode on {result['device']}"
    ax.set_title(title if c.get("is_ceiling", True) else title + ": reference rates, not ceilings")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
