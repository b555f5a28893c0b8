"""Batches SGLang 0.5.17 legitimately sends the adapter at the edges of its serving modes
(sglang 0.5.17 on CPU, tests/sglang_cpu/requirements.txt):

- DP attention: the eager forward pads a batch's tokens to a multiple of the attention-TP
  size (`ForwardBatch.prepare_mlp_sync_batch` -> `_pad_inputs_to_size`, SGLang's own method
  here) while `extend_seq_lens` keep the real counts; padded q rows are NaN-poisoned;
- a verify batch padded so that its tokens divide evenly by a wrong draft count;
- ragged verify layouts (per-request draft counts) and short verify batches, refused in
  one line.
Skipped, with the reason, where sglang cannot be imported.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang_cpu.env import load_sglang

try:
    load_sglang()
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch as SGLBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.plugins import load_plugins
    from sglang_cpu import kit_support as ks
except Exception as e:  # noqa: BLE001 - any import failure means: cannot run here
    pytest.skip(f"sglang unavailable: {' '.join(str(e).split())[:160]}", allow_module_level=True)

from test_sglang_cpu import SMALL, _adapter, _extend_batch, _mha_layer, _mqa_layer  # noqa: E402

from mla_backends.integrations.sglang.batches import BatchError  # noqa: E402

BACKENDS = ["mlab_torch", pytest.param("mlab_triton", marks=pytest.mark.interp)]


@pytest.fixture(scope="module", autouse=True)
def plugin() -> Any:
    load_plugins()
    undo = ks.use_torch_kv_writer()
    yield
    undo()


def _dp_pad(fb: Any, runner: Any, adapter: Any, num_tokens: int, bs: int) -> None:
    """SGLang's DP-attention padding of an eager batch, by SGLang's own method."""
    runner.attn_backend = adapter
    fb.batch_size = bs
    SGLBatch._pad_inputs_to_size(fb, runner, num_tokens, bs)


def _poisoned(real: torch.Tensor, rows: int) -> torch.Tensor:
    pad = torch.full((rows - real.shape[0], *real.shape[1:]), float("nan"), dtype=real.dtype)
    return torch.cat([real, pad])


@pytest.mark.parametrize("backend", BACKENDS)
def test_dp_padded_extend_attends_the_real_tokens(backend: str) -> None:
    """EXTEND of 7 tokens padded to 8 (attention TP 4): both DeepSeek layer shapes give the
    unpadded call's output on the real rows and zeros on the padded one; the padded token
    writes no slot. The adapter once refused it ('out_cache_loc has 8 slots for 7 tokens')."""
    adapter, runner = _adapter(backend, page=16, dims=SMALL)
    d = adapter.dims
    fb = _extend_batch(runner, 16, (0, 7), (5, 2), seed=7)
    t, rows = 7, 8
    gen = torch.Generator().manual_seed(8)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).bfloat16()

    q_nope, q_rope = rnd(t, d.num_heads, d.kv_lora_rank), rnd(t, d.num_heads, d.qk_rope_head_dim)
    k_nope, k_rope = rnd(t, 1, d.kv_lora_rank), rnd(t, 1, d.qk_rope_head_dim)
    q_mha, k_mha = rnd(t, d.num_heads, d.qk_head_dim), rnd(t, d.num_heads, d.qk_head_dim)
    v_mha = rnd(t, d.num_heads, d.v_head_dim)
    buf = runner.token_to_kv_pool.kv_buffer[0]
    buf.copy_(torch.randn(buf.shape, generator=gen).bfloat16())
    start = buf.clone()
    mqa, mha = _mqa_layer(adapter), _mha_layer(adapter)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=adapter)):
        adapter.init_forward_metadata(fb)
        want = mqa(q_nope, k_nope, k_nope, fb, q_rope=q_rope, k_rope=k_rope).clone()
        want_mha = mha(q_mha, k_mha, v_mha, fb, save_kv_cache=False).clone()
        stored = buf.clone()
        buf.copy_(start)
        _dp_pad(fb, runner, adapter, rows, 2)
        assert fb.out_cache_loc.numel() == rows and sum(fb.extend_seq_lens_cpu) == t
        adapter.init_forward_metadata(fb)
        got = mqa(
            _poisoned(q_nope, rows),
            _poisoned(k_nope, rows),
            _poisoned(k_nope, rows),
            fb,
            q_rope=_poisoned(q_rope, rows),
            k_rope=_poisoned(k_rope, rows),
        )
        got_mha = mha(
            _poisoned(q_mha, rows), _poisoned(k_mha, rows), _poisoned(v_mha, rows), fb, False
        )
    assert got.shape == (rows, *want.shape[1:]) and got_mha.shape[0] == rows
    assert torch.equal(got[:t], want) and torch.equal(got[t:], torch.zeros_like(got[t:]))
    assert torch.equal(got_mha[:t], want_mha) and not got_mha[t:].any()
    assert torch.equal(buf, stored)  # the real rows stored, slot 0 (padding) untouched


def test_dp_padded_chunked_prefix_returns_padded_lse() -> None:
    """Chunked-prefix MHA on a DP-padded batch: q padded, the chunk's k / v not; out and LSE
    come back with the padded row count (SGLang's merge_state takes them row for row)."""
    adapter, runner = _adapter("mlab_torch", page=16, dims=SMALL)
    d = adapter.dims
    fb = _extend_batch(runner, 16, (4, 9), (3, 2), seed=9)
    t, rows = 5, 8
    fb.prefix_chunk_seq_lens_cpu = [torch.tensor([4, 9])]
    fb.prefix_chunk_cu_seq_lens = [torch.tensor([0, 4, 13], dtype=torch.int32)]
    fb.num_prefix_chunks = 1
    gen = torch.Generator().manual_seed(10)
    q = torch.randn(t, d.num_heads, d.qk_head_dim, generator=gen).bfloat16()
    k = torch.randn(13, d.num_heads, d.qk_head_dim, generator=gen).bfloat16()
    v = torch.randn(13, d.num_heads, d.v_head_dim, generator=gen).bfloat16()
    layer = _mha_layer(adapter)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=adapter)):
        fb.attn_attend_prefix_cache, fb.prefix_chunk_idx, fb.mha_return_lse = True, 0, True
        adapter.init_forward_metadata(fb)
        want, want_lse = layer(q, k, v, fb, save_kv_cache=False)
        _dp_pad(fb, runner, adapter, rows, 2)
        adapter.init_forward_metadata(fb)
        got, lse = layer(_poisoned(q, rows), k, v, fb, save_kv_cache=False)
    assert got.shape[0] == rows and lse.shape == (rows, d.num_heads)
    assert torch.equal(got[:t], want) and torch.equal(lse[:t], want_lse)
    assert not got[t:].any() and not lse[t:].any()


