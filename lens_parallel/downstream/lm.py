"""An lm-evaluation-harness model that scores with the loaded bridge under lens_parallel edits.

:class:`EditedLM` is lm-eval's ``TemplateLM``: lm-eval's own code turns each request into tokens (its
``_encode_pair``: trailing context spaces moved to the continuation, the pair encoded whole and split; an empty
context conditioned on the prefix token) and cuts rolling windows for perplexity tasks (its
``get_rolling_token_windows`` / ``make_disjoint_window``, as its ``hf`` model does); this class only scores tokens.
A batch is a set of requests of similar length (longest first), right-padded, run through the bridge with the
edits' hooks to the final normalised residual (:func:`lens_parallel.hooks.forward`: no logits), and only the
continuation's positions are unembedded (:func:`lens_parallel.losses.scored_rows`). Right padding changes nothing
a scored position sees (causal attention). Requests sharing a context (a multiple-choice item's choices) are scored
against one key/value-cached run of it (:mod:`lens_parallel.generation.continuations`). ``generate_until``
decodes with the edits at every step (:meth:`EditedLM.generate_until`, lm-eval's ``hf`` semantics; see
``docs/downstream.md``).

Tokenisation follows lm-eval's ``hf`` model: the tokenizer as Hugging Face loads it from the model's tokenizer
folder or name (:func:`hf_tokenizer`; TransformerLens reloads it with ``add_bos_token=True``, which would prepend a
BOS that lm-eval's ``hf`` model does not), ``add_special_tokens`` as its ``add_bos_token`` option (None: the
tokenizer's default), a string that starts with the BOS text encoded without specials, the prefix token BOS (else
EOS), the maximum length the model's context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import torch
from jaxtyping import Bool, Float
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM, hash_args
from lm_eval.models import utils as lm_models_utils
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import compat
from lens_parallel.edits import Edit, compile_hooks, decode_safe
from lens_parallel.errors import LensParallelError, kept_in
from lens_parallel.generation.continuations import score_continuations
from lens_parallel.generation.decode import Sampling, decode_batch, end_of_sequence
from lens_parallel.hooks import forward
from lens_parallel.losses import scored_rows, unembedding
from lens_parallel.models import model_info
from lens_parallel.tokenizers import hf_tokenizer

TokenRequest = tuple[tuple[str, str] | None, list[int], list[int]]
"""lm-eval's tokenised loglikelihood request: the (context, continuation) strings, and their tokens."""


