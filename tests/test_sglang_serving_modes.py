"""SGLang 0.5.17 serving modes that reach the adapter other than as one plain batch (sglang
0.5.17 on CPU, tests/sglang_cpu/requirements.txt), driven through SGLang's own code:

- two-batch overlap (`--enable-two-batch-overlap`): `TboAttnBackend.init_new` calls our
  factory three times (primary and two children, one pool); eager children come from
  `TboForwardBatchPreparer.prepare_raw` (seq-boundary, two-chunk and MIXED splits); at
  capture each child binds its slice of the capture batch, and before every replay each gets
  the view `TboAttnBackend._dispatch_children_from_replay_view` slices from SGLang's padded
  replay view (`build_replay_fb_view`): no `num_padding`, only its share of the live slots;
  with `--enable-mixed-chunk` SGLang's split of a MIXED batch gives a child tokens that are
  not its requests', so that pair is refused at start-up;
- the breakable decode graph (`--cuda-graph-backend-decode breakable`): DECODE and
  TARGET_VERIFY attention is no eager break there, so it runs inside the captured segment
  on the metadata our graph hooks bound (and eagerly, on the same metadata, under
  `--debug-cuda-graph`).
SGLang's runtime context is not published here: two_batch_overlap's reads of it (attention TP
size, device, the position kernel) are answered for one CPU rank.
Skipped, with the reason, where sglang cannot be imported.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang_cpu.env import load_sglang

try:
    load_sglang()
    from sglang.srt.batch_overlap import two_batch_overlap as tbo
    from sglang.srt.layers import radix_attention
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.layers.attention.tbo_backend import TboAttnBackend
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch as SGLBatch
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import build_replay_fb_view
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import (
        enable_breakable_cuda_graph,
    )
    from sglang.srt.plugins import load_plugins
    from sglang.srt.speculative.eagle_info import EagleVerifyInput
    from sglang_cpu import kit_support as ks
except Exception as e:  # noqa: BLE001 - any import failure means: cannot run here
    pytest.skip(f"sglang unavailable: {' '.join(str(e).split())[:160]}", allow_module_level=True)

from test_sglang_cpu import (  # noqa: E402
    H100,
    SMALL,
    TINY_DSV3,
    _adapter,
    _extend_batch,
    _mqa_layer,
    _server_args,
)

from mla_backends.integrations.sglang import binding  # noqa: E402
from mla_backends.integrations.sglang.adapter import MLABackendAdapter  # noqa: E402
from mla_backends.integrations.sglang.batches import BatchError  # noqa: E402
from mla_backends.integrations.sglang.settings import SettingsError  # noqa: E402
from mla_backends.testing import TOLERANCES  # noqa: E402

BACKENDS = ["mlab_torch", pytest.param("mlab_triton", marks=pytest.mark.interp)]


@pytest.fixture(scope="module", autouse=True)
def plugin() -> Iterator[None]:
    load_plugins()
    undo = ks.use_torch_kv_writer()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            tbo, "get_parallel", lambda: SimpleNamespace(attn_tp_size=1, moe_dense_tp_size=1)
        )
        mp.setattr(tbo, "get_device", lambda: SimpleNamespace(device="cpu"))
        kernel = SimpleNamespace(attention_backend="torch_native")
        mp.setattr(tbo, "get_exec", lambda: SimpleNamespace(kernel=kernel))
        yield
    undo()


def _tbo(backend: str, runner: Any) -> Any:
    """What `attention_backend_setup.build_attention_backends` builds under TBO."""
    return TboAttnBackend.init_new(lambda: ATTENTION_BACKENDS[backend](runner))


def _split(fb: Any, backend: Any) -> None:
    """SGLang's TBO split of `fb` (its scheduler's split index, then the preparer)."""
    per_seq = tbo.get_token_num_per_seq(fb.forward_mode, fb.spec_info)
    fb.tbo_split_seq_index = tbo.compute_split_seq_index(
        fb.forward_mode, fb.input_ids.numel(), fb.extend_seq_lens_cpu, per_seq
    )
    with forward_context(ForwardContext(attn_backend=backend)):
        tbo.TboForwardBatchPreparer.prepare_raw(
            fb, tbo_children_num_token_non_padded=torch.zeros(2, dtype=torch.int32)
        )


def _per_child(backend: Any, fb: Any, call: Any) -> torch.Tensor:
    """`call(rows, child batch)` for each child in its own forward context (how TBO's stage
    executors run a layer), child a first; outputs in the parent's token order."""
    outs = []
    for child, cfb in zip(backend.children, fb.tbo_children, strict=True):
        with forward_context(ForwardContext(attn_backend=child)):
            outs.append(call(slice(*cfb.tbo_parent_token_range), cfb))
    return torch.cat(outs)


