"""The README and the documentation's pages run: every Python block of README.md, then of each page of the site's
guides in reading order (:data:`PAGES`), in one namespace (as a reader pastes them into one notebook), with no name
left undefined.

What the test changes, and why (each substitution must match the README, so a README edit that drops one fails
here rather than silently running something else):

- the real models (``smollm2-135m``; ``Qwen/Qwen3-8B``, a hub name that needs the network) become toys of the same
  kinds (``toy-qwen2``: grouped-query attention, as smollm2; ``toy-qwen3``), and the GPU memory map a CPU one;
- documents, training and tasks shrink to seconds: 8 blocks of 24 tokens, the ``tiny`` training preset with two
  seeds and three steps, one task with 3 items, the confirm check on 3 heads, one compression method;
- ``workers=8, ray_address="auto"`` (a running Ray cluster) becomes one worker in this process: the cluster path is
  tests/test_distributed.py's (a second Ray started here, beside its cluster, would contend with it);
- files go to a temporary folder (the working directory), and ``Figure.show()`` draws nothing.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import plotly.graph_objects as go
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [
    ROOT / "docs" / page
    for page in (
        "getting-started.md",
        "guides/edits.md",
        "guides/heads.md",
        "guides/nulls.md",
        "guides/training.md",
        "guides/compression.md",
        "guides/downstream.md",
        "guides/sandbox.md",
        "guides/explorer.md",
        "guides/models.md",
        "guides/scale.md",
    )
]
"""The pages whose examples build on the README's (``model``, ``blocks``), in the order the site reads them."""

SUBSTITUTIONS: list[tuple[str, str]] = [
    ('load_model("smollm2-135m")', 'load_model("toy-qwen2")'),
    (
        'load_model("Qwen/Qwen3-8B", device_map="auto", max_memory={0: "40GiB", 1: "40GiB"})',
        'load_model("toy-qwen3", device_map="auto", max_memory={"cpu": "2GiB"})',
    ),
    ("n_docs=16, seq_len=128", "n_docs=8, seq_len=24"),
    ("layer=3, head=4", "layer=2, head=1"),
    ("top_k=10", "top_k=3"),
    ('method=["int8", "torchao-intx4-g64", "wanda-seq-50%"]', 'method=["int8"]'),
    (
        'PRESETS["cpu-small"],\n    ["baseline", "random-direction-gated", "xsa-gated"],\n    seeds=[0, 1, 2, 3],',
        'dataclasses.replace(PRESETS["tiny"], steps=3, warmup_steps=1),\n'
        '    ["baseline", "random-direction-gated", "xsa-gated"],\n    seeds=[0, 1],',
    ),
    ('"quick", store="results/tasks.sqlite"', '[("copa", 0)], limit=3, store="results/tasks.sqlite"'),
    (
        'run_factorial(PRESETS["cpu-small"], arms, [0, 1, 2, 3]',
        'run_factorial(dataclasses.replace(PRESETS["tiny"], steps=3, warmup_steps=1), arms, [0, 1]',
    ),
    ('workers=8, ray_address="auto"', "workers=1, ray_address=None"),
    ("limit=20, allow_code_execution=True", "limit=2, max_gen_toks=24, allow_code_execution=True"),
]


def readme_blocks() -> list[str]:
    """The Python blocks of the README and then of :data:`PAGES`, dedented, with :data:`SUBSTITUTIONS` applied (each
    must be found)."""
    text = "\n".join(path.read_text(encoding="utf-8") for path in (README, *PAGES))
    for old, new in SUBSTITUTIONS:
        assert old in text, f"neither the README nor the guides hold {old!r}: update SUBSTITUTIONS"
        text = text.replace(old, new)
    return [textwrap.dedent(body) for _, body in re.findall(r"^( *)```python\n(.*?)^\1```", text, re.S | re.M)]


def test_the_readme_has_python_blocks_and_every_substitution_applies():
    assert len(readme_blocks()) >= 10


@pytest.mark.slow
def test_every_python_block_of_the_readme_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(go.Figure, "show", lambda self, *a, **k: None)
    namespace: dict[str, object] = {"__name__": "readme"}
    exec("import dataclasses", namespace)  # for the shrunk training presets above
    for i, block in enumerate(readme_blocks()):
        try:
            exec(compile(block, f"README / guides block {i}", "exec"), namespace)
        except NameError as exc:  # a name the README uses before any block defines it
            pytest.fail(f"README / guides block {i}: {exc}")
    assert (tmp_path / "out" / "smollm2.json").is_file()  # the first block's save
