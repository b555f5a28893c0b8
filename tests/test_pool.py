"""The latent pool: round trips, FP8 scale contract, views without copies, accounting."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from mla_backends.checks import ShapeError
from mla_backends.pool import FP8_MAX, MLATokenToKVPool, ReqToTokenPool, RequestRowError


def _pool(dtype: torch.dtype, page: int = 16, pages: int = 8) -> MLATokenToKVPool:
    return MLATokenToKVPool(2, pages, page, 512, 64, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_store_load_round_trip_is_bitwise(dtype: torch.dtype) -> None:
    pool = _pool(dtype)
    loc = torch.randperm(pool.num_slots - 16)[:40] + 16  # never the dummy page
    k_nope = torch.randn(40, 512).to(dtype)
    k_rope = torch.randn(40, 64).to(dtype)
    pool.set_mla_kv_buffer(1, loc, k_nope, k_rope)
    rows = pool.get_kv_buffer(1)[loc]
    assert torch.equal(rows[:, :512], k_nope) and torch.equal(rows[:, 512:], k_rope)
    assert torch.equal(pool.get_kv_buffer(0), torch.zeros_like(pool.get_kv_buffer(0)))


@pytest.mark.parametrize("bad", ["nope-nan", "rope-nan", "rope-inf"])
def test_calibrate_scale_refuses_rows_that_are_not_finite(bad: str) -> None:
    """A NaN in the rope sample was skipped by max() (the scale set from the latent alone,
    silently); one in the latent was a NaN scale refused without naming the rows (helper 63's
    review). Refused in one message, the scale left unset."""
    pool = _pool(torch.float8_e4m3fn)
    k_nope, k_rope = torch.randn(4, 512), torch.randn(4, 64)
    part, value = bad.split("-")
    (k_nope if part == "nope" else k_rope)[1, 3] = float(value)
    with pytest.raises(ValueError, match=r"calibrate_scale: the sample rows are not finite"):
        pool.calibrate_scale(0, k_nope, k_rope)
    assert not pool.scale_is_set(0)


def test_fp8_round_trip_within_e4m3_precision_and_scale_applies() -> None:
    pool = _pool(torch.float8_e4m3fn)
    k_nope = torch.randn(64, 512) * 3.0
    k_rope = torch.randn(64, 64) * 40.0  # rope range much larger than latent
    scale = pool.calibrate_scale(0, k_nope, k_rope)
    want = max(k_nope.abs().max(), k_rope.abs().max()).item() / FP8_MAX
    assert want <= scale <= want * (1 + 2.0**-7)  # rounded up to a bf16 value
    assert torch.tensor(scale).to(torch.bfloat16).item() == scale == pool.scale(0)
    loc = torch.arange(16, 80)
    pool.set_mla_kv_buffer(0, loc, k_nope, k_rope)
    raw = pool.get_kv_buffer(0)[loc]
    assert raw.dtype == torch.float8_e4m3fn
    back = pool.load_rows(0, loc)
    want = torch.cat([k_nope, k_rope], -1)
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normals, plus the subnormal step.
    tol = want.abs() * 2.0**-4 + scale * 2.0**-9
    assert ((back - want).abs() <= tol).all()
    assert not torch.isnan(back).any()  # calibrated over the whole row: rope not saturated
    # stored = value / scale: the raw fp8 numbers are the values divided by the scale.
    torch.testing.assert_close(raw.float() * scale, back)


def test_fp8_latent_only_calibration_would_saturate_rope() -> None:
    """The hazard the whole-row calibration exists for: a latent-only scale clips the rope."""
    pool = _pool(torch.float8_e4m3fn)
    k_nope, k_rope = torch.randn(8, 512), torch.randn(8, 64) * 50.0
    pool.set_scale(0, k_nope.abs().max().item() / FP8_MAX)
    pool.set_mla_kv_buffer(0, torch.arange(16, 24), k_nope, k_rope)
    back = pool.load_rows(0, torch.arange(16, 24))[:, 512:]
    assert (back - k_rope).abs().max() > 10.0


@pytest.mark.parametrize("x", [0.037, 1e-3, 0.5, 3.0, 1.0 / 448, 7.1e-5])
def test_scales_are_bf16_values_rounded_up(x: float) -> None:
    from mla_backends.pool import bf16_ceil

    r = bf16_ceil(x)
    assert r >= x and torch.tensor(r).to(torch.bfloat16).item() == r
    assert bf16_ceil(r) == r and r <= x * (1 + 2.0**-7)


@pytest.mark.parametrize("x", [0.0, -1.0, -1e39, float("nan"), float("-inf")])
def test_bf16_ceil_refuses_what_it_cannot_round_up(x: float) -> None:
    from mla_backends.pool import bf16_ceil

    with pytest.raises(ValueError, match="must be > 0"):
        bf16_ceil(x)


def test_non_unit_scale_requires_fp8_and_positive() -> None:
    with pytest.raises(ValueError, match="needs an FP8 pool"):
        _pool(torch.bfloat16).set_scale(0, 0.5)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="must be finite and > 0"):
            _pool(torch.float8_e4m3fn).set_scale(0, bad)


def test_a_layers_scale_is_fixed_once_it_stored_rows() -> None:
    """Rows are stored as value / scale and not requantised: a new scale after a store read
    every stored row under it (8x too large here), silently. Refused once the layer stored,
    per layer; the same scale again, and other layers, stay settable."""
    pool = _pool(torch.float8_e4m3fn)
    assert pool.set_scale(0, 2.0**-6) == 2.0**-6 and pool.set_scale(0, 2.0**-5) == 2.0**-5
    k_nope, k_rope = torch.randn(8, 512), torch.randn(8, 64)
    pool.set_mla_kv_buffer(0, torch.arange(16, 24), k_nope, k_rope)
    before = pool.load_rows(0, torch.arange(16, 24))
    for call in (
        lambda: pool.set_scale(0, 0.25),
        lambda: pool.calibrate_scale(0, k_nope * 9, k_rope),
    ):
        with pytest.raises(
            RuntimeError,
            match=r"layer 0: rows were stored under scale 0.03125.* "
            r"set the scale before the first store",
        ):
            call()
    assert pool.set_scale(0, 2.0**-5) == 2.0**-5 and pool.set_scale(1, 0.25) == 0.25
    assert torch.equal(pool.load_rows(0, torch.arange(16, 24)), before)


def test_a_store_refuses_rows_that_are_not_floating_point() -> None:
    """An integer k_nope was cast and stored as values; a refused store marks no layer as
    holding rows."""
    pool = _pool(torch.float8_e4m3fn)
    loc = torch.arange(16, 20)
    with pytest.raises(ShapeError, match=r"k_nope: expected dtype in .*got torch.int64"):
        pool.set_mla_kv_buffer(0, loc, torch.ones(4, 512, dtype=torch.int64), torch.randn(4, 64))
    with pytest.raises(ShapeError, match=r"k_rope: expected dtype in .*got torch.int32"):
        pool.set_mla_kv_buffer(0, loc, torch.randn(4, 512), torch.ones(4, 64, dtype=torch.int32))
    assert pool.set_scale(0, 0.5) == 0.5  # nothing was stored
    from mla_backends.sparse.fp8_row import Fp8RowPool  # DeepSeek-V3.2's 656-byte rows

    rows = Fp8RowPool(1, 4, 64, 512, 64)
    with pytest.raises(ShapeError, match=r"k_nope: expected dtype in .*got torch.int64"):
        rows.set_mla_kv_buffer(0, loc, torch.ones(4, 512, dtype=torch.int64), torch.randn(4, 64))


def test_views_share_storage_and_have_kernel_shapes() -> None:
    pool = _pool(torch.bfloat16, page=64, pages=3)
    buf = pool.get_kv_buffer(0)
    assert buf.shape == (4 * 64, 576)
    paged = pool.get_paged_buffer(0)
    assert paged.shape == (4, 64, 1, 576) and paged.data_ptr() == buf.data_ptr()
    ckv, kpe = pool.get_ckv_kpe(0)
    assert ckv.shape == (4, 64, 512) and kpe.shape == (4, 64, 64)
    assert ckv.data_ptr() == buf.data_ptr()
    assert kpe.data_ptr() == buf.data_ptr() + 512 * buf.element_size()
    v = pool.get_value_buffer(0)
    assert v.shape == (256, 512) and v.data_ptr() == buf.data_ptr()
    buf[70, 3] = 5.0
    buf[70, 512 + 2] = 7.0
    assert paged[1, 6, 0, 3] == 5.0 and ckv[1, 6, 3] == 5.0 and kpe[1, 6, 2] == 7.0


def test_memory_accounting() -> None:
    pool = MLATokenToKVPool(61, 100, 64, 512, 64, torch.float8_e4m3fn)
    assert pool.bytes_per_token == 576 * 61
    assert pool.total_bytes == 576 * 61 * 101 * 64
    assert sum(b.numel() * b.element_size() for b in pool.kv_buffer) == pool.total_bytes


def test_store_rejects_bad_shapes_naming_the_tensor() -> None:
    pool = _pool(torch.bfloat16)
    loc = torch.arange(16, 20)
    with pytest.raises(ShapeError, match=r"k_nope: expected shape \[4, 512\], got \[4, 500\]"):
        pool.set_mla_kv_buffer(0, loc, torch.zeros(4, 500), torch.zeros(4, 64))
    with pytest.raises(ShapeError, match=r"k_rope: expected shape \[4, 64\]"):
        pool.set_mla_kv_buffer(0, loc, torch.zeros(4, 512), torch.zeros(3, 64))
    with pytest.raises(ShapeError, match="loc: expected dtype"):
        pool.set_mla_kv_buffer(0, loc.float(), torch.zeros(4, 512), torch.zeros(4, 64))


def test_req_to_token_rows() -> None:
    rp = ReqToTokenPool(3, 32, "cpu")
    assert rp.req_to_token.shape == (4, 32) and rp.req_to_token.dtype == torch.int32
    rows = rp.alloc(3)
    assert sorted(rows) == [1, 2, 3]  # row 0 reserved
    with pytest.raises(MemoryError, match="requested 1 request rows, 0 free"):
        rp.alloc()
    with pytest.raises(ValueError, match="rows to allocate must be an integer >= 0, got -1"):
        rp.alloc(-1)
    assert rp.alloc(torch.tensor(0)) == [] and rp.alloc(np.int64(0)) == []  # any integer
    rp.free(2)
    with pytest.raises(ValueError, match="not an allocated"):
        rp.free(2)
    with pytest.raises(ValueError, match="not an allocated"):
        rp.free(0)
    assert rp.alloc() == [2]


def test_batch_build_refuses_lengths_that_are_not_integers() -> None:
    """Lengths become int32 tensors: a float prefix (1.5) was truncated, silently, giving
    seq_lens 2 and float positions; an IDLE batch with requests and a 2-D slot tensor were
    taken as they came."""
    from mla_backends.batch import ForwardBatch, ForwardMode

    loc = torch.tensor([5, 6], dtype=torch.int64)
    with pytest.raises(TypeError, match=r"prefix_lens must be integers, got \[1.5\]"):
        ForwardBatch.build(ForwardMode.EXTEND, [1], [1.5], [2], loc, "cpu")  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"rows must be integers"):
        ForwardBatch.build(ForwardMode.EXTEND, [1.0], [0], [2], loc, "cpu")  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"rows must be integers, got \[True\]"):
        ForwardBatch.build(ForwardMode.EXTEND, [True], [0], [2], loc, "cpu")
    with pytest.raises(ValueError, match=r"out_cache_loc must be 1-D \[tokens\], got shape"):
        ForwardBatch.build(ForwardMode.EXTEND, [1], [0], [2], loc[None], "cpu")
    with pytest.raises(ValueError, match=r"IDLE carries no requests, got rows \[1\]"):
        ForwardBatch.build(ForwardMode.IDLE, [1], [0], [2], loc, "cpu")
    with pytest.raises(TypeError, match=r"out_cache_loc must hold integer slots, got torch.fl"):
        ForwardBatch.build(ForwardMode.EXTEND, [1], [0], [2], loc.float() + 2**24, "cpu")
    b = ForwardBatch.build(ForwardMode.EXTEND, [np.int64(1)], [torch.tensor(3)], [2], loc, "cpu")
    assert b.seq_lens_cpu.tolist() == [5] and b.positions.tolist() == [3, 4]


def test_check_batch_refuses_a_batch_reading_fewer_tokens_than_the_row_stored() -> None:
    """A prefix passed short (4 where the row had 5 before its decode token was allocated):
    the new row was stored at position 5, the batch attended over positions 0..4 with the new
    token at position 4: a wrong answer without an error. Row 0 (padding) stays exempt."""
    from mla_backends.allocator import PagedTokenAllocator
    from mla_backends.batch import ForwardBatch, ForwardMode
    from mla_backends.pool import RequestRowError

    rp = ReqToTokenPool(2, 64, "cpu")
    alloc = PagedTokenAllocator(4, 16, rp)
    (row,) = rp.alloc(1)
    alloc.alloc_extend([row], [5])
    loc = alloc.alloc_decode([row])
    short = ForwardBatch.build(ForwardMode.DECODE, [row], [4], [1], loc, "cpu")
    with pytest.raises(RequestRowError, match=r"reads 5 tokens, the row has 6 stored"):
        rp.check_batch(short)
    padded = torch.cat([loc, torch.zeros(1, dtype=torch.int64)])
    rp.check_batch(ForwardBatch.build(ForwardMode.DECODE, [row, 0], [5, 0], [1, 1], padded, "cpu"))


@pytest.mark.parametrize("bad", [3.39e38, 3.4e38, 1e39, 1e38, 1e-46, 1e-40])
def test_scale_check_sees_the_stored_value_and_its_reciprocal(bad: float) -> None:
    """The check ran on the float64 argument; what is stored is its bf16 ceiling and the
    stores multiply by its fp32 reciprocal: 3.39e38 and 3.4e38 rounded up to inf (every row
    read back NaN), 1e39 broke struct.pack (an OverflowError), 1e-46 rounded down to 0 and
    1e-40 to a subnormal whose reciprocal is inf (rows stored as NaN or +-448); 1e38 has a
    subnormal reciprocal. Now the scale and its reciprocal are normal fp32 values."""
    pool = _pool(torch.float8_e4m3fn)
    msg = rf"layer 0: kv scale must be .* got {re.escape(f'{bad:g}')} \(stored"
    with pytest.raises(ValueError, match=msg):
        pool.set_scale(0, bad)
    assert pool.scale(0) == 1.0 and not pool.scale_is_set(0)
    tiny = torch.finfo(torch.float32).tiny
    for ok in (2.0**126, 8.5e37, tiny, 1.2e-38):  # the extremes: both ways normal in fp32
        used = pool.set_scale(0, ok)
        assert used == pool.scale(0) == float(pool.scales[0]) >= ok
        assert tiny <= float(pool.scales[0].reciprocal()) < float("inf")


def test_layer_and_row_checks_refuse_a_torch_bool() -> None:
    """operator.index takes a torch bool tensor as 0 / 1: `check_layer_index` and `as_ints`
    refused Python's bool only, so torch.tensor(True) stored into layer 1 and freed row 1;
    `warn_if_uncalibrated(True)` (no range check) marked layer 1 as warned, and a real
    uncalibrated store there then warned nothing (helper 67's sweep)."""
    import warnings

    from mla_backends.batch import as_int
    from mla_backends.pool import LayerIndexError, check_layer_index

    for bad in (1.5, torch.tensor(2.0)):  # operator.index's own TypeError named nothing
        with pytest.raises(ValueError, match="request rows to allocate must be an integer >= 0"):
            ReqToTokenPool(4, 16, "cpu").alloc(bad)  # type: ignore[arg-type]
    for bad in (True, torch.tensor(True), torch.tensor(False)):
        with pytest.raises(LayerIndexError):
            check_layer_index(bad, 2)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="row must be an integer"):
            as_int(bad, "row")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="request rows to allocate must be an integer >= 0"):
            ReqToTokenPool(4, 16, "cpu").alloc(bad)  # type: ignore[arg-type]  # it took 1 row
    assert check_layer_index(torch.tensor(1), 2) == as_int(np.int64(1), "row") == 1  # type: ignore[arg-type]
    pool = MLATokenToKVPool(2, 4, 16, 512, 64, torch.float8_e4m3fn)
    for bad in (True, -1):
        with pytest.raises(LayerIndexError):
            pool.warn_if_uncalibrated(bad)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pool.set_mla_kv_buffer(1, torch.tensor([17]), torch.randn(1, 512), torch.randn(1, 64))
    assert any("layer 1" in str(w.message) for w in seen), [str(w.message) for w in seen]


