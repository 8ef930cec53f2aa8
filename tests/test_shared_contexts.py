"""Requests sharing a context (the choices of a multiple-choice item) are scored against one cached run of it: the
scores equal the whole sequence's forward under every kind of edit, each context runs once, and what cannot run
cached (an edit that is not decode-safe, a context of its own) runs whole."""

from __future__ import annotations

import pytest
import torch
from lm_eval.api.instance import Instance

from lens_parallel.downstream import lm as lm_module
from lens_parallel.downstream.lm import EditedLM
from lens_parallel.edits import compile_hooks
from lens_parallel.generation import decode
from lens_parallel.models import model_info
from tests.conftest import FAMILIES, NotDecodeSafe, get_model
from tests.test_downstream import _own_loglikelihood
from tests.test_generation import EDITS, GATED_EDITS, SIZED_EDITS

PAIRS = [  # two contexts with three and two continuations (one token and several), two contexts alone
    ("Paris is the capital of", " France"),
    ("Paris is the capital of", " France, a country in Europe"),
    ("Paris is the capital of", " the moon"),
    ("Question: what is two plus two?\nAnswer:", " four"),
    ("Question: what is two plus two?\nAnswer:", " five, or so"),
    ("The cat sat on the", " mat"),
    ("", "Hello world"),
]
SHARED = {"Paris is the capital of": 3, "Question: what is two plus two?\nAnswer:": 2}

CASES = [(spec, "unedited") for spec in FAMILIES]
CASES += [(spec, name) for spec in ("toy-gpt2", "toy-llama") for name in [*EDITS, *SIZED_EDITS]]
CASES += [("toy-qwen3.5", name) for name in GATED_EDITS]


def _requests() -> list[Instance]:
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)]


def _counted(monkeypatch) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The (rows, positions) of every cached forward and of every whole-sequence forward the scoring runs."""
    cached: list[tuple[int, int]] = []
    whole: list[tuple[int, int]] = []
    step, run = decode.CachedForwards.__call__, lm_module.forward

    def counted_step(self, tokens, *args, **kwargs):
        cached.append(tuple(tokens.shape))
        return step(self, tokens, *args, **kwargs)

    def counted_forward(model, tokens, hooks):
        whole.append(tuple(tokens.shape))
        return run(model, tokens, hooks)

    monkeypatch.setattr(decode.CachedForwards, "__call__", counted_step)
    monkeypatch.setattr(lm_module, "forward", counted_forward)
    return cached, whole


@pytest.mark.parametrize(("spec", "name"), CASES)
def test_shared_contexts_score_as_the_whole_sequence_under_each_edit(spec, name, monkeypatch):
    model = get_model(spec)
    if name == "unedited":
        edits = ()
    else:
        edits = (SIZED_EDITS[name](model_info(model)) if name in SIZED_EDITS else (EDITS | GATED_EDITS)[name],)
    cached, whole = _counted(monkeypatch)
    lm = EditedLM(model, edits, batch_size=4, progress=False)
    got = lm.loglikelihood(_requests())
    assert len(cached) == 2 and cached[0][0] == len(SHARED)  # the contexts once, then the longer continuations
    assert sum(rows for rows, _ in whole) == len(PAIRS) - sum(SHARED.values())
    for (context, continuation), (ll, greedy) in zip(PAIRS, got, strict=True):
        want_ll, want_greedy = _own_loglikelihood(model, lm, edits, context, continuation)
        assert ll == pytest.approx(want_ll, abs=2e-4, rel=1e-5), (context, continuation)
        assert greedy == want_greedy


def test_each_context_runs_once_and_only_longer_continuations_run_after_it(monkeypatch):
    """Hand count on toy-gpt2 (every text below tokenises to the lengths asserted): one forward of the two shared
    contexts, left-padded to the longer; one of the three continuations longer than a token, without their last
    token, right-padded; one whole-sequence forward of the two requests alone."""
    model = get_model("toy-gpt2")
    lm = EditedLM(model, (), batch_size=8, progress=False)
    contexts = [lm.tok_encode(text) for text in SHARED]
    longer = [len(lm._encode_pair(c, x)[1]) - 1 for c, x in PAIRS if c in SHARED and len(lm._encode_pair(c, x)[1]) > 1]
    cached, whole = _counted(monkeypatch)
    lm.loglikelihood(_requests())
    assert cached == [(2, max(len(c) for c in contexts)), (len(longer), max(longer))]
    assert len(longer) == 3 and len(whole) == 1 and whole[0][0] == 2


def test_an_edit_that_is_not_decode_safe_scores_every_request_whole(monkeypatch):
    model = get_model("toy-qwen3")
    unedited = EditedLM(model, (), progress=False).loglikelihood(_requests())
    cached, whole = _counted(monkeypatch)
    got = EditedLM(model, (NotDecodeSafe(),), batch_size=8, progress=False).loglikelihood(_requests())
    assert cached == [] and sum(rows for rows, _ in whole) == len(PAIRS)
    assert [g[1] for g in got] == [u[1] for u in unedited]
    assert [g[0] for g in got] == pytest.approx([u[0] for u in unedited], abs=2e-4, rel=1e-5)


def test_batches_hold_at_most_the_token_budget_counting_each_items_sequences():
    """Hand-computed: a budget of 100 padded tokens; an item of width w holding k sequences costs w * k, a batch
    is as wide as its first (longest) item, and a first item over the budget runs alone."""
    lm = EditedLM(get_model("toy-gpt2"), (), batch_size=8, tokens_per_forward=100, progress=False)
    lengths = [50, 40, 30, 20, 200]
    assert lm._batches([0, 1, 2, 3], lengths, [1, 1, 2, 1, 3]) == [[0, 1], [2, 3]]  # 50*2 fits; 50*4 not; 30*3 fits
    assert lm._batches([4, 0], lengths, [1, 1, 2, 1, 3]) == [[4], [0]]  # alone over the budget; 200*4 > 200*3
    assert lm._batches([0, 1, 2, 3], lengths) == [[0, 1], [2, 3]]  # one sequence each: 50*2 fits, 50*3 not
    lm.batch_size = 1
    assert lm._batches([2, 3], lengths) == [[2], [3]]


def test_a_cached_forward_keeps_chosen_cache_rows():
    """CachedForwards.select: after the prefill of two prompts, rows [1, 1, 0] continue the second prompt twice
    and the first once, each exactly as the prompt's own whole forward (toy-qwen3)."""
    model = get_model("toy-qwen3")
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    tokens, mask, positions, starts = decode.left_padded(prompts, 0, torch.device("cpu"))
    assert tokens.tolist() == [[5, 6, 7, 8], [0, 9, 10, 11]] and starts.tolist() == [0, 1]
    assert positions.tolist() == [[0, 1, 2, 3], [0, 0, 1, 2]]
    hooks = compile_hooks(model, ())
    with decode.cached_forwards(model, hooks) as run:
        run(tokens, mask, positions, first=starts)
        run.select(torch.tensor([1, 1, 0]))
        chosen = torch.tensor([1, 1, 0])
        after = run(
            torch.tensor([[3], [4], [3]]),
            torch.cat([mask[chosen], torch.ones(3, 1, dtype=torch.long)], 1),
            mask.sum(-1)[chosen, None],
            first=None,
        )
    for row, (prompt, token) in enumerate([(prompts[1], 3), (prompts[1], 4), (prompts[0], 3)]):
        with decode.cached_forwards(model, hooks) as alone:
            sequence = torch.tensor([[*prompt, token]])
            want = alone(
                sequence, torch.ones_like(sequence), torch.arange(len(prompt) + 1)[None], first=torch.tensor([0])
            )
        torch.testing.assert_close(after[row, -1], want[0, -1], rtol=1e-5, atol=1e-5)


