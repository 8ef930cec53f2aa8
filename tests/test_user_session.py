"""A researcher's own session, as TransformerLens users run one: their own objects (a bridge booted from a folder,
packed token blocks, compatibility mode, hooks left on the bridge, a Hugging Face model, a model's name), their
habits (``attention_mask=``, ``layers=[-1]``), what they save and reopen in another process, and Ctrl-C to a running
command and to a Python call. Each case behaves as issue 75 asks: analysed as given and said so in provenance, or
refused in one line saying what to do."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pandas as pd
import pytest
import torch
import transformers
from transformer_lens.model_bridge import TransformerBridge
from transformer_lens.utilities.tokenize_utils import tokenize_and_concatenate

import lens_parallel as lp
from lens_parallel import architectures
from lens_parallel.errors import LensParallelError
from lens_parallel.models import UNPROCESSED, toy_folder
from lens_parallel.results import qualified_name
from lens_parallel.toys import toy_config
from tests import fresh
from tests.conftest import FAMILIES, get_model

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["The cat sat on the mat and looked at the door for a while.", "A dog ran home."]


def _fresh(code: str, *, cwd: Path) -> fresh.Ran:
    """``code`` run in a fresh process that never imported lens_parallel (:mod:`tests.fresh`), not the suite's."""
    return fresh.run(fresh.code, textwrap.dedent(code), cwd=cwd)


def _boot(spec: str) -> TransformerBridge:
    """A bridge as a TransformerLens user boots one: from a saved folder, with TransformerLens's own call."""
    bridge = TransformerBridge.boot_transformers(str(toy_folder(spec)))
    bridge.cfg.model_name = spec
    return bridge


# -- results reopen anywhere -------------------------------------------------------------------------------------------


