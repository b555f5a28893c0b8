"""CUDA-graph runner for decode and target-verify, backend-agnostic.

It captures `forward(batch, inputs) -> out` once per batch size, over static buffers sized for
the largest, and replays a batch of `n` real requests on the smallest captured size `bs >= n`.
The padding contract (DESIGN.md): `n` is passed explicitly (a real length-1 request looks like
padding), padded rows use request row 0, seq_len = the backend's fill value + q_len - 1 (each
of their queries sees at least the fill's keys: none has zero), and output slots in the dummy
page (slot 0); outputs are sliced to the real tokens. The runner calls only the backend's
graph hooks; it knows nothing about any particular backend.

`use_graphs=False` runs the same padded, static-buffer path eagerly (CPU tests of the padding
logic and the backends' replay hooks).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from mla_backends.backends.protocol import AttentionBackend
from mla_backends.batch import ForwardBatch, ForwardMode, as_int, as_ints
from mla_backends.checks import check_tensor
from mla_backends.pool import no_scale_freeze

Forward = Callable[[ForwardBatch, dict[str, torch.Tensor]], torch.Tensor]


def replayable(sizes: Sequence[int], max_batch: int) -> list[int]:
    """`sizes` without those past the smallest one that holds `max_batch` requests: no batch
    would ever replay them (a replay takes the smallest captured size that fits)."""
    cover = min((bs for bs in sizes if bs >= max_batch), default=None)
    return [bs for bs in sizes if cover is None or bs <= cover]


@dataclass(frozen=True)
class InputSpec:
    """One per-token input: `[tokens, *shape]` of `dtype` (e.g. q_nope `[T, H, L]`)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class CudaGraphRunner:
    def __init__(
        self,
        backend: AttentionBackend,
        forward: Forward,
        inputs: dict[str, InputSpec],
        batch_sizes: Sequence[int],
        q_len: int = 1,
        device: torch.device | str | None = None,
        use_graphs: bool = True,
    ) -> None:
        """`device`: the static buffers' (default: the backend's, else "cuda")."""
        if not backend.supports_graphs:
            raise ValueError(f"backend {backend.name!r} does not support CUDA graphs")
        batch_sizes = as_ints(batch_sizes, "batch_sizes")  # before anything is allocated
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"CudaGraphRunner: batch sizes must be >= 1, got {list(batch_sizes)}")
        q_len = as_int(q_len, "CudaGraphRunner: q_len")  # a torch bool once passed as 1
        if q_len < 1:
            raise ValueError(f"CudaGraphRunner: q_len must be >= 1, got {q_len!r}")
        self.backend, self.forward, self.q_len = backend, forward, q_len
        self.batch_sizes = sorted(set(batch_sizes))
        if device is None:
            device = getattr(backend, "device", None) or "cuda"
        self.device = torch.device(device)
        self.use_graphs = use_graphs
        self.mode = ForwardMode.DECODE if q_len == 1 else ForwardMode.TARGET_VERIFY
        max_bs = self.batch_sizes[-1]
        max_t = max_bs * q_len
        dev = self.device
        i32: dict[str, Any] = {"dtype": torch.int32, "device": dev}
        # Hazard: seq_len = fill under q_len > 1 left a padded row's first queries no key
        # (zero-key rows for CUTLASS / FlashMLA / TRT-LLM) and a negative prefix.
        self._pad_seq = backend.cuda_graph_seq_len_fill_value + q_len - 1
        self._rows = torch.zeros(max_bs, **i32)
        self._seq = torch.full((max_bs,), self._pad_seq, **i32)
        self._ext = torch.full((max_bs,), q_len, **i32)
        self._pre = torch.full((max_bs,), self._pad_seq - q_len, **i32)
        self._loc = torch.zeros(max_t, dtype=torch.int64, device=dev)
        # A padded row's tokens sit at positions prefix + i, as their lengths say (sparse
        # paths count a token's keys from its position).
        pad_pos = torch.arange(q_len, dtype=torch.int64, device=dev) + self._pad_seq - q_len
        self._pad_pos = pad_pos.repeat(max_bs)
        self._pos = self._pad_pos.clone()
        self._inputs = {
            k: torch.zeros(max_t, *s.shape, dtype=s.dtype, device=dev) for k, s in inputs.items()
        }
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pointers: dict[int, dict[str, int]] = {}  # per size, after capture
        backend.init_cuda_graph_state(max_bs, max_t)

    # ------------------------------------------------------------------ batches
    def _static_batch(self, bs: int, real: ForwardBatch | None) -> ForwardBatch:
        """The batch over the static buffers' leading `bs` rows; CPU copies padded alike."""
        n = 0 if real is None else real.batch_size
        seq_cpu = torch.full((bs,), self._pad_seq, dtype=torch.int32)
        if real is not None:
            seq_cpu[:n] = real.seq_lens_cpu
        ext_cpu = torch.full((bs,), self.q_len, dtype=torch.int32)
        t = bs * self.q_len
        return ForwardBatch(
            mode=self.mode,
            req_pool_indices=self._rows[:bs],
            seq_lens=self._seq[:bs],
            seq_lens_cpu=seq_cpu,
            extend_prefix_lens=self._pre[:bs],
            extend_prefix_lens_cpu=seq_cpu - ext_cpu,
            extend_seq_lens=self._ext[:bs],
            extend_seq_lens_cpu=ext_cpu,
            out_cache_loc=self._loc[:t],
            positions=self._pos[:t],
            num_draft_tokens=self.q_len if self.q_len > 1 else 0,
        )

    def _load(self, batch: ForwardBatch, inputs: dict[str, torch.Tensor], bs: int) -> None:
        """Copy n real requests into the static buffers; rows n..bs become padding. Device
        copies and fills only: no host sync."""
        n, t = batch.batch_size, batch.num_tokens
        self._rows[:n].copy_(batch.req_pool_indices)
        self._rows[n:bs].zero_()  # request row 0: points at the dummy page
        self._seq[:n].copy_(batch.seq_lens)
        self._seq[n:bs].fill_(self._pad_seq)
        self._pre[:n].copy_(batch.extend_prefix_lens)
        self._pre[n:bs].fill_(self._pad_seq - self.q_len)
        self._loc[:t].copy_(batch.out_cache_loc)
        self._loc[t : bs * self.q_len].zero_()  # padded tokens write the dummy page's slot 0
        self._pos[:t].copy_(batch.positions)
        self._pos[t : bs * self.q_len].copy_(self._pad_pos[t : bs * self.q_len])
        for k, buf in self._inputs.items():
            buf[:t].copy_(inputs[k])  # shapes checked by `_check_inputs`: copy_ broadcasts
            buf[t : bs * self.q_len].zero_()

    def _check_inputs(self, batch: ForwardBatch, inputs: dict[str, torch.Tensor]) -> None:
        """Every captured input given, [tokens, *shape] of its dtype on the runner's device
        (host checks: a replay copies them into static buffers, where a wrong shape would
        broadcast or cast silently)."""
        missing = sorted(set(self._inputs) - set(inputs))
        if missing:
            raise ValueError(f"replay inputs lack {missing} (captured: {sorted(self._inputs)})")
        for k, buf in self._inputs.items():
            check_tensor(k, inputs[k], (batch.num_tokens, *buf.shape[1:]), buf.dtype, self.device)

    # ------------------------------------------------------------------ capture / replay
    def capture(self) -> None:
        for bs in reversed(self.batch_sizes):  # largest first: the pool sees its peak early
            batch = self._static_batch(bs, None)
            # eager: no graph holds the FP8 scales, every run reads them per call
            with nullcontext() if self.use_graphs else no_scale_freeze():
                self.backend.init_forward_metadata_capture(batch)
            self._pointers[bs] = self.pointer_snapshot()
            inputs = {k: v[: bs * self.q_len] for k, v in self._inputs.items()}
            if not self.use_graphs:
                self._graphs[bs] = None  # type: ignore[assignment]
                continue
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: JIT, autotune, allocator
                    self.forward(batch, inputs)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._outputs[bs] = self.forward(batch, inputs)
            self._graphs[bs] = graph

    def pointer_snapshot(self) -> dict[str, int]:
        """data_ptr of every tensor in the backend's metadata for the current batch (fields,
        nested dataclasses, tuples and dicts): each must be the same buffer at every replay.
        Host copies (fields named `*_cpu`) are per-batch host data, not what a graph reads."""
        snap: dict[str, int] = {}
        _collect("metadata", self.backend.metadata, snap)
        return snap

    def padded_size(self, n: int) -> int:
        i = bisect.bisect_left(self.batch_sizes, n)
        if i == len(self.batch_sizes):
            raise ValueError(
                f"batch of {n} exceeds the largest captured size {self.batch_sizes[-1]}"
            )
        return self.batch_sizes[i]

    def replay(
        self, batch: ForwardBatch, inputs: dict[str, torch.Tensor], check_pointers: bool = False
    ) -> torch.Tensor:
        """Run `batch` (n real requests) on the captured graph of the next size; returns the
        real tokens' outputs (a view of the static output, valid until the next replay)."""
        if batch.mode is not self.mode or batch.q_len != self.q_len:
            raise ValueError(
                f"runner captured {self.mode.name} q_len={self.q_len}, got "
                f"{batch.mode.name} q_len={batch.q_len}"
            )
        if not self._graphs:
            raise RuntimeError("capture() first")
        # Hazard: the static buffers hold q_len tokens a request; other counts were copied
        # short or long (tokens dropped or read from padding), silently. The batch check
        # below refuses them (every request's new tokens = the mode's q_len, checked above).
        self.backend.check_batch(batch)  # rows and lengths, on the host: replay checks nothing
        self._check_inputs(batch, inputs)
        bs = self.padded_size(batch.batch_size)
        self._load(batch, inputs, bs)
        static = self._static_batch(bs, batch)
        self.backend.init_forward_metadata_replay(static)
        if check_pointers and self.pointer_snapshot() != self._pointers[bs]:
            raise RuntimeError(f"backend buffers moved after capture of batch size {bs}")
        if self.use_graphs:
            self._graphs[bs].replay()
            out = self._outputs[bs]
        else:
            out = self.forward(static, {k: v[: bs * self.q_len] for k, v in self._inputs.items()})
        t = batch.num_tokens
        if isinstance(out, tuple):  # (out, lse): each sliced, never the tuple itself
            return tuple(o[:t] for o in out)
        return out[:t]


def _collect(path: str, obj: object, snap: dict[str, int]) -> None:
    if isinstance(obj, torch.Tensor):
        snap[path] = obj.data_ptr()
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            if not f.name.endswith("_cpu"):
                _collect(f"{path}.{f.name}", getattr(obj, f.name), snap)
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            _collect(f"{path}[{i}]", v, snap)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _collect(f"{path}[{k!r}]", v, snap)
