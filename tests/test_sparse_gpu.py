"""DSA on a GPU (skipped without CUDA, SM90 or the kernel packages): every sparse backend
against the fp64 sparse reference at DeepSeek dims, the indexer kernels against the torch
maths, CUDA-graph capture / replay (no host sync) against eager, and a whole V3.2 model with
captured decode graphs. Run on an H100 / H200:

    pytest -q tests/test_sparse_gpu.py
"""

from __future__ import annotations

import contextlib
import importlib.util
import random
from collections.abc import Iterator, Sequence

import pytest
import torch

from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.config import MLADims
from mla_backends.graph_runner import CudaGraphRunner, InputSpec
from mla_backends.sparse.indexer import IndexerDims
from mla_backends.sparse.testing import SparseCase, kernel_cases, run

pytestmark = pytest.mark.gpu
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _has(pkg: str) -> bool:
    return importlib.util.find_spec(pkg) is not None


def _need(backend: str) -> None:
    if backend == "flashmla" and not (SM90 and _has("sgl_kernel")):
        pytest.skip("flashmla sparse needs SM90 and sglang-kernel 0.4.3")
    if backend == "flashinfer_mla" and not (SM90 and _has("flashinfer")):
        pytest.skip("flashinfer_mla sparse needs SM90 and flashinfer-python 0.7.2.post1")


def _dims(h: int) -> MLADims:
    return MLADims(h, 512, 64, 128, 128, 40.0, 1.0)


TOPK = 2048
KV_LENS = (1, 100, 2047, 2048, 2049, 5000)
MODES = {"decode": (ForwardMode.DECODE, 1), "verify": (ForwardMode.TARGET_VERIFY, 3)}
MODES["extend"] = (ForwardMode.EXTEND, 5)
POOLS = {
    "triton": ("bfloat16", "fp8", "fp8_row"),
    "flashmla": ("bfloat16", "fp8_row"),
    "flashinfer_mla": ("bfloat16", "fp8"),
}


def _cases() -> list[SparseCase]:
    return kernel_cases(POOLS, MODES, KV_LENS, TOPK)


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.id)
def test_sparse_backend_matches_reference(case: SparseCase) -> None:
    _need(case.backend)
    _, _, detail = run(case, "cuda")
    assert not detail, detail


@pytest.mark.parametrize("mode", ["decode", "extend"])
@pytest.mark.parametrize("act", ["bfloat16", "float32"])
def test_triton_sparse_backend_at_tiny_dims(mode: str, act: str) -> None:
    """The `triton` sparse kernel at the tiny random V3.2's dims (`run --random tiny-v32`:
    latent 32, rope 16, 4 heads, top-k 8, page 16) against the fp64 reference, poisoned pool,
    dropped entries and an empty row: the whole-model run in bf16 disagrees with its fp64
    reference (BENCHMARKS, seventh session), and this rules the kernel in or out."""
    fm, q = MODES[mode]
    dims = MLADims(4, 32, 16, 16, 16)
    case = SparseCase(
        "triton", act, act, fm, q, (1, 5, 14, 25, 40), 8, 16, dims, drop=0.2, empty_row=True
    )
    _, _, detail = run(case, "cuda")
    assert not detail, detail


PATHS = ["launches", "fused", "fused_wide"]
PATHS += [f"{p}_counted" for p in PATHS]


def _topk(logits, k, r2t, rows, vis=None, path="auto"):  # type: ignore[no-untyped-def]
    """`topk_slots` on `path`, where "fused" is the one launch on counters of COUNTS (8-bit
    digits) and "fused_wide" the one launch on wide counters (its 16-bit middle digit);
    "..._counted": the same told `counted`, its counters holding the first counts a logits
    kernel adds (`add_first_counts`, their torch form)."""
    from mla_backends.sparse.topk_kernel import add_first_counts, new_counts, topk_slots

    base = path.removesuffix("_counted")
    counts = new_counts(logits.shape[0], logits.device, wide=base == "fused_wide")
    if path != base:
        add_first_counts(logits, counts, vis)
    return topk_slots(
        logits, k, r2t, rows, vis, base.removesuffix("_wide"), counts, counted=path != base
    )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("with_visible", [False, True], ids=["masked", "visible"])
