"""Parity harness shared by the tests, `verify` and the GPU check: build a poisoned pool with a
chosen page layout, run one batch through a backend, compare with the MHA-expanded oracle.

Two comparisons per case, both on out and LSE:
- backend vs the absorbed reference on the *same* inputs (kernel precision alone), and
- backend out projected through w_vc vs the MHA-expanded oracle fed fp64 q_nope (end to end,
  so the rounding of q to the activation dtype counts too).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import torch

from mla_backends.arith import cdiv
from mla_backends.backends.base import MLABackend
from mla_backends.backends.paged_table import QueryQuantizer
from mla_backends.backends.protocol import AttentionBackend
from mla_backends.batch import ForwardBatch, ForwardMode, RaggedLayout
from mla_backends.config import KV_DTYPES, Config, MLADims
from mla_backends.reference import absorb_q, batch_reference, mha, project_v
from mla_backends.runtime import Runtime

# (out atol, out rtol, lse atol) per activation dtype: fp32 math on inputs rounded to it.
TOLERANCES: dict[str, tuple[float, float, float]] = {
    "float32": (2e-5, 2e-5, 2e-5),
    "float16": (4e-3, 4e-3, 4e-3),
    "bfloat16": (3e-2, 3e-2, 3e-2),
}
FP8_SCALE = 0.037  # non-unit on purpose: a backend that ignores the scale fails


@dataclass(frozen=True)
class Case:
    """One parity case. `kv_lens` are KV lengths after the step (prefix + new tokens)."""

    backend: str = "torch"
    mode: ForwardMode = ForwardMode.DECODE
    page_size: int = 16
    num_heads: int = 16
    kv_dtype: str = "bfloat16"
    dtype: str = "bfloat16"  # activation (q, out) dtype
    q_len: int = 1  # DECODE: 1; TARGET_VERIFY: draft tokens; EXTEND: 0 = random per request
    kv_lens: tuple[int, ...] = (1, 15, 16, 17, 40)
    # "monotonic": pages handed out 1, 2, ...; "shuffled": in random order (non-monotonic
    # tables); "interleaved": requests grow in turns so their pages alternate; "mixed": both.
    layout: str = "mixed"
    dims: MLADims = field(default_factory=lambda: MLADims())
    seed: int = 0
    joined_query: bool = False  # q_nope / q_rope as views of one [T, H, L + R] buffer

    @property
    def id(self) -> str:
        return (
            f"{self.backend}-{self.mode.value}-p{self.page_size}-h{self.num_heads}-"
            f"{self.kv_dtype}-{self.dtype}-q{self.q_len}-b{len(self.kv_lens)}-{self.layout}"
        )


@dataclass
class Result:
    case: Case
    out_err: float  # max |out - expanded oracle| (after w_vc)
    lse_err: float
    latent_err: float  # max |out - absorbed reference| on the same inputs
    ok: bool
    detail: str = ""


def effective_query(
    be: AttentionBackend, q_nope: torch.Tensor, q_rope: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The query the backend's kernel really attends with (FP8 q for TRT-LLM with an FP8 pool;
    q itself for every other backend)."""
    if isinstance(be, QueryQuantizer):
        return be.effective_query(q_nope, q_rope)
    return q_nope, q_rope


def _compare(
    name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float
) -> tuple[float, str]:
    """(max abs error, failure detail or ""). -inf must match -inf; NaN never passes."""
    got, want = got.double().cpu(), want.double().cpu()
    inf_g, inf_w = torch.isinf(got), torch.isinf(want)
    if not torch.equal(inf_g, inf_w) or not torch.equal(got[inf_g], want[inf_w]):
        return float("inf"), f"{name}: infinities differ"
    finite = ~inf_w
    diff = (got - want).abs().where(finite, torch.zeros((), dtype=torch.float64))
    if torch.isnan(got).any():
        return float("nan"), f"{name}: NaN at {torch.nonzero(torch.isnan(got))[0].tolist()}"
    bad = diff > atol + rtol * want.abs().where(finite, torch.zeros((), dtype=torch.float64))
    err = float(diff.max()) if diff.numel() else 0.0
    if bad.any():
        idx = torch.nonzero(bad)[0].tolist()
        return (
            err,
            f"{name}: worst {err:.3e} at {idx}: "
            f"got {got[tuple(idx)]:.6f} want {want[tuple(idx)]:.6f}",
        )
    return err, ""


