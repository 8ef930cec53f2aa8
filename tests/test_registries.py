"""The registries (spaces, edits, analyses) against everything that reads them: the type checker's Literals, the
command line, the explorer, the engine's hook selection, and what each edit's hooks really do."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np
import pandas as pd
import pytest
import torch

import lens_parallel as lp
from lens_parallel import cli, commands
from lens_parallel.analyses import registry
from lens_parallel.analyses.registry import Analysis, analyses
from lens_parallel.attention import paths as attention_paths
from lens_parallel.choices import Ablation, AttentionPath, ExplorerEdit, HeadSpace, LayerType, Space
from lens_parallel.downstream.specs import parse_spec, spec_kinds
from lens_parallel.edits import ABLATION_KINDS, EDITS, EditBase, compile_hooks, explorer_edits, hook_roles
from lens_parallel.edits.gates import GatedRemoval, LearnedGate
from lens_parallel.errors import LibraryError
from lens_parallel.hooks import hook_name
from lens_parallel.layers import LAYER_KINDS
from lens_parallel.models import model_info
from lens_parallel.options import RunOptions, resolve
from lens_parallel.results import Provenance, ResultMixin
from lens_parallel.spaces import HEAD_SPACES, SPACE_NAMES, SPACES
from lens_parallel.validate import choice_table

pytestmark = pytest.mark.integration


def test_the_space_registry_is_the_literal_types():
    assert get_args(Space) == SPACE_NAMES
    assert set(HEAD_SPACES) == set(get_args(HeadSpace))
    assert lp.SPACES is SPACES and all(spec.name == name for name, spec in SPACES.items())


@pytest.mark.parametrize(
    ("choice", "table"),
    [
        (Space, SPACES),
        (LayerType, LAYER_KINDS),
        (Ablation, ABLATION_KINDS),
        (AttentionPath, attention_paths.CHOICES),
    ],
)
def test_each_choice_table_is_its_literal_in_order_and_read_only(choice, table):
    assert tuple(table) == get_args(choice)
    with pytest.raises(TypeError):
        table["new"] = None  # a table is filled where it is written, never later


def test_a_table_that_drifts_from_its_literal_is_refused_at_once():
    choice = Literal["first", "second", "third"]
    assert dict(choice_table(choice, {"first": 1, "second": 2, "third": 3})) == {"first": 1, "second": 2, "third": 3}
    for table, said in [
        ({"first": 1, "second": 2}, r"missing \['third'\], unknown \[\]"),
        ({"first": 1, "second": 2, "third": 3, "fourth": 4}, r"missing \[\], unknown \['fourth'\]"),
        ({"second": 2, "first": 1, "third": 3}, r"missing \[\], unknown \[\] \(in the Literal's order\)"),
    ]:
        with pytest.raises(LibraryError, match=said):
            choice_table(choice, table)


# -- analyses -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(analyses()))
def test_every_analysis_has_its_subcommand_defaults_and_contract(name):
    analysis = analyses()[name]
    command = commands.COMMANDS[name]
    assert command.settings[0] is analysis.settings and command.help == analysis.help
    parser = cli.build_parser()
    inv = commands.Invocation(name, command, parser.parse_args([name]))
    assert inv.settings(analysis.settings) == analysis.settings()  # the command line's defaults are the library's
    params = inspect.signature(analysis.function).parameters
    for keyword in ("settings", "options", "protocol"):
        assert params[keyword].kind is inspect.Parameter.KEYWORD_ONLY and params[keyword].default is None
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    assert issubclass(analysis.result, ResultMixin)
    assert getattr(lp, analysis.function.__name__) is analysis.function  # exported by the package


@pytest.fixture(scope="module")
def toy():
    model = lp.load_model("toy-gpt2")
    return model, lp.token_blocks(model, "austen", n_docs=4, seq_len=10)


SMALL = {  # the smallest settings each analysis accepts, so that every one runs here in seconds
    "decompose": {},
    "scale": {"s_par": (0.0,), "s_perp": (), "n_resamples": 50},
    "diagonal": {},
    "sensitivity": {"layers": [0], "n_resamples": 50, "n_permutations": 50},
    "dominance": {"upstream_layers": [0], "query_start": 2, "query_stop": 6},
    "checks": {},
    "compress": {"method": ("int8",)},
}


def test_every_analysis_has_small_settings_here():
    assert set(SMALL) == set(analyses())


@pytest.mark.parametrize("name", list(SMALL))
def test_every_analysis_records_its_settings_and_options_in_provenance(name, toy, tmp_path):
    """Provenance comes from the objects the run used: the settings' fields and the run options' record."""
    model, blocks = toy
    analysis = analyses()[name]
    settings = resolve(analysis.settings, None, None, None, SMALL[name])[0]
    options = RunOptions(batch_size=2, progress=False)
    result = analysis.function(model, blocks, settings=settings, options=options)
    recorded = result.provenance.settings
    plain = settings.record() if hasattr(settings, "record") else dataclasses.asdict(settings)
    assert recorded["analysis"] in (name, analysis.function.__name__)
    for key, value in plain.items():
        assert key in recorded
        if value is not None and not isinstance(value, (list, tuple, dict)):  # None: resolved by the run
            assert recorded[key] == value, key
    assert recorded["options"]["batch_size"] == 2
    title, shown = analysis.printer(result, settings, analysis.display() if analysis.display else None)
    assert title.startswith(model_info(model).name) and isinstance(shown, pd.DataFrame) and len(shown)


@dataclass(frozen=True, kw_only=True)
class _TinySettings:
    """A test-only analysis: the mean first-layer residual norm."""

    scale: float = field(default=1.0, metadata={"help": "a factor"})


@dataclass(frozen=True)
class _TinyResult(ResultMixin):
    value: float
    provenance: Provenance

    def to_dataframe(self) -> pd.DataFrame:
        return pd.DataFrame([{"value": self.value}])

    def summary(self) -> pd.DataFrame:
        return self.to_dataframe()

    def figures(self) -> dict[str, Any]:
        return {}


def _tiny(
    model: Any,
    documents: Any,
    *,
    settings: _TinySettings | None = None,
    options: RunOptions | None = None,
    protocol: str | None = None,
    **changes: Any,
) -> _TinyResult:
    s, opts = resolve(_TinySettings, settings, options, protocol, changes)
    docs = lp.Documents.of(documents)
    value = float(docs.tokens.double().mean()) * s.scale
    return _TinyResult(value, Provenance.of(model_info(model), docs, "tiny", s, opts))


TINY = Analysis("tiny", "a test analysis", _tiny, _TinySettings, _TinyResult, lambda r, s, d: ("tiny", r.summary()))
ANALYSIS = TINY
"""This module as an analysis's module (:data:`~lens_parallel.analyses.registry.MODULES` reads ``ANALYSIS``)."""


