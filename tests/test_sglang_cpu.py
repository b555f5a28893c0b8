"""The SGLang plug-in on CPU (sglang 0.5.17, tests/sglang_cpu/requirements.txt):

- registration through the installed `sglang.srt.plugins` entry point, CLI choices, DeepSeek
  routing lists, the start-up check hook;
- argument parsing with our names; wrong settings refused at start-up with our reason, both in
  `ServerArgs.check_server_args` and in the backend factory (never a kit skip);
- SGLang batches converted to ours (eager, graph capture / padded replay, target-verify);
- both DeepSeek call shapes through RadixAttention (absorbed split / joined with the rows
  stored by us, MHA-mode prefill and chunked prefix with LSE) against our fp64 reference;
- SGLang's own MLA kit (make_mla_cases, CUDA-graph decode mode, eagle verify) on mlab_torch,
  and at DeepSeek shapes on mlab_torch and mlab_triton (Triton interpreter), bf16 and FP8.
Skipped, with the reason, where sglang cannot be imported.
"""

from __future__ import annotations

import argparse
import json
import math
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang_cpu.env import load_sglang

try:
    load_sglang()
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.plugins import load_plugins
    from sglang_cpu import kit_support as ks
except Exception as e:  # noqa: BLE001 - any import failure means: cannot run here
    pytest.skip(f"sglang unavailable: {' '.join(str(e).split())[:160]}", allow_module_level=True)

from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods import mla_attention as kit  # noqa: E402

import mla_backends.integrations.sglang as plugin  # noqa: E402
from mla_backends.backends.base import Capability  # noqa: E402
from mla_backends.integrations.sglang import binding  # noqa: E402
from mla_backends.integrations.sglang.batches import BatchError  # noqa: E402
from mla_backends.integrations.sglang.binding import SettingsError  # noqa: E402
from mla_backends.reference import absorbed, mha  # noqa: E402
from mla_backends.testing import TOLERANCES  # noqa: E402

NAMES = (
    "mlab_flashmla",
    "mlab_flashinfer",
    "mlab_cutlass",
    "mlab_trtllm",
    "mlab_triton",
    "mlab_torch",
)
BACKENDS = ["mlab_torch", pytest.param("mlab_triton", marks=pytest.mark.interp)]
H100 = Capability("cuda", (9, 0), "NVIDIA H100 80GB HBM3")
CPU = {"device": "cpu"}
DSV3_KIT = {**CPU, **ks.DSV3, "hidden_size": 256, "dtype": torch.bfloat16}


@pytest.fixture(scope="module", autouse=True)
def registered() -> list[str]:
    """Our names, registered the way SGLang does it: load_plugins() and the entry point."""
    load_plugins()
    missing = [n for n in NAMES if n not in ATTENTION_BACKENDS]
    if missing:
        pytest.fail(f"{missing} not registered: is mla-backends installed (pip install -e .)?")
    return list(NAMES)


@pytest.fixture(scope="module", autouse=True)
def torch_kv_writer() -> Any:
    """SGLang's MLA KV writer is a Triton kernel: on CPU the same scatter in torch."""
    undo = ks.use_torch_kv_writer()
    yield
    undo()


@pytest.fixture
def on_h100(monkeypatch: pytest.MonkeyPatch) -> Capability:
    """Capability checks see an H100 (the factory and the start-up hook both ask binding)."""
    monkeypatch.setattr(binding, "detect_capability", lambda device: H100)
    return H100


# ---------------------------------------------------------------------------------- registration
def test_entry_point_registers_every_suite_backend() -> None:
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
    )
    from sglang.srt.models.deepseek_common.utils import FORWARD_ABSORB_CORE_ATTENTION_BACKENDS
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import (
        ATTENTION_BACKEND_CHOICES,
        CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS,
        ServerArgs,
    )

    eps = {e.name: e.value for e in entry_points(group="sglang.srt.plugins")}
    assert eps.get("mla_backends") == "mla_backends.integrations.sglang:register"
    assert set(plugin.sglang_names()) == set(NAMES)
    for name in NAMES:
        assert ATTENTION_BACKEND_CHOICES.count(name) == 1, name
        assert name in CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS
        assert name in FORWARD_ABSORB_CORE_ATTENTION_BACKENDS
        assert AttentionBackendRegistry.get_handler(name).func is plugin.deepseek_handler
    hooks = [h for _, h, _ in HookRegistry._hooks[plugin.CHECK_TARGET]]
    assert hooks.count(plugin.check_server_args_hook) == 1
    assert hasattr(ServerArgs.check_server_args, "__wrapped__"), "hook not applied"
    assert plugin.register() == list(plugin.sglang_names())  # idempotent
    assert ATTENTION_BACKEND_CHOICES.count("mlab_triton") == 1


def _parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    return p


@pytest.mark.parametrize(
    "flags",
    [
        ["--attention-backend", "mlab_triton", "--page-size", "64"],
        [
            "--prefill-attention-backend",
            "mlab_triton",
            "--decode-attention-backend",
            "mlab_flashmla",
        ],
        ["--prefill-attention-backend", "mlab_torch", "--decode-attention-backend", "flashmla"],
        ["--attention-backend", "mlab_flashinfer", "--kv-cache-dtype", "fp8_e4m3"],
    ],
    ids=["one", "ours-ours", "ours-sglang", "fp8"],
)
def test_cli_accepts_our_names(flags: list[str]) -> None:
    ns = _parser().parse_args(["--model-path", "m", *flags])
    chosen = {ns.attention_backend, ns.prefill_attention_backend, ns.decode_attention_backend}
    assert chosen & set(NAMES)


def test_cli_rejects_unknown_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--model-path", "m", "--attention-backend", "mlab_nope"])
    assert "invalid choice" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- start-up checks
TINY_DSV3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": 128,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DeepSeek-V3 config.json (no weights): all ServerArgs needs to start checking."""
    d = tmp_path_factory.mktemp("dsv3tiny")
    (d / "config.json").write_text(json.dumps(TINY_DSV3))
    return d


def _server_args(model: Path, **kw: Any) -> Any:
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path=str(model), device="cpu", **kw)


