"""DeepSeek-V3.2 on the sparse backends against HF transformers' DeepseekV32ForCausalLM (fp32,
unquantised indexer: HF's maths), with contexts longer than index_topk so the selection
matters; the indexer's top-k sets against HF's indexer; engine paths; checkpoint errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_deepseek_v3 import TINY_HF as V3_TINY_HF

from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.config import Config
from mla_backends.models.deepseek_v3 import rope_tables
from mla_backends.models.deepseek_v32 import (
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    IndexerWeights,
    load_model,
)
from mla_backends.models.engine import Engine
from mla_backends.models.loader import CheckpointError
from mla_backends.pool import MLATokenToKVPool, RequestRowError
from mla_backends.runtime import Runtime
from mla_backends.sparse.base import runs_dense
from mla_backends.sparse.dsa import DSABackend
from mla_backends.sparse.indexer import (
    Indexer,
    IndexerMetadata,
    IndexKCache,
    positions_to_slots,
    prepare_q,
    select_topk,
)

TOPK = 6
# The tiny DeepSeek-V3 of tests/test_deepseek_v3.py with the lightning indexer.
TINY_HF = dict(V3_TINY_HF, index_n_heads=8, index_head_dim=32, index_topk=TOPK)


def _randomize(model) -> None:  # type: ignore[no-untyped-def]
    """Non-trivial routing and an indexer whose scores spread (HF's 0.02 init is near flat)."""
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0, 0.5)
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.2, 0.2)
        for layer in model.model.layers:
            ix = layer.self_attn.indexer
            for w in (ix.wq_b.weight, ix.wk.weight, ix.weights_proj.weight):
                w.normal_(0, 0.2)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**TINY_HF)).eval()
    _randomize(model)
    path = tmp_path_factory.mktemp("tiny-dsv32")
    model.save_pretrained(path)
    return path, model


def _engine(  # type: ignore[no-untyped-def]
    model,
    sparse: str = "torch",
    kernels: str = "torch",
    quantized: bool = False,
    fp8_rows: bool = False,
    dtype: str = "float32",
) -> tuple[Engine, DSABackend]:
    c = model.cfg
    rt = Runtime.build(
        Config(
            model=c.attention_dims,
            num_layers=c.num_hidden_layers,
            prefill_backend="torch",
            decode_backend="torch",
            page_size=16,
            kv_dtype=dtype,
            dtype=dtype,
            num_pages=64,
            max_requests=8,
            max_context_len=256,
            device="cpu",
        )
    )
    dsa = DSABackend.build(rt, c.indexer_dims(quantized), sparse, fp8_rows, kernels)
    return Engine(model, rt, dsa), dsa


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _hf_last(hf, seq: list[int], topk: int | None = None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """HF logits of the whole sequence; `topk` overrides every layer's index_topk."""
    idx = [layer.self_attn.indexer for layer in hf.model.layers]
    old = [i.index_topk for i in idx]
    try:
        for i in idx:
            i.index_topk = topk or i.index_topk
        with torch.no_grad():
            return hf(torch.tensor([seq])).logits[0].float()
    finally:
        for i, k in zip(idx, old):
            i.index_topk = k


def _parity(hf, model, sparse: str, kernels: str, steps: int) -> None:  # type: ignore[no-untyped-def]
    eng, dsa = _engine(model, sparse, kernels)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (17, 5, 11)]
    rows = eng.new_requests(len(prompts))
    logits = eng.extend(rows, prompts)
    assert not dsa.use_dense()  # 17 > topk keys: the prefill itself is sparse
    start = 0
    for p in prompts:
        assert _rel(logits[start : start + len(p)], _hf_last(hf, p)) <= 1e-4
        start += len(p)
    # The selection matters: HF attending densely gives different logits.
    assert _rel(logits[:17], _hf_last(hf, prompts[0], topk=1000)) > 1e-2
    seqs = [list(p) for p in prompts]
    for step in range(steps):
        nxt = [int(torch.randint(0, 96, (1,), generator=gen)) for _ in rows]
        out = eng.decode(rows, nxt)
        for i, s in enumerate(seqs):
            s.append(nxt[i])
            assert _rel(out[i], _hf_last(hf, s)[-1]) <= 1e-4, f"decode step {step}, request {i}"


