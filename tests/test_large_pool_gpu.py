"""Pools past the int32 marks on a GPU (skipped without CUDA): every kernel that turns a slot
into an address, reading and writing rows past 2^31 bytes, past 2^31 elements and past 2^32
elements of its buffer (where an int32 `slot * row_elems` would wrap back INTO the buffer, onto
other random rows, so a missing `.to(int64)` is a silently wrong answer this test sees; rows
between 2^31 and 2^32 elements would wrap below the buffer: an illegal address, also a fail).
Whole buffers are random, so any row a wrapped offset hits holds other data. Compared with
torch maths on the same rows (out and LSE). Peak GPU memory ~27 GB (the module's 8.75 GB bf16
pool plus one test's buffers, each freed after it); H200, about a minute with compiles.
Run on an H100 / H200:

    pytest -q tests/test_large_pool_gpu.py
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

pytestmark = pytest.mark.gpu
L, R, D, PAGE = 512, 64, 576, 64
SM = 576**-0.5
E31, E32 = 2**31, 2**32


def _cuda() -> torch.device:
    return torch.device("cuda")


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _fill(buf: torch.Tensor, gen: torch.Generator, top: int = 256) -> torch.Tensor:
    """Random contents in chunks (bf16 / fp16 / fp32 normal; bytes uniform below `top`)."""
    flat = buf.view(-1) if buf.is_contiguous() else buf
    step = 1 << 27
    for i in range(0, flat.numel(), step):
        part = flat[i : i + step]
        if part.is_floating_point() and part.element_size() >= 2:
            part.normal_(generator=gen)
        else:
            part.view(torch.uint8).random_(0, top, generator=gen)
    return buf


def _pages(row_elems: int, row_bytes: int, slots: int, n: int) -> list[torch.Tensor]:
    """Page ids (int64) enough for n keys from the first page past 2^31 bytes, past 2^31
    elements, past 2^32 elements of a buffer of `slots` rows, and the last pages."""
    need = -(-n // PAGE)
    firsts = [E31 // row_bytes, E31 // row_elems, E32 // row_elems, slots]
    # distinct: byte rows (row_elems == row_bytes) have one 2^31 mark, and a slot twice in
    # one store is two tokens racing for a row
    starts = sorted({min(f // PAGE + 1, slots // PAGE - need) for f in firsts})
    assert starts[-2] * PAGE * row_elems >= E32, "buffer too small for the 2^32 mark"
    return [torch.arange(p, p + need) for p in starts]


@pytest.fixture(scope="module")
def pool() -> Iterator[torch.Tensor]:
    """One bf16 latent layer of 7.6M rows (8.75 GB, 4.38e9 elements), random."""
    slots = 7_600_000 // PAGE * PAGE
    kv = torch.empty(slots, D, dtype=torch.bfloat16, device=_cuda())
    assert kv.numel() > E32
    yield _fill(kv, torch.Generator(device="cuda").manual_seed(71))
    del kv
    _free()


def _ref(qn: torch.Tensor, qr: torch.Tensor, rows: torch.Tensor, scale: float = SM):
    """[H, L], [H, R] queries over rows [N, L + R] -> (out [H, L], lse [H]) in fp32."""
    k = rows.float()
    s = (qn.float() @ k[:, :L].T + qr.float() @ k[:, L:].T) * scale
    return torch.softmax(s, -1) @ k[:, :L], torch.logsumexp(s, -1)


def _close(out, lse, want_out, want_lse, what: str) -> None:
    torch.testing.assert_close(out.float(), want_out, rtol=2e-2, atol=2e-2, msg=what)
    torch.testing.assert_close(lse.float(), want_lse, rtol=1e-2, atol=1e-2, msg=what)


def _decode(kv: torch.Tensor, h: int, lens: list[int], splits: int, scale: float = 1.0, **kw):
    """One decode step of len(lens) requests whose pages lie past each mark in turn."""
    from mla_backends.kernels.mla_attention import mla_attention

    dev, b = kv.device, len(lens)
    groups = _pages(D, D * kv.element_size(), kv.shape[0], max(lens) * b)
    per = -(-max(lens) // PAGE)
    table = torch.stack(
        [groups[i % len(groups)][(i // len(groups)) * per :][:per] for i in range(b)]
    )
    assert table.shape == (b, per), "not enough pages past a mark"
    g = torch.Generator(device="cuda").manual_seed(b * h)
    qn = torch.randn(b, h, L, generator=g, device=dev).to(torch.bfloat16)
    qr = torch.randn(b, h, R, generator=g, device=dev).to(torch.bfloat16)
    out = torch.empty(b, h, L, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(b, h, dtype=torch.float32, device=dev)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    qo = torch.arange(b + 1, dtype=torch.int32, device=dev)
    mla_attention(qn, qr, kv, table.int().to(dev), qo, seq, PAGE, SM, scale, 1, splits, out,
                  lse, **kw)  # fmt: skip
    for i in range(b):
        slots = (table[i][:, None] * PAGE + torch.arange(PAGE)).flatten()[: lens[i]].to(dev)
        want_out, want_lse = _ref(qn[i], qr[i], kv[slots].float() * scale)
        _close(out[i], lse[i], want_out, want_lse, f"request {i}, pages {table[i, 0]}")


ROUTES = {  # (heads, mla_attention options): the routes the triton backend takes
    "gluon64_h16": (16, dict(gluon=True, block_m=64)),  # the lockstep kernel (< 64 heads)
    "gluon64_h64": (64, dict(gluon=True, block_m=64)),  # the seesaw kernel (>= 64 heads)
    "gluon_h128": (128, dict(gluon=True, block_m=64)),
    "narrow_h16": (16, dict(gluon=True, block_m=16)),
    "narrow_h32": (32, dict(gluon=True, block_m=32)),
    "tldot_tma_h16": (16, dict(block_m=16, tma=True)),
    "tldot_gather_h16": (16, dict(block_m=16, tma=False)),
}


@pytest.mark.sm90
@pytest.mark.parametrize("route", list(ROUTES))
def test_dense_decode_past_int32_marks(pool: torch.Tensor, route: str) -> None:
    """Decode over pages past each mark (TMA tiles, the partial tail's gathered rows): ragged
    lengths so both the whole tiles and the tail are read; one split and eight."""
    from mla_backends.kernels.mla_attention import gluon_error

    h, kw = ROUTES[route]
    for splits in (1, 8):
        _decode(pool, h, [64 * 3 + 17, 64 * 2, 5, 64 * 4 + 63], splits, **kw)
    if kw.get("gluon"):
        assert gluon_error() is None, f"the Gluon route fell back: {gluon_error()}"


def test_split_partials_past_2e31_elements(pool: torch.Tensor) -> None:
    """Split partials [T * H * splits, 512] fp32 past 2^31 elements (520 tokens, H 128,
    64 splits: 2.2e9 elements, 8.7 GB) and their merge."""
    from mla_backends.kernels.mla_attention import gluon_usable

    gluon = gluon_usable(torch.bfloat16, pool, PAGE, L)
    assert 520 * 128 * 64 * L > E31
    _decode(pool, 128, [37 + (i * 13) % 150 for i in range(520)], 64, gluon=gluon, block_m=64)


def test_fp8_pool_decode_past_2e32_elements() -> None:
    """An e4m3 latent pool (per-layer scale) of 7.5M rows (4.3 GB, past 2^32 elements):
    the tl.dot kernel (TMA where it runs, and gathers)."""
    slots = 7_500_000 // PAGE * PAGE
    g = torch.Generator(device="cuda").manual_seed(8)
    kv = torch.empty(slots, D, dtype=torch.uint8, device=_cuda())
    kv = _fill(kv, g, top=0x40).view(torch.float8_e4m3fn)  # codes of [0, 1.875], no NaN
    assert kv.numel() > E32
    for tma in (True, False):
        _decode(kv, 16, [64 * 3 + 17, 64, 9], 2, scale=0.25, block_m=16, tma=tma)
    del kv
    _free()


def test_store_kernels_past_int32_marks(pool: torch.Tensor) -> None:
    """The fused latent store (bf16 pool, then an e4m3 one) and the FP8-row store (656-byte
    rows, past 2^32 e4m3 / 2^31 bf16 elements): each row lands at its slot, no other row
    (the wrap targets) changes."""
    from mla_backends.kernels.store import store_fp8_rows, store_latent_rows
    from mla_backends.sparse.fp8_row import Fp8RowFormat, pack_rows

    dev, n = _cuda(), 96
    g = torch.Generator(device="cuda").manual_seed(5)

    def slots_of(rows: torch.Tensor, row_elems: int, row_bytes: int) -> torch.Tensor:
        pages = torch.cat([p[:2] for p in _pages(row_elems, row_bytes, rows.shape[0], PAGE)])
        s = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()
        return s[torch.randperm(s.numel())[:n]].to(dev)

    def wrap_targets(s: torch.Tensor, row_elems: int, rows: int) -> torch.Tensor:
        w = ((s * row_elems + E31) % E32 - E31) // row_elems  # an int32 offset's row
        return w[(w != s) & (w >= 0) & (w < rows)]  # w == s: an offset below 2^31

    kn = torch.randn(n, L, generator=g, device=dev).bfloat16()
    kr = torch.randn(n, R, generator=g, device=dev).bfloat16()
    one = torch.ones((), device=dev)
    s = slots_of(pool, D, 2 * D)
    tw = wrap_targets(s, D, pool.shape[0])
    before = pool[tw].clone()
    store_latent_rows(pool, one, s.int(), kn, kr, False)
    assert torch.equal(pool[s, :L], kn) and torch.equal(pool[s, L:], kr)
    assert torch.equal(pool[tw], before)

    fmt = Fp8RowFormat()
    rows = _fill(torch.empty(6_600_000, fmt.row_bytes, dtype=torch.uint8, device=dev), g)
    assert rows.numel() > E32
    s = slots_of(rows, fmt.row_bytes, fmt.row_bytes)
    tw = wrap_targets(s, fmt.row_bytes, rows.shape[0])
    before = rows[tw].clone()
    store_fp8_rows(rows, s, kn, kr, fmt)
    assert torch.equal(rows[s], pack_rows(fmt, kn, kr))
    assert torch.equal(rows[tw], before)
    del rows
    _free()


def _sparse_case(kv_rows: int, row_elems: int, row_bytes: int, t: int, k: int):
    """Index rows [t, k] int32: slots past each mark, shuffled, a few -1."""
    pages = torch.cat(_pages(row_elems, row_bytes, kv_rows, k))
    s = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()
    idx = torch.stack([s[torch.randperm(s.numel())[:k]] for _ in range(t)]).int()
    idx[:, ::7] = -1
    return idx.to(_cuda())


@pytest.mark.parametrize("gluon", [0, 1], ids=["tldot", "gluon"])
def test_sparse_bf16_past_int32_marks(pool: torch.Tensor, gluon: int) -> None:
    """Sparse attention (tl.dot kernel; the Gluon kernel on an SM90) over indices past the
    marks of the bf16 pool, H 64, one split and four."""
    from mla_backends.kernels.mla_attention import gluon_error
    from mla_backends.sparse.triton_kernel import attend, gluon_kernel_for

    t, h, k = 3, 64, 512
    idx = _sparse_case(pool.shape[0], D, 2 * D, t, k)
    g = torch.Generator(device="cuda").manual_seed(11)
    qn = torch.randn(t, h, L, generator=g, device="cuda").bfloat16()
    qr = torch.randn(t, h, R, generator=g, device="cuda").bfloat16()
    if gluon and gluon_kernel_for(qn, qr, pool, None) is None:
        pytest.skip("the Gluon sparse kernel needs an SM90")
    for splits in (1, 4):
        launch = dict(splits=splits, gluon=gluon, block_m=64, block_n=64, num_warps=8)
        out, lse = attend(qn, qr, pool, idx, SM, 1.0, launch)
        for i in range(t):
            sel = idx[i][idx[i] >= 0].long()
            _close(out[i], lse[i], *_ref(qn[i], qr[i], pool[sel]), f"token {i}")
    if gluon:
        assert gluon_error() is None, gluon_error()


@pytest.mark.parametrize("gluon", [0, 1], ids=["tldot", "gluon"])
def test_sparse_fp8_rows_past_int32_marks(gluon: int) -> None:
    """FP8 rows (656 bytes: e4m3 codes, fp32 scales, bf16 rope) of 6.6M slots (4.3 GB, past
    2^32 e4m3 elements): rows stored by the kernel, read by the sparse kernels."""
    from mla_backends.kernels.mla_attention import gluon_error
    from mla_backends.kernels.store import store_fp8_rows
    from mla_backends.sparse.fp8_row import Fp8RowFormat, dequant_rows
    from mla_backends.sparse.triton_kernel import attend, gluon_kernel_for

    fmt, dev, t, h, k = Fp8RowFormat(), _cuda(), 2, 64, 384
    g = torch.Generator(device="cuda").manual_seed(12)
    rows = _fill(torch.empty(6_600_000, fmt.row_bytes, dtype=torch.uint8, device=dev), g)
    idx = _sparse_case(rows.shape[0], fmt.row_bytes, fmt.row_bytes, t, k)
    used = torch.unique(idx[idx >= 0]).long()
    kn = torch.randn(used.numel(), L, generator=g, device=dev).bfloat16()
    kr = torch.randn(used.numel(), R, generator=g, device=dev).bfloat16()
    store_fp8_rows(rows, used, kn, kr, fmt)  # real rows where read; random bytes elsewhere
    qn = torch.randn(t, h, L, generator=g, device=dev).bfloat16()
    qr = torch.randn(t, h, R, generator=g, device=dev).bfloat16()
    if gluon and gluon_kernel_for(qn, qr, rows, fmt) is None:
        pytest.skip("the Gluon FP8-row kernel needs an SM90")
    launch = dict(splits=2, gluon=gluon, block_m=64, block_n=64, num_warps=8)
    out, lse = attend(qn, qr, rows, idx, SM, 1.0, launch, fmt)
    for i in range(t):
        sel = idx[i][idx[i] >= 0].long()
        _close(out[i], lse[i], *_ref(qn[i], qr[i], dequant_rows(fmt, rows[sel])), f"token {i}")
    if gluon:
        assert gluon_error() is None, gluon_error()
    del rows
    _free()


@pytest.mark.parametrize("kernel", ["triton", "gluon"])
def test_indexer_past_int32_marks(kernel: str) -> None:
    """The index-K store and logits over 32.6M slots (132 bytes each: 4.3 GB, past 2^32
    bytes): keys stored past 2^31 and 2^32 bytes, logits against the torch maths; then the
    request table's own mark: int32 request rows x a 1M-wide table (row 4096: 2^32
    elements, where an int32 product reads row 0's slots)."""
    from mla_backends.sparse import indexer_gluon as ig
    from mla_backends.sparse.index_k import IndexerDims, IndexKCache, logits_reference
    from mla_backends.sparse.indexer_kernels import index_logits, prepare_q_fused, store_index_k

    dev, t, n = _cuda(), 4, 700
    dims = IndexerDims()
    g = torch.Generator(device="cuda").manual_seed(13)
    q = torch.randn(t, 64, 128, generator=g, device=dev).bfloat16()
    w = torch.randn(t, 64, generator=g, device=dev)
    ang = torch.rand(t, 32, generator=g, device=dev) * 6
    qp, wp = prepare_q_fused(dims, q, w, ang.cos().bfloat16(), ang.sin().bfloat16())
    if kernel == "gluon" and not ig.usable(IndexKCache(1, 64, 128, True, dev), qp):
        pytest.skip("the Gluon logits kernel needs an SM90")

    def check(cache: IndexKCache, r2t: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor):
        vis = torch.full((t,), n, dtype=torch.int32, device=dev)
        got = index_logits(cache, 0, qp, wp, r2t, rows, vis, n, kernel=kernel)
        codes, scale = cache.read(0, slots)
        want = logits_reference(qp, wp, codes[None].expand(t, -1, -1), scale[None].expand(t, -1))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max())

    cache = IndexKCache(1, 32_600_000, 128, True, dev)
    _fill(cache.buffers[0], g)
    assert cache.buffers[0].numel() > E32
    row_bytes = 132
    pages = torch.cat([p[:4] for p in _pages(row_bytes, row_bytes, 32_600_000, 4 * PAGE)])
    slots = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten()
    slots = slots[torch.randperm(slots.numel())[:n]].to(dev)
    k = torch.randn(n, 128, generator=g, device=dev).bfloat16()
    ang_k = torch.rand(n, 32, generator=g, device=dev) * 6
    store_index_k(cache, 0, k, ang_k.cos().bfloat16(), ang_k.sin().bfloat16(), slots)
    r2t = torch.zeros(3, 1024, dtype=torch.int32, device=dev)
    r2t[2, :n] = slots.int()
    check(cache, r2t, torch.full((t,), 2, device=dev), slots)
    del cache
    _free()

    small = IndexKCache(1, 4096, 128, True, dev)
    _fill(small.buffers[0], g)
    slots = torch.randperm(4000, device=dev)[:n] + 1
    store_index_k(small, 0, k, ang_k.cos().bfloat16(), ang_k.sin().bfloat16(), slots)
    big = torch.empty(4097, 1 << 20, dtype=torch.int32, device=dev)  # 17.2 GB, 2 rows written
    big[0, :n] = (slots + 37) % 4000 + 1  # row 0: other slots
    big[4096, :n] = slots.int()
    for dtype in (torch.int64, torch.int32):  # int64: the Indexer's rows; int32: the kernels'
        check(small, big, torch.full((t,), 4096, dtype=dtype, device=dev), slots)
    del big
    _free()