def test_tbo_builds_three_adapters_over_one_pool() -> None:
    """Three factory calls: three adapters, each viewing SGLang's KV pool in place (no copy),
    each with its own graph buffers and backend state, one fill value."""
    _, runner = _adapter("mlab_torch", page=16, dims=SMALL, batch=8)
    backend = _tbo("mlab_torch", runner)
    adapters = [backend.primary, *backend.children]
    assert all(isinstance(a, MLABackendAdapter) for a in adapters)
    assert len({id(a) for a in adapters}) == len({id(a.backend) for a in adapters}) == 3
    sgl = runner.token_to_kv_pool.kv_buffer[0].data_ptr()
    assert all(a.binding.kv_pool.kv_buffer[0].data_ptr() == sgl for a in adapters)
    backend.init_cuda_graph_state(4, 12)
    assert len({a._graph.seq.data_ptr() for a in adapters}) == 3
    assert (
        backend.get_cuda_graph_seq_len_fill_value()
        == adapters[0].backend.cuda_graph_seq_len_fill_value
    )


# (prefix, extend, forward mode): the split SGLang picks for each is asserted below
EAGER_SPLITS = {
    "seq-boundary": ((0, 5, 17, 3), (4, 4, 2, 6), ForwardMode.EXTEND),
    "two-chunk": ((0, 5, 17, 3), (4, 1, 2, 26), ForwardMode.EXTEND),  # request 3 straddles
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("split", list(EAGER_SPLITS), ids=list(EAGER_SPLITS))
def test_tbo_eager_children_attend_their_halves(backend: str, split: str) -> None:
    """Each child attends its own sub-batch on its own metadata (both children's metadata
    built before either attends); with the two-chunk split child b's half of request 3 reads
    child a's half from the pool as prefix. Together: the whole batch's output and stores."""
    prefix, ext, mode = EAGER_SPLITS[split]
    plain, runner = _adapter(backend, page=16, dims=SMALL, batch=8)
    backend_ = _tbo(backend, runner)
    d, t = plain.dims, sum(ext)
    gen = torch.Generator().manual_seed(21)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).bfloat16()

    q_nope, q_rope = rnd(t, d.num_heads, d.kv_lora_rank), rnd(t, d.num_heads, d.qk_rope_head_dim)
    k_nope, k_rope = rnd(t, 1, d.kv_lora_rank), rnd(t, 1, d.qk_rope_head_dim)
    buf = runner.token_to_kv_pool.kv_buffer[0]
    buf.copy_(torch.randn(buf.shape, generator=gen).bfloat16())
    start = buf.clone()
    layer = _mqa_layer(plain)
    with torch.no_grad():
        fb = _extend_batch(runner, 16, prefix, ext, seed=22)
        fb.forward_mode = mode
        with forward_context(ForwardContext(attn_backend=plain)):
            plain.init_forward_metadata(fb)
            want = layer(q_nope, k_nope, k_nope, fb, q_rope=q_rope, k_rope=k_rope).clone()
        stored = buf.clone()
        buf.copy_(start)
        fb = _extend_batch(runner, 16, prefix, ext, seed=22)
        fb.forward_mode = mode
        _split(fb, backend_)
        backend_.init_forward_metadata(fb)
        got = _per_child(
            backend_,
            fb,
            lambda s, cfb: layer(
                q_nope[s], k_nope[s], k_nope[s], cfb, q_rope=q_rope[s], k_rope=k_rope[s]
            ),
        )
    a, b = fb.tbo_children
    sizes = {"seq-boundary": (2, 2), "two-chunk": (4, 1)}[split]
    assert (a.batch_size, b.batch_size) == sizes
    assert a.forward_mode == b.forward_mode == mode
    atol, rtol, _ = TOLERANCES["bfloat16"]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    assert torch.equal(buf, stored)


