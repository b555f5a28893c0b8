"""GPU benchmarks: our backends against the raw peer kernels, in one run, with the copy and
matmul ceilings measured at the start of the same run (CUDA events, medians, random data)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.config import DEEPSEEK_V3, Config
from mla_backends.runtime import Runtime

# (heads, q_len, batch, kv_len): the decode table of ../shared/ANCHORS.md.
ANCHOR_SHAPES: list[tuple[int, int, int, int]] = [
    (16, 1, 1, 4096),
    (16, 1, 16, 4096),
    (16, 1, 64, 4096),
    (16, 1, 128, 8192),
    (16, 1, 256, 1024),
    (16, 2, 128, 8192),
    (128, 1, 1, 4096),
    (128, 1, 16, 4096),
    (128, 1, 64, 4096),
    (128, 1, 128, 8192),
    (128, 1, 256, 1024),
    (128, 2, 64, 4096),
    (128, 2, 128, 8192),
]


def bench_us(fn: Callable[[], object], warmup_ms: int = 25, rep_ms: int = 100) -> float:
    import triton.testing

    return 1000.0 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def ceilings(device: torch.device) -> dict[str, float]:
    """Device copy GB/s (read + write) and bf16 matmul TFLOP/s, measured now."""
    n = 1 << 28  # 512 MiB of bf16 per side
    a = torch.randn(n, device=device, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    copy_us = bench_us(lambda: b.copy_(a))
    m = 8192
    x = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    mm_us = bench_us(lambda: x @ y)
    return {"copy_gbps": 2 * n * 2 / copy_us / 1e3, "matmul_tflops": 2 * m**3 / mm_us / 1e6}


@dataclass
class DecodeSetup:
    rt: Runtime
    batch: ForwardBatch
    q_nope: torch.Tensor  # [T, H, L]
    q_rope: torch.Tensor  # [T, H, R]
    heads: int
    q_len: int
    kv_len: int


def decode_setup(
    backend: str,
    heads: int,
    q_len: int,
    batch: int,
    kv_len: int,
    page_size: int = 64,
    kv_dtype: str = "bfloat16",
    seed: int = 0,
) -> DecodeSetup:
    """A pool filled with random rows, pages handed out shuffled, one decode/verify batch."""
    dims = dataclasses.replace(DEEPSEEK_V3, num_heads=heads)
    pages = batch * -(-kv_len // page_size) + 1
    cfg = Config(
        model=dims,
        num_layers=1,
        prefill_backend=backend,
        decode_backend=backend,
        page_size=page_size,
        kv_dtype=kv_dtype,
        dtype="bfloat16",
        num_pages=pages,
        max_requests=batch,
        max_context_len=kv_len,
        device="cuda",
    )
    order = list(range(1, pages + 1))
    random.Random(seed).shuffle(order)
    rt = Runtime.build(cfg, order)
    buf = rt.kv_pool.kv_buffer[0]
    buf.copy_(torch.randn(buf.shape, device=buf.device).to(buf.dtype))
    rows = rt.req_pool.alloc(batch)
    rt.allocator.alloc_extend(rows, [kv_len - q_len] * batch)
    loc = rt.allocator.alloc_extend(rows, [q_len] * batch)
    mode = ForwardMode.DECODE if q_len == 1 else ForwardMode.TARGET_VERIFY
    fb = ForwardBatch.build(mode, rows, [kv_len - q_len] * batch, [q_len] * batch, loc, "cuda")
    t = batch * q_len
    q_nope = torch.randn(t, heads, dims.kv_lora_rank, device="cuda", dtype=torch.bfloat16)
    q_rope = torch.randn(t, heads, dims.qk_rope_head_dim, device="cuda", dtype=torch.bfloat16)
    return DecodeSetup(rt, fb, q_nope, q_rope, heads, q_len, kv_len)


def traffic(s: DecodeSetup) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode call, as ANCHORS.md counts them."""
    b = s.batch.batch_size
    elem = s.rt.kv_pool.kv_buffer[0].element_size()
    nbytes = 576 * elem * b * s.kv_len + b * s.q_len * s.heads * (576 + 512) * 2
    flops = 2 * b * s.q_len * s.heads * s.kv_len * 1088
    return float(nbytes), float(flops)


