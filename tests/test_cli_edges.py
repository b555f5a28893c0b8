"""Bad input at the edges of the command line and the YAML config, as a serving engineer's
typos and guesses meet it: keys that are not strings, config paths that are not files, numbers
YAML reads as text, sizes past int32 slot ids or int64, a model too large for `verify`, a
backend named twice. Each is one line on stderr naming the file / key / option, exit status 2,
no traceback."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from conftest import Cli

from mla_backends.config import MAX_SLOTS, ConfigError, load_config


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text + "device: cpu\n")
    return str(path)


def _one_line(cli: Cli, *argv: str) -> str:
    """The single stderr line of a refused command (exit 2, no traceback)."""
    proc = cli(*argv, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    "text, pattern",
    [
        # sorting the unknown keys mixed str and int: a TypeError traceback
        (
            "1: 2\npagesize: 3\n",
            r"c.yaml: unknown key\(s\) \['pagesize', 1\]; allowed: .*page_size",
        ),
        (
            "model: {base: tiny, 1: 2, heads: 3}\n",
            r"c.yaml: unknown key\(s\) model.\['heads', 1\]; allowed: .*num_heads",
        ),
    ],
    ids=["top-level", "model"],
)
def test_keys_that_are_not_strings_are_named(
    cli: Cli, tmp_path: Path, text: str, pattern: str
) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(_write(tmp_path, text))
    line = _one_line(cli, "run", "--config", _write(tmp_path, text))
    assert re.search("run: config error: .*" + pattern, line), line


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_a_config_path_that_is_not_a_regular_file_says_so(
    cli: Cli, tmp_path: Path, kind: str
) -> None:
    """/dev/null or a FIFO exists: "no such config file" sent the user looking for a typo."""
    if kind == "device":
        path = os.devnull
    else:
        path = str(tmp_path / "fifo")
        os.mkfifo(path)
    line = _one_line(cli, "verify", "--config", path)
    assert line == (
        f"mla-backends verify: config error: {path}: is not a regular file; --config takes a "
        "YAML file"
    )


def test_a_config_name_too_long_for_the_file_system_is_one_line(cli: Cli) -> None:
    """Path.is_dir raised OSError (ENAMETOOLONG): a traceback."""
    name = "x" * 300
    line = _one_line(cli, "run", "--config", name)
    assert line == f"mla-backends run: config error: {name}: cannot read: File name too long"


@pytest.mark.parametrize(
    "text, pattern",
    [
        (
            "model: {base: tiny, rope_scaling_factor: 1.0e308}\n",
            r"model.rope_scaling_factor must be a finite number, got '1.0e308' \(str\); YAML "
            r"reads an exponent without a dot and a sign as text: write e.g. 1.0e\+3",
        ),
        (
            "num_pages: 1e3\n",
            r"num_pages must be an integer >= 1, got '1e3' \(str\); an integer key takes "
            r"digits, e.g. 1000$",
        ),
        (
            "num_pages: '1.0e+3'\n",
            r"num_pages must be an integer >= 1, got '1.0e\+3' \(str\); an integer key takes "
            r"digits, e.g. 1000$",
        ),
        (
            "max_requests: '8'\n",
            r"max_requests must be an integer >= 1, got '8' \(str\); write the number without "
            r"quotes",
        ),
    ],
    ids=["float-exponent", "int-exponent", "int-quoted-float", "quoted"],
)
def test_a_number_yaml_read_as_text_says_why(tmp_path: Path, text: str, pattern: str) -> None:
    """PyYAML reads `1.0e308` (no signed exponent) as a string: "got '1.0e308' (str)" read as
    if the user had quoted it."""
    with pytest.raises(ConfigError, match=pattern):
        load_config(_write(tmp_path, text))


def test_a_pool_past_int32_slot_ids_is_refused_at_load(cli: Cli, tmp_path: Path) -> None:
    """The request table holds int32 slots: a larger pool wrapped its slot ids silently where
    memory allowed it, and past int64 was a TypeError traceback."""
    most = (MAX_SLOTS + 1) // 16 - 1  # slot ids 0 .. (most + 1) * 16 - 1 = MAX_SLOTS
    assert load_config(_write(tmp_path, f"num_pages: {most}\n"), resolve=False).num_pages == most
    with pytest.raises(ConfigError, match=rf"num_pages={most + 1} with page_size=16: .*at most"):
        load_config(_write(tmp_path, f"num_pages: {most + 1}\n"), resolve=False)
    line = _one_line(cli, "run", "--config", _write(tmp_path, f"num_pages: {10**30}\n"))
    assert re.fullmatch(
        rf"mla-backends run: config error: .*c.yaml: num_pages={10**30} with page_size=16: "
        rf"{(10**30 + 1) * 16} pool slots, past the request table's int32 slot ids "
        rf"\(2\*\*31 - 1\); at most {most} pages of 16 tokens",
        line,
    ), line


def test_sizes_past_int64_are_out_of_memory_in_one_line(cli: Cli, tmp_path: Path) -> None:
    """torch refuses such sizes with a TypeError ("Overflow when unpacking long") or a
    RuntimeError ("Storage size calculation overflowed"): both were tracebacks."""
    line = _one_line(cli, "run", "--config", _write(tmp_path, f"max_requests: {10**30}\n"))
    assert re.fullmatch(
        rf"mla-backends run: error: .*c.yaml: num_pages 256, max_requests {10**30}, "
        r"max_context_len 2048: out of memory on cpu; give smaller values",
        line,
    ), line
    out = str(tmp_path / "out")
    args = ("bench", "--suite", "linear", "--batch", "1", "--out", out)
    line = _one_line(cli, *args, "--head-dim", str(10**8))
    assert line == (
        f"mla-backends bench: error: --batch 1, --heads 32, --head-dim {10**8}: out of memory "
        "on cpu; give smaller values"
    )


def test_bench_pool_past_int32_slot_ids_names_the_options(cli: Cli, tmp_path: Path) -> None:
    """The grid sizes each pool from --batch and --kv-len: the refusal names those, not a
    num_pages the user never wrote (it was an OverflowError traceback)."""
    argv = ["bench", "--backends", "torch", "--out", str(tmp_path / "out")]
    line = _one_line(cli, *argv, "--batch", str(10**15), "--kv-len", str(10**14))
    assert re.fullmatch(
        rf"mla-backends bench: error: --batch {10**15}, --kv-len {10**14}: num_pages=\d+ with "
        r"page_size=16: \d+ pool slots, past the request table's int32 slot ids .*",
        line,
    ), line


def test_verify_of_a_model_too_large_for_memory_is_one_line(cli: Cli, tmp_path: Path) -> None:
    """`verify` allocated the config's model dims outside any memory check: a traceback."""
    cfg = _write(tmp_path, "model: {base: tiny-kernel, kv_lora_rank: 1000000000000}\n")
    line = _one_line(cli, "verify", "--config", cfg)
    assert re.fullmatch(
        r"mla-backends verify: error: .*c.yaml: model num_heads 4, kv_lora_rank 1000000000000, "
        r"qk_rope_head_dim 16, qk_nope_head_dim 24, v_head_dim 12: out of memory on cpu; give "
        r"smaller values",
        line,
    ), line


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--backends", "torch,torch"],
            "argument --backends: 'torch,torch': torch given twice",
        ),
        (
            ["--suite", "anchors", "--peers", "raw_flashmla, raw_flashmla"],
            "argument --peers: 'raw_flashmla, raw_flashmla': raw_flashmla given twice",
        ),
        (
            ["--batch", "1,1", "--kv-len", "16"],
            "argument --batch: '1,1': 1 appears twice",
        ),
        (
            ["--suite", "anchors", "--shapes", "4:1:1:64,4:1:1:64"],
            "argument --shapes: '4:1:1:64,4:1:1:64': 4:1:1:64 given twice",
        ),
        (  # the empty field was skipped: 4:1:1:64, the fields moved along (helper 69)
            ["--suite", "anchors", "--shapes", "4::1:1:64"],
            "argument --shapes: '4::1:1:64' is not H:q:B:kv (four integers >= 1, e.g. "
            "16:1:64:4096)",
        ),
    ],
    ids=["backends", "peers", "batch", "shapes", "shape-field"],
)
def test_bench_names_given_twice_are_refused(
    cli: Cli, tmp_path: Path, argv: list[str], message: str
) -> None:
    """A backend named twice was timed twice, its rows side by side under one name; a batch
    size twice, the same row twice."""
    line = _one_line(cli, "bench", *argv, "--out", str(tmp_path / "out"))
    assert line == f"mla-backends bench: error: {message} (see mla-backends bench --help)"


