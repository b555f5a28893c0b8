"""Configuration: YAML at the edge, frozen dataclasses inside.

`load_config(path)` is the only place YAML is read; with no path it reads the default config
shipped in the package (`mla_backends/configs/default.yaml`), and a shipped config can be
named without its path (`deepseek_v3_h100`). Unknown keys, values of the wrong type, bad names
and backend choices that cannot run here fail at load, naming the file, the key and the
allowed values.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Hashable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

PAGE_SIZES = (1, 16, 32, 64, 128)
# The request table maps (request, position) to an int32 pool slot id (pool.ReqToTokenPool):
# the largest id
MAX_SLOTS = 2**31 - 1
DCP_HEADS = ("replicated", "tp")
TOPK_PATHS = ("auto", "launches")  # sparse/topk_kernel.py
KV_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
ACT_DTYPES = {k: v for k, v in KV_DTYPES.items() if k != "float8_e4m3fn"}


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the file, key and allowed values."""


class PoolSizeError(ConfigError):
    """A pool too large for int32 slot ids; where a command sizes the pool from its own
    options (bench), it names those options instead of num_pages."""


def _string_number_hint(value: object, integer: bool = False) -> str:
    """Why a number in the YAML arrived as a string: quoted, or an exponent PyYAML's YAML 1.1
    rules do not take (`1e3`, `1.0e308`: a float needs a dot and a signed exponent). For an
    `integer` key the advice is digits: `1.0e+3` would load as a float, refused there too."""
    if not isinstance(value, str):
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    if not math.isfinite(number):
        return ""
    try:  # as the config's own loader reads it: "020" unquoted is refused there too
        loaded = yaml.load(value, Loader=_UniqueKeyLoader)
    except yaml.YAMLError:
        loaded = value
    if integer:
        if isinstance(loaded, int) and not isinstance(loaded, bool):
            return "; write the number without quotes"
        digits = int(number) if number.is_integer() else 1000
        return f"; an integer key takes digits, e.g. {digits}"
    if isinstance(loaded, (int, float)):
        return "; write the number without quotes"
    return "; YAML reads an exponent without a dot and a sign as text: write e.g. 1.0e+3"


def check_int(owner: str, name: str, value: object, low: int) -> None:
    """ConfigError (a ValueError) unless `value` is an int >= low; `owner` prefixes the name."""
    # bool is an int subclass and YAML reads `1.0` as a float: both are refused, not coerced.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{owner}{name} must be an integer >= {low}, got {value!r} ({type(value).__name__})"
            + _string_number_hint(value, integer=True)
        )
    if value < low:
        raise ConfigError(f"{owner}{name} must be an integer >= {low}, got {value}")


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past any float (YAML reads 1e400 as inf, 10**400 as an int)
        return False


def _check_number(owner: str, name: str, value: object) -> None:
    # YAML reads .nan and .inf as floats: a NaN scale would pass every later check
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise ConfigError(
            f"{owner}{name} must be a finite number, got {value!r} ({type(value).__name__})"
            + _string_number_hint(value)
        )


def _check_str(name: str, value: object, allowed: object) -> None:
    if not isinstance(value, str):
        raise ConfigError(
            f"{name} must be a string, one of {allowed}, got {value!r} ({type(value).__name__})"
        )


