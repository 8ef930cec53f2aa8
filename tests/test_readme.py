"""The documentation runs as users run it: every Python block of README.md and of each page of docs/ (in reading
order within a page), and every ``lens-parallel`` line of their shell blocks, each page and each command line in a
fresh process of its own that has never imported lens_parallel, never the suite's process (so nothing the suite
imported or registered before can make them pass; :mod:`tests.fresh` starts them fast).

A guide page starts where the README leaves a reader: its first Python block's set-up (``model``, ``blocks``) runs
before the page's own. What the test changes, and why (each substitution must match a page, so an edit that drops
one fails here rather than silently running something else):

- the real models (``smollm2-135m``, ``qwen2.5-coder-1.5b``; ``Qwen/Qwen3-8B``, a hub name that needs the network)
  become toys of the same architectures (``toy-llama``: smollm2 is a Llama with grouped-query attention;
  ``toy-qwen2``, ``toy-qwen3``), and the GPU memory map a CPU one;
- documents, training and tasks shrink to seconds: 8 blocks of 24 tokens, the ``tiny`` training preset with two
  seeds and three steps, one task with 3 items, the confirm check on 3 heads, one compression method; a head named
  for a 28-layer model becomes one of the toy's;
- ``workers=8, ray_address="auto"`` (a running Ray cluster) becomes one worker in this process: the cluster path is
  tests/test_distributed.py's (a second Ray started here, beside its cluster, would contend with it);
- files go to a temporary folder (the working directory), and ``Figure.show()`` draws nothing.

The command lines get the same toys and sizes through the saved parser (a flag is added only where the subcommand
takes it); the two that need what this machine lacks (a CUDA device and a Ray cluster; the paper's training data,
online) run as written and must end in one line saying so.
"""

from __future__ import annotations

import json
import re
import shlex
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from lens_parallel.analyses.registry import analyses
from lens_parallel.cli import SPEC_PATH
from tests import fresh

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
        "guides/scale.md",
        "downstream.md",
        "directional-decomposition.md",
    )
]
"""The pages with Python examples, in the order the site reads them (tests/test_docs.py checks that none is left
out)."""

SUBSTITUTIONS: list[tuple[str, str]] = [
    ('load_model("smollm2-135m")', 'load_model("toy-llama")'),
    (
        'load_model("Qwen/Qwen3-8B", device_map="auto", max_memory={0: "40GiB", 1: "40GiB"})',
        'load_model("toy-qwen3", device_map="auto", max_memory={"cpu": "2GiB"})',
    ),
    ("n_docs=16, seq_len=128", "n_docs=8, seq_len=24"),
    ("layer=3, head=4", "layer=2, head=1"),
    ("layer=19, head=6", "layer=2, head=1"),
    ("top_k=10", "top_k=3"),
    ('method=["int8", "torchao-intx4-g64", "wanda-seq-50%"]', 'method=["int8"]'),
    (
        'PRESETS["cpu-small"],\n    ["baseline", "random-direction-gated", "xsa-gated"],\n    seeds=[0, 1, 2, 3],',
        'dataclasses.replace(PRESETS["tiny"], steps=3, warmup_steps=1),\n'
        '    ["baseline", "random-direction-gated", "xsa-gated"],\n    seeds=[0, 1],',
    ),
    ('"quick", store="results/tasks.sqlite"', '[("copa", 0)], limit=3, store="results/tasks.sqlite"'),
    ('    "quick",                      # a preset', '    [("copa", 0)], limit=3,       # a preset'),
    (
        'run_factorial(PRESETS["cpu-small"], arms, [0, 1, 2, 3]',
        'run_factorial(dataclasses.replace(PRESETS["tiny"], steps=3, warmup_steps=1), arms, [0, 1]',
    ),
    ('workers=8, ray_address="auto"', "workers=1, ray_address=None"),
    ("limit=20, allow_code_execution=True", "limit=2, max_gen_toks=24, allow_code_execution=True"),
    (
        'text_windows(model, "wikipedia-en", window=512)',
        'text_windows(model, ["A first text, short.", "A second text, a little longer than the first."], window=8)',
    ),
    (
        'scale_sweep(model, texts, protocol="directional-decomposition")',
        'scale_sweep(model, texts, protocol="directional-decomposition", s_par=(0.0,), s_perp=(0.5,))',
    ),
    (
        'head_sensitivity(model, docs, protocol="directional-decomposition")',
        'head_sensitivity(model, docs, protocol="directional-decomposition", n_resamples=100, n_permutations=100)',
    ),
    ('prompts, protocol="directional-decomposition")', 'prompts, protocol="directional-decomposition", method="int8")'),
    (
        'protocol="directional-decomposition", mode="global")',
        'protocol="directional-decomposition", mode="global", method="int8")',
    ),
]


