"""`run` serves a DeepSeek-V3.2 checkpoint (indexer + sparse attention) and checks it against
the fp64 references (dense and sparse); it names the sparse backend that ran."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import Cli


def skew_served_sparse_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """The served run's `torch` sparse attention off by 2^-7 (the fp64 reference's is not):
    enough to flip a near-tie (an expert route, a greedy token) in a bf16 tiny V3.2."""
    from mla_backends.sparse import torch_backend as TB

    own = TB.TorchSparseBackend._attend

    def scaled(self, layer, q_nope, q_rope, indices):  # type: ignore[no-untyped-def]
        out, lse = own(self, layer, q_nope, q_rope, indices)
        if self.name == "torch":  # the served run's backend, not the fp64 reference
            out = (out.float() * (1 + 2**-7)).to(out.dtype)
        return out, lse

    monkeypatch.setattr(TB.TorchSparseBackend, "_attend", scaled)


def test_run_serves_a_v32_model_against_the_fp64_references(cli: Cli, tmp_path: Path) -> None:
    cfg = tmp_path / "f32.yaml"
    cfg.write_text("device: cpu\nkv_dtype: float32\ndtype: float32\nsparse_backend: auto\n")
    proc = cli(
        "run", "--random", "tiny-v32", "--requests", "3", "--max-new", "3", "--config", str(cfg)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sparse=torch" in proc.stdout  # the backend "auto" chose here, not "auto"
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


def test_run_comparison_measures_attention_not_discrete_flips(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bf16 tiny V3.2 on CPU, its sparse attention scaled by (1 + 2^-7) (about the rounding
    difference of a bf16 kernel): that flips a near-tie (an expert route or a greedy token)
    and, run independently, moved the logits by ~100 %; with the reference run following the
    served run's selections, routes and tokens, the logits differ by about the perturbation,
    within `run`'s bf16 tolerance."""
    import dataclasses
    import tempfile

    import torch

    from mla_backends.backends.registry import resolve_backends
    from mla_backends.config import load_config
    from mla_backends.models import run as R
    from mla_backends.models.loader import load_model

    base = dataclasses.replace(load_config(None), device="cpu", max_context_len=128)
    with tempfile.TemporaryDirectory() as tmp:
        R.save_random("tiny-v32", Path(tmp), 0)
        model = load_model(Path(tmp), dtype=base.torch_dtype, device=base.torch_device)
    c = model.cfg
    cfg = dataclasses.replace(
        base, model=c.attention_dims, num_layers=c.num_hidden_layers, sparse_backend="torch",
        prefill_backend="torch", decode_backend="torch",
    )  # fmt: skip
    config = resolve_backends(cfg, "test")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, c.vocab_size, (n,), generator=gen).tolist() for n in (3, 14, 25)]
    skew_served_sparse_attention(monkeypatch)
    sel = R.Selections()
    served = R._serve(model, config, prompts, 3, selections=sel)
    ref = R._serve(model, config, prompts, 3, True, sel, feed=served.tokens).steps
    diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(served.steps, ref))
    assert sel.layer0_calls == sel.layer0_same == 3 and sel.routes == 96
    assert 2**-9 < diff <= R.AGREE["bfloat16"], diff


def test_selections_snapshot_the_served_picks_and_refuse_a_mismatched_shape() -> None:
    """An indexer that hands back one buffer, rewritten each call (a graph's static output):
    the recorded picks are copies, not views of the next call's; a reference call whose
    selection has another shape than the served one is refused."""
    import torch

    from mla_backends.models.run import Selections

    class Ix:
        def __init__(self, *picks: list[list[int]]) -> None:
            self.picks = [torch.tensor(p) for p in picks]
            self.buf = torch.zeros_like(self.picks[0])

        def select(self, layer: int, *args: object) -> torch.Tensor:
            return self.buf.copy_(self.picks.pop(0))

    sel, served = Selections(), Ix([[1, 2]], [[3, 4]])
    sel.record(served)
    served.select(0), served.select(1)
    assert [p.tolist() for _, p in sel.picked] == [[[1, 2]], [[3, 4]]]
    sel, served, ref = Selections(), Ix([[1, 2]]), Ix([[1, 2, 0]])
    sel.record(served)
    served.select(1)
    sel.follow(ref)
    with pytest.raises(RuntimeError, match="indexer calls do not line up"):
        ref.select(1)


def test_selections_follow_the_served_expert_routes_and_count_flips() -> None:
    """Every MoE gate of the model records the served run's routes, then the reference run
    takes them in call order; a route whose experts differ as a set counts as differing (an
    order flip does not); a route of another shape is refused; `ungate` unhooks every gate."""
    import torch

    from mla_backends.models.deepseek_v3 import Gate
    from mla_backends.models.run import RANDOM_SIZES, Selections, random_model

    model = random_model(dict(RANDOM_SIZES["tiny"], num_hidden_layers=2), 0)
    gates = [m for m in model.modules() if isinstance(m, Gate)]
    assert gates
    sel = Selections()
    sel.gates(model, follow=False)
    served = [torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.tensor([[6, 7]])]
    for idx in served:
        assert torch.equal(gates[0].routes(idx), idx)  # type: ignore[misc]
    sel.gates(model, follow=True)
    mine = torch.tensor([[1, 0], [2, 5], [4, 5]])  # token 0 reordered, token 1 flipped
    assert torch.equal(gates[-1].routes(mine), served[0])  # type: ignore[misc]
    assert (sel.routes, sel.routes_differ) == (3, 1)
    with pytest.raises(RuntimeError, match="expert routes do not line up"):
        gates[0].routes(torch.tensor([[6, 7, 8]]))  # type: ignore[misc]
    sel.ungate(model)
    assert all(g.routes is None for g in gates)