def test_logits_equal_hf_prefill_and_every_decode_step(hf_checkpoint) -> None:  # type: ignore[no-untyped-def]
    path, hf = hf_checkpoint
    _parity(hf, load_model(path), "torch", "torch", 5)


@pytest.mark.interp
def test_logits_equal_hf_with_triton_indexer_and_sparse_kernels(hf_checkpoint) -> None:  # type: ignore[no-untyped-def]
    path, hf = hf_checkpoint
    _parity(hf, load_model(path), "triton", "triton", 2)


def test_short_batches_run_dense_then_sparse_and_equal_hf(hf_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Every query sees <= topk keys: V3's dense path (MHA prefill); once a request passes
    topk keys the batch turns sparse, the short request's row holding all its keys."""
    path, hf = hf_checkpoint
    eng, dsa = _engine(load_model(path))
    seqs = [[3, 14, 15, 92], [6, 53, 58, 9, 79]]
    rows = eng.new_requests(2)
    logits = eng.extend(rows, seqs)
    assert dsa.use_dense()
    assert _rel(logits[:4], _hf_last(hf, seqs[0])) <= 1e-4
    assert _rel(logits[4:], _hf_last(hf, seqs[1])) <= 1e-4
    for step, toks in enumerate(([1, 2], [4, 5], [7, 8])):
        out = eng.decode(rows, toks)
        assert dsa.use_dense() == (step == 0)  # 7 > topk keys from the second step on
        for i, s in enumerate(seqs):
            s.append(toks[i])
            assert _rel(out[i], _hf_last(hf, s)[-1]) <= 1e-4


@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=pytest.mark.interp)])
def test_indexer_topk_sets_equal_hf_indexer(kernels: str) -> None:
    """Random inputs, no ties: our unquantised indexer selects exactly HF's top-k sets."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m

    raw = dict(TINY_HF, index_topk=16)
    hf_cfg = transformers.DeepseekV32Config(**raw)
    torch.manual_seed(3)
    hf_ix = m.DeepseekV32Indexer(hf_cfg, 0).eval()
    with torch.no_grad():
        for w in (hf_ix.wq_b.weight, hf_ix.wk.weight, hf_ix.weights_proj.weight):
            w.normal_(0, 0.2)
    ours = IndexerWeights(DeepseekV32Config.from_hf(hf_cfg.to_dict()))
    ours.load_state_dict(hf_ix.state_dict())
    s = 48
    x, q_lora = torch.randn(1, s, 64), torch.randn(1, s, 48)
    pos = torch.arange(s)[None]
    cos_hf, sin_hf = m.DeepseekV32RotaryEmbedding(hf_cfg)(x, pos)
    mask = torch.full((s, s), float("-inf")).triu(1)[None]
    with torch.no_grad():
        hf_top = hf_ix(x, q_lora, (cos_hf, sin_hf), mask, pos)[0]

    cfg = DeepseekV32Config.from_hf(hf_cfg.to_dict())
    inv_freq, rope_scale = rope_tables(cfg)
    ang = torch.arange(s).float()[:, None] * inv_freq[None]
    cos, sin = ang.cos() * rope_scale, ang.sin() * rope_scale
    dims = cfg.indexer_dims(quantized=False)
    cache = IndexKCache(1, 64, dims.head_dim, False, "cpu")
    r2t = torch.zeros(2, 64, dtype=torch.int32)
    r2t[1, :s] = torch.randperm(60)[:s].int() + 2
    ix = Indexer(dims, cache, r2t, kernels)
    with torch.no_grad():
        ix.store(0, ours.key(x[0]), cos, sin, r2t[1, :s].long())
        q, w = ours.query(q_lora[0], x[0])
    rows, vis = torch.ones(s, dtype=torch.long), torch.arange(1, s + 1, dtype=torch.int32)
    ix.metadata = IndexerMetadata(rows, vis, s, [(0, s)])
    qp, wp = prepare_q(dims, q, w, cos, sin)
    logits = ix.logits(0, qp, wp, 0, s)
    ordered = logits.sort(dim=-1, descending=True).values
    gap = (ordered[:, 15] - ordered[:, 16])[vis > 16]
    # fp32 rounding differs from HF's by ~1e-7 relative: gaps far above it mean no ties.
    assert (gap > 1e-5 * ordered[:, 0][vis > 16].abs()).all(), "near ties: pick other inputs"
    slots = positions_to_slots(select_topk(logits, 16), r2t, rows)
    want = positions_to_slots(hf_top, r2t, rows)
    checked = 0
    for t in range(s):
        v = min(16, t + 1)
        got = sorted(x for x in slots[t].tolist() if x >= 0)
        # HF picks min(topk, S) entries, masked (future) ones among them for short rows.
        exp = sorted(r2t[1, p].item() for p in hf_top[t].tolist() if p <= t)
        assert got == exp and len(got) == v, f"token {t}"
        assert set(got) <= set(want[t].tolist())
        checked += 1
    assert checked == s


def test_incremental_equals_full_forward(hf_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Sparse prefill, prefix extend, decode beside another request, a q_len 3 verify and a
    final extend give the logits of one full prefill."""
    model = load_model(hf_checkpoint[0])
    gen = torch.Generator().manual_seed(2)
    seq = torch.randint(0, 96, (40,), generator=gen).tolist()
    full, _ = _engine(model)
    want = full.extend(full.new_requests(1), [seq])
    inc, _ = _engine(model)
    a, b = inc.new_requests(2)
    got = [inc.extend([a], [seq[:13]]), inc.extend([a], [seq[13:21]])]
    inc.extend([b], [seq[:5]])
    for i in range(21, 30):
        got.append(inc.decode([a, b], [seq[i], seq[i - 16]])[:1])
    got.append(inc.verify([a, b], [seq[30:33], seq[14:17]])[:3])
    inc.accept([a, b], [3, 3])
    got.append(inc.extend([a], [seq[33:]]))
    assert _rel(torch.cat(got), want) <= 1e-4


