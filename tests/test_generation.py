"""Generation under edits: KV-cached decoding equals Hugging Face's own ``generate`` (unedited) and, under every
built-in edit, a recomputation of the whole sequence at every step."""

from __future__ import annotations

import pytest
import torch
from lm_eval.api.instance import Instance
from transformers import AutoModelForCausalLM

import lens_parallel as lp
from lens_parallel.edits import (
    ComponentScale,
    DiagonalEdit,
    GatedRemoval,
    HeadEdit,
    LearnedGate,
    RandomDirectionRemoval,
    SkipFirstLayers,
    ZeroDiagonal,
    compile_hooks,
)
from lens_parallel.generation import decode
from lens_parallel.hooks import forward
from lens_parallel.losses import chunked_token_nll, logits_of, unembedding
from lens_parallel.models import model_info, toy_folder
from lens_parallel.tokenizers import hf_tokenizer
from lens_parallel.weights import real_model_folder
from tests.conftest import get_model

PROMPTS = ["The capital of France is", "Once upon a time there was a little girl who", "1, 2, 3,"]
TOYS = ["toy-gpt2", "toy-pythia", "toy-qwen2", "toy-qwen3", "toy-llama", "toy-qwen3.5"]


def _hugging_face(spec: str) -> AutoModelForCausalLM:
    """An independent copy of the same weights, run by transformers alone (the bridge's own Hugging Face model has
    TransformerLens's attention in it)."""
    folder = toy_folder(spec) if spec.startswith("toy-") else real_model_folder(spec)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("spec", [*TOYS, pytest.param("smollm2-135m", marks=pytest.mark.slow)])
def test_unedited_greedy_generation_equals_hugging_face_generate(spec, monkeypatch):
    model = get_model(spec)
    n = 8
    batched = lp.generate(model, PROMPTS, max_new_tokens=n, batch_size=3, progress=False)
    tokenizer, hf = hf_tokenizer(model), _hugging_face(spec)
    eos = hf.generation_config.eos_token_id
    for i, prompt in enumerate(PROMPTS):
        encoded = tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            out = hf.generate(
                **encoded,
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=eos,
                output_logits=True,
                return_dict_in_generate=True,
            )
        expected = [t for t in out.sequences[0, encoded["input_ids"].shape[1] :].tolist()]
        expected = expected[: expected.index(eos)] if eos in expected else expected
        assert list(batched.tokens[0][i]) == expected, (spec, prompt)
        alone = lp.generate(model, prompt, max_new_tokens=n, progress=False)
        assert alone.tokens[0][0] == batched.tokens[0][i] and alone.texts[0][0] == batched.texts[0][i]
        # every step's logits, not only their argmax (a cache that drops state can keep the argmax on a toy model)
        _, logits = _cached(model, encoded["input_ids"][0].tolist(), [], len(expected), monkeypatch)
        expected_logits = torch.stack([step[0] for step in out.logits[: len(expected)]])
        torch.testing.assert_close(logits.float(), expected_logits.float(), rtol=1e-4, atol=2e-4)
    if spec == "smollm2-135m":  # the text DESIGN.md records for Hugging Face's generate
        assert batched.texts[0][0] == " Paris.\n\nThe answer is:"


def _recomputed(model, prompt_ids, hooks, n):
    """Greedy continuation by a whole-sequence forward at every step (no cache): its tokens and step logits."""
    unembed, tokens, logits = unembedding(model), list(prompt_ids), []
    for _ in range(n):
        final = forward(model, torch.tensor([tokens]), hooks)
        with torch.inference_mode():
            logits.append(logits_of(final[:, -1], unembed)[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt_ids) :], torch.stack(logits)


def _cached(model, prompt_ids, hooks, n, monkeypatch, *, cached=True):
    seen = []

    def recording(resid, unembed):
        out = logits_of(resid, unembed)
        seen.append(out[0])
        return out

    monkeypatch.setattr(decode, "logits_of", recording)
    got = decode.decode_batch(
        model,
        [prompt_ids],
        hooks,
        max_new_tokens=n,
        sampling=decode.Sampling(),
        stop=(),
        tokenizer=hf_tokenizer(model),
        unembed=unembedding(model),
        indices=[0],
        eos=frozenset(),
        cached=cached,
    )
    return list(got[0].tokens), torch.stack(seen)


