"""The `bench` options as one typed record, which suite takes which, and the value parsers.

Every option but `--suite`, `--config` and `--out` defaults to None ("not given"): each suite
fills in its own default (`pick`), and an option given to a suite that does not take it is a
one-line usage error (`check_applies`) instead of being ignored."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from typing import TypeVar

from mla_backends.backends.registry import available_backends
from mla_backends.bench.peers import DECODE_PEERS
from mla_backends.cli import UsageError

T = TypeVar("T")
Shape = tuple[int, int, int, int]  # heads, q_len, batch, kv_len

SUITES: dict[str, tuple[str, ...]] = {
    "grid": (
        "backends", "batch", "kv_len", "heads", "q_len", "graphs", "layers", "raw",
        "prefill_tokens",
    ),
    "anchors": ("backends", "peers", "shapes", "quick", "prefill_tokens"),
    "prefill": ("backends", "heads", "prefill_tokens"),
    "stack": ("backends", "batch", "layers", "prompt", "steps", "stack_size"),
    "linear": ("batch", "heads", "head_dim"),
    "fi-plan": ("batch", "cprofile"),
    "metadata": ("backends", "batch"),
    "hopper": ("part", "shapes"),
}  # fmt: skip


@dataclass(frozen=True)
class Options:
    suite: str = "grid"
    config: str | None = None
    out: str = "bench-out"
    backends: list[str] | None = None
    batch: list[int] | None = None
    kv_len: list[int] | None = None
    heads: list[int] | None = None
    q_len: list[int] | None = None
    graphs: bool | None = None
    layers: int | None = None
    raw: bool | None = None
    prefill_tokens: int | None = None
    peers: list[str] | None = None
    shapes: list[Shape] | None = None
    quick: bool | None = None
    prompt: int | None = None
    steps: int | None = None
    stack_size: str | None = None
    head_dim: int | None = None
    cprofile: bool | None = None
    part: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Options:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def check_applies(self) -> None:
        """UsageError naming the first option given that this suite does not take."""
        takes = SUITES[self.suite]
        for f in dataclasses.fields(self):
            if f.name in ("suite", "config", "out") or getattr(self, f.name) is None:
                continue
            if f.name not in takes:
                opts = ", ".join("--" + t.replace("_", "-") for t in takes)
                raise UsageError(
                    f"--{f.name.replace('_', '-')} does not apply to --suite {self.suite} "
                    f"(it takes {opts}, --config, --out)"
                )

    def one_heads(self, default: int) -> int:
        """The single head count of a suite that times one (`--heads` given once)."""
        heads = pick(self.heads, [default])
        if len(heads) != 1:
            raise UsageError(f"--heads takes one value with --suite {self.suite}, got {heads}")
        return heads[0]


def pick(value: T | None, default: T) -> T:
    return default if value is None else value


def backend_list(text: str) -> list[str]:
    """A comma list of backend names the registry knows (whether they run here is checked
    against the config, at run time)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = available_backends()
    if not names:  # `--backends ,` would fall back to the config's backend unnoticed
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected backend names; known: {', '.join(known)}"
        )
    for n in names:
        if n not in known:
            raise argparse.ArgumentTypeError(f"unknown backend {n!r}; known: {', '.join(known)}")
    _refuse_repeats(text, names)
    return names


def _refuse_repeats(text: str, names: list[str]) -> None:
    # a name given twice was timed twice, its rows side by side under one name
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"{text!r}: {', '.join(repeated)} given twice")


def peer_list(text: str) -> list[str]:
    """A comma list of raw peer kernels, or `none`."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["none"]:
        return []
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected peer names, or none")
    for n in names:
        if n not in DECODE_PEERS:
            raise argparse.ArgumentTypeError(
                f"unknown peer {n!r}; known: {', '.join(DECODE_PEERS)}, or none"
            )
    _refuse_repeats(text, names)
    return names


def shape_text(shape: Shape) -> str:
    """One shape as `--shapes` takes it (H:q:B:kv)."""
    return "{}:{}:{}:{}".format(*shape)


def shape_list(text: str) -> list[Shape]:
    """A comma list of H:q:B:kv shapes (heads, query tokens, batch, KV length), e.g.
    16:1:64:4096; every KV length must hold the step's query tokens."""
    shapes: list[Shape] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        # Hazard: an empty field (`16:1::64:4096`) was skipped, the next one moving into it
        fields = [f.strip() for f in part.split(":")]
        if len(fields) != 4 or not all(re.fullmatch(r"0*[1-9][0-9]*", f) for f in fields):
            raise argparse.ArgumentTypeError(
                f"{part!r} is not H:q:B:kv (four integers >= 1, e.g. 16:1:64:4096)"
            )
        h, q, b, kv = (int(f) for f in fields)
        if kv < q:
            raise argparse.ArgumentTypeError(f"{part!r}: kv {kv} is shorter than q {q}")
        if (h, q, b, kv) in shapes:  # it was timed twice, its rows side by side
            raise argparse.ArgumentTypeError(f"{text!r}: {part} given twice")
        shapes.append((h, q, b, kv))
    if not shapes:
        raise argparse.ArgumentTypeError(f"{text!r}: expected at least one H:q:B:kv shape")
    return shapes
