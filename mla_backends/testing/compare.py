"""Comparisons with explicit per-dtype tolerances, and one parity case run against both
references (`run_case`):
- backend vs the absorbed reference on the *same* inputs (kernel precision alone), and
- backend out projected through w_vc vs the MHA-expanded oracle fed fp64 q_nope (end to end,
  so the rounding of q to the activation dtype counts too).
Both on out and LSE."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_backends.backends.base import MLABackend
from mla_backends.backends.paged_table import QueryQuantizer
from mla_backends.backends.protocol import AttentionBackend
from mla_backends.config import KV_DTYPES
from mla_backends.reference import absorb_q, batch_reference, project_v
from mla_backends.testing.cases import Case
from mla_backends.testing.pools import build_case, random_rows

# (out atol, out rtol, lse atol) per activation dtype: fp32 math on inputs rounded to it.
TOLERANCES: dict[str, tuple[float, float, float]] = {
    "float32": (2e-5, 2e-5, 2e-5),
    "float16": (4e-3, 4e-3, 4e-3),
    "bfloat16": (3e-2, 3e-2, 3e-2),
}


@dataclass
class Result:
    case: Case
    out_err: float  # max |out - expanded oracle| (after w_vc)
    lse_err: float
    latent_err: float  # max |out - absorbed reference| on the same inputs
    ok: bool
    detail: str = ""


def compare(
    name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float
) -> tuple[float, str]:
    """(max abs error, failure detail or ""). -inf must match -inf; NaN never passes."""
    got, want = got.double().cpu(), want.double().cpu()
    inf_g, inf_w = torch.isinf(got), torch.isinf(want)
    if not torch.equal(inf_g, inf_w) or not torch.equal(got[inf_g], want[inf_w]):
        return float("inf"), f"{name}: infinities differ"
    finite = ~inf_w
    diff = (got - want).abs().where(finite, torch.zeros((), dtype=torch.float64))
    if torch.isnan(got).any():
        return float("nan"), f"{name}: NaN at {torch.nonzero(torch.isnan(got))[0].tolist()}"
    bad = diff > atol + rtol * want.abs().where(finite, torch.zeros((), dtype=torch.float64))
    err = float(diff.max()) if diff.numel() else 0.0
    if bad.any():
        idx = torch.nonzero(bad)[0].tolist()
        return (
            err,
            f"{name}: worst {err:.3e} at {idx}: "
            f"got {got[tuple(idx)]:.6f} want {want[tuple(idx)]:.6f}",
        )
    return err, ""


_compare = compare  # the name mla_backends.sparse.testing imports


def effective_query(
    be: AttentionBackend, q_nope: torch.Tensor, q_rope: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The query the backend's kernel really attends with (FP8 q for TRT-LLM with an FP8 pool;
    q itself for every other backend)."""
    if isinstance(be, QueryQuantizer):
        return be.effective_query(q_nope, q_rope)
    return q_nope, q_rope


def run_case(case: Case, device: torch.device | str = "cpu") -> Result:
    """Run one batch through `case.backend` and compare it with both references."""
    device = torch.device(device)
    rt, batch = build_case(case, device)
    gen = torch.Generator().manual_seed(case.seed + 1)
    d, h, t = case.dims, case.num_heads, batch.num_tokens
    act = KV_DTYPES[case.dtype]
    q_nope = torch.randn(t, h, d.qk_nope_head_dim, generator=gen, dtype=torch.float64)
    q_rope = torch.randn(t, h, d.qk_rope_head_dim, generator=gen, dtype=torch.float64)
    w_kc = torch.randn(h, d.qk_nope_head_dim, d.kv_lora_rank, generator=gen, dtype=torch.float64)
    w_kc /= d.qk_nope_head_dim**0.5
    w_vc = torch.randn(h, d.kv_lora_rank, d.v_head_dim, generator=gen, dtype=torch.float64)
    w_vc /= d.kv_lora_rank**0.5
    q_latent = absorb_q(q_nope, w_kc).to(device, act)
    q_rope_in = q_rope.to(device, act)
    if case.joined_query:
        joined = torch.cat([q_latent, q_rope_in], dim=-1)
        q_latent, q_rope_in = joined[..., : d.kv_lora_rank], joined[..., d.kv_lora_rank :]
    k_nope, k_rope = random_rows(t, case, gen, device)

    be = rt.backend
    be.init_forward_metadata(batch)
    if isinstance(be, MLABackend) and not be.caps.lse:
        # a kernel without LSE (CUTLASS): out is checked, LSE cannot be
        out, lse = be.forward_absorbed(0, q_latent, q_rope_in, k_nope, k_rope, batch), None
    else:
        out, lse = be.forward_absorbed(0, q_latent, q_rope_in, k_nope, k_rope, batch, True)

    r2t = rt.req_pool.req_to_token
    scale = rt.config.model.softmax_scale
    # A kernel that takes q in FP8 (TRT-LLM, FP8 pool) is held to the absorbed reference on
    # the query it really used; absorbed equals expanded (tests/test_reference.py).
    q_eff = effective_query(be, q_latent, q_rope_in)
    ref_lat, ref_lat_lse = batch_reference(
        rt.kv_pool, 0, r2t, batch, *q_eff, w_kc, w_vc, scale, expanded=False
    )
    ref_out, ref_lse = batch_reference(rt.kv_pool, 0, r2t, batch, q_nope, q_rope, w_kc, w_vc, scale)
    atol, rtol, lse_tol = TOLERANCES[case.dtype]
    lat_err, d1 = compare("out(latent)", out, ref_lat, atol, rtol)
    if isinstance(be, QueryQuantizer) and be.quantizes_query:
        ref_out, ref_lse = project_v(ref_lat, w_vc.to(ref_lat.device)), ref_lat_lse
    out_v = project_v(out.double(), w_vc.to(out.device))
    out_err, d3 = compare("out(expanded)", out_v, ref_out, atol, rtol)
    lat_lse_err, d2, lse_err, d4 = 0.0, "", 0.0, ""
    if lse is not None:
        lat_lse_err, d2 = compare("lse(latent)", lse, ref_lat_lse, lse_tol, 0.0)
        lse_err, d4 = compare("lse(expanded)", lse, ref_lse, lse_tol, 0.0)
    detail = "; ".join(x for x in (d1, d2, d3, d4) if x)
    return Result(case, out_err, max(lse_err, lat_lse_err), lat_err, not detail, detail)
