"""CUTLASS MLA and TRT-LLM MLA (SM100 kernels) behind our interface.

No machine here has an SM100 GPU, so the contract tests swap the real kernel call for a
plain-PyTorch emulation of its documented contract (`mla_backends/backends/emulation.py`,
conftest's `emulated`), which rejects what the real call rejects. Everything our backend
computes around the kernel (page tables, padding to the block multiple, verify row
expansion, FP8 scale folding, output layout, graph refills) is then checked against the
MHA-expanded reference on CPU: the parity matrix and batch sizes through the emulations and on
a real SM100 are rows of tests/parity.py; here the padded graph batch, the emulations'
refusals, CUTLASS without LSE and the refusals on Hopper.
"""

from __future__ import annotations

import math

import pytest
import torch

import mla_backends.backends.cutlass_mla as cutlass_mod
import mla_backends.backends.trtllm_mla as trtllm_mod
from mla_backends.backends import emulation
from mla_backends.backends.base import Capability
from mla_backends.backends.registry import get_backend_class
from mla_backends.batch import ForwardMode
from mla_backends.config import DEEPSEEK_V3, Config
from mla_backends.testing import Case, build_case, run_case

CPU = torch.device("cpu")
H100 = Capability("cuda", (9, 0), "NVIDIA H100 80GB HBM3")
B200 = Capability("cuda", (10, 0), "NVIDIA B200")


