"""The CUDA-graph runner and its padding contract, for every graph-capable backend (the
`graphs` of each row of tests/parity.py).

CPU (CI): the runner's padded static-buffer path without capture (`use_graphs=False`): the
backends' capture / replay hooks, padding, slicing and dummy-page writes are all exercised.
GPU: real `torch.cuda.CUDAGraph` capture, 1,000 replays over changing batches, outputs equal to
eager and within tolerance of the reference, no pointer changes, no host sync during replay,
padded rows never writing a real slot.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np
import pytest
import torch
from parity import graph_params

from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.checks import ShapeError
from mla_backends.graph_runner import CudaGraphRunner, InputSpec, replayable
from mla_backends.testing import TOLERANCES, Case, DecodeStream, absorbed_forward, build_case


def _specs(case: Case) -> dict[str, InputSpec]:
    d, dt = case.dims, getattr(torch, case.dtype)
    h = case.num_heads
    return {
        "q_nope": InputSpec((h, d.kv_lora_rank), dt),
        "q_rope": InputSpec((h, d.qk_rope_head_dim), dt),
        "k_nope": InputSpec((d.kv_lora_rank,), dt),
        "k_rope": InputSpec((d.qk_rope_head_dim,), dt),
    }


def _slots_outside(pool_buf: torch.Tensor, page: int, touched: torch.Tensor) -> torch.Tensor:
    """Bit pattern of every row except the dummy page and the slots a step legitimately
    writes (its real new tokens)."""
    keep = torch.ones(pool_buf.shape[0], dtype=torch.bool, device=pool_buf.device)
    keep[:page] = False
    keep[touched] = False
    return pool_buf.view(torch.int16 if pool_buf.element_size() == 2 else torch.int8)[keep]


def _close(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float, what: str) -> None:
    g, w = got.double(), want.double()
    # NaN compares False with anything: a NaN on one side only is an error of its own
    bad = ((g - w).abs() > atol + rtol * w.abs()) | (g.isnan() != w.isnan())
    if bad.any():
        idx = tuple(torch.nonzero(bad)[0].tolist())
        raise AssertionError(
            f"{what}: {int(bad.sum())} elements off, first at {idx}: "
            f"{float(got[idx]):.6f} vs {float(want[idx]):.6f}"
        )


def _run(
    case: Case, device: str, steps: int, use_graphs: bool, ref_every: int, sizes=(1, 2, 4, 8)
) -> None:  # type: ignore[no-untyped-def]
    stream = DecodeStream(
        case,
        device,
        num_requests=12,
        max_prompt=200,
        max_context=200 + steps * max(case.q_len, 1) + 64,
    )
    be = stream.rt.backend
    lse = be.caps.lse  # the LSE through the graph too (CUTLASS's kernel returns none)
    runner = CudaGraphRunner(
        be,
        partial(absorbed_forward, be, return_lse=lse),
        _specs(case),
        sizes,
        q_len=max(case.q_len, 1),
        device=device,
        use_graphs=use_graphs,
    )
    runner.capture()
    atol, rtol, lse_tol = TOLERANCES[case.dtype]
    buf, page = stream.rt.kv_pool.kv_buffer[0], case.page_size
    for i in range(steps):
        n = (i % 7) + 1  # 1..7 real requests: every size pads except 1, 2, 4
        batch, inputs = stream.step(n)
        before = _slots_outside(buf, page, batch.out_cache_loc).clone()
        if use_graphs:
            torch.cuda.set_sync_debug_mode("error")
        try:
            replayed = runner.replay(batch, inputs, check_pointers=True)
            got, got_lse = (t.clone() for t in replayed) if lse else (replayed.clone(), None)
        finally:
            if use_graphs:
                torch.cuda.set_sync_debug_mode(0)
        assert torch.equal(_slots_outside(buf, page, batch.out_cache_loc), before), (
            f"step {i}: a padded row wrote a real slot"
        )
        assert torch.isfinite(got).all(), f"step {i}: non-finite output"
        # Eager may split the KV differently (split counts follow the real lengths, a graph's
        # the longest context), so equality is within the dtype's tolerance, not bitwise.
        be.init_forward_metadata(batch)
        eager = absorbed_forward(be, batch, inputs, lse)
        eager, eager_lse = eager if lse else (eager, None)
        _close(got, eager, atol, rtol, f"step {i} (n={n}) graph vs eager")
        ref, ref_lse = stream.reference(batch, inputs) if i % ref_every == 0 else (None, None)
        if ref is not None:
            _close(got.double().cpu(), ref.cpu(), atol, rtol, f"step {i} vs reference")
        if got_lse is not None:
            _close(got_lse, eager_lse, lse_tol, 0.0, f"step {i} (n={n}) graph vs eager, lse")
            if ref_lse is not None:
                _close(got_lse.double().cpu(), ref_lse.cpu(), lse_tol, 0.0, f"step {i} lse")


# (steps, reference every n steps) per place: the interpreter is slow, a GPU replays 1,000.
STEPS = {"cpu": (12, 3), "sm100-emulation": (12, 3), "interp": (6, 2)}


@pytest.mark.parametrize("where, case", graph_params(gpu=False))
def test_padding_contract_without_capture(
    where: str, case: Case, request: pytest.FixtureRequest
) -> None:
    if where == "sm100-emulation":
        request.getfixturevalue("emulated")
    steps, ref_every = STEPS[where]
    _run(case, "cpu", steps=steps, use_graphs=False, ref_every=ref_every)


@pytest.mark.interp
def test_padding_contract_with_forced_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton route's split count is fixed at capture (for the longest context) and its
    partials live in the graph state's workspace: FP8 pool, four splits, rows padded."""
    from parity import SMALL

    from mla_backends.kernels import tuning

    monkeypatch.setattr(tuning, "choose_num_splits", lambda *a, **k: 4)
    case = Case("triton", page_size=16, num_heads=4, kv_dtype="float8_e4m3fn",
                dtype="bfloat16", dims=SMALL)  # fmt: skip
    _run(case, "cpu", steps=3, use_graphs=False, ref_every=1)


