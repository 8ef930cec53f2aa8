"""Single-head sensitivity of every head: one process vs N Ray workers, in one run.

    python benchmarks/distributed_sweep.py [--model smollm2-135m] [--n-docs 4] [--seq-len 128] [--workers 2]
                                           [--device cpu] [--ray-address ADDR] [--out benchmarks/out/distributed_sweep]

On this machine (CPU): the single process uses every core (torch threads = cores); the Ray run starts a local Ray
(or joins ``--ray-address``) and N actors, each with an equal share of the cores, each loading the model once by
its spec. On GPUs: ``--device cuda --workers N`` puts the single process on one GPU and gives each actor one GPU
(a cluster's GPUs, with ``--ray-address``). Both runs sweep the same jobs (every head of every layer alone, and
each layer's heads jointly) with the same batch composition, so their results must be identical: the script checks
that and prints the largest difference. Times: the whole call (the Ray run's includes starting its actors and
loading the model in each; the time to start or join Ray itself is printed apart). Each phase writes its table
and time when done and is skipped on a rerun (its stored numbers are printed again); a phase killed midway resumes
from its sweep store, and its time is then marked as resumed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import pandas as pd
import torch

from lens_parallel import head_sensitivity, load_model, model_info, token_blocks
from lens_parallel.distributed import connect


def run_phase(out: Path, name: str, fn) -> dict:
    """Run ``fn(store)`` once: its table and time are written when it finishes, and read back on a rerun."""
    done = out / f"{name}.json"
    if done.is_file():
        print(f"[{name}] finished earlier: read back from {done}")
        return json.loads(done.read_text())
    store = out / f"{name}_store.jsonl"
    resumed = store.is_file()
    t0 = time.perf_counter()
    result = fn(store)
    seconds = time.perf_counter() - t0
    result.to_dataframe().to_csv(out / f"{name}.csv", index=False)
    record = {"seconds": seconds, "resumed": resumed}
    done.write_text(json.dumps(record))
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--n-docs", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ray-address", default=None)
    parser.add_argument("--out", default="benchmarks/out/distributed_sweep")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    model = load_model(args.model, device=args.device)
    info = model_info(model)
    blocks = token_blocks(model, "wikipedia-en", n_docs=args.n_docs, seq_len=args.seq_len, seed=0)
    kw = {"batch_size": args.n_docs, "n_resamples": 200, "n_permutations": 200, "progress": True}
    n_jobs = info.n_layers * (info.n_heads + 1)
    print(
        f"{args.model}: {info.n_layers} layers x {info.n_heads} heads = {n_jobs} ablations (every head and each "
        f"layer's heads jointly), {args.n_docs} x {args.seq_len} tokens, device {args.device}, {cores} cores"
    )

    single = run_phase(out, "one_process", lambda store: head_sensitivity(model, blocks, store=store, **kw))
    t0 = time.perf_counter()
    ray = connect(args.ray_address)
    t_ray = time.perf_counter() - t0
    resources = ray.cluster_resources()
    spread = run_phase(
        out,
        f"ray_{args.workers}_workers",
        lambda store: head_sensitivity(
            model, blocks, store=store, workers=args.workers, ray_address=args.ray_address, **kw
        ),
    )
    a = pd.read_csv(out / "one_process.csv")
    b = pd.read_csv(out / f"ray_{args.workers}_workers.csv")
    numeric = a.select_dtypes("number").columns
    largest = float((a[numeric] - b[numeric]).abs().max().max())
    identical = a.equals(b)

    per_worker = max(1, int(resources.get("CPU", 1) // args.workers)) if args.device == "cpu" else 1
    table = pd.DataFrame(
        {
            "seconds": [single["seconds"], spread["seconds"]],
            "threads_each": [cores if args.device == "cpu" else "-", per_worker if args.device == "cpu" else "-"],
            "resumed": [single["resumed"], spread["resumed"]],
        },
        index=["1 process", f"{args.workers} Ray workers"],
    )
    print()
    print(table.round(1).to_string())
    print(f"speed-up (1 process / {args.workers} workers): {single['seconds'] / spread['seconds']:.2f}x")
    print(f"starting or joining Ray: {t_ray:.1f} s (not in the workers' time); cluster: {dict(resources)}")
    print(f"results identical: {identical} (largest difference over every column: {largest:.1e})")
    print(f"machine: {platform.machine()}, {cores} cores, torch {torch.__version__}, ray {ray.__version__}")
    summary = {
        "model": args.model,
        "n_docs": args.n_docs,
        "seq_len": args.seq_len,
        "device": args.device,
        "workers": args.workers,
        "one_process_s": single["seconds"],
        "workers_s": spread["seconds"],
        "speedup": single["seconds"] / spread["seconds"],
        "ray_start_s": t_ray,
        "identical": identical,
        "largest_difference": largest,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("wrote:", out / "summary.json")


if __name__ == "__main__":
    main()
