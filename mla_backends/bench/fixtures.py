"""What the benchmarks run on: a pool of random rows (never zeros) with pages handed out
shuffled and one decode / verify batch over it, random MHA-prefill inputs, the configs the
suites build, the traffic / FLOP counts of ../shared/ANCHORS.md, and the one-line errors of a
size that does not fit in memory."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch

from mla_backends.arith import cdiv
from mla_backends.backends.base import Capability
from mla_backends.backends.registry import get_backend_class
from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.cli import UsageError
from mla_backends.config import DEEPSEEK_V3, Config, ConfigError, MLADims
from mla_backends.runtime import Runtime


@dataclass
class DecodeSetup:
    rt: Runtime
    batch: ForwardBatch
    q_nope: torch.Tensor  # [T, H, L]
    q_rope: torch.Tensor  # [T, H, R]
    heads: int
    q_len: int
    kv_len: int


def require_runs(
    name: str, config: Config, cap: Capability, role: str = "decode", option: str = "--backends"
) -> None:
    """ConfigError naming the option, the backend and the reason unless it can serve `role`
    for `config` here."""
    reason = get_backend_class(name).supports(config, cap, role)
    if reason is not None:
        raise ConfigError(f"{option}: {name!r} cannot run here: {reason}")


def pool_bytes(config: Config) -> int:
    """The bytes of `config`'s KV pool (`MLATokenToKVPool.total_bytes`: the reserved page 0
    included), known before it is allocated."""
    slots = (config.num_pages + 1) * config.page_size
    return config.num_layers * slots * config.model.kv_dim * config.torch_kv_dtype.itemsize


def require_fits(config: Config, options: str) -> None:
    """UsageError naming `options` when `config`'s KV pool alone is larger than the GPU's free
    memory: said before any timing, not at the shape's turn. The pool is a lower bound on what
    a setup allocates, so nothing that would fit is refused; the rest is `out_of_memory`'s."""
    dev = config.torch_device
    if dev.type != "cuda":  # a CPU's free memory is not asked; its allocation error is caught
        return
    # Blocks this process's caching allocator holds unused (the ceilings' buffers) are free too.
    free = torch.cuda.mem_get_info(dev)[0]
    free += torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    need = pool_bytes(config)
    if need > free:
        raise UsageError(
            f"{options}: out of memory on {dev}: the KV pool alone needs {need / 2**30:.1f} GiB, "
            f"{free / 2**30:.1f} GiB is free; give smaller values"
        )


def backend_config(config: Config, name: str, cap: Capability, heads: list[int]) -> Config:
    """The config with `name` as decode backend, at a page size it takes for every head count
    of the grid; a ConfigError naming the backend and the reason if there is none."""
    cls = get_backend_class(name)
    reason = None
    for page in (config.page_size, *cls.caps.page_sizes):
        cfg = dataclasses.replace(config, page_size=page, decode_backend=name)
        reasons = [
            cls.supports(dataclasses.replace(cfg, model=cfg.model.with_heads(h)), cap, "decode")
            for h in heads
        ]
        reason = next((r for r in reasons if r is not None), None)
        if reason is None:
            return cfg
    raise ConfigError(f"--backends: {name!r} cannot run here: {reason}")


def setup_config(
    backend: str,
    heads: int,
    batch: int,
    kv_len: int,
    page_size: int = 64,
    kv_dtype: str = "bfloat16",
    dims: MLADims = DEEPSEEK_V3,
    device: str = "cuda",
    dtype: str = "bfloat16",
) -> Config:
    """One layer, a pool of exactly the batch's pages (the pool adds its dummy page)."""
    return Config(
        model=dataclasses.replace(dims, num_heads=heads),
        num_layers=1,
        prefill_backend=backend,
        decode_backend=backend,
        page_size=page_size,
        kv_dtype=kv_dtype,
        dtype=dtype,
        num_pages=batch * cdiv(kv_len, page_size),
        max_requests=batch,
        max_context_len=kv_len,
        device=device,
    )