REFUSALS = {
    "flashmla-page16": (
        {"attention_backend": "mlab_flashmla", "page_size": 16},
        r"flashmla needs page_size in \(64,\).*Start SGLang with --page-size 64",
    ),
    "flashmla-fp8": (
        {"attention_backend": "mlab_flashmla", "page_size": 64, "kv_cache_dtype": "fp8_e4m3"},
        r"flashmla needs kv_dtype in .*float8_e4m3fn.*--kv-cache-dtype bf16",
    ),
    # both wrong: neither flag alone runs it, and the refusal named no flag at all
    "flashmla-page16-fp8": (
        {"attention_backend": "mlab_flashmla", "page_size": 16, "kv_cache_dtype": "fp8_e4m3"},
        r"config has 16; flashmla needs kv_dtype in .*float8_e4m3fn.*\. Start SGLang with "
        r"--page-size 64 and --kv-cache-dtype bf16 \[settings",
    ),
    "cutlass-on-sm90": (
        {"attention_backend": "mlab_cutlass", "page_size": 128},
        r"CUTLASS MLA needs SM 100, found NVIDIA H100 80GB HBM3 \(SM90\)",
    ),
    "decode-half-flashmla": (
        {
            "prefill_attention_backend": "mlab_triton",
            "decode_attention_backend": "mlab_flashmla",
            "page_size": 16,
        },
        r"--attention-backend mlab_flashmla: .*--page-size 64",
    ),
    "e5m2": (
        {"attention_backend": "mlab_triton", "page_size": 64, "kv_cache_dtype": "fp8_e5m2"},
        r"--kv-cache-dtype fp8_e5m2 .* not supported by mla-backends",
    ),
    # accepted, it failed at the first long prefill on a shape error naming q_nope
    "prefill-cp": (
        {
            "attention_backend": "mlab_triton",
            "page_size": 64,
            "tp_size": 2,
            "enable_prefill_cp": True,
            "cp_strategy": "zigzag",
        },
        r"mlab_triton: prefill context parallelism \(--enable-prefill-cp",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(REFUSALS), ids=list(REFUSALS))
def test_start_up_check_refuses_with_our_reason(
    case: str, tiny_model: Path, on_h100: Capability
) -> None:
    kw, pattern = REFUSALS[case]
    sa = _server_args(tiny_model, **kw)
    with pytest.raises(SettingsError, match=pattern):
        sa.check_server_args()


@pytest.mark.parametrize(
    ("kw", "heads"),
    [
        ({"tp_size": 2}, 8),
        ({"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}, 16),
        ({"tp_size": 4, "dp_size": 2, "enable_dp_attention": True}, 8),
    ],
    ids=["tp2", "tp2-dp2-attention", "tp4-dp2-attention"],
)
def test_start_up_check_counts_the_heads_a_worker_builds(
    kw: dict[str, Any], heads: int, tiny_model: Path, on_h100: Capability,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The workers split a layer's heads over SGLang's attention-TP size (tp_size / dp_size
    under --enable-dp-attention); the launch check divided by tp_size, so a head limit the
    workers refuse after loading the weights (CUTLASS's 128) passed there (helper 70)."""
    seen: list[int] = []
    choose = binding.choose_roles

    def spy(sgl_name: str, name: str, config: Any, cap: Capability) -> Any:
        seen.append(config.model.num_heads)
        return choose(sgl_name, name, config, cap)

    monkeypatch.setattr(binding, "choose_roles", spy)
    _server_args(
        tiny_model, attention_backend="mlab_triton", page_size=64, **kw
    ).check_server_args()
    assert seen == [heads]


SERVER_REFUSALS = {
    "dcp": ({"dcp_size": 2, "tp_size": 2}, r"decode context parallelism \(--dcp-size > 1\)"),
    "eagle-tree": (
        {
            "speculative_algorithm": "EAGLE",
            "speculative_eagle_topk": 4,
            "speculative_num_steps": 3,
            "speculative_num_draft_tokens": 8,
            "page_size": 1,  # SGLang itself refuses tree drafts on pages for other backends
        },
        r"--speculative-eagle-topk 4: our kernels verify chain.*use --speculative-eagle-topk 1",
    ),
    "ngram-tree": (
        {"speculative_algorithm": "NGRAM", "page_size": 1},
        r"--speculative-ngram-max-bfs-breadth 10: .*use --speculative-ngram-max-bfs-breadth 1",
    ),
    "full-prefill-graph": (
        {"cuda_graph_backend_prefill": "full"},
        r"--cuda-graph-backend-prefill full captures .*use --cuda-graph-backend-prefill breakable",
    ),
    "eagle-draft-on-ours": (
        {
            "speculative_algorithm": "EAGLE",
            "speculative_eagle_topk": 1,
            "speculative_num_steps": 3,
            "speculative_num_draft_tokens": 4,
        },
        r"EAGLE would build the draft model's attention on mlab_torch.*"
        r"--speculative-draft-attention-backend triton",
    ),
}


@pytest.mark.parametrize("case", list(SERVER_REFUSALS), ids=list(SERVER_REFUSALS))
def test_start_up_check_refuses_dcp_and_tree_drafts(
    case: str, tiny_model: Path, on_h100: Capability
) -> None:
    """What the factory refuses from the server flags alone is refused at launch too (not in
    each worker after the weights loaded); NGRAM's tree is named by NGRAM's own flag."""
    kw, pattern = SERVER_REFUSALS[case]
    if kw.get("speculative_algorithm") == "EAGLE":
        kw = {**kw, "speculative_draft_model_path": str(tiny_model)}
    sa = _server_args(tiny_model, **{"attention_backend": "mlab_torch", "page_size": 16, **kw})
    with pytest.raises(SettingsError, match=pattern):
        sa.check_server_args()


def test_eagle_chain_with_sglangs_draft_backend_is_accepted(
    tiny_model: Path, on_h100: Capability
) -> None:
    """Our name serves the target, SGLang's own backend the draft: accepted. Our name as the
    draft's is what SGLang's draft worker refuses (after the target's weights loaded), which
    is why the launch check refuses it first."""
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    kw = {
        "attention_backend": "mlab_torch",
        "page_size": 16,
        "speculative_algorithm": "EAGLE",
        "speculative_eagle_topk": 1,
        "speculative_num_steps": 3,
        "speculative_num_draft_tokens": 4,
        "speculative_draft_model_path": str(tiny_model),
    }
    _server_args(tiny_model, **kw, speculative_draft_attention_backend="triton").check_server_args()
    sa = _server_args(tiny_model, **kw)
    draft_runner = SimpleNamespace(model_config=SimpleNamespace(hf_config=None))
    factory = DraftBackendFactory(sa, draft_runner, 1, 3)
    with pytest.raises(ValueError, match="EAGLE is not supported in decode attention backend"):
        factory.create_decode_backend()


def test_start_up_check_refuses_a_model_without_mla(tmp_path: Path, on_h100: Capability) -> None:
    llama = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(llama))
    sa = _server_args(tmp_path, attention_backend="mlab_triton", page_size=16)
    with pytest.raises(SettingsError, match=r"mlab_triton serves MLA models.*attention is MHA"):
        sa.check_server_args()


def test_a_v32_checkpoint_under_our_name_is_refused_at_launch(
    tmp_path: Path, on_h100: Capability, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DeepSeek-V3.2 (DSA) config with our name passed the launch check and was refused
    by each worker's pool check, after the weights were loaded (minutes at 671B)."""
    # SGLang's DSA defaults ask for the GPU's capability
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    v32 = dict(TINY_DSV3, architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
               index_topk=64, index_head_dim=128, index_n_heads=4)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(v32))
    sa = _server_args(tmp_path, attention_backend="mlab_triton", page_size=64)
    with pytest.raises(SettingsError, match=r"DeepSeek-V3.2 \(DSA\) model; serve it with "
                       r"--attention-backend dsa and MLAB_DSA_SPARSE"):  # fmt: skip
        sa.check_server_args()


@pytest.mark.parametrize(
    "kw",
    [
        {"attention_backend": "mlab_triton", "page_size": 64},
        {"attention_backend": "mlab_triton", "page_size": 1, "kv_cache_dtype": "fp8_e4m3"},
        {"attention_backend": "mlab_torch", "page_size": 16},
    ],
    ids=["triton-p64", "triton-fp8-p1", "torch-p16"],
)
def test_start_up_check_accepts_settings_that_run(
    kw: dict[str, Any], tiny_model: Path, on_h100: Capability
) -> None:
    sa = _server_args(tiny_model, **kw)
    sa.check_server_args()
    assert (sa.attention_backend, sa.page_size) == (kw["attention_backend"], kw["page_size"])


@pytest.mark.parametrize(
    ("backend", "page", "fp8", "pattern"),
    [
        ("mlab_flashmla", 16, False, r"--page-size 64"),
        ("mlab_flashmla", 64, True, r"flashmla needs kv_dtype"),
        ("mlab_flashmla", 16, True, r"Start SGLang with --page-size 64 and --kv-cache-dtype bf16"),
        ("mlab_cutlass", 128, False, r"CUTLASS MLA needs SM 100, found .*SM90"),
        ("mlab_triton", 8, False, r"--page-size 8: mla-backends takes page sizes"),
    ],
    ids=["flashmla-page16", "flashmla-fp8", "flashmla-page16-fp8", "cutlass-sm90", "page8"],
)
def test_factory_refuses_with_our_reason_not_a_skip(
    backend: str, page: int, fp8: bool, pattern: str, on_h100: Capability
) -> None:
    """The kit turns AssertionError / ImportError from a factory into a skip; ours raise."""
    case = ks.decode_case("refused", backend, 4, page, (page + 1,))
    with pytest.raises(SettingsError, match=pattern):
        ks.run_case(case, fp8=fp8, max_context_len=4 * page, **DSV3_KIT)


def test_factory_refuses_kv_scale_not_one() -> None:
    adapter, runner = _adapter("mlab_torch", page=16, dims=(4, 32, 16, 16, 16))
    layer = _mqa_layer(adapter)
    layer.k_scale_float = 0.5
    fb = _extend_batch(runner, 16, (3,), (2,))
    adapter.init_forward_metadata(fb)
    q = torch.zeros(2, 4 * 48, dtype=torch.bfloat16)
    with pytest.raises(SettingsError, match=r"k_scale=0.5: SGLang's own KV writers ignore it"):
        with forward_context(ForwardContext(attn_backend=adapter)):
            layer(q, None, None, fb, save_kv_cache=False)


# ---------------------------------------------------------------------------------- settings
def _settings_config(**kw: Any) -> Any:
    from mla_backends.config import TINY
    from mla_backends.integrations.sglang.settings import settings_config

    base = {
        "page_size": 16,
        "kv_cache_dtype": torch.bfloat16,
        "kv_flag": "auto",
        "dtype": torch.bfloat16,
        "dims": TINY,
        "backend": "torch",
        "device": torch.device("cpu"),
    }
    return settings_config(**{**base, **kw})


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"kv_cache_dtype": None, "kv_flag": "auto"}, r"--kv-cache-dtype auto \(None\) is not"),
        ({"dtype": torch.float8_e4m3fn}, r"model dtype torch.float8_e4m3fn: use --dtype"),
    ],
    ids=["kv-none", "fp8-activations"],
)
def test_settings_refuse_dtypes_naming_the_flag(kw: dict[str, Any], pattern: str) -> None:
    """Refused as SettingsError naming SGLang's flag, not as Config's own error later."""
    with pytest.raises(SettingsError, match=pattern):
        _settings_config(**kw)


