"""Bad input to a backend gets a clear error naming the tensor, never a wrong answer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mla_backends.batch import ForwardBatch, ForwardMode, RaggedLayout
from mla_backends.checks import ShapeError
from mla_backends.testing import Case, build_case


@pytest.fixture
def setup():  # type: ignore[no-untyped-def]
    return build_case(Case(mode=ForwardMode.DECODE, kv_lens=(5, 9)), torch.device("cpu"))


def _q(t: int = 2, h: int = 16, lat: int = 512, r: int = 64, dtype=torch.bfloat16):  # type: ignore[no-untyped-def]
    return torch.randn(t, h, lat).to(dtype), torch.randn(t, h, r).to(dtype)


@pytest.mark.parametrize(
    "q, pattern",
    [
        (_q(h=8), r"q_nope: expected shape \[2, 16, 512\], got \[2, 8, 512\]"),
        (_q(t=3), r"q_nope: expected shape \[2, 16, 512\], got \[3, 16, 512\]"),
        (_q(lat=576), r"q_nope: expected shape \[2, 16, 512\], got \[2, 16, 576\]"),
        (_q(r=32), r"q_rope: expected shape \[2, 16, 64\], got \[2, 16, 32\]"),
        (_q(dtype=torch.int32), r"q_nope: expected dtype in .*got torch.int32"),
    ],
)
def test_absorbed_rejects_bad_q(setup, q, pattern) -> None:  # type: ignore[no-untyped-def]
    rt, batch = setup
    rt.backend.init_forward_metadata(batch)
    with pytest.raises(ShapeError, match=pattern):
        rt.backend.forward_absorbed(0, *q, None, None, batch)


def test_absorbed_rejects_mixed_q_dtypes_and_half_given_rows(setup) -> None:  # type: ignore[no-untyped-def]
    rt, batch = setup
    rt.backend.init_forward_metadata(batch)
    qn, qr = _q()
    with pytest.raises(ShapeError, match=r"q_rope: expected dtype in \['torch.bfloat16'\]"):
        rt.backend.forward_absorbed(0, qn, qr.float(), None, None, batch)
    with pytest.raises(ValueError, match="both be given or both be None"):
        rt.backend.forward_absorbed(0, qn, qr, torch.zeros(2, 512), None, batch)
    with pytest.raises(ShapeError, match=r"k_nope: expected shape \[2, 512\]"):
        rt.backend.forward_absorbed(0, qn, qr, torch.zeros(2, 64), torch.zeros(2, 64), batch)


def test_absorbed_lse_asked_for_and_not_returned_is_refused(
    setup, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """A backend that declares `caps.lse` but whose `_attend_absorbed` gives lse None: the
    caller got (out, None), and the parity matrix and `verify` passed it (nothing to compare)."""
    rt, batch = setup
    be = rt.backend
    attend = be._attend_absorbed
    monkeypatch.setattr(be, "_attend_absorbed", lambda *a: (attend(*a)[0], None))
    be.init_forward_metadata(batch)
    with pytest.raises(RuntimeError, match="'torch' returned no LSE although it was asked"):
        be.forward_absorbed(0, *_q(), None, None, batch, True)
    assert be.forward_absorbed(0, *_q(), None, None, batch).shape == (2, 16, 512)


def test_mha_rejects_bad_shapes(setup) -> None:  # type: ignore[no-untyped-def]
    rt, _ = setup
    layout = RaggedLayout.from_lens([3, 2], [3, 2], "cpu")
    q, k, v = torch.randn(5, 16, 192), torch.randn(5, 16, 192), torch.randn(5, 16, 128)
    with pytest.raises(ShapeError, match=r"v: expected shape \[5, 16, 128\], got \[5, 16, 192\]"):
        rt.backend.forward_mha(q, k, k, layout)
    with pytest.raises(ShapeError, match=r"q: expected shape \[5, 16, 192\], got \[4, 16, 192\]"):
        rt.backend.forward_mha(q[:4], k, v, layout)


def test_batch_build_rejects_inconsistent_modes() -> None:
    loc = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="DECODE needs one new token per request"):
        ForwardBatch.build(ForwardMode.DECODE, [1, 2], [0, 0], [2, 1], loc, "cpu")
    with pytest.raises(ValueError, match="TARGET_VERIFY needs equal q_len"):
        ForwardBatch.build(ForwardMode.TARGET_VERIFY, [1, 2], [4, 4], [2, 1], loc, "cpu")
    with pytest.raises(ValueError, match="out_cache_loc has 3 slots, batch has 4 tokens"):
        ForwardBatch.build(ForwardMode.EXTEND, [1, 2], [0, 0], [2, 2], loc, "cpu")


def test_batch_q_len_is_one_in_decode_and_the_draft_count_in_verify() -> None:
    loc = torch.zeros(6, dtype=torch.int64)
    decode = ForwardBatch.build(ForwardMode.DECODE, [1, 2], [4, 4], [1, 1], loc[:2], "cpu")
    verify = ForwardBatch.build(ForwardMode.TARGET_VERIFY, [1, 2], [4, 4], [3, 3], loc, "cpu")
    assert (decode.q_len, verify.q_len) == (1, 3)


def test_an_empty_decode_or_verify_batch_passes_its_check() -> None:
    """A rank with no requests still builds a DECODE / TARGET_VERIFY batch: its check must not
    take the max of no query lengths (a RuntimeError from torch's empty reduction)."""
    loc = torch.zeros(0, dtype=torch.int64)
    for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        batch = ForwardBatch.build(mode, [], [], [], loc, "cpu")
        batch.check(torch.device("cpu"))
        assert (batch.batch_size, batch.num_tokens, batch.max_q_len) == (0, 0, 0)


def test_metadata_must_be_built_first(setup) -> None:  # type: ignore[no-untyped-def]
    rt, batch = setup
    with pytest.raises(RuntimeError, match="init_forward_metadata was not called"):
        rt.backend.forward_absorbed(0, *_q(), None, None, batch)


def test_metadata_of_another_batch_is_refused(setup) -> None:  # type: ignore[no-untyped-def]
    """Metadata built for batch A, attention called with batch B (the engine skipped B's
    init): refused before anything is stored (it attended over A's rows and lengths, a wrong
    answer without an error)."""
    rt, batch = setup
    rt.backend.init_forward_metadata(batch)
    other = ForwardBatch.build(
        ForwardMode.DECODE,
        batch.req_pool_indices_cpu.tolist(),
        batch.extend_prefix_lens_cpu.tolist(),
        [1, 1],
        batch.out_cache_loc,
        "cpu",
    )
    before = rt.kv_pool.kv_buffer[0].clone()
    k = torch.randn(2, 512).bfloat16(), torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match=r"not called for this batch \(the metadata is another"):
        rt.backend.forward_absorbed(0, *_q(), *k, other)
    after = rt.kv_pool.kv_buffer[0]
    torch.testing.assert_close(after, before, rtol=0, atol=0, equal_nan=True)  # nothing stored
    rt.backend.forward_absorbed(0, *_q(), None, None, batch)  # its own batch runs


