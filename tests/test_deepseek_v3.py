"""DeepSeek-V3 on the backends: HF transformers parity (fp32), incremental == full forward,
checkpoint loading errors."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import Cli

from mla_backends.config import Config
from mla_backends.models.deepseek_v3 import DeepseekV3Config, rope_tables
from mla_backends.models.engine import Engine
from mla_backends.models.loader import CheckpointError, load_model
from mla_backends.models.run import RANDOM_SIZES, random_model
from mla_backends.runtime import Runtime

TINY_HF = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=16,
    v_head_dim=16,
    qk_nope_head_dim=16,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A tiny random DeepseekV3ForCausalLM saved by transformers as safetensors."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(**TINY_HF)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():  # make routing non-trivial: random gates and correction biases
        for layer in model.model.layers[cfg.first_k_dense_replace :]:
            layer.mlp.gate.weight.normal_(0, 0.5)
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.2, 0.2)
    path = tmp_path_factory.mktemp("tiny-dsv3")
    model.save_pretrained(path)
    return path, model


def _engine(  # type: ignore[no-untyped-def]
    model,
    backend: str = "torch",
    page: int = 16,
    device: str = "cpu",
    dtype: str = "float32",
    prefill: str | None = None,
) -> Engine:
    c = model.cfg
    rt = Runtime.build(
        Config(
            model=c.attention_dims,
            num_layers=c.num_hidden_layers,
            prefill_backend=prefill or backend,
            decode_backend=backend,
            page_size=page,
            kv_dtype=dtype,
            dtype=dtype,
            num_pages=64,
            max_requests=8,
            max_context_len=256,
            device=device,
        )
    )
    return Engine(model, rt)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_yarn_tables_match_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.DeepseekV3Config(**TINY_HF)
    inv_hf, scale_hf = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    ours = DeepseekV3Config.from_hf(hf.to_dict())
    inv, scale = rope_tables(ours)
    torch.testing.assert_close(inv, inv_hf.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(scale_hf)


def test_logits_equal_hf_transformers_prefill_and_every_decode_step(hf_checkpoint) -> None:  # type: ignore[no-untyped-def]
    path, hf = hf_checkpoint
    model = load_model(path)
    eng = _engine(model)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (7, 19, 1)]
    rows = eng.new_requests(len(prompts))
    logits = eng.extend(rows, prompts)  # MHA-mode prefill (no prefix)
    seqs = [list(p) for p in prompts]
    start = 0
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
        assert _rel(logits[start : start + len(p)], ref) <= 1e-4
        start += len(p)
    for step in range(6):  # incremental decode, absorbed attention over the pool
        nxt = [int(torch.randint(0, 96, (1,), generator=gen)) for _ in rows]
        out = eng.decode(rows, nxt)
        for i, s in enumerate(seqs):
            s.append(nxt[i])
            with torch.no_grad():
                ref = hf(torch.tensor([s])).logits[0, -1].float()
            assert _rel(out[i], ref) <= 1e-4, f"decode step {step}, request {i}"


def test_latent_norms_keep_their_own_eps_whatever_the_configs(tmp_path: Path) -> None:
    """HF, DeepSeek's reference and Kimi-Linear build q_a_layernorm / kv_a_layernorm with
    RMSNorm's default eps 1e-6; `rms_norm_eps` is the hidden-state norms' alone. A config
    with another eps (Kimi-Linear's 1e-5) moved only our logits when the latent norms read it."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**dict(TINY_HF, rms_norm_eps=0.5))
    ).eval()
    with torch.no_grad():  # latents of rms ~0.1: an eps of 0.5 in their norm is plain
        hf.model.embed_tokens.weight.mul_(0.1)
    hf.save_pretrained(tmp_path)
    eng = _engine(load_model(tmp_path))
    prompt = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    [row] = eng.new_requests(1)
    got = eng.extend([row], [prompt])
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].float()
    assert _rel(got, want) <= 1e-4, _rel(got, want)


def _incremental_equals_full(model, backend: str, page: int, tol: float) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(2)
    seq = torch.randint(0, 96, (40,), generator=gen).tolist()
    full = _engine(model, backend, page)
    [r] = full.new_requests(1)
    want = full.extend([r], [seq])  # one MHA-mode prefill of the whole sequence
    inc = _engine(model, backend, page)
    a, b = inc.new_requests(2)  # b: a second request joins halfway, interleaving pages
    got = [inc.extend([a], [seq[:13]])]  # prefill part
    got.append(inc.extend([a], [seq[13:21]]))  # extend over a cached prefix (absorbed)
    inc.extend([b], [seq[:5]])
    for i in range(21, 30):  # decode, with another request in the batch
        got.append(inc.decode([a, b], [seq[i], seq[i - 16]])[:1])
    got.append(inc.verify([a, b], [seq[30:33], seq[14:17]])[:3])  # q_len 3 verify
    inc.accept([a, b], [3, 3])  # every draft was the sequence's own token
    got.append(inc.extend([a], [seq[33:]]))
    got_all = torch.cat(got)
    assert got_all.shape == want.shape
    assert _rel(got_all, want) <= tol, _rel(got_all, want)