def test_settings_keep_the_runners_sizes_and_lift_an_empty_pool_to_one_page() -> None:
    """A pool smaller than one page (size // page_size = 0) still builds a Config."""
    cfg = _settings_config(num_pages=0, max_requests=3, max_context_len=7)
    assert (cfg.num_pages, cfg.max_requests, cfg.max_context_len) == (1, 3, 7)


def test_refusal_names_the_first_page_size_that_runs(on_h100: Capability) -> None:
    from mla_backends.backends.base import BackendCaps, MLABackend
    from mla_backends.backends.registry import _REGISTRY, register_backend
    from mla_backends.integrations.sglang.settings import refusal

    @register_backend("pages_32_64_test")
    class Pages(MLABackend):
        name = "pages_32_64_test"
        caps = BackendCaps(page_sizes=(32, 64))

        def _build_metadata(self, batch):  # type: ignore[no-untyped-def]
            return None

        def _attend_absorbed(self, *a):  # type: ignore[no-untyped-def]
            raise AssertionError

    try:
        cfg = _settings_config(backend="pages_32_64_test")
        msg = refusal("mlab_pages", "pages_32_64_test", cfg, on_h100, "decode")
        assert msg is not None and "Start SGLang with --page-size 32 (it takes [32, 64])" in msg
    finally:
        del _REGISTRY["pages_32_64_test"]


@pytest.mark.parametrize("ratio", [1.0 + 1e-6, 1.0 + 1e-4])
def test_model_dims_takes_a_scale_just_above_the_plain_one(ratio: float) -> None:
    """A YaRN mscale a hair above 1 is expressed (within 1e-9), not refused."""
    mc = SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                         v_head_dim=128, scaling=192**-0.5 * ratio)  # fmt: skip
    dims = binding.model_dims(mc, 16)
    assert math.isclose(dims.softmax_scale, mc.scaling, rel_tol=1e-9)


def test_model_dims_refuses_a_scale_just_below_the_plain_one() -> None:
    mc = SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                         v_head_dim=128, scaling=192**-0.5 * (1.0 - 1e-6))  # fmt: skip
    with pytest.raises(SettingsError, match=r"is below \(qk_nope \+ qk_rope\)\^-0.5"):
        binding.model_dims(mc, 16)


# ---------------------------------------------------------------------------------- helpers
def _adapter(
    backend: str,
    page: int,
    dims: tuple[int, int, int, int, int] = (4, 512, 64, 512, 512),
    fp8: bool = False,
    batch: int = 4,
    max_ctx: int = 64,
    device: str = "cpu",
) -> tuple[Any, Any]:
    """(adapter, runner) over the kit's MockMLAModelRunner with dims (H, L, R, P, V)."""
    h, lat, r, p, v = dims
    mc = kit.TinyMLAModelConfig(
        num_heads=h, kv_lora_rank=lat, qk_rope_head_dim=r, hidden_size=64, context_len=max_ctx
    )
    mc.qk_nope_head_dim, mc.v_head_dim, mc.scaling = p, v, (p + r) ** -0.5
    case = ks.decode_case("adapter", backend, h, page, (1,) * batch)
    runner = kit.MockMLAModelRunner(
        case=case,
        model_config=mc,
        dtype=torch.bfloat16,
        device=device,
        max_context_len=max_ctx,
        kv_lora_rank=lat,
        qk_rope_head_dim=r,
        fp8_kv_cache=fp8,
        runner_batch_size=batch,
    )
    return ATTENTION_BACKENDS[backend](runner), runner


def _mqa_layer(adapter: Any) -> Any:
    d = adapter.dims
    return RadixAttention(
        d.num_heads,
        d.kv_dim,
        d.softmax_scale,
        num_kv_heads=1,
        layer_id=0,
        v_head_dim=d.kv_lora_rank,
    )


def _mha_layer(adapter: Any) -> Any:
    d = adapter.dims
    return RadixAttention(
        d.num_heads,
        d.qk_head_dim,
        d.softmax_scale,
        num_kv_heads=d.num_heads,
        layer_id=0,
        v_head_dim=d.v_head_dim,
    )


