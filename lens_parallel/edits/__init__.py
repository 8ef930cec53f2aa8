"""Interventions as frozen dataclasses, compiled to TransformerLens forward hooks.

This package holds the only hooks that change activations. An *intervention* is a sequence of edits, applied in
order (an edit sees the activations earlier edits produced); :func:`apply_edits` attaches them within the model's
own hook context (hooks never stay attached after an exception). Every built-in edit has a row in :data:`EDITS`
under its kind (:mod:`~lens_parallel.edits.kinds`, a table written out) and declares its :class:`Footprint` (the
hooks it reads and writes, how it uses attention rows, whether it is defined at a decode step):

====================  ===============================  ================================================
kind                  class                            module
====================  ===============================  ================================================
scale                 :class:`ComponentScale`          :mod:`~lens_parallel.edits.scaling`
diagonal-scale        :class:`DiagonalEdit`            :mod:`~lens_parallel.edits.diagonal`
zero-diagonal         :class:`ZeroDiagonal`            :mod:`~lens_parallel.edits.diagonal`
head-ablation         :class:`HeadEdit`                :mod:`~lens_parallel.edits.heads`
random-direction      :class:`RandomDirectionRemoval`  :mod:`~lens_parallel.edits.directions`
gated-removal         :class:`GatedRemoval`            :mod:`~lens_parallel.edits.gates`
learned-gate          :class:`LearnedGate`             :mod:`~lens_parallel.edits.gates`
skip-first-layers     :class:`SkipFirstLayers`         :mod:`~lens_parallel.edits.wrappers`
====================  ===============================  ================================================

Heads are query heads. Under GQA an edit of query head h changes only h: the kv head it reads is shared, but the
edit acts on h's own aggregate (or attention row), never on v. Head-level edits act on softmax-attention layers
only: with ``layers=None`` Qwen3.5's linear-attention layers are left alone; naming one raises.

A TransformerLens user's own ``fwd_hooks`` list (``[(hook name or filter, fn), ...]``) is an edit too wherever one
is taken: :func:`as_edits` wraps it in :class:`~lens_parallel.edits.hooked.FwdHooks`, which follows the protocol as a
user's own edit does (no footprint, not registered) and is recorded by hook point, function and source digest.

Adding an edit: one module here defining a frozen dataclass deriving :class:`EditBase`, with its ``kind``, ``hooks``
and ``footprint``, and its row in :data:`~lens_parallel.edits.kinds.EDITS` (nothing registers itself).
"""

from lens_parallel.attention import STEP_VALUES
from lens_parallel.edits.base import (
    EDIT_POSITIONS,
    FIRST_INDEX,
    PATTERN_PATHS,
    PATTERN_USES,
    POSITIONS,
    UNEDITED,
    Edit,
    EditBase,
    Footprint,
    Heads,
    Intervention,
    PatternUse,
    Settings,
    all_values,
    apply_edits,
    as_edits,
    check_positions,
    compile_hooks,
    decode_safe,
    describe_edit,
    edit_footprint,
    edit_layers,
    edit_noop,
    hook_roles,
    named_edits,
    noop,
)
from lens_parallel.edits.diagonal import DiagonalEdit, ZeroDiagonal
from lens_parallel.edits.directions import RandomDirectionRemoval
from lens_parallel.edits.gates import GatedRemoval, LearnedGate
from lens_parallel.edits.heads import ABLATION_KINDS, ABLATIONS, LINEAR_ABLATIONS, AblationKind, HeadEdit
from lens_parallel.edits.hooked import FwdHooks
from lens_parallel.edits.kinds import EDITS, EditKind, edit_kind, explorer_edits
from lens_parallel.edits.scaling import ComponentScale, stacked_hooks
from lens_parallel.edits.wrappers import SkipFirstLayers

__all__ = [
    "ABLATIONS",
    "ABLATION_KINDS",
    "EDITS",
    "EDIT_POSITIONS",
    "FIRST_INDEX",
    "LINEAR_ABLATIONS",
    "PATTERN_PATHS",
    "PATTERN_USES",
    "POSITIONS",
    "STEP_VALUES",
    "UNEDITED",
    "AblationKind",
    "ComponentScale",
    "DiagonalEdit",
    "Edit",
    "EditBase",
    "EditKind",
    "Footprint",
    "FwdHooks",
    "GatedRemoval",
    "HeadEdit",
    "Heads",
    "Intervention",
    "LearnedGate",
    "PatternUse",
    "RandomDirectionRemoval",
    "Settings",
    "SkipFirstLayers",
    "ZeroDiagonal",
    "all_values",
    "apply_edits",
    "as_edits",
    "check_positions",
    "compile_hooks",
    "decode_safe",
    "describe_edit",
    "edit_footprint",
    "edit_kind",
    "edit_layers",
    "edit_noop",
    "explorer_edits",
    "hook_roles",
    "named_edits",
    "noop",
    "stacked_hooks",
]
