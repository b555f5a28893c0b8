"""`--enable-torch-compile` with our names (sglang 0.5.17, CPU).

SGLang compiles the model's forward for the decode graphs' small batch sizes
(`compilation/torch_compile_decoration.patch_model`: torch.compile(model.forward,
dynamic=False), called for the warm-up runs and the capture), and RadixAttention calls the
attention backend inside that trace. Our attention must run eagerly there (as SGLang's own
triton backend keeps its kernels out of the trace with torch.compiler.disable): never traced
by Dynamo, with the same output and the same stored KV rows as without the flag.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sglang_cpu.env import load_sglang

try:
    load_sglang()
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.plugins import load_plugins
except Exception as e:  # noqa: BLE001 - any import failure means: cannot run here
    pytest.skip(f"sglang unavailable: {' '.join(str(e).split())[:160]}", allow_module_level=True)

import test_sglang_cpu as base  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def plugin() -> Any:
    load_plugins()
    undo = base.ks.use_torch_kv_writer()
    yield
    undo()


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