def test_incremental_decode_equals_full_forward_torch(hf_checkpoint) -> None:  # type: ignore[no-untyped-def]
    model = load_model(hf_checkpoint[0])
    for page in (1, 16):
        _incremental_equals_full(model, "torch", page, 1e-4)


def test_engine_decode_through_the_graph_runner_equals_eager(hf_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """The engine's graph path without capture (static buffers, padding to 1/2/4): three
    requests pad to 4, two run at 2; logits equal the eager engine's. Of sizes past
    max_requests (8) only the first, 16, can replay: 32 and 64 are not captured."""
    model = load_model(hf_checkpoint[0])
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (9, 2, 17)]
    engines = [_engine(model), _engine(model)]
    engines[1].enable_graphs([64, 1, 2, 32, 4, 16], use_graphs=False)
    assert engines[1].runner is not None and engines[1].runner.batch_sizes == [1, 2, 4, 16]
    rows = [e.new_requests(3) for e in engines]
    for e, r in zip(engines, rows):
        e.extend(r, prompts)
    for step in range(5):
        k = 3 if step % 2 == 0 else 2
        toks = torch.randint(0, 96, (k,), generator=gen).tolist()
        want, got = (e.decode(r[:k], toks) for e, r in zip(engines, rows))
        assert _rel(got, want) <= 1e-5, f"step {step}: {_rel(got, want)}"


