"""lens_parallel on a GPU, against what a user would run instead, with no weights and no network.

    python benchmarks/gpu.py [--device cuda] [--shape llama-1b] [--configs 8x2048 1x16384 1x32768]
                             [--steps correctness speed engine generation features] [--repeats 3]
                             [--feature-configs 1x2048 1x16384] [--budget-s 480]
                             [--tokenizer DIR] [--tiny] [--out benchmarks/out/gpu]

A random-initialised model of a named shape (``--shape``: ``llama-1b`` = Llama-3.2-1B's, ``qwen2.5-1.5b``,
``gemma3-1b``; bfloat16 on CUDA, float32 on a CPU; random weights change no cost) is built once on the device,
saved with a tokenizer (``--tokenizer``, default the bundled Qwen3 one; the vocabulary is the shape's, at least the
tokenizer's) and loaded twice: by ``lens_parallel.load_model`` and by Hugging Face with SDPA attention. Steps:

- ``correctness``: toy-qwen3 in float32 on the device and on the CPU, same weights and tokens: decompose (three
  spaces), evaluate, causal_null(exact) and head_attribution, their largest relative difference;
- ``speed``: per ``--configs`` batch x length of random token ids, ``hf-sdpa`` (HF's forward to the last hidden
  state), ``hf-sdpa-pair`` (two, each unembedded over the whole vocabulary: the floor of any comparison of two
  next-token distributions), decompose in each head space and the three together, evaluate(ComponentScale("value",
  s_par=0)), causal_null(exact), head_attribution; time (``torch.cuda.synchronize`` around each call; the median of
  ``--repeats`` after a warm-up call) and ``max_memory_allocated`` added over the loaded models; ratios to hf-sdpa;
- ``engine``: head_sensitivity on 3 layers at 4 x 1,024 against the naive loop of as many HF forwards with
  ``labels=`` as it has jobs; scale_sweep of 5 value settings against 5 such forwards;
- ``features``: the feature rows of ``benchmarks/architectures.py`` (:data:`FEATURE_ROWS`: Gemma 2's soft cap,
  gpt-oss's sinks, Bloom's ALiBi, OLMo 2's and Qwen3-Next's route through the module, the Llama-like SDPA peer) at
  that benchmark's size in the device's dtype, per ``--feature-configs`` (1 x 2,048 and 1 x 16,384): Hugging Face's
  forward (SDPA, or eager where it has none), lens_parallel's forward and ``decompose(value)``, time and memory
  added, and lens_parallel's logits against Hugging Face's;
- ``generation``: 8 prompts, 128 new tokens, greedy: HF ``generate`` (KV cache, ``min_new_tokens``) against
  ``lens_parallel.generate`` unedited and with ComponentScale("value", s_par=0) (the edited setting alone: the
  difference of the two), a warm-up round then the median of ``--repeats`` (a GPU's first rounds are warm-up).

Each measurement is appended to ``OUT/gpu.jsonl`` as it ends; ``OUT/summary.md`` is written at the end. A global
``--budget-s`` skips what would start after it; an alarm stops a case that runs past it. ``--tiny --device cpu``
runs every step on a CPU in a few minutes (2-layer shapes, 2 x 64 tokens). The goals (issue "On the GPU"): any one
space <= 1.3x hf-sdpa, three spaces <= 2.5x, evaluate <= 1.2x hf-sdpa-pair, causal_null <= 1.5x, generation
unedited <= 1.3x HF, the edited setting alone <= 1.6x, memory added <= 1.5x HF's, head_sensitivity <= 0.5x the
naive loop, attribution on the device = the CPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "USE_HUB_KERNELS": "NO",  # transformers 5.25 asks for the `kernels` package (hub kernels) otherwise
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_key, _value)

import dispatch_counts  # noqa: E402  (benchmarks/: the cases it counts are the cases timed here)
import torch  # noqa: E402
import transformers  # noqa: E402

import lens_parallel as lp  # noqa: E402
from lens_parallel.tokenizers import bundled_tokenizer_folder  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "llama-1b": dict(
        kind="llama",
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=49152,
    ),
    "qwen2.5-1.5b": dict(
        kind="qwen2",
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
    ),
    "gemma3-1b": dict(
        kind="gemma3",
        hidden_size=1152,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        intermediate_size=6912,
        vocab_size=262144,
        sliding_window=512,
    ),
}
"""The named shapes (Hugging Face config fields), each a real model's."""
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "In 1905, Albert Einstein published four papers that changed physics. The first explained",
    "The recipe calls for two cups of flour, one cup of sugar and",
    "The most important thing to remember when learning a new language is",
    "def fibonacci(n):",
    "The stock market fell sharply on Monday after",
    "Photosynthesis is the process by which plants",
]


