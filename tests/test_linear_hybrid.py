"""Linear-attention layers and the hybrid router: the plain recurrence on CPU, and on the GPU
the fla kernels against it (prefill, then decode from the stored state; GDN and KDA)."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import GPU

from mla_backends.backends.hybrid import HybridBackend, layer_map, ratio_kinds
from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.config import TINY, Config
from mla_backends.linear.backend import LinearAttentionBackend
from mla_backends.linear.recurrence import gated_delta_rule
from mla_backends.linear.state_pool import LinearStatePool
from mla_backends.runtime import Runtime

H, K, V = 3, 8, 6


def _inputs(t: int, gen: torch.Generator, kda: bool = False):  # type: ignore[no-untyped-def]
    q = torch.nn.functional.normalize(torch.randn(t, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(t, H, K, generator=gen), dim=-1)
    v = torch.randn(t, H, V, generator=gen)
    g = -torch.rand(t, H, K if kda else 1, generator=gen).squeeze(-1) * 0.5
    beta = torch.rand(t, H, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_recurrence_split_anywhere_equals_one_pass(kda: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x = _inputs(11, gen, kda)
    s0 = torch.randn(H, K, V, generator=gen)
    o, s = gated_delta_rule(*x, s0)
    o1, s1 = gated_delta_rule(*(a[:4] for a in x), s0)
    o2, s2 = gated_delta_rule(*(a[4:] for a in x), s1)
    torch.testing.assert_close(torch.cat([o1, o2]), o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s2, s, rtol=1e-6, atol=1e-6)


def test_recurrence_closed_forms_and_kda_generalises_gdn() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta = _inputs(1, gen)
    o, s = gated_delta_rule(q, k, v, g, beta, torch.zeros(H, K, V))
    want_s = beta[0][:, None, None] * torch.einsum("hk,hv->hkv", k[0], v[0])
    torch.testing.assert_close(s, want_s)
    want_o = K**-0.5 * beta[0][:, None] * (k[0] * q[0]).sum(-1, keepdim=True) * v[0]
    torch.testing.assert_close(o[0], want_o)
    q, k, v, g, beta = _inputs(5, gen)
    s0 = torch.randn(H, K, V, generator=gen)
    gdn = gated_delta_rule(q, k, v, g, beta, s0)
    kda = gated_delta_rule(q, k, v, g[..., None].expand(-1, -1, K), beta, s0)
    torch.testing.assert_close(gdn[0], kda[0])
    # beta = 0: nothing is written, the state only decays
    _, s = gated_delta_rule(q, k, v, g, torch.zeros_like(beta), s0)
    torch.testing.assert_close(s, s0 * g.sum(0).exp()[:, None, None])


def _batch(
    mode: ForwardMode, rows: list[int], prefix: list[int], n: list[int], device: str = "cpu"
) -> ForwardBatch:
    loc = torch.zeros(sum(n), dtype=torch.int64, device=device)
    return ForwardBatch.build(mode, rows, prefix, n, loc, device)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_backend_prefill_then_decode_equals_one_pass_with_joins_and_leaves(kda: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    pool = LinearStatePool(2, 6, H, K, V, 16, 4, "cpu")
    be = LinearAttentionBackend(pool)
    seqs = {r: _inputs(9, gen, kda) for r in (1, 2, 3)}
    lens = {1: 0, 2: 0, 3: 0}
    outs: dict[int, list[torch.Tensor]] = {r: [] for r in seqs}

    def run(mode: ForwardMode, rows: list[int], n: list[int]) -> None:
        b = _batch(mode, rows, [lens[r] for r in rows], n)
        be.init_forward_metadata(b)
        cat = [
            torch.cat([seqs[r][j][lens[r] : lens[r] + m] for r, m in zip(rows, n)])
            for j in range(5)
        ]
        o = be.forward(1, *cat)
        start = 0
        for r, m in zip(rows, n):
            outs[r].append(o[start : start + m])
            lens[r] += m
            start += m

    pool.reset([1, 2])
    run(ForwardMode.EXTEND, [1, 2], [4, 2])
    run(ForwardMode.DECODE, [1, 2], [1, 1])
    pool.reset([3])  # request 3 joins
    run(ForwardMode.EXTEND, [3], [5])
    run(ForwardMode.DECODE, [2, 3, 1], [1, 1, 1])
    run(ForwardMode.EXTEND, [1], [3])  # request 2 left; 1 extends over its state
    for r in seqs:
        n = lens[r]
        want, _ = gated_delta_rule(*(a[:n] for a in seqs[r]), torch.zeros(H, K, V))
        torch.testing.assert_close(torch.cat(outs[r]), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool.recurrent[0], torch.zeros_like(pool.recurrent[0]))  # layer 0 idle


def test_padded_decode_rows_never_change_a_real_state() -> None:
    gen = torch.Generator().manual_seed(3)
    pool = LinearStatePool(1, 4, H, K, V, 16, 4, "cpu")
    be = LinearAttentionBackend(pool)
    pool.recurrent[0, 1:].normal_(generator=gen)
    pool.recurrent[0, 0] = float("nan")  # the dummy slot: whatever padding leaves there
    before = pool.recurrent[0, 1:].clone()
    b = _batch(ForwardMode.DECODE, [2, 0, 0], [5, 0, 0], [1, 1, 1])  # 1 real + 2 padded
    be.init_forward_metadata(b)
    o = be.forward(0, *_inputs(3, gen))
    assert torch.isfinite(o[0]).all()
    assert torch.equal(pool.recurrent[0, [1, 3, 4]], before[[0, 2, 3]])
    assert not torch.equal(pool.recurrent[0, 2], before[1])  # the real row advanced


def test_hybrid_routes_by_layer_kind_without_mutating_layers() -> None:
    kinds = ratio_kinds(8, 3)
    assert kinds == ["linear"] * 3 + ["full"] + ["linear"] * 3 + ["full"]
    m = layer_map(kinds)
    assert m[3].kind == "full" and m[3].index == 0 and m[7].index == 1 and m[6].index == 5
    rt = Runtime.build(
        Config(
            model=TINY,
            num_layers=2,
            prefill_backend="torch",
            decode_backend="torch",
            device="cpu",
            kv_dtype="float32",
            dtype="float32",
            num_pages=8,
            max_requests=4,
        )
    )
    lin = LinearAttentionBackend(LinearStatePool(6, 4, H, K, V, 16, 4, "cpu"))
    hy = HybridBackend(rt.backend, lin, kinds)
    rows = rt.req_pool.alloc(1)
    loc = rt.allocator.alloc_extend(rows, [3])
    b = ForwardBatch.build(ForwardMode.EXTEND, rows, [0], [3], loc, "cpu")
    hy.init_forward_metadata(b)
    d = TINY
    args = (
        torch.randn(3, d.num_heads, d.kv_lora_rank),
        torch.randn(3, d.num_heads, d.qk_rope_head_dim),
        torch.randn(3, d.kv_lora_rank),
        torch.randn(3, d.qk_rope_head_dim),
    )
    hy.forward_absorbed(7, *args, b)  # layer 7 -> MLA pool layer 1
    assert (
        torch.equal(rt.kv_pool.kv_buffer[1][loc].float(), torch.cat(args[2:], -1))
        and (rt.kv_pool.kv_buffer[0] == 0).all()
    )
    lin.pool.reset(rows)
    gen = torch.Generator().manual_seed(4)
    hy.forward_linear(4, *_inputs(3, gen))  # layer 4 -> linear pool layer 3
    assert lin.pool.recurrent[3, rows[0]].abs().sum() > 0 and (lin.pool.recurrent[2] == 0).all()
    with pytest.raises(ValueError, match="layer 4 is 'linear', called as a 'full' layer"):
        hy.forward_absorbed(4, *args, b)
    with pytest.raises(ValueError, match="MLA pool has 2 layers, the map 1 full"):
        HybridBackend(rt.backend, lin, ratio_kinds(4, 3))


# Relative to the largest value. fp32: fla's dots run in IEEE fp32 here (TRITON_F32_DEFAULT,
# set by the test; Triton's default would be tf32), so only the summation order differs from
# the exact recurrence. bf16: fla's chunked prefill multiplies bf16 operands on tensor cores.
FLA_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_gpu_fla_equals_recurrence_prefill_then_decode(
    kda: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three requests (varlen prefill: two extend a cached prefix from their non-zero stored
    states, one is new and starts from zero whatever its row holds; then 6 decode steps of
    the batch plus a padded row) through fla and through the recurrence: outputs and
    states."""
    pytest.importorskip("fla", reason="needs the fla package (pip install fla-core)")
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")  # fp32 dots in fp32 (part of the key)
    h, dk, dv, slots = 4, 128, 128, 6
    gen = torch.Generator().manual_seed(11)
    pools = [LinearStatePool(1, slots - 1, h, dk, dv, 16, 4, "cuda") for _ in range(2)]
    init = torch.randn(slots, h, dk, dv, generator=gen) * 0.1
    for p in pools:
        p.recurrent[0].copy_(init)
    fla, ref = (LinearAttentionBackend(p, kernels=k) for p, k in zip(pools, ("fla", "torch")))

    def inputs(t: int):  # type: ignore[no-untyped-def]
        q = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen), dim=-1)
        v = torch.randn(t, h, dv, generator=gen)
        g = -torch.rand(t, h, dk if kda else 1, generator=gen).squeeze(-1) * 0.3 - 0.01
        beta = torch.rand(t, h, generator=gen)
        # both paths see the same dtype-rounded inputs
        return [x.to(dtype).to("cuda") for x in (q, k, v)] + [g.cuda(), beta.to(dtype).cuda()]

    rows, prefix, ext = [3, 1, 4], [9, 0, 2], [70, 5, 130]
    lens = [p + n for p, n in zip(prefix, ext)]
    steps = [(ForwardMode.EXTEND, rows, prefix, ext)]
    steps += [(ForwardMode.DECODE, rows + [0], lens + [0], [1] * 4)] * 6
    for mode, r, prefix, ext in steps:
        b = _batch(mode, r, prefix, ext, "cuda")
        x = inputs(sum(ext))
        outs = []
        for be in (fla, ref):
            be.init_forward_metadata(b)
            outs.append(be.forward(0, *x))
        real = sum(ext) - (1 if mode is ForwardMode.DECODE else 0)  # the padded row's output
        err = _rel_err(outs[0][:real], outs[1][:real])
        assert err <= FLA_TOL[dtype], f"{mode.name}: out rel err {err:.2e}"
        s_err = _rel_err(pools[0].recurrent[0, rows], pools[1].recurrent[0, rows])
        assert s_err <= FLA_TOL[dtype], f"{mode.name}: state rel err {s_err:.2e}"
    untouched = [i for i in range(1, slots) if i not in rows]
    assert torch.equal(pools[0].recurrent[0, untouched], init[untouched].cuda())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gdn_decode_kernel_equals_recurrence(dtype: torch.dtype) -> None:
    """Our Triton GDN decode step (interpreted on CPU): out and state equal the recurrence;
    slots of other requests (NaN-poisoned) untouched; padded rows only touch the dummy slot."""
    from mla_backends.kernels.gdn_decode import gdn_decode

    dev = "cuda" if GPU else "cpu"
    gen = torch.Generator().manual_seed(5)
    b, h, dk, dv, slots = 3, 2, 16, 16, 6
    rows = torch.tensor([4, 0, 2], dtype=torch.int32)  # row 0: a padded row (dummy slot)
    states = torch.randn(slots, h, dk, dv, generator=gen)
    states[1] = states[3] = states[5] = float("nan")
    q = torch.nn.functional.normalize(torch.randn(b, h, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, h, dv, generator=gen)
    g = -torch.rand(b, h, generator=gen)
    beta = torch.rand(b, h, generator=gen)
    st = states.clone().to(dev)  # the kernel updates it in place
    args = [x.to(dev, dtype) for x in (q, k, v, g, beta)]
    out = gdn_decode(*args, st, rows.to(dev), 0.3)
    st = st.cpu()
    for i, r in enumerate(rows.tolist()):
        if r == 0:
            continue
        ref_o, ref_s = gated_delta_rule(*(x[i : i + 1].float().cpu() for x in args), states[r], 0.3)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[i].float().cpu(), ref_o[0], rtol=tol, atol=tol)
        torch.testing.assert_close(
            st[r], ref_s, rtol=1e-5 if dtype == torch.float32 else 2e-2, atol=tol
        )
    for r in (1, 3, 5):
        assert torch.isnan(st[r]).all()


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND], ids=["decode", "extend"])
def test_q_of_other_heads_than_the_state_pool_is_refused(mode: ForwardMode) -> None:
    """q / k / v / beta of one head broadcast through the decode einsums against a 3-head
    state: every head's state advanced with the same q and k, no error."""
    pool = LinearStatePool(1, 4, H, K, V, 16, 4, "cpu")
    be = LinearAttentionBackend(pool)
    be.init_forward_metadata(_batch(mode, [1, 2], [3, 3], [1, 1]))
    q, k, v, g, beta = _inputs(2, torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match=rf"q: expected shape \[\*, {H}, {K}\], got \[2, 1, {K}\]"):
        be.forward(0, q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1])
    assert (pool.recurrent == 0).all()


