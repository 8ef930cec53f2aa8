"""Qwen3.5's linear-attention layers at length: decompose of three spaces against the plain forward, and the
operations each dispatches (issue 64, item 5).

    python benchmarks/linear_attention.py [--seq-len 4096] [--repeats 3] [--threads 2]
                                          [--out benchmarks/out/linear_attention]

toy-qwen3.5 with a context of ``--seq-len`` (three Gated DeltaNet layers, two gated softmax layers), one document of
random token ids. Each mode in its own process, median of ``--repeats`` after a warm-up, peak RSS its own:

  forward     the forward every analysis runs, to the final normalised residual (no logits)
  hf          Hugging Face's own forward of an independent copy, to the last hidden state
  decompose   decompose(space=[value, value-exclude-self, residual-attn]): every layer, linear ones per value head

Then, with a GPU's work sizes (``devices.sized_as("cuda")``), the operations dispatched (PyTorch's dispatch mode)
by the forward and by decompose at a quarter of the length and at the length: what decompose adds must not grow
with the length. transformers' chunked delta rule (the CPU fallback when flash-linear-attention is not installed)
loops over chunks of 64 positions in Python, so the forward's own count grows with the length; that loop is the
model's, not lens_parallel's, and is printed beside. Writes ``linear_attention.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("forward", "hf", "decompose")
SPACES = ["value", "value-exclude-self", "residual-attn"]


def _setup(seq_len: int, threads: int):
    import torch

    from lens_parallel.documents import Documents
    from lens_parallel.models import load_model, toy_folder

    torch.set_num_threads(threads)
    folder = toy_folder("toy-qwen3.5", n_ctx=seq_len)
    model = load_model(str(folder))
    ids = torch.randint(0, 5000, (seq_len,), generator=torch.Generator().manual_seed(0))
    return folder, model, Documents.padded([ids.tolist()], {"source": "random token ids"})


def _calls(model, docs, hf=None):
    import warnings

    import torch

    import lens_parallel as lp
    from lens_parallel.hooks import forward

    def decompose() -> None:
        with warnings.catch_warnings():  # the note on residual-attn's per-head level
            warnings.simplefilter("ignore")
            lp.decompose(model, docs, space=SPACES, progress=False)

    def hf_forward() -> None:
        with torch.inference_mode():
            hf.model(docs.tokens)

    return {"forward": lambda: forward(model, docs.tokens), "hf": hf_forward, "decompose": decompose}


def worker(mode: str, args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    folder, model, docs = _setup(args.seq_len, args.threads)
    hf = AutoModelForCausalLM.from_pretrained(folder).eval() if mode == "hf" else None
    call = _calls(model, docs, hf)[mode]
    call()  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": mode, "median_s": statistics.median(times), "times_s": times, "peak_rss_mib": peak}


def dispatches(args: argparse.Namespace) -> dict:
    from lens_parallel import devices
    from lens_parallel.devices import sized_as

    out: dict[str, dict[int, int]] = {"forward": {}, "decompose": {}}
    for seq_len in (args.seq_len // 4, args.seq_len):
        _, model, docs = _setup(seq_len, args.threads)
        calls = _calls(model, docs)
        for name in out:
            with sized_as("cuda"):
                calls[name]()  # lazy initialisation dispatches once
                with devices.dispatch_counts() as counts:
                    calls[name]()
            out[name][seq_len] = sum(counts.kernels.values())
    out["added by decompose"] = {n: out["decompose"][n] - out["forward"][n] for n in out["forward"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/out/linear_attention")
    parser.add_argument("--worker", choices=[*MODES, "dispatch"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = dispatches(args) if args.worker == "dispatch" else worker(args.worker, args)
        print(json.dumps(result))
        return
    start = time.perf_counter()
    rows = {}
    for mode in (*MODES, "dispatch"):
        command = [sys.executable, __file__, "--worker", mode, *sys.argv[1:]]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        rows[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    base = rows["forward"]["median_s"]
    print(f"toy-qwen3.5, 1 x {args.seq_len} tokens, {args.threads} threads, median of {args.repeats}:")
    for mode in MODES:
        row = rows[mode]
        print(
            f"  {mode:10s} {row['median_s']:7.3f} s  {row['median_s'] / base:5.2f}x the forward   "
            f"peak RSS {row['peak_rss_mib']:7.1f} MiB"
        )
    print("kernels dispatched with a GPU's work sizes:")
    for name, by_length in rows["dispatch"].items():
        print(f"  {name:20s} " + "   ".join(f"{n} tokens: {k}" for n, k in by_length.items()))
    print(f"wall time {time.perf_counter() - start:.1f} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "linear_attention.json").write_text(json.dumps(rows, indent=1))
    figure(rows, args, out / "linear_attention")


def figure(rows: dict, args: argparse.Namespace, stem: Path) -> None:
    """Left: each mode's time as a multiple of the forward's (the 1.5x goal dashed). Right: kernels dispatched
    against the length, the forward's and what decompose adds."""
    from plotly.subplots import make_subplots

    from lens_parallel.plots import save_figure

    base = rows["forward"]["median_s"]
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=(
            f"time at 1 x {args.seq_len} tokens (median of {args.repeats})",
            "kernels dispatched with a GPU's work sizes",
        ),
    )
    ratios = [rows[mode]["median_s"] / base for mode in MODES]
    fig.add_bar(x=list(MODES), y=ratios, text=[f"{r:.2f}x" for r in ratios], name="time / the forward's", row=1, col=1)
    fig.add_hline(y=1.5, line={"dash": "dash", "color": "#d62728"}, annotation_text="goal: 1.5x", row=1, col=1)
    shown = {
        "forward": "the forward (transformers' Python loop over chunks of 64 positions)",
        "added by decompose": "added by decompose (lens_parallel's captures and reductions)",
    }
    for name, label in shown.items():
        by_length = rows["dispatch"][name]
        fig.add_scatter(
            x=[int(n) for n in by_length], y=list(by_length.values()), mode="lines+markers", name=label, row=1, col=2
        )
    fig.update_yaxes(title_text="× the forward to the final residual", row=1, col=1)
    fig.update_xaxes(title_text="tokens", type="log", row=1, col=2)
    fig.update_yaxes(title_text="kernels per call", rangemode="tozero", row=1, col=2)
    fig.update_layout(
        title=f"Linear-attention layers at length: toy-qwen3.5, decompose of {', '.join(SPACES)} vs the forward",
        template="plotly_white",
        width=1150,
        height=480,
        legend={"orientation": "h", "y": -0.2},
    )
    save_figure(fig, stem)


if __name__ == "__main__":
    main()
