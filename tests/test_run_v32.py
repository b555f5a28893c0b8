"""`run` serves a DeepSeek-V3.2 checkpoint (indexer + sparse attention) and checks it against
the fp64 references (dense and sparse); the config names the sparse backend."""

from __future__ import annotations

from pathlib import Path

from conftest import Cli


def test_run_serves_a_v32_model_against_the_fp64_references(cli: Cli, tmp_path: Path) -> None:
    cfg = tmp_path / "f32.yaml"
    cfg.write_text("device: cpu\nkv_dtype: float32\ndtype: float32\nsparse_backend: torch\n")
    proc = cli(
        "run", "--random", "tiny-v32", "--requests", "3", "--max-new", "3", "--config", str(cfg)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sparse=torch" in proc.stdout
    # prompts of 14 and 25 tokens over index_topk 8: the indexer's selection is in play
    assert "prompt lengths [3, 14, 25]" in proc.stdout and ": agree" in proc.stdout


def test_unknown_sparse_backend_is_one_line(cli: Cli, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("sparse_backend: bogus\n")
    proc = cli("run", "--config", str(cfg))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "sparse_backend='bogus' is not one of ['auto', 'flashmla'" in proc.stderr
