"""A minimal serving loop over the pool, allocator and backend: prefill, extend over a cached
prefix, decode, verify. Used by the model tests and the `run` command."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any, cast

import torch

from mla_backends.backends.protocol import AttentionBackend
from mla_backends.batch import ForwardBatch, ForwardMode, as_int, as_ints, is_bool
from mla_backends.config import MLADims
from mla_backends.graph_runner import CudaGraphRunner, InputSpec, replayable
from mla_backends.runtime import Runtime


def _check_dims(model: torch.nn.Module, runtime: Runtime) -> None:
    """The runtime's attention dims are the model's, head count aside (a rank's share, or a
    shape error at the first call). Hazard: the softmax scale (YaRN factor, mscale) lives in
    the runtime's dims: a Kimi-K2 checkpoint on a DeepSeek-V3 runtime served at the wrong
    scale with no error (logits 0.88 off in prefill)."""
    dims = getattr(getattr(model, "cfg", None), "attention_dims", None)
    if not isinstance(dims, MLADims):  # a model that declares none (Kimi-Linear's NoPE MLA)
        return
    have = runtime.config.model
    diff = [
        f"{f.name} {getattr(have, f.name)} (model: {getattr(dims, f.name)})"
        for f in dataclasses.fields(MLADims)
        if f.name != "num_heads" and getattr(have, f.name) != getattr(dims, f.name)
    ]
    if diff:
        raise ValueError(
            f"the runtime's attention dims are not the model's: {', '.join(diff)}; build the "
            "runtime's config with model=<the model's cfg>.attention_dims"
        )


class Engine:
    """`backend` defaults to the runtime's; a hybrid model passes its HybridBackend.

    Failed steps: a step that raises truncates its rows back to their lengths before it. A
    backend with per-request state outside the KV pool (`keeps_request_state`: a hybrid's
    linear-attention recurrent and conv states) advances it layer by layer and is not rolled
    back, so when a step (or `accept`) fails after the model began to run, its rows are
    marked (`rows_to_reset`) and every later step or accept naming them is refused until
    `reset(rows)` and a re-prefill of the whole sequence, or `free`. Failures before the model
    runs (token ids, allocation, metadata) mark nothing; a graph replay counts as running."""

    def __init__(
        self, model: torch.nn.Module, runtime: Runtime, backend: AttentionBackend | None = None
    ) -> None:
        self.model, self.rt = model, runtime
        _check_dims(model, runtime)
        self.backend = runtime.backend if backend is None else backend
        self.device = runtime.kv_pool.device
        self.runner: CudaGraphRunner | None = None
        self._drafts: int | None = None  # draft tokens per request of the last verify step
        self._verified: list[int] = []  # its rows, in order
        # Not in the AttentionBackend protocol: a backend that does not declare it keeps
        # nothing per request outside the KV pool (MLA, DSA), and rollback is complete.
        self._request_state = bool(getattr(self.backend, "keeps_request_state", False))
        self._unknown: set[int] = set()  # rows whose request state a failed step left unknown

    def enable_graphs(
        self, batch_sizes: Sequence[int] | None = None, use_graphs: bool = True
    ) -> None:
        """Capture decode steps of the whole model (every layer, the LM head) once per batch
        size (default: the config's `cuda_graph_batch_sizes`); `decode` then replays the
        smallest captured size that fits, padded. Sizes past the smallest one that holds
        `max_requests` could never replay and are not captured (their static buffers and
        graphs would only take memory)."""
        if self._drafts is not None and self._verified:  # capture replaces the staged verify
            raise RuntimeError(
                f"request rows {self._verified} have a pending verify: accept(rows, counts) "
                "before enable_graphs()"
            )
        sizes = self.rt.config.cuda_graph_batch_sizes if batch_sizes is None else batch_sizes
        sizes = replayable(as_ints(sizes, "batch_sizes"), self.rt.config.max_requests)
        runner = CudaGraphRunner(
            self.backend,
            lambda batch, inputs: self.model(inputs["ids"], batch, self.backend),
            {"ids": InputSpec((), torch.long)},
            sizes,
            device=self.device,
            use_graphs=use_graphs,
        )
        runner.capture()
        self.runner = runner

    def new_requests(self, n: int) -> list[int]:
        rows = self.rt.req_pool.alloc(n)
        try:
            self.backend.reset_requests(rows)  # recurrent state starts from zero (hybrid)
        except BaseException:
            for row in rows:
                self.rt.req_pool.free(row)
            raise
        self._unknown.difference_update(rows)
        return rows

    def free(self, row: int) -> None:
        row = as_int(row, "row")
        self._end_verify([row])
        if self.rt.allocator.holds(row):
            self.rt.allocator.free(row)
        # Hazard: a row taken back from the request table (not `new_requests`) whose first
        # step is a decode or verify continued the freed request's linear states.
        self.backend.reset_requests([row])
        self.rt.req_pool.free(row)
        self._unknown.discard(row)

    @property
    def rows_to_reset(self) -> list[int]:
        """Rows a failed step left with unknown request state: `reset` (and re-prefill) or
        `free` them before they run again."""
        return sorted(self._unknown)

    def reset(self, rows: Sequence[int]) -> None:
        """Start requests `rows` over on their rows: KV freed, request state zeroed (as for a
        new request); the caller re-prefills each whole sequence. Clears their marks."""
        rows = as_ints(rows, "rows")
        self.rt.req_pool.check_rows(rows)
        self.backend.reset_requests(rows)
        self._end_verify(rows)  # a pending accept would write verify states into a reset row
        for row in rows:
            if self.rt.allocator.holds(row):
                self.rt.allocator.free(row)
            self._unknown.discard(row)

    def _end_verify(self, rows: Sequence[int]) -> None:
        """A pending verify that names any of `rows` (freed or reset) can no longer be
        accepted: its other rows reject every draft (truncated back to their length before
        it; the verify wrote no request state), so none keeps unverified drafts' KV."""
        drafts = self._drafts
        if drafts is None or not set(rows) & set(self._verified):
            return
        self._drafts = None
        for r in self._verified:
            if r not in rows and self.rt.allocator.holds(r):
                self.rt.allocator.truncate(r, self.rt.allocator.seq_len(r) - drafts)

    def _refuse_unknown(self, rows: Sequence[int]) -> None:
        bad = sorted(self._unknown.intersection(rows))
        if bad:
            raise RuntimeError(
                f"request rows {bad} have unknown linear-attention state (a step or accept on "
                "them failed inside the model): reset(rows) and re-prefill them, or free them"
            )

    def _refuse_over_a_verify(self, mode: ForwardMode, rows: Sequence[int]) -> None:
        """A pending verify stays pending over steps on other rows (pure MLA); a step naming
        its rows, a second verify, or any step of a hybrid model is refused. Hazard: such a
        step once ended the verify silently, its drafts' KV kept as if all were accepted
        (attended by every later step) and the accept that followed refused."""
        if self._drafts is None:
            return
        if not self._verified:  # an empty verify: nothing to accept
            self._drafts = None
            return
        why = ""
        if self._request_state:  # accept reads the verify's staging via the last batch
            why = "; a hybrid model's linear states advance only there"
        elif mode is ForwardMode.TARGET_VERIFY:
            why = "; one verify at a time"
        elif set(rows).isdisjoint(self._verified):
            return
        raise RuntimeError(
            f"request rows {self._verified} have a pending verify: accept(rows, counts) "
            f"first (their drafts' KV stays in the cache until then{why}), or free them"
        )

    def step(
        self, mode: ForwardMode, rows: Sequence[int], tokens: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Append `tokens[i]` to request `rows[i]` and run them: logits [sum len, vocab].
        Token ids are checked before anything is allocated (on a GPU an id past the vocabulary
        is a device-side assert, fatal to the process); if the step raises, every row is
        truncated back to its length before it, so a retry does not attend over slots that
        were allocated but never written. With per-request state (a hybrid model's linear
        layers), a step that raised once the model ran also marks its rows: their states may
        have advanced in the layers before the failure, and a retry would compute over them
        without an error, so steps naming them are refused until `reset` (see the class)."""
        if not isinstance(mode, ForwardMode):  # a string mode skipped the verify bookkeeping
            raise TypeError(f"mode must be a ForwardMode, got {mode!r}")
        if len(rows) != len(tokens):
            raise ValueError(f"rows ({len(rows)}) and tokens ({len(tokens)}) differ")
        # Hazard: torch integer rows missed every set and dict lookup by row (lengths read 0:
        # a failed step's rollback then truncated the request to nothing).
        rows = as_ints(rows, "rows")
        self._refuse_unknown(rows)
        vocab: int = cast(Any, self.model).cfg.vocab_size  # every model here keeps a cfg
        flat = [t for ts in tokens for t in ts]
        bad = [t for t in flat if is_bool(t) or not 0 <= operator.index(t) < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:8]} are outside the vocabulary 0..{vocab - 1}")
        lens = [len(t) for t in tokens]
        empty = [r for r, n in zip(rows, lens) if n == 0]
        if empty:  # the model's reshapes fail on them, after the other rows' KV was allocated
            raise ValueError(f"request rows {empty} have no tokens in this step")
        self._refuse_over_a_verify(mode, rows)
        if not rows:  # nothing to run (the model's reshapes fail on an empty batch)
            if mode is ForwardMode.TARGET_VERIFY:
                self._drafts, self._verified = 0, []
            return torch.zeros(0, vocab, device=self.device)
        prefix = [self.rt.allocator.seq_len(r) for r in rows]
        loc = self.rt.allocator.alloc_extend(rows, lens)
        ran = False  # whether a layer may have run (and advanced request state)
        try:
            batch = ForwardBatch.build(mode, rows, prefix, lens, loc, self.device)
            ids = torch.tensor(flat, dtype=torch.long, device=self.device)
            r = self.runner
            if r is not None and r.mode is mode and len(rows) <= r.batch_sizes[-1]:
                # Conservative: replay's host checks and refill, which run no layer, are
                # inside the call too. The static output is overwritten by the next replay.
                ran = True
                out = r.replay(batch, {"ids": ids}).clone()
            else:
                self.backend.init_forward_metadata(batch)  # once for every layer
                ran = True
                out = self.model(ids, batch, self.backend)
        except BaseException:
            # Marked in every mode (TARGET_VERIFY writes no state by contract, but the mark
            # does not rely on a model keeping it), and first, whatever the truncation does.
            if ran and self._request_state:
                self._unknown.update(rows)
            for row, p in zip(rows, prefix):
                self.rt.allocator.truncate(row, p)
            raise
        if mode is ForwardMode.TARGET_VERIFY:
            self._drafts = lens[0]
            self._verified = list(rows)
        return out

    def extend(self, rows: Sequence[int], tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        return self.step(ForwardMode.EXTEND, rows, tokens)

    def decode(self, rows: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        return self.step(ForwardMode.DECODE, rows, [[t] for t in tokens])

    def verify(self, rows: Sequence[int], drafts: Sequence[Sequence[int]]) -> torch.Tensor:
        return self.step(ForwardMode.TARGET_VERIFY, rows, drafts)

    def accept(self, rows: Sequence[int], accepted: Sequence[int]) -> None:
        """After `verify(rows, drafts)`: request i keeps its first `accepted[i]` draft tokens.
        Rejected tokens' KV slots are freed; a hybrid backend's linear states advance to the
        last accepted token (if that raises, the rows are marked as a failed step's are)."""
        rows = as_ints(rows, "rows")
        drafts = self._drafts
        if drafts is None:
            raise RuntimeError("accept() follows a verify() step")
        if rows != self._verified:
            raise ValueError(
                f"accept() takes the rows of the verify step, in its order: {self._verified}, "
                f"got {list(rows)}"
            )
        if len(accepted) != len(rows):
            raise ValueError(f"{len(accepted)} accepted counts for {len(rows)} rows")
        # Checked before any row is truncated: a float count failed in the loop below, after
        # the rows before it were truncated and the verify was consumed (its drafts stuck).
        accepted = as_ints(accepted, "accepted counts")
        if any(not 0 <= a <= drafts for a in accepted):
            raise ValueError(f"accepted counts must be in 0..{drafts}, got {list(accepted)}")
        # A guard: a mark comes only from a failed step or accept, and both end the verify.
        self._refuse_unknown(rows)
        self._drafts = None
        if not rows:  # an empty verify: nothing to keep (a hybrid's accept needs its batch)
            return
        for r, a in zip(rows, accepted):
            self.rt.allocator.truncate(r, self.rt.allocator.seq_len(r) - drafts + a)
        try:  # writes the states layer by layer: a failure leaves some advanced
            self.backend.accept(torch.tensor(list(accepted), dtype=torch.long).to(self.device))
        except BaseException:
            if self._request_state:
                self._unknown.update(rows)
            raise