def _fill_table(runner: Any, page: int, seq_lens: tuple[int, ...], gen: torch.Generator) -> None:
    """Request i (row i) gets pages 1.. in shuffled order (a non-monotonic table)."""
    r2t = runner.req_to_token_pool.req_to_token
    table = r2t.cpu()
    pages = torch.randperm(sum(-(-s // page) for s in seq_lens), generator=gen) + 1
    k = 0
    for i, s in enumerate(seq_lens):
        for pos in range(s):
            if pos % page == 0:
                base = int(pages[k]) * page
                k += 1
            table[i, pos] = base + pos % page
    r2t.copy_(table)


def _extend_batch(
    runner: Any, page: int, prefix: tuple[int, ...], ext: tuple[int, ...], seed: int = 0
) -> Any:
    """An SGLang EXTEND ForwardBatch over requests 0..B-1 (int64 rows, as serving passes)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    gen = torch.Generator().manual_seed(seed)
    seq = tuple(p + n for p, n in zip(prefix, ext))
    _fill_table(runner, page, seq, gen)
    r2t = runner.req_to_token_pool.req_to_token
    dev = r2t.device
    loc = torch.cat([r2t[i, p:s].long() for i, (p, s) in enumerate(zip(prefix, seq))])
    pos = torch.cat([torch.arange(p, s) for p, s in zip(prefix, seq)]).to(dev)
    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(seq),
        input_ids=torch.zeros(sum(ext), dtype=torch.int64, device=dev),
        req_pool_indices=torch.arange(len(seq), dtype=torch.int64, device=dev),
        seq_lens=torch.tensor(seq, dtype=torch.int64, device=dev),
        seq_lens_cpu=torch.tensor(seq, dtype=torch.int64),
        out_cache_loc=loc,
        seq_lens_sum=sum(seq),
        positions=pos,
    )
    fb.extend_prefix_lens = torch.tensor(prefix, dtype=torch.int64, device=dev)
    fb.extend_prefix_lens_cpu = list(prefix)
    fb.extend_seq_lens = torch.tensor(ext, dtype=torch.int64, device=dev)
    fb.extend_seq_lens_cpu = list(ext)
    fb.extend_num_tokens = sum(ext)
    return fb


def _rows(runner: Any, slots: torch.Tensor) -> torch.Tensor:
    pool = runner.token_to_kv_pool
    return pool.get_key_buffer(0)[slots.long(), 0].float()


# ---------------------------------------------------------------------------------- conversion
def test_pools_are_wrapped_not_copied() -> None:
    for fp8 in (False, True):
        adapter, runner = _adapter("mlab_torch", page=16, fp8=fp8)
        ours, sgl = adapter.binding.kv_pool, runner.token_to_kv_pool
        assert ours.kv_buffer[0].data_ptr() == sgl.kv_buffer[0].data_ptr()
        assert ours.kv_buffer[0].dtype == sgl.dtype
        assert ours.num_slots % 16 == 0 and ours.num_slots <= sgl.kv_buffer[0].shape[0]
        assert adapter.binding.req_pool.req_to_token is runner.req_to_token_pool.req_to_token
        sgl.kv_buffer[0][17, 0, 3] = torch.tensor(1.5, dtype=sgl.dtype).view(sgl.store_dtype)
        assert float(ours.kv_buffer[0][17, 3]) == 1.5


def test_eager_batch_conversion() -> None:
    adapter, runner = _adapter("mlab_torch", page=16, dims=(4, 32, 16, 16, 16))
    fb = _extend_batch(runner, 16, (0, 5, 17), (4, 1, 2))
    adapter.init_forward_metadata(fb)
    b = adapter.forward_metadata.batch
    assert b.mode.name == "EXTEND" and b.req_pool_indices.dtype == torch.int32
    assert b.seq_lens.tolist() == [4, 6, 19] and b.seq_lens_cpu.tolist() == [4, 6, 19]
    assert b.extend_prefix_lens.tolist() == [0, 5, 17] == b.extend_prefix_lens_cpu.tolist()
    assert b.extend_seq_lens.tolist() == [4, 1, 2]
    lens = (b.seq_lens, b.seq_lens_cpu, b.extend_prefix_lens, b.extend_prefix_lens_cpu)
    lens += (b.extend_seq_lens, b.extend_seq_lens_cpu)  # SGLang's: int64 tensors and lists
    assert [t.dtype for t in lens] == [torch.int32] * 6
    assert torch.equal(b.out_cache_loc, fb.out_cache_loc)
    lay = adapter.forward_metadata.new_tokens
    assert lay.qo_indptr_cpu.tolist() == [0, 4, 5, 7] == lay.kv_indptr.tolist()


# SGLang's forward modes -> ours; None: refused in one line (the draft model's attention,
# diffusion's non-causal extend, a prebuilt cache, IDLE, which the hooks answer before).
SGL_MODES = {
    "EXTEND": "EXTEND",
    "MIXED": "EXTEND",
    "SPLIT_PREFILL": "EXTEND",
    "DECODE": "DECODE",
    "TARGET_VERIFY": "TARGET_VERIFY",
    "DRAFT_EXTEND_V2": None,
    "DLLM_EXTEND": None,
    "PREBUILT": None,
    "IDLE": None,
}


@pytest.mark.parametrize("name", [m.name for m in ForwardMode])
def test_every_sglang_forward_mode_maps_or_is_refused(name: str) -> None:
    from mla_backends.integrations.sglang.batches import _mode

    fb = SimpleNamespace(forward_mode=ForwardMode[name])
    want = SGL_MODES[name]  # a KeyError: a new SGLang mode this table must place
    if want is None:
        with pytest.raises(BatchError, match=f"forward mode {name} is not served"):
            _mode(fb)
    else:
        assert _mode(fb).name == want


@pytest.mark.parametrize("q_len", [1, 3], ids=["decode", "verify"])
def test_eager_decode_and_verify_conversion(q_len: int) -> None:
    """DECODE / TARGET_VERIFY batches carry no extend_* fields: ours derive them (q tokens a
    request, prefix = KV length - q, device and CPU copies alike); verify lengths gain the
    drafts, and `num_draft_tokens` is the draft count (0 in DECODE)."""
    from mla_backends.integrations.sglang.batches import eager_batch

    adapter, runner = _adapter("mlab_torch", page=16, dims=(4, 32, 16, 16, 16))
    fb = _extend_batch(runner, 16, (9, 20), (q_len, q_len), seed=1)
    fb.forward_mode = ForwardMode.DECODE if q_len == 1 else ForwardMode.TARGET_VERIFY
    if q_len > 1:  # SGLang's verify seq_lens exclude the draft tokens
        fb.seq_lens, fb.seq_lens_cpu = fb.seq_lens - q_len, fb.seq_lens_cpu - q_len
    b = eager_batch(fb)
    kv = [9 + q_len, 20 + q_len]
    assert b.seq_lens.tolist() == kv and b.seq_lens_cpu.tolist() == kv
    assert b.extend_prefix_lens.tolist() == [9, 20] == b.extend_prefix_lens_cpu.tolist()
    assert b.extend_seq_lens.tolist() == [q_len] * 2 == b.extend_seq_lens_cpu.tolist()
    assert b.num_draft_tokens == (q_len if q_len > 1 else 0)
    assert torch.equal(b.out_cache_loc, fb.out_cache_loc) and b.out_cache_loc.dtype == torch.int64


def _graph_view(fb: Any, bs: int, pad: int, mode: Any) -> SimpleNamespace:
    """SGLang's replay view (decode_cuda_graph_runner.build_replay_fb_view): padded request
    rows 0 with seq_len 1, live (unpadded) out_cache_loc."""
    n = bs - pad
    q = fb.input_ids.numel() // n
    return SimpleNamespace(
        batch_size=bs,
        forward_mode=mode,
        input_ids=torch.zeros(bs * q, dtype=torch.int64),
        positions=torch.zeros(bs * q, dtype=torch.int64),
        req_pool_indices=torch.cat([fb.req_pool_indices, torch.zeros(pad, dtype=torch.int64)]),
        seq_lens=torch.cat([fb.seq_lens, torch.ones(pad, dtype=torch.int64)]),
        seq_lens_cpu=torch.cat([fb.seq_lens_cpu, torch.ones(pad, dtype=torch.int64)]),
        seq_lens_sum=None,
        num_padding=pad,
        out_cache_loc=fb.out_cache_loc,
        spec_info=None,
    )


@pytest.mark.parametrize("q_len", [1, 3], ids=["decode", "verify"])
def test_graph_replay_view_padding(q_len: int) -> None:
    """Capture at 4 requests, replay 2 real + 2 padded: padded tokens point at slot 0, padded
    rows at request row 0 with the fill length; verify lengths gain the draft tokens; the
    static buffers keep their addresses; real rows match eager."""
    adapter, runner = _adapter("mlab_torch", page=16, dims=(4, 32, 16, 16, 16), batch=4)
    mode = ForwardMode.DECODE if q_len == 1 else ForwardMode.TARGET_VERIFY
    fb = _extend_batch(runner, 16, (9, 20), (q_len, q_len), seed=1)
    fb.forward_mode = mode
    if q_len > 1:  # SGLang's verify seq_lens exclude the draft tokens
        fb.seq_lens, fb.seq_lens_cpu = fb.seq_lens - q_len, fb.seq_lens_cpu - q_len
    layer = _mqa_layer(adapter)
    d = adapter.dims
    gen = torch.Generator().manual_seed(2)
    runner.token_to_kv_pool.kv_buffer[0].copy_(
        torch.randn(runner.token_to_kv_pool.kv_buffer[0].shape, generator=gen).bfloat16()
    )
    q = torch.randn(4 * q_len, d.num_heads * d.kv_dim, generator=gen).bfloat16()
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=adapter)):
        adapter.init_forward_metadata(fb)
        eager = layer(q[: 2 * q_len], None, None, fb, save_kv_cache=False).clone()
        adapter.init_cuda_graph_state(4, 4 * q_len)
        cap = _graph_view(fb, 4, 2, mode)
        cap.num_padding, cap.out_cache_loc = 0, torch.zeros(4 * q_len, dtype=torch.int64)
        adapter.init_forward_metadata_out_graph(cap, in_capture=True)
        ptr = adapter.forward_metadata.batch.seq_lens.data_ptr()
        adapter.init_forward_metadata_out_graph(_graph_view(fb, 4, 2, mode))
        adapter.init_forward_metadata_in_graph(_graph_view(fb, 4, 2, mode))
        b = adapter.forward_metadata.batch
        replay = layer(q, None, None, fb, save_kv_cache=False)
    assert b.seq_lens.data_ptr() == ptr
    assert b.req_pool_indices.tolist() == [0, 1, 0, 0]
    want = [9 + q_len, 20 + q_len] + ([1, 1] if q_len == 1 else [1 + q_len] * 2)
    assert b.seq_lens.tolist() == want and b.seq_lens_cpu.tolist() == want
    pre = [s - q_len for s in want]  # the KV each request had before this step
    assert b.extend_prefix_lens.tolist() == pre == b.extend_prefix_lens_cpu.tolist()
    assert b.extend_seq_lens.tolist() == [q_len] * 4 == b.extend_seq_lens_cpu.tolist()
    assert b.out_cache_loc[2 * q_len :].eq(0).all()
    assert torch.equal(b.out_cache_loc[: 2 * q_len], fb.out_cache_loc)
    assert b.num_draft_tokens == (q_len if q_len > 1 else 0)
    torch.testing.assert_close(replay[: 2 * q_len], eager, atol=0, rtol=0)


# ---------------------------------------------------------------------------------- both shapes
SMALL = (4, 32, 16, 16, 16)  # H, L, R, P, V: every kernel's power-of-two limits hold
DSV3_DIMS = (16, 512, 64, 128, 128)
# (backend, device, page, dims): CPU in CI; the gpu-* ones run our GPU backends through the
# adapter at DeepSeek-V3 shapes (mlab_flashmla's extend and MHA run on its triton partner).
SHAPE_SETUPS = [
    pytest.param("mlab_torch", "cpu", 16, SMALL, id="mlab_torch"),
    pytest.param("mlab_triton", "cpu", 16, SMALL, marks=pytest.mark.interp, id="mlab_triton"),
    *(
        pytest.param(be, "cuda", 64, DSV3_DIMS, marks=pytest.mark.gpu, id=f"gpu-{be}")
        for be in ("mlab_triton", "mlab_flashinfer", "mlab_flashmla", "mlab_torch")
    ),
]


def _absorbed_reference(
    runner: Any, fb: Any, q_nope: torch.Tensor, q_rope: torch.Tensor, scale: float
) -> torch.Tensor:
    r2t = runner.req_to_token_pool.req_to_token.cpu()
    lat = q_nope.shape[-1]
    outs, t = [], 0
    for i, (p, n) in enumerate(zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)):
        rows = _rows(runner, r2t[i, : p + n]).cpu()
        q_n, q_r = q_nope[t : t + n].cpu(), q_rope[t : t + n].cpu()
        o, _ = absorbed(q_n, q_r, rows[:, :lat], rows[:, lat:], scale)
        outs.append(o)
        t += n
    return torch.cat(outs)


@pytest.mark.parametrize(("backend", "device", "page", "dims"), SHAPE_SETUPS)
@pytest.mark.parametrize("shape", ["split", "joined", "split-q-whole-k"])
def test_absorbed_call_shapes_store_and_attend(
    backend: str, device: str, page: int, dims: tuple[int, ...], shape: str
) -> None:
    """DeepSeek's two absorbed call shapes with the new rows given (save_kv_cache=True): our
    store writes them into SGLang's buffer at out_cache_loc, and the output matches the fp64
    absorbed reference over SGLang's pool. `split` (our names are in FORWARD_ABSORB): q_nope
    is a transposed bmm result (strided), q_rope / k_rope come as keyword arguments;
    `split-q-whole-k`: q split, k the whole L + R rows and no k_rope (SGLang's own MLA
    backends store such a k whole; ours once skipped the store)."""
    adapter, runner = _adapter(backend, page=page, dims=dims, max_ctx=4 * page, device=device)
    d = adapter.dims
    fb = _extend_batch(runner, page, (0, 7, page), (5, 1, 2), seed=3)
    t = sum(fb.extend_seq_lens_cpu)
    gen = torch.Generator().manual_seed(4)
    buf = runner.token_to_kv_pool.kv_buffer[0]
    buf.fill_(float("nan"))
    for i, p in enumerate(fb.extend_prefix_lens_cpu):
        prefix_slots = runner.req_to_token_pool.req_to_token[i, :p].long()
        buf[prefix_slots] = torch.randn(p, 1, d.kv_dim, generator=gen).bfloat16().to(device)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).bfloat16().to(device)

    q_nope = rnd(d.num_heads, t, d.kv_lora_rank).transpose(0, 1)
    q_rope = rnd(t, d.num_heads, d.qk_rope_head_dim)
    k_nope, k_rope = rnd(t, 1, d.kv_lora_rank), rnd(t, 1, d.qk_rope_head_dim)
    layer = _mqa_layer(adapter)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=adapter)):
        adapter.init_forward_metadata(fb)
        if shape == "split":
            out = layer(q_nope, k_nope, k_nope, fb, q_rope=q_rope, k_rope=k_rope)
        elif shape == "split-q-whole-k":
            k_whole = torch.cat([k_nope, k_rope], -1)
            out = layer(q_nope, k_whole, k_nope, fb, save_kv_cache=True, q_rope=q_rope)
        else:
            q = torch.cat([q_nope, q_rope], -1)
            out = layer(q, torch.cat([k_nope, k_rope], -1), k_nope, fb, save_kv_cache=True)
    stored = _rows(runner, fb.out_cache_loc)
    assert torch.equal(stored, torch.cat([k_nope, k_rope], -1)[:, 0].float())
    want = _absorbed_reference(runner, fb, q_nope, q_rope, d.softmax_scale)
    atol, rtol, _ = TOLERANCES["bfloat16"]
    got = out.view(t, d.num_heads, -1).double().cpu()
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_absorbed_call_refuses_to_drop_new_rows() -> None:
    """save_kv_cache with k of only the latent columns and no k_rope (a direct backend call:
    RadixAttention itself refuses that k): the rows cannot be stored, so the call is refused
    (it once attended over whatever the slots held)."""
    adapter, runner = _adapter("mlab_torch", page=16, dims=SMALL)
    d = adapter.dims
    fb = _extend_batch(runner, 16, (3,), (2,))
    q_nope = torch.randn(2, d.num_heads, d.kv_lora_rank).bfloat16()
    q_rope = torch.randn(2, d.num_heads, d.qk_rope_head_dim).bfloat16()
    k_nope = torch.randn(2, 1, d.kv_lora_rank).bfloat16()
    with forward_context(ForwardContext(attn_backend=adapter)):
        adapter.init_forward_metadata(fb)
        with pytest.raises(BatchError, match=r"k of 32 columns and no k_rope"):
            adapter.forward(q_nope, k_nope, k_nope, _mqa_layer(adapter), fb, True, q_rope=q_rope)


def test_absorbed_call_without_save_kv_cache_stores_nothing() -> None:
    """save_kv_cache=False with k and k_rope given (SGLang's rows are stored already, e.g. by
    a fused kernel): the pool is left as it was."""
    adapter, runner = _adapter("mlab_torch", page=16, dims=SMALL)
    d = adapter.dims
    fb = _extend_batch(runner, 16, (3,), (2,))
    gen = torch.Generator().manual_seed(4)
    q_nope = torch.randn(2, d.num_heads, d.kv_lora_rank, generator=gen).bfloat16()
    q_rope = torch.randn(2, d.num_heads, d.qk_rope_head_dim, generator=gen).bfloat16()
    k_nope = torch.randn(2, 1, d.kv_lora_rank, generator=gen).bfloat16()
    k_rope = torch.randn(2, 1, d.qk_rope_head_dim, generator=gen).bfloat16()
    buf = runner.token_to_kv_pool.kv_buffer[0]
    before = buf.clone()
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=adapter)):
        adapter.init_forward_metadata(fb)
        adapter.forward(
            q_nope, k_nope, k_nope, _mqa_layer(adapter), fb, False, q_rope=q_rope, k_rope=k_rope
        )
    assert torch.equal(buf, before)


def test_mha_call_asked_to_save_kv_cache_is_refused() -> None:
    """An MHA-mode call (per-head K and V) with save_kv_cache=True: the expanded K has no
    place in the latent pool, and going on would leave the new tokens unstored while the
    caller believes them cached. Refused, and the pool is left as it was."""
    adapter, runner = _adapter("mlab_torch", page=16, dims=SMALL)
    d = adapter.dims
    fb = _extend_batch(runner, 16, (0,), (3,))
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(3, d.num_heads, d.qk_head_dim, generator=gen).bfloat16()
    k = torch.randn(3, d.num_heads, d.qk_head_dim, generator=gen).bfloat16()
    v = torch.randn(3, d.num_heads, d.v_head_dim, generator=gen).bfloat16()
    buf = runner.token_to_kv_pool.kv_buffer[0]
    before = buf.clone()
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=adapter)):
        adapter.init_forward_metadata(fb)
        with pytest.raises(BatchError, match="MHA-mode call with save_kv_cache=True"):
            adapter.forward(q, k, v, _mha_layer(adapter), fb, True)
    assert torch.equal(buf, before)


def test_kv_buffers_re_created_by_sglang_are_refused() -> None:
    """Our pool views SGLang's KV tensors; if SGLang re-allocates one (same count, e.g. on
    releasing and resuming memory), the views read freed memory: the next batch is refused."""
    adapter, runner = _adapter("mlab_torch", page=16, dims=SMALL)
    fb = _extend_batch(runner, 16, (3,), (2,))
    adapter.init_forward_metadata(fb)
    bufs = runner.token_to_kv_pool.kv_buffer
    bufs[0] = bufs[0].clone()
    with pytest.raises(RuntimeError, match="re-created its KV buffers"):
        adapter.init_forward_metadata(fb)


@pytest.mark.parametrize(
    "name", ["cos_sin_cache", "is_neox", "llama_4_scaling", "topk_indices", "sinks"]
)
def test_keyword_arguments_of_other_backends_are_refused(name: str) -> None:
    """DeepSeek passes these only to other backends (fused rope, DSA top-k, attention
    sinks); ours would ignore them, so a call with one is refused, naming it."""
    adapter, runner = _adapter("mlab_torch", page=16, dims=SMALL)
    d = adapter.dims
    fb = _extend_batch(runner, 16, (3,), (2,))
    q = torch.randn(2, d.num_heads * d.kv_dim).bfloat16()
    with forward_context(ForwardContext(attn_backend=adapter)):
        adapter.init_forward_metadata(fb)
        with pytest.raises(BatchError, match=rf"does not take \['{name}'\]"):
            adapter.forward(q, None, None, _mqa_layer(adapter), fb, False, **{name: True})


def test_mha_lse_comes_back_contiguous(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's merge_state reads the LSE as a contiguous [T, H] buffer; a backend may give a
    transposed view (a kernel's [H, T] output): the adapter hands back a contiguous one."""
    adapter, runner = _adapter("mlab_torch", page=16, dims=SMALL)
    d = adapter.dims
    fb = _extend_batch(runner, 16, (0,), (3,))
    inner = adapter.backend.forward_mha

    def transposed_lse(*args: Any, **kwargs: Any) -> Any:
        out, lse = inner(*args, **kwargs)
        return out, lse.t().contiguous().t()  # the same [T, H] values, strides (1, T)

    monkeypatch.setattr(adapter.backend, "forward_mha", transposed_lse)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(3, d.num_heads, d.qk_head_dim, generator=gen).bfloat16()
    k = torch.randn(3, d.num_heads, d.qk_head_dim, generator=gen).bfloat16()
    v = torch.randn(3, d.num_heads, d.v_head_dim, generator=gen).bfloat16()
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=adapter)):
        adapter.init_forward_metadata(fb)
        fb.mha_return_lse = True
        _, lse = _mha_layer(adapter)(q, k, v, fb, save_kv_cache=False)
    assert lse.shape == (3, d.num_heads) and lse.is_contiguous()


