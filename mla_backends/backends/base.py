"""The backend contract. The model calls `forward_absorbed` / `forward_mha` and nothing else.

Per forward batch: `init_forward_metadata(batch)` once, then every layer reuses it.
CUDA graphs: `init_cuda_graph_state(max_bs, max_num_tokens)` allocates static buffers once;
`init_forward_metadata_capture(batch)` binds slices of them; `init_forward_metadata_replay(
batch)` refills them in place. Padded rows carry `cuda_graph_seq_len_fill_value`.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from mla_backends.batch import ForwardBatch, RaggedLayout
from mla_backends.checks import check_tensor
from mla_backends.config import Config, MLADims
from mla_backends.pool import MLATokenToKVPool, ReqToTokenPool

ROLES = ("decode", "prefill")


@dataclass(frozen=True)
class Capability:
    """What the machine offers: device type and, on CUDA, the SM version and name."""

    device_type: str
    sm: tuple[int, int] | None = None
    device_name: str = "cpu"

    @classmethod
    def detect(cls, device: torch.device) -> Capability:
        if device.type != "cuda":
            return cls(device.type)
        return cls(
            "cuda",
            torch.cuda.get_device_capability(device),
            torch.cuda.get_device_name(device),
        )

    def describe(self) -> str:
        if self.sm is None:
            return f"{self.device_type} (no GPU)"
        return f"{self.device_name} (SM{self.sm[0]}{self.sm[1]})"


@dataclass(frozen=True)
class BackendContext:
    """What every backend is built from."""

    config: Config
    kv_pool: MLATokenToKVPool
    req_to_token_pool: ReqToTokenPool

    @property
    def dims(self) -> MLADims:
        return self.config.model

    @property
    def device(self) -> torch.device:
        return self.kv_pool.device


class MLABackend(ABC):
    """One attention backend. Subclasses implement `_attend_absorbed` (and `_attend_mha` if
    they do MHA-mode prefill); inputs are validated and new rows stored here, once."""

    name: ClassVar[str]
    page_sizes: ClassVar[tuple[int, ...]] = (1, 16, 32, 64, 128)
    kv_dtypes: ClassVar[tuple[str, ...]] = ("float32", "bfloat16", "float16", "float8_e4m3fn")
    roles: ClassVar[tuple[str, ...]] = ROLES
    supports_graphs: ClassVar[bool] = False
    provides_lse: ClassVar[bool] = True  # False: forward_absorbed(return_lse=True) raises
    # True: runs compiled on a CPU; "auto" on a CPU prefers such a backend to one that runs
    # there only interpreted (Triton's interpreter, a test tool).
    cpu_native: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        """Every backend's `init_forward_metadata` first runs `check_batch`, so a batch naming
        request rows never allocated, or reading past what a row stored, fails with a named
        error before any index is built from it (an index past the stored tokens reads stale
        or dummy slots, or out of bounds in a kernel)."""
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("init_forward_metadata")
        if init is None or getattr(init, "checks_batch", False):
            return

        @functools.wraps(init)
        def checked(self: MLABackend, batch: ForwardBatch) -> None:
            self.check_batch(batch)
            init(self, batch)

        checked.checks_batch = True  # type: ignore[attr-defined]
        cls.init_forward_metadata = checked  # type: ignore[method-assign]

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        self.dims = ctx.dims
        self.pool = ctx.kv_pool
        self.req_to_token = ctx.req_to_token_pool.req_to_token
        self.device = ctx.device
        self.scale = ctx.dims.softmax_scale
        self._checked_batch: ForwardBatch | None = None

    # ------------------------------------------------------------------ capability
    @classmethod
    def supports(cls, config: Config, cap: Capability, role: str) -> str | None:
        """None if this backend can serve `role` for `config` on `cap`, else the reason."""
        if role not in cls.roles:
            return f"{cls.name} has no {role} path (it serves: {', '.join(cls.roles)})"
        if config.page_size not in cls.page_sizes:
            return f"{cls.name} needs page_size in {cls.page_sizes}, config has {config.page_size}"
        if config.kv_dtype not in cls.kv_dtypes:
            return f"{cls.name} needs kv_dtype in {cls.kv_dtypes}, config has {config.kv_dtype!r}"
        return cls._supports_extra(config, cap, role)

    @classmethod
    def _supports_extra(cls, config: Config, cap: Capability, role: str) -> str | None:
        return None

    # ------------------------------------------------------------------ metadata
    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Build everything the attention calls of this batch need, once."""

    # ------------------------------------------------------------------ checks
    def check_batch(self, batch: ForwardBatch) -> None:
        """RequestRowError if the batch names a request row never allocated or reads past
        what a row stored (`ReqToTokenPool.check_batch`); once per batch object, host only."""
        if batch is not self._checked_batch:
            self.ctx.req_to_token_pool.check_batch(batch)
            self._checked_batch = batch

    # ------------------------------------------------------------------ attention
    def forward_absorbed(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        k_nope: torch.Tensor | None,
        k_rope: torch.Tensor | None,
        batch: ForwardBatch,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Absorbed latent attention (decode, target-verify, extend over a cached prefix).

        q_nope [T, H, L] (already multiplied by w_kc), q_rope [T, H, R]; the new rows
        k_nope [T, L], k_rope [T, R] are stored at `batch.out_cache_loc` first (pass None if
        they are stored already). Returns out [T, H, L] in q's dtype, and lse [T, H] fp32
        (natural log) if asked."""
        layer = self.pool.check_layer(layer)
        self.pool.warn_if_uncalibrated(layer)
        self.check_batch(batch)
        d, t = self.dims, batch.num_tokens
        act = (torch.float32, torch.bfloat16, torch.float16)
        check_tensor("q_nope", q_nope, (t, d.num_heads, d.kv_lora_rank), act, self.device)
        check_tensor(
            "q_rope", q_rope, (t, d.num_heads, d.qk_rope_head_dim), q_nope.dtype, self.device
        )
        if (k_nope is None) != (k_rope is None):
            raise ValueError("k_nope and k_rope must both be given or both be None")
        if k_nope is not None and k_rope is not None:
            self.store_kv(layer, batch.out_cache_loc, k_nope, k_rope)
        out, lse = self._attend_absorbed(layer, q_nope, q_rope, batch, return_lse)
        return (out, lse) if return_lse else out

    def effective_query(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The query values the kernel really attends with: identity unless the kernel takes
        q in FP8 (TRT-LLM with an FP8 pool). References use this to check such kernels."""
        return q_nope, q_rope

    @property
    def quantizes_query(self) -> bool:
        return False

    @staticmethod
    def joined_query(q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        """[T, H, L + R] query for kernels that take it whole (FlashMLA). Zero-copy when the
        caller passed q_nope / q_rope as the two column ranges of one [T, H, L + R] buffer
        (what a model writing both projections into one buffer gets); otherwise a copy."""
        lat = q_nope.shape[-1]
        if (
            q_rope.data_ptr() == q_nope.data_ptr() + lat * q_nope.element_size()
            and q_nope.stride() == q_rope.stride()
            and q_nope.stride(-1) == 1
            and q_nope.stride(1) == lat + q_rope.shape[-1]
            and q_nope.stride(0) == q_nope.shape[1] * q_nope.stride(1)
        ):
            return q_nope.as_strided((*q_nope.shape[:2], q_nope.stride(1)), q_nope.stride())
        return torch.cat([q_nope, q_rope], dim=-1)

    def prefix_rows(
        self, layer: int, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor, RaggedLayout]:
        """The cached prefix of every request in an EXTEND batch, dequantized:
        (latent [N, L] fp32, k_rope [N, R] fp32, layout: q = new tokens, kv = prefix rows).
        For chunked-prefix MHA prefill, where the prefix is expanded through kv_b_proj and
        merged with the new tokens' causal part by LSE. Sizes from the CPU copies: no sync."""
        from mla_backends.indices import build_token_indices

        layer = self.pool.check_layer(layer)
        self.check_batch(batch)
        pre_cpu = batch.extend_prefix_lens_cpu
        _, slots = build_token_indices(
            self.req_to_token, batch.req_pool_indices, batch.extend_prefix_lens, int(pre_cpu.sum())
        )
        rows = self.pool.load_rows(layer, slots)
        lat = self.dims.kv_lora_rank
        layout = RaggedLayout.from_lens(
            batch.extend_seq_lens_cpu.tolist(), pre_cpu.tolist(), self.device
        )
        return rows[:, :lat], rows[:, lat:], layout

    @staticmethod
    def mask_empty_rows(
        out: torch.Tensor, lse: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Contract for zero-length KV rows: out 0, lse -inf, whatever a kernel wrote there.
        Decided on the host from the CPU lengths, so batches without such rows (all decode
        steps, every padded graph batch) pay nothing."""
        if not bool((batch.seq_lens_cpu == 0).any()):
            return out, lse
        empty = (batch.seq_lens == 0).repeat_interleave(
            batch.extend_seq_lens.long(), output_size=batch.num_tokens
        )
        out = out.masked_fill(empty[:, None, None], 0.0)
        return out, None if lse is None else lse.masked_fill(empty[:, None], float("-inf"))

    def store_kv(
        self, layer: int, loc: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor
    ) -> None:
        """Write the new latent rows; backends with a fused store kernel override this."""
        self.pool.set_mla_kv_buffer(layer, loc, k_nope, k_rope)

    @abstractmethod
    def _attend_absorbed(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        batch: ForwardBatch,
        need_lse: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out [T, H, L], lse [T, H] fp32) over the cached rows, bottom-right causal."""

    def forward_mha(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: RaggedLayout,
        causal: bool = True,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """MHA-mode prefill over ragged requests: q [Tq, H, P+R], k [Tk, H, P+R], v [Tk, H, V]
        -> out [Tq, H, V] (and lse [Tq, H] fp32, natural log). Causal is bottom-right."""
        d = self.dims
        h, dqk = d.num_heads, d.qk_head_dim
        act = (torch.float32, torch.bfloat16, torch.float16)
        check_tensor("q", q, (layout.num_q, h, dqk), act, self.device)
        check_tensor("k", k, (layout.num_kv, h, dqk), q.dtype, self.device)
        check_tensor("v", v, (layout.num_kv, h, d.v_head_dim), q.dtype, self.device)
        out, lse = self._attend_mha(q, k, v, layout, causal, return_lse)
        if return_lse and lse is None:
            raise RuntimeError(f"backend {self.name!r} returned no LSE although it was asked")
        return (out, lse) if return_lse else out

    def _attend_mha(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: RaggedLayout,
        causal: bool,
        need_lse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(out [Tq, H, V], lse [Tq, H] fp32 or None when not `need_lse`)."""
        raise NotImplementedError(
            f"backend {self.name!r} has no MHA-mode prefill; set prefill_backend to one that has"
        )

    # ------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        raise NotImplementedError(f"backend {self.name!r} does not support CUDA graphs")

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        raise NotImplementedError(f"backend {self.name!r} does not support CUDA graphs")

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        raise NotImplementedError(f"backend {self.name!r} does not support CUDA graphs")

    @property
    def cuda_graph_seq_len_fill_value(self) -> int:
        """seq_len written into padded graph rows (request row 0, dummy page)."""
        return 1
