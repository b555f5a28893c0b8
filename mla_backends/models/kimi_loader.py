"""Load HF-layout safetensors into the Kimi-Linear model (`models/kimi_linear.py`).

The layout follows Kimi-Linear's and fla's names for what this model has:
- `model.` prefix, `self_attn.` for both layer kinds, `mlp.gate_proj / up_proj / down_proj`;
- `model.embed_tokens`, `model.norm`, `lm_head` (the embedding when `tie_word_embeddings` and
  none is stored: `loader.tie_head`);
- KDA short convolutions as three depthwise Conv1d weights `q_conv1d / k_conv1d /
  v_conv1d.weight` of shape [heads * head_dim, 1, kernel], which are joined into our one
  `conv_weight` [3 * heads * head_dim, kernel].

config.json: the model fields of `KimiLinearConfig`, plus `linear_attn_config` {"num_heads",
"head_dim", "short_conv_kernel_size", "kda_layers", "full_attn_layers"} with 1-based layer
numbers, as Kimi-Linear writes them: they name the MLA layers (`full_layers`), whatever
the ratio (Kimi-Linear-48B: 4, 8, ..., 24 and 27); without them, `linear_per_full` does.
`A_log` is read as [H] or in the hub's [1, 1, H, 1] (and written in the latter).
MoE blocks: Kimi-Linear's keys (`num_experts`, `num_experts_per_token`, `num_shared_experts`,
`num_expert_group`, `moe_renormalize`) and tensors (`block_sparse_moe.gate`, `.experts.N.w1 /
w2 / w3`, `.shared_experts`) on the layers from `first_k_dense_replace` on.
Not covered, refused from config.json in one line: a q LoRA, MLA layers with RoPE
(`mla_use_nope` false), a router other than sigmoid, MoE on every n-th layer only
(`moe_layer_freq` > 1).
"""

from __future__ import annotations

import json
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from mla_backends.models.deepseek_v3 import keeps_fp32, not_computed
from mla_backends.models.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM
from mla_backends.models.loader import (
    CheckpointError,
    fetch_tensor,
    read_config_json,
    read_tensors,
    tie_head,
)

_CONV = ("q_conv1d", "k_conv1d", "v_conv1d")
# Kimi-Linear's config.json keys -> ours (DeepSeek-V3's names, which the MoE blocks share)
_MOE_KEYS = {
    "num_experts": "n_routed_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
    "num_expert_group": "n_group",
    "moe_renormalize": "norm_topk_prob",
}
_EXPERT = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}  # ours -> the hub's


def config_from_hf(raw: dict[str, Any]) -> KimiLinearConfig:
    """The model's config from config.json; ValueError naming a missing or bad field (the
    dataclass defaults are the tiny test model's, never a checkpoint's)."""
    raw = dict(raw)
    unsupported = _unsupported(raw)
    if unsupported:
        raise ValueError(f"config.json: {unsupported}: not in this model")
    lin = raw.pop("linear_attn_config", None) or {}
    if not isinstance(lin, dict):
        raise ValueError(f"linear_attn_config must be an object, got {lin!r}")
    for key in ("kda_layers", "full_attn_layers"):
        got = lin.get(key, [])
        if not isinstance(got, list) or not all(type(i) is int for i in got):
            raise ValueError(
                f"linear_attn_config.{key} must be a list of layer numbers, got {got!r}"
            )
    for hub, ours in _MOE_KEYS.items():
        if hub in raw and raw.setdefault(ours, raw[hub]) != raw[hub]:
            raise ValueError(f"{hub} {raw[hub]!r} and {ours} {raw[ours]!r} disagree")
    kinds = raw.get("mlp_layer_types")  # transformers' own save: the MLP of each layer
    if kinds is not None:
        listed = isinstance(kinds, list)  # enumerate() over an int was a TypeError traceback
        dense = next((i for i, k in enumerate(kinds) if k != "dense"), len(kinds)) if listed else 0
        if not listed or any(k != "sparse" for k in kinds[dense:]):
            raise ValueError(
                f"mlp_layer_types must be 'dense' layers then 'sparse' ones, got {kinds!r}"
            )
        raw["first_k_dense_replace"] = dense
    if raw.get("use_grouped_topk") is False:  # one group: plain top-k over every expert
        raw["n_group"] = raw["topk_group"] = 1
    raw.setdefault("kda_heads", lin.get("num_heads"))
    raw.setdefault("kda_head_dim", lin.get("head_dim"))
    raw.setdefault("conv_kernel", lin.get("short_conv_kernel_size"))
    raw.setdefault("mla_heads", raw.get("num_attention_heads"))
    n = raw.get("num_hidden_layers")
    if "full_attn_layers" in lin:
        raw["full_layers"] = tuple(sorted(lin["full_attn_layers"]))
    elif "kda_layers" in lin and type(n) is int:
        raw["full_layers"] = tuple(i for i in range(1, n + 1) if i not in set(lin["kda_layers"]))
    if raw.get("linear_per_full") is None and raw.get("full_layers") is not None:
        # informative: the lists rule (none of them MLA: every layer linear)
        raw["linear_per_full"] = min(raw["full_layers"], default=raw["num_hidden_layers"]) - 1
    names = {f.name for f in fields(KimiLinearConfig)}
    missing = sorted(n for n in names - {"rms_norm_eps", "full_layers"} if raw.get(n) is None)
    if missing:
        raise ValueError(f"config.json lacks {missing}")
    cfg = KimiLinearConfig(**{k: v for k, v in raw.items() if k in names and v is not None})
    kda = [i + 1 for i, k in enumerate(cfg.kinds) if k == "linear"]
    if "kda_layers" in lin and sorted(lin["kda_layers"]) != kda:
        raise CheckpointError(
            f"config.json linear_attn_config.kda_layers = {sorted(lin['kda_layers'])} and "
            f"full_attn_layers = {list(cfg.full_layers or ())} do not split layers "
            f"1..{cfg.num_hidden_layers} between them"
        )
    return cfg