def test_adapter_builds_its_attention_tp_share_of_the_heads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under attention TP a worker's layers hold num_heads / attn_tp_size heads: the adapter
    builds our backend for that share (2 of the model's 4 heads at attention TP 2)."""
    from sglang.srt import runtime_context

    par = SimpleNamespace(attn_tp_size=2, dcp_enabled=False)
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: par)
    adapter, _ = _adapter("mlab_torch", page=16, dims=SMALL)
    assert adapter.dims.num_heads == 2


def test_idle_batch_clears_the_metadata() -> None:
    """DP attention runs IDLE batches (no requests) on idle ranks: every metadata hook
    answers with no metadata instead of refusing the mode."""
    adapter, runner = _adapter("mlab_torch", page=16, dims=SMALL)
    fb = _extend_batch(runner, 16, (3,), (2,))
    adapter.init_forward_metadata(fb)
    fb.forward_mode = ForwardMode.IDLE
    adapter.init_forward_metadata(fb)
    assert adapter.forward_metadata is None
    adapter.init_cuda_graph_state(4, 4)
    adapter.init_forward_metadata_out_graph(fb)
    adapter.init_forward_metadata_in_graph(fb)
    assert adapter.forward_metadata is None


def _hybrid(runner: Any, layer_ids: list[int], inner: Any = None) -> Any:
    """SGLang's Kimi-Linear pool: a HybridLinearKVPool(use_mla=True) whose full-attention
    layers (ids `layer_ids`) are the runner's MLATokenToKVPool (or `inner`)."""
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

    pool = runner.token_to_kv_pool
    return HybridLinearKVPool(
        size=pool.size,
        dtype=pool.dtype,
        page_size=pool.page_size,
        head_num=1,
        head_dim=pool.kv_lora_rank + pool.qk_rope_head_dim,
        full_attention_layer_ids=layer_ids,
        device=str(pool.device),
        mamba_pool=None,
        use_mla=True,
        kv_lora_rank=pool.kv_lora_rank,
        qk_rope_head_dim=pool.qk_rope_head_dim,
        full_kv_pool=pool if inner is None else inner,
    )


