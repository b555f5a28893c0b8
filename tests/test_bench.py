"""`bench` on CPU: --help works, a tiny run with the torch backend writes its outputs, labels
its CPU rates as references (not ceilings), and runs without matplotlib; every other suite's
CPU path runs at tiny sizes and writes the JSON keys of the recorded GPU runs
(benchmarks/*.json); what needs a GPU is one line; the tuning script's kernel call is the
backend's."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import GPU, PACKAGE_ROOT, Cli


def test_bench_help(cli: Cli) -> None:
    proc = cli("bench", "--help")
    assert proc.returncode == 0 and "--graphs" in proc.stdout and "--kv-len" in proc.stdout
    assert "--suite {grid,anchors,prefill,stack,linear,fi-plan,metadata,hopper}" in proc.stdout


def _tiny_args(tmp_path: Path) -> list[str]:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: tiny\ndecode_backend: torch\nprefill_backend: torch\ndevice: cpu\n")
    return [
        "bench",
        "--config",
        str(cfg),
        "--batch",
        "1,3",
        "--kv-len",
        "40,100",
        "--q-len",
        "1,2",
        "--out",
        str(tmp_path / "out"),
    ]


def test_tiny_bench_run_with_torch(cli: Cli, tmp_path: Path) -> None:
    proc = cli(*_tiny_args(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "out" / "grid.json").read_text())
    assert len(result["rows"]) == 8
    assert all(r["torch_us"] > 0 and r["bytes"] > 0 and r["flops"] > 0 for r in result["rows"])
    c = result["ceilings"]
    assert c["copy_gbps"] > 0 and c["matmul_tflops"] > 0
    png = (tmp_path / "out" / "roofline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "torch" in proc.stdout
    # A CPU's copy and matmul rates bound nothing (KV in cache reads faster than a DRAM copy):
    # the report says so instead of calling them ceilings.
    assert c["is_ceiling"] is False
    assert "NOT ceilings" in proc.stdout and "% copy ref" in proc.stdout
    assert "% mm ref" in proc.stdout and "ceilings measured" not in proc.stdout


def test_bench_table_calls_gpu_rates_ceilings() -> None:
    from mla_backends.bench.report import format_table

    result = {
        "device": "NVIDIA H100 (SM90)",
        "ceilings": {"copy_gbps": 3000.0, "matmul_tflops": 700.0, "is_ceiling": True},
        "rows": [{"heads": 16, "q_len": 1, "batch": 1, "kv_len": 4096, "bytes": 3e6,
                  "flops": 1e8, "triton_us": 10.0}],
    }  # fmt: skip
    table = format_table(result)
    assert "ceilings measured at the start of this run" in table and "ref" not in table
    assert " 10%" in table  # 300 GB/s of 3000


def test_bench_tables_read_each_number_the_right_way() -> None:
    """format_table: a path with no timing (NaN) has no line, a result written before the CPU
    references carries no `is_ceiling` and is a GPU's (ceilings). format_result: raw / ours
    is the peer's time over ours, the rates are the fastest of ours', a peer's first error
    is the one shown; the prefill lines' speed is SDPA's time over the path's."""
    from mla_backends.bench.report import format_result, format_table

    c = {"copy_gbps": 3000.0, "matmul_tflops": 700.0}
    shape = {"heads": 16, "q_len": 1, "batch": 1, "kv_len": 4096, "bytes": 3e6, "flops": 1e8}
    grid = [{**shape, "triton_us": 10.0, "torch_us": math.nan}]
    table = format_table({"device": "GPU", "ceilings": c, "rows": grid})
    assert "ceilings measured" in table and "torch" not in table
    assert re.search(r" triton +10\.0 ", table), table
    prefill = {"tokens": 1024, "heads": 16, "sdpa_us": 100.0, "sdpa_tflops": 5.0,
               "fa_us": 50.0, "fa_tflops": 10.0, "fa_max_abs_diff_vs_sdpa": 1e-3}  # fmt: skip
    rows = [
        {**shape, "flashmla_us": 10.0, "torch_us": 20.0, "raw_flashmla_us": 15.0},
        {**shape, "flashmla_us": 10.0, "torch_us": 20.0, "raw_flashmla_error": "first"},
        {**shape, "flashmla_us": 10.0, "torch_us": 20.0, "raw_flashmla_error": "second"},
    ]
    result = {"device": "GPU", "ceilings": c, "decode": rows, "prefill": prefill}
    lines = format_result(result, ["flashmla", "torch"], ["raw_flashmla"]).splitlines()
    assert lines[2].split()[-3:] == ["1.50", "300", "10"]  # 15 / 10; 3e6 B and 1e8 flop in 10 us
    assert [line for line in lines if "not run" in line] == ["raw_flashmla not run: first"]
    [fa] = [line for line in lines if " fa " in line]
    assert "vs sdpa 2.00x" in fa
    assert not [line for line in lines if line.startswith("prefill tokens")]


