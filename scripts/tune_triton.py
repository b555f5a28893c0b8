"""Tuning our Triton kernels on a GPU, against raw FlashMLA timed in the same run, on the
benchmark package's fixtures (random pools, shuffled pages):

    python3 scripts/tune_triton.py sweep OUT_DIR          launch-config sweep, decode and MHA
                                                          prefill; a table, OUT_DIR/sweep.json
    python3 scripts/tune_triton.py regs OUT_DIR [--small] registers, spills, shared memory and
                                                          pipelined IR of the compiled decode
                                                          kernel per config; probe.json and the
                                                          TTGIR of the H128 TMA configs
    python3 scripts/tune_triton.py probe OUT_DIR          the Gluon 64-row decode kernel vs the
                                                          Triton one: time, |diff| of out / LSE;
                                                          probe-gluon.json
    python3 scripts/tune_triton.py splits OUT_DIR         small batches: every KV split count
                                                          1-128, graph replay, vs FlashMLA's
                                                          replay; splits.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from mla_backends.backends.kernel_packages import missing
from mla_backends.backends.triton_backend import TritonBackend
from mla_backends.bench.fixtures import DecodeSetup, PrefillInputs, decode_setup, traffic
from mla_backends.bench.peers import flashmla_call, sdpa_prefill, time_flashmla
from mla_backends.bench.timing import bench_us, graph_us

Cfg = tuple  # (block_m, block_n, warps, stages, splits, tma[, gluon])
SWEEP_SHAPES = [(16, 1, 64, 4096), (16, 1, 128, 8192), (16, 2, 128, 8192),
                (128, 1, 64, 4096), (128, 1, 128, 8192), (128, 2, 64, 4096)]  # fmt: skip
# (block_m, None = the backend's; block_n, warps, stages)
SWEEP_CFGS = [(None, 32, 4, 2), (None, 64, 4, 3), (None, 64, 8, 3), (None, 32, 8, 3),
              (None, 64, 4, 4), (None, 128, 8, 2)]  # fmt: skip
SWEEP_SPLITS = [1, 2, 4]
PREFILL_CFGS = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                (128, 32, 8, 3), (64, 128, 8, 2), (128, 64, 4, 2), (64, 64, 8, 3)]  # fmt: skip
REGS_SHAPES: dict[tuple[int, int, int, int], list[Cfg]] = {
    (128, 1, 64, 4096): [(64, 64, 8, 3, 1, False), (64, 64, 8, 2, 1, True),
                         (64, 32, 8, 3, 1, True), (64, 32, 8, 4, 1, True)],
    (128, 2, 64, 4096): [(64, 64, 8, 3, 1, False), (64, 64, 8, 2, 1, True),
                         (64, 32, 8, 4, 1, True)],
    (16, 2, 128, 8192): [(32, 64, 4, 2, 2, False), (32, 64, 4, 2, 2, True),
                         (32, 32, 4, 3, 2, True), (32, 32, 4, 4, 2, True),
                         (32, 64, 4, 3, 2, True)],
    (16, 1, 256, 1024): [(16, 64, 4, 3, 2, False), (16, 64, 4, 3, 2, True),
                         (16, 32, 4, 4, 1, True), (16, 64, 4, 2, 1, True),
                         (16, 64, 4, 4, 2, True)],
    (16, 1, 64, 4096): [(16, 64, 4, 3, 4, False), (16, 64, 4, 3, 4, True),
                        (16, 64, 4, 4, 4, True)],
}  # fmt: skip
REGS_SMALL: dict[tuple[int, int, int, int], list[Cfg]] = {
    # many splits per request: the rows where TMA tiles were slower (2026-11-22)
    (16, 1, 16, 4096): [(16, 64, 4, 3, 16, False), (16, 32, 4, 4, 16, True),
                        (16, 32, 4, 4, 16, False), (16, 32, 4, 2, 16, True),
                        (16, 32, 4, 4, 4, True), (16, 64, 4, 3, 4, False)],
    (16, 1, 1, 4096): [(16, 64, 4, 3, 16, False), (16, 32, 4, 4, 16, True),
                       (16, 32, 4, 4, 16, False)],
}  # fmt: skip
OLD, GLUON = (64, 64, 8, 2, 1, True, False), (64, 64, 8, 2, 1, True, True)
PROBE_SHAPES: dict[tuple[int, int, int, int], list[Cfg]] = {
    (128, 1, 64, 4096): [OLD, GLUON],
    (128, 1, 128, 8192): [OLD, GLUON],
    (128, 2, 64, 4096): [OLD, GLUON],
    (128, 1, 256, 1024): [OLD, GLUON],
    (128, 1, 16, 4096): [GLUON, (64, 64, 8, 2, 2, True, True), (64, 64, 8, 2, 4, True, True)],
    (16, 2, 128, 8192): [(32, 64, 4, 2, 2, False, False), GLUON],
}


def triton_backend(s: DecodeSetup) -> TritonBackend:
    be = s.rt.backend
    if not isinstance(be, TritonBackend):
        raise TypeError(f"the setup built {be.name}, not the triton backend")
    return be


def decode_call(
    s: DecodeSetup,
    bm: int,
    bn: int,
    w: int,
    st: int,
    splits: int,
    tma: bool = True,
    gluon: bool = False,
) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """A no-argument call of our decode kernel on setup `s` (metadata built) with this
    launch config, and the out / lse it writes."""
    from mla_backends.kernels.mla_attention import mla_attention

    be = triton_backend(s)
    md = be.metadata
    if md is None:
        raise RuntimeError("build the setup's metadata first (init_forward_metadata)")
    out = torch.empty_like(s.q_nope)
    lse = torch.empty(s.q_nope.shape[:2], device=s.q_nope.device, dtype=torch.float32)
    kv, page = s.rt.kv_pool.kv_buffer[0], s.rt.kv_pool.page_size

    def call() -> None:
        mla_attention(
            s.q_nope, s.q_rope, kv, md.table, md.qo_indptr, s.batch.seq_lens, page, be.scale,
            1.0, md.max_q_len, splits, out, lse, None, block_m=bm, block_n=bn, num_warps=w,
            num_stages=st, tma=tma, gluon=gluon,
        )  # fmt: skip

    return call, out, lse


def measured_setup(shape: tuple[int, int, int, int]) -> tuple[DecodeSetup, float, float, float]:
    """The triton setup of `shape` with its metadata built, its (bytes, FLOPs), and raw
    FlashMLA's µs on the same pool and queries."""
    s = decode_setup("triton", *shape)
    s.rt.backend.init_forward_metadata(s.batch)
    nbytes, flops = traffic(s)
    return s, nbytes, flops, time_flashmla(s)


