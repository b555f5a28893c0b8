#!/usr/bin/env python3
"""The SGLang plug-in on a GPU host, with SGLang 0.5.17's own MLA attention test kit.

Set-up on the GPU host (offline bundles, see ../shared/sglang/README.md):
    source .gpu/activate.sh; source .sgl/activate.sh
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .
    python3 scripts/sglang_kit.py MODE OUT [options]

Backends are found the way SGLang finds them: `load_plugins()` through the installed
`sglang.srt.plugins` entry point (never `register()` by hand). Each mode fits one 10-minute
call (`--budget`, default 540 s: cases it cannot start in time are recorded as SKIP). Every
case prints `RESULT <mode> <name> PASS|FAIL|SKIP <seconds> <detail>`; the rows go to
OUT/<mode>[-<backend>][-p<pages>].json (rewritten after each one), the output to the .log of
that name (bench also writes a markdown table, .md).

Modes:
  entry    entry point and registration, CLI parsing, wrong settings refused with our reason
           at start-up (ServerArgs.check_server_args) and in the factory (never a kit skip):
           page 16 on mlab_flashmla, FP8 on mlab_flashmla, SM100-only backends on this GPU.
  kit      one backend (--backend): DeepSeek shapes (kv_lora_rank 512, rope 64), the page
           sizes it takes (probed through the factory, or --pages), H 16 / 128 (--heads),
           bf16 and FP8 KV where it takes FP8; the kit's eager cases, its CUDA-graph decode
           mode and its eagle-verify (chain) eager and CUDA-graph modes.
  compare  the same kit cases and inputs through ours and SGLang's counterpart (mlab_flashmla
           / flashmla, mlab_flashinfer / flashinfer, mlab_triton / triton): max differences.
  bench    decode batch 64, kv 4096, H 16 and 128, page 64: each backend called the way
           DeepSeek calls it (absorbed, KV stored by the backend) under a CUDA graph;
           replay time and per-step time (metadata + replay); JSON + markdown table.
  tests    pytest tests/test_sglang_graph.py tests/test_sglang_cpu.py: our adapter under a real
           torch.cuda.CUDAGraph (capture, padded replays) against the MHA-expanded oracle, both
           DeepSeek call shapes and MHA / chunked-prefix LSE on the GPU backends, and the CPU
           tests (registration, refusals, conversion) on this host.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import traceback
import unittest
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from mla_backends.arith import round_up

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

PAGE_SIZES = (1, 16, 32, 64, 128)
PAIRS = {"mlab_flashmla": "flashmla", "mlab_flashinfer": "flashinfer", "mlab_triton": "triton"}
EXTRA_PAIRS = {"mlab_torch": "torch_native"}  # only with --backend mlab_torch
TINY_DSV3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": 256,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
}


class Recorder:
    """RESULT lines on stdout and in OUT/<stem>.log; rows in OUT/<stem>.json after each."""

    def __init__(self, mode: str, out: Path, budget: float, stem: str | None = None) -> None:
        self.mode, self.out, self.stem = mode, out, stem or mode
        self.deadline = time.time() + budget
        self.rows: list[dict[str, Any]] = []
        self.log = open(out / f"{self.stem}.log", "a")  # noqa: SIM115 - closed at exit

    def say(self, *a: Any) -> None:
        line = " ".join(str(x) for x in a)
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def record(self, name: str, status: str, t0: float | None, detail: str = "", **m: Any) -> None:
        dt = time.time() - t0 if t0 is not None else 0.0
        self.rows.append(
            {"name": name, "status": status, "seconds": round(dt, 2), "detail": detail, **m}
        )
        self.say(f"RESULT {self.mode:8s} {name:48s} {status:4s} {dt:6.1f}s {detail}".rstrip())
        (self.out / f"{self.stem}.json").write_text(json.dumps(self.rows, indent=1))

    def run(self, name: str, fn: Callable[[], Any], min_left: float = 10.0) -> Any:
        """Run one case: PASS (returns its value), FAIL (any exception, traceback in the log),
        or SKIP (the kit's skipTest, or no time left)."""
        if time.time() > self.deadline - min_left:
            self.record(name, "SKIP", None, "no time left in --budget")
            return None
        t0 = time.time()
        try:
            ret = fn()
        except unittest.SkipTest as e:
            self.record(name, "SKIP", t0, f"kit skipTest: {e}")
            return None
        except Exception as e:  # noqa: BLE001 - a failed case is a result
            self.record(name, "FAIL", t0, " ".join(f"{type(e).__name__}: {e}".split())[:400])
            self.log.write(traceback.format_exc())
            return None
        metrics = ret if isinstance(ret, dict) else {}
        detail = metrics.pop("detail", "") if metrics else ("" if ret is None else str(ret))
        self.record(name, "PASS", t0, str(detail)[:400], **metrics)
        return ret if ret is not None else True

    def summary(self) -> int:
        n = {s: sum(r["status"] == s for r in self.rows) for s in ("PASS", "FAIL", "SKIP")}
        self.say(f"{self.mode}: {n['PASS']} passed, {n['FAIL']} failed, {n['SKIP']} skipped")
        return 1 if n["FAIL"] else 0


# ---------------------------------------------------------------------------------- set-up
def load(rec: Recorder) -> None:
    """Import SGLang (the bundle's transformers shim first, if present) and load plugins
    through the entry points, as every SGLang process does."""
    try:
        import sglprobe_compat  # noqa: F401 - the .sgl bundle's shim, before `import sglang`
    except ImportError:
        pass
    from sglang_cpu.env import load_sglang

    sgl = load_sglang()
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="sglang.srt.plugins")}
    rec.say(f"ENV sglang {sgl.__version__}; entry points sglang.srt.plugins: {eps}")
    if eps.get("mla_backends") != "mla_backends.integrations.sglang:register":
        raise SystemExit(
            "mla-backends' entry point is not installed: python3 -m pip install -q --no-deps "
            "--no-build-isolation --no-index -e ."
        )
    from sglang.srt.plugins import load_plugins

    load_plugins()


