"""What one forward pass carries: the mode, request rows, lengths (device + CPU copies), slots."""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from mla_backends.checks import ShapeError


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill, with or without a cached prefix; q_len varies per request
    DECODE = "decode"  # q_len == 1 for every request
    TARGET_VERIFY = "target_verify"  # q_len == num_draft_tokens for every request
    IDLE = "idle"  # no tokens (a data-parallel rank with nothing to do)

    @property
    def is_decode_or_verify(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)


def is_bool(v: object) -> bool:
    """A Python bool or a torch bool tensor (operator.index takes both as 0 / 1; numpy's
    bool it refuses itself)."""
    return isinstance(v, bool) or (isinstance(v, torch.Tensor) and v.dtype == torch.bool)


def as_ints(values: Sequence[int], name: str) -> list[int]:
    """Python ints (numpy / torch integers too); anything else is a TypeError naming `name`.
    Hazard: an int32 tensor made from floats truncates them, silently (prefix 1.5 -> 1)."""
    try:
        if any(is_bool(v) for v in values):  # operator.index(True) is 1
            raise TypeError
        return [operator.index(v) for v in values]
    except TypeError:
        raise TypeError(f"{name} must be integers, got {list(values)}") from None


def as_int(value: int, name: str) -> int:
    """One `as_ints` value. Hazard: a bool row (numpy's `a[True] = x` sets every entry) or a
    float (found in a dict by its hash, then refused by numpy half-way) rewrote host state."""
    try:
        return as_ints([value], name)[0]
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None


def as_int_at_least(value: int, name: str, low: int) -> int:
    """`value` as an int >= `low`, else one ValueError naming `name`, whatever was wrong with
    it. Hazard: `operator.index` takes a bool (a torch one too) as 0 / 1, and refuses a float
    with a TypeError that names no argument."""
    try:
        n: int | None = as_int(value, name)
    except TypeError:
        n = None
    if n is None or n < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return n


