"""The paged latent KV pool and the request-to-token table.

Layout (per layer): `(num_pages + 1) * page_size` rows of D = L + R values, each row
`concat(k_nope_latent[L], k_rope[R])`. Slot s lives in page `s // page_size`. Page 0 is the
dummy page: never handed out, the target of padded writes, what padded table rows point at.
Every store sends a slot outside the pool (vLLM pads with -1) to slot 0 of that page, on the
device and without a sync, so a bad slot never overwrites another request's row (nor wraps
around to the last one, as a negative index would).
V is the first L columns of the same rows; it is never stored twice.

FP8 contract: one fp32 scale per layer, `stored = value / scale`, `value = stored * scale`,
calibrated over the whole D-wide row (latent and rope together), and exactly representable
in bf16 (`bf16_ceil`), so every backend, whatever precision it applies it in, reads the same
values. Set it before storing rows, and before any CUDA graph is captured over the pool (after
one, `set_scale` is refused: captured kernels keep the scale they were launched with):
`calibrate_scale(layer, k_nope, k_rope)` on sample rows, or `set_scale(layer, scale)`. The
default scale 1.0 saturates every value beyond +-448 (and rounds small ones coarsely); storing
or attending over FP8 rows of a layer whose scale was never set warns once per layer
(`UncalibratedScaleWarning`, a host-side flag: no sync).

Layer indices are checked at this boundary: a layer outside 0..num_layers-1 (-1 included,
which Python indexing would read as the last layer) raises `LayerIndexError`.
"""

from __future__ import annotations

import contextvars
import math
import numbers
import operator
import struct
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch

from mla_backends.batch import as_int, as_int_at_least, as_ints, is_bool
from mla_backends.checks import ShapeError, check_tensor

if TYPE_CHECKING:
    from mla_backends.batch import ForwardBatch

FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
F32_MAX = float(torch.finfo(torch.float32).max)
F32_TINY = float(torch.finfo(torch.float32).tiny)  # smallest normal fp32: 2^-126


class LayerIndexError(IndexError):
    """A layer index outside 0..num_layers-1 was passed to the pool or a backend."""


def check_layer_index(layer: int, num_layers: int, owner: str = "the pool has layers") -> int:
    """`layer` as an int if it is in 0..num_layers-1, else LayerIndexError. Hazard: Python
    indexing reads -1 as the last layer and True as layer 1, silently."""
    if is_bool(layer) or not 0 <= operator.index(layer) < num_layers:
        raise LayerIndexError(f"layer {layer!r} is out of range: {owner} 0..{num_layers - 1}")
    return operator.index(layer)


class RequestRowError(ValueError):
    """A batch names a request row that was never allocated, or reads a different number of
    tokens of a row than it has stored (prefix_lens + new tokens != what the allocator holds)."""


class UncalibratedScaleWarning(UserWarning):
    """FP8 rows stored or read under a layer scale that was never set (the default 1.0)."""


class LayerBuffers(tuple):
    """The per-layer buffers of a pool; indexing checks the layer (Hazard: a plain list takes
    -1 as the last layer and would silently read or write it)."""

    def __getitem__(self, layer):
        if not isinstance(layer, slice):
            layer = check_layer_index(layer, len(self))
        return super().__getitem__(layer)


def bf16_ceil(x: float) -> float:
    """Smallest bf16-representable value >= x (x > 0).

    Hazard: FlashInfer's FP8 MLA kernel multiplies by the scale in bf16; a scale that bf16
    cannot represent (0.037 -> 0.03711) biases every score and output by up to 0.4%. Scales
    are therefore bf16 values, rounded up so calibrated rows never saturate. Beyond fp32's
    range: inf (what bf16 would hold). Hazard: the bit trick rounds a negative value down, NaN
    compares false everywhere: both are refused."""
    if not x > 0.0:
        raise ValueError(f"bf16_ceil: x must be > 0, got {x!r}")
    if x > F32_MAX:
        return math.inf
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    return struct.unpack("<f", struct.pack("<I", (bits + 0xFFFF) & 0xFFFF0000))[0]


