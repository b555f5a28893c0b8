"""Kimi-Linear, the hybrid model (checked against transformers' KimiLinearForCausalLM): KDA
(Kimi Delta Attention) layers and NoPE MLA layers in a configured ratio (3 : 1 in Kimi-Linear)
or at named layers (`full_layers`: Kimi-Linear-48B's last layer, 27, is MLA too), on
`HybridBackend`.

- KDA layer: q / k / v projections, a causal depthwise short convolution (kernel 4, SiLU)
  with its state per request in the `LinearStatePool`, per-channel log-decay
  `g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)`, `beta = sigmoid(b(x))`, L2-normalised
  q / k, the gated delta rule, an output RMSNorm gated by `sigmoid(g_b(g_a(x)))`, o_proj.
- MLA layer: DeepSeek-V3's attention with no rotation (NoPE). The 64 "rope" columns are still
  cached and attended, unrotated, so every MLA kernel keeps its 576-wide row.
- MLP: dense, or from `first_k_dense_replace` on DeepSeek-V3's MoE (sigmoid scores, grouped
  top-k, shared experts), as Kimi-Linear-48B's (256 experts, top 8, one group).

Layers are told their id once; the router maps it to a pool index (no mutation).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from mla_backends.backends.hybrid import HybridBackend, ratio_kinds
from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.config import check_int
from mla_backends.models.deepseek_v3 import (
    MLP,
    DeepseekV3Config,
    MLAttention,
    MoE,
    RMSNorm,
)


@dataclass(frozen=True)
class KimiLinearConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 8
    linear_per_full: int = 3  # KDA layers per MLA layer
    kda_heads: int = 4
    kda_head_dim: int = 16
    conv_kernel: int = 4
    mla_heads: int = 4
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 16  # NoPE: cached and attended, never rotated
    v_head_dim: int = 16
    rms_norm_eps: float = 1e-6
    # the MLA layers' 1-based numbers (config.json's `full_attn_layers`); None: the ratio's
    full_layers: tuple[int, ...] | None = None
    # MoE (DeepSeek-V3's routing, Kimi-Linear's blocks from layer first_k_dense_replace on);
    # n_routed_experts 0: every MLP dense
    n_routed_experts: int = 0
    num_experts_per_tok: int = 1
    n_shared_experts: int = 1
    moe_intermediate_size: int = 1
    first_k_dense_replace: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        """Every field a usable value (ValueError naming it), so a bad config.json fails when
        the model is built, not as a TypeError inside a layer."""
        zero_ok = (
            "linear_per_full",
            "n_routed_experts",
            "n_shared_experts",
            "first_k_dense_replace",
        )
        for f in fields(self):
            if f.name not in (
                "rms_norm_eps",
                "full_layers",
                "routed_scaling_factor",
                "norm_topk_prob",
            ):
                check_int("", f.name, getattr(self, f.name), 0 if f.name in zero_ok else 1)
        n, full = self.num_hidden_layers, self.full_layers
        if full is not None:  # a list from Python: hashable and equal to the tuple form
            object.__setattr__(self, "full_layers", full := tuple(full))
        if full is not None and (
            len(set(full)) != len(full) or not all(type(i) is int and 1 <= i <= n for i in full)
        ):
            raise ValueError(f"full_layers must be distinct layer numbers in 1..{n}, got {full}")
        self.mla_config()  # the MLA layers' and the MoE's checks (rms_norm_eps, groups...)

    @property
    def kinds(self) -> list[str]:
        if self.full_layers is None:
            return ratio_kinds(self.num_hidden_layers, self.linear_per_full)
        full = set(self.full_layers)
        return ["full" if i + 1 in full else "linear" for i in range(self.num_hidden_layers)]

    def is_moe(self, layer_id: int) -> bool:
        return self.n_routed_experts > 0 and layer_id >= self.first_k_dense_replace

    def mla_config(self) -> DeepseekV3Config:
        """DeepSeek-V3's config for the MLA layers and the MoE blocks (their shared code)."""
        moe = self.n_routed_experts > 0
        return DeepseekV3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.mla_heads,
            q_lora_rank=None,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            n_routed_experts=max(self.n_routed_experts, 1),
            n_shared_experts=self.n_shared_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            n_group=self.n_group,
            topk_group=self.topk_group,
            routed_scaling_factor=self.routed_scaling_factor,
            norm_topk_prob=self.norm_topk_prob,
            first_k_dense_replace=self.first_k_dense_replace if moe else self.num_hidden_layers,
            rms_norm_eps=self.rms_norm_eps,
            rope_interleave=False,  # with cos = 1, sin = 0 the "rotation" is the identity
        )


def short_conv(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv of one request: x [T, C], weight [C, W], state [C, W - 1] (the
    previous W - 1 inputs) -> (silu(conv) [T, C], new state [C, W - 1])."""
    w = weight.shape[1]
    full = torch.cat([state.t().to(x.dtype), x], dim=0)  # [W - 1 + T, C]
    windows = full.unfold(0, w, 1)  # [T, C, W]
    out = F.silu((windows * weight.to(x.dtype)).sum(-1))
    return out, full[-(w - 1) :].t().float() if w > 1 else state


def short_conv_step(
    x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B requests: x [B, C], states [B, C, W - 1] -> (out [B, C],
    new states [B, C, W - 1]); `short_conv` with T = 1, batched."""
    full = torch.cat([states.to(x.dtype), x[:, :, None]], dim=2)  # [B, C, W]
    out = F.silu((full * weight.to(x.dtype)).sum(-1))
    return out, full[:, :, 1:].float()


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's (and HF's) q / k norm: eps inside the root, not F.normalize's floor on it."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


