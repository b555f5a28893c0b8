"""YAML config: loads, resolves "auto" once, and refuses bad input naming file, key, values."""

from __future__ import annotations

from pathlib import Path

import pytest

from mla_backends.backends.base import Capability
from mla_backends.backends.registry import get_backend_class, resolve_backends
from mla_backends.config import DEEPSEEK_V3, TINY, Config, ConfigError, load_config

CONFIGS = Path(__file__).parent.parent / "configs"


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_default_config_loads_and_resolves_auto() -> None:
    cfg = load_config(CONFIGS / "default.yaml")
    assert cfg.model == TINY
    assert cfg.prefill_backend != "auto" and cfg.decode_backend != "auto"
    cap = Capability.detect(cfg.torch_device)
    assert get_backend_class(cfg.decode_backend).supports(cfg, cap, "decode") is None


def test_model_mapping_overrides_a_named_base(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, "model: {base: deepseek-v3, num_heads: 16}\ndevice: cpu\n"))
    assert cfg.model.num_heads == 16 and cfg.model.kv_lora_rank == DEEPSEEK_V3.kv_lora_rank
    assert cfg.model.softmax_scale == DEEPSEEK_V3.softmax_scale


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("pagesize: 16\n", r"c.yaml: unknown key\(s\) \['pagesize'\]; allowed: .*page_size"),
        ("page_size: 48\n", r"c.yaml: page_size=48 is not one of \(1, 16, 32, 64, 128\)"),
        ("kv_dtype: int8\n", r"c.yaml: kv_dtype='int8' is not one of .*float8_e4m3fn"),
        (
            "model: deepseek-v4\n",
            r"c.yaml: model='deepseek-v4' is not one of \['deepseek-v3', 'tiny'\]",
        ),
        (
            "model: {heads: 3}\n",
            r"c.yaml: unknown key\(s\) model.\['heads'\]; allowed: .*num_heads",
        ),
        (
            "decode_backend: flashmlaa\n",
            r"decode_backend='flashmlaa' is unknown; allowed: .*flashmla",
        ),
        ("num_pages: 0\n", r"c.yaml: num_pages must be > 0"),
        ("[1, 2]\n", r"c.yaml: top level must be a mapping"),
        ("page_size: [16\n", r"c.yaml: not valid YAML"),
        ("device: tpu\n", r"device='tpu' is not one of"),
    ],
)
def test_bad_yaml_fails_naming_file_key_and_allowed(
    tmp_path: Path, text: str, pattern: str
) -> None:
    if text[0] not in "[-" and "device" not in text:
        text += "device: cpu\n"  # results must not depend on whether this machine has a GPU
    with pytest.raises(ConfigError, match=pattern):
        load_config(_write(tmp_path, text))


def test_backend_that_cannot_run_fails_at_load(tmp_path: Path) -> None:
    from mla_backends.backends.base import MLABackend
    from mla_backends.backends.registry import _REGISTRY, register_backend

    @register_backend("only_page_64_test")
    class Page64(MLABackend):  # a backend declaring page 64 only, bf16 only
        name = "only_page_64_test"
        page_sizes = (64,)
        kv_dtypes = ("bfloat16",)

        def init_forward_metadata(self, batch):  # type: ignore[no-untyped-def]
            pass

        def _attend_absorbed(self, *a):  # type: ignore[no-untyped-def]
            raise AssertionError

    try:
        cfg = Config(device="cpu", decode_backend="only_page_64_test", prefill_backend="torch")
        with pytest.raises(
            ConfigError,
            match=r"x.yaml: decode_backend='only_page_64_test' cannot "
            r"run here: .*needs page_size in \(64,\), config has 16.*Backends that "
            r"can serve decode.*\['torch'\]",
        ):
            resolve_backends(cfg, "x.yaml")
        cfg = Config(
            device="cpu",
            page_size=64,
            kv_dtype="float16",
            decode_backend="only_page_64_test",
            prefill_backend="torch",
        )
        with pytest.raises(ConfigError, match=r"needs kv_dtype in \('bfloat16',\)"):
            resolve_backends(cfg, "x.yaml")
        cfg = Config(
            device="cpu", page_size=64, decode_backend="torch", prefill_backend="only_page_64_test"
        )
        assert resolve_backends(cfg).prefill_backend == "only_page_64_test"
    finally:
        del _REGISTRY["only_page_64_test"]


def test_shipped_configs_parse() -> None:
    """Every YAML in configs/ is valid; GPU-only choices may refuse this machine, clearly."""
    for path in sorted(CONFIGS.glob("*.yaml")):
        try:
            load_config(path)
        except ConfigError as e:
            assert str(path) in str(e), str(e)
            assert "cannot run here" in str(e) or "no usable CUDA device" in str(e), str(e)
