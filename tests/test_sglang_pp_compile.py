"""Pipeline parallelism, HiCache's layer-wise load and `--enable-torch-compile` with our
names (sglang 0.5.17, CPU).

- PP: a rank holds layers start_layer..end_layer-1; SGLang's MLATokenToKVPool indexes them
  by layer_id - start_layer (memory_pool.py, get_key_buffer / set_mla_kv_buffer). Ours must
  store into and read the same buffer SGLang does for every layer id, and refuse another
  rank's layer.
- HiCache: the device pool stays SGLang's (HiRadixCache builds MLATokenToKVPoolHost over it);
  what a backend owes it is the per-layer wait (`layer_transfer_counter.wait_until(layer_id
  - start_layer)`, through get_key_buffer) before the layer's first kernel.
- torch.compile: SGLang compiles the model's forward for the decode graphs' small batch
  sizes (`compilation/torch_compile_decoration.patch_model`: torch.compile(model.forward,
  dynamic=False), called for the warm-up runs and the capture), and RadixAttention calls the
  attention backend inside that trace. Our attention must run eagerly there (as SGLang's own
  triton backend keeps its kernels out of the trace with torch.compiler.disable): never
  traced by Dynamo, with the same output and the same stored KV rows as without the flag.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang_cpu.env import load_sglang

try:
    load_sglang()
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.plugins import load_plugins
except Exception as e:  # noqa: BLE001 - any import failure means: cannot run here
    pytest.skip(f"sglang unavailable: {' '.join(str(e).split())[:160]}", allow_module_level=True)

import test_sglang_cpu as base  # noqa: E402

import mla_backends.integrations.sglang as sglang_plugin  # noqa: E402
from mla_backends.integrations.sglang import dsa  # noqa: E402
from mla_backends.integrations.sglang.batches import BatchError  # noqa: E402
from mla_backends.integrations.sglang.layers import (  # noqa: E402
    check_layer,
    flat_heads,
    split_absorbed,
)
from mla_backends.integrations.sglang.settings import SettingsError  # noqa: E402
from mla_backends.reference import absorbed  # noqa: E402
from mla_backends.testing import TOLERANCES  # noqa: E402

START = 4  # this rank: layers 4 and 5
tiny_model, on_h100 = base.tiny_model, base.on_h100  # test_sglang_cpu's fixtures


@pytest.fixture(scope="module", autouse=True)
def plugin() -> Any:
    load_plugins()
    undo = base.ks.use_torch_kv_writer()
    yield
    undo()


class Counter:
    """SGLang's LayerDoneCounter as the backend sees it: records the waits, and when."""

    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def wait_until(self, threshold: int) -> None:
        self.log.append(("wait", threshold))


def _pp_adapter(backend: str) -> tuple[Any, Any]:
    _, runner = base._adapter(backend, page=16, dims=base.SMALL)
    old = runner.token_to_kv_pool
    runner.token_to_kv_pool = MLATokenToKVPool(
        old.size,
        page_size=16,
        dtype=old.dtype,
        kv_lora_rank=old.kv_lora_rank,
        qk_rope_head_dim=old.qk_rope_head_dim,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
        start_layer=START,
        end_layer=START + 2,
    )
    return base.ATTENTION_BACKENDS[backend](runner), runner