def test_bench_without_matplotlib_writes_table_and_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mla_backends.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails, find_spec: None
    argv = [*_tiny_args(tmp_path)[:3], "--batch", "2", "--kv-len", "40", "--graphs", "--raw"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    if not GPU:  # what a CPU cannot run is one line
        assert "--graphs / --raw not run: they need a CUDA GPU (this run is on cpu)" in out
    assert json.loads((tmp_path / "out" / "grid.json").read_text())["rows"]
    assert not (tmp_path / "out" / "roofline.png").exists()
    skipped = [line for line in out.splitlines() if "plot skipped" in line]
    assert len(skipped) == 1 and "pip install 'mla-backends[plot]'" in skipped[0], out
    assert "torch" in out  # the table


# ---------------------------------------------------------------- the other suites, on a CPU
RECORDED = PACKAGE_ROOT / "benchmarks"


def _bench(tmp_path: Path, *args: str) -> tuple[int, str, str]:
    """`bench ARGS` in this process with the tiny torch config: (status, stdout, stderr)."""
    import contextlib
    import io

    from mla_backends.cli import main

    cfg = _tiny_args(tmp_path)[2]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["bench", "--config", cfg, *args, "--out", str(tmp_path / "out")])
    return rc, out.getvalue(), err.getvalue()


def _recorded(name: str) -> dict:
    """A JSON file of a recorded GPU run (benchmarks/)."""
    return json.loads((RECORDED / name).read_text())


def test_anchors_suite_on_cpu_keeps_the_recorded_keys(tmp_path: Path) -> None:
    """The ANCHORS decode table at DeepSeek dims with tiny shapes; a peer that cannot run
    here is one line, not a failure."""
    rc, out, err = _bench(
        tmp_path, "--suite", "anchors", "--backends", "torch", "--shapes", "16:1:1:64,16:2:2:96",
        "--peers", "raw_flashmla", "--prefill-tokens", "0",
    )  # fmt: skip
    assert rc == 0, err
    result = json.loads((tmp_path / "out" / "anchors.json").read_text())
    recorded = _recorded("decode-h200-gluon-final.json")
    assert set(result) == set(recorded) - {"prefill"}
    rows = result["decode"]
    assert [(r["heads"], r["q_len"], r["batch"], r["kv_len"]) for r in rows] == [
        (16, 1, 1, 64),
        (16, 2, 2, 96),
    ]
    shared = {"heads", "q_len", "batch", "kv_len", "bytes", "flops"}
    assert shared <= set(recorded["decode"][0]) and all(shared <= set(r) for r in rows)
    assert all(r["torch_us"] > 0 and "RuntimeError" in r["raw_flashmla_error"] for r in rows)
    assert rows[0]["bytes"] == 1152 * 64 + 16 * 1088 * 2  # ANCHORS.md's count at B1, kv 64
    lines = out.splitlines()
    assert "NOT ceilings" in lines[0] and "torch us" in lines[1] and "raw_flashmla us" in lines[1]
    assert [ln for ln in lines if "not run" in ln] == [
        "raw_flashmla not run: RuntimeError: needs a CUDA GPU (this run is on cpu)"
    ]


def test_prefill_suite_on_cpu_checks_every_path_against_sdpa(tmp_path: Path) -> None:
    rc, out, err = _bench(
        tmp_path, "--suite", "prefill", "--backends", "torch", "--heads", "2",
        "--prefill-tokens", "24",
    )  # fmt: skip
    assert rc == 0, err
    p = json.loads((tmp_path / "out" / "prefill.json").read_text())["prefill"]
    recorded = _recorded("decode-h100-gluon-final.json")["prefill"]
    paths = ["sdpa", "torch_backend", "torch_backend_lse"]
    if os.environ.get("TRITON_INTERPRET") == "1":
        paths.append("triton_kernel_lse")  # our kernel, interpreted
    for path in paths:
        assert p[f"{path}_us"] > 0 and p[f"{path}_tflops"] > 0, p
        assert p[f"{path}_max_abs_diff_vs_sdpa"] < 3e-2, (path, p)
        assert f"{path}_max_abs_diff_vs_sdpa" in recorded or path.startswith("torch")
    assert "CUDA GPU" in p["flashinfer_raw_error"]
    assert (p["tokens"], p["heads"], p["flops"]) == (24, 2, 24 * 24 * 2 * 320)
    assert {"tokens", "heads", "flops"} <= set(recorded)
    assert sum("causal" in ln for ln in out.splitlines()) == len(paths)


