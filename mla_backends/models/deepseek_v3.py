"""DeepSeek-V3 on the MLA backends. The maths of `inference/model.py`, the weight names of the
HF checkpoint, attention through one backend object and nothing else.

Token-major throughout: hidden [T, D] for all tokens of a ForwardBatch. Attention:
- EXTEND without a cached prefix: MHA mode (c_kv expanded through kv_b_proj), rows stored;
- EXTEND over a prefix of >= `chunked_prefix_min` tokens: MHA over the prefix and over the new
  tokens, merged by LSE;
- otherwise (decode, verify, extend over a shorter prefix): absorbed, q_nope folded into
  w_kc, the latent output projected through w_vc.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from mla_backends.backends.protocol import AttentionBackend
from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.config import MLADims, check_int
from mla_backends.merge import merge_states

C = TypeVar("C", bound="DeepseekV3Config")


@dataclass(frozen=True)
class DeepseekV3Config:
    """The fields of an HF `config.json` this model reads (others are ignored)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    first_k_dense_replace: int
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # yarn: factor, mscale, ...
    rope_interleave: bool = True
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls: type[C], raw: dict[str, Any]) -> C:
        raw = dict(raw)
        # transformers >= 5 writes `rope_parameters`; checkpoints carry `rope_scaling`.
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ValueError(f"rope_scaling must be an object or null, got {rope!r}")
        raw["rope_theta"] = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        # Hazard: any other scaling (linear, dynamic, llama3...) was dropped, and positions
        # past the first rotated unscaled: logits unlike HF's, with no error.
        if kind not in ("default", "yarn"):
            raise ValueError(f"rope_scaling type {kind!r} is not supported (yarn or none)")
        raw["rope_scaling"] = dict(rope) if kind == "yarn" else {}
        ignored = not_computed(raw)
        if ignored:
            raise ValueError(f"config.json asks for {ignored}, which this model does not compute")
        # Hazard: the gate routes as DeepSeek-V3 does; V2's softmax / greedy routing was taken
        # and failed later on a missing tensor, or routed otherwise than the checkpoint's
        routing = raw.get("scoring_func", "sigmoid"), raw.get("topk_method", "noaux_tc")
        if routing != ("sigmoid", "noaux_tc"):
            raise ValueError(
                f"MoE routing scoring_func={routing[0]!r}, topk_method={routing[1]!r} is not "
                "supported (DeepSeek-V3's: sigmoid, noaux_tc)"
            )
        names = {f.name for f in fields(cls)}
        missing = sorted(n for n in names if n not in raw and f_default_missing(cls, n))
        if missing:
            raise ValueError(f"config.json lacks {missing}")
        return cls(**{k: v for k, v in raw.items() if k in names})

    def __post_init__(self) -> None:
        """Every field a usable value (ValueError naming it: `load_model` makes that one line
        naming config.json), so a bad config fails here, not inside a layer."""
        positive = [
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok",
            "n_group", "topk_group",
        ]  # fmt: skip
        for name in positive:
            check_int("", name, getattr(self, name), 1)
        for name in ("n_shared_experts", "first_k_dense_replace"):
            check_int("", name, getattr(self, name), 0)
        if self.q_lora_rank is not None:
            check_int("", "q_lora_rank", self.q_lora_rank, 1)
        for name in ("norm_topk_prob", "rope_interleave", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):  # "false" would read as true
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        for name in ("routed_scaling_factor", "rms_norm_eps", "rope_theta"):
            _positive_number(name, getattr(self, name))
        e, g = self.n_routed_experts, self.n_group
        if self.first_k_dense_replace < self.num_hidden_layers:  # MoE layers exist
            if e % g or e // g < 2:  # the gate scores a group by its top two experts
                raise ValueError(
                    f"n_routed_experts ({e}) must split into n_group ({g}) groups of >= 2"
                )
            if not 1 <= self.topk_group <= g:
                raise ValueError(f"topk_group ({self.topk_group}) must be in 1..n_group ({g})")
            if self.num_experts_per_tok > self.topk_group * (e // g):
                raise ValueError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) must fit in topk_group "
                    f"({self.topk_group}) of n_group ({g}) groups of {e // g} experts"
                )
        if self.rope_scaling:  # yarn
            rs = self.rope_scaling
            for key in ("factor", "original_max_position_embeddings"):
                if key not in rs:
                    raise ValueError(f"rope_scaling (yarn) lacks {key!r}")
            _positive_number("rope_scaling.factor", rs["factor"])
            orig = rs["original_max_position_embeddings"]
            check_int("rope_scaling.", "original_max_position_embeddings", orig, 1)

    def mlp_parameters(self) -> int:
        """Parameters of the embedding, the LM head and the MLPs (the bulk of a checkpoint;
        attention and norms left out): a floor on the model's size, from the config alone."""
        h, moe = self.hidden_size, max(self.num_hidden_layers - self.first_k_dense_replace, 0)
        experts = self.n_routed_experts + self.n_shared_experts
        mlp = (self.num_hidden_layers - moe) * self.intermediate_size
        mlp += moe * experts * self.moe_intermediate_size
        return 2 * self.vocab_size * h + 3 * h * mlp

    @property
    def attention_dims(self) -> MLADims:
        rs = self.rope_scaling
        return MLADims(
            num_heads=self.num_attention_heads,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            qk_nope_head_dim=self.qk_nope_head_dim,
            v_head_dim=self.v_head_dim,
            rope_scaling_factor=float(rs.get("factor", 1.0)),
            mscale_all_dim=float(rs.get("mscale_all_dim", 0.0) or 0.0),
        )


