"""SGLang's settings in our terms: the Config for its flags and model config, and our
backends' refusals phrased as the SGLang flag to change. Reads no runner and imports nothing
from SGLang, so the launching process's check (before any worker starts) and the factory
(`binding.bind`) share it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import torch

from mla_backends.backends.base import Capability
from mla_backends.backends.registry import why_not
from mla_backends.config import ACT_DTYPES, KV_DTYPES, PAGE_SIZES, Config, MLADims

# What SGLang's user passes to get each of our KV dtypes.
KV_FLAGS = {
    "bfloat16": "--kv-cache-dtype bf16",
    "float16": "--kv-cache-dtype auto with --dtype float16",
    "float32": "--kv-cache-dtype auto with --dtype float32",
    "float8_e4m3fn": "--kv-cache-dtype fp8_e4m3",
}


class SettingsError(ValueError):
    """SGLang was started with settings our backend cannot serve; the message names the flag.

    A ValueError on purpose: SGLang's test kit turns AssertionError / ImportError raised by a
    backend factory into a skipped test, and the server must fail loudly instead."""


def _dtype_name(dtype: torch.dtype, table: dict[str, torch.dtype]) -> str | None:
    return next((k for k, v in table.items() if v == dtype), None)


def model_dims(model_config: Any, num_heads: int) -> MLADims:
    """Our dims for SGLang's model config, with our softmax scale equal to SGLang's.

    Hazard: SGLang hands over the final scale (`model_config.scaling`, YaRN mscale^2 already
    applied by its own formula); our dims carry it as (P + R)^-0.5 * mscale^2. The mscale is
    expressed with mscale_all_dim = 1 and the YaRN factor that gives it, so whatever formula
    SGLang used, the scale the kernels get is SGLang's (checked to 1e-9 relative)."""
    mc = model_config
    dims = MLADims(
        num_heads=num_heads,
        kv_lora_rank=int(mc.kv_lora_rank),
        qk_rope_head_dim=int(mc.qk_rope_head_dim),
        qk_nope_head_dim=int(mc.qk_nope_head_dim),
        v_head_dim=int(mc.v_head_dim),
    )
    want = float(mc.scaling)
    ratio = want / dims.softmax_scale
    if ratio < 1.0 - 1e-9:
        raise SettingsError(
            f"the model's softmax scale {want:.6g} is below (qk_nope + qk_rope)^-0.5 = "
            f"{dims.softmax_scale:.6g}; mla-backends cannot express it"
        )
    if ratio > 1.0 + 1e-9:
        mscale = math.sqrt(ratio)
        dims = dataclasses.replace(
            dims, rope_scaling_factor=math.exp(10.0 * (mscale - 1.0)), mscale_all_dim=1.0
        )
    if not math.isclose(dims.softmax_scale, want, rel_tol=1e-9):
        raise SettingsError(f"softmax scale {dims.softmax_scale!r} != model's {want!r}")
    return dims


def settings_config(
    *,
    page_size: int,
    kv_cache_dtype: torch.dtype | None,
    kv_flag: str,
    dtype: torch.dtype,
    dims: MLADims,
    backend: str,
    device: torch.device,
    num_layers: int = 1,
    num_pages: int = 1,
    max_requests: int = 1,
    max_context_len: int = 1,
) -> Config:
    """Our Config for SGLang's settings; a setting it cannot express raises naming the flag."""
    if page_size not in PAGE_SIZES:
        raise SettingsError(f"--page-size {page_size}: mla-backends takes page sizes {PAGE_SIZES}")
    kv = None if kv_cache_dtype is None else _dtype_name(kv_cache_dtype, KV_DTYPES)
    if kv is None:
        raise SettingsError(
            f"--kv-cache-dtype {kv_flag} ({kv_cache_dtype}) is not supported by mla-backends; "
            "use auto, bf16 or fp8_e4m3"
        )
    act = _dtype_name(dtype, ACT_DTYPES)
    if act is None:
        raise SettingsError(f"model dtype {dtype}: use --dtype bfloat16 or float16")
    return Config(
        model=dims,
        num_layers=num_layers,
        prefill_backend=backend,
        decode_backend=backend,
        page_size=page_size,
        kv_dtype=kv,
        dtype=act,
        num_pages=max(num_pages, 1),
        max_requests=max(max_requests, 1),
        max_context_len=max(max_context_len, 1),
        device=str(device),
    )


