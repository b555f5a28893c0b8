"""DeepSeek-V3.2 through SGLang's `dsa` backend with our sparse kernel (sglang 0.5.17 on CPU,
tests/sglang_cpu/requirements.txt): the hook's contract is SGLang's own method signature, it
is installed only when `MLAB_DSA_SPARSE` asks for it, and SGLang's method, once replaced,
matches our fp64 sparse reference (Triton interpreter). Skipped, with the reason, where sglang
cannot be imported."""

from __future__ import annotations

import inspect

import pytest
import torch
from sglang_cpu.env import load_sglang

try:
    load_sglang()
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
except Exception as e:  # noqa: BLE001 - any import failure means: cannot run here
    pytest.skip(f"sglang unavailable: {' '.join(str(e).split())[:160]}", allow_module_level=True)

from mla_backends.integrations.sglang import dsa  # noqa: E402
from mla_backends.sparse.reference import sparse_attention  # noqa: E402
from mla_backends.testing import TOLERANCES  # noqa: E402

METHOD = "_forward_flashmla_sparse"


def test_hook_takes_sglangs_arguments() -> None:
    """Same parameter names, order and defaults as the method it replaces (self aside)."""
    theirs = list(inspect.signature(getattr(DeepseekSparseAttnBackend, METHOD)).parameters)
    ours = list(inspect.signature(dsa.forward_sparse).parameters)
    assert theirs[1:] == ours[1:], (theirs, ours)
    assert dsa.TARGET.endswith(f"{DeepseekSparseAttnBackend.__name__}.{METHOD}")


