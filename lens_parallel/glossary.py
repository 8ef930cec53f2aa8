"""Every column of every table lens_parallel gives, defined once by name, with its formula and unit.

``help()`` of each result class and of each analysis lists its own columns from here (a result class names them
in ``columns``; :mod:`lens_parallel.docstrings` writes the section), the documentation's glossary page is made from
it (``python scripts/build_glossary.py``; a test keeps it current) and ``lens-parallel glossary [COLUMN ...]``
prints it. A column is a name of :data:`COLUMNS`, or one of those names decorated by a rule of :data:`DECORATIONS`
(``self_cos[value,head]``, ``delta_loss_lo``, ``excess_A``, ``qkv_top25_share``, ``self_cos_value``); :func:`define`
reads either. Notation: m the message (a head's output, a sublayer's update), r its reference (the token's own
value v_t, or the residual state x_t it is added to), m_par = (m.r / |r|^2) r, m_perp = m - m_par; A the attention
pattern, a_tt its diagonal; nats are natural-log units of next-token loss per scored token.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TypeAlias

import pandas as pd

from lens_parallel.choices import Space
from lens_parallel.errors import LensParallelError
from lens_parallel.validate import did_you_mean, literal_values

COLUMNS: dict[str, str] = {
    # -- where a row is --------------------------------------------------------------------------------------------
    "model": "the model's name (the spec it was loaded by, or TransformerLens's model_name)",
    "family": "the model's family (gpt2, pythia, qwen2, ..., or its Hugging Face model_type); in a factorial's "
    "paired table, the family of endpoints Holm's correction runs within",
    "layer": "the layer (block) index, from 0",
    "layer_type": "the layer's kind on a hybrid model: softmax, linear (attention) or mixer",
    "head": "the head index within its layer, from 0: a query head (a linear-attention layer's value head)",
    "kv_head": "the key/value head the query head reads under grouped-query attention: head // (n_heads / n_kv_heads)",
    "label": "the row's name: L{layer}H{head} for a head, L{layer}* for all heads of a layer, L{layer} for a "
    "sublayer update",
    "heads": "the heads removed together, as a label",
    "space": "the decomposition space: value, value-exclude-self, value-merged, residual-attn, residual-mlp or "
    "residual-block (the spaces guide)",
    "level": "head: per head (or per query head's write); sublayer: the whole sublayer update. In a group table: "
    "pair, receiving_type or all",
    "sublayer": "attn, mlp or block: which residual update",
    "document": "the document's index among those run",
    "doc": "the document's index among those run",
    "doc_id": "the item's index in its task (lm-eval's doc_id)",
    "text": "the text's index among those run",
    "position": "the query token's position t in its text",
    "prompt": "the prompt's index (compression error: the prompt scored at its last token); in generation, the "
    "prompt's text",
    "prompt_index": "the prompt's index among those given",
    "half": "A or B: the half of the documents (split-half reliability)",
    "section": "which analysis of the report battery the row comes from",
    "task": "the lm-eval task (or 'average': the mean over tasks)",
    "tasks": "the lm-eval tasks run, comma-separated",
    "setting": "the named edit setting (unedited: the model as loaded)",
    "arm": "the training arm (baseline, xsa-gated, random-direction-gated, ...)",
    "arms": "the arms of the factorial, comma-separated",
    "seed": "the random seed (same seed: same initialisation and data order in every arm)",
    "step": "the training step",
    "method": "the compression method (int8, int4, wanda-50%, 2:4, ...); in a correlation table, the split-half method",
    "metric": "which quantity the row holds (a task metric, or a dominance statistic)",
    "unit": "the unit of the task metric: fraction, perplexity, bits per byte or 'mean of <metric>'",
    "scale": "the dominance scale: qkv (relative change of the effective q, k, v) or js / js_distance (of the "
    "receiving attention row); in attribution, par or perp (the scaled component); in training, the model size",
    "mask_scale": "the scale the weak and strong halves were ranked on (qkv or js)",
    "vary": "which coefficient the sweep point varies: s_par or s_perp (the other held at 1)",
    "role": "primary, secondary, contrast or exploratory (a factorial endpoint); in the projection table, q, k or v",
    "contrast": "the endpoint as 'arm - reference'",
    "reference": "the arm the endpoint subtracts",
    "statistic": "the per-head statistic: cos_self or excess",
    "group": "the pair (L{l}→L{l+1}), the receiving layer type, or all",
    "upstream_layer": "the layer l whose heads are removed one at a time",
    "receiving_layer": "the next layer l+1, whose effective q, k, v and attention rows are measured",
    "upstream_type": "the upstream layer's kind (softmax or linear attention)",
    "receiving_type": "the receiving layer's kind (softmax or linear attention)",
    "receiving_head": "the receiving head g of layer l+1",
    "upstream_head": "the removed head u of layer l",
    "upstream_label": "L{l}H{u} of the removed head",
    "ablation": "how heads are removed: zero (z_h = 0), mean (z_h = its mean), parallel-value (value-space s_par = "
    "0) or parallel-residual (residual-attn s_par = 0)",
    "positions": "all, or after-first (position 0, the boundary token, left untouched)",
    "null": "the causal null: exact (E_j cos(y_t, v_j) over j < t) or sampled (one j per position)",
    "chosen": "why the head was confirmed: top (by |estimate|) or random; in a task sample, the choice the model made",
    # -- decomposition ---------------------------------------------------------------------------------------------
    "self_cos": "mean over positions t >= 1 of cos(m, r) = m.r / (|m| |r|)",
    "self_cos_std": "standard deviation over positions of cos(m, r)",
    "par_frac": "mean over positions of |m_par| / |m|, the parallel share of the message's norm (= |cos(m, r)|)",
    "perp_frac": "mean over positions of |m_perp| / |m| (= sqrt(1 - cos^2))",
    "par_coef": "mean over positions of the signed parallel coefficient m.r / |r|^2 (m_par = par_coef r)",
    "par_perp_ratio": "mean(par_frac) / mean(perp_frac), a ratio of means",
    "n_positions": "positions averaged over (real positions t >= 1 of every document)",
    "n_degenerate": "positions left out by the eps guard (|m| or |r| below eps)",
    # -- losses and edits ------------------------------------------------------------------------------------------
    "loss": "mean next-token loss (negative log-likelihood, nats per scored token)",
    "loss_sum": "the document's summed next-token loss (nats)",
    "loss_base": "the unedited model's mean next-token loss (nats/token)",
    "loss_noop": "mean loss under the matched no-op (the edit with s_par = s_perp = 1; nats/token)",
    "loss_edited": "mean loss under the edit (nats/token)",
    "loss_dense": "the uncompressed model's mean loss on the prompts (nats/token)",
    "delta_loss": "loss under the edit minus the matched no-op (nats/token; > 0: the edit hurts)",
    "delta": "the arm's final validation loss minus the same seed's baseline (nats/token)",
    "ppl_noop": "perplexity under the matched no-op, exp(loss_noop)",
    "ppl_edited": "perplexity under the edit, exp(loss_edited)",
    "delta_ppl": "ppl_edited - ppl_noop",
    "kl": "mean over scored positions of KL(no-op || edited) of the next-token distributions (nats)",
    "top1_agreement": "share of scored positions whose most likely next token the edit leaves unchanged",
    "n_docs": "documents scored",
    "n_tokens": "scored tokens (positions predicting a real next token); in generation, tokens generated",
    "n_jobs": "ablation jobs run",
    "mean_delta_loss": "mean of delta_loss over the jobs (nats/token)",
    "max_delta_loss": "the largest delta_loss of a job (nats/token)",
    "max_delta_label": "the label of the job with max_delta_loss",
    "s_par": "the factor of the parallel component (m' = s_par m_par + s_perp m_perp; 1: unchanged)",
    "s_perp": "the factor of the perpendicular component (1: unchanged)",
    # -- attention diagonal ----------------------------------------------------------------------------------------
    "dA_mean": "mean over positions of the diagonal change dA_tt that reproduces parallel-only scaling exactly "
    "(value: (s_par - 1) o_t.v_t / |v_t|^2; exclude-self: (s_par - 1) c_t.v_t / |v_t|^2; residual-attn: (s_par - "
    "1) m.x_t / ((W_O v_t).x_t), a view)",
    "dA_min": "the smallest dA_tt over positions",
    "dA_max": "the largest dA_tt over positions",
    "share_negative": "share of positions whose edited diagonal a_tt + dA_tt is below 0",
    "n_guarded": "positions whose denominator (|v_t|^2 or (W_O v_t).x_t) fell below eps",
    "layer_delta_mean": "mean over positions of the layer-level diagonal change (all heads together, residual-attn)",
    "layer_side_effect": "mean over positions of |the perpendicular change the layer-level view adds| / |attn_out|",
    # -- sensitivity, attribution, confirmation --------------------------------------------------------------------
    "ci_lo": "lower end of the 95% confidence interval (bootstrap over documents, or over seeds in a factorial)",
    "ci_hi": "upper end of the 95% confidence interval",
    "ci_low": "lower end of the 95% confidence interval of the difference (paired bootstrap over items)",
    "ci_high": "upper end of the 95% confidence interval of the difference",
    "p": "two-sided p-value (a sign-flip test of delta_loss, weighted by documents or tokens; a paired t in a "
    "factorial)",
    "q_bh": "Benjamini-Hochberg q-value of p over the heads",
    "most_sensitive_layer": "the layer whose joint ablation has the largest delta_loss",
    "max_joint_delta_loss": "the largest joint (all heads of a layer) delta_loss (nats/token)",
    "max_head_delta_loss": "the largest single-head delta_loss (nats/token)",
    "max_head": "the label of the head with max_head_delta_loss",
    "n_heads_q05": "heads with q_bh < 0.05",
    "estimate": "first-order estimate of a head's delta_loss: the gradient of the loss along the ablation (one "
    "backward pass for every head)",
    "derivative": "dL/ds of the loss with respect to the component's scale s (s_par or s_perp) at s = 1, per token",
    "top_head": "the label of the head with the largest |estimate|",
    "top_estimate": "the estimate of top_head (nats/token)",
    "sum_of_estimates": "the sum of the heads' estimates (nats/token)",
    "mean_dloss_ds_par": "mean over heads of dL/ds_par, the loss's derivative along the parallel scale at 1",
    "mean_dloss_ds_perp": "mean over heads of dL/ds_perp, the loss's derivative along the perpendicular scale at 1",
    "attribution_spearman": "Spearman correlation of attribution estimates with exact delta_loss over the "
    "confirmed heads",
    "exact": "the head's exact delta_loss from a forward with it removed (nats/token)",
    "exact_over_estimate": "exact / estimate",
    "n_confirmed": "heads whose exact delta_loss was measured",
    "spearman": "Spearman correlation of estimate with exact over the confirmed heads",
    "pearson": "Pearson correlation of estimate with exact over the confirmed heads",
    "median_exact_over_estimate": "median over confirmed heads of exact / estimate",
    "top_sign_agreement": "share of the top heads whose exact delta_loss has the estimate's sign",
    "note": "what the summary cannot say (e.g. too few heads for a correlation)",
    # -- head statistics (the directional-decomposition paper's Fig. 7) --------------------------------------------
    "para_ratio": "mean over positions of |y_par|^2 / |y|^2 (y = o_t, its value-space parallel part y_par)",
    "para_over_ref": "mean over positions of |y_par| / |v_t|",
    "edit_over_y": "mean over positions of |edit| / |y| (the change the ablation makes, relative to the output)",
    "edit_over_ref": "mean over positions of |edit| / |v_t|",
    "mean_para_ratio": "mean over heads of para_ratio",
    "mean_para_over_ref": "mean over heads of para_over_ref",
    "mean_edit_over_y": "mean over heads of edit_over_y",
    "mean_edit_over_ref": "mean over heads of edit_over_ref",
    # -- nulls and reliability -------------------------------------------------------------------------------------
    "cos_self": "mean over positions t >= 1 of cos(y_t, v_t), the head's output with its own token's value",
    "cos_null": "mean over positions of the causal null cos(y_t, v_j), j uniform in [0, t) (exact expectation or "
    "one draw)",
    "cos_across": "mean cos(y_t, v'_t) with a neighbouring kv group's value at the same position (GQA)",
    "excess": "mean(cos_self - cos_null): self-alignment beyond what the causal null expects",
    "within_excess": "excess within the head's own kv group",
    "across_excess": "cos_across - cos_null (about -cos_null: across groups the raw cosine is about 0)",
    "self_specific_fraction": "excess / mean cos_self (a ratio of means over the heads)",
    "null_share": "mean cos_null / mean cos_self (a ratio of means over the heads)",
    "median_head_self_specific_fraction": "median over heads of the head's own excess / cos_self",
    "median_head_null_share": "median over heads of the head's own cos_null / cos_self",
    "n_heads": "heads the statistic covers (in a model row: query heads per layer)",
    "r_stat": "Spearman correlation over heads of the statistic between the two halves",
    "r_delta": "Spearman correlation over heads of the intervention's delta_loss between the two halves",
    "rho_max": "the ceiling sqrt(r_delta r_stat) of a statistic-effect correlation",
    "rho_raw": "Spearman over heads of the statistic with delta_loss, each averaged over the halves",
    "rho_disattenuated": "rho_raw / rho_max",
    "verdict": "reliable (r_delta >= 0.6), attenuated (>= 0.3) or unresolvable",
    # -- dominance -------------------------------------------------------------------------------------------------
    "qkv": "sqrt(|dq_g|^2 + |dk_g|^2 + |dv_g|^2) / sqrt(|q_g|^2 + |k_g|^2 + |v_g|^2): the relative change of what "
    "receiving head g uses when one upstream head is removed",
    "js": "Jensen-Shannon divergence of g's attention row with and without the upstream head (nats)",
    "js_distance": "sqrt(js)",
    "rel": "|x' - x| / |x| of the receiving q, k or v head (role) when one upstream head is removed",
    "effective_n": "exp(entropy of the upstream heads' shares of the effect): how many heads shape the observation",
    "effective_fraction": "effective_n / the number of upstream heads",
    "normalised_concentration": "1 - (effective_n - 1) / (upstream heads - 1): 1 when one head does everything",
    "top25_share": "share of the effect from the top quarter of upstream heads",
    "bottom25_share": "share of the effect from the bottom quarter of upstream heads",
    "heads_for_90": "fewest upstream heads whose shares reach 90% of the effect",
    "observations": "(pair, text, query token, receiving head) observations summarised",
    "joint_weak": "the measured effect of removing the weaker half of upstream heads together",
    "joint_strong": "the measured effect of removing the stronger half together",
    "joint_random": "the measured effect of removing a random half of the same size",
    "joint_all": "the measured effect of removing every upstream head",
    "strong_weak_ratio": "joint_strong / joint_weak",
    "weak_smaller": "whether joint_weak < joint_strong (in a summary: the share of observations)",
    "n_pairs": "adjacent layer pairs measured",
    "count": "observations in the group",
    "mean": "the group's mean",
    "q1": "the group's first quartile",
    "median": "the group's median",
    "q3": "the group's third quartile",
    # -- compression error -----------------------------------------------------------------------------------------
    "par": "|e_par| / |delta_base|: the part of the compression error e = delta_compressed - delta_base along the "
    "dense update",
    "perp": "|e_perp| / |delta_base|: the part of the compression error perpendicular to the dense update",
    "coef": "e.delta_base / |delta_base|^2, the signed parallel coefficient of the error",
    "par_mean": "mean over prompts (and layers) of par",
    "par_std": "standard deviation over prompts of par",
    "perp_mean": "mean over prompts (and layers) of perp",
    "perp_std": "standard deviation over prompts of perp",
    "err_mean": "mean over prompts of |e| / |delta_base| = hypot(par, perp)",
    "coef_mean": "mean of coef",
    "perp_share": "sum over layers of perp_mean^2 / sum of err_mean^2: the share of squared error that is "
    "perpendicular",
    "corr_err_perp": "Pearson correlation across layers of err_mean with perp_mean",
    "n_prompts": "prompts given",
    # -- generation ------------------------------------------------------------------------------------------------
    "finish": "why the continuation ended: eos (the end-of-text token), stop (a stop string) or length "
    "(max_new_tokens)",
    "departs_at": "the first generated token that differs from the unedited continuation (<NA>: none)",
    "mean_tokens": "mean tokens generated per prompt",
    "share_departing": "share of prompts whose continuation departs from the unedited one",
    "mean_departs_at": "mean departs_at over the prompts that depart",
    # -- downstream tasks ------------------------------------------------------------------------------------------
    "<metric>": "an lm-eval metric of the task, per item (acc, exact_match, pass_at_1, ...: each defined here)",
    "acc": "accuracy: 1 when the model's choice (or answer) is right, 0 otherwise (per item; a task: the mean)",
    "acc_norm": "accuracy with each choice's log-likelihood normalised by its length in bytes",
    "exact_match": "1 when the generated answer matches the reference exactly (after the task's filter)",
    "em": "exact match (1/0)",
    "pass_at_1": "1 when the generated program passes the task's tests in the sandbox",
    "f1": "token-overlap F1 of the answer with the reference",
    "score": "RULER's score: the share of the needles recalled",
    "word_perplexity": "exp(total loss / total words) of whole texts in lm-eval's rolling windows",
    "byte_perplexity": "exp(total loss / total bytes)",
    "bits_per_byte": "total loss / (total bytes ln 2)",
    "context": "the item's prompt as the model saw it (shortened unless asked for whole)",
    "target": "the item's reference answer",
    "response": "what the model answered (a generation, or its chosen option)",
    "n_items": "items scored",
    "unedited": "the unedited model's score",
    "edited": "the setting's score",
    "difference": "edited - unedited (a fraction; percentage points in the table)",
    "p_mcnemar": "McNemar's exact p of the paired 0/1 item outcomes",
    "p_holm": "p after Holm's correction within its family",
    "average": "the mean over tasks of their scores (percent)",
    # -- training --------------------------------------------------------------------------------------------------
    "val_loss": "validation loss at the step (nats/token)",
    "train_loss": "training loss of the step's batch (nats/token)",
    "final_val_loss": "validation loss after the last step (nats/token)",
    "n_params": "trainable parameters",
    "steps": "training steps run",
    "wall_s": "wall-clock seconds of the run",
    "seconds": "wall-clock seconds the model's battery took",
    "primary": "the primary endpoint ('arm - baseline')",
    "n_seeds": "seeds (paired runs) per arm",
    "mean_delta": "mean over seeds of the paired difference (nats/token)",
    "t": "the paired t statistic",
    "cohens_dz": "mean paired difference / its standard deviation",
    "sigma_paired": "standard deviation over seeds of the paired difference",
    "reference_loss": "mean final validation loss of the reference arm",
    "arm_loss": "mean final validation loss of the arm",
    "mde_paper": "the paper's minimum detectable effect at 80% power, 2.9 sigma_paired / sqrt(n)",
    "mde_80": "the exact noncentral-t minimum detectable effect at 80% power (two-sided, alpha 0.05)",
    "mde_90": "the same at 90% power",
    "plan_hash": "the hash of the analysis plan frozen before training",
    "gate": "the learned gate: g = tanh(alpha), or the mean learned s_par",
    "gate_std": "standard deviation of the learned s_par over positions (per-token gates)",
    # -- the model, in a report's summary --------------------------------------------------------------------------
    "n_layers": "layers (blocks)",
    "n_kv_heads": "key/value heads per layer (fewer than n_heads under grouped-query attention)",
}
"""Each column's definition, by name."""