@pytest.mark.parametrize(
    "backend", ["mlab_torch", pytest.param("mlab_triton", marks=pytest.mark.interp)]
)
def test_pp_rank_layers_and_hicache_waits(backend: str) -> None:
    adapter, runner = _pp_adapter(backend)
    pool, d = runner.token_to_kv_pool, adapter.dims
    assert [adapter.binding.layer_index(i) for i in range(3, 7)] == [None, 0, 1, None]
    log: list[Any] = []
    pool.register_layer_transfer_counter(Counter(log))
    inner = adapter.backend.forward_absorbed

    def spy(layer: int, *args: Any, **kwargs: Any) -> Any:
        log.append(("attend", layer))
        return inner(layer, *args, **kwargs)

    adapter.backend.forward_absorbed = spy
    fb = base._extend_batch(runner, 16, (0, 7), (5, 2), seed=5)
    t = sum(fb.extend_seq_lens_cpu)
    r2t = runner.req_to_token_pool.req_to_token
    gen = torch.Generator().manual_seed(1)
    for b in pool.kv_buffer:  # each layer's prefix rows its own
        b.fill_(float("nan"))
        b[r2t[1, :7].long()] = torch.randn(7, 1, d.kv_dim, generator=gen).bfloat16()
    atol, rtol, _ = TOLERANCES["bfloat16"]
    for lid in (START, START + 1):
        q_nope, q_rope = (
            torch.randn(t, d.num_heads, w, generator=gen).bfloat16() for w in (32, 16)
        )
        k_nope, k_rope = (torch.randn(t, 1, w, generator=gen).bfloat16() for w in (32, 16))
        layer = base._mqa_layer(adapter)
        layer.layer_id = lid
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=adapter)):
            adapter.init_forward_metadata(fb)
            out = layer(q_nope, k_nope, k_nope, fb, q_rope=q_rope, k_rope=k_rope)
        rows = pool.get_key_buffer(lid)  # SGLang's view of this layer
        assert torch.equal(rows[fb.out_cache_loc, 0], torch.cat([k_nope, k_rope], -1)[:, 0])
        want, s = [], 0
        for i, (p, n) in enumerate(zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)):
            kv = rows[r2t[i, : p + n].long(), 0].double()
            want.append(
                absorbed(
                    q_nope[s : s + n], q_rope[s : s + n], kv[:, :32], kv[:, 32:], d.softmax_scale
                )[0]
            )
            s += n
        got = out.view(t, d.num_heads, -1).double()
        torch.testing.assert_close(got, torch.cat(want), atol=atol, rtol=rtol)
    # every layer waited for its own load (local index), before its attention
    waits = [e for e in log if e[0] == "wait"]
    assert waits[:1] == [("wait", 0)] and ("wait", 1) in waits
    assert log.index(("wait", 0)) < log.index(("attend", 0)) < log.index(("wait", 1))
    assert log.index(("wait", 1)) < log.index(("attend", 1))
    layer = base._mqa_layer(adapter)
    layer.layer_id = START - 1  # the previous rank's layer
    with forward_context(ForwardContext(attn_backend=adapter)):
        adapter.init_forward_metadata(fb)
        with pytest.raises(BatchError, match="layer 3 is outside this rank's KV pool layers"):
            layer(q_nope, k_nope, k_nope, fb, q_rope=q_rope, k_rope=k_rope)


@pytest.mark.parametrize(
    "backend", ["mlab_torch", pytest.param("mlab_triton", marks=pytest.mark.interp)]
)
def test_torch_compiled_model_runs_our_attention_eagerly(backend: str) -> None:
    """A model (RadixAttention -> our adapter, DeepSeek's split q / k with the new rows
    stored by us) compiled the way SGLang's patch_model does and run three times (two
    warm-ups, the capture): our backend is never traced (Dynamo sees a graph break), the
    output and the stored rows equal eager's. Before the fix Dynamo traced our forward path
    (mlab_torch: into one graph; mlab_triton: into our kernel launches, which failed)."""
    adapter, runner = base._adapter(backend, page=16, dims=base.SMALL, batch=4)
    d = adapter.dims
    fb = base._extend_batch(runner, 16, (9, 20), (1, 1), seed=1)
    fb.forward_mode = ForwardMode.DECODE
    gen = torch.Generator().manual_seed(2)
    buf = runner.token_to_kv_pool.kv_buffer[0]
    buf.copy_(torch.randn(buf.shape, generator=gen).bfloat16())
    snapshot = buf.clone()
    layer = base._mqa_layer(adapter)
    traced: list[bool] = []
    inner = adapter.backend.forward_absorbed

    def spy(*args: Any, **kwargs: Any) -> Any:
        traced.append(torch.compiler.is_compiling())
        return inner(*args, **kwargs)

    adapter.backend.forward_absorbed = spy

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = layer

        def forward(self, q_nope: Any, q_rope: Any, k_nope: Any, k_rope: Any, fb: Any) -> Any:
            return self.attn(q_nope, k_nope, k_nope, fb, q_rope=q_rope, k_rope=k_rope) * 2

    model = Model()

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).bfloat16()

    q_nope = rnd(d.num_heads, 2, d.kv_lora_rank).transpose(0, 1)
    q_rope = rnd(2, d.num_heads, d.qk_rope_head_dim)
    k_nope, k_rope = rnd(2, 1, d.kv_lora_rank), rnd(2, 1, d.qk_rope_head_dim)
    args = (q_nope, q_rope, k_nope, k_rope, fb)
    torch._dynamo.reset()
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=adapter)):
        adapter.init_forward_metadata(fb)
        eager = model(*args).clone()
        eager_rows = buf.clone()
        compiled = torch.compile(torch.no_grad()(model.forward), backend="aot_eager")
        for _ in range(3):
            buf.copy_(snapshot)
            adapter.init_forward_metadata(fb)
            torch.testing.assert_close(compiled(*args), eager, atol=0, rtol=0)
            assert torch.equal(buf, eager_rows)
    torch._dynamo.reset()
    assert traced and not any(traced), f"Dynamo traced our attention ({traced})"


