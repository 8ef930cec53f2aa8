"""Architectures at length: decompose against Hugging Face's own SDPA forward and the plain forward, on toys of a
Mistral-like (sliding window), a Gemma-2-like (attention soft cap, alternating windows), a Mixtral-like (mixture of
experts) and an OLMo-2-like model (query/key norm before the head split: the route through its module), or any rows
of the support matrix, with the attention path that ran (issues 68, 76).

    python benchmarks/architectures.py [--seq-len 2048] [--repeats 3] [--threads 2] [--rows olmo2 cohere ...]
                                       [--out benchmarks/out/architectures]

Each toy is its architecture's own config shrunk by lens_parallel's template (``lens_parallel.toys.toy_config``) to
a benchmark size (4 layers, width 256, 8 query / 2 kv heads of 32, a 512-token window where the architecture has
one, a context of ``--seq-len``), seeded random weights, one document of random token ids; ``--rows`` names any
architecture of the support matrix. Each (model, mode) in its own process, median of ``--repeats`` after a warm-up,
peak RSS its own:

  hf-sdpa          Hugging Face's own decoder (base_model, no unembedding) with SDPA (eager where it has none)
  forward          the forward every analysis runs, to the final normalised residual (no logits)
  decompose-value  decompose(space="value")
  decompose        decompose(space=[value, value-exclude-self, residual-attn])
  decompose-eager  the same with every layer forced onto TransformerLens's eager attention (the full square)

The path each layer took (lens_parallel's fused / diagonal / blocked, or eager and why) is read from the model's
``attention_paths`` and from :func:`lens_parallel.attention.recorded_paths`. Writes ``architectures.json`` and a
figure to ``--out``.

``--memory`` measures memory at length instead (``--seq-len 16384``): each mode once, in its own process, the peak
resident memory the call adds over what the process held before it (Linux's high-water mark, VmHWM, reset by
``/proc/self/clear_refs`` just before the call). Hugging Face's peer is its SDPA forward; a row whose Hugging Face
model has no SDPA (Gemma 2, gpt-oss, Bloom: eager's square of every head would not fit) is compared with the
``--memory-peer`` row's (Llama-like, the same width, heads and length). Writes ``memory.json``, ``memory.md`` and a
figure.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("hf-sdpa", "forward", "decompose-value", "decompose", "decompose-eager")
SPACES = ["value", "value-exclude-self", "residual-attn"]
SIZE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "moe_intermediate_size": 256,
}
MODELS = {
    "mistral": ("Mistral-like: sliding window", {"sliding_window": 512}),
    "gemma2": (
        "Gemma-2-like: attention soft cap, sliding / global layers",
        {"sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"] * 2},
    ),
    "mixtral": ("Mixtral-like: mixture of experts (4 experts, top 2)", {}),
    "olmo2": ("OLMo-2-like: query/key norm before the head split (the route through its module)", {}),
}
"""The default rows; ``--rows`` names any architecture of the support matrix (its toy template at the same size)."""


def _folder(model_type: str, seq_len: int, root: Path) -> Path:
    import torch
    import transformers

    from lens_parallel.tokenizers import load_bundled_tokenizer
    from lens_parallel.toys import settable, toy_config

    folder = root / f"{model_type}-{seq_len}"
    if not (folder / "config.json").is_file():
        default = transformers.AutoConfig.for_model(model_type)
        size = {name: value for name, value in SIZE.items() if settable(default, name)}  # Falcon's head_dim: derived
        length = {name: seq_len for name in ("max_seq_len",) if settable(default, name)}  # MPT's ALiBi table
        config = toy_config(model_type, **size, **_row(model_type)[1], **length, max_position_embeddings=seq_len)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        load_bundled_tokenizer("gpt2").save_pretrained(folder)
    return folder


FITTED = {"gptj": {"rotary_dim": 16}}
"""Fields a row's config needs at the benchmark's size (GPT-J's default rotary_dim 64 exceeds a head of 32)."""


def _row(model_type: str) -> tuple[str, dict]:
    return MODELS.get(model_type, (f"{model_type}-like", FITTED.get(model_type, {})))


def _calls(
    model_type: str, modes: list[str], args: argparse.Namespace, *, eager_peer: bool = True
) -> tuple[dict[str, Any], Any, dict]:
    """Each mode's call on one document of ``--seq-len`` random ids (only the models the modes need are loaded),
    the lens_parallel model (or None) and what Hugging Face's peer ran."""
    import warnings

    import torch
    import transformers

    import lens_parallel as lp
    from lens_parallel.attention import attention_path
    from lens_parallel.documents import Documents
    from lens_parallel.hooks import forward

    torch.set_num_threads(args.threads)
    folder = _folder(model_type, args.seq_len, Path(args.models))
    ids = torch.randint(0, 5000, (args.seq_len,), generator=torch.Generator().manual_seed(0))
    calls: dict[str, Any] = {}
    peer: dict = {}
    if "hf-sdpa" in modes:  # Hugging Face's own decoder (base_model: no unembedding), SDPA or eager where it has none
        try:
            hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
            peer["hugging face sdpa"] = 1
        except ValueError:
            if not eager_peer:
                return {}, None, {}
            hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
            peer["hugging face eager"] = 1

        def run_hf() -> None:
            with torch.inference_mode():
                hf.base_model(ids[None])

        calls["hf-sdpa"] = run_hf
    model = lp.load_model(str(folder)) if set(modes) - {"hf-sdpa"} else None
    docs = Documents.padded([ids.tolist()], {"source": "random token ids"})

    def decompose(space: Any, path: str = "auto") -> None:
        with warnings.catch_warnings(), attention_path(path):  # post-norms: the note on residual-attn's heads
            warnings.simplefilter("ignore")
            lp.decompose(model, docs, space=space, progress=False)

    lens = {
        "forward": lambda: forward(model, docs.tokens),
        "decompose-value": lambda: decompose("value"),
        "decompose": lambda: decompose(SPACES),
        "decompose-eager": lambda: decompose(SPACES, "eager"),
    }
    calls |= {mode: call for mode, call in lens.items() if mode in modes}
    return calls, model, peer


def _row_record(model_type: str, mode: str, times: list[float], model: Any, paths: dict, peer: dict) -> dict:
    import lens_parallel as lp

    info = lp.model_info(model) if model is not None else None
    return {
        "model": model_type,
        "mode": mode,
        "median_s": statistics.median(times),
        "times_s": times,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "paths_per_forward": peer if mode == "hf-sdpa" else paths,
        "attention_paths": sorted(set(info.attention_paths) - {""}) if info else [],
        "features": list(info.features) if info else [],
    }


def worker(model_type: str, mode: str, args: argparse.Namespace) -> dict:
    """One mode in this process (its peak RSS its own): median of ``--repeats`` after a warm-up."""
    from lens_parallel.attention import recorded_paths

    calls, model, peer = _calls(model_type, [mode], args)
    calls[mode]()  # warm-up
    times = []
    with recorded_paths() as paths:
        for _ in range(args.repeats):
            start = time.perf_counter()
            calls[mode]()
            times.append(time.perf_counter() - start)
    per_call = {k: v // args.repeats for k, v in paths.items()}
    return _row_record(model_type, mode, times, model, per_call, peer)


def _high_water_mib() -> float:
    """The process's peak resident memory since the last :func:`_reset_high_water` (VmHWM), in MiB."""
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 1024


def _reset_high_water() -> float:
    """Reset the peak to the memory held now (``/proc/self/clear_refs``: 5); returns that, in MiB."""
    Path("/proc/self/clear_refs").write_text("5")
    return _high_water_mib()


def memory_worker(model_type: str, mode: str, args: argparse.Namespace) -> dict:
    """One call of ``mode`` in this process: the peak memory it adds over what the process held before it, and its
    time; ``{"no_sdpa": True}`` for Hugging Face's peer where its model has no SDPA."""
    import gc

    calls, model, peer = _calls(model_type, [mode], args, eager_peer=False)
    if not calls:
        return {"model": model_type, "mode": mode, "no_sdpa": True}
    gc.collect()
    held = _reset_high_water()
    with __import__("lens_parallel").attention.recorded_paths() as paths:
        start = time.perf_counter()
        calls[mode]()
        seconds = time.perf_counter() - start
    record = _row_record(model_type, mode, [seconds], model, dict(paths), peer)
    return record | {"held_mib": held, "added_mib": _high_water_mib() - held}


def run_memory(args: argparse.Namespace, out: Path) -> None:
    """``--memory``: each row's modes, each once in its own process (:func:`memory_worker`), against Hugging Face's
    SDPA forward (the ``--memory-peer`` row's where the row's model has none); rows written as they finish."""
    partial = out / "memory.partial.json"
    rows: dict[str, dict[str, dict]] = json.loads(partial.read_text()) if partial.is_file() else {}
    with tempfile.TemporaryDirectory() as models:
        for model_type in dict.fromkeys([args.memory_peer, *args.rows]):
            for mode in dict.fromkeys(["hf-sdpa", *args.modes]):
                if mode in rows.get(model_type, {}):
                    continue
                _folder(model_type, args.seq_len, Path(models))
                command = [sys.executable, __file__, "--worker", model_type, f"memory:{mode}", "--models", models]
                done = subprocess.run([*command, *sys.argv[1:]], capture_output=True, text=True)
                if done.returncode:
                    print(f"{model_type} {mode}: not run: {(done.stderr or '').strip().splitlines()[-1:]}")
                    continue
                rows.setdefault(model_type, {})[mode] = json.loads(done.stdout.strip().splitlines()[-1])
                partial.write_text(json.dumps(rows, indent=1))
    table = memory_markdown(rows, args)
    print(table)
    (out / "memory.md").write_text(table + "\n")
    (out / "memory.json").write_text(json.dumps(rows, indent=1))
    partial.unlink(missing_ok=True)
    memory_figure(rows, args, out / "memory")


def _memory_peer(rows: dict, model_type: str, args: argparse.Namespace) -> tuple[dict, str]:
    own = rows[model_type]["hf-sdpa"]
    if not own.get("no_sdpa"):
        return own, "its own"
    return rows[args.memory_peer]["hf-sdpa"], f"{args.memory_peer}-like (no SDPA of its own)"


def memory_markdown(rows: dict, args: argparse.Namespace) -> str:
    """The architectures guide's memory table: per row, Hugging Face's SDPA peer and each mode's added peak memory
    (MiB, and as a multiple of the peer's) and time."""
    modes = [mode for mode in MODES if mode != "hf-sdpa" and mode in next(iter(rows.values()), {})]
    head = ["architecture", "attention", "Hugging Face SDPA peer", "peer (MiB)"]
    head += [f"{mode} (MiB, x peer, s)" for mode in modes]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model_type, by_mode in rows.items():
        if not all(mode in by_mode for mode in modes):
            continue  # the peer row, run for Hugging Face's forward only
        peer, which = _memory_peer(rows, model_type, args)
        cells = [model_type, "; ".join(by_mode[modes[0]]["attention_paths"]), which, f"{peer['added_mib']:.0f}"]
        for mode in modes:
            row = by_mode[mode]
            cells.append(f"{row['added_mib']:.0f} ({row['added_mib'] / peer['added_mib']:.2f}x, {row['median_s']:.1f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _grouped_bars(fig: Any, title: str, width: int) -> None:
    """The benchmark figures' one layout: grouped bars, the legend (one entry per mode) below."""
    fig.update_layout(
        title=title,
        template="plotly_white",
        barmode="group",
        width=width,
        height=500,
        legend={"orientation": "h", "y": -0.15, "title": "mode"},
    )


def memory_figure(rows: dict, args: argparse.Namespace, stem: Path) -> None:
    """Per model: the peak memory each mode's call adds at ``--seq-len`` tokens, beside Hugging Face's SDPA peer."""
    import plotly.graph_objects as go

    from lens_parallel.plots import save_figure

    models = [m for m in rows if len(rows[m]) > 1]
    fig = go.Figure()
    peers = [_memory_peer(rows, m, args) for m in models]
    names = [_row(m)[0].split(":")[0] for m in models]
    fig.add_bar(
        x=names,
        y=[peer["added_mib"] for peer, _ in peers],
        name=f"Hugging Face SDPA (hatched: the {args.memory_peer}-like row's, where the model has none)",
        marker_color=COLORS["hf-sdpa"],
        marker_pattern_shape=["" if which == "its own" else "/" for _, which in peers],
    )
    for mode in [mode for mode in MODES if mode != "hf-sdpa" and mode in rows[models[0]]]:
        values = [rows[m][mode]["added_mib"] for m in models]
        labels = [f"{v / peer['added_mib']:.2f}x" for v, (peer, _) in zip(values, peers, strict=True)]
        fig.add_bar(x=names, y=values, name=mode, text=labels, textposition="outside", marker_color=COLORS[mode])
    fig.update_yaxes(title_text="peak memory the call adds (MiB; label: x Hugging Face's)", rangemode="tozero")
    _grouped_bars(fig, f"Memory at 1 x {args.seq_len} tokens (toys: 4 layers, width 256, 8 query heads of 32)", 950)
    save_figure(fig, stem)


def interleaved(model_type: str, modes: list[str], args: argparse.Namespace) -> dict:
    """Every mode in one process, round-robin ``--repeats`` times after a warm-up of each: medians less exposed to
    one process's luck (its placement, the machine's load) than a process per mode; the RSS is the process's."""
    from lens_parallel.attention import recorded_paths

    calls, model, peer = _calls(model_type, modes, args)
    for call in calls.values():
        call()
    times: dict[str, list[float]] = {mode: [] for mode in calls}
    counted: dict[str, dict] = {}
    for _ in range(args.repeats):
        for mode, call in calls.items():
            with recorded_paths() as paths:
                start = time.perf_counter()
                call()
                times[mode].append(time.perf_counter() - start)
            counted[mode] = dict(paths)
    return {mode: _row_record(model_type, mode, times[mode], model, counted[mode], peer) for mode in calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/out/architectures")
    parser.add_argument("--rows", nargs="+", default=list(MODELS), help="architectures (model types) to run")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="what to time (hf-sdpa first)")
    parser.add_argument(
        "--interleaved", action="store_true", help="all modes of a row in one process, round-robin (no RSS per mode)"
    )
    parser.add_argument("--memory", action="store_true", help="peak memory each call adds, one call per mode")
    parser.add_argument("--memory-peer", default="llama", help="the SDPA peer of rows whose model has none")
    parser.add_argument("--models", help=argparse.SUPPRESS)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        model_type, mode = args.worker
        if mode.startswith("memory:"):
            print(json.dumps(memory_worker(model_type, mode.removeprefix("memory:"), args)))
        elif mode == "interleaved":
            print(json.dumps(interleaved(model_type, list(dict.fromkeys(["hf-sdpa", "forward", *args.modes])), args)))
        else:
            print(json.dumps(worker(model_type, mode, args)))
        return
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.memory:
        run_memory(args, out)
        print(f"wall time {time.perf_counter() - start:.1f} s")
        return
    partial = out / "architectures.partial.json"  # each finished row, so a stopped run keeps them and resumes
    rows: dict[str, dict[str, dict]] = json.loads(partial.read_text()) if partial.is_file() else {}
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as models:
        for model_type in args.rows:
            modes = list(dict.fromkeys(["hf-sdpa", "forward", *args.modes]))
            if set(modes) <= set(rows.get(model_type, {})):
                continue
            try:
                _folder(model_type, args.seq_len, Path(models))
            except Exception as exc:  # transformers' own validators: a row this size cannot be built
                failed[model_type] = f"its config at the benchmark's size: {' '.join(str(exc).split())[:200]}"
                continue
            try:
                for mode in ["interleaved"] if args.interleaved else modes:
                    command = [sys.executable, __file__, "--worker", model_type, mode, "--models", models]
                    done = subprocess.run([*command, *sys.argv[1:]], capture_output=True, text=True, check=True)
                    found = json.loads(done.stdout.strip().splitlines()[-1])
                    rows.setdefault(model_type, {}).update(found if args.interleaved else {mode: found})
            except subprocess.CalledProcessError as exc:
                failed[model_type] = (exc.stderr or repr(exc)).strip().splitlines()[-1]
                rows.pop(model_type, None)
                continue
            partial.write_text(json.dumps(rows, indent=1))
    print(f"1 x {args.seq_len} tokens, {args.threads} threads, median of {args.repeats}; decompose of {SPACES}:")
    for model_type, by_mode in rows.items():
        base, peer = by_mode["forward"]["median_s"], by_mode["hf-sdpa"]["median_s"]
        print(f"{_row(model_type)[0]}  [{', '.join(by_mode['forward']['features'])}]")
        print(f"  attention: {'; '.join(by_mode['forward']['attention_paths'])}")
        for mode, row in by_mode.items():
            ran = ", ".join(f"{k} x{v}" for k, v in sorted(row["paths_per_forward"].items())) or "TransformerLens's"
            print(
                f"  {mode:16s} {row['median_s']:7.3f} s  {row['median_s'] / base:5.2f}x the forward  "
                f"{row['median_s'] / peer:5.2f}x Hugging Face's   "
                f"peak RSS {row['peak_rss_mib']:7.1f} MiB   paths per call: {ran}"
            )
    for model_type, reason in failed.items():
        print(f"{model_type}: not run: {reason}")
    table = markdown(rows, args)
    print(table)
    (out / "architectures.md").write_text(table + "\n")
    print(f"wall time {time.perf_counter() - start:.1f} s")
    (out / "architectures.json").write_text(json.dumps(rows, indent=1))
    partial.unlink(missing_ok=True)
    figure(rows, args, out / "architectures")


def markdown(rows: dict, args: argparse.Namespace) -> str:
    """The architectures guide's table: per row, the peer Hugging Face ran, the attention path, and each mode's time
    as a multiple of Hugging Face's decoder forward."""
    modes = [mode for mode in MODES if mode != "hf-sdpa" and mode in next(iter(rows.values()), {})]
    head = ["architecture", "features", "attention", "Hugging Face (s)", *(f"{mode} (x HF)" for mode in modes)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model_type, by_mode in rows.items():
        peer = by_mode["hf-sdpa"]
        ran = next(iter(peer["paths_per_forward"]), "").removeprefix("hugging face ")
        cells = [
            model_type,
            ", ".join(by_mode["forward"]["features"]),
            "; ".join(by_mode["forward"]["attention_paths"]),
            f"{peer['median_s']:.3f} ({ran})",
            *(f"{by_mode[mode]['median_s'] / peer['median_s']:.2f}" for mode in modes),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


COLORS = {
    "hf-sdpa": "#2ca02c",
    "forward": "#7f7f7f",
    "decompose-value": "#17becf",
    "decompose": "#1f77b4",
    "decompose-eager": "#ff7f0e",
}
"""One colour per mode, in both panels."""


def figure(rows: dict, args: argparse.Namespace, stem: Path) -> None:
    """Per model (a row each), each mode's time as a multiple of Hugging Face's forward of the same model (SDPA, or
    eager where it has none: said in the row's label), on a log axis with the 1.3x target marked; one colour per
    mode. (Peak RSS is the table's: per process, so one value per row under ``--interleaved``.)"""
    import plotly.graph_objects as go

    from lens_parallel.plots import save_figure

    models = list(rows)[::-1]  # the table's first row on top
    names = [
        f"{_row(m)[0].split(':')[0]} ({rows[m]['hf-sdpa']['median_s']:.2f} s, {_peer_kind(rows[m])})" for m in models
    ]
    fig = go.Figure()
    for mode in [mode for mode in MODES if mode != "hf-sdpa" and mode in next(iter(rows.values()))][::-1]:
        ratios = [rows[m][mode]["median_s"] / rows[m]["hf-sdpa"]["median_s"] for m in models]
        fig.add_bar(
            y=names,
            x=ratios,
            orientation="h",
            name=mode,
            marker_color=COLORS[mode],
            text=[f"{r:.2f}x" for r in ratios],
            textposition="outside",
        )
    marks = ((1.0, "Hugging Face", "solid", "#444", "right"), (1.3, "1.3x target", "dash", "#d62728", "left"))
    for x, text, dash, colour, side in marks:
        fig.add_vline(x=x, line_dash=dash, line_color=colour)  # (a log axis places a line's annotation unlogged)
        fig.add_annotation(
            x=math.log10(x), y=1, yref="paper", text=text, showarrow=False, yanchor="bottom", xanchor=side
        )
    fig.update_xaxes(
        type="log",
        range=[-1, math.log10(12)],
        title_text=f"time at 1 x {args.seq_len} tokens, x Hugging Face's forward (median of {args.repeats})",
    )
    fig.update_yaxes(title_text="architecture (Hugging Face's forward: seconds, attention)")
    fig.update_layout(
        title="lens_parallel against Hugging Face, per architecture (toys: 4 layers, width 256, window 512)",
        template="plotly_white",
        barmode="group",
        width=1150,
        height=220 + 70 * len(models),
        legend={"orientation": "h", "y": 1.04, "yanchor": "bottom", "x": 0, "title": "mode", "traceorder": "reversed"},
        margin={"t": 140},
    )
    save_figure(fig, stem)


def _peer_kind(row: dict) -> str:
    """Which Hugging Face forward a row's times are multiples of: ``sdpa`` or ``eager`` (where it has no SDPA)."""
    return "eager" if "eager" in str(row["hf-sdpa"].get("paths_per_forward", "")) else "sdpa"


if __name__ == "__main__":
    main()
