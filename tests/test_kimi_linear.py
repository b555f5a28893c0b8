"""The Kimi-Linear-style hybrid model (KDA + NoPE MLA, 3 : 1) on HybridBackend, CPU paths:
incremental decode equals the full-sequence forward with requests joining and leaving, and
padded decode rows never touch a real request's state."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from mla_backends.backends.hybrid import HybridBackend
from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.checks import ShapeError
from mla_backends.config import Config, MLADims
from mla_backends.linear.backend import LinearAttentionBackend
from mla_backends.linear.state_pool import LinearStatePool
from mla_backends.models.engine import Engine
from mla_backends.models.kimi_linear import (
    KimiLinearConfig,
    KimiLinearForCausalLM,
    short_conv,
    short_conv_step,
)
from mla_backends.pool import LayerIndexError
from mla_backends.runtime import Runtime

CFG = KimiLinearConfig()


def _model(
    cfg: KimiLinearConfig = CFG, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> KimiLinearForCausalLM:
    torch.manual_seed(0)
    m = KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    return m.to(device, dtype)


def _engine(
    model: KimiLinearForCausalLM,
    backend: str = "torch",
    device: str = "cpu",
    dtype: str = "float32",
    page: int = 16,
) -> Engine:
    cfg = model.cfg
    kinds = cfg.kinds
    n_full, n_lin = kinds.count("full"), kinds.count("linear")
    dims = MLADims(
        num_heads=cfg.mla_heads,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        v_head_dim=cfg.v_head_dim,
    )
    rt = Runtime.build(
        Config(
            model=dims,
            num_layers=n_full,
            prefill_backend=backend,
            decode_backend=backend,
            page_size=page,
            kv_dtype=dtype,
            dtype=dtype,
            num_pages=64,
            max_requests=6,
            device=device,
        )
    )
    h, d = cfg.kda_heads, cfg.kda_head_dim
    pool = LinearStatePool(n_lin, 6, h, d, d, 3 * h * d, cfg.conv_kernel, device)
    return Engine(model, rt, HybridBackend(rt.backend, LinearAttentionBackend(pool), kinds))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_short_conv_split_equals_one_pass() -> None:
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 5, generator=gen), torch.randn(5, 4, generator=gen)
    s0 = torch.randn(5, 3, generator=gen)
    full, s = short_conv(x, w, s0)
    a, s1 = short_conv(x[:4], w, s0)
    b, s2 = short_conv(x[4:], w, s1)
    torch.testing.assert_close(torch.cat([a, b]), full)
    torch.testing.assert_close(s2, s)
    torch.testing.assert_close(s, x[-3:].t())


def _full(model: KimiLinearForCausalLM, backend: str, seq: list[int]) -> torch.Tensor:
    eng = _engine(model, backend)
    [r] = eng.new_requests(1)
    return eng.extend([r], [seq])


def _incremental_equals_full(
    model: KimiLinearForCausalLM, engine, graphs: bool, tol: float
) -> None:  # type: ignore[no-untyped-def]
    """Two requests prefill and decode; one leaves, a new one joins (maybe on its row: its
    state must start from zero), the other extends; each request's logits over all steps
    equal one full-sequence forward. With `graphs`, decode steps replay captured graphs."""
    vocab = model.cfg.vocab_size
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (14, 9, 11)]
    eng = engine()
    if graphs:
        eng.enable_graphs([1, 2, 4])
    a, b = eng.new_requests(2)
    got: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}
    out = eng.extend([a, b], [seqs[0][:6], seqs[1][:4]])
    got[0].append(out[:6])
    got[1].append(out[6:])
    for i in range(5):  # decode both
        out = eng.decode([a, b], [seqs[0][6 + i], seqs[1][4 + i]])
        got[0].append(out[:1])
        got[1].append(out[1:])
    eng.free(b)  # b leaves; c joins and may reuse its row: its state must start from zero
    [c] = eng.new_requests(1)
    out = eng.extend([c], [seqs[2][:7]])
    got[2].append(out)
    out = eng.extend([a], [seqs[0][11:13]])  # a extends over its state and cached prefix
    got[0].append(out)
    for i in range(1):
        out = eng.decode([c, a], [seqs[2][7 + i], seqs[0][13 + i]])
        got[2].append(out[:1])
        got[0].append(out[1:])
    lens = {0: 14, 1: 9, 2: 8}
    for k, parts in got.items():
        full = engine()
        [r] = full.new_requests(1)
        want = full.extend([r], [seqs[k][: lens[k]]])
        err = _rel(torch.cat(parts), want)
        print(f"request {k}: incremental vs full {err:.2e}")
        assert err <= tol, (k, err)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interp)])
def test_incremental_equals_full_with_requests_joining_and_leaving(backend: str) -> None:
    model = _model()
    _incremental_equals_full(model, lambda: _engine(model, backend), False, 1e-4)


class _NoHostCopy(torch.Tensor):
    """Stands for a tensor on the GPU: reading it on the host (a device-to-host sync) fails."""

    def _refuse(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("host copy of the device tensor req_pool_indices")

    tolist = item = cpu = numpy = _refuse
    __iter__ = __int__ = __index__ = __bool__ = __float__ = _refuse

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        for a in (*args, kwargs.get("device")):
            if isinstance(a, torch.Tensor):
                a = a.device
            if isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu":
                self._refuse()
        return super().to(*args, **kwargs)


def test_prefill_reads_the_request_rows_from_the_batchs_host_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The linear layers' per-request prefill loops (the torch recurrence, the short conv)
    take the rows from the batch's CPU copy: a `.tolist()` of the device tensor was a host
    sync in every linear layer of every prefill on a GPU."""
    build = ForwardBatch.build.__func__  # type: ignore[attr-defined]

    def device_only_rows(cls, *args, **kwargs):  # type: ignore[no-untyped-def]
        b = build(cls, *args, **kwargs)
        b.req_pool_indices = b.req_pool_indices.as_subclass(_NoHostCopy)
        return b

    monkeypatch.setattr(ForwardBatch, "build", classmethod(device_only_rows))
    model = _model()
    eng = _engine(model)
    rows = eng.new_requests(2)
    got = eng.extend(rows, [[1, 2, 3], [4, 5]])
    monkeypatch.undo()
    ref = _engine(model)
    want = ref.extend(ref.new_requests(2), [[1, 2, 3], [4, 5]])
    assert torch.equal(got, want)