# ------------------------------------------- the layer check and the plug-in's registration
def test_layer_check_refuses_heads_scale_and_logit_cap() -> None:
    """A RadixAttention layer built otherwise than the model config is refused with its
    layer id and reason; a scale within 1e-6 relative is the same scale."""
    adapter, _ = base._adapter("mlab_torch", page=16, dims=base.SMALL)
    d = adapter.dims
    near = base._mqa_layer(adapter)
    near.scaling = d.softmax_scale * (1 + 1e-7)
    check_layer(near, d)
    cases = (
        (
            "tp_q_head_num",
            2 * d.num_heads,
            rf"has {2 * d.num_heads} query heads, .* for {d.num_heads}",
        ),
        ("scaling", d.softmax_scale * (1 + 1e-5), "softmax scale .* != the model config's"),
        ("logit_cap", 30.0, "logit capping is not supported"),
    )
    for field, value, match in cases:
        layer = base._mqa_layer(adapter)
        layer.layer_id = START
        setattr(layer, field, value)
        with pytest.raises(SettingsError, match=f"layer {START}.*{match}"):
            check_layer(layer, d)


def test_registering_again_adds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """`register` runs in every process, and again where SGLang reloads plug-ins: every name
    once in DeepSeek's absorbed list, one start-up check hook, no second DSA hook."""
    from sglang.srt.models.deepseek_common.utils import FORWARD_ABSORB_CORE_ATTENTION_BACKENDS
    from sglang.srt.plugins.hook_registry import HookRegistry

    hooks = type(HookRegistry._hooks)(list, {k: list(v) for k, v in HookRegistry._hooks.items()})
    monkeypatch.setattr(HookRegistry, "_hooks", hooks)
    absorb = list(FORWARD_ABSORB_CORE_ATTENTION_BACKENDS)
    monkeypatch.setenv(dsa.ENV, "triton")
    try:
        names = sglang_plugin.register()
        assert [FORWARD_ABSORB_CORE_ATTENTION_BACKENDS.count(n) for n in names] == [1] * len(names)
    finally:
        FORWARD_ABSORB_CORE_ATTENTION_BACKENDS[:] = absorb
    assert [h for _, h, _ in hooks[sglang_plugin.CHECK_TARGET]].count(
        sglang_plugin.check_server_args_hook
    ) == 1
    assert dsa.TARGET not in hooks


def test_bad_dsa_choice_is_logged_not_raised(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang logs and swallows a plug-in's exception: ours says why loudly and registers the
    rest."""
    monkeypatch.setenv(dsa.ENV, "flashmla")
    sglang_plugin._register_dsa()
    assert "DSA sparse attention hook not installed: MLAB_DSA_SPARSE='flashmla'" in caplog.text


def test_start_up_check_ignores_sglangs_own_backends() -> None:
    """Servers on SGLang's own backends are not ours to check (nothing else is read)."""
    sa = SimpleNamespace(
        attention_backend="flashinfer",
        prefill_attention_backend=None,
        decode_attention_backend=None,
    )
    assert sglang_plugin.check_server_args_hook(None, sa) is None


def test_attention_tp_size_divides_by_the_context_parallel_ranks() -> None:
    """A layer's heads split over tp / dp (under --enable-dp-attention) / attn_cp ranks."""
    sa = SimpleNamespace(tp_size=8, dp_size=2, enable_dp_attention=True, attn_cp_size=2)
    assert sglang_plugin._attn_tp_size(sa) == 2
    sa.enable_dp_attention = False
    assert sglang_plugin._attn_tp_size(sa) == 4


def test_start_up_check_checks_each_of_our_names(tiny_model: Any, on_h100: Any) -> None:
    """Prefill on one of our names, decode on another: the decode one is checked too."""
    sa = base._server_args(
        tiny_model,
        prefill_attention_backend="mlab_flashmla",
        decode_attention_backend="mlab_trtllm",
        page_size=64,
    )
    with pytest.raises(SettingsError, match=r"mlab_trtllm.*SM 100"):
        sa.check_server_args()


def test_flat_heads_flattens_only_where_it_is_a_view() -> None:
    """[T, H, D] contiguous -> the [T, H * D] view SGLang's callers take; head-major memory
    (a strided q's output) stays 3-D rather than be copied."""
    out = torch.randn(3, 4, 8)
    flat = flat_heads(out)
    assert flat.shape == (3, 32) and flat.data_ptr() == out.data_ptr()
    strided = torch.randn(4, 3, 8).transpose(0, 1)
    assert flat_heads(strided) is strided


def test_split_absorbed_without_k_gives_no_new_rows() -> None:
    """k None (the caller stored the rows already): q split into views, no k parts (a k part
    there was taken for new rows, and refused as missing its rope columns)."""
    adapter, _ = base._adapter("mlab_torch", page=16, dims=base.SMALL)
    d = adapter.dims
    q = torch.randn(3, d.num_heads * (d.kv_lora_rank + d.qk_rope_head_dim))
    q_nope, q_rope, k_nope, k_rope = split_absorbed(q, None, {}, d)
    assert k_nope is None and k_rope is None
    joined = q.view(3, d.num_heads, -1)
    assert torch.equal(q_nope, joined[..., : d.kv_lora_rank]) and q_nope.data_ptr() == q.data_ptr()
    assert torch.equal(q_rope, joined[..., d.kv_lora_rank :])