def env_lines(rec: Recorder) -> None:
    rec.say(
        f"ENV python {sys.version.split()[0]} torch {torch.__version__} cuda {torch.version.cuda}"
    )
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        rec.say(f"ENV gpu {torch.cuda.get_device_name()} sm_{cap[0]}{cap[1]}")
    for mod in ("triton", "flashinfer", "sgl_kernel", "transformers"):
        try:
            m = __import__(mod)
            rec.say(f"ENV {mod} {getattr(m, '__version__', '?')}")
        except Exception as e:  # noqa: BLE001
            rec.say(f"ENV {mod} not importable: {type(e).__name__}: {e}")


def kit_kwargs(page: int, device: str) -> dict[str, Any]:
    from sglang_cpu import kit_support as ks

    return {
        **ks.DSV3,
        "hidden_size": 1024,
        "max_context_len": ks.max_context(page),
        "dtype": torch.bfloat16,
        "device": device,
    }


def factory_reason(backend: str, page: int, fp8: bool, device: str) -> str | None:
    """None if SGLang's factory builds `backend` for these settings, else our reason."""
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as kit
    from sglang_cpu import kit_support as ks

    from mla_backends.integrations.sglang.binding import SettingsError

    case = ks.decode_case("probe", backend, 16, page, (page + 1,))
    try:
        kit.build_mla_attention_fixture(
            ks.KitTestCase(), case, fp8_kv_cache=fp8, **kit_kwargs(page, device)
        )
    except SettingsError as e:
        return str(e)
    return None


