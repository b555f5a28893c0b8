"""Decode metadata host time: the host microseconds of each backend's
`init_forward_metadata` for a decode batch (16 heads, kv 1024, batch 256 by default), median
of 50 calls with at most three batches in flight (`timing.host_us`), against the project's
target of 100 µs. The number depends on the host CPU behind the GPU (up to 2x between
machines of one kind), so it is a benchmark, not a test assertion; `tests/
test_kernel_backends.py` checks what does not depend on the host: no call waits for the GPU.
GPU only."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from mla_backends.backends.base import Capability
from mla_backends.bench.fixtures import (
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
TARGET_US = 100.0
BACKENDS = ["flashinfer_mla", "flashmla"]


def run(opts: Options, config: Config) -> None:
    dev = config.torch_device
    if dev.type != "cuda":  # host time of a GPU batch's metadata: CUDA events, a GPU
        raise ConfigError("--suite metadata: needs a CUDA GPU (it times a GPU batch's metadata)")
    names, batches = pick(opts.backends, BACKENDS), pick(opts.batch, [256])
    cap = Capability.detect(dev)
    for name in names:  # before any timing: one line if a backend cannot run here or fit
        for batch in batches:
            cfg = setup_config(name, HEADS, batch, KV_LEN, device=str(dev))
            require_runs(name, cfg, cap, option="--suite metadata")
            require_fits(cfg, f"--batch {batch}")
    rows = []
    for name in names:
        for batch in batches:
            with out_of_memory(f"--batch {batch}", dev):
                s = decode_setup(name, HEADS, 1, batch, KV_LEN, device=str(dev))
                us = host_us(partial(s.rt.backend.init_forward_metadata, s.batch))
            met = "met" if us <= TARGET_US else "not met"
            rows.append(dict(backend=name, batch=batch, host_us=us, target_us=TARGET_US))
            print(f"{name:15s} batch {batch:4d}: {us:7.1f} us (host); <= {TARGET_US:.0f} us: {met}")
    result = {"device": cap.describe(), "torch": torch.__version__, "rows": rows}
    print(f"wrote {write(Path(opts.out), {'metadata.json': result})[0]}")