def test_bench_out_and_prefill_memory_fail_before_any_timing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An --out that cannot be a folder is refused before the suite runs (it was found only
    when the results were written, and they were lost); a prefill out of memory is one line
    naming --prefill-tokens; on a CPU the prefill default is CPU-sized (8192 tokens at 128
    heads would need a 34 GB score matrix)."""
    import contextlib
    import io

    from mla_backends.bench import prefill
    from mla_backends.cli import main

    cfg, afile = _tiny_args(tmp_path)[2], tmp_path / "afile"
    afile.write_text("")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["bench", "--config", cfg, "--batch", "1", "--kv-len", "16", "--out", str(afile)])
    one_line = r"mla-backends bench: error: --out .*afile: cannot make this folder \(.*\)\n"
    assert rc == 2 and re.fullmatch(one_line, err.getvalue()), err.getvalue()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["bench", "--config", cfg, "--out", str(afile / "sub")])
    one_line = r"mla-backends bench: error: --out .*sub: cannot make .*afile is not a folder\)\n"
    assert rc == 2 and re.fullmatch(one_line, err.getvalue()), err.getvalue()
    # a folder nobody can write, root included (os.access answers yes to root): tried, not
    # asked; the run once finished and lost its results in a traceback
    monkeypatch.setattr(os, "access", lambda *a, **k: True)  # as root
    for out, why in (("/proc/mla-nope", "cannot make this folder"), ("/proc/self", "not writable")):
        if not Path("/proc/self").is_dir():  # Linux's
            break
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(["bench", "--config", cfg, "--batch", "1", "--kv-len", "16", "--out", out])
        one_line = rf"mla-backends bench: error: --out {out}: [^\n]*{why} \([^\n]+\)\n"
        assert rc == 2 and re.fullmatch(one_line, err.getvalue()), err.getvalue()

    def no_timing(*args: object) -> None:
        raise AssertionError("the suite ran before its output file was checked")

    def refuses(*args: object) -> None:
        from mla_backends.cli import UsageError

        raise UsageError("this suite refuses these options")

    # a suite that refuses its options leaves no empty --out folder behind (one was made)
    from mla_backends.bench import cli as bench_cli

    monkeypatch.setitem(bench_cli.RUN, "grid", refuses)
    new = tmp_path / "new" / "out"
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        assert main(["bench", "--config", cfg, "--out", str(new)]) == 2
    assert not (tmp_path / "new").exists()

    # a folder where the suite's file goes: the run's results would be lost at its end
    for suite, name, extra in (
        ("grid", "grid.json", []),
        ("hopper", "hopper-fp8.md", ["--part", "fp8"]),
    ):
        taken = tmp_path / f"taken-{suite}"
        (taken / name).mkdir(parents=True)
        monkeypatch.setitem(bench_cli.RUN, suite, no_timing)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(["bench", "--config", cfg, "--suite", suite, *extra, "--out", str(taken)])
        one_line = rf"mla-backends bench: error: --out .*: .*{name} is not a file, .*\n"
        assert rc == 2 and re.fullmatch(one_line, err.getvalue()), err.getvalue()

    def no_memory(x: object) -> object:
        raise RuntimeError(
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 34 GB"
        )

    monkeypatch.setattr(prefill, "sdpa_prefill", no_memory)
    rc, out, err_text = _bench(
        tmp_path, "--suite", "prefill", "--backends", "torch", "--heads", "2"
    )
    assert rc == 2 and out == "" and len(err_text.strip().splitlines()) == 1, err_text
    assert f"--prefill-tokens {prefill.CPU_TOKENS}: out of memory on cpu" in err_text
    assert prefill.default_tokens(torch.device("cpu"), 8192) == prefill.CPU_TOKENS
    assert prefill.default_tokens(torch.device("cuda"), 8192) == 8192


def test_each_suites_out_files_are_the_ones_it_writes() -> None:
    """`OUT_FILES` (checked before timing) names what each suite's `write` call writes."""
    import inspect

    from mla_backends.bench import cli as bench_cli

    for suite, names in bench_cli.OUT_FILES.items():
        source = inspect.getsource(sys.modules[bench_cli.RUN[suite].__module__])
        for name in names:
            assert name in source, (suite, name)