# ---------------------------------------------------------------------------------- entry
REFUSALS = [
    # name, server args, pattern of our reason
    ("flashmla-page16", {"attention_backend": "mlab_flashmla", "page_size": 16}, r"--page-size 64"),
    (
        "flashmla-fp8",
        {"attention_backend": "mlab_flashmla", "page_size": 64, "kv_cache_dtype": "fp8_e4m3"},
        r"flashmla needs kv_dtype in",
    ),
    (
        "cutlass-on-this-gpu",
        {"attention_backend": "mlab_cutlass", "page_size": 128},
        r"needs (a CUDA GPU with )?SM 100",
    ),
    (
        "trtllm-on-this-gpu",
        {"attention_backend": "mlab_trtllm", "page_size": 64},
        r"needs (a CUDA GPU with )?SM 100",
    ),
    (
        "split-decode-flashmla-page16",
        {
            "prefill_attention_backend": "mlab_triton",
            "decode_attention_backend": "mlab_flashmla",
            "page_size": 16,
        },
        r"mlab_flashmla: .*--page-size 64",
    ),
]


def mode_entry(rec: Recorder, args: argparse.Namespace) -> None:
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, ServerArgs

    import mla_backends.integrations.sglang as plugin
    from mla_backends.integrations.sglang.binding import SettingsError

    names = list(plugin.sglang_names())

    def registered() -> str:
        missing = [
            n for n in names if n not in ATTENTION_BACKENDS or n not in ATTENTION_BACKEND_CHOICES
        ]
        if missing:
            raise AssertionError(f"not registered by load_plugins(): {missing}")
        try:
            from sglang.srt.models.deepseek_common.utils import (
                FORWARD_ABSORB_CORE_ATTENTION_BACKENDS as absorb,
            )

            routing = all(n in absorb for n in names)
        except ImportError as e:
            routing = f"DeepSeek modules not importable here ({e})"
        return f"{names}; DeepSeek split-absorbed routing: {routing}"

    rec.run("registered through the entry point", registered)

    def cli() -> str:
        p = argparse.ArgumentParser()
        ServerArgs.add_cli_args(p)
        for flags in (
            ["--attention-backend", "mlab_triton"],
            [
                "--prefill-attention-backend",
                "mlab_triton",
                "--decode-attention-backend",
                "mlab_flashmla",
            ],
        ):
            p.parse_args(["--model-path", "m", *flags])
        return "argparse accepts our names"

    rec.run("CLI accepts --attention-backend mlab_*", cli)
    model = args.out / "dsv3tiny"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(TINY_DSV3))
    for name, kw, pattern in REFUSALS:

        def start_up(kw: dict[str, Any] = kw, pattern: str = pattern) -> str:
            sa = ServerArgs(model_path=str(model), device=args.device, **kw)
            try:
                sa.check_server_args()
            except SettingsError as e:
                if not re.search(pattern, str(e)):
                    raise AssertionError(f"refused, but not with /{pattern}/: {e}") from e
                return str(e)
            raise AssertionError("accepted")

        rec.run(f"start-up refuses {name}", start_up)
        if "attention_backend" not in kw:
            continue

        def factory(kw: dict[str, Any] = kw, pattern: str = pattern) -> str:
            fp8 = kw.get("kv_cache_dtype") == "fp8_e4m3"
            reason = factory_reason(kw["attention_backend"], kw["page_size"], fp8, args.device)
            if reason is None:
                raise AssertionError("the factory built it")
            if not re.search(pattern, reason):
                raise AssertionError(f"refused, but not with /{pattern}/: {reason}")
            return reason

        rec.run(f"factory refuses {name}", factory)

    def accepted() -> str:
        ServerArgs(
            model_path=str(model), device=args.device, attention_backend="mlab_triton", page_size=64
        ).check_server_args()
        reason = factory_reason("mlab_triton", 64, False, args.device)
        if reason is not None:
            raise AssertionError(reason)
        return "start-up check and factory accept mlab_triton page 64"

    rec.run("mlab_triton page 64 accepted", accepted)


