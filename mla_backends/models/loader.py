"""Load HF-layout safetensors (one file or shards with an index) into our DeepSeek-V3.

DeepSeek's block-scaled FP8 weights (`W` float8, e4m3 or e5m2, with `W_scale_inv` per
128 x 128 block) are dequantized on load. Every tensor the model needs must be present with
the right shape and a floating dtype; errors name the tensor. Extra tensors (the MTP layer, say) are
left out and counted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from mla_backends.arith import cdiv
from mla_backends.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM, keeps_fp32

BLOCK = 128
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
# config.json model types this loader builds (DeepSeek-V3's architecture; V3.2 adds the
# indexer); a config without one is taken as DeepSeek-V3 (the random checkpoints of `run`)
MODEL_TYPES = ("deepseek_v3", "kimi_k2", "deepseek_v32")


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, mis-shaped or of the wrong dtype (the message names it)."""


def read_config_json(path: Path) -> dict[str, Any]:
    """The checkpoint's `config.json` as a dict; CheckpointError naming the file otherwise."""
    cfg = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    if not cfg.is_file():
        raise CheckpointError(f"{path}: no config.json (an HF-layout checkpoint directory has one)")
    try:
        raw = json.loads(cfg.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg}: cannot read it as JSON: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg}: top level must be an object, got {type(raw).__name__}")
    quant = raw.get("quantization_config") or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    if method not in (None, "fp8"):  # else refused later for a weight name it lacks
        raise CheckpointError(
            f"{cfg}: quantization_config.quant_method {method!r}: the loaders read bf16 / fp16 "
            "/ fp32 weights and DeepSeek's block-scaled FP8 ('fp8') only"
        )
    return raw


def _index_shards(index: Path) -> dict[str, str]:
    """The index's weight_map (tensor name -> shard file); CheckpointError naming the file."""
    try:
        raw = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index}: cannot read it as JSON: {e}") from None
    wmap = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(wmap, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in wmap.items()
    ):
        raise CheckpointError(f"{index}: needs a 'weight_map' object of tensor name -> file")
    return wmap