def test_an_analysis_defined_here_appears_in_the_command_line(monkeypatch):
    """A row in the table is all it takes: the subcommand, its options and its run come from the analysis; a module
    whose analysis goes by another name than its row is refused in one line."""
    monkeypatch.setitem(registry.MODULES, "tiny", __name__)
    monkeypatch.setattr(commands, "COMMANDS", commands._commands())
    spec = commands.parser_spec()
    assert "tiny" in spec["commands"]
    flags = [a["flag"] for a in spec["commands"]["tiny"]["arguments"]]
    assert "--scale" in flags and "--model" in flags
    args = cli.build_parser(spec).parse_args(["tiny", "--scale", "2"])
    inv = commands.Invocation("tiny", commands.COMMANDS["tiny"], args)
    assert inv.settings(_TinySettings) == _TinySettings(scale=2.0)
    monkeypatch.setitem(registry.MODULES, "small", __name__)
    with pytest.raises(lp.LensParallelError, match=r"ANALYSIS is named 'tiny', listed as 'small'"):
        analyses()


def test_no_module_registers_itself_when_imported():
    """The tables are written out: no registering call or decorator is left, and no package walk fills one."""
    import pathlib
    import re

    source = "\n".join(p.read_text() for p in pathlib.Path(lp.__file__).parent.rglob("*.py"))
    for name in ("register_analysis", "register_edit", "@serializable", "pkgutil", "walk_packages", "iter_modules"):
        assert not re.search(rf"{re.escape(name)}\b", source), name


# -- edits --------------------------------------------------------------------------------------------------------


def _examples(info: Any) -> dict[str, list[Any]]:
    """Instances of every registered edit, covering each footprint branch."""
    n_l, n_h = info.n_layers, info.n_heads
    gen = torch.Generator().manual_seed(0)
    return {
        "scale": [lp.ComponentScale(space, s_par=0.3, s_perp=1.2) for space in SPACE_NAMES]
        + [lp.ComponentScale("residual-attn", s_par=0.0, heads=[0, 1])],
        "diagonal-scale": [lp.DiagonalEdit("value", s_par=0.0), lp.DiagonalEdit("residual-attn", s_par=0.5)],
        "zero-diagonal": [lp.ZeroDiagonal()],
        "head-ablation": [
            lp.HeadEdit(kind, 1, [0, 1], torch.randn(n_h, info.d_head, generator=gen))
            for kind in ("zero", "mean", "parallel-value", "parallel-residual")
        ],
        "random-direction": [lp.RandomDirectionRemoval(seed=1), lp.RandomDirectionRemoval(norm_matched=True)],
        "gated-removal": [
            GatedRemoval(alpha=torch.full((n_l, n_h), 0.7)),
            GatedRemoval(directions=torch.randn(n_l, n_h, info.d_head, generator=gen)),
        ],
        "learned-gate": [LearnedGate(torch.randn(n_l, n_h, info.d_model, generator=gen) * 0.1, torch.zeros(n_l, n_h))],
        "skip-first-layers": [lp.SkipFirstLayers(lp.ComponentScale("value", s_par=0.0))],
    }