def test_a_batch_without_a_host_copy_reads_its_rows_once_not_per_layer() -> None:
    """A batch with no CPU copy of its rows (`req_pool_indices_cpu` None): the prefill loops of
    the 6 linear layers (recurrence and short conv, 12 loops) copy the rows to the host once."""
    reads: list[int] = []

    class Counted(torch.Tensor):
        def tolist(self):  # type: ignore[no-untyped-def]
            reads.append(1)
            return super().tolist()

    model = _model()
    eng = _engine(model)
    rows = eng.new_requests(2)
    loc = eng.rt.allocator.alloc_extend(rows, [3, 2])
    batch = ForwardBatch.build(ForwardMode.EXTEND, rows, [0, 0], [3, 2], loc, "cpu")
    batch.req_pool_indices_cpu = None
    batch.req_pool_indices = batch.req_pool_indices.as_subclass(Counted)
    eng.backend.init_forward_metadata(batch)
    got = model(torch.tensor([1, 2, 3, 4, 5]), batch, eng.backend)
    assert len(reads) == 1, f"{len(reads)} host copies of the device rows"
    ref = _engine(model)
    assert torch.equal(got, ref.extend(ref.new_requests(2), [[1, 2, 3], [4, 5]]))


@pytest.mark.parametrize("mode", [ForwardMode.IDLE, ForwardMode.TARGET_VERIFY])
def test_an_idle_batch_through_a_kda_layer_is_empty_and_touches_no_state(
    mode: ForwardMode,
) -> None:
    """A KDA layer on an IDLE batch (no requests, no tokens) after a prefill: [0, hidden] out,
    no recurrent or conv state touched (its `reshape(0, -1)` raised)."""
    model = _model()
    eng = _engine(model)
    eng.extend(eng.new_requests(2), [[1, 2, 3], [4, 5]])
    pool = eng.backend.linear.pool
    rec, conv = pool.recurrent.clone(), pool.conv.clone()
    idle = ForwardBatch.build(mode, [], [], [], torch.zeros(0, dtype=torch.int64), "cpu")
    eng.backend.init_forward_metadata(idle)
    layer = model.layers[0]
    assert layer.kind == "linear"
    with torch.no_grad():
        out = layer.attn(torch.zeros(0, CFG.hidden_size), idle, eng.backend)
    assert out.shape == (0, CFG.hidden_size)
    assert torch.equal(pool.recurrent, rec) and torch.equal(pool.conv, conv)


def test_engine_static_padded_decode_path_on_cpu() -> None:
    """The graph runner's padded static-buffer path (no capture) through the hybrid."""
    model = _model()
    eng = _engine(model)
    eng.enable_graphs([1, 2, 4], use_graphs=False)
    ref = _engine(model)
    for e in (eng, ref):
        rows = e.new_requests(3)
        e.extend(rows, [[1, 2, 3], [4, 5], [6]])
    for step in range(3):
        want, got = (e.decode([1, 2, 3], [7 + step, 8, 9]) for e in (ref, eng))
        assert _rel(got, want) <= 1e-5
    # slot 0 is the dummy the padded row wrote; every request's slot must match
    got, want = eng.backend.linear.pool.recurrent, ref.backend.linear.pool.recurrent
    torch.testing.assert_close(got[:, 1:], want[:, 1:], rtol=1e-5, atol=1e-6)


def test_short_conv_step_equals_short_conv() -> None:
    gen = torch.Generator().manual_seed(4)
    x, w, s0 = torch.randn(3, 5, generator=gen), torch.randn(5, 4), torch.randn(3, 5, 3)
    out, s = short_conv_step(x, w, s0)
    for i in range(3):
        o1, s1 = short_conv(x[i : i + 1], w, s0[i])
        torch.testing.assert_close(out[i], o1[0])
        torch.testing.assert_close(s[i], s1)


GPU_CFG = KimiLinearConfig(
    hidden_size=256,
    intermediate_size=512,
    kda_heads=4,
    kda_head_dim=64,
    mla_heads=16,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "backend, dtype, tol",
    [
        # fp32: the equality check, every Triton dot in IEEE fp32 (TRITON_F32_DEFAULT).
        ("torch", "float32", 1e-4),
        ("triton", "float32", 1e-4),
        # bf16: a smoke bound for the production dtypes, catching gross errors (a state not
        # reset, a wrong slot: O(1)); bf16 q / k in fla's chunked vs recurrent kernels alone
        # move these logits by ~4e-2 (H200, measured), the torch recurrence on CPU by 1.4e-2.
        ("triton", "bfloat16", 1e-1),
        ("flashinfer_mla", "bfloat16", 1e-1),
    ],
)
def test_gpu_hybrid_fla_incremental_equals_full_with_graphs(
    backend: str, dtype: str, tol: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fla for the KDA layers, a GPU MLA backend for the others, decode through captured
    whole-model graphs; requests join and leave."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")  # tf32 otherwise: ~2e-3 here (H200)
    model = _model(GPU_CFG, "cuda", getattr(torch, dtype))

    def engine() -> Engine:
        eng = _engine(model, backend, "cuda", dtype, page=64)
        assert eng.backend.linear.kernels == "fla"
        return eng

    _incremental_equals_full(model, engine, True, tol)


@pytest.mark.gpu
def test_gpu_padded_graph_rows_never_change_a_real_state() -> None:
    """Graph decode of 3 requests (padded to 4) next to an idle request whose states and KV
    are poisoned with NaN: nothing of it changes, and the three equal eager decode."""
    model = _model(GPU_CFG, "cuda", torch.bfloat16)
    eng = _engine(model, "triton", "cuda", "bfloat16", page=64)
    eng.enable_graphs([1, 2, 4])
    ref = _engine(model, "triton", "cuda", "bfloat16", page=64)
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    for e in (eng, ref):
        rows = e.new_requests(4)
        e.extend(rows, prompts)
    idle = rows[3]
    pool = eng.backend.linear.pool
    pool.recurrent[:, idle] = float("nan")
    pool.conv[:, idle] = float("nan")
    kv = eng.rt.kv_pool.kv_buffer[0]
    idle_slots = eng.rt.req_pool.req_to_token[idle, :4].long()
    kv[idle_slots] = float("nan")
    before = (pool.recurrent[:, idle].clone(), pool.conv[:, idle].clone(), kv[idle_slots].clone())
    for step in range(4):
        toks = [11 + step, 12, 13]
        got, want = eng.decode(rows[:3], toks), ref.decode(rows[:3], toks)
        assert _rel(got, want) <= 2e-2, step
    after = (pool.recurrent[:, idle], pool.conv[:, idle], kv[idle_slots])
    for x, y in zip(before, after):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    r3 = rows[:3]
    ref_pool = ref.backend.linear.pool
    assert _rel(pool.recurrent[:, r3], ref_pool.recurrent[:, r3]) <= 2e-2