def test_engine_replays_a_batch_of_its_largest_captured_size(hf_checkpoint, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A batch of exactly the largest captured size replays (a `<` for `<=` sent it eager: the
    same logits on a CPU, so only a count of replays sees it)."""
    eng = _engine(load_model(hf_checkpoint[0]))
    eng.enable_graphs([1, 2], use_graphs=False)
    rows = eng.new_requests(2)
    eng.extend(rows, [[1, 2, 3], [4, 5]])
    runner, seen = eng.runner, []
    assert runner is not None
    replay = runner.replay
    monkeypatch.setattr(runner, "replay", lambda b, i: seen.append(b.batch_size) or replay(b, i))
    eng.decode(rows, [6, 7])
    eng.decode(rows[:1], [8])
    assert seen == [2, 1]


def test_engine_step_checks_ids_and_rolls_back_a_failed_step(hf_checkpoint, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A token id past the vocabulary is refused before any slot is allocated (on a GPU it
    would be a device-side assert); a step that raises inside the model leaves every row at
    its length before it, so the retry's logits equal a fresh engine's (they once attended
    over the failed step's unwritten slots)."""
    model = load_model(hf_checkpoint[0])
    eng, fresh = _engine(model), _engine(model)
    rows = eng.new_requests(2)
    eng.extend(rows, [[1, 2], [3]])
    vocab = model.cfg.vocab_size
    with pytest.raises(ValueError, match=rf"token ids \[{vocab}\] are outside the vocabulary"):
        eng.extend(rows, [[4, vocab], [5]])
    with pytest.raises(ValueError, match=r"token ids \[tensor\(True\)\] are outside"):
        eng.extend(rows, [[torch.tensor(True)], [5]])  # it ran as token 1
    assert [eng.rt.allocator.seq_len(r) for r in rows] == [2, 1]

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("a kernel failed")

    monkeypatch.setattr(eng.backend, "init_forward_metadata", broken)
    with pytest.raises(RuntimeError, match="a kernel failed"):
        eng.extend(rows, [[4, 6], [5]])
    assert [eng.rt.allocator.seq_len(r) for r in rows] == [2, 1]
    monkeypatch.undo()
    got = eng.extend(rows, [[4, 6], [5]])
    rows2 = fresh.new_requests(2)
    fresh.extend(rows2, [[1, 2], [3]])
    assert torch.equal(got, fresh.extend(rows2, [[4, 6], [5]]))


def test_engine_accept_takes_the_verify_steps_rows(hf_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """accept() names the verify step's rows in its order with one count each; anything else
    is refused before a row is truncated (a short list once left a request with its
    rejected drafts' KV)."""
    model = load_model(hf_checkpoint[0])
    eng = _engine(model)
    rows = eng.new_requests(2)
    eng.extend(rows, [[1, 2, 3], [4, 5, 6, 7]])
    eng.verify(rows, [[8, 9, 10], [11, 12, 13]])
    with pytest.raises(ValueError, match=r"1 accepted counts for 2 rows"):
        eng.accept(rows, [1])
    with pytest.raises(ValueError, match=r"the rows of the verify step, in its order"):
        eng.accept(rows[::-1], [1, 2])
    assert [eng.rt.allocator.seq_len(r) for r in rows] == [6, 7]
    eng.accept(rows, [1, 2])
    assert [eng.rt.allocator.seq_len(r) for r in rows] == [4, 6]
    eng.verify(rows, [[8, 9], [11, 12]])
    eng.free(rows[0])  # a freed row ends its verify: the other rows reject their drafts
    with pytest.raises(RuntimeError, match=r"accept\(\) follows a verify\(\) step"):
        eng.accept(rows, [1, 1])
    assert eng.rt.allocator.seq_len(rows[1]) == 6
    (other,) = eng.new_requests(1)
    eng.extend([other], [[1, 2]])
    eng.verify([rows[1]], [[3, 4]])
    eng.reset([other])  # a row outside the verify: it stays acceptable
    eng.accept([rows[1]], [1])
    assert eng.rt.allocator.seq_len(rows[1]) == 7


def test_a_pending_verify_outlives_steps_on_other_rows_and_refuses_its_own() -> None:
    """A step on other rows leaves a pending verify acceptable; a step naming its rows or a
    second verify is refused and changes nothing. Before, any step ended the verify with its
    drafts' KV kept (attended as if accepted) and the accept after it was refused."""
    model = random_model(dict(RANDOM_SIZES["tiny"], num_hidden_layers=2), 0)
    eng = _engine(model)
    a, b, c = eng.new_requests(3)
    eng.extend([a, b, c], [[1, 2, 3], [4, 5], [6]])
    eng.verify([a], [[7, 8, 9]])
    eng.decode([b], [10])  # other rows: the verify stays
    for call in (lambda: eng.decode([a, b], [11, 12]), lambda: eng.verify([c], [[13]])):
        with pytest.raises(RuntimeError, match=rf"rows \[{a}\] have a pending verify"):
            call()
    assert [eng.rt.allocator.seq_len(r) for r in (a, b, c)] == [6, 3, 1]
    eng.accept([a], [1])
    assert eng.rt.allocator.seq_len(a) == 4
    eng.decode([a, b], [11, 12])  # accepted: the rows run again


@pytest.mark.parametrize("end", ["free", "reset"])
def test_freeing_or_resetting_a_verify_row_rejects_the_other_rows_drafts(end: str) -> None:
    """Hazard: a pending verify that loses a row (freed, or reset for a re-prefill) can no
    longer be accepted, so its other rows must drop their drafts' KV; left in place, every
    later step attended over drafts nobody accepted."""
    model = random_model(dict(RANDOM_SIZES["tiny"], num_hidden_layers=2), 0)
    eng = _engine(model)
    a, b, c = eng.new_requests(3)
    eng.extend([a, b, c], [[1, 2, 3], [4, 5], [6]])
    eng.verify([a, b], [[7, 8], [9, 10]])
    eng.free(a) if end == "free" else eng.reset([a])
    assert [eng.rt.allocator.seq_len(r) for r in (b, c)] == [2, 1]
    with pytest.raises(RuntimeError, match="follows a verify"):
        eng.accept([b], [1])
    eng.decode([b, c], [11, 12])  # no verify pending
    assert [eng.rt.allocator.seq_len(r) for r in (b, c)] == [3, 2]


def test_a_step_after_an_empty_verify_ends_it() -> None:
    """Hazard: an empty verify has nothing to accept, so the next step ends it; kept pending,
    an accept() long after it (for no verify) passed instead of being refused."""
    model = random_model(dict(RANDOM_SIZES["tiny"], num_hidden_layers=2), 0)
    eng = _engine(model)
    eng.verify([], [])
    (a,) = eng.new_requests(1)
    eng.extend([a], [[1, 2]])
    with pytest.raises(RuntimeError, match="follows a verify"):
        eng.accept([], [])


def test_an_engine_takes_a_runtime_holding_a_share_of_the_heads() -> None:
    """Hazard: a tensor- or DCP-parallel rank's runtime holds a share of the model's heads;
    the dims check compares every field but the head count, so such a runtime is served."""
    model = random_model(dict(RANDOM_SIZES["tiny"], num_hidden_layers=2), 0)
    dims = model.cfg.attention_dims
    half = replace(dims, num_heads=dims.num_heads // 2)
    rt = Runtime.build(Config(model=half, num_layers=2, num_pages=8, device="cpu"))
    assert Engine(model, rt).rt is rt


def test_engine_pure_mla_step_failing_inside_the_model_marks_no_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """MLA keeps nothing per request outside the KV pool, so rolling the lengths back is the
    whole recovery: a step that raises after layer 0 wrote its KV marks no row, and the retry
    equals a fresh engine (hybrid models: test_kimi_linear)."""
    model = random_model(dict(RANDOM_SIZES["tiny"], num_hidden_layers=2), 0)
    eng, fresh = _engine(model), _engine(model)
    rows, rows2 = eng.new_requests(2), fresh.new_requests(2)
    for e, r in ((eng, rows), (fresh, rows2)):
        e.extend(r, [[1, 2, 3], [4, 5]])

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("a kernel failed")

    monkeypatch.setattr(model.model.layers[1].self_attn, "forward", broken)
    with pytest.raises(RuntimeError, match="a kernel failed"):
        eng.decode(rows, [6, 7])
    monkeypatch.undo()
    assert eng.rows_to_reset == []
    assert torch.equal(eng.decode(rows, [6, 7]), fresh.decode(rows2, [6, 7]))


def test_engine_empty_steps_and_a_bad_accept_change_nothing() -> None:
    """An empty batch (no request running) returns [0, vocab] logits in every mode (it raised
    a reshape error inside the model, and an empty verify an IndexError); accept() with a
    count that is not an integer is refused before any row is truncated (it truncated the
    rows before it, consumed the verify, and left the rest with their rejected drafts)."""
    model = random_model(dict(RANDOM_SIZES["tiny"], num_hidden_layers=2), 0)
    eng = _engine(model)
    vocab = model.cfg.vocab_size
    for step in (eng.extend, eng.decode, eng.verify):
        assert step([], []).shape == (0, vocab)
    eng.accept([], [])
    rows = eng.new_requests(2)
    eng.extend(rows, [[1, 2, 3], [4]])
    eng.verify(rows, [[5, 6], [7, 8]])
    with pytest.raises(TypeError, match=r"accepted counts must be integers, got \[1, 1.5\]"):
        eng.accept(rows, [1, 1.5])  # type: ignore[list-item]
    assert [eng.rt.allocator.seq_len(r) for r in rows] == [5, 3]
    eng.accept(rows, [1, 0])
    assert [eng.rt.allocator.seq_len(r) for r in rows] == [4, 1]
    with pytest.raises(ValueError, match=rf"request rows \[{rows[1]}\] have no tokens"):
        eng.extend(rows, [[9], []])  # refused before the first row's KV is allocated
    assert [eng.rt.allocator.seq_len(r) for r in rows] == [4, 1]


def test_dense_moe_equals_routed_moe(hf_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """The capture-safe MoE (every expert, zero weight where not routed) equals the routed."""
    moe = load_model(hf_checkpoint[0]).model.layers[1].mlp
    x = torch.randn(11, 64)
    w, idx = moe.gate(x)
    torch.testing.assert_close(moe._dense(x, w, idx) + moe.shared_experts(x), moe(x))


GPU_BACKENDS = [("triton", "triton"), ("flashinfer_mla", "flashinfer_mla"), ("flashmla", "triton")]


@pytest.mark.gpu
@pytest.mark.parametrize("decode, prefill", GPU_BACKENDS, ids=[d for d, _ in GPU_BACKENDS])
def test_gpu_incremental_equals_full_forward_with_graphs(decode: str, prefill: str) -> None:
    """Real MLA dims (512 + 64, 16 heads), bf16, page 64: prefill, prefix extend, decode steps
    replayed through captured whole-model graphs, a q_len 3 verify, a final extend, against
    one full prefill on the same backends, and against an fp32 torch-backend full forward."""
    from mla_backends.models.run import random_model

    raw = dict(TINY_HF, hidden_size=512, num_attention_heads=16, num_key_value_heads=16)
    raw.update(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    # Dense MLPs (first_k_dense_replace = every layer): a bf16 MoE's routing flips at near
    # ties between forwards of different shape, a discontinuity that is not attention's. It
    # hit this seed's incremental run (5.9e-2) once the gate kept HF's fp32 weights, and the
    # full forward's distance from the fp32 oracle (5.6e-2 before) before that. The MoE's
    # capture path equals the routed one in test_dense_moe_equals_routed_moe (CPU).
    raw.update(q_lora_rank=256, num_hidden_layers=2, intermediate_size=512)
    raw.update(first_k_dense_replace=2)
    model = random_model(raw, seed=0, device="cuda", dtype=torch.bfloat16)

    gen = torch.Generator().manual_seed(2)
    seq = torch.randint(0, 96, (40,), generator=gen).tolist()
    oracle = _engine(copy.deepcopy(model).float(), "torch", 64, "cuda")
    want32 = oracle.extend(oracle.new_requests(1), [seq])
    full = _engine(model, decode, 64, "cuda", "bfloat16", prefill)
    want = full.extend(full.new_requests(1), [seq])
    inc = _engine(model, decode, 64, "cuda", "bfloat16", prefill)
    a, b = inc.new_requests(2)
    got = [inc.extend([a], [seq[:13]]), inc.extend([a], [seq[13:21]])]
    inc.extend([b], [seq[:5]])
    inc.enable_graphs([1, 2, 4])
    for i in range(21, 30):
        got.append(inc.decode([a, b], [seq[i], seq[i - 16]])[:1])
    got.append(inc.verify([a, b], [seq[30:33], seq[14:17]])[:3])
    inc.accept([a, b], [3, 3])
    got.append(inc.extend([a], [seq[33:]]))
    got_all = torch.cat(got)
    print(
        f"{decode}: incremental vs full {_rel(got_all, want):.2e}, vs fp32 oracle "
        f"{_rel(got_all, want32):.2e}; full bf16 vs fp32 oracle {_rel(want, want32):.2e}"
    )
    # bf16 weights and KV: two bf16 forwards of different shape agree to about 2^-7. (The
    # fp32 oracle is printed, not asserted: a bf16 model's own distance from it.)
    assert _rel(got_all, want) <= 2e-2


@pytest.mark.interp
def test_incremental_decode_equals_full_forward_triton_interpreted(hf_checkpoint) -> None:  # type: ignore[no-untyped-def]
    _incremental_equals_full(load_model(hf_checkpoint[0]), "triton", 16, 1e-4)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interp)])
def test_chunked_prefix_mha_equals_absorbed_and_full(hf_checkpoint, backend: str) -> None:  # type: ignore[no-untyped-def]
    """Long-prefix EXTEND through MHA (prefix part + causal new part, merged by LSE) gives the
    logits of the absorbed path and of one full prefill; a request without a prefix in the
    same batch contributes an empty prefix part (lse -inf)."""
    gen = torch.Generator().manual_seed(5)
    a_seq = torch.randint(0, 96, (30,), generator=gen).tolist()
    b_seq = torch.randint(0, 96, (6,), generator=gen).tolist()
    results = []
    for chunked in (None, 8):
        model = load_model(hf_checkpoint[0], chunked_prefix_min=chunked)
        eng = _engine(model, backend)
        a, b = eng.new_requests(2)
        eng.extend([a], [a_seq[:20]])
        results.append(eng.extend([a, b], [a_seq[20:], b_seq]))
    assert _rel(results[1], results[0]) <= 1e-4
    full = _engine(load_model(hf_checkpoint[0]), backend)
    [r] = full.new_requests(1)
    assert _rel(results[1][:10], full.extend([r], [a_seq])[20:]) <= 1e-4


def _copy(src: Path, dst: Path) -> None:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())


@pytest.mark.parametrize(
    "change, pattern",
    [
        (
            "drop",
            r"checkpoint lacks tensor 'model.layers.1.self_attn.kv_b_proj.weight' \[128, 32\]",
        ),
        (
            "shape",
            r"model.layers.1.self_attn.kv_b_proj.weight: checkpoint shape \[128, 31\], "
            r"model expects \[128, 32\]",
        ),
        (
            "dtype",
            r"model.layers.1.self_attn.kv_b_proj.weight: dtype torch.int32, expected a floating",
        ),
    ],
)
def test_bad_checkpoints_fail_naming_the_tensor(
    hf_checkpoint, tmp_path: Path, change: str, pattern: str
) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    _copy(hf_checkpoint[0], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    if change == "drop":
        del tensors[name]
    elif change == "shape":
        tensors[name] = tensors[name][:, :31].contiguous()
    else:
        tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match=pattern):
        load_model(bad)


@pytest.mark.parametrize(
    "dtype, fmax, rel", [(torch.float8_e4m3fn, 448.0, 2**-4), (torch.float8_e5m2, 57344.0, 2**-3)]
)
def test_fp8_block_scaled_weights_dequantize_on_load(
    hf_checkpoint, tmp_path: Path, dtype: torch.dtype, fmax: float, rel: float
) -> None:  # type: ignore[no-untyped-def]
    """DeepSeek's checkpoint format: float8 weights (e4m3; e5m2 once loaded unscaled) with
    per-128x128-block `_scale_inv`, dequantized on load; a float8 weight without its scale,
    and a scale beside a weight that is not float8 (nothing would apply it), are refused."""
    from safetensors.torch import load_file, save_file

    fp8 = tmp_path / "fp8"
    _copy(hf_checkpoint[0], fp8)
    tensors = load_file(str(fp8 / "model.safetensors"))
    name = "model.layers.2.self_attn.q_b_proj.weight"
    w = tensors[name]
    scale = torch.tensor([[w.abs().max() / fmax]])
    tensors[name] = (w / scale).to(dtype)
    tensors[name + "_scale_inv"] = scale
    save_file(tensors, str(fp8 / "model.safetensors"))
    got = load_model(fp8).state_dict()[name]
    torch.testing.assert_close(got, tensors[name].float() * scale, rtol=0, atol=0)
    assert (got - w).abs().max() <= w.abs().max() * rel
    del tensors[name + "_scale_inv"]
    save_file(tensors, str(fp8 / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"{name}: float8 weight without"):
        load_model(fp8)
    tensors[name], tensors[name + "_scale_inv"] = w, scale
    save_file(tensors, str(fp8 / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"{name}: torch.float32 weight with a {name}_sc"):
        load_model(fp8)


@pytest.mark.parametrize("case", ["duplicate", "index-picks", "no-shard", "bad-index", "torn"])
def test_shards_are_read_as_the_index_says(hf_checkpoint, tmp_path: Path, case: str) -> None:  # type: ignore[no-untyped-def]
    """Without an index a tensor in two files is refused (a stale copy once won by file
    order); with one, each tensor comes from the shard its weight_map names; a missing or
    unreadable shard and a malformed index are one-line CheckpointErrors naming the file."""
    from safetensors.torch import load_file, save_file

    ck = tmp_path / "ck"
    _copy(hf_checkpoint[0], ck)
    tensors = load_file(str(ck / "model.safetensors"))
    stale = {"model.norm.weight": torch.full_like(tensors["model.norm.weight"], 7.0)}
    save_file(stale, str(ck / "model_old.safetensors"))
    wmap = {k: "model.safetensors" for k in tensors}
    index = ck / "model.safetensors.index.json"
    if case == "duplicate":
        pattern = r"'model.norm.weight' is in both model.safetensors and model_old.safetensors"
    elif case == "index-picks":
        index.write_text(json.dumps({"weight_map": wmap}))
        got = load_model(ck).state_dict()["model.norm.weight"]
        assert torch.equal(got, tensors["model.norm.weight"])
        return
    elif case == "no-shard":
        index.write_text(json.dumps({"weight_map": {**wmap, "model.norm.weight": "gone.st"}}))
        pattern = r"gone.st: shard named by the index is missing"
    elif case == "bad-index":
        index.write_text(json.dumps({"metadata": {}}))
        pattern = r"index.json: needs a 'weight_map' object"
    else:
        (ck / "model_old.safetensors").write_bytes(b"\x08\x00\x00\x00\x00")
        pattern = r"model_old.safetensors: cannot read it as safetensors"
    with pytest.raises(CheckpointError, match=pattern):
        load_model(ck)


BAD_CONFIGS = {
    "heads<0": (
        {"num_attention_heads": -4},
        r"num_attention_heads must be an integer >= 1, got -4",
    ),
    "layers-str": ({"num_hidden_layers": "3"}, r"num_hidden_layers must be an integer >= 1"),
    "lora-null": ({"kv_lora_rank": None}, r"kv_lora_rank must be an integer >= 1, got None"),
    "groups": ({"n_group": 3}, r"n_routed_experts \(8\) must split into n_group \(3\) groups"),
    "experts-k": ({"num_experts_per_tok": 20}, r"num_experts_per_tok \(20\) must fit"),
    "eps-nan": ({"rms_norm_eps": float("nan")}, r"rms_norm_eps must be a finite number > 0"),
    "rope-odd": ({"qk_rope_head_dim": 15}, r"qk_rope_head_dim must be even"),
    "yarn-factor": (
        {"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 64}},
        r"rope_scaling \(yarn\) lacks 'factor'",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS), ids=list(BAD_CONFIGS))
def test_bad_config_values_fail_at_load_naming_the_field(
    hf_checkpoint, tmp_path: Path, case: str
) -> None:  # type: ignore[no-untyped-def]
    """A config.json value no model can run (wrong type, out of range, MoE groups that do
    not split, yarn without its factor) is a CheckpointError naming the field when the
    model is built, not a TypeError / RuntimeError inside a layer later."""
    change, pattern = BAD_CONFIGS[case]
    ck = tmp_path / "ck"
    ck.mkdir()
    raw = json.loads((hf_checkpoint[0] / "config.json").read_text())
    raw.pop("rope_parameters", None)
    (ck / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(CheckpointError, match=pattern):
        load_model(ck)


def test_config_from_hf_reads_rope_scaling_both_spellings() -> None:
    raw = {k: v for k, v in TINY_HF.items() if k != "rope_scaling"}
    old = DeepseekV3Config.from_hf(
        {
            **raw,
            "rope_scaling": {
                "type": "yarn",
                "factor": 40,
                "original_max_position_embeddings": 4096,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        }
    )
    assert old.attention_dims.rope_scaling_factor == 40
    with pytest.raises(ValueError, match="lacks"):
        DeepseekV3Config.from_hf({"vocab_size": 3})
    assert json.dumps(old.rope_scaling)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.interp)])
def test_run_command_serves_a_batch(cli: Cli, tmp_path: Path, backend: str) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"decode_backend: {backend}\nprefill_backend: {backend}\ndevice: cpu\n"
        "kv_dtype: float32\ndtype: float32\n"
        "model: {base: tiny, qk_rope_head_dim: 16, v_head_dim: 16}\n"
    )
    proc = cli("run", "--config", str(cfg), "--requests", "3", "--max-new", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tokens/s" in proc.stdout and ": agree" in proc.stdout


@pytest.mark.interp
def test_run_resolves_backends_for_the_checkpoints_dims(cli: Cli, tmp_path: Path) -> None:
    """A YAML without a `model` key is checked against the model `run` serves, not the
    Config default's dims it throws away: `triton` decode, refused at the default's rope
    width, runs the tiny checkpoint (it was refused before the model was read)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("prefill_backend: torch\ndecode_backend: triton\ndevice: cpu\n")
    proc = cli("run", "--config", str(cfg), "--requests", "1", "--max-new", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "decode=triton" in proc.stdout and ": agree" in proc.stdout
    # and says so: the config's own dims are not what ran
    said = [ln for ln in proc.stdout.splitlines() if "the model's dims replace" in ln]
    assert len(said) == 1 and said[0].endswith("num_layers 2 -> 3"), proc.stdout


def test_an_engine_refuses_a_runtime_whose_dims_are_not_the_models() -> None:
    """The softmax scale lives in the runtime's dims: a Kimi-K2 checkpoint (YaRN factor 32)
    on a DeepSeek-V3 runtime (factor 40) served at the wrong scale, with no error."""
    import dataclasses

    model = random_model(dict(RANDOM_SIZES["tiny"], num_hidden_layers=2), 0)
    dims = model.cfg.attention_dims
    cfg = Config(model=dataclasses.replace(dims, rope_scaling_factor=dims.rope_scaling_factor + 8),
                 decode_backend="torch", prefill_backend="torch", device="cpu",
                 kv_dtype="float32", dtype="float32")  # fmt: skip
    with pytest.raises(ValueError, match=r"runtime's attention dims are not the model's: "
                       r"rope_scaling_factor"):  # fmt: skip
        Engine(model, Runtime.build(cfg))
    Engine(model, Runtime.build(dataclasses.replace(cfg, model=dims)))  # the model's: taken


def _tiny_hf_dict(**rope: float) -> dict:
    d = dict(TINY_HF)
    d["rope_scaling"] = {**TINY_HF["rope_scaling"], **rope}
    return d


@pytest.mark.parametrize("m,m_all", [(0.707, 1.0), (1.0, 0.707), (0.5, 0.8)])
def test_yarn_scale_matches_transformers_when_mscale_differs_from_mscale_all_dim(
    m: float, m_all: float
) -> None:
    """M31 (deepseek_v3.py:189 mscale factor dropped) and M32 (mscale / mscale_all_dim ratio
    inverted): the suite's only yarn config has mscale == mscale_all_dim == 1, where the cos /
    sin scale is exactly 1 whatever either does."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.DeepseekV3Config(**_tiny_hf_dict(mscale=m, mscale_all_dim=m_all))
    inv_hf, scale_hf = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    inv, scale = rope_tables(DeepseekV3Config.from_hf(hf.to_dict()))
    torch.testing.assert_close(inv, inv_hf.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(scale_hf) and scale != pytest.approx(1.0)


def test_logits_equal_hf_with_a_yarn_cos_sin_scale_other_than_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """M40 (deepseek_v3.py:504 `* m.rope_scale` dropped from cos): with mscale !=
    mscale_all_dim the cos / sin scale is not 1; the suite's checkpoint has it exactly 1."""
    transformers = pytest.importorskip("transformers")

    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(**_tiny_hf_dict(mscale=0.5, mscale_all_dim=1.0))
    hf = transformers.DeepseekV3ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.model.rope_scale != pytest.approx(1.0)
    eng = _engine(model)
    prompt = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    rows = eng.new_requests(1)
    logits = eng.extend(rows, [prompt])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    assert _rel(logits, ref) <= 1e-4


def test_yarn_tables_match_transformers_at_deepseek_v3s_real_rope_dims() -> None:
    """M33 (deepseek_v3.py:203 `floor` -> `ceil` for YaRN's low correction bound): at the
    suite's tiny dims corr(beta_fast) < 0 and both clamp to 0; at DeepSeek-V3's own (rope 64,
    original 4096, factor 40) it is 10.47: floor 10, ceil 11, one rotary pair off."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d = _tiny_hf_dict(factor=40.0, original_max_position_embeddings=4096)
    d.update(qk_rope_head_dim=64, max_position_embeddings=163840)
    hf = transformers.DeepseekV3Config(**d)
    inv_hf, scale_hf = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    inv, scale = rope_tables(DeepseekV3Config.from_hf(hf.to_dict()))
    torch.testing.assert_close(inv, inv_hf.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(scale_hf)


def test_extend_over_a_prefix_of_exactly_chunked_prefix_min_takes_the_chunked_path() -> None:
    """M38 (deepseek_v3.py:428 `>= m` -> `> m`): `chunked_prefix_min` is "at least this many
    tokens"; a prefix of exactly m must run the chunked MHA path (load_prefix called)."""
    from mla_backends.models.deepseek_v3 import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config.from_hf(dict(TINY_HF)), chunked_prefix_min=8)
    eng = _engine(model)
    calls = []
    real = eng.backend.load_prefix

    def spy(layer, batch):  # type: ignore[no-untyped-def]
        calls.append(int(batch.extend_prefix_lens_cpu.max()))
        return real(layer, batch)

    eng.backend.load_prefix = spy  # type: ignore[method-assign]
    [r] = eng.new_requests(1)
    eng.extend([r], [list(range(7))])
    eng.extend([r], [[1, 2]])  # prefix 7 < 8: absorbed
    assert calls == []
    eng.decode([r], [3])
    eng.extend([r], [[4, 5]])  # prefix 10 >= 8: chunked
    assert calls and set(calls) == {10}
    calls.clear()
    [s] = eng.new_requests(1)
    eng.extend([s], [list(range(8))])
    eng.extend([s], [[6, 7]])  # prefix exactly 8: chunked
    assert calls and set(calls) == {8}


def test_a_tied_checkpoint_without_lm_head_loads_with_the_embedding_as_head(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """B06 (loader.py:242 the tie_word_embeddings fallback skipped): transformers saves a
    tied model without `lm_head.weight`; the loader takes the embedding (the mutant refused
    the checkpoint for a missing lm_head.weight)."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    torch.manual_seed(0)
    d = _tiny_hf_dict()
    d["tie_word_embeddings"] = True
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**d)).eval()
    hf.save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    model = load_model(tmp_path)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert torch.equal(model.lm_head.weight, hf.model.embed_tokens.weight.float())


def test_a_tied_checkpoint_storing_a_different_head_keeps_it_as_hf_does(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A config with `tie_word_embeddings` whose checkpoint also stores a different
    `lm_head.weight`: transformers 5.x loads that head and does not tie (it warns), so our
    loader must too, or its logits leave HF's (a loader tying whenever the config says so
    passed every other test)."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    d = _tiny_hf_dict()
    d["tie_word_embeddings"] = True
    transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**d)).save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    head = tensors["model.embed_tokens.weight"] + 1
    save_file({**tensors, "lm_head.weight": head}, str(file), metadata={"format": "pt"})
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path).eval()
    model = load_model(tmp_path)
    assert torch.equal(hf.lm_head.weight.float(), head.float())
    assert torch.equal(model.lm_head.weight, head.float())


def test_an_indexed_shard_holding_a_stale_copy_of_another_shards_tensor_is_not_read_for_it(
    tmp_path,
) -> None:  # type: ignore[no-untyped-def]
    """B07 (loader.py:89 `wmap.get(name) == shard` -> always): a shard the index names for
    some tensors may hold a stale copy of one the index places elsewhere; the index decides
    (the mutant took whichever shard sorted last)."""
    transformers = pytest.importorskip("transformers")

    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**_tiny_hf_dict()))
    hf.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    moved = "model.embed_tokens.weight"
    norm = "model.norm.weight"
    save_file(
        {moved: tensors[moved], norm: torch.full_like(tensors[norm], 7.0)},
        str(tmp_path / "zz-shard.safetensors"),
    )
    wmap = {k: "model.safetensors" for k in tensors}
    wmap[moved] = "zz-shard.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    got = load_model(tmp_path).state_dict()[norm]
    assert torch.equal(got, tensors[norm])


def test_gate_picks_experts_only_in_the_kept_groups_even_when_every_choice_is_negative() -> None:
    """B14 (deepseek_v3.py:310 masked_fill -inf -> 0.0): experts outside the top groups are
    never chosen. With bias-corrected choices all below 0 (a negative correction bias larger
    than the scores, as trained biases can be), a 0 mask outranked every kept expert."""
    from mla_backends.models.deepseek_v3 import Gate

    cfg = DeepseekV3Config.from_hf(_tiny_hf_dict())
    gate = Gate(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        gate.weight.normal_(0, 0.5, generator=gen)
        gate.e_score_correction_bias.fill_(-1.0)
    x = torch.randn(32, cfg.hidden_size, generator=gen)
    w, idx = gate(x)
    choice = torch.sigmoid(x @ gate.weight.t()) + gate.e_score_correction_bias
    per = cfg.n_routed_experts // cfg.n_group
    group_score = choice.view(32, cfg.n_group, per).topk(2, dim=-1)[0].sum(-1)
    kept = group_score.topk(cfg.topk_group, dim=-1)[1]
    for t in range(32):
        assert set((idx[t] // per).tolist()) <= set(kept[t].tolist())


def test_config_takes_experts_per_token_filling_the_kept_groups_exactly() -> None:
    """B16 (deepseek_v3.py:121 `>` -> `>=`): num_experts_per_tok may equal topk_group x the
    group size (every expert of the kept groups); the mutant refused that valid config."""

    d = _tiny_hf_dict()
    cap = d["topk_group"] * d["n_routed_experts"] // d["n_group"]
    assert DeepseekV3Config.from_hf({**d, "num_experts_per_tok": cap}).num_experts_per_tok == cap
    with pytest.raises(ValueError, match="must fit in topk_group"):
        DeepseekV3Config.from_hf({**d, "num_experts_per_tok": cap + 1})