def test_prefix_chunk_whose_indptr_and_lengths_disagree_is_refused() -> None:
    """A chunk's device indptr (`prefix_chunk_cu_seq_lens`) must cover the requests its host
    lengths do; otherwise the kernels would read another request's prefix rows."""
    adapter, runner = _adapter("mlab_torch", page=16, dims=SMALL)
    fb = _extend_batch(runner, 16, (4, 9), (3, 2), seed=9)
    fb.prefix_chunk_seq_lens_cpu = [torch.tensor([4, 9])]
    fb.prefix_chunk_cu_seq_lens = [torch.tensor([0, 4], dtype=torch.int32)]
    fb.num_prefix_chunks = 1
    adapter.init_forward_metadata(fb)
    with pytest.raises(BatchError, match="prefix chunk 0: 2 vs 3 indptrs"):
        adapter.init_mha_chunk_metadata(fb)


def _verify_batch(runner: Any, q_len: int) -> Any:
    """TARGET_VERIFY of 2 requests x q_len chain drafts, with EAGLE's verify input (its
    draft_token_num) and SGLang's verify lengths (the drafts excluded)."""
    fb = _extend_batch(runner, 16, (9, 20), (q_len, q_len), seed=11)
    fb.forward_mode = ForwardMode.TARGET_VERIFY
    fb.seq_lens, fb.seq_lens_cpu = fb.seq_lens - q_len, fb.seq_lens_cpu - q_len
    fb.spec_info = SimpleNamespace(
        draft_token_num=q_len, ragged_verify_layout=None, is_draft_input=lambda: False
    )
    return fb


def test_dp_padded_verify_keeps_the_draft_count() -> None:
    """2 requests x 3 drafts, padded from 6 to 8 tokens (attention TP 4): 8 tokens over 2
    requests divide evenly, and the adapter once took 4 drafts a request from the shapes,
    attending request 1's first draft over request 0's rows. The draft count is EAGLE's."""
    adapter, runner = _adapter("mlab_torch", page=16, dims=SMALL)
    d = adapter.dims
    fb = _verify_batch(runner, 3)
    gen = torch.Generator().manual_seed(12)
    buf = runner.token_to_kv_pool.kv_buffer[0]
    buf.copy_(torch.randn(buf.shape, generator=gen).bfloat16())
    q = torch.randn(6, d.num_heads * d.kv_dim, generator=gen).bfloat16()
    layer = _mqa_layer(adapter)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=adapter)):
        adapter.init_forward_metadata(fb)
        want = layer(q, None, None, fb, save_kv_cache=False).clone()
        _dp_pad(fb, runner, adapter, 8, 2)
        adapter.init_forward_metadata(fb)
        b = adapter.forward_metadata.batch
        got = layer(_poisoned(q, 8), None, None, fb, save_kv_cache=False)
    assert b.num_draft_tokens == 3 and b.seq_lens_cpu.tolist() == [12, 23]
    assert torch.equal(got[:6], want) and not got[6:].any()