def test_suites_sharing_an_out_folder_keep_each_others_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """grid, anchors and prefill each write their own JSON (all three wrote bench.json: the
    second suite into one --out replaced the first's results, beside its roofline plot)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # no plot: faster, same JSON
    runs = {
        "grid.json": ["--suite", "grid", "--batch", "1", "--kv-len", "40"],
        "prefill.json": ["--suite", "prefill", "--heads", "2", "--prefill-tokens", "16"],
        "anchors.json": [
            "--suite", "anchors", "--shapes", "16:1:1:64", "--peers", "none",
            "--prefill-tokens", "0",
        ],
    }  # fmt: skip
    for name, args in runs.items():
        rc, out, err = _bench(tmp_path, *args, "--backends", "torch")
        assert rc == 0 and f"wrote {tmp_path / 'out' / name}" in out, (out, err)
    files = {p.name: json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json")}
    assert set(files) == set(runs), sorted(files)
    assert files["grid.json"]["rows"][0]["kv_len"] == 40
    assert files["prefill.json"]["prefill"]["tokens"] == 16
    assert files["anchors.json"]["decode"][0]["kv_len"] == 64


def _no_memory(*args: object, **kwargs: object) -> object:
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")


def _no_cpu_memory(*args: object, **kwargs: object) -> object:
    raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 64 GB")


def _no_host_memory(*args: object, **kwargs: object) -> object:
    raise MemoryError  # Python's own: a host list of every page (`--kv-len 1e15`) too long


@pytest.mark.parametrize(
    "module, name, fail, args, message",
    [
        (
            "grid", "decode_setup", _no_memory,
            ["--heads", "4", "--batch", "3", "--kv-len", "100"],
            "--heads 4, --q-len 1, --batch 3, --kv-len 100: out of memory on cpu",
        ),
        (
            "grid", "decode_setup", _no_host_memory,
            ["--heads", "4", "--batch", "1", "--kv-len", "100"],
            "--heads 4, --q-len 1, --batch 1, --kv-len 100: out of memory on cpu",
        ),
        (
            "anchors", "decode_setup", _no_cpu_memory,
            ["--suite", "anchors", "--shapes", "16:1:1:64", "--prefill-tokens", "0"],
            "--shapes 16:1:1:64: out of memory on cpu",
        ),
        (
            "linear", "LinearStatePool", _no_memory,
            ["--suite", "linear", "--batch", "3", "--heads", "2", "--head-dim", "16"],
            "--batch 3, --heads 2, --head-dim 16: out of memory on cpu",
        ),
        (
            "stack", "random_model", _no_memory,
            ["--suite", "stack", "--stack-size", "tiny", "--layers", "1"],
            "--layers 1, --stack-size tiny: out of memory on cpu",
        ),
        (
            "stack", "Engine", _no_cpu_memory,
            ["--suite", "stack", "--stack-size", "tiny", "--batch", "2", "--prompt", "8",
             "--steps", "2", "--layers", "1"],
            "--batch 2, --prompt 8, --steps 2, --layers 1: out of memory on cpu",
        ),
    ],
    ids=["grid", "grid-host-list", "anchors", "linear", "stack-model", "stack-pool"],
)  # fmt: skip
def test_bench_out_of_memory_is_one_line_naming_the_size_options(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    module: str,
    name: str,
    fail: object,
    args: list[str],
    message: str,
) -> None:
    """A size that does not fit (a CUDA OutOfMemoryError, or the CPU allocator's
    RuntimeError) is one line naming the options that set it, as prefill's is; the decode grid
    was a traceback (or the process was killed)."""
    import importlib

    monkeypatch.setattr(importlib.import_module(f"mla_backends.bench.{module}"), name, fail)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the grid's bar would write to stderr
    rc, out, err = _bench(tmp_path, *args, *(["--backends", "torch"] * (module != "linear")))
    assert rc == 2 and err == f"mla-backends bench: error: {message}; give smaller values\n", err
    assert not (tmp_path / "out" / f"{module}.json").exists()


def test_out_of_memory_keeps_other_runtime_errors() -> None:
    """Only the allocators' errors become the one line: another RuntimeError that merely says
    "allocate" keeps its type and traceback, and so does the page allocator's MemoryError."""
    from mla_backends.allocator import OutOfPagesError
    from mla_backends.cli import out_of_memory

    with pytest.raises(RuntimeError, match="state not allocated"):
        with out_of_memory("--batch 1", torch.device("cpu")):
            raise RuntimeError("indexer: CUDA-graph state not allocated")
    with pytest.raises(OutOfPagesError):  # a MemoryError of ours, with its message
        with out_of_memory("--batch 1", torch.device("cpu")):
            raise OutOfPagesError(requested=3, free=1, page_size=16)


def test_a_pool_larger_than_free_gpu_memory_is_refused_before_timing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The KV pool's size is known from the config (the same bytes the built pool has), and
    a pool larger than the GPU's free memory is one line before any timing."""
    from mla_backends.bench.fixtures import pool_bytes, require_fits, setup_config
    from mla_backends.cli import UsageError
    from mla_backends.runtime import Runtime

    cpu = setup_config("torch", 4, 3, 100, page_size=16, device="cpu", dtype="float32")
    assert pool_bytes(cpu) == Runtime.build(cpu).kv_pool.total_bytes
    require_fits(cpu, "--batch 3")  # a CPU's free memory is not asked
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (2 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 2 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: 1 * gib)
    fits = setup_config("torch", 128, 64, 4096, device="cuda")  # 64 x 4096 x 576 x 2 B: 0.3 GiB
    require_fits(fits, "--shapes 128:1:64:4096")
    big = setup_config("torch", 128, 256, 32768, device="cuda")  # 9.0 GiB
    with pytest.raises(UsageError) as e:
        require_fits(big, "--shapes 128:1:256:32768")
    assert str(e.value) == (
        "--shapes 128:1:256:32768: out of memory on cuda: the KV pool alone needs 9.0 GiB, "
        "3.0 GiB is free; give smaller values"
    )