def test_hybrid_linear_model_pool_maps_layer_ids() -> None:
    """Kimi-Linear in SGLang: the MLA layers' rows live in a HybridLinearKVPool's inner
    MLATokenToKVPool, indexed by the layer's place among the full-attention layers, not by
    its id. Our backend wraps the inner pool (views) and a layer with id 5 (the pool's only
    full-attention layer) stores into and reads that pool's layer 0, the same as a plain
    pool's layer 0, called through SGLang's HybridLinearAttnBackend; an id that is not a
    full-attention layer is refused."""
    plain, runner = _adapter("mlab_torch", page=16, dims=SMALL)
    n_layers = len(runner.token_to_kv_pool.kv_buffer)
    ids = [5 + 4 * i for i in range(n_layers)]  # e.g. every fourth layer full attention
    sgl_pool = runner.token_to_kv_pool
    runner.token_to_kv_pool = _hybrid(runner, ids)
    hybrid = ATTENTION_BACKENDS["mlab_torch"](runner)
    ours = hybrid.binding.kv_pool
    assert ours.kv_buffer[0].data_ptr() == sgl_pool.kv_buffer[0].data_ptr()
    d = hybrid.dims
    fb = _extend_batch(runner, 16, (0, 7), (5, 2), seed=5)
    t = sum(fb.extend_seq_lens_cpu)
    gen = torch.Generator().manual_seed(6)
    q_nope, q_rope = (torch.randn(t, d.num_heads, w, generator=gen).bfloat16() for w in (32, 16))
    k_nope, k_rope = (torch.randn(t, 1, w, generator=gen).bfloat16() for w in (32, 16))
    # SGLang's own wrapper for hybrid models: full-attention layers to our backend
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend

    linear = SimpleNamespace(needs_cpu_seq_lens=False, init_forward_metadata=lambda fb: None)
    wrapper = HybridLinearAttnBackend(hybrid, linear, ids)  # type: ignore[arg-type]
    outs = []
    for adapter, lid in ((wrapper, ids[0]), (plain, 0)):
        sgl_pool.kv_buffer[0].fill_(float("nan"))
        sgl_pool.kv_buffer[0][runner.req_to_token_pool.req_to_token[1, :7].long()] = 0.5
        layer = _mqa_layer(hybrid)
        layer.layer_id = lid
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=adapter)):
            adapter.init_forward_metadata(fb)
            outs.append(layer(q_nope, k_nope, k_nope, fb, q_rope=q_rope, k_rope=k_rope))
        stored = sgl_pool.kv_buffer[0][fb.out_cache_loc, 0]
        assert torch.equal(stored, torch.cat([k_nope, k_rope], -1)[:, 0])
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])
    layer = _mqa_layer(hybrid)
    layer.layer_id = 6  # a linear-attention layer: no rows in this pool
    with forward_context(ForwardContext(attn_backend=hybrid)):
        hybrid.init_forward_metadata(fb)
        with pytest.raises(BatchError, match="layer 6 is outside this rank's KV pool layers"):
            layer(q_nope, k_nope, k_nope, fb, q_rope=q_rope, k_rope=k_rope)


def test_hybrid_pool_other_than_plain_mla_is_refused() -> None:
    """A hybrid model whose full-attention rows are not a plain MLATokenToKVPool (the unified
    memory pool's) is refused at the factory, naming the pool."""

    class UnifiedMLATokenToKVPool:  # stands in for SGLang's (built over a shared buffer)
        def get_kv_size_bytes(self) -> int:
            return 0

    _, runner = _adapter("mlab_torch", page=16, dims=SMALL)
    runner.token_to_kv_pool = _hybrid(runner, [0], inner=UnifiedMLATokenToKVPool())
    with pytest.raises(SettingsError, match="are in UnifiedMLATokenToKVPool"):
        ATTENTION_BACKENDS["mlab_torch"](runner)


