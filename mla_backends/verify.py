"""`verify`: every backend that can run here, a mix of random batches, vs the MHA oracle;
then every sparse (DeepSeek-V3.2) backend that can run here vs the sparse reference."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import sys
from dataclasses import dataclass

import torch

from mla_backends.backends.base import Capability
from mla_backends.backends.registry import available_backends, get_backend_class
from mla_backends.batch import ForwardMode
from mla_backends.config import Config
from mla_backends.testing import DTYPE_PAIRS, Case, Result, edge_kv_lens, run_case, run_mha_case

# The MHA-mode prefill rows of every backend with a prefill path: (mode, q_lens, kv_lens, causal).
_MHA_CASES: tuple[tuple[str, tuple[int, ...], tuple[int, ...], bool], ...] = (
    ("mha-prefill", (1, 9, 30), (1, 9, 30), True),
    ("mha-prefix-chunk", (4, 7, 2), (0, 20, 5), False),
)


@dataclass(frozen=True)
class Row:
    backend: str
    mode: str
    dtype: str
    out_err: float
    lse_err: float
    ok: bool
    detail: str


def use_triton_interpreter(device: torch.device) -> bool:
    """On a CPU with triton installed, run the Triton kernels under Triton's interpreter
    (sets TRITON_INTERPRET=1 for this process); True if they will run interpreted.

    Hazard: Triton (3.4 through 3.9, `knobs.runtime.interpret`) reads TRITON_INTERPRET when
    `@triton.jit` wraps a kernel, i.e. when a kernel module is first imported: kernels already
    imported stay compiled-only, so then this leaves the setting alone and returns False."""
    if device.type != "cpu" or importlib.util.find_spec("triton") is None:
        return False
    if "TRITON_INTERPRET" in os.environ:  # the user's choice stands
        return os.environ["TRITON_INTERPRET"] == "1"
    loaded = [m for m in sys.modules if m.startswith("mla_backends.kernels.")]
    if any(m != "mla_backends.kernels.common" for m in loaded):
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True


def _runnable_config(config: Config, name: str, cap: Capability, role: str) -> Config | None:
    """The config with `name` in both roles, at the config's page size or the backend's."""
    cls = get_backend_class(name)
    for page in (config.page_size, *cls.caps.page_sizes):
        cfg = dataclasses.replace(config, page_size=page, prefill_backend=name, decode_backend=name)
        if cls.supports(cfg, cap, role) is None:
            return cfg
    return None


def not_runnable(config: Config) -> dict[str, str]:
    """The backends `verify` skips on this machine, each with the reason it gives at a page
    size it takes; then the sparse ones ("sparse:NAME")."""
    from mla_backends.sparse.verify import not_runnable_sparse

    cap = Capability.detect(config.torch_device)
    reasons = {}
    for name in available_backends():
        if _runnable_config(config, name, cap, "decode") is None:
            cls = get_backend_class(name)
            pages = cls.caps.page_sizes
            page = config.page_size if config.page_size in pages else pages[0]
            cfg = dataclasses.replace(
                config, page_size=page, prefill_backend=name, decode_backend=name
            )
            reasons[name] = cls.supports(cfg, cap, "decode") or "no page size it takes fits"
    return reasons | not_runnable_sparse(config.torch_device, config.model.num_heads)


def config_dtypes(config: Config) -> str:
    """The config's own (dtype, kv_dtype) as the rows name it: a DTYPE_PAIRS key, else
    "act/kv"."""
    pair = (config.dtype, config.kv_dtype)
    return next((k for k, p in DTYPE_PAIRS.items() if p == pair), "/".join(pair))


def _dtype_pairs(config: Config) -> dict[str, tuple[str, str]]:
    """The config's own pair first, then bf16 over FP8 (every backend's FP8 path). Hazard:
    the rows once took every pair with the config's kv_dtype, so a config's fp16 queries
    over FP8 were never run, yet its backends were reported as passing."""
    return {config_dtypes(config): (config.dtype, config.kv_dtype), "fp8": DTYPE_PAIRS["fp8"]}


def _row(r: Result, name: str, mode: str, dtype: str) -> Row:
    return Row(name, mode, dtype, r.out_err, r.lse_err, r.ok, r.detail)


def verify(config: Config, seed: int = 0) -> list[Row]:
    cap = Capability.detect(config.torch_device)
    rows: list[Row] = []
    modes = {
        "decode": (ForwardMode.DECODE, 1),
        "verify": (ForwardMode.TARGET_VERIFY, 3),
        "extend": (ForwardMode.EXTEND, 0),
    }
    for name in available_backends():
        cfg = _runnable_config(config, name, cap, "decode")
        if cfg is None:
            continue
        for dt, (act, kv) in _dtype_pairs(cfg).items():
            probe = dataclasses.replace(cfg, kv_dtype=kv, dtype=act)
            if get_backend_class(name).supports(probe, cap, "decode") is not None:
                continue
            for mode_name, (mode, q) in modes.items():
                if mode is ForwardMode.EXTEND and get_backend_class(name).supports(
                    probe, cap, "prefill"
                ):
                    continue
                case = Case(
                    name,
                    mode,
                    cfg.page_size,
                    cfg.model.num_heads,
                    kv,
                    act,
                    q,
                    edge_kv_lens(cfg.page_size, max(q, 1), long=120),
                    dims=cfg.model,
                    seed=seed,
                )
                rows.append(_row(run_case(case, cfg.torch_device), name, mode_name, dt))
        pcfg = _runnable_config(config, name, cap, "prefill")
        if pcfg is not None:
            act = config.dtype
            for mode_name, q_lens, kv_lens, causal in _MHA_CASES:
                r = run_mha_case(
                    name,
                    list(q_lens),
                    list(kv_lens),
                    causal,
                    act,
                    cfg.model.num_heads,
                    cfg.model,
                    cfg.torch_device,
                    seed,
                )
                rows.append(_row(r, name, mode_name, act))
    from mla_backends.sparse.verify import verify_sparse  # DeepSeek-V3.2 sparse attention

    rows += verify_sparse(config.torch_device, config.model.num_heads, seed)
    if config.dcp_size > 1:
        rows += _dcp_rows(config, seed)
    return rows


def _dcp_rows(config: Config, seed: int) -> list[Row]:
    """The config's backends over dcp_size ranks (`mla_backends.dcp.verify`), a row a case."""
    from mla_backends.dcp import verify as dcp
    from mla_backends.dcp.launch import RankFailed

    dtype = config_dtypes(config)
    try:
        results = dcp.verify_dcp(config, seed)
    except RankFailed as e:  # a rank raised: one failing row with its last line, not a traceback
        last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        return [Row(dcp.label(config), "a rank raised", dtype, math.nan, math.nan, False, last)]
    return [
        Row(dcp.label(config), dcp.mode_name(r["case"]), dtype, r["out_err"], r["lse_err"],
            r["ok"], r["detail"])
        for r in results
    ]  # fmt: skip


