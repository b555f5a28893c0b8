"""Command-line entry point: `python -m mla_backends verify --config configs/default.yaml`."""

from __future__ import annotations

import argparse
import sys

from mla_backends.config import ConfigError, load_config


def _verify(args: argparse.Namespace) -> int:
    from mla_backends.verify import format_table, verify

    config = load_config(args.config)
    print(
        f"config {args.config}: {config.model}, page {config.page_size}, "
        f"kv {config.kv_dtype}, device {config.torch_device}"
    )
    rows = verify(config, seed=args.seed)
    print(format_table(rows))
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed or not rows else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mla-backends", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("verify", help="check every runnable backend against the MHA oracle")
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_verify)
    from mla_backends import bench

    b = sub.add_parser(
        "bench",
        help="time the config's backends over a grid; table, JSON, roofline plot",
        description=bench.__doc__,
    )
    bench.add_arguments(b)
    b.set_defaults(func=lambda a: bench.run(a) and 0)
    from mla_backends.models import run as run_model

    r = sub.add_parser(
        "run",
        help="serve a batch through a DeepSeek-V3 model on the backends",
        description=run_model.__doc__,
    )
    run_model.add_arguments(r)
    r.set_defaults(func=run_model.run)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
