"""Per-batch layouts are built once, not once per layer: a DeepSeek-V3 prefill step builds its
ragged layout once (CPU, every backend), and through `flashinfer_mla` plans FlashInfer's ragged
prefill once per batch (GPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from mla_backends.batch import RaggedLayout
from mla_backends.config import Config
from mla_backends.models.engine import Engine
from mla_backends.models.run import RANDOM_SIZES, random_model
from mla_backends.runtime import Runtime

LAYERS = 4


def _engine(device: str, backend: str, dtype: str, chunked_prefix_min: int | None) -> Engine:
    raw = dict(RANDOM_SIZES["tiny"], num_hidden_layers=LAYERS)
    if device == "cuda":  # FlashInfer's kernels are built for DeepSeek's latent dims
        raw.update(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
        raw.update(num_attention_heads=16, hidden_size=512)
    model = random_model(copy.deepcopy(raw), 0, device, getattr(torch, dtype))
    for layer in model.model.layers:
        layer.self_attn.chunked_prefix_min = chunked_prefix_min
    a = model.cfg.attention_dims
    cfg = Config(
        model=a,
        num_layers=LAYERS,
        prefill_backend=backend,
        decode_backend=backend,
        page_size=16,
        kv_dtype=dtype,
        dtype=dtype,
        num_pages=64,
        max_requests=4,
        max_context_len=512,
        device=device,
    )
    return Engine(model, Runtime.build(cfg))


@pytest.mark.parametrize("chunked", [False, True], ids=["mha-prefill", "chunked-prefix"])
def test_prefill_step_builds_each_layout_once(
    monkeypatch: pytest.MonkeyPatch, chunked: bool
) -> None:
    eng = _engine("cpu", "torch", "float32", 1 if chunked else None)
    rows = eng.new_requests(2)
    gen = torch.Generator().manual_seed(0)
    toks = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 5)]
    eng.extend(rows, toks)  # the prefix, for the chunked step
    built: list[int] = []
    orig = RaggedLayout.from_lens.__func__  # type: ignore[attr-defined]

    def counted(cls, *a, **k):  # type: ignore[no-untyped-def]
        built.append(1)
        return orig(cls, *a, **k)

    monkeypatch.setattr(RaggedLayout, "from_lens", classmethod(counted))
    eng.extend(rows, [[1, 2, 3], [4, 5]])
    # Without a prefix the step is absorbed (no ragged layout); with one and chunked prefill
    # on, every layer reads the batch's prefix and new-token layouts: built once each.
    assert len(built) == (2 if chunked else 0), f"{len(built)} layouts for {LAYERS} layers"
    built.clear()
    rows2 = eng.new_requests(2)
    eng.extend(rows2, toks)  # MHA-mode prefill: one extend layout for every layer
    assert len(built) == 1, f"{len(built)} layouts for {LAYERS} layers"


@pytest.mark.gpu
def test_gpu_flashinfer_prefill_plans_ragged_wrapper_once_per_batch() -> None:
    pytest.importorskip("flashinfer")
    eng = _engine("cuda", "flashinfer_mla", "bfloat16", None)
    be = eng.backend
    rows = eng.new_requests(3)
    gen = torch.Generator().manual_seed(0)
    toks = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (200, 37, 96)]
    before = be.ragged_plans  # type: ignore[attr-defined]
    logits = eng.extend(rows, toks)
    assert torch.isfinite(logits).all()
    assert be.ragged_plans - before == 1, (  # type: ignore[attr-defined]
        f"{be.ragged_plans - before} ragged plans for {LAYERS} layers"  # type: ignore[attr-defined]
    )