def not_computed(raw: dict[str, Any]) -> str | None:
    """A config.json field that changes the maths and this model (and Kimi-Linear's) would
    ignore, or None. Hazard: each was dropped with no error (attention biases 0.99 off, a
    GELU MLP 0.62, YaRN's attention_factor 1.22, its truncate false up to 50 % on inv_freq)."""
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        return "biases on the projections (attention_bias / mlp_bias true)"
    if raw.get("hidden_act", "silu") != "silu":
        return f"hidden_act {raw['hidden_act']!r} (the MLP computes silu)"
    rope = raw.get("rope_scaling") or {}
    if rope.get("attention_factor") is not None:
        return "rope_scaling.attention_factor (cos / sin scaled by it)"
    if rope.get("truncate", True) is not True:
        return "rope_scaling.truncate false (YaRN's correction range not rounded)"
    return None


def _positive_number(name: str, value: Any) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def f_default_missing(cls: type, name: str) -> bool:
    from dataclasses import MISSING

    f = next(f for f in fields(cls) if f.name == name)
    return f.default is MISSING and f.default_factory is MISSING


# ---------------------------------------------------------------------------- RoPE (YaRN)
def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_tables(cfg: DeepseekV3Config) -> tuple[torch.Tensor, float]:
    """(inv_freq [R / 2], cos/sin scaling): YaRN as DeepSeek's reference computes it."""
    dim, base, rs = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if not rs:
        return freqs, 1.0
    factor, orig = float(rs["factor"]), rs["original_max_position_embeddings"]

    def corr(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(rs.get("beta_fast", 32))), 0)
    high = min(math.ceil(corr(rs.get("beta_slow", 1))), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / max(high - low, 0.001)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv_freq = freqs / factor * (1 - extrapolate) + freqs * extrapolate
    m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
    scale = _mscale(factor, m) / _mscale(factor, m_all) if m and m_all else _mscale(factor)
    return inv_freq, scale


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> torch.Tensor:
    """x [T, ..., R]; cos / sin [T, R / 2]. Interleaved checkpoints pair (x0, x1), (x2, x3)...
    and, like HF, write the result half-split: [rotated evens | rotated odds]."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# ---------------------------------------------------------------------------- blocks
# q_a_layernorm / kv_a_layernorm: RMSNorm's default eps in HF (DeepSeek-V2/V3/V3.2,
# Kimi-Linear) and DeepSeek's reference, whatever `rms_norm_eps` says. Hazard: SGLang reads
# the config's; at Kimi-Linear's 1e-5 that moves logits ~1.7e-5 off the reference.
LATENT_NORM_EPS = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, dim: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=False)
        self.up_proj = nn.Linear(dim, inter, bias=False)
        self.down_proj = nn.Linear(inter, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class KeepsFP32(nn.Module):
    """A module whose own parameters and buffers stay at least fp32 through `model.to(bf16)`
    and `.half()` (their device still follows), as HF keeps them. Hazard: cast with the rest,
    RoPE's `inv_freq` was rounded to bf16 (0.4 %: a query and key 4k positions apart rotated
    3.5 rad wrong at DeepSeek's dims) and the routing bias and gate to bf16 (0.5-5 % of
    tokens routed to other experts). `loader.load_weights` reads their tensors in fp32."""

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        own = [*self._parameters.items(), *self._buffers.items()]
        before = {n: t.data for n, t in own if t is not None and t.is_floating_point()}
        out = super()._apply(fn, recurse)
        for name, t in before.items():
            param = self._parameters.get(name)
            now = self._buffers[name] if param is None else param
            if now is None or now.dtype.itemsize >= 4:
                continue
            kept = t.to(device=now.device, dtype=torch.float32)  # from the value before the cast
            if param is None:
                self._buffers[name] = kept
            else:
                param.data = kept
        return out


def keeps_fp32(model: nn.Module) -> set[str]:
    """State-dict names of the tensors `KeepsFP32` modules hold (the loaders keep them fp32)."""
    return {
        f"{prefix}.{n}" if prefix else n
        for prefix, m in model.named_modules()
        if isinstance(m, KeepsFP32)
        for n, _ in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]
    }


class Gate(KeepsFP32):
    """Sigmoid scores, grouped top-k on bias-corrected scores, weights from raw scores."""

    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))
        # `run`'s hook: maps this call's chosen experts [T, k] to the ones used (records them,
        # or substitutes another run's); None in serving.
        self.routes: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        groups = choice.view(x.shape[0], c.n_group, -1).topk(2, dim=-1)[0].sum(-1)  # [T, G]
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(c.topk_group, dim=-1)[1], 1.0)
        choice = choice.masked_fill(
            ~keep.bool().repeat_interleave(c.n_routed_experts // c.n_group, 1), float("-inf")
        )
        idx = choice.topk(c.num_experts_per_tok, dim=-1)[1]  # [T, k]
        if self.routes is not None:
            idx = self.routes(idx)
        w = scores.gather(1, idx)
        if c.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * c.routed_scaling_factor, idx


class MoE(nn.Module):
    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__()
        self.gate = Gate(cfg)
        self.experts = nn.ModuleList(
            MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.n_routed_experts)
        )
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = self.gate(x)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self._dense(x, w, idx) + self.shared_experts(x)
        out = torch.zeros_like(x)
        # Host loop over the experts hit (reference MoE, not a grouped GEMM). Hazard: the
        # `.tolist()` is a device sync, so CUDA-graph capture takes `_dense` instead.
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            out.index_add_(0, tok, (self.experts[e](x[tok]) * w[tok, slot, None]).to(x.dtype))
        return out + self.shared_experts(x)

    def _dense(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by the routing (0 where not chosen): no
        data-dependent shapes, so it captures; costs E / k times the routed FLOPs."""
        dense = torch.zeros(x.shape[0], len(self.experts), dtype=w.dtype, device=x.device)
        dense.scatter_(1, idx, w)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, expert in enumerate(self.experts):
            out += expert(x).float() * dense[:, e : e + 1]
        return out.to(x.dtype)