class KDALayer(nn.Module):
    def __init__(self, cfg: KimiLinearConfig, layer_id: int) -> None:
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        h, d, hid = cfg.kda_heads, cfg.kda_head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(hid, h * d, bias=False)
        self.k_proj = nn.Linear(hid, h * d, bias=False)
        self.v_proj = nn.Linear(hid, h * d, bias=False)
        self.conv_weight = nn.Parameter(torch.randn(3 * h * d, cfg.conv_kernel) * 0.3)
        self.f_a_proj = nn.Linear(hid, d, bias=False)
        self.f_b_proj = nn.Linear(d, h * d, bias=False)
        self.A_log = nn.Parameter(torch.zeros(h))
        self.dt_bias = nn.Parameter(torch.zeros(h * d))
        self.b_proj = nn.Linear(hid, h, bias=False)
        self.g_a_proj = nn.Linear(hid, d, bias=False)
        self.g_b_proj = nn.Linear(d, h * d, bias=False)
        self.o_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(h * d, hid, bias=False)

    def _conv(self, x: torch.Tensor, batch: ForwardBatch, backend: HybridBackend) -> torch.Tensor:
        """Short conv over each request's tokens, continuing from / updating its conv state."""
        st = backend.linear_state(self.layer_id)
        want = (self.conv_weight.shape[0], self.conv_weight.shape[1] - 1)
        if tuple(st.conv.shape[1:]) != want:  # else a shape error deep in the conv, rows marked
            raise ValueError(
                f"linear state pool: conv state [conv_dim, conv_kernel - 1] = "
                f"{list(st.conv.shape[1:])}, layer {self.layer_id} needs {list(want)}"
            )
        if batch.mode is ForwardMode.TARGET_VERIFY:  # T drafts each, the state kept aside
            b, t = batch.batch_size, batch.q_len
            rows = batch.req_pool_indices.long()
            win = torch.cat([st.conv[rows].to(x.dtype), x.view(b, t, x.shape[-1]).mT], dim=2)
            st.stage_verify_conv(win)  # [B, C, W - 1 + T]
            out = F.silu(
                (
                    win.unfold(2, self.conv_weight.shape[1], 1)
                    * self.conv_weight.to(x.dtype)[:, None]
                ).sum(-1)
            )
            return out.mT.reshape(b * t, x.shape[-1])  # b may be 0: no -1
        if batch.mode is ForwardMode.DECODE:  # all requests at once: no host loop, capturable
            rows = batch.req_pool_indices.long()
            out, state = short_conv_step(x, self.conv_weight, st.conv[rows])
            st.conv[rows] = state  # padded rows all write slot 0, the dummy
            return out
        out = torch.empty_like(x)
        start = 0
        prefix = batch.extend_prefix_lens_cpu.tolist()
        for row, n, p in zip(batch.rows_host, batch.extend_seq_lens_cpu.tolist(), prefix):
            s0 = st.conv[row] if p else torch.zeros_like(st.conv[row])  # a new request
            out[start : start + n], st.conv[row] = short_conv(
                x[start : start + n], self.conv_weight, s0
            )
            start += n
        return out

    def forward(self, x: torch.Tensor, batch: ForwardBatch, backend: HybridBackend) -> torch.Tensor:
        c, t = self.cfg, x.shape[0]
        h, d = c.kda_heads, c.kda_head_dim
        qkv = self._conv(
            torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1), batch, backend
        )
        q, k, v = (z.view(t, h, d) for z in qkv.split(h * d, dim=-1))
        q, k = l2norm(q.float()), l2norm(k.float())
        f = self.f_b_proj(self.f_a_proj(x)) + self.dt_bias
        g = -self.A_log.float().exp()[:, None] * F.softplus(f.float()).view(t, h, d)  # [T, H, K]
        beta = self.b_proj(x).float().sigmoid()
        o = backend.forward_linear(self.layer_id, q, k, v, g, beta)  # [T, H, V] fp32
        gate = self.g_b_proj(self.g_a_proj(x)).view(t, h, d).float().sigmoid()
        o = self.o_norm(o.to(x.dtype)) * gate.to(x.dtype)
        return self.o_proj(o.reshape(t, h * d))


class HybridLayer(nn.Module):
    def __init__(self, cfg: KimiLinearConfig, layer_id: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.attn = (
            KDALayer(cfg, layer_id)
            if kind == "linear"
            else MLAttention(cfg.mla_config(), layer_id, None)
        )
        self.mlp: nn.Module = (
            MoE(cfg.mla_config())
            if cfg.is_moe(layer_id)
            else MLP(cfg.hidden_size, cfg.intermediate_size)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        backend: HybridBackend,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        y = self.input_layernorm(x)
        if self.kind == "linear":
            y = self.attn(y, batch, backend)
        else:
            y = self.attn(y, cos, sin, batch, backend)
        x = x + y
        return x + self.mlp(self.post_attention_layernorm(x))


class KimiLinearForCausalLM(nn.Module):
    def __init__(self, cfg: KimiLinearConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(cfg, i, k) for i, k in enumerate(cfg.kinds))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.extra_tensors: list[str] = []  # checkpoint tensors the loader left unused

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, batch: ForwardBatch, backend: HybridBackend
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # NoPE: cos = 1, sin = 0 leaves the "rope" columns as they are (never rotated).
        half = self.cfg.qk_rope_head_dim // 2
        cos = torch.ones(x.shape[0], half, dtype=x.dtype, device=x.device)
        sin = torch.zeros_like(cos)
        for layer in self.layers:
            x = layer(x, batch, backend, cos, sin)
        return self.lm_head(self.norm(x)).float()
