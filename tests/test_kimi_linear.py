"""The Kimi-Linear-style hybrid model (KDA + NoPE MLA, 3 : 1) on HybridBackend, CPU paths:
incremental decode equals the full-sequence forward with requests joining and leaving, and
padded decode rows never touch a real request's state."""

from __future__ import annotations

import os

import pytest
import torch

from mla_backends.backends.hybrid import HybridBackend
from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.config import Config, MLADims
from mla_backends.linear.backend import LinearAttentionBackend
from mla_backends.linear.state_pool import LinearStatePool
from mla_backends.runtime import Runtime
from models.engine import Engine
from models.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM, short_conv

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
CFG = KimiLinearConfig()


def _model() -> KimiLinearForCausalLM:
    torch.manual_seed(0)
    m = KimiLinearForCausalLM(CFG).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    return m


def _engine(model: KimiLinearForCausalLM, backend: str = "torch") -> Engine:
    kinds = CFG.kinds
    n_full, n_lin = kinds.count("full"), kinds.count("linear")
    dims = MLADims(
        num_heads=CFG.mla_heads,
        kv_lora_rank=CFG.kv_lora_rank,
        qk_rope_head_dim=CFG.qk_rope_head_dim,
        qk_nope_head_dim=CFG.qk_nope_head_dim,
        v_head_dim=CFG.v_head_dim,
    )
    rt = Runtime.build(
        Config(
            model=dims,
            num_layers=n_full,
            prefill_backend=backend,
            decode_backend=backend,
            page_size=16,
            kv_dtype="float32",
            dtype="float32",
            num_pages=64,
            max_requests=6,
            device="cpu",
        )
    )
    h, d = CFG.kda_heads, CFG.kda_head_dim
    pool = LinearStatePool(n_lin, 6, h, d, d, 3 * h * d, CFG.conv_kernel, "cpu")
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


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_incremental_equals_full_with_requests_joining_and_leaving(backend: str) -> None:
    if backend == "triton" and not INTERP:
        pytest.skip("triton on CPU needs TRITON_INTERPRET=1")
    model = _model()
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n in (14, 9, 11)]
    eng = _engine(model, backend)
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
        want = _full(model, backend, seqs[k][: lens[k]])
        assert _rel(torch.cat(parts), want) <= 1e-4, (k, _rel(torch.cat(parts), want))


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