@pytest.mark.parametrize(("backend", "device", "page", "dims"), SHAPE_SETUPS)
def test_mha_prefill_and_chunked_prefix_with_lse(
    backend: str, device: str, page: int, dims: tuple[int, ...]
) -> None:
    """The MHA-mode layer (head_dim P + R, H KV heads, strided v): causal over the new tokens,
    then non-causal against prefix chunks with LSE asked, as DeepSeek's MHA_CHUNKED_KV does.
    Chunk 2 has no rows for two requests: out 0, lse -inf there. LSE is natural log."""
    adapter, runner = _adapter(backend, page=page, dims=dims, max_ctx=4 * page, device=device)
    d = adapter.dims
    h, dqk, dv = d.num_heads, d.qk_head_dim, d.v_head_dim
    prefix, ext = (0, 5, 9), (3, 2, 4)
    fb = _extend_batch(runner, page, prefix, ext, seed=5)
    chunk_lens = torch.tensor([[0, 4, 4], [0, 1, 4], [0, 0, 1]], dtype=torch.int32)
    fb.num_prefix_chunks = 3
    fb.prefix_chunk_seq_lens_cpu = chunk_lens
    cu = torch.zeros(3, 4, dtype=torch.int32)
    cu[:, 1:] = chunk_lens.cumsum(1)
    fb.prefix_chunk_cu_seq_lens = cu.to(device)
    t = sum(ext)
    gen = torch.Generator().manual_seed(6)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).bfloat16()

    q = rnd(t, h, dqk)
    kv = rnd(t, h, d.qk_nope_head_dim + dv)  # kv_b_proj output: v is a strided view
    k = torch.cat([kv[..., : d.qk_nope_head_dim], rnd(t, h, d.qk_rope_head_dim)], -1)
    v = kv[..., d.qk_nope_head_dim :]
    layer = _mha_layer(adapter)
    atol, rtol, lse_tol = TOLERANCES["bfloat16"]
    qo = [0, 3, 5, 9]

    def per_request(kk: torch.Tensor, vv: torch.Tensor, kvp: list[int], causal: bool) -> Any:
        ref = [
            mha(
                q[qo[b] : qo[b + 1]],
                kk[kvp[b] : kvp[b + 1]],
                vv[kvp[b] : kvp[b + 1]],
                d.softmax_scale,
                causal=causal,
            )
            for b in range(3)
        ]
        return torch.cat([o for o, _ in ref]), torch.cat([s for _, s in ref])

    dev = torch.device(device)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=adapter)):
        adapter.init_forward_metadata(fb)
        adapter.init_mha_chunk_metadata(fb)
        chunks = adapter.forward_metadata.chunks
        assert [chunks[i].kv_indptr.tolist() for i in range(3)] == cu.tolist()
        fb.mha_return_lse = True
        fb.set_attn_attend_prefix_cache(False)
        out, lse = layer(q.to(dev), k.to(dev), v.to(dev), fb, save_kv_cache=False)
        want_o, want_l = per_request(k, v, qo, causal=True)
        torch.testing.assert_close(out.double().cpu(), want_o, atol=atol, rtol=rtol)
        torch.testing.assert_close(lse.double().cpu(), want_l, atol=lse_tol, rtol=0)
        for i in range(3):
            n = int(chunk_lens[i].sum())
            kc, vc = rnd(n, h, dqk), rnd(n, h, dv)
            fb.set_attn_attend_prefix_cache(True)
            fb.set_prefix_chunk_idx(i)
            oc, lc = layer(q.to(dev), kc.to(dev), vc.to(dev), fb, save_kv_cache=False)
            assert lc.dtype == torch.float32 and lc.shape == (t, h) and lc.is_contiguous()
            want_o, want_l = per_request(kc, vc, [0, *chunk_lens[i].cumsum(0).tolist()], False)
            torch.testing.assert_close(oc.double().cpu(), want_o, atol=atol, rtol=rtol)
            torch.testing.assert_close(lc.double().cpu(), want_l, atol=lse_tol, rtol=0)
    lc = lc.cpu()
    assert torch.isinf(lc[:5]).all() and (lc[:5] < 0).all() and oc[:5].eq(0).all()
    assert math.isfinite(float(lc[5:].max()))


def test_deepseek_routing_for_our_names() -> None:
    """Prompts without a cached prefix run MHA-mode, short prefixes absorbed, long prefixes
    chunked MHA (SGLang's policy for flashinfer / fa3); decode always absorbed."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
    )
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import (
        AttnForwardMethod,
    )

    adapter, runner = _adapter("mlab_torch", page=16, dims=SMALL)
    attn = SimpleNamespace(
        chunked_prefix_cache_threshold=8,
        disable_chunked_prefix_cache=False,
        flashinfer_mla_disable_ragged=False,
    )
    handler = AttentionBackendRegistry.get_handler("mlab_triton")
    got = {}
    for name, prefix in (("fresh", (0, 0)), ("short", (3, 0)), ("long", (9, 4))):
        fb = _extend_batch(runner, 16, prefix, (2, 2))
        got[name] = handler(attn, fb)
    fb.forward_mode = ForwardMode.DECODE
    got["decode"] = handler(attn, fb)
    mha_, mla = AttnForwardMethod.MHA_CHUNKED_KV, AttnForwardMethod.MLA
    assert got == {"fresh": mha_, "short": mla, "long": mha_, "decode": mla}


# ---------------------------------------------------------------------------------- the kit
@pytest.mark.parametrize("case", kit.make_mla_cases("mlab_torch"), ids=lambda c: c.name)
def test_kit_default_cases_mlab_torch(case: Any) -> None:
    ks.run_case(case, **CPU)


def test_kit_cuda_graph_decode_mode_mlab_torch() -> None:
    from sglang.test.kits.attention_unittest.runner_modes import cuda_graph_decode_runner as cg

    case = ks.decode_case("cg", "mlab_torch", 4, 16, (14, 15, 16))
    cg.run_mla_cuda_graph_decode_case(ks.KitTestCase(), case, **CPU)


def test_kit_eagle_verify_mlab_torch() -> None:
    """Chain drafts (topk 1): the kit's eager verify and its CUDA-graph verify mode."""
    from sglang.test.kits.attention_unittest.runner_modes import (
        speculative_target_verify_runner as tv,
    )

    case = ks.verify_case("verify_chain", "mlab_torch", 4, 16, (13, 16, 30), 3)
    tv.run_mla_eagle_verify_case(ks.KitTestCase(), case, topk=1, **CPU)
    ks.run_verify_cuda_graph(case, **CPU)


def test_eagle_verify_input_without_seq_lens_sum() -> None:
    """After SGLang filters or merges a running batch its seq_lens_sum is None; EAGLE's
    verify-input builder then sizes the tree mask by bs * attn_backend.max_context_len."""
    from sglang.srt.speculative import eagle_worker_common as ewc
    from sglang.srt.speculative.eagle_utils import TreeMaskMode

    adapter, runner = _adapter("mlab_torch", page=16, dims=SMALL, max_ctx=64)
    seen: list[int] = []

    class Built(Exception):
        pass

    def build_tree(*args: Any, **kwargs: Any) -> None:
        seen.append(args[5])  # seq_lens_sum
        raise Built

    batch = SimpleNamespace(
        forward_mode=ForwardMode.DECODE, seq_lens=torch.tensor([5, 9]), seq_lens_sum=None
    )
    target = SimpleNamespace(model_runner=SimpleNamespace(attn_backend=adapter))
    with pytest.MonkeyPatch.context() as mp, pytest.raises(Built):
        mp.setattr(ewc, "build_tree_kernel_efficient", build_tree)
        ewc.build_eagle_verify_input(
            batch,
            SimpleNamespace(bonus_tokens=None),
            None,
            None,
            None,
            None,
            target_worker=target,
            topk=1,
            num_steps=3,
            num_draft_tokens=4,
            tree_mask_mode=TreeMaskMode.FULL_MASK,
            device="cpu",
        )
    assert seen == [2 * 64]
    # the overlap plan stream's fix-up after the draft: nothing of ours reads draft output
    adapter.update_verify_buffers_to_fill_after_draft(None, None)


DSV3_CASES = [
    pytest.param(
        be,
        p,
        c,
        fp8,
        marks=pytest.mark.interp if be == "mlab_triton" else (),
        id=(f"{c.name}-{be}-{'fp8' if fp8 else 'bf16'}"),
    )
    for be, pages in (("mlab_torch", (16, 64)), ("mlab_triton", (64,)))
    for p in pages
    for c in ks.page_edge_cases(be, 4, p)
    for fp8 in (False, True)
    if not (fp8 and c.forward_mode.is_target_verify())
]


