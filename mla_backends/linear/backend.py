"""Linear-attention backend (Gated DeltaNet, KDA) over a `LinearStatePool`.

EXTEND runs the recurrence per request from its stored state (zero for a request with no
cached prefix: a new request on a reused row) and stores the final state.
DECODE runs one step for the whole batch at once, gathering and scattering states by request
row: shapes depend only on the batch size, so it is graph-capturable, and padded rows (row 0)
read and write the dummy slot. TARGET_VERIFY runs the T draft tokens of every request from its
stored state without writing it, keeping the state after each token (and the short-conv
input windows the model stages); `accept(num_accepted)` then stores, per request, the state
after its last accepted token, so rejected drafts leave nothing behind (verify runs the batched
fp32 step maths on every device). Kernels: `torch` (the plain recurrence: the reference and
the CPU path) or `fla` (chunked prefill, in-place recurrent decode; `fla_ops`); `auto` picks
fla on a CUDA device when the package is importable and the head dims fit its kernels
(`_fla_dims`), else torch, with a warning on a CUDA pool (the torch path is a per-token loop).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from mla_backends.backends.kernel_packages import missing
from mla_backends.batch import ForwardBatch, ForwardMode, as_ints
from mla_backends.checks import ShapeError, check_tensor
from mla_backends.linear import fla_ops
from mla_backends.linear.recurrence import gated_delta_rule
from mla_backends.linear.state_pool import LinearStatePool

_COUNT_DTYPES = (torch.int32, torch.int64)  # a float count was truncated (1.9 -> 1)

logger = logging.getLogger(__name__)


class LinearAttentionBackend:
    def __init__(
        self, pool: LinearStatePool, scale: float | None = None, kernels: str = "auto"
    ) -> None:
        fla_unfit = missing("fla") or _need_cuda(pool) or _fla_dims(pool)
        if kernels == "auto":
            kernels = "torch" if fla_unfit else "fla"
            if fla_unfit and pool.device.type == "cuda":
                logger.warning(
                    "linear kernels auto: torch on %s, not fla: %s", pool.device, fla_unfit
                )
        if kernels not in ("torch", "fla"):
            raise ValueError(f"linear kernels must be 'torch', 'fla' or 'auto', got {kernels!r}")
        if kernels == "fla" and fla_unfit:
            raise ValueError(f"linear kernels 'fla': {fla_unfit}")
        self.kernels = kernels
        self.name = f"linear_{kernels}"
        self._gdn_decode: Callable[..., torch.Tensor] | None = None
        if kernels == "fla":  # triton is imported only when a Triton kernel can run
            from mla_backends.kernels.gdn_decode import gdn_decode

            self._gdn_decode = gdn_decode
        self.pool = pool
        self.scale = scale
        self._batch: ForwardBatch | None = None
        self._cu: torch.Tensor | None = None  # varlen offsets of an EXTEND batch (fla)
        # TARGET_VERIFY staging per (linear layer, key): states after each draft token
        # [B, T, H, K, V] and the short-conv input windows [B, C, W - 1 + T]. Hazard: under
        # CUDA graphs these are the captured tensors, refreshed by each replay without Python
        # running, so they are kept per captured (batch size, draft count), the key accept
        # reads after a replay (keyed by batch size alone, a second runner's capture at the
        # same size with another draft count replaced the first's, which accept then read
        # stale). A verify that Python runs (eager, or a graph runner's `use_graphs=False`
        # replay) stages under None: one set, dropped by its accept and by the next batch
        # (kept per size, every batch size ever verified held its staging for good).
        self._verify_states: dict[tuple[int, tuple[int, int] | None], torch.Tensor] = {}
        self._verify_conv: dict[tuple[int, tuple[int, int] | None], torch.Tensor] = {}
        self._graphed = False  # whether the current batch runs through the graph hooks
        self._capturing = False  # whether it is being captured (the graph's staging)
        # The verify batch `accept` may still follow (its staging complete, its rows not
        # reset since). Hazard: a second accept rewrote graph-staged states the KV had been
        # truncated past; one after a verify that failed part-way mixed two verifies' states.
        self._accept_pending = False
        # EXTEND (fla): [B, 1, 1, 1] device mask of the requests that continue a cached prefix
        # (None: all do). Hazard: a new request on a reused row, never reset, started from the
        # row's last request's state, silently.
        self._continues: torch.Tensor | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._batch = batch
        self._graphed = self._capturing = False
        self._cu = None  # Hazard: offsets left from an earlier EXTEND batch
        self._continues = None
        self._accept_pending = batch.mode is ForwardMode.TARGET_VERIFY
        self._drop_eager_staging()  # an unaccepted eager verify's
        if self.kernels == "fla" and batch.mode is ForwardMode.EXTEND:
            n = batch.extend_seq_lens_cpu.to(torch.int64)
            cu = torch.zeros(n.numel() + 1, dtype=torch.int64)
            cu[1:] = n.cumsum(0)
            self._cu = cu.to(self.pool.device, non_blocking=True)
            cont = batch.extend_prefix_lens_cpu > 0
            if not bool(cont.all()):
                self._continues = cont.view(-1, 1, 1, 1).to(self.pool.device, non_blocking=True)

    def reset(self, rows: Sequence[int]) -> None:
        """Zero the rows' states; a pending verify over any of them is dropped (its staging
        belongs to the rows' old requests: accepting it would bring their state back)."""
        rows = as_ints(rows, "rows")
        if self._accept_pending and self._batch is not None:
            if set(rows) & set(self._batch.rows_host):
                self._accept_pending = False
        self.pool.reset(rows)

    # graph hooks: decode reads everything from the batch's static tensors
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        pass

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self.init_forward_metadata(batch)
        self._graphed = self._capturing = True

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        self.init_forward_metadata(batch)
        self._graphed = True

    def _graph_key(self, batch_size: int) -> tuple[int, int]:
        assert self._batch is not None
        return batch_size, self._batch.q_len

    def _stage_key(self, batch_size: int) -> tuple[int, int] | None:
        """Where a verify run by Python stages: the captured graph's key while capturing,
        else None (eager, and a graph runner's Python replay)."""
        return self._graph_key(batch_size) if self._capturing else None

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
    ) -> torch.Tensor:
        """layer: index in the linear state pool. q, k [T, H, K], v [T, H, V], g [T, H] or
        [T, H, K], beta [T, H] -> o [T, H, V] in v's dtype (computed in fp32); the requests'
        states advance."""
        batch = self._batch
        if batch is None:
            raise RuntimeError("init_forward_metadata was not called for this batch")
        layer = self.pool.check_layer(layer)
        rec = self.pool.recurrent
        # Hazard: a q of other heads (one, say) broadcast through the einsums, silently; one
        # of other tokens than the batch was sliced per request short (EXTEND: a request's
        # state advanced over fewer tokens) or gathered past the rows. Host metadata only.
        check_tensor("q", q, (-1, *rec.shape[2:4]))
        t, h, dk = q.shape
        if t != batch.num_tokens:
            raise ShapeError(f"q: expected the batch's {batch.num_tokens} tokens, got {t}")
        check_tensor("k", k, (t, h, dk))
        check_tensor("v", v, (t, h, rec.shape[-1]))
        check_tensor("beta", beta, (t, h))
        inputs = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
        bad = {n: str(x.dtype) for n, x in inputs.items() if not x.is_floating_point()}
        if bad:  # integer inputs ran the recurrence as ints
            raise TypeError(
                f"linear layer {layer}: q, k, v, g and beta must be floating point, got {bad}"
            )
        if g.shape not in ((t, h), (t, h, dk)):
            raise ValueError(
                f"g: expected shape [{t}, {h}] (GDN) or [{t}, {h}, {dk}] (KDA), got {list(g.shape)}"
            )
        if t == 0:  # IDLE (or nothing new): no kernel, no state touched
            return torch.empty(0, h, v.shape[-1], dtype=v.dtype, device=v.device)
        if batch.mode is ForwardMode.TARGET_VERIFY:
            return self._verify(layer, q, k, v, g, beta, batch).to(v.dtype)
        if batch.mode is ForwardMode.DECODE:
            rows = batch.req_pool_indices
            if self.kernels == "fla":
                rec_l = self.pool.recurrent[layer]
                if g.dim() == 2:  # GDN: our kernel (fla's GDN kernel cannot index state slots)
                    assert self._gdn_decode is not None  # set with kernels="fla"
                    return self._gdn_decode(q, k, v, g, beta, rec_l, rows, self.scale)
                return fla_ops.decode(q, k, v, g, beta, rec_l, rows, self.scale)
            return self._decode(layer, q, k, v, g, beta, rows.long()).to(v.dtype)
        if self.kernels == "fla":
            rows = batch.req_pool_indices.long()
            assert self._cu is not None  # set by init_forward_metadata for EXTEND
            s0 = rec[layer][rows]  # a copy
            if self._continues is not None:  # new requests start from zero
                s0 = s0 * self._continues
            o, final = fla_ops.prefill(q, k, v, g, beta, s0, self._cu, self.scale)
            rec[layer][rows] = final
            return o
        out = torch.empty(t, h, v.shape[-1], dtype=torch.float32, device=q.device)
        start = 0
        prefix = batch.extend_prefix_lens_cpu.tolist()
        for row, n, p in zip(batch.rows_host, batch.extend_seq_lens_cpu.tolist(), prefix):
            sl = slice(start, start + n)
            s0 = rec[layer, row] if p else torch.zeros_like(rec[layer, row])  # a new request
            out[sl], rec[layer, row] = gated_delta_rule(
                q[sl], k[sl], v[sl], g[sl], beta[sl], s0, self.scale
            )
            start += n
        return out.to(v.dtype)

    def _verify(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """T draft tokens per request, all requests at once, step by step (the same maths as
        decode, fp32, on every device): outputs, and the state after every token staged for
        `accept`. The pool is not written."""
        b, t = batch.batch_size, batch.q_len
        s = self.pool.recurrent[layer][batch.req_pool_indices.long()]  # [B, H, K, V] copy
        q, k, v, g, beta = (x.view(b, t, *x.shape[1:]) for x in (q, k, v, g, beta))
        outs, states = [], []
        for i in range(t):
            o, s = self._step(s, q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i])
            outs.append(o)
            states.append(s)
        self._verify_states[layer, self._stage_key(b)] = torch.stack(states, 1)
        return torch.stack(outs, 1).flatten(0, 1)

    def stage_verify_conv(self, layer: int, windows: torch.Tensor) -> None:
        """The model's short-conv inputs of a verify batch: [B, C, W - 1 + T] (the stored
        window, then the T draft tokens), so `accept` can keep the window after token a."""
        batch = self._batch
        if batch is None or batch.mode is not ForwardMode.TARGET_VERIFY:
            raise RuntimeError("stage_verify_conv() stages a TARGET_VERIFY batch's windows")
        # Hazard: -1 staged the last layer; a window of other channels failed in accept's
        # gather after the recurrent states were written (half a request accepted)
        layer = self.pool.check_layer(layer)
        _, _, channels, kept = self.pool.conv.shape
        t = batch.q_len
        check_tensor(
            "windows", windows, (batch.batch_size, channels, kept + t), None, self.pool.conv.device
        )
        self._verify_conv[layer, self._stage_key(batch.batch_size)] = windows

    def accept(self, num_accepted: torch.Tensor) -> None:
        """After a TARGET_VERIFY batch: request i keeps its first `num_accepted[i]` draft tokens
        (0..T, a device tensor [B]); its recurrent and conv states become those after that
        token (unchanged for 0). No host sync; padded rows write the dummy slot. After a
        graph runner's replay B is the captured (padded) batch size: 0 for each padding row."""
        batch = self._batch
        if batch is None or batch.mode is not ForwardMode.TARGET_VERIFY:
            raise RuntimeError("accept() follows a TARGET_VERIFY batch")
        if not self._accept_pending:
            raise RuntimeError(
                "accept(): no verify is pending (accept was called for it already, or its rows "
                "were reset since)"
            )
        if not isinstance(num_accepted, torch.Tensor) or num_accepted.dtype not in _COUNT_DTYPES:
            got = getattr(num_accepted, "dtype", type(num_accepted).__name__)
            raise TypeError(f"num_accepted: expected an int32 / int64 tensor, got {got}")
        rows = batch.req_pool_indices.long()
        n = num_accepted.to(device=rows.device, dtype=torch.long)
        b, t = rows.numel(), batch.q_len
        if n.shape != (b,):
            raise ValueError(
                f"num_accepted: expected shape [{b}] (a count for every row of the verify batch; "
                f"after a graph runner's padded replay, 0 for each padding row), got "
                f"{list(n.shape)}"
            )
        # Checked before any state is written where it costs no sync (a host tensor): a count
        # out of range wrote the recurrent states, then failed in the conv gather
        host = num_accepted
        if host.device.type == "cpu" and b and not 0 <= int(host.min()) <= int(host.max()) <= t:
            raise ValueError(f"num_accepted: counts must be in 0..{t}, got {host.tolist()}")
        # A graph replay runs no Python: its staging is the captured tensors. What this
        # batch's Python staged is under None (every batch drops the last one's), so a None
        # key says Python ran it. Hazard: a Python replay that failed part-way left the
        # graph-keyed staging in place, and accept took it as complete, writing a rejected
        # verify's states; one that failed before its first linear layer staged nothing,
        # and the eager runner captures no graph-keyed staging either: refused below.
        python_ran = any(key[1] is None for key in self._verify_states)
        size = self._graph_key(b) if self._graphed and not python_ran else None
        done = sum(key[1] == size for key in self._verify_states)
        if b and done != self.pool.num_layers:
            raise RuntimeError(
                f"accept(): the verify batch staged {done} of {self.pool.num_layers} linear "
                "layers (it failed part-way?): reset its rows and prefill them again"
            )
        # On the device a count can't be checked without a sync: one out of range is clamped
        # (it indexed past the staging, a device-side assert that ends the process)
        n = n.clamp(0, t)
        ar = torch.arange(b, device=rows.device)
        for (layer, staged), states in self._verify_states.items():
            if staged != size:
                continue
            rec = self.pool.recurrent[layer]
            after = states[ar, (n - 1).clamp_min(0)]
            keep = (n == 0).view(b, 1, 1, 1)
            rec[rows] = torch.where(keep, rec[rows], after)
        for (layer, staged), win in self._verify_conv.items():
            if staged != size:
                continue
            w1 = self.pool.conv.shape[-1]
            idx = (n[:, None] + torch.arange(w1, device=rows.device))[:, None, :]
            self.pool.conv[layer][rows] = win.gather(2, idx.expand(b, win.shape[1], w1)).float()
        self._accept_pending = False
        if size is None:  # an eager verify's staging is read once
            self._drop_eager_staging()

    def _drop_eager_staging(self) -> None:
        """Forget an eager verify's staging (size None); graph-captured sizes keep theirs."""
        for staging in (self._verify_states, self._verify_conv):
            for key in [k for k in staging if k[1] is None]:
                del staging[key]

    def _decode(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """One token per request, all requests at once (the batch is the recurrence's T=1)."""
        rec = self.pool.recurrent[layer]
        o, rec[rows] = self._step(rec[rows], q, k, v, g, beta)  # padded rows: slot 0, the dummy
        return o

    def _step(
        self,
        s: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token of every request, fp32: states s [B, H, K, V] -> (o [B, H, V], new s)."""
        scale = q.shape[-1] ** -0.5 if self.scale is None else self.scale
        decay = g.float().exp()
        s = s * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        err = v.float() - torch.einsum("bhkv,bhk->bhv", s, k.float())
        s = s + torch.einsum("bhk,bhv->bhkv", k.float(), beta.float()[..., None] * err)
        return scale * torch.einsum("bhkv,bhk->bhv", s, q.float()), s


def _need_cuda(pool: LinearStatePool) -> str | None:
    return None if pool.device.type == "cuda" else f"needs a CUDA device, pool is on {pool.device}"


def _fla_dims(pool: LinearStatePool) -> str | None:
    """fla's chunk kernels take key dims up to 256; our GDN decode kernel (`gdn_decode`, no
    masks) needs power-of-two key and value dims."""
    dk, dv = pool.recurrent.shape[-2:]
    if dk > 256 or dk & (dk - 1) or dv & (dv - 1):
        return f"needs power-of-two head dims with key dim <= 256, pool has K {dk}, V {dv}"
    return None