class Budget(Exception):
    """The global budget ran out inside a case."""


class Run:
    """The device, the budget, and one JSON line per finished measurement."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.device = args, torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.deadline = time.monotonic() + args.budget_s
        args.out.mkdir(parents=True, exist_ok=True)
        self.log = (args.out / "gpu.jsonl").open("a", buffering=1)
        self.rows: list[dict[str, Any]] = []

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def write(self, **row: Any) -> None:
        self.rows.append(row)
        self.log.write(json.dumps(row, default=str) + "\n")
        print("::", json.dumps(row, default=str)[:300], flush=True)

    def case(self, step: str, name: str, fn: Callable[[], dict[str, Any]], **meta: Any) -> None:
        """Run ``fn`` under the budget (an alarm at the deadline), writing its row, or the error or skip."""
        left = self.deadline - time.monotonic()
        if left < 2:
            self.write(step=step, case=name, status="skipped", reason="budget", **meta)
            return
        signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, left)
        try:
            self.write(step=step, case=name, status="ok", **meta, **fn())
        except Budget:
            self.write(step=step, case=name, status="timeout", **meta)
        except Exception as exc:  # a case that fails is recorded, the others still run
            self.write(step=step, case=name, status="error", error=f"{type(exc).__name__}: {exc}"[:500], **meta)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            self.free()

    def free(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def timed(self, fn: Callable[[], Any], warm: Callable[[], Any]) -> dict[str, Any]:
        """The median and minimum of ``--repeats`` calls after a warm-up, and the peak memory a call adds."""
        warm()
        self.sync()
        base = torch.cuda.memory_allocated() if self.cuda else 0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(self.args.repeats):
            start = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - start)
        added = (torch.cuda.max_memory_allocated() - base) / 1e9 if self.cuda else float("nan")
        return {"s": statistics.median(times), "min_s": min(times), "gb_added": added}


def _alarm(signum: int, frame: Any) -> None:
    raise Budget


def build(run: Run) -> tuple[Any, Any, Any]:
    """The random model of ``--shape``, loaded by lens_parallel and by Hugging Face (SDPA), and its tokenizer."""
    shape = dict(SHAPES[run.args.shape])
    kind = shape.pop("kind")
    tokenizer = transformers.AutoTokenizer.from_pretrained(run.args.tokenizer or bundled_tokenizer_folder("qwen3"))
    if run.args.tiny:
        shape |= TINY | {"head_dim": 16}
    shape["vocab_size"] = max(shape["vocab_size"], len(tokenizer))
    common = dict(max_position_embeddings=40000, tie_word_embeddings=True, bos_token_id=None, pad_token_id=None)
    eos = tokenizer.eos_token_id
    if kind == "llama":
        rope = {"rope_type": "default", "rope_theta": 500000.0}
        config = transformers.LlamaConfig(**shape, **common, eos_token_id=eos, rope_parameters=rope)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**shape, **common, eos_token_id=eos)
    else:
        config = transformers.Gemma3TextConfig(**shape, **common, eos_token_id=eos)
    dtype = torch.bfloat16 if run.cuda else torch.float32
    torch.manual_seed(0)
    with torch.device(run.device):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    with torch.no_grad():  # greedy never picks the end of the sequence: every call decodes the same count
        hf.get_input_embeddings().weight[eos] *= 0.1
    folder = Path(tempfile.mkdtemp(prefix="lp-gpu-")) / run.args.shape
    hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model = lp.load_model(str(folder), device=str(run.device), dtype=dtype)
    run.write(step="setup", case=run.args.shape, status="ok", params=sum(p.numel() for p in hf.parameters()))
    return model, hf, tokenizer


def step_correctness(run: Run) -> None:
    """toy-qwen3 on the device and on the CPU: the largest relative difference of each analysis's numbers."""
    cpu, dev = lp.load_model("toy-qwen3"), lp.load_model("toy-qwen3", device=str(run.device))
    docs = lp.token_blocks(cpu, "wikipedia-en", n_docs=4, seq_len=64)
    analyses = {
        "decompose": lambda m: lp.decompose(m, docs, space=["value", "value-exclude-self", "residual-attn"]),
        "evaluate": lambda m: lp.evaluate(m, docs, lp.ComponentScale("value", s_par=0.0), n_resamples=50),
        "causal_null": lambda m: lp.causal_null(m, docs, null="exact"),
        "head_attribution": lambda m: lp.head_attribution(m, docs, n_resamples=50, progress=False),
    }
    for name, fn in analyses.items():

        def compare(fn: Callable[[Any], Any] = fn) -> dict[str, Any]:
            a, b = fn(cpu).to_dataframe(), fn(dev).to_dataframe()
            numbers = a.select_dtypes("number").columns
            x, y = a[numbers].to_numpy(float), b[numbers].to_numpy(float)
            scale = max(float(abs(x[~(x != x)]).max()), 1e-30)
            return {"max_rel_diff": float(abs(x - y)[~(x != x)].max()) / scale}

        run.case("correctness", name, compare)