def test_runner_refuses_oversized_and_mismatched_batches() -> None:
    case = Case("torch", page_size=16, num_heads=16, kv_dtype="float32", dtype="float32")
    stream = DecodeStream(case, "cpu", num_requests=12)
    be = stream.rt.backend
    runner = CudaGraphRunner(
        be, partial(absorbed_forward, be), _specs(case), [1, 2], device="cpu", use_graphs=False
    )
    runner.capture()
    batch, inputs = stream.step(3)
    with pytest.raises(ValueError, match="exceeds the largest captured size 2"):
        runner.replay(batch, inputs)
    for sizes in ([], [0, 2]):  # no size at all, or one that captures nothing
        with pytest.raises(ValueError, match="batch sizes must be >= 1"):
            CudaGraphRunner(
                be, partial(absorbed_forward, be), _specs(case), sizes, device="cpu",
                use_graphs=False,
            )  # fmt: skip
    # A bool or float size failed inside capture() with a torch traceback, after the largest
    # size had taken the backend's graph state, which then refused every larger runner
    # (helper 67's sweep): one TypeError naming the argument, before anything is allocated.
    fresh = DecodeStream(case, "cpu", num_requests=4).rt.backend
    for sizes in ([True, 4], [1.0, 2]):
        with pytest.raises(TypeError, match=r"batch_sizes must be integers"):
            CudaGraphRunner(
                fresh, partial(absorbed_forward, fresh), _specs(case), sizes, device="cpu",
                use_graphs=False,
            )  # fmt: skip
    assert fresh._graph_sizes is None and not fresh._graph_captured
    runner = CudaGraphRunner(
        fresh, partial(absorbed_forward, fresh), _specs(case), [np.int64(2)], device="cpu",
        use_graphs=False,
    )  # fmt: skip
    assert runner.batch_sizes == [2] and type(runner.batch_sizes[0]) is int


