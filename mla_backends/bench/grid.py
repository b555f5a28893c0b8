"""The default suite: decode / verify timings of the config's backends (or `--backends`) over
a grid of heads x q_len x batch x kv_len; optionally whole decode steps eager vs one CUDA
graph, the raw peer kernels, and one MHA-mode prefill. Table, `grid.json`, `roofline.png`."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import torch

from mla_backends.backends.base import Capability
from mla_backends.backends.registry import get_backend_class
from mla_backends.bench.fixtures import (
    backend_config,
    decode_setup,
    require_fits,
    setup_config,
    traffic,
)
from mla_backends.bench.options import Options, pick
from mla_backends.bench.ours import time_backend, time_graph
from mla_backends.bench.peers import DECODE_PEERS, RAW_PEER
from mla_backends.bench.prefill import prefill_table
from mla_backends.bench.report import format_table, progress, write
from mla_backends.bench.timing import ceilings
from mla_backends.cli import UsageError, int_list, out_of_memory
from mla_backends.config import Config

# Grid defaults per device: a GPU gets serving sizes, a CPU sizes that finish in seconds.
DEFAULT_GRID = {"cuda": ("1,8,64", "1024,4096"), "cpu": ("1,8", "256,1024")}


def measure(opts: Options, config: Config) -> dict:
    dev = config.torch_device
    cap = Capability.detect(dev)
    names = opts.backends or [config.decode_backend]
    batches, kv_lens = DEFAULT_GRID["cuda" if dev.type == "cuda" else "cpu"]
    batch_sizes = opts.batch or int_list(1)(batches)
    kv_sizes = opts.kv_len or int_list(1)(kv_lens)
    heads = opts.heads or [config.model.num_heads]
    q_lens, layers = pick(opts.q_len, [1]), pick(opts.layers, 8)
    if min(kv_sizes) < max(q_lens):
        raise UsageError(
            f"--kv-len {min(kv_sizes)} is shorter than --q-len {max(q_lens)}: every KV "
            "length must hold the step's query tokens"
        )
    cfgs = {n: backend_config(config, n, cap, heads) for n in names}
    grid = list(itertools.product(heads, q_lens, batch_sizes, kv_sizes))
    graphs = bool(opts.graphs) and dev.type == "cuda"
    raws = [r for r in DECODE_PEERS if opts.raw and dev.type == "cuda"]
    if dev.type != "cuda" and (opts.graphs or opts.raw):
        print(f"--graphs / --raw not run: they need a CUDA GPU (this run is on {dev})")
    if opts.layers is not None and not opts.graphs:
        raise UsageError(
            "--layers: the grid times whole steps of --layers calls only with --graphs"
        )
    for h, q, b, kv in grid:  # before any timing (and before the ceilings' buffers)
        for name, cfg in cfgs.items():
            size = (cfg.page_size, cfg.kv_dtype, cfg.model, str(dev), cfg.dtype)
            require_fits(setup_config(name, h, b, kv, *size), _options(h, q, b, kv))
    result: dict = {
        "device": cap.describe(),
        "torch": torch.__version__,
        "config": opts.config or "default (shipped)",
        "ceilings": ceilings(dev),
        "rows": [],
    }
    if opts.prefill_tokens:  # first: a size that did not fit was refused after the timing
        pre = [n for n in names if get_backend_class(n).supports(cfgs[n], cap, "prefill") is None]
        result["prefill"] = prefill_table(pre, opts.prefill_tokens, heads[0], dev)
    step = progress(len(grid) * len(names))
    for h, q, b, kv in grid:
        row: dict = {"heads": h, "q_len": q, "batch": b, "kv_len": kv}
        for name, cfg in cfgs.items():
            with out_of_memory(_options(h, q, b, kv), dev):
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
                    row[f"{name}_step_eager_us"] = time_backend(s, layers) / layers
                    row[f"{name}_step_graph_us"] = time_graph(s, layers) / layers
                for raw in raws:
                    if f"{raw}_us" not in row and RAW_PEER.get(name) == raw:
                        row[f"{raw}_us"] = DECODE_PEERS[raw](s)
                del s
            step(f"H{h} q{q} B{b} kv{kv} {name}")
        result["rows"].append(row)
    return result


def _options(heads: int, q_len: int, batch: int, kv_len: int) -> str:
    """The options that set one grid point's size, as an error names them."""
    return f"--heads {heads}, --q-len {q_len}, --batch {batch}, --kv-len {kv_len}"


def run(opts: Options, config: Config) -> None:
    result = measure(opts, config)
    out = Path(opts.out)
    (path,) = write(out, {"grid.json": result})
    print(format_table(result))
    if importlib.util.find_spec("matplotlib") is None:
        print(
            f"wrote {path}; roofline plot skipped: matplotlib is not installed "
            "(pip install 'mla-backends[plot]')"
        )
    else:
        from mla_backends.bench.plot import plot_roofline

        plot_roofline(result, out / "roofline.png")
        print(f"wrote {path} and {out / 'roofline.png'}")