def _blocks(text: str) -> list[str]:
    return [textwrap.dedent(body) for _, body in re.findall(r"^( *)```python\n(.*?)^\1```", text, re.S | re.M)]


def _substituted(path: Path) -> str:
    text = path.read_text(encoding="utf-8")
    for old, new in SUBSTITUTIONS:
        text = text.replace(old, new)
    return text


def page_blocks(path: Path) -> list[str]:
    """The Python blocks a reader of ``path`` runs, in order, with :data:`SUBSTITUTIONS` applied: a guide's after the
    README's set-up (its first block up to ``blocks = ...``: the model and the documents the guides build on)."""
    own = _blocks(_substituted(path))
    if path == README:
        return own
    first = _blocks(_substituted(README))[0]
    return [first[: first.index("\n", first.index("blocks = ")) + 1], *own]


def test_every_substitution_applies_and_every_page_has_python_blocks():
    text = "\n".join(path.read_text(encoding="utf-8") for path in (README, *PAGES))
    for old, _ in SUBSTITUTIONS:
        assert old in text, f"no page holds {old!r}: update SUBSTITUTIONS"
    assert all(_blocks(path.read_text(encoding="utf-8")) for path in (README, *PAGES))


def run_blocks(blocks: list[str], where: str) -> None:
    """A page's blocks in order, in one namespace, as a reader runs them (each named by page and block in a
    traceback); figures are not shown."""
    import plotly.graph_objects as go

    go.Figure.show = lambda self, *args, **kwargs: None
    namespace: dict[str, object] = {"__name__": "__main__"}
    exec("import dataclasses", namespace)  # for the shrunk training presets
    for i, block in enumerate(blocks):
        exec(compile(block, f"{where}, block {i}", "exec"), namespace)


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_each_page_runs_in_a_fresh_interpreter(page, tmp_path):
    where = str(page.relative_to(ROOT))
    done = fresh.run(run_blocks, page_blocks(page), where, cwd=tmp_path)
    assert done.returncode == 0, f"{where}:\n{done.stderr[-3000:]}"
    if page == README:
        assert (tmp_path / "out" / "smollm2.json").is_file()  # the first block's save


# -- the command lines ---------------------------------------------------------------------------------------------


