"""One SGLang attention call, in our terms: the layer checks (once per layer) and the two
absorbed call shapes DeepSeek uses, split into our q / k parts."""

from __future__ import annotations

import math
from typing import Any

import torch

from mla_backends.config import MLADims
from mla_backends.integrations.sglang.binding import check_kv_scales
from mla_backends.integrations.sglang.settings import SettingsError

TensorOrNone = torch.Tensor | None


def check_layer(layer: Any, d: MLADims) -> None:
    """A RadixAttention layer our backend can serve: its heads, softmax scale, no logit
    capping, no KV scale other than 1 (SGLang's own writers ignore it)."""
    lid = int(layer.layer_id)
    if layer.tp_q_head_num != d.num_heads:
        raise SettingsError(
            f"layer {lid} has {layer.tp_q_head_num} query heads, the backend was "
            f"built for {d.num_heads}"
        )
    if not math.isclose(float(layer.scaling), d.softmax_scale, rel_tol=1e-6):
        raise SettingsError(
            f"layer {lid} softmax scale {layer.scaling} != the model config's {d.softmax_scale}"
        )
    if getattr(layer, "logit_cap", 0.0):
        raise SettingsError(f"layer {lid}: logit capping is not supported")
    check_kv_scales([layer])


def split_absorbed(
    q: torch.Tensor, k: TensorOrNone, kwargs: dict[str, Any], d: MLADims
) -> tuple[torch.Tensor, torch.Tensor, TensorOrNone, TensorOrNone]:
    """(q_nope, q_rope, k_nope, k_rope) of an absorbed call. Two shapes of q: split (our names
    are in DeepSeek's FORWARD_ABSORB list: q_nope [T, H, L] strided, q_rope in kwargs) and
    joined (q [T, H*(L+R)] or [T, H, L+R]). k: [T, 1, L] with k_rope in kwargs, [T, 1, L+R]
    (whole rows, also beside a split q, as SGLang's own MLA backends take it), or None when
    the caller stored the rows already. A k of L columns without k_rope gives k_nope and no
    k_rope (the caller refuses to store it). Views only."""
    h, lat, r = d.num_heads, d.kv_lora_rank, d.qk_rope_head_dim
    q_rope, k_rope = kwargs.get("q_rope"), kwargs.get("k_rope")
    if q_rope is not None:
        q_nope, q_rope = q.view(-1, h, lat), q_rope.view(-1, h, r)
    else:
        q3 = q.view(-1, h, lat + r)
        q_nope, q_rope = q3[..., :lat], q3[..., lat:]
    if k is None:
        return q_nope, q_rope, None, None
    k2 = kv_rows(k)
    if k_rope is not None:
        return q_nope, q_rope, k2, kv_rows(k_rope)
    if k2.shape[-1] == lat + r:
        return q_nope, q_rope, k2[:, :lat], k2[:, lat:]
    return q_nope, q_rope, k2, None


def flat_heads(out: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> [T, H * D] where that is a view. Hazard: a backend that allocates its
    output like a strided q (SGLang's q_nope is a transposed bmm result) returns [T, H, D]
    with head-major memory; reshaping would copy it, so it is returned 3-D, which every
    SGLang caller accepts (they `.view(-1, H, D)` it: DeepSeek, the kit, the piecewise op)."""
    return out.view(out.shape[0], -1) if out.is_contiguous() else out


def kv_rows(k: torch.Tensor) -> torch.Tensor:
    """[T, 1, W] (one KV head) or [T, W] -> a [T, W] view, whatever the row stride."""
    return k[:, 0] if k.dim() == 3 else k
