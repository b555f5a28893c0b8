"""DCP parity checks, run on every rank of a group: a single-process runtime and this rank's
DCP runtime hold the same requests (same rows, same random KV, each with its own shuffled
page order and NaN-poisoned pool); the same batch goes through both. The DCP result must
equal the single-process one and the fp64 absorbed reference within the dtype's tolerance,
rows no rank can see must be exactly out 0 / lse -inf, and every rank must hold exactly its
tokens (global position p at local index p // N on rank p % N).

Used by tests/test_dcp.py (gloo, CPU) and scripts/bench_dcp.py (NCCL, GPUs).
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from mla_backends.arith import cdiv
from mla_backends.backends.base import MLABackend
from mla_backends.backends.protocol import AttentionBackend
from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.config import DEEPSEEK_V3, KV_DTYPES, Config, MLADims
from mla_backends.dcp.runtime import DCPRuntime, build_dcp_runtime
from mla_backends.graph_runner import CudaGraphRunner, InputSpec
from mla_backends.reference import batch_reference
from mla_backends.runtime import Runtime
from mla_backends.testing import FP8_SCALE, TOLERANCES, compare, effective_query

# Kernel-legal tiny dims for the triton interpreter: powers of two, distinct.
SMALL = MLADims(
    num_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16
)


@dataclass(frozen=True)
class DCPCase:
    """One DCP parity case. `kv_lens` are global KV lengths after the step; `num_heads` is
    the group's H (each rank holds H / N of them in "tp" mode)."""

    backend: str = "torch"
    mode: ForwardMode = ForwardMode.DECODE
    q_len: int = 1  # TARGET_VERIFY: draft tokens; EXTEND: 0 = random per request
    page_size: int = 16
    num_heads: int = 4
    heads: str = "replicated"
    kv_lens: tuple[int, ...] = (0, 1, 2, 3, 15, 16, 17, 40)
    dtype: str = "float32"
    kv_dtype: str = "float32"
    dims: MLADims = field(default_factory=lambda: SMALL)
    prefill_backend: str | None = None  # EXTEND's backend in both runtimes (default: backend)
    graphs: bool = False  # decode / verify stream through the graph runner
    undefined_empty: bool = False  # wrap the rank's backend in `UndefinedEmptyRows`
    steps: int = 4  # graph stream: steps
    seed: int = 0

    @property
    def id(self) -> str:
        g = f"-graph{self.steps}" if self.graphs else ""
        u = "-undef" if self.undefined_empty else ""
        pre = self.prefill_backend
        u += f"-prefill_{pre}" if pre not in (None, self.backend) else ""
        return (
            f"{self.backend}-{self.mode.value}-q{self.q_len}-p{self.page_size}-h{self.num_heads}-"
            f"{self.heads}-{self.kv_dtype}-b{len(self.kv_lens)}{g}{u}"
        )