SPACE_NAMES = tuple(sorted(literal_values(Space), key=len, reverse=True))
"""The spaces a column name may end in (longest first, so that ``value-exclude-self`` is read before ``value``)."""


Found: TypeAlias = "tuple[str, Callable[[str], str]] | None"
"""What a decoration rule gives for a name: (the undecorated name, how the decoration changes its definition)."""
Rule: TypeAlias = Callable[[str], Found]


def _bound(explain: Callable[[str, str], str], what: str) -> Callable[[str], str]:
    return lambda base: explain(base, what)


def _suffix(endings: dict[str, str], explain: Callable[[str, str], str]) -> Rule:
    def rule(name: str) -> Found:
        for end, what in endings.items():
            if name.endswith(end) and len(name) > len(end):
                return name[: -len(end)], _bound(explain, what)
        return None

    return rule


def _prefix(starts: dict[str, str], explain: Callable[[str, str], str]) -> Rule:
    def rule(name: str) -> Found:
        for start, what in starts.items():
            if name.startswith(start) and len(name) > len(start):
                return name[len(start) :], _bound(explain, what)
        return None

    return rule


def _bracket(name: str) -> Found:
    found = re.fullmatch(r"([^\[]+)\[(.+)\]", name)
    if found is None:
        return None
    return found.group(1), lambda base: f"{base}, for {found.group(2)} (the setting in the brackets)"


