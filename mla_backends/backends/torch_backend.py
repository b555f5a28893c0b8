"""The `torch` backend: plain PyTorch, fp32 math, any device, every mode, page size and KV dtype.

Absorbed attention gathers each request's rows into a padded [B, S, D] block (only the rows
the batch uses are read and dequantized, never the whole pool), so shapes depend only on
(B, max q_len, max kv_len): under CUDA graphs those maxima are the static ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from mla_backends.arith import cumsum_indptr
from mla_backends.backends.base import BackendCaps, GraphCapable
from mla_backends.backends.registry import register_backend
from mla_backends.batch import ForwardBatch, ForwardMode, RaggedLayout
from mla_backends.indices import segment_ids
from mla_backends.reference import absorbed, mha, softmax_with_lse


@dataclass
class TorchMetadata:
    token_b: torch.Tensor  # [T] int64, device: request index of each query token
    token_j: torch.Tensor  # [T] int64, device: index of the token among its request's queries
    kv_slots: torch.Tensor  # [B, S] int64, device: slot of key s of request b (stale past len)
    kv_valid: torch.Tensor  # [B, S] bool, device: s < seq_len[b]
    visible: torch.Tensor  # [B, Q] int64, device: keys query j of request b may see
    q_max: int  # host
    kv_max: int  # host


def build_torch_metadata(
    req_to_token: torch.Tensor, batch: ForwardBatch, q_max: int, kv_max: int
) -> TorchMetadata:
    """Pure function of the batch's device tensors and two host maxima: no sync."""
    dev = batch.seq_lens.device
    qo_indptr = cumsum_indptr(batch.extend_seq_lens)
    token_b, token_j = segment_ids(qo_indptr, batch.num_tokens)
    s = torch.arange(kv_max, device=dev, dtype=torch.int64)
    rows = batch.req_pool_indices.to(torch.int64)[:, None]
    kv_slots = req_to_token[rows, s[None, :]].to(torch.int64)
    seq = batch.seq_lens.to(torch.int64)[:, None]
    q_len = batch.extend_seq_lens.to(torch.int64)[:, None]
    j = torch.arange(q_max, device=dev, dtype=torch.int64)[None, :]
    visible = (seq - q_len + j + 1).clamp(min=0)
    visible = torch.minimum(visible, seq)
    return TorchMetadata(token_b, token_j, kv_slots, s[None, :] < seq, visible, q_max, kv_max)


@dataclass
class TorchGraphState:
    kv_max: int  # host: the longest context a graph may see (req_to_token's width)
    # per captured (batch, q_len): the metadata tensors that graph reads, refilled on replay
    captured: dict[tuple[int, int], TorchMetadata] = field(default_factory=dict)


