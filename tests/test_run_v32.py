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
    # the reference follows the served run's selections; at layer 0 it must pick them itself
    # (3 layers x (1 prefill + 2 decode steps): 3 layer-0 calls)
    assert "picked the same sets on its own in 3 of 3 calls" in proc.stdout


def test_reference_run_follows_the_served_selections() -> None:
    """`Selections`: the reference run's indexer returns the served run's picks in call
    order, counts the layer-0 calls whose own picks match as sets, and refuses calls that do
    not line up."""
    import pytest
    import torch

    from mla_backends.models.run import Selections

    class Ix:
        def __init__(self, *picks: list[list[int]]) -> None:
            self.picks = [torch.tensor(p) for p in picks]

        def select(self, layer: int, *args: object) -> torch.Tensor:
            return self.picks.pop(0)

    sel, served, ref = Selections(), Ix([[3, 1, -1]], [[7, 5, 4]]), Ix([[1, 3, -1]], [[0, 0, 0]])
    sel.record(served)
    a, b = served.select(0), served.select(1)
    sel.follow(ref)
    assert torch.equal(ref.select(0), a) and torch.equal(ref.select(1), b)
    assert (sel.layer0_calls, sel.layer0_same) == (1, 1)
    sel, served, ref = Selections(), Ix([[2, 8]]), Ix([[2, 9]])
    sel.record(served)
    served.select(0)
    sel.follow(ref)
    ref.select(0)
    assert (sel.layer0_calls, sel.layer0_same) == (1, 0)  # a differing layer-0 pick counts
    sel, served, ref = Selections(), Ix([[1]]), Ix([[1]])
    sel.record(served)
    served.select(0)
    sel.follow(ref)
    with pytest.raises(RuntimeError, match="do not line up"):
        ref.select(1)


def test_unknown_sparse_backend_is_one_line(cli: Cli, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("sparse_backend: bogus\n")
    proc = cli("run", "--config", str(cfg))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "sparse_backend='bogus' is not one of ['auto', 'flashmla'" in proc.stderr