def test_padded_decode_rows_leave_real_states_and_kv_alone() -> None:
    model = _model()
    eng = _engine(model)
    rows = eng.new_requests(2)
    eng.extend(rows, [[1, 2, 3], [4, 5]])
    pool = eng.backend.linear.pool
    rec, conv = pool.recurrent.clone(), pool.conv.clone()
    kv = eng.rt.kv_pool.kv_buffer[0].clone()
    # one real request (rows[0]) and two padded rows (request row 0, dummy slot 0)
    loc = eng.rt.allocator.alloc_extend([rows[0]], [1])
    batch = ForwardBatch.build(
        ForwardMode.DECODE,
        [rows[0], 0, 0],
        [3, 0, 0],
        [1, 1, 1],
        torch.cat([loc, torch.zeros(2, dtype=torch.int64)]),
        "cpu",
    )
    eng.backend.init_forward_metadata(batch)
    model(torch.tensor([7, 0, 0]), batch, eng.backend)
    other = rows[1]
    assert torch.equal(pool.recurrent[:, other], rec[:, other])
    assert torch.equal(pool.conv[:, other], conv[:, other])
    assert not torch.equal(pool.recurrent[:, rows[0]], rec[:, rows[0]])
    ps = eng.rt.kv_pool.page_size
    keep = torch.ones(kv.shape[0], dtype=torch.bool)
    keep[:ps] = False
    keep[loc] = False
    assert torch.equal(eng.rt.kv_pool.kv_buffer[0][keep], kv[keep])


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.gpu),
    ],
)
def test_verify_then_accept_equals_decoding_the_accepted_tokens(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculative verify on the hybrid: 3 requests verify 3 draft tokens each and accept
    3, 1 and 0 of them. Verify logits equal decoding the drafts one at a time; afterwards every
    request's linear states, conv states and next-token logits equal those of an engine that
    decoded only the accepted tokens. GPU: fla prefill / decode, fp32 with IEEE dots."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    cfg = CFG if device == "cpu" else GPU_CFG
    model = _model(cfg, device)

    def make(m: KimiLinearForCausalLM) -> Engine:
        return _engine(m, "torch", device, "float32", 16 if device == "cpu" else 64)

    gen = torch.Generator().manual_seed(6)
    vocab = cfg.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 8, 3)]
    drafts = [torch.randint(0, vocab, (3,), generator=gen).tolist() for _ in prompts]
    accepted = [3, 1, 0]
    spec, ref = make(model), make(model)
    rows = [e.new_requests(3) for e in (spec, ref)]
    for e, r in zip((spec, ref), rows):
        e.extend(r, prompts)
    got = spec.verify(rows[0], drafts)
    spec.accept(rows[0], accepted)
    for i in range(3):  # reference: decode every draft, then check the verify logits
        want = ref.decode(rows[1], [d[i] for d in drafts])
        assert _rel(got[i::3], want) <= 1e-4, i
    ref2 = make(model)  # an engine that saw only the accepted tokens
    r2 = ref2.new_requests(3)
    ref2.extend(r2, [p + d[:a] for p, d, a in zip(prompts, drafts, accepted)])
    nxt = [7, 8, 9]
    assert _rel(spec.decode(rows[0], nxt), ref2.decode(r2, nxt)) <= 1e-4
    for name in ("recurrent", "conv"):  # relative to the largest value, as for the logits
        a = getattr(spec.backend.linear.pool, name)[:, rows[0]]
        b = getattr(ref2.backend.linear.pool, name)[:, r2]
        err = _rel(a, b)
        print(f"{device} {name} state: accepted-path vs prefill-path rel err {err:.2e}")
        assert err <= 1e-4, (name, err)
    assert [spec.rt.allocator.seq_len(r) for r in rows[0]] == [9, 10, 4]


def test_a_new_request_on_a_reused_row_starts_from_zero_state_without_a_reset() -> None:
    """A row freed and handed out again by the request table (the README's way of taking
    rows) kept its last request's recurrent and conv states: the new request's prefill
    logits were 1.3x off, silently (helper 59's review). A request with no cached prefix now
    starts from zero state, reset or not."""
    m = _model()
    eng, fresh = _engine(m), _engine(m)
    (a,) = eng.new_requests(1)
    eng.extend([a], [[9, 8, 7, 6]])
    eng.decode([a], [5])
    eng.free(a)
    row = eng.rt.req_pool.alloc(1)
    lin = eng.backend.linear.pool
    lin.recurrent[:, a].fill_(0.5)  # an old request's states, as a backend-level engine
    lin.conv[:, a].fill_(0.5)  # that frees rows without a reset leaves them
    r2 = fresh.new_requests(1)
    assert _rel(eng.extend(row, [[1, 2, 3]]), fresh.extend(r2, [[1, 2, 3]])) < 1e-6
    assert _rel(eng.decode(row, [4]), fresh.decode(r2, [4])) < 1e-6


@pytest.mark.parametrize("first", ["decode", "verify"])
def test_a_freed_row_taken_back_whose_first_step_is_a_decode_starts_from_zero(first: str) -> None:
    """Only an EXTEND starts a request with no cached prefix from zero linear state; a row the
    Engine freed and the request table handed out again, whose first step was a decode or a
    verify, continued the freed request's states (1.4x off, silently; helper 62's review).
    `Engine.free` now resets the row."""
    m = _model()
    eng, fresh = _engine(m), _engine(m)
    (a,) = eng.new_requests(1)
    eng.extend([a], [[9, 8, 7, 6]])
    eng.free(a)
    row, r2 = eng.rt.req_pool.alloc(1), fresh.new_requests(1)
    if first == "decode":
        assert _rel(eng.decode(row, [4]), fresh.decode(r2, [4])) < 1e-6
    else:
        assert _rel(eng.verify(row, [[4, 5]]), fresh.verify(r2, [[4, 5]])) < 1e-6