def _filtered(name: str) -> Found:
    metric, comma, kept = name.partition(",")
    return (metric, lambda base: f"{base}, after lm-eval's filter {kept}") if comma and kept else None


def _average(name: str) -> Found:
    found = re.fullmatch(r"average_(.+)_difference((?:_lo|_hi)?)", name)
    if found is None:
        return None
    return f"{found.group(1)}{found.group(2)}", lambda base: f"the mean over tasks of edited minus unedited: {base}"


def _ruler_length(name: str) -> Found:
    return ("score", lambda base: f"{base}, at a context of {name} tokens") if name.isdigit() else None


DECORATIONS: tuple[Rule, ...] = (
    _bracket,
    _filtered,
    _average,
    _ruler_length,
    _suffix({"_lo": "lower", "_hi": "upper"}, lambda base, end: f"{end} end of the 95% confidence interval of: {base}"),
    _suffix({"_A": "A", "_B": "B"}, lambda base, half: f"{base}, in half {half} of the documents"),
    _suffix({f"_{s}": s for s in (*SPACE_NAMES, "<space>")}, lambda base, space: f"{base}, in the {space} space"),
    _suffix({"_s_par0": "s_par = 0"}, lambda base, at: f"{base}, at {at}"),
    _suffix(
        {"_cos_self": "cos_self", "_excess": "excess"}, lambda base, stat: f"{base}, of the per-head statistic {stat}"
    ),
    _prefix(
        {"qkv_": "qkv", "js_distance_": "js_distance"},
        lambda base, scale: f"{base}, on the {scale} scale (median over observations; joint effects: mean)",
    ),
)
"""How a decorated column name reads: each rule takes a name and gives (the undecorated name, how the decoration
changes its definition), or None."""