def decode_setup(
    backend: str,
    heads: int,
    q_len: int,
    batch: int,
    kv_len: int,
    page_size: int = 64,
    kv_dtype: str = "bfloat16",
    seed: int = 0,
    dims: MLADims = DEEPSEEK_V3,
    device: str = "cuda",
    dtype: str = "bfloat16",
) -> DecodeSetup:
    """A pool filled with random rows, pages handed out shuffled, one decode/verify batch."""
    cfg = setup_config(backend, heads, batch, kv_len, page_size, kv_dtype, dims, device, dtype)
    pages, dims = cfg.num_pages, cfg.model
    order = list(range(1, pages + 1))
    random.Random(seed).shuffle(order)
    rt = Runtime.build(cfg, order)
    buf = rt.kv_pool.kv_buffer[0]
    buf.copy_(torch.randn(buf.shape, device=buf.device).to(buf.dtype))
    if rt.kv_pool.is_fp8:
        rt.kv_pool.set_scale(0, 0.05)
    rows = rt.req_pool.alloc(batch)
    rt.allocator.alloc_extend(rows, [kv_len - q_len] * batch)
    loc = rt.allocator.alloc_extend(rows, [q_len] * batch)
    mode = ForwardMode.DECODE if q_len == 1 else ForwardMode.TARGET_VERIFY
    fb = ForwardBatch.build(mode, rows, [kv_len - q_len] * batch, [q_len] * batch, loc, device)
    t = batch * q_len
    # One [T, H, L + R] buffer, q_nope / q_rope its column ranges: how a model lays out the
    # absorbed query (FlashMLA reads it whole, with no concatenation copy).
    q = torch.randn(t, heads, dims.kv_dim, device=device).to(getattr(torch, dtype))
    q_nope, q_rope = q[..., : dims.kv_lora_rank], q[..., dims.kv_lora_rank :]
    if backend == "flashinfer_mla":  # its parity tests cover contiguous halves only
        q_nope, q_rope = q_nope.contiguous(), q_rope.contiguous()
    return DecodeSetup(rt, fb, q_nope, q_rope, heads, q_len, kv_len)


def traffic(s: DecodeSetup) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode call, as ANCHORS.md counts them (576 + 512 = 1088 at
    DeepSeek dims: the cache row once; q in and out once)."""
    b, d = s.batch.batch_size, s.rt.config.model
    elem = s.rt.kv_pool.kv_buffer[0].element_size()
    width = d.kv_dim + d.kv_lora_rank
    nbytes = d.kv_dim * elem * b * s.kv_len + b * s.q_len * s.heads * width * 2
    flops = 2 * b * s.q_len * s.heads * s.kv_len * width
    return float(nbytes), float(flops)


@dataclass
class PrefillInputs:
    """One causal request of `tokens`, DeepSeek MHA-mode widths (qk 192, v 128), bf16."""

    q: torch.Tensor  # [T, H, 192]
    k: torch.Tensor  # [T, H, 192]
    v: torch.Tensor  # [T, H, 128]
    dims: MLADims
    flops: int  # causal: half of 4 * T^2 * H * d / 2

    @classmethod
    def random(cls, tokens: int, heads: int, device: torch.device) -> PrefillInputs:
        dims = prefill_dims(heads)
        q = torch.randn(tokens, heads, 192, device=device, dtype=torch.bfloat16)
        k = torch.randn(tokens, heads, 192, device=device, dtype=torch.bfloat16)
        v = torch.randn(tokens, heads, 128, device=device, dtype=torch.bfloat16)
        return cls(q, k, v, dims, tokens * tokens * heads * (192 + 128))


def prefill_dims(heads: int) -> MLADims:
    return dataclasses.replace(DEEPSEEK_V3, num_heads=heads)


def prefill_config(backend: str, dims: MLADims, device: torch.device) -> Config:
    """A one-request, one-page config: MHA-mode prefill reads no pool."""
    return Config(
        model=dims,
        num_layers=1,
        prefill_backend=backend,
        decode_backend=backend,
        num_pages=1,
        max_requests=1,
        device=str(device),
    )
