"""Continuations scored against their shared context: each context runs once, key/value-cached, and every
continuation of it after it.

lm-eval's multiple-choice tasks ask for log P(continuation | context) of every choice of an item, the choices
sharing the item's context (MMLU's five shots and question, then " A" .. " D"; ARC-Challenge's 25 shots, then each
answer). Scoring each (context + continuation) whole runs the context once per choice. Here a batch of distinct
contexts runs once, left-padded (:func:`~lens_parallel.generation.decode.left_padded`), filling a key/value cache; the
last position's final residual of a context predicts the first token of each of its continuations, and the other
tokens of the continuations (each continuation but its last token, right-padded) run in one more forward against
the cache, each row against its own context's cached rows (:meth:`~lens_parallel.generation.decode.CachedForwards.
select`). The edits' hooks are active in both forwards, as at a cached decoding step, so only decode-safe edits are
accepted (:func:`~lens_parallel.edits.decode_safe`: at each of several new positions against cached keys and values
an edit sees what it sees in the whole sequence's forward). Causal attention makes this the whole sequence's
computation; only the kernels' rounding differs (``tests/test_downstream.py`` compares them on every family, under
each kind of edit).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Bool, Float
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.generation.decode import cached_forwards, left_padded
from lens_parallel.hooks import Hook, is_finite, raise_non_finite
from lens_parallel.losses import Unembedding, scored_rows


def score_continuations(
    model: TransformerBridge,
    hooks: Sequence[Hook],
    contexts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    owner: Sequence[int],
    *,
    unembed: Unembedding,
    pad: int,
) -> tuple[Float[Tensor, " token"], Bool[Tensor, " token"]]:
    """Every token c_j of each continuation c (continuation i follows ``contexts[owner[i]]``; every context
    non-empty, every continuation too) under ``hooks``: its NLL -log p(c_j | context, c_<j) and whether it is the
    argmax of those logits, the tokens of the continuations one after another in order (``[sum_i len(c_i)]``).

    Two forwards at most: the contexts (left-padded with ``pad``), then the continuations longer than one token
    without their last (right-padded) against each one's own context. A final residual holding NaN or infinity is
    refused by :func:`~lens_parallel.hooks.raise_non_finite` on the whole sequence it came from (no cache), before
    any score is returned."""
    device = unembed.W_U.device
    tokens, mask, positions, starts = left_padded(contexts, pad, device)
    longer = [i for i, c in enumerate(continuations) if len(c) > 1]
    chosen = torch.tensor([owner[i] for i in longer], dtype=torch.long, device=device)
    width = max((len(continuations[i]) - 1 for i in longer), default=0)
    with cached_forwards(model, hooks) as run:
        final = run(tokens, mask, positions, first=starts)
        if longer:
            run.select(chosen)
            fed = [[*continuations[i][:-1], *[pad] * (width + 1 - len(continuations[i]))] for i in longer]
            seen = torch.cat([mask[chosen], mask.new_ones(len(longer), width)], dim=1)
            # a shorter continuation's padding may run past the context (the batch's widest sets the width): its
            # positions are clamped; every real token lies inside it (the caller cuts each request to fit)
            after = (mask.sum(-1)[chosen, None] + torch.arange(width, device=device)).clamp(
                max=int(model.cfg.n_ctx) - 1
            )
            rest = run(torch.tensor(fed, device=device), seen, after, first=None)
        else:
            rest = final.new_zeros(0, 0, final.shape[-1])
    if not (is_finite(final) and is_finite(rest)):
        bad_context = torch.isfinite(final).flatten(1).all(-1).logical_not().nonzero()
        if len(bad_context):
            sequence = list(contexts[int(bad_context[0, 0])])
        else:
            i = longer[int(torch.isfinite(rest).flatten(1).all(-1).logical_not().nonzero()[0, 0])]
            sequence = [*contexts[owner[i]], *continuations[i][:-1]]
        raise_non_finite(model, torch.tensor([sequence], device=device), hooks)
    row_of = {i: k for k, i in enumerate(longer)}
    rows = [
        final[owner[i], -1:] if i not in row_of else torch.cat([final[owner[i], -1:], rest[row_of[i], : len(c) - 1]])
        for i, c in enumerate(continuations)
    ]
    targets = torch.tensor([t for c in continuations for t in c], device=device)
    with torch.inference_mode():
        return scored_rows(torch.cat(rows), unembed, targets)