def slots_or_dummy(loc: torch.Tensor, num_slots: int) -> torch.Tensor:
    """int64 slots with every slot outside [0, num_slots) replaced by the dummy slot 0 (the
    stores' rule, module docstring): on the device, no host sync; one Triton launch on a GPU
    (`kernels.store.safe_slots`), torch elsewhere."""
    if loc.is_cuda and loc.dim() == 1:
        from mla_backends.kernels.store import safe_slots

        return safe_slots(loc, num_slots)
    loc = loc.long()
    return torch.where((loc >= 0) & (loc < num_slots), loc, torch.zeros_like(loc))


# False inside `no_scale_freeze`: a capture prepared there freezes no pool's scales.
_FREEZE: contextvars.ContextVar[bool] = contextvars.ContextVar("mla_scale_freeze", default=True)


@contextmanager
def no_scale_freeze() -> Iterator[None]:
    """Capture hooks called inside freeze no pool's FP8 scales (`freeze_scales`): for a
    caller that captures no graph over them (`CudaGraphRunner(use_graphs=False)` runs its
    static-buffer path eagerly, reading the scales each call), whatever backend or wrapper
    the hooks pass through."""
    token = _FREEZE.set(False)
    try:
        yield
    finally:
        _FREEZE.reset(token)


STORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # rows to store


