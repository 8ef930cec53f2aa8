"""Peak memory and wall time of the loss paths, each call in its own process.

    python benchmarks/memory.py [--models gemma-3-270m:8x512 qwen2.5-coder-1.5b:4x512] [--threads 2]
                                [--calls forward-logits forward-final evaluate sweep-job attribution]
                                [--out benchmarks/out/memory]

Per model (``SPEC:NxT``: N documents of T tokens) and call, a fresh process loads the model, makes the
documents, runs an 8-token forward (the memory-mapped weights paged in), records its resident set (RSS), resets
the kernel's high-water mark (``/proc/self/clear_refs``), runs the call once and reports the peak RSS (on CUDA
also ``torch.cuda.max_memory_allocated``) and the wall time:

- ``forward-logits``: ``model(tokens)``, the logits returned (what every loss path held before);
- ``forward-final``: a forward to the final normalised residual (a hook on ``unembed.hook_in`` ends it; no
  logits): the floor any loss path can reach;
- ``evaluate``: ``evaluate(model, docs, ComponentScale("value", s_par=0))`` (matched no-op and edited run);
- ``sweep-job``: ``run_sweep`` of one single-head ablation job (reference pass + the job);
- ``attribution``: ``head_attribution`` (one forward and one backward over all documents).

Every call sees all documents in one batch. Prints, per model, the memory each call adds over the loaded model and
its ratio to what ``forward-final`` adds. The script uses only APIs that exist before and after the chunked
losses, so ``python benchmarks/before_after.py REV benchmarks/memory.py`` compares two revisions in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

CALLS = ("forward-logits", "forward-final", "evaluate", "sweep-job", "attribution")


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(call: str, spec: str, n_docs: int, seq_len: int, threads: int) -> dict:
    import torch

    from lens_parallel import ComponentScale, evaluate, head_attribution, load_model, token_blocks
    from lens_parallel.sweep import AblationJob, run_sweep

    torch.set_num_threads(threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(spec, device=device)
    blocks = token_blocks(model, "wikipedia-en", n_docs=n_docs, seq_len=seq_len, seed=0)
    tokens = blocks.tokens.to(device)
    with torch.inference_mode():  # page every weight in (safetensors are memory-mapped): the baseline holds them
        model(tokens[:1, :8])

    class Stop(Exception):
        pass

    def stop(tensor, hook):
        raise Stop

    def forward_final():
        with torch.inference_mode(), model.hooks(fwd_hooks=[("unembed.hook_in", stop)]), contextlib.suppress(Stop):
            model(tokens)

    def forward_logits():
        with torch.inference_mode():
            return model(tokens)

    kw = {"batch_size": n_docs, "progress": False}
    run = {
        "forward-logits": forward_logits,
        "forward-final": forward_final,
        "evaluate": lambda: evaluate(model, blocks, ComponentScale("value", s_par=0.0), batch_size=n_docs),
        "sweep-job": lambda: run_sweep(model, blocks, [AblationJob(0, (0,))], ablation="zero", **kw),
        "attribution": lambda: head_attribution(model, blocks, ablation="parallel-value", **kw),
    }[call]
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda_base = torch.cuda.memory_allocated()
    loaded_kb = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts at the current RSS
    t0 = time.perf_counter()
    out = run()
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    peak_kb = _status_kb("VmHWM")
    del out
    result = {"loaded_gb": loaded_kb / 2**20, "peak_gb": peak_kb / 2**20, "wall_s": wall, "device": device}
    if device == "cuda":
        result["cuda_added_gb"] = (torch.cuda.max_memory_allocated() - cuda_base) / 2**30
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gemma-3-270m:8x512", "qwen2.5-coder-1.5b:4x512"])
    parser.add_argument("--calls", nargs="+", default=list(CALLS), choices=CALLS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/out/memory")
    parser.add_argument("--child", nargs=4, metavar=("CALL", "SPEC", "N", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        call, spec, n, t = args.child
        print(json.dumps(child(call, spec, int(n), int(t), args.threads)))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for entry in args.models:
        spec, shape = entry.rsplit(":", 1)
        n, t = shape.split("x")
        for call in args.calls:
            cmd = [sys.executable, __file__, "--threads", str(args.threads), "--child", call, spec, n, t]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                why = f"killed by signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
                print(f"{spec} {call}: failed ({why})\n{done.stderr[-2000:]}", file=sys.stderr)
                rows.append({"model": spec, "docs": f"{n} x {t}", "call": call, "failed": why})
                continue
            got = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append({"model": spec, "docs": f"{n} x {t}", "call": call, **got})
            row = rows[-1]
            row["added_gb"] = row["peak_gb"] - row["loaded_gb"]
            print(f"{spec} {call}: +{row['added_gb']:.2f} GB over {row['loaded_gb']:.2f} GB, {row['wall_s']:.1f} s")
            (out / "memory.json").write_text(json.dumps(rows, indent=1))  # as it goes: a killed run keeps its rows
    import pandas as pd

    table = pd.DataFrame(rows)
    floor = table[table.call == "forward-final"].set_index("model")["added_gb"]
    table["x forward-final"] = table["added_gb"] / table["model"].map(floor)
    columns = ["model", "docs", "call", "loaded_gb", "peak_gb", "added_gb", "x forward-final", "wall_s"]
    columns += [c for c in ("cuda_added_gb", "failed") if c in table]
    table[columns].to_csv(out / "memory.csv", index=False)
    print(table[columns].to_string(index=False, float_format=lambda x: f"{x:.2f}"))


if __name__ == "__main__":
    main()