class MLAttention(nn.Module):
    def __init__(
        self, cfg: DeepseekV3Config, layer_id: int, chunked_prefix_min: int | None
    ) -> None:
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        # EXTEND over a cached prefix of at least this many tokens runs MHA mode in two
        # parts (prefix, new tokens) merged by LSE; shorter prefixes use absorbed attention.
        self.chunked_prefix_min = chunked_prefix_min
        h, p, r, v = (
            cfg.num_attention_heads,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        qk = p + r
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * qk, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + r, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (p + v), bias=False)
        self.o_proj = nn.Linear(h * v, cfg.hidden_size, bias=False)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj [H * (P + V), L] -> w_kc [H, P, L], w_vc [H, L, V] (views, no copies)."""
        c = self.cfg
        w = self.kv_b_proj.weight.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim :].transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        c, t = self.cfg, x.shape[0]
        h, p, lat = c.num_attention_heads, c.qk_nope_head_dim, c.kv_lora_rank
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if c.q_lora_rank else self.q_proj(x)
        q = q.view(t, h, -1)
        q_nope, q_pe = q[..., :p], apply_rope(q[..., p:], cos, sin, c.rope_interleave)
        kv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(kv[:, :lat])
        k_pe = apply_rope(kv[:, lat:], cos, sin, c.rope_interleave)
        if batch.mode is ForwardMode.EXTEND and not batch.has_prefix:
            backend.store_kv(self.layer_id, batch.out_cache_loc, c_kv, k_pe)
            k, v = self._expand(c_kv, k_pe)
            out = backend.forward_mha(torch.cat([q_nope, q_pe], -1), k, v, batch.extend_layout)
        elif batch.mode is ForwardMode.EXTEND and self._long_prefix(batch):
            out = self._chunked_prefix(torch.cat([q_nope, q_pe], -1), c_kv, k_pe, batch, backend)
        else:
            w_kc, w_vc = self.absorbed_weights()
            q_abs = torch.einsum("thp,hpl->thl", q_nope, w_kc)
            o_lat = backend.forward_absorbed(self.layer_id, q_abs, q_pe, c_kv, k_pe, batch)
            out = torch.einsum("thl,hlv->thv", o_lat, w_vc)
        return self.o_proj(out.reshape(t, -1))

    def _expand(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows -> per-head K [N, H, P + R] and V [N, H, V] through kv_b_proj."""
        c, n = self.cfg, c_kv.shape[0]
        k_nope, v = (
            self.kv_b_proj(c_kv)
            .view(n, c.num_attention_heads, -1)
            .split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        )
        k_pe = k_pe[:, None, :].expand(-1, c.num_attention_heads, -1)
        return torch.cat([k_nope, k_pe], dim=-1), v

    def _long_prefix(self, batch: ForwardBatch) -> bool:
        m = self.chunked_prefix_min
        return m is not None and int(batch.extend_prefix_lens_cpu.max()) >= m

    def _chunked_prefix(
        self,
        q: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        batch: ForwardBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """MHA over the cached prefix (no mask) and over the new tokens (causal), merged by
        log-sum-exp; requests without a prefix contribute an empty part (lse -inf)."""
        latent, rope = backend.load_prefix(self.layer_id, batch)
        k, v = self._expand(latent.to(q.dtype), rope.to(q.dtype))
        o1, lse1 = backend.forward_mha(q, k, v, batch.prefix_layout, causal=False, return_lse=True)
        backend.store_kv(self.layer_id, batch.out_cache_loc, c_kv, k_pe)
        k, v = self._expand(c_kv, k_pe)
        o2, lse2 = backend.forward_mha(q, k, v, batch.new_layout, causal=True, return_lse=True)
        return merge_states(o1, lse1, o2, lse2)[0]


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: DeepseekV3Config, layer_id: int, chunked_prefix_min: int | None
    ) -> None:
        super().__init__()
        self.self_attn = MLAttention(cfg, layer_id, chunked_prefix_min)
        dense = layer_id < cfg.first_k_dense_replace
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size) if dense else MoE(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3Model(KeepsFP32):
    inv_freq: torch.Tensor  # a buffer: [R / 2], fp32 whatever the model's dtype

    def __init__(self, cfg: DeepseekV3Config, chunked_prefix_min: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, chunked_prefix_min) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        inv_freq, self.rope_scale = rope_tables(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, chunked_prefix_min: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DeepseekV3Model(cfg, chunked_prefix_min)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.extra_tensors: list[str] = []  # checkpoint tensors the loader left unused

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend
    ) -> torch.Tensor:
        """input_ids [T] (the batch's new tokens, request-major) -> logits [T, vocab] fp32.
        The caller has built `backend`'s metadata for `batch` (once, for every layer)."""
        m = self.model
        x = m.embed_tokens(input_ids)
        ang = batch.positions.float()[:, None] * m.inv_freq[None, :]
        cos = (ang.cos() * m.rope_scale).to(x.dtype)
        sin = (ang.sin() * m.rope_scale).to(x.dtype)
        for layer in m.layers:
            x = layer(x, cos, sin, batch, backend)
        return self.lm_head(m.norm(x)).float()