def _static(max_bs: int, q: int) -> SimpleNamespace:
    """The decode graph runner's static input buffers that `build_replay_fb_view` reads."""
    i64 = {"dtype": torch.int64}
    return SimpleNamespace(
        input_ids=torch.zeros(max_bs * q, **i64),
        positions=torch.zeros(max_bs * q, **i64),
        req_pool_indices=torch.zeros(max_bs, **i64),
        seq_lens=torch.ones(max_bs, **i64),
        seq_lens_cpu=torch.ones(max_bs, **i64),
        out_cache_loc=torch.zeros(max_bs * q, **i64),
        encoder_lens=None,
        mamba_track_indices=None,
    )


def _verify_input(q: int) -> Any:
    """EAGLE's chain verify input (topk 1), as the verify graph runner's spec info."""
    return EagleVerifyInput(
        draft_token=None,
        custom_mask=None,
        positions=None,
        retrieve_index=None,
        retrieve_next_token=None,
        retrieve_next_sibling=None,
        retrieve_cum_len=None,
        spec_steps=q - 1,
        topk=1,
        draft_token_num=q,
        capture_hidden_mode=CaptureHiddenMode.FULL,
        seq_lens_sum=0,
        seq_lens_cpu=None,
    )


def _capture_batch(s: SimpleNamespace, bs: int, q: int, mode: Any) -> Any:
    """`DecodeCudaGraphRunner.capture_prepare`'s batch: slices of the static buffers."""
    spec = _verify_input(q) if mode.is_target_verify() else None
    return SGLBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=s.input_ids[: bs * q],
        req_pool_indices=s.req_pool_indices[:bs],
        seq_lens=s.seq_lens[:bs],
        seq_lens_cpu=s.seq_lens_cpu[:bs],
        out_cache_loc=s.out_cache_loc[: bs * q],
        seq_lens_sum=bs,
        positions=s.positions[: bs * q],
        spec_info=spec,
    )


def _fill(s: SimpleNamespace, fb: Any, bs: int, q: int, fill: int) -> None:
    """`fill_from`: the live batch's rows, then padded rows (request 0, the fill length,
    slot 0), in place."""
    raw = fb.batch_size
    s.req_pool_indices[:bs].zero_()
    s.req_pool_indices[:raw].copy_(fb.req_pool_indices)
    s.seq_lens[:bs].fill_(fill)
    s.seq_lens[:raw].copy_(fb.seq_lens)
    s.seq_lens_cpu[:bs].fill_(fill)
    s.seq_lens_cpu[:raw].copy_(fb.seq_lens_cpu)
    s.out_cache_loc[: bs * q].zero_()
    s.out_cache_loc[: raw * q].copy_(fb.out_cache_loc)


def _live(runner: Any, raw: int, q: int, mode: Any) -> Any:
    """The scheduler's batch of `raw` requests; verify lengths exclude the drafts."""
    fb = _extend_batch(runner, 16, (9, 20, 33, 4)[:raw], (q,) * raw, seed=23)
    fb.forward_mode = mode
    if mode.is_target_verify():
        fb.seq_lens, fb.seq_lens_cpu = fb.seq_lens - q, fb.seq_lens_cpu - q
        fb.spec_info = _verify_input(q)
    return fb


