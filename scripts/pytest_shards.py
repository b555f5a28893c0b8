"""Run a pytest selection as N concurrent pytest processes on one machine, then report.

The GPU suite's wall time on a fresh machine is mostly Triton compilation, one core per
process; a 16-core GPU host runs many processes while the GPU sits mostly idle. Tests are
collected once, sorted (a file's cases stay together: neighbours often share compiled
kernels), cut into chunks and dealt round-robin to the shards. Tests whose node id contains a
`--serial` string (timing assertions that contention would break) run first, alone; each
`--group` string gathers its tests into one shard of their own (fla's autotuning: tuned once
in that process rather than in every shard at once); each `--each` string gives each of its
tests a process of its own (autotuning of different kernels side by side). `--only` and
`--exclude` filter the node ids.

    python3 scripts/pytest_shards.py --shards 12 --out DIR [--cwd TREE] -- PYTEST_SELECTION...
    python3 scripts/pytest_shards.py ... --ids-from FILE   (node ids, one a line: no collection)

DIR gets shard-K.log / shard-K.xml (JUnit) per shard and summary.json: counts, failures with
their first message line, each shard's wall time. A shard killed at the time limit writes no
JUnit file: its counts come from its verbose log, and `stopped_in` names the test it was in.
Exit 1 if any test failed or errored or a shard ran out of time, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
OUTCOMES = ("passed", "failed", "error", "skipped")


@dataclass
class Shard:
    name: str
    ids: list[str]
    seconds: float = 0.0
    returncode: int | None = None  # None: killed at the time limit
    counts: dict[str, int] = field(default_factory=dict)
    stopped_in: str | None = None  # killed: the test it was running (started, no outcome)


def collect(selection: list[str], cwd: Path) -> list[str]:
    run = subprocess.run(
        [*PYTEST, "--collect-only", "-q", *selection], cwd=cwd, capture_output=True, text=True
    )
    ids = sorted(line for line in run.stdout.splitlines() if "::" in line)
    if run.returncode not in (0, 5) or not ids:  # 5: nothing collected
        tail = "\n".join((run.stdout + run.stderr).splitlines()[-15:])
        raise SystemExit(f"collection failed (exit {run.returncode}):\n{tail}")
    return ids


def deal(ids: list[str], shards: int, chunk: int) -> list[list[str]]:
    """Contiguous chunks of `chunk` ids, dealt round-robin: every shard gets a share of each
    part of the suite instead of one shard getting all of a slow file."""
    out: list[list[str]] = [[] for _ in range(shards)]
    for i in range(0, len(ids), chunk):
        out[(i // chunk) % shards].extend(ids[i : i + chunk])
    return [s for s in out if s]


def junit_counts(path: Path) -> tuple[dict[str, int], list[str]]:
    counts = dict.fromkeys(OUTCOMES, 0)
    failures: list[str] = []
    if not path.exists():
        return counts, failures
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        kind = {"failure": "failed", "error": "error", "skipped": "skipped"}.get(
            kinds[0] if kinds else "", "passed"
        )
        counts[kind] += 1
        if kind in ("failed", "error"):
            child = next(c for c in case if c.tag in ("failure", "error"))
            first = (child.get("message") or "").splitlines()[:1]
            failures.append(f"{name}: {first[0] if first else kind}")
    return counts, failures


_LOG_WORDS = {
    "PASSED": "passed",
    "FAILED": "failed",
    "ERROR": "error",
    "SKIPPED": "skipped",
    "XFAIL": "skipped",
    "XPASS": "passed",  # as JUnit counts them
}
# An outcome as `-v` writes it: the word first (after the node id, or alone on its line when
# the test wrote to the terminal), the progress column last.
_OUTCOME = re.compile(r"^\s*(" + "|".join(_LOG_WORDS) + r")\b.*\[\s*\d+%\]\s*$")


def log_counts(s: Shard, log: Path) -> tuple[dict[str, int], list[str]]:
    """A killed shard's outcomes from its `-v` log ("node-id PASSED  [ 50%]" lines), and
    `s.stopped_in` set to the test it was in (the last one started without an outcome).
    Node ids may hold spaces and brackets: a line is matched to the longest id it starts
    with, not split on whitespace."""
    ids = sorted(s.ids, key=len, reverse=True)  # test_x[1] must not take test_x[10]'s line
    seen: dict[str, str] = {}
    current: str | None = None
    for line in log.read_text(errors="replace").splitlines():
        rest = line
        for i in ids:
            if line == i or line.startswith(i + " "):
                current, rest = i, line[len(i) :]
                break
        m = _OUTCOME.match(rest)
        if current is None or m is None:
            continue
        word = _LOG_WORDS[m.group(1)]
        if current not in seen or word in ("failed", "error"):  # a teardown ERROR after PASSED
            seen[current] = word
    counts = dict.fromkeys(OUTCOMES, 0)
    for outcome in seen.values():
        counts[outcome] += 1
    s.stopped_in = current if current is not None and current not in seen else None
    failures = [
        f"{i}: {o} (shard killed; see its log)" for i, o in seen.items() if o in OUTCOMES[1:3]
    ]
    return counts, failures


def run_shards(shards: list[Shard], out: Path, cwd: Path, deadline: float) -> None:
    """Start every shard, then poll: each shard's own wall time; past the deadline the
    running ones are killed (returncode stays None)."""
    start = time.monotonic()
    running = {}
    for s in shards:
        log = (out / f"{s.name}.log").open("w")
        cmd = [*PYTEST, "-v", "-rfEs", "--junitxml", str(out / f"{s.name}.xml"), *s.ids]
        running[s.name] = (s, subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT))
    while running:
        for name, (s, p) in list(running.items()):
            if p.poll() is not None:
                s.returncode, s.seconds = p.returncode, round(time.monotonic() - start, 1)
                del running[name]
        if time.monotonic() > deadline:
            for s, p in running.values():
                p.kill()
                p.wait()
                s.seconds = round(time.monotonic() - start, 1)
            break
        time.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=12)
    ap.add_argument("--chunk", type=int, default=6, help="tests per dealt chunk")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cwd", type=Path, default=Path.cwd(), help="the tree whose tests run")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds for everything")
    ap.add_argument("--serial", action="append", default=[], help="node-id part run alone")
    ap.add_argument("--group", action="append", default=[], help="node-id part: one shard")
    ap.add_argument("--each", action="append", default=[], help="node-id part: a shard a test")
    ap.add_argument("--only", action="append", default=[], help="keep ids with this part")
    ap.add_argument("--exclude", action="append", default=[], help="drop ids with this part")
    ap.add_argument("--ids-from", type=Path, help="node ids, one a line, instead of collecting")
    ap.add_argument("selection", nargs="*", help="pytest arguments that select the tests")
    args = ap.parse_args()
    if args.shards < 1 or args.chunk < 1:
        ap.error("--shards and --chunk take a whole number >= 1")
    start = time.monotonic()
    deadline = start + args.timeout
    args.out.mkdir(parents=True, exist_ok=True)
    if args.ids_from:
        ids = sorted(
            line.strip() for line in args.ids_from.read_text().splitlines() if "::" in line
        )
    elif args.selection:
        ids = collect(args.selection, args.cwd)
    else:
        ap.error("name the tests: a pytest selection after --, or --ids-from FILE")
    if args.only:
        ids = [i for i in ids if any(part in i for part in args.only)]
    ids = [i for i in ids if not any(part in i for part in args.exclude)]
    serial = [i for i in ids if any(s in i for s in args.serial)]
    taken = set(serial)
    groups = []
    for k, part in enumerate(args.group):
        group = [i for i in ids if part in i and i not in taken]
        taken |= set(group)
        if group:
            groups.append(Shard(f"group-{k}", group))
    for i in ids:
        if i not in taken and any(part in i for part in args.each):
            taken.add(i)
            groups.append(Shard(f"each-{len(groups)}", [i]))
    rest = [i for i in ids if i not in taken]
    dealt = deal(rest, max(1, args.shards - len(groups)), args.chunk)
    shards = [*groups, *(Shard(f"shard-{k}", g) for k, g in enumerate(dealt))]
    print(f"{len(ids)} tests: {len(serial)} alone first, then {len(shards)} shards")
    if serial:
        alone = Shard("serial", serial)
        run_shards([alone], args.out, args.cwd, deadline)
    run_shards(shards, args.out, args.cwd, deadline)
    if serial:
        shards.insert(0, alone)
    total = dict.fromkeys(OUTCOMES, 0)
    failures: list[str] = []
    for s in shards:
        if s.returncode is None:
            s.counts, fails = log_counts(s, args.out / f"{s.name}.log")
        else:
            s.counts, fails = junit_counts(args.out / f"{s.name}.xml")
        failures += fails
        for k, v in s.counts.items():
            total[k] += v
    timed_out = [s.name for s in shards if s.returncode is None]
    summary = {
        "tests": len(ids),
        "total": total,
        "not_reported": len(ids) - sum(total.values()),
        "failures": failures,
        "timed_out": timed_out,
        "stopped_in": [s.stopped_in for s in shards if s.stopped_in],
        "wall_s": round(time.monotonic() - start, 1),
        "cwd": str(args.cwd),
        "selection": args.selection,
        "cpus": os.cpu_count(),
        "shards": [{k: v for k, v in asdict(s).items() if k != "ids"} for s in shards],
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(
        json.dumps(
            {k: summary[k] for k in ("total", "not_reported", "timed_out", "stopped_in", "wall_s")}
        )
    )
    for f in failures:
        print("FAILED", f)
    return 1 if failures or timed_out or summary["not_reported"] else 0


if __name__ == "__main__":
    sys.exit(main())