def define(column: str) -> str:
    """The definition of ``column``: its entry in :data:`COLUMNS`, or a decorated name's (:data:`DECORATIONS`).
    Raises :class:`~lens_parallel.errors.LensParallelError` naming the closest column for a name it does not know.

    Examples:
        >>> from lens_parallel.glossary import define
        >>> define("par_frac")
        'mean over positions of |m_par| / |m|, the parallel share of the message\\'s norm (= |cos(m, r)|)'
        >>> define("delta_loss_hi").split(":")[0]
        'upper end of the 95% confidence interval of'
    """
    if column in COLUMNS:
        return COLUMNS[column]
    for rule in DECORATIONS:
        if (found := rule(column)) is not None:
            base, explain = found
            try:
                return explain(define(base))
            except LensParallelError:
                continue
    raise LensParallelError(
        f"no column {column!r} in the glossary{did_you_mean(column, COLUMNS)}; lens-parallel glossary lists every one"
    )


def section(columns: Iterable[str]) -> str:
    """A docstring's ``Columns:`` entries for ``columns`` (each defined by :func:`define`), indented as Google-style
    sections are."""
    return "\n".join(f"    {name}: {define(name)}" for name in columns)


def glossary_table(columns: Iterable[str] | None = None) -> pd.DataFrame:
    """``columns`` (default: every name of :data:`COLUMNS`) and their definitions, as a table (``column``,
    ``definition``)."""
    names = list(COLUMNS) if columns is None else list(columns)
    return pd.DataFrame({"column": names, "definition": [define(name) for name in names]})