def test_check_rows_refuses_the_padding_row_zero() -> None:
    """Hazard: `check_rows` accepting row 0 (the padding row, allocated from the start) let
    `Engine.reset([0])` / `alloc_extend([0], ...)` treat the dummy row as a request row:
    KV for the padding row, or its state reset, silently."""
    pool = ReqToTokenPool(4, 16, "cpu")
    rows = pool.alloc(2)
    pool.check_rows(rows)  # allocated request rows pass
    with pytest.raises(RequestRowError, match=r"\[0\]"):
        pool.check_rows([0])
    with pytest.raises(RequestRowError):
        pool.check_rows([rows[0], 0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pools_that_are_not_fp8_never_warn_of_an_uncalibrated_scale(dtype: torch.dtype) -> None:
    """Hazard: the uncalibrated-scale warning is for FP8 pools only (a bf16 pool has no
    scale to set: `set_scale` refuses one other than 1.0); fired for every layer of a bf16
    pool it told users to calibrate a scale they cannot set, and `-W error` runs failed."""
    import warnings

    from mla_backends.pool import UncalibratedScaleWarning

    pool = MLATokenToKVPool(2, 4, 16, 32, 16, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncalibratedScaleWarning)
        for layer in range(2):
            pool.set_mla_kv_buffer(
                layer, torch.tensor([17, 18]), torch.randn(2, 32), torch.randn(2, 16)
            )
            pool.warn_if_uncalibrated(layer)


@pytest.mark.parametrize(
    "bad", [None, "0.5", True, torch.ones(2)], ids=["none", "str", "bool", "2-elem"]
)
def test_set_scale_refuses_what_is_not_a_number_naming_it(bad: object) -> None:
    """A missing (None) or string scale failed inside the range check ("'>' not supported"),
    naming no argument; True was taken as 1.0."""
    pool = _pool(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"layer 1: kv scale must be a real number, got"):
        pool.set_scale(1, bad)  # type: ignore[arg-type]
    assert not pool.scale_is_set(1)
    assert (
        pool.set_scale(1, np.float32(0.5)) == 0.5 and pool.set_scale(0, torch.tensor(0.25)) == 0.25
    )


def test_load_rows_refuses_float_slots() -> None:
    """`.long()` truncated float slots (1.5 read slot 1), silently."""
    pool = _pool(torch.float32)
    with pytest.raises(ShapeError, match=r"loc: expected integer slots, got torch.float32"):
        pool.load_rows(0, torch.tensor([1.5]))
    assert pool.load_rows(0, torch.tensor([[1, 2]], dtype=torch.int32)).shape == (1, 2, 576)


@pytest.mark.parametrize(
    "kwargs, want",
    [
        ({"num_layers": -1}, "num_layers must be an integer >= 0, got -1"),
        ({"kv_lora_rank": 0}, "kv_lora_rank must be an integer >= 1, got 0"),
        ({"page_size": 16.0}, "page_size must be an integer >= 1, got 16.0"),
    ],
    ids=["layers-neg", "rank-0", "page-float"],
)
def test_pool_constructor_names_a_bad_size(kwargs: dict, want: str) -> None:
    """Negative or float sizes failed inside torch.zeros naming no argument; kv_lora_rank 0
    built a pool of rope-only rows. The refusal names the one size that is wrong."""
    args = {"num_layers": 2, "num_pages": 4, "page_size": 16, "kv_lora_rank": 32}
    with pytest.raises(ValueError, match=rf"^MLATokenToKVPool: {want}$"):
        MLATokenToKVPool(**(args | kwargs), qk_rope_head_dim=8, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "sizes, want",
    [
        ((-3, 16), "max_requests must be an integer >= 0, got -3"),
        ((4, 0), "max_context_len must be an integer >= 1, got 0"),
        ((4, 16.0), "max_context_len must be an integer >= 1, got 16.0"),
    ],
    ids=["rows-neg", "ctx-0", "ctx-float"],
)
def test_request_table_constructor_names_a_bad_size(sizes: tuple, want: str) -> None:
    with pytest.raises(ValueError, match=rf"^ReqToTokenPool: {want}$"):
        ReqToTokenPool(*sizes, "cpu")
