"""`python -m mla_backends bench`: the options, checked at the boundary, and one call of the
chosen suite's `run(options, config)`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from mla_backends.bench import anchors, fi_plan, grid, hopper, linear, metadata, prefill, stack
from mla_backends.bench.options import (
    SUITES,
    Options,
    backend_list,
    peer_list,
    pick,
    shape_list,
    shape_text,
)
from mla_backends.bench.report import check_out
from mla_backends.cli import UsageError, add_config_argument, int_at_least, int_list
from mla_backends.config import Config, ConfigError, PoolSizeError, load_config

# Kernel packages, triton and matplotlib are imported inside the suites' calls, never here.
RUN: dict[str, Callable[[Options, Config], None]] = {
    "grid": grid.run,
    "anchors": anchors.run,
    "prefill": prefill.run,
    "stack": stack.run,
    "linear": linear.run,
    "fi-plan": fi_plan.run,
    "metadata": metadata.run,
    "hopper": hopper.run,
}
assert set(RUN) == set(SUITES)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--suite", choices=list(SUITES), default="grid", help="what to time (default: grid)"
    )
    add_config_argument(p, "; it gives the device and the default backends")
    p.add_argument(
        "--backends",
        type=backend_list,
        help="comma list (default: the config's decode backend; prefill: its prefill "
        "backend); each must be able to run here",
    )
    p.add_argument(
        "--batch",
        type=int_list(1),
        help=f"batch sizes, comma list (grid default: {grid.DEFAULT_GRID['cuda'][0]} on a GPU, "
        f"{grid.DEFAULT_GRID['cpu'][0]} on a CPU; stack: 1,8,32,64; linear: 1,16,64,256; "
        "fi-plan: 256)",
    )
    p.add_argument(
        "--kv-len",
        type=int_list(1),
        help=f"KV lengths, comma list (default: {grid.DEFAULT_GRID['cuda'][1]} on a GPU, "
        f"{grid.DEFAULT_GRID['cpu'][1]} on a CPU)",
    )
    p.add_argument(
        "--heads",
        type=int_list(1),
        help="query heads (grid default: the config's; prefill: 128, one value; linear: 32)",
    )
    p.add_argument("--q-len", type=int_list(1), help="1 = decode (default), >1 = target-verify")
    p.add_argument(
        "--graphs",
        action="store_true",
        default=None,
        help="also time whole decode steps, eager vs one CUDA graph (see --layers)",
    )
    p.add_argument(
        "--layers",
        type=int_at_least(1),
        help="grid: attention layers per decode step for --graphs (default 8; eager step: "
        "metadata + L calls; graph step: input staging + metadata refill + one replay); "
        "stack: model layers (default 4)",
    )
    p.add_argument(
        "--raw", action="store_true", default=None, help="add raw FlashMLA / FlashInfer rows"
    )
    p.add_argument(
        "--prefill-tokens",
        type=int_at_least(0),
        help="also time one causal MHA-mode prefill of this many tokens (grid default 0 = "
        "none; anchors: 8192, 2048 with --quick, 0 = none; prefill: 8192; on a CPU both "
        f"{prefill.CPU_TOKENS})",
    )
    p.add_argument(
        "--peers",
        type=peer_list,
        help="anchors: raw peer kernels, comma list or none (default on a GPU: the peers of "
        "--backends; on a CPU: none)",
    )
    p.add_argument(
        "--shapes",
        type=shape_list,
        help=f"anchors: H:q:B:kv comma list (default: the {len(anchors.ANCHOR_SHAPES)} shapes of "
        "the project's reference table, anchors.ANCHOR_SHAPES); hopper: replaces the part's "
        "shapes",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        default=None,
        help="anchors: the first 3 shapes and a 2048-token prefill",
    )
    p.add_argument("--prompt", type=int_at_least(2), help="stack: mean prompt length (1024)")
    p.add_argument("--steps", type=int_at_least(2), help="stack: timed decode steps (20)")
    p.add_argument(
        "--stack-size",
        choices=list(stack.SIZES),
        help="stack: real-size DeepSeek-V3 layers (default) or a small random model",
    )
    p.add_argument("--head-dim", type=int_at_least(1), help="linear: K = V per head (128)")
    p.add_argument(
        "--cprofile",
        action="store_true",
        default=None,
        help="fi-plan: also print where the host time of the whole call goes",
    )
    p.add_argument(
        "--part",
        choices=list(hopper.PARTS),
        help="hopper: which table (default small; see mla_backends/bench/hopper.py)",
    )
    p.add_argument(
        "--out",
        type=_out_folder,
        default="bench-out",
        help="folder for the JSON, tables and plot (default bench-out); each suite writes its own "
        "files, named after it (grid.json, anchors.json, prefill.json, hopper-PART.json, ...), "
        "replacing those of an earlier run of the same suite there",
    )


def _out_folder(text: str) -> str:
    """A non-empty folder name (an empty one wrote into the working directory, silently)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a folder name, got an empty string")
    return text


def run(args: argparse.Namespace) -> int:
    opts = Options.from_args(args)
    opts.check_applies()
    config = load_config(opts.config)
    if config.dcp_size > 1:  # every suite times one process over the whole KV
        raise ConfigError(
            f"{opts.config}: dcp_size={config.dcp_size}: bench times one process; use "
            "dcp_size: 1 (scripts/bench_dcp.py times decode context parallelism)"
        )
    check_out(Path(opts.out), out_files(opts))
    try:
        RUN[opts.suite](opts, config)
    except PoolSizeError as e:  # the suites size each pool from the options, not num_pages
        raise UsageError(f"{_size_options(opts)}: {e}") from None
    return 0


# The files each suite writes under --out (each suite's `write` call), checked before timing
OUT_FILES: dict[str, tuple[str, ...]] = {
    "grid": ("grid.json", "roofline.png"),
    "anchors": ("anchors.json",),
    "prefill": ("prefill.json",),
    "stack": ("stack.json", "stack.md"),
    "linear": ("linear.json", "linear.md"),
    "fi-plan": ("fi-plan.json",),
    "metadata": ("metadata.json",),
    "hopper": ("hopper-{part}.json", "hopper-{part}.md"),
}
assert set(OUT_FILES) == set(SUITES)


def out_files(opts: Options) -> list[str]:
    """The files `opts.suite` writes under --out (hopper's named after its --part)."""
    part = pick(opts.part, "small")
    return [name.format(part=part) for name in OUT_FILES[opts.suite]]


def _size_options(opts: Options) -> str:
    """The options given that size a suite's pools, as an error names them."""
    given = [
        f"--{name.replace('_', '-')} {_text(getattr(opts, name))}"
        for name in ("heads", "q_len", "batch", "kv_len", "shapes", "prompt", "steps")
        if getattr(opts, name) is not None
    ]
    return ", ".join(given) or f"--suite {opts.suite}"


def _text(value: object) -> str:
    """An option's value as given: `1,8`, `16:1:64:4096`, `1024`."""
    if not isinstance(value, list):
        return str(value)
    return ",".join(shape_text(v) if isinstance(v, tuple) else str(v) for v in value)