@dataclass(frozen=True)
class MLADims:
    """Attention dimensions of one MLA layer (per tensor-parallel rank).

    num_heads H, kv_lora_rank L, qk_rope_head_dim R, qk_nope_head_dim P, v_head_dim V.
    A cached row is D = L + R wide. NoPE MLA (Kimi-Linear) keeps R = 64 and simply does not
    rotate that part, so every kernel still sees a 576-wide row.
    """

    num_heads: int = 128
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    rope_scaling_factor: float = 1.0
    mscale_all_dim: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            check_int("model.", name, getattr(self, name), 1)
        check_int("model.", "qk_rope_head_dim", self.qk_rope_head_dim, 0)
        for name in ("rope_scaling_factor", "mscale_all_dim"):
            _check_number("model.", name, getattr(self, name))
        if self.rope_scaling_factor < 1.0:
            raise ConfigError(
                f"model.rope_scaling_factor must be >= 1, got {self.rope_scaling_factor}"
            )
        # Hazard: a negative mscale_all_dim made the softmax scale 0 (attention a plain mean
        # of the values) and `verify` agreed, its reference reading the same scale
        if self.mscale_all_dim < 0:
            raise ConfigError(f"model.mscale_all_dim must be >= 0, got {self.mscale_all_dim}")
        try:
            scale = self.softmax_scale
        except OverflowError:
            scale = math.inf
        if not 0.0 < scale < math.inf:
            raise ConfigError(
                f"model: rope_scaling_factor {self.rope_scaling_factor} with mscale_all_dim "
                f"{self.mscale_all_dim} gives a softmax scale of {scale}"
            )

    @property
    def kv_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mscale(self) -> float:
        """YaRN attention-magnitude correction; 1.0 when no rope scaling applies."""
        if self.rope_scaling_factor <= 1.0 or self.mscale_all_dim == 0.0:
            return 1.0
        return 0.1 * self.mscale_all_dim * math.log(self.rope_scaling_factor) + 1.0

    @property
    def softmax_scale(self) -> float:
        # Hazard: the scale is over the *MHA* head dim (P + R = 192), not the latent width
        # (576, FlashMLA's default), and YaRN multiplies it by mscale squared.
        return self.qk_head_dim**-0.5 * self.mscale**2

    def with_heads(self, num_heads: int) -> MLADims:
        return dataclasses.replace(self, num_heads=num_heads)


DEEPSEEK_V3 = MLADims(
    num_heads=128,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    rope_scaling_factor=40.0,
    mscale_all_dim=1.0,
)
# Tiny shapes for CPU tests and the default config: every dimension distinct so a swapped
# axis cannot go unnoticed.
TINY = MLADims(
    num_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    rope_scaling_factor=4.0,
    mscale_all_dim=0.707,
)
# The smallest shape the Triton kernels take (kv_lora_rank and qk_rope_head_dim powers of two
# >= 16), dimensions still distinct, P + R = 40 not a power of two: the default config's model,
# so `verify` on a CPU runs the triton backend under the interpreter in seconds.
TINY_KERNEL = MLADims(
    num_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=24,
    v_head_dim=12,
    rope_scaling_factor=4.0,
    mscale_all_dim=0.707,
)
NAMED_DIMS: dict[str, MLADims] = {
    "deepseek-v3": DEEPSEEK_V3,
    "tiny": TINY,
    "tiny-kernel": TINY_KERNEL,
}


