"""YAML config: loads, resolves "auto" once, and refuses bad input naming file, key, values."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from mla_backends.backends.base import Capability
from mla_backends.backends.registry import get_backend_class, resolve_backends
from mla_backends.config import (
    DEEPSEEK_V3,
    TINY_KERNEL,
    Config,
    ConfigError,
    load_config,
    shipped_configs,
)


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_default_config_loads_and_resolves_auto() -> None:
    cfg = load_config()
    assert cfg.model == TINY_KERNEL
    assert cfg.prefill_backend != "auto" and cfg.decode_backend != "auto"
    cap = Capability.detect(cfg.torch_device)
    assert get_backend_class(cfg.decode_backend).supports(cfg, cap, "decode") is None


def test_config_argument_takes_a_path_or_a_shipped_name(tmp_path: Path) -> None:
    assert load_config("default") == load_config() == load_config("default.yaml")
    with pytest.raises(ConfigError, match=r"nope.yaml: no such config file; .*'default'"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"is a directory; --config takes a YAML file"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=r"default: no such config file"):
        load_config(tmp_path / "default")  # a shipped name only without a folder
    with pytest.raises(ConfigError, match=r"^\./default: no such config file"):
        load_config("./default")  # "./" asks for a file (it loaded the shipped default)
    with pytest.raises(ConfigError, match=r"--config is empty"):
        load_config("")  # it was reported as "."'s being a directory


def test_an_unknown_backend_class_name_reads_as_its_message() -> None:
    """`get_backend_class` (public) and the sparse registry refuse an unknown name with an
    error that is a KeyError and a ValueError and prints as its message: a bare KeyError
    printed its repr, in quotes, with the inner quotes escaped."""
    from mla_backends.backends.registry import UnknownBackendError, get_backend_class
    from mla_backends.sparse.base import get_sparse_backend_class

    for lookup, what in (
        (get_backend_class, "backend"),
        (get_sparse_backend_class, "sparse backend"),
    ):
        with pytest.raises(UnknownBackendError) as e:
            lookup("flashmlaa")
        assert isinstance(e.value, KeyError) and isinstance(e.value, ValueError)
        assert str(e.value).startswith(f"unknown {what} 'flashmlaa'; known: [")
        assert "'torch'" in str(e.value)


def test_auto_on_a_cpu_never_picks_an_interpreted_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the Triton interpreter enabled (tests, `verify`) the triton backend can run on a
    CPU, but "auto" keeps to the backend that runs there compiled."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = load_config()
    if cfg.torch_device.type != "cpu":
        pytest.skip("a CUDA device is present: auto picks a GPU backend")
    assert (cfg.prefill_backend, cfg.decode_backend) == ("torch", "torch")
    triton = Config(device="cpu", decode_backend="triton", prefill_backend="triton")
    if get_backend_class("triton").supports(triton, Capability("cpu"), "decode") is None:
        assert resolve_backends(triton).decode_backend == "triton"  # still there when named


def test_model_mapping_overrides_a_named_base(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, "model: {base: deepseek-v3, num_heads: 16}\ndevice: cpu\n"))
    assert cfg.model.num_heads == 16 and cfg.model.kv_lora_rank == DEEPSEEK_V3.kv_lora_rank
    assert cfg.model.softmax_scale == DEEPSEEK_V3.softmax_scale


def test_hex_integers_load(tmp_path: Path) -> None:
    """YAML 1.1's octal / binary / base-60 numbers are refused; hex says what it is."""
    assert load_config(_write(tmp_path, "page_size: 0x40\ndevice: cpu\n")).page_size == 64