def step_speed(run: Run, model: Any, hf: Any) -> None:
    for config in run.args.configs:
        batch, length = (int(x) for x in config.split("x"))
        tokens = torch.randint(16, hf.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(1))
        tokens = tokens.to(run.device)
        warm = tokens[:1, :64]

        cases: dict[str, Callable[[Any], Any]] = dispatch_counts.cases(model, hf) | {
            "head_attribution": lambda t: lp.head_attribution(
                model, t, batch_size=len(t), n_resamples=100, progress=False
            ),
        }
        for name, fn in cases.items():
            run.case(
                "speed",
                name,
                lambda fn=fn, tokens=tokens, warm=warm: run.timed(lambda: fn(tokens), lambda: fn(warm)),
                config=config,
            )


def step_engine(run: Run, model: Any, hf: Any) -> None:
    batch, length = (2, 64) if run.args.tiny else (4, 1024)
    tokens = torch.randint(16, hf.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(2))
    tokens = tokens.to(run.device)
    layers = list(range(min(3, model.cfg.n_layers)))
    n_jobs = 1 + len(layers) * (model.cfg.n_heads + 1)  # the reference, each head alone and all jointly per layer

    def naive(n: int) -> Callable[[], None]:
        def loop() -> None:
            with torch.inference_mode():
                for _ in range(n):
                    hf(input_ids=tokens, labels=tokens, use_cache=False)

        return loop

    engine = {
        "head_sensitivity": (
            lambda: lp.head_sensitivity(model, tokens, layers=layers, n_resamples=100, progress=False),
            naive(n_jobs),
        ),
        "scale_sweep(5 settings)": (
            lambda: lp.scale_sweep(
                model, tokens, s_par=(0.0, 0.5, 1.5), s_perp=(0.5, 1.5), n_resamples=100, progress=False
            ),
            naive(5),
        ),
    }
    for name, (ours, loop) in engine.items():

        def both(ours: Callable[[], Any] = ours, loop: Callable[[], None] = loop) -> dict[str, Any]:
            mine, theirs = run.timed(ours, ours), run.timed(loop, loop)
            return {"s": mine["s"], "naive_hf_s": theirs["s"], "x_naive": mine["s"] / theirs["s"]}

        run.case("engine", name, both, config=f"{batch}x{length}", jobs=n_jobs)