class MLATokenToKVPool:
    """Per-layer latent KV buffers plus the per-layer FP8 scales."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        *,
        buffers: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """`buffers`: wrap an engine's existing per-layer tensors (`[num_slots, D]` views of
        this dtype and device, last dim contiguous) instead of allocating: no copy, one pool."""
        if dtype not in (torch.float32, torch.bfloat16, torch.float16, *FP8_DTYPES):
            raise ValueError(f"MLATokenToKVPool: unsupported kv dtype {dtype}")
        # Hazard: a float size failed inside torch.zeros ("takes 1 positional argument"), a
        # negative one there too, and kv_lora_rank 0 built a pool of rope-only rows
        num_layers = as_int_at_least(num_layers, "MLATokenToKVPool: num_layers", 0)
        num_pages = as_int_at_least(num_pages, "MLATokenToKVPool: num_pages", 1)
        page_size = as_int_at_least(page_size, "MLATokenToKVPool: page_size", 1)
        kv_lora_rank = as_int_at_least(kv_lora_rank, "MLATokenToKVPool: kv_lora_rank", 1)
        qk_rope_head_dim = as_int_at_least(
            qk_rope_head_dim, "MLATokenToKVPool: qk_rope_head_dim", 0
        )
        self.num_layers = num_layers
        self.num_pages = num_pages  # usable pages, page 0 excluded
        self.page_size = page_size
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_dim = kv_lora_rank + qk_rope_head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_slots = (num_pages + 1) * page_size
        if buffers is None:
            buffers = [
                torch.zeros(self.num_slots, self.kv_dim, dtype=dtype, device=self.device)
                for _ in range(num_layers)
            ]
        elif len(buffers) != num_layers:
            raise ValueError(f"{len(buffers)} buffers given for {num_layers} layers")
        shape = (self.num_slots, self.kv_dim)
        for i, buf in enumerate(buffers):
            check_tensor(f"buffers[{i}]", buf, shape, dtype, self.device)
            if buf.stride(1) != 1:
                raise ValueError(f"buffers[{i}]: rows must be contiguous: {buf.stride()}")
        self.kv_buffer = LayerBuffers(buffers)
        # Scales live on the host (kernels take Python floats) and on the device (kernels that
        # take a tensor, and graph-captured code). They change only via set_scale, never per call.
        self._scales_host = [1.0] * num_layers
        self.scales = torch.ones(num_layers, dtype=torch.float32, device=self.device)
        self._scale_set = [False] * num_layers
        self._scale_warned = [False] * num_layers
        self._stored = [False] * num_layers  # a layer's rows were stored under its scale
        self._captured_by: str | None = None  # the backend whose graph capture froze the scales

    # ----------------------------------------------------------------- accounting
    @property
    def is_fp8(self) -> bool:
        return self.dtype in FP8_DTYPES

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers."""
        return self.kv_dim * self.dtype.itemsize * self.num_layers

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * self.num_slots

    # ----------------------------------------------------------------- layers
    def check_layer(self, layer: int) -> int:
        """`layer` if it is one of this pool's layers, else LayerIndexError. Host only."""
        return check_layer_index(layer, self.num_layers)

    # ----------------------------------------------------------------- scales
    def scale(self, layer: int) -> float:
        return self._scales_host[self.check_layer(layer)]

    def scale_is_set(self, layer: int) -> bool:
        return self._scale_set[self.check_layer(layer)]

    def warn_if_uncalibrated(self, layer: int) -> None:
        """Warn once per layer when an FP8 layer is used under the default scale 1.0 that was
        never set. A host-side flag: no device work, nothing once warned or calibrated."""
        layer = self.check_layer(layer)
        if self.is_fp8 and not self._scale_set[layer] and not self._scale_warned[layer]:
            self._scale_warned[layer] = True
            warnings.warn(
                f"FP8 KV pool, layer {layer}: rows stored / read under the default scale 1.0, "
                f"never set: values beyond +-{FP8_MAX:g} saturate. Call "
                "MLATokenToKVPool.calibrate_scale(layer, k_nope, k_rope) on sample rows, or "
                "set_scale(layer, scale), before storing.",
                UncalibratedScaleWarning,
                stacklevel=3,
            )

    def freeze_scales(self, captured_by: str) -> None:
        """A CUDA graph is being captured over this pool (`captured_by`: the backend): from now
        on `set_scale` is refused. Hazard: captured kernels may hold a scale as a host float
        launch argument (triton, FlashInfer), so replays would keep the old one while eager
        calls and stores took the new one. A no-op inside `no_scale_freeze` (no graph is
        captured there)."""
        if _FREEZE.get():
            self._captured_by = captured_by

    @property
    def scales_frozen_by(self) -> str | None:
        """The backend whose graph capture froze the scales, or None."""
        return self._captured_by

    def set_scale(self, layer: int, scale: float) -> float:
        """Set the layer scale; returns the scale actually used (rounded up to bf16). Refused
        once a CUDA graph was captured over the pool (`freeze_scales`), and once the layer
        stored rows under another scale (rows are not requantised: every stored row would be
        read under the new one)."""
        layer = self.check_layer(layer)
        # Hazard: None or a string failed inside the range check below ("'>' not supported"),
        # naming no argument; a bool was taken as 1.0
        one = isinstance(scale, torch.Tensor) and scale.numel() == 1  # read back: not in decode
        if is_bool(scale) or not (isinstance(scale, numbers.Real) or one):
            raise TypeError(f"layer {layer}: kv scale must be a real number, got {scale!r}")
        scale = float(scale)
        if self._captured_by is not None:
            raise RuntimeError(
                f"layer {layer}: {self._captured_by} prepared a CUDA-graph capture over this pool "
                "(init_forward_metadata_capture), and a captured graph keeps the scale it was "
                "captured with; set the scale before capture"
            )
        # Hazard: checked as stored, not as passed: bf16 rounds 3.4e38 up to inf and 1e-46 down
        # to 0; the stores multiply by the fp32 reciprocal (inf below 2.9e-39). Both the scale
        # and its reciprocal must be normal fp32 values (kernels may flush subnormals to 0).
        used = bf16_ceil(scale) if scale > 0.0 else math.nan
        if not F32_TINY <= used <= 1.0 / F32_TINY:
            raise ValueError(
                f"layer {layer}: kv scale must be finite and > 0, stored (rounded up to bf16) "
                f"within [2^-126, 2^126] so it and 1/scale are normal fp32; got {scale:g} "
                f"(stored: {used:g})"
            )
        if not self.is_fp8 and scale != 1.0:
            raise ValueError(
                f"layer {layer}: a non-unit kv scale needs an FP8 pool, got {self.dtype}"
            )
        if self._stored[layer] and used != self._scales_host[layer]:
            raise RuntimeError(
                f"layer {layer}: rows were stored under scale {self._scales_host[layer]:g}, "
                f"and the pool does not requantise them (nor track which are still live): "
                f"under {used:g} any left would be read wrong; set the scale before the "
                "first store (a new pool starts unset)"
            )
        self._scales_host[layer] = scale = used
        self.scales[layer] = scale
        self._scale_set[layer] = True
        return scale

    def calibrate_scale(self, layer: int, k_nope: torch.Tensor, k_rope: torch.Tensor) -> float:
        """Set the layer scale from sample rows: amax over the whole row / FP8 max.

        Hazard: calibrating on the latent alone saturates the rope part, whose range differs.
        This reads a max back to the host; call it at calibration time, never in decode.
        """
        layer = self.check_layer(layer)
        amax = {
            n: t.abs().max().item() if t.numel() else 0.0
            for n, t in (("k_nope", k_nope), ("k_rope", k_rope))
        }
        # Hazard: max() skipped a NaN amax after a finite one (NaN rope rows were ignored,
        # silently) and kept it before one (refused as a NaN scale, naming no row)
        if not all(math.isfinite(a) for a in amax.values()):
            raise ValueError(
                f"calibrate_scale: the sample rows are not finite (amax {amax}): calibrate on "
                "rows without NaN or inf"
            )
        return self.set_scale(layer, max(*amax.values(), 1e-12) / FP8_MAX)

    # ----------------------------------------------------------------- store / load
    def check_store(
        self, layer: int, loc: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor
    ) -> int:
        """A store's checks (the layer, integer slots [T], the rows' shapes, the FP8 warning),
        shared by every path that writes rows: the layer as an index."""
        layer = self.check_layer(layer)
        self.warn_if_uncalibrated(layer)
        t = loc.shape[0] if loc.dim() == 1 else -1
        check_tensor("loc", loc, (t,), (torch.int32, torch.int64), self.device)
        # Hazard: integer rows were cast and stored as if they were values, silently
        check_tensor("k_nope", k_nope, (t, self.kv_lora_rank), STORE_DTYPES, self.device)
        check_tensor("k_rope", k_rope, (t, self.qk_rope_head_dim), STORE_DTYPES, self.device)
        self._stored[layer] = True
        return layer

    def set_mla_kv_buffer(
        self, layer: int, loc: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor
    ) -> None:
        """Store rows `concat(k_nope, k_rope)` at slots `loc` [T] of `layer`.

        k_nope [T, L], k_rope [T, R]. FP8 pools store `value / scale` (saturated at +-448).
        """
        layer = self.check_store(layer, loc, k_nope, k_rope)
        buf = self.kv_buffer[layer]
        if buf.is_cuda and buf.stride(1) == 1:
            # one launch (concat, quantise, the slot rule, scatter) where torch takes two (bf16)
            # to six (FP8) and the slot rule five more: 3.3x / 9.2x faster a decode step
            from mla_backends.kernels.store import store_latent_rows

            store_latent_rows(buf, self.scales[layer], loc, k_nope, k_rope, self.is_fp8)
            return
        row = torch.cat([k_nope, k_rope], dim=-1)
        buf[slots_or_dummy(loc, self.num_slots)] = self.quantize(layer, row)

    def quantize(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Convert rows to the storage dtype under the layer scale."""
        layer = self.check_layer(layer)
        if not self.is_fp8:
            return rows.to(self.dtype)
        # Saturate instead of producing NaN: e4m3fn has no inf, out-of-range casts give NaN.
        q = (rows.float() * self.scales[layer].reciprocal()).clamp(-FP8_MAX, FP8_MAX)
        return q.to(self.dtype)

    def dequantize(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Rows in storage dtype -> float32 values (scale applied)."""
        layer = self.check_layer(layer)
        if not self.is_fp8:
            return rows.float()
        return rows.float() * self.scales[layer]

    def load_rows(self, layer: int, loc: torch.Tensor) -> torch.Tensor:
        """Float32 values of rows at slots `loc` (integers, any shape), [*loc.shape, D]. Reads
        only those rows. Hazard: float slots were truncated by `.long()` (1.5 read slot 1,
        bf16 rounds ids past 256), silently; refused by dtype (metadata, no sync)."""
        if loc.is_floating_point() or loc.is_complex() or loc.dtype == torch.bool:
            raise ShapeError(f"loc: expected integer slots, got {loc.dtype}")
        return self.dequantize(layer, self.kv_buffer[layer][loc.long()])

    # ----------------------------------------------------------------- views (no copies)
    def get_kv_buffer(self, layer: int) -> torch.Tensor:
        """[num_slots, D] rows."""
        return self.kv_buffer[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        """[num_slots, L] strided view: V is the latent part of the same rows."""
        return self.kv_buffer[layer][:, : self.kv_lora_rank]

    def get_paged_buffer(self, layer: int) -> torch.Tensor:
        """[num_pages + 1, page_size, 1, D] (FlashMLA / CUTLASS / TRT-LLM layout)."""
        return self.kv_buffer[layer].view(self.num_pages + 1, self.page_size, 1, self.kv_dim)

    def get_ckv_kpe(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """FlashInfer's (ckv [pages+1, page, L], kpe [pages+1, page, R]): strided views."""
        paged = self.kv_buffer[layer].view(self.num_pages + 1, self.page_size, self.kv_dim)
        return paged[..., : self.kv_lora_rank], paged[..., self.kv_lora_rank :]


class ReqToTokenPool:
    """int32 `[max_requests + 1, max_context_len]` map (request row, position) -> slot.

    Row 0 is reserved: it points at the dummy page (all zeros = slot 0) and is what padded
    CUDA-graph rows use. On the host it knows which rows are allocated and how many leading
    positions of each hold stored tokens (`filled`, kept by the allocator), so a batch that
    names a row never allocated, or reads more or fewer tokens than a row stored, fails
    (`check_batch`): allocate exactly the tokens of the batch that stores them.
    """

    def __init__(
        self,
        max_requests: int,
        max_context_len: int,
        device: torch.device | str,
        *,
        table: torch.Tensor | None = None,
    ) -> None:
        """`table`: wrap an engine's existing int32 `[max_requests + 1, max_context_len]` table
        instead of allocating (no copy)."""
        # Hazard: a negative or float size failed inside torch.zeros, naming neither
        max_requests = as_int_at_least(max_requests, "ReqToTokenPool: max_requests", 0)
        max_context_len = as_int_at_least(max_context_len, "ReqToTokenPool: max_context_len", 1)
        self.size = max_requests
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        if table is None:
            table = torch.zeros(
                max_requests + 1, max_context_len, dtype=torch.int32, device=self.device
            )
        check_tensor("table", table, (max_requests + 1, max_context_len), torch.int32, self.device)
        self.req_to_token = table
        self._free_rows = list(range(max_requests, 0, -1))  # pop() hands out 1, 2, ...
        self._used_rows: set[int] = set()
        # Host arrays indexed by request row; row 0 (padding) counts as allocated and holds
        # max_context_len dummy-page positions.
        self.allocated = np.zeros(max_requests + 1, dtype=bool)
        self.allocated[0] = True
        self.filled = np.zeros(max_requests + 1, dtype=np.int64)
        self.filled[0] = max_context_len
        # Who holds KV for a row (the allocators over this table: `PagedTokenAllocator.holds`)
        self._holders: list[Callable[[int], bool]] = []

    def add_holder(self, holds: Callable[[int], bool]) -> None:
        """Register an allocator's `holds(row)`: a row it still holds KV for cannot be freed."""
        self._holders.append(holds)

    @property
    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self, n: int = 1) -> list[int]:
        n = as_int_at_least(n, "ReqToTokenPool: request rows to allocate", 0)  # numpy / torch too
        if n > len(self._free_rows):
            raise MemoryError(
                f"ReqToTokenPool: requested {n} request rows, {len(self._free_rows)} free "
                f"of {self.size}"
            )
        rows = [self._free_rows.pop() for _ in range(n)]
        self._used_rows.update(rows)
        self.allocated[rows] = True
        self.filled[rows] = 0
        return rows

    def free(self, row: int) -> None:
        """Return a request row. Hazard: a row whose KV pages an allocator still holds is
        refused: handed out again it would keep the old request's length and slots, and the
        new request would attend over the old one's KV (free its KV first: `allocator.free`)."""
        row = as_int(row, "row")
        if row not in self._used_rows:
            raise ValueError(f"ReqToTokenPool: row {row} is not an allocated request row")
        if any(holds(row) for holds in self._holders):
            raise ValueError(
                f"ReqToTokenPool: row {row} still holds KV pages; free them first "
                "(allocator.free(row)), or the row's next request would read them"
            )
        self._used_rows.remove(row)
        self._free_rows.append(row)
        self.allocated[row] = False
        self.filled[row] = 0

    def check_rows(self, rows: list[int] | tuple[int, ...]) -> None:
        """RequestRowError unless every row is an allocated request row."""
        rows = as_ints(rows, "rows")  # a float row indexed the host arrays deep inside
        bad = [r for r in rows if not (0 < r <= self.size and self.allocated[r])]
        if bad:
            raise RequestRowError(
                f"request row(s) {bad} were never allocated (or were freed): take rows from "
                f"ReqToTokenPool.alloc; allocated now: {sorted(self._used_rows)}"
            )

    def check_seq_lens(self, batch: ForwardBatch, limit: int | None = None, what: str = "") -> None:
        """ShapeError unless every `seq_lens_cpu` is in 0..limit (default the table's width,
        max_context_len; `what` says what the limit is): the length check of a batch without
        CPU rows (SGLang's, a graph runner's static one); one with them is held to each row's
        stored length instead. Hazard: a length past the table's width read the next request
        row's slots (triton, silently) or raised an IndexError inside the torch backend's
        gather. The CPU copy only: no sync."""
        if limit is None:
            limit, what = self.max_context_len, "the request table's max_context_len"
        seq = batch.seq_lens_cpu.numpy()
        if seq.size and (seq.min() < 0 or seq.max() > limit):
            raise ShapeError(
                f"ForwardBatch.seq_lens_cpu: every length must be in 0..{limit} ({what}), "
                f"got {seq.tolist()}"
            )

    def check_batch(self, batch: ForwardBatch, filled: np.ndarray | None = None) -> None:
        """RequestRowError if the batch names a row never allocated, or reads more or fewer
        tokens of a row (prefix + new) than the row has stored (row 0, padding, excepted).
        `filled`: each row's length if not this table's (a DCP group's global lengths).
        Host arrays and the batch's CPU copies only (no sync); a batch without CPU rows (a
        graph runner's static one, SGLang's) is checked for its fields' shapes
        (`ForwardBatch.check`) and its lengths against the table's width only."""
        batch.check(self.device)
        rows_cpu = batch.req_pool_indices_cpu
        if rows_cpu is None or rows_cpu.numel() == 0:
            if filled is None:  # DCP's global lengths (`filled` given): DCPBackend checks them
                self.check_seq_lens(batch)
            return
        filled = self.filled if filled is None else filled
        rows = rows_cpu.numpy().astype(np.int64)
        real = rows[rows != 0]  # padding repeats row 0
        if np.unique(real).size != real.size:  # one token's state update was lost
            raise RequestRowError(f"a request row appears twice in one batch: {rows.tolist()}")
        if rows.min() < 0 or rows.max() > self.size or not self.allocated[rows].all():
            self.check_rows(rows.tolist())
        seq = batch.seq_lens_cpu.numpy()
        over = np.nonzero(seq > filled[rows])[0]
        # Hazard: reading fewer tokens than stored is as wrong (a prefix passed short: the new
        # rows land at the row's end, the batch attends over older ones at the wrong positions)
        short = np.nonzero((seq < filled[rows]) & (rows != 0))[0]
        if short.size:
            i = int(short[0])
            raise RequestRowError(
                f"request row {int(rows[i])} (batch index {i}): the batch reads {int(seq[i])} "
                f"tokens, the row has {int(filled[rows[i]])} stored; pass the prefix the "
                "row really has (its length before this batch's tokens were allocated; after a "
                "verify step, PagedTokenAllocator.truncate drops the rejected drafts' slots)"
            )
        if over.size:
            i = int(over[0])
            pre, new = int(batch.extend_prefix_lens_cpu[i]), int(batch.extend_seq_lens_cpu[i])
            raise RequestRowError(
                f"request row {int(rows[i])} (batch index {i}): the batch reads {int(seq[i])} "
                f"tokens (prefix_lens {pre} + {new} new), the row has {int(filled[rows[i]])} "
                "stored; store them first (PagedTokenAllocator.alloc_extend), and pass the "
                "prefix the row really has"
            )
