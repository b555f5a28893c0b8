"""Host-side loading of the model stack: safetensors shards and FP8 blocks, config.json
values and the sizes the loader derives from them (mutation round 14: each test killed a
mutant the other tests let through)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_deepseek_v3 import TINY_HF

from mla_backends.models.deepseek_v3 import DeepseekV3Config, Gate
from mla_backends.models.loader import (
    CheckpointError,
    dequant_fp8_blocks,
    host_bytes_to_load,
    load_model,
    read_config_json,
)
from mla_backends.models.run import save_random


def test_fp8_dequant_applies_each_blocks_own_scale_over_ragged_edges() -> None:
    """A weight of 2 x 3 blocks of 128 (the last row and column blocks partial): each block
    scaled by its own entry of scale_inv [2, 3]; a [3, 2] scale (transposed) is refused."""
    w = torch.ones(130, 260).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    got = dequant_fp8_blocks(w, scale, "w")
    want = torch.empty(130, 260)
    for i, rows in enumerate((slice(0, 128), slice(128, 130))):
        for j, cols in enumerate((slice(0, 128), slice(128, 256), slice(256, 260))):
            want[rows, cols] = scale[i, j]
    assert torch.equal(got, want)
    with pytest.raises(CheckpointError, match=r"w_scale_inv: shape \[3, 2\], expected \[2, 3\]"):
        dequant_fp8_blocks(w, scale.t().contiguous(), "w")


def test_an_index_naming_a_shard_that_lacks_the_tensor_is_refused(tmp_path: Path) -> None:
    """The index says where a tensor is; a shard without it (a torn download) is one error
    naming the tensor and the shard, even for a tensor the model would not read."""
    from safetensors.torch import load_file

    save_random("tiny", tmp_path, seed=0)
    wmap = {k: "model.safetensors" for k in load_file(str(tmp_path / "model.safetensors"))}
    wmap["model.layers.3.eh_proj.weight"] = "model.safetensors"  # an MTP tensor, not there
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    with pytest.raises(
        CheckpointError,
        match=r"1 tensor\(s\) not in the shards it names, e.g. 'model.layers.3.eh_proj.weight'",
    ):
        load_model(tmp_path)


def test_an_fp8_checkpoint_loads_and_its_scales_are_not_counted_unused(tmp_path: Path) -> None:
    """DeepSeek-V3's own config.json says quant_method "fp8": it is read, and the
    `_scale_inv` tensors the loader applied are not reported as left unused."""
    from safetensors.torch import load_file, save_file

    save_random("tiny", tmp_path, seed=0)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert read_config_json(tmp_path)["quantization_config"]["quant_method"] == "fp8"
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.self_attn.q_b_proj.weight"
    tensors[name + "_scale_inv"] = torch.ones(1, 1)
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = load_model(tmp_path)
    assert model.extra_tensors == []


def test_host_bytes_count_the_fp32_build_its_cast_copy_and_the_files(tmp_path: Path) -> None:
    (tmp_path / "a.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "model.safetensors.index.json").write_text("y" * 10)
    assert host_bytes_to_load(100, tmp_path, torch.bfloat16) == 100 * (4 + 2) + 1010


def test_mlp_parameters_count_embedding_head_dense_and_expert_mlps() -> None:
    """TINY_HF: 3 layers, 1 dense (intermediate 96), 2 MoE of 8 routed + 1 shared experts
    (32 each); vocab 96, hidden 64."""
    cfg = DeepseekV3Config.from_hf(TINY_HF)
    mlp = 1 * 96 + 2 * (8 + 1) * 32
    assert cfg.mlp_parameters() == 2 * 96 * 64 + 3 * 64 * mlp


BAD_CONFIGS = {
    # groups of one expert: the gate scores a group by its top two, topk(2) failed in a layer
    "groups-of-1": ({"n_group": 8, "topk_group": 2}, r"groups of >= 2"),
    # a KeyError traceback, not the field's name
    "yarn-no-orig": (
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        r"rope_scaling \(yarn\) lacks 'original_max_position_embeddings'",
    ),
    # every routing weight 0: the MoE layers added nothing
    "scaling-0": ({"routed_scaling_factor": 0}, r"routed_scaling_factor must be a finite number"),
    # HF adds the MLP biases; this model has none
    "mlp-bias": ({"mlp_bias": True}, r"biases on the projections"),
    # "false" would read as true: the routing weights renormalised when asked not to be
    "norm-str": ({"norm_topk_prob": "false"}, r"norm_topk_prob must be true or false"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS), ids=list(BAD_CONFIGS))
def test_deepseek_config_refuses_a_value_it_cannot_run(case: str) -> None:
    change, pattern = BAD_CONFIGS[case]
    with pytest.raises(ValueError, match=pattern):
        DeepseekV3Config.from_hf({**TINY_HF, **change})


def test_deepseek_config_takes_the_edges_of_what_it_runs() -> None:
    """Valid configs at the bounds: every group kept (topk_group = n_group), no shared
    expert, and an all-dense model whose unused MoE fields would not split into groups."""
    assert DeepseekV3Config.from_hf({**TINY_HF, "topk_group": 4}).topk_group == 4
    assert DeepseekV3Config.from_hf({**TINY_HF, "n_shared_experts": 0}).n_shared_experts == 0
    dense = {**TINY_HF, "first_k_dense_replace": 3, "n_routed_experts": 1, "n_group": 1}
    assert DeepseekV3Config.from_hf({**dense, "topk_group": 1}).n_routed_experts == 1


def test_yarn_without_mscale_all_dim_leaves_the_softmax_scale_alone() -> None:
    """HF: `mscale_all_dim = rope_scaling.get("mscale_all_dim", 0)`, and 0 scales nothing."""
    rs = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64}
    dims = DeepseekV3Config.from_hf({**TINY_HF, "rope_scaling": rs}).attention_dims
    assert dims.mscale_all_dim == 0.0 and dims.softmax_scale == (16 + 16) ** -0.5


def test_gate_without_norm_topk_prob_weights_experts_by_their_raw_scores() -> None:
    """norm_topk_prob false (DeepSeek-V2-Lite style, Kimi's moe_renormalize false): the
    weights are the chosen sigmoid scores times routed_scaling_factor, not renormalised."""
    cfg = DeepseekV3Config.from_hf({**TINY_HF, "norm_topk_prob": False})
    gate = Gate(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        gate.weight.normal_(0, 0.5, generator=gen)
    x = torch.randn(16, cfg.hidden_size, generator=gen)
    w, idx = gate(x)
    scores = torch.sigmoid(x @ gate.weight.t()).gather(1, idx)
    torch.testing.assert_close(w, scores * cfg.routed_scaling_factor, rtol=1e-6, atol=0)


def _kimi_raw(tmp_path: Path) -> dict:
    from mla_backends.models.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM
    from mla_backends.models.kimi_loader import save_kimi_linear

    save_kimi_linear(KimiLinearForCausalLM(KimiLinearConfig(num_hidden_layers=4)), tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def test_kimi_config_reads_the_hubs_moe_keys(tmp_path: Path) -> None:
    """Kimi-Linear's config.json names the MoE its own way (num_experts, moe_renormalize,
    use_grouped_topk false for one group, mlp_layer_types): each lands in our field."""
    from mla_backends.models.kimi_loader import config_from_hf

    raw = _kimi_raw(tmp_path)
    for ours in ("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "n_group"):
        del raw[ours]
    del raw["norm_topk_prob"], raw["first_k_dense_replace"]
    hub = dict(num_experts=8, num_experts_per_token=2, num_shared_experts=1, num_expert_group=2)
    hub.update(moe_renormalize=False, mlp_layer_types=["dense", "dense", "sparse", "sparse"])
    cfg = config_from_hf({**raw, **hub, "topk_group": 2, "moe_intermediate_size": 8})
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == (8, 2, 1)
    assert (cfg.n_group, cfg.norm_topk_prob, cfg.first_k_dense_replace) == (2, False, 2)
    assert [cfg.is_moe(i) for i in range(4)] == [False, False, True, True]
    one = config_from_hf({**raw, **hub, "topk_group": 2, "use_grouped_topk": False})
    assert (one.n_group, one.topk_group) == (1, 1)


def test_kimi_conv_parts_of_another_shape_are_refused_naming_the_part(tmp_path: Path) -> None:
    """A short-conv part [C, 2, K] (not depthwise) lost its second channel to the join into
    our [3C, K] weight, and loaded; each part must be [C, 1, K]."""
    from safetensors.torch import load_file, save_file

    from mla_backends.models.kimi_loader import load_kimi_linear

    _kimi_raw(tmp_path)
    file, name = tmp_path / "model.safetensors", "model.layers.0.self_attn.k_conv1d.weight"
    t = load_file(str(file))
    c, _, k = t[name].shape
    t[name] = t[name].expand(c, 2, k).contiguous()
    save_file(t, str(file))
    want = rf"{name}: checkpoint shape \[{c}, 2, {k}\], expected \[{c}, 1, {k}\]"
    with pytest.raises(CheckpointError, match=want):
        load_kimi_linear(tmp_path)


def test_kimi_bf16_load_keeps_the_routing_gate_at_the_checkpoints_fp32_values(
    tmp_path: Path,
) -> None:
    """A bf16 Kimi-Linear load kept the MoE gate's dtype fp32 but took its values rounded to
    bf16 first (0.5-5 % of tokens sent to other experts, as DeepSeek-V3's gate was)."""
    from mla_backends.models.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM
    from mla_backends.models.kimi_loader import load_kimi_linear, save_kimi_linear

    cfg = KimiLinearConfig(num_hidden_layers=2, n_routed_experts=4, moe_intermediate_size=8)
    model = KimiLinearForCausalLM(cfg)
    with torch.no_grad():  # its init leaves the gate at values bf16 holds exactly
        for name, p in model.named_parameters():
            if ".mlp.gate." in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    save_kimi_linear(model, tmp_path)
    want = dict(load_kimi_linear(tmp_path).named_parameters())
    got = dict(load_kimi_linear(tmp_path, dtype=torch.bfloat16).named_parameters())
    gates = [n for n in got if ".mlp.gate." in n]
    assert gates and got["embed_tokens.weight"].dtype == torch.bfloat16
    for name in gates:
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want[name]), name
