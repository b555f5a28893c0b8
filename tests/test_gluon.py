"""The Gluon decode kernels (64-row blocks, and the narrow keys-as-rows kernel for <= 32 query
rows): compiled for SM90 on any machine (no GPU needed), and taken by the triton backend on
an SM90 GPU, matching the reference."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from offline_compile import compile_usage

from mla_backends.testing import Case, parity_cases, run_case, with_batch

triton = pytest.importorskip("triton")
TRITON = tuple(int(x) for x in triton.__version__.split(".")[:2])
if TRITON < (3, 6):
    pytest.skip(
        "the Gluon kernel is written against Triton 3.6's Gluon API", allow_module_level=True
    )
gluon_mod = pytest.importorskip(
    "mla_backends.kernels.mla_attention_gluon", reason="this Triton has no Gluon"
)
SMEM_LIMIT = 232448  # bytes of shared memory one H100 / H200 block may use
# Spills (stack bytes) measured offline for a Triton of the supported range that has any; a
# kernel not listed for this Triton must compile without spills. 3.7 and 3.8, what torch
# 2.12 / 2.13 and 2.14's CUDA wheels pin, spill in kernels that 3.6 (the GPU hosts') and 3.9
# (CI's) compile without (3.7.1 and 3.8.0, 2026-11-30; neither run on a GPU). A bound, not a
# pass: a larger spill fails, as any spill does on 3.6 and 3.9. Leaving them out of `[test]`
# instead made `pip install torch==2.13.0 ".[test]"` unresolvable from PyPI (its CUDA build
# pins triton 3.7.1) and made pip replace a torch 2.14 install with 2.13.
KNOWN_SPILLS: dict[tuple[int, int], dict[str, int]] = {
    (3, 7): {"gluon": 96, "gluon_q2": 8, "narrow32": 72, "full": 8, "producer": 56},
    (3, 8): {"gluon": 80, "narrow32": 64, "producer": 40},
}


def _spill_ok(kernel: str, use: dict[str, Any]) -> bool:
    """No local memory, and no stack frame beyond this Triton's `KNOWN_SPILLS`."""
    return use["local"] == 0 and use["stack"] <= KNOWN_SPILLS.get(TRITON, {}).get(kernel, 0)


def _compile_sm90(dtype: str, kernel: str) -> dict:  # type: ignore[type-arg]
    """scripts/compile_gluon_sm90.py's usage JSON (one kernel)."""
    return compile_usage("compile_gluon_sm90.py", dtype, kernel)[-1]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("launch", ["gluon", "gluon_q2"])
def test_gluon_kernel_compiles_for_sm90_without_spills(dtype: str, launch: str) -> None:
    """Both launches of the 64-row kernel: single-token decode under its register cap, and
    q_len 2 grids with ptxas's own count."""
    use = _compile_sm90(dtype, launch)
    # The numbers may move between Triton versions (3.6: 255 registers uncapped, 3.9: 251);
    # the hazards may not: no spills (ptxas puts them in the stack frame or local memory;
    # `KNOWN_SPILLS` for 3.7 / 3.8), shared memory within one block's limit, only the
    # intended wgmma shapes.
    assert _spill_ok(launch, use), f"register spills: {use}"
    cap = gluon_mod.launch_options(1 if launch == "gluon" else 2).get("maxnreg", 255)
    assert use["reg"] <= cap and use["shared"] <= SMEM_LIMIT, use
    # The point of this kernel: each warpgroup computes its own 32 keys of the score tile
    # and its own 256 of the 512 output columns, never the whole [64, 64] score tile.
    assert use["wgmma"] == ["m64n256k16", "m64n32k16"], use


def test_seesaw_kernel_compiles_for_sm90_with_its_wgmma_shapes() -> None:
    """The warp-specialised kernel (what 64-row Gluon blocks run) keeps building:
    P over the rope columns keeps Q and two tiles within one block's shared memory, and each
    warpgroup scores whole tiles (`m64n64`) and keeps half the output (`m64n256`). Its loop's
    wgmma descriptors stay in the loop (`_opaque_zero`): hoisted above it they were spilled,
    60 / 45 spill loads / stores with triton 3.6 and 171 / 132 with 3.9's CUDA 13.4 ptxas,
    8-15 % of the kernel's time (BENCHMARKS.md, forty-fifth session); now 0 / 0 and 20 / 6
    (those outside the loop). A stack frame shows as spill loads and stores in the SASS."""
    use = _compile_sm90("bf16", "seesaw")
    assert use["shared"] <= SMEM_LIMIT and use["local"] == 0, use
    assert (use["stack"] > 0) == (use["ldl"] > 0 and use["stl"] > 0), use
    assert use["ldl"] < 40 and use["stl"] < 40, f"hoisted wgmma descriptors spilled? {use}"
    assert use["wgmma"] == ["m64n256k16", "m64n64k16"], use


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("rows", [16, 32])
def test_narrow_kernel_compiles_for_sm90_without_spills(dtype: str, rows: int) -> None:
    """The keys-as-rows kernel: one warpgroup, Q and two 64-key stages within one block's
    shared memory, no spills, and query rows only on the MMAs' N side (`m64n16` / `m64n32`:
    no 64-row query block padded from 16)."""
    use = _compile_sm90(dtype, f"narrow{rows}")
    assert _spill_ok(f"narrow{rows}", use), f"register spills: {use}"
    assert use["reg"] <= 255 and use["shared"] <= SMEM_LIMIT, use
    assert use["wgmma"] == [f"m64n{rows}k16"], use


