"""DeepSeek-V3.2 on the MLA backends: DeepSeek-V3 plus the lightning indexer and sparse MLA.

Per layer (`MLAttentionV32.forward`): the indexer's K of the new tokens is stored (always);
then, if the batch runs dense (`sparse.base.runs_dense`: every query sees <= index_topk keys),
the layer is DeepSeek-V3's on the dense backend; otherwise the indexer selects each token's
top-k pool slots and absorbed attention runs over them on the sparse backend. HF weight names:
`self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`.

The indexer is quantised (Hadamard + e4m3, as deployed) or not (`quantized_indexer=False`:
fp32, HF transformers' maths, for parity tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mla_backends.batch import ForwardBatch
from mla_backends.config import check_int
from mla_backends.models.deepseek_v3 import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MLAttention,
    apply_rope,
)
from mla_backends.sparse.dsa import DSABackend
from mla_backends.sparse.indexer import IndexerDims


@dataclass(frozen=True)
class DeepseekV32Config(DeepseekV3Config):
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    indexer_rope_interleave: bool = False  # GLM-5 sets True; V3.2 has no key (NeoX RoPE)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("index_n_heads", "index_head_dim", "index_topk"):
            check_int("", name, getattr(self, name), 1)
        self.indexer_dims()  # the indexer's own refusals, at load

    def indexer_dims(self, quantized: bool = True) -> IndexerDims:
        if self.indexer_rope_interleave:
            raise ValueError("indexer_rope_interleave=True (GLM-5) is not implemented")
        if not self.q_lora_rank:
            raise ValueError("DeepSeek-V3.2's indexer needs q_lora_rank")
        return IndexerDims(
            self.index_n_heads,
            self.index_head_dim,
            self.qk_rope_head_dim,
            self.index_topk,
            quantized,
        )


class IndexerWeights(nn.Module):
    def __init__(self, cfg: DeepseekV32Config) -> None:
        super().__init__()
        n, d = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = nn.Linear(int(cfg.q_lora_rank or 0), n * d, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, d, bias=False)
        self.k_norm = nn.LayerNorm(d, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, n, bias=False)

    def key(self, x: torch.Tensor) -> torch.Tensor:
        """k_norm(wk(x)) [T, D], the LayerNorm in fp32 (as the reference)."""
        k = self.wk(x)
        n = self.k_norm
        return F.layer_norm(
            k.float(), n.normalized_shape, n.weight.float(), n.bias.float(), n.eps
        ).to(k.dtype)

    def query(self, q_lora: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(wq_b(q_lora) [T, Hi, D], weights_proj(x) [T, Hi] fp32: the reference keeps this
        projection in fp32)."""
        q = self.wq_b(q_lora).view(x.shape[0], self.weights_proj.out_features, -1)
        return q, F.linear(x.float(), self.weights_proj.weight.float())


class MLAttentionV32(MLAttention):
    def __init__(
        self, cfg: DeepseekV32Config, layer_id: int, chunked_prefix_min: int | None
    ) -> None:
        super().__init__(cfg, layer_id, chunked_prefix_min)
        self.indexer = IndexerWeights(cfg)

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        backend: DSABackend,
    ) -> torch.Tensor:
        dsa = backend
        dsa.indexer.store(self.layer_id, self.indexer.key(x), cos, sin, batch.out_cache_loc)
        dense = dsa.use_dense()
        if dense and dsa.dense is not None:
            return super().forward(x, cos, sin, batch, dsa.dense)
        c, t = self.cfg, x.shape[0]
        h, p, lat = c.num_attention_heads, c.qk_nope_head_dim, c.kv_lora_rank
        q_lora = self.q_a_layernorm(self.q_a_proj(x))
        if dense:  # FP8 rows: the sparse backend over every visible key
            slots = dsa.dense_slots(batch)
            selected = lambda: slots  # noqa: E731
        else:  # on its own stream on a GPU, beside the projections below (DSABackend)
            query = lambda: self.indexer.query(q_lora, x)  # noqa: E731
            selected = dsa.begin_select(self.layer_id, query, cos, sin)
        q = self.q_b_proj(q_lora).view(t, h, -1)
        q_nope, q_pe = q[..., :p], apply_rope(q[..., p:], cos, sin, c.rope_interleave)
        kv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(kv[:, :lat])
        k_pe = apply_rope(kv[:, lat:], cos, sin, c.rope_interleave)
        dsa.sparse.store_kv(self.layer_id, batch.out_cache_loc, c_kv, k_pe)
        w_kc, w_vc = self.absorbed_weights()
        q_abs = torch.einsum("thp,hpl->thl", q_nope, w_kc)
        o_lat = dsa.sparse.forward_sparse(self.layer_id, q_abs, q_pe, selected(), batch)
        out = torch.einsum("thl,hlv->thv", o_lat, w_vc)
        return self.o_proj(out.reshape(t, -1))


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3's model with every attention replaced by `MLAttentionV32`; `forward`
    takes a `DSABackend`."""

    cfg: DeepseekV32Config

    def __init__(self, cfg: DeepseekV32Config, chunked_prefix_min: int | None = None) -> None:
        super().__init__(cfg, chunked_prefix_min)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = MLAttentionV32(cfg, i, chunked_prefix_min)

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, batch: ForwardBatch, backend: DSABackend
    ) -> torch.Tensor:
        """DeepSeek-V3's forward on a `DSABackend` whose indexer has this checkpoint's dims."""
        got = getattr(getattr(backend, "indexer", None), "dims", None)
        if not isinstance(got, IndexerDims):
            raise TypeError(
                f"DeepSeek-V3.2 runs on a DSABackend (DSABackend.build), got "
                f"{type(backend).__name__}"
            )
        want = self.cfg.indexer_dims(got.quantized)
        # Hazard: another index_topk selected other keys than the checkpoint's, silently.
        if got != want:
            raise ValueError(
                f"the DSA backend's indexer (index_n_heads {got.n_heads}, index_head_dim "
                f"{got.head_dim}, index_topk {got.topk}, rope {got.rope_dim}) is not the "
                f"model's ({want.n_heads}, {want.head_dim}, {want.topk}, {want.rope_dim}): "
                "build it with the config's indexer_dims()"
            )
        return super().forward(input_ids, batch, backend)


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> DeepseekV32ForCausalLM:
    """An HF-layout DeepSeek-V3.2 checkpoint (config.json + safetensors), through the loader
    every DeepSeek model shares (it reads `model_type`)."""
    from mla_backends.models.loader import CheckpointError
    from mla_backends.models.loader import load_model as load

    model = load(path, dtype, device)
    if not isinstance(model, DeepseekV32ForCausalLM):
        raise CheckpointError(f"{path}: config.json's model_type is not deepseek_v32")
    return model