def _page_order(case: Case, num_pages: int, rng: random.Random) -> list[int] | None:
    if case.layout in ("shuffled", "mixed"):
        order = list(range(1, num_pages + 1))
        rng.shuffle(order)
        return order
    return None


def _q_lens(case: Case, rng: random.Random) -> list[int]:
    if case.mode is ForwardMode.EXTEND:
        if case.q_len:
            return [min(case.q_len, n) for n in case.kv_lens]
        # Short requests are whole prompts (no prefix); long ones extend a cached prefix by a
        # few tokens (a long q block adds cost, not coverage).
        return [n if n <= case.page_size + 1 else rng.randint(1, min(n, 24)) for n in case.kv_lens]
    return [case.q_len] * len(case.kv_lens)


def _fill_prefix(
    rt: Runtime,
    rows: list[int],
    prefix: list[int],
    case: Case,
    gen: torch.Generator,
    rng: random.Random,
) -> None:
    """Allocate and store the cached prefix rows; "interleaved" grows requests in turns."""
    remaining = dict(zip(rows, prefix))
    turns = case.layout in ("interleaved", "mixed")
    chunk = max(1, case.page_size // 2) if turns else max(prefix, default=1)
    while any(remaining.values()):
        grow = [r for r in rows if remaining[r]]
        lens = [min(remaining[r], rng.randint(1, chunk) if turns else chunk) for r in grow]
        slots = rt.allocator.alloc_extend(grow, lens)
        _store_random(rt, slots, case, gen)
        for r, n in zip(grow, lens):
            remaining[r] -= n


def _random_rows(
    n: int, case: Case, gen: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    d = case.dims
    k_nope = torch.randn(n, d.kv_lora_rank, generator=gen).to(device, KV_DTYPES[case.dtype])
    k_rope = (2.0 * torch.randn(n, d.qk_rope_head_dim, generator=gen)).to(
        device, KV_DTYPES[case.dtype]
    )
    return k_nope, k_rope


def _store_random(rt: Runtime, slots: torch.Tensor, case: Case, gen: torch.Generator) -> None:
    k_nope, k_rope = _random_rows(slots.numel(), case, gen, rt.kv_pool.device)
    for layer in range(rt.config.num_layers):
        rt.kv_pool.set_mla_kv_buffer(layer, slots, k_nope, k_rope)


def build_case(case: Case, device: torch.device) -> tuple[Runtime, ForwardBatch]:
    """A runtime whose pool is NaN except for the rows the case stores, and the batch."""
    rng = random.Random(case.seed)
    gen = torch.Generator().manual_seed(case.seed)
    q_lens = _q_lens(case, rng)
    prefix = [max(n - q, 0) for n, q in zip(case.kv_lens, q_lens)]
    pages = sum(cdiv((n + 1), case.page_size) for n in case.kv_lens) + 2
    cfg = Config(
        model=case.dims.with_heads(case.num_heads),
        num_layers=1,
        prefill_backend=case.backend,
        decode_backend=case.backend,
        page_size=case.page_size,
        kv_dtype=case.kv_dtype,
        dtype=case.dtype,
        num_pages=pages,
        max_requests=len(case.kv_lens) + 1,
        max_context_len=max(max(case.kv_lens, default=1), 1) + 1,
        device=str(device),
    )
    rt = Runtime.build(cfg, _page_order(case, pages, rng))
    rt.kv_pool.kv_buffer[0].fill_(float("nan"))
    if rt.kv_pool.is_fp8:
        rt.kv_pool.set_scale(0, FP8_SCALE)
    rows = rt.req_pool.alloc(len(case.kv_lens))
    # Unused request rows point at NaN slots too (slot 0 is the dummy page, also NaN).
    _fill_prefix(rt, rows, prefix, case, gen, rng)
    # A zero-length KV row (kv_len 0) in DECODE / VERIFY keeps its query but sees no keys: its
    # new row goes to the dummy page and its seq_len stays 0 (the contract: out 0, lse -inf).
    live = [r for r, n in zip(rows, case.kv_lens) if n > 0]
    live_q = [q for q, n in zip(q_lens, case.kv_lens) if n > 0]
    new_slots = rt.allocator.alloc_extend(live, live_q)
    parts, start = [], 0
    for n, q in zip(case.kv_lens, q_lens):
        if n > 0:
            parts.append(new_slots[start : start + q])
            start += q
        else:
            parts.append(torch.zeros(q, dtype=torch.int64, device=new_slots.device))
    out_loc = torch.cat(parts) if parts else new_slots
    batch = ForwardBatch.build(case.mode, rows, prefix, q_lens, out_loc, device)
    if any(n == 0 for n in case.kv_lens):
        seq = torch.tensor(list(case.kv_lens), dtype=torch.int32)
        batch.seq_lens_cpu, batch.seq_lens = seq, seq.to(device)
    return rt, batch


def run_case(case: Case, device: torch.device | str = "cpu") -> Result:
    """Run one batch through `case.backend` and compare it with both references."""
    device = torch.device(device)
    rt, batch = build_case(case, device)
    gen = torch.Generator().manual_seed(case.seed + 1)
    d, h, t = case.dims, case.num_heads, batch.num_tokens
    act = KV_DTYPES[case.dtype]
    q_nope = torch.randn(t, h, d.qk_nope_head_dim, generator=gen, dtype=torch.float64)
    q_rope = torch.randn(t, h, d.qk_rope_head_dim, generator=gen, dtype=torch.float64)
    w_kc = torch.randn(h, d.qk_nope_head_dim, d.kv_lora_rank, generator=gen, dtype=torch.float64)
    w_kc /= d.qk_nope_head_dim**0.5
    w_vc = torch.randn(h, d.kv_lora_rank, d.v_head_dim, generator=gen, dtype=torch.float64)
    w_vc /= d.kv_lora_rank**0.5
    q_latent = absorb_q(q_nope, w_kc).to(device, act)
    q_rope_in = q_rope.to(device, act)
    if case.joined_query:
        joined = torch.cat([q_latent, q_rope_in], dim=-1)
        q_latent, q_rope_in = joined[..., : d.kv_lora_rank], joined[..., d.kv_lora_rank :]
    k_nope, k_rope = _random_rows(t, case, gen, device)

    be = rt.backend
    be.init_forward_metadata(batch)
    if isinstance(be, MLABackend) and not be.caps.lse:
        # a kernel without LSE (CUTLASS): out is checked, LSE cannot be
        out, lse = be.forward_absorbed(0, q_latent, q_rope_in, k_nope, k_rope, batch), None
    else:
        out, lse = be.forward_absorbed(0, q_latent, q_rope_in, k_nope, k_rope, batch, True)

    r2t = rt.req_pool.req_to_token
    scale = rt.config.model.softmax_scale
    # A kernel that takes q in FP8 (TRT-LLM, FP8 pool) is held to the absorbed reference on
    # the query it really used; absorbed equals expanded (tests/test_reference.py).
    q_eff = effective_query(be, q_latent, q_rope_in)
    ref_lat, ref_lat_lse = batch_reference(
        rt.kv_pool, 0, r2t, batch, *q_eff, w_kc, w_vc, scale, expanded=False
    )
    ref_out, ref_lse = batch_reference(rt.kv_pool, 0, r2t, batch, q_nope, q_rope, w_kc, w_vc, scale)
    atol, rtol, lse_tol = TOLERANCES[case.dtype]
    lat_err, d1 = _compare("out(latent)", out, ref_lat, atol, rtol)
    if isinstance(be, QueryQuantizer) and be.quantizes_query:
        ref_out, ref_lse = project_v(ref_lat, w_vc.to(ref_lat.device)), ref_lat_lse
    out_v = project_v(out.double(), w_vc.to(out.device))
    out_err, d3 = _compare("out(expanded)", out_v, ref_out, atol, rtol)
    lat_lse_err, d2, lse_err, d4 = 0.0, "", 0.0, ""
    if lse is not None:
        lat_lse_err, d2 = _compare("lse(latent)", lse, ref_lat_lse, lse_tol, 0.0)
        lse_err, d4 = _compare("lse(expanded)", lse, ref_lse, lse_tol, 0.0)
    detail = "; ".join(x for x in (d1, d2, d3, d4) if x)
    return Result(case, out_err, max(lse_err, lat_lse_err), lat_err, not detail, detail)


def run_mha_case(
    backend: str,
    q_lens: list[int],
    kv_lens: list[int],
    causal: bool,
    dtype: str = "bfloat16",
    num_heads: int = 16,
    dims: MLADims | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    return_lse: bool = True,
) -> Result:
    """MHA-mode prefill through `backend` vs the fp64 reference, per request. Rows of requests
    with no keys must be exactly 0 (and LSE -inf), with or without `return_lse`."""
    dims = (dims or MLADims()).with_heads(num_heads)
    device = torch.device(device)
    case = Case(
        backend=backend,
        mode=ForwardMode.EXTEND,
        num_heads=num_heads,
        dtype=dtype,
        kv_lens=tuple(kv_lens),
        dims=dims,
        seed=seed,
    )
    cfg = Config(
        model=dims,
        num_layers=1,
        prefill_backend=backend,
        decode_backend=backend,
        dtype=dtype,
        kv_dtype=dtype,
        num_pages=1,
        max_requests=1,
        device=str(device),
    )
    rt = Runtime.build(cfg)
    gen = torch.Generator().manual_seed(seed)
    act = KV_DTYPES[dtype]
    layout = RaggedLayout.from_lens(q_lens, kv_lens, device)
    q = torch.randn(layout.num_q, num_heads, dims.qk_head_dim, generator=gen).to(act)
    k = torch.randn(layout.num_kv, num_heads, dims.qk_head_dim, generator=gen).to(act)
    v = torch.randn(layout.num_kv, num_heads, dims.v_head_dim, generator=gen).to(act)
    q, k, v = (x.to(device) for x in (q, k, v))
    if return_lse:
        out, lse = rt.backend.forward_mha(q, k, v, layout, causal, return_lse=True)
    else:
        out, lse = rt.backend.forward_mha(q, k, v, layout, causal), None
    refs, ref_lses = [], []
    qo, kvp = layout.qo_indptr_cpu.tolist(), layout.kv_indptr_cpu.tolist()
    for i in range(layout.batch_size):
        o, lse_i = mha(
            q[qo[i] : qo[i + 1]],
            k[kvp[i] : kvp[i + 1]],
            v[kvp[i] : kvp[i + 1]],
            dims.softmax_scale,
            causal,
        )
        refs.append(o)
        ref_lses.append(lse_i)
    atol, rtol, lse_tol = TOLERANCES[dtype]
    out_err, d1 = _compare("out", out, torch.cat(refs), atol, rtol)
    lse_err, d2 = (
        (0.0, "") if lse is None else _compare("lse", lse, torch.cat(ref_lses), lse_tol, 0.0)
    )
    kv_lens_t = torch.tensor(kv_lens)
    empty = (kv_lens_t == 0).repeat_interleave(torch.tensor(q_lens), output_size=layout.num_q)
    d3 = ""
    if bool(empty.any()) and bool((out.cpu()[empty] != 0).any()):
        d3 = "out: rows of requests with no keys are not exactly 0"
    detail = "; ".join(x for x in (d1, d2, d3) if x)
    return Result(case, out_err, lse_err, out_err, not detail, detail)


# Activation / KV dtype pairs the parity matrix runs: "fp8" is an FP8 pool read by bf16 queries.
DTYPE_PAIRS: dict[str, tuple[str, str]] = {
    "float32": ("float32", "float32"),
    "bfloat16": ("bfloat16", "bfloat16"),
    "float16": ("float16", "float16"),
    "fp8": ("bfloat16", "float8_e4m3fn"),
}
MODES: dict[str, tuple[ForwardMode, int]] = {
    "decode": (ForwardMode.DECODE, 1),
    "verify": (ForwardMode.TARGET_VERIFY, 3),
    "extend": (ForwardMode.EXTEND, 0),
}


def edge_kv_lens(page_size: int, q_len: int = 1, long: int = 300) -> tuple[int, ...]:
    """KV lengths that break kernels: 0, 1, page - 1, page, page + 1, long. A query block of
    q_len tokens needs kv_len >= q_len, so non-zero lengths are raised to q_len."""
    raw = (0, 1, page_size - 1, page_size, page_size + 1, max(long, 2 * page_size + 37))
    return tuple(n if n == 0 else max(n, q_len) for n in raw)


def parity_cases(
    backend: str,
    page_sizes: tuple[int, ...],
    heads: tuple[int, ...] = (16, 128),
    dtypes: tuple[str, ...] = tuple(DTYPE_PAIRS),
    modes: tuple[str, ...] = tuple(MODES),
    long: int = 300,
) -> list[Case]:
    """The core parity matrix for one backend: every page size x heads x dtype x mode, each
    batch mixing the edge kv lengths on a shuffled, interleaved page layout."""
    cases = []
    for p in page_sizes:
        for h in heads:
            for dt in dtypes:
                for m in modes:
                    mode, q = MODES[m]
                    act, kv = DTYPE_PAIRS[dt]
                    cases.append(
                        Case(backend, mode, p, h, kv, act, q, edge_kv_lens(p, max(q, 1), long))
                    )
    return cases


class DecodeStream:
    """A stream of decode / verify batches over one poisoned pool, for graph tests: requests
    with random prompt lengths, each step a random subset of them (so batch sizes, lengths
    and page tables change from step to step) grows by q_len tokens."""

    def __init__(
        self,
        case: Case,
        device: torch.device | str,
        num_requests: int = 12,
        max_prompt: int = 300,
        max_context: int = 2048,
    ) -> None:
        self.case, self.device = case, torch.device(device)
        self.rng = random.Random(case.seed)
        self.gen = torch.Generator().manual_seed(case.seed)
        pages = num_requests * cdiv(max_context, case.page_size) + 1
        cfg = Config(
            model=case.dims.with_heads(case.num_heads),
            num_layers=1,
            prefill_backend=case.backend,
            decode_backend=case.backend,
            page_size=case.page_size,
            kv_dtype=case.kv_dtype,
            dtype=case.dtype,
            num_pages=pages,
            max_requests=num_requests,
            max_context_len=max_context,
            device=str(self.device),
        )
        self.rt = Runtime.build(cfg, _page_order(case, pages, self.rng))
        self.rt.kv_pool.kv_buffer[0].fill_(float("nan"))
        if self.rt.kv_pool.is_fp8:
            self.rt.kv_pool.set_scale(0, FP8_SCALE)
        self.rows = self.rt.req_pool.alloc(num_requests)
        prompts = [self.rng.randint(1, max_prompt) for _ in self.rows]
        _fill_prefix(self.rt, self.rows, prompts, case, self.gen, self.rng)

    def step(self, n: int) -> tuple[ForwardBatch, dict[str, torch.Tensor]]:
        d, q, act = self.case.dims, max(self.case.q_len, 1), KV_DTYPES[self.case.dtype]
        rows = self.rng.sample(self.rows, n)
        prefix = [self.rt.allocator.seq_len(r) for r in rows]
        loc = self.rt.allocator.alloc_extend(rows, [q] * n)
        mode = ForwardMode.DECODE if q == 1 else ForwardMode.TARGET_VERIFY
        batch = ForwardBatch.build(mode, rows, prefix, [q] * n, loc, self.device)
        t, h = n * q, self.case.num_heads

        def rnd(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=self.gen).to(self.device, act)

        inputs = {
            "q_nope": rnd(t, h, d.kv_lora_rank),
            "q_rope": rnd(t, h, d.qk_rope_head_dim),
            "k_nope": rnd(t, d.kv_lora_rank),
            "k_rope": rnd(t, d.qk_rope_head_dim),
        }
        return batch, inputs

    def reference(self, batch: ForwardBatch, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Absorbed fp64 reference over the pool as it is now (new rows already stored)."""
        be = self.rt.backend
        q = effective_query(be, inputs["q_nope"], inputs["q_rope"])
        out, _ = batch_reference(
            self.rt.kv_pool,
            0,
            self.rt.req_pool.req_to_token,
            batch,
            *q,
            None,
            None,
            self.rt.config.model.softmax_scale,
            expanded=False,
        )
        return out


def absorbed_forward(backend, batch: ForwardBatch, inputs: dict[str, torch.Tensor]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The forward a graph runner captures in tests: store the new rows, attend, layer 0."""
    return backend.forward_absorbed(
        0, inputs["q_nope"], inputs["q_rope"], inputs["k_nope"], inputs["k_rope"], batch
    )


def ragged_prefill_lens(causal: bool, long: bool = True) -> tuple[list[int], list[int]]:
    """Ragged MHA-prefill requests: one with no keys, one with no queries, one long. Causal
    (bottom-right) needs kv_len >= q_len, so kv lengths are raised to the query lengths."""
    q_lens, kv_lens = (
        ([1, 300, 0, 77, 128], [1, 1000, 30, 0, 128])
        if long
        else ([1, 19, 0, 5, 6], [1, 40, 3, 0, 6])
    )
    if causal:
        kv_lens = [max(q, k) for q, k in zip(q_lens, kv_lens)]
    return q_lens, kv_lens


def with_batch(case: Case, batch: int) -> Case:
    """The case with `batch` requests, cycling through its kv lengths."""
    lens = case.kv_lens
    return dataclasses.replace(case, kv_lens=tuple(lens[i % len(lens)] for i in range(batch)))
