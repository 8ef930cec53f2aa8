"""Downstream tasks under edits: lm-evaluation-harness on the bridge (:mod:`.lm`), the offline task data and
definitions (:mod:`.data`), presets (:mod:`.presets`), edit specs for the command line (:mod:`.specs`) and
:func:`~lens_parallel.downstream.effects.task_effects` with its paired statistics (:mod:`.effects`)."""