def test_backend_config_keeps_the_configs_page_size_where_the_backend_takes_it() -> None:
    """The config's page size first, the backend's own sizes only where it is refused: torch
    on page 32 stays on 32 (not 1, the first size torch takes)."""
    from mla_backends.backends.context import Capability
    from mla_backends.bench.fixtures import backend_config, setup_config

    cfg = setup_config("torch", 4, 2, 100, page_size=32, device="cpu", dtype="float32")
    got = backend_config(cfg, "torch", Capability("cpu"), [4, 8])
    assert (got.page_size, got.decode_backend) == (32, "torch")


def test_decode_setup_sets_an_fp8_pools_scale() -> None:
    """The FP8 pool's random codes are read under a set scale (0.05, rounded to bf16), not
    the default 1.0 that warns as uncalibrated on the first timed call."""
    from mla_backends.bench.fixtures import decode_setup

    s = decode_setup("torch", 4, 1, 2, 100, 16, "float8_e4m3fn", device="cpu", dtype="float32")
    pool = s.rt.kv_pool
    assert pool.scale_is_set(0) and pool.scale(0) == pytest.approx(0.05, rel=1e-2)


def test_stack_suite_on_cpu_eager_half_with_the_recorded_keys(tmp_path: Path) -> None:
    rc, out, err = _bench(
        tmp_path, "--suite", "stack", "--backends", "torch", "--stack-size", "tiny",
        "--batch", "1,2", "--prompt", "8", "--steps", "2", "--layers", "1",
    )  # fmt: skip
    assert rc == 0, err
    result = json.loads((tmp_path / "out" / "stack.json").read_text())
    recorded = _recorded("dsv3-stack-h200.json")
    assert set(recorded["meta"]) <= set(result["meta"]) and result["meta"]["layers"] == 1
    fixed = {k: result["meta"][k] for k in ("page_size", "kv_dtype", "dtype")}
    assert fixed == {"page_size": 64, "kv_dtype": "bfloat16", "dtype": "bfloat16"}
    assert [set(r) for r in result["rows"]] == [set(recorded["rows"][0])] * 2
    assert all(r["eager_ms"] > 0 and r["graph_ms"] is None for r in result["rows"])
    assert result["rows"][0]["vs_first_backend"] == 0.0  # the first backend against itself
    md = (tmp_path / "out" / "stack.md").read_text().splitlines()
    assert len(md) == 4 and md[2].startswith("| torch | 1 | ") and md[2].endswith(" 0/1 |")


def test_stack_suite_says_which_config_keys_it_does_not_use(tmp_path: Path) -> None:
    """It times a real model at page 64, bf16: a config's FP8 pool or page 16 was replaced
    silently (the timing recorded nothing of it)."""
    from mla_backends.cli import main

    cfg = tmp_path / "f8.yaml"
    cfg.write_text("device: cpu\ndecode_backend: torch\nprefill_backend: torch\n"
                   "kv_dtype: float8_e4m3fn\npage_size: 16\n")  # fmt: skip
    argv = ["bench", "--config", str(cfg), "--suite", "stack", "--stack-size", "tiny",
            "--batch", "1", "--prompt", "8", "--steps", "2", "--layers", "1",
            "--out", str(tmp_path / "o")]  # fmt: skip
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    assert out.getvalue().splitlines()[0] == (
        "stack: times page 64, bfloat16 pools and bfloat16 activations; the config's page_size "
        "16, kv_dtype float8_e4m3fn not used (it gives the device and the default backends)"
    )


