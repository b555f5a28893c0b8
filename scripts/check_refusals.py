"""Print what choosing each backend in YAML gives on this machine: the resolved config or the
ConfigError. On a Hopper GPU the SM100 backends must be refused at load, naming the GPU."""

from __future__ import annotations

import tempfile
from pathlib import Path

from mla_backends.config import ConfigError, load_config

CASES = {
    "cutlass_mla": "page_size: 128",
    "trtllm_mla": "page_size: 64",
    "flashmla": "page_size: 64",
    "flashinfer_mla": "page_size: 64",
    "triton": "page_size: 64",
}

if __name__ == "__main__":
    failed = False
    for name, extra in CASES.items():
        text = f"model: deepseek-v3\ndecode_backend: {name}\nprefill_backend: triton\n{extra}\n"
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / f"{name}.yaml"
            path.write_text(text)
            try:
                cfg = load_config(path)
                print(f"{name:<15} accepted: decode={cfg.decode_backend} page={cfg.page_size}")
            except ConfigError as e:
                print(f"{name:<15} refused: {e}")
