"""The `triton` sparse backend: our sparse kernels on any CUDA GPU (SM80+, FP8 rows SM89+), and
on CPU under TRITON_INTERPRET=1 (tests). Both pool formats. On SM90 at H a multiple of 64 the
Gluon kernels (`gluon_kernel.py` for bf16 / fp16 rows, `gluon_fp8row.py` for FP8 rows) take
the call; everywhere else, and as their fallback, the `tl.dot` kernel (`triton_kernel.py`)."""

from __future__ import annotations

import functools

import torch

from mla_backends.backends.base import Capability
from mla_backends.backends.context import joined
from mla_backends.backends.kernel_packages import need_triton, need_triton_sm
from mla_backends.kernels.common import interpreting, num_sms
from mla_backends.sparse.base import (
    SparseCaps,
    SparseContext,
    SparseMLABackend,
    register_sparse_backend,
)
from mla_backends.sparse.fp8_row import Fp8RowPool


def choose_splits(
    programs: int, topk: int, sms: int, block_n: int, max_splits: int = 64, one_wave: bool = False
) -> int:
    """Split the index list until the grid fills the GPU about twice (one_wave: the most
    splits that stay in one wave), down to one key block a split; a power of two (the merge
    kernel's arange needs one). At batch 1 a program's time is a chain of dependent loads
    (indices, then the rows they name) per block, so one block a program is the shortest
    chain; the merge then reads splits x heads partial rows. The Gluon kernels hold one CTA an
    SM: at H128 on an H100 two waves took 1.3-1.6x one wave's time from 4 tokens on
    (BENCHMARKS.md, fifteenth session)."""
    n = max(programs, 1)
    fill = sms // n if one_wave else round(2 * sms / n)
    want = max(1, min(fill, topk // block_n, max_splits))
    return 1 << (want.bit_length() - 1)


# Launch configurations from H100 timings (`scripts/bench_sparse.py --triton-configs`);
# registers / spilled bytes a thread from SM90 offline compiles with the pointers and
# strides aligned as at run time (`scripts/compile_sparse_sm90.py`, Triton 3.9):
# H16 bf16 rows 16 x 64 keys, 4 warps, 2 stages (186 regs, no spill; 205 with Triton 3.6):
# 0.8-1.3 us faster than 16 x 32 x 3 stages at batch 1 (32 splits, half the partials to
# merge), 2-3 % at batch 64, the same at 16 (H100, twenty-third session); H16 FP8 rows 16 x
# 32: 255 regs, 8 B. H128: 64 heads x 64 keys, 8 warps (one wgmma row block; 255 regs, 312 B
# spilled) timed faster than 32 x 64 at batch 16 (74 against 96 us) and 64 (187-191
# against 294), within 0.4 us at batch 1 (16k and 128k). FP8 rows at H128 spill in every
# shape tried (in-register dequantisation): 64 x 16, 8 warps, 304 B. (The compiles behind
# the choice, before pointers were marked aligned, counted more: 236 regs, 1112 B, 408 B.)
# Keys a tile of the Gluon sparse kernels (`gluon_kernel.BLOCK_N`; a CPU test holds them equal)
GLUON_BLOCK_N = 64
LAUNCH = {
    (16, False): {"block_m": 16, "block_n": 64, "num_warps": 4, "num_stages": 2},
    (16, True): {"block_m": 16, "block_n": 32, "num_warps": 4, "num_stages": 3},
    (64, False): {"block_m": 64, "block_n": 64, "num_warps": 8, "num_stages": 2},
    (64, True): {"block_m": 64, "block_n": 16, "num_warps": 8, "num_stages": 2},
}


def launch_splits(cfg: dict[str, int], heads: int, tokens: int, topk: int, sms: int) -> int:
    """KV splits of the index list for `cfg`'s programs (`choose_splits`; one wave where
    `cfg` takes the Gluon kernel)."""
    programs = tokens * -(-heads // cfg["block_m"])
    # <= 4096 partial rows a token (8 MB of fp32 partials to write and merge at H128)
    cap = max(1, min(64, 4096 // heads))
    if cfg.get("gluon"):  # the Gluon kernels' 64 x 64 tiles, one CTA an SM
        return choose_splits(programs, topk, sms, GLUON_BLOCK_N, cap, one_wave=True)
    return choose_splits(programs, topk, sms, cfg["block_n"], cap)


def sm90_gpu(device: torch.device) -> bool:
    """Whether `device` is an SM90 GPU outside the Triton interpreter: where a Gluon kernel
    may run at all (`gluon_here` adds the route's state, which may change)."""
    return (
        device.type == "cuda"
        and not interpreting()
        and torch.cuda.get_device_capability(device) == (9, 0)
    )


def gluon_here(device: torch.device) -> bool:
    """Whether sparse calls on `device` may take the Gluon kernel: an SM90 GPU and the Gluon
    route open (`mla_attention.gluon_error`); the call's own tensors decide the rest."""
    if not sm90_gpu(device):
        return False
    # imported here: this module loads without triton (its refusal says it is missing)
    from mla_backends.kernels.mla_attention import gluon_error

    return gluon_error() is None


def launch_config(
    heads: int, fp8_rows: bool, tokens: int, topk: int, sms: int, gluon: bool = False
) -> dict[str, int]:
    """Tiles, warps, stages and KV splits of one `triton_kernel.sparse_mla` call: `tokens`
    query tokens of `heads` heads, `topk` indices each, bf16 rows or FP8 rows, on `sms` SMs.
    gluon: the call may take a Gluon kernel (an SM90, a bf16 / fp16 or FP8-row pool, the
    Gluon route open; the caller says): then "gluon" is set for H a multiple of 64, with the
    `tl.dot` kernel's 64-row tiles and split count ("tl_splits") as its fallback. A fresh
    dict each call (callers may change theirs); the rule runs once per argument set
    (`_launch_rule`): every layer of a batch asks for the same launch, and the rule alone is
    ~5 us of Python a call."""
    if interpreting():
        return {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1, "splits": 2}
    return dict(_launch_rule(heads, fp8_rows, tokens, topk, sms, gluon))


@functools.lru_cache(maxsize=256)
def _launch_rule(
    heads: int, fp8_rows: bool, tokens: int, topk: int, sms: int, gluon: bool
) -> dict[str, int]:
    """`launch_config` off the interpreter. Shared by every caller: never mutate it."""
    cfg = dict(LAUNCH[(16 if heads <= 16 else 64, fp8_rows)])
    splits = launch_splits(cfg, heads, tokens, topk, sms)
    if gluon and heads % 64 == 0:
        # "splits" the Gluon kernel's (one wave), "tl_splits" the tl.dot fallback's own
        cfg |= {"gluon": 1, "tl_splits": splits}
        splits = launch_splits(cfg, heads, tokens, topk, sms)
    return {**cfg, "splits": splits}


@register_sparse_backend("triton")
class TritonSparseBackend(SparseMLABackend):
    name = "triton"
    caps = SparseCaps(pool_kinds=("paged", "fp8_row"))

    @classmethod
    def _machine_reason(cls, ctx: SparseContext, cap: Capability) -> str | None:
        fp8 = ctx.fp8_rows or getattr(ctx.pool, "is_fp8", False)
        reasons = [
            need_triton(cap.device_type),
            need_triton_sm(cap, fp8, "the sparse Triton kernel needs"),
        ]
        d = ctx.dims
        bad = [n for n in (d.kv_lora_rank, d.qk_rope_head_dim) if n < 16 or n & (n - 1)]
        if bad:
            got = ", ".join(map(str, bad))
            reasons.append(f"the sparse Triton kernel needs L and R powers of two >= 16, got {got}")
        return joined(reasons)

    def __init__(self, ctx: SparseContext) -> None:
        super().__init__(ctx)
        from mla_backends.kernels.mla_attention import gluon_error
        from mla_backends.sparse import triton_kernel

        self._kernel, self._gluon_error = triton_kernel, gluon_error
        self._sms = num_sms(self.device)
        self._fmt = ctx.pool.fmt if isinstance(ctx.pool, Fp8RowPool) else None
        # bf16 / fp16 pools and FP8 rows may take a Gluon kernel (`gluon_here`, then each
        # kernel's `usable`); e4m3 pools under a per-layer scale stay on `tl.dot`
        gluon_pool = self._fmt is not None or not getattr(ctx.pool, "is_fp8", False)
        # `gluon_here` but the route's state, asked once (the device does not change)
        self._gluon_device = gluon_pool and sm90_gpu(self.device)
        # a launch config instead of LAUNCH's (with "splits": that split count, else the rule)
        self.launch: dict[str, int] | None = None
        # the `tl.dot` kernel's merge inside its launch (`triton_kernel.merges_here`: batch
        # 2-4 at H16, bf16 / fp16 rows); this backend's calls run on one stream
        # (`sparse_mla`'s hazard). merge_here: off for benchmarks' A/B (MLA_SPARSE_MERGE_HERE=0
        # turns it off for the process)
        self._sync = torch.zeros(2, dtype=torch.int32, device=self.device)
        self.merge_here = True

    def _launch(self, tokens: int) -> dict[str, int]:
        """The launch of a call over `tokens` query tokens: a sweep's `launch`, else the
        rule's (`launch_config`, with the Gluon route's state now). Hazard: the interpreter
        runs the same `tl.dot` kernel, and a sweep's `launch` was dropped there without a
        word (the interpreter's own tiles and splits ran instead); it is taken there too."""
        h = self.dims.num_heads
        if self.launch is None:
            gluon = self._gluon_device and self._gluon_error() is None
            return launch_config(h, self._fmt is not None, tokens, self.topk, self._sms, gluon)
        cfg = dict(self.launch)  # a sweep's config (with "splits": that split count)
        if "splits" not in cfg:
            cfg["splits"] = launch_splits(cfg, h, tokens, self.topk, self._sms)
        return cfg

    def _attend(
        self, layer: int, q_nope: torch.Tensor, q_rope: torch.Tensor, indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kernel.attend(
            q_nope,
            q_rope,
            self.pool.kv_buffer[layer],
            indices,
            self.scale,
            self.pool.scale(layer),
            self._launch(q_nope.shape[0]),
            self._fmt,
            self._sync if self.merge_here else None,
        )