def test_engine_rows_as_torch_integers_and_mode_and_graphs_mid_verify() -> None:
    """Helper 62's review: a torch-integer row missed every lookup by row (its length read 0:
    a refused decode's rollback truncated the request to nothing, the retry ran on an empty
    context, silently); a string mode skipped the verify bookkeeping; `enable_graphs`
    between a verify and its accept replaced the staged verify (accept then failed and
    marked the rows)."""
    m = _model()
    eng, fresh = _engine(m), _engine(m)
    rows, r2 = eng.new_requests(2), fresh.new_requests(2)
    eng.extend(rows, [[9, 8, 7], [6, 5]])
    fresh.extend(r2, [[9, 8, 7], [6, 5]])
    t_rows = [torch.tensor(r) for r in rows]
    alloc = eng.rt.allocator
    assert alloc.seq_len(t_rows[0]) == 3 and alloc.holds(t_rows[1])
    assert alloc.pages(t_rows[0]) == alloc.pages(rows[0]) != []
    assert _rel(eng.decode(t_rows, [4, 3]), fresh.decode(r2, [4, 3])) < 1e-6
    with pytest.raises(TypeError, match=r"mode must be a ForwardMode, got 'target_verify'"):
        eng.step("target_verify", rows, [[1, 2], [3, 4]])  # type: ignore[arg-type]
    eng.verify(t_rows, [[1, 2], [3, 4]])
    with pytest.raises(RuntimeError, match=r"pending verify: accept\(rows, counts\) before"):
        eng.enable_graphs([1, 2], use_graphs=False)
    eng.accept(t_rows, [1, 2])
    fresh.verify(r2, [[1, 2], [3, 4]])
    fresh.accept(r2, [1, 2])
    assert eng.rows_to_reset == [] and [eng.rt.allocator.seq_len(r) for r in rows] == [5, 5]
    assert _rel(eng.decode(rows, [7, 7]), fresh.decode(r2, [7, 7])) < 1e-6


def test_accept_is_once_per_whole_verify_and_not_after_its_rows_were_reset() -> None:
    """Through the backend API, past the Engine's own guards (helper 59's review): a second
    accept after one verify rewrote the states (silently, under a graph runner); an accept
    after a verify that failed part-way took that verify's states in the layers it reached
    and the one before's elsewhere; a reset row got its old request's verify state back from
    the accept that followed."""
    m = _model()
    eng = _engine(m)
    be, lin = eng.backend, eng.backend.linear
    rows = eng.new_requests(2)
    eng.extend(rows, [[1, 2], [3]])

    def verify(ids: list[int]) -> None:
        loc = eng.rt.allocator.alloc_extend(rows, [2, 2])
        b = ForwardBatch.build(ForwardMode.TARGET_VERIFY, rows, [2, 1], [2, 2], loc, "cpu")
        be.init_forward_metadata(b)
        try:
            m(torch.tensor(ids), b, be)
        finally:
            for r, p in zip(rows, [2, 1]):
                eng.rt.allocator.truncate(r, p)

    verify([4, 5, 6, 7])
    be.accept(torch.tensor([1, 1]))
    after = lin.pool.recurrent.clone()
    with pytest.raises(RuntimeError, match=r"no verify is pending \(accept was called for it"):
        be.accept(torch.tensor([2, 2]))
    assert torch.equal(lin.pool.recurrent, after)
    for bad in (torch.tensor([1.9, 2.0]), torch.tensor([True, True]), [1, 2]):
        verify([4, 5, 6, 7])
        with pytest.raises(TypeError, match=r"num_accepted: expected an int32 / int64 tensor"):
            be.accept(bad)  # type: ignore[arg-type]
    verify([4, 5, 6, 7])  # never accepted
    own = m.layers[1].attn.forward
    m.layers[1].attn.forward = _raise  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="a kernel failed"):
        verify([9, 9, 9, 9])
    m.layers[1].attn.forward = own  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match=r"staged 1 of \d+ linear layers \(it failed part-way"):
        be.accept(torch.tensor([2, 2]))
    assert torch.equal(lin.pool.recurrent, after)
    verify([4, 5, 6, 7])
    be.reset_requests([rows[0]])
    with pytest.raises(RuntimeError, match=r"no verify is pending .*or its rows were reset"):
        be.accept(torch.tensor([2, 1]))
    assert not lin.pool.recurrent[:, rows[0]].any() and not lin.pool.conv[:, rows[0]].any()


def test_accept_needs_a_verify_batch() -> None:
    eng = _engine(_model())
    rows = eng.new_requests(1)
    eng.extend(rows, [[1, 2]])
    with pytest.raises(RuntimeError, match="follows a TARGET_VERIFY batch"):
        eng.backend.linear.accept(torch.tensor([1]))
    with pytest.raises(RuntimeError, match=r"accept\(\) follows a verify\(\) step"):
        eng.accept(rows, [1])
    eng.verify(rows, [[3, 4]])
    with pytest.raises(ValueError, match=r"accepted counts must be in 0..2, got \[3\]"):
        eng.accept(rows, [3])
    assert eng.rt.allocator.seq_len(rows[0]) == 4  # a refused accept changed nothing


def test_stage_verify_conv_refuses_a_bad_layer_or_window_and_keeps_the_staging() -> None:
    """Layer -1 staged the last layer's windows, and a window of other channels failed in
    accept's gather after the recurrent states were written: both refused at staging, and
    the verify's own staging is accepted as if nothing happened."""
    model = _model()
    eng, ref = _engine(model), _engine(model)
    for e in (eng, ref):
        rows = e.new_requests(1)
        e.extend(rows, [[1, 2, 3]])
    lin = eng.backend.linear
    _, _, channels, kept = lin.pool.conv.shape
    with pytest.raises(RuntimeError, match="stages a TARGET_VERIFY batch"):
        lin.stage_verify_conv(0, torch.zeros(1, channels, kept + 1))
    eng.verify(rows, [[4, 5]])
    with pytest.raises(LayerIndexError):
        lin.stage_verify_conv(-1, torch.zeros(1, channels, kept + 2))
    with pytest.raises(ShapeError, match=rf"windows: expected shape \[1, {channels}, {kept + 2}\]"):
        lin.stage_verify_conv(0, torch.zeros(1, channels + 1, kept + 2))
    eng.accept(rows, [1])
    ref.decode(rows, [4])
    for name in ("conv", "recurrent"):  # verify and decode sum in another order
        assert _rel(getattr(lin.pool, name), getattr(ref.backend.linear.pool, name)) <= 1e-6