def probe_row(s: DecodeSetup, cfg: Cfg, us: float, fm: float, nbytes: float, flops: float) -> dict:
    return dict(
        heads=s.heads, q_len=s.q_len, batch=s.batch.batch_size, kv=s.kv_len, cfg=cfg, us=us,
        flashmla_us=fm, ratio=fm / us, gbps=nbytes / us / 1e3, tflops=flops / us / 1e6,
    )  # fmt: skip


def decode_sweep() -> list[dict]:
    rows = []
    for shape in SWEEP_SHAPES:
        s, nbytes, flops, fm = measured_setup(shape)
        be, (heads, q_len, batch, kv) = triton_backend(s), shape
        md = be.metadata
        assert md is not None
        mine = []
        for bm, bn, w, st in SWEEP_CFGS:
            bm = bm or md.block_m
            for splits in SWEEP_SPLITS:
                try:
                    us = bench_us(decode_call(s, bm, bn, w, st, splits)[0], 10, 40)
                except Exception as e:  # out of resources etc.
                    us = float("nan")
                    print("fail", heads, bm, bn, w, st, type(e).__name__, str(e)[:80])
                mine.append(dict(
                    heads=heads, q_len=q_len, batch=batch, kv=kv, bm=bm, bn=bn, warps=w,
                    stages=st, splits=splits, us=us, flashmla_us=fm,
                    default_splits=md.num_splits, gbps=nbytes / us / 1e3,
                    tflops=flops / us / 1e6,
                ))  # fmt: skip
        rows += mine
        best = min((r for r in mine if r["us"] == r["us"]), key=lambda r: r["us"])
        print(
            f"decode H{heads} q{q_len} B{batch} kv{kv}: flashmla {fm:.1f} us; best {best['us']:.1f}"
            f" us (ratio {fm / best['us']:.2f}) bm{best['bm']} bn{best['bn']} w{best['warps']}"
            f" st{best['stages']} splits{best['splits']} (default splits {md.num_splits})"
        )
        torch.cuda.empty_cache()
    return rows