class EditedLM(TemplateLM):  # type: ignore[misc]
    """lm-eval model: ``model`` (a TransformerBridge) under ``edits`` (one combined intervention; empty: unedited),
    ``batch_size`` requests per forward at most and ``tokens_per_forward`` tokens (padded) at most; ``tokenizer``:
    default :func:`hf_tokenizer`."""

    def __init__(
        self,
        model: TransformerBridge,
        edits: Sequence[Edit] = (),
        *,
        batch_size: int = 8,
        tokens_per_forward: int = 8192,
        add_bos_token: bool | None = None,
        max_length: int | None = None,
        max_gen_toks: int | None = None,
        progress: bool = True,
        desc: str = "scoring requests",
        tokenizer: Any = None,
    ) -> None:
        super().__init__()
        self.model, self.edits = model, tuple(edits)
        self.hooks = compile_hooks(model, self.edits)  # every edit checked against the model before any forward
        self.tokenizer = hf_tokenizer(model) if tokenizer is None else tokenizer
        self.batch_size, self.tokens_per_forward, self.progress = batch_size, tokens_per_forward, progress
        self.add_bos_token = add_bos_token
        self._max_length = max_length or int(model.cfg.n_ctx)
        self.max_gen_toks = 256 if max_gen_toks is None else max_gen_toks  # lm-eval's hf default: 256
        self.gen_toks_override = max_gen_toks is not None  # then it overrides the task's own
        self.unembed = unembedding(model)
        self._device = next(model.parameters()).device
        self.desc = desc
        self.store: Any = None
        self.cut: dict[str, int] = {}
        """Requests whose context was cut to fit the model (lm-eval's ``hash_args`` of the request -> the tokens of
        context kept), counted for every request asked for, stored answers included."""

    def attach_store(self, store: Any) -> None:
        """Keep every answer in ``store`` (a mapping: a ``SqliteDict`` table, committed as written) under lm-eval's
        ``hash_args`` of its request, as each batch finishes, and read answers found there instead of computing them
        (greedy generations only, as lm-eval's own request cache)."""
        self.store = store
        self.set_cache_hook(_StoreHook(store))

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return int(bos if bos is not None else self.tokenizer.eos_token_id)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's name or folder, as lm-eval's ``hf`` model names it (part of its request-cache key)."""
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """``chat_history`` in the tokenizer's chat template, as lm-eval's ``hf`` model renders it (the model's turn
        opened, or with ``add_generation_prompt=False`` the last message continued); a template without a system
        role gets the history without system messages, as there."""
        kwargs = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
        kwargs["continue_final_message"] = not add_generation_prompt
        try:
            return str(self.tokenizer.apply_chat_template(chat_history, **kwargs))
        except jinja2.exceptions.TemplateError:
            history = [message for message in chat_history if message["role"] != "system"]
            return str(self.tokenizer.apply_chat_template(history, **kwargs))

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        special = compat.add_special_kwargs(add_special_tokens, self.add_bos_token)
        bos_text = self.tokenizer.decode(self.prefix_token_id)
        if add_special_tokens is None and lm_models_utils.has_bos_prefix(string, bos_text):
            special["add_special_tokens"] = False
        return list(self.tokenizer.encode(string, **special))

    def _batches(self, order: list[int], lengths: list[int], cost: Sequence[int] | None = None) -> list[list[int]]:
        """``order`` (longest first) cut into batches of at most ``batch_size`` items and ``tokens_per_forward``
        padded tokens, an item of ``lengths[i]`` tokens holding ``cost[i]`` (default 1) padded sequences (a first
        item over the budget runs alone)."""
        weight = [1] * len(lengths) if cost is None else cost
        out: list[list[int]] = []
        for i in order:
            if out and len(out[-1]) < self.batch_size:
                width, held = lengths[out[-1][0]], sum(weight[j] for j in out[-1])
                if width * (held + weight[i]) <= max(self.tokens_per_forward, width * weight[out[-1][0]]):
                    out[-1].append(i)
                    continue
            out.append([i])
        return out

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """lm-eval's tokenisation of each (context, continuation), then :meth:`_loglikelihood_tokens`."""
        return list(super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress))

    def _loglikelihood_tokens(self, requests: list[TokenRequest], **kwargs: Any) -> list[tuple[float, bool]]:
        """(sum of log-probabilities of the continuation, whether every continuation token is the argmax) per
        request: the input is (context + continuation)[-(max_length + 1):][:-1], as lm-eval's ``hf`` model (a
        request whose context loses tokens so is recorded in :attr:`cut`). Answers in the store are read, not
        computed; each computed one goes to the store as its batch finishes.

        Requests whose (cut) contexts are the same token ids, as the choices of a multiple-choice item, are scored
        against one run of that context (:func:`~lens_parallel.generation.continuations.score_continuations`,
        every edit decode-safe); the others, a batch of whole sequences right-padded."""
        inputs = [(ctx + cont)[-(self.max_length + 1) :][:-1] for _, ctx, cont in requests]
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for i, ((key, ctx, cont), inp) in enumerate(zip(requests, inputs, strict=True)):
            if not cont or len(cont) > len(inp):
                raise LensParallelError(f"a continuation of {len(cont)} tokens does not fit {self.max_length} tokens")
            if key is None:
                continue
            hashed = hash_args("loglikelihood", key)
            if len(ctx) + len(cont) > self.max_length + 1:
                self.cut[hashed] = self.max_length + 1 - len(cont)
            if self.store is not None and hashed in self.store:
                results[i] = (float(self.store[hashed][0]), bool(self.store[hashed][1]))
        todo = [i for i, r in enumerate(results) if r is None]
        bar = tqdm(total=len(todo), desc=self.desc, disable=not self.progress or kwargs.get("disable_tqdm"))
        groups: dict[tuple[int, ...], list[int]] = {}
        for i in todo if decode_safe(self.edits, model_info(self.model)) else ():
            groups.setdefault(tuple(inputs[i][: len(inputs[i]) - len(requests[i][2]) + 1]), []).append(i)
        kept = {context: members for context, members in groups.items() if len(members) > 1}
        contexts, shared = [list(context) for context in kept], list(kept.values())
        alone = sorted(set(todo) - {i for members in shared for i in members}, key=lambda i: -len(inputs[i]))
        lengths = [len(x) for x in inputs]
        for batch in self._batches(alone, lengths):
            width = lengths[batch[0]]
            tokens = torch.full((len(batch), width), self.eot_token_id, dtype=torch.long, device="cpu")
            for row, i in enumerate(batch):
                tokens[row, : lengths[i]] = torch.tensor(inputs[i], device="cpu")
            final = forward(self.model, tokens.to(self._device), self.hooks)
            assert final is not None
            rows = [final[row, lengths[i] - len(requests[i][2]) : lengths[i]] for row, i in enumerate(batch)]
            targets = torch.tensor([t for i in batch for t in requests[i][2]], device=final.device)
            with torch.inference_mode():
                self._answer(
                    [requests[i] for i in batch], batch, results, *scored_rows(torch.cat(rows), self.unembed, targets)
                )
            bar.update(len(batch))
        widths = [len(c) for c in contexts]
        held = [1 + sum(len(requests[i][2]) > 1 for i in members) for members in shared]
        for batch in self._batches(sorted(range(len(shared)), key=lambda g: -widths[g]), widths, held):
            members = [i for g in batch for i in shared[g]]
            owner = [k for k, g in enumerate(batch) for _ in shared[g]]
            scored = score_continuations(
                self.model,
                self.hooks,
                [contexts[g] for g in batch],
                [requests[i][2] for i in members],
                owner,
                unembed=self.unembed,
                pad=self.eot_token_id,
            )
            self._answer([requests[i] for i in members], members, results, *scored)
            bar.update(len(members))
        bar.close()
        return [r for r in results if r is not None]

    def _answer(
        self,
        requests: list[TokenRequest],
        indices: list[int],
        results: list[tuple[float, bool] | None],
        nll: Float[Tensor, " token"],
        greedy: Bool[Tensor, " token"],
    ) -> None:
        """Each request's answer from its continuation tokens' NLL and greedy flags (the requests' continuations one
        after another): (-sum NLL in float64, every token greedy), into ``results[indices[k]]`` and the store."""
        nll64, greedy_cpu = nll.double().cpu(), greedy.cpu()
        start = 0
        for (key, _, cont), i in zip(requests, indices, strict=True):
            n = len(cont)
            results[i] = (-float(nll64[start : start + n].sum()), bool(greedy_cpu[start : start + n].all()))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, results[i])
            start += n

    def rolling_windows(self, string: str) -> list[tuple[list[int], list[int]]]:
        """lm-eval's disjoint rolling windows of ``string`` (as its ``hf`` model cuts them): (context,
        continuation) token lists, the continuation being the tokens the window predicts."""
        rolling = lm_utils.get_rolling_token_windows(
            token_list=self.tok_encode(string),
            prefix_token=self.prefix_token_id,
            max_seq_len=self.max_length,
            context_len=1,
        )
        return [lm_utils.make_disjoint_window(w) for w in rolling]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole string, over lm-eval's disjoint rolling windows of ``max_length`` (a
        string in the store is read, not computed)."""
        windows: list[TokenRequest] = []
        counts = []
        stored: dict[int, float] = {}
        for i, req in enumerate(requests):
            hashed = hash_args("loglikelihood_rolling", req.args)
            if self.store is not None and hashed in self.store:
                stored[i] = float(self.store[hashed])
                continue
            found: list[TokenRequest] = [(None, *w) for w in self.rolling_windows(req.args[0])]
            windows += found
            counts.append(len(found))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        out, start, fresh = [], 0, iter(counts)
        for i, req in enumerate(requests):
            if i in stored:
                out.append(stored[i])
                continue
            n = next(fresh)
            total = sum(s for s, _ in scores[start : start + n])
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
            out.append(total)
            start += n
        return out

    def plan_generation(self, context: str, gen_kwargs: dict[str, Any]) -> GenerationPlan:
        """How one ``generate_until`` request runs, with lm-eval's ``hf`` semantics: its generation kwargs
        normalised by lm-eval (``max_gen_toks``, default 256, or this model's ``max_gen_toks`` where given; greedy
        unless ``do_sample``), the EOS text added to its ``until`` strings, the context left-truncated to
        ``max_length - max_gen_toks`` tokens."""
        kwargs = lm_models_utils.normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        if self.gen_toks_override:
            kwargs["max_gen_toks"] = self.max_gen_toks
        until = lm_models_utils.handle_stop_sequences(
            kwargs.pop("until", None), eos=self.tokenizer.decode(self.eot_token_id)
        )
        max_gen = int(kwargs.pop("max_gen_toks"))
        if max_gen >= self.max_length:
            raise LensParallelError(f"max_gen_toks {max_gen} leaves no room for a context in {self.max_length}")
        do_sample = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
        sampling = Sampling(do_sample, temperature if do_sample else 1.0, float(kwargs.pop("top_p", 1.0)))
        ids = self.tok_encode(context)
        room = self.max_length - max_gen
        return GenerationPlan(ids[-room:], tuple(until), max_gen, sampling, room if len(ids) > room else None)

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation (:meth:`plan_generation`; a request whose context was cut is recorded in
        :attr:`cut`), the text cut at the first stop string (lm-eval's ``postprocess_generated_text``). Requests with
        the same kwargs run in batches, longest first, with the edits at every step (KV-cached where every edit is
        decode-safe, else recomputing the sequence at each step: :mod:`lens_parallel.generation.decode`); a greedy
        answer in the store is read, not computed, and each finished answer goes to the store at once (resumable).
        Progress: one step per request finished."""
        cached = decode_safe(self.edits, model_info(self.model))
        eos_ids = end_of_sequence(self.model, self.tokenizer)
        planned = [self.plan_generation(*req.args) for req in requests]
        results: list[str | None] = [None] * len(requests)
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, (req, plan) in enumerate(zip(requests, planned, strict=True)):
            hashed = hash_args("generate_until", req.args)
            if plan.cut_to is not None:
                self.cut[hashed] = plan.cut_to
            if self.store is not None and not plan.sampling.do_sample and hashed in self.store:
                results[i] = str(self.store[hashed])
                continue
            groups.setdefault((plan.until, plan.max_gen, plan.sampling), []).append(i)
        todo = sum(len(members) for members in groups.values())
        bar = tqdm(total=todo, desc=self.desc, disable=not self.progress or disable_tqdm)
        for (until, max_gen, sampling), members in groups.items():
            members.sort(key=lambda i: -len(planned[i].ids))
            for k in range(0, len(members), self.batch_size):
                batch = members[k : k + self.batch_size]
                decoded = decode_batch(
                    self.model,
                    [planned[i].ids for i in batch],
                    self.hooks,
                    max_new_tokens=max_gen,
                    sampling=sampling,
                    stop=until,
                    tokenizer=self.tokenizer,
                    unembed=self.unembed,
                    indices=batch,
                    eos=eos_ids,
                    advance=lambda tokens, rows: bar.update(rows),
                    cached=cached,
                )
                for i, d in zip(batch, decoded, strict=True):
                    text = self.tokenizer.decode(list(d.tokens), skip_special_tokens=True)
                    results[i] = lm_models_utils.postprocess_generated_text(text, list(until), None)
                    self.cache_hook.add_partial("generate_until", requests[i].args, results[i])
        bar.close()
        return [r for r in results if r is not None]


@dataclass(frozen=True)
class GenerationPlan:
    """One ``generate_until`` request as it runs: the context's token ``ids`` (after any cut), the ``until``
    strings, ``max_gen`` tokens at most, the ``sampling``, and ``cut_to``: the tokens kept of a context that was cut
    to fit the model (None: whole)."""

    ids: list[int]
    until: tuple[str, ...]
    max_gen: int
    sampling: Sampling
    cut_to: int | None


class _StoreHook:
    """lm-eval's cache hook, writing each finished answer into a request store (a ``SqliteDict`` table, committed
    as it is written) under lm-eval's ``hash_args`` of the request."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def add_partial(self, attr: str, req: Any, res: Any) -> None:
        self.store[hash_args(attr, req)] = res
        kept_in(self.store.filename)
