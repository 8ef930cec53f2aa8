"""A live explorer for notebooks: every head's self-alignment, one head's attention and its diagonal, and the loss
change of scaling its parallel part, recomputed as the settings change.

:class:`Explorer` holds the state (space, layer, head, document, s_par, s_perp, one head or the whole layer) and
computes every view from the package's analyses; :meth:`Explorer.widget` shows them as Plotly ``FigureWidget`` s
with ipywidgets controls (click a heatmap cell to select a head; sliders for s_par and s_perp; a space selector; a
document selector; "save view"). Views, for the selected head h of layer l and document d:

- heatmap: mean self-cosine of every head in the chosen space (:func:`~lens_parallel.analyses.decompose.decompose`,
  computed once for value, value-exclude-self and residual-attn);
- pattern: A_ts of head h, token labels on both axes;
- diagonal: A_tt and A'_tt = A_tt + dA_tt, the edit's diagonal form at the current s_par
  (:meth:`~lens_parallel.spaces.SpaceSpec.pattern_weight_change`), with the per-token parallel coefficient of the space
  (value: o.v/|v|^2; exclude-self: c.v/|v|^2 with c = o - A_tt v; residual-attn: m.x/|x|^2 with m = o W_O[h]);
- loss: per-token NLL under the edit on head h (or every head of layer l) minus its reference, nats. ``edit``
  (:data:`~lens_parallel.choices.ExplorerEdit`): ``scale`` is ``ComponentScale(space, s_par, s_perp)`` against the
  matched no-op (the same hooks at scales 1); the paper's comparison edits, ``random-direction`` (and
  ``random-direction-norm-matched``: :class:`~lens_parallel.edits.RandomDirectionRemoval`, directions from
  ``seed``) and ``zero-diagonal`` (:class:`~lens_parallel.edits.ZeroDiagonal`), against the unedited model. The
  diagonal view draws A'_tt of ``scale`` and of ``zero-diagonal`` (0 past position 0); a random-direction removal
  edits z along u, not along v_t, and has no diagonal form (A'_tt is left blank).

Linear-attention layers (Qwen3.5's gated delta rule) are explored as the others, per value head: their map is the head's
exact delta-rule mixing weights M (o_t = sum_s M_ts v_s, M_tt = a_tt;
:func:`~lens_parallel.layers.linear_mixing_weights`), ``zero-diagonal`` removes the self term a_tt v_t (no
renormalisation), residual-attn has no diagonal view there (a head's write passes its gated RMSNorm) and
``random-direction`` is a softmax-layer edit (both refused in one line). The heatmap's rows are as wide as the widest
layer's heads (NaN past a layer's own), and the views name the layer type.

Cost: one capture per (layer, document), stopped after that layer, keeps resid_pre, v and the pattern; moving
s_par redraws the diagonal from it without a forward; the loss view is one forward of that document resumed at
layer l (the earlier blocks are not computed), and the no-op's losses are kept per (space, layer, head set,
document). :meth:`Explorer.to_html` writes a page with no kernel behind it: the heatmap, and for a few heads a small
grid of s_par values, switched by Plotly's own menus, plotly.js inlined.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import plotly.graph_objects as go
import torch
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import geometry
from lens_parallel.analyses.decompose import decompose
from lens_parallel.analyses.diagonal import diagonal_roles, with_map
from lens_parallel.bridges import check_model
from lens_parallel.choices import ExplorerEdit, HeadSpace
from lens_parallel.documents import Documents, DocumentsLike, document_batches
from lens_parallel.edits import Edit, Heads, compile_hooks, edit_noop, explorer_edits
from lens_parallel.errors import LensParallelError
from lens_parallel.generation import GenerationResult, generate
from lens_parallel.hooks import check_heads, check_indices, expand_kv, head_layers, output_weights
from lens_parallel.models import head_label
from lens_parallel.plots import explore as plots
from lens_parallel.results import Provenance
from lens_parallel.spaces import HEAD_SPACES, SPACES, ResidualFrame, check_spaces
from lens_parallel.sweep import Batch, EditJob, TokenNLL, run_rows, run_sweep
from lens_parallel.validate import check_finite, check_non_negative_int, did_you_mean


@dataclass(frozen=True)
class View:
    """Everything drawn for one state (arrays are NumPy, float64).

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> view = lp.explore(model, docs).view
        >>> isinstance(view, lp.View)
        True
    """

    space: str
    layer: int
    head: int
    doc: int
    s_par: float
    s_perp: float
    all_heads: bool
    edit: str  # an ExplorerEdit
    seed: int  # of the random directions
    heatmap: np.ndarray  # [layer, head] mean self-cosine in ``space`` (NaN where undefined)
    layer_types: tuple[str, ...]  # per layer: "softmax" or "linear" (its map is then the delta rule's M)
    tokens: tuple[str, ...]  # the document's tokens, each decoded alone (newlines shown as ⏎)
    pattern: np.ndarray  # [query_pos, key_pos] A_ts of the head
    diag: np.ndarray  # [pos] A_tt
    diag_edited: np.ndarray  # [pos] A'_tt under the edit (NaN: no diagonal form)
    coef: np.ndarray  # [pos] parallel coefficient in ``space``
    loss_change: np.ndarray  # [pos - 1] edited minus reference NLL of each next token, nats

    @property
    def label(self) -> str:
        return head_label(self.layer, self.head)


class Explorer:
    """State and views of :func:`explore` (see the module docstring); the setters recompute only what changed.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> explorer = lp.Explorer(model, ["The cat sat on the mat.", "A dog ran home."])
        >>> explorer.update(layer=1, head=0).label
        'L1H0'
    """

    def __init__(
        self,
        model: TransformerBridge,
        documents: DocumentsLike,
        *,
        space: HeadSpace = "value",
        layer: int | None = None,
        head: int | None = None,
        doc: int = 0,
        s_par: float = 0.0,
        s_perp: float = 1.0,
        all_heads: bool = False,
        edit: ExplorerEdit = "scale",
        seed: int = 0,
        batch_size: int = 8,
    ) -> None:
        self.model, self.info, self.documents = model, check_model(model), Documents.of(documents, model)
        self.layers, _ = head_layers(self.info, None, what="the explorer (heads and their maps)")
        self.width = max(self.info.output_heads(layer) for layer in self.layers)
        with warnings.catch_warnings():  # a post-attention norm (Gemma 3): no per-head residual-attn, a note
            warnings.simplefilter("ignore", UserWarning)
            result = decompose(model, self.documents, space=list(HEAD_SPACES), batch_size=batch_size, progress=False)
        self.heatmaps: dict[str, np.ndarray] = {}
        for sp in HEAD_SPACES:
            grid = np.full((self.info.n_layers, self.width), np.nan)
            try:
                table = result.table(sp, "head")
                grid[list(table.layers), : table.self_cos.shape[1]] = table.self_cos
            except KeyError:  # residual-attn per head is undefined with a post-attention norm
                pass
            self.heatmaps[sp] = grid
        if layer is None or head is None:
            best = np.nanargmax(np.where(np.isnan(self.heatmaps["value"]), -np.inf, self.heatmaps["value"]))
            layer, head = divmod(int(best), self.width)
        self._captures: dict[tuple[int, int], dict[str, Tensor]] = {}
        self._memo: dict[Any, Any] = {}
        self._noops: dict[tuple[Any, ...], np.ndarray] = {}
        self.state: dict[str, Any] = {}
        self.update(
            space=space,
            layer=layer,
            head=head,
            doc=doc,
            s_par=s_par,
            s_perp=s_perp,
            all_heads=all_heads,
            edit=edit,
            seed=seed,
        )

    # -- state -------------------------------------------------------------------------------------------------
    def update(self, **changes: Any) -> View:
        """Change any of space, layer, head, doc, s_par, s_perp, all_heads, edit, seed (checked first) and return
        the view."""
        state = self.state | changes
        known = ("space", "layer", "head", "doc", "s_par", "s_perp", "all_heads", "edit", "seed")
        if unknown := sorted(set(changes) - set(known)):
            raise LensParallelError(
                f"unknown explorer setting {unknown[0]!r}{did_you_mean(unknown[0], known)}; accepted: "
                f"{', '.join(known)}"
            )
        check_spaces(state["space"], choice=HeadSpace)
        (state["layer"],) = check_indices("layer", state["layer"], self.info.n_layers)
        refusal = self.info.kind(state["layer"]).residual_map_refusal(state["layer"])
        if refusal and SPACES[state["space"]].head_writes:
            raise LensParallelError(refusal)
        (state["head"],) = check_heads(self.info, state["layer"], state["head"])
        (state["doc"],) = check_indices("doc", state["doc"], len(self.documents))
        for name in ("s_par", "s_perp"):
            check_finite(name, state[name])
        if state["edit"] not in explorer_edits():
            raise LensParallelError(f"unknown edit {state['edit']!r}; the explorer's: {', '.join(explorer_edits())}")
        check_non_negative_int("seed", state["seed"])
        compile_hooks(self.model, self._edits(state, reference=False))  # the edit is valid on this model
        before, self.state = self.state, state
        try:
            self.view = self._view()
        except ValueError:
            self.state = before
            raise
        return self.view

    def _document(self, doc: int) -> Documents:
        """Document ``doc`` alone, as the engine runs it."""
        n = int(self.documents.lengths[doc])
        return Documents.padded([self.documents.tokens[doc, :n].tolist()], {"corpus": f"document {doc}"})

    def _capture(self, layer: int, doc: int) -> dict[str, Tensor]:
        """resid_pre, v and the full pattern of ``layer`` for document ``doc`` (one forward, stopped there); on a
        linear-attention layer its values and mixing weights M as ``v`` and ``pattern_full``."""
        key = (layer, doc)
        if key not in self._captures:
            batch = Batch(next(document_batches(self._document(doc), 1)))
            roles = {layer: diagonal_roles(self.info, layer, ("value",))}
            self._captures[key] = with_map(
                self.info, layer, run_rows(self.model, self.info, batch, capture=roles).captured
            )
        return self._captures[key]

    @staticmethod
    def _edits(state: dict[str, Any], *, reference: bool) -> tuple[Edit, ...]:
        """The loss view's edit of ``state`` on the selected head (or every head of the layer, each on its own
        write), or with ``reference`` what it is compared with: the matched no-op of ``scale``, the unedited model
        (no edit) for the comparison edits."""
        kind, fixed = explorer_edits()[state["edit"]]
        settings = {f.name: state[f.name] for f in dataclasses.fields(cast(Any, kind.cls)) if f.name in state}
        heads = cast(Heads, "all" if state["all_heads"] else (state["head"],))
        edit = kind.cls(**settings | {"layers": (state["layer"],), "heads": heads} | dict(fixed))
        if not reference:
            return (edit,)
        matched = edit_noop(edit)  # the same hooks at scales 1, or None: the unedited model
        return () if matched is None else (matched,)

    def _losses(self, edits: tuple[Edit, ...], layer: int, doc: int) -> np.ndarray:
        """Per-token NLL of ``doc`` under ``edits`` of ``layer`` (one forward resumed at ``layer``: the engine's
        reference pass of that document and layer is kept in the explorer's memo)."""
        job = EditJob(repr(edits), edits, start_layer=layer)
        docs = self._document(doc)
        metric = TokenNLL(docs.tokens.shape[1])
        run = run_sweep(self.model, docs, [job], metric=metric, progress=False, memo=self._memo)
        nll: np.ndarray = run.value(job)["nll"][0]
        return nll

    def _view(self) -> View:
        st = self.state
        space, layer, head, doc = st["space"], st["layer"], st["head"], st["doc"]
        t = self._capture(layer, doc)
        pattern, x = t["pattern_full"], t["resid_pre"]
        v = expand_kv(t["v"], pattern.shape[1])
        spec = SPACES[space]
        frame = None
        if spec.head_writes:
            frame = ResidualFrame(x, output_weights(self.model, self.info, layer, dtype=torch.float64).to(x.device))
        diag = geometry.self_weights(pattern)[0, head]
        if st["edit"] == "scale":
            diag_edited = diag + spec.pattern_weight_change(pattern, v, s_par=st["s_par"], frame=frame).d_a[0, head]
        elif st["edit"] == "zero-diagonal":
            diag_edited = geometry.self_weights(self.info.kind(layer).zeroed_map(pattern))[0, head]
        else:  # a removal along a random direction of z has no diagonal form
            diag_edited = torch.full_like(diag, float("nan"))
        coef = spec.coefficient(pattern, v, frame=frame)[0, :, head]
        reference = self._edits(st, reference=True)
        key = (repr(reference), doc)
        if key not in self._noops:
            self._noops[key] = self._losses(reference, layer, doc)
        edited = self._losses(self._edits(st, reference=False), layer, doc)
        ids = self.documents.tokens[doc, : int(self.documents.lengths[doc])].tolist()
        return View(
            space=space,
            layer=layer,
            head=head,
            doc=doc,
            s_par=float(st["s_par"]),
            s_perp=float(st["s_perp"]),
            all_heads=bool(st["all_heads"]),
            edit=st["edit"],
            seed=int(st["seed"]),
            heatmap=self.heatmaps[space],
            layer_types=self.info.layer_types,
            tokens=tuple(self.model.tokenizer.decode([i]).replace("\n", "⏎") for i in ids),
            pattern=pattern[0, head].cpu().numpy(),
            diag=diag.cpu().numpy(),
            diag_edited=diag_edited.cpu().numpy(),
            coef=coef.cpu().numpy(),
            loss_change=edited - self._noops[key],
        )

    # -- output ------------------------------------------------------------------------------------------------
    def figures(self) -> dict[str, go.Figure]:
        """The four figures of the current view (static copies)."""
        return plots.explorer_figures(self.view, self.info.name)

    def provenance(self) -> Provenance:
        return Provenance.of(self.info, self.documents, "explore", self.state, None)

    def generate(self, prompt: str, *, max_new_tokens: int = 24) -> GenerationResult:
        """``prompt`` continued greedily by the unedited model and under the current view's edit (on the selected
        head, or every head of its layer), KV-cached with the edit at every step (:func:`lens_parallel.generate`);
        shown in a notebook as the two texts side by side, the edited one marked from where it departs."""
        where = f"layer {self.view.layer}" if self.view.all_heads else self.view.label
        setting = f"{plots.setting_label(self.view)} on {where}"
        edits = self._edits(self.state, reference=False)
        return generate(self.model, prompt, {setting: edits}, max_new_tokens=max_new_tokens, progress=False)

    def save_view(self, folder: str | Path) -> list[Path]:
        """Write the current figures as HTML (PNG too when kaleido finds Chromium) and ``view.json`` (the settings
        and provenance) into ``folder``; returns the files written."""
        from lens_parallel.plots import save_figure

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        stem = f"{self.view.label}_{self.view.space}_doc{self.view.doc}_s{self.view.s_par:g}"
        written = []
        for name, fig in self.figures().items():
            written += save_figure(fig, folder / f"{stem}_{name}")
        meta = folder / f"{stem}_view.json"
        record = {"state": self.state, "provenance": dataclasses.asdict(self.provenance())}
        meta.write_text(json.dumps(record, indent=1, default=str))
        return [*written, meta]

    def to_html(
        self,
        path: str | Path,
        *,
        heads: Sequence[tuple[int, int]] | None = None,
        s_par: Sequence[float] = (0.0, 0.5, 1.5),
    ) -> Path:
        """A self-contained page (plotly.js inlined, no kernel): the heatmap of every space, and for ``heads``
        (default: the 6 most self-aligned in the current space, and the selected one) the pattern, diagonal and
        loss views at each ``s_par`` of the grid (s_perp, edit and document as now; a comparison edit has no s_par:
        one view per head), chosen with Plotly's menus."""
        st = dict(self.state)
        if st["edit"] != "scale":
            s_par = (st["s_par"],)
        if heads is None:
            grid = np.where(np.isnan(self.view.heatmap), -np.inf, self.view.heatmap)
            top = np.argsort(grid, axis=None)[::-1][:6]
            heads = [(st["layer"], st["head"]), *(divmod(int(i), self.width) for i in top)]
        heads = list(dict.fromkeys((int(a), int(b)) for a, b in heads))
        views = {}
        try:
            for layer, head in heads:
                for s in s_par:
                    views[layer, head, float(s)] = self.update(layer=layer, head=head, s_par=float(s))
        finally:
            self.update(**st)
        page = plots.explorer_page(self.heatmaps, views, self.info.name, dataclasses.asdict(self.provenance()))
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(page)
        return path

    def widget(self) -> Any:
        """The live widget (ipywidgets + Plotly FigureWidgets; ``pip install 'lens_parallel[notebook]'``)."""
        try:
            from lens_parallel.explore_widget import ExplorerWidget
        except ImportError as exc:
            raise ImportError(
                f"the live explorer needs ipywidgets and anywidget ({exc}): pip install 'lens_parallel[notebook]'; "
                "without them, explorer.figures() and explorer.to_html(path) still work"
            ) from exc

        return ExplorerWidget(self).box

    def _ipython_display_(self) -> None:
        from IPython.display import display

        try:
            display(self.widget())
        except ImportError as exc:  # no ipywidgets: the same views, static
            print(exc)
            for fig in self.figures().values():
                display(fig)


def explore(model: TransformerBridge, documents: DocumentsLike, **settings: Any) -> Explorer:
    """An :class:`Explorer` of ``model`` on ``documents`` (any form :meth:`~lens_parallel.documents.Documents.of`
    takes: text, token ids, a masked batch, ...); shown as a live widget when it is a cell's last value.
    ``settings``: space, layer, head (default: the most self-aligned head in value space), doc, s_par, s_perp,
    all_heads, edit (:data:`~lens_parallel.choices.ExplorerEdit`), seed, batch_size.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")
        >>> docs = lp.token_blocks(model, "austen", n_docs=4, seq_len=16)
        >>> explorer = lp.explore(model, docs)
        >>> explorer.view.head in range(4)
        True
    """
    return Explorer(model, documents, **settings)
