"""The triton backend beyond its rows of the parity table (tests/parity.py: interpreter
parity at tiny shapes on CPU, the full matrix on a GPU): strided queries, split-KV merges, the
index builder and fused store, offline SM90 compiles, the MHA-prefill routes, Gluon fallbacks."""

from __future__ import annotations

import logging

import pytest
import torch
from offline_compile import compile_usage
from parity import SMALL

from mla_backends.batch import ForwardMode
from mla_backends.config import MLADims
from mla_backends.indices import build_page_indices, build_page_table, build_token_indices
from mla_backends.pool import MLATokenToKVPool
from mla_backends.testing import (
    DTYPE_PAIRS,
    Case,
    build_case,
    edge_kv_lens,
    run_case,
    run_mha_case,
)

CPU = torch.device("cpu")
SMEM_SM90 = 232448  # bytes of shared memory one H100 / H200 block may opt into


@pytest.mark.interp
def test_interpreter_strided_query_views() -> None:
    """q_nope / q_rope as column ranges of one buffer (non-contiguous): strides honoured."""
    for mode, q in [(ForwardMode.DECODE, 1), (ForwardMode.EXTEND, 0)]:
        case = Case(
            "triton",
            mode,
            16,
            4,
            "float16",
            "float16",
            q,
            (1, 17, 40),
            dims=SMALL,
            joined_query=True,
        )
        r = run_case(case)
        assert r.ok, r.detail


# (page, heads, DTYPE_PAIRS key, mode, q_len, kv lens, splits): several KV splits forced so
# the log-sum-exp merge and empty splits run: fp16 at page 16, then (helper 78's coverage
# audit) FP8's scale in the partials, bf16 at page 1, fp32 at page 64, verify at 16 heads
# (several row blocks), and more splits than any row has keys.
FORCED_SPLITS = [
    *(
        (16, 4, "float16", mode, q, (0, 1, 3, 17, 45), splits)
        for splits in (2, 4, 64)
        for mode, q in ((ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, 2))
    ),
    (16, 4, "fp8", ForwardMode.DECODE, 1, (0, 1, 3, 17, 45), 4),
    (1, 4, "bfloat16", ForwardMode.DECODE, 1, (0, 1, 2, 17, 45), 8),
    (64, 4, "float32", ForwardMode.DECODE, 1, (0, 1, 63, 64, 65), 2),
    (16, 16, "fp8", ForwardMode.TARGET_VERIFY, 3, (0, 3, 16, 17, 45), 4),
    (16, 4, "float16", ForwardMode.TARGET_VERIFY, 3, (3, 4, 5), 64),
]


@pytest.mark.interp
@pytest.mark.parametrize(
    "page, heads, pair, mode, q, lens, splits",
    FORCED_SPLITS,
    ids=[f"p{c[0]}-h{c[1]}-{c[2]}-{c[3].value}-q{c[4]}-s{c[6]}" for c in FORCED_SPLITS],
)
def test_interpreter_forced_splits_across_pools(
    monkeypatch: pytest.MonkeyPatch,
    page: int,
    heads: int,
    pair: str,
    mode: ForwardMode,
    q: int,
    lens: tuple[int, ...],
    splits: int,
) -> None:
    """The split merge (and empty splits) against both references on every pool dtype and
    several pages."""
    from mla_backends.kernels import tuning

    monkeypatch.setattr(tuning, "choose_num_splits", lambda *a, **k: splits)
    act, kv = DTYPE_PAIRS[pair]
    r = run_case(Case("triton", mode, page, heads, kv, act, q, lens, dims=SMALL, seed=splits))
    assert r.ok, r.detail


@pytest.mark.interp
@pytest.mark.parametrize("sms", [1, 8, 64])  # column blocks: 1, 2 (8 // 3 rows), 4 (L / 64)
def test_interpreter_merge_over_column_blocks(monkeypatch: pytest.MonkeyPatch, sms: int) -> None:
    """The split merge with its columns spread over programs where rows are few: out and LSE
    equal log-sum-exp weighting of the partials, empty splits and an all-empty row included;
    and the column blocks' rule (`merge_blocks`)."""
    from mla_backends.kernels import mla_attention as ma

    assert ma.merge_blocks(3, 256, 4, sms) == ({1: 1, 8: 2, 64: 4}[sms], 4)
    assert ma.merge_blocks(16, 512, 128, 132) == (8, 128)  # H16 B1: 128 x 64 fp32 a program
    assert ma.merge_blocks(128, 512, 64, 132) == (1, 16)  # H128 B1: 16 x 512 a chunk
    assert ma.merge_blocks(64, 512, 64, 132) == (2, 32)
    assert ma.merge_blocks(4096, 512, 2, 132) == (1, 2)

    monkeypatch.setattr(ma, "num_sms", lambda device: sms)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(sms)
    # 1024 columns, 16 splits: one program a row at sms 1 takes its splits in two chunks of 8
    assert ma.merge_blocks(3, 1024, 16, 1) == (1, 8)
    for lat, splits in ((256, 4), (1024, 16)):
        t, h = 3, 1
        part_out = torch.randn(t * h * splits, lat, generator=g)
        part_lse = torch.randn(t * h * splits, generator=g) * 3
        part_lse[1] = -torch.inf  # an empty split
        part_lse[2 * splits : 3 * splits] = -torch.inf  # token 2: every split empty
        out = torch.empty(t, h, lat, device=dev)
        lse = torch.empty(t, h, device=dev)
        ma._merge(part_out.to(dev), part_lse.to(dev), out, lse, splits)
        pl = part_lse.view(t * h, splits).double()
        want_lse = torch.logsumexp(pl, dim=1)
        w = torch.exp(pl - want_lse[:, None]).nan_to_num(0.0)
        want = (w[:, :, None] * part_out.view(t * h, splits, lat).double()).sum(1)
        got_lse, got = lse.cpu().double().view(-1), out.cpu().double().view(t * h, lat)
        torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sms", [4, 78, 114, 132, 148])
