"""config.json checks at load: what no model here can run is one CheckpointError naming the
field (the CLI prints it as one line), never a silently different model or a deep traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Cli
from test_deepseek_v3 import TINY_HF

from mla_backends.models.deepseek_v3 import DeepseekV3Config
from mla_backends.models.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM
from mla_backends.models.kimi_loader import load_kimi_linear, save_kimi_linear
from mla_backends.models.loader import CheckpointError, load_model

DSV3 = TINY_HF  # the DeepSeek-V3 tests' tiny config

BAD_DSV3: dict[str, tuple[dict[str, Any], str]] = {
    # HF applies these; we dropped them and rotated unscaled (logits unlike HF's, no error)
    "linear": ({"rope_scaling": {"type": "linear", "factor": 4.0}}, r"type 'linear' is not"),
    "dynamic": ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, r"'dynamic' is not"),
    "llama3": ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, r"'llama3' is not"),
    "not-object": ({"rope_scaling": "yarn"}, r"rope_scaling must be an object or null"),
    "bool-str": ({"rope_interleave": "false"}, r"rope_interleave must be true or false"),
    # GLM-5's V3.2-like model was built as dense V3, its indexer tensors left unused
    "model-type": ({"model_type": "glm_moe_dsa"}, r"model_type 'glm_moe_dsa' is not one this"),
    # read and ignored: the maths differ from HF's, with no error
    "attention-bias": ({"attention_bias": True}, r"asks for biases on the projections"),
    "gelu": ({"hidden_act": "gelu"}, r"hidden_act 'gelu' \(the MLP computes silu\)"),
    "yarn-factor": (
        {"rope_scaling": {"type": "yarn", "factor": 4.0, "attention_factor": 1.3}},
        r"rope_scaling.attention_factor",
    ),
    "yarn-truncate": (
        {"rope_scaling": {"type": "yarn", "factor": 4.0, "truncate": False}},
        r"rope_scaling.truncate false",
    ),
    # an INT4 checkpoint was refused for a weight name it lacked
    "int4": (
        {"quantization_config": {"quant_method": "compressed-tensors"}},
        r"quant_method 'compressed-tensors': the loaders read",
    ),
    # blamed on num_experts_per_tok
    "topk-group": ({"topk_group": 99}, r"topk_group \(99\) must be in 1..n_group"),
    # DeepSeek-V2's routing was taken, then failed on a missing tensor
    "v2-routing": (
        {"scoring_func": "softmax", "topk_method": "group_limited_greedy"},
        r"scoring_func='softmax', topk_method='group_limited_greedy' is not supported",
    ),
}


@pytest.mark.parametrize("case", list(BAD_DSV3), ids=list(BAD_DSV3))
def test_deepseek_config_refuses_what_it_would_run_differently(tmp_path: Path, case: str) -> None:
    change, pattern = BAD_DSV3[case]
    (tmp_path / "config.json").write_text(json.dumps({**DSV3, **change}))
    with pytest.raises(CheckpointError, match=pattern):
        load_model(tmp_path)


def test_a_checkpoint_too_large_for_the_host_is_refused_before_it_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real 671B config.json was built in fp32 on the host and the process killed for
    memory, with no message: now sized from the config first and refused in one line.
    DeepSeek-V3's and Kimi-K2's model types, or none, are built."""
    from mla_backends.models import loader

    (tmp_path / "config.json").write_text(json.dumps({**DSV3, "model_type": "kimi_k2"}))
    monkeypatch.setattr(loader, "available_host_bytes", lambda: 2**20)
    with pytest.raises(
        CheckpointError,
        match=r"over 0.0B parameters need over 0 GiB of host memory .* 0 GiB available",
    ):
        load_model(tmp_path)
    monkeypatch.setattr(loader, "available_host_bytes", lambda: None)  # unknown: try
    with pytest.raises(CheckpointError, match=r"no \*.safetensors files"):
        load_model(tmp_path)
    for kind in ("deepseek_v3", None):
        raw = {**DSV3, "model_type": kind} if kind else DSV3
        assert type(loader.build_model(raw)).__name__ == "DeepseekV3ForCausalLM"


def test_deepseek_config_keeps_yarn_and_no_scaling() -> None:
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    assert DeepseekV3Config.from_hf({**DSV3, "rope_scaling": yarn}).rope_scaling == yarn
    plain = {"rope_type": "default", "rope_theta": 5e4}
    cfg = DeepseekV3Config.from_hf({**DSV3, "rope_parameters": plain})
    assert cfg.rope_scaling == {} and cfg.rope_theta == 5e4