def _raise(*args, **kwargs):  # type: ignore[no-untyped-def]
    raise RuntimeError("a kernel failed")


def test_a_step_failing_inside_the_model_is_refused_until_its_rows_are_reset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Layer 1 (KDA) raises after layer 0 (KDA) advanced the states of the step's rows: the
    lengths roll back but the states cannot, so a retry once ran over corrupted states with no
    error. Now a step naming those rows is refused; a request outside the step runs on; after
    reset and re-prefill the rows give a fresh engine's logits."""
    model = _model()
    eng, fresh = _engine(model), _engine(model)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    a, b, c = eng.new_requests(3)
    eng.extend([a, b, c], prompts)
    rec0 = eng.backend.linear.pool.recurrent[0].clone()
    monkeypatch.setattr(model.layers[1].attn, "forward", _raise)
    with pytest.raises(RuntimeError, match="a kernel failed"):
        eng.decode([a, b], [10, 11])
    monkeypatch.undo()
    assert not torch.equal(eng.backend.linear.pool.recurrent[0, a], rec0[a])  # the hazard
    assert [eng.rt.allocator.seq_len(r) for r in (a, b)] == [3, 2]  # rolled back
    want = (
        rf"request rows \[{b}\] have unknown linear-attention state .*reset\(rows\) and re-prefill"
    )
    with pytest.raises(RuntimeError, match=want):
        eng.decode([b, c], [11, 12])
    with pytest.raises(RuntimeError, match=rf"rows \[{a}\] have unknown"):
        eng.verify([a], [[10, 11]])
    assert eng.rows_to_reset == [a, b]
    assert [eng.rt.allocator.seq_len(r) for r in (a, b, c)] == [
        3,
        2,
        4,
    ]  # refusals allocate nothing

    rows = fresh.new_requests(3)
    fresh.extend(rows, prompts)
    assert torch.equal(eng.decode([c], [12]), fresh.decode([rows[2]], [12]))  # c runs on
    eng.reset([a, b])
    assert eng.rows_to_reset == [] and eng.rt.allocator.seq_len(a) == 0
    retry = [prompts[0] + [10], prompts[1] + [11]]
    ref = _engine(model)
    r2 = ref.new_requests(2)
    assert torch.equal(eng.extend([a, b], retry), ref.extend(r2, retry))
    assert torch.equal(eng.decode([a, b], [5, 6]), ref.decode(r2, [5, 6]))


def test_a_failing_graph_decode_marks_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph runner's padded static path (no capture): a layer failing in it marks the
    step's rows as the eager path does."""
    model = _model()
    eng = _engine(model)
    eng.enable_graphs([1, 2, 4], use_graphs=False)
    rows = eng.new_requests(3)
    eng.extend(rows, [[1, 2], [3], [4, 5]])
    monkeypatch.setattr(model.layers[1].attn, "forward", _raise)
    with pytest.raises(RuntimeError, match="a kernel failed"):
        eng.decode(rows[:2], [6, 7])
    assert eng.rows_to_reset == rows[:2]


def test_a_step_failing_before_the_model_runs_marks_no_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bad token id, an allocation past the context limit and a metadata failure all raise
    before any layer touched a state: nothing is marked, and the retry equals a fresh engine."""
    model = _model()
    eng, fresh = _engine(model), _engine(model)
    rows, rows2 = eng.new_requests(2), fresh.new_requests(2)
    for e, r in ((eng, rows), (fresh, rows2)):
        e.extend(r, [[1, 2, 3], [4, 5]])
    vocab = model.cfg.vocab_size
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.decode(rows, [7, vocab])
    limit = eng.rt.config.max_context_len
    with pytest.raises(ValueError, match=f"exceeds max_context_len {limit}"):
        eng.extend(rows, [[7] * limit, [8]])
    monkeypatch.setattr(eng.backend, "init_forward_metadata", _raise)
    with pytest.raises(RuntimeError, match="a kernel failed"):
        eng.decode(rows, [7, 8])
    monkeypatch.undo()
    assert eng.rows_to_reset == []
    assert torch.equal(eng.decode(rows, [7, 8]), fresh.decode(rows2, [7, 8]))


def test_a_failed_accept_marks_its_rows() -> None:
    """accept writes the linear states layer by layer after truncating the rejected drafts: a
    failure in it leaves the rows' states unknown, as a failed step does."""
    eng = _engine(_model())
    rows = eng.new_requests(2)
    eng.extend(rows, [[1, 2], [3]])
    eng.verify(rows, [[4, 5], [6, 7]])
    eng.backend.linear.accept = _raise  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="a kernel failed"):
        eng.accept(rows, [1, 2])
    assert eng.rows_to_reset == rows
    with pytest.raises(RuntimeError, match=r"have unknown linear-attention state"):
        eng.decode(rows, [8, 9])


def test_an_empty_verify_is_accepted_in_a_hybrid_model() -> None:
    """An empty verify runs no batch, so its accept must not call the linear backend's accept
    (which reads the last batch it saw: a decode, or another verify of other shapes)."""
    eng = _engine(_model())
    rows = eng.new_requests(1)
    eng.extend(rows, [[1, 2]])
    eng.decode(rows, [3])
    assert eng.verify([], []).shape[0] == 0
    eng.accept([], [])
    eng.decode(rows, [4])