def test_split_rows_bound_holds_for_every_grid(sms: int) -> None:
    """The graph workspace (tuning.split_rows_bound) holds the partials of every grid the
    backend splits, at any batch, query length and head count."""
    from mla_backends.kernels import tuning

    bound = tuning.split_rows_bound(sms)
    for bm in (16, 32, 64):
        for rows in range(1, 4 * bm + 1):  # query rows of one request (q_len x heads)
            for bs in range(1, 2 * sms + 2):
                splits = tuning.decode_splits(bs, rows, bm, 1 << 20, sms)
                if splits > 1:
                    assert bs * rows * splits <= bound, (bm, rows, bs, splits, bound)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "heads,kv", [(16, "bfloat16"), (128, "bfloat16"), (16, "fp8"), (128, "fp8")]
)
def test_gpu_small_batch_long_context_many_splits(
    heads: int, kv: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch 1-2 at 32k keys: 32-128 KV splits (eager) and their merge (H16: all splits in
    one chunk; H128: 16 a chunk), out and LSE against the reference."""
    from mla_backends.kernels import mla_attention as ma
    from mla_backends.testing.cases import DTYPE_PAIRS

    seen: list[int] = []
    merge = ma._merge
    monkeypatch.setattr(ma, "_merge", lambda *a: seen.append(a[-1]) or merge(*a))
    dtype, kv_dtype = DTYPE_PAIRS[kv]
    for lens in [(32768,), (32000, 17)]:
        case = Case("triton", ForwardMode.DECODE, 64, heads, kv_dtype, dtype, 1, lens)
        r = run_case(case, "cuda")
        assert r.ok, f"{case.id}: {r.detail}"
    assert max(seen) >= 32, seen


@pytest.mark.interp
@pytest.mark.parametrize("page", [1, 16, 64])
def test_triton_index_builder_equals_torch(page: int) -> None:
    from mla_backends.kernels import index

    case = Case(
        mode=ForwardMode.DECODE,
        page_size=page,
        kv_lens=edge_kv_lens(page, long=150),
        layout="mixed",
        dims=SMALL,
        num_heads=4,
        seed=3,
    )
    rt, batch = build_case(case, CPU)
    r2t, rows, seq = rt.req_pool.req_to_token, batch.req_pool_indices, batch.seq_lens
    lens = batch.seq_lens_cpu.tolist()
    for fill in (0, -1):
        width = -(-max(lens) // page) + 3
        torch.testing.assert_close(
            index.page_table(r2t, rows, seq, page, width, fill),
            build_page_table(r2t, rows, seq, page, width, fill),
            rtol=0,
            atol=0,
        )
    want = build_token_indices(r2t, rows, seq, sum(lens))
    got = index.token_indices(r2t, rows, seq, sum(lens), max(lens))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    n_pages = [-(-n // page) for n in lens]
    want = build_page_indices(r2t, rows, seq, page, sum(n_pages))
    got = index.page_indices(r2t, rows, seq, page, sum(n_pages), max(n_pages))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    flat = torch.full((sum(n_pages) + 5,), -7, dtype=torch.int32)  # tail must stay untouched
    index.flat_page_indices(r2t, rows, seq, page, sum(n_pages), max(n_pages), flat)
    assert torch.equal(flat[: sum(n_pages)], want[1]) and (flat[sum(n_pages) :] == -7).all()


@pytest.mark.interp
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_fused_store_equals_pool_store(dtype: torch.dtype) -> None:
    from mla_backends.kernels.store import store_latent_rows

    a, b = (MLATokenToKVPool(1, 4, 16, 32, 16, dtype) for _ in range(2))
    for p in (a, b):
        if p.is_fp8:
            p.set_scale(0, 0.05)
    # -1 (vLLM's padding) and a slot past the pool's 80: the dummy slot 0 in both stores,
    # nothing else written (a negative index would wrap around to the last row)
    loc = torch.tensor([17, 63, -1, 20, 16, 80])
    k_nope, k_rope = torch.randn(6, 32) * 3, torch.randn(6, 16) * 30
    if not a.is_fp8:  # rows arrive in the pool dtype: stored bitwise
        k_nope, k_rope = k_nope.to(dtype), k_rope.to(dtype)
    a.set_mla_kv_buffer(0, loc, k_nope, k_rope)
    store_latent_rows(b.kv_buffer[0], b.scales[0], loc, k_nope, k_rope, b.is_fp8)
    # the two out-of-pool rows race for slot 0 (either may land): compare the others
    assert torch.equal(a.kv_buffer[0][1:].view(torch.uint8), b.kv_buffer[0][1:].view(torch.uint8))
    for p in (a, b):
        rows = p.kv_buffer[0].view(torch.uint8)
        assert (rows[1:16] == 0).all() and (rows[64:] == 0).all() and rows[0].any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_pool_store_equals_the_torch_store(dtype: torch.dtype) -> None:
    """On a GPU the pools' own stores are fused Triton kernels (one launch; every backend
    without a store of its own takes them), latent rows and FP8 rows: the same bytes as the
    torch stores on a CPU, -1 and past-the-pool slots on the dummy slot 0; NaN and +-inf
    read back alike (the kernels turned a NaN into -448 x scale, and an inf in an FP8 row's
    tile made its scale inf)."""
    from mla_backends.sparse.fp8_row import Fp8RowPool, dequant_rows

    pools = [MLATokenToKVPool(2, 4, 16, 512, 64, dtype, device=d) for d in ("cpu", "cuda")]
    for p in pools:
        if p.is_fp8:
            p.set_scale(1, 0.05)
    loc = torch.tensor([17, 63, -1, 20, 16, 80])
    k_nope, k_rope = torch.randn(6, 512) * 3, torch.randn(6, 64) * 30
    special = torch.tensor([float("nan"), float("inf"), float("-inf")])
    k_nope[3, 200:203], k_rope[3, 10:13] = special, special  # slot 20 (NaN bits may differ)
    for p in pools:
        dev = p.device
        p.set_mla_kv_buffer(1, loc.to(dev), k_nope.to(dev), k_rope.to(dev))
    cpu, gpu = (p.kv_buffer[1].view(torch.uint8).cpu() for p in pools)
    keep = torch.ones(cpu.shape[0], dtype=torch.bool)
    keep[[0, 20]] = False
    assert torch.equal(cpu[keep], gpu[keep]) and (gpu[1:16] == 0).all() and (gpu[64:] == 0).all()
    row20 = [p.kv_buffer[1][20].float().cpu() for p in pools]
    torch.testing.assert_close(row20[1], row20[0], rtol=0, atol=0, equal_nan=True)
    assert row20[1][[200, 522]].isnan().all()
    assert bool(row20[1][[201, 202]].isfinite().all()) == pools[0].is_fp8  # FP8 saturates
    assert gpu[0].any() and not pools[1].kv_buffer[0].view(torch.uint8).any()  # layer 0 untouched
    # the FP8 rows: the fused store on the GPU against pack_rows and the scatter on a CPU
    # (fp32 inputs: e4m3 and bf16 rounding, ue8m0 scales from the bits against frexp)
    k_nope[0, :128] = 0.0  # an all-zero tile: amax clamped at 1e-4
    k_nope[1, :128] = torch.linspace(-448.0 * 4, 448.0 * 4, 128)  # amax 4 * 448: scale 4
    rows = [Fp8RowPool(1, 3, 16, 512, 64, d) for d in ("cpu", "cuda")]  # 64 slots
    for r in rows:
        r.set_mla_kv_buffer(0, loc.to(r.device), k_nope.to(r.device), k_rope.to(r.device))
    a, b = (r.kv_buffer[0].cpu() for r in rows)
    written = torch.zeros(64, dtype=torch.bool)
    written[[0, 16, 17, 20, 63]] = True
    keep = torch.ones(64, dtype=torch.bool)
    keep[[0, 20]] = False
    assert torch.equal(a[keep], b[keep]) and b[written].any(1).all() and not b[~written].any()
    fmt = rows[0].fmt
    torch.testing.assert_close(
        dequant_rows(fmt, b[20:21]), dequant_rows(fmt, a[20:21]), rtol=0, atol=0, equal_nan=True
    )
    # the tile's scale from its finite values: only the NaN reads back NaN, inf saturates
    assert dequant_rows(fmt, b[20:21])[0, :512].isnan().sum() == 1


# ------------------------------------------------- offline SM90 compiles (no GPU needed)
def _compile_sm90(*args: str) -> list[dict]:  # type: ignore[type-arg]
    return compile_usage("compile_triton_sm90.py", *args, timeout=900)


def _fits(use: dict) -> None:  # type: ignore[type-arg]
    tiles = {k: use[k] for k in ("heads", "page", "block_m", "block_n", "num_stages", "tma")}
    assert use["shared"] <= SMEM_SM90, f"over the H100's shared memory: {use['shared']} {tiles}"
    # The backend picks tiles by this estimate: it must not be below what Triton allocates.
    assert use["shared"] <= use["estimate"], f"smem_bytes under-estimates: {use}"


def test_fp32_decode_configs_fit_sm90_shared_memory() -> None:
    """The tiles the backend picks for an fp32 pool at H 16 / 128, q_len 1 / 2 / 4, pages 1 /
    16 / 64 / 128 compile for SM90 within its shared memory (they asked for 442376 bytes of
    232448 at H128 page 64), without spills (fp32 dots are FMA loops: bigger tiles spilled)."""
    uses = _compile_sm90("float32")
    served = {(h, q, p) for use in uses for h, q, p, _, _ in use["shapes"]}
    assert served == {(h, q, p) for h in (16, 128) for q in (1, 2, 4) for p in (1, 16, 64, 128)}
    for use in uses:
        _fits(use)
        assert use["local"] == 0 and use["stack"] == 0, f"register spills: {use}"


def test_gluon_fallback_config_fits_sm90_shared_memory() -> None:
    """Where the Gluon kernel cannot build, its H128 page-64 rows take the tl.dot kernel's
    64-row TMA tiles: those must fit too."""
    uses = _compile_sm90("bfloat16", "gluon-off", "heads=128", "pages=64")
    assert {use["block_m"] for use in uses} == {64}, uses
    for use in uses:
        _fits(use)


def test_fp32_mha_prefill_config_compiles_for_sm90() -> None:
    for use in _compile_sm90("float32", "mha"):
        assert use["shared"] <= SMEM_SM90 and use["local"] == 0 and use["stack"] == 0, use


# ----------------------------------------------------------------- routes and fallbacks
def test_mha_route_keeps_fp32_off_cudnn() -> None:
    """torch's cuDNN attention op reads every dtype but bf16 as fp16: an fp32 prefill with
    LSE must take our kernel (it gave NaN in out and LSE on the H100 through cuDNN)."""
    from mla_backends.kernels.tuning import mha_route

    for dt in (torch.float16, torch.bfloat16):
        assert mha_route(dt, True, True, True, True) == "cudnn"
        assert mha_route(dt, True, True, True, False) == "triton"  # cuDNN failed once
    assert mha_route(torch.float32, True, True, True, True) == "triton"
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        assert mha_route(dt, True, True, False, True) == "sdpa"
        assert mha_route(dt, True, False, True, True) == "triton"  # bottom-right != top-left
        assert mha_route(dt, False, True, True, True) == "triton"  # no GPU


@pytest.mark.interp
def test_gluon_build_failure_routes_to_tl_dot_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A Gluon kernel that fails to compile (as it did on Triton 3.9: a removed TMA name)
    is reported once; that call and every later one take the tl.dot kernel, same result."""
    from mla_backends.kernels import mla_attention as ma

    mg = pytest.importorskip("mla_backends.kernels.mla_attention_gluon")
    monkeypatch.setattr(ma, "_gluon_route", ma.GluonRoute())
    # On CPU the Gluon conditions never hold: pretend they do until the route is broken.
    monkeypatch.setattr(ma, "gluon_usable", lambda *a: ma.gluon_error() is None)
    reason = "async_copy_global_to_shared has been removed; call async_load instead"
    tries = []

    def broken_launch(*a: object, **k: object) -> None:
        tries.append(1)
        raise RuntimeError(reason)

    monkeypatch.setattr(mg, "launch", broken_launch)

    gen = torch.Generator().manual_seed(0)
    h, lat, r, page, lens = 4, 32, 16, 16, [1, 17, 40]
    kv = torch.randn(8 * page, lat + r, generator=gen).half()
    table = torch.tensor([[3, 0, 0], [1, 5, 0], [6, 2, 4]], dtype=torch.int32)
    qo = torch.arange(len(lens) + 1, dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    q_nope = torch.randn(len(lens), h, lat, generator=gen).half()
    q_rope = torch.randn(len(lens), h, r, generator=gen).half()

    def attend(gluon: bool) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = torch.full_like(q_nope, float("nan")), torch.full((len(lens), h), 7.0)
        ma.mla_attention(
            q_nope, q_rope, kv, table, qo, seq, page, 0.1, 1.0, 1, 1, out, lse,
            block_m=16, block_n=16, num_warps=4, num_stages=1, dot_f32=True, gluon=gluon,
        )  # fmt: skip
        return out, lse

    want = attend(False)
    with caplog.at_level(logging.WARNING, logger=ma.__name__):
        got = [attend(True), attend(True)]
    assert tries == [1], "the broken Gluon kernel was tried again"
    for out, lse in got:
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    logged = [rec.getMessage() for rec in caplog.records if rec.name == ma.__name__]
    assert len(logged) == 1 and reason in logged[0], logged
    assert reason in (ma.gluon_error() or "")


@pytest.mark.interp
def test_backend_block_sizes_after_gluon_failure(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """16 and 32 query rows go to the narrow Gluon kernel (MLA_NARROW=0: half of a 64-row
    Gluon block, or the 16-row tl.dot kernel above batch 16); once Gluon failed here, the
    tl.dot kernel's 16- and 32-row blocks take them."""
    from mla_backends.config import Config
    from mla_backends.kernels import mla_attention as ma
    from mla_backends.kernels import tuning
    from mla_backends.runtime import Runtime

    monkeypatch.setattr(ma, "_gluon_route", ma.GluonRoute())
    cfg = Config(model=SMALL, prefill_backend="triton", decode_backend="triton", num_pages=4)
    be = Runtime.build(cfg).backend
    be._gluon = True  # as on an SM90 with a bf16 pool
    for rows, bs, narrow in ((16, 1, 16), (16, 256, 16), (32, 64, 32), (48, 1, 64)):
        assert be._block_m(rows, torch.bfloat16, bs) == narrow
        assert tuning.is_narrow(narrow, True) == (narrow < 64)
    monkeypatch.setenv("MLA_NARROW", "0")
    tuning.narrow_on.cache_clear()  # read once a process: read again here and after the test
    request.addfinalizer(tuning.narrow_on.cache_clear)
    assert be._block_m(32, torch.bfloat16, 64) == 64
    assert be._block_m(16, torch.bfloat16, 16) == 64  # H16 decode at batch <= 16
    assert be._block_m(16, torch.bfloat16, 17) == 16
    assert not tuning.is_narrow(16, True)
    monkeypatch.delenv("MLA_NARROW")
    tuning.narrow_on.cache_clear()
    ma.gluon_failed("simulated")
    assert be._block_m(32, torch.bfloat16, 64) == 32
    assert be._block_m(16, torch.bfloat16, 1) == 16
    assert be._block_m(64, torch.float32, 1) == 16  # fp32 never takes Gluon or 64-row blocks


@pytest.mark.interp
@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix", "prefix"])
def test_interpreter_fp32_mha_prefill_nine_ragged_requests(prefix: bool) -> None:
    """The shape of the H100 fp32 report (9 ragged causal requests, 15 to 2725 tokens) at
    interpreter size, on the 16 x 16 tiles fp32 takes on a GPU too: lengths around tile
    edges, with and without a cached prefix (bottom-right causal)."""
    q_lens = [15, 16, 17, 31, 33, 47, 48, 49, 70]
    kv_lens = [n + (i * 7 % 23 if prefix else 0) for i, n in enumerate(q_lens)]
    r = run_mha_case("triton", q_lens, kv_lens, True, "float32", 4, SMALL)
    assert r.ok, r.detail


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_mha_prefill_without_lse_uses_sdpa_and_agrees() -> None:
    """No LSE asked and q_len == kv_len: the SDPA route; it must equal the Triton kernel."""
    from mla_backends.batch import RaggedLayout
    from mla_backends.config import Config
    from mla_backends.runtime import Runtime

    dims = MLADims(num_heads=16)
    cfg = Config(
        model=dims,
        prefill_backend="triton",
        decode_backend="triton",
        num_pages=1,
        max_requests=1,
        device="cuda",
    )
    be = Runtime.build(cfg).backend
    lens = [1, 300, 0, 77]
    layout = RaggedLayout.from_lens(lens, lens, "cuda")
    q = torch.randn(layout.num_q, 16, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn(layout.num_q, 16, 128, device="cuda", dtype=torch.bfloat16)
    plain = be.forward_mha(q, k, v, layout)
    be._cudnn_lse = False  # the LSE route through our Triton kernel
    with_lse, _ = be.forward_mha(q, k, v, layout, return_lse=True)
    torch.testing.assert_close(plain, with_lse, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_mha_prefill_with_lse_through_cudnn(
    causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LSE asked and q_len == kv_len: cuDNN with compute_log_sumexp, out and LSE against the
    fp64 reference (an empty request included); it must really take that route."""
    from mla_backends.kernels import torch_prefill

    calls = []
    route = torch_prefill.torch_mha_prefill

    def counted(*a):  # type: ignore[no-untyped-def]
        route(*a)
        calls.append(a[-1] is not None)  # only when cuDNN returned (a failure falls back)

    monkeypatch.setattr(torch_prefill, "torch_mha_prefill", counted)
    lens = [1, 300, 0, 77, 128]
    for dtype in ("bfloat16", "float16"):
        r = run_mha_case("triton", lens, lens, causal, dtype, 16, device="cuda")
        assert r.ok, r.detail
    assert calls == [True, True], "the LSE route did not go through cuDNN"


FP32_PREFILL_LENS = [15, 96, 255, 513, 1000, 1024, 1537, 2048, 2725]


@pytest.mark.gpu
@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix", "prefix"])
def test_gpu_fp32_mha_prefill_nine_ragged_causal(prefix: bool) -> None:
    """The H100 report: fp32, H16, 9 ragged causal requests of 15 to 2725 tokens gave NaN in
    out and LSE (the cuDNN op read fp32 as fp16). Out and LSE against the fp64 reference,
    with LSE (our kernel) and, without a prefix, also without LSE (SDPA)."""
    from mla_backends.batch import RaggedLayout
    from mla_backends.config import Config
    from mla_backends.reference import mha
    from mla_backends.runtime import Runtime
    from mla_backends.testing import TOLERANCES, compare

    q_lens = FP32_PREFILL_LENS
    kv_lens = [n + (37 * i if prefix else 0) for i, n in enumerate(q_lens)]
    r = run_mha_case("triton", q_lens, kv_lens, True, "float32", 16, device="cuda")
    assert r.ok, r.detail
    if prefix:
        return
    dims = MLADims(num_heads=16)
    cfg = Config(
        model=dims,
        prefill_backend="triton",
        decode_backend="triton",
        dtype="float32",
        kv_dtype="float32",
        num_pages=1,
        max_requests=1,
        device="cuda",
    )
    be = Runtime.build(cfg).backend
    layout = RaggedLayout.from_lens(q_lens, q_lens, "cuda")
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(layout.num_q, 16, dims.qk_head_dim, generator=gen)
    k = torch.randn(layout.num_q, 16, dims.qk_head_dim, generator=gen)
    v = torch.randn(layout.num_q, 16, dims.v_head_dim, generator=gen)
    out = be.forward_mha(q.cuda(), k.cuda(), v.cuda(), layout, True)
    qo = layout.qo_indptr_cpu.tolist()
    want = torch.cat(
        [mha(q[a:e], k[a:e], v[a:e], dims.softmax_scale, True)[0] for a, e in zip(qo[:-1], qo[1:])]
    )
    atol, rtol, _ = TOLERANCES["float32"]
    err, detail = compare("out (no LSE)", out, want, atol, rtol)
    assert not detail, detail


def test_narrow_blocks_only_for_short_one_wave_grids(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """33-128 query rows a request take the narrow kernel's 32-row blocks only where its
    grid is one wave of CTAs streaming <= NARROW_MAX_TILES tiles each (the H100 shapes it
    measured faster on), never without the grid's KV length, Gluon or MLA_NARROW."""
    from mla_backends.kernels import tuning

    sms, bf16 = 132, torch.bfloat16
    faster = [(128, 1, 2048), (128, 1, 4096), (128, 1, 16384), (128, 2, 4096), (128, 4, 4096)]
    faster += [(64, 1, 4096), (64, 1, 32768), (64, 4, 4096)]
    slower = [(128, 1, 32768), (128, 8, 4096), (128, 16, 4096), (128, 4, 32768), (64, 16, 4096)]
    slower += [(128, 64, 256)]  # few tiles, but 256 CTAs: two waves, not measured
    for rows, bs, kv in faster:
        assert tuning.narrow_pays(rows, bs, kv, sms), (rows, bs, kv)
        assert tuning.block_m_for(rows, bf16, True, bs, kv, sms) == 32
    for rows, bs, kv in slower:
        assert not tuning.narrow_pays(rows, bs, kv, sms), (rows, bs, kv)
        assert tuning.block_m_for(rows, bf16, True, bs, kv, sms) == 64
    assert not tuning.narrow_pays(256, 1, 4096, sms) and not tuning.narrow_pays(32, 1, 4096, sms)
    assert tuning.block_m_for(128, bf16, True, 1, None, None) == 64  # no grid given
    assert tuning.block_m_for(128, bf16, False, 1, 4096, sms) == 64  # no Gluon
    monkeypatch.setenv("MLA_NARROW", "0")
    tuning.narrow_on.cache_clear()
    request.addfinalizer(tuning.narrow_on.cache_clear)
    assert tuning.block_m_for(128, bf16, True, 1, 4096, sms) == 64


def test_seesaw_only_for_h64_and_up(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """64-row Gluon blocks take the warp-specialised kernel at H >= 64 only (faster there,
    not measured below), and never with MLA_SEESAW=0."""
    from mla_backends.kernels import tuning

    assert [tuning.seesaw_pays(h) for h in (16, 32, 64, 128, 256)] == [False] * 2 + [True] * 3
    monkeypatch.setenv("MLA_SEESAW", "0")
    tuning.seesaw_on.cache_clear()  # read once a process: read again here and after the test
    request.addfinalizer(tuning.seesaw_on.cache_clear)
    assert not tuning.seesaw_pays(128)


def test_mla_attention_refuses_splits_and_blocks_that_are_not_powers_of_two() -> None:
    """A direct caller's num_splits of 3 was an InterpreterError deep in tl.arange, 0 a
    negative shift; now one line before any launch (no tensor is read)."""
    from mla_backends.kernels.mla_attention import mla_attention

    t = torch.zeros(1)
    for kw, bad in (
        ({"num_splits": 3}, 3),
        ({"num_splits": 0}, 0),
        ({"num_splits": 1, "block_n": 48}, 48),
    ):
        with pytest.raises(ValueError, match=rf"must be a power of two >= 1, got {bad}"):
            mla_attention(t, t, t, t, t, t, 16, 1.0, 1.0, 1, out=t, lse=t, **kw)  # type: ignore[arg-type]


@pytest.mark.interp
def test_fused_store_reads_a_strided_loc() -> None:
    """The store kernel read loc[t] at Loc + t: a strided view (a column of a table) stored
    every row after the first at the wrong slot, silently."""
    from mla_backends.kernels.store import store_latent_rows

    pool = MLATokenToKVPool(1, 4, 16, 32, 16, torch.float16)
    loc = torch.tensor([[17, 40], [33, 41], [20, 42]])[:, 0]  # [17, 33, 20], stride 2
    k_nope, k_rope = torch.randn(3, 32).half(), torch.randn(3, 16).half()
    store_latent_rows(pool.kv_buffer[0], pool.scales[0], loc, k_nope, k_rope, False)
    rows = torch.cat([k_nope, k_rope], dim=-1)
    assert torch.equal(pool.kv_buffer[0][loc], rows)
    kept = torch.ones(pool.num_slots, dtype=torch.bool)
    kept[loc] = False
    assert (pool.kv_buffer[0][kept] == 0).all()


@pytest.mark.interp
def test_page_table_refuses_an_out_buffer_too_small() -> None:
    """The GPU index builder wrote b rows x width pages into `out` whatever its size (a
    static table of a smaller graph state): past its end, silently."""
    from mla_backends.kernels import index

    r2t = torch.arange(2 * 64, dtype=torch.int32).view(2, 64)
    rows, seq = torch.tensor([1, 1, 1], dtype=torch.int32), torch.tensor([5, 9, 20])
    out = torch.full((3, 8), -7, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"page_table: out \[2, 8\] cannot hold 3 rows x 2"):
        index.page_table(r2t, rows, seq, 16, 2, 0, out[:2])
    assert (out[2] == -7).all()


def test_tma_32_key_tiles_for_h16_decode_at_one_and_two_splits_only() -> None:
    """Hazard: the 16-row, page % 32 == 0, batch >= 32 decode grid takes TMA 32-key tiles
    at one and two KV splits (B256 kv1k 0.90-0.92x FlashMLA against the gather's 0.84x;
    B128 kv8k, 2 splits, 0.85x both) and the gather from four on (TMA 0.59-0.61x). An
    off-by-one in the split bound moved the two-split grids off the measured choice."""
    from mla_backends.kernels.tuning import launch_config

    for splits in (1, 2):
        cfg = launch_config(16, 32, 128, splits, torch.bfloat16, False, 576, None)
        assert cfg["tma"] and cfg["block_n"] == 32, (splits, cfg)
    cfg = launch_config(16, 32, 128, 4, torch.bfloat16, False, 576, None)
    assert not cfg["tma"] and cfg["block_n"] == 64


def test_fit_smem_drops_tma_stages_to_one_before_narrowing_the_key_tiles() -> None:
    """Hazard: `_fit_smem` must shed TMA stages down to one before it halves the key tiles
    (narrower tiles cost more than a stage); stopping at two stages narrowed 64-key tiles to
    32 on a GPU whose shared memory holds one 64-key stage."""
    from mla_backends.kernels.mla_attention import smem_bytes
    from mla_backends.kernels.tuning import launch_config

    one_stage = smem_bytes(64, 64, 1, True, 576, 2)
    assert smem_bytes(64, 64, 2, True, 576, 2) > one_stage  # two stages do not fit
    cfg = launch_config(64, 64, 8, 1, torch.bfloat16, False, 576, one_stage)
    assert cfg["tma"] and cfg["block_n"] == 64 and cfg["num_stages"] == 1, cfg


def test_num_splits_rounds_the_wave_ratio_to_nearest() -> None:
    """Hazard: the splits that cover the GPU `waves` times are round(waves * sms / programs),
    then a power of two at or below: 80 programs on 132 SMs (1.65 waves' worth) take 2 splits;
    truncating the ratio gave 1, a grid of 80 programs on 132 SMs."""
    from mla_backends.kernels.tuning import choose_num_splits

    assert choose_num_splits(80, 4096, 132, 1, 256) == 2
    assert choose_num_splits(100, 4096, 132, 1, 256) == 1  # 1.32 -> 1
    assert choose_num_splits(44, 4096, 132, 1, 256) == 2  # 3 -> a power of two at or below


@pytest.mark.parametrize("kv, want", [(255, 1), (300, 1), (511, 1), (512, 2), (1023, 2), (1024, 4)])
def test_every_split_keeps_at_least_min_keys(kv: int, want: int) -> None:
    """Hazard: the split count is capped at floor(kv / min_keys) so every split keeps >=
    min_keys keys; rounding up let a 300-key context take two splits of 150 keys (more
    partials to merge for less work each)."""
    from mla_backends.kernels.tuning import choose_num_splits

    assert choose_num_splits(1, kv, 132, 2, 256) == want


def test_narrow_kernel_pays_for_a_grid_of_exactly_one_wave() -> None:
    """Hazard: the narrow kernel's rule is one wave of CTAs, ctas <= SMs: a grid of exactly
    132 CTAs on 132 SMs (33 requests of 64 rows, 2 splits, 1k keys) is one wave and takes it;
    a strict bound sent it to 64-row blocks. One request more (136 CTAs) is past a wave."""
    from mla_backends.kernels.tuning import decode_splits, narrow_pays

    assert decode_splits(33, 64, 32, 1024, 132, narrow=True) == 2  # 33 * 2 * 2 = 132 CTAs
    assert narrow_pays(64, 33, 1024, 132)
    assert not narrow_pays(64, 34, 1024, 132)


@pytest.mark.parametrize("rows", [129, 160, 256])
def test_narrow_kernel_never_takes_more_than_128_rows_a_request(rows: int) -> None:
    """Hazard: the narrow kernel's measured range is 33-128 query rows a request (each
    32-row block streams the request's tiles again); a wider bound sent 129-256 rows (H128
    verify with q_len 2) to it where no measurement covers them."""
    from mla_backends.kernels.tuning import narrow_pays

    assert narrow_pays(128, 1, 1024, 132)  # the edge of the range, a short grid: it pays
    assert not narrow_pays(rows, 1, 1024, 132)


def test_split_policy_gives_64_key_splits_to_16_row_requests_in_64_row_blocks() -> None:
    """Hazard: a 64-row block holding a request of <= 16 rows (H16 decode) may split down to
    64 keys (B1 kv 4k: 64 splits 1.59x FlashMLA against 16 splits' 1.31x); an off-by-one gave
    exactly 16 rows (the H16 case itself) the 256-key minimum."""
    from mla_backends.kernels.tuning import split_policy

    assert split_policy(64, 16) == (1, 64)
    assert split_policy(64, 17) == (1, 256)
    assert split_policy(16, 16) == (2, 256)


def test_block_m_split_and_launch_bounds_are_inclusive(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """Hazard: every row / batch / page bound of the launch policy includes its value (the
    measured shapes sit on them: H16 decode is 16 rows, H16 verify of 2 tokens 32 rows, B16
    graphs): a strict bound moved 16- and 32-row requests and batches of 16 to the other
    kernel, and 64 splits of a 16-row Gluon block to 256-key splits."""
    from mla_backends.kernels import tuning

    bf16 = torch.bfloat16
    tuning.narrow_on.cache_clear()
    request.addfinalizer(tuning.narrow_on.cache_clear)
    monkeypatch.delenv("MLA_NARROW", raising=False)
    assert [tuning.block_m_for(r, bf16, True, 64) for r in (16, 17, 32, 33)] == [16, 32, 32, 64]
    assert [tuning.block_m_for(r, bf16, False, 64) for r in (16, 17, 32, 33)] == [16, 32, 32, 64]
    assert tuning.split_policy(64, 16) == (1, 64) and tuning.split_policy(64, 17) == (1, 256)
    # narrow kernel: 64-key TMA tiles, Gluon; a 64-row block on 32-token pages: no TMA
    narrow = tuning.launch_config(32, 64, 1, 1, bf16, True, 576, None)
    assert narrow["gluon"] and narrow["tma"] and narrow["num_warps"] == 4, narrow
    gather = tuning.launch_config(64, 32, 8, 1, bf16, True, 576, None)
    assert not gather["tma"] and gather["num_stages"] == 3 and "gluon" not in gather, gather
    monkeypatch.setenv("MLA_NARROW", "0")
    tuning.narrow_on.cache_clear()
    assert tuning.block_m_for(16, bf16, True, 16) == 64  # one Gluon block at batch <= 16
    assert tuning.block_m_for(16, bf16, True, 17) == 16


def test_fit_smem_narrows_key_tiles_down_to_16() -> None:
    """Hazard: a GPU whose shared memory holds 16-key gather tiles but not 32-key ones must
    get 16 (the narrowest tile the kernel takes), not the error; below that it fails naming
    the sizes."""
    from mla_backends.kernels.mla_attention import smem_bytes
    from mla_backends.kernels.tuning import launch_config

    limit = smem_bytes(64, 16, 3, False, 576, 2)
    assert smem_bytes(64, 32, 3, False, 576, 2) > limit
    cfg = launch_config(64, 16, 8, 1, torch.bfloat16, False, 576, limit)
    assert cfg["block_n"] == 16 and cfg["num_stages"] == 3 and not cfg["tma"], cfg
    with pytest.raises(ValueError, match=f"64 x 16 tiles of 576-wide rows need {limit} bytes"):
        launch_config(64, 16, 8, 1, torch.bfloat16, False, 576, limit - 1)


def test_mha_route_takes_torch_only_where_its_causal_rule_is_ours() -> None:
    """Hazard: torch's SDPA / cuDNN causal mask is top-left; with a prefix (fewer queries
    than keys) ours is bottom-right, so `sdpa_fits=False` must always take our kernel."""
    from mla_backends.kernels.tuning import mha_route

    for lse, cudnn in ((False, False), (False, True), (True, True)):
        assert mha_route(torch.bfloat16, True, False, lse, cudnn) == "triton"
    assert mha_route(torch.bfloat16, True, True, False, False) == "sdpa"
    assert mha_route(torch.bfloat16, True, True, True, True) == "cudnn"


def test_narrow_kernel_counts_a_splits_tiles_rounded_up() -> None:
    """Hazard: a split of a 1025-key context over 2 splits streams up to 513 keys, 9 tiles,
    past NARROW_MAX_TILES; flooring the keys a split counted 8 and took the narrow kernel."""
    from mla_backends.kernels.tuning import decode_splits, narrow_pays

    assert decode_splits(33, 64, 32, 1025, 132, narrow=True) == 2
    assert narrow_pays(64, 33, 1024, 132) and not narrow_pays(64, 33, 1025, 132)