def _load_shard(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise CheckpointError(f"{path}: shard named by the index is missing")
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"{path}: cannot read it as safetensors: {e}") from None


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by name. With an index, each tensor comes from the
    shard its weight_map names (other files, a stale copy say, are not read for it); without
    one, a name found in two files is refused (which one is meant is not knowable)."""
    index = path / "model.safetensors.index.json"
    out: dict[str, torch.Tensor] = {}
    if index.exists():
        wmap = _index_shards(index)
        for shard in sorted(set(wmap.values())):
            for name, t in _load_shard(path / shard).items():
                if wmap.get(name) == shard:
                    out[name] = t
        missing = sorted(set(wmap) - set(out))
        if missing:
            raise CheckpointError(
                f"{index}: {len(missing)} tensor(s) not in the shards it names, e.g. "
                f"{missing[0]!r} (in {wmap[missing[0]]!r})"
            )
        return out
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{path}: no *.safetensors files")
    seen: dict[str, str] = {}
    for shard in shards:
        for name, t in _load_shard(path / shard).items():
            if name in seen:
                raise CheckpointError(
                    f"{path}: tensor {name!r} is in both {seen[name]} and {shard} (no "
                    "model.safetensors.index.json says which): remove the stale file"
                )
            seen[name] = shard
            out[name] = t
    return out


def dequant_fp8_blocks(w: torch.Tensor, scale_inv: torch.Tensor, name: str) -> torch.Tensor:
    """w [out, in] float8 with scale_inv [ceil(out / 128), ceil(in / 128)] -> fp32."""
    rows, cols = w.shape
    want = (cdiv(rows, BLOCK), cdiv(cols, BLOCK))
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(
            f"{name}_scale_inv: shape {list(scale_inv.shape)}, expected "
            f"{list(want)} for a {[rows, cols]} weight in {BLOCK}x{BLOCK} blocks"
        )
    s = scale_inv.float().repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return w.float() * s


def fetch_tensor(
    tensors: dict[str, torch.Tensor], name: str, shape: torch.Size | tuple[int, ...]
) -> torch.Tensor:
    """Checkpoint tensor `name` as a floating tensor (block-scaled FP8 dequantized); errors
    name it. The caller checks the shape (`shape` is for the message when it is missing)."""
    if name not in tensors:
        raise CheckpointError(f"checkpoint lacks tensor {name!r} {list(shape)}")
    t = tensors[name]
    scale = tensors.get(name + "_scale_inv")
    if t.dtype in FLOAT8:
        if scale is None:
            raise CheckpointError(f"{name}: float8 weight without {name}_scale_inv")
        t = dequant_fp8_blocks(t, scale, name)
    elif scale is not None:  # a scale nobody applies would leave the weight off by it
        raise CheckpointError(
            f"{name}: {t.dtype} weight with a {name}_scale_inv (only float8 weights are "
            "block-scaled)"
        )
    if not t.is_floating_point():
        raise CheckpointError(f"{name}: dtype {t.dtype}, expected a floating dtype")
    return t


def build_model(
    raw: dict[str, Any], chunked_prefix_min: int | None = None
) -> DeepseekV3ForCausalLM:
    """The model a config.json describes, on the current default device: DeepSeek-V3 (or
    V3.2: `model_type` "deepseek_v32" adds the indexer). ValueError for another model type
    (Hazard: GLM-5's `glm_moe_dsa` was built as dense V3, its indexer tensors left unused:
    dense attention served for sparse, silently)."""
    return model_from_config(model_config(raw), chunked_prefix_min)


def model_config(raw: dict[str, Any]) -> DeepseekV3Config:
    """`build_model`'s config (V3.2's for "deepseek_v32"); ValueError naming what is wrong."""
    kind = raw.get("model_type")
    if kind is not None and kind not in MODEL_TYPES:
        raise ValueError(
            f"model_type {kind!r} is not one this loader builds ({', '.join(MODEL_TYPES)}; "
            "Kimi-Linear: mla_backends.models.kimi_loader.load_kimi_linear)"
        )
    if kind == "deepseek_v32":
        from mla_backends.models.deepseek_v32 import DeepseekV32Config

        return DeepseekV32Config.from_hf(raw)
    return DeepseekV3Config.from_hf(raw)


def model_from_config(
    cfg: DeepseekV3Config, chunked_prefix_min: int | None = None
) -> DeepseekV3ForCausalLM:
    from mla_backends.models.deepseek_v32 import DeepseekV32Config, DeepseekV32ForCausalLM

    if isinstance(cfg, DeepseekV32Config):
        return DeepseekV32ForCausalLM(cfg, chunked_prefix_min)
    return DeepseekV3ForCausalLM(cfg, chunked_prefix_min)


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    chunked_prefix_min: int | None = None,
) -> DeepseekV3ForCausalLM:
    """DeepSeek-V3 / Kimi-K2 / V3.2 (`build_model`) from an HF-layout checkpoint directory,
    built whole on the host in fp32 and then moved: refused first, in one line, when that
    would not fit the host's available memory (a real 671B checkpoint was killed for memory
    with no message)."""
    path = Path(path)
    raw = read_config_json(path)
    try:
        cfg = model_config(raw)
        n = cfg.mlp_parameters()  # a floor: enough to refuse the checkpoints that cannot fit
        need = host_bytes_to_load(n, path, dtype)
        free = available_host_bytes()
        if free is not None and need > free:
            raise CheckpointError(
                f"{path}: over {n / 1e9:.1f}B parameters need over {need / 2**30:.0f} GiB of "
                f"host memory to load (built in fp32, then cast), {free / 2**30:.0f} GiB "
                "available: this loader is for reference-size checkpoints"
            )
        model = model_from_config(cfg, chunked_prefix_min)
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return load_weights(model, path, dtype, device)


def host_bytes_to_load(n: int, path: Path, dtype: torch.dtype) -> int:
    """Peak host bytes of `load_weights` for `n` parameters, about: the fp32 model, the
    checkpoint's tensors and their cast copies."""
    files = (path / "model.safetensors.index.json", *path.glob("*.safetensors"))
    return n * (4 + dtype.itemsize) + sum(f.stat().st_size for f in files if f.is_file())


def available_host_bytes() -> int | None:
    """The host memory available now (Linux MemAvailable), or None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def tie_head(tensors: dict[str, torch.Tensor], tied: bool) -> None:
    """With `tie_word_embeddings` and no `lm_head.weight` stored (as transformers saves a tied
    model), the head is the embedding. Hazard: a tied config whose checkpoint also stores a
    different head keeps that head, as transformers 5.x does (it warns and does not tie);
    taking the embedding there would give logits HF's model does not."""
    if tied and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors.get("model.embed_tokens.weight", torch.empty(0))


M = TypeVar("M", bound=torch.nn.Module)


def load_weights(model: M, path: Path, dtype: torch.dtype, device: torch.device | str) -> M:
    """Fill every tensor of `model` (its own state-dict names) from the checkpoint at `path`."""
    cfg = cast(Any, model).cfg  # every model here keeps its HF config as `cfg`
    tensors = read_tensors(path)
    want = model.state_dict()
    tie_head(tensors, cfg.tie_word_embeddings)
    fp32 = keeps_fp32(model)  # RoPE, the routing gate: as HF keeps them
    loaded = {}
    for name, ref in want.items():
        try:
            t = fetch_tensor(tensors, name, ref.shape)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
        if t.shape != ref.shape:
            raise CheckpointError(
                f"{name}: checkpoint shape {list(t.shape)}, model expects {list(ref.shape)}"
            )
        loaded[name] = t.to(torch.float32 if name in fp32 else dtype)
    model.load_state_dict(loaded, strict=True)
    cast(Any, model).extra_tensors = sorted(
        k for k in tensors if k not in want and not k.endswith("_scale_inv")
    )
    return model.to(device=device, dtype=dtype).eval()
