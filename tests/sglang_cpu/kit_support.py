"""Driving SGLang's MLA attention test kit (sglang 0.5.17,
`sglang/test/kits/attention_unittest`), shared by tests/test_sglang_cpu.py and
scripts/sglang_kit.py. Import after `env.load_sglang()`.

The kit's reference reads the unquantized K. For FP8 KV it is therefore compared here with
`kit_reference(..., kv_round=to_e4m3)`: the kit's own reference arithmetic with K rounded the way
SGLang's writer stores it (a cast to float8_e4m3fn, no scale), at the kit's default tolerance.
The replica is checked against the kit's function on every unquantized run (`replica_matches`).
"""

from __future__ import annotations

import unittest
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.test.kits.attention_unittest.attention_methods import mla_attention as kit

Case = kit.MLAAttentionCase
DSV3 = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}


class KitTestCase(unittest.TestCase):
    """The kit only needs `testcase.skipTest`."""

    def runTest(self) -> None:  # pragma: no cover - never run
        pass


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """What SGLang's MLA pool stores for an FP8 cache and reads back: a plain cast."""
    return x.to(torch.float8_e4m3fn).to(x.dtype)


def kit_reference(
    module: Any,
    case: Any,
    prefix_hidden: list[torch.Tensor],
    input_hidden: torch.Tensor,
    kv_round: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The kit's `_mla_attention_reference` (mla_attention.py:720-756) with the cached K
    (latent and rope) passed through `kv_round`."""
    rnd = kv_round or (lambda x: x)
    dtype = input_hidden.dtype
    q, k, q_rope, k_rope = module.project_latent_qk(input_hidden)
    k, k_rope = rnd(k), rnd(k_rope)
    outputs, start = [], 0
    for req, prefix in enumerate(prefix_hidden):
        n = case.input_lens[req]
        _, pk, _, pk_rope = module.project_latent_qk(prefix)
        req_k = torch.cat([rnd(pk), k[start : start + n]], dim=0).squeeze(1)
        req_k_rope = torch.cat([rnd(pk_rope), k_rope[start : start + n]], dim=0).squeeze(1)
        for j in range(n):
            pos = case.prefix_lens[req] + j
            keys = req_k[: pos + 1].movedim(0, 1).float()
            scores = torch.einsum("hd,dk->hk", q[start + j].float(), keys) * module.scaling
            if module.qk_rope_head_dim:
                kr = req_k_rope[: pos + 1].movedim(0, 1).float()
                scores = scores + torch.einsum("hd,dk->hk", q_rope[start + j].float(), kr) * (
                    module.scaling
                )
            probs = torch.softmax(scores, dim=-1)
            outputs.append(torch.einsum("hk,kd->hd", probs, req_k[: pos + 1].float()))
        start += n
    return module.reconstruct_output(torch.stack(outputs, dim=0).to(dtype))


def kit_outputs(case: Any, *, fp8: bool = False, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(actual, expected) for one eager kit case, the way the kit builds and runs it.

    DECODE / EXTEND: `build_mla_attention_fixture` + `run_mla_fixture_eager`, expected from the
    kit's reference (with the replica checked against it), or for FP8 KV from `kit_reference`
    with K rounded to e4m3. TARGET_VERIFY: the kit's eagle-verify preparation (seq_lens
    without the drafts, chain spec info, topk 1) and its custom-mask reference."""
    tc = KitTestCase()
    verify = case.forward_mode.is_target_verify()
    if fp8 and verify:
        raise ValueError("the kit's verify runner has no FP8 mode")
    fixture = kit.build_mla_attention_fixture(tc, case, fp8_kv_cache=fp8, **kw)
    inputs = (fixture.reference_module, case, fixture.prefix_hidden, fixture.input_hidden)
    if verify:
        from sglang.test.kits.attention_unittest.runner_modes import (
            speculative_target_verify_runner as tv,
        )

        dev = kw.get("device", kit.DEFAULT_DEVICE)
        tv._prepare_target_verify_batch(fixture.forward_batch, case, dev)
        masks, _ = tv._make_custom_masks(case, topk=1, device=dev)
        fixture.forward_batch.spec_info = tv._make_spec_verify_input(
            case, fixture.forward_batch, topk=1, device=dev, spec_kind="eagle"
        )
        expected = kit.mla_attention_reference_with_custom_mask(*inputs, masks)
    actual = kit.run_mla_fixture_eager(fixture)
    with torch.no_grad():
        if verify:
            pass
        elif fp8:
            expected = kit_reference(*inputs, kv_round=to_e4m3)
        else:
            expected = kit.expected_mla_fixture_output(fixture)
            if not torch.equal(kit_reference(*inputs), expected):
                raise AssertionError("kit_reference no longer matches the kit's reference")
    return actual, expected


def run_case(
    case: Any,
    *,
    fp8: bool = False,
    atol: float = kit.MLA_ATOL,
    rtol: float = kit.MLA_RTOL,
    **kw: Any,
) -> float:
    """One eager kit case at the kit's tolerance; returns max |actual - expected|."""
    actual, expected = kit_outputs(case, fp8=fp8, **kw)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    return float((actual.float() - expected.float()).abs().max())


def decode_case(name: str, backend: str, heads: int, page: int, prefix: tuple[int, ...]) -> Any:
    return Case(
        name=name,
        backend=backend,
        forward_mode=ForwardMode.DECODE,
        num_heads=heads,
        page_size=page,
        prefix_lens=prefix,
    )


def extend_case(
    name: str,
    backend: str,
    heads: int,
    page: int,
    prefix: tuple[int, ...],
    extend: tuple[int, ...],
) -> Any:
    return Case(
        name=name,
        backend=backend,
        forward_mode=ForwardMode.EXTEND,
        num_heads=heads,
        page_size=page,
        prefix_lens=prefix,
        extend_lens=extend,
    )


def verify_case(
    name: str, backend: str, heads: int, page: int, prefix: tuple[int, ...], q_len: int
) -> Any:
    return Case(
        name=name,
        backend=backend,
        forward_mode=ForwardMode.TARGET_VERIFY,
        num_heads=heads,
        page_size=page,
        prefix_lens=prefix,
        extend_lens=(q_len,) * len(prefix),
    )


def page_edge_cases(backend: str, heads: int, page: int) -> list[Any]:
    """The kit's own case shapes (make_mla_cases: prefixes just below, at and past a page
    edge, ragged extends with and without a prefix, batch-1 decode) at page size `page`, plus
    a chain verify of 3 draft tokens. Lengths stay within 2 * page + 8 tokens."""
    p, low = page, max(page - 1, 1)
    return [
        decode_case(f"decode_p{p}_h{heads}", backend, heads, p, (low, p, p + 1, 2 * p + 3)),
        decode_case(f"decode_bs1_p{p}_h{heads}", backend, heads, p, (7,)),
        extend_case(
            f"extend_p{p}_h{heads}", backend, heads, p, (0, p // 2, p, low), (low, 8, 1, 2)
        ),
        extend_case(f"extend_noprefix_p{p}_h{heads}", backend, heads, p, (0, 0), (p, p + 1)),
        verify_case(f"verify_p{p}_h{heads}", backend, heads, p, (low, p, 2 * p + 1), 3),
    ]


def max_context(page: int) -> int:
    """A kit max_context_len that holds page_edge_cases and is a whole number of pages."""
    need = 2 * page + 8
    return -(-need // page) * page


class KitCorruptedPool(AssertionError):
    """SGLang's kit overwrote cached prefix rows before the backend ran (not a backend error)."""


def run_verify_cuda_graph(case: Any, **kw: Any) -> None:
    """The kit's eagle-verify CUDA-graph mode (topk 1), on the kit's contiguous page layout.

    Hazard (kit bug, sglang 0.5.17): that mode's first leg runs the fixture's batch, whose
    request table uses the default `shuffled_pages` layout (each request's pages permuted),
    after `prepare_mla_runner_inputs` re-wrote every prefix at the contiguous layout: for a
    request of more than one page those writes land on its other positions' rows, so any
    backend then reads corrupted prefixes. The fixture is therefore built with
    `loc_layout="contiguous"` here (the eager cases keep the shuffled layout), and a guard
    checks before every forward that each request's cached prefix rows are its own, raising
    KitCorruptedPool (not a backend mismatch) if the kit corrupted them anyway."""
    import functools

    from sglang.test.kits.attention_unittest.runner_modes import (
        speculative_target_verify_runner as tv,
    )

    forward, build = tv.run_mla_forward, tv.build_mla_attention_fixture

    def guarded(fixture: Any, batch: Any, inputs: dict[str, Any]) -> torch.Tensor:
        buf = fixture.runner.token_to_kv_pool.get_key_buffer(0)
        r2t = fixture.runner.req_to_token_pool.req_to_token
        for r, prefix in enumerate(inputs["prefix_hidden"]):
            _, k, _, _ = fixture.actual_module.forward_absorb_prepare(prefix)
            rows = buf[r2t[r, : prefix.shape[0]].long(), 0, : k.shape[-1]].to(k.dtype)
            if not torch.equal(rows, k[:, 0].to(buf.dtype).to(k.dtype)):
                raise KitCorruptedPool(
                    f"{case.name}: the kit overwrote request {r}'s prefix rows before the "
                    "forward (see run_verify_cuda_graph)"
                )
        return forward(fixture, batch, inputs)

    tv.run_mla_forward = guarded
    tv.build_mla_attention_fixture = functools.partial(build, loc_layout="contiguous")
    try:
        tv.run_mla_eagle_verify_cuda_graph_case(KitTestCase(), case, topk=1, **kw)
    finally:
        tv.run_mla_forward, tv.build_mla_attention_fixture = forward, build


def use_torch_kv_writer() -> Callable[[], None]:
    """CPU only: replace SGLang's `MLATokenToKVPool.set_mla_kv_buffer` with the same row
    scatter in torch; returns the undo. SGLang's writer is a Triton kernel (CUDA only), and
    under the Triton interpreter of triton >= 3.7 it fails ("mask has unsupported dtype");
    the kit writes every prefix row through it. Semantics kept: cast to the pool dtype, no
    scale, bytes stored in the pool's storage dtype."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    original = MLATokenToKVPool.set_mla_kv_buffer

    def set_mla_kv_buffer(
        self: Any, layer: Any, loc: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor
    ) -> None:
        row = torch.cat([k_nope, k_rope], dim=-1).to(self.dtype)
        buf = self.kv_buffer[layer.layer_id - self.start_layer]
        buf[loc.long()] = row.view(self.store_dtype) if self.store_dtype != self.dtype else row

    MLATokenToKVPool.set_mla_kv_buffer = set_mla_kv_buffer

    def undo() -> None:
        MLATokenToKVPool.set_mla_kv_buffer = original

    return undo
