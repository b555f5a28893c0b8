"""Where the host time of flashinfer_mla's decode metadata goes (16 heads, kv 1024, batch 256
by default): the whole `init_forward_metadata`, the host-side length arithmetic, the
page-index launch, our schedule + page-id launch (what the backend uses), and, for
comparison, our host `plan` wrapper and FlashInfer's C++ planner alone. Median of 50 calls
each (`timing.host_us`); the schedule kernel's own GPU time inside a CUDA graph. GPU only."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from mla_backends.backends.base import Capability
from mla_backends.bench.fixtures import (
    DecodeSetup,
    decode_setup,
    require_fits,
    require_runs,
    setup_config,
)
from mla_backends.bench.options import Options, pick
from mla_backends.bench.report import write
from mla_backends.bench.timing import host_us
from mla_backends.cli import out_of_memory
from mla_backends.config import Config, ConfigError

HEADS, KV_LEN = 16, 1024


def parts(s: DecodeSetup) -> dict[str, Callable[[], object]]:
    """The metadata's pieces, each a no-argument call on setup `s`."""
    from mla_backends.backends.flashinfer_kernel import host_lengths
    from mla_backends.backends.flashinfer_mla import FlashInferMLABackend
    from mla_backends.kernels.fi_schedule import PageGather
    from mla_backends.kernels.index import flat_page_indices

    be, b = s.rt.backend, s.batch
    if not isinstance(be, FlashInferMLABackend):
        raise TypeError(f"fi-plan times flashinfer_mla, the setup built {be.name}")
    ps = be.pool.page_size
    h = host_lengths(b, ps)
    qo_indptr, kv_indptr, seq = (torch.from_numpy(x) for x in (h.qo_indptr, h.kv_indptr, h.seq))
    total, maxp = int(h.kv_indptr[-1]), int(h.pages.max())
    k = be.kernel
    raw = k.module._module
    args = (k.float_ws, k.int_ws, k.pinned[0], qo_indptr, kv_indptr, seq, HEADS, 512, True)
    r2t = be.req_to_token
    out = torch.empty(total, dtype=torch.int32, device="cuda")
    gather = PageGather(r2t, b.req_pool_indices, out, maxp)
    return {
        "init_forward_metadata": lambda: be.init_forward_metadata(b),
        "host length arithmetic": lambda: host_lengths(b, ps),
        "page-index launch": lambda: flat_page_indices(
            r2t, b.req_pool_indices, b.seq_lens, ps, total, maxp
        ),
        "our plan wrapper": lambda: k.plan(qo_indptr, kv_indptr, seq, HEADS, 512, True),
        "schedule + page ids launch": lambda: k.plan_on_device(b, HEADS, 512, ps, gather),
        "FlashInfer C++ plan alone": lambda: raw.plan(*args),
    }


def profile(s: DecodeSetup) -> None:
    """cProfile of 300 metadata builds: where the host time of the whole call goes."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        s.rt.backend.init_forward_metadata(s.batch)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def run(opts: Options, config: Config) -> None:
    import triton.testing

    dev = config.torch_device
    if dev.type != "cuda":  # host time of a GPU batch's metadata: CUDA events, a GPU
        raise ConfigError("--suite fi-plan: needs a CUDA GPU (it times a GPU batch's metadata)")
    batches = pick(opts.batch, [256])
    cap = Capability.detect(dev)
    for batch in batches:  # before any timing: one line if flashinfer_mla cannot run or fit
        cfg = setup_config("flashinfer_mla", HEADS, batch, KV_LEN, device=str(dev))
        require_runs("flashinfer_mla", cfg, cap, option="--suite fi-plan")
        require_fits(cfg, f"--batch {batch}")
    rows = []
    for batch in batches:
        with out_of_memory(f"--batch {batch}", dev):
            s = decode_setup("flashinfer_mla", HEADS, 1, batch, KV_LEN, device=str(dev))
            calls = parts(s)
        for name, fn in calls.items():
            us = host_us(fn)
            rows.append(dict(batch=batch, part=name, host_us=us))
            print(f"batch {batch}: {name:28s} {us:8.1f} us (host)")
        # inside a CUDA graph, so the kernel's own time, not the launch rate
        gpu = 1e3 * triton.testing.do_bench_cudagraph(calls["schedule + page ids launch"], rep=100)
        rows.append(dict(batch=batch, part="schedule + page ids kernel", gpu_us=gpu))
        print(f"batch {batch}: {'schedule + page ids kernel':28s} {gpu:8.1f} us (GPU, graph)")
        if opts.cprofile:
            profile(s)
    result = {"device": cap.describe(), "torch": torch.__version__, "rows": rows}
    print(f"wrote {write(Path(opts.out), {'fi-plan.json': result})[0]}")