def cli_examples() -> list[tuple[str, str]]:
    """Every ``lens-parallel`` line of the shell blocks of README.md and docs/ (continuation lines joined), with the
    first page it is on (a line two pages show runs once)."""
    found = []
    for path in (README, *sorted((ROOT / "docs").rglob("*.md"))):
        for block in re.findall(r"^```bash\n(.*?)^```", path.read_text(encoding="utf-8"), re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                if line.strip().startswith("lens-parallel "):
                    found.append((str(path.relative_to(ROOT)), line.split(" #")[0].strip()))
    return list({" ".join(line.split()): (page, line) for page, line in reversed(found)}.values())[::-1]


MODELS = {"smollm2-135m": "toy-llama", "qwen2.5-coder-1.5b": "toy-qwen2", "toy-qwen3": "toy-qwen3"}
"""The models the examples name, and the toys they run as."""
SMALLER = {
    "--n-docs": ["8"],
    "--seq-len": ["16"],
    "--limit": ["2"],
    "--steps": ["3"],
    "--max-new-tokens": ["3"],
    "--max-gen-toks": ["16"],
}
"""Sizes added where a subcommand takes the flag and the example does not give it."""
SHRUNK = {
    ("--preset", "cpu-small"): ["tiny"],
    ("--tasks", "quick"): ["copa"],
    ("--seeds", "0"): ["0", "1"],
    ("--limit", "50"): ["1"],
}
"""Values replaced (a flag's first value -> the new values)."""
WRITES = {
    "attribution": ["attribution_confirm.csv"],
    "compress": ["compress_methods.csv", "compress_mlp.html"],
}
"""Files an analysis's command writes beside its table, summary, result and figure (each more than 100 bytes)."""
CANNOT_RUN_HERE = {
    "--ray-address": "device 'cuda' asked for, but this machine has no CUDA device",
    "xsa-controls": "cannot load hub data set 'hf:HuggingFaceFW/fineweb-edu",
}
"""Examples that need what this machine lacks, by a word of theirs: the one line they end in."""


def _argv(line: str) -> list[str]:
    """An example's arguments with :data:`MODELS`, :data:`SHRUNK` and :data:`SMALLER` applied (none but the models to
    one that cannot run here), the default model a toy, and no progress bars."""
    words = shlex.split(line)[1:]
    command = words[0]
    flags = {a["flag"] for a in json.loads(SPEC_PATH.read_text())["commands"][command]["arguments"]}
    out: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word in MODELS:
            out.append(MODELS[word])
        elif i + 1 < len(words) and (word, words[i + 1]) in SHRUNK:
            out += [word, *SHRUNK[word, words[i + 1]]]
            i += 1
            while i + 1 < len(words) and not words[i + 1].startswith("--"):
                i += 1
        else:
            out.append(word)
        i += 1
    keep = {"--seq-len"} if command == "dominance" else set()  # the study's texts are 32 tokens
    if any(word in line for word in CANNOT_RUN_HERE):
        keep = set(SMALLER)  # as written: it must stop before any work
    added = [flag for flag in SMALLER if flag in flags and flag not in out and flag not in keep]
    out += [item for flag in added for item in (flag, *SMALLER[flag])]
    if "--model" in flags and "--model" not in out:
        out += ["--model", "toy-llama"]  # the default, smollm2-135m's architecture
    return out + (["--no-progress"] if "--progress" in flags else [])


def _written(stdout: str, folder: Path) -> list[Path]:
    """The files the ``wrote:`` lists of a command's output name (each list: the indented lines after it)."""
    found, listing = [], False
    for row in stdout.splitlines():
        listing = row == "wrote:" or (listing and row.startswith("  "))
        if listing and row != "wrote:":
            found.append(folder / row.strip())
    return found


@pytest.mark.parametrize("page, line", cli_examples(), ids=[f"{p}: {line}" for p, line in cli_examples()])
def test_each_command_line_example_runs_in_a_fresh_process(page, line, tmp_path):
    done = fresh.run(fresh.command, _argv(line), cwd=tmp_path)
    refusal = next((said for word, said in CANNOT_RUN_HERE.items() if word in line), None)
    if refusal is not None:
        lines = done.stderr.strip().splitlines()
        assert done.returncode in (2, 3) and refusal in lines[-1] and "Traceback" not in done.stderr, done.stderr
        return
    assert done.returncode == 0, f"{page}: {line}\n{done.stderr[-3000:]}"
    if _argv(line)[0] not in analyses():
        return
    written = _written(done.stdout, tmp_path)
    outputs = {p for p in tmp_path.rglob("*") if p.is_file() and ".example" not in p.parts}
    assert {p.resolve() for p in outputs} == {p.resolve() for p in written}  # each file it wrote named, no other
    stem = "attribution" if "attribution" in line else _argv(line)[0]
    for name in [*WRITES.get(stem, ()), f"{stem}.csv", f"{stem}_summary.csv", f"{stem}.json", f"{stem}.html"]:
        assert next(tmp_path.rglob(name)).stat().st_size > 100, name
    for result in (p for p in written if p.suffix == ".json" and p.with_suffix(".npz").is_file()):
        meta = json.loads(result.read_text())
        assert meta["format"] == "lens_parallel.result" and meta["version"] == 2
        provenance = meta["data"]["null" if stem == "checks" else "provenance"]  # checks: two results in one
        provenance = provenance["provenance"] if stem == "checks" else provenance
        assert provenance["model"]["name"] in MODELS.values()
        assert len(pd.read_csv(result.with_suffix(".csv"))) > 0
    if _argv(line)[0] == "dominance":  # the study's texts by default, the window and scale as given
        assert "js_distance scale" in done.stdout and "L0→L1" in done.stdout
        provenance = json.loads((tmp_path / "results/dominance/dominance.json").read_text())["data"]["provenance"]
        assert provenance["settings"]["query_positions"] == list(range(7, 32))
        assert "lunyu" in provenance["texts"]["corpus"]


def test_every_documented_command_line_is_found():
    commands = {shlex.split(line)[1] for _, line in cli_examples()}
    spec = json.loads(SPEC_PATH.read_text())["commands"]
    assert len(cli_examples()) >= 15 and commands >= set(spec)