@pytest.mark.parametrize("name, page", [("cutlass_mla", 128), ("trtllm_mla", 32)])
def test_contract_padded_graph_batch(emulated: None, name: str, page: int) -> None:
    """Graph hooks: static tables sized for the longest context, refilled on replay; a
    padded batch (request row 0, seq_len = fill value, dummy-page slots) leaves real rows
    and their outputs unchanged."""
    case = Case(name, ForwardMode.DECODE, page, 16, "bfloat16", "bfloat16", 1, (5, 40, 200))
    rt, batch = build_case(case, CPU)
    be = rt.backend
    q = torch.randn(3, 16, 512).bfloat16(), torch.randn(3, 16, 64).bfloat16()
    k = torch.randn(3, 512).bfloat16(), torch.randn(3, 64).bfloat16()
    be.init_forward_metadata(batch)
    eager = be.forward_absorbed(0, *q, *k, batch)
    assert torch.isfinite(eager).all()
    # pad 3 real requests to a captured size of 5
    from mla_backends.batch import ForwardBatch

    fill = be.cuda_graph_seq_len_fill_value
    rows = batch.req_pool_indices.tolist() + [0, 0]
    seq = batch.seq_lens_cpu.tolist() + [fill, fill]
    loc = torch.cat([batch.out_cache_loc, torch.zeros(2, dtype=torch.int64)])  # dummy page
    padded = ForwardBatch.build(ForwardMode.DECODE, rows, [s - 1 for s in seq], [1] * 5, loc, "cpu")
    be.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    be.init_forward_metadata_capture(padded)
    table_ptr = be.metadata.table.data_ptr()
    assert be.metadata.table.shape[1] % max(1, 128 // page) == 0
    be.init_forward_metadata_replay(padded)
    assert be.metadata.table.data_ptr() == table_ptr
    pad = lambda x: torch.cat([x, torch.randn(2, *x.shape[1:]).to(x.dtype)])  # noqa: E731
    before = rt.kv_pool.kv_buffer[0].view(torch.int16).clone()
    out = be.forward_absorbed(0, *map(pad, q), *map(pad, k), padded)
    torch.testing.assert_close(out[:3], eager, rtol=0, atol=0)
    after = rt.kv_pool.kv_buffer[0].view(torch.int16)
    ps = rt.kv_pool.page_size
    assert torch.equal(after[ps:], before[ps:]), "a padded row wrote outside the dummy page"


def test_emulations_reject_what_the_kernels_reject() -> None:
    kv = torch.zeros(3, 128, 576, dtype=torch.bfloat16)
    qn, qp = (
        torch.zeros(2, 16, 512, dtype=torch.bfloat16),
        torch.zeros(2, 16, 64, dtype=torch.bfloat16),
    )
    seq, table, ws = (
        torch.tensor([3, 4], dtype=torch.int32),
        torch.ones(2, 1, dtype=torch.int32),
        torch.zeros(8),
    )
    ok = emulation.cutlass_mla_decode(qn, qp, kv, seq, table, ws, 0.1)
    assert ok.shape == (2, 16, 512)
    wide = qn.new_zeros(2, 128, 512), qp.new_zeros(2, 128, 64)  # the most heads it takes
    assert emulation.cutlass_mla_decode(*wide, kv, seq, table, ws, 0.1).shape == (2, 128, 512)
    bad = [
        ((qn, qp[:, :8], kv, seq, table, ws, 0.1), "q_nope / q_pe batch or heads differ"),
        ((qn, qp, kv, seq, table[:, :0], ws, 0.1), "block num must be greater than 0"),
        ((qn, qp, kv, seq, table, ws[:0], 0.1), "workspace must be allocated"),
        ((qn.float(), qp.float(), kv.float(), seq, table, ws, 0.1), "not fp16/bf16"),
        ((qn, qp, kv, seq.long(), table, ws, 0.1), "seq_lens must be int32"),
        ((qn, qp, kv, seq, table.long(), ws, 0.1), "page_table must be int32"),
        ((qn, qp, kv[:, :64], seq, table, ws, 0.1), r"block num % \(128 / 64\)"),
        (
            (
                torch.zeros(2, 129, 512, dtype=torch.bfloat16),
                torch.zeros(2, 129, 64, dtype=torch.bfloat16),
                kv,
                seq,
                table,
                ws,
                0.1,
            ),
            "H must be <= 128",
        ),
        ((qn, qp, kv.half(), seq, table, ws, 0.1), "dtypes differ"),
    ]
    for args, msg in bad:
        with pytest.raises(emulation.KernelContractError, match=msg):
            emulation.cutlass_mla_decode(*args)

    kv = torch.zeros(3, 64, 576, dtype=torch.bfloat16)
    q = torch.zeros(2, 1, 16, 576, dtype=torch.bfloat16)
    table = torch.ones(2, 2, dtype=torch.int32)
    ws = torch.zeros(64, dtype=torch.uint8)
    base = dict(
        query=q,
        kv_cache=kv,
        workspace_buffer=ws,
        qk_nope_head_dim=128,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        block_tables=table,
        seq_lens=seq,
        max_seq_len=4,
    )
    assert emulation.trtllm_batch_decode_with_kv_cache_mla(**base).shape == (2, 1, 16, 512)
    lse = {  # base 2 unless asked for base e
        b: emulation.trtllm_batch_decode_with_kv_cache_mla(
            **base, return_lse=True, return_lse_base=b
        )[1]
        for b in (None, "base2", "basee")
    }
    torch.testing.assert_close(lse[None], lse["basee"] / math.log(2), rtol=1e-6, atol=0)
    torch.testing.assert_close(lse["base2"], lse[None], rtol=0, atol=0)
    for change, msg in [
        ({"kv_cache": torch.zeros(3, 2, 64, 576, dtype=torch.bfloat16)}, "4D kv_cache must be"),
        ({"seq_lens": torch.tensor([3, 4, 4], dtype=torch.int32)}, r"seq_lens \[B\] int32"),
        ({"kv_cache": torch.zeros(3, 16, 576, dtype=torch.bfloat16)}, "page size 32 or 64"),
        ({"block_tables": torch.ones(2, 3, dtype=torch.int32)}, r"blocks % \(128 / 64\)"),
        ({"kv_cache": kv.to(torch.float8_e4m3fn)}, "share a dtype"),
        ({"workspace_buffer": torch.ones(64, dtype=torch.uint8)}, "zero-initialized"),
        ({"max_seq_len": 3}, "exceeds max_seq_len"),
        ({"query": q.half(), "kv_cache": kv.half()}, "query dtype"),
    ]:
        with pytest.raises(emulation.KernelContractError, match=msg):
            emulation.trtllm_batch_decode_with_kv_cache_mla(**{**base, **change})


def test_cutlass_has_no_lse(emulated: None) -> None:
    rt, batch = build_case(Case("cutlass_mla", page_size=128, kv_lens=(5,)), CPU)
    rt.backend.init_forward_metadata(batch)
    q = torch.randn(1, 16, 512).bfloat16(), torch.randn(1, 16, 64).bfloat16()
    with pytest.raises(NotImplementedError, match="returns no LSE"):
        rt.backend.forward_absorbed(0, *q, None, None, batch, return_lse=True)


@pytest.mark.parametrize(
    "name, cfg, pattern",
    [
        (
            "cutlass_mla",
            {"page_size": 128},
            r"CUTLASS MLA needs SM 100, found NVIDIA H100 80GB HBM3 \(SM90\)",
        ),
        (
            "trtllm_mla",
            {"page_size": 64},
            r"TRT-LLM MLA needs SM 100 or 103, found NVIDIA H100 80GB HBM3",
        ),
        ("cutlass_mla", {"page_size": 64}, r"needs page_size in \(128,\)"),
        ("trtllm_mla", {"page_size": 128}, r"needs page_size in \(32, 64\)"),
        ("cutlass_mla", {"page_size": 128, "kv_dtype": "float8_e4m3fn"}, "needs kv_dtype in"),
    ],
)
def test_refused_on_hopper_with_a_clear_reason(
    monkeypatch: pytest.MonkeyPatch, name: str, cfg: dict, pattern: str
) -> None:
    monkeypatch.setattr(cutlass_mod, "missing", lambda *a: None)
    monkeypatch.setattr(trtllm_mod, "missing", lambda *a: None)
    config = Config(model=DEEPSEEK_V3, device="cpu", **cfg)
    reason = get_backend_class(name).supports(config, H100, "decode")
    assert reason is not None and __import__("re").search(pattern, reason), reason
    ok = {"cutlass_mla": {"page_size": 128}, "trtllm_mla": {"page_size": 64}}[name]
    assert (
        get_backend_class(name).supports(
            Config(model=DEEPSEEK_V3, device="cpu", **ok), B200, "decode"
        )
        is None
    )


def test_cutlass_always_one_kv_split_and_workspace_for_one(
    emulated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN: CUTLASS split-KV > 1 is not graph-safe (a peer hung): every call, eager and
    verify, passes num_kv_splits=1, and the workspace is sized for one split."""
    seen: list[int] = []
    sized: list[int] = []

    def decode(*a: object, **k: object) -> torch.Tensor:
        seen.append(int(k.get("num_kv_splits", a[7] if len(a) > 7 else 1)))  # type: ignore[arg-type]
        return emulation.cutlass_mla_decode(*a, **k)  # type: ignore[arg-type]

    def ws(max_len: int, rows: int, sms: int = 0, splits: int = 1) -> int:
        sized.append(splits)
        return 1 << 20

    monkeypatch.setattr(cutlass_mod, "load_kernel", lambda: (decode, ws))
    for mode, q in ((ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, 3)):
        case = Case("cutlass_mla", mode, 128, 16, "bfloat16", "bfloat16", q, (0, 3, 129, 300))
        r = run_case(case)
        assert r.ok, r.detail
    assert seen and set(seen) == {1} and set(sized) == {1}, (seen, sized)
