"""How many operations each analysis dispatches, against Hugging Face's own SDPA forward: a device-independent
measure of launch overhead (a kernel launch costs 5-10 us of CPU on a GPU, so a loop of small blocks that is cheap
on a CPU is launch-bound there).

    python benchmarks/dispatch_counts.py [--model toy-qwen3] [--lengths 1024 8192] [--sized-as cuda cpu]
                                         [--out benchmarks/out/dispatch_counts.json]

The model is a toy with its context raised to the longest length (``toy_folder(spec, n_ctx=...)``), one document of
random token ids of each length (what is counted does not depend on the text). Every case runs under
:func:`lens_parallel.devices.dispatch_counts` (PyTorch's dispatch mode) with the block sizes of
``--sized-as`` (:func:`lens_parallel.devices.sized_as`: ``cuda`` makes every size choice a GPU would, on this
CPU), once after a warm-up; it counts kernels (operations that are not views). Cases: HF SDPA
forward to the last hidden state (``hf-sdpa``); two such forwards, each unembedded over the whole vocabulary
(``hf-sdpa-pair``); decompose in each of value, value-exclude-self, residual-attn and the three together; evaluate
of ComponentScale("value", s_par=0); causal_null(null="exact"). Per case: kernels per layer, that over HF's, and its
growth from the shortest to the longest length over HF's growth (goal: at most 1.5x HF's per layer, growing no
faster than HF's; the pair's floor for evaluate).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

import lens_parallel as lp
from lens_parallel import devices
from lens_parallel.devices import sized_as
from lens_parallel.documents import Documents
from lens_parallel.models import toy_folder


def cases(model: Any, hf: Any) -> dict[str, Callable[[Any], Any]]:
    """Each analysis case (and Hugging Face's SDPA forward and its pair, the floors) as a function of the documents
    or token ids, run in one batch: what this script counts and ``benchmarks/gpu.py`` times."""

    def hf_forward(t: Any) -> None:
        with torch.inference_mode():
            hf.model(input_ids=tokens_of(t), use_cache=False)

    def hf_pair(t: Any) -> None:
        with torch.inference_mode():
            for _ in range(2):  # two forwards, each unembedded over the whole vocabulary, 4,096 positions at a time
                hidden = hf.model(input_ids=tokens_of(t), use_cache=False).last_hidden_state
                for rows in hidden.flatten(0, 1).split(4096):
                    hf.lm_head(rows)

    def decompose(*spaces: str) -> Callable[[Any], Any]:
        return lambda t: lp.decompose(model, t, space=list(spaces), batch_size=len(t), progress=False)

    return {
        "hf-sdpa": hf_forward,
        "hf-sdpa-pair": hf_pair,
        "decompose(value)": decompose("value"),
        "decompose(value-exclude-self)": decompose("value-exclude-self"),
        "decompose(residual-attn)": decompose("residual-attn"),
        "decompose(3 spaces)": decompose("value", "value-exclude-self", "residual-attn"),
        "evaluate": lambda t: lp.evaluate(
            model, t, lp.ComponentScale("value", s_par=0.0), batch_size=len(t), n_resamples=100
        ),
        "causal_null(exact)": lambda t: lp.causal_null(model, t, null="exact", batch_size=len(t), progress=False),
    }


def tokens_of(t: Any) -> torch.Tensor:
    """The token ids of documents or of a tensor of them."""
    return t.tokens if isinstance(t, Documents) else t


def count(fn: Callable[[Any], Any], docs: Documents) -> int:
    """Kernels dispatched by ``fn(docs)``, after one warm-up call (lazy initialisation dispatches once)."""
    fn(docs)
    with devices.dispatch_counts() as counts:
        fn(docs)
    return sum(counts.kernels.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="toy-qwen3")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--sized-as", nargs="+", default=["cuda", "cpu"], choices=["cuda", "cpu"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/dispatch_counts.json"))
    args = parser.parse_args()
    folder = toy_folder(args.model, n_ctx=max(args.lengths))
    model = lp.load_model(str(folder))
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    n_layers = model.cfg.n_layers
    rows: list[dict[str, Any]] = []
    for kind in args.sized_as:
        for length in args.lengths:
            ids = torch.randint(model.cfg.d_vocab, (length,), generator=torch.Generator().manual_seed(length))
            docs = Documents.padded([ids.tolist()], {"source": "random token ids", "seed": length})
            with sized_as(kind):
                for name, fn in cases(model, hf).items():
                    kernels = count(fn, docs)
                    rows.append({"sized_as": kind, "length": length, "case": name, "kernels": kernels})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    first, last = min(args.lengths), max(args.lengths)
    print(f"{args.model} ({n_layers} layers), kernels dispatched per layer; x HF: over hf-sdpa's per layer at the")
    print(f"same length; growth: {first:,} -> {last:,} tokens, over hf-sdpa's growth")
    for kind in args.sized_as:
        got = {(r["length"], r["case"]): r["kernels"] for r in rows if r["sized_as"] == kind}
        print(f"\n sized as {kind}")
        print(f"  {'case':32s} " + " ".join(f"{f'{n:,} tok':>10s} {'x HF':>6s}" for n in args.lengths) + "  growth")
        for name in dict.fromkeys(r["case"] for r in rows):
            cells = []
            for n in args.lengths:
                per_layer = got[n, name] / n_layers
                cells.append(f"{per_layer:10.1f} {got[n, name] / got[n, 'hf-sdpa']:6.2f}")
            growth = (got[last, name] / got[first, name]) / (got[last, "hf-sdpa"] / got[first, "hf-sdpa"])
            print(f"  {name:32s} " + " ".join(cells) + f"  {growth:6.2f}")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
