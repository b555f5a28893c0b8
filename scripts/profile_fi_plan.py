"""Where the host time of flashinfer_mla's decode metadata goes (batch 256, 16 heads, kv 1024):
the whole `init_forward_metadata`, the host-side length arithmetic, the page-index launch,
our schedule + page-id launch (what the backend uses), and, for comparison, our host `plan`
wrapper and FlashInfer's C++ planner alone. Median of 50 calls each. GPU only."""

from __future__ import annotations

import statistics
import sys
import time

import torch

from mla_backends.backends.flashinfer_mla import host_lengths
from mla_backends.bench.fixtures import decode_setup
from mla_backends.kernels.fi_schedule import PageGather
from mla_backends.kernels.index import flat_page_indices


def med_us(fn, n: int = 50) -> float:  # type: ignore[no-untyped-def]
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for i in range(n):
        if i % 3 == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6


def main(batch: int = 256) -> None:
    s = decode_setup("flashinfer_mla", 16, 1, batch, 1024)
    be, b = s.rt.backend, s.batch
    ps = be.pool.page_size
    h = host_lengths(b, ps)
    qo_indptr, kv_indptr, seq = (torch.from_numpy(x) for x in (h.qo_indptr, h.kv_indptr, h.seq))
    total, maxp = int(h.kv_indptr[-1]), int(h.pages.max())
    k = be.kernel
    raw = k.module._module
    args = (k.float_ws, k.int_ws, k.pinned[0], qo_indptr, kv_indptr, seq, 16, 512, True)

    gather = PageGather(
        be.req_to_token,
        b.req_pool_indices,
        torch.empty(total, dtype=torch.int32, device="cuda"),
        maxp,
    )
    parts = {
        "init_forward_metadata": lambda: be.init_forward_metadata(b),
        "host length arithmetic": lambda: host_lengths(b, ps),
        "page-index launch": lambda: flat_page_indices(
            be.req_to_token, b.req_pool_indices, b.seq_lens, ps, total, maxp
        ),
        "our plan wrapper": lambda: k.plan(qo_indptr, kv_indptr, seq, 16, 512, True),
        "schedule + page ids launch": lambda: k.plan_on_device(b, 16, 512, ps, gather),
        "FlashInfer C++ plan alone": lambda: raw.plan(*args),
    }
    for name, fn in parts.items():
        print(f"batch {batch}: {name:28s} {med_us(fn):8.1f} us (host)")
    import triton.testing

    # inside a CUDA graph, so the kernel's own time, not the launch rate
    gpu = triton.testing.do_bench_cudagraph(parts["schedule + page ids launch"], rep=100)
    print(f"batch {batch}: {'schedule + page ids kernel':28s} {gpu * 1e3:8.1f} us (GPU, graph)")
    if "--cprofile" in sys.argv:  # where the host time of the whole call goes
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            be.init_forward_metadata(b)
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 256)