@pytest.mark.parametrize("row", [-1, 5])
def test_state_reset_refuses_rows_outside_the_requests(row: int) -> None:
    """reset([-1]) zeroed the last slot, a live request's state."""
    pool = LinearStatePool(1, 4, H, K, V, 16, 4, "cpu")
    pool.recurrent.fill_(1.0)
    with pytest.raises(ValueError, match=rf"rows \[{row}\] are not request rows \(1..4\)"):
        pool.reset([2, row])
    assert (pool.recurrent == 1).all()


def test_linear_layers_and_rows_of_the_wrong_kind_are_refused_before_any_write() -> None:
    """Layer -1 advanced the last linear layer's states and a float or bool row reset row 1,
    silently; a float row in a request-table check failed deep inside (helper 59's review).
    A new request (no cached prefix) starts from zero state whatever its row holds."""
    from mla_backends.pool import LayerIndexError, ReqToTokenPool

    pool = LinearStatePool(2, 4, H, K, V, 16, 4, "cpu")
    pool.recurrent.fill_(1.0)
    be = LinearAttentionBackend(pool)
    be.init_forward_metadata(_batch(ForwardMode.DECODE, [1, 2], [3, 3], [1, 1]))
    x = _inputs(2, torch.Generator().manual_seed(6))
    for layer in (-1, 2, True):
        with pytest.raises(
            LayerIndexError, match=r"out of range: the state pool has linear layers 0..1"
        ):
            be.forward(layer, *x)  # type: ignore[arg-type]
    for bad in ([1.5], [True]):
        with pytest.raises(TypeError, match=r"rows must be integers"):
            pool.reset(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"rows must be integers"):
            ReqToTokenPool(4, 16, "cpu").check_rows(bad)  # type: ignore[arg-type]
    assert (pool.recurrent == 1).all()
    be.init_forward_metadata(_batch(ForwardMode.EXTEND, [1, 2], [0, 3], [2, 2]))
    q, k, v, g, beta = _inputs(4, torch.Generator().manual_seed(7))
    out = be.forward(0, q, k, v, g, beta)
    want, _ = gated_delta_rule(q[:2], k[:2], v[:2], g[:2], beta[:2], torch.zeros(H, K, V), be.scale)
    torch.testing.assert_close(out[:2], want, rtol=1e-6, atol=1e-6)  # row 1: from zero
    cont, _ = gated_delta_rule(q[2:], k[2:], v[2:], g[2:], beta[2:], torch.ones(H, K, V), be.scale)
    torch.testing.assert_close(out[2:], cont, rtol=1e-6, atol=1e-6)  # row 2: its state