# ---------------------------------------------------------------------------------- kit
def probe(
    rec: Recorder, backend: str, device: str, pages: list[int] | None
) -> tuple[list[int], bool]:
    """Page sizes (and FP8) the factory accepts for `backend` here; refusals are logged with
    our reason."""
    ok = []
    for p in pages or PAGE_SIZES:
        reason = factory_reason(backend, p, False, device)
        if reason is None:
            ok.append(p)
        else:
            rec.say(f"INFO {backend} page {p}: refused: {reason}")
    fp8 = False
    if ok:
        reason = factory_reason(backend, ok[-1], True, device)
        fp8 = reason is None
        if reason:
            rec.say(f"INFO {backend} FP8 KV: refused: {reason}")
    rec.say(f"INFO {backend}: page sizes {ok}, FP8 {fp8}")
    return ok, fp8


def mode_kit(rec: Recorder, args: argparse.Namespace) -> None:
    from sglang.test.kits.attention_unittest.runner_modes import cuda_graph_decode_runner as cg
    from sglang_cpu import kit_support as ks

    be = args.backend
    pages, fp8_ok = probe(rec, be, args.device, args.pages)
    if not pages:
        rec.record(
            f"{be} runs here",
            "FAIL" if be in ("mlab_triton", "mlab_flashmla", "mlab_flashinfer") else "SKIP",
            None,
            "no page size accepted (reasons above)",
        )
        return
    for h in args.heads:
        for p in pages:
            kw = kit_kwargs(p, args.device)
            for case in ks.page_edge_cases(be, h, p):
                for fp8 in (False, True) if fp8_ok else (False,):
                    if fp8 and case.forward_mode.is_target_verify():
                        continue
                    tag = "fp8" if fp8 else "bf16"

                    def one(
                        case: Any = case, fp8: bool = fp8, kw: dict[str, Any] = kw
                    ) -> dict[str, Any]:
                        err = ks.run_case(case, fp8=fp8, **kw)
                        return {"detail": f"max |actual - expected| {err:.4g}", "max_err": err}

                    rec.run(f"{case.name} {tag}", one)
            dec = ks.decode_case(f"cg_p{p}_h{h}", be, h, p, (max(p - 1, 1), p, p + 1))
            rec.run(
                f"cuda-graph decode p{p} h{h}",
                lambda dec=dec, kw=kw: cg.run_mla_cuda_graph_decode_case(
                    ks.KitTestCase(), dec, **kw
                ),
            )

            def verify_graph(h: int = h, p: int = p, kw: dict[str, Any] = kw) -> None:
                prefix = (max(p - 1, 1), p, 2 * p + 1)
                ks.run_verify_cuda_graph(
                    ks.verify_case(f"vcg_p{p}_h{h}", be, h, p, prefix, 3), **kw
                )

            rec.run(f"cuda-graph eagle verify p{p} h{h}", verify_graph)
    if be == "mlab_torch":
        from sglang.test.kits.attention_unittest.attention_methods import mla_attention as kit

        for case in kit.make_mla_cases(be):
            rec.run(f"default {case.name}", lambda case=case: ks.run_case(case, device=args.device))


