"""``lens-parallel``: the command line.

    lens-parallel decompose [--model smollm2-135m] [--space value ...] [--out results/decompose]

Every subcommand writes a CSV table, the result as JSON (+ .npz, with provenance), the figure as interactive HTML
(and PNG when kaleido can find a Chrome/Chromium), and prints a short table. A user error exits with status 2
and one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"


class UserError(Exception):
    """Bad input from the command line: printed as one line, exit status 2."""


def _writable_dir(path: str) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--out {path}: cannot create the folder ({exc.strerror})") from exc
    if not os.access(out, os.W_OK):
        raise UserError(f"--out {path}: the folder is not writable")
    return out


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model spec (default: {DEFAULT_MODEL})")
    parser.add_argument("--texts", default="wikipedia-en", help="bundled corpus (default: wikipedia-en)")
    parser.add_argument("--n-docs", type=int, default=16, help="documents (token blocks), default 16")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per block, default 128")
    parser.add_argument("--batch-size", type=int, default=8, help="documents per forward, default 8")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document order, default 0")
    parser.add_argument("--device", default="cpu", help="torch device, default cpu")
    parser.add_argument("--out", required=False, help="output folder (default: results/<subcommand>)")


def _build_parser() -> argparse.ArgumentParser:
    from lens_parallel.analyses.decompose import SPACES

    parser = argparse.ArgumentParser(prog="lens-parallel", description="Parallel/perpendicular geometry of heads.")
    sub = parser.add_subparsers(dest="command", required=True)
    dec = sub.add_parser("decompose", help="self-alignment of head outputs and residual updates")
    _common(dec)
    dec.add_argument("--space", nargs="+", default=["value"], choices=[*SPACES, "all"], help="space(s), default value")
    dec.add_argument("--layers", type=int, nargs="+", default=None, help="layers (default: all)")
    return parser


def _write_figure(fig, stem: Path) -> list[Path]:
    written = [stem.with_suffix(".html")]
    fig.write_html(written[0], include_plotlyjs=True)
    try:
        fig.write_image(stem.with_suffix(".png"), scale=2)
        written.append(stem.with_suffix(".png"))
    except Exception as exc:  # kaleido missing, or no Chrome/Chromium on this machine
        print(f"(no PNG: {str(exc).splitlines()[0][:120]})", file=sys.stderr)
    return written


def _decompose(args: argparse.Namespace) -> None:
    from lens_parallel.analyses.decompose import decompose
    from lens_parallel.data import token_blocks
    from lens_parallel.models import load_model

    out = _writable_dir(args.out or "results/decompose")
    model = load_model(args.model, device=args.device)
    blocks = token_blocks(model, args.texts, n_docs=args.n_docs, seq_len=args.seq_len, seed=args.seed)
    space = "all" if "all" in args.space else args.space
    result = decompose(model, blocks, space=space, layers=args.layers, batch_size=args.batch_size)
    df = result.to_dataframe()
    df.to_csv(out / "decompose.csv", index=False)
    written = [out / "decompose.csv", result.save(out / "decompose")]
    written += _write_figure(result.figure(), out / "decompose")
    cols = ["self_cos", "par_frac", "perp_frac", "par_coef"]
    print(f"{result.info.name}: means over layers and heads, positions t >= 1")
    print(df.groupby(["space", "level"])[cols].mean().round(4).to_string())
    print("wrote:", *map(str, written), sep="\n  ")


COMMANDS = {"decompose": _decompose}


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except (UserError, ValueError, FileNotFoundError) as exc:
        print(f"lens-parallel {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
