"""Single-head parallel-removal sensitivity of every head: the ablation engine vs the naive loop, in one run.

    python benchmarks/ablation_sweep.py [--model smollm2-135m] [--n-docs 8] [--seq-len 128]
                                        [--save losses.npz] [--reference losses.npz]

Every head of every layer edited alone (``HeadEdit("parallel-value")``), per-document next-token NLL.
Naive loop: one full forward with hooks per head (``document_losses`` under the edit). Engine:
``run_ablations`` (unedited prefix computed once per batch, forwards resume at the edited layer). Prints both wall
times, their ratio and the largest absolute difference of the per-document losses. ``--save`` writes the engine's
per-document losses; ``--reference`` compares them with a file an earlier version wrote (same numbers?).
Head dominance has its own benchmark (``dominance.py``).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from lens_parallel import AblationJob, HeadEdit, document_losses, load_model, model_info, run_ablations, token_blocks


def sweep(model, args) -> None:
    info = model_info(model)
    blocks = token_blocks(model, "wikipedia-en", n_docs=args.n_docs, seq_len=args.seq_len)
    jobs = [AblationJob(layer, (h,)) for layer in range(info.n_layers) for h in range(info.n_heads)]
    document_losses(model, blocks, batch_size=args.n_docs)  # warm-up
    t0 = time.perf_counter()
    run = run_ablations(model, blocks, jobs, ablation="parallel-value", batch_size=args.n_docs, progress=True)
    engine = time.perf_counter() - t0
    t0 = time.perf_counter()
    naive = {
        job: document_losses(model, blocks, HeadEdit("parallel-value", job.layer, job.heads), batch_size=args.n_docs)
        for job in jobs
    }
    loop = time.perf_counter() - t0
    diff = max(np.abs(run[j].loss_sum - naive[j].loss_sum).max() for j in jobs)
    deltas = np.array([run[j].loss - run.base.loss for j in jobs])
    print(f"{info.name}: {len(jobs)} single-head parallel-value ablations, {args.n_docs} x {args.seq_len} tokens")
    print(f"engine {engine:.1f} s, naive loop {loop:.1f} s, naive / engine = {loop / engine:.2f}x")
    print(f"max |engine - naive| per-document NLL sum: {diff:.3g} nats")
    if args.save:
        np.savez(args.save, base=run.base_loss_sum, edited=run.loss_sum)
    if args.reference:
        ref = np.load(args.reference)
        same = max(np.abs(ref["base"] - run.base_loss_sum).max(), np.abs(ref["edited"] - run.loss_sum).max())
        print(f"max |this run - {args.reference}| per-document NLL sum: {same:.3g} nats")
    print(
        f"delta loss over heads: mean {deltas.mean():.4f}, max {deltas.max():.4f} "
        f"({jobs[int(deltas.argmax())].key}), min {deltas.min():.4f} nats/token"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--n-docs", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--save", default=None, help="write the engine's per-document losses to this .npz")
    parser.add_argument("--reference", default=None, help="compare with losses an earlier run saved (.npz)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    sweep(model, args)


if __name__ == "__main__":
    main()