def test_tile_probe_kernels_compile_for_sm90_without_spills() -> None:
    """scripts/probe_tile_chain.py's kernels (the 64-row loop, its variant with a one-warp
    TMA producer partition, `gl.warp_specialize`, and the loads-only stream in 64-column TMA
    boxes) keep building for SM90: no spills, one block's shared memory, the 64-row kernel's
    wgmma shapes (none in the loads-only one)."""
    uses = {u["kernel"]: u for u in compile_usage("probe_tile_chain.py", "--compile")}
    assert set(uses) == {"full", "producer", "loads"}, uses
    for name, use in uses.items():
        assert _spill_ok(name, use) and use["shared"] <= SMEM_LIMIT, use
        want = [] if name == "loads" else ["m64n256k16", "m64n32k16"]
        assert use["wgmma"] == want, use


def _gluon_cases() -> list[Case]:
    """Rows the backend gives the Gluon kernels at 48-256 query rows a request: H128, H64
    (20000-key contexts, decode and verify), and H16 at q_len 3 (48 query rows), bf16 and
    fp16, pages 64 and 128, the core matrix's edge lengths and NaN. Short one-wave grids
    take the narrow kernel's 32-row blocks (`tuning.narrow_pays`), the rest the 64-row
    kernels: batch 64 and contexts of 20000 keys keep their parity here
    (`test_gluon_cases_cover_both_kernels`)."""
    cases = parity_cases("triton", (64, 128), (128,), ("bfloat16", "float16"), ("decode",))
    long = parity_cases("triton", (64,), (128,), ("bfloat16", "float16"), ("decode",), 20000)
    verify = parity_cases("triton", (64,), (16, 128), ("bfloat16",), ("verify",))
    h64 = parity_cases("triton", (64,), (64,), ("bfloat16",), ("decode", "verify"), 20000)
    return (
        cases
        + long
        + h64
        + [with_batch(cases[0], 64)]
        + [c for c in verify if c.num_heads == 128]
        + [replace(c, q_len=3) for c in verify if c.num_heads == 16]
    )


def _expected_rows(case: Case, sms: int) -> int:
    """The rows a CTA the backend's policy gives this case's decode grid."""
    import torch

    from mla_backends.kernels import tuning

    rows = case.num_heads * max(case.q_len, 1)
    batch, max_kv = len(case.kv_lens), max(case.kv_lens)
    return tuning.block_m_for(rows, torch.bfloat16, True, batch, max_kv, sms)


def test_gluon_cases_cover_both_kernels() -> None:
    """On an H100's 132 SMs the Gluon cases below run both the 64-row kernel and the narrow
    kernel's 32-row blocks, each at H128 decode."""
    h128 = [c for c in _gluon_cases() if c.num_heads == 128 and c.q_len <= 1]
    assert {_expected_rows(c, 132) for c in h128} == {32, 64}


def _narrow_cases() -> list[Case]:
    """Rows the backend gives the narrow kernel: H16 decode (16 rows) and q_len 2 (MTP
    verify: 32 rows), H32 decode; pages 64 and 128, bf16 and fp16, the edge lengths (empty requests,
    partial tail tiles, NaN-poisoned free rows); batch 64 and contexts of 20000 keys for
    grids of one split and of many splits over whole tiles."""
    cases = parity_cases("triton", (64, 128), (16,), ("bfloat16", "float16"), ("decode",))
    cases += parity_cases("triton", (64,), (32,), ("bfloat16",), ("decode",))
    cases.append(with_batch(cases[0], 64))
    long = parity_cases("triton", (64,), (16,), ("bfloat16",), ("decode",), 20000)
    verify = parity_cases("triton", (64,), (16,), ("bfloat16",), ("verify",))
    verify += parity_cases("triton", (64,), (16,), ("bfloat16",), ("verify",), 20000)
    return cases + long + [replace(c, q_len=2) for c in verify]


