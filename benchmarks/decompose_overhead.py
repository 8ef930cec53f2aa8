"""Time and peak memory of the streaming decomposition against a bare forward and a full cache.

    python benchmarks/decompose_overhead.py [--model smollm2-135m] [--n-docs 16] [--seq-len 128] [--repeats 3]

Modes, each in its own fresh process (so one mode's allocations cannot hide another's peak):
  bare          model(tokens): a plain forward to logits
  stream-value  lens_parallel.decompose(space="value"): all layers and heads, reduced inside the hooks
  stream-all    lens_parallel.decompose(space="all"): all five spaces from the same forward
  cache-value   run_with_cache (every hook), then the same value-space statistics from the cache

Time: median of ``--repeats`` runs after one warm-up. Memory: peak resident set size (RSS) sampled every 2 ms
during the timed runs, and its increase over the RSS once the model and tokens are loaded, before the warm-up
(the activations' share; the model's weights are in that baseline). Ratios are against ``bare``, all measured
in one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

MODES = ("bare", "stream-value", "stream-all", "cache-value")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Sample the current RSS in a thread; ``peak`` is the largest seen."""

    def __init__(self, every_s: float = 0.002) -> None:
        self.every_s, self.peak, self._stop = every_s, _rss_bytes(), threading.Event()

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(self.every_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def _cache_value_stats(model, tokens):
    """The value-space statistics the naive way: full cache, then geometry on every layer."""
    import torch

    from lens_parallel import geometry
    from lens_parallel.hooks import expand_kv
    from lens_parallel.models import model_info

    info = model_info(model)
    with torch.inference_mode():
        _, cache = model.run_with_cache(tokens)
        out = []
        for layer in range(info.n_layers):
            z = cache[f"blocks.{layer}.attn.hook_z"].double()
            v = expand_kv(cache[f"blocks.{layer}.attn.hook_v"].double(), info.n_heads)
            a = geometry.alignment(z[:, 1:], v[:, 1:])
            out.append(a.cos.mean((0, 1)))
    return torch.stack(out)


def worker(mode: str, args: argparse.Namespace) -> dict:
    import torch

    from lens_parallel.analyses.decompose import decompose
    from lens_parallel.data import token_blocks
    from lens_parallel.models import load_model

    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    tokens = token_blocks(model, "wikipedia-en", n_docs=args.n_docs, seq_len=args.seq_len).tokens
    run = {
        "bare": lambda: model(tokens),
        "stream-value": lambda: decompose(model, tokens, space="value", batch_size=args.n_docs, progress=False),
        "stream-all": lambda: decompose(model, tokens, space="all", batch_size=args.n_docs, progress=False),
        "cache-value": lambda: _cache_value_stats(model, tokens),
    }[mode]
    baseline = _rss_bytes()  # model and tokens loaded, nothing run yet
    with torch.inference_mode():
        run()  # warm-up
    times = []
    with PeakRSS() as peak, torch.inference_mode():
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = run()
            times.append(time.perf_counter() - t0)
            del out
    return {"mode": mode, "time_s": statistics.median(times), "peak_rss": peak.peak, "baseline_rss": baseline}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--n-docs", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args)))
        return
    rows = {}
    for mode in MODES:
        cmd = [sys.executable, __file__, "--worker", mode, *sys.argv[1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"  {mode:13s} done", file=sys.stderr, flush=True)
    bare = rows["bare"]
    mib = 2**20
    print(f"{args.model}, {args.n_docs} x {args.seq_len} tokens, {args.threads} threads, median of {args.repeats}")
    print(
        f"{'mode':13s} {'time s':>8s} {'x bare':>7s} {'peak RSS MiB':>13s} {'x bare':>7s} "
        f"{'+act MiB':>9s} {'x bare':>7s}"
    )
    for mode, r in rows.items():
        act, bare_act = r["peak_rss"] - r["baseline_rss"], bare["peak_rss"] - bare["baseline_rss"]
        print(
            f"{mode:13s} {r['time_s']:8.3f} {r['time_s'] / bare['time_s']:7.2f} {r['peak_rss'] / mib:13.0f} "
            f"{r['peak_rss'] / bare['peak_rss']:7.2f} {act / mib:9.0f} {act / max(bare_act, 1):7.2f}"
        )
    b, c = rows["stream-value"], rows["cache-value"]
    print(
        f"b/a (stream-value / bare): time {b['time_s'] / bare['time_s']:.2f} (goal <= 1.5), "
        f"peak RSS {b['peak_rss'] / bare['peak_rss']:.2f} (goal <= 1.2)"
    )
    print(
        f"c/a (cache-value / bare):  time {c['time_s'] / bare['time_s']:.2f}, "
        f"peak RSS {c['peak_rss'] / bare['peak_rss']:.2f}"
    )


if __name__ == "__main__":
    main()