def test_graph_runner_path_equals_eager(hf_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Decode through the graph runner's static, padded batches (no capture on CPU): the
    indexer and sparse backend replay hooks refill static buffers; logits equal eager."""
    model = load_model(hf_checkpoint[0])
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (9, 2, 17)]
    (e1, _), (e2, dsa) = _engine(model), _engine(model)
    e2.enable_graphs([1, 2, 4], use_graphs=False)
    rows = [e.new_requests(3) for e in (e1, e2)]
    for e, r in zip((e1, e2), rows):
        e.extend(r, prompts)
    for step in range(4):
        k = 3 if step % 2 == 0 else 2
        toks = torch.randint(0, 96, (k,), generator=gen).tolist()
        want, got = (e.decode(r[:k], toks) for e, r in zip((e1, e2), rows))
        assert not dsa.use_dense()  # graphs always take the sparse path
        assert _rel(got, want) <= 1e-5, f"step {step}"


@pytest.mark.interp
def test_quantized_indexer_triton_equals_torch(hf_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """The deployed indexer (Hadamard + e4m3): fused Triton store and logits kernels select
    what the torch maths selects, and so give the same logits."""
    model = load_model(hf_checkpoint[0])
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (15, 9)]
    outs = []
    for kernels in ("torch", "triton"):
        eng, _ = _engine(model, "torch", kernels, quantized=True)
        rows = eng.new_requests(2)
        got = [eng.extend(rows, prompts)]
        got += [eng.decode(rows, [5, 6]), eng.decode(rows, [7, 8])]
        outs.append(torch.cat(got))
    assert _rel(outs[1], outs[0]) <= 1e-5


def _fp8_row_model(tmp: Path):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    raw = dict(TINY_HF, kv_lora_rank=128, num_hidden_layers=2)
    hf = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**raw)).eval()
    _randomize(hf)
    hf.save_pretrained(tmp)
    return load_model(tmp), hf


@pytest.mark.interp
def test_fp8_row_pool_model_torch_equals_triton(tmp_path: Path) -> None:
    """Latent rows in the 656-style FP8 row format (L = 128 here): dense batches run the
    sparse backend over every key, long ones the indexer's selection; the torch and Triton
    sparse backends read the same dequantised rows, and the logits stay within e4m3 error
    of HF's unquantised model."""
    model, hf = _fp8_row_model(tmp_path)
    seqs = [[3, 1, 4, 1, 5], list(range(20, 32))]
    outs = []
    for sparse in ("torch", "triton"):
        eng, dsa = _engine(model, sparse, "torch", fp8_rows=True)
        rows = eng.new_requests(2)
        got = [eng.extend(rows[:1], seqs[:1])]
        assert dsa.use_dense() and dsa.dense is None  # FP8 rows: dense via the sparse backend
        got.append(eng.extend(rows[1:], seqs[1:]))
        got.append(eng.decode(rows, [9, 9]))
        outs.append(torch.cat(got))
    assert _rel(outs[1], outs[0]) <= 1e-4
    want = torch.cat([_hf_last(hf, seqs[0]), _hf_last(hf, seqs[1])])
    assert _rel(outs[0][:17], want) <= 2**-4


def test_fp8_row_dense_slots_are_built_once_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dense batch over FP8 rows runs the sparse backend over every visible key: those
    slots are built once per batch (`DSABackend.init_forward_metadata`) and read by every
    layer (each layer rebuilt them: two indexing kernels and a table gather a layer); another
    batch's slots, or slots of a sparse batch, are refused."""
    from mla_backends.sparse import dsa as dsa_mod

    model = DeepseekV32ForCausalLM(
        DeepseekV32Config.from_hf(dict(TINY_HF, kv_lora_rank=128, num_hidden_layers=2))
    ).eval()
    eng, dsa = _engine(model, fp8_rows=True)
    built: list[int] = []
    real = dsa_mod.dense_indices

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dsa_mod, "dense_indices", counted)
    a, b = eng.new_requests(2)
    eng.extend([a], [[3, 1, 4, 1, 5]])
    assert dsa.use_dense() and dsa.dense is None and len(built) == 1  # two layers, one build
    eng.extend([b], [list(range(20, 32))])  # 12 > topk keys: sparse, no dense slots
    assert not dsa.use_dense() and len(built) == 1
    batches = [_decode_batch(eng, r) for r in (a, b)]
    dsa.init_forward_metadata(batches[0])  # 6 keys: dense
    assert len(built) == 2
    slots = dsa.dense_slots(batches[0])
    assert dsa.dense_slots(batches[0]) is slots
    assert torch.equal(slots, real(dsa.sparse.req_to_token, batches[0], TOPK))
    with pytest.raises(RuntimeError, match="no dense slots for this batch"):
        dsa.dense_slots(batches[1])
    dsa.init_forward_metadata(batches[1])  # 13 keys: sparse
    with pytest.raises(RuntimeError, match="no dense slots for this batch"):
        dsa.dense_slots(batches[1])
    with pytest.raises(RuntimeError, match="no dense slots for this batch"):
        dsa.dense_slots(batches[0])  # a later batch's init drops the earlier one's slots