def test_ragged_verify_layout_is_refused() -> None:
    """DSPARK's compact ragged verify (per-request draft counts) in one line; it once took a
    uniform count from the shapes (here 2 + 4 tokens over 2 requests: 3 each, silently)."""
    adapter, runner = _adapter("mlab_torch", page=16, dims=SMALL)
    fb = _verify_batch(runner, 3)
    fb.spec_info.ragged_verify_layout = object()
    with pytest.raises(BatchError, match="ragged verify layout .* not served"):
        adapter.init_forward_metadata(fb)


def test_verify_with_fewer_tokens_than_drafts_is_refused() -> None:
    adapter, runner = _adapter("mlab_torch", page=16, dims=SMALL)
    fb = _verify_batch(runner, 3)
    fb.spec_info.draft_token_num = 4
    with pytest.raises(BatchError, match="6 tokens for 2 requests x 4 drafts"):
        adapter.init_forward_metadata(fb)


def test_verify_without_a_draft_count_and_uneven_tokens_is_refused() -> None:
    """Without EAGLE's draft count the shapes name it: 3 + 4 tokens over 2 requests are no
    uniform count (taking 7 // 2 = 3 would drop a token and misplace the rest)."""
    adapter, runner = _adapter("mlab_torch", page=16, dims=SMALL)
    fb = _extend_batch(runner, 16, (9, 20), (3, 4), seed=11)
    fb.forward_mode, fb.spec_info = ForwardMode.TARGET_VERIFY, None
    with pytest.raises(BatchError, match="7 tokens over 2 requests: not uniform"):
        adapter.init_forward_metadata(fb)


def test_surplus_slots_outside_sglangs_padding_are_refused() -> None:
    """Slots past the requests' token counts are cut only where SGLang padded the batch
    (`_pad_inputs_to_size` records `_original_num_tokens`): elsewhere the surplus is a real
    token whose KV the cut would drop silently."""
    from mla_backends.integrations.sglang.batches import eager_batch

    adapter, runner = _adapter("mlab_torch", page=16, dims=SMALL)
    fb = _extend_batch(runner, 16, (0, 7), (5, 2), seed=7)
    fb.out_cache_loc = torch.cat([fb.out_cache_loc, fb.out_cache_loc[-1:] + 1])
    with pytest.raises(BatchError, match="8 slots for 7 tokens and the batch is not SGLang's"):
        eager_batch(fb)
    fb = _extend_batch(runner, 16, (0, 7), (5, 2), seed=7)
    _dp_pad(fb, runner, adapter, 8, 2)
    assert eager_batch(fb).out_cache_loc.numel() == 7
    fb.out_cache_loc = fb.out_cache_loc[:6]  # padded, yet a real token has no slot
    with pytest.raises(BatchError, match="out_cache_loc has 6 slots for 7 tokens$"):
        eager_batch(fb)
    fb = _extend_batch(runner, 16, (0, 7), (5, 2), seed=7)
    fb.out_cache_loc = torch.cat([fb.out_cache_loc, fb.out_cache_loc[-1:] + 1])
    fb.positions = torch.cat([fb.positions, fb.positions[-1:] + 1])
    _dp_pad(fb, runner, adapter, 8, 2)  # SGLang padded nothing: its 8 tokens were real
    with pytest.raises(BatchError, match="8 slots for 7 tokens and the batch is not SGLang's"):
        eager_batch(fb)


