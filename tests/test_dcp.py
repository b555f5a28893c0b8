"""Decode context parallelism: the DCP result equals the single-process one.

CPU (CI): one gloo launch of 2 processes and one of 4 run every multi-process check (starting
processes costs seconds each); each check is reported per case and rank, and the tests below
read those reports. Cases: decode, verify and extend; page sizes 1-128; ragged lengths with
requests shorter than the number of ranks (0, 1, 2, 3); replicated and tensor-parallel heads;
the torch backend, and the triton backend under the interpreter; the graph runner's padded
static-buffer path. The tiny DeepSeek-V3's logits with DCP 2 equal those without to 1e-5.
GPU (>= 2 CUDA devices): the same equality over NCCL with captured CUDA graphs.
"""

from __future__ import annotations

import random
import re
import signal
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import INTERP
from torch.utils._python_dispatch import TorchDispatchMode

from mla_backends.allocator import OutOfPagesError, PagedTokenAllocator
from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.config import Config
from mla_backends.dcp.comm import merge_partials
from mla_backends.dcp.launch import RankFailed, spawn
from mla_backends.dcp.layout import DCPLayout, DCPTokenAllocator
from mla_backends.dcp.metadata import DCPGraphState, rows_metadata
from mla_backends.dcp.parity import SMALL, DCPCase, edge_lens, gpu_cases, parity_worker
from mla_backends.dcp.runtime import build_dcp_runtime
from mla_backends.pool import ReqToTokenPool, RequestRowError
from mla_backends.runtime import Runtime

DECODE, VERIFY, EXTEND = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND


# ---------------------------------------------------------------------------- one process
@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_local_len_counts_the_positions_a_rank_owns(size: int) -> None:
    for rank in range(size):
        lay = DCPLayout(rank, size)
        counts = [sum(1 for p in range(s) if p % size == rank) for s in range(70)]
        assert [lay.local_len(s) for s in range(70)] == counts
        lens = torch.arange(70, dtype=torch.int32)
        assert lay.local_lens(lens).tolist() == counts
        assert lay.owned(torch.arange(70)).tolist() == [p % size == rank for p in range(70)]


def _rank_allocators(size: int, pages: int, page: int) -> list[DCPTokenAllocator]:
    out = []
    for rank in range(size):
        req = ReqToTokenPool(4, 64, "cpu")
        req.alloc(4)
        out.append(DCPTokenAllocator(DCPLayout(rank, size), PagedTokenAllocator(pages, page, req)))
    return out