def _runs(name: str, config: Config, cap: Capability, role: str, **change: Any) -> bool:
    return why_not(name, dataclasses.replace(config, **change), cap, role) is None


def _alternatives(
    name: str, config: Config, cap: Capability, role: str
) -> tuple[list[int], list[str]]:
    """Page sizes and KV dtypes with which our backend would run here, the rest unchanged."""
    pages = [p for p in PAGE_SIZES if _runs(name, config, cap, role, page_size=p)]
    kvs = [k for k in KV_DTYPES if _runs(name, config, cap, role, kv_dtype=k)]
    return pages, kvs


def _both_flags(name: str, config: Config, cap: Capability, role: str) -> str:
    """The --page-size and --kv-cache-dtype that together make our backend run here (the
    first page size that runs with some KV dtype), or "" when no pair does. Hazard: with both
    wrong, neither alone runs, and the refusal named no flag at all."""
    for p in PAGE_SIZES:
        kvs = [k for k in KV_DTYPES if _runs(name, config, cap, role, page_size=p, kv_dtype=k)]
        if kvs:
            return f"--page-size {p} and {' or '.join(KV_FLAGS[k] for k in kvs)}"
    return ""


def refusal(sgl_name: str, name: str, config: Config, cap: Capability, role: str) -> str | None:
    """Why our backend `name` cannot serve `role` under these settings, in SGLang's terms, or
    None. The reason is our backend's own (its `supports`), plus the flag that would fix it."""
    reason = why_not(name, config, cap, role)
    if reason is None:
        return None
    msg = f"--attention-backend {sgl_name}: our {name!r} backend cannot serve {role}: {reason}"
    pages, kvs = _alternatives(name, config, cap, role)
    if config.page_size not in pages and pages:
        msg += f". Start SGLang with --page-size {pages[0]} (it takes {pages})"
    elif config.kv_dtype not in kvs and kvs:
        msg += f". Start SGLang with {' or '.join(KV_FLAGS[k] for k in kvs)}"
    elif not pages and not kvs and (both := _both_flags(name, config, cap, role)):
        msg += f". Start SGLang with {both}"
    return (
        msg
        + f" [settings: --page-size {config.page_size}, {KV_FLAGS[config.kv_dtype]}, "
        + (f"--dtype {config.dtype}, device {cap.describe()}]")
    )


def _prefill_graph_backend(server_args: Any) -> str | None:
    """SGLang's prefill CUDA-graph backend: the resolved config's where it has one, else the
    --cuda-graph-backend-prefill flag (None: SGLang's default, breakable)."""
    config = getattr(getattr(server_args, "cuda_graph_config", None), "prefill", None)
    value = getattr(config, "backend", None) or getattr(
        server_args, "cuda_graph_backend_prefill", None
    )
    return None if value is None else str(getattr(value, "value", value))


# SGLang's speculative algorithms whose draft worker takes its attention backend from a fixed
# table of SGLang's own names (speculative/draft_utils.py, DraftBackendFactory).
DRAFT_TABLE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")


def _spec_algorithm(server_args: Any) -> str:
    return str(getattr(server_args, "speculative_algorithm", "") or "").upper()


def _draft_refusal(sgl_name: str, server_args: Any) -> str | None:
    """Our name as an EAGLE draft's attention backend: SGLang's draft worker would raise
    'EAGLE is not supported in attention backend mlab_*' after the target's weights loaded.
    Without --speculative-draft-attention-backend the draft takes --attention-backend (or the
    per-phase flags) too."""
    from mla_backends.integrations.sglang import sglang_names

    algo = _spec_algorithm(server_args)
    if algo not in DRAFT_TABLE_ALGORITHMS:
        return None
    draft = getattr(server_args, "speculative_draft_attention_backend", None)
    base = getattr(server_args, "attention_backend", None)
    chosen = (
        {draft}
        if draft
        else {
            getattr(server_args, f, None) or base
            for f in ("prefill_attention_backend", "decode_attention_backend")
        }
    )
    ours = sorted(n for n in chosen if n in sglang_names())
    if not ours:
        return None
    return (
        f"{sgl_name}: --speculative-algorithm {algo} would build the draft model's attention "
        f"on {ours[0]}, and SGLang's draft worker takes only its own backends; keep "
        f"{sgl_name} for the target and add --speculative-draft-attention-backend triton (or "
        "flashinfer, fa3, flashmla at --page-size 64)"
    )


