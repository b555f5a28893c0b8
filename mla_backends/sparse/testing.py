"""Parity harness for the sparse backends, shared by the CPU and GPU tests and the benchmark:
a poisoned pool (NaN in every row no request owns; 0xFF bytes, NaN everywhere, in FP8 rows),
requests on shuffled pages, each query token's index row a random duplicate-free subset of
its visible keys (exactly min(topk, visible) of them, -1 elsewhere at random places), and the
fp64 `sparse_reference` on the same inputs."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from mla_backends.allocator import PagedTokenAllocator
from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.config import KV_DTYPES, MLADims
from mla_backends.pool import MLATokenToKVPool, ReqToTokenPool
from mla_backends.sparse.base import (
    SparseContext,
    SparseMLABackend,
    create_sparse_backend,
    get_sparse_backend_class,
)
from mla_backends.sparse.fp8_row import Fp8RowPool
from mla_backends.sparse.reference import sparse_reference
from mla_backends.testing import TOLERANCES, _compare

FP8_SCALE = 0.037  # per-layer scale of e4m3 standard pools: non-unit on purpose


@dataclass(frozen=True)
class SparseCase:
    backend: str = "torch"
    pool: str = "bfloat16"  # a standard pool dtype, "fp8" (e4m3, per-layer scale), "fp8_row"
    dtype: str = "bfloat16"  # activations
    mode: ForwardMode = ForwardMode.DECODE
    q_len: int = 1  # DECODE 1, TARGET_VERIFY > 1; EXTEND: new tokens of each request
    kv_lens: tuple[int, ...] = (1, 5, 40, 70)  # after the step
    topk: int = 32
    page_size: int = 16
    dims: MLADims = field(default_factory=lambda: MLADims(16, 128, 16, 16, 16))
    drop: float = 0.0  # share of valid entries turned into -1 (not for exact-count backends)
    empty_row: bool = False  # one token's row all -1
    joined_q: bool = False  # q_nope / q_rope as column ranges of one [T, H, L + R] buffer
    seed: int = 0
    check_support: bool = True  # False: build the class directly (emulated kernels on CPU)

    @property
    def id(self) -> str:
        extra = f"-drop{self.drop}" if self.drop else ""
        extra += "-empty" if self.empty_row else ""
        extra += "-joined" if self.joined_q else ""
        return (
            f"{self.backend}-{self.pool}-{self.dtype}-{self.mode.value}-q{self.q_len}-"
            f"h{self.dims.num_heads}-k{self.topk}-b{len(self.kv_lens)}{extra}"
        )


def kernel_cases(
    pools: dict[str, tuple[str, ...]],
    modes: dict[str, tuple[ForwardMode, int]],
    kv_lens: tuple[int, ...],
    topk: int,
    check_support: bool = True,
) -> list[SparseCase]:
    """The parity grid of the kernel backends at DeepSeek's dims: each backend x its pools x
    each mode x H 16 / 128, page 64. Every backend but `flashinfer_mla` also gets dropped
    entries and an all -1 row; `flashinfer_mla` reads exactly min(topk, visible) entries, so
    its rows keep the indexer's exact count. H 128 passes its query as the two column ranges
    of one buffer (how a model writing both projections into one buffer calls), H 16 as two
    tensors."""
    out = []
    for backend, backend_pools in pools.items():
        exact = backend == "flashinfer_mla"
        for pool in backend_pools:
            for mode, q in modes.values():
                for h in (16, 128):
                    dims = MLADims(h, 512, 64, 128, 128, 40.0, 1.0)
                    out.append(
                        SparseCase(
                            backend,
                            pool,
                            "bfloat16",
                            mode,
                            q,
                            kv_lens,
                            topk,
                            64,
                            dims,
                            drop=0.0 if exact else 0.2,
                            empty_row=not exact,
                            joined_q=h == 128,
                            check_support=check_support,
                        )  # fmt: skip
                    )
    return out


@dataclass
class Built:
    backend: SparseMLABackend
    batch: ForwardBatch
    q_nope: torch.Tensor
    q_rope: torch.Tensor
    indices: torch.Tensor


def _pool(case: SparseCase, pages: int, device: torch.device) -> MLATokenToKVPool | Fp8RowPool:
    """The case's pool format, every row NaN-poisoned (an FP8 pool at `FP8_SCALE`)."""
    d, ps = case.dims, case.page_size
    if case.pool == "fp8_row":
        rows = Fp8RowPool(1, pages, ps, d.kv_lora_rank, d.qk_rope_head_dim, device)
        rows.kv_buffer[0].fill_(0xFF)  # e4m3 0xFF, fp32 and bf16 all-ones bits: NaN
        return rows
    kv = "float8_e4m3fn" if case.pool == "fp8" else case.pool
    pool = MLATokenToKVPool(1, pages, ps, d.kv_lora_rank, d.qk_rope_head_dim, KV_DTYPES[kv], device)
    pool.kv_buffer[0].fill_(float("nan"))
    if pool.is_fp8:
        pool.set_scale(0, FP8_SCALE)
    return pool


