"""The decode table of ../shared/ANCHORS.md: our backends against the raw peer kernels over
its shapes (DeepSeek-V3 dims, page 64, bf16), in one run, with the ceilings measured at its
start; then the MHA-mode prefill table. `anchors.json` holds `decode` and `prefill`."""

from __future__ import annotations

from pathlib import Path

import torch

from mla_backends.backends.base import Capability
from mla_backends.backends.registry import get_backend_class
from mla_backends.bench.fixtures import (
    decode_setup,
    require_fits,
    require_runs,
    setup_config,
    traffic,
)
from mla_backends.bench.options import Options, Shape, pick, shape_text
from mla_backends.bench.ours import time_backend
from mla_backends.bench.peers import DECODE_PEERS, RAW_PEER
from mla_backends.bench.prefill import check_prefill_backends, default_tokens, prefill_table
from mla_backends.bench.report import format_result, write
from mla_backends.bench.timing import ceilings
from mla_backends.cli import UsageError, out_of_memory
from mla_backends.config import Config

# (heads, q_len, batch, kv_len): the decode table of ../shared/ANCHORS.md.
ANCHOR_SHAPES: list[Shape] = [
    (16, 1, 1, 4096),
    (16, 1, 16, 4096),
    (16, 1, 64, 4096),
    (16, 1, 128, 8192),
    (16, 1, 256, 1024),
    (16, 2, 128, 8192),
    (128, 1, 1, 4096),
    (128, 1, 16, 4096),
    (128, 1, 64, 4096),
    (128, 1, 128, 8192),
    (128, 1, 256, 1024),
    (128, 2, 64, 4096),
    (128, 2, 128, 8192),
]
QUICK_SHAPES = ANCHOR_SHAPES[:3]
PREFILL_HEADS = 128


def decode_table(
    backends: list[str],
    peers: list[str],
    shapes: list[Shape] = ANCHOR_SHAPES,
    device: str = "cuda",
) -> list[dict]:
    """One row per shape: each backend's call (`<name>_us`), then each peer on the first
    backend's setup (`<peer>_us`, or `<peer>_error` where it cannot run), bytes and FLOPs."""
    rows = []
    for shape in shapes:
        heads, q_len, batch, kv_len = shape
        row: dict = {"heads": heads, "q_len": q_len, "batch": batch, "kv_len": kv_len}
        setups = {}
        with out_of_memory(f"--shapes {shape_text(shape)}", torch.device(device)):
            for name in backends:
                setups[name] = s = decode_setup(name, heads, q_len, batch, kv_len, device=device)
                row[f"{name}_us"] = time_backend(s)
        base = next(iter(setups.values()))
        nbytes, flops = traffic(base)
        row["bytes"], row["flops"] = nbytes, flops
        for peer in peers:
            try:
                row[f"{peer}_us"] = DECODE_PEERS[peer](base)
            except Exception as e:  # a peer that cannot run here is reported, not fatal
                row[f"{peer}_error"] = f"{type(e).__name__}: {e}"[:200]
        del setups, base
        torch.cuda.empty_cache()
        rows.append(row)
    return rows


def run(opts: Options, config: Config) -> None:
    dev = config.torch_device
    cap = Capability.detect(dev)
    backends = opts.backends or [config.decode_backend]
    default_peers = [RAW_PEER[b] for b in backends if b in RAW_PEER and dev.type == "cuda"]
    peers = pick(opts.peers, list(dict.fromkeys(default_peers)))
    if opts.quick and opts.shapes:  # --quick was ignored, silently
        raise UsageError("--quick picks the first 3 shapes: give it or --shapes, not both")
    shapes = opts.shapes or (QUICK_SHAPES if opts.quick else ANCHOR_SHAPES)
    tokens = pick(opts.prefill_tokens, default_tokens(dev, 2048 if opts.quick else 8192))
    for shape in shapes:  # every backend runs every shape and fits, or nothing is timed
        h, _, b, kv = shape
        for name in backends:
            cfg = setup_config(name, h, b, kv, device=str(dev))
            require_runs(name, cfg, cap)
            require_fits(cfg, f"--shapes {shape_text(shape)}")
    prefill = [b for b in backends if "prefill" in get_backend_class(b).caps.roles]
    if tokens:
        check_prefill_backends(prefill, PREFILL_HEADS, dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cap.describe()
    result: dict = {"device": name, "torch": torch.__version__, "ceilings": ceilings(dev)}
    if tokens:  # first: a size that did not fit was refused after the decode rows' timing
        result["prefill"] = prefill_table(prefill, tokens, PREFILL_HEADS, dev)
    result["decode"] = decode_table(backends, peers, shapes, str(dev))
    (path,) = write(Path(opts.out), {"anchors.json": result})
    print(format_result(result, backends, peers))
    print(f"wrote {path}")
