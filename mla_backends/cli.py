"""Command-line entry point: `mla-backends verify | run | bench` (`python -m mla_backends ...`).

`--config` is optional everywhere: a YAML path, or the name of a config shipped in the package
(`default`, `deepseek_v3_h100`); without it the shipped default. Bad input ends the command with
one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import torch

from mla_backends.config import Config, ConfigError, load_config

USAGE_ERROR = 2


class UsageError(ValueError):
    """A command-line value that can only be checked against the loaded config (say, more
    requests than the config's pool holds); the message names the option and the range."""


@contextmanager
def out_of_memory(
    options: str, device: torch.device, fix: str = "give smaller values"
) -> Iterator[None]:
    """An allocation inside that runs out of memory: a one-line UsageError naming `options`,
    the values that set the size (e.g. "--batch 64, --kv-len 131072"), not a traceback."""
    try:
        yield
    except (RuntimeError, MemoryError, OverflowError, TypeError) as e:
        if not _too_large(e):
            raise
        raise UsageError(f"{options}: out of memory on {device}; {fix}") from e


# What torch says of a size it cannot allocate: the CPU allocator's plain RuntimeError, and
# sizes past int64 (a size, or the product of a shape's sizes)
_SIZE_ERRORS = (
    "can't allocate memory",
    "Overflow when unpacking long",
    "Storage size calculation overflowed",
    # OverflowError: a size past the C index range (a host list, a range, a shape)
    "into an index-sized integer",
    "too large to convert to C",
)


def _too_large(e: BaseException) -> bool:
    """Whether `e` says an allocation is too large. Other RuntimeErrors (say, "CUDA-graph state
    not allocated") and TypeErrors keep their tracebacks. Python's own MemoryError (a host list
    too long) has no message; ours (OutOfPagesError) have. OverflowError only by its words: a
    float overflow (`math.exp(1000)`, `int(inf)`) is a bug to show, not a size."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    if isinstance(e, MemoryError):
        return not e.args
    return any(words in str(e) for words in _SIZE_ERRORS)


class _StoreOnce(argparse._StoreAction):
    """A value option given twice is an error. Hazard: argparse keeps the last, so
    `bench --batch 1 --batch 2` timed batch 2 alone and `run --random tiny-v32 --random tiny`
    served tiny, silently."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given: set[str] = getattr(parser, "given", set())
        if self.dest in given:
            raise argparse.ArgumentError(self, "given twice")
        given.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad value in one line (no usage block), exit status 2, and
    refuses a value option given twice."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)
        self.given: set[str] = set()

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self.given = set()  # each parse counts afresh (a subcommand's parser counts its own)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            span = f">= {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"{value} is out of range: must be {span}")
        return value

    parse.__name__ = f"integer >= {low}" if high is None else f"integer in {low}..{high}"
    return parse


# torch.manual_seed takes a 64-bit seed; a larger one was an OverflowError traceback
SEED = int_at_least(0, 2**63 - 1)


def int_list(low: int = 1, distinct: bool = True) -> Callable[[str], list[int]]:
    """A comma list of integers >= low, e.g. `1,8,64`; `distinct`: each at most once."""

    def parse(text: str) -> list[int]:
        values = []
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                value = int(part)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{text!r}: {part!r} is not an integer; expected a comma list of "
                    f"integers >= {low}, e.g. 1,8,64"
                ) from None
            if value < low:
                raise argparse.ArgumentTypeError(f"{text!r}: {value} is out of range (>= {low})")
            if distinct and value in values:  # each would be timed again, a row of the same shape
                raise argparse.ArgumentTypeError(f"{text!r}: {value} appears twice")
            values.append(value)
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r}: expected at least one integer")
        return values

    parse.__name__ = "comma list"
    return parse


def existing_dir(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"{text} {what}; expected a checkpoint directory")
    return path


def add_config_argument(p: argparse.ArgumentParser, help_extra: str = "") -> None:
    p.add_argument(
        "--config",
        default=None,
        help="YAML config path, or a shipped config name (default, deepseek_v3_h100); "
        "default: the shipped default" + help_extra,
    )