@register_backend("torch")
class TorchBackend(GraphCapable[TorchMetadata, TorchGraphState]):
    name = "torch"
    caps = BackendCaps(graphs=True, cpu_native=True)

    # ------------------------------------------------------------------ metadata
    def _build_metadata(self, batch: ForwardBatch) -> TorchMetadata | None:
        if batch.mode is ForwardMode.EXTEND:
            return None  # the ragged path reads the batch's CPU lengths directly
        return build_torch_metadata(self.req_to_token, batch, batch.max_q_len, batch.max_kv_len)

    def _new_graph_state(self, max_bs: int, max_num_tokens: int) -> TorchGraphState:
        return TorchGraphState(kv_max=self.req_to_token.shape[1])

    def graph_refill_on_device(self, batch_size: int) -> bool:
        return True  # build_torch_metadata: device lengths and two capture-time maxima

    def _bind_graph(
        self, batch: ForwardBatch, state: TorchGraphState, capture: bool
    ) -> TorchMetadata:
        key = (batch.batch_size, batch.q_len)
        new = build_torch_metadata(self.req_to_token, batch, key[1], state.kv_max)
        if capture:  # the tensors built now are the ones the graph reads
            state.captured[key] = new
            return new
        static = state.captured.get(key)
        if static is None:
            raise RuntimeError(f"no graph captured for (batch, q_len) = {key}")
        for name in ("token_b", "token_j", "kv_slots", "kv_valid", "visible"):
            getattr(static, name).copy_(getattr(new, name))
        return static

    # ------------------------------------------------------------------ attention
    def _attend_absorbed(
        self, layer: int, q_nope: Tensor, q_rope: Tensor, batch: ForwardBatch, need_lse: bool
    ) -> tuple[Tensor, Tensor | None]:
        if batch.mode is ForwardMode.EXTEND:
            return self._attend_absorbed_ragged(layer, q_nope, q_rope, batch)
        md = self._require_metadata()
        b, lat = md.kv_slots.shape[0], self.dims.kv_lora_rank
        kv = self.pool.load_rows(layer, md.kv_slots)  # [B, S, D] fp32, only the rows used
        # Hazard: rows past a request's length may be NaN (stale or poisoned); a masked score
        # still gives 0 * NaN = NaN in P @ V, so zero them instead of only masking scores.
        kv = torch.where(md.kv_valid[..., None], kv, torch.zeros((), device=kv.device))
        q = torch.cat([q_nope, q_rope], dim=-1).float()
        qp = torch.zeros(b, md.q_max, *q.shape[1:], device=q.device, dtype=torch.float32)
        qp[md.token_b, md.token_j] = q
        scores = torch.einsum("bqhd,bsd->bhqs", qp, kv) * self.scale
        keys = torch.arange(md.kv_max, device=q.device)
        mask = keys[None, None, None, :] < md.visible[:, None, :, None]
        probs, lse = softmax_with_lse(scores, mask)  # lse [B, H, Q]
        out = torch.einsum("bhqs,bsl->bqhl", probs, kv[..., :lat])
        lse = lse.transpose(1, 2)[md.token_b, md.token_j]  # [T, H]
        return out[md.token_b, md.token_j].to(q_nope.dtype), lse

    def _attend_absorbed_ragged(
        self, layer: int, q_nope: torch.Tensor, q_rope: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """EXTEND (never graph-captured): one request at a time, sized by the CPU lengths, so
        a long prompt costs q_len x kv_len, not max_q x max_kv x batch."""
        t, h, lat = q_nope.shape
        out = torch.zeros_like(q_nope)
        lse = torch.full((t, h), float("-inf"), dtype=torch.float32, device=q_nope.device)
        rows = batch.rows_host  # host ints: a device row index synced per request per layer
        start = 0
        for b, (n, s) in enumerate(
            zip(batch.extend_seq_lens_cpu.tolist(), batch.seq_lens_cpu.tolist())
        ):
            if n and s:
                kv = self.pool.load_rows(layer, self.req_to_token[rows[b], :s])
                o, lse[start : start + n] = absorbed(
                    q_nope[start : start + n],
                    q_rope[start : start + n],
                    kv[:, :lat],
                    kv[:, lat:],
                    self.scale,
                    torch.float32,
                )
                out[start : start + n] = o.to(out.dtype)
            start += n
        return out, lse

    def _attend_mha(
        self, q: Tensor, k: Tensor, v: Tensor, layout: RaggedLayout, causal: bool, need_lse: bool
    ) -> tuple[Tensor, Tensor | None]:
        out = torch.zeros(*q.shape[:2], v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        qo, kvp = layout.qo_indptr_cpu.tolist(), layout.kv_indptr_cpu.tolist()
        for i in range(layout.batch_size):
            qs, qe, ks, ke = qo[i], qo[i + 1], kvp[i], kvp[i + 1]
            if qe == qs:
                continue
            o, lse[qs:qe] = mha(q[qs:qe], k[ks:ke], v[ks:ke], self.scale, causal, torch.float32)
            out[qs:qe] = o.to(q.dtype)
        return out, lse