def test_a_yaml_merge_key_is_overridden_not_a_key_given_twice(tmp_path: Path) -> None:
    text = "model:\n  <<: {base: tiny, num_heads: 8}\n  num_heads: 2\ndevice: cpu\n"
    assert load_config(_write(tmp_path, text)).model.num_heads == 2


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("pagesize: 16\n", r"c.yaml: unknown key\(s\) \['pagesize'\]; allowed: .*page_size"),
        ("page_size: 48\n", r"c.yaml: page_size=48 is not one of \(1, 16, 32, 64, 128\)"),
        ("kv_dtype: int8\n", r"c.yaml: kv_dtype='int8' is not one of .*float8_e4m3fn"),
        (
            "model: deepseek-v4\n",
            r"c.yaml: model='deepseek-v4' is not one of \['deepseek-v3', 'tiny', 'tiny-kernel'\]",
        ),
        (
            "model: {heads: 3}\n",
            r"c.yaml: unknown key\(s\) model.\['heads'\]; allowed: .*num_heads",
        ),
        (
            "decode_backend: flashmlaa\n",
            r"decode_backend='flashmlaa' is unknown; allowed: .*flashmla",
        ),
        ("num_pages: 0\n", r"c.yaml: num_pages must be an integer >= 1, got 0"),
        ("[1, 2]\n", r"c.yaml: top level must be a mapping"),
        ("page_size: [16\n", r"c.yaml: not valid YAML"),
        (
            "page_size: 16\npage_size: 32\n",
            r"c.yaml: not valid YAML: line 2, column 1: key 'page_size' is given twice",
        ),
        ("model: {num_heads: 4, num_heads: 8}\n", r"line 1, column 23: key 'num_heads' is given"),
        ("device: tpu\n", r"device='tpu' is not one of"),
        ("device: 'cuda:-1'\n", r"device='cuda:-1' is not one of auto, cpu, cuda, cuda:N"),
        ("device: 'cuda:x'\n", r"device='cuda:x' is not one of"),
        ("device: 'cuda:01'\n", r"device='cuda:01' is not one of"),  # torch's traceback later
        ("device: 'cuda:256'\n", r"device='cuda:256' is not one of"),  # torch keeps 8 bits: 0
        # the softmax scale was 0 (attention a plain mean of the values), and verify agreed
        ("model: {base: tiny, mscale_all_dim: -7.2}\n", r"model.mscale_all_dim must be >= 0"),
        (
            "model: {rope_scaling_factor: 40.0, mscale_all_dim: 1.0e+200}\n",
            r"mscale_all_dim 1e\+200 gives a softmax scale of inf",
        ),
        # YAML 1.1 reads these as 16, 3 and 60, silently
        ("page_size: 020\n", r"line 1, column 12: 020 is read as 16 in YAML 1.1: write it in"),
        ("num_pages: 0b11\n", r"0b11 is read as 3 in YAML 1.1"),
        ("num_layers: 1:00\n", r"1:00 is read as 60 in YAML 1.1"),
        ("model: {rope_scaling_factor: 1:30.0}\n", r"1:30.0 is read as 90.0 in YAML 1.1"),
        ("page_size: '020'\n", r"got '020' \(str\); an integer key takes digits, e.g. 20$"),
        ("model: {rope_scaling_factor: .nan}\n", r"model.rope_scaling_factor must be a finite"),
        ("model: {mscale_all_dim: .inf}\n", r"model.mscale_all_dim must be a finite number"),
        ("model: {mscale_all_dim: 1" + "0" * 400 + "}\n", r"model.mscale_all_dim must be a finite"),
        ("cuda_graph_batch_sizes: []\n", r"cuda_graph_batch_sizes must be a list of positive"),
        (
            "model: {base: deepseek-v4}\n",
            r"c.yaml: model.base='deepseek-v4' is not one of \['deepseek-v3', 'tiny', "
            r"'tiny-kernel'\]",
        ),
        ("model: {num_heads: 4.5}\n", r"c.yaml: model.num_heads must be an integer >= 1, got 4.5"),
        ("model: {qk_rope_head_dim: -1}\n", r"c.yaml: model.qk_rope_head_dim must be .* >= 0"),
        ("model: {mscale_all_dim: yes}\n", r"c.yaml: model.mscale_all_dim must be a finite number"),
        ("num_pages: 1.5\n", r"c.yaml: num_pages must be an integer >= 1, got 1.5 \(float\)"),
        ("num_layers: true\n", r"c.yaml: num_layers must be an integer >= 1, got True \(bool\)"),
        ("page_size: 16.0\n", r"c.yaml: page_size must be an integer >= 1, got 16.0"),
        ("max_requests: '8'\n", r"c.yaml: max_requests must be an integer >= 1, got '8' \(str\)"),
        ("max_context_len: -5\n", r"c.yaml: max_context_len must be an integer >= 1, got -5"),
        (
            "cuda_graph_batch_sizes: 4\n",
            r"c.yaml: cuda_graph_batch_sizes must be a list of positive integers, .*got 4",
        ),
        ("cuda_graph_batch_sizes: [1, 0]\n", r"cuda_graph_batch_sizes must be a list of positive"),
        ("cuda_graph_batch_sizes: [1.5]\n", r"cuda_graph_batch_sizes must be a list of positive"),
        ("cuda_graph_batch_sizes: [true]\n", r"cuda_graph_batch_sizes must be a list of positive"),
        ("model: {base: [tiny]}\n", r"c.yaml: model.base=\['tiny'\] is not one of"),  # unhashable
        ("kv_dtype: 8\n", r"c.yaml: kv_dtype must be a string, one of .*got 8 \(int\)"),
        ("decode_backend: 3\n", r"c.yaml: decode_backend must be a string"),
    ],
)
def test_bad_yaml_fails_naming_file_key_and_allowed(
    tmp_path: Path, text: str, pattern: str
) -> None:
    if text[0] not in "[-" and "device" not in text:
        text += "device: cpu\n"  # results must not depend on whether this machine has a GPU
    with pytest.raises(ConfigError, match=pattern):
        load_config(_write(tmp_path, text))