def test_allocator_gives_each_rank_its_tokens_and_fails_on_all_ranks_alike() -> None:
    """Three ranks' allocators driven by the same calls: each new token gets a local slot on
    exactly one rank (its owner, at local index p // N) and slot 0 elsewhere; truncate and
    free give pages back; an allocation that does not fit on the fullest rank fails on every
    rank, with nothing taken."""
    size, page = 3, 2
    allocs = _rank_allocators(size, 6, page)
    lens = {1: 0, 2: 0}
    calls = [([1, 2], [5, 1]), ([2], [4]), ([1, 2], [1, 1])]
    for rows, n in calls:
        slots = [a.alloc_extend(rows, n) for a in allocs]
        start = 0
        for row, k in zip(rows, n):
            for p in range(lens[row], lens[row] + k):
                owner = p % size
                for r in range(size):
                    s = int(slots[r][start + p - lens[row]])
                    assert (s != 0) == (r == owner), (row, p, r)
                    if r == owner:
                        assert int(allocs[r].req_to_token.req_to_token[row, p // size]) == s
            start += k
            lens[row] += k
    for a in allocs:
        assert a.seq_len(1) == 6 and a.seq_len(2) == 6
        assert a.local.seq_len(1) == a.layout.local_len(6)
    # Each rank holds 2 tokens per request (1 page of 2 each): 6 - 2 = 4 pages free.
    assert [a.available_pages for a in allocs] == [4, 4, 4]
    # 13 more tokens for both rows (19): rank 0 needs 3 + 3 pages and has 4 free, rank 1
    # needs 2 + 2: every rank refuses, naming rank 0's numbers.
    for a in allocs:
        with pytest.raises(OutOfPagesError, match="requested 6 page"):
            a.alloc_extend([1, 2], [13, 13])
        assert a.seq_len(1) == 6 and a.available_pages == 4
    for a in allocs:
        a.truncate(1, 1)  # only rank 0 keeps a token of row 1
        assert a.local.seq_len(1) == (1 if a.layout.rank == 0 else 0)
        a.free(2)
    assert [a.available_pages for a in allocs] == [5, 6, 6]
    with pytest.raises(ValueError, match="exceeds the group's context limit 192"):
        allocs[1].alloc_extend([1], [192])


def test_allocator_random_sequences_keep_every_ranks_pages_consistent() -> None:
    """Three ranks' allocators driven by the same random alloc / truncate / free calls, misuse
    included (rows holding nothing, duplicate rows, more pages than the fullest rank has): a
    call succeeds or fails on every rank alike, and every rank's count of every rank's pages
    equals what that rank's own allocator holds. Truncating a row holding nothing used to
    make it look held on the group but not locally: its free raised KeyError and left the
    row held by the local allocator for good."""
    allocs = _rank_allocators(3, 5, 2)
    rng = random.Random(0)
    for step in range(500):
        op, row = rng.randrange(3), rng.randint(1, 4)
        rows = [row, row] if rng.random() < 0.1 else rng.sample([1, 2, 3, 4], 2)
        ext = [rng.randint(0, 7) for _ in rows]
        cut = rng.randint(0, allocs[0].seq_len(row))
        outcomes = []
        for a in allocs:
            try:
                if op == 0:
                    a.alloc_extend(rows, ext)
                elif op == 1:
                    a.truncate(row, cut)
                else:
                    a.free(row)
                outcomes.append("ok")
            except (ValueError, MemoryError) as e:
                outcomes.append(type(e).__name__)
        assert len(set(outcomes)) == 1, (step, op, outcomes)
        used = [sum(len(b.local.pages(r)) for r in (1, 2, 3, 4)) for b in allocs]
        for a in allocs:
            assert a._used == used and a.available_pages == 5 - used[a.layout.rank], step
            for r in (1, 2, 3, 4):
                assert a.holds(r) == a.local.holds(r) and a.seq_len(r) == allocs[0].seq_len(r)
                assert a.local.seq_len(r) == a.layout.local_len(a.seq_len(r))


def test_out_of_pages_names_the_rank_that_ran_out() -> None:
    """Every rank refuses an allocation the fullest rank cannot take, naming that rank and its
    numbers (rank 1, with a page free, said '0 free' without saying whose pages)."""
    allocs = _rank_allocators(2, 2, 2)
    for a in allocs:
        a.alloc_extend([1], [5])  # rank 0: 3 tokens, 2 pages; rank 1: 2 tokens, 1 page
    for a in allocs:
        with pytest.raises(OutOfPagesError, match=r"DCP rank 0: requested 1 page\(s\) of 2 tok"):
            a.alloc_extend([2], [1])
        assert a.seq_len(2) == 0 and not a.holds(2)


def _context_limit_worker(rank: int, group: dist.ProcessGroup) -> list[str]:
    from mla_backends.config import Config
    from mla_backends.dcp import build_dcp_runtime
    from mla_backends.dcp.parity import SMALL

    cfg = Config(
        model=SMALL,
        prefill_backend="torch",
        decode_backend="torch",
        device="cpu",
        kv_dtype="float32",
        dtype="float32",
        page_size=16,
        max_context_len=9,
        dcp_size=2,
    )
    rt = build_dcp_runtime(cfg, group)
    rows = rt.req_pool.alloc(1)
    out = []
    for n in (10, 9):
        try:
            rt.allocator.alloc_extend(rows, [n])
            out.append(f"{n}: {rt.allocator.seq_len(rows[0])}")
        except ValueError as e:
            out.append(f"{n}: {e}")
    return out


def test_dcp_runtime_keeps_the_configs_context_limit() -> None:
    """max_context_len is the group's per-request limit, as in one process: at M = 9 over two
    ranks each rank's table holds ceil(9 / 2) = 5 tokens (10 in all), and a 10-token request
    is refused on every rank; 9 tokens fit."""
    for got in spawn(_context_limit_worker, 2, "gloo"):
        assert got[0].startswith("10: row 1: length 10 exceeds the group's context limit 9")
        assert got[1] == "9: 9"


# torch on a CPU at SMALL dims, fp32: the config the host-side DCP tests build their ranks on
CPU_SMALL = Config(
    model=SMALL, prefill_backend="torch", decode_backend="torch", device="cpu",
    kv_dtype="float32", dtype="float32", page_size=16, max_context_len=64, num_pages=8,
)  # fmt: skip


def _pointer_check_worker(rank: int, group: Any) -> list[str]:
    """A DCP graph runner (eager replay on the CPU): the pointers its check compares at each
    replay, and the wrapped backend's metadata tensors they must include."""
    from mla_backends.graph_runner import CudaGraphRunner, InputSpec, _collect

    rt = build_dcp_runtime(CPU_SMALL, group)
    d, be = CPU_SMALL.model, rt.backend
    rows = rt.req_pool.alloc(2)
    rt.allocator.alloc_extend(rows, [5, 9])
    specs = {
        "qn": InputSpec((d.num_heads, d.kv_lora_rank), torch.float32),
        "qr": InputSpec((d.num_heads, d.qk_rope_head_dim), torch.float32),
    }
    runner = CudaGraphRunner(
        be, lambda b, i: be.forward_absorbed(0, i["qn"], i["qr"], None, None, b), specs, [2],
        device="cpu", use_graphs=False,
    )  # fmt: skip
    runner.capture()
    loc = rt.allocator.alloc_decode(rows)
    batch = ForwardBatch.build(ForwardMode.DECODE, rows, [5, 9], [1, 1], loc, "cpu")
    q = {k: torch.randn(2, *spec.shape) for k, spec in specs.items()}
    runner.replay(batch, q, check_pointers=True)
    inner: dict[str, int] = {}
    _collect("inner", be.inner.metadata, inner)  # type: ignore[attr-defined]
    seen = set(runner.pointer_snapshot().values())
    return sorted(path for path, ptr in inner.items() if ptr not in seen)


def test_dcp_graph_pointer_check_sees_the_wrapped_backends_buffers() -> None:
    """Under DCP the graph runner's `check_pointers` compares the wrapped backend's metadata
    too (page table, indptr...): before, it saw only DCP's own rows, so the attending
    backend's buffers could move after capture unnoticed."""
    for missing in spawn(_pointer_check_worker, 2, "gloo"):
        assert missing == []


def _wrong_length_worker(rank: int, group: Any, cases: list[tuple[int, int]]) -> list[str]:
    """Per case: a row storing `stored` tokens, a DECODE batch reading `claimed`; what this
    rank's metadata call says."""
    from mla_backends.batch import ForwardBatch, ForwardMode

    rt = build_dcp_runtime(CPU_SMALL, group)
    out = []
    for stored, claimed in cases:
        [row] = rt.req_pool.alloc(1)
        rt.allocator.alloc_extend([row], [stored])
        loc = torch.zeros(1, dtype=torch.int64)
        batch = ForwardBatch.build(ForwardMode.DECODE, [row], [claimed - 1], [1], loc, "cpu")
        try:
            rt.backend.init_forward_metadata(batch)
            out.append("taken")
        except RequestRowError as e:
            out.append(str(e))
        rt.allocator.free(row)
        rt.req_pool.free(row)
    return out


@pytest.mark.parametrize("size", [2, 3, 4])
def test_a_batch_of_the_wrong_length_is_refused_on_every_rank_alike(size: int) -> None:
    """Checked on each rank's share alone, a length one off was refused on some ranks and
    taken on others (rank 0 holds 2 tokens of 3 and of 4 over two ranks), which then waited
    in the merge's collective for ever. Checked against the global lengths every rank holds,
    it is refused on all, with the same message; the right length is taken on all."""
    cases = [(4, 3), (4, 5), (6, 5), (9, 10), (9, 8), (7, 7)]
    per_rank = spawn(_wrong_length_worker, size, "gloo", (cases,))
    for i, (stored, claimed) in enumerate(cases):
        said = {got[i] for got in per_rank}
        assert len(said) == 1, f"{stored} stored, {claimed} read: ranks differ: {said}"
        want = "taken" if stored == claimed else f"reads {claimed} tokens.* has {stored} stored"
        assert re.search(want, said.pop())


def _rowless_length_worker(rank: int, group: Any, extra: list[int]) -> list[str]:
    """Per `extra`: a DECODE batch without CPU rows (SGLang's) whose global length is the
    group's width (ranks x table columns) plus `extra`; what this rank's metadata call says."""
    import dataclasses

    from mla_backends.checks import ShapeError

    rt = build_dcp_runtime(CPU_SMALL, group)
    [row] = rt.req_pool.alloc(1)
    rt.allocator.alloc_extend([row], [5])
    width = rt.backend.layout.size * rt.req_pool.max_context_len  # type: ignore[attr-defined]
    out = []
    for n in extra:
        seq = torch.tensor([width + n], dtype=torch.int32)
        loc = torch.zeros(1, dtype=torch.int64)
        batch = ForwardBatch.build(ForwardMode.DECODE, [row], [4], [1], loc, "cpu")
        rowless = dataclasses.replace(
            batch, seq_lens=seq.clone(), seq_lens_cpu=seq, extend_prefix_lens=seq - 1,
            extend_prefix_lens_cpu=seq - 1, req_pool_indices_cpu=None,
        )  # fmt: skip
        try:
            rt.backend.init_forward_metadata(rowless)
            out.append("taken")
        except ShapeError as e:
            out.append(str(e))
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_a_batch_without_cpu_rows_past_the_groups_width_is_refused_on_every_rank(
    size: int,
) -> None:
    """A batch without CPU rows had only each rank's share checked against its table: a
    global length one past the group's width is past rank 0's share alone, so rank 0 refused
    it and the others took it (and would then wait in the merge's collective for ever). The
    global length is now held to ranks x table columns on every rank alike."""
    per_rank = spawn(_rowless_length_worker, size, "gloo", ([1, 0],))
    past, at = ({got[i] for got in per_rank} for i in range(2))
    assert len(past) == 1, f"ranks differ: {past}"
    assert re.search(rf"every length must be in 0\.\.\d+ \({size} ranks x \d+ table", past.pop())
    assert at == {"taken"}


def test_merge_partials_takes_a_lone_share_exactly_and_ignores_garbage() -> None:
    """Rows where one rank saw keys equal that rank's partial bit for bit; rows no rank saw
    are exactly 0 / -inf; whatever invalid partials hold (NaN, junk) never leaks in; rows
    with several shares equal the fp64 log-sum-exp merge."""
    n, t, h, lat = 3, 6, 2, 5
    gen = torch.Generator().manual_seed(0)
    out = torch.randn(n, t, h, lat, generator=gen)
    lse = torch.randn(n, t, h, generator=gen)
    valid = torch.tensor(
        [
            [1, 0, 0, 1, 1, 0],
            [0, 1, 0, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
        ],
        dtype=torch.bool,
    ).reshape(n, t)
    out[~valid] = float("nan")
    lse[~valid] = float("nan")
    got, got_lse = merge_partials(out, lse, valid)
    for row, only in ((0, 0), (1, 1), (2, 2)):
        assert torch.equal(got[row], out[only, row]) and torch.equal(got_lse[row], lse[only, row])
    assert torch.equal(got[5], torch.zeros(h, lat))
    assert torch.equal(got_lse[5], torch.full((h,), float("-inf")))
    for row in (3, 4):
        ks = valid[:, row].nonzero()[:, 0]
        m = torch.logsumexp(lse[ks, row].double(), dim=0)
        want = (torch.exp(lse[ks, row].double() - m)[..., None] * out[ks, row].double()).sum(0)
        torch.testing.assert_close(got[row].double(), want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_lse[row].double(), m, rtol=1e-6, atol=1e-6)


class _CountOps(TorchDispatchMode):
    VIEWS = frozenset({"view", "expand", "slice", "select", "alias", "unsqueeze", "t"})

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket.__name__ not in self.VIEWS:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("size,q", [(2, 1), (3, 1), (2, 2), (3, 4)])
def test_rows_metadata_refills_its_static_buffers_in_place_in_few_ops(size: int, q: int) -> None:
    """A graph replay's per-rank rows are written into the captured buffers (the local batch
    aliases them) with one op per value: the refill is a DCP decode step's host cost on
    every rank. The values are those of the per-token rule (query j of a request of length
    L sees L - q + 1 + j keys)."""
    b, max_t = 5, 32
    lens = [1, 2, 3, 17, 40]
    mode = ForwardMode.DECODE if q == 1 else ForwardMode.TARGET_VERIFY
    for rank in range(size):
        lay = DCPLayout(rank, size)
        loc = torch.zeros(b * q, dtype=torch.int64)
        batch = ForwardBatch.build(mode, [1, 2, 3, 4, 5], lens, [q] * b, loc, "cpu")
        state = DCPGraphState.allocate(size, max_t, "cpu")
        rows_metadata(lay, batch, state)  # warm: first calls may allocate
        with _CountOps() as count:
            md = rows_metadata(lay, batch, state)
        assert len(count.ops) <= (13 if q == 1 else 16), count.ops  # were 27 / 30
        local = md.local
        for got, buf in ((local.req_pool_indices, state.rows), (local.seq_lens, state.seq),
                         (local.extend_prefix_lens, state.pre), (md.vis, state.vis)):  # fmt: skip
            assert got.data_ptr() == buf.data_ptr()
        vis = [(s + q) - q + 1 + j for s in lens for j in range(q)]  # seq_len s + q
        seq = [lay.local_len(v) for v in vis]
        assert md.vis.tolist() == vis
        assert local.seq_lens.tolist() == seq == local.seq_lens_cpu.tolist()
        assert local.extend_prefix_lens.tolist() == [max(0, s - 1) for s in seq]
        assert local.req_pool_indices.tolist() == [r for r in range(1, b + 1) for _ in range(q)]
        assert md.valid.tolist() == [[v > k for v in vis] for k in range(size)]


# ---------------------------------------------------------------------------- gloo launches
def _cases(
    size: int, backends: tuple[str, ...], pages: tuple[int, ...], few: bool = False
) -> list[DCPCase]:
    """Decode, verify and extend at every page size; TP heads, bf16 and the graph runner's
    static path at one (`few`: only TP-heads extend and a graph-path TP verify there)."""
    cases = []
    for be in backends:
        for page in pages:
            lens = edge_lens(size, page)
            cases += [
                DCPCase(be, DECODE, 1, page, kv_lens=lens),
                DCPCase(be, VERIFY, 3, page, kv_lens=lens),
                DCPCase(be, EXTEND, 0, page, kv_lens=lens),
            ]
        # Tensor-parallel heads, the graph runner's static path, bf16: at one page size.
        p = pages[len(pages) // 2]
        lens = edge_lens(size, p)
        extras = [
            DCPCase(be, EXTEND, 0, p, heads="tp", kv_lens=lens, seed=1),
            DCPCase(be, VERIFY, 2, p, heads="tp", kv_lens=lens, graphs=True, steps=3),
        ]
        if not few:
            extras += [
                DCPCase(be, DECODE, 1, p, heads="tp", kv_lens=lens),
                DCPCase(be, VERIFY, 2, p, heads="tp", kv_lens=lens),
                DCPCase(be, DECODE, 1, p, kv_lens=lens, dtype="bfloat16", kv_dtype="bfloat16"),
                DCPCase(be, DECODE, 1, p, kv_lens=lens, graphs=True, steps=4),
            ]
        cases += extras
    return cases


def _undefined_empty_cases(size: int, page: int) -> list[DCPCase]:
    """A backend that leaves rows without keys undefined, as kernels do inside a graph."""
    lens = edge_lens(size, page)
    return [
        DCPCase("torch", DECODE, 1, page, kv_lens=lens, undefined_empty=True),
        DCPCase("torch", VERIFY, 3, page, heads="tp", kv_lens=lens, undefined_empty=True),
        DCPCase("torch", EXTEND, 0, page, kv_lens=lens, undefined_empty=True),
        DCPCase("torch", VERIFY, 2, page, kv_lens=lens, graphs=True, undefined_empty=True),
    ]


def _dispatch_cases(size: int, page: int) -> list[DCPCase]:
    """Decode and prefill on different backends (the runtime's `DispatchBackend`, as with
    `flashmla`, which has no prefill path): decode through triton, extend through torch."""
    lens = edge_lens(size, page)
    kw: dict[str, Any] = {"kv_lens": lens, "prefill_backend": "torch"}
    return [
        DCPCase("triton", DECODE, 1, page, **kw),
        DCPCase("triton", EXTEND, 0, page, **kw),
        DCPCase("triton", EXTEND, 0, page, heads="tp", **kw),
        DCPCase("triton", VERIFY, 2, page, graphs=True, steps=3, **kw),
    ]


ALL_PAGES = (1, 16, 32, 64, 128)
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.interp)]
CASES_2 = (
    _cases(2, ("torch",), ALL_PAGES)
    + _undefined_empty_cases(2, 16)
    + [DCPCase("torch", DECODE, kv_lens=()), DCPCase("torch", EXTEND, heads="tp", kv_lens=())]
    + (_cases(2, ("triton",), (1, 16, 64)) if INTERP else [])
    + (_dispatch_cases(2, 16) if INTERP else [])
)
# The triton interpreter is slow: pages 1, 16, 64 with 2 processes, 16 with 4 (on 2 CI cores).
CASES_4 = (
    _cases(4, ("torch",), ALL_PAGES)
    + _undefined_empty_cases(4, 1)
    + (_cases(4, ("triton",), (16,), few=True) if INTERP else [])
)


def _launch(size: int, cases: list[DCPCase]) -> dict[str, list[dict[str, Any]]]:
    by_id: dict[str, list[dict[str, Any]]] = {}
    for rank_results in spawn(parity_worker, size, "gloo", (cases,)):
        for r in rank_results:
            by_id.setdefault(r["id"], []).append(r)
    return by_id


@pytest.fixture(scope="module")
def gloo2() -> dict[str, list[dict[str, Any]]]:
    return _launch(2, CASES_2)


@pytest.fixture(scope="module")
def gloo4() -> dict[str, list[dict[str, Any]]]:
    return _launch(4, CASES_4)


def _check(results: dict[str, list[dict[str, Any]]], case: DCPCase, size: int) -> None:
    got = results[case.id]
    assert len(got) == size, f"{case.id}: {len(got)} rank reports, want {size}"
    bad = [f"rank {r['rank']}: {r['detail']}" for r in got if not r["ok"]]
    assert not bad, f"{case.id}: " + " | ".join(bad)


def test_case_ids_are_unique() -> None:
    for cases in (CASES_2, CASES_4, gpu_cases(2)):
        assert len({c.id for c in cases}) == len(cases)


@pytest.mark.parametrize("case", CASES_2, ids=lambda c: c.id)
def test_dcp2_equals_single_process(gloo2: dict[str, list[dict[str, Any]]], case: DCPCase) -> None:
    _check(gloo2, case, 2)


@pytest.mark.parametrize("case", CASES_4, ids=lambda c: c.id)
def test_dcp4_equals_single_process(gloo4: dict[str, list[dict[str, Any]]], case: DCPCase) -> None:
    _check(gloo4, case, 4)


# ---------------------------------------------------------------------------- the model
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _serve_both(engines: tuple[Any, Any], seq: list[int], tag: str) -> list[list[Any]]:
    """The same steps on both engines (single process, DCP): relative logit difference."""
    single, dcp = engines
    a, b, c = single.new_requests(3)
    assert dcp.new_requests(3) == [a, b, c]
    report: list[list[Any]] = []

    def step(name: str, *call: Any) -> None:
        want, got = (getattr(e, call[0])(*call[1:]) for e in engines)
        report.append([f"{tag}: {name}", _rel(got, want)])

    step("prefill (MHA)", "extend", [a, c], [seq[:13], seq[:2]])
    step("extend over a prefix", "extend", [a, b], [seq[13:21], seq[:5]])
    for i in range(3):
        step(f"decode {i}", "decode", [a, b, c], [seq[21 + i], seq[5 + i], seq[2 + i]])
    for e in engines:
        e.enable_graphs([1, 2, 4], use_graphs=False)
    for i in range(3):  # 3 requests pad to 4, 2 run at 2
        rows = [a, b, c] if i != 1 else [c, a]
        step(f"graph decode {i}", "decode", rows, [seq[30 + i + k] for k in range(len(rows))])
    step("verify", "verify", [a, c], [seq[34:37], seq[10:13]])
    for e in engines:
        e.accept([a, c], [2, 0])
    step("graph decode after accept", "decode", [a, c], [seq[37], seq[38]])
    step("extend after decode", "extend", [a, b], [seq[39:], seq[9:12]])
    return report


def _fails_while_peer_waits(rank: int, group: dist.ProcessGroup) -> None:
    """Rank 0 enters a collective its peer never joins; rank 1 raises."""
    if rank == 1:
        raise ValueError("rank 1 broke")
    dist.all_reduce(torch.ones(1), group=group)


def test_a_failing_rank_ends_the_launch_with_its_traceback() -> None:
    """A rank that raises must not wait for its peers (with NCCL a teardown while a peer
    sits in a collective blocks for ever): the launch ends and names the error."""

    def stuck(signum: int, frame: Any) -> None:
        raise TimeoutError("the launch did not end within 120 s")

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(120)
    try:
        with pytest.raises(RankFailed, match="rank 1 broke"):
            spawn(_fails_while_peer_waits, 2, "gloo")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _model_worker(
    rank: int, group: dist.ProcessGroup, backend: str, setups: list[tuple[int, int | None]]
) -> list[list[Any]]:
    """The tiny DeepSeek-V3 served by one engine without DCP and one with (this rank's
    share), per (page size, chunked_prefix_min): None extends over a prefix absorbed, 8
    through chunked-prefix MHA."""
    from mla_backends.dcp.runtime import build_dcp_runtime
    from mla_backends.models.engine import Engine
    from mla_backends.models.run import RANDOM_SIZES, random_model
    from mla_backends.runtime import Runtime

    raw = dict(RANDOM_SIZES["tiny"], num_hidden_layers=2)
    gen = torch.Generator().manual_seed(7)
    seq = torch.randint(0, raw["vocab_size"], (48,), generator=gen).tolist()
    report: list[list[Any]] = []
    for page, chunked in setups:
        model = random_model(raw, seed=0)
        with torch.no_grad():  # scores of order 1: attention far from uniform
            for layer in model.model.layers:
                layer.self_attn.chunked_prefix_min = chunked
                layer.self_attn.q_b_proj.weight.mul_(8.0)
                layer.self_attn.kv_b_proj.weight.mul_(8.0)
        cfg = Config(
            model=model.cfg.attention_dims,
            num_layers=raw["num_hidden_layers"],
            prefill_backend=backend,
            decode_backend=backend,
            page_size=page,
            kv_dtype="float32",
            dtype="float32",
            num_pages=64,
            max_requests=4,
            max_context_len=128,
            device="cpu",
        )
        engines = (Engine(model, Runtime.build(cfg)), Engine(model, build_dcp_runtime(cfg, group)))
        report += _serve_both(engines, seq, f"page {page} chunked {chunked}")
    return report


@pytest.mark.parametrize("backend", BACKENDS)
def test_deepseek_v3_logits_with_dcp2_equal_single_process(backend: str) -> None:
    """Prefill (MHA mode), extend over a cached prefix (absorbed; chunked-prefix MHA with a
    prefix gathered from both ranks), decode eager and through the graph runner, verify with
    rejected drafts, extend again: fp32 logits within 1e-5 of the single-process engine's."""
    # The interpreted triton run (slow) takes one setup; both paths are backend-independent
    # on the DCP side (prefix rows gathered, MHA on every rank).
    setups = [(1, None), (16, 8)] if backend == "torch" else [(16, None)]
    reports = spawn(_model_worker, 2, "gloo", (backend, setups))
    bad = [
        f"rank {r}: {name} {err:.2e}"
        for r, rep in enumerate(reports)
        for name, err in rep
        if not err <= 1e-5
    ]
    assert not bad, "; ".join(bad)
    assert len(reports[0]) == len(setups) * 11


# ---------------------------------------------------------------------------- NCCL
@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["triton", "flashinfer_mla", "flashmla"])
def test_nccl_dcp2_equals_single_process_with_graphs(backend: str) -> None:
    """Over NCCL, DeepSeek-V3 dims: decode, verify, extend, H 16 / 128, replicated and TP
    heads, FP8 pools, and captured CUDA graphs with the collectives inside (50 replays over
    changing batches, no host sync). One launch a backend: a backend that compiles or hangs
    past a time limit leaves the others' results."""
    cases = [c for c in gpu_cases(2) if c.backend == backend]
    assert cases, backend
    results: dict[str, list[dict[str, Any]]] = {}
    for rank_results in spawn(parity_worker, 2, "nccl", (cases, "cuda")):
        for r in rank_results:
            results.setdefault(r["id"], []).append(r)
    bad = [
        f"{c.id} rank {r['rank']}: {r['detail']}"
        for c in cases
        for r in results[c.id]
        if not r["ok"]
    ]
    assert not bad, "\n".join(bad)


def _torch_backend() -> Any:
    """The wrapped backend DCPBackend's host-side checks read: torch on a CPU, SMALL dims."""
    return Runtime.build(CPU_SMALL).backend


@pytest.mark.parametrize("size", [2, 3, 4])
def test_dcp_graph_fill_gives_every_rank_the_inner_backends_fill(size: int) -> None:
    """M27 (dcp/backend.py:114 `self.layout.size *` dropped): a padded graph row's global
    seq_len must leave every rank at least the wrapped backend's fill (its kernels' floor,
    1); with the inner fill itself, ranks >= 1 got 0 keys in a padded row."""
    from types import SimpleNamespace

    from mla_backends.dcp.backend import DCPBackend

    inner = _torch_backend()
    want = inner.cuda_graph_seq_len_fill_value
    assert want >= 1
    for rank in range(size):
        be = DCPBackend(inner, SimpleNamespace(rank=rank, size=size))  # type: ignore[arg-type]
        fill = be.cuda_graph_seq_len_fill_value
        lay = DCPLayout(rank, size)
        assert all(lay.local_len(fill, k) >= want for k in range(size))


@pytest.mark.parametrize("size", [2, 3])
def test_dcp_extend_rows_are_consistent_bottom_right_batches(size: int) -> None:
    """B13 (dcp/metadata.py `pre_cpu = seq_cpu - ext_cpu` + 1): each local EXTEND row has
    prefix + q_len == kv_len (the bottom-right rule the wrapped backend implements), on the
    host and device copies alike."""
    from mla_backends.dcp.metadata import extend_metadata

    seq, ext = [5, 9, 1, 12], [5, 4, 1, 7]
    prefix = [s - n for s, n in zip(seq, ext)]
    batch = ForwardBatch.build(
        ForwardMode.EXTEND,
        [1, 2, 3, 4],
        prefix,
        ext,
        torch.zeros(sum(ext), dtype=torch.long),
        "cpu",
    )
    for r in range(size):
        loc = extend_metadata(DCPLayout(r, size), batch).local
        assert torch.equal(loc.extend_prefix_lens_cpu + loc.extend_seq_lens_cpu, loc.seq_lens_cpu)
        assert torch.equal(loc.extend_prefix_lens + loc.extend_seq_lens, loc.seq_lens)
        assert (loc.extend_prefix_lens_cpu >= 0).all()


def test_dcp_tp_heads_that_do_not_split_over_the_ranks_are_refused() -> None:
    """B18 (dcp/backend.py:88 the `h % group.size` check skipped): heads="tp" over a group
    that does not divide the heads is refused when the backend is built (the mutant built
    ranks with H // N heads: heads dropped, a shape error or wrong output later)."""
    from types import SimpleNamespace

    from mla_backends.dcp.backend import DCPBackend

    inner = _torch_backend()
    h = SMALL.num_heads
    bad = next(n for n in range(2, h + 2) if h % n)
    with pytest.raises(ValueError, match=rf"{h} heads do not split over {bad} ranks"):
        DCPBackend(inner, SimpleNamespace(rank=0, size=bad), heads="tp")  # type: ignore[arg-type]


def test_dcp_verify_reports_each_ranks_worst_error() -> None:
    """M51 (dcp/verify.py `_worst` max -> min): a DCP row's error is the largest of the
    rank's checks of that kind (the mutant reported the smallest: a bad graph replay hidden
    behind a good eager one); checks of the other kind are not counted."""
    from mla_backends.dcp.verify import _worst

    errs = {"out vs single": 1e-6, "out vs fp64": 3e-2, "lse vs single": 5.0, "lse graph": 0.5}
    assert _worst(errs, "out") == 3e-2
    assert _worst(errs, "lse") == 5.0
    assert _worst({}, "out") == 0.0


@pytest.mark.parametrize("rank, size", [(2, 2), (-1, 2), (0, 0)])
def test_a_rank_outside_its_group_is_refused(rank: int, size: int) -> None:
    with pytest.raises(ValueError, match=rf"DCP rank {rank} of size {size} is not a valid rank"):
        DCPLayout(rank, size)


def test_dcp_allocator_limits_and_refusals() -> None:
    """A local allocator with pages in use is refused (the group's page counts start at 0);
    a max_context_len above what the ranks' tables hold is capped to it (2 x 32 here); a
    negative length is refused with nothing taken."""
    req = ReqToTokenPool(2, 32, "cpu")
    req.alloc(2)
    used = PagedTokenAllocator(8, 4, req)
    used.alloc_extend([1], [1])
    with pytest.raises(ValueError, match="needs a fresh local allocator"):
        DCPTokenAllocator(DCPLayout(0, 2), used)
    used.free(1)
    alloc = DCPTokenAllocator(DCPLayout(0, 2), used, max_context_len=100)
    assert alloc.max_context_len == 64
    with pytest.raises(ValueError, match="length 65 exceeds the group's context limit 64"):
        alloc.alloc_extend([1], [65])
    alloc.alloc_extend([1, 2], [5, 3])
    with pytest.raises(ValueError, match=r"row 2: extend length -1 < 0"):
        alloc.alloc_extend([1, 2], [1, -1])
    assert alloc.seq_len(1) == 5 and alloc.seq_len(2) == 3 and alloc.available_pages == 6


def test_dcp_global_lengths_exempt_padding_and_drop_a_freed_row() -> None:
    """Batches are checked against `DCPTokenAllocator.filled`: row 0 (padding) reads any
    length, and a row whose KV was freed holds 0 tokens (a batch reading its old length is
    refused, as on one process)."""
    req = ReqToTokenPool(2, 32, "cpu")
    (row,) = req.alloc(1)
    alloc = DCPTokenAllocator(DCPLayout(1, 2), PagedTokenAllocator(8, 4, req))
    alloc.alloc_extend([row], [6])
    loc = alloc.alloc_decode([row])
    padded = torch.cat([loc, torch.zeros(1, dtype=torch.int64)])
    batch = ForwardBatch.build(ForwardMode.DECODE, [row, 0], [6, 40], [1, 1], padded, "cpu")
    req.check_batch(batch, alloc.filled)
    assert alloc.holds(torch.tensor(row))
    alloc.free(row)
    freed = r"reads 7 tokens \(prefix_lens 6 \+ 1 new\), the row has 0 stored"
    with pytest.raises(RequestRowError, match=freed):
        req.check_batch(batch, alloc.filled)