def prefill_sweep(tokens: int = 8192, heads: int = 128) -> list[dict]:
    from mla_backends.kernels.mha_prefill import mha_prefill

    x = PrefillInputs.random(tokens, heads, torch.device("cuda"))
    ind = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)
    out = torch.empty(tokens, heads, 128, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(tokens, heads, device="cuda", dtype=torch.float32)
    sdpa, scale = bench_us(sdpa_prefill(x)), x.dims.softmax_scale
    rows = []
    for bm, bn, w, st in PREFILL_CFGS:
        call = partial(mha_prefill, x.q, x.k, x.v, ind, ind, tokens, scale, True, out, lse)
        try:
            us = bench_us(partial(call, block_m=bm, block_n=bn, num_warps=w, num_stages=st), 10, 50)
        except Exception as e:
            us = float("nan")
            print("fail prefill", bm, bn, w, st, type(e).__name__, str(e)[:80])
        tf, sdpa_tf = x.flops / us / 1e6, x.flops / sdpa / 1e6
        rows.append(dict(bm=bm, bn=bn, warps=w, stages=st, us=us, sdpa_us=sdpa, tflops=tf,
                         sdpa_tflops=sdpa_tf))  # fmt: skip
        print(
            f"prefill bm{bm} bn{bn} w{w} st{st}: {us:.0f} us {tf:.0f} TFLOP/s;"
            f" sdpa {sdpa:.0f} us {sdpa_tf:.0f} TFLOP/s"
        )
    return rows


def sweep(out: Path, small: bool) -> None:
    res = {"device": torch.cuda.get_device_name(), "decode": decode_sweep()}
    res["prefill"] = prefill_sweep()
    (out / "sweep.json").write_text(json.dumps(res, indent=1))


SPLIT_SHAPES = [(h, 1, b, kv) for h in (128, 16) for b in (1, 4, 16) for kv in (4096, 32768)]


def split_sweep(out: Path, small: bool, shapes: list[tuple[int, ...]] | None = None) -> None:
    """Our decode with the backend's launch config at 1-128 KV splits, each replayed from a
    CUDA graph, against raw FlashMLA's replay on the same inputs; the backend's own choice
    marked. `shapes` (H, q, B, kv) replace `SPLIT_SHAPES`."""
    rows = []
    for shape in shapes or SPLIT_SHAPES:
        s = decode_setup("triton", *shape)
        be = triton_backend(s)
        be.init_forward_metadata(s.batch)
        md = be.metadata
        assert md is not None
        fm = graph_us(flashmla_call(s))
        bm = md.block_m  # the backend's own choice for this grid (its rows a program)
        line = []
        for splits in (1, 2, 4, 8, 16, 32, 64, 128):
            if splits * 64 > s.kv_len:
                break
            cfg = be._launch_cfg(bm, s.batch.batch_size, splits, s.q_nope.dtype)
            bn, w, st = int(cfg["block_n"]), int(cfg["num_warps"]), int(cfg["num_stages"])
            # the kernel the backend launches: Gluon only where the config says so (the first
            # sweep passed the backend's Gluon flag, so its H16 rows ran the Gluon kernel)
            gluon = bool(cfg.get("gluon", False))
            call = decode_call(s, bm, bn, w, st, splits, bool(cfg["tma"]), gluon)[0]
            us = graph_us(call)
            rows.append(dict(heads=s.heads, batch=s.batch.batch_size, kv=s.kv_len, splits=splits,
                             us=us, flashmla_us=fm, chosen=splits == md.num_splits))  # fmt: skip
            line.append(f"{splits}{'*' if splits == md.num_splits else ''}:{fm / us:.2f}")
        print(f"H{s.heads} B{s.batch.batch_size} kv{s.kv_len} FlashMLA {fm:.1f} us; "
              f"FlashMLA / ours by splits: " + " ".join(line))  # fmt: skip
        del s, be
        torch.cuda.empty_cache()
    (out / "splits.json").write_text(json.dumps(rows, indent=1))


def ir_counts(ttgir: str) -> dict[str, int]:
    pats = {
        "wgmma": r"warp_group_dot ",
        "mma_v2": r"tt\.dot ",
        "async_copy": r"async_copy_global_to_local",
        "local_alloc": r"ttg\.local_alloc",
        "tma": r"async_tma_copy",
    }
    return {k: len(re.findall(p, ttgir)) for k, p in pats.items()}


def regs(out: Path, small: bool) -> None:
    from mla_backends.kernels.mla_attention import _mla_attn_kernel

    def compiled() -> list:  # type: ignore[type-arg]
        return list(_mla_attn_kernel.device_caches[torch.cuda.current_device()][0].values())

    rows = []
    for shape, cfgs in (REGS_SMALL if small else REGS_SHAPES).items():
        s, nbytes, flops, fm = measured_setup(shape)
        for cfg in cfgs:
            before = set(map(id, compiled()))
            try:
                us = bench_us(decode_call(s, *cfg)[0], 10, 40)
            except Exception as e:  # out of resources
                print(f"{shape} {cfg}: {type(e).__name__} {str(e)[:100]}")
                continue
            new = [k for k in compiled() if id(k) not in before]
            info: dict = {}
            if new:
                k = new[0]
                if shape[0] == 128 and cfg[5]:  # the device tool returns few files
                    tag = "h{}q{}b{}-".format(*shape[:3]) + "-".join(map(str, cfg))
                    (out / f"{tag}.ttgir").write_text(k.asm["ttgir"])
                info = dict(n_regs=k.n_regs, n_spills=k.n_spills, shared=k.metadata.shared,
                            **ir_counts(k.asm["ttgir"]))  # fmt: skip
            rows.append({**probe_row(s, cfg, us, fm, nbytes, flops), **info})
            print(json.dumps(rows[-1]))
        del s
        torch.cuda.empty_cache()
    (out / "probe.json").write_text(json.dumps(rows, indent=1))


def probe(out: Path, small: bool) -> None:
    rows = []
    for shape, cfgs in PROBE_SHAPES.items():
        s, nbytes, flops, fm = measured_setup(shape)
        wide = shape[0] * shape[1] > 32
        # the reference: the gather kernel as it ran before TMA tiles and Gluon
        ref_call, ref_out, ref_lse = decode_call(
            s, 64 if wide else 16, 64, 8 if wide else 4, 2, 1, False, False
        )
        ref_call()
        for cfg in cfgs:
            call, o, lse = decode_call(s, *cfg)
            try:
                call()
                torch.cuda.synchronize()
                us = bench_us(call, 10, 40)
            except Exception as e:  # out of resources, launch failure
                print(f"{shape} {cfg}: {type(e).__name__} {str(e)[:300]}")
                heads, q_len, batch, kv = shape
                rows.append(dict(heads=heads, q_len=q_len, batch=batch, kv=kv, cfg=cfg,
                                 error=str(e)[:300]))  # fmt: skip
                continue
            rows.append(probe_row(s, cfg, us, fm, nbytes, flops))
            rows[-1]["out_diff"] = (o.float() - ref_out.float()).abs().max().item()
            rows[-1]["lse_diff"] = (lse - ref_lse).abs().max().item()
            rows[-1]["nan"] = bool(torch.isnan(o).any().item())
            print(json.dumps(rows[-1]), flush=True)
        del s
        torch.cuda.empty_cache()
    (out / "probe-gluon.json").write_text(json.dumps(rows, indent=1))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="tune_triton.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("command", choices=["sweep", "regs", "probe", "splits"])
    p.add_argument("out", nargs="?", default="/tmp", type=Path, help="folder for the JSON")
    p.add_argument("--small", action="store_true", help="regs: the small-batch shapes")
    p.add_argument("--shapes", default="", help="splits: H:q:B:kv,... instead of the defaults")
    a = p.parse_args(argv)
    reason = "no CUDA GPU here" if not torch.cuda.is_available() else missing("sgl_kernel")
    if reason:  # every command times raw FlashMLA (sgl_kernel) on a GPU
        print(f"tune_triton.py {a.command}: cannot run: {reason}", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    if a.command == "splits":
        shapes = [tuple(int(x) for x in v.split(":")) for v in a.shapes.split(",") if v]
        split_sweep(a.out, a.small, shapes)
        return 0
    {"sweep": sweep, "regs": regs, "probe": probe}[a.command](a.out, a.small)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
