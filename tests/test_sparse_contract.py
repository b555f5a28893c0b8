"""The `flashmla` and `flashinfer_mla` sparse backends on CPU, their kernels replaced by
plain-PyTorch emulations of the documented contracts (`sparse/emulation.py`): head and index
padding, the 656-byte row view, EXTEND remapping, compaction and CSR gathers, plan / run
order, LSE conventions and empty rows, against the fp64 sparse reference; and a V3.2 engine's
graph path (static buffers, padded batches) through them. The real kernels: test_sparse_gpu."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from mla_backends.backends.emulation import KernelContractError
from mla_backends.backends.flashinfer_kernel import FaPlan
from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.checks import ShapeError
from mla_backends.config import Config, MLADims
from mla_backends.sparse import flashinfer_mla as fi_mod
from mla_backends.sparse import flashmla as fm_mod
from mla_backends.sparse.emulation import FaMLAEmulation, FlashMLAEmulation
from mla_backends.sparse.testing import SparseCase, build, kernel_cases, run

MODES = {
    "decode": (ForwardMode.DECODE, 1),
    "verify": (ForwardMode.TARGET_VERIFY, 2),
    "extend": (ForwardMode.EXTEND, 5),
}
KV_LENS = (1, 100, 127, 128, 129, 300)


def _dims(h: int) -> MLADims:
    return MLADims(h, 512, 64, 128, 128, 40.0, 1.0)


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    fm = FlashMLAEmulation()
    made: list[FaMLAEmulation] = []

    def fa(*args: object) -> FaMLAEmulation:
        made.append(FaMLAEmulation(*args))  # type: ignore[arg-type]
        return made[-1]

    monkeypatch.setattr(fm_mod, "load_kernels", lambda: fm)
    monkeypatch.setattr(fi_mod, "load_kernel", fa)
    return {"flashmla": fm, "flashinfer": made}


def _cases() -> list[SparseCase]:
    pools = {"flashmla": ("bfloat16", "fp8_row"), "flashinfer_mla": ("bfloat16", "fp8")}
    return kernel_cases(pools, MODES, KV_LENS, 128, check_support=False)


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.id)
def test_contract_parity(kernels: dict[str, object], case: SparseCase) -> None:
    _, _, detail = run(case)
    assert not detail, detail
    fm = kernels["flashmla"]
    assert isinstance(fm, FlashMLAEmulation)
    if case.backend == "flashmla":  # the kernel each mode must take
        fp8_decode = case.pool == "fp8_row" and case.mode is not ForwardMode.EXTEND
        assert (fm.decode_calls, fm.prefill_calls > 1) == (int(fp8_decode), not fp8_decode)


@pytest.mark.parametrize(
    "backend, pool",
    [("flashmla", "fp8_row"), ("flashmla", "bfloat16"), ("flashinfer_mla", "bfloat16")],
)
def test_a_query_in_another_dtype_than_the_kernels_is_one_shape_error(
    kernels: dict[str, object], backend: str, pool: str
) -> None:
    """The vendor kernels are built for the context's activation dtype: an fp16 / fp32 query
    failed inside the kernel's wrapper, naming no argument (helper 58's review)."""
    case = SparseCase(
        backend, pool, "bfloat16", ForwardMode.DECODE, 1, (200, 300), 128, 64, _dims(16),
        check_support=False,
    )  # fmt: skip
    b = build(case, "cpu")
    sp = b.backend
    sp.init_forward_metadata(b.batch)
    for dt in (torch.float16, torch.float32):
        with pytest.raises(ShapeError, match=r"q_nope: expected dtype in \['torch.bfloat16'\]"):
            sp.forward_sparse(0, b.q_nope.to(dt), b.q_rope.to(dt), b.indices, b.batch)
    assert torch.isfinite(sp.forward_sparse(0, b.q_nope, b.q_rope, b.indices, b.batch)).all()


def test_flashmla_base2_prefill_lse_is_measured_and_converted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FlashMLA before 082094b wrote base-2 LSE and -inf for empty rows: the construction
    probe finds the base, the backend converts it, and empty rows still read -inf."""
    monkeypatch.setattr(fm_mod, "load_kernels", lambda: FlashMLAEmulation("2"))
    case = SparseCase(
        "flashmla", "bfloat16", "bfloat16", ForwardMode.EXTEND, 5, KV_LENS, 128, 64, _dims(16),
        drop=0.2, empty_row=True, check_support=False,
    )  # fmt: skip
    assert build(case, "cpu").backend._lse_factor == pytest.approx(math.log(2))
    _, _, detail = run(case)
    assert not detail, detail


