"""Tables, progress and files: the grid table (one row per shape and path, rates against the
run's ceilings), the ANCHORS decode table (our backends beside the raw peers, with ratios),
the prefill lines, and JSON / markdown written under `--out`."""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from mla_backends.bench.peers import RAW_PEER
from mla_backends.cli import UsageError

# tqdm bars not yet at their total: `close_bars` ends them before an error is printed (an
# open bar's carriage return put the one-line error on the bar's line).
_OPEN_BARS: list[Any] = []


def close_bars() -> None:
    while _OPEN_BARS:
        _OPEN_BARS.pop().close()


def progress(total: int) -> Callable[[str], None]:
    """A step callback: a tqdm bar if tqdm is installed, else one line per step."""
    try:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="case")
        _OPEN_BARS.append(bar)

        def step(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update(1)
            if bar.n == total:
                bar.close()
                if bar in _OPEN_BARS:
                    _OPEN_BARS.remove(bar)
    except ImportError:
        done = [0]

        def step(label: str) -> None:
            done[0] += 1
            print(f"[{done[0]}/{total}] {label}", flush=True)

    return step


def _cannot_write(folder: Path, make_folder: bool) -> str | None:
    """Why this process cannot make a folder (or a file) in `folder`, tried rather than asked
    and undone at once, else None. Hazard: `os.access` answers yes to root on a virtual or
    read-only file system (`--out /proc/x` passed, and the run's results were lost at its end
    in a traceback), and GPU containers usually run as root."""
    try:
        if make_folder:
            os.rmdir(tempfile.mkdtemp(dir=folder))
        else:
            with tempfile.TemporaryFile(dir=folder):
                pass
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def check_out(out: Path, names: Iterable[str] = ()) -> None:
    """UsageError unless `out` is, or can be made, a folder this process may write, and each
    of `names` (the suite's files) is absent there or a file it may replace: checked before
    any timing, so that a long run's results are never lost at its end. Nothing is left here
    (`write` makes the folder): a suite that then refuses its options leaves none."""
    if not out.exists():
        parent = next(p for p in out.absolute().parents if p.exists())
        if not parent.is_dir():
            raise UsageError(f"--out {out}: cannot make this folder ({parent} is not a folder)")
        why = _cannot_write(parent, make_folder=True)
        if why is not None:
            raise UsageError(f"--out {out}: cannot make this folder (in {parent}: {why})")
        return
    if not out.is_dir():
        raise UsageError(f"--out {out}: cannot make this folder (a file of that name exists)")
    why = _cannot_write(out, make_folder=False)
    if why is not None:
        raise UsageError(f"--out {out}: this folder is not writable ({why})")
    for name in names:
        path = out / name
        if path.is_dir() or (path.exists() and not path.is_file()):
            raise UsageError(f"--out {out}: {path} is not a file, the run could not write it")
        if path.exists():
            try:
                path.open("a").close()  # appends nothing: the file and its time stay as they are
            except OSError as e:
                raise UsageError(f"--out {out}: {path} is not writable ({e.strerror})") from None


def write(out: Path, files: Mapping[str, object]) -> list[Path]:
    """Write each file under `out` (dicts and lists as JSON, text as is); the paths. A file of
    the same name is replaced: each suite names its own files, so only a previous run of the
    same suite (and part) into `out` is overwritten, as `--out`'s help says."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content, indent=1)
        (out / name).write_text(text)
        paths.append(out / name)
    return paths


def timings(row: dict) -> list[tuple[str, float]]:
    return [(k[:-3], v) for k, v in row.items() if k.endswith("_us") and v == v]


def ceiling_words(c: dict) -> tuple[str, str]:
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
    """The grid: one line per shape and timed path, GB/s and TFLOP/s against the ceilings."""
    c = result["ceilings"]
    words, ref = ceiling_words(c)
    lines = [
        f"{result['device']}: copy {c['copy_gbps']:.1f} GB/s "
        f"({c.get('copy_what', 'bf16 copy')}), {c['matmul_tflops']:.3g} TFLOP/s "
        f"({c.get('matmul_what', 'bf16 matmul')}); {words}",
        f"{'H':>4}{'q':>3}{'B':>5}{'kv':>7}  {'path':<28}{'us':>10}{'GB/s':>9}"
        f"{'% copy' + ref:>11}{'TFLOP/s':>9}{'% mm' + ref:>9}",
    ]
    for r in result["rows"]:
        for name, us in timings(r):
            gbps, tflops = r["bytes"] / us / 1e3, r["flops"] / us / 1e6
            lines.append(
                f"{r['heads']:>4}{r['q_len']:>3}{r['batch']:>5}{r['kv_len']:>7}  "
                f"{name:<28}{us:>10.1f}{gbps:>9.2f}{100 * gbps / c['copy_gbps']:>10.0f}%"
                f"{tflops:>9.4f}{100 * tflops / c['matmul_tflops']:>8.0f}%"
            )
    return "\n".join(lines + prefill_lines(result.get("prefill", {})))


def format_result(result: dict, backends: list[str], peers: list[str]) -> str:
    """The ANCHORS decode table: µs per path, raw / ours ratios, the fastest of ours in GB/s
    and TFLOP/s; then the prefill lines and one line per peer that could not run."""
    c = result["ceilings"]
    head = (
        f"{result['device']}: copy {c['copy_gbps']:.0f} GB/s, "
        f"bf16 mm {c['matmul_tflops']:.0f} TFLOP/s"
    )
    if not c.get("is_ceiling", True):
        head += "; " + ceiling_words(c)[0]
    lines = [head]
    ratio_names = [(b, RAW_PEER[b]) for b in backends if RAW_PEER.get(b) in peers]
    head = "H    q  B    kv     " + "".join(f"{n + ' us':>18}" for n in backends + peers)
    head += "".join(f"{b + '/' + p:>30}" for b, p in ratio_names)
    lines.append(head + "   GB/s TFLOP/s (fastest of ours)")
    errors: dict[str, str] = {}
    for r in result["decode"]:
        cells = "".join(f"{r.get(n + '_us', math.nan):>18.1f}" for n in backends + peers)
        ratios = "".join(
            f"{r.get(p + '_us', math.nan) / r[b + '_us']:>30.2f}" for b, p in ratio_names
        )
        best = min(r[n + "_us"] for n in backends)
        lines.append(
            f"{r['heads']:<5}{r['q_len']:<3}{r['batch']:<5}{r['kv_len']:<7}{cells}{ratios}"
            f"{r['bytes'] / best / 1e3:>7.0f}{r['flops'] / best / 1e6:>8.0f}"
        )
        for p in peers:
            if r.get(p + "_error"):
                errors.setdefault(p, r[p + "_error"])
    lines += prefill_lines(result.get("prefill", {}))
    lines += [f"{p} not run: {e}" for p, e in errors.items()]
    return "\n".join(lines)


def prefill_lines(p: dict) -> list[str]:
    """One line per timed prefill path (µs, TFLOP/s, speed vs SDPA, |diff|), then errors."""
    lines = []
    for key in sorted(k[:-3] for k in p if k.endswith("_us")):
        lines.append(
            f"prefill {p['tokens']} x {p['heads']} heads causal {key:<24} {p[key + '_us']:>8.0f} us"
            f" {p[key + '_tflops']:>5.0f} TFLOP/s  vs sdpa {p['sdpa_us'] / p[key + '_us']:.2f}x"
            f"  max|diff| {p.get(key + '_max_abs_diff_vs_sdpa', math.nan):.1e}"
        )
    return lines + [f"prefill {k}: {v}" for k, v in p.items() if k.endswith("_error")]
