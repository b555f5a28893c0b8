"""The command line as a user meets it: from any directory, with the shipped default config;
every bad input gets one clear line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import PACKAGE_ROOT, Cli

from mla_backends.backends.registry import _REGISTRY, register_backend
from mla_backends.backends.torch_backend import TorchBackend


def test_help_works_beside_a_foreign_models_package(cli: Cli, tmp_path: Path) -> None:
    pkg = tmp_path / "models"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('the wrong models package')\n")
    proc = cli("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "verify" in proc.stdout and "run" in proc.stdout and "bench" in proc.stdout
    proc = cli("run", "--help", cwd=tmp_path)
    assert proc.returncode == 0 and "--requests" in proc.stdout, proc.stderr


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text + "device: cpu\n")
    return str(path)


# (id, argv builder (tmp_path -> args), regex the one stderr line must match)
BAD_INPUTS = [
    (
        "missing-config",
        lambda t: ["verify", "--config", str(t / "missing.yaml")],
        r"config error: .*missing.yaml: no such config file; give a YAML path or a shipped "
        r"config: \['deepseek_v3_h100', 'default'\]",
    ),
    (
        "directory-as-config",
        lambda t: ["verify", "--config", str(t)],
        r"config error: .*: is a directory; --config takes a YAML file",
    ),
    (
        "unknown-model-base",
        lambda t: ["verify", "--config", _yaml(t, "model: {base: deepseek-v4}\n")],
        r"c.yaml: model.base='deepseek-v4' is not one of \['deepseek-v3', 'tiny', 'tiny-kernel'\]",
    ),
    (
        "run-with-dcp",
        lambda t: ["run", "--config", _yaml(t, "dcp_size: 2\n")],
        r"run: config error: .*c.yaml: dcp_size=2: run serves from one process; use dcp_size: 1",
    ),
    (
        "graph-sizes-not-a-list",
        lambda t: ["verify", "--config", _yaml(t, "cuda_graph_batch_sizes: 4\n")],
        r"c.yaml: cuda_graph_batch_sizes must be a list of positive integers, e.g. \[1, 2, 4, 8\], "
        r"got 4",
    ),
    (
        "float-num-pages",
        lambda t: ["bench", "--config", _yaml(t, "num_pages: 1.5\n")],
        r"c.yaml: num_pages must be an integer >= 1, got 1.5 \(float\)",
    ),
    (
        "float-page-size",
        lambda t: ["run", "--config", _yaml(t, "page_size: 16.0\n")],
        r"c.yaml: page_size must be an integer >= 1, got 16.0 \(float\)",
    ),
    (
        "yaml-not-valid",
        lambda t: ["verify", "--config", _yaml(t, "model: [tiny\n")],
        r"config error: .*c.yaml: not valid YAML: line 2, column 7: expected ',' or '\]'",
    ),
    (
        "yaml-key-given-twice",
        lambda t: ["verify", "--config", _yaml(t, "page_size: 16\npage_size: 32\n")],
        r"config error: .*c.yaml: not valid YAML: line 2, column 1: key 'page_size' is given "
        r"twice",
    ),
    (
        "bench-unknown-backend",
        lambda t: ["bench", "--backends", "bogus"],
        r"bench: error: argument --backends: unknown backend 'bogus'; known: .*torch",
    ),
    (
        "bench-empty-backends",
        lambda t: ["bench", "--backends", ","],
        r"bench: error: argument --backends: ',': expected backend names; known: .*torch",
    ),
    (
        "bench-empty-peers",
        lambda t: ["bench", "--suite", "anchors", "--peers", " , "],
        r"bench: error: argument --peers: ' , ': expected peer names, or none",
    ),
    (
        "bench-kv-len-not-int",
        lambda t: ["bench", "--kv-len", "abc"],
        r"bench: error: argument --kv-len: 'abc': 'abc' is not an integer; expected a comma list "
        r"of integers >= 1",
    ),
    (
        "bench-empty-out",
        lambda t: ["bench", "--out", ""],
        r"bench: error: argument --out: expected a folder name, got an empty string",
    ),
    (
        "bench-metadata-on-a-cpu",
        lambda t: ["bench", "--suite", "metadata", "--backends", "torch", "--out", str(t / "o")],
        r"bench: config error: --suite metadata: needs a CUDA GPU",
    ),
    (
        "bench-layers-without-graphs",
        lambda t: ["bench", "--layers", "3", "--out", str(t / "o")],
        r"bench: error: --layers: the grid times whole steps of --layers calls only with --graphs",
    ),
    (
        "bench-one-token-prompts",
        lambda t: ["bench", "--suite", "stack", "--stack-size", "tiny", "--prompt", "1"],
        r"bench: error: argument --prompt: 1 is out of range: must be >= 2",
    ),
    (
        "bench-stack-of-v32",
        lambda t: ["bench", "--suite", "stack", "--stack-size", "tiny-v32"],
        r"bench: error: argument --stack-size: invalid choice: 'tiny-v32'",
    ),
    (
        # argparse kept the last value: batch 2 alone was timed, silently (helper 69)
        "bench-option-given-twice",
        lambda t: ["bench", "--batch", "1", "--batch", "2", "--out", str(t / "o")],
        r"bench: error: argument --batch: given twice \(see mla-backends bench --help\)",
    ),
    (
        "run-option-given-twice",
        lambda t: ["run", "--random", "tiny-v32", "--random", "tiny"],
        r"run: error: argument --random: given twice",
    ),
    (
        "run-zero-requests",
        lambda t: ["run", "--requests", "0"],
        r"run: error: argument --requests: 0 is out of range: must be >= 1",
    ),
    (
        "run-too-many-requests",
        lambda t: ["run", "--requests", "100"],
        r"run: error: --requests 100 is out of range: 1\.\.26 with this config \(the shipped "
        r"default: max_requests 64, 256 pages of 16 tokens",
    ),
    (
        "run-seed-past-64-bits",
        lambda t: ["run", "--seed", "99999999999999999999999"],
        r"run: error: argument --seed: 99999999999999999999999 is out of range: must be in "
        r"0\.\.9223372036854775807",
    ),
    (
        "verify-negative-seed",
        lambda t: ["verify", "--seed", "-1"],
        r"verify: error: argument --seed: -1 is out of range: must be in 0\.\.",
    ),
    (
        "run-max-new-fits-no-request",
        lambda t: ["run", "--max-new", "100000"],
        r"run: error: --max-new 100000 does not fit this config \(the shipped default: 256 "
        r"pages of 16 tokens, max_context_len 2048\): one request of 3 prompt tokens plus "
        r"--max-new needs a context of 100002 tokens, over max_context_len 2048",
    ),
    (
        "run-max-new-past-the-pages",
        lambda t: ["run", "--max-new", "100", "--config", _yaml(t, "num_pages: 4\n")],
        r"run: error: --max-new 100 does not fit this config \(.*c.yaml: 4 pages of 16 tokens, "
        r"max_context_len 2048\): one request of 3 prompt tokens plus --max-new needs 7 pages, "
        r"over num_pages 4",
    ),
    (
        # the config's max_context_len stands: it was raised to 64 + --max-new without a word
        "run-requests-past-max-context-len",
        lambda t: ["run", "--requests", "4", "--config", _yaml(t, "max_context_len: 16\n")],
        r"run: error: --requests 4 is out of range: 1\.\.1 with this config \(.*c.yaml: "
        r"max_requests 64, 256 pages of 16 tokens, max_context_len 16;",
    ),
    (
        "run-sparse-backend-that-cannot-run",
        lambda t: [
            "run",
            "--random",
            "tiny-v32",
            "--config",
            _yaml(t, "sparse_backend: flashmla\n"),
        ],
        r"run: config error: .*c.yaml: sparse_backend: sparse backend 'flashmla' cannot run here: "
        r"FlashMLA sparse is built for kv_lora_rank 512.*\. Sparse backends that can run with "
        r"this config on cpu.*: \[.*'torch'\]",
    ),
    (
        # num_pages that large is past the int32 slot ids (test_cli_edges): the table is here
        "run-pool-past-memory",
        lambda t: ["run", "--config", _yaml(t, "max_requests: 1000000000000\n")],
        r"run: error: .*c.yaml: num_pages 256, max_requests 1000000000000, max_context_len 2048: "
        r"out of memory on cpu; give smaller values",
    ),
    (
        "run-missing-model-folder",
        lambda t: ["run", "--model", str(t / "no-such-checkpoint")],
        r"run: error: argument --model: .*no-such-checkpoint does not exist; expected a "
        r"checkpoint directory",
    ),
    (
        "run-model-folder-without-config",
        lambda t: ["run", "--model", str(t)],
        r"run: checkpoint error: .*: no config.json",
    ),
]


@pytest.mark.parametrize(
    "argv, pattern", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input_is_one_clear_line_and_exit_2(
    cli: Cli,
    tmp_path: Path,
    argv,
    pattern: str,  # type: ignore[no-untyped-def]
) -> None:
    proc = cli(*argv(tmp_path), timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert re.search(pattern, lines[0]), lines[0]
    assert proc.stdout == ""  # it failed before doing any work


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_run_of_a_cuda_config_on_a_cpu_is_one_line(cli: Cli) -> None:
    """`run` builds the model before it resolves the backends: `device: cuda` was a torch
    AssertionError traceback ("Torch not compiled with CUDA enabled") there."""
    proc = cli("run", "--config", "deepseek_v3_h100", timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr == (
        "mla-backends run: config error: deepseek_v3_h100: device='cuda' but this machine has "
        f"no usable CUDA device (torch {torch.__version__}); use device: auto or cpu\n"
    )


def test_run_from_an_empty_folder_checks_against_the_fp64_reference(cli: Cli) -> None:
    proc = cli("run", "--requests", "3", "--max-new", "3", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "logits vs the same model with fp64 reference attention" in proc.stdout
    assert ": agree;" in proc.stdout


def test_run_over_an_fp8_pool_sets_its_scale_and_says_so(tmp_path: Path, cli: Cli) -> None:
    """`run` with an FP8 KV pool stored under a scale never set: one multi-line
    UncalibratedScaleWarning a layer on stderr. It sets SGLang's convention, 1.0 a layer,
    and says so in its summary line."""
    cfg = _yaml(tmp_path, "kv_dtype: float8_e4m3fn\n")
    proc = cli("run", "--config", cfg, "--requests", "2", "--max-new", "2", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "UncalibratedScaleWarning" not in proc.stderr, proc.stderr
    assert "kv float8_e4m3fn at scale 1.0 a layer" in proc.stdout, proc.stdout


def test_run_catches_a_backend_that_is_wrong(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`run` compares with the fp64 reference, not with itself: the torch backend with a
    softmax scale off by 10 % disagrees."""
    from mla_backends.cli import main

    @register_backend("wrong_scale_test")
    class WrongScale(TorchBackend):
        name = "wrong_scale_test"

        def __init__(self, ctx) -> None:  # type: ignore[no-untyped-def]
            super().__init__(ctx)
            self.scale *= 1.1

    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "device: cpu\ndtype: float32\nkv_dtype: float32\n"
        "prefill_backend: wrong_scale_test\ndecode_backend: wrong_scale_test\n"
    )
    try:
        assert main(["run", "--config", str(cfg), "--requests", "2", "--max-new", "3"]) == 1
    finally:
        del _REGISTRY["wrong_scale_test"]
    assert "DISAGREE" in capsys.readouterr().out