@pytest.fixture
def hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """HookRegistry's hooks and SGLang's method restored after the test."""
    monkeypatch.setattr(HookRegistry, "_hooks", type(HookRegistry._hooks)(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.setattr(
        DeepseekSparseAttnBackend, METHOD, getattr(DeepseekSparseAttnBackend, METHOD)
    )


def test_hook_installed_only_when_asked(hooks: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dsa.ENV, raising=False)
    assert dsa.register_hook() is None and dsa.TARGET not in HookRegistry._hooks
    monkeypatch.setenv(dsa.ENV, "flashmla")
    with pytest.raises(
        ValueError, match=r"MLAB_DSA_SPARSE='flashmla' is not one of \['triton', 'auto'\]"
    ):
        dsa.register_hook()
    original = getattr(DeepseekSparseAttnBackend, METHOD)
    HookRegistry.apply_hooks()
    assert getattr(DeepseekSparseAttnBackend, METHOD) is original
    monkeypatch.setenv(dsa.ENV, "triton")
    assert dsa.register_hook() == "triton"
    assert [h[:2] for h in HookRegistry._hooks[dsa.TARGET]] == [
        (HookType.REPLACE, dsa.forward_sparse)
    ]
    HookRegistry.apply_hooks()
    assert getattr(DeepseekSparseAttnBackend, METHOD) is not original  # SGLang's wrapper


@pytest.mark.interp
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_replaced_method_matches_the_reference(
    hooks: None, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """SGLang's call, as its `dsa` backend makes it (q_all [T, H, L + R], the layer's pool
    [slots, 1, L + R], slot ids with -1 padding, one token with none), on a pool whose unused
    rows are NaN. fp16 / fp32: the interpreter's bf16 dots are wrong (DESIGN.md)."""
    monkeypatch.setenv(dsa.ENV, "triton")
    dsa.register_hook()
    HookRegistry.apply_hooks()
    gen = torch.Generator().manual_seed(0)
    t, h, lat, r, slots, k = 3, 16, 32, 16, 96, 24
    q_all = torch.randn(t, h, lat + r, generator=gen).to(dtype)
    pool = torch.full((slots, 1, lat + r), float("nan"), dtype=dtype)
    idx = torch.full((t, k), -1, dtype=torch.int32)
    for i, n in enumerate((k, 7, 0)):  # full, short (-1 tail), none
        chosen = torch.randperm(slots, generator=gen)[:n].to(torch.int32)
        idx[i, :n] = chosen
        pool[chosen.long(), 0] = torch.randn(n, lat + r, generator=gen).to(dtype)
    scale = (lat + r) ** -0.5
    backend = object.__new__(DeepseekSparseAttnBackend)  # the method reads nothing of self
    got = backend._forward_flashmla_sparse(q_all, pool, lat, idx, scale, None)
    valid = idx >= 0
    rows = torch.where(valid[..., None], pool[idx.clamp(min=0).long(), 0].double(), 0.0)
    want, _ = sparse_attention(q_all[..., :lat], q_all[..., lat:], rows, valid, scale)
    atol, rtol, _ = TOLERANCES[str(dtype).removeprefix("torch.")]
    assert got.shape == (t, h, lat) and got.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # no index: out 0
    # the same values in views strided along their last dimension (a column-major table was
    # read as if row-major: 3.2 off, without an error)
    idx_cols = idx.t().contiguous().t()
    q_cols = q_all.transpose(1, 2).contiguous().transpose(1, 2)
    assert idx_cols.stride(1) != 1 and q_cols.stride(2) != 1
    again = backend._forward_flashmla_sparse(q_cols, pool, lat, idx_cols, scale, None)
    assert torch.equal(again, got)


def test_launch_config_once_per_token_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer of a batch makes the same call shape: the launch rule runs once per token
    count and the device is asked its SMs once, not once per layer (the rule alone was ~10 us
    of host work a call); the Gluon route's state is read each call. Off the interpreter's
    fixed config, as on a GPU (no kernel runs here)."""
    from mla_backends.sparse import triton_backend as tb

    monkeypatch.setattr(tb, "interpreting", lambda: False)
    rule, facts = tb._launch_rule, dsa._device_facts
    rule.cache_clear()
    facts.cache_clear()
    cpu = torch.device("cpu")
    got = [dsa._launch(cpu, 16, t, 8) for t in (3, 3, 3, 5, 5, 3)]  # layers of 3 batches
    assert rule.cache_info().misses == 2 and rule.cache_info().hits == 4
    assert facts.cache_info().misses == 1
    assert got[0] == got[5] == tb.launch_config(16, False, 3, 8, 4) and "gluon" not in got[0]
    got[0]["splits"] = 999  # a caller's own copy
    assert dsa._launch(cpu, 16, 3, 8) == got[5]
    rule.cache_clear()


def test_bad_inputs_refused_with_a_reason() -> None:
    q = torch.zeros(2, 16, 48)
    idx = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_cache rows must be 48 wide"):
        dsa.forward_sparse(None, q, torch.zeros(8, 1, 40), 32, idx, 0.1)
    with pytest.raises(ValueError, match="page_table_1 must be"):
        dsa.forward_sparse(None, q, torch.zeros(8, 1, 48), 32, idx[:1], 0.1)
    with pytest.raises(ValueError, match="v_head_dim 48 must be below"):
        dsa.forward_sparse(None, q, torch.zeros(8, 1, 48), 48, idx, 0.1)


def test_no_latent_columns_a_pool_of_another_dtype_and_a_flat_table_refused() -> None:
    """Refused with the reason before any launch (each reached the kernel, or an IndexError)."""
    q, pool = torch.zeros(2, 16, 48), torch.zeros(8, 1, 48)
    idx = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="v_head_dim 0 must be below q_all's width 48"):
        dsa.forward_sparse(None, q, pool, 0, idx, 0.1)
    with pytest.raises(ValueError, match=r"48 wide and torch.float32 like q_all .* torch.float16"):
        dsa.forward_sparse(None, q, pool.half(), 32, idx, 0.1)
    with pytest.raises(ValueError, match=r"page_table_1 must be \[tokens = 2, topk\], got \(2,\)"):
        dsa.forward_sparse(None, q, pool, 32, idx[:, 0], 0.1)


def test_call_launches_for_its_own_shape_with_the_gluon_routes_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The launch is `launch_config(heads, tokens, topk)` of this call, with the Gluon kernel
    only while its route is open. Off the interpreter's fixed config on a faked SM90; the
    table is int64 (cast to the kernel's int32). No kernel runs."""
    from mla_backends.kernels import mla_attention
    from mla_backends.sparse import triton_backend as tb
    from mla_backends.sparse import triton_kernel

    calls: list[tuple[torch.Tensor, dict[str, int]]] = []

    def attend(q_nope: torch.Tensor, q_rope: torch.Tensor, kv: torch.Tensor,
               indices: torch.Tensor, sm_scale: float, kv_scale: float,
               launch: dict[str, int]) -> tuple[torch.Tensor, None]:  # fmt: skip
        calls.append((indices, launch))
        return q_nope, None

    monkeypatch.setattr(triton_kernel, "attend", attend)
    monkeypatch.setattr(tb, "interpreting", lambda: False)
    monkeypatch.setattr(dsa, "_device_facts", lambda device: (132, True))
    monkeypatch.setattr(mla_attention, "gluon_error", lambda: None)
    q, pool = torch.zeros(3, 64, 48), torch.zeros(8, 1, 48)
    idx = torch.zeros(3, 2048, dtype=torch.int64)
    dsa.forward_sparse(None, q, pool, 32, idx, 0.1)
    monkeypatch.setattr(mla_attention, "gluon_error", lambda: "Gluon turned off")
    dsa.forward_sparse(None, q, pool, 32, idx, 0.1)
    assert [c[1] for c in calls] == [
        tb.launch_config(64, False, 3, 2048, 132, True),
        tb.launch_config(64, False, 3, 2048, 132, False),
    ]
    assert "gluon" in calls[0][1] and "gluon" not in calls[1][1]
    assert calls[0][0].dtype == torch.int32


@pytest.mark.parametrize("choice", ["triton", "auto"])
def test_hook_runs_eagerly_inside_a_compiled_model(
    hooks: None, monkeypatch: pytest.MonkeyPatch, choice: str
) -> None:
    """`--enable-torch-compile`: SGLang's `dsa` backend calls the hook inside the model's
    compiled forward; our kernel launch must run eagerly there, never traced by Dynamo (the
    adapter's twin: tests/test_sglang_pp_compile.py)."""
    from mla_backends.sparse import triton_kernel

    traced: list[bool] = []

    def attend(q_nope: torch.Tensor, *args: object) -> tuple[torch.Tensor, None]:
        traced.append(torch.compiler.is_compiling())
        return q_nope * 2, None

    monkeypatch.setattr(triton_kernel, "attend", attend)
    monkeypatch.setenv(dsa.ENV, choice)  # auto: its row limit chosen inside the trace
    dsa.register_hook()
    HookRegistry.apply_hooks()
    backend = object.__new__(DeepseekSparseAttnBackend)
    q_all, pool = torch.randn(2, 16, 48), torch.randn(8, 1, 48)
    idx = torch.zeros(2, 4, dtype=torch.int32)

    def layer(q: torch.Tensor) -> torch.Tensor:
        return backend._forward_flashmla_sparse(q + 1, pool, 32, idx, 0.1, None) - 1

    torch._dynamo.reset()
    got = torch.compile(layer, backend="aot_eager")(q_all)
    torch._dynamo.reset()
    torch.testing.assert_close(got, (q_all[..., :32] + 1) * 2 - 1)
    assert traced == [False], f"Dynamo traced our sparse call ({traced})"


def test_auto_wraps_sglangs_call(hooks: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """`MLAB_DSA_SPARSE=auto` wraps SGLang's method (HookType.AROUND): SGLang's own call
    still runs for calls above `auto_rows` query rows."""
    monkeypatch.setenv(dsa.ENV, "auto")
    assert dsa.register_hook() == "auto"
    assert [h[:2] for h in HookRegistry._hooks[dsa.TARGET]] == [(HookType.AROUND, dsa.auto_sparse)]


@pytest.mark.interp
def test_auto_takes_ours_up_to_its_row_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to `auto_rows` tokens x heads a call is ours (the same bits as `forward_sparse`),
    above it SGLang's own method gets every argument unchanged. Off an SM90 GPU the limit is
    the `tl.dot` kernel's (AUTO_ROWS), whatever the head count."""
    calls: list[tuple[object, ...]] = []

    def sglangs(*args: object) -> torch.Tensor:
        calls.append(args)
        return torch.full((1,), 7.0)

    gen = torch.Generator().manual_seed(0)
    lat, r, slots, k = 32, 16, 64, 8
    pool = torch.randn(slots, 1, lat + r, generator=gen).half()
    small = torch.randn(3, 16, lat + r, generator=gen).half()
    idx = torch.randperm(slots, generator=gen)[: 3 * k].view(3, k).to(torch.int32)
    got = dsa.auto_sparse(sglangs, None, small, pool, lat, idx, 0.1, None)
    assert not calls and torch.equal(got, dsa.forward_sparse(None, small, pool, lat, idx, 0.1))
    no_sm90 = dsa.auto_rows(torch.zeros(1, 64, 576).half(), torch.zeros(8, 1, 576).half(), 512)
    assert no_sm90 == dsa.AUTO_ROWS  # the Gluon kernel's limit needs an SM90
    t = dsa.AUTO_ROWS // 16 + 1  # one token past the limit at 16 heads
    large = torch.zeros(t, 16, lat + r).half()
    big_idx = torch.zeros(t, k, dtype=torch.int32)
    out = dsa.auto_sparse(sglangs, "self", large, pool, lat, big_idx, 0.1, None)
    assert out.item() == 7.0 and len(calls) == 1
    assert calls[0][0] == "self" and calls[0][1] is large and calls[0][2] is pool
    assert calls[0][4] is big_idx


def test_auto_limit_follows_the_kernel_the_call_will_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto_rows` gives the Gluon kernel's limit only where the call will take it: an SM90
    with the Gluon route open (faked here) and tensors the kernel takes (H a multiple of 64,
    bf16 / fp16 576-wide rows of q's dtype); the `tl.dot` kernel's limit for everything else."""
    pytest.importorskip("triton.experimental.gluon")
    from mla_backends.kernels import mla_attention
    from mla_backends.sparse import gluon_kernel

    monkeypatch.setattr(mla_attention, "gluon_route_open", lambda kv: True)
    monkeypatch.setattr(gluon_kernel, "on_sm90", lambda kv: True)
    pool = torch.zeros(64, 1, 576, dtype=torch.bfloat16)
    for h, want in ((64, dsa.AUTO_ROWS_GLUON), (128, dsa.AUTO_ROWS_GLUON), (16, dsa.AUTO_ROWS)):
        assert dsa.auto_rows(torch.zeros(2, h, 576).bfloat16(), pool, 512) == want, h
    q = torch.zeros(2, 64, 576)
    assert dsa.auto_rows(q.half(), pool.half(), 512) == dsa.AUTO_ROWS_GLUON
    assert dsa.auto_rows(q, pool.float(), 512) == dsa.AUTO_ROWS  # fp32: tl.dot only
    assert dsa.auto_rows(q.half(), pool, 512) == dsa.AUTO_ROWS  # pool in another dtype
    narrow = torch.zeros(64, 1, 320, dtype=torch.bfloat16)  # L 256: not the kernel's 512
    assert dsa.auto_rows(torch.zeros(2, 64, 320).bfloat16(), narrow, 256) == dsa.AUTO_ROWS


def test_auto_limit_is_inclusive_and_every_argument_passes_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Exactly `auto_rows` query rows is ours, one token more SGLang's; either call gets every
    argument as given, `topk_length` too (SGLang's own method may read it)."""
    got: list[tuple[object, ...]] = []
    monkeypatch.setattr(dsa, "forward_sparse", lambda *a: got.append(("ours", *a)))

    def sglangs(*args: object) -> None:
        got.append(("sglangs", *args))

    pool, lengths = torch.zeros(8, 1, 48).half(), torch.full((1,), 4, dtype=torch.int32)
    for t, who in ((dsa.AUTO_ROWS // 16, "ours"), (dsa.AUTO_ROWS // 16 + 1, "sglangs")):
        q, idx = torch.zeros(t, 16, 48).half(), torch.zeros(t, 4, dtype=torch.int32)
        dsa.auto_sparse(sglangs, "self", q, pool, 32, idx, 0.1, lengths)
        want = (who, "self", q, pool, 32, idx, 0.1, lengths)
        assert len(got[-1]) == len(want) and all(a is b for a, b in zip(got[-1], want)), t


def test_env_value_read_without_surrounding_space(
    hooks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value written with a trailing newline or spaces (a shell file) is still `auto`."""
    monkeypatch.setenv(dsa.ENV, " auto\n")
    assert dsa.register_hook() == "auto"