def test_load_without_resolve_keeps_auto(tmp_path: Path) -> None:
    """A caller that changes the dims first (the SGLang plug-in) resolves after that itself."""
    cfg = load_config(_write(tmp_path, "device: cpu\n"), resolve=False)
    assert (cfg.prefill_backend, cfg.decode_backend) == ("auto", "auto")


def test_backend_that_cannot_run_fails_at_load(tmp_path: Path) -> None:
    from mla_backends.backends.base import BackendCaps, MLABackend
    from mla_backends.backends.registry import _REGISTRY, register_backend

    @register_backend("only_page_64_test")
    class Page64(MLABackend):  # a backend declaring page 64 only, bf16 only
        name = "only_page_64_test"
        caps = BackendCaps(page_sizes=(64,), kv_dtypes=("bfloat16",))

        def _build_metadata(self, batch):  # type: ignore[no-untyped-def]
            return None

        def _attend_absorbed(self, *a):  # type: ignore[no-untyped-def]
            raise AssertionError

    try:
        cfg = Config(device="cpu", decode_backend="only_page_64_test", prefill_backend="torch")
        with pytest.raises(
            ConfigError,
            match=r"x.yaml: decode_backend='only_page_64_test' cannot "
            r"run here: .*needs page_size in \(64,\), config has 16.*Backends that "
            r"can serve decode.*\[.*'torch'.*\]",  # a list, not pinned: new CPU backends join it
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
    """Every YAML shipped in the package is valid; GPU-only choices may refuse this machine,
    clearly."""
    shipped = shipped_configs()
    assert {"default", "deepseek_v3_h100"} <= set(shipped)
    for name, path in sorted(shipped.items()):
        try:
            load_config(name)
        except ConfigError as e:
            assert str(path) in str(e), str(e)
            assert "cannot run here" in str(e) or "no usable CUDA device" in str(e), str(e)


def test_indexer_topk_key_is_checked(tmp_path: Path) -> None:
    """`indexer_topk`: auto (one launch where it fits) or launches; anything else is one
    line naming the choices."""
    bad = r"indexer_topk='fused' is not one of \['auto', 'launches'\]"
    with pytest.raises(ConfigError, match=bad):
        load_config(_write(tmp_path, "indexer_topk: fused\n"))
    assert load_config(_write(tmp_path, "indexer_topk: launches\n")).indexer_topk == "launches"
    assert load_config(_write(tmp_path, "device: cpu\n")).indexer_topk == "auto"


def test_dcp_keys_are_checked_and_a_single_process_runtime_refuses_dcp(tmp_path: Path) -> None:
    from mla_backends.runtime import Runtime

    with pytest.raises(ConfigError, match=r"dcp_heads='rows' is not one of \['replicated', 'tp'\]"):
        load_config(_write(tmp_path, "dcp_heads: rows\n"))
    with pytest.raises(ConfigError, match=r"dcp_size"):
        load_config(_write(tmp_path, "dcp_size: 0\n"))
    cfg = load_config(_write(tmp_path, "dcp_size: 2\ndevice: cpu\n"))
    with pytest.raises(ConfigError, match=r"dcp_size=2: build each rank with .*build_dcp_runtime"):
        Runtime.build(cfg)


def test_runtime_build_resolves_auto_and_a_triton_cpu_runtime_fails_when_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Config built in Python keeps "auto" (only load_config resolved it): Runtime.build
    resolves it (it was a KeyError); the triton backend on a CPU outside the interpreter is a
    ConfigError when built (it was Triton's "0 active drivers" at the first launch), and so
    is one whose kernels cannot take the config's dims."""
    from mla_backends import TINY, Config, Runtime
    from mla_backends.config import TINY_KERNEL

    rt = Runtime.build(Config(model=TINY, prefill_backend="auto", decode_backend="auto"))
    assert "auto" not in (rt.config.prefill_backend, rt.config.decode_backend)
    assert rt.backend is not None
    # Hazard: Triton reads TRITON_INTERPRET when a kernel module is first imported; imported
    # here without it, the kernels stayed compiled-only for every later test of the process
    # ("0 active drivers" in test_errors' triton cases). Import them first.
    from mla_backends.kernels import mha_prefill, mla_attention, store  # noqa: F401

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = Config(model=TINY, prefill_backend="torch", decode_backend="triton", device="cpu")
    with pytest.raises(
        ConfigError,
        match=r"decode_backend='triton' cannot run here: triton on a "
        r"CPU runs only under TRITON_INTERPRET=1",
    ):
        Runtime.build(cfg)
    # a named backend whose kernels cannot take the config's dims fails when built with the
    # reason `supports` gives (it built, then raised 7 frames into Triton at the first call)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    odd = dataclasses.replace(TINY_KERNEL, kv_lora_rank=48)
    for decode in ("triton", "auto"):
        with pytest.raises(
            ConfigError,
            match=r"Runtime.build: prefill_backend='triton' cannot "
            r"run here: triton MLA kernels need kv_lora_rank .*powers of two",
        ):
            Runtime.build(Config(model=odd, prefill_backend="triton", decode_backend=decode))
    # Config's default model (what a YAML file without `model:` gets) is named as the cause
    with pytest.raises(
        ConfigError,
        match=r"got 32 and 8 \(model tiny, the default without `model:`; tiny-kernel runs\)",
    ):
        Runtime.build(Config(decode_backend="triton"))
    # one that can run the config builds as named
    rt = Runtime.build(Config(model=TINY_KERNEL, prefill_backend="triton", decode_backend="triton"))
    assert rt.config.decode_backend == "triton"


def test_runtime_with_two_backends_prefills_on_the_prefill_backend() -> None:
    """M49 (runtime.py:22 `prefill == decode` -> always): a config naming another prefill
    backend gets a DispatchBackend whose prefill side is that backend (the mutant served
    prefill on the decode backend: silent for torch / triton, a failure for a decode-only
    backend such as flashmla)."""
    from mla_backends import Config, Runtime
    from mla_backends.backends.dispatch import DispatchBackend
    from mla_backends.config import TINY_KERNEL as TINY

    rt = Runtime.build(  # needs TRITON_INTERPRET=1 on a CPU, as the suite runs
        Config(model=TINY, prefill_backend="torch", decode_backend="triton", device="cpu")
    )
    be = rt.backend
    assert isinstance(be, DispatchBackend)
    assert be.prefill.name == "torch" and be.decode.name == "triton"
    same = Runtime.build(Config(model=TINY, prefill_backend="torch", decode_backend="torch"))
    assert not isinstance(same.backend, DispatchBackend) and same.backend.name == "torch"


def test_verify_runs_the_configs_dtype_pair_and_fp8() -> None:
    """M50 (verify.py:95 the "fp8" pair dropped): `verify` checks every backend's FP8 path
    besides the config's own pair (the mutant reported backends passing with no FP8 row)."""
    from mla_backends.testing import DTYPE_PAIRS
    from mla_backends.verify import _dtype_pairs, config_dtypes

    cfg = Config(device="cpu", dtype="float16", kv_dtype="float16")
    pairs = _dtype_pairs(cfg)
    assert pairs[config_dtypes(cfg)] == ("float16", "float16")
    assert pairs["fp8"] == DTYPE_PAIRS["fp8"] and len(pairs) == 2


@pytest.mark.parametrize("factor", [0.999, 0.7, 0.5])
def test_rope_scaling_factor_just_below_one_is_refused(factor: float) -> None:
    """Hazard: a YaRN factor below 1 (a typo for 1.0, or a compression factor written
    upside down) was taken and `mscale` read it as "no scaling" (1.0), silently; only
    factors well below 1 were refused. The bound is 1 itself: 1.0 loads, 0.999 does not."""
    from mla_backends.config import MLADims, config_from_dict

    assert MLADims(rope_scaling_factor=1.0).mscale == 1.0
    with pytest.raises(ConfigError, match=r"rope_scaling_factor must be >= 1"):
        MLADims(rope_scaling_factor=factor)
    with pytest.raises(ConfigError, match=r"rope_scaling_factor must be >= 1"):
        config_from_dict({"model": {"base": "tiny", "rope_scaling_factor": factor}}, resolve=False)


@pytest.mark.parametrize("mscale_all_dim", [-1e-3, -0.5, -1.0])
def test_slightly_negative_mscale_all_dim_is_refused(mscale_all_dim: float) -> None:
    """Hazard: a negative mscale_all_dim shrinks the softmax scale (mscale < 1, squared) and
    `verify` agrees, its reference reading the same scale; small negatives (-0.5, -1) were
    taken where only large ones were refused. 0 is the bound (no YaRN magnitude term)."""
    from mla_backends.config import MLADims

    assert MLADims(rope_scaling_factor=40.0, mscale_all_dim=0.0).mscale == 1.0
    with pytest.raises(ConfigError, match=r"mscale_all_dim must be >= 0"):
        MLADims(rope_scaling_factor=40.0, mscale_all_dim=mscale_all_dim)


def test_pool_of_exactly_int32_slot_ids_loads_and_one_more_page_is_refused() -> None:
    """Hazard: slot ids are int32 (the request table's dtype): the largest id the pool hands
    out, (num_pages + 1) * page_size - 1, must be <= 2**31 - 1. At page size 1, one page
    more than that (largest id 2**31) wrapped to a negative id in the int32 table, silently:
    the bound is exact, not off by one."""
    from mla_backends.config import PoolSizeError

    last_ok = 2**31 - 1  # slots 0 .. 2**31 - 1: ids fit int32 exactly
    Config(page_size=1, num_pages=last_ok)
    with pytest.raises(PoolSizeError, match=r"int32 slot ids"):
        Config(page_size=1, num_pages=last_ok + 1)
    Config(page_size=16, num_pages=2**27 - 1)  # (2**27) * 16 slots: ids up to 2**31 - 1
    with pytest.raises(PoolSizeError):
        Config(page_size=16, num_pages=2**27)


def test_runtime_build_hands_its_page_order_to_the_allocator() -> None:
    """Hazard: the parity suites poison page tables through `Runtime.build(cfg, page_order)`
    (pages out of order); an order dropped on the way gave every test pages 1, 2, ... and a
    kernel that ignored the page table passed."""
    from mla_backends import Config, Runtime
    from mla_backends.config import TINY_KERNEL as TINY

    cfg = Config(model=TINY, prefill_backend="torch", decode_backend="torch", num_pages=4)
    rt = Runtime.build(cfg, page_order=[3, 1, 4, 2])
    (row,) = rt.req_pool.alloc(1)
    loc = rt.allocator.alloc_extend([row], [1])
    assert int(loc[0]) // cfg.page_size == 3