def test_run_fits_requests_to_the_pool_and_context_exactly() -> None:
    """`run`'s request bound at its edges: a prompt of 3 plus --max-new 14 stores 16 tokens
    (the last pick is never fed back), one page of 16 and max_context_len 16 exactly; prompts
    of 3, 14 and 25 with one new token fill 1 + 1 + 2 pages, a pool of 4 exactly."""
    import dataclasses

    from mla_backends.config import load_config
    from mla_backends.models.run import max_requests

    base = load_config(None)
    assert base.page_size == 16
    assert max_requests(dataclasses.replace(base, num_pages=4), 1) == 3
    assert max_requests(dataclasses.replace(base, num_pages=3), 1) == 2
    for edge in (dict(num_pages=1), dict(max_context_len=16)):
        cfg = dataclasses.replace(base, **edge)  # type: ignore[arg-type]
        assert (max_requests(cfg, 14), max_requests(cfg, 15)) == (1, 0), edge


def _run_diff(out: str) -> float:
    return float(re.search(r"max relative difference (\S+) \(tolerance", out).group(1))  # type: ignore[union-attr]


def test_run_judges_every_decode_step_at_the_float32_tolerance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A decode backend whose output is off by 0.1 % (prefill exact): `run` compares the
    logits of every step, not the prefill's alone, at fp32's 1e-4, and exits 1 on it."""
    from mla_backends.cli import main

    @register_backend("off_decode_test")
    class OffDecode(TorchBackend):
        name = "off_decode_test"

        def _attend_absorbed(self, layer, q_nope, q_rope, batch, need_lse):  # type: ignore[no-untyped-def]
            out, lse = super()._attend_absorbed(layer, q_nope, q_rope, batch, need_lse)
            return out * (1 + 1e-3), lse

    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "device: cpu\ndtype: float32\nkv_dtype: float32\n"
        "prefill_backend: torch\ndecode_backend: off_decode_test\n"
    )
    try:
        code = main(["run", "--config", str(cfg), "--requests", "2", "--max-new", "3"])
    finally:
        del _REGISTRY["off_decode_test"]
    out = capsys.readouterr().out
    assert code == 1 and "(tolerance 0.0001): DISAGREE" in out, out
    assert 2e-4 < _run_diff(out) < 1e-3, out  # past 1e-4, within a 10x looser bound


def test_run_compares_logits_relative_to_their_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tiny checkpoint with its head scaled by 1000 (logits near 1000): fp32 kernels
    still agree with the fp64 reference, the difference taken relative to the logits."""
    from safetensors.torch import load_file, save_file

    from mla_backends.cli import main
    from mla_backends.models.run import save_random

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_random("tiny", ckpt, seed=0)
    t = load_file(str(ckpt / "model.safetensors"))
    t["lm_head.weight"] = t["lm_head.weight"] * 1000
    save_file(t, str(ckpt / "model.safetensors"))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("device: cpu\ndtype: float32\nkv_dtype: float32\n")
    argv = ["run", "--model", str(ckpt), "--config", str(cfg), "--requests", "2", "--max-new", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert ": agree;" in out and _run_diff(out) < 1e-5, out


def test_run_fails_when_the_reference_picks_other_layer0_index_sets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """V3.2: the reference run follows the served run's index selections, so its logits agree
    whatever it would pick; at layer 0 (the same inputs) its own picks must match, or `run`
    fails even though the logits agree."""
    from mla_backends.cli import main
    from mla_backends.models.choices import Selections

    own = Selections.follow

    def follow(self: Selections, indexer: object) -> None:
        select = indexer.select  # type: ignore[attr-defined]
        indexer.select = lambda layer, *a: select(layer, *a) + 1  # type: ignore[attr-defined]
        own(self, indexer)

    monkeypatch.setattr(Selections, "follow", follow)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("device: cpu\ndtype: float32\nkv_dtype: float32\nsparse_backend: torch\n")
    argv = ["run", "--random", "tiny-v32", "--config", str(cfg), "--requests", "2"]
    assert main([*argv, "--max-new", "2"]) == 1
    out = capsys.readouterr().out
    assert "on its own in 0 of 2 calls" in out and _run_diff(out) <= 1e-4, out
    assert "(tolerance 0.0001): DISAGREE" in out, out


def test_run_follows_the_served_routes_and_tokens_past_a_near_tie(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`run` itself (test_run_v32 drives `_serve`): bf16 tiny V3.2, its sparse attention off
    by 2^-7, flips a near-tie (an expert route, a greedy token); the reference run follows
    the served run's routes and decodes its tokens, so the logits still agree."""
    from test_run_v32 import skew_served_sparse_attention

    from mla_backends.cli import main

    skew_served_sparse_attention(monkeypatch)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "device: cpu\nmax_context_len: 128\nsparse_backend: torch\n"
        "prefill_backend: torch\ndecode_backend: torch\n"
    )
    argv = ["run", "--random", "tiny-v32", "--config", str(cfg), "--requests", "3"]
    assert main([*argv, "--max-new", "3"]) == 0
    out = capsys.readouterr().out
    assert ": agree;" in out and "kv bfloat16" in out, out
    assert 2**-9 < _run_diff(out) <= 5e-2, out


def test_verify_gives_its_verdict_on_the_configs_own_choices(
    cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """verify runs every backend, so its table alone read as "this config is fine": it now
    says how the config's own backends fared and fails when none of their rows ran; a config
    with dcp_size > 1 gets its backends checked over that many ranks (it accepted and
    ignored dcp_size, then named it as not checked)."""
    import dataclasses

    from mla_backends import verify as V
    from mla_backends.cli import main
    from mla_backends.config import load_config

    cfg = dataclasses.replace(load_config(None, resolve=False), decode_backend="torch",
                              prefill_backend="torch", sparse_backend="auto")  # fmt: skip

    def row(backend: str, ok: bool) -> V.Row:
        return V.Row(backend, "decode", "bfloat16", 0.0, 0.0, ok, "" if ok else "out err")

    fp8 = V.Row("torch", "decode", "fp8", 0.0, 0.0, False, "out err")  # not this config's pair
    mixed = [row("torch", True), row("triton", False), row("sparse:torch", True), fp8]
    assert V.config_summary(cfg, mixed) == [
        "this config's backends torch: 1 of 1 rows pass",
        "this config's sparse_backend auto: 1 of 1 rows pass",
    ]
    lines = V.config_summary(
        dataclasses.replace(cfg, sparse_backend="triton", dcp_size=2),
        [row("torch", True), row("torch", False), row("sparse:torch", True)],
    )
    assert lines[0] == "this config's backends torch: 1 of 2 rows FAIL"
    assert lines[1] == "this config's sparse_backend triton: NOT CHECKED: no row of it ran here"
    assert lines[2] == (
        "this config's dcp_size 2 (replicated heads) over torch: NOT CHECKED: no row of it ran here"
    )
    # a named sparse backend that cannot run here says why (it said only "no row of it ran")
    on_cpu = dataclasses.replace(cfg, device="cpu", sparse_backend="flashmla")
    line = V.config_summary(on_cpu, [row("torch", True)])[1]
    assert line.startswith("this config's sparse_backend flashmla: NOT CHECKED: FlashMLA sparse")
    assert "needs a CUDA GPU with SM 90, found cpu" in line and "topk 32)" in line
    assert "needs a CUDA GPU" in V.not_runnable(on_cpu)["sparse:flashinfer_mla"]
    assert "sparse:torch" not in V.not_runnable(on_cpu)
    # the command fails when the config's backend had no row, though every row passed
    yaml = tmp_path / "c.yaml"
    yaml.write_text("device: cpu\ndecode_backend: torch\nprefill_backend: torch\n")
    monkeypatch.setattr(V, "verify", lambda config, seed=0: [row("triton", True)])
    assert main(["verify", "--config", str(yaml)]) == 1
    assert "backends torch: NOT CHECKED" in capsys.readouterr().out
    monkeypatch.undo()
    yaml.write_text("device: cpu\ndcp_size: 2\nsparse_backend: torch\n")
    proc = cli("verify", "--config", str(yaml), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"this config's backends \S+: (\d+) of \1 rows pass", proc.stdout)
    assert re.search(r"this config's sparse_backend torch: (\d+) of \1 rows pass", proc.stdout)
    # two gloo ranks against one process and fp64: decode, verify, extend, the graph path
    said = re.search(r"this config's dcp_size 2 \(replicated heads\) over (\S+): 4 of 4 rows pass",
                     proc.stdout)  # fmt: skip
    assert said, proc.stdout
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"dcp2:{said[1]} ")]
    assert [ln.split()[1] for ln in rows] == [
        "decode-replicated", "verify-replicated", "extend-replicated", "decode-graph-replicated"
    ] and all(ln.endswith("PASS") for ln in rows), rows  # fmt: skip