def time_backend(s: DecodeSetup) -> float:
    """Our backend call: metadata built once for the batch, the store excluded."""
    be = s.rt.backend
    be.init_forward_metadata(s.batch)
    return bench_us(lambda: be.forward_absorbed(0, s.q_nope, s.q_rope, None, None, s.batch))


def time_flashmla(s: DecodeSetup) -> float:
    """The raw FlashMLA call (sgl_kernel) on the same pool, page table and queries."""
    from sgl_kernel.flash_mla import flash_mla_with_kvcache, get_mla_metadata

    from mla_backends.indices import build_page_table, page_table_width

    pool, b = s.rt.kv_pool, s.batch.batch_size
    table = build_page_table(
        s.rt.req_pool.req_to_token,
        s.batch.req_pool_indices,
        s.batch.seq_lens,
        pool.page_size,
        page_table_width(s.kv_len, pool.page_size),
        0,
    )
    q = torch.cat([s.q_nope, s.q_rope], -1).view(b, s.q_len, s.heads, 576)
    seqlens = s.batch.seq_lens
    md, splits = get_mla_metadata(seqlens, s.q_len * s.heads, 1)
    kcache = pool.get_paged_buffer(0)
    scale = s.rt.config.model.softmax_scale
    return bench_us(
        lambda: flash_mla_with_kvcache(
            q, kcache, table, seqlens, 512, md, splits, softmax_scale=scale, causal=True
        )
    )


def time_flashinfer(s: DecodeSetup) -> float:
    """The raw FlashInfer MLA wrapper (fa3), planned once, on the same pool and queries."""
    import flashinfer

    from mla_backends.indices import build_page_indices

    pool, b, ps = s.rt.kv_pool, s.batch.batch_size, s.rt.kv_pool.page_size
    n_pages = b * -(-s.kv_len // ps)
    indptr, indices = build_page_indices(
        s.rt.req_pool.req_to_token, s.batch.req_pool_indices, s.batch.seq_lens, ps, n_pages
    )
    qo = torch.arange(0, b + 1, device="cuda", dtype=torch.int32) * s.q_len
    ws = torch.empty(128 << 20, dtype=torch.int8, device="cuda")
    w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend="fa3")
    w.plan(
        qo_indptr=qo,
        kv_indptr=indptr,
        kv_indices=indices,
        kv_len_arr=s.batch.seq_lens,
        num_heads=s.heads,
        head_dim_ckv=512,
        head_dim_kpe=64,
        page_size=ps,
        causal=True,
        sm_scale=s.rt.config.model.softmax_scale,
        q_data_type=torch.bfloat16,
        kv_data_type=pool.dtype,
    )
    ckv, kpe = pool.get_ckv_kpe(0)
    return bench_us(lambda: w.run(q_nope=s.q_nope, q_pe=s.q_rope, ckv_cache=ckv, kpe_cache=kpe))


def decode_table(backends: list[str], peers: list[str], shapes=ANCHOR_SHAPES) -> list[dict]:  # type: ignore[no-untyped-def]
    rows = []
    peer_fns = {"flashmla": time_flashmla, "flashinfer_fa3": time_flashinfer}
    for heads, q_len, batch, kv_len in shapes:
        row: dict = {"heads": heads, "q_len": q_len, "batch": batch, "kv_len": kv_len}
        setups = {}
        for name in backends:
            setups[name] = s = decode_setup(name, heads, q_len, batch, kv_len)
            row[f"{name}_us"] = time_backend(s)
        base = next(iter(setups.values()))
        nbytes, flops = traffic(base)
        row["bytes"], row["flops"] = nbytes, flops
        for peer in peers:
            try:
                row[f"{peer}_us"] = peer_fns[peer](base)
            except Exception as e:  # a peer that cannot run here is reported, not fatal
                row[f"{peer}_error"] = f"{type(e).__name__}: {e}"[:200]
        del setups, base
        torch.cuda.empty_cache()
        rows.append(row)
    return rows


