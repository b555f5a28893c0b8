"""Plain-PyTorch emulations of the sparse kernels' documented contracts, so the `flashmla`
and `flashinfer_mla` sparse backends' host logic (head padding, index padding and remapping,
the FP8 row view, compaction, CSR gathers, plan / run order, LSE conventions, empty rows,
graph replay hooks) is tested on machines without an SM90 GPU. Each takes the real call's
arguments, rejects what the real call rejects, and computes the documented result.

- `FlashMLAEmulation`: sgl_kernel 0.4.3 `sgl_kernel.flash_mla` (`get_mla_metadata`,
  `flash_mla_with_kvcache` sparse FP8 decode, `flash_mla_sparse_fwd`). Decode: only -1 is
  unused, any other index must lie in the cache (the GPU would read it), natural-log LSE,
  +inf and out 0 for a row with no index, scales read as bf16. Prefill: i < 0 or i >= s_kv
  unused, topk % 128, LSE natural log / +inf (`prefill_lse="e"`) or, as FlashMLA before
  082094b, base 2 / -inf (`"2"`).
- `FaMLAEmulation`: the fa3 MLA kernel of `backends/flashinfer_mla.py` (`plan` / `run`),
  page size 1 CSR: `plan` fills the one workspace that `run` reads; rows with kv_len 0 are
  left undefined (NaN here), as FlashInfer leaves them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mla_backends.backends.emulation import _require
from mla_backends.backends.flashinfer_kernel import FaPlan
from mla_backends.sparse.fp8_row import TILE, Fp8RowFormat, unpack_rows


def _attend(
    q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, D], rows [T, K, D], valid [T, K] -> (out [T, H, d_v], max logit, lse) fp32."""
    rows = torch.where(valid[..., None], rows.float(), torch.zeros((), device=rows.device))
    s = torch.einsum("thd,tkd->thk", q.float(), rows) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("thk,tkd->thd", p, rows[..., :d_v]), s.amax(-1), lse


