"""What the edited model says: :func:`generate`, several settings side by side on the same prompts."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from tqdm.auto import tqdm
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel.bridges import check_model
from lens_parallel.documents import Documents, DocumentsLike
from lens_parallel.edits import UNEDITED, Settings, compile_hooks, decode_safe, describe_edit, named_edits
from lens_parallel.errors import LensParallelError, long_call
from lens_parallel.generation.decode import Decoded, Sampling, cut_at_stop, decode_batch, end_of_sequence
from lens_parallel.losses import unembedding
from lens_parallel.options import RunOptions, resolve
from lens_parallel.paths import check_writable
from lens_parallel.plots.texts import html_page, shared_prefix, texts_table
from lens_parallel.results import Provenance, ResultMixin
from lens_parallel.store import SweepStore, Values, ValueSpec
from lens_parallel.sweep import model_fingerprint
from lens_parallel.tokenizers import hf_tokenizer
from lens_parallel.validate import check_bool, check_finite, check_non_negative_int, check_positive_int


@dataclass(frozen=True, kw_only=True)
class GenerateSettings:
    """How continuations are generated: at most ``max_new_tokens`` tokens, greedy or (``do_sample``) sampled at
    ``temperature`` from the ``top_p`` nucleus with ``seed``; a continuation also ends at the end-of-sequence token
    or at the first of the ``stop`` strings (cut from the text, as lm-eval's ``until``). Prompts are tokenised as the
    model's own tokenizer does by default (Hugging Face's defaults; ``add_bos_token`` True / False overrides).

    Examples:
        >>> import lens_parallel as lp
        >>> lp.GenerateSettings(max_new_tokens=8).max_new_tokens
        8
    """

    max_new_tokens: int = field(default=32, metadata={"help": "the most tokens generated per prompt"})
    do_sample: bool = field(default=False, metadata={"help": "sample the next token (without it: greedy)"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (> 0)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling: the smallest top set of this mass"})
    seed: int = field(default=0, metadata={"help": "seed of the sampling (each prompt its own generator)"})
    stop: tuple[str, ...] | None = field(
        default=(), metadata={"help": "stop strings (cut from the text)", "none": "none"}
    )
    add_bos_token: bool | None = field(
        default=None, metadata={"help": "prepend BOS to each prompt", "none": "the tokenizer's default"}
    )

    def __post_init__(self) -> None:
        check_positive_int("max_new_tokens", self.max_new_tokens)
        check_non_negative_int("seed", self.seed)
        check_bool("do_sample", self.do_sample)
        check_bool("add_bos_token", self.add_bos_token, optional=True)
        if not check_finite("temperature", self.temperature) > 0:
            raise LensParallelError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        if not 0 < check_finite("top_p", self.top_p) <= 1:
            raise LensParallelError(f"top_p must be in (0, 1], got {self.top_p!r}")
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in stop):
            raise LensParallelError(
                f"stop must be a string, a list of non-empty strings or None (no stop strings), got {self.stop!r}"
            )
        object.__setattr__(self, "stop", tuple(stop))

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.do_sample, float(self.temperature), float(self.top_p), self.seed)


@dataclass(frozen=True, repr=False, kw_only=True)
class GenerationResult(ResultMixin):
    """Each prompt's continuation under each setting (``settings[0]`` is the unedited model): ``texts[s][p]``,
    ``tokens[s][p]`` (token ids) and ``finish[s][p]`` (``eos``, ``stop`` or ``length``).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> out = lp.generate(model, "Once upon a time", max_new_tokens=4, progress=False)
        >>> len(out.tokens[0][0]) <= 4
        True
    """

    columns: ClassVar[str] = (
        "prompt_index prompt setting text n_tokens finish departs_at model n_prompts mean_tokens[<setting>] "
        "share_departing[<setting>] mean_departs_at[<setting>]"
    )

    prompts: tuple[str, ...]
    settings: tuple[str, ...]
    texts: tuple[tuple[str, ...], ...]
    tokens: tuple[tuple[tuple[int, ...], ...], ...]
    finish: tuple[tuple[str, ...], ...]
    provenance: Provenance | None = None

    def departs_at(self, setting: int, prompt: int) -> int | None:
        """The first generated token where ``setting``'s continuation of ``prompt`` departs from the unedited one
        (None: identical)."""
        a, b = self.tokens[0][prompt], self.tokens[setting][prompt]
        return None if a == b else shared_prefix(a, b)

    def to_dataframe(self) -> pd.DataFrame:
        """One row per prompt x setting: ``prompt_index``, ``prompt``, ``setting``, ``text``, ``n_tokens``,
        ``finish`` and ``departs_at`` (the first token that differs from the unedited continuation; <NA>: none)."""
        rows = [
            {
                "prompt_index": p,
                "prompt": prompt,
                "setting": setting,
                "text": self.texts[s][p],
                "n_tokens": len(self.tokens[s][p]),
                "finish": self.finish[s][p],
                "departs_at": self.departs_at(s, p),
            }
            for p, prompt in enumerate(self.prompts)
            for s, setting in enumerate(self.settings)
        ]
        frame = pd.DataFrame(rows)
        frame["departs_at"] = frame["departs_at"].astype("Int64")
        return frame

    def summary(self) -> pd.DataFrame:
        """One row: the model, the number of prompts, and per setting the mean tokens generated
        (``mean_tokens[<setting>]``), and per edited setting the share of continuations that depart from the
        unedited one (``share_departing[<setting>]``) and the mean token where they do (``mean_departs_at[...]``)."""
        frame = self.to_dataframe()
        row: dict[str, Any] = {"model": self.info.name if self.provenance else None, "n_prompts": len(self.prompts)}
        for setting, part in frame.groupby("setting", sort=False):
            row[f"mean_tokens[{setting}]"] = float(part["n_tokens"].mean())
            if setting != self.settings[0]:
                departed = part["departs_at"].dropna()
                row[f"share_departing[{setting}]"] = len(departed) / len(part)
                row[f"mean_departs_at[{setting}]"] = float(departed.mean()) if len(departed) else math.nan
        return pd.DataFrame([row])

    def _repr_html_(self) -> str:
        """A table: one row per prompt, one column per setting; in each edited setting, the text from where it
        departs from the unedited one is highlighted."""
        rows = [
            ((prompt,), [self.texts[s][p] for s in range(len(self.settings))]) for p, prompt in enumerate(self.prompts)
        ]
        return texts_table(("prompt", *self.settings), rows)

    def html(self) -> str:
        """A self-contained page: the texts side by side (:meth:`_repr_html_`), then :meth:`figure`."""
        model = self.info.name if self.provenance else "model"
        return html_page(f"{model}: continuations under each setting", [self._repr_html_(), self.figure()])

    def figure(self) -> go.Figure:
        """Per edited setting, how many tokens each continuation shares with the unedited one before it departs
        (a prompt whose continuation never departs is drawn at its length, marked "same")."""
        fig = go.Figure()
        for s, setting in enumerate(self.settings[1:], start=1):
            at = [self.departs_at(s, p) for p in range(len(self.prompts))]
            shared = np.array([len(self.tokens[s][p]) if a is None else a for p, a in enumerate(at)])
            fig.add_trace(
                go.Box(
                    x=shared,
                    name=setting,
                    boxpoints="all",
                    text=[f"{self.prompts[p][:40]} ({'same' if a is None else 'departs'})" for p, a in enumerate(at)],
                    hovertemplate="%{text}: %{x} tokens<extra></extra>",
                )
            )
        model = self.info.name if self.provenance else "model"
        fig.update_layout(
            title=f"{model}: generated tokens shared with the unedited continuation<br><sup>box: quartiles over "
            "prompts; dots: prompts (one that never departs is drawn at its length)</sup>",
            xaxis_title="tokens before the continuation departs (greedy: then it differs)",
            yaxis_title="setting",
            showlegend=False,
        )
        return fig


def _prompt_ids(tokenizer: Any, prompts: Sequence[str], add_bos_token: bool | None) -> list[list[int]]:
    special = {} if add_bos_token is None else {"add_special_tokens": False}
    out = []
    for prompt in prompts:
        ids = list(tokenizer.encode(prompt, **special))
        if add_bos_token and tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id, *ids]
        out.append(ids)
    return out


def _prompts(
    model: TransformerBridge, tokenizer: Any, prompts: DocumentsLike, add_bos_token: bool | None
) -> tuple[tuple[str, ...], list[list[int]]]:
    """Each prompt's text and token ids: strings encoded as the tokenizer encodes them (Hugging Face ``generate``'s
    rule; ``add_bos_token``), anything else as :meth:`~lens_parallel.documents.Documents.of` reads it (token ids, a
    masked batch: padding dropped), its text decoded for the result."""
    if isinstance(prompts, str) or (
        isinstance(prompts, (list, tuple)) and prompts and all(isinstance(p, str) for p in prompts)
    ):
        texts = (prompts,) if isinstance(prompts, str) else tuple(prompts)
        if empty := [i for i, p in enumerate(texts) if not p]:
            raise LensParallelError(f"prompt {empty[0]} is empty: every prompt must be a non-empty string")
        return texts, _prompt_ids(tokenizer, texts, add_bos_token)
    docs = Documents.of(prompts, model)
    ids = [row[:n].tolist() for row, n in zip(docs.tokens.cpu(), docs.lengths.tolist(), strict=True)]
    return tuple(tokenizer.decode(row) for row in ids), ids


@dataclass(frozen=True)
class _Continuation:
    """One prompt continued under one setting: a unit of the generation store (its repr, hashed into the store's
    row, holds the prompt's text and the setting's edits, so a store never hands back another prompt's text)."""

    setting: str
    prompt: int
    text: str
    edits: str  # the setting's edits as described in provenance (JSON)

    @property
    def key(self) -> str:
        return f"{self.setting}|{self.prompt}"


_FINISH = ("eos", "stop", "length")


def _stored(decoded: Decoded, max_new_tokens: int) -> Values:
    """A continuation as the store's row: its tokens padded with NaN to ``max_new_tokens``, its finish's index."""
    tokens = np.full(max_new_tokens, np.nan)
    tokens[: len(decoded.tokens)] = decoded.tokens
    return {"tokens": tokens, "finish": np.array(float(_FINISH.index(decoded.finish)))}


def _restored(value: Values, tokenizer: Any, stop: Sequence[str]) -> Decoded:
    """A stored continuation (:func:`_stored`), its text decoded and cut again (as the decoding loop cuts it)."""
    tokens = tuple(int(t) for t in value["tokens"] if not np.isnan(t))
    text, _ = cut_at_stop(tokenizer.decode(list(tokens)), stop)
    return Decoded(tokens, text, _FINISH[int(value["finish"])])


@long_call
def generate(
    model: TransformerBridge,
    prompts: DocumentsLike,
    edits: Settings | None = None,
    *,
    settings: GenerateSettings | None = None,
    options: RunOptions | None = None,
    protocol: str | None = None,
    **changes: Any,
) -> GenerationResult:
    """Continue ``prompts`` (strings, as the tokenizer encodes them; or token ids or a masked batch, as
    :meth:`~lens_parallel.documents.Documents.of` reads them) with the unedited model and under each of ``edits``
    (None: the unedited model only; one edit, a list applied together, or a dict naming several settings), the edits
    active at every decoding step (KV-cached where every edit is decode-safe, else each step reruns the whole sequence:
    :mod:`lens_parallel.generation.decode`; the provenance's ``decoding`` says which, per setting). ``settings`` /
    keywords: :class:`GenerateSettings` (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_p``, ``seed``,
    ``stop``); run options: ``batch_size`` prompts per forward, ``progress`` (one bar over the tokens of the call: every
    setting's prompts times ``max_new_tokens``, a continuation that ends early counting its unused budget), ``store``: a
    JSON-lines file that makes the call resumable (each batch's continuations written as it finishes; a rerun decodes
    only the prompts not stored, in the same batches, so its texts equal an uninterrupted run's; a store written with
    another model, weights, settings or batch size is refused). Every prompt, setting and edit is checked before the
    first forward. A NaN or an infinite logit is refused (:class:`~lens_parallel.errors.NonFiniteError`), never decoded
    into a token.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> edit = lp.ZeroDiagonal(layers=[0])
        >>> out = lp.generate(model, ["The cat", "A dog"], edit, max_new_tokens=4, progress=False)
        >>> out.settings
        ('unedited', 'ZeroDiagonal')
    """
    info = check_model(model)
    s, opts = resolve(GenerateSettings, settings, options, protocol, changes)
    if opts.batch_size == "auto":
        raise LensParallelError("generate takes an integer batch_size (prompts per forward), not 'auto'")
    named = {UNEDITED: (), **({} if edits is None else named_edits(edits, info))}
    hooks = {name: compile_hooks(model, setting) for name, setting in named.items()}
    cached = {name: decode_safe(setting, info) for name, setting in named.items()}
    tokenizer = hf_tokenizer(model)
    texts, ids = _prompts(model, tokenizer, prompts, s.add_bos_token)
    n_ctx = int(model.cfg.n_ctx)
    for i, prompt in enumerate(ids):
        if len(prompt) + s.max_new_tokens > n_ctx:
            raise LensParallelError(
                f"prompt {i} has {len(prompt)} tokens: with max_new_tokens={s.max_new_tokens} it exceeds the model's "
                f"context of {n_ctx} tokens"
            )
    if opts.store is not None:
        check_writable(opts.store, "store")
    described = {k: [describe_edit(e) for e in v] for k, v in named.items()}
    as_json = {k: json.dumps(v, sort_keys=True, default=str) for k, v in described.items()}
    rows = _decode_all(model, tokenizer, texts, ids, named, hooks, cached, as_json, s, opts)
    provenance = Provenance.of(
        info,
        None,
        "generate",
        s,
        opts,
        texts={"prompts": list(texts)},
        edits={k: v for k, v in described.items() if v},
        decoding={k: "kv-cache" if v else "recomputed every step" for k, v in cached.items()},
    )
    return GenerationResult(
        prompts=texts,
        settings=tuple(named),
        texts=tuple(tuple(d.text for d in rows[n]) for n in named),
        tokens=tuple(tuple(d.tokens for d in rows[n]) for n in named),
        finish=tuple(tuple(d.finish for d in rows[n]) for n in named),
        provenance=provenance,
    )


def _decode_all(
    model: TransformerBridge,
    tokenizer: Any,
    texts: tuple[str, ...],
    ids: list[list[int]],
    named: dict[str, Any],
    hooks: dict[str, Any],
    cached: dict[str, bool],
    as_json: dict[str, str],
    s: GenerateSettings,
    opts: RunOptions,
) -> dict[str, list[Decoded]]:
    """Every setting's continuation of every prompt, per setting in the prompts' order: those ``opts.store`` holds
    read back, the rest decoded in batches of ``opts.batch_size`` prompts (longest first) and stored as each
    finishes."""
    unembed, eos = unembedding(model), end_of_sequence(model, tokenizer)
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    batches = [order[k : k + int(opts.batch_size)] for k in range(0, len(order), int(opts.batch_size))]
    jobs = [_Continuation(name, i, texts[i], as_json[name]) for name in named for i in range(len(ids))]
    spec = {"tokens": ValueSpec((s.max_new_tokens,), allow_nan=True), "finish": ValueSpec(())}
    store = None
    if opts.store is not None:
        record = {"analysis": "generate", "settings": dataclasses.asdict(s), "batch_size": opts.batch_size}
        plain = json.loads(json.dumps(model_fingerprint(model) | record))  # as the store's header reads back
        store = SweepStore(opts.store, plain, 0, lambda job: spec)
    results: dict[str, list[Decoded | None]] = {name: [None] * len(ids) for name in named}
    with contextlib.ExitStack() as stack:
        done = stack.enter_context(store.session(jobs)) if store is not None else {}
        bar = stack.enter_context(
            tqdm(total=len(jobs) * s.max_new_tokens, desc="generating", unit="tok", disable=not opts.progress)
        )
        for job in jobs:
            if job.key in done:
                results[job.setting][job.prompt] = _restored(done[job.key], tokenizer, s.stop or ())
                bar.update(s.max_new_tokens)
        for name in named:
            for batch in batches:
                if all(results[name][i] is not None for i in batch):
                    continue
                decoded = decode_batch(
                    model,
                    [ids[i] for i in batch],
                    hooks[name],
                    max_new_tokens=s.max_new_tokens,
                    sampling=s.sampling,
                    stop=s.stop or (),
                    tokenizer=tokenizer,
                    unembed=unembed,
                    indices=batch,
                    eos=eos,
                    advance=lambda tokens, rows: bar.update(tokens),
                    cached=cached[name],
                )
                for i, d in zip(batch, decoded, strict=True):
                    results[name][i] = d
                    if store is not None:
                        store.append(_Continuation(name, i, texts[i], as_json[name]), _stored(d, s.max_new_tokens))
    return {name: [d for d in got if d is not None] for name, got in results.items()}