def _cpu_runner(q_len: int = 1, sizes=(4,), forward=absorbed_forward):  # type: ignore[no-untyped-def]
    case = Case("torch", page_size=16, num_heads=16, kv_dtype="float32", dtype="float32")
    stream = DecodeStream(case, "cpu", num_requests=12)
    be = stream.rt.backend
    runner = CudaGraphRunner(
        be, partial(forward, be), _specs(case), sizes, q_len=q_len, use_graphs=False
    )
    return stream, runner


def test_runner_refuses_a_verify_batch_of_another_q_len() -> None:
    """A runner captured for q_len 2 must refuse a TARGET_VERIFY batch of q_len 3 by name: its
    static buffers hold 2 tokens a request, so the copy would misplace every request's tokens
    (the batch itself is consistent, so the backend's check lets it through)."""
    case = Case(
        backend="torch", mode=ForwardMode.TARGET_VERIFY, page_size=16, num_heads=16,
        kv_dtype="float32", dtype="float32", q_len=3,
    )  # fmt: skip
    stream = DecodeStream(case, "cpu", num_requests=4, max_prompt=120, max_context=200)
    be = stream.rt.backend
    runner = CudaGraphRunner(
        be, partial(absorbed_forward, be), _specs(case), (4,), q_len=2, use_graphs=False
    )
    runner.capture()
    with pytest.raises(
        ValueError, match="captured TARGET_VERIFY q_len=2, got TARGET_VERIFY q_len=3"
    ):
        runner.replay(*stream.step(2))