def test_bench_quick_with_shapes_is_refused(cli: Cli, tmp_path: Path) -> None:
    """--quick picks the shapes: beside --shapes it was ignored, silently (helper 69)."""
    argv = ["--suite", "anchors", "--shapes", "4:1:1:64", "--quick"]
    line = _one_line(cli, "bench", *argv, "--out", str(tmp_path / "out"))
    assert line == (
        "mla-backends bench: error: --quick picks the first 3 shapes: give it or --shapes, not both"
    )


def test_bench_stack_too_large_for_memory_is_one_line(cli: Cli, tmp_path: Path) -> None:
    """The random model was built with no size check: Linux overcommits, so --layers 40 was
    killed for memory with no message, and a huge --layers built layers without end."""
    argv = ["bench", "--suite", "stack", "--stack-size", "tiny", "--layers", str(10**20)]
    line = _one_line(cli, *argv, "--out", str(tmp_path / "out"))
    assert re.fullmatch(
        rf"mla-backends bench: error: --layers {10**20}, --stack-size tiny: the model needs over "
        r"\d+ GiB on cpu \(built in fp32, then cast\), \d+ GiB free; give fewer --layers",
        line,
    ), line


def test_out_of_memory_keeps_a_float_overflow_as_the_bug_it_is() -> None:
    """`out_of_memory` turns a size past the C index range into one line, but a float overflow
    inside the run (a numeric bug) keeps its traceback: it was reported as out of memory."""
    import math

    from mla_backends.cli import UsageError, out_of_memory

    with pytest.raises(OverflowError, match="math range"):
        with out_of_memory("--x 1", "cpu"):
            math.exp(1000)
    with pytest.raises(UsageError, match="out of memory on cpu"):
        with out_of_memory("--x 1", "cpu"):
            list(range(2**70))[:1]