# ---------------------------------------------------------------- API misuse: named errors


def _backends_here() -> list[str]:
    from mla_backends.backends.base import Capability
    from mla_backends.backends.registry import why_not
    from mla_backends.config import TINY_KERNEL, Config

    cfg = Config(model=TINY_KERNEL, device="cpu")
    return [n for n in ("torch", "triton") if why_not(n, cfg, Capability("cpu"), "decode") is None]


def _tiny_case(backend: str, kv_dtype: str = "bfloat16"):  # type: ignore[no-untyped-def]
    from mla_backends.config import TINY_KERNEL

    case = Case(
        backend=backend,
        mode=ForwardMode.DECODE,
        num_heads=TINY_KERNEL.num_heads,
        kv_dtype=kv_dtype,
        kv_lens=(5, 9),
        dims=TINY_KERNEL,
    )
    return build_case(case, torch.device("cpu"))


def _tiny_q(batch, d):  # type: ignore[no-untyped-def]
    t = batch.num_tokens
    return (
        torch.randn(t, d.num_heads, d.kv_lora_rank).bfloat16(),
        torch.randn(t, d.num_heads, d.qk_rope_head_dim).bfloat16(),
        torch.randn(t, d.kv_lora_rank).bfloat16(),
        torch.randn(t, d.qk_rope_head_dim).bfloat16(),
    )


