"""Plain-PyTorch references, fp64 by default, one request at a time.

Index names: n query tokens, s keys, h heads, p nope dim, r rope dim, l latent dim, v value dim.

- `mha_expanded`: the oracle. The cached latent is expanded through `kv_b_proj` (w_kc, w_vc)
  into per-head K [s, h, p + r] and V [s, h, v]; plain softmax attention.
- `absorbed`: attention in latent space, q_nope folded into w_kc; out [n, h, l].
  `project_v(absorbed(...)) == mha_expanded(...)`, and it is the oracle for every kernel.

Both: bottom-right causal (query j of n sees s - n + j + 1 keys), zero visible keys gives
out = 0 and lse = -inf, LSE in natural log.
(`backends/reference_backend.py` puts them behind the backend interface.)
"""

from __future__ import annotations

import torch

from mla_backends.batch import ForwardBatch
from mla_backends.pool import MLATokenToKVPool


def causal_mask(n: int, s: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[n, s] bool, True where query j may see key k (bottom-right: k <= s - n + j)."""
    j = torch.arange(n, device=device)[:, None]
    k = torch.arange(s, device=device)[None, :]
    return k <= s - n + j


def softmax_with_lse(scores: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [..., s] -> (probs [..., s], lse [...]); rows with no visible key give
    probs 0 and lse -inf (never NaN)."""
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    probs = torch.nan_to_num(probs, nan=0.0)  # -inf - -inf on empty rows
    return probs, lse


def mha(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = True,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, h, d], k [s, h, d], v [s, h, v] -> (out [n, h, v], lse [n, h])."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    scores = torch.einsum("nhd,shd->hns", q, k) * scale
    n, s = q.shape[0], k.shape[0]
    mask = causal_mask(n, s, q.device) if causal else torch.ones(n, s, dtype=torch.bool)
    probs, lse = softmax_with_lse(scores, mask.to(q.device))
    return torch.einsum("hns,shv->nhv", probs, v), lse.transpose(0, 1)


def mha_expanded(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    w_kc: torch.Tensor,
    w_vc: torch.Tensor,
    scale: float,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_nope [n, h, p], q_rope [n, h, r], latent [s, l], k_rope [s, r], w_kc [h, p, l],
    w_vc [h, l, v] -> (out [n, h, v], lse [n, h]); causal bottom-right."""
    latent, w_kc, w_vc = latent.to(dtype), w_kc.to(dtype), w_vc.to(dtype)
    h = q_nope.shape[1]
    k_nope = torch.einsum("sl,hpl->shp", latent, w_kc)
    k_pe = k_rope.to(dtype)[:, None, :].expand(-1, h, -1)
    k = torch.cat([k_nope, k_pe], dim=-1)
    v = torch.einsum("sl,hlv->shv", latent, w_vc)
    q = torch.cat([q_nope.to(dtype), q_rope.to(dtype)], dim=-1)
    return mha(q, k, v, scale, causal=True, dtype=dtype)


def absorbed(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    scale: float,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_latent [n, h, l], q_rope [n, h, r], latent [s, l], k_rope [s, r]
    -> (out_latent [n, h, l], lse [n, h]); causal bottom-right."""
    q_latent, q_rope = q_latent.to(dtype), q_rope.to(dtype)
    latent, k_rope = latent.to(dtype), k_rope.to(dtype)
    scores = (
        torch.einsum("nhl,sl->hns", q_latent, latent) + torch.einsum("nhr,sr->hns", q_rope, k_rope)
    ) * scale
    mask = causal_mask(q_latent.shape[0], latent.shape[0], latent.device)
    probs, lse = softmax_with_lse(scores, mask)
    return torch.einsum("hns,sl->nhl", probs, latent), lse.transpose(0, 1)


def absorb_q(q_nope: torch.Tensor, w_kc: torch.Tensor) -> torch.Tensor:
    """q_nope [n, h, p] @ w_kc [h, p, l] -> q_latent [n, h, l]."""
    return torch.einsum("nhp,hpl->nhl", q_nope, w_kc.to(q_nope.dtype))


def project_v(o_latent: torch.Tensor, w_vc: torch.Tensor) -> torch.Tensor:
    """o_latent [n, h, l] @ w_vc [h, l, v] -> [n, h, v]."""
    return torch.einsum("nhl,hlv->nhv", o_latent, w_vc.to(o_latent.dtype))


def request_kv(
    pool: MLATokenToKVPool, layer: int, req_to_token: torch.Tensor, row: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached (latent [s, l], k_rope [s, r]) of one request, dequantized to fp32."""
    slots = req_to_token[row, :length]
    rows = pool.load_rows(layer, slots)
    return rows[:, : pool.kv_lora_rank], rows[:, pool.kv_lora_rank :]


def batch_reference(
    pool: MLATokenToKVPool,
    layer: int,
    req_to_token: torch.Tensor,
    batch: ForwardBatch,
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    w_kc: torch.Tensor | None,
    w_vc: torch.Tensor | None,
    scale: float,
    expanded: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference over a whole batch whose new rows are already in the pool. It reads the
    keys from the pool, as the backends do: it checks attention, not what was stored where
    (to check stores, slots and page reuse, keep your own rows and call `absorbed` /
    `mha_expanded`).

    expanded=True: q_nope [T, h, p] -> (out [T, h, v], lse [T, h]) via `mha_expanded`.
    expanded=False: q_nope is q_latent [T, h, l] -> (out [T, h, l], lse) via `absorbed`."""
    outs, lses, start = [], [], 0
    rows = batch.rows_host
    for b, (n, s) in enumerate(
        zip(batch.extend_seq_lens_cpu.tolist(), batch.seq_lens_cpu.tolist())
    ):
        latent, k_rope = request_kv(pool, layer, req_to_token, rows[b], s)
        dev = latent.device
        qn, qr = q_nope[start : start + n].to(dev), q_rope[start : start + n].to(dev)
        if expanded:
            if w_kc is None or w_vc is None:
                raise ValueError("the expanded reference needs w_kc and w_vc")
            o, lse = mha_expanded(qn, qr, latent, k_rope, w_kc.to(dev), w_vc.to(dev), scale)
        else:
            o, lse = absorbed(qn, qr, latent, k_rope, scale)
        outs.append(o)
        lses.append(lse)
        start += n
    return torch.cat(outs), torch.cat(lses)