def test_missing_indexer_tensor_is_named(hf_checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    for f in hf_checkpoint[0].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.self_attn.indexer.wk.weight"
    del tensors[name]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"checkpoint lacks tensor '{name}' \[32, 64\]"):
        load_model(bad)


@pytest.mark.parametrize(
    "change, pattern",
    [
        ({"index_topk": 0}, r"index_topk must be an integer >= 1, got 0"),
        ({"index_n_heads": "64"}, r"index_n_heads must be an integer >= 1"),
        ({"indexer_rope_interleave": True}, r"indexer_rope_interleave=True \(GLM-5\)"),
    ],
    ids=["topk0", "heads-str", "interleave"],
)
def test_bad_indexer_config_fails_when_the_config_is_read(change: dict, pattern: str) -> None:
    """The indexer's fields are checked with the rest of config.json (a ValueError naming
    the field; `load_model` makes it a one-line CheckpointError), not when a layer runs."""
    with pytest.raises(ValueError, match=pattern):
        DeepseekV32Config.from_hf(dict(TINY_HF, **change))


def _decode_batch(eng: Engine, row: int, prefix: int | None = None) -> ForwardBatch:
    """One new token of `row`, its slot allocated; `prefix`: the row's length unless given."""
    seq = eng.rt.allocator.seq_len(row)
    loc = eng.rt.allocator.alloc_extend([row], [1])
    pre = seq if prefix is None else prefix
    return ForwardBatch.build(ForwardMode.DECODE, [row], [pre], [1], loc, "cpu")