@pytest.mark.parametrize("layer", [-1, 1, 7, True])
def test_pool_rejects_a_layer_outside_its_range(layer: int) -> None:
    from mla_backends.pool import LayerIndexError, MLATokenToKVPool

    pool = MLATokenToKVPool(1, 4, 16, 32, 16, torch.bfloat16)  # one layer: 0
    loc = torch.arange(16, 18)
    rows = torch.zeros(2, 32), torch.zeros(2, 16)
    msg = rf"layer {layer} is out of range: the pool has layers 0..0"
    for call in (
        lambda: pool.set_mla_kv_buffer(layer, loc, *rows),
        lambda: pool.load_rows(layer, loc),
        lambda: pool.scale(layer),
        lambda: pool.set_scale(layer, 1.0),
        lambda: pool.get_kv_buffer(layer),
        lambda: pool.get_paged_buffer(layer),
        lambda: pool.get_ckv_kpe(layer),
        lambda: pool.kv_buffer[layer],  # what kernels index directly
    ):
        with pytest.raises(LayerIndexError, match=msg):
            call()
    pool.set_mla_kv_buffer(0, loc, *rows)  # layer 0 is fine


@pytest.mark.parametrize("backend", _backends_here())
def test_backend_rejects_a_layer_outside_the_pool(backend: str) -> None:
    from mla_backends.pool import LayerIndexError

    rt, batch = _tiny_case(backend)  # build_case: one layer
    rt.backend.init_forward_metadata(batch)
    q_nope, q_rope, k_nope, k_rope = _tiny_q(batch, rt.config.model)
    before = rt.kv_pool.kv_buffer[0].view(torch.int16).clone()  # NaN-poisoned: bitwise
    for layer in (-1, 1):
        with pytest.raises(LayerIndexError, match=rf"layer {layer} is out of range"):
            rt.backend.forward_absorbed(layer, q_nope, q_rope, k_nope, k_rope, batch)
        with pytest.raises(LayerIndexError, match=rf"layer {layer} is out of range"):
            rt.backend.store_kv(layer, batch.out_cache_loc, k_nope, k_rope)
    assert torch.equal(rt.kv_pool.kv_buffer[0].view(torch.int16), before)  # nothing written
    out = rt.backend.forward_absorbed(0, q_nope, q_rope, k_nope, k_rope, batch)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("backend", _backends_here())
def test_prefix_longer_than_what_a_request_stored_is_refused(backend: str) -> None:
    from mla_backends.pool import RequestRowError

    rt, batch = _tiny_case(backend)  # rows hold 5 and 9 tokens (the decode token included)
    rows = batch.req_pool_indices_cpu.tolist()
    assert [int(rt.req_pool.filled[r]) for r in rows] == [5, 9]
    q_nope, q_rope, _, _ = _tiny_q(batch, rt.config.model)
    for prefix, row, reads, stored in (([5, 8], rows[0], 6, 5), ([4, 40], rows[1], 41, 9)):
        bad = ForwardBatch.build(
            ForwardMode.DECODE, rows, prefix, [1, 1], batch.out_cache_loc, "cpu"
        )
        want = (
            rf"request row {row} .*reads {reads} tokens \(prefix_lens {reads - 1} \+ 1 new\), "
            rf"the row has {stored} stored"
        )
        with pytest.raises(RequestRowError, match=want):  # before any index is built
            rt.backend.init_forward_metadata(bad)
        with pytest.raises(RequestRowError, match=want):  # and without metadata asked for
            rt.backend.forward_absorbed(0, q_nope, q_rope, None, None, bad)
    rt.backend.init_forward_metadata(batch)
    rt.backend.forward_absorbed(0, q_nope, q_rope, None, None, batch)  # the true prefix is fine