def _requests_past_the_context(tokenizer, n_ctx: int) -> list[Instance]:
    """Multiple-choice items whose choices of 1 to 9 words share a context: one context far past ``n_ctx`` tokens,
    one ending a few tokens before it (its longer choices cross it), a short one; and two plain requests past it."""
    from lens_parallel.data import load_texts

    words = " ".join(load_texts("wikipedia-en")[:8]).split()

    def text_of(n_tokens: int) -> str:
        kept = words[:n_tokens]
        while len(tokenizer(" ".join(kept))["input_ids"]) > n_tokens:
            kept = kept[:-1]
        return " ".join(kept)

    choices = [" " + " ".join(words[100 + k : 101 + k + n]) for k, n in enumerate(range(9))]  # 1 to 9 words
    contexts = [text_of(n_ctx + 120), text_of(n_ctx - 4), "The answer is"]
    pairs = [(context, choice) for context in contexts for choice in choices]
    pairs += [(text_of(n_ctx + 40), " and so on"), (text_of(n_ctx - 1), words[7])]
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


@pytest.mark.parametrize("spec", ["toy-gpt2", "toy-pythia", "toy-llama"])  # learned positions, rotary, rotary
def test_requests_past_the_context_score_as_lm_evals_own_hf_model(spec):
    """lm-eval's ``hf`` model cuts (context + continuation) to its last ``max_length + 1`` tokens; so does
    EditedLM, on the shared-context path (a batch's shorter continuations padded past the context, whose positions
    must stay inside it) and on the plain one, at every batch size."""
    from lm_eval.models.huggingface import HFLM

    from lens_parallel.models import toy_folder

    model = get_model(spec)
    n_ctx = int(model.cfg.n_ctx)
    hf = HFLM(pretrained=str(toy_folder(spec)), dtype="float32", batch_size=1, max_length=n_ctx, device="cpu")
    requests = _requests_past_the_context(hf.tokenizer, n_ctx)
    expected = hf.loglikelihood(requests, disable_tqdm=True)
    lengths = [len(hf.tok_encode(r.args[0] + r.args[1])) for r in requests]
    assert max(lengths) > n_ctx + 100 and sum(n > n_ctx + 1 for n in lengths) >= 11  # cut, shared and alone
    for batch_size in (1, 3, 8):
        lm = EditedLM(model, (), batch_size=batch_size, progress=False)
        got = lm.loglikelihood(requests)
        for (ll, greedy), (want_ll, want_greedy) in zip(got, expected, strict=True):
            assert ll == pytest.approx(want_ll, rel=1e-5, abs=2e-4) and greedy == want_greedy
        assert len(lm.cut) == sum(n > n_ctx + 1 for n in lengths)  # every cut request recorded as cut