def test_linear_suite_on_cpu_times_our_backend_and_says_what_needs_a_gpu(tmp_path: Path) -> None:
    rc, out, err = _bench(
        tmp_path, "--suite", "linear", "--batch", "1,3", "--heads", "2", "--head-dim", "16"
    )
    assert rc == 0, err
    result = json.loads((tmp_path / "out" / "linear.json").read_text())
    recorded = _recorded("linear-decode-h200.json")["rows"][0]
    rows = result["rows"]
    assert [(r["kind"], r["batch"]) for r in rows] == [
        ("kda", 1), ("kda", 3), ("gdn", 1), ("gdn", 3)
    ]  # fmt: skip
    assert all(set(r) <= set(recorded) and r["ours_us"] > 0 for r in rows)
    assert "raw fla and CUDA graphs not run: they need a CUDA GPU" in out.splitlines()[0]
    assert "reference (CPU: not a ceiling)" in out


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["--suite", "fi-plan"], r"config error: --suite fi-plan: needs a CUDA GPU"),
        (["--suite", "metadata"], r"config error: --suite metadata: needs a CUDA GPU"),
        (["--suite", "metadata", "--part", "fp8"], r"error: --part does not apply to --suite meta"),
        (  # both of its options taken: the refusal is the GPU's
            ["--suite", "metadata", "--backends", "torch", "--batch", "4"],
            r"config error: --suite metadata: needs a CUDA GPU",
        ),
        (["--suite", "linear", "--graphs"], r"error: --graphs does not apply to --suite linear"),
        (["--suite", "prefill", "--heads", "2,4"], r"--heads takes one value with --suite prefill"),
        (["--suite", "stack", "--backends", "flashmla"], r"--backends: 'flashmla' cannot run"),
        (["--suite", "hopper"], r"config error: --suite hopper: needs a CUDA GPU"),
        (["--suite", "hopper", "--batch", "2"], r"error: --batch does not apply to --suite hopper"),
        (["--suite", "grid", "--part", "fp8"], r"error: --part does not apply to --suite grid"),
    ],
    ids=[
        "fi-plan-needs-a-gpu",
        "metadata-needs-a-gpu",
        "metadata-options",
        "metadata-takes-backends-and-batch",
        "option-of-another-suite",
        "prefill-one-heads",
        "stack",
        "hopper-needs-a-gpu",
        "hopper-options",
        "part-is-hopper-only",
    ],
)
def test_bench_suite_refusals_are_one_line(tmp_path: Path, args: list[str], pattern: str) -> None:
    if GPU and args[1] in ("fi-plan", "metadata", "stack", "hopper"):
        pytest.skip("a GPU machine may run these")
    rc, out, err = _bench(tmp_path, *args)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, (out, err)
    assert re.search(pattern, err), err


