"""Generation under edits: decoding speed against Hugging Face's ``generate``, and GSM8K under the paper's edits.

    python benchmarks/generation.py [--speed-model smollm2-135m] [--prompts 8] [--new-tokens 64] [--repeats 3]
                                    [--gsm8k-model qwen2.5-coder-1.5b] [--limit 8] [--max-gen-toks 256]
                                    [--threads 2] [--out benchmarks/out/generation] [--skip-speed] [--skip-gsm8k]

Speed: the same prompts (the bundled Wikipedia texts' openings, one batch, left-padded), greedy, a fixed number of
new tokens (no stop: every call decodes the same count), timed in one process with the cases interleaved
(``--repeats`` rounds, median): Hugging Face ``generate`` on an independent copy of the weights (its own attention
and cache), ``lens_parallel.generate`` unedited, and under ``ComponentScale("value", s_par=0)``; tokens/s counts
generated tokens of every prompt. Goals (the issue's): unedited within 1.5x of Hugging Face, edited within 2x.

GSM8K: ``task_effects`` on the offline ``gsm8k_cot`` (lm-eval's 8 fixed exemplars, test items) with ``--limit``
items, unedited / value-parallel removal / attention-output (residual-attn) parallel removal / hard diagonal
removal, greedy, ``--max-gen-toks`` tokens at most (lm-eval's default 256), exact match per item paired by McNemar;
what each setting wrote on every item (``TaskResult.samples``) in ``--out`` as JSON lines and a page, the first
item's answers printed.
The paper's Qwen3-1.7B 5-shot numbers (68.0 unedited, 0.2 under attention-output parallel removal) are printed as
context only: another model, shots and items. Resumable (the request store in ``--out``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from downstream import in_points  # benchmarks/downstream.py: the same table in percentage points
from transformers import AutoModelForCausalLM

from lens_parallel import ComponentScale, ZeroDiagonal, generate, load_model, load_texts, task_effects
from lens_parallel.plots.common import save_figure
from lens_parallel.tokenizers import hf_tokenizer
from lens_parallel.weights import real_model_folder

PAPER_QWEN3_17B_GSM8K = {"unedited": 68.0, "attention-output parallel removal": 0.2}


def _prompts(n: int) -> list[str]:
    return [" ".join(text.split()[:24]) for text in load_texts("wikipedia-en")[:n]]


def speed(spec: str, n_prompts: int, new_tokens: int, repeats: int) -> None:
    model = load_model(spec)
    hf = AutoModelForCausalLM.from_pretrained(real_model_folder(spec), dtype=torch.float32).eval()
    tokenizer = hf_tokenizer(model)
    tokenizer.padding_side = "left"
    prompts = _prompts(n_prompts)
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)

    def hugging_face() -> int:
        with torch.inference_mode():
            out = hf.generate(**encoded, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        return int(out[:, encoded["input_ids"].shape[1] :].numel())

    def ours(edits: object) -> int:
        result = generate(model, prompts, edits, max_new_tokens=new_tokens, batch_size=n_prompts, progress=False)
        return sum(len(t) for t in result.tokens[-1])

    cases = {
        "Hugging Face generate": hugging_face,
        "lens_parallel unedited": lambda: ours(None),
        "lens_parallel value s_par=0": lambda: ours(ComponentScale("value", s_par=0.0)),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    tokens: dict[str, int] = {}
    for _ in range(repeats):
        for name, fn in cases.items():
            start = time.perf_counter()
            tokens[name] = fn()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["Hugging Face generate"])
    print(f"\n== decoding speed: {spec}, {n_prompts} prompts x {new_tokens} new tokens, median of {repeats} ==")
    print(f"  {'case':32s} {'s':>8s} {'tokens/s':>9s} {'x HF':>6s}")
    for name, t in times.items():
        m = statistics.median(t)
        print(f"  {name:32s} {m:8.2f} {tokens[name] / m:9.1f} {m / base:6.2f}")
    alone = statistics.median(times["lens_parallel value s_par=0"]) - statistics.median(times["lens_parallel unedited"])
    name = "  value s_par=0 setting alone"
    print(f"{name:34s} {alone:8.2f} {tokens['lens_parallel value s_par=0'] / alone:9.1f} {alone / base:6.2f}")
    print("  (generate always decodes the unedited setting first: the edited call decodes both; 'alone' is the")
    print("   difference of the two medians, the edited setting's own decoding)")


def gsm8k(spec: str, limit: int, max_gen_toks: int, out: Path) -> None:
    model = load_model(spec)
    settings = {
        "value-parallel removal": ComponentScale("value", s_par=0.0),
        "attention-output parallel removal": ComponentScale("residual-attn", s_par=0.0),
        "zero diagonal": ZeroDiagonal(),
    }
    start = time.perf_counter()
    result = task_effects(
        model,
        settings,
        ["gsm8k_cot"],
        limit=limit,
        max_gen_toks=max_gen_toks,
        batch_size=4,
        store=out / f"{spec}-gsm8k-requests.sqlite",
        progress=False,
    )
    wall = time.perf_counter() - start
    result.save(out / f"{spec}-gsm8k")
    save_figure(result.figure(), out / f"{spec}-gsm8k")
    samples = result.samples()
    samples.to_json(out / f"{spec}-gsm8k-samples.jsonl", orient="records", lines=True, force_ascii=False)
    (out / f"{spec}-gsm8k-samples.html").write_text(result.samples_html(), encoding="utf-8")
    table = in_points(result.differences())
    cols = ["metric", "setting", "n_items", "unedited %", "edited %", "diff pp", "95% CI pp", "p_mcnemar"]
    print(f"\n== GSM8K (gsm8k_cot, 8-shot, {limit} test items, <= {max_gen_toks} tokens): {spec}, {wall:.0f} s ==")
    print(table[cols].to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    print("paper, Qwen3-1.7B, GSM8K 5-shot (context only):", PAPER_QWEN3_17B_GSM8K)
    first = samples[samples["doc_id"] == samples["doc_id"].min()]
    print(f"\nwhat each setting wrote for item {first['doc_id'].iloc[0]} (target {first['target'].iloc[0]!r}):")
    for _, row in first.iterrows():
        print(f"  {row['setting']:34s} {row['response'][:100]!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speed-model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gsm8k-model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-gen-toks", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/generation"))
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-gsm8k", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.skip_speed:
        speed(args.speed_model, args.prompts, args.new_tokens, args.repeats)
    if not args.skip_gsm8k:
        gsm8k(args.gsm8k_model, args.limit, args.max_gen_toks, args.out)


if __name__ == "__main__":
    main()
