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

from mla_backends.arith import cdiv
from mla_backends.backends.util import joined_query
from mla_backends.batch import ForwardBatch, ForwardMode
from mla_backends.config import DEEPSEEK_V3, Config, MLADims
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


def bench_us(
    fn: Callable[[], object],
    warmup_ms: int = 25,
    rep_ms: int = 100,
    device: torch.device | None = None,
) -> float:
    """Median microseconds per call: CUDA events (do_bench) on a GPU, perf_counter on CPU."""
    if device is None or device.type == "cuda":
        import triton.testing

        return 1000.0 * triton.testing.do_bench(
            fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"
        )
    import time

    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1000.0
    while time.perf_counter() < deadline or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * sorted(times)[len(times) // 2]


def ceilings(device: torch.device) -> dict:
    """Copy GB/s (read + write) and matmul TFLOP/s, measured now, with what they are.

    On a GPU they bound a decode kernel: a copy of 512 MiB (far past L2) and a bf16
    tensor-core matmul. On a CPU they are reference rates, not ceilings (`is_ceiling` False):
    a KV cache that fits in the CPU caches reads faster than a copy through DRAM, and the
    torch backend computes in fp32, which on a CPU without bf16 units outruns a bf16 matmul
    (a bf16-only "ceiling" can be beaten that way); the matmul rate is the best of fp32 and
    bf16, and the attention's own matmuls are smaller than it."""
    gpu = device.type == "cuda"
    n = 1 << (28 if gpu else 25)
    a = torch.randn(n, device=device, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    copy_us = bench_us(lambda: b.copy_(a), device=device)
    rates = {}
    for dtype, m in (
        [(torch.bfloat16, 8192)] if gpu else [(torch.float32, 1024), (torch.bfloat16, 512)]
    ):
        x = torch.randn(m, m, device=device, dtype=dtype)
        y = torch.randn(m, m, device=device, dtype=dtype)
        rates[dtype] = 2 * m**3 / bench_us(lambda x=x, y=y: x @ y, device=device) / 1e6
    best = max(rates, key=rates.__getitem__)
    mib = n * 2 >> 20
    return {
        "copy_gbps": 2 * n * 2 / copy_us / 1e3,
        "matmul_tflops": rates[best],
        "is_ceiling": gpu,
        "copy_what": f"{mib} MiB bf16 copy",
        "matmul_what": f"{str(best).removeprefix('torch.')} matmul"
        + ("" if gpu else " (best of float32 and bfloat16)"),
    }


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
    dims: MLADims = DEEPSEEK_V3,
    device: str = "cuda",
    dtype: str = "bfloat16",
) -> DecodeSetup:
    """A pool filled with random rows, pages handed out shuffled, one decode/verify batch."""
    dims = dataclasses.replace(dims, num_heads=heads)
    pages = batch * cdiv(kv_len, page_size) + 1
    cfg = Config(
        model=dims,
        num_layers=1,
        prefill_backend=backend,
        decode_backend=backend,
        page_size=page_size,
        kv_dtype=kv_dtype,
        dtype=dtype,
        num_pages=pages,
        max_requests=batch,
        max_context_len=kv_len,
        device=device,
    )
    order = list(range(1, pages + 1))
    random.Random(seed).shuffle(order)
    rt = Runtime.build(cfg, order)
    buf = rt.kv_pool.kv_buffer[0]
    buf.copy_(torch.randn(buf.shape, device=buf.device).to(buf.dtype))
    if rt.kv_pool.is_fp8:
        rt.kv_pool.set_scale(0, 0.05)
    rows = rt.req_pool.alloc(batch)
    rt.allocator.alloc_extend(rows, [kv_len - q_len] * batch)
    loc = rt.allocator.alloc_extend(rows, [q_len] * batch)
    mode = ForwardMode.DECODE if q_len == 1 else ForwardMode.TARGET_VERIFY
    fb = ForwardBatch.build(mode, rows, [kv_len - q_len] * batch, [q_len] * batch, loc, device)
    t = batch * q_len
    # One [T, H, L + R] buffer, q_nope / q_rope its column ranges: how a model lays out the
    # absorbed query (FlashMLA reads it whole, with no concatenation copy).
    q = torch.randn(t, heads, dims.kv_dim, device=device).to(getattr(torch, dtype))
    q_nope, q_rope = q[..., : dims.kv_lora_rank], q[..., dims.kv_lora_rank :]
    if backend == "flashinfer_mla":  # its parity tests cover contiguous halves only
        q_nope, q_rope = q_nope.contiguous(), q_rope.contiguous()
    return DecodeSetup(rt, fb, q_nope, q_rope, heads, q_len, kv_len)


def traffic(s: DecodeSetup) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode call, as ANCHORS.md counts them (576 + 512 = 1088 at
    DeepSeek dims: the cache row once; q in and out once)."""
    b, d = s.batch.batch_size, s.rt.config.model
    elem = s.rt.kv_pool.kv_buffer[0].element_size()
    width = d.kv_dim + d.kv_lora_rank
    nbytes = d.kv_dim * elem * b * s.kv_len + b * s.q_len * s.heads * width * 2
    flops = 2 * b * s.q_len * s.heads * s.kv_len * width
    return float(nbytes), float(flops)


def time_backend(s: DecodeSetup, layers: int = 0) -> float:
    """Our backend call, store excluded. layers = 0: one attention call with the metadata
    built once for the batch. layers = L: one eager decode step, the metadata built for the
    step and then L attention calls (what a graph replaces)."""
    be = s.rt.backend

    def call() -> object:
        return be.forward_absorbed(0, s.q_nope, s.q_rope, None, None, s.batch)

    if layers == 0:
        be.init_forward_metadata(s.batch)
        return bench_us(call, device=s.q_nope.device)

    def step() -> None:
        be.init_forward_metadata(s.batch)
        for _ in range(layers):
            call()

    return bench_us(step, device=s.q_nope.device)


def time_graph(s: DecodeSetup, layers: int = 1) -> float:
    """One decode step through a captured CUDA graph of `layers` attention calls, timed per
    `runner.replay`: staging the inputs, refilling the backend's metadata, the replay."""
    from mla_backends.graph_runner import CudaGraphRunner, InputSpec

    be, b = s.rt.backend, s.batch.batch_size
    specs = {
        "q_nope": InputSpec(tuple(s.q_nope.shape[1:]), s.q_nope.dtype),
        "q_rope": InputSpec(tuple(s.q_rope.shape[1:]), s.q_rope.dtype),
    }

    def fwd(batch: ForwardBatch, x: dict[str, torch.Tensor]) -> torch.Tensor:
        for _ in range(layers):
            out = be.forward_absorbed(0, x["q_nope"], x["q_rope"], None, None, batch)
        return out

    runner = CudaGraphRunner(be, fwd, specs, [b], q_len=s.q_len, device=s.q_nope.device)
    runner.capture()
    inputs = {"q_nope": s.q_nope, "q_rope": s.q_rope}
    return bench_us(lambda: runner.replay(s.batch, inputs), device=s.q_nope.device)


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
    q = joined_query(s.q_nope, s.q_rope).view(b, s.q_len, s.heads, 576)
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
    n_pages = b * cdiv(s.kv_len, ps)
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
    peer_fns = {"raw_flashmla": time_flashmla, "raw_flashinfer_fa3": time_flashinfer}
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


def prefill_table(backends: list[str], tokens: int = 8192, heads: int = 128) -> dict:
    """MHA-mode prefill, one causal request of `tokens`: torch SDPA and FlashInfer's raw
    ragged wrapper against our backends' `forward_mha` (without and with LSE) and our Triton
    kernel (LSE)."""
    import torch.nn.functional as F

    from mla_backends.batch import RaggedLayout
    from mla_backends.kernels.mha_prefill import mha_prefill

    dims = dataclasses.replace(DEEPSEEK_V3, num_heads=heads)
    q = torch.randn(tokens, heads, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, heads, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(tokens, heads, 128, device="cuda", dtype=torch.bfloat16)
    layout = RaggedLayout.from_lens([tokens], [tokens], "cuda")
    out = torch.empty(tokens, heads, 128, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(tokens, heads, device="cuda", dtype=torch.float32)
    scale = dims.softmax_scale
    flops = tokens * tokens * heads * (192 + 128)  # causal: half of 4 * T^2 * H * d / 2
    res: dict = {"tokens": tokens, "heads": heads, "flops": flops}
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    fns: dict[str, Callable[[], object]] = {
        "sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)[
            0
        ].transpose(0, 1),
        "triton_kernel_lse": lambda: mha_prefill(
            q, k, v, layout.qo_indptr, layout.kv_indptr, tokens, scale, True, out, lse
        ),
    }
    try:
        import flashinfer

        ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        raw = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
        raw.plan(
            layout.qo_indptr_cpu,
            layout.kv_indptr_cpu,
            heads,
            heads,
            192,
            head_dim_vo=128,
            causal=True,
            sm_scale=scale,
            q_data_type=torch.bfloat16,
        )
        fns["flashinfer_raw"] = lambda: raw.run(q, k, v)
    except Exception as e:
        res["flashinfer_raw_error"] = f"{type(e).__name__}: {e}"[:200]
    for name in backends:
        cfg = Config(
            model=dims,
            num_layers=1,
            prefill_backend=name,
            decode_backend=name,
            num_pages=1,
            max_requests=1,
            device="cuda",
        )
        be = Runtime.build(cfg).backend
        fns[f"{name}_backend"] = lambda be=be: be.forward_mha(q, k, v, layout)
        fns[f"{name}_backend_lse"] = lambda be=be: be.forward_mha(q, k, v, layout, return_lse=True)[
            0
        ]
    ref = fns["sdpa"]().float()
    for name, fn in fns.items():
        try:
            o = fn()
            o = out if o is None else o
            res[f"{name}_max_abs_diff_vs_sdpa"] = float((o.float() - ref).abs().max())
            us = bench_us(fn)
            res[f"{name}_us"], res[f"{name}_tflops"] = us, flops / us / 1e6
        except Exception as e:
            res[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
    return res


RAW_PEER = {
    "triton": "raw_flashmla",
    "flashmla": "raw_flashmla",
    "flashinfer_mla": "raw_flashinfer_fa3",
}


def main(
    out_dir: str, backends: list[str], peers: list[str], quick: bool = False, prefill: bool = True
) -> None:
    dev = torch.device("cuda")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    result["ceilings"] = ceilings(dev)
    shapes = ANCHOR_SHAPES[:3] if quick else ANCHOR_SHAPES
    result["decode"] = decode_table(backends, peers, shapes)
    if prefill:
        prefill_backends = [b for b in backends if b != "flashmla"]
        result["prefill"] = prefill_table(prefill_backends, 2048 if quick else 8192)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    print(format_result(result, backends, peers))


def format_result(result: dict, backends: list[str], peers: list[str]) -> str:
    c = result["ceilings"]
    lines = [
        f"{result['device']}: copy {c['copy_gbps']:.0f} GB/s, "
        f"bf16 mm {c['matmul_tflops']:.0f} TFLOP/s"
    ]
    ratio_names = [(b, RAW_PEER[b]) for b in backends if RAW_PEER.get(b) in peers]
    head = "H    q  B    kv     " + "".join(f"{n + ' us':>18}" for n in backends + peers)
    head += "".join(f"{b + '/' + p:>30}" for b, p in ratio_names)
    lines.append(head + "   GB/s TFLOP/s (fastest of ours)")
    for r in result["decode"]:
        cells = "".join(f"{r.get(n + '_us', math.nan):>18.1f}" for n in backends + peers)
        ratios = "".join(
            f"{r.get(p + '_us', math.nan) / r[b + '_us']:>30.2f}" for b, p in ratio_names
        )
        best = min(r[n + "_us"] for n in backends)
        lines.append(
            f"{r['heads']:<5}{r['q_len']:<3}{r['batch']:<5}{r['kv_len']:<7}{cells}{ratios}"
            f"{r['bytes'] / best / 1e3:>7.0f}{r['flops'] / best / 1e6:>8.0f}"
        )
    p = result.get("prefill", {})
    for key in sorted(k[:-3] for k in p if k.endswith("_us")):
        lines.append(
            f"prefill {p['tokens']} x {p['heads']} heads causal {key:<24} {p[key + '_us']:>8.0f} us"
            f" {p[key + '_tflops']:>5.0f} TFLOP/s  vs sdpa {p['sdpa_us'] / p[key + '_us']:.2f}x"
            f"  max|diff| {p.get(key + '_max_abs_diff_vs_sdpa', math.nan):.1e}"
        )
    lines += [f"prefill {k}: {v}" for k, v in p.items() if k.endswith("_error")]
    return "\n".join(lines)