@pytest.mark.parametrize(
    "mode, refused", [("compact", True), ("cap-accept", True), ("static", False)]
)
def test_ragged_verify_mode_is_refused_at_start_up(
    mode: str, refused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DSPARK builds a ragged verify layout in every SGLANG_RAGGED_VERIFY_MODE but static: the
    launch stops with the setting to use, not at the first verify batch."""
    from mla_backends.integrations.sglang.settings import server_refusal

    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", mode)
    args = SimpleNamespace(speculative_algorithm="DSPARK")
    why = server_refusal("mlab_torch", args, dcp=False)
    if refused:
        assert why is not None and f"SGLANG_RAGGED_VERIFY_MODE={mode}" in why, why
        assert why.endswith("set SGLANG_RAGGED_VERIFY_MODE=static")
    else:
        assert why is None or "RAGGED" not in why, why


@pytest.mark.parametrize(
    ("algo", "mode", "refused"),
    [("DFLASH", "compact", True), ("dspark", "compact", True), ("DSPARK", " Static ", False)],
)
def test_ragged_verify_mode_reads_both_algorithms_and_any_spelling_of_static(
    algo: str, mode: str, refused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mla_backends.integrations.sglang.settings import server_refusal

    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", mode)
    why = server_refusal("mlab_torch", SimpleNamespace(speculative_algorithm=algo), dcp=False)
    assert (why is not None and "SGLANG_RAGGED_VERIFY_MODE" in why) == refused, why


@pytest.mark.parametrize(
    ("args", "text"),
    [
        ({"attn_cp_size": 2}, "mlab_torch: prefill context parallelism"),
        ({"speculative_eagle_topk": 2}, "--speculative-eagle-topk 2: our kernels verify chain"),
        (  # the resolved config's backend, an enum, wins over the flag
            {
                "cuda_graph_config": SimpleNamespace(
                    prefill=SimpleNamespace(backend=SimpleNamespace(value="full"))
                ),
                "cuda_graph_backend_prefill": "breakable",
            },
            "--cuda-graph-backend-prefill full captures",
        ),
        (  # every algorithm whose draft takes SGLang's table, the per-phase flags too
            {
                "speculative_algorithm": "STANDALONE",
                "attention_backend": "triton",
                "decode_attention_backend": "mlab_torch",
            },
            "--speculative-algorithm STANDALONE would build the draft model's attention on "
            "mlab_torch",
        ),
        (  # the draft's own flag wins over the target's
            {
                "speculative_algorithm": "NEXTN",
                "attention_backend": "mlab_torch",
                "speculative_draft_attention_backend": "mlab_triton",
            },
            "--speculative-algorithm NEXTN would build the draft model's attention on mlab_triton",
        ),
    ],
    ids=["attn-cp-2", "topk-2", "resolved-full-prefill-graph", "standalone-draft", "nextn-draft"],
)
def test_server_refusal_from_the_flags_alone(args: dict[str, Any], text: str) -> None:
    from mla_backends.integrations.sglang.settings import server_refusal

    why = server_refusal("mlab_torch", SimpleNamespace(**args), dcp=False)
    assert why is not None and text in why, why


def test_int_flag_reads_unset_and_unresolved_as_one() -> None:
    from mla_backends.integrations.sglang.settings import int_flag

    args = SimpleNamespace(a=None, b=0, c="auto", d=3)
    assert [int_flag(args, f) for f in ("a", "b", "c", "d", "missing")] == [1, 1, 1, 3, 1]


def test_chunk_metadata_through_sglangs_wrappers() -> None:
    """DeepSeek's chunked-prefix MHA calls `init_mha_chunk_metadata` on whatever wrapper is
    installed: SGLang's HybridAttnBackend (our prefill and decode names differ, as in the
    README's per-phase flags) and HybridLinearAttnBackend (every Kimi-Linear server) pass a
    second argument, which raised a TypeError at a long prefix's first prefill."""
    from sglang.srt.layers.attention.hybrid_attn_backend import HybridAttnBackend
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
    from test_sglang_cpu import ATTENTION_BACKENDS, _hybrid

    pre, runner = _adapter("mlab_torch", page=16, dims=SMALL, max_ctx=64)
    dec, _ = _adapter("mlab_torch", page=16, dims=SMALL, max_ctx=64)
    ns = SimpleNamespace(
        kv_cache_dtype=runner.kv_cache_dtype, token_to_kv_pool=runner.token_to_kv_pool,
        req_to_token_pool=runner.req_to_token_pool, model_config=runner.model_config,
        server_args=SimpleNamespace(speculative_attention_mode="prefill"),
    )  # fmt: skip
    kimi, kimi_runner = _adapter("mlab_torch", page=16, dims=SMALL, max_ctx=64)
    ids = [5 + 4 * i for i in range(len(kimi_runner.token_to_kv_pool.kv_buffer))]
    kimi_runner.token_to_kv_pool = _hybrid(kimi_runner, ids)
    kimi = ATTENTION_BACKENDS["mlab_torch"](kimi_runner)
    linear = SimpleNamespace(needs_cpu_seq_lens=False, init_forward_metadata=lambda fb: None)
    for wrapper, inner, r in (
        (HybridAttnBackend(ns, pre, dec), pre, runner),
        (HybridLinearAttnBackend(kimi, linear, ids), kimi, kimi_runner),
    ):
        fb = _extend_batch(r, 16, (20, 9), (4, 3))
        wrapper.init_forward_metadata(fb)
        # what ForwardBatch.prepare_chunked_prefix_cache_info leaves for one chunk
        fb.num_prefix_chunks = 1
        fb.prefix_chunk_cu_seq_lens = torch.tensor([[0, 20, 29]])
        fb.prefix_chunk_seq_lens_cpu = [torch.tensor([20, 9])]
        wrapper.init_mha_chunk_metadata(fb)  # as forward_mha.py calls it
        (chunk,) = inner.forward_metadata.chunks.values()
        assert chunk.kv_indptr_cpu.tolist() == [0, 20, 29]
