"""The Hopper decode table: our `triton` backend (the Gluon / `tl.dot` kernel) against raw
FlashMLA and raw FlashInfer fa3 in one process, every call timed twice: eager (median of
`do_bench`) and replayed from a captured CUDA graph (the time a serving engine's decode graph
pays). Each call runs three times before any timing, so compiles and first calls stay out of
every row. Ratios are peer / ours on the graph replays; bandwidth is ours against the copy
ceiling measured at the start of the run.

Parts (`--part`), one per target of the kernel work:
- `h128`: H 128, q_len 1 and 2, B 64-256, kv 1k-32k, bf16;
- `small`: H 128 and 16, B 1 / 4 / 16, kv 4k and 32k, bf16;
- `heads`: H 16 / 32 / 64, B 16-256, kv 4k and 32k, bf16 (bandwidth-bound);
- `fp8`: FP8 pools (e4m3, one scale), H 128 and 16, B 16-128, kv 4k-32k, against fa3 FP8
  (FlashMLA's dense SM90 kernel takes no FP8 pool).
`--shapes H:q:B:kv,...` replaces a part's shapes."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from mla_backends.backends.base import Capability
from mla_backends.bench.fixtures import (
    DecodeSetup,
    decode_setup,
    require_fits,
    require_runs,
    setup_config,
    traffic,
)
from mla_backends.bench.options import Options, Shape, pick, shape_text
from mla_backends.bench.peers import PEER_CALLS
from mla_backends.bench.report import progress, write
from mla_backends.bench.timing import bench_us, ceilings, graph_us
from mla_backends.cli import out_of_memory
from mla_backends.config import Config, ConfigError

BF16 = "bfloat16"
FP8 = "float8_e4m3fn"
PARTS: dict[str, tuple[str, list[Shape]]] = {
    "h128": (BF16, [(128, q, b, kv) for q in (1, 2) for b in (64, 128, 256)
                    for kv in (1024, 4096, 8192, 16384, 32768)]),
    "small": (BF16, [(h, 1, b, kv) for h in (128, 16) for b in (1, 4, 16) for kv in (4096, 32768)]),
    "heads": (BF16, [(h, 1, b, kv) for h in (16, 32, 64) for b in (16, 64, 256)
                     for kv in (4096, 32768)]),
    "fp8": (FP8, [(h, 1, b, kv) for h in (128, 16) for b in (16, 64, 128) for kv in (4096, 32768)]),
}  # fmt: skip
PEERS = {BF16: ("raw_flashmla", "raw_flashinfer_fa3"), FP8: ("raw_flashinfer_fa3",)}


def _ours(s: DecodeSetup) -> Callable[[], object]:
    be = s.rt.backend
    be.init_forward_metadata(s.batch)  # once per batch, outside the timed call
    return lambda: be.forward_absorbed(0, s.q_nope, s.q_rope, None, None, s.batch)


def _timed(make: Callable[[], Callable[[], object]]) -> dict[str, float | str]:
    """Eager and graph-replay medians (us) of one call, after three warm-up calls; a call that
    cannot run is recorded as its one-line error."""
    try:
        fn = make()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        return {"eager_us": bench_us(fn), "graph_us": graph_us(fn)}
    except Exception as e:  # a peer missing here is reported in its row, not fatal
        return {"error": f"{type(e).__name__}: {e}"[:200]}


def hopper_row(
    shape: Shape, kv_dtype: str, device: str, copy_gbps: float, backend: str = "triton"
) -> dict:
    """One shape: ours and each peer of the pool's dtype, eager and graph, with the ratios."""
    heads, q_len, batch, kv_len = shape
    s = decode_setup(backend, heads, q_len, batch, kv_len, kv_dtype=kv_dtype, device=device)
    row: dict = {"heads": heads, "q_len": q_len, "batch": batch, "kv_len": kv_len}
    row["kv_dtype"] = kv_dtype
    row["ours"] = _timed(partial(_ours, s))
    for peer in PEERS[kv_dtype]:
        row[peer] = _timed(partial(PEER_CALLS[peer], s))
    nbytes, flops = traffic(s)
    row["bytes"], row["flops"] = nbytes, flops
    ours = row["ours"].get("graph_us")
    if isinstance(ours, float):
        row["gbps"] = nbytes / ours / 1e3
        row["copy_fraction"] = row["gbps"] / copy_gbps
        row["tflops"] = flops / ours / 1e6
        for peer in PEERS[kv_dtype]:
            theirs = row[peer].get("graph_us")
            if isinstance(theirs, float):
                row[f"{peer}/ours"] = theirs / ours
    return row


def markdown(rows: list[dict]) -> str:
    peers = list(dict.fromkeys(p for r in rows for p in PEERS[r["kv_dtype"]]))
    head = ["H", "q", "B", "kv", "pool", "ours eager", "ours graph"]
    for p in peers:
        head += [f"{p} eager", f"{p} graph", f"{p} / ours (graph)"]
    head += ["ours GB/s", "of copy", "ours TFLOP/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(x: object, fmt: str) -> str:
        return format(x, fmt) if isinstance(x, float) else "-"

    for r in rows:
        cells = [str(r[k]) for k in ("heads", "q_len", "batch", "kv_len")] + [r["kv_dtype"]]
        cells += [f(r["ours"].get("eager_us"), ".1f"), f(r["ours"].get("graph_us"), ".1f")]
        for p in peers:
            t = r.get(p, {})
            cells += [f(t.get("eager_us"), ".1f"), f(t.get("graph_us"), ".1f")]
            cells += [f(r.get(f"{p}/ours"), ".2f")]
        cells += [f(r.get("gbps"), ".0f"), f(r.get("copy_fraction"), ".2f")]
        cells += [f(r.get("tflops"), ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(opts: Options, config: Config) -> None:
    dev = config.torch_device
    if dev.type != "cuda":
        raise ConfigError("--suite hopper: needs a CUDA GPU (it times raw FlashMLA and fa3)")
    part = pick(opts.part, "small")
    kv_dtype, shapes = PARTS[part]
    shapes = opts.shapes or shapes
    cap = Capability.detect(dev)
    for shape in shapes:  # every shape runs and fits, or nothing is timed
        h, _, b, kv = shape
        cfg = setup_config("triton", h, b, kv, kv_dtype=kv_dtype, device=str(dev))
        require_runs("triton", cfg, cap)
        require_fits(cfg, f"--part {part}, --shapes {shape_text(shape)}")
    ceil = ceilings(dev)
    result: dict = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    result |= {"part": part, "ceilings": ceil, "rows": []}
    step = progress(len(shapes))
    for shape in shapes:
        with out_of_memory(f"--part {part}, --shapes {shape_text(shape)}", dev):
            result["rows"].append(hopper_row(shape, kv_dtype, str(dev), ceil["copy_gbps"]))
        torch.cuda.empty_cache()  # the shape's pool and graphs are gone with its setup
        step("H{}:q{}:B{}:kv{}".format(*shape))
    text = markdown(result["rows"])
    paths = write(Path(opts.out), {f"hopper-{part}.json": result, f"hopper-{part}.md": text})
    print(text)
    print("wrote " + ", ".join(map(str, paths)))