def test_bench_refuses_a_dcp_config_and_its_error_has_a_line_of_its_own(
    cli: Cli, tmp_path: Path
) -> None:
    """`bench` times one process: a `dcp_size` config was timed over the whole KV, silently.
    An error after a progress bar started shared the bar's line (its carriage return)."""
    line = _one_line(
        cli, "bench", "--config", _write(tmp_path, "dcp_size: 2\n"), "--out", str(tmp_path / "o")
    )
    assert re.fullmatch(r"mla-backends bench: config error: .*dcp_size=2: bench times one .*", line)
    proc = cli("bench", "--batch", "1", "--kv-len", "16", "--heads", "1000000000", "--out",
               str(tmp_path / "o"), timeout=300)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("mla-backends bench: error: --heads 1000000000"), proc.stderr


def test_the_cli_module_run_as_a_script_gives_one_line(cli: Cli, tmp_path: Path) -> None:
    """`python -m mla_backends.cli` loaded the module twice, and its main did not catch the
    UsageError the subcommands raise: a traceback, exit 1."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run(
        [sys.executable, "-m", "mla_backends.cli", "run", "--requests", "100"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("mla-backends run: error: --requests 100 is out of range")


def test_dcp_configs_refuse_what_cannot_run_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend with no LSE under DCP passed load and was refused inside every rank; a CPU
    check of dcp_size 1000 started 1000 gloo processes."""
    from mla_backends.backends import cutlass_mla
    from mla_backends.backends.registry import resolve_backends
    from mla_backends.config import Config
    from mla_backends.dcp.verify import unrunnable

    monkeypatch.setattr(cutlass_mla.CutlassMLABackend, "supports", classmethod(lambda *a: None))
    lse = r"cutlass_mla' cannot run here: dcp_size 2: decode context parallelism merges by LSE"
    with pytest.raises(ConfigError, match=lse):
        resolve_backends(Config(decode_backend="cutlass_mla", dcp_size=2, device="cpu"))
    cpus = os.cpu_count() or 1
    why = unrunnable(Config(dcp_size=1000, device="cpu"))
    assert (
        why
        == f"dcp_size 1000 would start 1000 gloo processes, over twice this machine's {cpus} CPUs"
    )