EDITS = {
    "value s_par=0": ComponentScale("value", s_par=0.0),
    "value after-first": ComponentScale("value", s_par=0.0, s_perp=1.5, positions="after-first"),
    "value-exclude-self": ComponentScale("value-exclude-self", s_par=0.0, layers=(0, 1)),
    "residual-attn": ComponentScale("residual-attn", s_par=0.0),
    "residual-mlp": ComponentScale("residual-mlp", s_par=0.5, s_perp=0.8),
    "residual-block": ComponentScale("residual-block", s_par=0.5),
    "zero-diagonal": ZeroDiagonal(),
    "zero-diagonal heads": ZeroDiagonal(layers=(1,), heads=(0, 2)),
    "head zero": HeadEdit("zero", 1, (0, 1)),
    "head parallel-value after-first": HeadEdit("parallel-value", 0, (1,), positions="after-first"),
    "random-direction": RandomDirectionRemoval(seed=3),
    "diagonal value": DiagonalEdit("value", s_par=0.0),
    "diagonal exclude-self heads": DiagonalEdit("value-exclude-self", s_par=-0.5, heads=(1, 2), layers=(1,)),
    "diagonal residual-attn after-first": DiagonalEdit("residual-attn", s_par=0.0, heads=(0,), positions="after-first"),
    "skip-first-layers": SkipFirstLayers(ComponentScale("value", s_par=0.0), 1),
}


SIZED_EDITS = {  # edits holding a tensor per layer and head: made for the model at hand
    "gated-removal": lambda info: GatedRemoval(alpha=torch.full((info.n_layers, info.n_heads), 0.7)),
    "learned-gate": lambda info: LearnedGate(
        torch.randn(info.n_layers, info.n_heads, info.d_model, generator=torch.Generator().manual_seed(0)),
        torch.zeros(info.n_layers, info.n_heads),
    ),
}
GATED_EDITS = {  # gated attention (toy-qwen3.5's softmax layers): the pre-gate A v rebuilt from every value
    "gated value pre-gate": ComponentScale("value", s_par=0.0, layers=(1, 2)),
    "gated value-exclude-self pre-gate": ComponentScale("value-exclude-self", s_par=0.0, s_perp=1.2, layers=(1, 2)),
    "gated diagonal value": DiagonalEdit("value", s_par=0.0, layers=(1, 2)),
}
CASES = [(spec, name) for spec in ("toy-gpt2", "toy-qwen3") for name in [*EDITS, *SIZED_EDITS]] + [
    ("toy-qwen3.5", name) for name in GATED_EDITS
]


@pytest.mark.parametrize(("spec", "name"), CASES)
def test_cached_generation_under_each_edit_equals_recomputing_the_whole_sequence(spec, name, monkeypatch):
    model = get_model(spec)
    edit = SIZED_EDITS[name](model_info(model)) if name in SIZED_EDITS else (EDITS | GATED_EDITS)[name]
    hooks = compile_hooks(model, edit)
    prompt = hf_tokenizer(model).encode(PROMPTS[1])
    n = 6
    tokens, logits = _cached(model, prompt, hooks, n, monkeypatch)
    expected, expected_logits = _recomputed(model, prompt, hooks, n)
    assert tokens == expected
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
    unedited, unedited_logits = _recomputed(model, prompt, [], n)
    if name not in ("head parallel-value after-first",):  # an edit that changes nothing would pass vacuously
        assert not torch.equal(expected_logits, unedited_logits), name
    assert len(unedited) == n


def test_every_registered_edit_kind_has_a_cached_generation_case():
    info = model_info(get_model("toy-gpt2"))
    made = [*EDITS.values(), *GATED_EDITS.values(), *(make(info) for make in SIZED_EDITS.values())]
    assert {type(edit).kind for edit in made} == set(lp.EDITS)


def test_mean_ablation_and_a_left_padded_batch_under_an_edit_equal_each_prompt_alone():
    model = get_model("toy-qwen3")
    means = torch.randn(model.cfg.n_heads, model.cfg.d_head)
    edits = {"mean": HeadEdit("mean", 1, (0, 3), means=means), "value": ComponentScale("value", s_par=0.0)}
    batched = lp.generate(model, PROMPTS, edits, max_new_tokens=6, batch_size=3, progress=False)
    for i, prompt in enumerate(PROMPTS):
        alone = lp.generate(model, prompt, edits, max_new_tokens=6, progress=False)
        assert [t[0] for t in alone.tokens] == [t[i] for t in batched.tokens], prompt
    assert batched.settings == ("unedited", "mean", "value")
    frame = batched.to_dataframe()
    assert list(frame.columns) == ["prompt_index", "prompt", "setting", "text", "n_tokens", "finish", "departs_at"]
    assert len(frame) == 9 and (frame[frame.setting == "unedited"]["departs_at"].isna()).all()


def test_sampling_is_reproducible_and_independent_of_the_batch():
    model = get_model("toy-qwen2")
    kw = dict(max_new_tokens=8, do_sample=True, temperature=1.5, top_p=0.9, seed=7, progress=False)
    one = lp.generate(model, PROMPTS, batch_size=3, **kw)
    two = lp.generate(model, PROMPTS, batch_size=1, **kw)
    assert one.tokens == two.tokens
    other = lp.generate(model, PROMPTS, batch_size=3, **(kw | {"seed": 8}))
    assert other.tokens != one.tokens
    greedy = lp.generate(model, PROMPTS, max_new_tokens=8, progress=False)
    assert greedy.tokens != one.tokens