def test_a_request_row_twice_in_one_batch_is_refused() -> None:
    """Two tokens of one row in a DECODE batch built by hand: the linear state kept only the
    last token's update, silently (the allocator refuses it; a hand-built batch did not)."""
    from mla_backends.pool import ReqToTokenPool, RequestRowError

    table = ReqToTokenPool(4, 16, "cpu")
    (row,) = table.alloc(1)
    table.filled[row] = 3
    batch = ForwardBatch.build(
        ForwardMode.DECODE, [row, row], [2, 2], [1, 1], torch.zeros(2, dtype=torch.int64), "cpu"
    )
    with pytest.raises(
        RequestRowError, match=r"a request row appears twice in one batch: \[1, 1\]"
    ):
        table.check_batch(batch)
    table.check_batch(ForwardBatch.build(ForwardMode.DECODE, [row, 0, 0], [2, 0, 0], [1] * 3,
                                         torch.zeros(3, dtype=torch.int64), "cpu"))  # fmt: skip


@pytest.mark.parametrize(
    "before", [ForwardMode.EXTEND, ForwardMode.DECODE], ids=["after_extend", "after_decode"]
)
@pytest.mark.parametrize("kernels", ["torch", "fla"])
def test_an_idle_batch_runs_no_kernel_and_touches_no_state(
    kernels: str, before: ForwardMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An IDLE batch (no requests, no tokens) after another batch, GDN and KDA inputs: an
    empty [0, H, V] output from one branch shared by every kernel path (fla's took it for a
    prefill with the EXTEND batch's varlen offsets still set)."""
    from mla_backends.linear import fla_ops

    def no_kernel(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a linear kernel ran for an IDLE batch")

    monkeypatch.setattr(fla_ops, "prefill", no_kernel)
    monkeypatch.setattr(fla_ops, "decode", no_kernel)
    pool = LinearStatePool(1, 4, H, K, V, 16, 4, "cpu")
    pool.recurrent.normal_(generator=torch.Generator().manual_seed(6))
    before_state = pool.recurrent.clone()
    be = LinearAttentionBackend(pool)
    be.kernels = kernels  # fla's constructor needs CUDA; the dispatch under test does not
    be._gdn_decode = no_kernel  # fla's GDN decode (Triton)
    n = [3, 2] if before is ForwardMode.EXTEND else [1, 1]
    be.init_forward_metadata(_batch(before, [1, 2], [0, 0], n))
    be.init_forward_metadata(_batch(ForwardMode.IDLE, [], [], []))
    gen = torch.Generator().manual_seed(7)
    for kda in (False, True):
        o = be.forward(0, *_inputs(0, gen, kda))
        assert o.shape == (0, H, V) and o.dtype == torch.float32
    assert torch.equal(pool.recurrent, before_state)


@pytest.mark.parametrize(
    ("dk", "dv", "fits"), [(8, 8, True), (8, 6, False), (6, 8, False), (512, 8, False)]
)
def test_fla_is_chosen_only_for_head_dims_its_kernels_take(
    dk: int, dv: int, fits: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`auto` picked fla on any CUDA pool; our GDN decode kernel (`tl.arange`, no masks) needs
    power-of-two K and V, fla's chunk kernels assert K <= 256. Unfit dims: auto runs torch and
    warns why, kernels="fla" is refused naming the dims."""
    from mla_backends.linear import backend as lb

    monkeypatch.setattr(lb, "missing", lambda name: None)  # as if fla were installed
    pool = LinearStatePool(1, 2, H, dk, dv, 16, 4, "cpu")
    pool.device = torch.device("cuda")  # as if on a GPU: the choice reads the device, not data
    with caplog.at_level(logging.WARNING, logger=lb.__name__):
        assert LinearAttentionBackend(pool).kernels == ("fla" if fits else "torch")
    assert (
        f"not fla: needs power-of-two head dims with key dim <= 256, pool has K {dk}, V {dv}"
        in caplog.text
    ) is not fits
    if not fits:
        with pytest.raises(ValueError, match=rf"'fla': .* pool has K {dk}, V {dv}$"):
            LinearAttentionBackend(pool, kernels="fla")


def test_fla_head_dims_take_a_key_dim_of_exactly_256() -> None:
    """M47 (linear/backend.py:343 `dk > 256` -> `dk >= 256`): fla's chunk kernels take key
    dims up to 256 inclusive (Kimi-Linear's KDA heads are 128; 256 is the documented limit)."""
    from mla_backends.linear.backend import _fla_dims

    assert _fla_dims(LinearStatePool(1, 2, 2, 256, 64, 16, 4, "cpu")) is None
    assert _fla_dims(LinearStatePool(1, 2, 2, 512, 64, 16, 4, "cpu")) is not None


def test_linear_forward_refuses_inputs_that_are_not_the_batchs_tokens_or_not_float() -> None:
    """A q of fewer tokens than the batch was sliced per request short (the second request's
    state advanced over 2 of its 4 tokens, silently); integer inputs ran as ints."""
    pool = LinearStatePool(1, 4, H, K, V, 16, 4, "cpu")
    lin = LinearAttentionBackend(pool, kernels="torch")
    loc = torch.arange(1, 8)
    lin.init_forward_metadata(
        ForwardBatch.build(ForwardMode.EXTEND, [1, 2], [0, 0], [3, 4], loc, "cpu")
    )
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match=r"q: expected the batch's 7 tokens, got 5"):
        lin.forward(0, *_inputs(5, gen))
    assert not pool.recurrent.any()  # nothing advanced
    q, k, v, g, beta = _inputs(7, gen)
    with pytest.raises(TypeError, match=r"must be floating point, got \{'q': 'torch.int32'\}$"):
        lin.forward(0, q.int(), k, v, g, beta)
    with pytest.raises(TypeError, match=r"got \{'beta': 'torch.int64'\}$"):  # named alone
        lin.forward(0, q, k, v, g, beta.long())
    assert lin.forward(0, q, k, v, g, beta).shape == (7, H, V)
