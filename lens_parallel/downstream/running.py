"""One lm-eval run of every task on a model under a tuple of edits (``simple_evaluate`` through
:class:`~lens_parallel.downstream.lm.EditedLM`), resumable through a store named by everything that changes a number;
the items whose contexts were cut to fit; code execution allowed only inside a run that opted in."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from typing import Any

from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.downstream.harness import lm_eval_quietly
from lens_parallel.downstream.settings import TaskSettings
from lens_parallel.edits import Edit, describe_edit
from lens_parallel.errors import LensParallelError
from lens_parallel.logs import say
from lens_parallel.options import RunOptions
from lens_parallel.sandbox import ALLOW_ENV
from lens_parallel.sweep import model_fingerprint


def run_fingerprint(
    model: TransformerBridge,
    edits: tuple[Edit, ...],
    opts: RunOptions,
    s: TaskSettings,
    *,
    weights: str,
    probe: list[int],
) -> str:
    import lm_eval

    record = {
        **model_fingerprint(model, weights=weights),
        "edits": [describe_edit(e) for e in edits],
        "lm_eval": lm_eval.__version__,
        "batch_size": opts.batch_size,
        "tokens_per_forward": opts.tokens_per_forward,
        "add_bos_token": s.add_bos_token,
        "max_gen_toks": s.max_gen_toks,
        "chat_template": [s.apply_chat_template, s.fewshot_as_multiturn],
        "tokenized": probe,  # how the tokenizer encodes a fixed text (BOS or not)
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_tasks(
    model: TransformerBridge,
    edits: tuple[Edit, ...],
    manager: Any,
    task_objects: dict[str, Any],
    *,
    s: TaskSettings,
    opts: RunOptions,
    limit: int | None,
    desc: str,
    weights: str | None,
) -> dict[str, Any]:
    from lm_eval.evaluator import simple_evaluate
    from sqlitedict import SqliteDict

    from lens_parallel.downstream.lm import EditedLM

    if opts.batch_size == "auto":
        raise LensParallelError("task_effects takes an integer batch_size (requests per forward), not 'auto'")
    lm = EditedLM(
        model,
        edits,
        batch_size=opts.batch_size,
        tokens_per_forward=opts.tokens_per_forward,
        add_bos_token=s.add_bos_token,
        max_gen_toks=s.max_gen_toks,
        progress=opts.progress,
        desc=desc,
    )
    with contextlib.ExitStack() as stack:
        if weights is not None:
            table = run_fingerprint(model, edits, opts, s, weights=weights, probe=lm.tok_encode("Hello world"))
            store = SqliteDict(str(opts.store), tablename=f"requests_{table}", autocommit=True)
            stack.callback(store.close)
            if stored := len(store):
                say(f"resumed {stored} finished requests of {desc} from {opts.store}")
            lm.attach_store(store)
        stack.enter_context(lm_eval_quietly(progress=opts.progress))
        out = simple_evaluate(
            model=lm,
            tasks=list(task_objects.values()),
            limit=limit,
            bootstrap_iters=0,
            log_samples=True,
            fewshot_random_seed=s.fewshot_seed,
            task_manager=manager,
            verbosity="ERROR",
            confirm_run_unsafe_code=s.allow_code_execution,
            apply_chat_template=s.apply_chat_template,
            fewshot_as_multiturn=s.fewshot_as_multiturn,
        )
    assert out is not None
    return dict(out) | {"cut": _cut_items(out["samples"], task_objects, lm.cut)}


def _cut_items(
    samples: dict[str, list[dict[str, Any]]], task_objects: dict[str, Any], cut: dict[str, int]
) -> dict[str, tuple[int, int, tuple[int, ...]]]:
    """Per task, how many items had a context cut to fit the model, out of how many, and the lengths in tokens the
    contexts were cut to (from the requests the model recorded as cut: :attr:`EditedLM.cut`)."""
    from lm_eval.api.model import hash_args

    out = {}
    for task, rows in samples.items():
        kind = task_objects[task].OUTPUT_TYPE
        request = "loglikelihood" if kind == "multiple_choice" else kind
        items: dict[int, int] = {}
        for row in rows:
            for args in row["arguments"]:
                kept = cut.get(hash_args(request, args))
                if kept is not None:
                    items[int(row["doc_id"])] = kept
        out[task] = (len(items), len({int(r["doc_id"]) for r in rows}), tuple(sorted(set(items.values()))))
    return out


@contextlib.contextmanager
def code_execution(allowed: bool) -> Iterator[None]:
    """Inside, when ``allowed``, the code a model writes may run: the offline HumanEval and MBPP in
    :mod:`~lens_parallel.sandbox.fence` (its :data:`~lens_parallel.sandbox.fence.ALLOW_ENV`, restored on
    exit). Hugging Face's ``HF_ALLOW_CODE_EVAL`` is never set: nothing runs through ``code_eval``."""
    if not allowed:
        yield
        return
    before = os.environ.get(ALLOW_ENV)
    os.environ[ALLOW_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[ALLOW_ENV]
        else:
            os.environ[ALLOW_ENV] = before