@pytest.mark.parametrize("prefix", [12, 20], ids=["short", "long"])
def test_sparse_batches_are_checked_against_the_request_table(prefix: int) -> None:
    """A sparse batch whose prefix disagrees with what its row stored (17 tokens) is refused
    as the dense backends refuse it; it used to select and attend at the wrong positions."""
    model = DeepseekV32ForCausalLM(DeepseekV32Config.from_hf(TINY_HF)).eval()
    eng, dsa = _engine(model)
    [row] = eng.new_requests(1)
    eng.extend([row], [list(range(17))])
    batch = _decode_batch(eng, row, prefix)
    assert not runs_dense(batch, TOPK)
    with pytest.raises(RequestRowError, match=f"request row {row}"):
        dsa.init_forward_metadata(batch)


def test_layers_refuse_another_batchs_metadata() -> None:
    """Metadata built for batch A, the model run on batch B of as many tokens: the indexer
    read A's request rows (logits 0.34 off, no error); now a RuntimeError."""
    model = DeepseekV32ForCausalLM(DeepseekV32Config.from_hf(TINY_HF)).eval()
    eng, dsa = _engine(model)
    a, b = eng.new_requests(2)
    eng.extend([a, b], [list(range(17)), list(range(30, 50))])
    batches = [_decode_batch(eng, r) for r in (a, b)]
    dsa.init_forward_metadata(batches[1])
    model(torch.tensor([7]), batches[1], dsa)
    dsa.init_forward_metadata(batches[0])
    with pytest.raises(RuntimeError, match="init_forward_metadata was not called for this batch"):
        model(torch.tensor([7]), batches[1], dsa)


def test_model_refuses_a_dsa_backend_of_other_indexer_dims() -> None:
    """A DSA backend built with another index_topk than the checkpoint's selected other keys,
    silently; the model checks its indexer's dims (and that it is given a DSA backend)."""
    import dataclasses

    model = DeepseekV32ForCausalLM(DeepseekV32Config.from_hf(TINY_HF)).eval()
    eng, dsa = _engine(model)
    [row] = eng.new_requests(1)
    loc = eng.rt.allocator.alloc_extend([row], [20])
    batch = ForwardBatch.build(ForwardMode.EXTEND, [row], [0], [20], loc, "cpu")
    dims = dataclasses.replace(dsa.indexer.dims, topk=3)
    other = DSABackend.build(eng.rt, dims, "torch", False, "torch")
    other.init_forward_metadata(batch)
    with pytest.raises(ValueError, match="index_topk 3.* build it with the config"):
        model(torch.arange(20), batch, other)
    eng.rt.backend.init_forward_metadata(batch)
    with pytest.raises(TypeError, match="runs on a DSABackend"):
        model(torch.arange(20), batch, eng.rt.backend)


def test_a_dense_backend_over_another_latent_pool_is_refused() -> None:
    """DSABackend took a dense backend over a pool other than the sparse backend's (another
    latent pool, or beside FP8 rows): the dense batches stored rows the sparse ones never
    read, and a request that grew past top-k attended over empty rows, 0.24-0.35 off,
    silently (helper 68's review). The constructor refuses both, as `build` did FP8 rows."""
    from mla_backends.backends.base import BackendContext
    from mla_backends.backends.registry import get_backend_class

    torch.manual_seed(0)
    model = DeepseekV32ForCausalLM(DeepseekV32Config.from_hf(TINY_HF)).eval()
    eng, dsa = _engine(model)
    rt, p = eng.rt, eng.rt.kv_pool
    other = MLATokenToKVPool(
        p.num_layers, p.num_pages, p.page_size, p.kv_lora_rank, p.qk_rope_head_dim, p.dtype
    )
    torch_cls = get_backend_class("torch")
    elsewhere = torch_cls(BackendContext(rt.config, other, rt.req_pool))
    with pytest.raises(ValueError, match="another latent pool than the sparse backend reads"):
        DSABackend(elsewhere, dsa.indexer, dsa.sparse)
    wide = DeepseekV32ForCausalLM(DeepseekV32Config.from_hf(dict(TINY_HF, kv_lora_rank=128)))
    eng8, rows = _engine(wide.eval(), fp8_rows=True)  # FP8 rows: 128-wide latent tiles
    with pytest.raises(ValueError, match="reads FP8 rows, which no dense backend stores"):
        DSABackend(eng8.rt.backend, rows.indexer, rows.sparse)
    DSABackend(rt.backend, dsa.indexer, dsa.sparse)  # the runtime's own: the same pool