def _model_sizes(source: str | None, config: Config) -> str:
    """The config's model dims, as an out-of-memory error names them."""
    m = config.model
    return (
        f"{source or 'the shipped default'}: model num_heads {m.num_heads}, kv_lora_rank "
        f"{m.kv_lora_rank}, qk_rope_head_dim {m.qk_rope_head_dim}, qk_nope_head_dim "
        f"{m.qk_nope_head_dim}, v_head_dim {m.v_head_dim}"
    )


def _verify(args: argparse.Namespace) -> int:
    from mla_backends.backends.registry import resolve_backends
    from mla_backends.config import config_source
    from mla_backends.verify import (
        config_summary,
        format_table,
        not_runnable,
        use_triton_interpreter,
        verify,
    )

    # Hazard: the interpreter is set before the backends are resolved: a config naming
    # `triton` on a CPU was refused ("runs only under TRITON_INTERPRET=1") by the very check
    # that then runs it interpreted.
    raw = load_config(args.config, resolve=False)
    interpreted = use_triton_interpreter(raw.torch_device)
    config = resolve_backends(raw, str(config_source(args.config)))
    if interpreted:
        print("triton kernels run under the Triton interpreter on this CPU (TRITON_INTERPRET=1)")
    print(
        f"config {args.config or 'default (shipped)'}: {config.model}, page {config.page_size}, "
        f"kv {config.kv_dtype}, device {config.torch_device}"
    )
    with out_of_memory(_model_sizes(args.config, config), config.torch_device):
        rows = verify(config, seed=args.seed)
    print(format_table(rows))
    skipped = not_runnable(config)
    for name, reason in skipped.items():
        print(f"not run here: {name}: {reason}")
    summary = config_summary(config, rows, skipped)
    print("\n".join(summary))
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    unchecked = any("NOT CHECKED" in line for line in summary)
    return 1 if failed or not rows or unchecked else 0


def build_parser() -> argparse.ArgumentParser:
    from mla_backends import bench
    from mla_backends.bench import cli as bench_cli
    from mla_backends.models import run as run_model

    parser = OneLineParser(prog="mla-backends", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "verify",
        help="check every backend this machine can run against the MHA oracle",
        description="Every backend this machine can run (on a CPU with triton installed, "
        "the triton backend under the Triton interpreter too), decode / verify / extend and "
        "MHA prefill, against the fp64 MHA-expanded reference.",
    )
    add_config_argument(p)
    p.add_argument("--seed", type=SEED, default=0)
    p.set_defaults(func=_verify)
    b = sub.add_parser(
        "bench",
        help="time the backends against raw peers and ceilings (suites: --suite)",
        description=bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_cli.add_arguments(b)
    b.set_defaults(func=bench_cli.run)
    r = sub.add_parser(
        "run",
        help="serve a batch through a DeepSeek-V3 model on the backends",
        description=run_model.__doc__,
    )
    run_model.add_arguments(r)
    r.set_defaults(func=run_model.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from mla_backends.bench.report import close_bars
    from mla_backends.models.loader import CheckpointError

    args = build_parser().parse_args(argv)
    try:
        try:
            return args.func(args)
        finally:
            close_bars()  # an open progress bar would share the error's line
    except ConfigError as e:
        print(f"mla-backends {args.command}: config error: {e}", file=sys.stderr)
    except UsageError as e:
        print(f"mla-backends {args.command}: error: {e}", file=sys.stderr)
    except CheckpointError as e:
        print(f"mla-backends {args.command}: checkpoint error: {e}", file=sys.stderr)
    return USAGE_ERROR


if __name__ == "__main__":  # `python -m mla_backends.cli`
    # Hazard: run as __main__, this module's classes are a second copy; the subcommands raise
    # the imported module's UsageError, which a local main() did not catch (a traceback).
    from mla_backends.cli import main as imported_main

    sys.exit(imported_main())