@pytest.mark.parametrize("on_device", [True, False], ids=["in-graph", "out-graph"])
@pytest.mark.parametrize("raw", [3, 1], ids=["raw3", "raw1"])
@pytest.mark.parametrize("q_len", [1, 3], ids=["decode", "verify"])
def test_tbo_graph_replay_children_take_padded_views(
    q_len: int, raw: int, on_device: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Capture bucket 4 split 2 + 2; replay 3 (child b: 1 real + 1 padded) or 1 real request
    (child a half padded, child b all padding, no live slot). Each child refills its own
    buffers from TBO's child view, the primary keeps the whole batch, and the children's
    attention over the capture batch's halves is the eager attention of the real requests.
    The adapter once refused those views ('1 live slots for 2 requests x 1 tokens')."""
    plain, runner = _adapter("mlab_torch", page=16, dims=SMALL, batch=8)
    backend = _tbo("mlab_torch", runner)
    adapters = [backend.primary, *backend.children]
    if not on_device:
        for a in adapters:
            monkeypatch.setattr(a.backend, "graph_refill_on_device", lambda bs: False)
    bs, q = 4, q_len
    mode = ForwardMode.DECODE if q == 1 else ForwardMode.TARGET_VERIFY
    fill = plain.get_cuda_graph_seq_len_fill_value()
    q_all = _random_pool_and_queries(runner, plain, bs * q, 24)
    layer = _mqa_layer(plain)
    s = _static(8, q)
    with torch.no_grad():
        backend.init_cuda_graph_state(8, 8 * q)
        cap = _capture_batch(s, bs, q, mode)
        _split(cap, backend)
        backend.init_forward_metadata_out_graph(cap, in_capture=True)
        backend.init_forward_metadata_in_graph(cap)
        fb = _live(runner, raw, q, mode)
        _fill(s, fb, bs, q, fill)
        view = build_replay_fb_view(
            forward_batch=fb,
            buffers=s,
            bs=bs,
            raw_bs=raw,
            num_tokens=bs * q,
            seq_len_fill_value=fill,
            capture_forward_mode=mode,
            is_encoder_decoder=False,
        )
        backend.init_forward_metadata_out_graph(view)
        backend.init_forward_metadata_in_graph(cap)  # recorded: runs with every replay
        got = _per_child(
            backend, cap, lambda t, cfb: layer(q_all[t], None, None, cfb, save_kv_cache=False)
        )
        with forward_context(ForwardContext(attn_backend=plain)):
            plain.init_forward_metadata(fb)
            want = layer(q_all[: raw * q], None, None, fb, save_kv_cache=False)
    extra = q if q > 1 else 0
    lens = [int(x) + extra for x in fb.seq_lens] + [fill + extra] * (bs - raw)
    batches = [a.forward_metadata.batch for a in adapters]
    assert [b.seq_lens.tolist() for b in batches] == [lens, lens[:2], lens[2:]]
    assert len({b.seq_lens.data_ptr() for b in batches}) == 3
    loc = torch.cat([fb.out_cache_loc, torch.zeros((bs - raw) * q, dtype=torch.int64)])
    assert [b.out_cache_loc.tolist() for b in batches[1:]] == [
        loc[: 2 * q].tolist(),
        loc[2 * q :].tolist(),
    ]
    torch.testing.assert_close(got[: raw * q], want, atol=0, rtol=0)


def test_graph_views_without_num_padding_still_check_their_live_slots() -> None:
    """A view without `num_padding` (a TBO child's) must hold whole requests' live slots,
    no more than its batch; a view that says `num_padding` must match it."""
    adapter, _ = _adapter("mlab_torch", page=16, dims=SMALL, batch=8)
    adapter.init_cuda_graph_state(4, 12)

    def view(live: int, **kw: Any) -> SimpleNamespace:
        return SimpleNamespace(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=4,
            input_ids=torch.zeros(12, dtype=torch.int64),
            spec_info=_verify_input(3),
            out_cache_loc=torch.zeros(live, dtype=torch.int64),
            **kw,
        )

    assert adapter._graph.check(view(6))[1:3] == (4, 3)
    with pytest.raises(BatchError, match="5 live slots for 1 of 4 requests x 3 tokens"):
        adapter._graph.check(view(5))
    with pytest.raises(BatchError, match="6 live slots for 3 of 4 requests x 3 tokens"):
        adapter._graph.check(view(6, num_padding=1))
    with pytest.raises(BatchError, match="15 live slots for 5 of 4 requests x 3 tokens"):
        adapter._graph.check(view(15))  # more live requests than the batch holds


@pytest.mark.parametrize("q_len", [1, 3], ids=["decode", "verify"])
def test_breakable_decode_graph_keeps_attention_in_the_segment(
    q_len: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under SGLang's breakable decode graph, RadixAttention sends DECODE and TARGET_VERIFY
    straight to the backend (its eager-break ops serve only tc-piecewise EXTEND), so our
    attention is captured in the segment and replays on the metadata out_graph / in_graph
    bound; run eagerly there (`--debug-cuda-graph`), it reads the same metadata."""

    def eager_break(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("decode attention became an eager break of the breakable graph")

    for op in (
        "breakable_unified_attention_with_output",
        "breakable_unified_attention_with_output_and_lse",
        "breakable_attention_with_output_extra_kwargs",
    ):
        monkeypatch.setattr(radix_attention, op, eager_break)
    adapter, runner = _adapter("mlab_torch", page=16, dims=SMALL, batch=8)
    q, bs = q_len, 4
    mode = ForwardMode.DECODE if q == 1 else ForwardMode.TARGET_VERIFY
    q_all = _random_pool_and_queries(runner, adapter, bs * q, 25)
    layer = _mqa_layer(adapter)
    s = _static(bs, q)
    fb = _live(runner, 3, q, mode)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=adapter)):
        adapter.init_forward_metadata(fb)
        want = layer(q_all[: 3 * q], None, None, fb, save_kv_cache=False).clone()
        with enable_breakable_cuda_graph():
            adapter.init_cuda_graph_state(bs, bs * q)
            cap = _capture_batch(s, bs, q, mode)
            adapter.init_forward_metadata_out_graph(cap, in_capture=True)
            adapter.init_forward_metadata_in_graph(cap)
            layer(q_all, None, None, cap, save_kv_cache=False)  # the captured segment
            fill = adapter.get_cuda_graph_seq_len_fill_value()
            _fill(s, fb, bs, q, fill)
            view = build_replay_fb_view(fb, s, bs, 3, bs * q, fill, mode, False)
            adapter.init_forward_metadata_out_graph(view)
            adapter.init_forward_metadata_in_graph(cap)
            got = layer(q_all, None, None, cap, save_kv_cache=False)
    torch.testing.assert_close(got[: 3 * q], want, atol=0, rtol=0)


TBO_DP = {"enable_two_batch_overlap": True, "enable_dp_attention": True, "tp_size": 2, "dp_size": 2}


def test_tbo_with_mixed_chunk_is_refused_at_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang 0.5.17 cuts a MIXED batch (a prefill chunk beside decodes) into requests at the
    balanced split and into tokens at the two-chunk one, re-deriving the lengths for EXTEND
    only: here child b gets 5 tokens for requests extending 4 + 1 + 1, which the adapter
    could only refuse deep in that batch. The launch (and the factory) refuse the pair in one
    line; TBO without mixed chunks is accepted. If SGLang fixes the split, the first assert
    fails: then lift the refusal."""
    _, runner = _adapter("mlab_torch", page=16, dims=SMALL, batch=8)
    backend = _tbo("mlab_torch", runner)
    fb = _extend_batch(runner, 16, (0, 9, 20, 30), (4, 4, 1, 1), seed=26)
    fb.forward_mode = ForwardMode.MIXED
    _split(fb, backend)
    b = fb.tbo_children[1]
    assert (b.out_cache_loc.numel(), sum(b.extend_seq_lens_cpu)) == (5, 6)
    with pytest.raises(BatchError, match="out_cache_loc has 5 slots for 6 tokens"):
        backend.children[1].init_forward_metadata(b)

    monkeypatch.setattr(binding, "detect_capability", lambda device: H100)
    (tmp_path / "config.json").write_text(json.dumps(TINY_DSV3))
    flags = {"attention_backend": "mlab_torch", "page_size": 16, **TBO_DP}
    _server_args(tmp_path, **flags).check_server_args()
    sa = _server_args(tmp_path, **flags, enable_mixed_chunk=True)
    refusal = r"--enable-two-batch-overlap with --enable-mixed-chunk: .* drop --enable-mixed-chunk"
    with pytest.raises(SettingsError, match=refusal):
        sa.check_server_args()
    runner.server_args = sa
    with pytest.raises(SettingsError, match=refusal):
        ATTENTION_BACKENDS["mlab_torch"](runner)


def _random_pool_and_queries(runner: Any, adapter: Any, tokens: int, seed: int) -> torch.Tensor:
    """Random rows in SGLang's layer-0 KV buffer, and random [tokens, H * kv_dim] queries."""
    d = adapter.dims
    gen = torch.Generator().manual_seed(seed)
    buf = runner.token_to_kv_pool.kv_buffer[0]
    buf.copy_(torch.randn(buf.shape, generator=gen).bfloat16())
    return torch.randn(tokens, d.num_heads * d.kv_dim, generator=gen).bfloat16()
