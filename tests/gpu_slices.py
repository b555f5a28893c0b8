"""The GPU suite in slices that each fit one 10-minute device call on a fresh H100:
`pytest --gpu-slice tests-N` (scripts/gpu_check.sh runs them; `tests-all` is their union,
for a machine without the limit).

Every test with the gpu marker (sm90 / sm100 / multigpu imply it) falls in exactly one slice:
the first rule below that matches it, else the last slice. A few tests without the marker
join a slice too (`cpu=True`: the offline SM90 compiles, which check the GPU toolchain).

Costs are estimates for a fresh H100 with empty compile caches: seconds per test, from the
distinct kernel configurations a test compiles (a Triton parity case: one absorbed-attention
configuration of its own, about 3.5 s; a FlashInfer parity case: about 1 s, its JIT builds
shared by the row) and the last measured runs (87 Triton GPU tests in 280 s on an H100;
the FlashInfer selection of 97 tests and a decode table in one call; fla's autotuning alone
ran a fresh machine's 10 minutes out). tests/test_gpu_slices.py keeps each slice under
`BUDGET_S`. On a warm machine the later slices reuse the caches (gpu_check.sh keeps them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pytest

BUDGET_S = 420  # of the device call's 600 s: bundle set-up, collection and slack beside it
START_S = 30  # each slice: interpreter start, imports (torch, sglang), collection


@dataclass(frozen=True)
class Rule:
    slice: str
    file: str
    tests: tuple[str, ...] = ()  # test function names; () = every test of the file
    backend: str | None = None  # the parametrised backend (tests/parity.py tables)
    kv_dtypes: tuple[str, ...] = ()  # ... and the case's KV dtypes; () = any
    pages: tuple[int, ...] = ()  # ... and the case's page sizes; () = any
    tag: str = ""  # ... and the parity row's tag (`Row.tag`, the id's last part); "" = any
    seconds: float = 5.0  # per test
    cpu: bool = False  # the file's tests without any marker (instead of gpu-marked ones)


SLICES: dict[str, str] = {
    "tests-1": "regressions (issue 15): zero-key MHA rows, fp32 Triton, Gluon compiles, routes; "
    "the Gluon sparse kernels and indexer logits",
    "tests-2": "triton bf16 / fp16: parity, batch sizes, MHA prefill, graph replays; the "
    "narrow Gluon kernel's and the tile probe's compiles",
    "tests-3": "triton FP8 parity; DeepSeek-V3 models; SGLang plug-in",
    "tests-4": "flashinfer_mla: parity, batch sizes, MHA prefill, graphs, metadata, schedule; "
    "the DSA top-k kernel alone",
    "tests-5": "flashmla; DeepSeek-V3.2 sparse attention (DSA)",
    "tests-6": "linear attention through fla (its autotuning is slow)",
    "tests-7": "hybrid Kimi-Linear models; multi-GPU DCP; SM100 kernels; the Gluon routes' "
    "parity cases (64-row and narrow); any test no rule names",
    "tests-8": "hybrid Kimi-Linear verify graphs of two draft counts (tests-7 is full); pools "
    "past the int32 marks; the page-32 parity cases of triton and flashinfer_mla; their MHA "
    "prefill at YaRN's scale; the Gluon kernel switches' A/B tests",
}

PARITY = "test_parity.py"
GRAPHS = "test_graph_runner.py"
RULES: list[Rule] = [
    # tests-8: page 32 joined the GPU parity rows in the thirty-eighth session (42 cases,
    # 108 s on a fresh H200 in 12 processes with 7 graph tests); tests-1 to 4 were full
    Rule("tests-8", PARITY, ("test_parity",), pages=(32,), seconds=3.5),
    # tests-8: the YaRN-scale MHA prefill rows (tests/parity.py's yarn_mha_row; 4 cases) at
    # the other MHA cases' estimate: tests-2 and tests-4 had 6 s and 2 s left
    Rule("tests-8", PARITY, ("test_mha_prefill",), tag="yarn", seconds=4.0),
    # tests-7's Gluon-route parity cases first (the first matching rule wins); on a fresh
    # H100 (fourteenth session, call 9) the 20 GPU tests of test_gluon.py took 61 s,
    # compiles included: 8 s a case still leaves room
    Rule("tests-7", "test_gluon.py", ("test_backend_takes_gluon_kernel",), seconds=8.0),
    # the narrow kernel's cases: on a fresh H100 (eleventh session, call 1) the 17 GPU
    # tests of test_gluon.py then, these and the 64-row ones, took 49 s, compiles included
    Rule("tests-7", "test_gluon.py", ("test_backend_takes_narrow_kernel",), seconds=5.0),
    # tests-8: the kernel switches' A/B tests (MLA_NARROW=0, MLA_SEESAW=0) at the narrow
    # cases' estimate: tests-7 went 3 s over with the H64 cases (forty-fifth session)
    Rule(
        "tests-8",
        "test_gluon.py",
        ("test_narrow_off_keeps_the_earlier_kernels", "test_seesaw_off_keeps_the_lockstep_kernel"),
        seconds=5.0,
    ),
    # tests-2: the narrow kernel's and the tile probe's offline compiles (tests-1 holds the
    # 64-row kernel's)
    Rule(
        "tests-2",
        "test_gluon.py",
        (
            "test_narrow_kernel_compiles_for_sm90_without_spills",
            "test_tile_probe_kernels_compile_for_sm90_without_spills",
        ),
        seconds=8.0,
        cpu=True,
    ),
    # tests-2: the pool's store on the GPU (a few small kernels; tests-1 has no room left)
    Rule("tests-2", "test_triton.py", ("test_gpu_pool_store_equals_the_torch_store",)),
    # tests-1
    Rule("tests-1", "test_zero_key_rows.py", seconds=3.0),
    Rule("tests-1", "test_triton.py", seconds=6.0),
    Rule(  # the offline SM90 compiles (the file's other unmarked tests are CPU logic)
        "tests-1",
        "test_triton.py",
        (
            "test_fp32_decode_configs_fit_sm90_shared_memory",
            "test_gluon_fallback_config_fits_sm90_shared_memory",
            "test_fp32_mha_prefill_config_compiles_for_sm90",
        ),
        seconds=8.0,
        cpu=True,
    ),
    Rule("tests-1", "test_gluon.py", seconds=12.0),
    Rule(  # the 64-row kernels' offline compiles (lockstep and seesaw)
        "tests-1",
        "test_gluon.py",
        (
            "test_gluon_kernel_compiles_for_sm90_without_spills",
            "test_seesaw_kernel_compiles_for_sm90_with_its_wgmma_shapes",
        ),
        seconds=8.0,
        cpu=True,
    ),
    # the Gluon sparse kernels and the Gluon indexer logits (tests-5 holds the rest of the
    # file): on a fresh H100 (fifteenth session, call 6) the first 6 tests took 22 s,
    # compiles included; the logits' 3 with the indexer's and top-k's tests, 34 in 62 s
    # (sixteenth session, call 11)
    Rule(
        "tests-1",
        "test_sparse_gpu.py",
        (
            "test_gluon_sparse_kernel_matches_the_reference",
            "test_gluon_fp8row_kernel_matches_the_reference",
            "test_triton_sparse_backend_takes_the_gluon_kernel",
            "test_gluon_indexer_logits_match_the_triton_kernel",
        ),
        seconds=5.0,
    ),
    Rule("tests-1", PARITY, ("test_parity",), "triton", ("float32",), seconds=3.5),
    Rule("tests-1", "test_layouts_once.py", seconds=20.0),
    # tests-2
    Rule("tests-2", PARITY, ("test_parity",), "triton", ("bfloat16", "float16"), seconds=3.5),
    Rule("tests-2", PARITY, ("test_batch_sizes",), "triton", seconds=2.0),
    Rule("tests-2", PARITY, ("test_mha_prefill",), "triton", seconds=4.0),
    Rule("tests-2", GRAPHS, backend="triton", seconds=30.0),
    Rule("tests-2", GRAPHS, backend="torch", seconds=20.0),
    # tests-3
    Rule("tests-3", PARITY, ("test_parity",), "triton", ("float8_e4m3fn",), seconds=3.5),
    Rule("tests-3", "test_deepseek_v3.py", seconds=40.0),
    Rule("tests-3", "test_sglang_cpu.py", seconds=5.0),
    Rule("tests-3", "test_sglang_graph.py", seconds=12.0),
    # tests-4
    Rule("tests-4", PARITY, ("test_parity",), "flashinfer_mla", seconds=2.5),
    Rule("tests-4", PARITY, backend="flashinfer_mla", seconds=4.0),
    Rule("tests-4", GRAPHS, backend="flashinfer_mla", seconds=25.0),
    Rule("tests-4", "test_kernel_backends.py", seconds=5.0),
    Rule("tests-4", "test_fi_schedule.py", seconds=5.0),
    # the DSA top-k kernel alone: small compiles, milliseconds of GPU work a case; here since
    # its one launch runs on two counter widths (nineteenth session), which took tests-5 over.
    # Every path also runs "counted" since the twenty-second session (62 tests): on a fresh
    # H100 (its call 8) these with the indexer's Gluon logits and select tests, 70 in 70 s
    # compiles included, so 0.75 s a test
    Rule(
        "tests-4",
        "test_sparse_gpu.py",
        (
            "test_topk_slots_kernel_matches_torch_topk",
            "test_topk_slots_kernel_takes_exactly_k_with_ties_gpu",
            "test_topk_slots_kernel_stops_after_any_pass",
            "test_topk_slots_auto_takes_one_launch_where_it_fits",
            "test_topk_slots_launches_keep_one_program_rows_in_order",
        ),
        seconds=0.75,
    ),
    # the dense DSA step over FP8 rows under sync debug mode: tests-5 is full (an estimate)
    Rule(
        "tests-2",
        "test_sparse_gpu.py",
        ("test_eager_dense_dsa_step_over_fp8_rows_does_not_sync",),
        seconds=0.75,
    ),
    # tests-5
    Rule("tests-5", PARITY, backend="flashmla", seconds=1.5),
    Rule("tests-5", GRAPHS, backend="flashmla", seconds=25.0),
    # an eager DSA step under sync debug mode: small setup, kernels the file's earlier tests
    # compiled in the same process (an estimate, not yet measured)
    Rule("tests-5", "test_sparse_gpu.py", ("test_eager_dsa_step_does_not_sync",), seconds=0.75),
    Rule("tests-5", "test_sparse_gpu.py", seconds=3.5),
    # tests-6
    Rule("tests-6", "test_linear_hybrid.py", seconds=70.0),
    Rule(
        "tests-6",
        "test_kimi_linear.py",
        ("test_verify_then_accept_equals_decoding_the_accepted_tokens",),
        seconds=70.0,
    ),
    # tests-8: alone, it took 95 s in its own process on an H200 (thirty-sixth session,
    # compiles and two graph captures included)
    Rule(
        "tests-8",
        "test_kimi_linear.py",
        ("test_gpu_verify_runners_of_two_draft_counts_accept_their_own_staging",),
        seconds=100.0,
    ),
    # tests-8: pools past the int32 marks (helper 71): the 16 tests took 53 s on a fresh H200
    # (thirty-seventh session), compiles included; ~27 GB of GPU memory at the peak, so
    # gpu_check.sh's suite runs them in one shard of their own
    Rule("tests-8", "test_large_pool_gpu.py", seconds=5.0),
    # tests-7: the rest
    Rule("tests-7", "test_kimi_linear.py", seconds=50.0),
    Rule("tests-7", "test_dcp.py", seconds=120.0),
]
REST = Rule("tests-7", "", seconds=30.0)  # a GPU test no rule names


def _case_keys(item: pytest.Item) -> tuple[str | None, str | None, int | None]:
    """(backend, KV dtype, page size) of a parametrised test: a `case` (Case) or a `backend`
    name."""
    params = getattr(item, "callspec", None)
    p = params.params if params else {}
    case = p.get("case")
    if hasattr(case, "backend"):
        return case.backend, getattr(case, "kv_dtype", None), getattr(case, "page_size", None)
    return p.get("backend"), p.get("dtype"), None


def _matches(rule: Rule, item: pytest.Item, gpu: bool) -> bool:
    if item.path.name != rule.file or gpu == rule.cpu:
        return False
    if rule.tests and getattr(item, "originalname", item.name) not in rule.tests:
        return False
    backend, kv, page = _case_keys(item)
    if rule.backend is not None and backend != rule.backend:
        return False
    params = getattr(item, "callspec", None)
    if rule.tag and not (params and params.id.endswith(f"-{rule.tag}")):
        return False
    return (not rule.kv_dtypes or kv in rule.kv_dtypes) and (not rule.pages or page in rule.pages)


def rule_of(item: pytest.Item) -> Rule | None:
    """The rule that puts `item` in a slice; None for a CPU test in no slice."""
    names = {m.name for m in item.iter_markers()}
    gpu = "gpu" in names
    if "interp" in names:
        return None
    rule = next((r for r in RULES if _matches(r, item, gpu)), None)
    return REST if rule is None and gpu else rule


def estimate(items: Iterable[pytest.Item]) -> dict[str, tuple[int, float]]:
    """(tests, estimated seconds on a fresh H100) per slice. Tests an H100 skips (SM100, two
    GPUs) cost nothing there."""
    total = {name: (0, float(START_S)) for name in SLICES}
    for item in items:
        rule = rule_of(item)
        if rule is None:
            continue
        n, s = total[rule.slice]
        skips = any(item.iter_markers("sm100")) or any(item.iter_markers("multigpu"))
        total[rule.slice] = (n + 1, s + (0.0 if skips else rule.seconds))
    return total