def step_generation(run: Run, model: Any, hf: Any, tokenizer: Any) -> None:
    new = 8 if run.args.tiny else 128
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    encoded = tokenizer(PROMPTS, return_tensors="pt", padding=True).to(run.device)

    def hf_generate() -> None:
        with torch.inference_mode():
            hf.generate(**encoded, max_new_tokens=new, min_new_tokens=new, do_sample=False)

    def ours(edits: Any) -> Callable[[], None]:
        return lambda: lp.generate(model, PROMPTS, edits, max_new_tokens=new, batch_size=len(PROMPTS), progress=False)

    cases = {
        "hf generate": hf_generate,
        "generate unedited": ours(None),
        "generate + value s_par=0": ours({"value s_par=0": lp.ComponentScale("value", s_par=0.0)}),
    }
    for name, fn in cases.items():
        run.case("generation", name, lambda fn=fn: run.timed(fn, fn), prompts=len(PROMPTS), new_tokens=new)


FEATURE_ROWS = ("llama", "gemma2", "gpt_oss", "bloom", "olmo2", "qwen3_next")
"""The rows of ``benchmarks/architectures.py`` the ``features`` step runs on the device, at that benchmark's size:
each feature lens_parallel's attention computes itself (Gemma 2's soft cap, gpt-oss's sinks, Bloom's ALiBi), the
route through the module (OLMo 2's query/key norm before the head split, Qwen3-Next's output gate between
linear-attention layers), and the Llama-like row, the SDPA forward of the same shapes without a feature."""


def step_features(run: Run) -> None:
    """Each :data:`FEATURE_ROWS` model in the device's dtype, per ``--feature-configs``: Hugging Face's forward (SDPA,
    or eager where the architecture has none), lens_parallel's forward and ``decompose(value)`` (time and memory
    added), and, at the first configuration, how far lens_parallel's logits are from Hugging Face's (the largest
    difference over the largest logit)."""
    import architectures  # benchmarks/: the same toys the CPU table measures

    root = Path(tempfile.mkdtemp(prefix="lp-gpu-features-"))
    shapes = [tuple(int(x) for x in config.split("x")) for config in run.args.feature_configs]
    for model_type in FEATURE_ROWS:
        _feature_row(run, model_type, architectures._folder(model_type, max(n for _, n in shapes), root), shapes)
        run.free()


def _feature_row(run: Run, model_type: str, folder: Path, shapes: list[tuple[int, ...]]) -> None:
    from lens_parallel.hooks import forward

    dtype = torch.bfloat16 if run.cuda else torch.float32
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
        peer = "sdpa"
    except ValueError:  # no SDPA for its feature: eager is Hugging Face's only forward
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
        peer = "eager"
    hf = hf.to(run.device).eval()
    model = lp.load_model(str(folder), device=str(run.device), dtype=dtype)

    def run_hf(t: torch.Tensor) -> None:
        with torch.inference_mode():
            hf.base_model(t)

    def logits(t: torch.Tensor) -> dict[str, Any]:
        with torch.inference_mode():
            want, got = hf(t).logits.float(), model(t).float()
        return {"max_rel_diff": float((got - want).abs().max() / want.abs().max())}

    cases: dict[str, Callable[[torch.Tensor], Any]] = {
        f"hf-{peer}": run_hf,
        "forward": lambda t: forward(model, t),
        "decompose-value": lambda t: lp.decompose(model, t, space="value", batch_size=len(t), progress=False),
    }
    for index, (batch, length) in enumerate(shapes):
        tokens = torch.randint(0, 5000, (batch, length), generator=torch.Generator().manual_seed(3))
        tokens, warm = tokens.to(run.device), tokens[:1, :64].to(run.device)
        meta = dict(config=f"{batch}x{length}", model=model_type, peer=peer)
        if index == 0:
            run.case("features", "logits against Hugging Face's", lambda tokens=tokens: logits(tokens), **meta)
        for name, fn in cases.items():
            run.case(
                "features",
                name,
                lambda fn=fn, tokens=tokens, warm=warm: run.timed(lambda: fn(tokens), lambda: fn(warm)),
                **meta,
            )