@pytest.mark.parametrize(("backend", "page", "case", "fp8"), DSV3_CASES)
def test_kit_dsv3_shapes(backend: str, page: int, case: Any, fp8: bool) -> None:
    """kv_lora_rank 512, rope 64 (SGLang's own Triton writer runs under the interpreter)."""
    ks.run_case(case, fp8=fp8, max_context_len=ks.max_context(page), **DSV3_KIT)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kit_cuda_graph_decode_mode_dsv3(backend: str) -> None:
    from sglang.test.kits.attention_unittest.runner_modes import cuda_graph_decode_runner as cg

    case = ks.decode_case("cg_dsv3", backend, 4, 64, (63, 64, 65))
    cg.run_mla_cuda_graph_decode_case(ks.KitTestCase(), case, max_context_len=192, **DSV3_KIT)


def test_graph_buffers_are_kept_and_a_larger_state_is_refused_after_capture() -> None:
    """A second `init_cuda_graph_state` (another runner on the same backend) must not
    replace the static buffers a captured graph's metadata views."""
    adapter, runner = _adapter("mlab_torch", page=16, dims=(4, 32, 16, 16, 16), batch=4)
    fb = _extend_batch(runner, 16, (9, 20), (1, 1), seed=1)
    fb.forward_mode = ForwardMode.DECODE
    with torch.no_grad():
        adapter.init_cuda_graph_state(2, 2)
        adapter.init_cuda_graph_state(4, 4)  # before any capture: grows
        bufs = adapter._graph
        cap = _graph_view(fb, 4, 2, ForwardMode.DECODE)
        cap.num_padding, cap.out_cache_loc = 0, torch.zeros(4, dtype=torch.int64)
        adapter.init_forward_metadata_out_graph(cap, in_capture=True)
        adapter.init_cuda_graph_state(2, 4)  # covered: kept
        assert adapter._graph is bufs
        with pytest.raises(RuntimeError, match=r"already captured; 4 / 8 would replace"):
            adapter.init_cuda_graph_state(4, 8)
    assert adapter._graph is bufs


@pytest.mark.parametrize(
    ("mode", "ext", "pattern"),
    [
        ("EXTEND", (3, 3), "CUDA graphs serve DECODE and TARGET_VERIFY batches only"),
        ("TARGET_VERIFY", (3, 3), "graph batch of 2 x 3 tokens exceeds .* 2 requests / 4 tokens"),
        ("DECODE", (1, 1, 1), "graph batch of 3 x 1 tokens exceeds .* 2 requests / 4 tokens"),
    ],
    ids=["extend", "too-many-tokens", "too-many-requests"],
)
def test_graph_batch_outside_the_graph_state_is_refused(
    mode: str, ext: tuple[int, ...], pattern: str
) -> None:
    """A capture batch the static buffers cannot hold (an EXTEND, more tokens or more
    requests than init_cuda_graph_state sized) is refused in one line, not copied past
    the buffers' ends."""
    adapter, runner = _adapter("mlab_torch", page=16, dims=SMALL, batch=4)
    fb = _extend_batch(runner, 16, (9, 20, 5)[: len(ext)], ext, seed=1)
    fb.forward_mode = ForwardMode[mode]
    adapter.init_cuda_graph_state(2, 4)
    with pytest.raises(BatchError, match=pattern):
        adapter.init_forward_metadata_out_graph(fb, in_capture=True)


@pytest.mark.parametrize("on_device", [True, False], ids=["in-graph", "out-graph"])
def test_graph_refill_recorded_in_graph(on_device: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend whose refill is device-only (`graph_refill_on_device`) is refilled by
    init_forward_metadata_in_graph, so SGLang records it in its graph and the replay-side
    out_graph enqueues nothing; a backend that plans on the host is refilled by out_graph."""
    adapter, runner = _adapter("mlab_torch", page=16, dims=(4, 32, 16, 16, 16), batch=4)
    if not on_device:
        monkeypatch.setattr(adapter.backend, "graph_refill_on_device", lambda bs: False)
    assert adapter.backend.graph_refill_on_device(4) is on_device
    fb = _extend_batch(runner, 16, (9, 20), (1, 1), seed=1)
    fb.forward_mode = ForwardMode.DECODE
    with torch.no_grad():
        adapter.init_cuda_graph_state(4, 4)
        cap = _graph_view(fb, 4, 2, ForwardMode.DECODE)
        cap.num_padding, cap.out_cache_loc = 0, torch.zeros(4, dtype=torch.int64)
        adapter.init_forward_metadata_out_graph(cap, in_capture=True)
        seq = adapter.forward_metadata.batch.seq_lens
        seq.fill_(-7)  # stale contents a replay must overwrite
        adapter.init_forward_metadata_out_graph(_graph_view(fb, 4, 2, ForwardMode.DECODE))
        assert adapter.forward_metadata.batch.seq_lens.data_ptr() == seq.data_ptr()
        after_out = seq.tolist()
        adapter.init_forward_metadata_in_graph(_graph_view(fb, 4, 2, ForwardMode.DECODE))
    assert after_out == ([-7] * 4 if on_device else [10, 21, 1, 1])
    assert seq.tolist() == [10, 21, 1, 1]
    if on_device:  # replay of a size never captured: a clear error, not stale metadata
        with pytest.raises(RuntimeError, match="no graph captured for batch size 3"):
            adapter.init_forward_metadata_out_graph(_graph_view(fb, 3, 1, ForwardMode.DECODE))


def test_replay_recorded_in_graph_still_checks_the_view_on_the_host() -> None:
    """With the refill in the graph, out_graph's replay side does host checks only; they
    must still run: a view whose num_padding disagrees with its live slots is refused, not
    replayed over the captured metadata. in_graph before any graph state does nothing."""
    adapter, runner = _adapter("mlab_torch", page=16, dims=(4, 32, 16, 16, 16), batch=4)
    fb = _extend_batch(runner, 16, (9, 20), (1, 1), seed=1)
    fb.forward_mode = ForwardMode.DECODE
    with torch.no_grad():
        adapter.init_forward_metadata_in_graph(_graph_view(fb, 4, 2, ForwardMode.DECODE))
        adapter.init_cuda_graph_state(4, 4)
        cap = _graph_view(fb, 4, 2, ForwardMode.DECODE)
        cap.num_padding, cap.out_cache_loc = 0, torch.zeros(4, dtype=torch.int64)
        adapter.init_forward_metadata_out_graph(cap, in_capture=True)
        assert adapter.backend.graph_refill_on_device(4)
        bad = _graph_view(fb, 4, 2, ForwardMode.DECODE)
        bad.num_padding = 1
        with pytest.raises(BatchError, match="2 live slots for 3 of 4 requests x 1 tokens"):
            adapter.init_forward_metadata_out_graph(bad)


def test_graph_replay_padding_writes_the_dummy_slot_after_a_fuller_replay() -> None:
    """Padded rows write the dummy slot on every replay: the replay test captured with zero
    slots, so the static buffer was zero anyway; after a replay with more live requests the
    padding kept their real slots and would overwrite their KV (helper 75)."""
    from mla_backends.integrations.sglang.batches import GraphBuffers

    bufs = GraphBuffers.allocate(4, 4, torch.device("cpu"))

    def view(live: list[int]) -> SimpleNamespace:
        n, pad = len(live), 4 - len(live)
        rows = list(range(1, n + 1)) + [0] * pad
        lens = [10 + i for i in range(n)] + [1] * pad
        return SimpleNamespace(
            batch_size=4,
            forward_mode=ForwardMode.DECODE,
            input_ids=torch.zeros(4, dtype=torch.int64),
            positions=torch.tensor(lens, dtype=torch.int64) - 1,  # the new token's
            req_pool_indices=torch.tensor(rows, dtype=torch.int64),
            seq_lens=torch.tensor(lens, dtype=torch.int64),
            seq_lens_cpu=torch.tensor(lens, dtype=torch.int64),
            seq_lens_sum=None,
            num_padding=pad,
            out_cache_loc=torch.tensor(live, dtype=torch.int64),
            spec_info=None,
        )

    bufs.load(view([33, 34, 35, 36]))  # every row live: real slots fill the buffer
    b = bufs.load(view([40, 41]))  # 2 live + 2 padded
    assert b.out_cache_loc.tolist() == [40, 41, 0, 0]
    assert b.positions.tolist() == [9, 10, 0, 0]  # the view's, which DSA's indexer reads
