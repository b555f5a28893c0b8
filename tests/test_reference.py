"""The references: absorbed equals MHA-expanded in fp64; conventions (scale, causal, empty rows)."""

from __future__ import annotations

import math

import pytest
import torch

from mla_backends.config import DEEPSEEK_V3, MLADims
from mla_backends.merge import merge_states
from mla_backends.reference import (
    absorb_q,
    absorbed,
    mha,
    mha_expanded,
    project_v,
    softmax_with_lse,
)


def _rand(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    finite = torch.isfinite(b)
    return float((a - b)[finite].norm() / b[finite].norm().clamp_min(1e-300))


@pytest.mark.parametrize("yarn", [False, True], ids=["plain", "yarn"])
@pytest.mark.parametrize("n,s", [(1, 1), (1, 37), (4, 37), (37, 37), (5, 0)], ids=lambda x: str(x))
@pytest.mark.parametrize("heads", [16, 128])
def test_absorbed_equals_expanded_fp64(n: int, s: int, heads: int, yarn: bool) -> None:
    """n < s: q_len > 1 over a cached prefix; n == s: no prefix; s == 0: empty row."""
    if s == 0:
        n = 0
    dims = DEEPSEEK_V3 if yarn else MLADims(rope_scaling_factor=1.0)
    gen = torch.Generator().manual_seed(n * 100 + s)
    p, r, lat, v = dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.kv_lora_rank, dims.v_head_dim
    q_nope, q_rope = _rand(gen, n, heads, p), _rand(gen, n, heads, r)
    latent, k_rope = _rand(gen, s, lat), _rand(gen, s, r)
    w_kc, w_vc = _rand(gen, heads, p, lat) / p**0.5, _rand(gen, heads, lat, v) / lat**0.5
    out_e, lse_e = mha_expanded(q_nope, q_rope, latent, k_rope, w_kc, w_vc, dims.softmax_scale)
    o_lat, lse_a = absorbed(absorb_q(q_nope, w_kc), q_rope, latent, k_rope, dims.softmax_scale)
    out_a = project_v(o_lat, w_vc)
    assert out_e.shape == (n, heads, v) and lse_e.shape == (n, heads)
    if n:
        assert _rel(out_a, out_e) < 1e-10
        assert _rel(lse_a, lse_e) < 1e-10


def test_deepseek_v3_softmax_scale_has_yarn_mscale_squared() -> None:
    mscale = 0.1 * 1.0 * math.log(40.0) + 1.0
    assert DEEPSEEK_V3.mscale == pytest.approx(mscale)
    assert DEEPSEEK_V3.softmax_scale == pytest.approx(192**-0.5 * mscale**2)
    assert DEEPSEEK_V3.softmax_scale != pytest.approx(576**-0.5)  # FlashMLA's default is wrong
    assert MLADims(rope_scaling_factor=1.0, mscale_all_dim=1.0).softmax_scale == 192**-0.5


def test_causal_is_bottom_right() -> None:
    """Query j of n sees s - n + j + 1 keys: the last query sees everything."""
    gen = torch.Generator().manual_seed(0)
    s, n, h = 9, 3, 2
    q, k, v = _rand(gen, n, h, 8), _rand(gen, s, h, 8), _rand(gen, s, h, 4)
    out, lse = mha(q, k, v, 0.3, causal=True)
    for j in range(n):
        o_j, l_j = mha(q[j : j + 1], k[: s - n + j + 1], v[: s - n + j + 1], 0.3, causal=False)
        torch.testing.assert_close(out[j : j + 1], o_j, rtol=0, atol=1e-12)
        torch.testing.assert_close(lse[j : j + 1], l_j, rtol=0, atol=1e-12)


def test_zero_length_rows_give_zero_and_neg_inf() -> None:
    q = torch.randn(3, 2, 8, dtype=torch.float64)
    out, lse = mha(q, torch.zeros(0, 2, 8), torch.zeros(0, 2, 4), 0.5, causal=False)
    assert torch.equal(out, torch.zeros(3, 2, 4, dtype=torch.float64))
    assert torch.isneginf(lse).all()


def test_merge_states_equals_full_attention_and_ignores_empty_side() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = _rand(gen, 4, 2, 8), _rand(gen, 10, 2, 8), _rand(gen, 10, 2, 4)
    full_o, full_lse = mha(q, k, v, 0.4, causal=False)
    o1, l1 = mha(q, k[:6], v[:6], 0.4, causal=False)
    o2, l2 = mha(q, k[6:], v[6:], 0.4, causal=False)
    o, lse = merge_states(o1, l1, o2, l2)
    torch.testing.assert_close(o, full_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, full_lse, rtol=1e-12, atol=1e-12)
    e_o, e_l = mha(q, k[:0], v[:0], 0.4, causal=False)
    o, lse = merge_states(e_o, e_l, full_o, full_lse)
    torch.testing.assert_close(o, full_o, rtol=0, atol=0)
    o, lse = merge_states(e_o, e_l, e_o, e_l)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()


def test_merge_states_refuses_mismatched_shapes() -> None:
    """An lse of [n, h, 1] once broadcast into a 4-D output; now every shape is checked."""
    from mla_backends.checks import ShapeError

    o, lse = torch.randn(2, 3, 4), torch.randn(2, 3)
    with pytest.raises(ShapeError, match=r"lse1: expected shape \[2, 3\], got \[2, 3, 1\]"):
        merge_states(o, lse[..., None], o, lse)
    with pytest.raises(ShapeError, match=r"o2: expected shape \[2, 3, 4\], got \[2, 3, 5\]"):
        merge_states(o, lse, torch.randn(2, 3, 5), lse)


def test_merge_states_refuses_mixed_dtypes() -> None:
    """o2 and lse2 must match o1's and lse1's dtypes (a bf16 partial merged with an fp32 one
    was cast silently to o1's dtype); mutants dropping either dtype check took them."""
    from mla_backends.checks import ShapeError

    o, lse = torch.randn(2, 3, 4), torch.randn(2, 3)
    with pytest.raises(ShapeError, match=r"o2: expected dtype in \['torch.float32'\]"):
        merge_states(o, lse, o.bfloat16(), lse)
    with pytest.raises(ShapeError, match=r"lse2: expected dtype in \['torch.float32'\]"):
        merge_states(o, lse, o, lse.double())


def test_check_tensor_refuses_what_is_not_a_tensor() -> None:
    """A list (or None) named as such in a ShapeError, not an AttributeError on `.dim()`."""
    from mla_backends.checks import ShapeError, check_tensor

    with pytest.raises(ShapeError, match="x: expected a torch.Tensor, got list"):
        check_tensor("x", [1.0, 2.0], (2,))  # type: ignore[arg-type]


def test_merge_two_empty_sides_gives_zero_whatever_finite_o_they_hold() -> None:
    """M01 (merge.py:22 nan=0.0 -> 1.0): both sides lse -inf must give out 0 / lse -inf even
    when the (finite) o of a side is not zero; the mutant returned o1."""
    o1 = torch.full((2, 3, 4), 0.5)
    o2 = torch.full((2, 3, 4), -0.25)
    ninf = torch.full((2, 3), float("-inf"))
    o, lse = merge_states(o1, ninf, o2, ninf.clone())
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    # and a lone empty side with garbage-but-finite o contributes nothing
    lse2 = torch.randn(2, 3)
    o, lse = merge_states(o1, ninf, o2, lse2)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


def test_merge_accumulates_in_fp32_for_low_precision_inputs() -> None:
    """M04 (merge.py:24 acc = o1.dtype): with bf16 o and bf16 lse the weighted sum must be
    formed in fp32 and rounded once (the mutant rounded products and sum in bf16)."""
    gen = torch.Generator().manual_seed(0)
    o1 = torch.randn(64, 8, 32, generator=gen).bfloat16()
    o2 = torch.randn(64, 8, 32, generator=gen).bfloat16()
    l1 = torch.randn(64, 8, generator=gen).bfloat16()
    l2 = torch.randn(64, 8, generator=gen).bfloat16()
    o, lse = merge_states(o1, l1, o2, l2)
    ref_lse = torch.logaddexp(l1, l2)
    w1 = torch.exp(l1 - ref_lse).float()[..., None]
    w2 = torch.exp(l2 - ref_lse).float()[..., None]
    want = (o1.float() * w1 + o2.float() * w2).bfloat16()
    assert o.dtype == torch.bfloat16
    assert torch.equal(o, want)


def test_check_tensor_refuses_a_tensor_on_another_device_type() -> None:
    """M11 (checks.py:_same_device `if a.type != b.type` skipped): a CPU tensor checked
    against another device type must be refused (the mutant took any CPU tensor)."""

    from mla_backends.checks import ShapeError, check_tensor

    with pytest.raises(ShapeError, match="expected device meta"):
        check_tensor("x", torch.zeros(2), (2,), None, torch.device("meta"))


def test_unit_stride_copies_a_view_whose_last_stride_is_not_one() -> None:
    """M12 (checks.py:247 `t.stride(-1) == 1` -> `>= 1`): a transposed view must come back
    with a unit last stride (the mutant passed it through: kernels read wrong addresses)."""
    from mla_backends.checks import unit_stride

    x = torch.arange(12.0).view(3, 4).t()  # [4, 3], strides (1, 4)
    y = unit_stride(x)
    assert y.stride(-1) == 1 and torch.equal(y, x)
    z = torch.arange(12.0).view(3, 4)
    assert unit_stride(z) is z  # already unit-stride: no copy


def test_softmax_with_lse_gives_zero_and_minus_inf_on_a_row_with_no_key() -> None:
    mask = torch.tensor([[True, False, True], [False, False, False]])
    probs, lse = softmax_with_lse(torch.randn(2, 3, dtype=torch.float64), mask)
    assert not probs.isnan().any() and probs[1].eq(0).all() and lse[1] == float("-inf")
    assert probs[0, 1] == 0 and math.isclose(float(probs[0].sum()), 1.0)