def _unsupported(raw: dict[str, Any]) -> str | None:
    """What a Kimi-Linear config.json asks for that this model does not compute (each was
    ignored: the MoE's tensors then missing, a q LoRA or RoPE silently not applied)."""
    router = raw.get("moe_router_activation_func", "sigmoid")
    moe = raw.get("num_experts") or raw.get("n_routed_experts")
    if moe and router != "sigmoid":
        return f"an MoE router of {router!r} (moe_router_activation_func; sigmoid only)"
    if moe and raw.get("moe_layer_freq", 1) != 1:
        return f"MoE on every {raw['moe_layer_freq']}th layer (moe_layer_freq; 1 only)"
    if raw.get("q_lora_rank") is not None:
        return f"a q LoRA (q_lora_rank {raw['q_lora_rank']})"
    if raw.get("mla_use_nope") is False:
        return "MLA layers with RoPE (mla_use_nope false)"
    return not_computed(raw)


def hf_name(name: str) -> str:
    """Our parameter name -> the checkpoint's (the conv weight is handled apart); an MoE
    block's (gate, experts, shared experts) is `block_sparse_moe.`, a dense MLP's `mlp.`."""
    if name.startswith("lm_head."):
        return name
    name = re.sub(r"^layers\.(\d+)\.attn\.", r"layers.\1.self_attn.", name)
    moe = re.match(r"^(layers\.\d+\.)mlp\.(gate|experts|shared_experts)\.(.*)$", name)
    if moe:
        head, part, rest = moe.groups()
        if part == "experts":  # experts.N.gate_proj.weight -> experts.N.w1.weight
            i, proj, tail = rest.split(".", 2)
            rest = f"{i}.{_EXPERT[proj]}.{tail}"
        name = f"{head}block_sparse_moe.{part}.{rest}"
    return "model." + name


def _conv_weight(tensors: dict[str, torch.Tensor], prefix: str, shape: torch.Size) -> torch.Tensor:
    parts = []
    per = (shape[0] // 3, 1, shape[1])
    for c in _CONV:
        name = f"{prefix}.{c}.weight"
        t = fetch_tensor(tensors, name, torch.Size(per))
        if tuple(t.shape) != per:
            raise CheckpointError(f"{name}: checkpoint shape {list(t.shape)}, expected {list(per)}")
        parts.append(t[:, 0])
    return torch.cat(parts, 0)


def load_kimi_linear(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> KimiLinearForCausalLM:
    path = Path(path)
    raw = read_config_json(path)
    try:
        model = KimiLinearForCausalLM(config_from_hf(raw))
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    tensors = read_tensors(path)
    tie_head(tensors, bool(raw.get("tie_word_embeddings")))
    loaded: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    fp32 = keeps_fp32(model)  # the MoE gates: as HF keeps them
    for name, ref in model.state_dict().items():
        if name.endswith(".attn.conv_weight"):
            prefix = hf_name(name).removesuffix(".conv_weight")
            t = _conv_weight(tensors, prefix, ref.shape)
            used.update(f"{prefix}.{c}.weight" for c in _CONV)
        else:
            key = hf_name(name)
            t = fetch_tensor(tensors, key, ref.shape)
            used.add(key)
            if name.endswith(".attn.A_log") and t.shape == (1, 1, ref.numel(), 1):
                t = t.view(ref.shape)  # the hub's layout (modeling_kimi: view(1, 1, -1, 1))
        if t.shape != ref.shape:
            raise CheckpointError(
                f"{hf_name(name)}: checkpoint shape {list(t.shape)}, model expects "
                f"{list(ref.shape)}"
            )
        loaded[name] = t.to(torch.float32 if name in fp32 else dtype)
    model.load_state_dict(loaded, strict=True)
    model.extra_tensors = sorted(
        k for k in tensors if k not in used and not k.endswith("_scale_inv")
    )
    return model.to(device=device, dtype=dtype).eval()


def save_kimi_linear(model: KimiLinearForCausalLM, path: str | Path) -> None:
    """Write `model` in the layout `load_kimi_linear` reads (tests, tiny checkpoints)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name.endswith(".attn.conv_weight"):
            prefix = hf_name(name).removesuffix(".conv_weight")
            for comp, part in zip(_CONV, t.chunk(3, 0)):
                out[f"{prefix}.{comp}.weight"] = part[:, None].contiguous()
        elif name.endswith(".attn.A_log"):
            out[hf_name(name)] = t.reshape(1, 1, -1, 1).contiguous()  # the hub's layout
        else:
            out[hf_name(name)] = t.contiguous()
    save_file(out, str(path / "model.safetensors"))
    c = model.cfg
    raw = {f.name: getattr(c, f.name) for f in fields(c) if f.name != "full_layers"}
    raw["linear_attn_config"] = {  # the layer lists name the MLA layers, as Kimi-Linear's
        "num_heads": c.kda_heads,
        "head_dim": c.kda_head_dim,
        "short_conv_kernel_size": c.conv_kernel,
        "kda_layers": [i + 1 for i, k in enumerate(c.kinds) if k == "linear"],
        "full_attn_layers": [i + 1 for i, k in enumerate(c.kinds) if k == "full"],
    }
    (path / "config.json").write_text(json.dumps(raw, indent=1))