# ---------------------------------------------------------------------------------- compare
def mode_compare(rec: Recorder, args: argparse.Namespace) -> None:
    import dataclasses

    from sglang_cpu import kit_support as ks

    pairs = {args.backend: {**PAIRS, **EXTRA_PAIRS}[args.backend]} if args.backend else PAIRS
    for ours, theirs in pairs.items():
        pages = args.pages or ([64] if ours == "mlab_flashmla" else [1, 16, 64])
        for h in args.heads:
            for p in pages:
                kw = kit_kwargs(p, args.device)
                fp8_reason = factory_reason(ours, p, True, args.device)
                if fp8_reason:
                    rec.say(f"INFO {ours} page {p} FP8 KV: refused: {fp8_reason}")
                for case in ks.page_edge_cases(ours, h, p):
                    for fp8 in (False, True) if fp8_reason is None else (False,):
                        if fp8 and case.forward_mode.is_target_verify():
                            continue

                        def one(
                            case: Any = case, fp8: bool = fp8, kw: dict[str, Any] = kw
                        ) -> dict[str, Any]:
                            a, ref = ks.kit_outputs(case, fp8=fp8, **kw)
                            b, ref2 = ks.kit_outputs(
                                dataclasses.replace(case, backend=theirs), fp8=fp8, **kw
                            )
                            if not torch.equal(ref, ref2):
                                raise AssertionError("the two runs did not get the same inputs")
                            d = {
                                "ours_vs_theirs": float((a.float() - b.float()).abs().max()),
                                "ours_vs_ref": float((a.float() - ref.float()).abs().max()),
                                "theirs_vs_ref": float((b.float() - ref.float()).abs().max()),
                            }
                            detail = " ".join(f"{k} {v:.4g}" for k, v in d.items())
                            # the kit's bound; a failure names all three differences, so a
                            # disagreement says which side left the kit's reference
                            for x, y, what in ((a, ref, "ours vs ref"), (a, b, "ours vs theirs")):
                                if not torch.allclose(x.float(), y.float(), atol=3e-2, rtol=3e-2):
                                    raise AssertionError(f"{what} out of 3e-2 + 3e-2|x|: {detail}")
                            return {"detail": detail, "ours": ours, "theirs": theirs, **d}

                        rec.run(f"{ours}~{theirs} {case.name} {'fp8' if fp8 else 'bf16'}", one)