@pytest.mark.parametrize(
    "text", ["0:1:64:4096", "16:0:64:4096", "16:1:0:4096", "16:1:64:000", "16:1:64:4096:2"]
)
def test_shapes_refuse_a_zero_field(text: str) -> None:
    """Hazard: `--shapes` takes four integers >= 1; a 0 head count, query length, batch or
    KV length was taken and timed an empty grid (or divided by zero in a rate). A fifth
    field is refused alike (not a bare unpacking error)."""
    import argparse

    from mla_backends.bench.options import shape_list, shape_text

    assert shape_list("16:1:64:4096, 016:2:8:64") == [(16, 1, 64, 4096), (16, 2, 8, 64)]
    assert shape_text((16, 2, 8, 64)) == "16:2:8:64"  # the shape as --shapes takes it
    with pytest.raises(argparse.ArgumentTypeError, match=r"four integers >= 1"):
        shape_list(text)


def test_shapes_refuse_a_kv_length_shorter_than_the_query() -> None:
    """Hazard: a step's KV length holds its own query tokens: kv >= q; kv = q - 1 (a verify
    step of 4 drafts over 3 keys) was timed as if it could run."""
    import argparse

    from mla_backends.bench.options import shape_list

    assert shape_list("16:4:8:4") == [(16, 4, 8, 4)]
    with pytest.raises(argparse.ArgumentTypeError, match=r"shorter than q"):
        shape_list("16:4:8:3")


def test_peers_none_only_alone() -> None:
    """Hazard: `--peers none` means no peer; `none` beside names (`flashmla,none`) silently
    dropped the named peers too."""
    import argparse

    from mla_backends.bench.options import peer_list
    from mla_backends.bench.peers import DECODE_PEERS

    assert peer_list("none") == []
    with pytest.raises(argparse.ArgumentTypeError):
        peer_list("none,none")
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown peer 'none'"):
        peer_list(f"{next(iter(DECODE_PEERS))},none")


@pytest.mark.parametrize(
    "parse, one, want, message",
    [
        ("backend_list", "torch,", ["torch"], r"expected backend names"),
        ("peer_list", "raw_flashmla,", ["raw_flashmla"], r"expected peer names, or none"),
        ("shape_list", "16:1:8:64,", [(16, 1, 8, 64)], r"expected at least one H:q:B:kv shape"),
    ],
    ids=["backends", "peers", "shapes"],
)
def test_backends_refuse_a_list_of_no_name(parse: str, one: str, want: list, message: str) -> None:
    """Hazard: `--backends ,` gave no name, and the run fell back to the config's backend;
    `--peers ,` and `--shapes ,` alike fell back to the suite's defaults."""
    import argparse

    from mla_backends.bench import options

    assert getattr(options, parse)(one) == want
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        getattr(options, parse)(" , ")


def test_an_option_the_suite_does_not_take_is_refused() -> None:
    """Hazard: an option given to a suite that ignores it (`--kv-len` to `--suite prefill`)
    was dropped silently: the run timed the defaults the user meant to change."""
    from mla_backends.bench.options import Options
    from mla_backends.cli import UsageError

    Options(suite="grid", kv_len=[1024]).check_applies()
    with pytest.raises(UsageError, match=r"--kv-len does not apply to --suite prefill"):
        Options(suite="prefill", kv_len=[1024]).check_applies()
    with pytest.raises(UsageError, match=r"--prefill-tokens does not apply to --suite stack"):
        Options(suite="stack", prefill_tokens=0).check_applies()  # given, though 0 is falsy


def test_int_lists_refuse_repeats_and_the_seed_takes_its_top_value() -> None:
    """Hazards: a repeated value (`--batch 8,8`) was timed twice, two rows of one shape; the
    seed's range is 0..2**63 - 1 inclusive (torch.manual_seed's), an off-by-one refused the
    top value."""
    import argparse

    from mla_backends.cli import SEED, int_list

    assert int_list()("1,8, 64") == [1, 8, 64]
    with pytest.raises(argparse.ArgumentTypeError, match=r"appears twice"):
        int_list()("8,8")
    assert SEED(str(2**63 - 1)) == 2**63 - 1
    with pytest.raises(argparse.ArgumentTypeError):
        SEED(str(2**63))


def test_a_value_option_given_twice_is_refused() -> None:
    """Hazard: argparse keeps the last of a repeated option: `bench --batch 1 --batch 2`
    timed batch 2 alone, silently."""
    from mla_backends.cli import OneLineParser, int_list

    p = OneLineParser(prog="x")
    p.add_argument("--batch", type=int_list())
    assert p.parse_args(["--batch", "1"]).batch == [1]
    with pytest.raises(SystemExit):
        p.parse_args(["--batch", "1", "--batch", "2"])