def test_verify_of_a_dcp_config_reports_a_failing_rank_as_a_row(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A DCP case that fails on one rank fails its row (the worst error of the ranks, each
    failing rank named); a rank that raises is one FAIL row with its last line, exit 1, not a
    traceback; a GPU config short of GPUs is NOT CHECKED, saying how many it needs."""
    import dataclasses
    import math

    from mla_backends import verify as V
    from mla_backends.cli import main
    from mla_backends.config import load_config
    from mla_backends.dcp import verify as D
    from mla_backends.dcp.launch import RankFailed

    cfg = dataclasses.replace(
        load_config(None, resolve=False), decode_backend="torch", prefill_backend="torch",
        dcp_size=2, dcp_heads="tp",
    )  # fmt: skip
    cases = D.dcp_cases(cfg)
    assert {c.num_heads for c in cases} == {2 * cfg.model.num_heads}  # the group's heads

    def rank_results(rank: int, bad: int) -> list[dict[str, object]]:
        return [
            {"id": c.id, "rank": rank, "ok": not (rank == 1 and i == bad),
             "errors": {"out vs single": 0.1 * rank + i, "lse vs reference": 0.01 * rank,
                        "layout": 0.0},
             "detail": "out vs single: too far" if rank == 1 and i == bad else ""}
            for i, c in enumerate(cases)
        ]  # fmt: skip

    monkeypatch.setattr(D, "spawn", lambda *a: [rank_results(0, 2), rank_results(1, 2)])
    got = D.verify_dcp(cfg)
    assert [r["ok"] for r in got] == [True, True, False, True]
    assert got[2]["detail"] == "rank 1: out vs single: too far"
    assert got[3]["out_err"] == 0.1 + 3 and got[3]["lse_err"] == 0.01
    assert [D.mode_name(r["case"]) for r in got][:2] == ["decode-tp", "verify-tp"]

    def raised(*a: object) -> list[object]:
        raise RankFailed("rank1: Traceback (most recent call last):\n  ...\nValueError: boom")

    monkeypatch.setattr(D, "spawn", raised)
    (row,) = V._dcp_rows(cfg, 0)
    assert not row.ok and row.detail == "ValueError: boom" and math.isnan(row.out_err)
    yaml = tmp_path / "c.yaml"
    yaml.write_text("device: cpu\ndcp_size: 2\ndecode_backend: torch\nprefill_backend: torch\n")
    monkeypatch.setattr(V, "verify", lambda config, seed=0: [V.Row("torch", "decode", "bf16",
                        0.0, 0.0, True, ""), *V._dcp_rows(config, 0)])  # fmt: skip
    assert main(["verify", "--config", str(yaml)]) == 1
    out = capsys.readouterr().out
    assert "dcp2:torch      a rank raised" in out and "FAIL ValueError: boom" in out
    assert "dcp_size 2 (replicated heads) over torch: 1 of 1 rows FAIL" in out

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    gpu = dataclasses.replace(cfg, device="cuda")
    assert D.unrunnable(gpu) == "dcp_size 2 needs 2 GPUs (one NCCL rank each), found 1"
    assert D.verify_dcp(gpu) == []
    assert V.config_summary(gpu, [])[-1] == (
        "this config's dcp_size 2 (tp heads) over torch: NOT CHECKED: dcp_size 2 needs 2 GPUs "
        "(one NCCL rank each), found 1"
    )


def test_cli_values_parse_with_named_ranges() -> None:
    from mla_backends.cli import int_at_least, int_list

    assert int_list(1)("1, 8,64") == [1, 8, 64]
    for bad, msg in [("", "at least one"), ("0", "out of range"), ("1,x", "'x' is not")]:
        with pytest.raises(argparse.ArgumentTypeError, match=msg):
            int_list(1)(bad)
    assert int_at_least(0)("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match=r"-1 is out of range: must be >= 0"):
        int_at_least(0)("-1")


def test_config_loading_and_run_import_no_triton(tmp_path: Path) -> None:
    """A base install (no triton) loads every config and runs `run` on a CPU: triton is
    imported only once a Triton backend is built."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("device: cpu\n")
    script = tmp_path / "probe.py"
    script.write_text(
        "import sys\n"
        "from mla_backends.cli import main\n"
        "from mla_backends.config import load_config, shipped_configs\n"
        "for name in shipped_configs():\n"
        "    try:\n"
        "        load_config(name)\n"
        "    except Exception as e:  # GPU configs refuse a CPU machine, by a ConfigError\n"
        "        assert type(e).__name__ == 'ConfigError', e\n"
        f"argv = ['run', '--config', {str(cfg)!r}, '--requests', '2', '--max-new', '2']\n"
        "assert main(argv) == 0\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'triton')\n"
        "assert not bad, bad\n"
        "print('no triton')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(PACKAGE_ROOT)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0 and "no triton" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.interp
def test_verify_of_a_config_naming_triton_on_a_cpu_runs_it_interpreted(
    cli: Cli, tmp_path: Path
) -> None:
    """verify runs the Triton kernels under the interpreter on a CPU, but set it only after
    resolving the config's backends: a config naming `triton` was refused there ("runs only
    under TRITON_INTERPRET=1") by the check whose condition verify itself then met."""
    yaml = tmp_path / "c.yaml"
    yaml.write_text(
        "device: cpu\nprefill_backend: triton\ndecode_backend: triton\nmodel: tiny-kernel\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = cli("verify", "--config", str(yaml), env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("triton kernels run under the Triton interpreter")
    assert re.search(r"this config's backends triton: (\d+) of \1 rows pass", proc.stdout)


def test_verify_runs_the_configs_own_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 queries over an FP8 cache: the rows ran bf16 over FP8 (and every pair with the
    config's kv_dtype) and never the config's own pair, yet its backends were reported as
    passing."""
    import dataclasses

    from mla_backends import verify as V
    from mla_backends.config import load_config
    from mla_backends.sparse import verify as sparse_verify

    cfg = dataclasses.replace(load_config(None, resolve=False), decode_backend="torch",
                              prefill_backend="torch", dtype="float16",
                              kv_dtype="float8_e4m3fn")  # fmt: skip
    monkeypatch.setattr(V, "available_backends", lambda: ["torch"])
    monkeypatch.setattr(sparse_verify, "verify_sparse", lambda *a: [])
    rows = V.verify(cfg)
    own = [r for r in rows if r.dtype == "float16/float8_e4m3fn"]
    assert {r.mode for r in own} == {"decode", "verify", "extend"} and all(r.ok for r in own)
    assert V.config_summary(cfg, rows)[0] == "this config's backends torch: 5 of 5 rows pass"


def test_verify_asks_a_named_sparse_backend_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`verify` with `sparse_backend: flashmla` on a CPU asked its `supports` twice over every
    pool (`not_runnable`, then `config_summary` through `_sparse_why`), building a context
    each time; the one answer now serves both lines, which read as before."""
    from mla_backends import verify as V
    from mla_backends.cli import main
    from mla_backends.sparse.base import get_sparse_backend_class
    from mla_backends.sparse.verify import POOLS

    cls = get_sparse_backend_class("flashmla")
    asked: list[str] = []

    def supports(c: type, ctx: object, cap: object) -> str:
        asked.append(c.__name__)
        return "REASON"

    monkeypatch.setattr(cls, "supports", classmethod(supports))
    monkeypatch.setattr(V, "verify", lambda config, seed=0: [])
    yaml = tmp_path / "c.yaml"
    yaml.write_text("device: cpu\ndecode_backend: torch\nprefill_backend: torch\n"
                    "sparse_backend: flashmla\n")  # fmt: skip
    assert main(["verify", "--config", str(yaml)]) == 1
    out = capsys.readouterr().out
    assert len(asked) == len(POOLS), asked
    because = "REASON (verify's sparse cases here: kv_lora_rank 128 + rope 16, topk 32)"
    assert f"not run here: sparse:flashmla: {because}" in out
    assert f"this config's sparse_backend flashmla: NOT CHECKED: {because}" in out