def _feature_lines(run: Run) -> list[str]:
    """The features step as a table: each row's times and memory as multiples of Hugging Face's forward and of the
    Llama-like row's SDPA forward at the same configuration (the target where a feature has no SDPA)."""
    rows = [r for r in run.rows if r.get("step") == "features"]
    ok = [r for r in rows if r.get("status") == "ok" and "s" in r]
    others = [r for r in rows if r not in ok]  # the logits' differences, errors, skips
    if not rows:
        return []
    lines = [
        "## features",
        "",
        "| model | config | case | s | x HF's | x llama sdpa | GB added |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in ok:
        own = next(
            x for x in ok if x["model"] == r["model"] and x["config"] == r["config"] and x["case"] == f"hf-{x['peer']}"
        )
        llama = next(
            (x for x in ok if x["model"] == "llama" and x["config"] == r["config"] and x["case"] == "hf-sdpa"), None
        )
        versus = f"{r['s'] / llama['s']:.2f}" if llama else ""
        lines.append(
            f"| {r['model']} | {r['config']} | {r['case']} | {r['s']:.3f} | {r['s'] / own['s']:.2f} | {versus} "
            f"| {r['gb_added']:.2f} |"
        )
    lines += [f"- {r['model']} {r['config']}: {r['case']}: " + str(r.get("max_rel_diff", r["status"])) for r in others]
    return [*lines, ""]


def summary(run: Run) -> str:
    """A table per step, speed as ratios to hf-sdpa (and evaluate to the pair) at each configuration."""
    ok = [r for r in run.rows if r.get("status") == "ok"]
    lines = [f"# lens_parallel on {run.device} ({run.args.shape}{', tiny' if run.args.tiny else ''})", ""]
    for config in run.args.configs:
        got = {r["case"]: r for r in ok if r["step"] == "speed" and r.get("config") == config}
        if "hf-sdpa" not in got:
            continue
        base, pair = got["hf-sdpa"], got.get("hf-sdpa-pair")
        lines += [
            f"## {config}",
            "",
            "| case | s | x hf-sdpa | GB added | x HF's GB |",
            "| --- | --- | --- | --- | --- |",
        ]
        for name, r in got.items():
            ratio = r["s"] / base["s"]
            note = f" ({r['s'] / pair['s']:.2f}x the pair)" if name == "evaluate" and pair else ""
            gb = r["gb_added"] / base["gb_added"] if base["gb_added"] == base["gb_added"] and base["gb_added"] else 0
            lines.append(f"| {name} | {r['s']:.3f} | {ratio:.2f}{note} | {r['gb_added']:.2f} | {gb:.2f} |")
        lines.append("")
    lines += _feature_lines(run)
    for step in ("correctness", "engine", "generation"):
        rows = [r for r in run.rows if r["step"] == step]
        if rows:
            lines += [f"## {step}", ""] + [
                "- " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items())
                for r in rows
            ]
            lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="llama-1b", choices=list(SHAPES))
    parser.add_argument("--configs", nargs="+", default=["8x2048", "1x16384", "1x32768"])
    parser.add_argument("--steps", nargs="+", default=["correctness", "speed", "engine", "generation", "features"])
    parser.add_argument("--feature-configs", nargs="+", default=["1x2048", "1x16384"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--tiny", action="store_true", help="2-layer shapes and 2 x 64 tokens: every path on a CPU")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/gpu"))
    args = parser.parse_args()
    if args.tiny and args.configs == parser.get_default("configs"):
        args.configs = ["2x64"]
    if args.tiny and args.feature_configs == parser.get_default("feature_configs"):
        args.feature_configs = ["1x64", "1x128"]
    run = Run(args)
    try:
        if "correctness" in args.steps:
            step_correctness(run)
        model, hf, tokenizer = build(run)
        if "speed" in args.steps:
            step_speed(run, model, hf)
        if "engine" in args.steps:
            step_engine(run, model, hf)
        if "generation" in args.steps:
            step_generation(run, model, hf, tokenizer)
        if "features" in args.steps:
            del model, hf  # the features step loads its own models
            step_features(run)
    finally:
        text = summary(run)
        (args.out / "summary.md").write_text(text + "\n")
        print(text)


if __name__ == "__main__":
    main()