@pytest.mark.parametrize("backend", _backends_here())
def test_request_rows_never_allocated_are_refused(backend: str) -> None:
    from mla_backends.pool import RequestRowError

    rt, batch = _tiny_case(backend)
    rows = batch.req_pool_indices_cpu.tolist()
    stranger = rt.req_pool.size  # a valid index, never handed out by alloc()
    assert stranger not in rows
    q_nope, q_rope, _, _ = _tiny_q(batch, rt.config.model)
    bad = ForwardBatch.build(
        ForwardMode.DECODE, [rows[0], stranger], [4, 0], [1, 1], batch.out_cache_loc, "cpu"
    )
    want = rf"request row\(s\) \[{stranger}\] were never allocated"
    with pytest.raises(RequestRowError, match=want):
        rt.backend.init_forward_metadata(bad)
    with pytest.raises(RequestRowError, match=want):
        rt.backend.forward_absorbed(0, q_nope, q_rope, None, None, bad)
    with pytest.raises(RequestRowError, match=r"were never allocated"):
        rt.allocator.alloc_extend([stranger], [3])
    with pytest.raises(ValueError, match=rf"row {rows[1]} still holds KV pages; free them"):
        rt.req_pool.free(rows[1])  # its KV first: a reused row would read it
    rt.allocator.free(rows[1])
    rt.req_pool.free(rows[1])  # freed rows are refused too
    with pytest.raises(
        RequestRowError, match=rf"\[{rows[1]}\] were never allocated \(or were freed\)"
    ):
        rt.backend.forward_absorbed(0, q_nope, q_rope, None, None, batch)


def _with(batch: ForwardBatch, **fields: object) -> ForwardBatch:
    return dataclasses.replace(batch, **fields)  # type: ignore[arg-type]


_ONE = torch.ones(1, dtype=torch.int32)
_THREE = torch.ones(3, dtype=torch.int32)


_DISAGREEING: list[tuple[dict[str, object], str]] = [
    ({"req_pool_indices": _ONE}, r"req_pool_indices: expected shape \[2\] .*batch size.*\[1\]"),
    ({"extend_seq_lens": _THREE}, r"extend_seq_lens: expected shape \[2\].*got \[3\]"),
    ({"extend_prefix_lens_cpu": _ONE}, r"extend_prefix_lens_cpu: expected shape \[2\]"),
    ({"seq_lens": torch.ones(2, 1, dtype=torch.int32)}, r"seq_lens: expected shape \[2\]"),
    (
        {"positions": torch.zeros(3, dtype=torch.int64)},
        r"positions: expected shape \[2\] .*new tokens",
    ),
    (
        {"out_cache_loc": torch.zeros(1, dtype=torch.int64)},
        r"out_cache_loc: expected shape \[2\]",
    ),
    ({"seq_lens": torch.ones(2)}, r"seq_lens: expected an integer dtype, got torch.float32"),
    (
        {"seq_lens": torch.ones(2, dtype=torch.int32, device="meta")},
        r"seq_lens: expected device cpu, got meta",
    ),
    (
        {"seq_lens_cpu": torch.ones(2, dtype=torch.int32, device="meta")},
        r"seq_lens_cpu: expected device cpu",
    ),
    ({"req_pool_indices_cpu": _THREE}, r"req_pool_indices_cpu: expected shape \[2\]"),
    # The query count a decode kernel reads is the mode's and num_draft_tokens', not ext's.
    ({"num_draft_tokens": 3}, r"num_draft_tokens: 3 in DECODE"),
    ({"mode": ForwardMode.TARGET_VERIFY}, r"num_draft_tokens: 0 in TARGET_VERIFY"),
    (
        {"mode": ForwardMode.TARGET_VERIFY, "num_draft_tokens": 2},
        r"extend_seq_lens_cpu: TARGET_VERIFY .* needs 2 new token\(s\) per request, got \[1, 1\]",
    ),
    (
        {"extend_seq_lens_cpu": torch.tensor([2, 0], dtype=torch.int32)},
        r"extend_seq_lens_cpu: DECODE .* needs 1 new token\(s\) per request, got \[2, 0\]",
    ),
]
_DISAGREEING_IDS = (
    "rows ext pre-cpu seq-2d positions loc float device cpu-copy rows-cpu "
    "decode-draft verify-draft-0 verify-q decode-ext"
).split()


