"""``lens-parallel``: the command line.

    lens-parallel decompose|scale|diagonal|sensitivity|dominance|checks|compress [--model M] [options] [--out DIR]
    lens-parallel report [--model M [M ...]]        # the standard battery, one self-contained report.html
    lens-parallel train --preset cpu-small          # training-time interventions, paired by seed
    lens-parallel models                            # what loads offline now, what needs the hub

Every analysis writes a CSV table, the result as JSON (+ .npz, with provenance), its figures as interactive HTML
(and PNG when kaleido can find a Chrome/Chromium), and prints a short table. Bad input exits with status 2 and one
line on stderr (:class:`~lens_parallel.errors.LensParallelError`); a failed environment (no registry, no Ray) with
status 3 and what failed and what to do (:class:`~lens_parallel.errors.EnvironmentFailure`); anything else (a
:class:`~lens_parallel.errors.LibraryError`, a bug) keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pandas as pd

from lens_parallel.errors import EnvironmentFailure, LensParallelError

DEFAULT_MODEL = "smollm2-135m"


class _Parser(argparse.ArgumentParser):
    """argparse with the package's error contract: a bad command line is one line on stderr and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


OUTPUT_SUFFIXES = (".csv", ".json", ".npz", ".html", ".png")


def _writable_dir(path: str) -> Path:
    if not path.strip():
        raise LensParallelError("--out is empty: give the folder to write to (or leave --out out for the default)")
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LensParallelError(f"--out {path}: cannot create the folder ({exc.strerror})") from exc
    if not os.access(out, os.W_OK):
        raise LensParallelError(f"--out {path}: the folder is not writable")
    return out


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def _output_dir(args: argparse.Namespace, *names: str) -> Path:
    """The output folder (``--out``, else ``results/<subcommand>``), created and checked before any work: no file
    this subcommand writes (``<name>*.csv|json|npz|html|png``) may be a folder there."""
    out = _writable_dir(args.out if args.out is not None else f"results/{args.command}")
    for name in names:
        for path in out.glob(f"{name}*"):
            if path.is_dir() and path.suffix in OUTPUT_SUFFIXES:
                raise LensParallelError(f"--out {out}: {path.name} is a folder, where an output file goes; remove it")
    return out


def _common(parser: argparse.ArgumentParser, *, n_docs: int = 16, many_models: bool = False) -> None:
    if many_models:
        parser.add_argument("--model", nargs="+", default=[DEFAULT_MODEL], help="model spec(s); several: side by side")
    else:
        parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model spec (default: {DEFAULT_MODEL})")
    parser.add_argument(
        "--texts",
        default="wikipedia-en",
        help="bundled corpus, hf:DATASET, or study (2 English + 2 Chinese texts, --n-docs ignored); "
        "default: %(default)s",
    )
    parser.add_argument("--n-docs", type=_positive, default=n_docs, help=f"documents (token blocks), default {n_docs}")
    parser.add_argument("--seq-len", type=_positive, default=128, help="tokens per block, default 128")
    parser.add_argument("--batch-size", type=_positive, default=8, help="documents per forward, default 8")
    parser.add_argument("--seed", type=_non_negative, default=0, help="seed (document order, null draws), default 0")
    parser.add_argument("--device", default="cpu", help="torch device, default cpu")
    parser.add_argument("--out", required=False, help="output folder (default: results/<subcommand>)")


def _store(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--store",
        default=None,
        metavar="FILE",
        help=f"the sweep's resumable store (JSON lines), default OUT/{default}: a rerun skips finished jobs",
    )


def _workers(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workers",
        type=_positive,
        default=1,
        help="run the jobs on this many Ray workers (pip install 'lens_parallel[distributed]'), default 1: here",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="a running Ray cluster (auto, or host:6379); default: a local Ray when --workers > 1",
    )