# ---------------------------------------------------------------------------------- bench
def bench_one(
    name: str, heads: int, batch: int, kv: int, page: int, iters: int, device: str
) -> tuple[dict[str, float], torch.Tensor]:
    """One backend, DeepSeek's absorbed call for `name`, captured in a CUDA graph at `batch`."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as kit
    from sglang_cpu import kit_support as ks

    try:
        from sglang.srt.models.deepseek_common.utils import (
            FORWARD_ABSORB_CORE_ATTENTION_BACKENDS as absorb,
        )
    except ImportError:  # the bundle may not carry the DeepSeek modules: 0.5.17's list
        absorb = ["fa3", "fa4", "dsa", "nsa", "flashinfer", "cutlass_mla", "trtllm_mla"]
        absorb += ["cutedsl_mla", "tokenspeed_mla", "ascend", "intel_xpu"]
        absorb += [n for n in ATTENTION_BACKENDS if n.startswith("mlab_")]
    lat, r = 512, 64
    max_ctx = round_up(kv + 1, page)
    mc = kit.TinyMLAModelConfig(
        num_heads=heads, kv_lora_rank=lat, qk_rope_head_dim=r, hidden_size=1024, context_len=max_ctx
    )
    case = ks.decode_case("bench", name, heads, page, (kv - 1,) * batch)
    runner = kit.MockMLAModelRunner(
        case=case,
        model_config=mc,
        dtype=torch.bfloat16,
        device=device,
        max_context_len=max_ctx,
        kv_lora_rank=lat,
        qk_rope_head_dim=r,
        disable_cuda_graph=False,
        runner_batch_size=batch,
    )
    backend = ATTENTION_BACKENDS[name](runner)
    gen = torch.Generator().manual_seed(0)
    pool = runner.token_to_kv_pool
    rows_needed = page + batch * max_ctx
    pool.kv_buffer[0][:rows_needed].copy_(
        torch.randn(rows_needed, 1, lat + r, generator=gen).bfloat16()
    )
    r2t = runner.req_to_token_pool.req_to_token
    slots = page + torch.arange(batch)[:, None] * max_ctx + torch.arange(kv)[None, :]
    r2t[:batch, :kv] = slots.to(device, torch.int32)
    dev = torch.device(device)
    i64 = {"dtype": torch.int64, "device": dev}
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=batch,
        input_ids=torch.zeros(batch, **i64),
        req_pool_indices=torch.arange(batch, **i64),
        seq_lens=torch.full((batch,), kv, **i64),
        seq_lens_cpu=torch.full((batch,), kv, dtype=torch.int64),
        out_cache_loc=slots[:, -1].to(dev),
        seq_lens_sum=batch * kv,
        positions=torch.full((batch,), kv - 1, **i64),
    )
    q_nope_ht = torch.randn(heads, batch, lat, generator=gen).bfloat16().to(dev)
    q_pe = torch.randn(batch, heads, r, generator=gen).bfloat16().to(dev)
    k_nope = torch.randn(batch, 1, lat, generator=gen).bfloat16().to(dev)
    k_pe = torch.randn(batch, 1, r, generator=gen).bfloat16().to(dev)
    layer = RadixAttention(
        heads, lat + r, (lat + r) ** -0.5, num_kv_heads=1, layer_id=0, v_head_dim=lat
    )

    def step() -> torch.Tensor:
        backend.init_forward_metadata_in_graph(fb)
        q_nope_out = q_nope_ht.transpose(0, 1)  # DeepSeek's bmm result, [T, H, L] strided
        if name in absorb:
            return layer(q_nope_out, k_nope, k_nope, fb, q_rope=q_pe, k_rope=k_pe)
        q = torch.cat([q_nope_out, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe], dim=-1)
        return layer(q, k, k_nope, fb)

    view = SimpleNamespace(
        batch_size=batch,
        forward_mode=ForwardMode.DECODE,
        actual_forward_mode=ForwardMode.DECODE,
        input_ids=fb.input_ids,
        positions=fb.positions,
        req_pool_indices=fb.req_pool_indices,
        seq_lens=fb.seq_lens,
        seq_lens_sum=fb.seq_lens_sum,
        seq_lens_cpu=fb.seq_lens_cpu,
        num_padding=0,
        encoder_lens=None,
        extend_seq_lens=None,
        out_cache_loc=fb.out_cache_loc,
        spec_info=None,
    )
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        backend.init_cuda_graph_state(batch, batch)
        backend.init_forward_metadata_out_graph(fb, in_capture=True)
        if dev.type != "cuda":  # CPU smoke run of the plumbing: no graph, no timing claim
            backend.init_forward_metadata_out_graph(view)
            out = step()
            return {"replay_us": float("nan"), "step_us": float("nan")}, out.float().reshape(
                batch, heads, lat
            )
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        backend.on_after_cuda_graph_warmup()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = step()
        for _ in range(10):
            backend.init_forward_metadata_out_graph(view)
            g.replay()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(iters):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        replay_us = e0.elapsed_time(e1) * 1e3 / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            backend.init_forward_metadata_out_graph(view)
            g.replay()
        torch.cuda.synchronize()
        step_us = (time.perf_counter() - t0) * 1e6 / iters
        result = out.detach().float().reshape(batch, heads, lat).clone()
    return {"replay_us": replay_us, "step_us": step_us}, result


def mode_bench(rec: Recorder, args: argparse.Namespace) -> None:
    rows = []
    pairs = {args.backend: {**PAIRS, **EXTRA_PAIRS}[args.backend]} if args.backend else PAIRS
    for h in args.heads:
        for ours, theirs in pairs.items():

            def one(ours: str = ours, theirs: str = theirs, h: int = h) -> dict[str, Any]:
                a, out_a = bench_one(ours, h, args.batch, args.kv, 64, args.iters, args.device)
                b, out_b = bench_one(theirs, h, args.batch, args.kv, 64, args.iters, args.device)
                diff = float((out_a - out_b).abs().max())
                row = {
                    "heads": h,
                    "batch": args.batch,
                    "kv": args.kv,
                    "page": 64,
                    "ours": ours,
                    "theirs": theirs,
                    "ours_replay_us": a["replay_us"],
                    "theirs_replay_us": b["replay_us"],
                    "ours_step_us": a["step_us"],
                    "theirs_step_us": b["step_us"],
                    "replay_ratio": b["replay_us"] / a["replay_us"],
                    "step_ratio": b["step_us"] / a["step_us"],
                    "max_abs_diff": diff,
                }
                rows.append(row)
                return {
                    "detail": f"replay {a['replay_us']:.1f} vs {b['replay_us']:.1f} us "
                    f"(theirs/ours {row['replay_ratio']:.3f}); step {a['step_us']:.1f} vs "
                    f"{b['step_us']:.1f} us ({row['step_ratio']:.3f}); max|diff| {diff:.3g}",
                    **row,
                }

            rec.run(f"bench {ours}~{theirs} h{h}", one, min_left=60)
    table = [
        "| H | ours | SGLang's | ours replay (us) | theirs replay (us) | theirs / ours | "
        "ours step (us) | theirs step (us) | theirs / ours | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        table.append(
            f"| {r['heads']} | {r['ours']} | {r['theirs']} | {r['ours_replay_us']:.1f} | "
            f"{r['theirs_replay_us']:.1f} | {r['replay_ratio']:.3f} | {r['ours_step_us']:.1f} | "
            f"{r['theirs_step_us']:.1f} | {r['step_ratio']:.3f} | {r['max_abs_diff']:.3g} |"
        )
    text = (
        f"Decode batch {args.batch}, kv {args.kv}, page 64, bf16, one CUDA graph per backend "
        f"({args.iters} replays; step = init_forward_metadata_out_graph + replay).\n\n"
        + "\n".join(table)
        + "\n"
    )
    (args.out / f"{rec.stem}.md").write_text(text)
    rec.say(text)


# ---------------------------------------------------------------------------------- tests
def mode_tests(rec: Recorder, args: argparse.Namespace) -> None:
    files = ["tests/test_sglang_graph.py", "tests/test_sglang_cpu.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *files]
    cmd.append(f"--junitxml={args.out / 'tests.xml'}")
    t0 = time.time()
    left = max(int(rec.deadline - time.time()), 30)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired as e:
        rec.say(str(e.stdout or ""))
        rec.record("pytest " + " ".join(files), "FAIL", t0, f"timeout after {left}s")
        return
    rec.say(proc.stdout[-12000:] + proc.stderr[-2000:])
    tail = [x for x in proc.stdout.splitlines() if " passed" in x or " failed" in x]
    status = "PASS" if proc.returncode == 0 else "FAIL"
    rec.record("pytest " + " ".join(files), status, t0, tail[-1] if tail else "")


MODES = {
    "entry": mode_entry,
    "kit": mode_kit,
    "compare": mode_compare,
    "bench": mode_bench,
    "tests": mode_tests,
}


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("mode", choices=sorted(MODES))
    ap.add_argument("out", type=Path)
    ap.add_argument(
        "--backend", help="kit: the SGLang name (mlab_triton, ...); compare/bench: one pair"
    )
    ap.add_argument("--pages", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--heads", type=lambda s: [int(x) for x in s.split(",")], default=[16, 128])
    ap.add_argument("--budget", type=float, default=540.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--kv", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.mode == "kit" and not args.backend:
        ap.error("kit needs --backend (one SGLang name per call: mlab_triton, mlab_flashmla, ...)")
    stem = "-".join(
        [args.mode]
        + ([args.backend] if args.backend else [])
        + (["p" + "_".join(map(str, args.pages))] if args.pages else [])
    )
    rec = Recorder(args.mode, args.out, args.budget, stem)
    env_lines(rec)
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(args.out / "flashinfer-ws"))
    if args.mode != "tests":
        load(rec)
        if args.device == "cpu":  # smoke runs of this script's plumbing on a CPU machine
            from sglang_cpu import kit_support as ks

            ks.use_torch_kv_writer()
    MODES[args.mode](rec, args)
    return rec.summary()


if __name__ == "__main__":
    sys.exit(main())