@pytest.mark.parametrize(
    "fields, want, host_rows",
    [
        pytest.param(f, w, host, id=f"{name}-{'host' if host else 'no-host'}-rows")
        for (f, w), name in zip(_DISAGREEING, _DISAGREEING_IDS)
        for host in (True, False)
        if host or "req_pool_indices_cpu" not in f  # batches without host rows lack the field
    ],
)
@pytest.mark.parametrize("backend", _backends_here())
def test_batch_fields_that_disagree_are_refused_before_anything_is_stored(
    backend: str, fields: dict[str, object], want: str, host_rows: bool
) -> None:
    """A batch built field by field (an engine's own, a graph runner's) whose fields disagree
    on the batch size or token count: one clear error, nothing stored. Before, `triton` gave
    a wrong answer and `torch` an IndexError deep in its gather."""
    rt, batch = _tiny_case(backend)
    if not host_rows:  # SGLang's eager batches and graph batches carry no host rows
        batch = _with(batch, req_pool_indices_cpu=None)
    q_nope, q_rope, k_nope, k_rope = _tiny_q(batch, rt.config.model)
    bad = _with(batch, **fields)
    before = rt.kv_pool.kv_buffer[0].view(torch.int16).clone()  # poisoned rows: NaN
    with pytest.raises(ShapeError, match=rf"ForwardBatch\.{want}"):
        rt.backend.init_forward_metadata(bad)
    rt.backend.init_forward_metadata(batch)
    with pytest.raises(ShapeError, match=rf"ForwardBatch\.{want}"):
        rt.backend.forward_absorbed(0, q_nope, q_rope, k_nope, k_rope, bad)
    assert torch.equal(rt.kv_pool.kv_buffer[0].view(torch.int16), before)  # nothing stored
    out = rt.backend.forward_absorbed(0, q_nope, q_rope, k_nope, k_rope, batch)
    assert torch.isfinite(out).all()


def test_padding_row_zero_stays_usable() -> None:
    """Request row 0 (padding, the dummy page) is never allocated yet always allowed."""
    rt, batch = _tiny_case("torch")
    rows = batch.req_pool_indices_cpu.tolist()
    loc = torch.cat([batch.out_cache_loc, torch.zeros(1, dtype=torch.int64)])
    padded = ForwardBatch.build(ForwardMode.DECODE, [*rows, 0], [4, 8, 0], [1, 1, 1], loc, "cpu")
    rt.backend.init_forward_metadata(padded)
    q_nope, q_rope, _, _ = _tiny_q(padded, rt.config.model)
    rt.backend.forward_absorbed(0, q_nope, q_rope, None, None, padded)


@pytest.mark.parametrize("backend", _backends_here())
def test_uncalibrated_fp8_pool_warns_once_per_layer(backend: str) -> None:
    from mla_backends.config import TINY_KERNEL, Config
    from mla_backends.pool import UncalibratedScaleWarning
    from mla_backends.runtime import Runtime

    cfg = Config(
        model=TINY_KERNEL,
        num_layers=2,
        prefill_backend=backend,
        decode_backend=backend,
        kv_dtype="float8_e4m3fn",
        num_pages=4,
        max_requests=2,
        max_context_len=32,
        device="cpu",
    )
    rt = Runtime.build(cfg)
    rows = rt.req_pool.alloc(1)
    loc = rt.allocator.alloc_extend(rows, [3])
    batch = ForwardBatch.build(ForwardMode.EXTEND, rows, [0], [3], loc, "cpu")
    rt.backend.init_forward_metadata(batch)
    q_nope, q_rope, k_nope, k_rope = _tiny_q(batch, TINY_KERNEL)
    rt.kv_pool.set_scale(1, 0.05)  # layer 1 calibrated, layer 0 left at the default
    with pytest.warns(UncalibratedScaleWarning) as seen:
        for layer in (0, 0, 1, 1):
            rt.backend.forward_absorbed(layer, q_nope, q_rope, k_nope, k_rope, batch)
        rt.kv_pool.set_mla_kv_buffer(0, loc, k_nope, k_rope)
    assert len(seen) == 1, [str(w.message) for w in seen]
    msg = str(seen[0].message)
    assert "layer 0" in msg and "calibrate_scale" in msg and "set_scale" in msg


def test_batch_build_refuses_negative_lengths() -> None:
    """A negative prefix gave a batch that attended nothing (out 0, LSE -inf) without an
    error, and a negative extend a cryptic torch.arange error."""
    loc = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(
        ValueError, match=r"lengths must be >= 0, got \(prefix, extend\) \[\(-1, 1\)\]"
    ):
        ForwardBatch.build(ForwardMode.DECODE, [1], [-1], [1], loc, "cpu")
    with pytest.raises(ValueError, match=r"\[\(3, -1\)\]"):
        ForwardBatch.build(ForwardMode.EXTEND, [1, 2], [0, 3], [1, -1], loc, "cpu")


