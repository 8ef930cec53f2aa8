"""How long the notebook explorer takes to respond, on a real model on this machine.

    python benchmarks/explorer.py [--model smollm2-135m] [--n-docs 4] [--seq-len 128] [--repeats 5]

Times, in one process: building the explorer (the decomposition of every head in three spaces, then the first
view), and each kind of update the widget makes: a slider move (s_par, then s_perp: the diagonal redrawn from the
kept capture, one forward of the document resumed at the edited layer), another head of the same layer, a head of
another layer (a new capture of that layer), another document, another space (a new matched no-op), and all heads
of the layer. Each update is timed ``--repeats`` times (median and max printed), on ``explorer.update`` plus the
figures it redraws; "widget slider s_par" is the whole kernel side of a slider move in the widget (the update and
the FigureWidgets' data replaced), to which the browser adds only the transfer and the redraw.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from lens_parallel import explore, load_model, token_blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--n-docs", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/out/explorer")
    args = parser.parse_args()
    model = load_model(args.model)
    blocks = token_blocks(model, "wikipedia-en", n_docs=args.n_docs, seq_len=args.seq_len, seed=0)
    t0 = time.perf_counter()
    ex = explore(model, blocks)
    ex.figures()
    built = time.perf_counter() - t0
    layer, head = ex.view.layer, ex.view.head
    n_layers, n_heads = ex.info.n_layers, ex.info.n_heads
    other = (layer + 1) % n_layers

    def timed(changes: dict) -> float:
        t = time.perf_counter()
        ex.update(**changes)
        ex.figures()
        return time.perf_counter() - t

    moves = {
        "slider s_par": lambda i: {"s_par": round(0.1 * (i + 1), 2)},
        "slider s_perp": lambda i: {"s_perp": round(1.0 - 0.1 * (i + 1), 2)},
        "head, same layer": lambda i: {"head": (head + i + 1) % n_heads},
        "head, another layer": lambda i: {"layer": (other + i) % n_layers, "head": 0},
        "document": lambda i: {"doc": (i + 1) % args.n_docs},
        "space": lambda i: {"space": ("value-exclude-self", "residual-attn", "value")[i % 3]},
        "all heads of the layer": lambda i: {"all_heads": i % 2 == 0},
    }
    rows = {}
    from lens_parallel.explore_widget import ExplorerWidget

    widget = ExplorerWidget(ex, save_to=Path(args.out))
    ex.update(layer=layer, head=head, doc=0, space="value", s_par=0.0, s_perp=1.0, all_heads=False)
    seconds = []
    for i in range(args.repeats):
        t = time.perf_counter()
        widget.s_par.value = round(0.1 * (i + 1), 2)  # what a slider move runs in the kernel
        seconds.append(time.perf_counter() - t)
    rows["widget slider s_par"] = {"median_s": statistics.median(seconds), "max_s": max(seconds)}
    for name, change in moves.items():
        ex.update(layer=layer, head=head, doc=0, space="value", s_par=0.0, s_perp=1.0, all_heads=False)
        seconds = [timed(change(i)) for i in range(args.repeats)]
        rows[name] = {"median_s": statistics.median(seconds), "max_s": max(seconds)}
    print(
        f"{args.model}: {n_layers} layers x {n_heads} heads, {args.n_docs} documents x {args.seq_len} tokens, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"building the explorer (decomposition in 3 spaces + first view): {built:.2f} s")
    print(f"{'update':<26}{'median s':>10}{'max s':>10}")
    for name, r in rows.items():
        print(f"{name:<26}{r['median_s']:>10.3f}{r['max_s']:>10.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "explorer.json").write_text(json.dumps({"model": args.model, "build_s": built, "updates": rows}, indent=1))
    print("wrote:", out / "explorer.json")


if __name__ == "__main__":
    main()
