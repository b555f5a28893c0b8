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
if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 6):
    pytest.skip(
        "the Gluon kernel is written against Triton 3.6's Gluon API", allow_module_level=True
    )
gluon_mod = pytest.importorskip(
    "mla_backends.kernels.mla_attention_gluon", reason="this Triton has no Gluon"
)
SMEM_LIMIT = 232448  # bytes of shared memory one H100 / H200 block may use


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
    # the hazards may not: no spills (ptxas puts them in the stack frame or local memory),
    # shared memory within one block's limit, only the intended wgmma shapes.
    assert use["local"] == 0 and use["stack"] == 0, f"register spills: {use}"
    cap = gluon_mod.launch_options(1 if launch == "gluon" else 2).get("maxnreg", 255)
    assert use["reg"] <= cap and use["shared"] <= SMEM_LIMIT, use
    # The point of this kernel: each warpgroup computes its own 32 keys of the score tile
    # and its own 256 of the 512 output columns, never the whole [64, 64] score tile.
    assert use["wgmma"] == ["m64n256k16", "m64n32k16"], use


def test_seesaw_prototype_compiles_for_sm90_with_its_wgmma_shapes() -> None:
    """The warp-specialised prototype (issue 19, not wired into a backend) keeps building:
    P over the rope columns keeps Q and two tiles within one block's shared memory, and each
    warpgroup scores whole tiles (`m64n64`) and keeps half the output (`m64n256`). Its small
    spill (144-200 B of stack) is recorded in BENCHMARKS.md, not asserted away."""
    use = _compile_sm90("bf16", "seesaw")
    assert use["shared"] <= SMEM_LIMIT and use["local"] == 0, use
    assert use["wgmma"] == ["m64n256k16", "m64n64k16"], use


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("rows", [16, 32])
def test_narrow_kernel_compiles_for_sm90_without_spills(dtype: str, rows: int) -> None:
    """The keys-as-rows kernel: one warpgroup, Q and two 64-key stages within one block's
    shared memory, no spills, and query rows only on the MMAs' N side (`m64n16` / `m64n32`:
    no 64-row query block padded from 16)."""
    use = _compile_sm90(dtype, f"narrow{rows}")
    assert use["local"] == 0 and use["stack"] == 0, f"register spills: {use}"
    assert use["reg"] <= 255 and use["shared"] <= SMEM_LIMIT, use
    assert use["wgmma"] == [f"m64n{rows}k16"], use


@pytest.mark.parametrize(
    "kernel", ["gluon_join", "gluon_q2_join", "narrow16_join", "narrow32_join"]
)
def test_kernels_with_the_split_join_compile_for_sm90_without_spills(kernel: str) -> None:
    """The 64-row and narrow kernels with their splits merged in the launch (`gluon_join`):
    still no spills (the 64-row kernel under its register cap for single-token decode), the
    same shared memory and wgmma shapes as without it."""
    use = _compile_sm90("bf16", kernel)
    plain = _compile_sm90("bf16", kernel.removesuffix("_join"))
    assert use["local"] == 0 and use["stack"] == 0, f"register spills: {use}"
    cap = 255
    if kernel.startswith("gluon"):
        cap = gluon_mod.launch_options(2 if "q2" in kernel else 1).get("maxnreg", 255)
    assert use["reg"] <= cap, use
    assert use["shared"] == plain["shared"] and use["wgmma"] == plain["wgmma"], (use, plain)


def test_tile_probe_kernels_compile_for_sm90_without_spills() -> None:
    """scripts/probe_tile_chain.py's kernels (the 64-row loop, its variant with a one-warp
    TMA producer partition, `gl.warp_specialize`, and the loads-only stream in 64-column TMA
    boxes) keep building for SM90: no spills, one block's shared memory, the 64-row kernel's
    wgmma shapes (none in the loads-only one)."""
    uses = {u["kernel"]: u for u in compile_usage("probe_tile_chain.py", "--compile")}
    assert set(uses) == {"full", "producer", "loads"}, uses
    for name, use in uses.items():
        assert use["local"] == 0 and use["stack"] == 0 and use["shared"] <= SMEM_LIMIT, use
        want = [] if name == "loads" else ["m64n256k16", "m64n32k16"]
        assert use["wgmma"] == want, use


