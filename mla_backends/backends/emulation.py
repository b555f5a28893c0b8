"""Plain-PyTorch emulations of the SM100 kernels' documented contracts, for tests on machines
without a Blackwell GPU. They take exactly the real call's arguments, reject what the real
call rejects (shapes, dtypes, page sizes, block-count alignment), and compute the documented
result from the paged cache, reading only the pages the table names for each row's length.

- `cutlass_mla_decode`: sgl_kernel 0.4.3 `cutlass_mla_decode` (python wrapper asserts
  mirrored line by line). Output only, no LSE.
- `trtllm_batch_decode_with_kv_cache_mla`: flashinfer 0.7.2.post1, trtllm-gen backend, dense
  MLA: scores are `q . k_stored * bmm1_scale`, output `softmax @ v_stored * bmm2_scale`, so
  FP8 scales are folded into the two BMM scales; causal bottom-right for q_len > 1.
"""

from __future__ import annotations

import torch

from mla_backends.arith import cdiv
from mla_backends.reference import causal_mask, softmax_with_lse


class KernelContractError(AssertionError):
    """The emulated kernel would have rejected this call."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise KernelContractError(msg)


def _attend_paged(
    q: torch.Tensor,
    kv: torch.Tensor,
    table: torch.Tensor,
    seq_len: int,
    lat: int,
    bmm1: torch.Tensor | float,
    bmm2: torch.Tensor | float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: q [n, H, 576] (fp32), kv [pages, page, 576], table [W] -> out, lse."""
    page = kv.shape[1]
    n_pages = cdiv(seq_len, page)
    rows = kv[table[:n_pages].long()].reshape(-1, kv.shape[-1])[:seq_len].float()
    scores = torch.einsum("nhd,sd->hns", q, rows) * bmm1
    probs, lse = softmax_with_lse(scores, causal_mask(q.shape[0], seq_len, q.device))
    out = torch.einsum("hns,sl->nhl", probs, rows[:, :lat]) * bmm2
    return out, lse.transpose(0, 1)


def cutlass_mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c_and_k_pe_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    workspace: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int = 1,
) -> torch.Tensor:
    _require(q_nope.ndim == 3 and q_pe.ndim == 3, "q_nope and q_pe must be 3D")
    _require(kv_c_and_k_pe_cache.ndim == 3, "kv_c_and_k_pe_cache must be a 3D tensor")
    b, h, d_nope = q_nope.shape
    _require(q_pe.shape[:2] == (b, h), "q_nope / q_pe batch or heads differ")
    _, page, d_ckv = kv_c_and_k_pe_cache.shape
    _require(d_nope == 512 and q_pe.shape[2] == 64 and d_ckv == 576, "dims must be 512/64/576")
    _require(h <= 128, f"H must be <= 128, got {h}")
    _require(page_table.ndim == 2 and page_table.shape[0] == b, "page_table must be [B, blocks]")
    _require(page_table.shape[1] > 0, "block num must be greater than 0")
    _require(page_table.shape[1] % (128 / page) == 0, f"block num % (128 / {page}) != 0")
    _require(
        q_nope.dtype in (torch.float16, torch.bfloat16), f"q dtype {q_nope.dtype} not fp16/bf16"
    )
    _require(q_nope.dtype == q_pe.dtype == kv_c_and_k_pe_cache.dtype, "q / kv dtypes differ")
    _require(seq_lens.dtype == torch.int32, f"seq_lens must be int32, got {seq_lens.dtype}")
    _require(page_table.dtype == torch.int32, f"page_table must be int32, got {page_table.dtype}")
    _require(workspace.numel() > 0, "workspace must be allocated")
    out = q_nope.new_empty(b, h, 512)
    q = torch.cat([q_nope, q_pe], -1).float()
    for i, s in enumerate(seq_lens.tolist()):
        o, _ = _attend_paged(
            q[i : i + 1], kv_c_and_k_pe_cache, page_table[i], s, 512, sm_scale, 1.0
        )
        out[i] = o[0].to(out.dtype)
    return out


def trtllm_batch_decode_with_kv_cache_mla(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    workspace_buffer: torch.Tensor,
    qk_nope_head_dim: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    bmm1_scale: float | torch.Tensor = 1.0,
    bmm2_scale: float | torch.Tensor = 1.0,
    return_lse: bool = False,
    return_lse_base: str | None = None,
    **unsupported: object,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    _require(not unsupported, f"emulation does not model {sorted(unsupported)}")
    _require(query.ndim == 4, "query must be [B, q_len, H, 576]")
    b, q_len, h, d = query.shape
    _require((kv_lora_rank, qk_rope_head_dim) == (512, 64) and d == 576, "MLA dims 512 + 64")
    if kv_cache.ndim == 4:
        _require(kv_cache.shape[1] == 1, "4D kv_cache must be [pages, 1, page, 576]")
        kv_cache = kv_cache[:, 0]
    _require(kv_cache.ndim == 3 and kv_cache.shape[-1] == 576, "kv_cache [pages, page, 576]")
    page = kv_cache.shape[1]
    _require(page in (32, 64), f"trtllm-gen MLA takes page size 32 or 64, got {page}")
    _require(query.dtype in (torch.bfloat16, torch.float8_e4m3fn), f"query dtype {query.dtype}")
    _require(query.dtype == kv_cache.dtype, "query and kv_cache must share a dtype")
    _require(block_tables.dtype == torch.int32 and block_tables.shape[0] == b, "block_tables")
    _require(block_tables.shape[1] % (128 // page) == 0, f"blocks % (128 / {page}) != 0")
    _require(seq_lens.dtype == torch.int32 and seq_lens.shape == (b,), "seq_lens [B] int32")
    _require(workspace_buffer.dtype == torch.uint8, "workspace must be uint8 bytes")
    _require(int(workspace_buffer.count_nonzero()) == 0, "workspace must be zero-initialized")
    _require(return_lse_base in (None, "basee", "base2"), "return_lse_base")
    lens = seq_lens.tolist()
    _require(max(lens, default=0) <= max_seq_len, "a seq_len exceeds max_seq_len")
    out = torch.empty(
        b,
        q_len,
        h,
        512,
        dtype=torch.bfloat16 if query.element_size() == 1 else query.dtype,
        device=query.device,
    )
    lse = torch.empty(b * q_len, h, dtype=torch.float32, device=query.device)
    for i, s in enumerate(lens):
        o, l_i = _attend_paged(
            query[i].float(), kv_cache, block_tables[i], s, 512, bmm1_scale, bmm2_scale
        )
        out[i] = o.to(out.dtype)
        lse[i * q_len : (i + 1) * q_len] = l_i
    if not return_lse:
        return out
    if return_lse_base != "basee":  # trtllm-gen's historical default is base 2
        lse = lse * 1.4426950408889634
    return out, lse