class UndefinedEmptyRows(MLABackend):
    """A backend whose rows without keys come back undefined (out NaN, lse 30, which would
    win any merge): what FlashInfer and FlashMLA return there when the host cannot mask
    them, inside a captured graph. Decided on the device. DCP must not depend on it."""

    name = "undefined_empty"

    def __init__(self, inner: MLABackend[Any]) -> None:
        super().__init__(inner.ctx)
        self.inner = inner

    @property
    def supports_graphs(self) -> bool:
        return self.inner.supports_graphs

    @property
    def cuda_graph_seq_len_fill_value(self) -> int:
        return self.inner.cuda_graph_seq_len_fill_value

    def _build_metadata(self, batch: ForwardBatch) -> None:
        self.inner.init_forward_metadata(batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.inner.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self.inner.init_forward_metadata_capture(batch)
        self._metadata_for = batch

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        self.inner.init_forward_metadata_replay(batch)
        self._metadata_for = batch

    def store_kv(
        self, layer: int, loc: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor
    ) -> None:
        self.inner.store_kv(layer, loc, k_nope, k_rope)

    def _attend_absorbed(
        self, layer: int, q_nope: Tensor, q_rope: Tensor, batch: ForwardBatch, need_lse: bool
    ) -> tuple[Tensor, Tensor | None]:
        out, lse = self.inner._attend_absorbed(layer, q_nope, q_rope, batch, True)
        ext = batch.extend_seq_lens.long()
        qo = torch.cumsum(ext, 0) - ext  # first token of each request
        req = torch.repeat_interleave(
            torch.arange(ext.numel(), device=ext.device), ext, output_size=batch.num_tokens
        )
        j = torch.arange(batch.num_tokens, device=ext.device) - qo[req]
        empty = batch.seq_lens.long()[req] - ext[req] + j + 1 <= 0
        assert lse is not None
        return out.masked_fill(empty[:, None, None], float("nan")), lse.masked_fill(
            empty[:, None], 30.0
        )


def edge_lens(size: int, page: int, long: int = 0) -> tuple[int, ...]:
    """Ragged global lengths: shorter than the group (0-3), around a local page edge on every
    rank (N * page - 1, N * page, N * page + 1), one odd longer one, and `long` if given."""
    edge = size * page
    return (0, 1, 2, 3, edge - 1, edge, edge + 1, 2 * edge + 37) + ((long,) if long else ())


def gpu_cases(size: int = 2) -> list[DCPCase]:
    """The NCCL equality matrix (DeepSeek-V3 dims, bf16): triton, flashinfer_mla and flashmla
    (EXTEND through triton, as its runtime would) at their page sizes; decode, verify and
    extend at H 16; H 128 decode and TP-heads verify; FP8 pools where the backend takes them;
    captured CUDA graphs with NCCL collectives inside, replayed over changing batches."""
    bf16: dict[str, Any] = {"dtype": "bfloat16", "kv_dtype": "bfloat16", "dims": DEEPSEEK_V3}
    cases = []
    for be, pages, fp8 in (
        ("triton", (16, 64), True),
        ("flashinfer_mla", (1, 64), True),
        ("flashmla", (64,), False),
    ):
        pre = "triton" if be == "flashmla" else None
        for p in pages:
            lens = edge_lens(size, p, long=3001)
            kw: dict[str, Any] = {"kv_lens": lens, "prefill_backend": pre, **bf16}
            cases += [
                DCPCase(be, ForwardMode.DECODE, 1, p, 16, **kw),
                DCPCase(be, ForwardMode.TARGET_VERIFY, 2, p, 16, **kw),
                DCPCase(be, ForwardMode.EXTEND, 0, p, 16, **kw),
                DCPCase(be, ForwardMode.DECODE, 1, p, 128, **kw),
                DCPCase(be, ForwardMode.TARGET_VERIFY, 2, p, 128, "tp", **kw),
            ]
        p = pages[-1]
        kw = {"kv_lens": edge_lens(size, p, long=3001), "prefill_backend": pre, **bf16}
        cases += [
            DCPCase(be, ForwardMode.DECODE, 1, p, 128, graphs=True, steps=50, **kw),
            DCPCase(be, ForwardMode.TARGET_VERIFY, 2, p, 16, "tp", graphs=True, steps=20, **kw),
        ]
        if fp8:
            kw = dict(kw, kv_dtype="float8_e4m3fn")
            cases.append(DCPCase(be, ForwardMode.DECODE, 1, p, 16, **kw))
    return cases


class DCPPair:
    """A single-process runtime and this rank's DCP runtime over the same requests."""

    def __init__(
        self,
        case: DCPCase,
        group: dist.ProcessGroup,
        device: torch.device,
        num_requests: int,
        max_context: int,
        num_pages: int,
    ) -> None:
        self.case, self.device = case, device
        self.rng = random.Random(case.seed)  # same stream on every rank
        self.gen = torch.Generator().manual_seed(case.seed)
        cfg = Config(
            model=case.dims.with_heads(case.num_heads),
            num_layers=1,
            prefill_backend=case.prefill_backend or case.backend,
            decode_backend=case.backend,
            page_size=case.page_size,
            kv_dtype=case.kv_dtype,
            dtype=case.dtype,
            num_pages=num_pages,
            max_requests=num_requests + 1,
            max_context_len=max_context,
            device=str(device),
        )
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.group, self.rank, self.size = group, rank, size
        self.single = Runtime.build(cfg, self._order(num_pages, case.seed))
        local_heads = case.num_heads // size if case.heads == "tp" else case.num_heads
        dcp_cfg = dataclasses.replace(cfg, model=case.dims.with_heads(local_heads))
        order = self._order(num_pages, case.seed * 131 + rank + 1)
        self.dcp: DCPRuntime = build_dcp_runtime(dcp_cfg, group, case.heads, order)
        if case.undefined_empty:
            inner = self.dcp.backend.inner
            assert isinstance(inner, MLABackend), "undefined_empty wraps one backend"
            self.dcp.backend.inner = UndefinedEmptyRows(inner)
        for pool in (self.single.kv_pool, self.dcp.kv_pool):
            pool.kv_buffer[0].fill_(float("nan"))
            if pool.is_fp8:
                pool.set_scale(0, FP8_SCALE)
        self.rows = self.single.req_pool.alloc(num_requests)
        if self.dcp.req_pool.alloc(num_requests) != self.rows:
            raise AssertionError("request rows differ between the runtimes")
        h = case.num_heads // size
        self.heads = slice(rank * h, (rank + 1) * h) if case.heads == "tp" else slice(None)

    @staticmethod
    def _order(num_pages: int, seed: int) -> list[int]:
        order = list(range(1, num_pages + 1))
        random.Random(seed).shuffle(order)
        return order

    def _rand(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        x = scale * torch.randn(*shape, generator=self.gen)
        return x.to(self.device, KV_DTYPES[self.case.dtype])

    def grow(
        self, rows: list[int], lens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Allocate `lens` tokens on both runtimes: (single slots, DCP slots, k_nope, k_rope)."""
        loc_s = self.single.allocator.alloc_extend(rows, lens)
        loc_d = self.dcp.allocator.alloc_extend(rows, lens)
        t, d = sum(lens), self.case.dims
        return (
            loc_s,
            loc_d,
            self._rand(t, d.kv_lora_rank),
            self._rand(t, d.qk_rope_head_dim, scale=2.0),
        )

    def fill(self, rows: list[int], lens: list[int]) -> None:
        """Store prompts of `lens` tokens, requests growing in turns (interleaved pages); the
        DCP side through its backend's store_kv (dummy slot for tokens it does not own)."""
        left = dict(zip(rows, lens))
        chunk = max(1, self.case.page_size // 2)
        while any(left.values()):
            grow = [r for r in rows if left[r]]
            n = [min(left[r], self.rng.randint(1, chunk)) for r in grow]
            loc_s, loc_d, kn, kr = self.grow(grow, n)
            self.single.kv_pool.set_mla_kv_buffer(0, loc_s, kn, kr)
            self.dcp.backend.store_kv(0, loc_d, kn, kr)
            for r, k in zip(grow, n):
                left[r] -= k

    def single_attend(
        self,
        batch: ForwardBatch,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        k_nope: torch.Tensor,
        k_rope: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The single-process (out, lse), computed on rank 0 and broadcast (on every rank it
        would multiply the CPU tests' work by N); every rank stores the new rows."""
        be = self.single.backend
        if self.rank == 0:
            be.init_forward_metadata(batch)
            out, lse = be.forward_absorbed(0, q_nope, q_rope, k_nope, k_rope, batch, True)
            out, lse = out.contiguous(), lse.contiguous()
        else:
            be.store_kv(0, batch.out_cache_loc, k_nope, k_rope)
            out = torch.empty_like(q_nope)
            lse = torch.empty(q_nope.shape[:2], dtype=torch.float32, device=q_nope.device)
        src = dist.get_global_rank(self.group, 0)
        dist.broadcast(out, src, group=self.group)
        dist.broadcast(lse, src, group=self.group)
        return out, lse

    def queries(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        d, h = self.case.dims, self.case.num_heads
        return self._rand(t, h, d.kv_lora_rank, scale=0.3), self._rand(t, h, d.qk_rope_head_dim)

    def check_layout(self) -> str:
        """Every rank holds exactly its tokens, at local index p // N: bitwise."""
        s_r2t, d_r2t = self.single.req_pool.req_to_token, self.dcp.req_pool.req_to_token
        lay, bad = self.dcp.layout, []
        for row in self.rows:
            n = self.single.allocator.seq_len(row)
            if self.dcp.allocator.seq_len(row) != n:
                bad.append(f"row {row}: global length {self.dcp.allocator.seq_len(row)} != {n}")
                continue
            m = lay.local_len(n)
            mine = self.dcp.kv_pool.kv_buffer[0][d_r2t[row, :m].long()]
            pos = torch.arange(m, device=self.device) * lay.size + lay.rank
            want = self.single.kv_pool.kv_buffer[0][s_r2t[row, pos].long()]
            if not torch.equal(mine.view(torch.uint8), want.view(torch.uint8)):
                bad.append(f"row {row}: local rows differ from positions {pos.tolist()[:4]}...")
        return "; ".join(bad)


def _q_lens(case: DCPCase, rng: random.Random) -> list[int]:
    if case.mode is ForwardMode.EXTEND:
        if case.q_len:
            return [min(case.q_len, n) for n in case.kv_lens]
        # Short requests are whole prompts (no prefix); long ones extend a cached prefix.
        return [n if n <= 3 else rng.randint(1, min(n, 24)) for n in case.kv_lens]
    return [case.q_len] * len(case.kv_lens)


def _result(case: DCPCase, rank: int, checks: list[tuple[str, float, str]]) -> dict[str, Any]:
    detail = "; ".join(f"{name}: {d}" for name, _, d in checks if d)
    return {
        "id": case.id,
        "rank": rank,
        "ok": not detail,
        "errors": {name: err for name, err, _ in checks},
        "detail": detail,
    }


def _empty_rows_exact(out: torch.Tensor, lse: torch.Tensor, vis: torch.Tensor) -> str:
    """Rows that see no key anywhere: out exactly 0, lse exactly -inf."""
    empty = (vis == 0).to(out.device)
    if not empty.any():
        return ""
    if bool((out[empty] != 0).any()) or bool((lse[empty] != float("-inf")).any()):
        return "rows without keys are not exactly out 0 / lse -inf"
    return ""


def run_dcp_case(case: DCPCase, group: dist.ProcessGroup, device: torch.device) -> dict[str, Any]:
    """One batch (DECODE, TARGET_VERIFY or EXTEND) through the DCP backend on this rank."""
    if case.graphs:
        return run_dcp_stream(case, group, device)
    if not case.kv_lens:
        return _run_empty_batch(case, group, device)
    pages = sum(cdiv(n + 1, case.page_size) for n in case.kv_lens) + 2
    pair = DCPPair(case, group, device, len(case.kv_lens), max(max(case.kv_lens), 1) + 1, pages)
    q_lens = _q_lens(case, pair.rng)
    prefix = [max(n - q, 0) for n, q in zip(case.kv_lens, q_lens)]
    pair.fill(pair.rows, prefix)
    # A zero-length request in DECODE / VERIFY keeps its query but sees no keys (the parity
    # harness's convention): its new row goes to the dummy page, its seq_len stays 0.
    live = [i for i, n in enumerate(case.kv_lens) if n > 0]
    loc_s, loc_d, kn_live, kr_live = pair.grow(
        [pair.rows[i] for i in live], [q_lens[i] for i in live]
    )
    t = sum(q_lens)
    d = case.dims
    loc_s_all = torch.zeros(t, dtype=torch.int64, device=device)
    loc_d_all = torch.zeros(t, dtype=torch.int64, device=device)
    kn = torch.zeros(t, d.kv_lora_rank, dtype=kn_live.dtype, device=device)
    kr = torch.zeros(t, d.qk_rope_head_dim, dtype=kr_live.dtype, device=device)
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    idx = torch.tensor(
        [s + j for i in live for s in [starts[i]] for j in range(q_lens[i])], dtype=torch.int64
    ).to(device)
    if idx.numel():
        loc_s_all[idx], loc_d_all[idx], kn[idx], kr[idx] = loc_s, loc_d, kn_live, kr_live
    batches = []
    for loc in (loc_s_all, loc_d_all):
        b = ForwardBatch.build(case.mode, pair.rows, prefix, q_lens, loc, device)
        if any(n == 0 for n in case.kv_lens):
            lens = [0 if n == 0 else p + q for n, p, q in zip(case.kv_lens, prefix, q_lens)]
            seq = torch.tensor(lens, dtype=torch.int32)
            b.seq_lens_cpu, b.seq_lens = seq, seq.to(device)
        batches.append(b)
    q_nope, q_rope = pair.queries(t)
    hs = pair.heads

    single = pair.single.backend
    want, want_lse = pair.single_attend(batches[0], q_nope, q_rope, kn, kr)
    dcp = pair.dcp.backend
    dcp.init_forward_metadata(batches[1])
    got, got_lse = dcp.forward_absorbed(
        0, q_nope[:, hs].contiguous(), q_rope[:, hs].contiguous(), kn, kr, batches[1], True
    )
    ref, ref_lse = batch_reference(
        pair.single.kv_pool,
        0,
        pair.single.req_pool.req_to_token,
        batches[0],
        *effective_query(single, q_nope, q_rope),
        None,
        None,
        pair.single.config.model.softmax_scale,
        expanded=False,
    )
    atol, rtol, lse_tol = TOLERANCES[case.dtype]
    vis = dcp.metadata.vis if dcp.metadata is not None else torch.zeros(0)
    checks = [
        ("out vs single", *compare("out", got, want[:, hs], atol, rtol)),
        ("lse vs single", *compare("lse", got_lse, want_lse[:, hs], lse_tol, 0.0)),
        ("out vs reference", *compare("out", got, ref[:, hs], atol, rtol)),
        ("lse vs reference", *compare("lse", got_lse, ref_lse[:, hs], lse_tol, 0.0)),
        ("empty rows", 0.0, _empty_rows_exact(got, got_lse, vis)),
        ("layout", 0.0, pair.check_layout()),
    ]
    if case.mode is ForwardMode.EXTEND:  # chunked-prefix MHA reads the prefix from all ranks
        checks.append(("prefix rows", 0.0, _same_prefix_rows(single, dcp, batches)))
    return _result(case, pair.rank, checks)


def _run_empty_batch(
    case: DCPCase, group: dist.ProcessGroup, device: torch.device
) -> dict[str, Any]:
    """A batch of no requests (an idle step every rank of the group takes together)."""
    pair = DCPPair(case, group, device, 1, 2, 2)
    empty = torch.zeros(0, dtype=torch.int64)
    batch = ForwardBatch.build(case.mode, [], [], [], empty, device)
    q_nope, q_rope = pair.queries(0)
    h = q_nope.shape[1] // (pair.size if case.heads == "tp" else 1)
    dcp = pair.dcp.backend
    dcp.init_forward_metadata(batch)
    out, lse = dcp.forward_absorbed(0, q_nope[:, :h], q_rope[:, :h], None, None, batch, True)
    lat = case.dims.kv_lora_rank
    ok = out.shape == (0, h, lat) and lse.shape == (0, h)
    return _result(case, pair.rank, [("shapes", 0.0, "" if ok else f"{out.shape} {lse.shape}")])


def _same_prefix_rows(
    single: AttentionBackend, dcp: MLABackend[Any], batches: list[ForwardBatch]
) -> str:
    want, got = single.load_prefix(0, batches[0]), dcp.load_prefix(0, batches[1])
    for name, w, g in zip(("latent", "rope"), want, got):
        if w.shape != g.shape or not torch.equal(w, g):
            return f"{name} prefix rows differ from the single-process ones"
    return ""


def _absorbed_with_lse(
    backend: Any, batch: ForwardBatch, inputs: dict[str, torch.Tensor]
) -> torch.Tensor:
    """What the graph runner captures: store, attend, and return out and lse in one tensor
    [T, H, L + 1] fp32 (the runner hands back one output)."""
    out, lse = backend.forward_absorbed(
        0, inputs["q_nope"], inputs["q_rope"], inputs["k_nope"], inputs["k_rope"], batch, True
    )
    return torch.cat([out.float(), lse[..., None]], dim=-1)


def run_dcp_stream(case: DCPCase, group: dist.ProcessGroup, device: torch.device) -> dict[str, Any]:
    """Decode / verify steps through the graph runner (captured on CUDA, the same padded
    static-buffer path eagerly elsewhere): each step a different subset of requests grows,
    so batch sizes pad (1, 2, 4, 8), lengths and page tables change between replays."""
    q = max(case.q_len, 1)
    n_req = len(case.kv_lens)
    max_ctx = max(case.kv_lens) + case.steps * q + 1
    pages = n_req * (cdiv(max_ctx, case.page_size) + 1) + 2
    pair = DCPPair(case, group, device, n_req, max_ctx, pages)
    live = [i for i, n in enumerate(case.kv_lens) if n > 0]
    pair.fill([pair.rows[i] for i in live], [case.kv_lens[i] for i in live])
    d, act = case.dims, KV_DTYPES[case.dtype]
    h_local = case.num_heads // pair.size if case.heads == "tp" else case.num_heads
    specs = {
        "q_nope": InputSpec((h_local, d.kv_lora_rank), act),
        "q_rope": InputSpec((h_local, d.qk_rope_head_dim), act),
        "k_nope": InputSpec((d.kv_lora_rank,), act),
        "k_rope": InputSpec((d.qk_rope_head_dim,), act),
    }
    dcp = pair.dcp.backend
    use_graphs = device.type == "cuda"
    # every batch a step may draw (up to all n_req requests) has a captured size
    sizes = tuple(1 << i for i in range(max(n_req - 1, 0).bit_length() + 1))
    runner = CudaGraphRunner(
        dcp, partial(_absorbed_with_lse, dcp), specs, sizes, q, device, use_graphs
    )
    runner.capture()
    mode = ForwardMode.DECODE if q == 1 else ForwardMode.TARGET_VERIFY
    atol, rtol, lse_tol = TOLERANCES[case.dtype]
    checks: list[tuple[str, float, str]] = []
    buf = pair.dcp.kv_pool.kv_buffer[0]
    for step in range(case.steps):
        n = min(len(pair.rows), 1 + pair.rng.randrange(len(pair.rows)))
        rows = pair.rng.sample(pair.rows, n)
        prefix = [pair.single.allocator.seq_len(r) for r in rows]
        loc_s, loc_d, kn, kr = pair.grow(rows, [q] * n)
        b_s = ForwardBatch.build(mode, rows, prefix, [q] * n, loc_s, device)
        b_d = ForwardBatch.build(mode, rows, prefix, [q] * n, loc_d, device)
        q_nope, q_rope = pair.queries(n * q)
        want, want_lse = pair.single_attend(b_s, q_nope, q_rope, kn, kr)
        hs = pair.heads
        inputs = {
            "q_nope": q_nope[:, hs].contiguous(),
            "q_rope": q_rope[:, hs].contiguous(),
            "k_nope": kn,
            "k_rope": kr,
        }
        keep = torch.ones(buf.shape[0], dtype=torch.bool, device=device)
        keep[: case.page_size] = False  # the dummy page takes padded and non-owned writes
        keep[loc_d] = False
        before = buf[keep].clone()
        if use_graphs:
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = runner.replay(b_d, inputs, check_pointers=True).clone()
        finally:
            if use_graphs:
                torch.cuda.set_sync_debug_mode(0)
        lat = d.kv_lora_rank
        tag = f"step {step} (n={n})"
        stray = (
            ""
            if torch.equal(buf[keep].view(torch.uint8), before.view(torch.uint8))
            else ("a padded or non-owned row wrote a real slot")
        )
        checks += [
            (f"{tag} out", *compare("out", got[..., :lat], want[:, hs].float(), atol, rtol)),
            (f"{tag} lse", *compare("lse", got[..., lat], want_lse[:, hs], lse_tol, 0.0)),
            (f"{tag} stores", 0.0, stray),
        ]
    checks.append(("layout", 0.0, pair.check_layout()))
    return _result(case, pair.rank, checks)


def parity_worker(
    rank: int, group: dist.ProcessGroup, cases: list[DCPCase], device: str = "cpu"
) -> list[dict[str, Any]]:
    """Every case on this rank (`launch.spawn` target). Rank 0 prints a line a case as it
    ends: a run that stops at a time limit still says how far it came."""
    dev = torch.device(device if device == "cpu" else f"cuda:{torch.cuda.current_device()}")
    out = []
    begin = time.perf_counter()
    for case in cases:  # a rank that raises ends the launch (the launcher stops the others)
        start = time.perf_counter()
        out.append(run_dcp_case(case, group, dev))
        out[-1]["seconds"] = time.perf_counter() - start
        if rank == 0:
            state = "ok" if out[-1]["ok"] else "FAIL"
            took, total = out[-1]["seconds"], time.perf_counter() - begin
            print(f"[dcp {total:6.1f}s] {case.id}: {state} ({took:.1f}s)", flush=True)
    return out