@dataclass(frozen=True)
class Config:
    """Everything a serving engine needs to build the pool and the attention backends.

    `prefill_backend` / `decode_backend` may be "auto": resolved once in `load_config` /
    `resolve_backends` from declared capabilities, never per call.
    """

    model: MLADims = field(default_factory=lambda: TINY)
    num_layers: int = 2
    prefill_backend: str = "auto"
    decode_backend: str = "auto"
    page_size: int = 16
    kv_dtype: str = "bfloat16"
    dtype: str = "bfloat16"
    num_pages: int = 256
    max_requests: int = 64
    max_context_len: int = 2048
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    device: str = "auto"
    # Decode context parallelism: each request's KV spread over `dcp_size` ranks
    # (mla_backends.dcp); "replicated": every rank holds all heads, "tp": H / dcp_size each.
    dcp_size: int = 1
    dcp_heads: str = "replicated"
    # DeepSeek-V3.2 models (sparse attention): the sparse backend (mla_backends.sparse), or
    # "auto": the first of flashmla, flashinfer_mla, triton, torch that runs here.
    sparse_backend: str = "auto"
    # The indexer's top-k on a GPU: "auto" runs it in one launch while the batch's logits fit
    # one program per SM (its programs wait for each other, so all must be resident at once);
    # "launches" always takes the four-launch form: set it where the process gets fewer SMs
    # than the device has (MPS thread limits, green contexts), or the launch could hang.
    indexer_topk: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.model, MLADims):
            raise ConfigError(f"model must be an MLADims, got {type(self.model).__name__}")
        check_int("", "page_size", self.page_size, 1)
        if self.page_size not in PAGE_SIZES:
            raise ConfigError(f"page_size={self.page_size} is not one of {PAGE_SIZES}")
        _check_str("kv_dtype", self.kv_dtype, sorted(KV_DTYPES))
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype={self.kv_dtype!r} is not one of {sorted(KV_DTYPES)}")
        _check_str("dtype", self.dtype, sorted(ACT_DTYPES))
        if self.dtype not in ACT_DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not one of {sorted(ACT_DTYPES)}")
        for name in ("num_layers", "num_pages", "max_requests", "max_context_len"):
            check_int("", name, getattr(self, name), 1)
        slots = (self.num_pages + 1) * self.page_size  # ids 0 .. slots - 1
        if slots - 1 > MAX_SLOTS:
            raise PoolSizeError(
                f"num_pages={self.num_pages} with page_size={self.page_size}: {slots} pool "
                f"slots, past the request table's int32 slot ids (2**31 - 1); at most "
                f"{(MAX_SLOTS + 1) // self.page_size - 1} pages of {self.page_size} tokens"
            )
        sizes = self.cuda_graph_batch_sizes
        if (
            not isinstance(sizes, (tuple, list))
            or not sizes
            or not all(isinstance(bs, int) and not isinstance(bs, bool) and bs > 0 for bs in sizes)
        ):
            raise ConfigError(
                f"cuda_graph_batch_sizes must be a list of positive integers, e.g. [1, 2, 4, 8], "
                f"got {sizes!r}"
            )
        object.__setattr__(self, "cuda_graph_batch_sizes", tuple(sizes))
        for key in ("prefill_backend", "decode_backend"):
            _check_str(key, getattr(self, key), "auto or a backend name")
        check_int("", "dcp_size", self.dcp_size, 1)
        _check_str("dcp_heads", self.dcp_heads, "replicated, tp")
        if self.dcp_heads not in DCP_HEADS:
            raise ConfigError(f"dcp_heads={self.dcp_heads!r} is not one of {list(DCP_HEADS)}")
        _check_str("sparse_backend", self.sparse_backend, "auto or a sparse backend name")
        from mla_backends.sparse.base import sparse_backend_names  # imports this module

        allowed = ["auto", *sparse_backend_names()]  # a plug-in's, registered before, too
        if self.sparse_backend not in allowed:
            raise ConfigError(f"sparse_backend={self.sparse_backend!r} is not one of {allowed}")
        _check_str("indexer_topk", self.indexer_topk, ", ".join(TOPK_PATHS))
        if self.indexer_topk not in TOPK_PATHS:
            raise ConfigError(
                f"indexer_topk={self.indexer_topk!r} is not one of {list(TOPK_PATHS)}"
            )
        _check_str("device", self.device, "auto, cpu, cuda, cuda:N")
        if self.device not in ("auto", "cpu", "cuda") and not _cuda_index(self.device):
            raise ConfigError(f"device={self.device!r} is not one of auto, cpu, cuda, cuda:N")

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.kv_dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        return ACT_DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def _cuda_index(device: str) -> bool:
    """Whether `device` is cuda:N as torch keeps it. Hazard: torch refuses "cuda:01" (a
    traceback later) and keeps an index in 8 bits: "cuda:256" is cuda:0, silently."""
    m = re.fullmatch(r"cuda:(0|[1-9]\d{0,2})", device)
    return m is not None and torch.device(device).index == int(m[1])


def _unknown_keys(raw: dict[Any, Any], allowed: set[str]) -> list[Any]:
    # YAML keys need not be strings (`1: 2`, `~: 3`): sorting them mixed was a TypeError
    return sorted(set(raw) - allowed, key=repr)


def _model_from_yaml(value: Any, where: str) -> MLADims:
    if isinstance(value, str):
        if value not in NAMED_DIMS:
            raise ConfigError(f"{where}: model={value!r} is not one of {sorted(NAMED_DIMS)}")
        return NAMED_DIMS[value]
    if isinstance(value, dict):
        value = dict(value)
        base_name = value.pop("base", "deepseek-v3")
        if not isinstance(base_name, str) or base_name not in NAMED_DIMS:
            raise ConfigError(
                f"{where}: model.base={base_name!r} is not one of {sorted(NAMED_DIMS)}"
            )
        allowed = {f.name for f in dataclasses.fields(MLADims)}
        unknown = _unknown_keys(value, allowed)
        if unknown:
            raise ConfigError(
                f"{where}: unknown key(s) model.{unknown}; allowed: {sorted(allowed)}"
            )
        try:
            return dataclasses.replace(NAMED_DIMS[base_name], **value)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    raise ConfigError(f"{where}: model must be a name {sorted(NAMED_DIMS)} or a mapping of dims")