def test_a_verify_is_accepted_before_another_step_and_its_staging_is_dropped() -> None:
    """A step between a verify and its accept kept the drafts' KV but not the linear states
    (the next logits 117 % off, silently): refused now, naming accept, before anything is
    allocated. An eager verify's staging was kept per batch size for good (sizes 1..6 left 36
    tensors): one set now, dropped by its accept. Counts out of range wrote the recurrent
    states, then failed in the conv gather: refused before any write."""
    eng = _engine(_model())
    rows, other = eng.new_requests(3), eng.new_requests(1)
    eng.extend(rows + other, [[1, 2], [3], [4, 5, 6], [7]])
    lin = eng.backend.linear
    for b in (3, 1, 2):
        eng.verify(rows[:b], [[8, 9]] * b)
        lens = [eng.rt.allocator.seq_len(r) for r in rows + other]
        for step in (lambda: eng.decode(rows, [1, 2, 3]), lambda: eng.extend(other, [[5]])):
            with pytest.raises(
                RuntimeError, match=r"have a pending verify: accept\(rows, counts\)"
            ):
                step()
        assert [eng.rt.allocator.seq_len(r) for r in rows + other] == lens
        staged = len(lin._verify_states) + len(lin._verify_conv)
        assert staged == 2 * CFG.kinds.count("linear")  # one verify's, whatever came before
        if b == 2:
            state = lin.pool.recurrent.clone(), lin.pool.conv.clone()
            for bad in ([-1, 0], [0, 3]):
                with pytest.raises(ValueError, match=r"counts must be in 0..2, got \[.*\]"):
                    eng.backend.accept(torch.tensor(bad))
            assert torch.equal(lin.pool.recurrent, state[0]) and torch.equal(
                lin.pool.conv, state[1]
            )
        eng.accept(rows[:b], [1] * b)
        assert not lin._verify_states and not lin._verify_conv
    eng.decode(rows + other, [1, 2, 3, 4])


# ---------------------------------------------------------------------------- HF checkpoint
def _hf_kimi_linear_checkpoint(path: Path, rms_norm_eps: float, moe: bool) -> Any:
    """A tiny random HF `KimiLinearForCausalLM` (KDA layers 1-3, MLA layer 4; dense MLPs, or
    MoE blocks from layer 2 on), written in the hub's layout: transformers' save names every
    MLP `block_sparse_moe.`, where Kimi-Linear's checkpoints have `mlp.` on dense layers, and
    writes its own layer keys, where they have `linear_attn_config`."""
    import json

    from safetensors.torch import load_file, save_file

    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "KimiLinearForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no KimiLinearForCausalLM")
    kinds = ["linear_attention"] * 3 + ["full_attention"]
    cfg = transformers.KimiLinearConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, linear_num_heads=4, linear_head_dim=16,
        mlp_layer_types=["dense"] + ["sparse" if moe else "dense"] * 3, layer_types=kinds,
        num_local_experts=8, moe_intermediate_size=16, num_experts_per_tok=2, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, rms_norm_eps=rms_norm_eps,
        tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():  # HF's init leaves decays at zero and norms at one
        for name, p in hf.named_parameters():
            if p.dim() > 1 and "A_log" not in name:
                p.normal_(0, 0.1)
        for layer in hf.model.layers[:3]:
            layer.self_attn.forget_gate.A_log.uniform_(-1, 1)
            layer.self_attn.forget_gate.dt_bias.normal_(0, 0.5)
            layer.self_attn.o_norm.weight.uniform_(0.5, 1.5)
        for layer in hf.model.layers[1:] if moe else []:  # routing that is not a near tie
            layer.mlp.gate.weight.normal_(0, 0.5)
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.2, 0.2)
    hf.save_pretrained(path)
    t = load_file(str(path / "model.safetensors"))
    dense = re.compile(r"\.block_sparse_moe\.(?=(gate|up|down)_proj)")
    save_file({dense.sub(".mlp.", k): v for k, v in t.items()}, str(path / "model.safetensors"))
    raw = json.loads((path / "config.json").read_text())
    raw["linear_attn_config"] = dict(
        num_heads=4, head_dim=16, short_conv_kernel_size=raw["linear_conv_kernel_dim"],
        kda_layers=[1, 2, 3], full_attn_layers=[4],
    )  # fmt: skip
    (path / "config.json").write_text(json.dumps(raw))
    return hf


@pytest.mark.parametrize(
    ("rms_norm_eps", "moe"),
    [(1e-5, False), (1e-2, False), (1e-5, True)],
    ids=["dense", "eps", "moe"],
)
def test_logits_equal_hf_transformers_prefill_every_decode_step_and_an_extend(
    tmp_path: Path, rms_norm_eps: float, moe: bool
) -> None:
    """Against transformers' own Kimi-Linear (its torch KDA, chunked over a whole sequence
    each call): our model, loaded from its checkpoint, prefill, decode steps and an extend
    over the cached prefix, to 1e-5 in fp32. Before q / k took fla's l2norm (eps inside the
    root) and the latent norms their own eps, it was 8e-5 off; MoE blocks were refused."""
    from mla_backends.models.kimi_loader import load_kimi_linear

    hf = _hf_kimi_linear_checkpoint(tmp_path, rms_norm_eps, moe)
    model = load_kimi_linear(tmp_path)
    assert model.extra_tensors == []
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["MLP"] + [
        "MoE" if moe else "MLP"
    ] * 3
    eng = _engine(model)

    def ref(seq: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([seq])).logits[0].float()

    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (7, 19, 1)]
    rows = eng.new_requests(len(seqs))
    got = eng.extend(rows, seqs).split([len(s) for s in seqs])
    for s, g in zip(seqs, got):
        assert _rel(g, ref(s)) <= 1e-5, "prefill"
    for step in range(4):
        nxt = [int(torch.randint(0, 96, (1,), generator=gen)) for _ in rows]
        out = eng.decode(rows, nxt)
        for i, s in enumerate(seqs):
            s.append(nxt[i])
            assert _rel(out[i], ref(s)[-1]) <= 1e-5, f"decode step {step}, request {i}"
    more = torch.randint(0, 96, (5,), generator=gen).tolist()
    out = eng.extend(rows[:1], [more])
    assert _rel(out, ref(seqs[0] + more)[-5:]) <= 1e-5, "extend"


def test_hf_safetensors_load_gives_the_same_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file, save_file

    from mla_backends.models.kimi_loader import load_kimi_linear, save_kimi_linear

    src = _model()
    save_kimi_linear(src, tmp_path)
    # the file holds Kimi / fla names, not ours
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert "model.layers.0.self_attn.q_conv1d.weight" in names
    assert "model.layers.3.self_attn.kv_b_proj.weight" in names
    assert not any(".attn." in n or n.endswith("conv_weight") for n in names)
    got = load_kimi_linear(tmp_path)
    seq = [5, 17, 3, 9, 250, 1, 77]
    assert torch.equal(_full(got, "torch", seq), _full(src, "torch", seq))
    assert got.extra_tensors == []

    # each conv part lands in its third of our joined weight
    t = load_file(str(tmp_path / "model.safetensors"))
    c = CFG.kda_heads * CFG.kda_head_dim
    t["model.layers.0.self_attn.k_conv1d.weight"] = torch.full((c, 1, CFG.conv_kernel), 7.0)
    save_file(t, str(tmp_path / "model.safetensors"))
    w = load_kimi_linear(tmp_path).layers[0].attn.conv_weight
    assert bool((w[c : 2 * c] == 7.0).all()) and not bool((w[:c] == 7.0).any())