@pytest.mark.slow
def test_a_stop_string_ends_the_text_before_it(tmp_path):
    model = get_model("smollm2-135m")
    full = lp.generate(model, "The capital of France is", max_new_tokens=8, progress=False)
    assert full.texts[0][0].startswith(" Paris.\n\n")
    stopped = lp.generate(model, "The capital of France is", max_new_tokens=8, stop=("\n",), progress=False)
    assert stopped.texts[0][0] == " Paris." and stopped.finish[0][0] == "stop"
    assert stopped.tokens[0][0] == full.tokens[0][0][: len(stopped.tokens[0][0])]
    assert "<mark" not in stopped._repr_html_()  # the unedited text alone: nothing departs from it
    loaded = lp.GenerationResult.load(stopped.save(tmp_path / "generated"))
    assert loaded.tokens == stopped.tokens and loaded.texts == stopped.texts and loaded.finish == stopped.finish


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: lp.generate(m, []), "documents: got list '\\[\\]'; accepted: a string, a list of strings"),
        (lambda m: lp.generate(m, ["fine", ""]), "prompt 1 is empty: every prompt must be a non-empty string"),
        (lambda m: lp.generate(m, "x", max_new_tokens=0), "max_new_tokens must be a positive integer, got 0"),
        (lambda m: lp.generate(m, "x", max_new_tokens=10**6), "exceeds the model's context of"),
        (lambda m: lp.generate(m, "x", stop=("",)), "stop must be a string, a list of non-empty strings or None"),
        (lambda m: lp.generate(m, "x", top_p=0.0), r"top_p must be in \(0, 1\]"),
    ],
)
def test_bad_input_is_refused_before_any_forward(call, message, monkeypatch):
    model = get_model("toy-gpt2")

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward ran")

    monkeypatch.setattr(decode, "decode_batch", no_forward)
    monkeypatch.setattr("lens_parallel.generation.api.decode_batch", no_forward)
    with pytest.raises(lp.LensParallelError, match=message):
        call(model)


def test_a_killed_generate_resumes_only_the_unfinished_prompts_and_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    from tests.conftest import Killed, KillSwitch

    model = get_model("toy-qwen3")
    prompts = [*PROMPTS, "Two roads diverged in a yellow wood", "It was the best of times"]
    edits = {"zero diagonal": ZeroDiagonal()}
    run = dict(max_new_tokens=5, batch_size=2, progress=False)
    whole = lp.generate(model, prompts, edits, **run)
    store = tmp_path / "generate.jsonl"
    switch = KillSwitch(monkeypatch, decode, "decode_batch", at=4, record=lambda m, batch, *a, **k: len(batch))
    monkeypatch.setattr("lens_parallel.generation.api.decode_batch", decode.decode_batch)
    with pytest.raises(Killed):
        lp.generate(model, prompts, edits, store=store, **run)
    assert switch.calls == [2, 2, 1, 2]  # killed in the edited setting's first batch: the unedited run is stored
    switch.disarm()
    resumed = lp.generate(model, prompts, edits, store=store, **run)
    assert switch.calls == [2, 2, 1]  # only the edited setting's three batches ran again
    assert resumed.tokens == whole.tokens and resumed.texts == whole.texts and resumed.finish == whole.finish
    switch.calls.clear()
    assert lp.generate(model, prompts, edits, store=store, **run).texts == whole.texts and switch.calls == []
    with pytest.raises(lp.LensParallelError, match="was written by a run whose numbers differ"):
        lp.generate(model, prompts, edits, store=store, **(run | {"max_new_tokens": 6}))


def test_progress_counts_every_token_of_the_call_and_every_finished_row():
    model = get_model("toy-gpt2")
    tokenizer = hf_tokenizer(model)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    common = dict(
        max_new_tokens=7, sampling=decode.Sampling(), stop=(), tokenizer=tokenizer, unembed=unembedding(model)
    )
    eos = decode.end_of_sequence(model, tokenizer)
    plain = decode.decode_batch(model, prompts, [], indices=range(3), eos=eos, **common)
    early = plain[0].tokens[2]  # the first row's third token, made an end-of-sequence token: that row ends early
    seen: list[tuple[int, int]] = []
    decoded = decode.decode_batch(
        model, prompts, [], indices=range(3), eos=eos | {early}, advance=lambda t, r: seen.append((t, r)), **common
    )
    assert decoded[0].finish == "eos" and len(decoded[0].tokens) == plain[0].tokens.index(early)
    assert sum(t for t, _ in seen) == 3 * 7 and sum(r for _, r in seen) == 3  # the bar ends full
    assert seen[plain[0].tokens.index(early)][1] >= 1  # the row that ended early counted at its step


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("do_sample", "no", "do_sample must be True or False, got 'no'"),
        ("add_bos_token", "yes", "add_bos_token must be True, False or None, got 'yes'"),
        ("temperature", True, "temperature must be a finite number, got True"),
        ("stop", 3, "stop must be a string, a list of non-empty strings or None"),
    ],
)
def test_generate_settings_are_typed(field, value, message):
    from tests.test_task_answers import unchecked

    with pytest.raises(lp.LensParallelError, match=message):
        unchecked(lp.GenerateSettings, **{field: value})
    assert lp.GenerateSettings(stop=None).stop == () and unchecked(lp.GenerateSettings, stop="Q:").stop == ("Q:",)


