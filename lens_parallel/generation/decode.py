"""KV-cached decoding over the bridge with edits active at every step.

One batch of prompts is left-padded (the real tokens of every row end at the same column, as Hugging Face's
``generate`` pads), its attention mask marks the padding, and every position's id counts only the row's real tokens
(``cumsum(mask) - 1``). The prompt runs once (the prefill), filling a Hugging Face ``DynamicCache``; each later step
feeds one token per row against it. Every forward ends at the unembedding's input (:data:`FINAL_HOOK`): only the
last position's residual is unembedded (:class:`~lens_parallel.losses.Unembedding`), so no
[batch, pos, vocab] logits exist. The edits' hooks are registered for the whole loop: at the prefill they see the
prompt as a whole-sequence forward does (position 0 of each row where its real tokens start:
:data:`~lens_parallel.edits.FIRST_INDEX`), at each step one query position against the cached keys (only
decode-safe edits run so: :func:`~lens_parallel.edits.decode_safe`; an edit that reads every value, as
``DiagonalEdit``'s o_t, finds the cached ones in :data:`~lens_parallel.edits.STEP_VALUES`). Any other edit (one on a
Qwen3.5 linear-attention layer, whose cached steps run Hugging Face's own module where the bridge's hooks never
fire; a user edit that does not say) decodes without a cache (:func:`recomputed_forwards`): each step reruns the
whole sequence so far, as every analysis runs it, so each token is the edited model's, at O(T^2) cost.

TransformerLens 4.3's attention bridges drop the cache transformers 5 hands them
(:func:`lens_parallel.generation.cache.cache_reaches_attention` passes it on); ``tests/test_generation.py`` checks
the tokens against Hugging Face's own ``generate`` on the same weights and token ids.

Choosing a token: greedy (argmax; ties to the lowest id, as ``torch.argmax``), or sampled from
softmax(logits / temperature) restricted to the smallest set of tokens whose probability reaches ``top_p`` (nucleus
sampling), each prompt with its own generator seeded by (seed, the prompt's index), so a prompt's text does not
depend on the batch it ran in. A row stops at the end-of-sequence token or when its text contains a stop string.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.hook_points import HookPoint
from transformer_lens.model_bridge import TransformerBridge
from transformers import DynamicCache, PreTrainedConfig

from lens_parallel.edits import FIRST_INDEX, STEP_VALUES
from lens_parallel.generation.cache import cache_keywords, cache_reaches_attention
from lens_parallel.hooks import FINAL_HOOK, Hook, StopForward, model_lock, raise_non_finite
from lens_parallel.losses import Unembedding, logits_of


@dataclass(frozen=True)
class Sampling:
    """How a token is chosen: greedy, or sampled at ``temperature`` from the top-``top_p`` nucleus with ``seed``."""

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class Decoded:
    """One prompt's continuation: its ``tokens`` (up to and including the one that ended it; the end-of-sequence
    token is not kept), its ``text`` (cut before the first stop string), and why it ended (``eos``, ``stop``: a stop
    string, ``length``: max_new_tokens)."""

    tokens: tuple[int, ...]
    text: str
    finish: str


class _Forwards:
    """Forwards of one batch under hooks, each call returning the final normalised residual of its new positions
    (the unembedding's input, :data:`FINAL_HOOK`: the forward ends there, no logits); :meth:`_sequence` says what
    the model runs for them, ``keywords`` what else it is handed."""

    model: TransformerBridge
    kept: list[Tensor]
    keywords: dict[str, Any]

    def __call__(
        self,
        tokens: Int[Tensor, "batch pos"],
        mask: Int[Tensor, "batch key_pos"],
        positions: Int[Tensor, "batch pos"],
        *,
        first: Tensor | None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """One forward of ``tokens`` (``mask``: every key position's, earlier and new; ``positions``: the new
        tokens' position ids); ``first``: where position 0 of each row lies in ``tokens``
        (:data:`~lens_parallel.edits.FIRST_INDEX`: the real tokens' start in a left-padded prompt; None: every new
        position comes after it)."""
        run, run_positions, first = self._sequence(tokens, positions, first)
        with _bound(FIRST_INDEX, first), contextlib.suppress(StopForward):
            self.model(run, attention_mask=mask, position_ids=run_positions, return_type=None, **self.keywords)
        return self.kept.pop()[:, -tokens.shape[1] :]

    def _sequence(
        self, tokens: Tensor, positions: Tensor, first: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        raise NotImplementedError


class CachedForwards(_Forwards):
    """Forwards against one growing Hugging Face ``DynamicCache`` (opened by :func:`cached_forwards`): each call
    runs ``tokens`` after whatever the cache holds, extending it; :meth:`select` keeps chosen rows of the cache for
    the next call."""

    def __init__(self, model: TransformerBridge, cache: DynamicCache, kept: list[Tensor]) -> None:
        self.model, self.cache, self.kept = model, cache, kept
        self.keywords = cache_keywords(model.original_model, cache)

    def _sequence(
        self, tokens: Tensor, positions: Tensor, first: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        return tokens, positions, first

    def select(self, rows: Int[Tensor, " row"]) -> None:
        """Keep the cache's rows ``rows`` (in that order, a row repeated as often as named) for the next forward."""
        self.cache.reorder_cache(cast(torch.LongTensor, rows))


class RecomputedForwards(_Forwards):
    """Forwards without a cache (opened by :func:`recomputed_forwards`): each call appends ``tokens`` to the
    sequence so far and reruns all of it (position 0 of each row where the first call's ``first`` said)."""

    def __init__(self, model: TransformerBridge, kept: list[Tensor]) -> None:
        self.model, self.kept, self.keywords = model, kept, {"use_cache": False}
        self.tokens: Tensor | None = None
        self.positions: Tensor | None = None
        self.first: Tensor | None = None

    def _sequence(
        self, tokens: Tensor, positions: Tensor, first: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        if self.tokens is None or self.positions is None:
            self.tokens, self.positions, self.first = tokens, positions, first
        else:
            self.tokens = torch.cat([self.tokens, tokens], dim=1)
            self.positions = torch.cat([self.positions, positions], dim=1)
        return self.tokens, self.positions, self.first


def _keep_final(resid: Tensor, hook: HookPoint, *, kept: list[Tensor]) -> None:
    kept.append(resid)
    raise StopForward


@contextlib.contextmanager
def cached_forwards(model: TransformerBridge, hooks: Sequence[Hook]) -> Iterator[CachedForwards]:
    """Cached forwards of ``model`` under ``hooks`` (registered once for every forward inside, not per step),
    without gradients, the model held (:func:`~lens_parallel.hooks.model_lock`), the cache handed to every
    attention bridge (:func:`~lens_parallel.generation.cache.cache_reaches_attention`) and every layer's cached
    values to the edits that read them (:data:`~lens_parallel.edits.STEP_VALUES`)."""
    values: dict[int, Tensor] = {}  # each layer's cached and new values, for the edits that read them all
    kept: list[Tensor] = []
    cache = DynamicCache(config=cast(PreTrainedConfig, model.original_model.config))
    with (
        torch.inference_mode(),
        model_lock(model),
        cache_reaches_attention(model, values=values),
        model.hooks(fwd_hooks=[*hooks, (FINAL_HOOK, partial(_keep_final, kept=kept))]),
        _bound(STEP_VALUES, values),
    ):
        yield CachedForwards(model, cache, kept)


@contextlib.contextmanager
def recomputed_forwards(model: TransformerBridge, hooks: Sequence[Hook]) -> Iterator[RecomputedForwards]:
    """Uncached forwards of ``model`` under ``hooks`` (registered once), without gradients, the model held
    (:func:`~lens_parallel.hooks.model_lock`): what decoding runs for an edit that is not decode-safe."""
    kept: list[Tensor] = []
    with (
        torch.inference_mode(),
        model_lock(model),
        model.hooks(fwd_hooks=[*hooks, (FINAL_HOOK, partial(_keep_final, kept=kept))]),
    ):
        yield RecomputedForwards(model, kept)


def left_padded(
    prompts: Sequence[Sequence[int]], pad: int, device: torch.device
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"], Int[Tensor, "batch pos"], Int[Tensor, " batch"]]:
    """``prompts`` left-padded with ``pad`` to one width, as Hugging Face's ``generate`` pads: the tokens, the
    attention mask (1: a real token), each position's id counting the row's real tokens only (``cumsum(mask) -
    1``, 0 on the pads) and where each row's real tokens start."""
    width = max(len(p) for p in prompts)
    starts = torch.tensor([width - len(p) for p in prompts], device=device)
    tokens = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = (torch.arange(width, device=device) >= starts[:, None]).long()
    return tokens, mask, (mask.cumsum(-1) - 1).clamp_min(0), starts


def end_of_sequence(model: TransformerBridge, tokenizer: Any) -> frozenset[int]:
    """The tokens that end a continuation: the model's generation config's ``eos_token_id`` (one or several, as
    Hugging Face's ``generate`` reads it) and the tokenizer's."""
    config = getattr(model.original_model, "generation_config", None)
    ids = getattr(config, "eos_token_id", None)
    found = {ids} if isinstance(ids, int) else set(ids or ())
    return frozenset(found | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()))


def _choose(logits: Float[Tensor, "batch d_vocab"], sampling: Sampling, generators: list[torch.Generator]) -> Tensor:
    """Each row's next token. A row whose logits are not finite (refused after the batch: :func:`decode_batch`)
    samples from a uniform distribution meanwhile, so that nothing here raises or waits for the device."""
    if not sampling.do_sample:
        return logits.argmax(-1)
    logits = torch.where(torch.isfinite(logits).all(-1, keepdim=True), logits, 0.0)
    probs = torch.softmax(logits.double() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the tokens ranked above each one
        sorted_probs = torch.where(before < sampling.top_p, sorted_probs, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    rows = [torch.multinomial(p.cpu(), 1, generator=g) for p, g in zip(probs, generators, strict=True)]
    return torch.cat(rows).to(logits.device)


@contextlib.contextmanager
def _bound(variable: contextvars.ContextVar[Any], value: Any) -> Iterator[None]:
    """``variable`` set to ``value`` while inside."""
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``text`` cut before the first of the ``stop`` strings, and whether one was found."""
    at = min((i for s in stop if (i := text.find(s)) >= 0), default=-1)
    return (text, False) if at < 0 else (text[:at], True)


Advance = Callable[[int, int], None]
"""Progress of a decoding loop: ``advance(tokens, rows)`` after each step, with the token budget used up in it (one
per row still decoding, plus the unused budget of each row that ended) and the rows that ended."""


def decode_batch(
    model: TransformerBridge,
    prompts: Sequence[Sequence[int]],
    hooks: Sequence[Hook],
    *,
    max_new_tokens: int,
    sampling: Sampling,
    stop: Sequence[str],
    tokenizer: Any,
    unembed: Unembedding,
    indices: Sequence[int],
    eos: frozenset[int],
    advance: Advance | None = None,
    cached: bool = True,
) -> list[Decoded]:
    """Continue every prompt (token ids, left-padded here) under ``hooks`` for at most ``max_new_tokens`` tokens,
    ending a row at a token of ``eos`` (:func:`end_of_sequence`) or a ``stop`` string; ``indices``: each prompt's
    index in the whole call (its sampling generator's seed); ``advance``: progress (:data:`Advance`); ``cached``:
    with a key/value cache (the hooks must be decode-safe), else each step reruns the whole sequence.

    Non-finite logits are never a token: each step ORs, on the device, whether a row still decoding had a NaN or an
    infinite logit into a per-row flag, read once when the batch ends (no wait for the device per step on its
    account); a flagged batch is refused with :class:`~lens_parallel.errors.NonFiniteError` naming the first hook
    point (or parameter) holding one, found by recomputing the first flagged row's whole sequence under ``hooks``
    (:func:`~lens_parallel.hooks.raise_non_finite`), before any of its texts is returned."""
    device = unembed.W_U.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos, default=0)
    tokens, mask, positions, starts = left_padded(prompts, pad, device)
    generators = [torch.Generator().manual_seed(sampling.seed * 1_000_003 + i) for i in indices]
    out: list[list[int]] = [[] for _ in prompts]
    finish: list[str | None] = [None] * len(prompts)
    texts = [""] * len(prompts)
    non_finite = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    decoding = torch.ones(len(prompts), dtype=torch.bool, device=device)
    forwards = cached_forwards if cached else recomputed_forwards
    with forwards(model, hooks) as run:
        logits = logits_of(run(tokens, mask, positions, first=starts)[:, -1], unembed)
        for step in range(max_new_tokens):
            non_finite |= decoding & ~torch.isfinite(logits).all(-1)
            chosen = _choose(logits, sampling, generators).tolist()
            used, ended = 0, 0
            for row, token in enumerate(chosen):
                if finish[row] is not None:
                    continue
                used += 1
                if token in eos:
                    finish[row] = "eos"
                else:
                    out[row].append(token)
                    texts[row], stopped = cut_at_stop(tokenizer.decode(out[row]), stop)
                    finish[row] = "stop" if stopped else None
                if finish[row] is not None:
                    ended += 1
                    used += max_new_tokens - step - 1
            last = all(f is not None for f in finish) or step == max_new_tokens - 1
            if advance is not None:
                advance(used, ended + (sum(f is None for f in finish) if last else 0))
            if last:
                break
            rows = [[pad, 0] if finish[r] else [t, 1] for r, t in enumerate(chosen)]  # one copy to the device
            fed_and_decoding = torch.tensor(rows, device=device)
            fed, decoding = fed_and_decoding[:, :1], fed_and_decoding[:, 1].bool()
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            logits = logits_of(run(fed, mask, positions, first=None)[:, -1], unembed)
    if bool(non_finite.any()):  # the batch's one read of the flag
        row = int(non_finite.nonzero()[0, 0])
        sequence = torch.tensor([[*prompts[row], *out[row]]], device=device)
        raise_non_finite(model, sequence, hooks, output="a decoding step's logits")
    return [Decoded(tuple(o), t, f or "length") for o, t, f in zip(out, texts, finish, strict=True)]