def test_saved_results_reopen_in_a_fresh_interpreter(tmp_path):
    """The README's save / load pattern across processes: results saved here (a decomposition, an edit's effect, a
    sensitivity sweep and the report battery, whose sections nest other result types) load in an interpreter that
    imported nothing but ``lens_parallel``, with the same tables; and every class the package saves resolves there
    by the name its files record."""
    model = get_model("toy-gpt2")
    blocks = lp.token_blocks(model, "austen", n_docs=8, seq_len=16)
    made = {
        "decompose": lp.decompose(model, blocks, space="all", progress=False),
        "evaluate": lp.evaluate(model, blocks, lp.ZeroDiagonal(), n_resamples=20),
        "sensitivity": lp.head_sensitivity(model, blocks, layers=[0], n_resamples=20, n_permutations=20),
        "battery": lp.run_battery(model, blocks, progress=False),
    }
    for name, result in made.items():
        result.save(tmp_path / name)
    names = [qualified_name(cls) for cls in lp.result_classes()]
    done = _fresh(
        f"""
        import json, sys
        import lens_parallel as lp
        from lens_parallel.results import saved_class
        frames = {{name: lp.load_result(name).to_dataframe().to_json() for name in {list(made)!r}}}
        resolved = [saved_class(name, "-").__name__ for name in {names!r}]
        print(json.dumps({{"frames": frames, "resolved": resolved}}))
        """,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["resolved"] == [name.rsplit(".", 1)[-1] for name in names]
    for name, result in made.items():
        pd.testing.assert_frame_equal(
            pd.read_json(io.StringIO(out["frames"][name])), pd.read_json(io.StringIO(result.to_dataframe().to_json()))
        )


def test_a_cli_output_folder_reopens_in_a_fresh_interpreter(tmp_path):
    argv = ["scale", "--model", "toy-qwen2", "--n-docs", "4", "--seq-len", "16", "--s-par", "0", "--s-perp", "0.5"]
    ran = fresh.run(fresh.command, [*argv, "--no-progress", "--out", "out"], cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-2000:]
    code = "import lens_parallel as lp; print(lp.load_result('out/scale').to_dataframe().to_json())"
    done = _fresh(code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    reopened = pd.read_json(io.StringIO(done.stdout.splitlines()[-1]))
    pd.testing.assert_frame_equal(reopened, pd.read_csv(tmp_path / "out" / "scale.csv"), check_dtype=False)


def test_a_result_saved_by_another_patch_version_loads(tmp_path):
    """A class a later version moved to another module is found by its exported name, and a field a later version
    added with a default takes it, where the files lack it; a field this version does not know is refused."""
    model = get_model("toy-gpt2")
    result = lp.decompose(model, TEXTS, progress=False)
    path = result.save(tmp_path / "r")
    payload = json.loads(path.read_text())
    payload["data"]["__class__"] = "lens_parallel.analyses.old_place.DecompositionResult"
    for table in payload["data"]["tables"]["__tuple__"]:
        del table["info"]  # a field added since, with a default
    path.write_text(json.dumps(payload))
    loaded = lp.load_result(tmp_path / "r")
    pd.testing.assert_frame_equal(loaded.to_dataframe(), result.to_dataframe())
    payload["data"]["tables"]["__tuple__"][0]["from_the_future"] = 1
    path.write_text(json.dumps(payload))
    with pytest.raises(LensParallelError, match=r"another layout \(missing: \[\], unknown: \['from_the_future'\]\)"):
        lp.load_result(tmp_path / "r")


# -- packed blocks are text --------------------------------------------------------------------------------------------


_PACKED: dict[str, Any] = {}


def _packed(tokenizer: transformers.PreTrainedTokenizerBase) -> Any:
    """TransformerLens's packing of 30 austen documents, every third one empty: a datasets Column of 1-D tensors, as
    users index it. Once per tokenizer (the toys of a family share their bundled one): datasets hashes the tokenizer
    for its fingerprint, 2-3 s each."""
    if tokenizer.name_or_path not in _PACKED:
        texts = [text if i % 3 else "" for i, text in enumerate(lp.load_texts("austen")[:30])]
        dataset = datasets.Dataset.from_dict({"text": texts})
        packed = tokenize_and_concatenate(dataset, tokenizer, max_length=24, num_proc=None)
        _PACKED[tokenizer.name_or_path] = packed["tokens"]
    return _PACKED[tokenizer.name_or_path]


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenize_and_concatenate_blocks_are_analysed_as_given(family):
    """TransformerLens's own packing (documents joined by the EOS, BOS first in every row), of a corpus with empty
    documents (runs of separators, some at a row's edge): every row is text, whole, and gives the numbers of the
    same tokens given as Documents."""
    model = get_model(family)
    column = _packed(model.tokenizer)
    rows = column[:12]
    docs = lp.Documents.of(rows, model)
    assert docs.lengths.tolist() == [24] * 12
    assert torch.equal(lp.Documents.of(column, model).tokens, torch.stack(list(column)))
    given = lp.Documents(rows, torch.full((12,), 24), {"corpus": "packed"})
    packed = lp.decompose(model, rows, space="value", progress=False).table("value").self_cos
    np.testing.assert_array_equal(
        packed, lp.decompose(model, given, space="value", progress=False).table("value").self_cos
    )


def test_separators_at_the_row_edges_are_text_and_real_padding_is_not():
    """GPT-2's pad id is its EOS: a block that begins with BOS and a separator (two pad ids) beside one that begins
    with BOS alone is text; TransformerLens's to_tokens([...]) padding is still refused, and taken with its mask."""
    model = get_model("toy-gpt2")
    eos = model.tokenizer.eos_token_id
    words = model.tokenizer(" and the sea was calm that night under the stars", add_special_tokens=False)["input_ids"]
    rows = torch.tensor([[eos, eos, *words[:8]], [eos, *words[:8], eos], [eos, *words[1:10]]])
    assert lp.Documents.of(rows, model).lengths.tolist() == [10, 10, 10]
    padded = model.to_tokens(TEXTS)
    with pytest.raises(LensParallelError, match="these tokens look padded") as refused:
        lp.Documents.of(padded, model)
    assert "\n" not in str(refused.value)
    lengths = torch.tensor([[len(model.to_tokens(t)[0])] for t in TEXTS])
    mask = (torch.arange(padded.shape[1])[None] < lengths).long()
    assert (
        lp.Documents.of({"input_ids": padded, "attention_mask": mask}, model).lengths.tolist() == mask.sum(1).tolist()
    )


# -- the model a user brings -------------------------------------------------------------------------------------------


def test_a_bridge_booted_by_the_user_is_analysed_on_the_same_paths():
    """TransformerBridge.boot_transformers(folder): the numbers of load_model's bridge, lens_parallel's attention on
    every softmax layer, and provenance that says so, with the dtype, device and unprocessed weights read off it."""
    own = _boot("toy-qwen2")
    result = lp.decompose(own, TEXTS, space="value", progress=False)
    ours = lp.decompose(get_model("toy-qwen2"), TEXTS, space="value", progress=False)
    np.testing.assert_allclose(result.table("value").self_cos, ours.table("value").self_cos, rtol=0, atol=1e-6)
    recorded = result.provenance.model
    assert list(recorded["attention_paths"]) == ["lens_parallel: the module's q, k, v"] * own.cfg.n_layers
    assert (recorded["dtype"], recorded["device"], result.provenance.weight_processing) == (
        "float32",
        "cpu",
        UNPROCESSED,
    )


def test_compatibility_mode_is_refused_and_its_no_processing_form_is_said(tmp_path):
    """enable_compatibility_mode() folds value biases into b_O (hook_v changes): every entry point refuses it in one
    line saying how to get an unprocessed bridge; with no_processing=True the numbers are the model's and provenance
    says the mode."""
    processed = _boot("toy-gpt2")
    processed.enable_compatibility_mode(disable_warnings=True)
    calls = [
        lambda m: lp.decompose(m, TEXTS, progress=False),
        lambda m: lp.evaluate(m, TEXTS, lp.ZeroDiagonal()),
        lambda m: lp.causal_null(m, TEXTS),
        lambda m: lp.generate(m, TEXTS[0], max_new_tokens=2, progress=False),
        lambda m: lp.explore(m, TEXTS),
    ]
    for call in calls:
        with pytest.raises(LensParallelError, match=r"weights were processed by TransformerLens .*boot it again") as no:
            call(processed)
        assert "\n" not in str(no.value) and "no_processing=True" in str(no.value)
    legacy = _boot("toy-gpt2")
    legacy.enable_compatibility_mode(no_processing=True, disable_warnings=True)
    result = lp.decompose(legacy, TEXTS, space="value", progress=False)
    assert (
        result.provenance.weight_processing == UNPROCESSED + " (TransformerLens compatibility mode, no_processing=True)"
    )
    plain = lp.decompose(get_model("toy-gpt2"), TEXTS, space="value", progress=False)
    np.testing.assert_allclose(result.table("value").self_cos, plain.table("value").self_cos, rtol=0, atol=1e-6)


def test_hooks_left_on_the_bridge_read_and_are_recorded_or_are_refused_where_they_write():
    """A read-only hook left on the bridge (or in a ``with model.hooks(...)`` block) runs in the analysis, sees its
    activations, leaves the numbers as they are and is recorded in provenance; a hook that returns a new activation,
    or writes its activation in place, is refused the first time it does, saying how to pass it as an edit; after
    the analysis the user's own TransformerLens calls run the hooks as before."""
    model = _boot("toy-gpt2")
    plain = lp.decompose(model, TEXTS, progress=False)
    seen: list[tuple[str, tuple[int, ...]]] = []
    model.add_hook("blocks.1.hook_resid_pre", lambda x, hook: seen.append((hook.name, tuple(x.shape))))
    watched = lp.decompose(model, TEXTS, progress=False)
    np.testing.assert_array_equal(watched.table("value").self_cos, plain.table("value").self_cos)
    assert watched.provenance.model["observer_hooks"] == ("blocks.1.hook_resid_pre",)
    assert seen and {name for name, _ in seen} == {"blocks.1.hook_in"}  # the point's own name for itself
    model.blocks[0].attn.hook_z.add_hook(lambda z, hook: z * 0)
    with pytest.raises(LensParallelError) as refused:
        lp.decompose(model, TEXTS, progress=False)
    assert str(refused.value).startswith(
        "a hook left on toy-gpt2 at blocks.0.attn.hook_z changes its activation, which would change every number "
        "unrecorded; remove it (model.reset_hooks(), or leave the `with model.hooks(...)` block) and pass it as an "
        "edit, the fwd_hooks list run_with_hooks takes (lp.evaluate(model, docs, [('blocks.0.attn.hook_z', fn)]))"
    )
    model.reset_hooks()

    def in_place(x: torch.Tensor, hook: Any) -> None:
        x.add_(1.0)  # returns None, but writes

    written = pytest.raises(LensParallelError, match=r"at blocks\.0\.hook_resid_post changes its activation")
    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", in_place)]), written:
        lp.decompose(model, TEXTS, progress=False)
    tokens = model.to_tokens(TEXTS[0])
    with torch.no_grad():
        before = model(tokens)
        model.blocks[0].attn.hook_z.add_hook(lambda z, hook: z * 0)  # the user's own call runs it, as TransformerLens
        zeroed = model(tokens)
    assert not torch.equal(before, zeroed)
    model.reset_hooks()
    assert lp.decompose(model, TEXTS, progress=False).provenance.model["observer_hooks"] == ()


USERS_HOOKS = """
import json, torch
import lens_parallel as lp

model = lp.load_model("toy-gpt2")
texts = ["The cat sat on the mat and looked at the door for a while.", "A dog ran home."]
factor = float(__import__("sys").argv[1])


def scale_z(z, hook):
    return z * factor


seen = []
effect = lp.evaluate(
    model,
    texts,
    [("blocks.1.attn.hook_z", scale_z), (lambda name: name.endswith("ln_final.hook_normalized"), lambda x, hook: None)],
    n_resamples=20,
)
tokens = model.to_tokens(texts[0])
with torch.no_grad():
    logits = model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.attn.hook_z", scale_z)])
nll = torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:])  # position t predicts token t + 1
alone = lp.evaluate(model, texts[:1], [("blocks.1.attn.hook_z", scale_z)], n_resamples=20)
print(json.dumps({
    "recorded": effect.provenance.settings["edits"][0]["recorded"],
    "by_hand": float(nll),
    "loss_edited": alone.loss_edited,
}))
"""
"""A TransformerLens user's own hooks passed as an edit, in a fresh interpreter (argv[1]: the factor the hook's closure
reads)."""


def test_a_users_fwd_hooks_are_an_edit_recorded_by_hook_point_function_and_source(tmp_path):
    """A fwd_hooks list is taken where an edit is, runs as run_with_hooks runs it (the edited loss equals the one
    computed by hand from run_with_hooks' logits), and is recorded by hook point (a filter by its name), function and
    a digest of its source and what it reads: the same in two interpreters, another for another captured value."""
    (tmp_path / "hooks.py").write_text(USERS_HOOKS)
    said = []
    for factor in ("0.5", "0.5", "0.25"):
        done = fresh.run(fresh.code, f"import sys; sys.argv = ['hooks.py', {factor!r}]\n" + USERS_HOOKS, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        said.append(json.loads(done.stdout.splitlines()[-1]))
    (point, function, digest), (a_filter, observer, _) = said[0]["recorded"]
    assert (point, function) == ("blocks.1.attn.hook_z", "__main__.scale_z") and observer == "__main__.<lambda>"
    assert a_filter.startswith("filter __main__.<lambda> ")
    assert said[1]["recorded"] == said[0]["recorded"]  # the same code and values: the same record
    assert said[2]["recorded"][0][2] != digest  # another captured factor: another digest
    for run in said:
        assert run["loss_edited"] == pytest.approx(run["by_hand"], rel=1e-5)
    assert said[2]["loss_edited"] != said[0]["loss_edited"]


def test_fwd_hooks_run_in_sweeps_and_generation_as_any_edit():
    """The same pairs in a sweep job, a named setting of generate and apply_edits: the numbers of the equivalent
    built-in edit (zeroing one head's z is HeadEdit("zero"))."""
    model = get_model("toy-gpt2")

    def zero_head(z, hook):
        z = z.clone()
        z[:, :, 3] = 0.0
        return z

    pairs = [("blocks.2.attn.hook_z", zero_head)]
    mine = lp.run_sweep(model, TEXTS, [lp.EditJob("mine", (lp.FwdHooks(tuple(pairs)),))])  # a job holds edits
    built_in = lp.run_sweep(model, TEXTS, [lp.EditJob("mine", (lp.HeadEdit("zero", 2, [3]),))])
    np.testing.assert_allclose(mine.values["mine"]["loss_sum"], built_in.values["mine"]["loss_sum"], rtol=1e-6)
    out = lp.generate(model, ["The cat"], {"mine": pairs, "head": lp.HeadEdit("zero", 2, [3])}, max_new_tokens=4)
    texts = out.to_dataframe().set_index("setting").text
    assert texts["mine"] == texts["head"]
    calls: list[str] = []
    aliases = {"blocks.1.hook_resid_pre", "blocks.1.hook_in"}  # two names of one hook point
    assert model.hook_dict["blocks.1.hook_resid_pre"] is model.hook_dict["blocks.1.hook_in"]

    def either(name: str) -> bool:
        return name in aliases

    lp.document_losses(model, TEXTS[:1], [(either, lambda x, hook: calls.append(hook.name))])
    expected: list[str] = []
    with torch.no_grad():
        tokens = model.to_tokens(TEXTS[0])
        model.run_with_hooks(tokens, fwd_hooks=[(either, lambda x, hook: expected.append(hook.name))])
    assert calls == expected == ["blocks.1.hook_in"]  # once a forward, as run_with_hooks adds a filter's hook
    with pytest.raises(LensParallelError, match=r"'blocks\.2\.attn\.hook_zz' is not a hook point of toy-gpt2 \(did"):
        lp.evaluate(model, TEXTS, [("blocks.2.attn.hook_zz", zero_head)])


WHAT_USERS_TYPE = """
import json, torch, transformers, datasets
import lens_parallel as lp
from lens_parallel.models import toy_folder

model = lp.load_model("toy-gpt2")
texts = ["The cat sat on the mat and looked at the door for a while.", "A dog ran home."]
tokens = model.to_tokens(texts)
hf = transformers.AutoModelForCausalLM.from_pretrained(toy_folder("toy-gpt2"))
calls = {
    "a name": lambda: lp.decompose("toy-gpt2", texts),
    "a name, sensitivity": lambda: lp.head_sensitivity("toy-gpt2", texts),
    "a name, explorer": lambda: lp.explore("toy-gpt2", texts),
    "a Hugging Face model": lambda: lp.decompose(hf, texts),
    "None": lambda: lp.causal_null(None, texts),
    "attention_mask=": lambda: lp.decompose(model, tokens, attention_mask=torch.ones_like(tokens)),
    "no edits": lambda: lp.evaluate(model, texts, []),
    "eps=-1": lambda: lp.decompose(model, texts, eps=-1),
    "eps=0 on an edit": lambda: lp.ComponentScale("value", eps=0),
    "batch_size=0": lambda: lp.decompose(model, texts, batch_size=0),
    "a misspelt option": lambda: lp.decompose(model, texts, spcae="value"),
    "a misspelt model": lambda: lp.load_model("toy-gtp2"),
    "an empty tensor": lambda: lp.decompose(model, torch.zeros(0, dtype=torch.long)),
    "one-token documents": lambda: lp.decompose(model, [[5], [6]]),
    "an edit's layer -4 of 3": lambda: lp.evaluate(model, texts, lp.HeadEdit("zero", -4, 0)),
    "an edit's head -5 of 4": lambda: lp.evaluate(model, texts, lp.ComponentScale("value", s_par=0, heads=[-5])),
    "an ActivationCache": lambda: lp.decompose(model, model.run_with_cache(tokens)[1]),
    "hook_z as a space": lambda: lp.decompose(model, texts, space="hook_z"),
    "a hook point's full name as a space": lambda: lp.ComponentScale("blocks.1.hook_resid_post"),
    "hook_attn_out as a diagonal space": lambda: lp.diagonal_view(model, texts, space="hook_attn_out"),
    "a mask as tokens": lambda: lp.decompose(model, tokens != 0),
    "a Dataset without tokens": lambda: lp.decompose(model, datasets.Dataset.from_dict({"text": texts})),
    "a hook point without its function": lambda: lp.evaluate(model, texts, ["blocks.2.attn.hook_z"]),
}
said = {}
for name, call in calls.items():
    try:
        call()
        said[name] = "(no error)"
    except lp.LensParallelError as error:
        said[name] = str(error)
print(json.dumps(said))
"""
"""What users type that is not accepted, run as they run it (no runtime type checker in front of the package)."""


def test_what_users_type_is_one_line_saying_what_to_do(tmp_path):
    done = _fresh(WHAT_USERS_TYPE, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    said = json.loads(done.stdout.splitlines()[-1])
    expected = {
        "a name": "model: got the string 'toy-gpt2'; load it once and pass the bridge: model = lp.load_model(",
        "a name, sensitivity": "model = lp.load_model('toy-gpt2')",
        "a name, explorer": "model = lp.load_model('toy-gpt2')",
        "a Hugging Face model": "got a Hugging Face GPT2LMHeadModel; bridge it first: lp.wrap_hf_model(hf_model",
        "None": "model: got NoneType; accepted: a TransformerBridge",
        "attention_mask=": "attention_mask= (TransformerLens's keyword) travels with the tokens here: pass {",
        "no edits": "evaluate: no edits (an empty list)",
        "eps=-1": "eps must be above 0 (the guard on a norm: 1e-8 by default), got -1",
        "eps=0 on an edit": "eps must be above 0",
        "batch_size=0": "batch_size must be a positive integer or 'auto', got 0",
        "a misspelt option": "unknown option 'spcae' (did you mean 'space'?)",
        "a misspelt model": "unknown model spec 'toy-gtp2' (did you mean 'toy-gpt2'?)",
        "an empty tensor": "tokens are empty (a torch.int64 tensor of shape (0,)): give one document of 2 tokens",
        "one-token documents": "documents of 1 token: each needs 2 at least (a first token and one scored)",
        "an edit's layer -4 of 3": "layers [-4] out of range: this model has layers 0..2 (or -3..-1 from the end)",
        "an edit's head -5 of 4": "heads [-5] out of range: this model has heads 0..3 (or -4..-1 from the end)",
        "an ActivationCache": "an ActivationCache holds a forward already run; lens_parallel runs its own forward "
        "(its hooks reduce inside it), so pass the tokens you cached",
        "hook_z as a space": "space 'hook_z' is a TransformerLens hook point, not a space: its space is 'value'",
        "a hook point's full name as a space": "'blocks.1.hook_resid_post' is a TransformerLens hook point, not a "
        "space: its space is 'residual-block'",
        "hook_attn_out as a diagonal space": "diagonal space 'hook_attn_out' is a TransformerLens hook point, not a "
        "space: its space is 'residual-attn'",
        "a mask as tokens": "tokens: a torch.bool tensor of shape (2, 16) is a mask, not token ids: pass the ids, or "
        "the tokenizer's batch",
        "a Dataset without tokens": "a datasets.Dataset needs a 'tokens' column of token ids (tokenize_and_concatenate "
        "makes one); this one has ['text']",
        "a hook point without its function": "or is a TransformerLens fwd_hooks list [(hook point or filter, fn), "
        "...]; got str",
    }
    assert set(said) == set(expected)
    for name, message in expected.items():
        assert message in said[name] and "\n" not in said[name], (name, said[name])
    tokenizer = transformers.AutoTokenizer.from_pretrained(toy_folder("toy-gpt2"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(toy_folder("toy-gpt2"))
    bridged = lp.wrap_hf_model(hf, tokenizer, name="mine")
    assert lp.decompose(bridged, TEXTS, progress=False).provenance.model["name"] == "mine"


def test_a_result_shows_itself_in_a_notebook_and_its_figure_survives_the_export(tmp_path):
    """A result as a cell's last value is a short table (type, model, summary, the table's head), not its arrays;
    a figure as a cell's last value is drawn by the page nbconvert exports, with no notebook_figures() call."""
    import nbconvert
    import nbformat
    from nbclient import NotebookClient

    cells = [
        "import lens_parallel as lp\nmodel = lp.load_model('toy-gpt2')\n"
        "result = lp.decompose(model, ['The cat sat on the mat and looked at the door for a while.'], progress=False)",
        "result",
        "result.figure()",
        "print(repr(result))",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code) for code in cells])
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    shown = nb.cells[1].outputs[0]["data"]
    title = "<div class='lens-parallel-result'><strong>DecompositionResult: toy-gpt2 (gpt2, 3 layers x 4 heads)"
    assert shown["text/html"].startswith(title) and shown["text/html"].count("<table") == 2  # summary, table's head
    for text in (shown["text/html"], shown["text/plain"], nb.cells[3].outputs[0]["text"]):
        assert len(text) < 6000 and "array(" not in text, text
    printed = nb.cells[3].outputs[0]["text"].splitlines()
    assert printed[0].startswith("DecompositionResult: toy-gpt2") and len(printed) <= 24
    assert max(len(line) for line in printed) <= 160
    page, _ = nbconvert.HTMLExporter().from_notebook_node(nb)
    assert page.count("Plotly.newPlot(") >= 1  # the figure drawn by the exported page itself, offline
    assert not re.search(r'<script[^>]*\ssrc="(?:https?:)?//', page.split("</head>", 1)[1])


def test_one_index_rule_for_analyses_and_edits(tmp_path):
    """Negative layers and heads count from the end in edits as in analyses: an edit is resolved when it meets a model
    (evaluate, a sweep's jobs, task effects, generate, apply_edits) and provenance records the resolved indices; an
    edit over layers of different head counts refuses a head from the end."""
    model = get_model("toy-gpt2")
    from_end = lp.evaluate(model, TEXTS, lp.HeadEdit("zero", -1, [-1, 0]), n_resamples=50)
    counted = lp.evaluate(model, TEXTS, lp.HeadEdit("zero", 2, [3, 0]), n_resamples=50)
    recorded = from_end.provenance.settings["edits"]
    assert recorded == counted.provenance.settings["edits"]
    assert recorded[0]["layer"] == 2 and recorded[0]["heads"] == (3, 0)
    pd.testing.assert_frame_equal(from_end.to_dataframe(), counted.to_dataframe())
    scale = lp.ComponentScale("value", s_par=0.0, layers=[-1, 0], heads=[-2])
    run = lp.run_sweep(model, TEXTS, [lp.EditJob("from end", (lp.SkipFirstLayers(scale),), start_layer=1)])
    counted_scale = lp.ComponentScale("value", s_par=0.0, layers=[2, 0], heads=[2])
    same = lp.run_sweep(model, TEXTS, [lp.EditJob("from end", (lp.SkipFirstLayers(counted_scale),))])
    np.testing.assert_array_equal(run.values["from end"]["loss_sum"], same.values["from end"]["loss_sum"])
    tokens = model.to_tokens(TEXTS[0])
    with lp.apply_edits(model, lp.ZeroDiagonal(layers=[-1], heads=[-1])) as edited:
        resolved = edited(tokens)
    with lp.apply_edits(model, lp.ZeroDiagonal(layers=[2], heads=[3])) as edited:
        torch.testing.assert_close(resolved, edited(tokens), rtol=0, atol=0)
    out = lp.generate(model, ["The cat"], {"last": lp.ZeroDiagonal(layers=[-1])}, max_new_tokens=2)
    assert out.provenance.settings["edits"]["last"][0]["layers"] == (2,)
    hybrid = get_model("toy-qwen3.5")  # linear-attention layers have other head counts than the softmax ones
    info = lp.model_info(hybrid)
    counts = {info.output_heads(i) for i in range(hybrid.cfg.n_layers)}
    assert len(counts) > 1
    with pytest.raises(LensParallelError, match=r"heads \[-1\] count from the end of a layer's heads, but the edited"):
        lp.evaluate(hybrid, TEXTS, lp.ComponentScale("value", s_par=0.0, heads=[-1]))


def _same(a: lp.Documents, b: lp.Documents) -> bool:
    return torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tokenizers_batch_and_the_texts_are_the_same_documents_or_a_warning_says_how_to_match(family):
    """On every family a tokenizer's batch of the texts is the texts' documents, or one warning names the difference
    (Pythia: its tokenizer adds the BOS that TransformerLens's to_tokens leaves off) and each way it gives to match
    them does."""
    model = get_model(family)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from_batch = lp.Documents.of(model.tokenizer(TEXTS, padding=True, return_tensors="pt"), model)
    said = [str(w.message) for w in caught if "different documents" in str(w.message)]
    from_texts = lp.Documents.of(TEXTS, model)
    assert (said == []) == _same(from_batch, from_texts), said
    assert bool(said) == (family == "toy-pythia")
    for advice in said:
        assert "add_special_tokens=False" in advice and "bos='boundary'" in advice
        plain = model.tokenizer(TEXTS, padding=True, return_tensors="pt", add_special_tokens=False)
        assert _same(lp.Documents.of(plain, model), from_texts)
        assert _same(lp.Documents.of(TEXTS, model, bos="boundary"), from_batch)


def test_token_ids_of_every_integer_dtype_and_a_dataset_column_are_the_same_documents():
    """Token ids as users hold them (any integer dtype, a numpy array, the ``tokens`` column of the
    ``datasets.Dataset`` TransformerLens's ``tokenize_and_concatenate`` returns) give the int64 tensor's numbers."""
    model = get_model("toy-gpt2")
    column = torch.stack(list(_packed(model.tokenizer)[:6]))
    expected = lp.decompose(model, column, space="value", progress=False).table("value").self_cos
    given = {
        **{str(dtype): column.to(dtype) for dtype in (torch.uint16, torch.int32, torch.uint32)},
        "numpy uint16": column.numpy().astype(np.uint16),
        "a Dataset's tokens column": datasets.Dataset.from_dict({"tokens": column.tolist(), "other": list(range(6))}),
    }
    small = column[:, :8].clamp_max(127)  # ids that int8 holds
    small_expected = lp.decompose(model, small, space="value", progress=False).table("value").self_cos
    given |= {str(dtype): small.to(dtype) for dtype in (torch.int8, torch.uint8, torch.int16)}
    for name, documents in given.items():
        got = lp.decompose(model, documents, space="value", progress=False).table("value").self_cos
        want = small_expected if name in {"torch.int8", "torch.uint8", "torch.int16"} else expected
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_transformer_lens_failing_to_bridge_a_config_is_one_line(monkeypatch):
    from transformer_lens.factories.architecture_adapter_factory import ArchitectureAdapterFactory

    def refuses(cfg):
        raise RuntimeError("rope_scaling type 'longrope' is not supported\n(see the adapter)")

    refusing = classmethod(lambda _, cfg: refuses(cfg))
    monkeypatch.setattr(ArchitectureAdapterFactory, "select_architecture_adapter", refusing)
    with pytest.raises(lp.ModelSpecError) as refused:
        lp.load_model(str(toy_folder("toy-llama")))
    said = str(refused.value)
    assert "TransformerLens cannot bridge LlamaForCausalLM (RuntimeError: rope_scaling type 'longrope' is not " in said
    assert "\n" not in said


def _saved_toy(tmp_path: Path, model_type: str, **overrides: Any) -> Path:
    """A folder holding a seeded random model of ``model_type``'s toy config with ``overrides``, and a tokenizer."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(toy_config(model_type, **overrides))
    hf.save_pretrained(tmp_path)
    transformers.AutoTokenizer.from_pretrained(toy_folder("toy-gpt2")).save_pretrained(tmp_path)
    return tmp_path


def test_the_command_line_takes_options_spelled_whole(tmp_path):
    """As a shell runs it: a prefix of an option is not taken for it (argparse's default would run --n-docs 4), and
    the refusal names the closest option of that subcommand and its help; nothing is written."""
    for given, meant in (("--n-doc", "--n-docs"), ("--ndocs", "--n-docs"), ("--spce", "--space")):
        ran = fresh.run(fresh.command, ["decompose", "--model", "toy-gpt2", given, "4", "--out", "out"], cwd=tmp_path)
        assert ran.returncode == 2
        assert ran.stderr.strip().splitlines()[-1] == (
            f"lens-parallel decompose: error: unrecognized arguments: {given} 4 (did you mean '{meant}'?) (see "
            "lens-parallel decompose --help)"
        )
    assert not (tmp_path / "out").exists()


def test_a_bridge_whose_forward_fails_is_refused_at_load(tmp_path):
    """Granite-hybrid without an attention layer: TransformerLens bridges it, and the first forward fails in
    transformers' mask code. Refused by load_model in one line naming the architecture and the reason."""
    folder = _saved_toy(tmp_path, "granitemoehybrid", position_embedding_type="nope", layer_types=["mamba", "mamba"])
    with pytest.raises(lp.ModelSpecError) as refused:
        lp.load_model(str(folder))
    said = str(refused.value)
    assert (
        "TransformerLens bridges GraniteMoeHybridForCausalLM but its forward fails (ValueError: `get_mask_sizes`"
        in said
    )
    assert "\n" not in said


def test_an_attention_layer_without_position_embeddings_runs_as_transformer_lens_runs_it(tmp_path):
    """Granite-hybrid with NoPE attention: its bridge has no hook_rot_q / hook_rot_k; lens_parallel's attention
    fires none, gives TransformerLens's untouched logits and Hugging Face's, and analyses it."""
    folder = _saved_toy(
        tmp_path, "granitemoehybrid", position_embedding_type="nope", layer_types=["attention", "mamba"]
    )
    tokens = torch.tensor([[5, 17, 250, 3, 99, 42, 7, 1000]])
    untouched = TransformerBridge.boot_transformers(str(folder))
    assert "blocks.0.attn.hook_rot_q" not in untouched.hook_dict
    with torch.no_grad():
        expected = untouched(tokens)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder)(tokens).logits
    model = lp.load_model(str(folder))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), expected, rtol=1e-5, atol=1e-5)  # SDPA against its eager weights
        torch.testing.assert_close(model(tokens), hf, rtol=1e-5, atol=1e-5)
    assert not lp.model_info(model).rotary_hooks
    table = lp.decompose(model, tokens, space="value", progress=False).table("value")
    assert table.layers == (0,) and np.isfinite(table.self_cos).all()


# -- habits ------------------------------------------------------------------------------------------------------------


def test_transformer_lens_habits():
    """Indices from the end as TransformerLens reads them, and tables that are data frames."""
    model = get_model("toy-gpt2")
    last = lp.decompose(model, TEXTS, layers=[-1], progress=False)
    assert last.table("value").layers == (model.cfg.n_layers - 1,)
    assert last.provenance.settings["layers"] == [2]  # as resolved on this model
    view = lp.diagonal_view(model, TEXTS, layer=-1, head=-1)
    assert (view.layer, view.head) == (2, 3)
    same = lp.diagonal_view(model, TEXTS, layer=2, head=3)
    np.testing.assert_array_equal(view.d_a, same.d_a)
    table = lp.decompose(model, TEXTS, progress=False).table("value")
    assert isinstance(table, lp.AlignmentTable) and isinstance(table.to_dataframe(), pd.DataFrame)
    assert list(table.to_dataframe().label) == [f"L{layer}H{head}" for layer in range(3) for head in range(4)]
    losses = lp.document_losses(model, TEXTS).to_dataframe()
    assert list(losses.columns) == ["doc", "loss_sum", "n_tokens", "loss"]
    np.testing.assert_allclose(losses.loss, losses.loss_sum / losses.n_tokens)


def test_help_defines_every_column_an_analysis_returns():
    doc = lp.decompose.__doc__
    for column in ("self_cos", "par_frac", "par_coef", "perp_frac", "par_perp_ratio", "n_degenerate"):
        assert f"    {column}: " in doc.split("Columns:")[1], column
    assert "m.r / |r|^2" in doc.split("    par_coef: ")[1].splitlines()[0]


# -- interrupts and failures -------------------------------------------------------------------------------------------


def _rows(store: Path) -> int:
    return max(0, len(store.read_text().splitlines()) - 1) if store.is_file() else 0


def _interrupt_after_a_job(argv: list[str], store: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Start the script ``argv`` in a new interpreter (a script's end is the interpreter's: its excepthook), send
    SIGINT once its store holds a finished job (polled: never a fixed sleep), and wait."""
    process = subprocess.Popen(
        argv,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )
    deadline = time.monotonic() + 300
    while _rows(store) < 1 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "the run ended before a job finished: give it more jobs"
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


SWEEP = [  # one job a forward (tokens_per_forward: one batch), so that Ctrl-C lands inside the sweep
    "--model",
    "toy-gpt2",
    "--n-docs",
    "32",
    "--seq-len",
    "128",
    "--batch-size",
    "4",
    "--layers",
    "1",
    "--tokens-per-forward",
    "512",
    "--no-progress",
]


def test_ctrl_c_in_a_command_is_one_line_and_the_rerun_resumes(tmp_path):
    argv = ["sensitivity", *SWEEP, "--out", "out/a"]
    store = tmp_path / "out/a/sensitivity_store.jsonl"
    process, logs = fresh.start(fresh.command, argv, cwd=tmp_path)
    fresh.interrupt_when(process, lambda: _rows(store) >= 1)
    stopped = fresh.finish(process, logs)
    lines = stopped.stderr.strip().splitlines()
    assert stopped.returncode == 130 and "Traceback" not in stopped.stderr
    kept = _rows(tmp_path / "out/a/sensitivity_store.jsonl")
    assert lines[-1].startswith("lens-parallel sensitivity: interrupted: ")
    assert 1 <= kept < 5 and lines[-1].endswith(
        f"stopped after {kept} of 5 jobs finished, kept in out/a/sensitivity_store.jsonl: run the same call again to "
        "resume from them"
    )
    assert sorted(p.name for p in (tmp_path / "out/a").iterdir()) == ["sensitivity_store.jsonl"]  # no lock file
    again = fresh.run(fresh.command, argv, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"[lens_parallel] resumed {kept} of 5 jobs from out/a/sensitivity_store.jsonl" in again.stderr
    assert (tmp_path / "out/a/sensitivity.csv").is_file()


def test_ctrl_c_in_a_python_call_is_one_line(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(
        "import lens_parallel as lp\n"
        "model = lp.load_model('toy-gpt2')\n"
        "docs = lp.token_blocks(model, 'austen', n_docs=32, seq_len=128)\n"
        "lp.head_sensitivity(model, docs, layers=[1], batch_size=4, tokens_per_forward=512, progress=False,"
        " store='store.jsonl')\n"
    )
    stopped = _interrupt_after_a_job([sys.executable, str(script)], tmp_path / "store.jsonl", tmp_path)
    last = stopped.stderr.strip().splitlines()[-1]
    assert stopped.returncode != 0 and "Traceback" not in stopped.stderr
    kept = _rows(tmp_path / "store.jsonl")
    assert 1 <= kept < 5 and last == (
        f"KeyboardInterrupt: sweep: stopped after {kept} of 5 jobs finished, kept in store.jsonl: run the same call "
        "again to resume from them"
    )


def test_a_failed_command_leaves_no_empty_folder(tmp_path):
    argv = ["decompose", "--model", "toy-gpt2", "--n-docs", "4", "--seq-len", "16", "--layers", "9"]
    failed = fresh.run(fresh.command, [*argv, "--out", "new/deeper"], cwd=tmp_path)
    assert failed.returncode == 2 and "layers [9] out of range" in failed.stderr
    assert not (tmp_path / "new").exists()


def test_an_interrupt_outside_a_sweep_says_where_finished_work_is_kept():
    """Ctrl-C after a sweep kept its jobs (in the statistics), or before any: the outermost long call says which."""
    from lens_parallel.errors import interrupt_message, kept_in, long_call

    @long_call
    def analysis(store: str | None) -> None:
        if store:
            kept_in(store)
        inner()

    @long_call
    def inner() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as after:
        analysis("out/store.jsonl")
    assert interrupt_message(after.value) == (
        "analysis stopped; its finished work is kept in out/store.jsonl: run the same again to resume from it"
    )
    with pytest.raises(KeyboardInterrupt) as before:
        analysis(None)
    assert interrupt_message(before.value) == "analysis stopped before any of its work was kept"


def test_the_one_line_interrupt_keeps_every_other_exception_as_it_was(tmp_path):
    from lens_parallel.errors import interrupted

    made = interrupted("3 of 8 jobs kept")
    assert type(made) is KeyboardInterrupt and str(made) == "3 of 8 jobs kept"
    assert made._render_traceback_() == ["KeyboardInterrupt: 3 of 8 jobs kept"]
    shown = _fresh(
        """
        import sys
        from lens_parallel.errors import interrupted
        interrupted("kept")
        sys.excepthook(ValueError, ValueError("other"), None)
        sys.excepthook(KeyboardInterrupt, interrupted("3 of 8 jobs kept"), None)
        """,
        cwd=tmp_path,
    )
    assert shown.stderr.splitlines()[-2:] == ["ValueError: other", "KeyboardInterrupt: 3 of 8 jobs kept"]


def test_architectures_refused_before_the_bridge_stay_refused():
    """(The one-line TransformerLens failure above is TransformerLens's own; an architecture lens_parallel refuses is
    refused before TransformerLens is asked.)"""
    assert "codegen" in architectures.REFUSED
    with pytest.raises(lp.ModelSpecError, match=r"CodeGenForCausalLM \(codegen\) is refused"):
        lp.load_model("toy-codegen")
