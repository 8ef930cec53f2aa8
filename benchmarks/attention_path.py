"""The attention path: every analysis against a Hugging Face SDPA forward, before (TransformerLens's eager attention)
and after (lens_parallel's own path), time and peak memory.

    python benchmarks/attention_path.py [--config smollm2-135m:4x512 --config smollm2-135m:1x4096 ...]
                                        [--cases hf-sdpa,hf-sdpa-loss,hf-sdpa-pair,decompose-value,
                                                 decompose-3,evaluate,causal-null]
                                        [--paths before,after] [--repeats 3] [--threads 2]
                                        [--out benchmarks/out/attention_path]

Each measurement runs in a fresh process (so that its peak memory is its own): the model is loaded, one short warm-up
forward runs, freed heap memory is returned to the system (``malloc_trim``) and the peak is reset
(``/proc/self/clear_refs``; on CUDA ``reset_peak_memory_stats``), the case runs once and reports its wall time and
the peak resident memory (CUDA: ``max_memory_allocated``) it added over the loaded model. Time and memory come from
separate processes (``--modes``): a *memory* process runs glibc's allocator with a fixed mmap threshold
(``MALLOC_MMAP_THRESHOLD_``), so that every tensor buffer over 128 KiB is its own mapping, returned to the system
when freed, and the resident peak is the peak of live buffers (with glibc's default threshold, which grows as
buffers are freed, freed buffers stay resident in the heap: one case read 2.7 GB in one process and 1.7 GB in the
next); mapping every buffer afresh costs time (about 25% at 4,096 tokens), so a *time* process keeps glibc's
default. Cases (``before``: ``attention_path("eager")``, TransformerLens's square pattern in every layer; ``after``:
``auto``):

- ``hf-sdpa``: Hugging Face's own model (an independent load, ``attn_implementation="sdpa"``) to its last hidden
  state, no logits: the cheapest forward a user could run, the denominator of every ratio;
- ``hf-sdpa-loss``: the same forward with ``labels=``, so through the unembedding and the loss: the cheapest
  forward that measures a loss (``evaluate`` needs two);
- ``hf-sdpa-pair``: the floor of any comparison of two next-token distributions, ``evaluate``'s included: two such
  forwards to the last hidden state, each unembedded over the whole vocabulary (``lm_head``, 1,024 positions at a
  time, nothing reduced);
- ``decompose-value``: ``decompose(space="value")``; ``decompose-3``: value, value-exclude-self, residual-attn;
- ``evaluate``: ``evaluate(ComponentScale("value", s_par=0))`` (the edited and the no-op forward);
- ``causal-null``: ``causal_null(null="exact")``.

``--paths after`` skips the eager runs (at 32k tokens one layer's eager pattern alone outgrows this machine).

Text: Moby-Dick, ``batch`` chapters' first ``length`` tokens; past 4,096 tokens (longer than any chapter) the
whole book as one document. Rounds of every case are interleaved (``--repeats``): the median time of the time
processes, the memory of the first round's memory process (``--modes memory`` alone: the time is the memory
process's, marked ``*``, HF's forward measured the same way). Every finished measurement is appended to
``results.jsonl`` in ``--out`` and skipped on a rerun (resumable; a failed one is run again); the table is
printed and written as ``table.md``. On a CUDA device add ``--device cuda`` (the GPU section: time and
``max_memory_allocated`` at 4k and 32k).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from memory import _status_kb  # benchmarks/memory.py: the same /proc reader

CASES = ("hf-sdpa", "hf-sdpa-loss", "hf-sdpa-pair", "decompose-value", "decompose-3", "evaluate", "causal-null")
LONGEST_CHAPTER = 4096
"""Tokens up to which the text is ``batch`` chapters (every tokenizer here finds enough chapters this long)."""
DEFAULT_CONFIGS = ("smollm2-135m:4x512", "smollm2-135m:1x4096")


def measure(spec: str, batch: int, length: int, case: str, path: str, device: str) -> dict[str, float]:
    """One case in this process: seconds and bytes added at peak over the loaded model."""
    import torch

    from lens_parallel import ComponentScale, causal_null, decompose, evaluate, load_model
    from lens_parallel.attention import attention_path
    from lens_parallel.data import texts_of, token_blocks

    model = load_model(spec, device=device)
    chapters = texts_of("moby-dick")[1]
    texts = chapters if length <= LONGEST_CHAPTER else ["\n\n".join(chapters)]
    tokens = token_blocks(model, texts, n_docs=batch, seq_len=length).tokens.to(device)
    if case.startswith("hf-"):
        from transformers import AutoModelForCausalLM

        from lens_parallel.weights import real_model_folder

        del model
        hf = AutoModelForCausalLM.from_pretrained(real_model_folder(spec), dtype=torch.float32)
        hf = hf.to(device).eval()
        hf.set_attn_implementation("sdpa")

        def run(t: torch.Tensor) -> None:
            with torch.inference_mode():
                if case == "hf-sdpa":
                    hf.model(input_ids=t)
                elif case == "hf-sdpa-loss":
                    hf(input_ids=t, labels=t)
                else:
                    for _ in range(2):
                        hidden = hf.model(input_ids=t).last_hidden_state
                        for rows in hidden.flatten(0, 1).split(1024):
                            hf.lm_head(rows)
    else:
        runs = {
            "decompose-value": lambda t: decompose(model, t, space="value", batch_size=batch, progress=False),
            "decompose-3": lambda t: decompose(
                model, t, space=["value", "value-exclude-self", "residual-attn"], batch_size=batch, progress=False
            ),
            "evaluate": lambda t: evaluate(
                model, t, ComponentScale("value", s_par=0.0), batch_size=batch, n_resamples=100
            ),
            "causal-null": lambda t: causal_null(model, t, null="exact", batch_size=batch, progress=False),
        }

        def run(t: torch.Tensor) -> None:
            with attention_path("eager" if path == "before" else "auto"):
                runs[case](t)

    run(tokens[:1, :64])  # warm-up: kernels chosen, lazy imports done
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the system: the case's peak shows in the RSS
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        base = _status_kb("VmRSS") * 1024
    start = time.perf_counter()
    run(tokens)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else _status_kb("VmHWM") * 1024
    return {"seconds": seconds, "added_gb": (peak - base) / 1e9}


def _table(rows: list[dict]) -> str:
    """Per config, case and path: median seconds of the time processes (else the memory process's, marked *) and
    the memory process's GB added, each beside the HF SDPA forward's measured the same way."""
    lines = [
        "| model | shape | case | path | seconds (median) | x HF SDPA | GB added | x HF SDPA's |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["config"], row["case"], row["path"]), []).append(row)

    def seconds(found: list[dict]) -> tuple[float, str]:
        timed = [r["seconds"] for r in found if r.get("mode", "time") == "time"]
        if timed:
            return statistics.median(timed), ""
        return statistics.median(r["seconds"] for r in found), "*"

    def gb(found: list[dict]) -> float:
        first = [r for r in found if r.get("mode") == "memory"]
        return first[0]["added_gb"] if first else float("nan")

    for config in dict.fromkeys(r["config"] for r in rows):
        spec, shape = config.split(":")
        base = groups.get((config, "hf-sdpa", "hf"), [])
        base_s, base_gb = (seconds(base)[0], gb(base)) if base else (float("nan"), float("nan"))
        for (cfg, case, path), found in groups.items():
            if cfg != config:
                continue
            (sec, mark), mem = seconds(found), gb(found)
            lines.append(
                f"| {spec} | {shape} | {case} | {path} | {sec:.2f}{mark} | {sec / base_s:.2f} | {mem:.2f} | "
                f"{mem / base_gb if base_gb > 0 else float('nan'):.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", help="MODEL:BATCHxLENGTH (repeatable)")
    parser.add_argument("--cases", default="hf-sdpa,decompose-value,decompose-3,evaluate")
    parser.add_argument("--paths", default="before,after", help="which of before,after to run")
    parser.add_argument("--modes", default="time,memory", help="which of time,memory to measure")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/attention_path"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one measurement, as JSON
    args = parser.parse_args()
    if args.one:
        job = json.loads(args.one)
        print(json.dumps(measure(**job)))
        return
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    paths = [p for p in args.paths.split(",") if p]
    if not paths or set(paths) - {"before", "after"}:
        parser.error(f"--paths takes before, after or both, got {args.paths!r}")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"time", "memory"}:
        parser.error(f"--modes takes time, memory or both, got {args.modes!r}")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    envs = {"time": env, "memory": {**env, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}}
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    done = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    seen = {(r["config"], r["case"], r["path"], r.get("mode", "time"), r["round"]) for r in done if not r.get("failed")}
    for round_ in range(args.repeats):
        for config in args.config or DEFAULT_CONFIGS:
            spec, shape = config.split(":")
            batch, length = (int(x) for x in shape.split("x"))
            for case in cases:
                for path in ("hf",) if case.startswith("hf-") else paths:
                    for mode in modes if round_ == 0 else [m for m in modes if m == "time"]:
                        if (config, case, path, mode, round_) in seen:
                            continue
                        job = {"spec": spec, "batch": batch, "length": length, "case": case, "path": path}
                        job["device"] = args.device
                        command = [sys.executable, __file__, "--one", json.dumps(job)]
                        out = subprocess.run(command, env=envs[mode], capture_output=True, text=True)
                        row = {"config": config, "case": case, "path": path, "mode": mode, "round": round_}
                        if out.returncode != 0:
                            print(f"{config} {case} {path} {mode}: failed (rc {out.returncode}): {out.stderr[-400:]}")
                            row.update(failed=True, error=out.stderr[-400:])
                        else:
                            row.update(json.loads(out.stdout.strip().splitlines()[-1]))
                            print(json.dumps(row), flush=True)
                        with results.open("a") as f:
                            f.write(json.dumps(row) + "\n")
                        done.append(row)
    table = _table([r for r in done if not r.get("failed")])
    (args.out / "table.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