def context(case: SparseCase, device: torch.device | str) -> SparseContext:
    """The case's context over a one-page pool and a one-row table: enough for `supports`
    (nothing stored, nothing built)."""
    device = torch.device(device)
    req = ReqToTokenPool(1, case.page_size, device)
    return SparseContext(case.dims, _pool(case, 1, device), req, case.topk, KV_DTYPES[case.dtype])


def build(case: SparseCase, device: torch.device | str) -> Built:
    device = torch.device(device)
    rng = random.Random(case.seed)
    gen = torch.Generator().manual_seed(case.seed)
    d, act = case.dims, KV_DTYPES[case.dtype]
    ps, n = case.page_size, len(case.kv_lens)
    pages = sum(-(-max(k, case.q_len) // ps) for k in case.kv_lens) + 2
    pool = _pool(case, pages, device)
    max_ctx = max(max(case.kv_lens), case.q_len) + 1
    req = ReqToTokenPool(n, max_ctx, device)
    order = list(range(1, pages + 1))
    rng.shuffle(order)
    alloc = PagedTokenAllocator(pages, ps, req, order)
    rows = req.alloc(n)
    q_lens = [min(case.q_len, k) for k in case.kv_lens]
    kv_lens = list(case.kv_lens)
    if case.mode is ForwardMode.TARGET_VERIFY:  # equal q_len: contexts raised to it
        q_lens, kv_lens = [case.q_len] * n, [max(k, case.q_len) for k in kv_lens]
    # Requests grow in turns so their pages interleave.
    remaining = {r: k - q for r, k, q in zip(rows, kv_lens, q_lens)}
    while any(remaining.values()):
        grow = [r for r in rows if remaining[r]]
        lens = [min(remaining[r], rng.randint(1, ps)) for r in grow]
        _store(pool, alloc.alloc_extend(grow, lens), d, act, gen)
        for r, k in zip(grow, lens):
            remaining[r] -= k
    prefix = [alloc.seq_len(r) for r in rows]
    loc = alloc.alloc_extend(rows, q_lens)
    _store(pool, loc, d, act, gen)
    batch = ForwardBatch.build(case.mode, rows, prefix, q_lens, loc, device)

    r2t = req.req_to_token.cpu()
    idx = torch.full((batch.num_tokens, case.topk), -1, dtype=torch.int32)
    t = 0
    for r, p, q in zip(rows, prefix, q_lens):
        for j in range(q):
            vis = p + j + 1
            pos = rng.sample(range(vis), min(case.topk, vis))
            if case.drop:
                pos = [x for x in pos if rng.random() >= case.drop]
            cols = rng.sample(range(case.topk), len(pos))
            idx[t, cols] = r2t[r, pos].to(torch.int32)
            t += 1
    if case.empty_row:
        idx[rng.randrange(batch.num_tokens)] = -1
    h = d.num_heads
    if case.joined_q:
        joined = torch.randn(batch.num_tokens, h, d.kv_dim, generator=gen).to(device, act)
        q_nope, q_rope = joined[..., : d.kv_lora_rank], joined[..., d.kv_lora_rank :]
    else:
        q_nope = torch.randn(batch.num_tokens, h, d.kv_lora_rank, generator=gen).to(device, act)
        q_rope = torch.randn(batch.num_tokens, h, d.qk_rope_head_dim, generator=gen)
        q_rope = q_rope.to(device, act)
    ctx = SparseContext(d, pool, req, case.topk, act)
    if case.check_support:
        backend = create_sparse_backend(case.backend, ctx)
    else:
        backend = get_sparse_backend_class(case.backend)(ctx)
    return Built(backend, batch, q_nope, q_rope, idx.to(device))


def _store(
    pool: MLATokenToKVPool | Fp8RowPool,
    loc: torch.Tensor,
    d: MLADims,
    act: torch.dtype,
    gen: torch.Generator,
) -> None:
    k_nope = torch.randn(loc.numel(), d.kv_lora_rank, generator=gen).to(pool.device, act)
    k_rope = (2.0 * torch.randn(loc.numel(), d.qk_rope_head_dim, generator=gen)).to(
        pool.device, act
    )
    pool.set_mla_kv_buffer(0, loc, k_nope, k_rope)


def run(case: SparseCase, device: torch.device | str = "cpu") -> tuple[float, float, str]:
    """(max out error, max lse error, failure detail or "") of the backend against the fp64
    reference on the same inputs, with the activation dtype's tolerances."""
    b = build(case, device)
    b.backend.init_forward_metadata(b.batch)
    out, lse = b.backend.forward_sparse(0, b.q_nope, b.q_rope, b.indices, b.batch, True)
    ref_out, ref_lse = sparse_reference(
        b.backend.pool, 0, b.q_nope, b.q_rope, b.indices, b.backend.scale
    )
    atol, rtol, lse_tol = TOLERANCES[case.dtype]
    e1, d1 = _compare("out", out, ref_out, atol, rtol)
    e2, d2 = _compare("lse", lse, ref_lse, lse_tol, 0.0)
    return e1, e2, "; ".join(x for x in (d1, d2) if x)