class FlashMLAEmulation:
    def __init__(self, prefill_lse: str = "e") -> None:
        _require(prefill_lse in ("e", "2"), f"prefill_lse must be 'e' or '2', got {prefill_lse}")
        self.prefill_lse = prefill_lse
        self.decode_calls = self.prefill_calls = 0

    def get_mla_metadata(
        self,
        cache_seqlens: torch.Tensor | None = None,
        num_q_tokens_per_head_k: int | None = None,
        num_heads_k: int | None = None,
        num_heads_q: int | None = None,
        is_fp8_kvcache: bool = False,
        topk: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _require(cache_seqlens is not None, "the legacy metadata API needs cache_seqlens")
        assert cache_seqlens is not None
        _require(cache_seqlens.dtype == torch.int32 and cache_seqlens.dim() == 1, "seqlens int32")
        _require(num_heads_k == 1, "MLA has one KV head")
        _require(num_q_tokens_per_head_k == num_heads_q, "s_q = 1 per request: rows = h_q")
        _require(is_fp8_kvcache and topk is not None, "sparse decode metadata: FP8, with topk")
        b = cache_seqlens.numel()
        dev = cache_seqlens.device
        return torch.zeros(8, 8, dtype=torch.int32, device=dev), torch.zeros(
            b + 1, dtype=torch.int32, device=dev
        )

    def flash_mla_with_kvcache(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        block_table: torch.Tensor | None,
        cache_seqlens: torch.Tensor | None,
        head_dim_v: int,
        tile_scheduler_metadata: torch.Tensor,
        num_splits: torch.Tensor | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        is_fp8_kvcache: bool = False,
        indices: torch.Tensor | None = None,
        **unused: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _require(not any(v is not None for v in unused.values()), f"unsupported {unused}")
        _require(num_splits is not None and block_table is not None, "legacy path asserts")
        _require(cache_seqlens is not None, "legacy path asserts cache_seqlens")
        _require(indices is not None and is_fp8_kvcache, "sparse decode: FP8 cache + indices")
        _require(not causal, "causal must be False with indices")
        _require(softmax_scale is not None, "pass the softmax scale (the default is 576 ** -0.5)")
        assert indices is not None and softmax_scale is not None
        b, s_q, h_q, d = q.shape
        _require(q.dtype == torch.bfloat16 and d == 576, "q bf16 [B, s_q, h_q, 576]")
        _require(h_q in (64, 128), f"Unsupported h_q {h_q}")
        _require(k_cache.dtype == torch.float8_e4m3fn, "k_cache float8_e4m3fn")
        _require(k_cache.dim() == 4 and k_cache.shape[1:3] == (64, 1), "k_cache [n, 64, 1, 656]")
        _require(k_cache.stride(1) == 656, f"kv.stride(1) must be 656, got {k_cache.stride(1)}")
        _require(indices.dtype == torch.int32 and indices.shape[:2] == (b, s_q), "indices")
        topk = indices.shape[-1]
        _require(topk % 64 == 0, f"topk % 64 != 0: {topk}")
        rows_all = k_cache.view(torch.uint8).reshape(-1, 656)
        idx = indices.reshape(b * s_q, topk).long()
        _require(bool((idx >= -1).all()), "indices below -1 are read as memory on the GPU")
        _require(bool((idx < rows_all.shape[0]).all()), "index past the cache: illegal access")
        valid = idx >= 0
        codes, scales, rope = unpack_rows(Fp8RowFormat(), rows_all[idx.clamp(min=0).reshape(-1)])
        # The SM90 kernel reads the fp32 scales as bf16.
        scales = scales.bfloat16().float()
        lat = (codes.float().view(-1, 4, TILE) * scales[..., None]).reshape(-1, 512)
        rows = torch.cat([lat, rope.float()], -1).view(b * s_q, topk, 576)
        out, _, lse = _attend(q.reshape(b * s_q, h_q, d), rows, valid, softmax_scale, head_dim_v)
        lse = lse.masked_fill(~valid.any(-1)[:, None], float("inf"))
        self.decode_calls += 1
        out = out.to(torch.bfloat16).view(b, s_q, h_q, head_dim_v)
        return out, lse.view(b, s_q, h_q).transpose(1, 2).contiguous()

    def flash_mla_sparse_fwd(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        indices: torch.Tensor,
        sm_scale: float,
        d_v: int = 512,
        attn_sink: torch.Tensor | None = None,
        topk_length: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _require(attn_sink is None and topk_length is None, "not used here")
        s_q, h_q, d = q.shape
        _require(q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16, "q, kv bfloat16")
        _require(d == 576 and kv.dim() == 3 and kv.shape[1:] == (1, 576), "kv [s_kv, 1, 576]")
        _require(h_q in (64, 128), f"Unsupported h_q {h_q}")
        _require(d_v == 512, "d_v must be 512")
        _require(indices.dtype == torch.int32 and indices.shape[:2] == (s_q, 1), "indices")
        topk = indices.shape[-1]
        _require(topk % 128 == 0, f"SM90 sparse prefill needs topk % 128 == 0, got {topk}")
        idx = indices[:, 0].long()
        valid = (idx >= 0) & (idx < kv.shape[0])
        rows = kv[:, 0][idx.clamp(0, kv.shape[0] - 1)]
        out, max_logits, lse = _attend(q, rows, valid, sm_scale, d_v)
        empty = ~valid.any(-1)[:, None]
        if self.prefill_lse == "e":
            lse = lse.masked_fill(empty, float("inf"))
        else:
            lse = (lse / math.log(2)).masked_fill(empty, float("-inf"))
        self.prefill_calls += 1
        return out.to(torch.bfloat16), max_logits, lse


@dataclass
class _Plan:
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    num_heads: int
    causal: bool


class FaMLAEmulation:
    def __init__(
        self, device: torch.device, q_dtype: torch.dtype, kv_dtype: torch.dtype, lat: int, rope: int
    ) -> None:
        _require((lat, rope) == (512, 64), "fa3 MLA is built for 512 + 64")
        _require(q_dtype in (torch.bfloat16, torch.float16), "q bf16 / fp16")
        _require(kv_dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn), "kv dtype")
        self.q_dtype, self.kv_dtype = q_dtype, kv_dtype
        self.workspace: _Plan | None = None
        self.plans = self.runs = 0

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_lens: torch.Tensor,
        num_heads: int,
        head_dim: int,
        causal: bool,
    ) -> tuple[int, ...]:
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_lens", kv_lens)):
            _require(t.device.type == "cpu" and t.dtype == torch.int32, f"{name}: int32 on CPU")
        _require(qo_indptr.numel() == kv_indptr.numel() == kv_lens.numel() + 1, "lengths")
        _require(torch.equal(kv_indptr[1:] - kv_indptr[:-1], kv_lens), "page size 1: pages = lens")
        _require(head_dim == 512, "head_dim_ckv 512")
        self.workspace = _Plan(qo_indptr.clone(), kv_indptr.clone(), num_heads, causal)
        self.plans += 1
        return (132, num_heads, head_dim)  # the grid: independent of the lengths

    def run(
        self,
        plan: FaPlan,
        q: tuple[torch.Tensor, torch.Tensor],
        kv_rows: tuple[torch.Tensor, torch.Tensor],
        out: torch.Tensor,
        lse: torch.Tensor | None,
        kv_scale: float,
    ) -> None:
        ws = self.workspace
        _require(ws is not None, "run before plan")
        assert ws is not None
        (q_nope, q_pe), (ckv, kpe), kv_indices = q, kv_rows, plan.kv_indices
        _require(lse is not None, "the sparse backend always asks for the LSE")
        assert lse is not None
        _require(plan.page_size == 1 and ckv.shape[1] == 1 and kpe.shape[1] == 1, "page size 1")
        _require(plan.causal == ws.causal and q_nope.shape[1] == ws.num_heads, "plan mismatch")
        _require(q_nope.dtype == self.q_dtype and ckv.dtype == self.kv_dtype, "dtypes")
        n = ws.qo_indptr.numel() - 1
        _require(q_nope.shape[0] == int(ws.qo_indptr[-1]), "q rows != the plan's")
        total = int(ws.kv_indptr[-1])
        _require(kv_indices.dtype == torch.int32 and kv_indices.numel() >= total, "indices")
        used = kv_indices[:total].long()
        _require(bool(((used >= 0) & (used < ckv.shape[0])).all()), "a page id out of the cache")
        kv = torch.cat([ckv[:, 0].float(), kpe[:, 0].float()], -1) * kv_scale
        qf = torch.cat([q_nope, q_pe], -1).float()
        for i in range(n):
            qs, qe = int(ws.qo_indptr[i]), int(ws.qo_indptr[i + 1])
            ks, ke = int(ws.kv_indptr[i]), int(ws.kv_indptr[i + 1])
            if ke == ks:  # undefined in FlashInfer
                out[qs:qe] = float("nan")
                lse[qs:qe] = float("nan")
                continue
            rows = kv[used[ks:ke]][None].expand(qe - qs, -1, -1)
            valid = torch.ones(rows.shape[:2], dtype=torch.bool)
            o, _, l_ = _attend(qf[qs:qe], rows, valid, plan.sm_scale, 512)
            out[qs:qe], lse[qs:qe] = o.to(out.dtype), l_
        self.runs += 1
