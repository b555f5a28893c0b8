"""The README's example runs, and its two set-up commands are the ones CI uses."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
from pathlib import Path

from conftest import Cli

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
COMMANDS = re.findall(r"```bash\n(.*?)\n```", README, re.S)


def test_readme_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run installs what the README's test command installs, in a fresh virtualenv, and
    runs its test command: the whole command, install and test, appears in it verbatim."""
    assert len(COMMANDS) >= 2
    ci = (ROOT / ".ci" / "run").read_text()
    assert COMMANDS[1].strip() in ci
    assert "python3 -m venv" in ci and "TRITON_INTERPRET=1" in ci


def test_readme_verify_command_passes_from_an_empty_folder(cli: Cli) -> None:
    """The README's first command (after its install step), run where a user would: any
    folder. No --config: the default shipped in the package. On a CPU with triton installed
    the triton backend runs too, under the interpreter, at the default model's dims."""
    install, verify = COMMANDS[0].split("&&")
    assert install.split()[:2] == ["pip", "install"]
    argv = shlex.split(verify)
    assert argv[:2] == ["mla-backends", "verify"], verify
    # As a user's shell has it: no TRITON_INTERPRET (verify sets it itself on a CPU).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = cli(*argv[1:], env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout and "passed, 0 failed" in proc.stdout
    assert re.search(r"this config's backends \S+: (\d+) of \1 rows pass", proc.stdout)
    rows = [line.split() for line in proc.stdout.splitlines() if line.endswith("PASS")]
    assert "torch" in {r[0] for r in rows}
    if importlib.util.find_spec("triton") is not None:
        modes = {r[1] for r in rows if r[0] == "triton"}
        assert modes == {"decode", "verify", "extend", "mha-prefill", "mha-prefix-chunk"}, (
            proc.stdout
        )


def test_verify_exits_2_on_bad_config(cli: Cli, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("page_size: 12\n")
    proc = cli("verify", "--config", str(bad))
    assert proc.returncode == 2 and "page_size=12" in proc.stderr
    assert "Traceback" not in proc.stderr


def _resolve(dotted: str) -> object:
    """`pkg.mod.Name.attr` (or `pkg.mod:attr`) -> the object: submodules imported while they
    are packages' modules, then attributes."""
    parts = dotted.replace(":", ".").split(".")
    obj: object = importlib.import_module(parts[0])
    for i, attr in enumerate(parts[1:], 1):
        if not hasattr(obj, attr) and hasattr(obj, "__path__"):
            importlib.import_module(".".join(parts[: i + 1]))
        obj = getattr(obj, attr)
    return obj


def test_readme_dotted_names_and_their_keywords_exist() -> None:
    """Every `mla_backends....` name the prose gives resolves, and every keyword it shows a
    call of (`DSABackend.build(..., topk_path=...)`) is a parameter: a name a newcomer copies
    from the README once named a module that does not export it."""
    import inspect

    names = set(re.findall(r"`(mla_backends(?:[.:]\w+)+)", README))
    assert "mla_backends.reference.batch_reference" in names
    for dotted in sorted(names):
        _resolve(dotted)
    short = {"DSABackend": "mla_backends.sparse.dsa.DSABackend"}
    calls = re.findall(r"`((?:mla_backends\.)?[\w.]+)\(\.\.\.,\s+(\w+)=", README)
    assert ("mla_backends.sparse.dsa.DSABackend.build", "topk_path") in calls  # wrapped
    assert calls, "README shows no call with a keyword"
    for func, keyword in calls:
        head, _, rest = func.partition(".")
        target = _resolve(f"{short[head]}.{rest}" if head in short else func)
        assert callable(target), func
        assert keyword in inspect.signature(target).parameters, f"{func}(..., {keyword}=)"


def test_readme_states_the_index_rows_contract_the_indexers_keep() -> None:
    """The README's DSA section once said `flashinfer_mla` needs each index row's *first*
    min(top-k, visible) entries valid and that the indexer's rows are so; the torch indexer
    (`torch.topk(sorted=False)`) leaves -1 between valid entries, and `flashinfer_mla`
    compacts each row itself: what it needs, and what both indexers write, is that count of
    valid entries. The section states that, and the torch indexer keeps it."""
    import torch

    from mla_backends.sparse.index_k import select_topk

    section = README.split("## DeepSeek-V3.2 sparse attention")[1].split("\n## ")[0]
    text = " ".join(section.split())
    assert "first min(top-k" not in text
    assert "exactly min(top-k, visible keys) valid entries, in any position" in text
    topk, width = 8, 40
    logits = torch.randn(6, width, generator=torch.Generator().manual_seed(0))
    visible = torch.tensor([1, 3, 6, 8, 9, 40])
    logits[torch.arange(width)[None, :] >= visible[:, None]] = float("-inf")
    rows = select_topk(logits, topk)
    assert (rows >= 0).sum(1).tolist() == visible.clamp(max=topk).tolist()
