"""How tasks are scored (:class:`TaskSettings`), and the settings that depend on the model, checked before any
forward."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.downstream.data import (
    RULER_ONLINE,
    RULER_SCORED_LENGTHS,
    RULER_SYNTHETIC,
)
from lens_parallel.errors import LensParallelError
from lens_parallel.models import model_info
from lens_parallel.stats import N_RESAMPLES
from lens_parallel.tokenizers import hf_tokenizer
from lens_parallel.validate import check_bool, check_non_negative_int, check_positive_int


@dataclass(frozen=True, kw_only=True)
class TaskSettings:
    """How tasks are scored: ``num_fewshot`` (None: each task's shots from its preset, else lm-eval's default),
    ``limit`` items per task (None: all), few-shot examples drawn with ``fewshot_seed`` (lm-eval's default 1234),
    CIs from ``n_resamples`` bootstrap resamples seeded by ``seed``, ``add_bos_token`` as lm-eval's ``hf`` model
    (None: the tokenizer's default), ``max_gen_toks`` for generation tasks, ``apply_chat_template`` (each request
    rendered in the tokenizer's chat template, as lm-eval's option; ``fewshot_as_multiturn``: a turn per shot). A
    task scored by running the code the model writes (lm-eval's ``unsafe_code``: HumanEval, MBPP) is refused unless
    ``allow_code_execution`` (then lm-eval's ``confirm_run_unsafe_code`` is set for the run and every program runs
    in lens_parallel's sandbox, :mod:`~lens_parallel.sandbox.fence`; a code task lm-eval would score with its
    own runner is refused). RULER's synthetic tasks build their prompts with the model's own tokenizer at
    ``max_seq_lengths`` tokens (lm-eval's task metadata), of the lengths it scores
    (:data:`~lens_parallel.downstream.data.RULER_SCORED_LENGTHS`), each at most the model's context.

    Examples:
        >>> import lens_parallel as lp
        >>> lp.TaskSettings(limit=10).limit
        10
    """

    num_fewshot: int | None = field(default=None, metadata={"help": "few-shot examples", "none": "the preset's"})
    limit: int | None = field(default=None, metadata={"help": "items per task", "none": "all (or the preset's)"})
    fewshot_seed: int = field(default=1234, metadata={"help": "seed of the few-shot sampling (lm-eval's default)"})
    n_resamples: int = field(default=N_RESAMPLES, metadata={"help": "bootstrap resamples of the CIs"})
    seed: int = field(default=0, metadata={"help": "seed of the bootstrap"})
    add_bos_token: bool | None = field(
        default=None, metadata={"help": "prepend BOS as lm-eval's hf model", "none": "the tokenizer's default"}
    )
    max_gen_toks: int | None = field(
        default=None,
        metadata={
            "help": "generation tasks: the most tokens generated per item (overrides the task's)",
            "none": "the task's, else lm-eval's 256",
        },
    )
    apply_chat_template: bool = field(
        default=False,
        metadata={"help": "render each request in the tokenizer's chat template (lm-eval's apply_chat_template)"},
    )
    fewshot_as_multiturn: bool = field(
        default=False,
        metadata={"help": "with the chat template: each few-shot example a turn of its own (lm-eval's option)"},
    )
    allow_code_execution: bool = field(
        default=False,
        metadata={
            "help": "run tasks scored by executing the code the model writes (HumanEval, MBPP), in a bubblewrap sandbox"
        },
    )
    max_seq_lengths: tuple[int, ...] | None = field(
        default=None,
        metadata={
            "help": "RULER's synthetic tasks: the prompt lengths in tokens, of those it scores (4096, ..., 131072)",
            "none": "the preset's, else RULER's 4096",
        },
    )

    def __post_init__(self) -> None:
        check_bool("add_bos_token", self.add_bos_token, optional=True)
        for name in ("apply_chat_template", "fewshot_as_multiturn", "allow_code_execution"):
            check_bool(name, getattr(self, name))
        if self.max_seq_lengths is not None:
            lengths = tuple(self.max_seq_lengths)
            for length in lengths:
                check_positive_int("max_seq_lengths", length)
            if not lengths:
                raise LensParallelError("max_seq_lengths: give at least one length in tokens, e.g. (4096,)")
            unscored = [x for x in lengths if x not in RULER_SCORED_LENGTHS]
            if unscored:
                raise LensParallelError(
                    f"max_seq_lengths {unscored[0]:,}: lm-eval's RULER tasks score only "
                    f"{', '.join(f'{x:,}' for x in RULER_SCORED_LENGTHS)} tokens"
                )
            object.__setattr__(self, "max_seq_lengths", tuple(sorted(set(lengths))))
        if self.max_gen_toks is not None:
            check_positive_int("max_gen_toks", self.max_gen_toks)
        if self.num_fewshot is not None:
            check_non_negative_int("num_fewshot", self.num_fewshot)
        if self.limit is not None:
            check_positive_int("limit", self.limit)
        check_non_negative_int("fewshot_seed", self.fewshot_seed)
        check_positive_int("n_resamples", self.n_resamples)
        check_non_negative_int("seed", self.seed)
        if self.fewshot_as_multiturn and not self.apply_chat_template:
            raise LensParallelError(
                "fewshot_as_multiturn needs apply_chat_template=True (the turns are the template's)"
            )


def check_for_model(model: TransformerBridge, s: TaskSettings, names: Sequence[str], lengths: Sequence[int]) -> None:
    """The settings that depend on the model, checked before any task loads: ``max_gen_toks`` must leave room for a
    context, RULER's lengths must fit the model's context (a length that was not run is never reported), a chat
    template must exist where asked for."""
    info, n_ctx = model_info(model), int(model.cfg.n_ctx)
    if s.max_gen_toks is not None and s.max_gen_toks >= n_ctx:
        raise LensParallelError(
            f"max_gen_toks={s.max_gen_toks} leaves no room for a context in {info.name}'s {n_ctx:,} tokens: give "
            f"at most {n_ctx - 1:,}"
        )
    ruler = [n for n in names if n in RULER_SYNTHETIC | RULER_ONLINE]
    too_long = [length for length in lengths if length > n_ctx]
    if ruler and too_long:
        served = [x for x in RULER_SCORED_LENGTHS if x <= n_ctx]
        longest = (
            f"the longest RULER length it can serve is {served[-1]:,} (max_seq_lengths=({served[-1]},))"
            if served
            else f"RULER's shortest length is {RULER_SCORED_LENGTHS[0]:,}, so it can serve none"
        )
        raise LensParallelError(
            f"RULER at {', '.join(f'{x:,}' for x in too_long)} tokens cannot run on {info.name}, whose context is "
            f"{n_ctx:,} tokens: {longest}"
        )
    if s.apply_chat_template and not getattr(hf_tokenizer(model), "chat_template", None):
        raise LensParallelError(
            f"{info.name}'s tokenizer has no chat template: run without apply_chat_template (a base model's "
            "tokenizer often has none)"
        )


def check_generation_room(model: TransformerBridge, s: TaskSettings, tasks: dict[str, Any]) -> None:
    """Every generation task must leave its prompt room in the model's context: its ``max_gen_toks`` (the task's,
    else lm-eval's 256; ``max_gen_toks`` of the settings overrides it) below ``n_ctx``. Refused in one line naming
    the tasks, before any forward."""
    n_ctx = int(model.cfg.n_ctx)
    asked = {
        name: s.max_gen_toks or int((task.config.generation_kwargs or {}).get("max_gen_toks", 256))
        for name, task in tasks.items()
        if task.OUTPUT_TYPE == "generate_until"
    }
    over = {name: n for name, n in asked.items() if n >= n_ctx}
    if over:
        named = ", ".join(f"{name} ({n:,})" for name, n in over.items())
        raise LensParallelError(
            f"{named} may generate as many tokens as {model_info(model).name}'s whole context of {n_ctx:,}, which "
            f"leaves no room for the prompt: give max_gen_toks={min(256, n_ctx // 2)} (any below {n_ctx})"
        )