def test_flashinfer_long_extend_plans_each_chunk_before_its_run(
    kernels: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan fills the kernel's one workspace: chunks of a long EXTEND are planned one by
    one, right before their runs (planning all first would run every chunk on the last
    plan, which the emulation's single workspace would expose)."""
    monkeypatch.setattr(fi_mod, "MAX_PLAN_TOKENS", 4)
    case = SparseCase(
        "flashinfer_mla", "bfloat16", "bfloat16", ForwardMode.EXTEND, 5, KV_LENS, 128, 64,
        _dims(16), check_support=False,
    )  # fmt: skip
    _, _, detail = run(case)
    assert not detail, detail
    [fa] = kernels["flashinfer"]  # type: ignore[misc]
    tokens = 1 + 5 * 5  # the kv_len 1 request has one new token
    assert fa.plans == fa.runs == -(-tokens // 4)


def test_flashmla_graph_replay_recomputes_the_whole_fp8_schedule(
    kernels: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """FP8 rows, decode through the graph hooks: capture, then a replay with other lengths
    refills all T + 1 splits of the static buffer. The emulation's splits are zeros, so here
    they are the lengths' prefix sums (a split table depends on the lengths, as the
    kernel's does), and a stale last entry shows."""
    fm = kernels["flashmla"]
    assert isinstance(fm, FlashMLAEmulation)
    zeros = fm.get_mla_metadata

    def by_length(**kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        tile, splits = zeros(**kw)
        return tile, torch.cat([splits[:1], kw["cache_seqlens"].cumsum(0, dtype=torch.int32)])

    monkeypatch.setattr(fm, "get_mla_metadata", by_length)
    case = SparseCase("flashmla", "fp8_row", kv_lens=(1, 5, 40, 70), topk=128, page_size=64,
                      dims=_dims(16), check_support=False)  # fmt: skip
    b = build(case, "cpu")
    be, real = b.backend, b.batch
    be.init_cuda_graph_state(4, 4)
    rows, loc = real.req_pool_indices.tolist(), real.out_cache_loc
    for hook, pre in (
        (be.init_forward_metadata_capture, [0, 4, 39, 69]),
        (be.init_forward_metadata_replay, [0, 2, 19, 34]),
    ):
        static = ForwardBatch.build(ForwardMode.DECODE, rows, pre, [1] * 4, loc, "cpu")
        hook(static)
        md, state = be.metadata, be.graph_state
        assert isinstance(md, fm_mod.FlashMLASparseMetadata) and md.splits is not None
        assert isinstance(state, fm_mod.FlashMLASparseGraphState)
        assert md.splits.data_ptr() == state.splits.data_ptr()
        assert md.splits.tolist() == [0, *torch.tensor(pre).add(1).cumsum(0).tolist()]


def test_flashinfer_graph_of_more_tokens_than_one_plan_is_refused(
    kernels: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A captured launch holds one plan: a graph batch of MAX_PLAN_TOKENS + 1 tokens is
    refused in one line, one of MAX_PLAN_TOKENS is captured."""
    monkeypatch.setattr(fi_mod, "MAX_PLAN_TOKENS", 4)
    case = SparseCase("flashinfer_mla", kv_lens=(1, 5, 40, 70, 33), topk=128, page_size=64,
                      dims=_dims(16), check_support=False)  # fmt: skip
    b = build(case, "cpu")
    be, real = b.backend, b.batch
    be.init_cuda_graph_state(8, 8)
    with pytest.raises(ValueError, match=r"graphs of more than 4 tokens are not supported"):
        be.init_forward_metadata_capture(real)
    rows, pre = real.req_pool_indices[:4].tolist(), real.extend_prefix_lens_cpu[:4].tolist()
    four = ForwardBatch.build(ForwardMode.DECODE, rows, pre, [1] * 4, real.out_cache_loc[:4], "cpu")
    be.init_forward_metadata_capture(four)
    assert be.metadata is not None and be.metadata.valid.tolist() == [1, 5, 40, 70]


def test_emulations_reject_what_the_kernels_reject() -> None:
    fm = FlashMLAEmulation()
    q = torch.zeros(2, 1, 64, 576, dtype=torch.bfloat16)
    kc = torch.zeros(1, 64, 1, 656, dtype=torch.float8_e4m3fn)
    idx = torch.full((2, 1, 64), -1, dtype=torch.int32)
    seq, table = torch.ones(2, dtype=torch.int32), torch.empty(2, 0, dtype=torch.int32)
    tile, splits = fm.get_mla_metadata(seq, 64, 1, 64, True, 64)
    base = dict(softmax_scale=0.1, causal=False, is_fp8_kvcache=True)
    out, lse = fm.flash_mla_with_kvcache(q, kc, table, seq, 512, tile, splits, indices=idx, **base)
    assert out.shape == (2, 1, 64, 512) and torch.isinf(lse).all() and (lse > 0).all()
    bad = idx.clone()
    bad[0, 0, 0] = 64  # one past the cache: an illegal memory access on the GPU
    with pytest.raises(KernelContractError, match="past the cache"):
        fm.flash_mla_with_kvcache(q, kc, table, seq, 512, tile, splits, indices=bad, **base)
    with pytest.raises(KernelContractError, match="Unsupported h_q 16"):
        fm.flash_mla_with_kvcache(
            q[:, :, :16], kc, table, seq, 512, tile, splits, indices=idx, **base
        )
    below = idx.clone()
    below[0, 0, 0] = -2
    wide = torch.zeros(1, 64, 1, 672, dtype=torch.float8_e4m3fn)[..., :656]  # rows 672 apart
    call: dict[str, Any] = dict(q=q, k_cache=kc, block_table=table, cache_seqlens=seq,
                                head_dim_v=512, tile_scheduler_metadata=tile, num_splits=splits,
                                indices=idx, **base)  # fmt: skip
    changes: list[tuple[dict[str, Any], str]] = [
        ({"softmax_scale": None}, "softmax scale"),
        ({"indices": below}, "indices below -1"),
        ({"causal": True}, "causal must be False"),
        ({"k_cache": wide}, "stride"),
    ]
    for change, msg in changes:
        with pytest.raises(KernelContractError, match=msg):
            fm.flash_mla_with_kvcache(**{**call, **change})
    kv = torch.zeros(10, 1, 576, dtype=torch.bfloat16)
    with pytest.raises(KernelContractError, match="topk % 128"):
        fm.flash_mla_sparse_fwd(q[:, 0], kv, torch.zeros(2, 1, 64, dtype=torch.int32), 0.1)
    # prefill: an index >= s_kv is unused, as -1 is
    kv, qr = torch.randn(10, 1, 576).bfloat16(), torch.randn(2, 64, 576).bfloat16()
    unused = torch.full((2, 1, 128), -1, dtype=torch.int32)
    unused[:, 0, :5] = torch.arange(5)
    past = unused.clone()
    past[:, 0, 5:] = 10
    for a, b in zip(*(fm.flash_mla_sparse_fwd(qr, kv, i, 0.1) for i in (unused, past))):
        assert torch.equal(a, b)
    fa = FaMLAEmulation(torch.device("cpu"), torch.bfloat16, torch.bfloat16, 512, 64)
    with pytest.raises(KernelContractError, match="run before plan"):
        plan = FaPlan(None, torch.zeros(1, dtype=torch.int32), False, 1, 0.1)
        out = torch.empty(1, 1, 512)
        fa.run(plan, (q[:, 0, :, :512], q[:, 0, :, 512:]), (kv, kv), out, None, 1.0)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    with pytest.raises(KernelContractError, match="page size 1: pages = lens"):
        fa.plan(i32(0, 1, 2), i32(0, 2, 5), i32(2, 2), 64, 512, False)
    fa.plan(i32(0, 1, 2), i32(0, 2, 2), i32(2, 0), 64, 512, False)  # row 1: no keys
    qa = (qr[..., :512], qr[..., 512:])
    rows = torch.randn(4, 1, 512).bfloat16(), torch.randn(4, 1, 64).bfloat16()
    out, lse = torch.zeros(2, 64, 512, dtype=torch.bfloat16), torch.zeros(2, 64)
    fa.run(FaPlan(None, i32(1, 3), False, 1, 0.1), qa, rows, out, lse, 1.0)
    assert out[0].isfinite().all() and out[1].isnan().all() and lse[1].isnan().all()
    for plan, qb, msg in [
        (FaPlan(None, i32(1, 4), False, 1, 0.1), qa, "a page id out of the cache"),
        (FaPlan(None, i32(1, 3), True, 1, 0.1), qa, "plan mismatch"),
        (FaPlan(None, i32(1, 3), False, 1, 0.1), (qa[0][:1], qa[1][:1]), "q rows != the plan's"),
    ]:
        with pytest.raises(KernelContractError, match=msg):
            fa.run(plan, qb, rows, out, lse, 1.0)


# ----------------------------------------------------------------------------- V3.2 engine
V32_RAW = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, q_lora_rank=48, kv_lora_rank=512,
    qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16, n_routed_experts=8,
    n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
    routed_scaling_factor=2.5, first_k_dense_replace=2, index_n_heads=8, index_head_dim=64,
    index_topk=64,
)  # fmt: skip


def _model():  # type: ignore[no-untyped-def]
    from mla_backends.models.deepseek_v32 import DeepseekV32Config, DeepseekV32ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV32ForCausalLM(DeepseekV32Config.from_hf(V32_RAW))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
    return model.to(torch.bfloat16).eval()


def _engine(model, sparse: str, fp8_rows: bool):  # type: ignore[no-untyped-def]
    from mla_backends.models.engine import Engine
    from mla_backends.runtime import Runtime
    from mla_backends.sparse.base import SparseContext, get_sparse_backend_class
    from mla_backends.sparse.dsa import DSABackend
    from mla_backends.sparse.fp8_row import Fp8RowPool
    from mla_backends.sparse.indexer import Indexer, IndexKCache

    c = model.cfg
    cfg = Config(
        model=c.attention_dims, num_layers=2, prefill_backend="torch", decode_backend="torch",
        page_size=64, kv_dtype="bfloat16", dtype="bfloat16", num_pages=16, max_requests=4,
        max_context_len=512, device="cpu",
    )  # fmt: skip
    rt = Runtime.build(cfg)
    dims = c.indexer_dims(True)
    latent = Fp8RowPool(2, 16, 64, 512, 64) if fp8_rows else rt.kv_pool
    cache = IndexKCache(2, latent.num_slots, dims.head_dim, True, "cpu")
    indexer = Indexer(dims, cache, rt.req_pool.req_to_token, "torch")
    ctx = SparseContext(c.attention_dims, latent, rt.req_pool, dims.topk, torch.bfloat16)
    sp = get_sparse_backend_class(sparse)(ctx)
    dsa = DSABackend(None if fp8_rows else rt.backend, indexer, sp)
    return Engine(model, rt, dsa)


ENGINE_CASES = [("flashmla", False), ("flashmla", True), ("flashinfer_mla", False)]


def _follow_selection(leader: Any, follower: Any) -> list[int]:
    """The follower engine's indexer returns the leader's last selection of the same layer
    (run the leader first, every step). Hazard: past layer 0 the indexer's inputs are bf16
    activations that two attention backends round differently, so a near-tie in the scores
    can flip one selected slot, and the logits would then measure that flip, not the
    backend (seen on AVX-512 / AMX CPUs: 0.035 against the 2e-2 bound). Layer 0's inputs are
    bit-identical: there the follower must select the same set on its own. Returns the
    count of layer-0 checks made."""
    picked: dict[int, torch.Tensor] = {}
    checked = [0]
    lead_select, own_select = leader.backend.indexer.select, follower.backend.indexer.select

    def lead(layer: int, *args: Any) -> torch.Tensor:
        picked[layer] = lead_select(layer, *args)
        return picked[layer]

    def follow(layer: int, *args: Any) -> torch.Tensor:
        own = own_select(layer, *args)
        theirs = picked.pop(layer)[: own.shape[0]]  # the leader's batch may be padded
        if layer == 0:
            assert torch.equal(own.sort(-1).values, theirs.sort(-1).values), "layer 0 selection"
            checked[0] += 1
        return theirs

    leader.backend.indexer.select, follower.backend.indexer.select = lead, follow
    return checked


@pytest.mark.parametrize(
    "sparse, fp8_rows", ENGINE_CASES, ids=["flashmla", "flashmla-fp8row", "flashinfer"]
)
def test_v32_engine_graph_path_through_emulated_kernels(
    kernels: dict[str, object], sparse: str, fp8_rows: bool
) -> None:
    """Dense MLPs (no MoE routing flips in bf16). Prompts longer than topk (sparse prefill),
    then decode steps through the graph runner's static padded batches (replay hooks, no
    capture on CPU), against the torch sparse backend on the same pool format and the same
    index selection (`_follow_selection`)."""
    model = _model()
    ref, eng = _engine(model, "torch", fp8_rows), _engine(model, sparse, fp8_rows)
    eng.enable_graphs([1, 2, 4], use_graphs=False)
    checked = _follow_selection(eng, ref)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (80, 20, 100)]
    rows = [e.new_requests(3) for e in (eng, ref)]
    out, want = (e.extend(r, prompts) for e, r in zip((eng, ref), rows))
    assert float((out - want).abs().max() / want.abs().max()) <= 2e-2
    for step in range(4):
        k = 3 if step % 2 == 0 else 2
        toks = torch.randint(0, 96, (k,), generator=gen).tolist()
        out, want = (e.decode(r[:k], toks) for e, r in zip((eng, ref), rows))
        err = float((out - want).abs().max() / want.abs().max())
        assert err <= 2e-2, f"step {step}: {err}"
    assert checked[0] == 5  # layer 0 of the prefill and of each decode step
    fm = kernels["flashmla"]
    assert isinstance(fm, FlashMLAEmulation)
    assert (fm.decode_calls > 0) == (sparse == "flashmla" and fp8_rows)  # FP8 decode kernel


def test_flashinfer_replay_fails_loudly_if_the_plan_layout_moves(
    kernels: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    eng = _engine(model, "flashinfer_mla", False)
    eng.enable_graphs([1, 2], use_graphs=False)
    rows = eng.new_requests(2)
    eng.extend(rows, [[1] * 70, [2] * 3])
    [fa] = kernels["flashinfer"]  # type: ignore[misc]
    monkeypatch.setattr(fa, "plan", lambda *a: (0, 0, 0))  # a planner whose grid moved
    with pytest.raises(RuntimeError, match="plan layout changed since capture"):
        eng.decode(rows, [3, 4])


def test_case_ids_are_unique() -> None:
    ids = [c.id for c in _cases()]
    assert len(set(ids)) == len(ids)