def _gluon_cases() -> list[Case]:
    """Rows the backend gives the 64-row Gluon kernel: H128, and H16 at q_len 3 (48 query
    rows), bf16 and fp16, pages 64 and 128, the core matrix's edge lengths and NaN."""
    cases = parity_cases("triton", (64, 128), (128,), ("bfloat16", "float16"), ("decode",))
    verify = parity_cases("triton", (64,), (16, 128), ("bfloat16",), ("verify",))
    return (
        cases
        + [c for c in verify if c.num_heads == 128]
        + [replace(c, q_len=3) for c in verify if c.num_heads == 16]
    )


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


def _recorded_launch(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The query rows a CTA (`block_m`) of every Gluon launch from now on."""
    rows: list[int] = []
    launch = gluon_mod.launch

    def record(*a: object, **k: Any) -> None:
        rows.append(k.get("block_m", gluon_mod.BLOCK_M))
        launch(*a, **k)

    monkeypatch.setattr(gluon_mod, "launch", record)
    return rows


@pytest.mark.sm90
@pytest.mark.parametrize("case", _gluon_cases(), ids=lambda c: c.id)
def test_backend_takes_gluon_kernel(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = _recorded_launch(monkeypatch)
    r = run_case(case, "cuda")
    assert r.ok, f"{case.id}: {r.detail}"
    assert rows and set(rows) == {64}, f"{case.id}: 64-row Gluon launches expected, got {rows}"


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
def test_fp8_pool_and_small_pages_keep_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gluon_mod, "launch", lambda *a, **k: pytest.fail("Gluon took it"))
    for c in parity_cases("triton", (16,), (128,), ("bfloat16",), ("decode",)) + parity_cases(
        "triton", (64,), (128,), ("fp8",), ("decode",)
    ):
        r = run_case(c, "cuda")
        assert r.ok, f"{c.id}: {r.detail}"


def _decode_inputs(
    h: int, q_lens: list[int], lens: list[int], page: int = 64, seed: int = 0
) -> dict[str, Any]:
    """A random bf16 pool on the GPU (free rows NaN), shuffled pages, and queries for
    requests of `q_lens` query tokens over `lens` keys."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // page) for n in lens]
    kv = torch.full((sum(pages) * page + page, 576), float("nan"))
    order = (torch.randperm(sum(pages), generator=gen) + 1).tolist()  # page 0: never read
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    for i, n in enumerate(lens):
        ids = [order.pop() for _ in range(pages[i])]
        table[i, : len(ids)] = torch.tensor(ids)
        for j, p in enumerate(ids):
            keys = min(page, n - j * page)
            kv[p * page : p * page + keys] = torch.randn(keys, 576, generator=gen)
    t = sum(q_lens)
    qo = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    dev = "cuda"
    return {
        "q_nope": torch.randn(t, h, 512, generator=gen).bfloat16().to(dev),
        "q_rope": torch.randn(t, h, 64, generator=gen).bfloat16().to(dev),
        "kv": kv.bfloat16().to(dev),
        "table": table.to(dev),
        "qo_indptr": qo.to(dev),
        "seq_lens": torch.tensor(lens, dtype=torch.int32, device=dev),
        "page_size": page,
        "max_q_len": max(q_lens),
    }


# (heads, query tokens a request, keys a request, splits): grids of <= 128 CTAs that take
# the narrow kernel (H16, H32, H16 at q_len 2) and the 64-row one (H64, H128), single
# requests of 128 / 64 splits, and H64 q_len 2 / 1 mixed (the q_len 1 requests' second row
# block exits at once, its counters never touched).
_JOIN_CASES = [
    (16, [1] * 16, [4096, 1, 17, 300, 64, 4000, 65, 129] * 2, 8),
    (16, [1], [20000], 128),
    (32, [1] * 4, [5000, 63, 1, 4096], 32),
    (16, [2] * 8, [2, 700, 4096, 3000, 65, 64, 128, 1000], 16),
    (64, [1] * 16, [4096, 1, 17, 300, 64, 4000, 65, 129] * 2, 8),
    (128, [1], [30000], 64),
    (128, [1] * 16, [4096, 1, 17, 300, 64, 4000, 65, 129] * 2, 4),
    (128, [2] * 4, [4096, 2, 900, 8000], 8),
    (64, [2, 1, 2, 1], [3000, 5000, 2, 64], 16),
]


@pytest.mark.sm90
@pytest.mark.parametrize(
    "case", _JOIN_CASES, ids=lambda c: f"h{c[0]}-q{max(c[1])}-b{len(c[1])}-s{c[3]}"
)
def test_join_matches_the_merge_kernel(
    case: tuple[int, list[int], list[int], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The splits merged inside the Gluon launch (`gluon_join`) give the merge kernel's out
    and LSE (one merge order apart: 1 bf16 ulp, fp32 LSE to 1e-5), the same bits on every
    call and on every replay of a captured graph, and leave every counter at zero."""
    import torch

    from mla_backends.kernels import mla_attention as ma

    h, q_lens, lens, splits = case
    x = _decode_inputs(h, q_lens, lens)
    joined: list[bool] = []
    launch = gluon_mod.launch

    def record(*a: object, **k: Any) -> None:
        joined.append(k.get("join") is not None)
        launch(*a, **k)

    monkeypatch.setattr(gluon_mod, "launch", record)
    counters = ma.new_join_counters(x["kv"].device)
    rows = h * x["max_q_len"]
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64

    def attend(join: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.full_like(x["q_nope"], float("nan"))
        lse = torch.full(out.shape[:2], 7.0, device=out.device)
        ma.mla_attention(
            x["q_nope"], x["q_rope"], x["kv"], x["table"], x["qo_indptr"], x["seq_lens"],
            x["page_size"], 0.07, 1.0, x["max_q_len"], splits, out, lse, block_m=block_m,
            gluon=True, join=join,
        )  # fmt: skip
        return out, lse

    want = attend(None)
    got = attend(counters)
    assert joined == [False, True], joined
    assert not got[0].isnan().any() and torch.equal(got[0].isnan(), want[0].isnan())
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-5)
    assert torch.equal(attend(counters)[0], got[0]), "a second joined call differs"
    assert int(counters.abs().sum()) == 0, counters

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attend(counters)
    for _ in range(3):
        captured[0].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured[0], got[0]) and torch.equal(captured[1], got[1])
    assert int(counters.abs().sum()) == 0, counters


@pytest.mark.sm90
def test_backend_joins_small_grids_and_merges_large_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the triton backend: a small batch (one wave of CTAs) merges its splits in the
    launch; H128 at batch 44 (two splits: 176 CTAs, more than an H100's 132 SMs) keeps the
    merge kernel; both match the reference."""
    joined: list[bool] = []
    launch = gluon_mod.launch

    def record(*a: object, **k: Any) -> None:
        joined.append(k.get("join") is not None)
        launch(*a, **k)

    monkeypatch.setattr(gluon_mod, "launch", record)
    small = parity_cases("triton", (64,), (16,), ("bfloat16",), ("decode",), 20000)[0]
    long = parity_cases("triton", (64,), (128,), ("bfloat16",), ("decode",), 20000)[0]
    large = with_batch(long, 44)
    for case, want in ((small, True), (large, False)):
        joined.clear()
        r = run_case(case, "cuda")
        assert r.ok, f"{case.id}: {r.detail}"
        assert joined and set(joined) == {want}, (case.id, joined)