@pytest.mark.parametrize("width", [1500, 16384, 40000, 131072])
def test_topk_slots_kernel_matches_torch_topk(width: int, with_visible: bool, path: str) -> None:
    """The radix-select top-k on the GPU, both paths (six launches; one launch whose programs
    wait for each other between passes, blocks of 2048-8192 keys): the same slot sets as
    torch.topk + the slot mapping on distinct logits (no ties), rows with more and fewer
    visible keys than top-k."""
    from mla_backends.sparse.indexer import positions_to_slots, select_topk

    g = torch.Generator(device="cuda").manual_seed(width)
    t, k = 6, 2048
    logits = torch.stack(
        [torch.randperm(width, generator=g, device="cuda").float() - width / 2 for _ in range(t)]
    )
    vis = torch.tensor([width, 1, k - 1, k, k + 1, width // 3], device="cuda")
    logits = logits.masked_fill(
        torch.arange(width, device="cuda")[None] >= vis[:, None], -torch.inf
    )
    r2t = torch.randint(0, 1 << 30, (8, width), generator=g, device="cuda", dtype=torch.int32)
    rows = torch.tensor([5, 0, 7, 1, 2, 3], device="cuda")
    want = positions_to_slots(select_topk(logits, k), r2t, rows)
    if with_visible:  # past visible: large garbage, which only `visible` keeps out
        limit = vis.clamp(max=width).to(torch.int32)
        past = torch.arange(width, device="cuda")[None] >= limit[:, None]
        got = _topk(logits.masked_fill(past, 1e6), k, r2t, rows, limit, path=path)
    else:
        got = _topk(logits, k, r2t, rows, path=path)
    for i in range(t):
        a, b = got[i].tolist(), want[i].tolist()
        assert set(a) - {-1} == set(b) - {-1} and a.count(-1) == b.count(-1), i


def test_topk_slots_launches_keep_one_program_rows_in_order() -> None:
    """Rows of at most one program's keys (prefill rows up to 2048 keys) come out of the
    launches in the same order on every call, ties included: the model's attention over
    them then rounds the same way run to run (scattering each key by its own atomic
    reordered them, and the V3.2 graph test's eager / graph gap grew past its bound)."""
    from mla_backends.sparse.topk_kernel import topk_slots

    g = torch.Generator(device="cuda").manual_seed(5)
    t, width, k = 64, 2048, 128
    logits = torch.randn(t, width, generator=g, device="cuda")
    logits[::4] = logits[::4].round()  # many ties at the threshold
    r2t = torch.randperm(width, generator=g, device="cuda").to(torch.int32).view(1, width)
    rows = torch.zeros(t, dtype=torch.int64, device="cuda")
    first = topk_slots(logits, k, r2t, rows, path="launches")
    for _ in range(5):
        assert torch.equal(topk_slots(logits, k, r2t, rows, path="launches"), first)


@pytest.mark.parametrize("path", PATHS)
def test_topk_slots_kernel_takes_exactly_k_with_ties_gpu(path: str) -> None:
    """Ties at the threshold over many programs: exactly k distinct slots, all at or above the
    k-th value; repeated calls (fresh counters each) give the same counts; the one launch
    takes the first tied keys in row order (32 programs a row here), the launches any."""

    k, width = 2048, 65536
    logits = torch.ones(3, width, device="cuda")
    logits[0, ::7] = 2.0  # 9363 twos: 2048 of them taken
    logits[2, 5000:] = -torch.inf  # 5000 visible, all ones: every one taken
    r2t = torch.arange(width, dtype=torch.int32, device="cuda").view(1, width).repeat(3, 1)
    rows = torch.tensor([0, 1, 2], device="cuda")
    for _ in range(3):
        got = _topk(logits, k, r2t, rows, path=path).cpu()
        assert len(set(got[0].tolist())) == k and (got[0] % 7 == 0).all()
        assert len(set(got[1].tolist())) == k and (got[1] >= 0).all()
        assert len(set(got[2].tolist())) == k and (got[2] >= 0).all() and (got[2] < 5000).all()
        if not path.startswith("launches"):  # slots are positions here
            assert torch.equal(got[0].sort().values, torch.arange(0, 7 * k, 7, dtype=torch.int32))
            assert torch.equal(got[1].sort().values, torch.arange(k, dtype=torch.int32))
            assert torch.equal(got[2].sort().values, torch.arange(k, dtype=torch.int32))


@pytest.mark.parametrize("path", PATHS)
def test_topk_slots_kernel_stops_after_any_pass(path: str) -> None:
    """Both paths stop once the threshold's bucket holds exactly the keys still needed (the
    one launch skips its later passes, the launches' resolve its later digits): rows built to
    be resolved by the first 8, 16, 24 and all 32 bits of their keys
    (powers of four, powers of two, 1 + i 2^-15, 1 + i 2^-23), and a row with fewer keys than
    k, each the same set as torch.topk (no ties)."""
    from mla_backends.sparse.indexer import positions_to_slots, select_topk

    k, width = 16, 4096
    rows_vals = [
        4.0 ** torch.arange(-30, 30).double(),  # exponents differ in their top 7 bits
        2.0 ** torch.arange(-60, 60).double(),  # pairs share the top 7, the 8th tells
        1 + torch.arange(4096).double() * 2**-15,  # 256 a 16-bit bucket, 1 a 24-bit one
        1 + torch.arange(4096).double() * 2**-23,  # 256 a 24-bit bucket: all four passes
        torch.arange(10).double(),  # fewer than k: every key, after the first pass
    ]
    g = torch.Generator().manual_seed(0)
    logits = torch.full((len(rows_vals), width), -torch.inf)
    for i, v in enumerate(rows_vals):
        logits[i, torch.randperm(width, generator=g)[: len(v)]] = v.float()
    logits = logits.cuda()
    r2t = torch.arange(width, dtype=torch.int32, device="cuda").view(1, width)
    rows = torch.zeros(len(rows_vals), dtype=torch.int64, device="cuda")
    want = positions_to_slots(select_topk(logits, k), r2t, rows)
    got = _topk(logits, k, r2t, rows, path=path)
    for i in range(len(rows_vals)):
        a, b = got[i].tolist(), want[i].tolist()
        assert set(a) - {-1} == set(b) - {-1} and a.count(-1) == b.count(-1), i


def test_topk_slots_auto_takes_one_launch_where_it_fits() -> None:
    """`auto` picks the one-launch path while T x blocks of up to 4096 keys fit one program
    per SM (batch 1 at 128k keys), the launches beyond it; an explicit `fused` that cannot
    fit is refused."""
    from mla_backends.sparse import topk_fused

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    assert topk_fused.block_for(1, 32768, dev) == 512
    assert topk_fused.block_for(1, 131072, dev) == 1024
    b = topk_fused.block_for(16, 32768, dev)  # the smallest block that fits: 4096 on an H100
    assert b is not None and 16 * -(-32768 // b) <= sms < 16 * -(-32768 // (b // 2))
    assert topk_fused.block_for(sms + 1, 2048, dev) is None
    # auto stops at 4096-key blocks: B16 at 64k fits one launch only in 8192-key blocks,
    # where the launches are faster
    assert topk_fused.block_for(16, 65536, dev) == 8192
    assert topk_fused.block_for(16, 65536, dev, topk_fused.AUTO_LARGEST) is None
    from mla_backends.sparse.topk_kernel import topk_slots

    r2t = torch.zeros(1, 8192 * 2, dtype=torch.int32, device=dev)
    logits = torch.randn(sms + 1, 8192 * 2, device=dev)
    rows = torch.zeros(sms + 1, dtype=torch.int64, device=dev)
    with pytest.raises(ValueError, match="do not fit one launch"):
        topk_slots(logits, 64, r2t, rows, path="fused")


def test_indexer_kernels_match_torch_maths_bf16() -> None:
    """bf16 activations, quantised: the fused store's codes within one e4m3 step of the torch
    maths (the Hadamard's fp32 sums differ in order), logits and top-k sets on the same cache."""
    from mla_backends.sparse.indexer import (
        Indexer,
        IndexerMetadata,
        IndexKCache,
        prepare_k,
        prepare_q,
        select_topk,
    )
    from mla_backends.sparse.indexer_kernels import index_logits, prepare_q_fused, store_index_k

    dims = IndexerDims()
    g = torch.Generator(device="cuda").manual_seed(0)
    t = 3000
    k = torch.randn(t, 128, generator=g, device="cuda").bfloat16()
    ang = torch.rand(t, 32, generator=g, device="cuda") * 6
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    cache = IndexKCache(1, 4096, 128, True, "cuda")
    loc = torch.randperm(4000, device="cuda")[:t] + 64
    store_index_k(cache, 0, k, cos, sin, loc)
    got_k, got_s = cache.read(0, loc)
    want_k, want_s = prepare_k(dims, k, cos, sin)
    assert (got_s == want_s).float().mean() >= 0.99
    diff = (got_k.float() * got_s[:, None] - want_k.float() * want_s[:, None]).abs()
    assert (
        diff <= 2**-3 * (want_k.float() * want_s[:, None]).abs() + 2**-9 * want_s[:, None]
    ).all()

    r2t = torch.zeros(2, 4096, dtype=torch.int32, device="cuda")
    r2t[1, :t] = loc.int()
    rows = torch.ones(8, dtype=torch.long, device="cuda")
    vis = torch.tensor([1, 50, 2047, 2048, 2049, 2500, 2999, 3000], device="cuda").int()
    q = torch.randn(8, 64, 128, generator=g, device="cuda").bfloat16()
    w = torch.randn(8, 64, generator=g, device="cuda")
    qp, wp = prepare_q(dims, q, w, cos[:8], sin[:8])
    # the one-launch q preparation: codes within one e4m3 step (fp32 sums in another order)
    fq, fw = prepare_q_fused(dims, q, w, cos[:8], sin[:8])
    q_scale, f_scale = wp / (w * dims.weight_scale), fw / (w * dims.weight_scale)
    assert (torch.isclose(q_scale, f_scale, rtol=1e-6)).float().mean() >= 0.99
    want_q = qp.float() * q_scale[..., None]
    diff = (fq.float() * f_scale[..., None] - want_q).abs()
    assert (diff <= 2**-3 * want_q.abs() + 2**-9 * q_scale[..., None]).all()
    tri = index_logits(cache, 0, qp, wp, r2t, rows, vis, t)
    ref = Indexer(dims, cache, r2t, "torch")
    ref.metadata = IndexerMetadata(rows, vis, t, [(0, 8)])
    want = ref.logits(0, qp, wp, 0, 8)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(tri))
    torch.testing.assert_close(
        tri[fin], want[fin], rtol=1e-5, atol=1e-5 * want[fin].abs().max().item()
    )
    a, b = select_topk(tri, TOPK), select_topk(want, TOPK)
    for i in range(8):
        sa, sb = set(a[i].tolist()) - {-1}, set(b[i].tolist()) - {-1}
        assert len(sa) == min(TOPK, int(vis[i])) and len(sa & sb) >= 0.995 * len(sb)


def _wide_logits_case(vis_list: list[int], width: int, heads: int, seed: int):  # type: ignore[no-untyped-def]
    """Index keys stored for tokens seeing vis_list keys each of a `width`-wide row (token i
    on its own shuffled slots, NaN codes and scales in every other slot), and their prepared
    queries: (cache, q codes, weights, req_to_token, rows, visible counts)."""
    from mla_backends.sparse.indexer import IndexKCache
    from mla_backends.sparse.indexer_kernels import prepare_q_fused, store_index_k

    dims, g = IndexerDims(n_heads=heads), torch.Generator(device="cuda").manual_seed(seed)
    t = len(vis_list)
    cache = IndexKCache(1, 40960 * t, 128, True, "cuda")
    cache.buffers[0].fill_(0x7F)  # NaN codes and scales wherever nothing is stored
    r2t = torch.zeros(t, width, dtype=torch.int32, device="cuda")
    for i, n in enumerate(vis_list):
        loc = torch.randperm(40960, generator=g, device="cuda")[:n] + i * 40960
        r2t[i, :n] = loc.int()
        ang = torch.rand(n, 32, generator=g, device="cuda") * 6
        k = torch.randn(n, 128, generator=g, device="cuda").bfloat16()
        store_index_k(cache, 0, k, ang.cos().bfloat16(), ang.sin().bfloat16(), loc)
    ang = torch.rand(t, 32, generator=g, device="cuda") * 6
    q = torch.randn(t, heads, 128, generator=g, device="cuda").bfloat16()
    qp, wp = prepare_q_fused(dims, q, torch.randn(t, heads, generator=g, device="cuda"),
                             ang.cos().bfloat16(), ang.sin().bfloat16())  # fmt: skip
    rows = torch.arange(t, device="cuda")
    vis = torch.tensor(vis_list, dtype=torch.int32, device="cuda")
    return cache, qp, wp, r2t, rows, vis


@pytest.mark.parametrize(
    "vis_list, path",
    [([40000], "auto"), ([2049, 16384, 9000], "auto"), ([1, 2047, 2049, 9000, 40000], "auto")]
    + [([2049, 16384, 9000], "launches")],
    ids=["b1-wide", "b3-wide", "b5", "b3-launches"],
)
def test_indexer_select_takes_the_topk_of_its_logits(vis_list: list[int], path: str) -> None:
    """`Indexer.select` on the GPU (its q prep zeroing the counters; up to `COUNT_TOKENS`
    tokens the logits counting the keys' first digit and the top-k told `counted`, in one
    launch on wide counters or in the launches; above, neither, on narrow counters) picks the
    slots torch.topk picks from the same logits (`index_logits` uncounted): contexts shorter
    and longer than top-k, one of 40000 keys."""
    from mla_backends.sparse.indexer import (
        Indexer,
        IndexerMetadata,
        positions_to_slots,
        select_topk,
    )
    from mla_backends.sparse.indexer_kernels import index_logits, prepare_q_fused

    width, dims = 40001, IndexerDims()
    cache, _, _, r2t, rows, vis = _wide_logits_case(vis_list, width, 64, 9)
    g = torch.Generator(device="cuda").manual_seed(len(vis_list))
    t = len(vis_list)
    q = torch.randn(t, 64, 128, generator=g, device="cuda").bfloat16()
    w = torch.randn(t, 64, generator=g, device="cuda")
    ang = torch.rand(t, 32, generator=g, device="cuda") * 6
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    ix = Indexer(dims, cache, r2t, "triton", topk_path=path)
    ix.metadata = IndexerMetadata(rows, vis, width, [(0, t)])
    got = ix.select(0, q, w, cos, sin)
    qp, wp = prepare_q_fused(dims, q, w, cos, sin)
    logits = index_logits(cache, 0, qp, wp, r2t, rows, vis, width)
    want = positions_to_slots(select_topk(logits, dims.topk), r2t, rows)
    for i in range(t):
        a, b = got[i].tolist(), want[i].tolist()
        assert set(a) - {-1} == set(b) - {-1} and a.count(-1) == b.count(-1), i


def test_indexer_logits_looping_programs_equal_one_program_a_block() -> None:
    """The logits as a captured graph runs them (a few programs a token looping over its
    visible blocks, `index_logits(loop=True)`, under its register cap) equal one program a
    block bit for bit, over a width far above most tokens' contexts; positions past each
    context come out -inf whatever their table entries point at (NaN-poisoned slots)."""
    from mla_backends.sparse.indexer_kernels import index_logits

    width, vis_list = 40000, [1, 127, 2049, 9000, 40000]
    cache, qp, wp, r2t, rows, vis = _wide_logits_case(vis_list, width, 64, 2)
    want = index_logits(cache, 0, qp, wp, r2t, rows, vis, width, kernel="triton")
    got = index_logits(cache, 0, qp, wp, r2t, rows, vis, width, loop=True, kernel="triton")
    assert torch.equal(got, want)
    assert torch.isfinite(want).sum(1).tolist() == vis_list


@pytest.mark.parametrize("heads, programs", [(64, None), (64, 3), (8, 2)])
def test_gluon_indexer_logits_match_the_triton_kernel(heads: int, programs: int | None) -> None:
    """The Gluon logits kernel (`sparse/indexer_gluon.py`) against the Triton kernel on the
    same keys: the same -inf pattern (keys from a token's visible count on, whatever their
    table entries point at, NaN-poisoned slots among them, over a width far above most
    contexts and not a whole number of tiles, so that the last tile's stores past the row
    are masked), the same values up to summation order; at the default grid, and with few
    programs a token so that each one loops through its cp.async ring many times (partial
    last tiles, empty tiles); the same logits with the keys streamed before the kernel's
    programmatic wait."""
    from mla_backends.sparse import indexer_gluon as ig
    from mla_backends.sparse.indexer import IndexKCache
    from mla_backends.sparse.indexer_kernels import index_logits
    from mla_backends.sparse.topk_kernel import add_first_counts, new_counts

    if not ig.usable(IndexKCache(1, 64, 128, True, "cuda"), torch.empty(1, heads, 128,
                     dtype=torch.float8_e4m3fn, device="cuda")):  # fmt: skip
        pytest.skip("the Gluon logits kernel needs an SM90")
    width, vis_list = 40001, [1, 64, 127, 2049, 9000, 40000]  # 625 tiles and one key
    cache, qp, wp, r2t, rows, vis = _wide_logits_case(vis_list, width, heads, 3)
    want = index_logits(cache, 0, qp, wp, r2t, rows, vis, width, kernel="triton")
    got = ig.index_logits(cache, 0, qp, wp, r2t, rows, vis, width, programs)
    # keys streamed before the programmatic wait (the indexer's call): the launch before it
    # (the one above) released it after its own wait and wrote no keys, slots or counts
    early = ig.index_logits(cache, 0, qp, wp, r2t, rows, vis, width, programs, early_keys=True)
    assert torch.equal(early, got)
    if programs is None:  # what the indexer calls (kernel "auto") takes it on an SM90
        assert torch.equal(index_logits(cache, 0, qp, wp, r2t, rows, vis, width), got)
    assert torch.isfinite(got).sum(1).tolist() == vis_list
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    # counting the keys for the top-k (`counts=`, as the indexer launches it): the same
    # logits, and the counts `add_first_counts` takes from them, narrow and wide counters;
    # the Triton kernel's counting too (what runs where the Gluon route is closed)
    fin = torch.isfinite(want)
    for wide in (False, True):
        counts, ref, tri = (new_counts(len(vis_list), got.device, wide=wide) for _ in range(3))
        args = (cache, 0, qp, wp, r2t, rows, vis, width, programs)
        assert torch.equal(ig.index_logits(*args, early_keys=True, counts=counts), got)
        add_first_counts(got, ref)
        assert torch.equal(counts, ref), wide
        # the Triton kernel's counts are exactly those of the logits the same launch stored;
        # those logits are the uncounted launch's up to summation order (bit for bit with
        # triton 3.6, not with 3.9, which compiles the counting variant's sums another way)
        base = (cache, 0, qp, wp, r2t, rows, vis, width)
        counted = index_logits(*base, kernel="triton", counts=tri)
        assert torch.equal(torch.isfinite(counted), fin)
        _assert_ulps(counted[fin], want[fin])
        ref.zero_()
        add_first_counts(counted, ref)
        assert torch.equal(tri, ref), wide
    _assert_ulps(got[fin], want[fin])


def _assert_ulps(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 sums of the same exact products in another order: within a few fp32 ulps."""
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max())


def _graph_setup(  # type: ignore[no-untyped-def]
    backend: str, pool: str, h: int, seed: int = 0, lengths: Sequence[int] | None = None
):
    """Pools, indexer and sparse backend over requests with random prompts (latent rows and
    index K stored), for the graph tests; `lengths`: one request a prompt of each length
    (else six of random lengths)."""
    from mla_backends.allocator import PagedTokenAllocator
    from mla_backends.pool import MLATokenToKVPool, ReqToTokenPool
    from mla_backends.sparse.base import SparseContext, create_sparse_backend
    from mla_backends.sparse.fp8_row import Fp8RowPool
    from mla_backends.sparse.indexer import Indexer, IndexKCache

    dims, dev = _dims(h), torch.device("cuda")
    rng, gen = random.Random(seed), torch.Generator(device="cuda").manual_seed(seed)
    n_req, max_ctx, ps = len(lengths) if lengths else 6, 4096, 64
    pages = n_req * max_ctx // ps + 1
    if pool == "fp8_row":
        latent = Fp8RowPool(1, pages, ps, 512, 64, dev)
    else:
        kv = torch.float8_e4m3fn if pool == "fp8" else torch.bfloat16
        latent = MLATokenToKVPool(1, pages, ps, 512, 64, kv, dev)
        if pool == "fp8":
            latent.set_scale(0, 0.037)
    req = ReqToTokenPool(n_req, max_ctx, dev)
    order = list(range(1, pages + 1))
    rng.shuffle(order)
    alloc = PagedTokenAllocator(pages, ps, req, order)
    idims = IndexerDims()
    cache = IndexKCache(1, latent.num_slots, 128, True, dev)
    indexer = Indexer(idims, cache, req.req_to_token)
    ctx = SparseContext(dims, latent, req, TOPK, torch.bfloat16)
    sparse = create_sparse_backend(backend, ctx)
    rows = req.alloc(n_req)
    for i, r in enumerate(rows):
        n = lengths[i] if lengths else rng.randint(1, 3500)
        loc = alloc.alloc_extend([r], [n])
        ang = torch.rand(n, 32, generator=gen, device=dev) * 6
        indexer.store(
            0,
            torch.randn(n, 128, generator=gen, device=dev).bfloat16(),
            ang.cos().bfloat16(),
            ang.sin().bfloat16(),
            loc,
        )
        latent.set_mla_kv_buffer(
            0,
            loc,
            torch.randn(n, 512, generator=gen, device=dev).bfloat16(),
            torch.randn(n, 64, generator=gen, device=dev).bfloat16(),
        )
    return indexer, sparse, alloc, rows, gen, rng


INPUTS = {
    "k_idx": InputSpec((128,), torch.bfloat16),
    "q_idx": InputSpec((64, 128), torch.bfloat16),
    "w": InputSpec((64,), torch.float32),
    "cos": InputSpec((32,), torch.bfloat16),
    "sin": InputSpec((32,), torch.bfloat16),
    "k_nope": InputSpec((512,), torch.bfloat16),
    "k_rope": InputSpec((64,), torch.bfloat16),
}


class _Step:
    """indexer store + select + latent store + sparse attention: what a layer runs."""

    def __init__(self, indexer, sparse) -> None:  # type: ignore[no-untyped-def]
        self.indexer, self.sparse = indexer, sparse
        self.name, self.supports_graphs = sparse.name, True
        self.cuda_graph_seq_len_fill_value = 1

    @property
    def metadata(self) -> object:
        """The device buffers a captured graph reads (the runner checks they never move)."""
        ix, sp = self.indexer.metadata, self.sparse.metadata
        return {"rows": ix.rows, "visible": ix.visible, "sparse": sp}

    def check_batch(self, batch: ForwardBatch) -> None:
        self.sparse.ctx.req_to_token_pool.check_batch(batch)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.indexer.init_forward_metadata(batch)
        self.sparse.init_forward_metadata(batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.indexer.init_cuda_graph_state(max_bs, max_num_tokens)
        self.sparse.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self.indexer.init_forward_metadata_capture(batch)
        self.sparse.init_forward_metadata_capture(batch)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        self.indexer.init_forward_metadata_replay(batch)
        self.sparse.init_forward_metadata_replay(batch)

    def forward(self, batch: ForwardBatch, x: dict[str, torch.Tensor]) -> torch.Tensor:
        self.indexer.store(0, x["k_idx"], x["cos"], x["sin"], batch.out_cache_loc)
        slots = self.indexer.select(0, x["q_idx"], x["w"], x["cos"], x["sin"])
        self.sparse.store_kv(0, batch.out_cache_loc, x["k_nope"], x["k_rope"])
        return self.sparse.forward_sparse(0, x["q_nope"], x["q_rope"], slots, batch)


GRAPH_CASES = [("triton", "bfloat16"), ("triton", "fp8_row"), ("flashmla", "bfloat16")]
GRAPH_CASES += [("flashmla", "fp8_row"), ("flashinfer_mla", "bfloat16"), ("flashinfer_mla", "fp8")]


@pytest.mark.parametrize("q_len", [1, 2], ids=["decode", "verify"])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("backend, pool", GRAPH_CASES, ids=[f"{b}-{p}" for b, p in GRAPH_CASES])
def test_graph_replay_equals_eager_without_host_sync(
    backend: str, pool: str, heads: int, q_len: int
) -> None:
    """Indexer + sparse attention captured once per batch size, replayed on changing batches
    (sizes, lengths across topk, page tables), padded; no host sync during replay; each
    replay equals the eager step on the same state."""
    _need(backend)
    indexer, sparse, alloc, rows, gen, rng = _graph_setup(backend, pool, heads)
    step = _Step(indexer, sparse)
    inputs = dict(INPUTS, q_nope=InputSpec((heads, 512), torch.bfloat16))
    inputs["q_rope"] = InputSpec((heads, 64), torch.bfloat16)
    runner = CudaGraphRunner(step, step.forward, inputs, [1, 2, 4], q_len, "cuda")  # type: ignore[arg-type]
    runner.capture()
    mode = ForwardMode.DECODE if q_len == 1 else ForwardMode.TARGET_VERIFY
    for i in range(6):
        n = rng.choice([1, 2, 3, 4])
        rs = rng.sample(rows, n)
        prefix = [alloc.seq_len(r) for r in rs]
        loc = alloc.alloc_extend(rs, [q_len] * n)
        batch = ForwardBatch.build(mode, rs, prefix, [q_len] * n, loc, "cuda")
        x = {
            k: torch.randn(n * q_len, *s.shape, generator=gen, device="cuda").to(s.dtype)
            for k, s in inputs.items()
        }
        step.init_forward_metadata(batch)
        want = step.forward(batch, x).clone()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = runner.replay(batch, x, check_pointers=True).clone()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
        assert err <= 2e-2, f"step {i}: {err}"


@contextlib.contextmanager
def _no_host_sync() -> Iterator[None]:
    """Any synchronizing CUDA call in the block raises (`set_sync_debug_mode("error")`),
    from an idle GPU."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


STEP_CASES = [("triton", "bfloat16"), ("triton", "fp8_row"), ("flashmla", "bfloat16")]
STEP_CASES += [("flashmla", "fp8_row"), ("flashinfer_mla", "bfloat16")]


@pytest.mark.parametrize("q_len", [1, 2], ids=["decode", "verify"])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("backend, pool", STEP_CASES, ids=[f"{b}-{p}" for b, p in STEP_CASES])
def test_eager_dsa_step_does_not_sync(backend: str, pool: str, heads: int, q_len: int) -> None:
    """An eager DSA decode (or verify) step as a V3.2 layer runs it through `DSABackend`: the
    batch's metadata (indexer and sparse backend), the index K store, the indexer (q prep,
    logits, top-k) on its own stream, the latent store and sparse attention, with any host
    sync raising (`set_sync_debug_mode("error")`), after one warm-up step of the same shape.
    Contexts of about 2050 and 3500 keys, past top-k, beside one of 40-odd. The batch is
    built before (its host-to-device copies are the scheduler's). The selection holds
    min(topk, pos + 1) distinct slots of each token's request; out and LSE match the fp64
    reference over it."""
    # widths (longest context) 3498 / 3499 (decode) and 3499 / 3501 (verify): none a multiple
    # of 16, so the measured step's Triton launches specialise as the warm-up's did
    _dsa_step_without_sync(backend, pool, heads, q_len, (3497, 2049, 40), dense=False)


DENSE_STEP_CASES = [(b, p) for b, p in STEP_CASES if p == "fp8_row"]


@pytest.mark.parametrize("q_len", [1, 2], ids=["decode", "verify"])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize(
    "backend, pool", DENSE_STEP_CASES, ids=[f"{b}-{p}" for b, p in DENSE_STEP_CASES]
)
def test_eager_dense_dsa_step_over_fp8_rows_does_not_sync(
    backend: str, pool: str, heads: int, q_len: int
) -> None:
    """The same for a batch the dense/sparse rule sends dense over FP8 rows (every context
    shorter than top-k): no indexer; the sparse backend over every visible key's slot, built
    once per batch by `DSABackend.init_forward_metadata` (`dense_slots`)."""
    _dsa_step_without_sync(backend, pool, heads, q_len, (1500, 301, 40), dense=True)


def _dsa_step_without_sync(
    backend: str, pool: str, heads: int, q_len: int, lengths: tuple[int, ...], dense: bool
) -> None:
    _need(backend)
    from mla_backends.sparse.dsa import DSABackend
    from mla_backends.sparse.reference import sparse_reference
    from mla_backends.testing import TOLERANCES, compare

    indexer, sparse, alloc, rows, gen, _ = _graph_setup(backend, pool, heads, 1, lengths)
    dsa = DSABackend(None, indexer, sparse)
    assert dsa.side is not None  # the indexer on its own stream, as a model runs it
    mode = ForwardMode.DECODE if q_len == 1 else ForwardMode.TARGET_VERIFY
    inputs = dict(INPUTS, q_nope=InputSpec((heads, 512), torch.bfloat16))
    inputs["q_rope"] = InputSpec((heads, 64), torch.bfloat16)

    def new_batch() -> tuple[ForwardBatch, dict[str, torch.Tensor]]:
        prefix = [alloc.seq_len(r) for r in rows]
        loc = alloc.alloc_extend(rows, [q_len] * len(rows))
        batch = ForwardBatch.build(mode, rows, prefix, [q_len] * len(rows), loc, "cuda")
        x = {
            k: torch.randn(batch.num_tokens, *s.shape, generator=gen, device="cuda").to(s.dtype)
            for k, s in inputs.items()
        }
        return batch, x

    def step(batch: ForwardBatch, x: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
        dsa.init_forward_metadata(batch)
        dsa.indexer.store(0, x["k_idx"], x["cos"], x["sin"], batch.out_cache_loc)
        if dsa.use_dense():  # as `models/deepseek_v32.py` takes a dense batch over FP8 rows
            dense_slots = dsa.dense_slots(batch)
            selected = lambda: dense_slots  # noqa: E731
        else:
            selected = dsa.begin_select(0, lambda: (x["q_idx"], x["w"]), x["cos"], x["sin"])
        dsa.store_kv(0, batch.out_cache_loc, x["k_nope"], x["k_rope"])
        slots = selected()
        out, lse = dsa.sparse.forward_sparse(0, x["q_nope"], x["q_rope"], slots, batch, True)
        return out, lse, slots

    step(*new_batch())  # warm-up: compiles, plans, allocator pools
    with _no_host_sync(), pytest.raises(RuntimeError, match="synchronizing"):
        torch.ones(1, device="cuda").item()  # the mode is on: a sync would raise
    batch, x = new_batch()
    with _no_host_sync():
        out, lse, slots = step(batch, x)
    torch.cuda.synchronize()
    assert dsa.use_dense() is dense

    valid = slots >= 0
    r2t, pos = indexer.req_to_token.cpu(), batch.positions.cpu()
    assert valid.sum(1).cpu().tolist() == (pos + 1).clamp(max=TOPK).tolist()
    for t, row in enumerate(torch.tensor(rows).repeat_interleave(q_len).tolist()):
        got = slots[t][valid[t]].cpu()
        assert got.unique().numel() == got.numel(), t
        assert torch.isin(got, r2t[row, : int(pos[t]) + 1]).all(), t
    ref_out, ref_lse = sparse_reference(sparse.pool, 0, x["q_nope"], x["q_rope"], slots,
                                        sparse.scale)  # fmt: skip
    atol, rtol, lse_tol = TOLERANCES["bfloat16"]
    _, bad_out = compare("out", out, ref_out, atol, rtol)
    _, bad_lse = compare("lse", lse, ref_lse, lse_tol, 0.0)
    assert not bad_out and not bad_lse, (bad_out, bad_lse)


@pytest.mark.parametrize(
    "sparse, fp8_rows",
    [("triton", False), ("flashmla", False), ("flashmla", True), ("flashinfer_mla", False)],
)
def test_v32_model_decode_graphs_equal_eager(sparse: str, fp8_rows: bool) -> None:
    """A random bf16 DeepSeek-V3.2 (DeepSeek dims, 16 heads, topk 128) through the engine:
    prompts longer than topk, decode steps through captured whole-model graphs (the indexer
    on its own stream, `DSABackend.begin_select`) against the same steps eager with the
    indexer inline; and eager with the indexer on its stream within the same bound (the same
    kernels on another stream; the top-k's output order, set by atomics, may differ)."""
    _need(sparse)
    from mla_backends.config import Config
    from mla_backends.models.deepseek_v32 import DeepseekV32Config, DeepseekV32ForCausalLM
    from mla_backends.models.engine import Engine
    from mla_backends.runtime import Runtime
    from mla_backends.sparse.dsa import DSABackend

    raw = dict(
        vocab_size=256,
        hidden_size=512,
        intermediate_size=512,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=16,
        q_lora_rank=256,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=2,
        index_topk=128,
    )
    cfg = DeepseekV32Config.from_hf(raw)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = DeepseekV32ForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)

    def engine(overlap: bool = True) -> tuple[Engine, DSABackend]:
        rt = Runtime.build(
            Config(
                model=cfg.attention_dims,
                num_layers=2,
                prefill_backend="triton",
                decode_backend="triton",
                page_size=64,
                kv_dtype="bfloat16",
                dtype="bfloat16",
                num_pages=64,
                max_requests=4,
                max_context_len=1024,
                device="cuda",
            )
        )
        dsa = DSABackend.build(
            rt, cfg.indexer_dims(True), sparse, fp8_rows, overlap_indexer=overlap
        )
        return Engine(model, rt, dsa), dsa

    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (300, 40, 150)]
    # Hazard: equal within 2e-2 only while every decode row's keys fit one program of the
    # one-launch top-k: across programs the slots' order is set by atomics, the attention
    # then sums in another order, and this random model's expert routing turns that into
    # 1-3 % (eighteenth session, BENCHMARKS.md). A change of block sizes fails here first.
    from mla_backends.sparse import topk_fused

    assert max(map(len, prompts)) + 8 <= topk_fused.BLOCKS[0]
    (eager, inline), (graphed, _), (beside, side) = engine(False), engine(), engine()
    assert inline.side is None and side.side is not None
    engines = (eager, graphed, beside)
    rows = [e.new_requests(3) for e in engines]
    for e, r in zip(engines, rows):
        e.extend(r, prompts)
    graphed.enable_graphs([1, 2, 4])
    for i in range(8):
        k = 3 if i % 2 == 0 else 2
        toks = torch.randint(0, 256, (k,), generator=gen).tolist()
        want = eager.decode(rows[0][:k], toks)
        got = graphed.decode(rows[1][:k], toks)
        err = float((got - want).abs().max() / want.abs().max())
        assert err <= 2e-2, f"step {i}: {err}"
        near = beside.decode(rows[2][:k], toks)
        err = float((near - want).abs().max() / want.abs().max())
        assert err <= 2e-2, f"step {i}, indexer on its stream: {err}"


@pytest.mark.sm90
@pytest.mark.parametrize("splits", [1, 4])
def test_gluon_sparse_kernel_matches_the_reference(splits: int) -> None:
    """The Gluon sparse kernel (`sparse/gluon_kernel.py`) against the fp64 sparse reference
    at H128: -1 entries in the middle and at the tail of a list, a token with none, NaN in
    every pool row no list names (a masked gather lane must write zeros, never a stale or
    NaN row)."""
    from mla_backends.sparse import gluon_kernel as gk
    from mla_backends.sparse.reference import sparse_attention
    from mla_backends.testing import TOLERANCES

    gen = torch.Generator().manual_seed(0)
    t, h, slots, k = 4, 128, 8192, TOPK
    pool = torch.full((slots, 576), float("nan"))
    idx = torch.full((t, k), -1, dtype=torch.int32)
    for i, n in enumerate((k, 1500, 0, 700)):
        chosen = torch.randperm(slots, generator=gen)[:n].to(torch.int32)
        idx[i, :n] = chosen
        pool[chosen.long()] = torch.randn(n, 576, generator=gen)
    idx[3, 100:164] = -1  # a whole tile of unused entries inside a list
    q = torch.randn(t, h, 576, generator=gen)
    scale = 576**-0.5
    valid = idx >= 0
    rows = torch.where(valid[..., None], pool[idx.clamp(min=0).long()].double(), 0.0)
    want, want_lse = sparse_attention(q[..., :512], q[..., 512:], rows, valid, scale)
    dev = torch.device("cuda")
    qb, kv = q.bfloat16().to(dev), pool.bfloat16().to(dev)
    out = torch.full((t, h, 512), float("nan"), dtype=torch.bfloat16, device=dev)
    lse = torch.full((t, h), 7.0, device=dev)
    gk.sparse_mla(qb[..., :512], qb[..., 512:], kv, idx.to(dev), scale, splits, out, lse)
    atol, rtol, _ = TOLERANCES["bfloat16"]
    torch.testing.assert_close(out.double().cpu()[[0, 1, 3]], want[[0, 1, 3]], atol=atol, rtol=rtol)
    torch.testing.assert_close(
        lse.double().cpu()[[0, 1, 3]], want_lse[[0, 1, 3]], atol=atol, rtol=rtol
    )
    assert torch.equal(out[2].cpu(), torch.zeros(h, 512, dtype=torch.bfloat16))  # no index
    assert bool((lse[2] == float("-inf")).all())


@pytest.mark.parametrize("tokens, splits", [(2, 32), (4, 32), (2, 64), (3, 8)])
def test_tl_dot_sparse_kernel_merges_its_splits_in_its_launch(
    tokens: int, splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `tl.dot` sparse kernel at H16 merging its own splits (`sparse_mla(sync=)`, what the
    `triton` backend runs at batch 2-4) against the fp64 reference and against the same
    launch with the merge kernel: -1 entries mid-list and at the tail, a token with none (a
    split with no key, and one with nothing at all), NaN in every unnamed pool row; the sync
    counters back at zero after each call; a captured graph replayed with new queries equal to
    eager calls, bit for bit."""
    from mla_backends.sparse import triton_kernel as sk
    from mla_backends.sparse.reference import sparse_attention
    from mla_backends.testing import TOLERANCES

    dev = torch.device("cuda")
    h, slots, k, cfg = 16, 8192, TOPK, dict(block_m=16, block_n=64, num_warps=4, num_stages=2)
    if not sk.merges_here((1, tokens, splits), 16, 512, splits, dev, True):
        pytest.skip("fewer SMs than the launch's programs")
    gen = torch.Generator().manual_seed(tokens * 100 + splits)
    pool = torch.full((slots, 576), float("nan"))
    idx = torch.full((tokens, k), -1, dtype=torch.int32)
    for i, n in enumerate((k, 1500, 0, 700)[:tokens]):
        chosen = torch.randperm(slots, generator=gen)[:n].to(torch.int32)
        idx[i, :n] = chosen
        pool[chosen.long()] = torch.randn(n, 576, generator=gen)
    if tokens == 4:
        idx[3, 100:164] = -1  # a whole key block of unused entries inside a list
    scale = 576**-0.5
    valid = idx >= 0
    rows = torch.where(valid[..., None], pool[idx.clamp(min=0).long()].double(), 0.0)
    kv, ix = pool.bfloat16().to(dev), idx.to(dev)
    sync = torch.zeros(2, dtype=torch.int32, device=dev)

    merge = sk._merge

    def no_merge_kernel(*args: object) -> None:
        raise AssertionError("the merge kernel ran where the launch merges its own splits")

    def call(q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, here: bool) -> None:
        qn, qr = q[..., :512], q[..., 512:]
        monkeypatch.setattr(sk, "_merge", no_merge_kernel if here else merge)
        sk.sparse_mla(qn, qr, kv, ix, scale, 1.0, splits, out, lse, sync=sync if here else None,
                      **cfg)  # fmt: skip
        monkeypatch.setattr(sk, "_merge", merge)

    def new_out() -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.full((tokens, h, 512), float("nan"), dtype=torch.bfloat16, device=dev)
        return out, torch.full((tokens, h), 7.0, device=dev)

    q = torch.randn(tokens, h, 576, generator=gen).bfloat16()
    want, want_lse = sparse_attention(q[..., :512].double(), q[..., 512:].double(), rows, valid,
                                      scale)  # fmt: skip
    (out, lse), (plain, plain_lse) = new_out(), new_out()
    call(q.to(dev), out, lse, True)
    assert sync.tolist() == [0, 0]
    call(q.to(dev), plain, plain_lse, False)
    atol, rtol, _ = TOLERANCES["bfloat16"]
    keep = [i for i in range(tokens) if i != 2]
    torch.testing.assert_close(out.double().cpu()[keep], want[keep], atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double().cpu()[keep], want_lse[keep], atol=atol, rtol=rtol)
    # the merge kernel's sum in another order: the same within a rounding of the output
    torch.testing.assert_close(out, plain, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse, plain_lse, atol=1e-5, rtol=1e-5)
    if tokens > 2:
        assert torch.equal(out[2].cpu(), torch.zeros(h, 512, dtype=torch.bfloat16))  # no index
        assert bool((lse[2] == float("-inf")).all())

    q_static = q.to(dev).clone()
    g_out, g_lse = new_out()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # q_static was written there
    with torch.cuda.stream(stream):
        call(q_static, g_out, g_lse, True)  # warm-up off the default stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            call(q_static, g_out, g_lse, True)
    torch.cuda.synchronize()
    for step in range(3):
        q_new = torch.randn(tokens, h, 576, generator=gen).bfloat16().to(dev)
        q_static.copy_(q_new)
        graph.replay()
        e_out, e_lse = new_out()
        call(q_new, e_out, e_lse, True)
        torch.cuda.synchronize()
        assert torch.equal(g_out, e_out) and torch.equal(g_lse, e_lse), f"replay {step}"
        assert sync.tolist() == [0, 0], f"replay {step}"


@pytest.mark.sm90
@pytest.mark.parametrize("splits", [1, 4])
def test_gluon_fp8row_kernel_matches_the_reference(splits: int) -> None:
    """The FP8-row Gluon kernel (`sparse/gluon_fp8row.py`) against the fp64 sparse reference
    over the dequantised rows (`dequant_rows`, the one scale contract) at H128: -1 entries
    mid-list and at the tail, a token with none, every unnamed row 0xFF (NaN codes, scales
    and rope), so a masked lane or scale that read the pool would show."""
    from mla_backends.sparse import gluon_fp8row as gf
    from mla_backends.sparse.fp8_row import Fp8RowFormat, dequant_rows, pack_rows
    from mla_backends.sparse.reference import sparse_attention
    from mla_backends.testing import TOLERANCES

    gen = torch.Generator().manual_seed(1)
    t, h, slots, k, fmt = 4, 128, 8192, TOPK, Fp8RowFormat()
    rows = torch.full((slots, fmt.row_bytes), 0xFF, dtype=torch.uint8)
    idx = torch.full((t, k), -1, dtype=torch.int32)
    for i, n in enumerate((k, 1500, 0, 700)):
        chosen = torch.randperm(slots, generator=gen)[:n]
        idx[i, :n] = chosen.to(torch.int32)
        latent = torch.randn(n, 512, generator=gen) * torch.rand(n, 1, generator=gen) * 4
        rows[chosen] = pack_rows(fmt, latent, torch.randn(n, 64, generator=gen))
    idx[3, 100:164] = -1
    q = torch.randn(t, h, 576, generator=gen)
    scale = 576**-0.5
    valid = idx >= 0
    kv_all = dequant_rows(fmt, rows[idx.clamp(min=0).reshape(-1).long()]).double()
    kv_all = kv_all.view(t, k, 576)
    ref_rows = torch.where(valid[..., None], kv_all, 0.0)
    qb = q.bfloat16()
    want, want_lse = sparse_attention(
        qb[..., :512].double(), qb[..., 512:].double(), ref_rows, valid, scale
    )
    dev = torch.device("cuda")
    qd = qb.to(dev)
    out = torch.full((t, h, 512), float("nan"), dtype=torch.bfloat16, device=dev)
    lse = torch.full((t, h), 7.0, device=dev)
    gf.sparse_mla(qd[..., :512], qd[..., 512:], rows.to(dev), idx.to(dev), scale, splits, out, lse)
    atol, rtol, _ = TOLERANCES["bfloat16"]
    keep = [0, 1, 3]
    torch.testing.assert_close(out.double().cpu()[keep], want[keep], atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double().cpu()[keep], want_lse[keep], atol=atol, rtol=rtol)
    assert torch.equal(out[2].cpu(), torch.zeros(h, 512, dtype=torch.bfloat16))  # no index
    assert bool((lse[2] == float("-inf")).all())


@pytest.mark.sm90
@pytest.mark.parametrize("heads", [64, 128])
def test_triton_sparse_backend_takes_the_gluon_kernel(
    heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On SM90 the `triton` sparse backend runs H a multiple of 64 through the Gluon kernels
    (bf16 rows: `gluon_kernel`, FP8 rows: `gluon_fp8row`), with the one-wave split count,
    and matches the fp64 reference; H16 and e4m3 pools under a per-layer scale stay on the
    `tl.dot` kernel. (The parity grid above runs H128 through them too.)"""
    from mla_backends.kernels.common import num_sms
    from mla_backends.kernels.mla_attention import gluon_error
    from mla_backends.sparse import gluon_fp8row, gluon_kernel
    from mla_backends.sparse.triton_backend import launch_config

    calls: list[tuple[str, int]] = []

    def spy(module: object, name: str) -> None:
        real = module.sparse_mla  # type: ignore[attr-defined]

        def call(*args: object) -> None:
            real(*args)  # recorded once it returned: a failure would fall back to tl.dot
            calls.append((name, int(args[5])))  # type: ignore[call-overload]

        monkeypatch.setattr(module, "sparse_mla", call)

    spy(gluon_kernel, "bf16")
    spy(gluon_fp8row, "fp8_row")
    plan = (
        ("bfloat16", heads, "bf16"),
        ("fp8_row", heads, "fp8_row"),
        ("bfloat16", 16, None),
        ("fp8", heads, None),
    )
    for pool, h, kernel in plan:
        calls.clear()
        case = SparseCase(
            "triton", pool, "bfloat16", ForwardMode.DECODE, 1, KV_LENS, TOPK, 64, _dims(h),
            drop=0.2, empty_row=True,
        )  # fmt: skip
        _, _, detail = run(case, "cuda")
        assert not detail, detail
        assert gluon_error() is None, gluon_error()
        if kernel is None:
            assert calls == [], (pool, h, calls)
            continue
        sms = num_sms(torch.device("cuda"))
        splits = launch_config(h, pool == "fp8_row", len(KV_LENS), TOPK, sms, True)["splits"]
        assert calls == [(kernel, splits)], (pool, calls, splits)
