"""The roofline plot of a grid run (matplotlib, optional: `pip install 'mla-backends[plot]'`)."""

from __future__ import annotations

import itertools
from pathlib import Path

from mla_backends.bench.report import timings


def plot_roofline(result: dict, path: Path) -> None:
    """Achieved TFLOP/s against arithmetic intensity, with both ceilings drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = result["ceilings"]
    kind = "ceiling" if c.get("is_ceiling", True) else "reference (not a ceiling)"
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ai_all = [r["flops"] / r["bytes"] for r in result["rows"]]
    lo, hi = min(ai_all) / 2, max(ai_all) * 4
    xs = [lo * (hi / lo) ** (i / 99) for i in range(100)]
    bw = [c["copy_gbps"] * x / 1e3 for x in xs]
    ax.plot(xs, bw, "b--", lw=1, label=f"copy {kind} {c['copy_gbps']:.3g} GB/s")
    ax.axhline(
        c["matmul_tflops"],
        color="r",
        ls="--",
        lw=1,
        label=f"{c.get('matmul_what', 'bf16 matmul')} {kind} {c['matmul_tflops']:.3g} TFLOP/s",
    )
    if c.get("is_ceiling", True):
        ax.plot(xs, [min(b, c["matmul_tflops"]) for b in bw], "k-", lw=2, label="roofline")
    markers = itertools.cycle("osD^v<>ph*")
    names = sorted({n for r in result["rows"] for n, _ in timings(r)})
    for name, m in zip(names, markers):
        pts = [
            (r["flops"] / r["bytes"], r["flops"] / r[f"{name}_us"] / 1e6)
            for r in result["rows"]
            if f"{name}_us" in r
        ]
        ax.scatter(*zip(*pts), marker=m, label=name, alpha=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte of KV cache + q + out)")
    ax.set_ylabel("achieved TFLOP/s")
    title = f"MLA decode on {result['device']}"
    ax.set_title(title if c.get("is_ceiling", True) else title + ": reference rates, not ceilings")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