def config_summary(
    config: Config, rows: list[Row], skipped: dict[str, str] | None = None
) -> list[str]:
    """What `verify` says of the config's own choices: the rows of the backends it names
    (every sparse backend's when sparse_backend is auto, resolved only with a model's indexer
    dims), and the settings it does not check. Hazard: a table of PASS rows reads as "my
    config is fine" even where the config's backend had no row or its DCP was never run.
    skipped: `not_runnable(config)` where the caller has it (the sparse reasons are then not
    asked of `supports` a second time)."""
    names = dict.fromkeys((config.decode_backend, config.prefill_backend))
    own = config_dtypes(config)  # rows of other dtype pairs say nothing of this config
    mine = [r for r in rows if r.backend in names and (r.dtype == own or r.mode.startswith("mha"))]
    sparse = config.sparse_backend
    sparse_rows = [r for r in rows if r.backend.startswith("sparse:")]
    if sparse != "auto":
        sparse_rows = [r for r in sparse_rows if r.backend == f"sparse:{sparse}"]
    sparse_why = None if sparse_rows else _sparse_why(config, skipped)
    groups: list[tuple[str, list[Row], str | None]] = [
        ("backends " + " / ".join(names), mine, None),
        (f"sparse_backend {sparse}", sparse_rows, sparse_why),
    ]
    if config.dcp_size > 1:
        from mla_backends.dcp import verify as dcp

        dcp_rows = [r for r in rows if r.backend == dcp.label(config)]
        what = f"dcp_size {config.dcp_size} ({config.dcp_heads} heads) over {config.decode_backend}"
        groups.append((what, dcp_rows, dcp.unrunnable(config)))
    lines = []
    for label, picks, why_not in groups:
        failed = sum(not r.ok for r in picks)
        verdict = (
            f"{failed} of {len(picks)} rows FAIL"
            if failed
            else f"{len(picks)} of {len(picks)} rows pass"
            if picks
            else f"NOT CHECKED: {why_not or 'no row of it ran here'}"
        )
        lines.append(f"this config's {label}: {verdict}")
    return lines


def _sparse_why(config: Config, skipped: dict[str, str] | None = None) -> str | None:
    """Why the config's named sparse backend ran no row here (None for "auto"), from
    `skipped` (`not_runnable`'s) when given."""
    from mla_backends.sparse.verify import not_runnable_sparse

    name = config.sparse_backend
    if name == "auto":
        return None
    if skipped is None:
        skipped = not_runnable_sparse(config.torch_device, config.model.num_heads, [name])
    return skipped.get(f"sparse:{name}")


def format_table(rows: list[Row]) -> str:
    head = f"{'backend':<16}{'mode':<24}{'dtype':<10}{'out err':>11}{'lse err':>11}  verdict"
    lines = [head, "-" * len(head)]
    for r in rows:
        verdict = "PASS" if r.ok else f"FAIL {r.detail}"
        lines.append(
            f"{r.backend:<16}{r.mode:<24}{r.dtype:<10}"
            f"{r.out_err:>11.2e}{r.lse_err:>11.2e}  {verdict}"
        )
    return "\n".join(lines)