def _last_dim_strided(x: torch.Tensor) -> torch.Tensor:
    """The same values with a last stride != 1 (a transposed layout)."""
    return x.transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.mark.parametrize("backend", _backends_here())
def test_views_whose_last_dim_is_strided_give_the_contiguous_answer(backend: str) -> None:
    """The Triton kernels take leading strides and assume the last is 1: a transposed q (or
    index rows) was read at the wrong addresses, a wrong answer without an error (out off by
    ~1e37 in the dense verify path). Every backend call now equals its contiguous twin:
    absorbed verify, MHA prefill and sparse attention."""
    from mla_backends import Config, Runtime
    from mla_backends.config import TINY_KERNEL as D
    from mla_backends.sparse.base import SparseContext, create_sparse_backend

    cfg = Config(
        model=D, prefill_backend=backend, decode_backend=backend, device="cpu",
        kv_dtype="float32", dtype="float32", page_size=16, num_pages=8, max_requests=2,
        max_context_len=64, num_layers=1,
    )  # fmt: skip
    rt = Runtime.build(cfg)
    g = torch.Generator().manual_seed(0)
    rt.kv_pool.kv_buffer[0].copy_(torch.randn(rt.kv_pool.kv_buffer[0].shape, generator=g))
    rows = rt.req_pool.alloc(1)
    rt.allocator.alloc_extend(rows, [30])
    loc = rt.allocator.alloc_extend(rows, [3])
    batch = ForwardBatch.build(ForwardMode.TARGET_VERIFY, rows, [30], [3], loc, "cpu")
    t, h, lat, r = 3, D.num_heads, D.kv_lora_rank, D.qk_rope_head_dim
    qn, qr = torch.randn(t, h, lat, generator=g), torch.randn(t, h, r, generator=g)
    rt.backend.init_forward_metadata(batch)
    want = rt.backend.forward_absorbed(0, qn, qr, None, None, batch, return_lse=True)
    got = rt.backend.forward_absorbed(0, _last_dim_strided(qn), qr, None, None, batch, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    layout = RaggedLayout.from_lens([3], [3], "cpu")
    q, k = (torch.randn(3, h, D.qk_head_dim, generator=g) for _ in range(2))
    v = torch.randn(3, h, D.v_head_dim, generator=g)
    want = rt.backend.forward_mha(q, k, v, layout, return_lse=True)
    got = rt.backend.forward_mha(_last_dim_strided(q), k, _last_dim_strided(v), layout, True, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    sparse = create_sparse_backend(
        backend, SparseContext(D, rt.kv_pool, rt.req_pool, 16, torch.float32)
    )
    sparse.init_forward_metadata(batch)
    slots = rt.req_pool.req_to_token[rows[0], :33].long()
    idx = torch.stack([slots[torch.randperm(30 + i, generator=g)[:16]] for i in range(t)]).int()
    want = sparse.forward_sparse(0, qn, qr, idx, batch, return_lse=True)
    got = sparse.forward_sparse(0, _last_dim_strided(qn), qr, idx.t().contiguous().t(), batch, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend", _backends_here())
def test_store_kv_keeps_the_pools_checks(backend: str) -> None:
    """The triton backend's own store (MHA-mode prefill stores through it) skipped what the
    pool's store checks: no warning for an FP8 layer never calibrated, float slots taken."""
    from mla_backends.pool import UncalibratedScaleWarning

    rt, batch = _tiny_case(backend, "float8_e4m3fn")
    rt.kv_pool._scale_set[0] = rt.kv_pool._scale_warned[0] = False  # as a fresh pool's
    _, _, k_nope, k_rope = _tiny_q(batch, rt.config.model)
    with pytest.warns(UncalibratedScaleWarning):
        rt.backend.store_kv(0, batch.out_cache_loc, k_nope, k_rope)
    with pytest.raises(ShapeError, match=r"loc: expected dtype"):
        rt.backend.store_kv(0, batch.out_cache_loc.float(), k_nope, k_rope)


def test_batch_build_refuses_bool_slots() -> None:
    """Hazard: a bool mask passed as `out_cache_loc` (a common slip: `loc = free_mask[...]`)
    was cast to int64 slots 0 / 1, silently: every new token's KV went to slot 0 or slot 1,
    and at page size 1 slot 1 is a real request's row."""

    with pytest.raises(TypeError, match=r"integer slots"):
        ForwardBatch.build(
            ForwardMode.EXTEND, [1, 2], [0, 0], [1, 1], torch.tensor([True, False]), "cpu"
        )
    ForwardBatch.build(ForwardMode.EXTEND, [1, 2], [0, 0], [1, 1], torch.tensor([5, 6]), "cpu")


def test_batch_positions_are_prefix_to_seq_len_minus_one() -> None:
    """Hazard: `positions` feed RoPE (and the sparse indexer counts a token's visible keys
    from them): new token i of a request with prefix p sits at position p + i. Shifted by
    one, every rotary embedding was off by one position, silently (attention over the
    stored rows still ran)."""

    b = ForwardBatch.build(
        ForwardMode.EXTEND, [1, 2, 3], [0, 5, 2], [3, 1, 0], torch.arange(4), "cpu"
    )
    assert b.positions.tolist() == [0, 1, 2, 5]
    assert b.positions.dtype == torch.int64
    d = ForwardBatch.build(ForwardMode.DECODE, [1, 2], [7, 0], [1, 1], torch.arange(2), "cpu")
    assert d.positions.tolist() == [7, 0]


@pytest.mark.parametrize("draft", [2, 3])
def test_decode_batch_with_a_draft_count_above_one_is_refused(draft: int) -> None:
    """Hazard: `q_len` is max(num_draft_tokens, 1), what decode kernels and graph runners
    size from; a DECODE batch carrying num_draft_tokens 2 (a verify field left set) had
    q_len 2 while each request has one new token: read as two tokens a request."""

    b = ForwardBatch.build(ForwardMode.DECODE, [1, 2], [3, 4], [1, 1], torch.arange(2), "cpu")
    b.check(torch.device("cpu"))
    bad = dataclasses.replace(b, num_draft_tokens=draft)
    with pytest.raises(ShapeError, match=r"num_draft_tokens"):
        bad.check(torch.device("cpu"))


@pytest.mark.parametrize("backend", _backends_here())
@pytest.mark.parametrize("bad", [-1, 1], ids=["negative", "past-the-table"])
def test_a_batch_without_cpu_rows_is_held_to_the_tables_width(backend: str, bad: int) -> None:
    """A batch without CPU rows (SGLang's, a graph runner's) is not checked against the rows'
    stored lengths; a seq_len past the request table's width read the next row's slots
    (triton, silently) or raised an IndexError inside the torch backend's gather."""
    rt, batch = _tiny_case(backend)
    width = rt.req_pool.max_context_len
    seq = torch.tensor([5, -1 if bad < 0 else width + 1], dtype=torch.int32)
    unchecked = dataclasses.replace(
        batch,
        seq_lens=seq.clone(),
        seq_lens_cpu=seq,
        extend_prefix_lens=seq - 1,
        extend_prefix_lens_cpu=seq - 1,
        req_pool_indices_cpu=None,
    )
    want = rf"seq_lens_cpu: every length must be in 0\.\.{width} .*got \[5, {int(seq[1])}\]"
    with pytest.raises(ShapeError, match=want):
        rt.backend.init_forward_metadata(unchecked)
    at_width = torch.tensor([5, width], dtype=torch.int32)  # the table's last column is fine
    ok = dataclasses.replace(unchecked, seq_lens_cpu=at_width, seq_lens=at_width.clone())
    rt.req_pool.check_batch(ok)


def test_ragged_layout_refuses_negative_or_fractional_lengths() -> None:
    """A negative length stepped the indptr back (a request read another's rows, or none),
    and a float one was truncated by the int32 tensor, silently."""
    with pytest.raises(ValueError, match=r"must be >= 0, got \[3, -2\] / \[3, 2\]"):
        RaggedLayout.from_lens([3, -2], [3, 2], "cpu")
    with pytest.raises(ValueError, match=r"must be >= 0, got \[1\] / \[-1\]"):
        RaggedLayout.from_lens([1], [-1], "cpu")  # the bound itself: -1 is refused
    with pytest.raises(TypeError, match=r"kv_lens must be integers, got \[3, 2\.5\]"):
        RaggedLayout.from_lens([3, 2], [3, 2.5], "cpu")
    assert RaggedLayout.from_lens([3, 0], [3, 2], "cpu").num_q == 3