def _tune_triton():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "tune_triton", PACKAGE_ROOT / "scripts" / "tune_triton.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(GPU, reason="on a GPU the script would run its sweeps")
def test_tune_triton_refuses_a_cpu_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _tune_triton().main(["probe", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == "tune_triton.py probe: cannot run: no CUDA GPU here\n"


@pytest.mark.skipif(
    GPU or os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreted CPU check"
)
def test_tune_triton_decode_call_is_the_backend_kernel() -> None:
    """The call every tuning command times is the backend's decode kernel: same out (here
    with 2 KV splits, so the merge runs too), launched with an explicit config."""
    from mla_backends.bench.fixtures import decode_setup

    s = decode_setup(
        "triton", 16, 2, 2, 80, page_size=16, kv_dtype="float32", device="cpu", dtype="float32"
    )
    s.rt.backend.init_forward_metadata(s.batch)
    ref = s.rt.backend.forward_absorbed(0, s.q_nope, s.q_rope, None, None, s.batch)
    call, out, lse = _tune_triton().decode_call(s, 16, 16, 4, 1, 2, tma=False)
    call()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(lse).all()


def test_hopper_rows_and_table_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hopper suite's row and table logic (its timings need a GPU): CPU timers in place
    of do_bench and graph replay, stand-in peers, one peer failing. Ratios are peer / ours on
    the graph column; a failing peer is its one-line error and a '-' in the table."""
    from mla_backends.bench import hopper

    monkeypatch.setattr(hopper, "bench_us", lambda fn: 10.0)
    monkeypatch.setattr(hopper, "graph_us", lambda fn: (fn(), 8.0)[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    def broken(s: object) -> object:
        raise RuntimeError("no fa3 here")

    peers = {"raw_flashmla": lambda s: lambda: None, "raw_flashinfer_fa3": broken}
    monkeypatch.setattr(hopper, "PEER_CALLS", peers)
    row = hopper.hopper_row((16, 1, 2, 64), "bfloat16", "cpu", copy_gbps=100.0, backend="torch")
    assert row["ours"] == {"eager_us": 10.0, "graph_us": 8.0}
    assert row["raw_flashmla/ours"] == 1.0 and "raw_flashinfer_fa3/ours" not in row
    assert row["raw_flashinfer_fa3"] == {"error": "RuntimeError: no fa3 here"}
    assert row["gbps"] == row["bytes"] / 8.0 / 1e3 and row["copy_fraction"] == row["gbps"] / 100
    table = hopper.markdown([row]).splitlines()
    assert len(table) == 3 and table[2].startswith("| 16 | 1 | 2 | 64 | bfloat16 | 10.0 | 8.0 |")
    assert "| 1.00 |" in table[2] and "| - | - | - |" in table[2]


# ------------------------------------------------- mutation round 11: host-side numbers
def test_grid_table_reads_each_rate_against_its_own_ceiling() -> None:
    """The TFLOP/s column is FLOPs / µs / 1e6 and its % is of the matmul ceiling (the copy
    one's of the copy ceiling): 1e8 FLOPs in 10 µs is 10 TFLOP/s, 50% of 20."""
    from mla_backends.bench.report import format_table

    c = {"copy_gbps": 3000.0, "matmul_tflops": 20.0}
    row = {"heads": 16, "q_len": 1, "batch": 1, "kv_len": 4096, "bytes": 3e6, "flops": 1e8,
           "triton_us": 10.0}  # fmt: skip
    line = format_table({"device": "GPU", "ceilings": c, "rows": [row]}).splitlines()[2]
    assert line.split()[-4:] == ["300.00", "10%", "10.0000", "50%"], line


def _fake_clock(monkeypatch: pytest.MonkeyPatch, module: object, durations: list[float]):  # type: ignore[no-untyped-def]
    """`module.time.perf_counter` reads a clock that each call of the returned fn advances by
    the next of `durations` (seconds); the fn's calls are counted in `calls`."""
    clock, calls = [0.0], []

    def fn(*args: object) -> None:
        calls.append(args)
        clock[0] += durations[len(calls) - 1]

    monkeypatch.setattr(module.time, "perf_counter", lambda: clock[0])  # type: ignore[attr-defined]
    return fn, calls


def test_cpu_bench_us_is_the_median_after_an_untimed_warm_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a CPU: one warm-up call, not timed and not in the window; calls until `rep_ms` has
    passed, at least 3; the median of them (not the first, the least or the mean)."""
    from mla_backends.bench import timing

    cpu = torch.device("cpu")
    # a cold 1 s warm-up, then 1, 4, 2, 3.5 ms: the 10 ms window ends after the fourth
    fn, calls = _fake_clock(monkeypatch, timing, [1.0, 1e-3, 4e-3, 2e-3, 3.5e-3, 1.0])
    assert timing.bench_us(fn, rep_ms=10, device=cpu) == pytest.approx(3500.0)
    assert len(calls) == 5
    # a window of 0 ms still times 3 calls
    fn, calls = _fake_clock(monkeypatch, timing, [1.0, 4e-3, 1e-3, 2e-3, 1.0])
    assert timing.bench_us(fn, rep_ms=0, device=cpu) == pytest.approx(2000.0)
    assert len(calls) == 4


def test_host_us_is_the_median_of_the_calls_after_five_warm_ups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mla_backends.bench import timing

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    fn, calls = _fake_clock(monkeypatch, timing, [1.0] * 5 + [1e-3, 5e-3, 2e-3])
    assert timing.host_us(fn, n=3) == pytest.approx(2000.0)
    assert len(calls) == 8


def test_cpu_reference_rates_count_read_and_write_and_take_the_faster_matmul(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The copy rate counts the bytes read and the bytes written; the matmul rate is the
    best of float32 and bfloat16 (here float32's), named as such."""
    from functools import partial

    from mla_backends.bench import timing

    def fake_us(fn: object, device: object = None) -> float:
        if isinstance(fn, partial):  # torch.matmul(x, y): 100 µs in fp32, 50 µs in bf16
            return 100.0 if fn.args[0].dtype == torch.float32 else 50.0
        return 1000.0  # the copy

    monkeypatch.setattr(timing, "bench_us", fake_us)
    c = timing.ceilings(torch.device("cpu"))
    assert c["copy_gbps"] == pytest.approx(2 * 2**25 * 2 / 1000 / 1e3)
    assert c["matmul_tflops"] == pytest.approx(2 * 1024**3 / 100 / 1e6)  # over bf16's 5.4
    assert c["matmul_what"].startswith("float32 matmul") and c["is_ceiling"] is False


def test_grid_refuses_any_kv_length_shorter_than_the_query(tmp_path: Path) -> None:
    """Every KV length of the grid must hold the step's query tokens: the shortest, not only
    the longest."""
    rc, out, err = _bench(
        tmp_path, "--backends", "torch", "--batch", "1", "--kv-len", "1,100", "--q-len", "2"
    )
    assert rc == 2 and out == "", (out, err)
    assert "error: --kv-len 1 is shorter than --q-len 2" in err, err


def test_hopper_out_files_follow_its_default_part() -> None:
    """Without --part, hopper writes hopper-small.*: the files checked before timing are those."""
    from mla_backends.bench import hopper
    from mla_backends.bench.cli import out_files
    from mla_backends.bench.options import Options

    assert "small" in hopper.PARTS
    assert out_files(Options(suite="hopper")) == ["hopper-small.json", "hopper-small.md"]


def test_size_options_name_every_list_as_given() -> None:
    """A pool-size error names the options as given: comma lists, shapes among them."""
    from mla_backends.bench.cli import _size_options
    from mla_backends.bench.options import Options

    shapes = Options(suite="anchors", shapes=[(16, 1, 1, 64), (4, 2, 2, 8)])
    assert _size_options(shapes) == "--shapes 16:1:1:64,4:2:2:8"
    grid = Options(suite="grid", batch=[1, 8], kv_len=[16])
    assert _size_options(grid) == "--batch 1,8, --kv-len 16"
    assert _size_options(Options(suite="stack")) == "--suite stack"


def test_out_refuses_a_blank_folder_name() -> None:
    import argparse

    from mla_backends.bench.cli import _out_folder

    assert _out_folder("o") == "o"
    with pytest.raises(argparse.ArgumentTypeError, match="expected a folder name"):
        _out_folder("  ")


def test_stack_numbers_speed_up_step_time_and_differences(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Speed-up is eager / graph; a step's time leaves its warm-up step out; differences are
    relative to the second (reference) tensor, per token the median."""
    from mla_backends.bench import stack

    row = dict(backend="torch", batch=2, eager_ms=10.0, graph_ms=4.0, graph_tokens_per_s=500.0,
               graph_vs_eager=1e-3, graph_vs_eager_tokens=(1e-3, 0), vs_first_backend=0.0,
               vs_first_backend_tokens=(0.0, 0))  # fmt: skip
    assert "| 10.00 | 4.00 | 2.50x | 500 |" in stack.table([row]).splitlines()[2]

    fn, calls = _fake_clock(monkeypatch, stack, [1.0, 2e-3, 4e-3])
    eng = type("Eng", (), {"decode": staticmethod(fn), "device": torch.device("cpu")})()
    gen = torch.Generator().manual_seed(0)
    assert stack._timed_steps(eng, [0], 3, gen, 10) == pytest.approx(3e-3)  # type: ignore[arg-type]
    assert len(calls) == 3

    assert stack._rel(torch.tensor([2.0]), torch.tensor([1.0])) == 1.0
    a, b = torch.tensor([[1.0], [1.0], [1.9]]), torch.ones(3, 1)
    assert stack._per_token(a, b) == (0.0, 1)


def test_traffic_counts_anchors_bytes_and_flops() -> None:
    """ANCHORS.md: the cache row once (576 elements) and q in and out (576 + 512) once per
    query head; FLOPs 2 x (576 + 512) per query head and key."""
    from mla_backends.bench.fixtures import decode_setup, traffic

    s = decode_setup("torch", 4, 2, 3, 100, 16, device="cpu", dtype="float32")
    b, q, h, kv = 3, 2, 4, 100
    assert traffic(s) == (576 * 2 * b * kv + b * q * h * 1088 * 2, 2 * b * q * h * kv * 1088)


def test_backend_config_refuses_a_head_count_past_the_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A page size is taken only if the backend runs every head count of the grid: a refusal
    of the second head count (at every page size) is the ConfigError."""
    from mla_backends.backends.context import Capability
    from mla_backends.bench import fixtures
    from mla_backends.config import ConfigError

    class EightHeadsOnly:
        caps = type("Caps", (), {"page_sizes": (1, 64)})

        @staticmethod
        def supports(cfg: object, cap: object, role: str) -> str | None:
            heads = cfg.model.num_heads  # type: ignore[attr-defined]
            return None if heads == 8 else f"{heads} heads: takes 8"

    monkeypatch.setattr(fixtures, "get_backend_class", lambda name: EightHeadsOnly)
    cfg = fixtures.setup_config("torch", 8, 2, 100, page_size=32, device="cpu", dtype="float32")
    assert fixtures.backend_config(cfg, "torch", Capability("cpu"), [8]).page_size == 32
    with pytest.raises(ConfigError, match=r"'torch' cannot run here: 4 heads: takes 8"):
        fixtures.backend_config(cfg, "torch", Capability("cpu"), [8, 4])


def test_grid_table_ends_with_the_prefill_lines_and_errors() -> None:
    """`--prefill-tokens` on the grid: its timed paths and its errors are in the table."""
    from mla_backends.bench.report import format_table

    prefill = {"tokens": 64, "heads": 2, "sdpa_us": 100.0, "sdpa_tflops": 5.0,
               "fa_error": "RuntimeError: needs a GPU"}  # fmt: skip
    result = {"device": "GPU", "ceilings": {"copy_gbps": 1.0, "matmul_tflops": 1.0},
              "rows": [], "prefill": prefill}  # fmt: skip
    lines = format_table(result).splitlines()
    assert lines[2].startswith("prefill 64 x 2 heads causal sdpa") and "vs sdpa 1.00x" in lines[2]
    assert lines[3:] == ["prefill fa_error: RuntimeError: needs a GPU"]


def test_require_fits_refuses_a_pool_one_byte_over_the_free_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mla_backends.bench.fixtures import pool_bytes, require_fits, setup_config
    from mla_backends.cli import UsageError

    cfg = setup_config("torch", 128, 64, 4096, device="cuda")
    free = [pool_bytes(cfg)]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (free[0], 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: 0)
    require_fits(cfg, "--batch 64")  # exactly enough
    free[0] -= 1
    with pytest.raises(UsageError, match="--batch 64: out of memory on cuda"):
        require_fits(cfg, "--batch 64")