def _build_parser() -> argparse.ArgumentParser:
    from lens_parallel.analyses.decompose import SPACES
    from lens_parallel.analyses.nulls import NULLS
    from lens_parallel.edits import ABLATIONS, DIAGONAL_SPACES, POSITIONS, SCALE_SPACES
    from lens_parallel.training import ARMS, DESIGNS, PRESETS

    parser = _Parser(prog="lens-parallel", description="Parallel/perpendicular geometry of heads.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("decompose", help="self-alignment of head outputs and residual updates")
    _common(p)
    p.add_argument("--space", nargs="+", default=["value"], choices=[*SPACES, "all"], help="space(s), default value")
    p.add_argument("--layers", type=int, nargs="+", default=None, help="layers (default: all)")
    p = sub.add_parser("scale", help="loss when parallel / perpendicular parts are rescaled")
    _common(p)
    p.add_argument("--space", nargs="+", default=["value-exclude-self", "residual-attn"], choices=SCALE_SPACES)
    p.add_argument("--s-par", type=float, nargs="+", default=[-1.0, 0.0, 0.5, 1.5, 2.0])
    p.add_argument("--s-perp", type=float, nargs="+", default=[0.0, 0.5, 1.5])
    p.add_argument("--layers", type=int, nargs="+", default=None, help="layers edited (default: all)")
    p.add_argument("--per-layer", action="store_true", help="one layer at a time instead of all together")
    p.add_argument("--positions", default="all", choices=POSITIONS, help="after-first: leave the boundary token")
    _store(p, "scale_store.jsonl")
    _workers(p)
    p = sub.add_parser("diagonal", help="attention-diagonal form of parallel scaling for one head")
    _common(p, n_docs=4)
    p.add_argument("--layer", type=int, default=None, help="layer (default: the most self-aligned head's)")
    p.add_argument("--head", type=int, default=None, help="query head (default: the most self-aligned head)")
    p.add_argument("--s-par", type=float, default=0.0)
    p.add_argument("--space", nargs="+", default=list(DIAGONAL_SPACES), choices=DIAGONAL_SPACES)
    p = sub.add_parser("sensitivity", help="per-head and joint ablation effects, layer by layer")
    _common(p, n_docs=8)
    p.add_argument("--edit", default="parallel-value", choices=ABLATIONS)
    p.add_argument("--positions", default="all", choices=POSITIONS, help="after-first: leave the boundary token")
    p.add_argument("--layers", type=int, nargs="+", default=None)
    p.add_argument(
        "--method",
        default="exact",
        choices=["exact", "attribution"],
        help="exact: one ablation per head (engine); attribution: every head from one forward + one backward",
    )
    p.add_argument("--confirm", type=int, default=0, metavar="K", help="attribution: rerun the top K heads exactly")
    _store(p, "sensitivity_store.jsonl")
    _workers(p)
    p = sub.add_parser("dominance", help="how strongly each upstream head drives the next layer's q/k/v")
    _common(p, n_docs=4)
    p.set_defaults(texts="study", seq_len=32)
    p.add_argument("--upstream-layers", type=int, nargs="+", default=None)
    p.add_argument(
        "--query-start", type=int, default=None, help="first receiving query token scored (default: the study's 7)"
    )
    p.add_argument(
        "--query-stop",
        type=int,
        default=None,
        help="score tokens before this one (default: the study's 32, or the sequences' end if shorter)",
    )
    p.add_argument("--scale", default="qkv", choices=["qkv", "js", "js_distance"], help="scale of the printed table")
    p.add_argument(
        "--mask-scale",
        default="qkv",
        choices=["qkv", "both"],
        help="rank the weak/strong halves on qkv (the study) or also on js",
    )
    _workers(p)
    p = sub.add_parser("checks", help="sanity checks: causal null, GQA groups, split-half reliability")
    _common(p, n_docs=8)
    p.add_argument("--edit", default="parallel-value", choices=ABLATIONS)
    p.add_argument(
        "--positions", default="after-first", choices=POSITIONS, help="the paper's frozen protocol: after-first"
    )
    p.add_argument("--null", default="sampled", choices=NULLS, help="causal null: sampled (the paper's) or exact")
    _store(p, "ablations.jsonl")
    _workers(p)
    p = sub.add_parser("compress", help="compression error along / across each layer's update")
    _common(p, n_docs=12)
    p.add_argument(
        "--method",
        nargs="+",
        default=["int8", "int4-g128", "wanda-50%", "wanda-2:4"],
        help="int8, int4, int4-g128, magnitude-50%%, wanda-50%%, magnitude-2:4, wanda-4:8, ...",
    )
    p.add_argument("--positions", default="last", choices=["last", "all"])
    _workers(p)
    p = sub.add_parser("report", help="the standard battery on one or several models: report.html + tables")
    _common(p, n_docs=8, many_models=True)
    p = sub.add_parser("train", help="train small LMs with each arm, paired by seed")
    p.add_argument("--preset", default="cpu-small", choices=sorted(PRESETS))
    p.add_argument(
        "--design",
        default=None,
        choices=sorted(DESIGNS),
        help="a pre-specified factorial (preset, arms, seeds, endpoints): xsa-controls is the sanity-checks paper's; "
        "--preset/--arms/--seeds are then ignored",
    )
    p.add_argument("--tokens", type=_positive, default=None, help="tokens per run (whole batches; overrides --steps)")
    p.add_argument("--plan", default=None, help="freeze the analysis plan to this JSON file before the first run")
    p.add_argument("--arms", nargs="+", default=["baseline", "random-direction-gated", "xsa-gated"], choices=ARMS)
    p.add_argument("--primary", default=None, help="primary endpoint arm (default: the first arm after baseline)")
    p.add_argument("--seeds", type=_non_negative, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--steps", type=_positive, default=None, help="override the preset's number of steps")
    p.add_argument("--texts", nargs="+", default=None, help="corpora to train on (default: the preset's)")
    p.add_argument("--device", default="auto", help="auto (CUDA + bf16 when available), cpu or cuda")
    p.add_argument("--out", required=False, help="output folder (default: results/train)")
    _workers(p)
    p = sub.add_parser("models", help="list the models that load offline now and those that need the hub")
    p.add_argument("--out", required=False, help="also write models.csv here")
    return parser


def _emit(out: Path, name: str, result, shown: pd.DataFrame) -> None:
    """Write ``name.csv`` (the tidy table), ``name_summary.csv``, the result (JSON + npz) and every figure
    (``name`` for the main one, ``name_<figure>`` for the others); print ``shown`` and the files."""
    from lens_parallel.plots import save_figure

    result.to_dataframe().to_csv(out / f"{name}.csv", index=False)
    result.summary().to_csv(out / f"{name}_summary.csv", index=False)
    written = [out / f"{name}.csv", out / f"{name}_summary.csv", result.save(out / name)]
    for i, (fig_name, fig) in enumerate(result.figures().items()):
        written += save_figure(fig, out / (name if i == 0 else f"{name}_{fig_name}"))
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(shown.to_string())
    print("wrote:", *map(str, written), sep="\n  ")


def _store_path(args: argparse.Namespace, out: Path, default: str) -> Path:
    return Path(args.store) if args.store else out / default


def _load(args: argparse.Namespace, *names: str):
    """The output folder (checked for ``names``), the model and the documents, in that order (nothing loads before
    the folder and the worker settings are checked)."""
    from lens_parallel.data import check_corpus, token_blocks
    from lens_parallel.distributed import check_workers
    from lens_parallel.models import load_model

    out = _output_dir(args, *names or (args.command,))
    check_workers(getattr(args, "workers", 1), getattr(args, "ray_address", None))  # before loading anything
    if args.texts != "study":
        check_corpus(args.texts)
    model = load_model(args.model, device=args.device)
    if args.texts == "study":
        from lens_parallel.analyses.dominance import study_texts

        return out, model, study_texts(model, seq_len=args.seq_len, seed=args.seed)
    blocks = token_blocks(model, args.texts, n_docs=args.n_docs, seq_len=args.seq_len, seed=args.seed)
    return out, model, blocks


def _decompose(args: argparse.Namespace) -> None:
    from lens_parallel.analyses.decompose import decompose

    out, model, blocks = _load(args)
    space = "all" if "all" in args.space else args.space
    result = decompose(model, blocks, space=space, layers=args.layers, batch_size=args.batch_size)
    df = result.to_dataframe()
    print(f"{result.info.name}: means over layers and heads, positions t >= 1")
    shown = df.groupby(["space", "level"])[["self_cos", "par_frac", "perp_frac", "par_coef"]].mean().round(4)
    _emit(out, "decompose", result, shown)


def _scale(args: argparse.Namespace) -> None:
    from lens_parallel.analyses.scaling import scale_sweep

    out, model, blocks = _load(args)
    result = scale_sweep(
        model,
        blocks,
        space=args.space,
        s_par=args.s_par,
        s_perp=args.s_perp,
        layers=args.layers,
        per_layer=args.per_layer,
        positions=args.positions,
        batch_size=args.batch_size,
        seed=args.seed,
        store=_store_path(args, out, "scale_store.jsonl"),
        workers=args.workers,
        ray_address=args.ray_address,
    )
    df = result.to_dataframe()
    print(f"{result.info.name}: edited minus no-op (nats/token), no-op loss {df['loss_noop'].iloc[0]:.4f}")
    cols = ["space", "layer", "s_par", "s_perp", "delta_loss", "delta_loss_lo", "delta_loss_hi"]
    _emit(out, "scale", result, df[cols].round(4).set_index("space"))


def _diagonal(args: argparse.Namespace) -> None:
    from lens_parallel.analyses.decompose import decompose
    from lens_parallel.analyses.diagonal import diagonal_view
    from lens_parallel.report import strongest_parallel_heads

    out, model, blocks = _load(args)
    layer, head = args.layer, args.head
    if (layer is None) != (head is None):
        raise LensParallelError("give both --layer and --head, or neither (then the most self-aligned head is shown)")
    if layer is None:
        ((layer, head),) = strongest_parallel_heads(decompose(model, blocks, space="value", progress=False), k=1)
    result = diagonal_view(
        model, blocks, layer=layer, head=head, s_par=args.s_par, space=args.space, batch_size=args.batch_size
    )
    df = result.to_dataframe()
    print(f"{result.info.name}: dA_tt per head at layer {layer} for s_par = {args.s_par} (figure: head {head})")
    _emit(out, "diagonal", result, df.head(12))


def _sensitivity(args: argparse.Namespace) -> None:
    from lens_parallel.analyses.sensitivity import head_sensitivity

    if args.confirm and args.method != "attribution":
        raise LensParallelError("--confirm K checks an attribution screen: use it with --method attribution")
    if args.confirm < 0:
        raise LensParallelError(f"--confirm must be >= 0 heads, got {args.confirm}")
    if args.method == "attribution" and (args.workers > 1 or args.ray_address):
        raise LensParallelError(
            "--method attribution is one forward + backward per batch: it runs here, without --workers"
        )
    if args.method == "attribution":
        _attribution(args)
        return
    out, model, blocks = _load(args)
    result = head_sensitivity(
        model,
        blocks,
        edit=args.edit,
        positions=args.positions,
        layers=args.layers,
        batch_size=args.batch_size,
        seed=args.seed,
        store=_store_path(args, out, "sensitivity_store.jsonl"),
        workers=args.workers,
        ray_address=args.ray_address,
    )
    df = result.to_dataframe()
    joint = df[df["head"].isna()]
    print(f"{result.info.name}: joint {args.edit} ablation per layer (delta loss, nats/token)")
    _emit(out, "sensitivity", result, joint[["label", "delta_loss", "ci_lo", "ci_hi", "p"]].round(4))


def _attribution(args: argparse.Namespace) -> None:
    from lens_parallel.analyses.attribution import head_attribution
    from lens_parallel.analyses.confirm import confirm
    from lens_parallel.hooks import softmax_layers
    from lens_parallel.models import model_info

    out, model, blocks = _load(args, "attribution")
    info = model_info(model)
    n_heads = info.n_heads * len(softmax_layers(info, args.layers, what="attribution")[0])
    if args.confirm > n_heads:
        raise LensParallelError(f"--confirm {args.confirm} exceeds the {n_heads} heads screened")
    kw = {"edit": args.edit, "positions": args.positions, "layers": args.layers, "batch_size": args.batch_size}
    result = head_attribution(model, blocks, **kw, seed=args.seed)
    heads = result.to_dataframe().dropna(subset=["head"])
    top = heads.loc[heads["estimate"].abs().nlargest(10).index]
    print(f"{result.info.name}: first-order estimate of {args.edit} per head (nats/token), largest 10")
    _emit(out, "attribution", result, top.head(10)[["label", "estimate", "ci_lo", "ci_hi"]].round(5))
    if args.confirm:
        checked = confirm(
            model,
            blocks,
            result,
            top_k=args.confirm,
            n_random=min(args.confirm, n_heads - args.confirm),
            seed=args.seed,
            batch_size=args.batch_size,
        )
        print(f"exact check of the top {args.confirm} heads and as many random ones:")
        _emit(out, "attribution_confirm", checked, checked.summary().drop(columns="note").round(4))
        print(checked.summary()["note"].iloc[0])


def _dominance(args: argparse.Namespace) -> None:
    from lens_parallel.analyses.dominance import head_dominance

    out, model, blocks = _load(args)
    result = head_dominance(
        model,
        blocks,
        query_positions=_query_window(args.query_start, args.query_stop),
        upstream_layers=args.upstream_layers,
        mask_scales=("qkv", "js") if args.mask_scale == "both" else ("qkv",),
        seed=args.seed,
        batch_size=args.batch_size,
        workers=args.workers,
        ray_address=args.ray_address,
    )
    table = result.group_table()
    table = table[(table.level == "pair") & (table.scale == args.scale) & table.mask_scale.isin(["", "qkv"])]
    shown = table.pivot(index="group", columns="metric", values="median")
    shown = shown.reindex(index=list(dict.fromkeys(table.group)), columns=_DOMINANCE_COLUMNS)
    print(
        f"{result.info.name}: dominance of upstream heads over the next layer, {args.scale} scale: medians over "
        "observations (text, query token, receiving head); weak_smaller = share of observations"
    )
    shown["weak_smaller"] = table[table.metric == "weak_smaller"].set_index("group")["mean"]
    _emit(out, "dominance", result, shown.round(4))


def _query_window(start: int | None, stop: int | None) -> slice | None:
    """None (the study's window within the sequences) unless a bound is given; a given bound is checked as is."""
    if start is None and stop is None:
        return None
    from lens_parallel.analyses.dominance import STUDY_WINDOW

    return slice(STUDY_WINDOW[0] if start is None else start, stop)


_DOMINANCE_COLUMNS = [
    "effective_fraction",
    "top25_share",
    "bottom25_share",
    "heads_for_90",
    "joint_weak",
    "joint_strong",
    "joint_all",
    "strong_weak_ratio",
    "weak_smaller",
]


def _checks(args: argparse.Namespace) -> None:
    from lens_parallel.analyses.reliability import sanity_report

    out, model, blocks = _load(args)
    result = sanity_report(
        model,
        blocks,
        edit=args.edit,
        positions=args.positions,
        null=args.null,
        seed=args.seed,
        batch_size=args.batch_size,
        store=_store_path(args, out, "ablations.jsonl"),
        workers=args.workers,
        ray_address=args.ray_address,
    )
    row = result.summary()
    print(f"{result.info.name}: sanity checks on {args.n_docs} documents")
    _emit(out, "checks", result, row.T.rename(columns={0: ""}))


def _compress(args: argparse.Namespace) -> None:
    from lens_parallel.analyses.compression import compression_error
    from lens_parallel.compression import Compression

    for method in args.method:  # before loading anything
        Compression.parse(method)
    out, model, blocks = _load(args)
    result = compression_error(
        model,
        blocks,
        method=args.method,
        positions=args.positions,
        batch_size=args.batch_size,
        workers=args.workers,
        ray_address=args.ray_address,
    )
    table = result.method_table()
    table.to_csv(out / "compress_methods.csv", index=False)
    print(f"{result.info.name}: error relative to the dense update, mean over layers; delta loss in nats/token")
    _emit(out, "compress", result, table.round(4).set_index(["method", "sublayer"]))


def _report(args: argparse.Namespace) -> None:
    import time

    from lens_parallel.data import token_blocks
    from lens_parallel.models import check_device, check_spec, load_model
    from lens_parallel.report import check_battery, run_battery, write_report

    check_device(args.device)
    for spec in args.model:  # every spec before the first (long) battery
        check_spec(spec)
    check_battery(n_docs=args.n_docs, texts=args.texts, batch_size=args.batch_size)
    out = _output_dir(args, "report")
    for folder in ("tables", "results"):
        if (out / folder).exists() and not (out / folder).is_dir():
            raise LensParallelError(f"--out {out}: {folder} is a file, where the report writes a folder; remove it")
    t0 = time.perf_counter()
    reports = []
    for spec in args.model:
        print(f"[{spec}] running the battery")
        model = load_model(spec, device=args.device)
        blocks = token_blocks(model, args.texts, n_docs=args.n_docs, seq_len=args.seq_len, seed=args.seed)
        reports.append(run_battery(model, blocks, seed=args.seed, batch_size=args.batch_size))
    settings = {"texts": args.texts, "n_docs": args.n_docs, "seq_len": args.seq_len, "seed": args.seed}
    path = write_report(reports, out, settings=settings)
    summary = pd.concat([r.summary() for r in reports]).set_index("model")
    with pd.option_context("display.width", 160, "display.max_columns", 30):
        print(summary.T.to_string())
    print(f"report: {path} ({time.perf_counter() - t0:.0f} s); tables in {out / 'tables'}")


def _train(args: argparse.Namespace) -> None:
    import dataclasses

    from lens_parallel.distributed import check_workers
    from lens_parallel.training import PRESETS, run_design, run_factorial

    check_workers(args.workers, args.ray_address)
    changes = {"device": args.device} | ({"steps": args.steps} if args.steps else {})
    changes |= {"texts": tuple(args.texts)} if args.texts else {}
    out = _output_dir(args, "train", "paired", "curves")
    if args.design:
        result = run_design(
            args.design,
            out=out,
            plan=args.plan,
            tokens=args.tokens,
            workers=args.workers,
            ray_address=args.ray_address,
            **changes,
        )
        name = f"design {args.design}"
    else:
        config = dataclasses.replace(PRESETS[args.preset], **changes)
        config = config.with_tokens(args.tokens) if args.tokens else config
        result = run_factorial(
            config,
            args.arms,
            args.seeds,
            out=out,
            primary=args.primary,
            plan=args.plan,
            workers=args.workers,
            ray_address=args.ray_address,
        )
        name = f"preset {args.preset}"
    table = result.paired_table()
    table.to_csv(out / "paired.csv", index=False)
    result.curves().to_csv(out / "curves.csv", index=False)
    print(
        f"{name}: delta = arm - reference final validation loss (nats/token), paired by seed; mde_paper = the paper's "
        "2.9 sigma/sqrt(n) approximation, mde_80 / mde_90 = exact noncentral-t MDE at 80% / 90% power"
    )
    cols = ["role", "n_seeds", "mean_delta", "ci_lo", "ci_hi", "p", "p_holm", "cohens_dz", "mde_paper", "mde_80"]
    _emit(out, "train", result, table.set_index("contrast")[cols].round(5))


def _models(args: argparse.Namespace) -> None:
    from lens_parallel.models import available_models

    table = available_models()
    left = {col: f"{{:<{table[col].astype(str).str.len().max()}}}".format for col in table.columns}
    print(table.to_string(index=False, formatters=left, justify="left"))
    if args.out is not None:
        path = _output_dir(args, "models") / "models.csv"
        table.to_csv(path, index=False)
        print("wrote:", path)


COMMANDS = {
    "decompose": _decompose,
    "scale": _scale,
    "diagonal": _diagonal,
    "sensitivity": _sensitivity,
    "dominance": _dominance,
    "checks": _checks,
    "compress": _compress,
    "report": _report,
    "train": _train,
    "models": _models,
}


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a bad command line (one line on stderr, status 2)
        return int(exc.code or 0)
    try:
        COMMANDS[args.command](args)
    except LensParallelError as exc:  # bad input: one line
        print(f"lens-parallel {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except EnvironmentFailure as exc:  # the environment failed: what failed and what to do, no traceback
        print(f"lens-parallel {args.command}: could not run: {_one_line(exc)}", file=sys.stderr)
        return 3
    return 0  # anything else (LibraryError, a bug inside the package) shows its traceback


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


if __name__ == "__main__":
    sys.exit(main())
