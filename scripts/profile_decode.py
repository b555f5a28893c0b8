"""Dense decode kernel by kernel: our `triton` backend's call and raw FlashMLA's (the Hopper
table's calls, `mla_backends/bench/hopper.py`) each captured in a CUDA graph and replayed under
the torch profiler with L2 flushed before every replay (`scripts/profile_step.py`): per kernel
median durations and the span of each graph.

    python scripts/profile_decode.py --shapes 16:1:16:4096,64:1:16:4096 --out $OUT/prof
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_step import profile  # noqa: E402

from mla_backends.bench.fixtures import decode_setup  # noqa: E402
from mla_backends.bench.hopper import _ours  # noqa: E402
from mla_backends.bench.peers import PEER_CALLS  # noqa: E402
from mla_backends.bench.timing import capture_graph  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="16:1:16:4096,64:1:16:4096,16:1:64:4096")
    p.add_argument("--peers", default="raw_flashmla")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    res = []
    for spec in a.shapes.split(","):
        h, q, b, kv = (int(x) for x in spec.split(":"))
        s = decode_setup("triton", h, q, b, kv)
        makers = {"ours": partial(_ours, s)}
        makers |= {peer: partial(PEER_CALLS[peer], s) for peer in a.peers.split(",") if peer}
        for name, make in makers.items():
            row = {"shape": spec, "call": name, **profile(capture_graph(make()))}
            res.append(row)
            print(json.dumps(row), flush=True)
        del s
        torch.cuda.empty_cache()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_decode.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