def test_runner_sorts_its_sizes_and_pads_to_the_smallest_that_fits() -> None:
    """Sizes given out of order (and repeated) are sorted once: the largest sizes the static
    buffers and a batch pads to the smallest captured size that holds it (bisect on an
    unsorted list picked a wrong size)."""
    _, runner = _cpu_runner(sizes=(4, 1, 2, 2))
    assert runner.batch_sizes == [1, 2, 4]
    assert [runner.padded_size(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]


def test_check_pointers_refuses_metadata_that_moved_after_capture() -> None:
    """A replay whose metadata buffers are not the captured ones raises under check_pointers
    (a graph would read the old buffers: stale metadata without an error)."""
    stream, runner = _cpu_runner(sizes=(4,))
    runner.capture()
    runner.replay(*stream.step(2), check_pointers=True)  # the same buffers: fine
    runner._pointers[4] = {k: p + 1 for k, p in runner._pointers[4].items()}
    with pytest.raises(RuntimeError, match="backend buffers moved after capture of batch size 4"):
        runner.replay(*stream.step(2), check_pointers=True)


def test_pointer_snapshot_leaves_out_host_copies() -> None:
    """Fields named `*_cpu` are per-batch host data a graph never reads: a snapshot that took
    them flagged every replay as 'buffers moved' under check_pointers."""
    from mla_backends.graph_runner import _collect

    @dataclasses.dataclass
    class Meta:
        lens: torch.Tensor
        lens_cpu: torch.Tensor
        nested: tuple[torch.Tensor, dict[str, torch.Tensor]]

    a, b, c, d = (torch.zeros(2) for _ in range(4))
    snap: dict[str, int] = {}
    _collect("m", Meta(a, b, (c, {"k": d})), snap)
    want = {"m.lens": a, "m.nested[0]": c, "m.nested[1]['k']": d}
    assert snap == {k: t.data_ptr() for k, t in want.items()}


def test_replay_checks_its_inputs_and_slices_every_output() -> None:
    """Replay copies inputs into static buffers, where a wrong token count broadcast and a
    wrong dtype cast silently: now each input is checked like an eager call's, a missing one
    named; an (out, lse) forward has both sliced to the real tokens (the tuple itself was
    sliced: LSE dropped, padded rows returned). The device defaults to the backend's."""

    def with_lse(be, batch, inputs):  # type: ignore[no-untyped-def]
        return be.forward_absorbed(
            0, inputs["q_nope"], inputs["q_rope"], inputs["k_nope"], inputs["k_rope"], batch,
            return_lse=True,
        )  # fmt: skip

    stream, runner = _cpu_runner(forward=with_lse)
    assert runner.device == torch.device("cpu")
    runner.capture()
    batch, inputs = stream.step(3)
    with pytest.raises(ValueError, match=r"replay inputs lack \['k_rope'\]"):
        runner.replay(batch, {k: v for k, v in inputs.items() if k != "k_rope"})
    with pytest.raises(ShapeError, match=r"q_nope: expected shape \[3, 16, 512\], got \[1, 16"):
        runner.replay(batch, dict(inputs, q_nope=inputs["q_nope"][:1]))
    with pytest.raises(ShapeError, match=r"k_nope: expected dtype"):
        runner.replay(batch, dict(inputs, k_nope=inputs["k_nope"].double()))
    out, lse = runner.replay(batch, inputs)
    assert out.shape == (3, 16, 512) and lse.shape == (3, 16)
    with pytest.raises(ValueError, match="q_len must be >= 1, got 0"):
        _cpu_runner(q_len=0)
    for q_len in (torch.tensor(True), 2.0):  # a torch bool was taken as q_len 1
        with pytest.raises(TypeError, match="CudaGraphRunner: q_len must be an integer"):
            _cpu_runner(q_len=q_len)  # type: ignore[arg-type]


def test_a_second_runner_keeps_the_first_runners_graph_state() -> None:
    """Decode and verify runners on one backend: state is allocated for the largest before
    capture and kept after (a second runner once replaced the buffers a captured graph
    reads); one that needs more after a capture is refused."""
    stream, dec = _cpu_runner(q_len=1, sizes=(2, 4))
    be = dec.backend
    ver = CudaGraphRunner(
        be, partial(absorbed_forward, be), _specs(stream.case), [4], q_len=2, use_graphs=False
    )  # 8 tokens: the state grows before any capture
    dec.capture()
    ver.capture()
    state = be.graph_state
    CudaGraphRunner(be, partial(absorbed_forward, be), _specs(stream.case), [2], use_graphs=False)
    assert be.graph_state is state  # a smaller runner keeps it
    batch, inputs = stream.step(3)
    dec.replay(batch, inputs, check_pointers=True)  # the captured buffers are still the ones
    with pytest.raises(RuntimeError, match=r"already captured; 16 / 16 would replace"):
        CudaGraphRunner(
            be, partial(absorbed_forward, be), _specs(stream.case), [16], use_graphs=False
        )


@pytest.mark.parametrize("where, case", graph_params(gpu=True))
def test_gpu_graph_replay_1000(where: str, case: Case) -> None:
    _run(case, "cuda", steps=1000, use_graphs=True, ref_every=50)


def test_replay_refuses_a_batch_whose_tokens_are_not_q_len_a_request() -> None:
    """The static buffers hold q_len tokens a request: a batch of 2 requests carrying 3
    tokens (one request with 2) had its third token copied in and then dropped, the output
    sliced to 3 rows of 2, silently."""
    stream, runner = _cpu_runner(sizes=(4,))
    runner.capture()
    batch, inputs = stream.step(2)
    extra = stream.rt.allocator.alloc_extend([int(batch.req_pool_indices_cpu[1])], [1])
    ext = torch.tensor([1, 2], dtype=torch.int32)
    bad = dataclasses.replace(
        batch,
        out_cache_loc=torch.cat([batch.out_cache_loc, extra]),
        positions=torch.cat([batch.positions, batch.positions[1:] + 1]),
        extend_seq_lens=ext,
        extend_seq_lens_cpu=ext,
        seq_lens=batch.seq_lens + torch.tensor([0, 1], dtype=torch.int32),
        seq_lens_cpu=batch.seq_lens_cpu + torch.tensor([0, 1], dtype=torch.int32),
    )
    inputs = {k: torch.cat([v, v[1:]]) for k, v in inputs.items()}
    with pytest.raises(
        ShapeError, match=r"DECODE .* needs 1 new token\(s\) per request, got \[1, 2\]"
    ):
        runner.replay(bad, inputs)


@pytest.mark.parametrize(
    "backend", [pytest.param("triton", marks=pytest.mark.interp), "trtllm_mla"]
)
def test_graph_hooks_refuse_a_batch_larger_than_the_state(emulated: None, backend: str) -> None:
    """State allocated for 2 requests / 2 tokens, a batch of 3 bound to it: the static
    buffers were sliced short (a size mismatch deep in a copy) and on a GPU the index
    builder wrote page ids past the static table; now one line names both sizes."""
    from mla_backends.config import MLADims

    dims = MLADims(16, 512, 64) if backend == "trtllm_mla" else MLADims(4, 32, 16, 16, 16)
    page = 32 if backend == "trtllm_mla" else 16
    case = Case(backend, page_size=page, num_heads=dims.num_heads, kv_lens=(5, 7, 9), dims=dims)
    rt, batch = build_case(case, torch.device("cpu"))
    rt.backend.init_cuda_graph_state(2, 2)
    for hook in (rt.backend.init_forward_metadata_capture, rt.backend.init_forward_metadata_replay):
        with pytest.raises(
            ValueError,
            match=r"3 requests / 3 tokens exceeds the CUDA-graph state, allocated for 2 / 2",
        ):
            hook(batch)


def test_runner_defaults_to_a_dispatch_backends_device() -> None:
    """Prefill and decode on different backends give a DispatchBackend, which had no
    `device`: the runner's static buffers went to "cuda" (on a CPU: an assertion deep in
    torch; on a GPU: the current device, not the pool's)."""
    from mla_backends.backends.dispatch import DispatchBackend
    from mla_backends.backends.torch_backend import TorchBackend

    stream, _ = _cpu_runner()
    be = stream.rt.backend
    dispatch = DispatchBackend(TorchBackend(be.ctx), be)
    runner = CudaGraphRunner(
        dispatch, partial(absorbed_forward, dispatch), _specs(stream.case), [4], use_graphs=False
    )
    assert runner.device == torch.device("cpu")
    runner.capture()
    batch, inputs = stream.step(3)
    assert runner.replay(batch, inputs).shape[0] == 3


def test_padded_rows_go_back_to_row_zero_after_a_larger_replay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Padded rows name request row 0 on every replay, not only after capture (whose static
    rows were still zeros): a replay of 4 real requests, then one of 2, must not leave rows
    2..3 naming the first batch's requests, whose recurrent states a hybrid model's padded
    rows would then write (mutation testing, helper 73)."""
    stream, runner = _cpu_runner(sizes=(4,))
    be = runner.backend
    seen: list[torch.Tensor] = []
    orig = be.init_forward_metadata_replay

    def spy(b: ForwardBatch) -> None:
        seen.append(b.req_pool_indices.clone())
        orig(b)

    monkeypatch.setattr(be, "init_forward_metadata_replay", spy)
    runner.capture()
    runner.replay(*stream.step(4))
    runner.replay(*stream.step(2))
    assert (seen[0] != 0).all() and (seen[-1][2:] == 0).all(), [s.tolist() for s in seen]


def test_padded_verify_rows_see_a_key_for_every_query(monkeypatch: pytest.MonkeyPatch) -> None:
    """A q_len-3 runner padding 2 real requests to 4, and its capture (all padding): padded
    rows carried the decode fill (seq_len 1) under 3 queries, so their first two queries saw
    no key (the zero-key rows CUTLASS / FlashMLA / TRT-LLM are never asked to handle) and
    their prefix was -2. Now every query of a padded row sees at least the fill's keys, the
    length stays inside row 0 (the dummy page), padded tokens still write only slot 0, and
    their positions (0 before) agree with the lengths."""
    case = Case("torch", ForwardMode.TARGET_VERIFY, kv_dtype="float32", dtype="float32", q_len=3)
    stream = DecodeStream(case, "cpu", num_requests=12)
    be = stream.rt.backend
    runner = CudaGraphRunner(
        be, partial(absorbed_forward, be), _specs(case), [4], q_len=3, use_graphs=False
    )
    seen: list[tuple[int, ForwardBatch]] = []
    for hook in ("init_forward_metadata_capture", "init_forward_metadata_replay"):
        orig = getattr(be, hook)

        def spy(b: ForwardBatch, orig=orig) -> None:  # type: ignore[no-untyped-def]
            seen.append((int((b.req_pool_indices != 0).sum()), _cloned(b)))
            orig(b)

        monkeypatch.setattr(be, hook, spy)
    runner.capture()
    batch, inputs = stream.step(2)
    runner.replay(batch, inputs)
    assert [n for n, _ in seen] == [0, 2]
    fill, width = be.cuda_graph_seq_len_fill_value, be.req_to_token.shape[1]
    assert fill >= 1  # checked against fill alone, a fill of 0 passed (helper 73's mutant)
    for n, b in seen:
        seq, pre = b.seq_lens[n:], b.extend_prefix_lens[n:]
        assert (b.req_pool_indices[n:] == 0).all() and (b.out_cache_loc[n * 3 :] == 0).all()
        assert ((seq - 3 + 1 >= fill) & (seq <= width)).all(), seq.tolist()
        assert torch.equal(pre, seq - 3) and torch.equal(b.seq_lens_cpu[n:], seq)
        assert torch.equal(b.extend_prefix_lens_cpu[n:], pre)
        pos = b.positions[n * 3 :].view(-1, 3)  # prefix + i, as the lengths say
        assert torch.equal(pos, pre[:, None] + torch.arange(3)), pos.tolist()


def _cloned(b: ForwardBatch) -> ForwardBatch:
    """A copy of a batch over the runner's static buffers (refilled by the next step)."""
    fields = [f.name for f in dataclasses.fields(b) if f.init]
    tensors = {k: v.clone() for k in fields if isinstance(v := getattr(b, k), torch.Tensor)}
    return dataclasses.replace(b, **tensors)


def test_set_scale_after_capture_is_refused() -> None:
    """Captured kernels hold the FP8 scale as a host float (triton's and FlashInfer's launch
    arguments): a scale set after capture changed eager calls and the stores but not the
    replays, which read the new rows under the old scale. Now set_scale (and calibrate_scale)
    refuses once a graph capture over the pool was prepared (the backend's hook, as SGLang
    calls it), naming the fix; before it works. A runner that captures nothing
    (use_graphs=False: eager runs read the scale each call) leaves it settable (it froze it)."""
    case = Case("torch", page_size=16, num_heads=16, kv_dtype="float8_e4m3fn", dtype="bfloat16")
    stream = DecodeStream(case, "cpu", num_requests=4)
    be, pool = stream.rt.backend, stream.rt.kv_pool
    runner = CudaGraphRunner(
        be, partial(absorbed_forward, be), _specs(case), [2], device="cpu", use_graphs=False
    )
    # the pool holds rows, so only their own scale may be set (`test_pool.py`): set it again
    s = pool.scale(0)
    assert pool.set_scale(0, s) == s  # not captured yet
    runner.capture()  # eager: no graph
    assert pool.set_scale(0, s) == s and pool.scales_frozen_by is None
    be.init_forward_metadata_capture(runner._static_batch(2, None))  # a graph's capture
    with pytest.raises(RuntimeError, match=r"layer 0: .*captured.* set the scale before capture"):
        pool.set_scale(0, s)
    k = torch.ones(1, 512), torch.ones(1, 64)
    with pytest.raises(RuntimeError, match="set the scale before capture"):
        pool.calibrate_scale(0, *k)
    assert pool.scale(0) == s and float(pool.scales[0]) == s
    runner.capture()  # an eager runner keeps the earlier graph's freeze
    assert pool.scales_frozen_by == be.name
    runner.replay(*stream.step(2))

    # through a wrapper too (a dispatch backend has no `pool` of its own; an eager runner
    # over it froze the scales before)
    from mla_backends.backends.dispatch import DispatchBackend

    fresh = DecodeStream(case, "cpu", num_requests=4)
    both, pool = fresh.rt.backend, fresh.rt.kv_pool
    wrapped = DispatchBackend(both, both)
    eager = CudaGraphRunner(
        wrapped, partial(absorbed_forward, wrapped), _specs(case), [2], device="cpu",
        use_graphs=False,
    )  # fmt: skip
    eager.capture()
    assert pool.scales_frozen_by is None and pool.set_scale(0, s) == s


@pytest.mark.parametrize("q_len", [1, 3])
def test_padded_rows_device_lengths_equal_the_host_copies_after_a_larger_batch(
    q_len: int,
) -> None:
    """Hazard: a replay of n requests on a captured size bs must reset every padded row
    n..bs-1 of the static device buffers (seq_lens, extend_prefix_lens) to the padding
    values; a row left out kept the previous (larger) batch's real length, so the device
    lengths a captured kernel reads disagreed with the host copies (`seq_lens_cpu`) the
    backend sized its metadata from, and the padding contract (seq_len = fill + q_len - 1,
    prefix = seq_len - q_len) no longer held. Padded tokens' positions and inputs are reset
    alike (a stale position sent sparse paths past the padded row's keys)."""
    mode = ForwardMode.DECODE if q_len == 1 else ForwardMode.TARGET_VERIFY
    case = Case(
        backend="torch", mode=mode, page_size=16, num_heads=16, kv_dtype="float32",
        dtype="float32", q_len=q_len,
    )  # fmt: skip
    stream = DecodeStream(case, "cpu", num_requests=8, max_prompt=120, max_context=200)
    be = stream.rt.backend
    seen: list[tuple[torch.Tensor, ...]] = []

    def forward(batch, inputs):  # type: ignore[no-untyped-def]
        seen.append(
            (
                batch.seq_lens.clone(), batch.seq_lens_cpu.clone(),
                batch.extend_prefix_lens.clone(), batch.extend_prefix_lens_cpu.clone(),
                batch.positions.clone(), *(v.clone() for v in inputs.values()),
            )
        )  # fmt: skip
        return absorbed_forward(be, batch, inputs, False)

    runner = CudaGraphRunner(
        be, forward, _specs(case), (4,), q_len=q_len, device="cpu", use_graphs=False
    )
    runner.capture()
    pad_seq = be.cuda_graph_seq_len_fill_value + q_len - 1
    for n in (4, 1, 3, 2):  # each after a larger one: stale rows would show
        batch, inputs = stream.step(n)
        seen.clear()
        runner.replay(batch, inputs)
        seq, seq_cpu, pre, pre_cpu, pos, *ins = seen[-1]
        assert torch.equal(seq.cpu(), seq_cpu), f"n={n}: device seq_lens {seq} vs {seq_cpu}"
        assert torch.equal(pre.cpu(), pre_cpu), f"n={n}: device prefix {pre} vs {pre_cpu}"
        assert (seq[n:] == pad_seq).all() and (pre[n:] == pad_seq - q_len).all()
        pad_pos = torch.arange(pad_seq - q_len, pad_seq).repeat(4 - n)
        assert torch.equal(pos[n * q_len :], pad_pos), f"n={n}: padded positions {pos}"
        assert torch.equal(pos[: n * q_len], batch.positions), f"n={n}: real positions {pos}"
        assert all((x[n * q_len :] == 0).all() for x in ins), f"n={n}: padded inputs not 0"


@pytest.mark.parametrize(
    ("sizes", "max_batch", "kept"),
    [
        ([1, 2, 4, 8], 8, [1, 2, 4, 8]),
        ([1, 2, 4, 8, 16], 3, [1, 2, 4]),  # 8 and 16 never replay: 4 holds every batch
        ([1, 2, 4, 8, 16], 4, [1, 2, 4]),  # a size equal to max_batch is the cover
        ([16, 1, 32], 8, [16, 1]),  # unsorted: the order is the runner's to fix
        ([1, 2], 8, [1, 2]),  # larger batches run eagerly
        ([8], 1, [8]),
    ],
)
def test_replayable_drops_sizes_no_batch_can_reach(
    sizes: list[int], max_batch: int, kept: list[int]
) -> None:
    assert replayable(sizes, max_batch) == kept