_CPU = torch.device("cpu")
_INT_DTYPES = frozenset(
    (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
    + (torch.uint16, torch.uint32, torch.uint64)  # torch >= 2.3
)


def _check_field(name: str, t: object, n: int, what: str, device: torch.device) -> None:
    """ShapeError unless `t` is a 1-D integer tensor of `n` entries on `device` (a device
    with its index: `t.device == device` is the whole test, ~0.1 us). Not `check_tensor`:
    this runs for every field of every batch, and that general form (dtype tuples, device
    index resolution) made the batch check 42.7 us, this one 13.3 (BENCHMARKS.md)."""
    if not isinstance(t, torch.Tensor):
        raise ShapeError(f"ForwardBatch.{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.numel() != n:
        raise ShapeError(
            f"ForwardBatch.{name}: expected shape [{n}] (the batch's {what}), got {list(t.shape)}"
        )
    if t.dtype not in _INT_DTYPES:
        raise ShapeError(f"ForwardBatch.{name}: expected an integer dtype, got {t.dtype}")
    if t.device != device:
        raise ShapeError(f"ForwardBatch.{name}: expected device {device}, got {t.device}")


def _i32(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32)


@dataclass
class RaggedLayout:
    """Ragged q / kv segments for MHA-mode attention: request i owns q rows
    `qo_indptr[i]:qo_indptr[i+1]` and kv rows `kv_indptr[i]:kv_indptr[i+1]`.
    Causal masks are bottom-right aligned: query j of n sees `kv_len - n + j + 1` keys."""

    qo_indptr: torch.Tensor  # [B + 1] int32, device
    kv_indptr: torch.Tensor  # [B + 1] int32, device
    qo_indptr_cpu: torch.Tensor  # [B + 1] int32, cpu
    kv_indptr_cpu: torch.Tensor  # [B + 1] int32, cpu

    @classmethod
    def from_lens(
        cls, q_lens: Sequence[int], kv_lens: Sequence[int], device: torch.device | str
    ) -> RaggedLayout:
        if len(q_lens) != len(kv_lens):
            raise ValueError(f"q_lens ({len(q_lens)}) and kv_lens ({len(kv_lens)}) differ")
        # Hazard: a negative length made the indptr step back (a request read another's
        # rows, or none) and a float one was truncated by the int32 tensor, silently
        q_lens, kv_lens = as_ints(q_lens, "q_lens"), as_ints(kv_lens, "kv_lens")
        if min(q_lens + kv_lens, default=0) < 0:
            raise ValueError(f"q_lens and kv_lens must be >= 0, got {q_lens} / {kv_lens}")
        qo = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        kv = torch.zeros(len(kv_lens) + 1, dtype=torch.int32)
        qo[1:] = torch.cumsum(_i32(q_lens), 0)
        kv[1:] = torch.cumsum(_i32(kv_lens), 0)
        return cls(qo.to(device), kv.to(device), qo, kv)

    @property
    def batch_size(self) -> int:
        return self.qo_indptr_cpu.numel() - 1

    @property
    def num_q(self) -> int:
        return int(self.qo_indptr_cpu[-1])

    @property
    def num_kv(self) -> int:
        return int(self.kv_indptr_cpu[-1])

    @property
    def max_q_len(self) -> int:
        return (
            int((self.qo_indptr_cpu[1:] - self.qo_indptr_cpu[:-1]).max()) if self.batch_size else 0
        )

    @property
    def max_kv_len(self) -> int:
        return (
            int((self.kv_indptr_cpu[1:] - self.kv_indptr_cpu[:-1]).max()) if self.batch_size else 0
        )


@dataclass
class ForwardBatch:
    """One forward pass. Every length exists on the device and as a CPU copy; backends read
    the CPU copies for host-side sizes, so building metadata needs no device-to-host sync.

    `seq_lens` is the KV length *after* this pass (prefix + new tokens); `extend_seq_lens` is
    the number of new (query) tokens per request, 1 in DECODE, num_draft_tokens in TARGET_VERIFY.

    Build a new batch for every forward pass. Hazard: a batch changed in place and passed
    again is the same object to the backends, so its checks are not rerun and its cached
    host sizes (`max_kv_len`, the layouts) are the old ones.
    """

    mode: ForwardMode
    req_pool_indices: torch.Tensor  # [B] int32, device
    seq_lens: torch.Tensor  # [B] int32, device
    seq_lens_cpu: torch.Tensor  # [B] int32, cpu
    extend_prefix_lens: torch.Tensor  # [B] int32, device
    extend_prefix_lens_cpu: torch.Tensor  # [B] int32, cpu
    extend_seq_lens: torch.Tensor  # [B] int32, device
    extend_seq_lens_cpu: torch.Tensor  # [B] int32, cpu
    out_cache_loc: torch.Tensor  # [T] int64, device: slot of each new token
    positions: torch.Tensor  # [T] int64, device: position of each new token in its request
    num_draft_tokens: int = 0
    # [B] int32, cpu: the request rows, for host-side checks (`ReqToTokenPool.check_batch`);
    # None in batches built over static buffers (a graph runner's).
    req_pool_indices_cpu: torch.Tensor | None = None
    _prefix_slots: torch.Tensor | None = field(default=None, init=False, repr=False)

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        rows: Sequence[int],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        out_cache_loc: torch.Tensor,
        device: torch.device | str,
    ) -> ForwardBatch:
        """Assemble a batch from host-side lists (the scheduler's view)."""
        if not len(rows) == len(prefix_lens) == len(extend_lens):
            raise ValueError("rows, prefix_lens and extend_lens must have the same length")
        rows, prefix_lens = as_ints(rows, "rows"), as_ints(prefix_lens, "prefix_lens")
        extend_lens = as_ints(extend_lens, "extend_lens")
        if mode is ForwardMode.IDLE and rows:
            raise ValueError(f"IDLE carries no requests, got rows {rows}")
        bad = [(p, n) for p, n in zip(prefix_lens, extend_lens) if p < 0 or n < 0]
        if bad:  # a negative prefix attended nothing (out 0, LSE -inf), silently
            raise ValueError(f"prefix and extend lengths must be >= 0, got (prefix, extend) {bad}")
        if mode is ForwardMode.DECODE and any(n != 1 for n in extend_lens):
            raise ValueError(f"DECODE needs one new token per request, got {list(extend_lens)}")
        draft = 0
        if mode is ForwardMode.TARGET_VERIFY:
            if len(set(extend_lens)) > 1:
                raise ValueError(f"TARGET_VERIFY needs equal q_len, got {list(extend_lens)}")
            draft = extend_lens[0] if extend_lens else 0
        seq = [p + n for p, n in zip(prefix_lens, extend_lens)]
        if out_cache_loc.numel() != sum(extend_lens):
            raise ValueError(
                f"out_cache_loc has {out_cache_loc.numel()} slots, "
                f"batch has {sum(extend_lens)} tokens"
            )
        if out_cache_loc.dim() != 1:
            raise ValueError(
                f"out_cache_loc must be 1-D [tokens], got shape {list(out_cache_loc.shape)}"
            )
        # Hazard: a float slot id was cast silently (fp32 rounds ids past 2**24, bf16 past 256)
        # and the token's KV landed in another request's slot.
        if out_cache_loc.is_floating_point() or out_cache_loc.dtype == torch.bool:
            raise TypeError(f"out_cache_loc must hold integer slots, got {out_cache_loc.dtype}")
        positions = (
            torch.cat([torch.arange(p, s, dtype=torch.int64) for p, s in zip(prefix_lens, seq)])
            if rows
            else torch.empty(0, dtype=torch.int64)
        )
        rows_t, seq_t, pre_t, ext_t = _i32(rows), _i32(seq), _i32(prefix_lens), _i32(extend_lens)
        return cls(
            mode=mode,
            req_pool_indices=rows_t.to(device),
            seq_lens=seq_t.to(device),
            seq_lens_cpu=seq_t,
            extend_prefix_lens=pre_t.to(device),
            extend_prefix_lens_cpu=pre_t,
            extend_seq_lens=ext_t.to(device),
            extend_seq_lens_cpu=ext_t,
            out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),
            positions=positions.to(device),
            num_draft_tokens=draft,
            req_pool_indices_cpu=rows_t,
        )

    def check(self, device: torch.device) -> None:
        """ShapeError unless the batch's fields agree: every per-request field [B] (B from
        `seq_lens_cpu`), `out_cache_loc` and `positions` [sum(extend_seq_lens_cpu)], integer
        dtypes, the CPU copies on the CPU and the rest on `device`. Hazard: fields built
        apart (an engine's own batch) that disagree on B gave one backend a wrong answer
        without an error (kernels size their grids from one field and read another) and
        another a traceback deep in an index. Metadata and CPU copies only: no sync."""
        if device.type == "cuda" and device.index is None:  # as tensors name theirs
            device = torch.device("cuda", torch.cuda.current_device())
        b, cpu = self.seq_lens_cpu.numel(), _CPU
        per_request = [
            ("req_pool_indices", self.req_pool_indices, device),
            ("seq_lens", self.seq_lens, device),
            ("seq_lens_cpu", self.seq_lens_cpu, cpu),
            ("extend_prefix_lens", self.extend_prefix_lens, device),
            ("extend_prefix_lens_cpu", self.extend_prefix_lens_cpu, cpu),
            ("extend_seq_lens", self.extend_seq_lens, device),
            ("extend_seq_lens_cpu", self.extend_seq_lens_cpu, cpu),
        ]
        if self.req_pool_indices_cpu is not None:
            per_request.append(("req_pool_indices_cpu", self.req_pool_indices_cpu, cpu))
        for name, t, dev in per_request:
            _check_field(name, t, b, "batch size (seq_lens_cpu)", dev)
        n = int(self.extend_seq_lens_cpu.sum())
        for name, t in (("out_cache_loc", self.out_cache_loc), ("positions", self.positions)):
            _check_field(name, t, n, "new tokens (sum of extend_seq_lens_cpu)", device)
        if self.mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY) and b:
            self._check_q_len(n, b)

    def _check_q_len(self, n: int, b: int) -> None:
        """Hazard: decode kernels and DCP take every request's query count from the mode and
        `num_draft_tokens` (1 in DECODE), not from `extend_seq_lens`: a verify batch built with
        `num_draft_tokens` left at 0 was read as one token a request."""
        d = self.num_draft_tokens
        q = 1 if self.mode is ForwardMode.DECODE else d
        if (self.mode is ForwardMode.DECODE and d > 1) or q < 1:
            raise ShapeError(
                f"ForwardBatch.num_draft_tokens: {d} in {self.mode.name} (DECODE takes 0 or 1, "
                "TARGET_VERIFY the query tokens of each request, >= 1)"
            )
        # b * q tokens in all and none past q: then every request has q (one host op).
        if n != b * q or int(self.extend_seq_lens_cpu.max()) != q:
            raise ShapeError(
                f"ForwardBatch.extend_seq_lens_cpu: {self.mode.name} with num_draft_tokens {d} "
                f"needs {q} new token(s) per request, got {self.extend_seq_lens_cpu.tolist()}"
            )

    @property
    def batch_size(self) -> int:
        return self.seq_lens_cpu.numel()

    @property
    def num_tokens(self) -> int:
        return self.out_cache_loc.numel()

    @property
    def q_len(self) -> int:
        """Query tokens of every request in DECODE (1) and TARGET_VERIFY (`num_draft_tokens`):
        what decode kernels, graph runners and the linear layers size from. `check` holds
        `extend_seq_lens_cpu` to it. Meaningless for EXTEND, whose requests differ (it gives 1)."""
        return max(self.num_draft_tokens, 1)

    @property
    def has_prefix(self) -> bool:
        return bool(self.extend_prefix_lens_cpu.numel()) and bool(
            (self.extend_prefix_lens_cpu > 0).any()
        )

    # Built once per batch on first use and read by every layer (each is a host-to-device
    # copy; the model's layer loop must not rebuild them).
    @cached_property
    def max_q_len(self) -> int:
        """Longest query run of the batch (host, from the CPU copy)."""
        return int(self.extend_seq_lens_cpu.max()) if self.batch_size else 0

    @cached_property
    def max_kv_len(self) -> int:
        """Longest KV length after this pass (host, from the CPU copy)."""
        return int(self.seq_lens_cpu.max()) if self.batch_size else 0

    @cached_property
    def rows_host(self) -> list[int]:
        """The request rows as host ints, for per-request host loops (prefill). From the CPU
        copy when the batch has one; else one device-to-host copy per batch, not per layer."""
        src = self.req_pool_indices_cpu
        return (src if src is not None else self.req_pool_indices).tolist()

    @cached_property
    def extend_layout(self) -> RaggedLayout:
        """q = the new tokens, kv = the whole sequence (prefix + new): bottom-right causal."""
        return self._layout(self.seq_lens_cpu)

    @cached_property
    def prefix_layout(self) -> RaggedLayout:
        """q = the new tokens, kv = the cached prefix only (chunked-prefix prefill, no mask)."""
        return self._layout(self.extend_prefix_lens_cpu)

    @cached_property
    def new_layout(self) -> RaggedLayout:
        """q = kv = the new tokens (chunked-prefix prefill's causal part)."""
        return self._layout(self.extend_seq_lens_cpu)

    def prefix_slots(self, req_to_token: torch.Tensor) -> torch.Tensor:
        """[sum(prefix_lens)] int64 pool slots of every request's cached prefix, request-major
        (chunked-prefix prefill reads these rows in every layer). Built once per batch."""
        if self._prefix_slots is None:
            from mla_backends.indices import build_token_indices

            total = int(self.extend_prefix_lens_cpu.sum())
            _, self._prefix_slots = build_token_indices(
                req_to_token, self.req_pool_indices, self.extend_prefix_lens, total
            )
        return self._prefix_slots

    def _layout(self, kv_lens_cpu: torch.Tensor) -> RaggedLayout:
        return RaggedLayout.from_lens(
            self.extend_seq_lens_cpu.tolist(), kv_lens_cpu.tolist(), self.seq_lens.device
        )