def test_every_registered_edit_has_an_example_here():
    assert set(_examples(model_info(lp.load_model("toy-gpt2")))) == set(EDITS)


def test_every_training_arm_declares_the_registered_edit_it_trains_with():
    from lens_parallel.training.arms import ARM_EDITS, ARMS, ArmParameters

    info = model_info(lp.load_model("toy-gpt2"))
    assert set(ARM_EDITS) == set(ARMS)
    for arm, kind in ARM_EDITS.items():
        edits = ArmParameters(arm, info).edits()
        assert (not edits) if kind is None else edits and all(isinstance(e, EDITS[kind].cls) for e in edits), arm


def test_the_explorer_menu_and_the_specs_come_from_the_registry():
    assert set(explorer_edits()) == set(get_args(ExplorerEdit))
    assert set(spec_kinds()) == set(SPACES) | {name for name, kind in EDITS.items() if kind.spec}
    assert parse_spec("zero-diagonal") == lp.ZeroDiagonal()
    assert parse_spec("scale:space=value,s_par=0") == lp.ComponentScale("value", s_par=0.0)
    with pytest.raises(lp.LensParallelError, match="accepted: value, value-exclude-self"):
        parse_spec("gated-removal")  # tensor settings: not a spec kind


def _logits_and_patterns(model, tokens, hooks, layers):
    """Logits, and each layer's attention pattern as the edit hooks receive it and as they leave it (hooks at one
    hook point fire in the order added)."""
    seen: dict[tuple[str, int], torch.Tensor] = {}

    def keep(when, layer):
        def fn(pattern, hook):
            seen[when, layer] = pattern.detach().clone()

        return fn

    before = [(hook_name(layer, "pattern_full"), keep("before", layer)) for layer in layers]
    after = [(hook_name(layer, "pattern_full"), keep("after", layer)) for layer in layers]
    with model.hooks(fwd_hooks=[*before, *hooks, *after]):
        logits = model(tokens)
    return logits, seen


@pytest.mark.parametrize("name", ["toy-gpt2", "toy-qwen3", "toy-qwen3.5"])
def test_every_edit_runs_with_only_the_hooks_it_declares(name):
    """Per example: the hooks on declared roles alone give the edit's full result; a hook on a role it only reads
    returns nothing; an edit whose footprint leaves the pattern alone leaves hook_pattern unchanged."""
    model = lp.load_model(name)
    info = model_info(model)
    tokens = torch.randint(0, info.d_vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    layers = info.softmax_layers
    clean, _ = _logits_and_patterns(model, tokens, [], layers)
    for examples in _examples(info).values():
        for edit in examples:
            try:
                hooks = edit.hooks(model, info)
            except lp.LensParallelError:
                continue  # not defined on this model (gated attention, ...): refused before any forward
            footprint = edit.footprint(info)
            declared = set(footprint.roles)
            kept = [(n, fn) for n, fn in hooks if hook_roles(n) & declared]
            assert len(kept) == len(hooks), (edit, [n for n, _ in hooks if not hook_roles(n) & declared])

            what = type(edit).__name__

            def read_only(fn, hook_name_, what=what):
                def run(tensor, hook):
                    out = fn(tensor, hook)
                    assert out is None, f"{what} changes {hook_name_}, declared read-only"
                    return out

                return run

            writes = set(footprint.writes)
            checked = [(n, fn if hook_roles(n) & writes else read_only(fn, n)) for n, fn in kept]
            edited, patterns = _logits_and_patterns(model, tokens, checked, layers)
            full, _ = _logits_and_patterns(model, tokens, hooks, layers)
            torch.testing.assert_close(edited, full, rtol=0, atol=0)
            assert not torch.equal(edited, clean), edit  # every example changes something
            if footprint.pattern == "none" or not {"pattern_diag", "pattern_full"} & writes:
                for layer in layers:
                    torch.testing.assert_close(patterns["after", layer], patterns["before", layer], rtol=0, atol=0)
            if footprint.pattern == "none":
                assert not {"pattern_diag", "pattern_full"} & declared
            assert isinstance(edit, EditBase) and edit.kind in EDITS


def test_a_stray_hook_outside_the_footprint_is_a_library_bug():
    model = lp.load_model("toy-gpt2")

    @dataclass(frozen=True)
    class Liar(lp.ZeroDiagonal):
        def hooks(self, model, info):
            return [*super().hooks(model, info), (hook_name(0, "resid_pre"), lambda t, hook: None)]

    with pytest.raises(lp.LibraryError, match="outside its declared footprint"):
        compile_hooks(model, Liar())
    np.testing.assert_equal(len(compile_hooks(model, lp.ZeroDiagonal())), model_info(model).n_layers)