def prefill_table(tokens: int = 8192, heads: int = 128) -> dict:
    """MHA-mode prefill, one causal request: our triton kernel vs torch SDPA, same inputs."""
    import torch.nn.functional as F

    from mla_backends.batch import RaggedLayout
    from mla_backends.kernels.mha_prefill import mha_prefill

    dims = DEEPSEEK_V3
    q = torch.randn(tokens, heads, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, heads, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(tokens, heads, 128, device="cuda", dtype=torch.bfloat16)
    layout = RaggedLayout.from_lens([tokens], [tokens], "cuda")
    out = torch.empty(tokens, heads, 128, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(tokens, heads, device="cuda", dtype=torch.float32)
    scale = dims.softmax_scale
    flops = 4 * tokens * tokens / 2 * heads * (192 + 128) / 2  # causal: half the matrix
    res: dict = {"tokens": tokens, "heads": heads, "flops": flops}

    def ours() -> None:
        mha_prefill(q, k, v, layout.qo_indptr, layout.kv_indptr, tokens, scale, True, out, lse)

    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)

    def sdpa_lse() -> tuple[torch.Tensor, torch.Tensor]:
        o, lse_, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qt, kt, vt, None, True, 0.0, True, False, scale=scale
        )
        return o, lse_

    ref = sdpa()[0].transpose(0, 1)
    ours()
    res["max_abs_diff_vs_sdpa"] = float((out.float() - ref.float()).abs().max())
    try:
        o2, lse2 = sdpa_lse()
        res["cudnn_lse_shape"] = list(lse2.shape)
        lse2 = lse2.reshape(heads, tokens) if lse2.numel() == heads * tokens else lse2
        res["cudnn_lse_max_diff"] = float((lse2[0].transpose(0, 1).float() - lse).abs().max())
        res["cudnn_out_max_diff"] = float((o2[0].transpose(0, 1).float() - out.float()).abs().max())
        res["cudnn_lse_us"] = bench_us(sdpa_lse)
    except Exception as e:
        res["cudnn_lse_error"] = f"{type(e).__name__}: {e}"[:300]
    for name, fn in (("triton", ours), ("sdpa", sdpa)):
        us = bench_us(fn)
        res[f"{name}_us"], res[f"{name}_tflops"] = us, flops / us / 1e6
    return res


def main(out_dir: str, backends: list[str], peers: list[str], quick: bool = False) -> None:
    dev = torch.device("cuda")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    result["ceilings"] = ceilings(dev)
    shapes = ANCHOR_SHAPES[:3] if quick else ANCHOR_SHAPES
    result["decode"] = decode_table(backends, peers, shapes)
    result["prefill"] = prefill_table(2048 if quick else 8192)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    print(format_result(result, backends, peers))


def format_result(result: dict, backends: list[str], peers: list[str]) -> str:
    c = result["ceilings"]
    lines = [
        f"{result['device']}: copy {c['copy_gbps']:.0f} GB/s, "
        f"bf16 mm {c['matmul_tflops']:.0f} TFLOP/s"
    ]
    ref = peers[0] if peers else None
    head = "H    q  B    kv     " + "".join(f"{n + ' us':>16}" for n in backends + peers)
    head += "".join(f"{n + '/' + ref:>18}" for n in backends) if ref else ""
    head += "   GB/s(best ours) TFLOP/s"
    lines.append(head)
    for r in result["decode"]:
        cells = "".join(f"{r.get(n + '_us', math.nan):>16.1f}" for n in backends + peers)
        ratios = ""
        if ref:
            for n in backends:
                ratios += f"{r.get(ref + '_us', math.nan) / r[n + '_us']:>18.2f}"
        best = min(r[n + "_us"] for n in backends)
        lines.append(
            f"{r['heads']:<5}{r['q_len']:<3}{r['batch']:<5}{r['kv_len']:<7}{cells}{ratios}"
            f"{r['bytes'] / best / 1e3:>17.0f}{r['flops'] / best / 1e6:>8.0f}"
        )
    p = result.get("prefill")
    if p:
        lines.append(
            f"prefill {p['tokens']} tok x {p['heads']} heads causal: triton "
            f"{p['triton_us']:.0f} us ({p['triton_tflops']:.0f} TFLOP/s), sdpa "
            f"{p['sdpa_us']:.0f} us ({p['sdpa_tflops']:.0f} TFLOP/s), ratio "
            f"{p['sdpa_us'] / p['triton_us']:.2f}, max|diff| {p['max_abs_diff_vs_sdpa']:.1e}"
        )
    return "\n".join(lines)