def config_from_dict(raw: dict[str, Any], where: str = "<dict>", resolve: bool = True) -> Config:
    """Build and validate a Config; resolves "auto" backends for the machine this runs on
    (`resolve`; a caller that changes the model dims first resolves after that itself)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: top level must be a mapping, got {type(raw).__name__}")
    allowed = {f.name for f in dataclasses.fields(Config)}
    unknown = _unknown_keys(raw, allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    raw = dict(raw)
    if "model" in raw:
        raw["model"] = _model_from_yaml(raw["model"], where)
    try:
        cfg = Config(**raw)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None
    if not resolve:
        return cfg
    from mla_backends.backends.registry import resolve_backends

    return resolve_backends(cfg, where)


def shipped_configs() -> dict[str, Traversable]:
    """The YAML configs inside the package, by name without `.yaml`."""
    folder = resources.files("mla_backends") / "configs"
    return {p.name[:-5]: p for p in folder.iterdir() if p.name.endswith(".yaml")}


def config_source(path: str | Path | None) -> Path | Traversable:
    """What `load_config(path)` reads: the file at `path`; else a shipped config of that name
    (`default`, `deepseek_v3_h100`, with or without `.yaml`); None is the shipped default."""
    shipped = shipped_configs()
    if path is None:
        return shipped["default"]
    if not str(path).strip():  # Path("") is "." (reported as a directory)
        raise ConfigError("--config is empty; give a YAML path or a shipped config name")
    p = Path(path)
    try:
        if p.is_dir():
            raise ConfigError(f"{p}: is a directory; --config takes a YAML file")
        if p.is_file():
            return p
        if os.path.lexists(p):  # a device, a FIFO (reading one would block), a broken link
            raise ConfigError(f"{p}: is not a regular file; --config takes a YAML file")
    except OSError as e:  # a name too long for the file system
        raise ConfigError(f"{p}: cannot read: {e.strerror}") from None
    name = p.name[:-5] if p.name.endswith(".yaml") else p.name
    # a bare name only: Path("./default") is Path("default"), but "./" asked for a file
    if os.path.dirname(str(path)) == "" and name in shipped:
        return shipped[name]
    raise ConfigError(
        f"{path}: no such config file; give a YAML path or a shipped config: {sorted(shipped)}"
    )


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.safe_load`, but a key given twice in one mapping is an error: PyYAML keeps the
    last value, so a second `page_size:` further down silently replaced the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: later keys override it
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # a list as a key: PyYAML's own error follows
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)

    def _refuse_surprise(self, node: yaml.ScalarNode, value: object) -> None:
        """Hazard: YAML 1.1 reads `020` as 16 (octal), `0b11` as 3 and `1:00` / `1:30.0` as
        60 / 90.0 (base 60), silently. Hex (`0x40`) says what it is and stays."""
        text = str(node.value).replace("_", "").lstrip("+-")
        if ":" in text or re.fullmatch(r"0[0-9]+|0b[01]+", text):
            raise yaml.constructor.ConstructorError(
                None, None, f"{node.value} is read as {value} in YAML 1.1: write it in decimal",
                node.start_mark,
            )  # fmt: skip

    def construct_decimal_int(self, node: yaml.ScalarNode) -> int:
        value = self.construct_yaml_int(node)
        self._refuse_surprise(node, value)
        return value

    def construct_decimal_float(self, node: yaml.ScalarNode) -> float:
        value = self.construct_yaml_float(node)
        self._refuse_surprise(node, value)
        return value


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_decimal_int)
_UniqueKeyLoader.add_constructor(
    "tag:yaml.org,2002:float", _UniqueKeyLoader.construct_decimal_float
)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error in one line (PyYAML's own message spans several, with a caret drawing)."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is None or problem is None:
        return " ".join(str(e).split())
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def load_config(path: str | Path | None = None, resolve: bool = True) -> Config:
    """Read, validate and resolve a YAML config (None: the shipped default); `resolve`:
    as `config_from_dict`'s."""
    src = config_source(path)
    try:
        text = src.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{src}: cannot read: {e}") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{src}: not valid YAML: {_yaml_problem(e)}") from None
    return config_from_dict({} if raw is None else raw, str(src), resolve)