def test_mha_prefill_past_2e31_elements() -> None:
    """MHA prefill over q / k / v views whose token stride puts the later tokens past 2^31
    elements (one 8.6 GB buffer holding all three), causal, out and LSE."""
    from mla_backends.kernels.mha_prefill import mha_prefill

    dev, h, tq, stride = _cuda(), 16, 256, (1 << 24) + 1024
    buf = torch.empty(tq * stride, dtype=torch.bfloat16, device=dev)
    assert buf.numel() > E32 and (tq // 2) * stride >= E31
    q, k, v = (
        buf.as_strided((tq, h, width), (stride, width, 1), off)
        for off, width in ((0, 192), (h * 192, 192), (2 * h * 192, 128))
    )
    g = torch.Generator(device="cuda").manual_seed(14)
    for x in (q, k, v):
        x.copy_(torch.randn(x.shape, generator=g, device=dev))
    out = torch.empty(tq, h, 128, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(tq, h, dtype=torch.float32, device=dev)
    indptr = torch.tensor([0, 100, tq], dtype=torch.int32, device=dev)
    mha_prefill(q, k, v, indptr, indptr, 156, 192**-0.5, True, out, lse)
    for a, b in ((0, 100), (100, tq)):
        qf, kf, vf = (x[a:b].float().transpose(0, 1) for x in (q, k, v))
        s = qf @ kf.transpose(1, 2) * 192**-0.5
        s = s.masked_fill(torch.ones(b - a, b - a, device=dev).triu(1).bool(), float("-inf"))
        want_out = (torch.softmax(s, -1) @ vf).transpose(0, 1)
        _close(out[a:b], lse[a:b], want_out, torch.logsumexp(s, -1).T, f"request {a}:{b}")
    del buf
    _free()