@pytest.fixture
def kimi(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    save_kimi_linear(KimiLinearForCausalLM(KimiLinearConfig(num_hidden_layers=12)), tmp_path)
    return tmp_path


def _edit(path: Path, **change: object) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw.update(change)
    (path / "config.json").write_text(json.dumps(raw))


def test_kimi_config_missing_a_field_is_refused_not_defaulted(kimi: Path) -> None:
    """The dataclass defaults are the tiny test model's: a config.json without
    num_hidden_layers (and no layer lists) loaded 8 of 12 layers, the rest left as extras."""
    raw = json.loads((kimi / "config.json").read_text())
    del raw["num_hidden_layers"]
    for key in ("kda_layers", "full_attn_layers"):
        del raw["linear_attn_config"][key]
    (kimi / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"config.json lacks \['num_hidden_layers'\]"):
        load_kimi_linear(kimi)


def test_kimi_config_takes_the_mla_layers_from_the_layer_lists(kimi: Path) -> None:
    """Kimi-Linear's own config.json has the layer lists and no `linear_per_full`, and its
    MLA layers are not all at a ratio's places: Kimi-Linear-48B has 27 layers, MLA at 4, 8,
    ..., 24 and 27 (the ratio alone puts 27 in KDA; its config was refused). The lists rule;
    either one names the split; both must split the layers; without them the ratio does."""
    from mla_backends.models.kimi_loader import config_from_hf

    raw = json.loads((kimi / "config.json").read_text())
    del raw["linear_per_full"]
    (kimi / "config.json").write_text(json.dumps(raw))
    assert load_kimi_linear(kimi).cfg.kinds == KimiLinearConfig(num_hidden_layers=12).kinds
    full48 = [4, 8, 12, 16, 20, 24, 27]
    lists = {"full_attn_layers": full48, "kda_layers": [i for i in range(1, 28) if i not in full48]}
    for given in (lists, {"kda_layers": lists["kda_layers"]}, {"full_attn_layers": full48}):
        cfg = config_from_hf({**raw, "num_hidden_layers": 27, "linear_attn_config": given})
        assert [i + 1 for i, k in enumerate(cfg.kinds) if k == "full"] == full48
    every = {"kda_layers": list(range(1, 28))}  # no MLA layer: every layer linear
    cfg = config_from_hf({**raw, "num_hidden_layers": 27, "linear_attn_config": every})
    assert cfg.kinds == ["linear"] * 27 and cfg.full_layers == ()
    assert KimiLinearConfig(full_layers=[4, 8]) == KimiLinearConfig(full_layers=(4, 8))
    lists["kda_layers"] = lists["kda_layers"][:-1]  # layer 26 in neither list
    with pytest.raises(CheckpointError, match=r"do not split layers 1..27 between them"):
        config_from_hf({**raw, "num_hidden_layers": 27, "linear_attn_config": lists})
    with pytest.raises(ValueError, match=r"full_layers must be distinct layer numbers in 1..12"):
        config_from_hf({**raw, "linear_attn_config": {"full_attn_layers": [4, 13]}})
    for key in ("full_attn_layers", "kda_layers"):
        del raw["linear_attn_config"][key]
    (kimi / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"lacks \['linear_per_full'\]"):
        load_kimi_linear(kimi)


BAD_KIMI: dict[str, tuple[dict[str, Any], str]] = {
    "hidden-str": ({"hidden_size": "64"}, r"hidden_size must be an integer >= 1, got '64'"),
    "conv-0": ({"conv_kernel": 0}, r"conv_kernel must be an integer >= 1, got 0"),
    "rope-odd": ({"qk_rope_head_dim": 15}, r"qk_rope_head_dim must be even"),
    "eps-str": ({"rms_norm_eps": "x"}, r"rms_norm_eps must be a finite number > 0"),
    "lists": ({"linear_attn_config": {"kda_layers": 3}}, r"kda_layers must be a list"),
    # a q LoRA / RoPE / another router were silently not applied
    "moe-keys": ({"num_experts": 8}, r"num_experts 8 and n_routed_experts 0 disagree"),
    "router": (
        {"n_routed_experts": 8, "moe_router_activation_func": "softmax"},
        r"an MoE router of 'softmax' \(moe_router_activation_func; sigmoid only\)",
    ),
    "moe-freq": ({"n_routed_experts": 8, "moe_layer_freq": 2}, r"MoE on every 2th layer"),
    "mlp-kinds": ({"mlp_layer_types": ["sparse", "dense"]}, r"'dense' layers then 'sparse'"),
    "mlp-kinds-int": ({"mlp_layer_types": 3}, r"'dense' layers then 'sparse' ones, got 3"),
    "q-lora": ({"q_lora_rank": 16}, r"a q LoRA \(q_lora_rank 16\): not in this model"),
    "rope": ({"mla_use_nope": False}, r"MLA layers with RoPE \(mla_use_nope false\)"),
    "bias": ({"attention_bias": True}, r"biases on the projections"),
}


@pytest.mark.parametrize("case", list(BAD_KIMI), ids=list(BAD_KIMI))
def test_kimi_bad_config_values_are_one_checkpoint_error(kimi: Path, case: str) -> None:
    change, pattern = BAD_KIMI[case]
    _edit(kimi, **change)
    with pytest.raises(CheckpointError, match=pattern):
        load_kimi_linear(kimi)


def test_kimi_config_json_missing_or_unreadable_is_a_checkpoint_error(kimi: Path) -> None:
    (kimi / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config.json: cannot read it as JSON"):
        load_kimi_linear(kimi)
    (kimi / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"no config.json"):
        load_kimi_linear(kimi)


def test_run_names_the_checkpoint_tensors_it_left_unused() -> None:
    """`run` left unused tensors unsaid (a V3.2 indexer dropped by a dense build, say); the
    multi-token-prediction layers past num_hidden_layers are not counted."""
    from types import SimpleNamespace

    from mla_backends.models.run import _unused_tensors

    extra = ["model.layers.3.eh_proj.weight", "model.layers.1.self_attn.indexer.wk.weight", "x"]
    m = SimpleNamespace(cfg=SimpleNamespace(num_hidden_layers=3), extra_tensors=extra)
    assert _unused_tensors(m) == extra[1:]  # type: ignore[arg-type]


def test_run_refuses_an_fp8_pool_over_a_checkpoint_with_kv_scales(cli: Cli, tmp_path: Path) -> None:
    """A checkpoint with KV-cache scales (k_scale / v_scale / kv_scale a layer) served with
    an FP8 kv_dtype was stored at scale 1.0 with its scales left unused, and `run` said
    "agree" (its reference run reads the same pool): one line, exit 2, before serving. The
    same checkpoint with a bf16 pool is not refused."""
    from safetensors.torch import load_file, save_file

    from mla_backends.models.run import save_random

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_random("tiny", ckpt, seed=0)
    t = load_file(str(ckpt / "model.safetensors"))
    for i in range(json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]):
        for name in ("k_scale", "v_scale", "kv_scale"):
            t[f"model.layers.{i}.self_attn.{name}"] = torch.tensor(0.01)
    save_file(t, str(ckpt / "model.safetensors"))
    fp8 = tmp_path / "fp8.yaml"
    fp8.write_text(
        "model: tiny-kernel\nprefill_backend: torch\ndecode_backend: torch\npage_size: 16\n"
        "kv_dtype: float8_e4m3fn\ndtype: float32\ndevice: cpu\n"
    )
    argv = ("run", "--model", str(ckpt), "--requests", "1", "--max-new", "2")
    proc = cli(*argv, "--config", str(fp8), timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line and "KV-cache scales" in line and "self_attn.k_scale" in line, line
    assert "use kv_dtype bfloat16" in line, line
    bf16 = tmp_path / "bf16.yaml"
    bf16.write_text(fp8.read_text().replace("float8_e4m3fn", "bfloat16"))
    proc = cli(*argv, "--config", str(bf16), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "left unused" in proc.stdout and "self_attn.k_scale" in proc.stdout, proc.stdout


def test_kimi_a_log_is_read_in_the_hubs_layout_and_ours(kimi: Path) -> None:
    """The hub's checkpoints keep A_log as [1, 1, H, 1] (refused as a shape mismatch); the
    saver writes that layout, and [H] is read too."""
    from safetensors.torch import load_file, save_file

    file = kimi / "model.safetensors"
    t = load_file(str(file))
    name = "model.layers.0.self_attn.A_log"
    h = KimiLinearConfig().kda_heads
    assert t[name].shape == (1, 1, h, 1)
    want = load_kimi_linear(kimi).layers[0].attn.A_log.detach().clone()
    t[name] = t[name].reshape(h).contiguous()
    save_file(t, str(file))
    assert torch.equal(load_kimi_linear(kimi).layers[0].attn.A_log.detach(), want)


def test_a_bf16_model_keeps_rope_and_the_routing_gate_in_fp32(tmp_path: Path) -> None:
    """As HF keeps them: cast with the model, RoPE's inv_freq was rounded to bf16 (0.4 %, a
    query and key thousands of positions apart rotated radians wrong) and the routing gate
    and bias too (0.5-5 % of tokens sent to other experts); a double() model stays fp64."""
    from mla_backends.models.deepseek_v3 import rope_tables
    from mla_backends.models.run import save_random

    save_random("tiny", tmp_path, seed=0)
    want = load_model(tmp_path, dtype=torch.float32)
    got = load_model(tmp_path, dtype=torch.bfloat16)
    assert got.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(got.model.inv_freq, rope_tables(got.cfg)[0].float())
    gates = [n for n, _ in got.named_parameters() if ".mlp.gate." in n]
    assert gates  # the tiny model has MoE layers
    ref = dict(want.named_parameters())
    for name, p in got.named_parameters():
        if name in gates:
            assert p.dtype == torch.float32 and torch.equal(p, ref[name]), name
    assert got.double().model.inv_freq.dtype == torch.float64