def _recorded_launch(
    monkeypatch: pytest.MonkeyPatch, kernels: list[object] | None = None
) -> list[int]:
    """The query rows a CTA (`block_m`) of every Gluon launch from now on, and into
    `kernels` the kernel each launch named (None: the lockstep 64-row kernel)."""
    rows: list[int] = []
    launch = gluon_mod.launch

    def record(*a: object, **k: Any) -> None:
        rows.append(k.get("block_m", gluon_mod.BLOCK_M))
        if kernels is not None:
            kernels.append(k.get("kernel"))
        launch(*a, **k)

    monkeypatch.setattr(gluon_mod, "launch", record)
    return rows


def _seesaw_kernel() -> object:
    from mla_backends.kernels import mla_attention_seesaw as ms

    return ms.KERNEL


@pytest.mark.sm90
@pytest.mark.parametrize(
    "case", _gluon_cases(), ids=lambda c: f"{c.id}-b{len(c.kv_lens)}-kv{max(c.kv_lens)}"
)
def test_backend_takes_gluon_kernel(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from mla_backends.kernels.common import num_sms

    kernels: list[object] = []
    rows = _recorded_launch(monkeypatch, kernels)
    r = run_case(case, "cuda")
    assert r.ok, f"{case.id}: {r.detail}"
    want = _expected_rows(case, num_sms(torch.device("cuda")))
    assert rows and set(rows) == {want}, f"{case.id}: {want}-row Gluon launches expected: {rows}"
    if want == 64:  # 64-row blocks of H >= 64 run the warp-specialised kernel (`seesaw_pays`)
        assert set(kernels) == {_seesaw_kernel() if case.num_heads >= 64 else None}, kernels


@pytest.mark.sm90
@pytest.mark.parametrize("case", _narrow_cases(), ids=lambda c: f"{c.id}-b{len(c.kv_lens)}")
def test_backend_takes_narrow_kernel(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = _recorded_launch(monkeypatch)
    r = run_case(case, "cuda")
    assert r.ok, f"{case.id}: {r.detail}"
    want = 16 if case.num_heads * max(case.q_len, 1) <= 16 else 32
    assert rows and set(rows) == {want}, f"{case.id}: narrow launches of {want} expected: {rows}"


@pytest.mark.sm90
def test_narrow_off_keeps_the_earlier_kernels(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """MLA_NARROW=0 (A/B runs): H16 decode at batch <= 16 goes back to the 64-row Gluon
    block, and the result still matches the reference."""
    from mla_backends.kernels import tuning

    monkeypatch.setenv("MLA_NARROW", "0")
    tuning.narrow_on.cache_clear()  # read once a process: read again here and after the test
    request.addfinalizer(tuning.narrow_on.cache_clear)
    rows = _recorded_launch(monkeypatch)
    case = parity_cases("triton", (64,), (16,), ("bfloat16",), ("decode",))[0]
    r = run_case(case, "cuda")
    assert r.ok, f"{case.id}: {r.detail}"
    assert set(rows) == {64}, rows


@pytest.mark.sm90
def test_seesaw_off_keeps_the_lockstep_kernel(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """MLA_SEESAW=0 (A/B runs): 64-row blocks go back to the lockstep kernel
    (`mla_attention_gluon`'s own), and the result still matches the reference."""
    from mla_backends.kernels import tuning

    monkeypatch.setenv("MLA_SEESAW", "0")
    tuning.seesaw_on.cache_clear()  # read once a process: read again here and after the test
    request.addfinalizer(tuning.seesaw_on.cache_clear)
    kernels: list[object] = []
    rows = _recorded_launch(monkeypatch, kernels)
    case = with_batch(parity_cases("triton", (64,), (128,), ("bfloat16",), ("decode",))[0], 64)
    r = run_case(case, "cuda")
    assert r.ok, f"{case.id}: {r.detail}"
    assert set(rows) == {64} and set(kernels) == {None}, (rows, kernels)


@pytest.mark.sm90
def test_fp8_pool_and_small_pages_keep_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gluon_mod, "launch", lambda *a, **k: pytest.fail("Gluon took it"))
    for c in parity_cases("triton", (16,), (128,), ("bfloat16",), ("decode",)) + parity_cases(
        "triton", (64,), (128,), ("fp8",), ("decode",)
    ):
        r = run_case(c, "cuda")
        assert r.ok, f"{c.id}: {r.detail}"
