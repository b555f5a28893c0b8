"""FlashInfer MLA schedules: our device planner (Triton, interpreted on CPU) against the port
of flashinfer's host planner, and (GPU) the port against the C++ planner's own bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mla_backends.fi_planner import (
    check_schedule,
    decode_workspace,
    int_workspace_bytes,
    plan_reference,
    synthetic_info,
)

# (heads, q_lens, kv_lens, page, SMs): decode, verify, empty and split-heavy batches
CASES = {
    "h16-decode-b3": (16, [1, 1, 1], [5, 700, 64], 16, 8),
    "h128-decode-b1-long": (128, [1], [3000], 64, 8),
    "h128-verify-q3": (128, [3, 3], [40, 1500], 1, 8),
    "h16-verify-q2-b5": (16, [2, 2, 2, 2, 2], [2, 90, 400, 7, 1100], 64, 6),
    "h8-mixed-q": (8, [1, 4, 9, 2], [3, 300, 2000, 17], 16, 5),
    "h128-b1-short": (128, [1], [1], 64, 8),
    "h16-b20": (16, [1] * 20, list(range(50, 1050, 50)), 64, 8),
    # more items than one 256-wide block: the carries between blocks
    "h16-b300": (16, [1] * 300, [(37 * i) % 900 + 1 for i in range(300)], 16, 7),
    "h128-verify-q3-b90": (128, [3] * 90, [(53 * i) % 700 + 3 for i in range(90)], 64, 8),
}


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter


def _ours(heads, q, kv, page, sms, cluster, ws=None, info=None, poison=True):
    """Our device planner's schedule; `poison=False` keeps what an earlier batch left in a
    reused `ws` (the workspace lives from batch to batch)."""
    from mla_backends.kernels.fi_schedule import write_schedule

    info = info or synthetic_info(cluster, sms)
    if ws is None:
        ws = torch.empty(int_workspace_bytes(info, sms), dtype=torch.uint8, device=DEV)
    if poison:  # whatever the kernel does not write reads as garbage
        ws.fill_(0x7F)
    qt, kvt = (torch.as_tensor(np.asarray(x), dtype=torch.int32, device=ws.device) for x in (q, kv))
    write_schedule(ws, cluster, heads, page, sms, qt, kvt, int(max(q)))
    return decode_workspace(ws.view(torch.int32).cpu().numpy(), info, sms)


def _agree(heads, q, kv, page, sms, ws=None):  # type: ignore[no-untyped-def]
    """Our device schedule for the batch and the host planner's port, each held to the rule
    book: the same work items (partial rows included) and the same merge entries, in order.
    A given `ws` is reused unpoisoned. (reference, ours)."""
    qa, kva = np.array(q), np.array(kv)
    ref = plan_reference(qa, kva, page, heads, sms)
    check_schedule(ref, qa, kva, page, heads, sms)
    ours = _ours(heads, q, kv, page, sms, ref.cluster, ws=ws, poison=ws is None)
    check_schedule(ours, qa, kva, page, heads, sms)
    assert sorted(ours.flat()) == sorted(ref.flat())
    assert ours.merges == ref.merges
    return ref, ours


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_device_schedule_matches_host_planner(case: str) -> None:
    heads, q, kv, page, sms = CASES[case]
    _, ours = _agree(heads, q, kv, page, sms)
    # equal-cost cut: no cluster carries more than the average plus one item
    tile = 64 * ours.cluster

    def load(items: list[tuple[int, ...]]) -> int:
        return sum(2 * tile + w[7] - w[6] for w in items)

    total = sum(load(c) for c in ours.works)
    biggest = max(2 * tile + w[7] - w[6] for w in ours.flat())
    assert max(load(c) for c in ours.works) <= total / ours.num_clusters + biggest


@pytest.mark.parametrize("seed", range(4))
def test_device_schedule_random_batches(seed: int) -> None:
    gen = np.random.default_rng(seed)
    b = int(gen.integers(1, 24))
    heads = int(gen.choice([8, 16, 128]))
    q = gen.integers(1, 4, b) if seed % 2 else np.ones(b, np.int64)
    kv = q + gen.integers(0, 2500, b)
    page, sms = int(gen.choice([1, 16, 64])), int(gen.integers(3, 12))
    _agree(heads, q.tolist(), kv.tolist(), page, sms)


def test_check_schedule_catches_broken_schedules() -> None:
    heads, q, kv, page, sms = CASES["h128-decode-b1-long"]
    qa, kva = np.array(q), np.array(kv)
    good = plan_reference(qa, kva, page, heads, sms)
    items = good.flat()
    assert len(items) > 2 and good.merges
    dropped = type(good)(good.cluster, good.num_clusters, [items[1:]] + [[]] * (sms // 2 - 1))
    with pytest.raises(AssertionError, match="key range|gap"):
        check_schedule(dropped, qa, kva, page, heads, sms)
    shared = [(*w[:2], items[0][2], *w[3:]) for w in items]  # every split writes one row block
    bad = type(good)(good.cluster, good.num_clusters, [shared] + [[]] * (sms // 2 - 1))
    with pytest.raises(AssertionError, match="overlap"):
        check_schedule(bad, qa, kva, page, heads, sms)
    no_merge = type(good)(good.cluster, good.num_clusters, good.works, good.merges[1:])
    with pytest.raises(AssertionError, match="never merged"):
        check_schedule(no_merge, qa, kva, page, heads, sms)


def test_check_schedule_catches_overflow_stray_merges_and_stray_tiles() -> None:
    """Hazard: the rule book must refuse what the kernel would read or write out of bounds:
    partial rows past the 2 * clusters * tile rows of the partial buffer, more merge entries
    than SMs (FlashInfer's merge arrays hold one an SM), a merge entry for a row of no split
    tile, and a work item for a tile the batch does not have."""
    heads, q, kv, page, sms = CASES["h128-decode-b1-long"]
    qa, kva = np.array(q), np.array(kv)
    good = plan_reference(qa, kva, page, heads, sms)
    check_schedule(good, qa, kva, page, heads, sms)
    tile = good.cluster * 64
    off = 2 * good.num_clusters * tile  # every partial row moved past the buffer, consistently
    works = [[(*w[:2], w[2] + off if w[2] >= 0 else -1, *w[3:]) for w in c] for c in good.works]
    merges = [(a, b, c + off, d + off, e) for a, b, c, d, e in good.merges]
    with pytest.raises(AssertionError, match="partial buffer overflow"):
        check_schedule(
            type(good)(good.cluster, good.num_clusters, works, merges), qa, kva, page, heads, sms
        )
    rows = q[0] * heads
    stray = [(rows + i, rows + i + 1, 0, 1, 1) for i in range(sms + 1)]
    too_many = type(good)(good.cluster, good.num_clusters, good.works, good.merges + stray)
    with pytest.raises(AssertionError, match="merge entries > 8 SMs"):
        check_schedule(too_many, qa, kva, page, heads, sms)
    assert len(good.merges) < sms
    one_more = type(good)(good.cluster, good.num_clusters, good.works, good.merges + stray[:1])
    with pytest.raises(AssertionError, match="rows no split tile has"):
        check_schedule(one_more, qa, kva, page, heads, sms)
    w = good.flat()[0]
    ghost = [*good.works[0], (*w[:5], 4 * tile, *w[6:])]
    extra = type(good)(good.cluster, good.num_clusters, [ghost, *good.works[1:]], good.merges)
    with pytest.raises(AssertionError, match="tiles that do not exist"):
        check_schedule(extra, qa, kva, page, heads, sms)


def test_int_workspace_offsets_must_be_4_byte_aligned() -> None:
    """Hazard: plan-info offsets are bytes, read as int32 elements (offset // 4); an offset
    of 2 mod 4 read every field two bytes off. Only a multiple of 4 passes."""
    from mla_backends.fi_planner import info_offsets

    info = synthetic_info(1, 8)
    assert info_offsets(info)["q_indptr"] == info[2] // 4
    for bad in (info[3] + 2, info[3] + 1):
        with pytest.raises(ValueError, match=f"kv_indptr={bad} is not 4-byte"):
            info_offsets([*info[:3], bad, *info[4:]])


def test_schedule_refuses_batches_beyond_flashinfer_arrays() -> None:
    from mla_backends.kernels.fi_schedule import write_schedule

    info = synthetic_info(1, 8)
    ws = torch.zeros(int_workspace_bytes(info, 8), dtype=torch.uint8, device=DEV)
    lens = torch.ones(17000, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="workspace holds 16384"):
        write_schedule(ws, 1, 16, 64, 8, lens, lens, max_q_len=2)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["h16-decode", "h128-decode", "h128-verify-q2", "h16-mixed"])
def test_gpu_port_equals_flashinfer_planner(case: str) -> None:
    """The port's work items and merges equal the C++ planner's, read back from its bytes;
    our device planner's equal both, at the GPU's real SM count."""
    pytest.importorskip("flashinfer")
    from mla_backends.backends.flashinfer_kernel import FaMLAKernel
    from mla_backends.kernels.common import num_sms

    gen = np.random.default_rng(1)
    heads, q = {
        "h16-decode": (16, np.ones(256, np.int32)),
        "h128-decode": (128, np.ones(64, np.int32)),
        "h128-verify-q2": (128, np.full(32, 2, np.int32)),
        "h16-mixed": (16, gen.integers(1, 5, 40).astype(np.int32)),
    }[case]
    kv = (q + gen.integers(0, 6000, q.size)).astype(np.int32)
    page, dev = 64, torch.device("cuda")
    sms = num_sms(dev)
    k = FaMLAKernel(dev, "fa3", torch.bfloat16, torch.bfloat16, 512, 64)
    qo_indptr = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(-(-kv // page))]).astype(np.int32)
    info = k.plan(
        torch.from_numpy(qo_indptr),
        torch.from_numpy(kv_indptr),
        torch.from_numpy(kv),
        heads,
        512,
        True,
    )
    torch.cuda.synchronize()
    real = decode_workspace(k.int_ws.view(torch.int32).cpu().numpy(), list(info), sms)
    ref = plan_reference(q, kv, page, heads, sms)
    assert list(int(x) for x in info) == synthetic_info(ref.cluster, sms)
    check_schedule(real, q, kv, page, heads, sms)
    assert sorted(real.flat()) == sorted(ref.flat())
    assert real.merges == ref.merges
    ours = _ours(heads, q, kv, page, sms, ref.cluster, ws=k.int_ws, info=list(info))
    assert sorted(ours.flat()) == sorted(real.flat())
    assert ours.merges == real.merges


@pytest.mark.parametrize("page", [1, 16, 64])
def test_one_launch_writes_schedule_and_page_ids(page: int) -> None:
    """With a PageGather the same launch also writes the page ids: equal to the shared index
    builder, nothing written past them, and the schedule unchanged."""
    from mla_backends.batch import ForwardMode
    from mla_backends.indices import build_page_indices
    from mla_backends.kernels.fi_schedule import PageGather, write_schedule
    from mla_backends.testing import Case, build_case, edge_kv_lens

    lens = edge_kv_lens(page, long=150) + (3 * page + 2, 7)
    case = Case(mode=ForwardMode.DECODE, page_size=page, kv_lens=lens, layout="mixed", seed=3)
    rt, batch = build_case(case, torch.device(DEV))
    r2t = rt.req_pool.req_to_token
    n_pages = [-(-n // page) for n in batch.seq_lens_cpu.tolist()]
    total = sum(n_pages)
    _, want = build_page_indices(r2t, batch.req_pool_indices, batch.seq_lens, page, total)
    heads, sms = 16, 6
    info = synthetic_info(1, sms)
    ws = torch.full((int_workspace_bytes(info, sms),), 0x7F, dtype=torch.uint8, device=DEV)
    out = torch.full((total + 40,), -7, dtype=torch.int32, device=DEV)
    gather = PageGather(r2t, batch.req_pool_indices, out, max(n_pages))
    write_schedule(ws, 1, heads, page, sms, batch.extend_seq_lens, batch.seq_lens, 1, gather)
    assert torch.equal(out[:total], want)
    assert (out[total:] == -7).all()
    q = batch.extend_seq_lens_cpu.numpy()
    kv = batch.seq_lens_cpu.numpy()
    got = decode_workspace(ws.view(torch.int32).cpu().numpy(), info, sms)
    ref = plan_reference(q, kv, page, heads, sms)
    assert sorted(got.flat()) == sorted(ref.flat()) and got.merges == ref.merges


def test_cluster_of_one_cta_at_exactly_one_tile_of_packed_rows() -> None:
    """Hazard: flashinfer 0.7.2's MLAPlan takes 2-CTA clusters only when the average packed
    query length *exceeds* 64 rows; at exactly 64 (H64 decode: Kimi, DeepSeek at TP 2;
    H16 verify of 4 tokens) a `>=` gave the port and our device planner 2-CTA clusters, a
    layout the kernel launched from FlashInfer's plan does not read."""
    from mla_backends.fi_planner import cluster_size

    assert cluster_size(np.array([1, 1, 1]), 64) == 1
    assert cluster_size(np.array([4, 4]), 16) == 1
    assert cluster_size(np.array([1]), 65) == 2
    assert cluster_size(np.array([1, 1]), 128) == 2


def test_check_schedule_catches_a_gap_between_split_items() -> None:
    """Hazard: `check_schedule` is the oracle's rule book: a split tile whose work items
    leave keys between one item's end and the next one's start attends without those keys;
    a check that only refused overlaps let that schedule through."""
    heads, q, kv, page, sms = 128, [1], [3000], 64, 8
    qa, kva = np.array(q), np.array(kv)
    good = plan_reference(qa, kva, page, heads, sms)
    items = sorted(good.flat(), key=lambda w: w[6])
    assert len(items) > 2
    w = items[1]
    gap = [(*w[:6], w[6] + 1, w[7])] + [x for x in items if x is not w]
    bad = type(good)(good.cluster, good.num_clusters, [gap] + [[]] * (good.num_clusters - 1))
    with pytest.raises(AssertionError, match="gap or overlap"):
        check_schedule(bad, qa, kva, page, heads, sms)


@pytest.mark.parametrize("heads", [24, 48, 40])
def test_device_schedule_rounds_causal_tile_keys_up_for_heads_that_do_not_divide_the_tile(
    heads: int,
) -> None:
    """Hazard: a causal query tile of packed rows [0, (t + 1) * tile) holds tokens up to
    ceil((t + 1) * tile / heads) - 1, so it may see kv - q + ceil(...) keys. Floor division
    (exact whenever heads divides 64: every head count of the other tests) dropped the last
    token's final key for H24 / H40 / H48 prefill tiles: those rows attended one key short."""
    _agree(heads, [9, 5, 13], [300, 2000, 77], 16, 8)


@pytest.mark.parametrize("kv", [[65], [400], [2049], [1000, 1049]])
def test_device_key_limit_rounds_the_per_cluster_share_up(kv: list[int]) -> None:
    """Hazard: the planner's per-item key limit comes from ceil(total keys / clusters); a
    total just past a bound (8 clusters: 65 keys -> 9 a cluster -> limit 64; 2049 -> 257 ->
    512) under floor division took the smaller limit, twice the splits and partials of
    FlashInfer's own plan. 400 keys (50 a cluster): the 33-64 band's limit, 192, which no
    other case reaches."""
    _agree(16, [1] * len(kv), kv, 16, 8)


def test_device_schedule_clears_merge_entries_an_earlier_batch_left() -> None:
    """Hazard: the workspace is reused from batch to batch (and across graph replays); merge
    entries past this batch's count must read as empty. Leaving the first stale entry (index
    == merge count) made FlashInfer merge rows of the earlier batch's split, over this
    batch's final rows."""
    cluster = plan_reference(np.array([1, 1]), np.array([3000, 2500]), 64, 128, 8).cluster
    info = synthetic_info(cluster, 8)
    ws = torch.zeros(int_workspace_bytes(info, 8), dtype=torch.uint8, device=DEV)
    _agree(128, [1, 1], [3000, 2500], 64, 8, ws)  # many merges
    _agree(128, [1, 1], [3000, 20], 64, 8, ws)  # fewer, same workspace
    _agree(128, [1], [20], 64, 8, ws)  # none


def test_schedule_refuses_a_batch_whose_tiles_fit_but_tiles_plus_clusters_do_not() -> None:
    """Hazard: FlashInfer's work arrays hold 16384 items; a batch makes one item a tile plus
    at most one extra a cluster (splits). 16384 one-tile requests fit the tiles alone but not
    the bound: accepted, the split items were written past the arrays (into the next field
    of the int workspace)."""
    from mla_backends.kernels.fi_schedule import work_bound, write_schedule

    assert work_bound(16384, 1, 16, 1, 8) == 16384 + 8
    info = synthetic_info(1, 8)
    ws = torch.zeros(int_workspace_bytes(info, 8), dtype=torch.uint8)
    lens = torch.ones(16384, dtype=torch.int32)
    with pytest.raises(ValueError, match="workspace holds 16384"):
        write_schedule(ws, 1, 16, 64, 8, lens, lens, max_q_len=1)


@pytest.mark.parametrize("kv", [[32], [64], [128], [256], [512], [4096]])
def test_device_key_limit_bands_hold_their_upper_bound(kv: list[int]) -> None:
    """Hazard: each band of the key limit includes its bound (8 clusters: 64 keys -> 8 a
    cluster -> 32; 128 -> 16 -> 64; 256 -> 32 -> 128; 512 -> 64 -> 192) and past them the
    share rounds up to a multiple of 256 (4096 -> 512, itself). A strict bound, or rounding a
    multiple of 256 up a step, gave one side of the port / device pair another limit; a tile
    of exactly `limit` keys (32) is one final item, not a split of one chunk."""
    _agree(16, [1] * len(kv), kv, 16, 8)


@pytest.mark.parametrize("cluster", [1, 2])
def test_synthetic_partial_o_holds_every_partial_row_the_rule_book_allows(cluster: int) -> None:
    """Hazard: `check_schedule` lets partial rows reach 2 * clusters * tile rows; a partial-O
    region (2-byte elements, 512 wide) sized for half of them put the partial LSE over the
    second half of the partial rows."""
    sms = 8
    info = synthetic_info(cluster, sms)
    rows = 2 * (sms // cluster) * cluster * 64
    assert info[17] - info[16] >= rows * 512 * 2