def int_flag(server_args: Any, flag: str) -> int:
    """An integer server flag, 1 when unset (None, 0) or not resolved yet."""
    try:
        return int(getattr(server_args, flag, None) or 1)
    except (TypeError, ValueError):  # not resolved yet ("auto"): SGLang's own check decides
        return 1


def server_refusal(sgl_name: str, server_args: Any, dcp: bool) -> str | None:
    """What no backend of ours serves, from SGLang's server flags alone (the launching process's
    check and the factory ask the same): decode context parallelism (`dcp`, SGLang's --dcp-size
    > 1) and prefill context parallelism, ragged verify layouts (DSPARK / DFLASH under
    SGLANG_RAGGED_VERIFY_MODE other than static), two-batch overlap over mixed chunks (SGLang
    0.5.17's `two_batch_overlap` cuts a MIXED batch's requests at the balanced split and its
    tokens at the two-chunk one, and re-derives the lengths for EXTEND only), a full prefill
    CUDA graph (breakable, SGLang's default on CUDA, runs our attention eagerly between its
    pieces; full would send EXTEND batches to the graph hooks), tree drafts (EAGLE's
    --speculative-eagle-topk > 1; NGRAM copies its --speculative-ngram-max-bfs-breadth into
    that top-k, so the message names NGRAM's flag) and our names as an EAGLE draft's attention
    backend (`_draft_refusal`)."""
    if dcp:
        return (
            f"{sgl_name}: decode context parallelism (--dcp-size > 1) is not supported through "
            "SGLang; start without --dcp-size"
        )
    prefill_cp = getattr(server_args, "enable_prefill_cp", False)
    if prefill_cp or int_flag(server_args, "attn_cp_size") > 1:
        # Hazard: accepted, the first long prefill failed on a shape error naming q_nope
        return (
            f"{sgl_name}: prefill context parallelism (--enable-prefill-cp, "
            "--attention-context-parallel-size > 1) hands attention this rank's share of the "
            "query tokens over the whole sequence's keys, which our backends do not take; "
            "start without it"
        )
    ragged = os.environ.get("SGLANG_RAGGED_VERIFY_MODE", "static").strip().lower()
    if _spec_algorithm(server_args) in ("DSPARK", "DFLASH") and ragged != "static":
        return (
            f"{sgl_name}: SGLANG_RAGGED_VERIFY_MODE={ragged} sends verify batches with "
            "per-request draft counts, which our verify metadata does not take; set "
            "SGLANG_RAGGED_VERIFY_MODE=static"
        )
    if getattr(server_args, "enable_two_batch_overlap", False) and getattr(
        server_args, "enable_mixed_chunk", False
    ):
        return (
            f"{sgl_name}: --enable-two-batch-overlap with --enable-mixed-chunk: SGLang splits "
            "a MIXED batch's requests and tokens at different points, so a sub-batch's tokens "
            "are not its requests'; drop --enable-mixed-chunk"
        )
    if _prefill_graph_backend(server_args) == "full":
        return (
            f"{sgl_name}: --cuda-graph-backend-prefill full captures the prefill's attention "
            "metadata, which our graph hooks serve for DECODE and TARGET_VERIFY only; use "
            "--cuda-graph-backend-prefill breakable (the default) or disabled"
        )
    topk = int_flag(server_args, "speculative_eagle_topk")
    if topk <= 1:
        return _draft_refusal(sgl_name, server_args)
    flag = "--speculative-eagle-topk"
    if _spec_algorithm(server_args) == "NGRAM":
        flag = "--speculative-ngram-max-bfs-breadth"
    return (
        f"{sgl_name}: {flag} {topk}: our kernels verify chain drafts (causal, no tree mask); "
        f"use {flag} 1"
    )