LINEAR_EDITS = {  # toy-qwen3.5's linear-attention layers are 0, 3 and 4
    "value s_par=0, every layer": ComponentScale("value", s_par=0.0),
    "value-exclude-self on layer 3": ComponentScale("value-exclude-self", s_par=0.0, s_perp=1.5, layers=(3,)),
    "value-merged on layer 0 after-first": ComponentScale(
        "value-merged", s_par=3.0, layers=(0,), positions="after-first"
    ),
    "residual-attn on layer 4": ComponentScale("residual-attn", s_par=0.0, s_perp=1.3, layers=(4,)),
    "diagonal value": DiagonalEdit("value", s_par=-0.5, layers=(0, 4)),
    "zero-diagonal, every layer": ZeroDiagonal(),
    "head zero": HeadEdit("zero", 0, (0, 1)),
    "head parallel-value": HeadEdit("parallel-value", 3, (1, 2)),
    "residual-attn on value heads": ComponentScale("residual-attn", s_par=0.0, s_perp=1.5, layers=(3,), heads=(1, 2)),
    "head parallel-residual": HeadEdit("parallel-residual", 0, (0, 1, 2, 3)),
}


@pytest.mark.parametrize("name", list(LINEAR_EDITS))
def test_generation_under_a_linear_layer_edit_equals_recomputing_the_whole_sequence(name, monkeypatch):
    """A Qwen3.5 linear-attention layer's cached steps (the prefill included) run Hugging Face's own module, where
    the bridge's linear-attention hooks never fire: cached, such an edit would be silently absent (under
    HeadEdit("zero") the logits were 3e-7 from the unedited model's, 0.07-0.16 from the edited recomputation). Such
    edits say they are not decode-safe, and generation reruns the whole sequence at each step: every step's logits
    equal an independent recomputation's, in a batch of left-padded prompts too, and the choices of a shared
    context are scored as whole sequences."""
    from lens_parallel.downstream.lm import EditedLM

    model = get_model("toy-qwen3.5")
    edit = LINEAR_EDITS[name]
    assert not lp.edits.decode_safe([edit], model_info(model))
    hooks, tokenizer, n = compile_hooks(model, edit), hf_tokenizer(model), 5
    prompt = tokenizer.encode(PROMPTS[1])
    tokens, logits = _cached(model, prompt, hooks, n, monkeypatch, cached=False)
    expected, expected_logits = _recomputed(model, prompt, hooks, n)
    assert tokens == expected
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
    _, unedited_logits = _recomputed(model, prompt, [], n)
    assert (expected_logits - unedited_logits).abs().max() > 1e-3  # the edit is there at every step
    monkeypatch.undo()
    batched = lp.generate(model, PROMPTS, {"edited": edit}, max_new_tokens=n, batch_size=3, progress=False)
    assert batched.provenance.settings["decoding"] == {"unedited": "kv-cache", "edited": "recomputed every step"}
    for i, text in enumerate(PROMPTS):
        ids = tokenizer.encode(text)
        for setting, setting_hooks in ((1, hooks), (0, [])):
            got = list(batched.tokens[setting][i])
            assert got == _recomputed(model, ids, setting_hooks, len(got))[0], (text, setting)
    requests = [
        Instance("loglikelihood", {}, ("The cat sat on the", choice), i)
        for i, choice in enumerate([" mat", " big red mat"])
    ]
    for (ll, _), request in zip(
        EditedLM(model, (edit,), progress=False).loglikelihood(requests), requests, strict=True
    ):
        whole, context = tokenizer.encode("".join(request.args)), tokenizer.encode(request.args[0])
        continuation = whole[len(context) :]  # as lm-eval splits a pair
        sequence = torch.tensor([whole])
        with torch.no_grad():
            nll = chunked_token_nll(forward(model, sequence, hooks), unembedding(model), sequence)
        assert ll == pytest.approx(-float(nll[0, -len(continuation) :].double().sum()), abs=1e-4)