def test_moe_blocks_save_and_load_in_the_hubs_names_with_fp32_gates(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from mla_backends.models.kimi_loader import load_kimi_linear, save_kimi_linear

    cfg = KimiLinearConfig(
        num_hidden_layers=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8
    )
    src = _model(cfg)
    save_kimi_linear(src, tmp_path)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert "model.layers.0.mlp.gate_proj.weight" in names  # first_k_dense_replace 1
    assert {"model.layers.1.block_sparse_moe.experts.3.w2.weight",
            "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
            "model.layers.3.block_sparse_moe.shared_experts.up_proj.weight"} <= names  # fmt: skip
    got = load_kimi_linear(tmp_path)
    seq = [5, 17, 3, 9, 250, 1, 77]
    assert torch.equal(_full(got, "torch", seq), _full(src, "torch", seq))
    half = load_kimi_linear(tmp_path, dtype=torch.bfloat16)
    assert half.layers[1].mlp.gate.weight.dtype == torch.float32  # as HF keeps the router
    assert half.layers[1].mlp.experts[0].up_proj.weight.dtype == torch.bfloat16


def test_hf_safetensors_errors_name_the_tensor(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from safetensors.torch import load_file, save_file

    from mla_backends.models.kimi_loader import load_kimi_linear, save_kimi_linear
    from mla_backends.models.loader import CheckpointError

    save_kimi_linear(_model(), tmp_path)
    file = tmp_path / "model.safetensors"
    good = load_file(str(file))

    bad = dict(good)
    del bad["model.layers.1.self_attn.v_conv1d.weight"]
    save_file(bad, str(file))
    with pytest.raises(CheckpointError, match=r"lacks tensor 'model.layers.1.self_attn.v_conv1d"):
        load_kimi_linear(tmp_path)

    bad = dict(good)  # a MoE block instead of the dense MLP
    del bad["model.layers.2.mlp.gate_proj.weight"]
    bad["model.layers.2.block_sparse_moe.gate.weight"] = torch.zeros(4, CFG.hidden_size)
    save_file(bad, str(file))
    with pytest.raises(CheckpointError, match=r"lacks tensor 'model.layers.2.mlp.gate_proj"):
        load_kimi_linear(tmp_path)

    bad = dict(good)
    bad["model.layers.3.self_attn.kv_b_proj.weight"] = good[
        "model.layers.3.self_attn.kv_b_proj.weight"
    ][:, :-1].contiguous()
    save_file(bad, str(file))
    with pytest.raises(CheckpointError, match=r"kv_b_proj.weight: checkpoint shape"):
        load_kimi_linear(tmp_path)

    save_file(good, str(file))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["linear_attn_config"]["full_attn_layers"] = [1, 5]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"full_attn_layers = \[1, 5\] do not split layers"):
        load_kimi_linear(tmp_path)


def test_state_pool_smaller_than_the_request_table_is_refused() -> None:
    """A request's state slot is its request row: a state pool with fewer slots than the
    table has rows is refused when the backend is built (it was an IndexError at the first
    new request beyond it, with that request's rows left taken)."""
    eng = _engine(_model())
    cfg = eng.model.cfg
    h, d = cfg.kda_heads, cfg.kda_head_dim
    small = LinearStatePool(
        cfg.kinds.count("linear"), 2, h, d, d, 3 * h * d, cfg.conv_kernel, "cpu"
    )
    with pytest.raises(ValueError, match=r"state pool has 3 slots, the request table 7 rows"):
        HybridBackend(eng.rt.backend, LinearAttentionBackend(small), cfg.kinds)


@pytest.mark.parametrize("conv", ["kernel", "dim"])
def test_a_state_pool_of_another_conv_shape_is_one_error_naming_it(conv: str) -> None:
    """A state pool built with another conv kernel or conv dim than the model's gave a shape
    error deep inside the conv, naming neither (helper 59's review)."""
    m = _model()
    cfg = m.cfg
    h, d = cfg.kda_heads, cfg.kda_head_dim
    width, kernel = (3 * h * d, cfg.conv_kernel - 1) if conv == "kernel" else (2 * h * d, 4)
    eng = _engine(m)
    pool = LinearStatePool(cfg.kinds.count("linear"), 6, h, d, d, width, kernel, "cpu")
    bad = Engine(m, eng.rt, HybridBackend(eng.rt.backend, LinearAttentionBackend(pool), cfg.kinds))
    rows = bad.new_requests(1)
    with pytest.raises(ValueError, match=r"linear state pool: conv state \[conv_dim, conv_kernel"):
        bad.extend(rows, [[1, 2, 3]])


# ------------------------------------------------------------ verify through graph runners
def _verify_runners(
    model: KimiLinearForCausalLM, eng: Engine, q_lens: list[int], graphs: bool
) -> dict[int, Any]:
    """Verify runners of batch size 2 on the engine's backend, one a draft count, captured
    in that order (a graph runner, not the Engine: it captures decode graphs only)."""
    from mla_backends.graph_runner import CudaGraphRunner, InputSpec

    be = eng.backend
    dev = str(eng.rt.kv_pool.device)

    def fwd(batch: ForwardBatch, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(inputs["ids"], batch, be)

    runners = {}
    for q in q_lens:
        ids = {"ids": InputSpec((), torch.long)}
        run = CudaGraphRunner(be, fwd, ids, [2], q_len=q, device=dev, use_graphs=graphs)
        run.capture()
        runners[q] = run
    return runners


def _runner_verify(eng: Engine, run: Any, rows: list[int], drafts: list[list[int]]) -> None:
    al, q = eng.rt.allocator, len(drafts[0])
    pre = [al.seq_len(r) for r in rows]
    loc = al.alloc_extend(rows, [q] * len(rows))
    dev = str(eng.rt.kv_pool.device)
    batch = ForwardBatch.build(ForwardMode.TARGET_VERIFY, rows, pre, [q] * len(rows), loc, dev)
    run.replay(batch, {"ids": torch.tensor([t for d in drafts for t in d], device=dev)})


def _truncate(eng: Engine, rows: list[int], rejected: list[int]) -> None:
    for r, n in zip(rows, rejected):
        eng.rt.allocator.truncate(r, eng.rt.allocator.seq_len(r) - n)


@pytest.mark.parametrize("where", ["last-linear-layer", "first-layer"])
def test_a_runner_verify_that_failed_part_way_is_not_accepted(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verify replayed by a `use_graphs=False` runner (Python runs the model) that failed
    part-way: accept took the staging an earlier replay left under the graph's key as
    complete and wrote that rejected verify's states, silently (helper 64's review). Refused
    now, whether the failure came before any linear layer staged or after some did."""
    model = _model()
    eng = _engine(model)
    run = _verify_runners(model, eng, [3], graphs=False)[3]
    rows = eng.new_requests(2)
    eng.extend(rows, [[1, 2, 3, 4], [5, 6, 7]])
    _runner_verify(eng, run, rows, [[8, 9, 10], [11, 12, 13]])
    eng.backend.accept(torch.tensor([0, 0]))
    _truncate(eng, rows, [3, 3])
    linear = [i for i, k in enumerate(CFG.kinds) if k == "linear"]
    failing = model.layers[linear[-1] if where == "last-linear-layer" else 0].attn
    monkeypatch.setattr(failing, "forward", _raise)
    with pytest.raises(RuntimeError, match="a kernel failed"):
        _runner_verify(eng, run, rows, [[20, 21, 22], [23, 24, 25]])
    monkeypatch.undo()
    _truncate(eng, rows, [3, 3])
    pool = eng.backend.linear.pool
    before = pool.recurrent.clone(), pool.conv.clone()
    staged = 0 if where == "first-layer" else len(linear) - 1
    with pytest.raises(RuntimeError, match=rf"staged {staged} of {len(linear)} linear layers"):
        eng.backend.accept(torch.tensor([2, 2]))
    assert torch.equal(pool.recurrent, before[0]) and torch.equal(pool.conv, before[1])


@pytest.mark.gpu
def test_gpu_verify_runners_of_two_draft_counts_accept_their_own_staging() -> None:
    """Two verify graphs of one batch size, 3 and 2 draft tokens: the staging was keyed by
    batch size alone, so the second capture's replaced the first's, and accept after a
    3-token replay read the 2-token graph's stale states (a count of 3 indexed past them: a
    device-side assert). Keyed by (batch size, draft count) now: the states and the next
    logits equal the Engine's eager verify and accept of the same drafts (the same kernels)."""
    model = _model(GPU_CFG, "cuda", torch.bfloat16)
    eng, ref = (_engine(model, "triton", "cuda", "bfloat16", page=64) for _ in range(2))
    runners = _verify_runners(model, eng, [3, 2], graphs=True)
    prompts, drafts, accepted = [[1, 2, 3, 4], [5, 6, 7]], [[8, 9, 10], [11, 12, 13]], [2, 1]
    rows, r2 = eng.new_requests(2), ref.new_requests(2)
    for e, r in ((eng, rows), (ref, r2)):
        e.extend(r, prompts)
    _runner_verify(eng, runners[3], rows, drafts)
    eng.backend.accept(torch.tensor(accepted, device="cuda"))
    _truncate(eng, rows, [3 - a for a in accepted])
    ref.verify(r2, drafts)
    ref.accept(r2, accepted)
    for name in ("recurrent", "conv"):
        a = getattr(eng.backend.linear.pool, name)[:, rows]
        b = getattr(ref.backend.linear.pool, name)[:, r2]
        assert _rel(a, b) <= 1e-3, name
    assert _rel(eng.decode(rows, [7, 8]), ref.decode(r2, [7, 8])) <= 1e-3


def test_accept_after_a_padded_runner_verify_takes_the_captured_batchs_counts() -> None:
    """A runner pads one request to its captured size 2: accept takes a count for every row
    of that batch, 0 for the padding, and says so when given the real batch's; the real
    row's states then equal the Engine's eager verify and accept."""
    model = _model()
    eng, ref = _engine(model), _engine(model)
    run = _verify_runners(model, eng, [2], graphs=False)[2]
    (row,), (r2,) = eng.new_requests(1), ref.new_requests(1)
    for e, r in ((eng, row), (ref, r2)):
        e.extend([r], [[1, 2, 3]])
    _runner_verify(eng, run, [row], [[4, 5]])
    with pytest.raises(ValueError, match=r"expected shape \[2\] .* 0 for each padding row"):
        eng.backend.accept(torch.tensor([1]))
    eng.backend.accept(torch.tensor([1, 0]))
    ref.verify([r2], [[4, 5]])
    ref.accept([r2], [1])
    for name in ("recurrent", "conv"):
        a = getattr(eng.backend.linear.pool, name)[:, row]
        assert _rel(a, getattr(ref.backend.linear.pool, name)[:, r2]) <= 1e-6, name


def test_hybrid_layer_ids_are_integers() -> None:
    """The hybrid backend looked its layer up in a dict: True and 1.0 hash as 1 and ran as
    layer 1, silently, and a torch integer was refused as no layer (helper 67's sweep).
    Now the model's layer range check: bools and floats refused, integers of any kind taken."""
    eng = _engine(_model())
    be, pool = eng.backend, eng.rt.kv_pool
    full = CFG.kinds.index("full")
    loc = torch.tensor([17])
    kn, kr = torch.randn(1, pool.kv_lora_rank), torch.randn(1, pool.qk_rope_head_dim)
    before = pool.kv_buffer[0].clone()
    for bad in (True, torch.tensor(True)):
        with pytest.raises(LayerIndexError, match=r"layer .* is out of range"):
            be.store_kv(bad, loc, kn, kr)
    with pytest.raises(TypeError):
        be.store_kv(float(full), loc, kn, kr)
    assert torch.equal(pool.kv_buffer[0], before)
    be.store_kv(torch.tensor(full), loc, kn, kr)  # the first full layer: pool layer 0
    assert torch.equal(pool.kv_buffer[0][17], torch.cat([kn, kr], -1)[0].to(pool.dtype))
