"""The chunked loss: the final normalised residual unembedded a chunk of positions at a time equals token_nll of
the full logits (values and gradients), on every toy family, with a final-logit soft cap, and in the engine."""

from __future__ import annotations

import pytest
import torch
import transformers

from lens_parallel.hooks import forward
from lens_parallel.losses import chunked_token_nll, token_nll, unembedding
from lens_parallel.models import wrap_hf_model
from lens_parallel.tokenizers import load_bundled_tokenizer
from tests.conftest import FAMILIES, get_model


def _tokens(model, batch: int = 3, pos: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, model.cfg.d_vocab, (batch, pos), generator=g)


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(tokens, return_type="logits")


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_nll_equals_full_logits_on_every_family(family: str) -> None:
    model = get_model(family)
    tokens = _tokens(model)
    lengths = torch.tensor([12, 7, 2])
    with torch.inference_mode():
        final = forward(model, tokens, grad=True)
    assert final is not None and final.shape == (3, 12, model.cfg.d_model)
    expected = token_nll(_logits(model, tokens), tokens, lengths)
    # 3 rows a chunk: the 33 scored positions in 11 chunks, some straddling documents
    got = chunked_token_nll(final, unembedding(model), tokens, lengths, chunk_bytes=3 * 4 * model.cfg.d_vocab)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5, equal_nan=True)
    assert torch.isnan(got[2, 1:]).all() and not torch.isnan(got[0]).any()


def _gradients(
    final: torch.Tensor, unembed, tokens: torch.Tensor, *, chunked: bool, bias: bool = False, chunk_bytes: int = 0
) -> tuple[torch.Tensor, ...]:
    """d(sum of NLL)/d(final residual, W_U[, b_U]) through the full logits (autograd of token_nll) or chunked."""
    x = final.clone().requires_grad_(True)
    W = unembed.W_U.detach().clone().requires_grad_(True)
    b = torch.linspace(-1, 1, W.shape[0], dtype=W.dtype).requires_grad_(True) if bias else None
    leaves = (x, W) if b is None else (x, W, b)
    if chunked:
        loss = chunked_token_nll(x, type(unembed)(W, b, unembed.softcap), tokens, chunk_bytes=chunk_bytes)
    else:
        logits = torch.nn.functional.linear(x, W, b).float()
        if unembed.softcap is not None:
            logits = unembed.softcap * torch.tanh(logits / unembed.softcap)
        loss = token_nll(logits, tokens)
    return torch.autograd.grad(loss.sum(), leaves)


def _assert_gradients_close(got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], rel: float) -> None:
    """Each gradient equal to within ``rel`` of its own largest entry (float32 rounding of sums over rows and the
    vocabulary: up to 1.5e-5 seen)."""
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=rel * float(e.abs().max()))


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_nll_gradient_equals_full_logits_gradient(family: str) -> None:
    """Gradients with respect to the final residual, the (tied or untied) unembedding weight and a bias, with
    5-row chunks (16 bytes a logit under grad: half the no-grad rows)."""
    model = get_model(family)
    tokens = _tokens(model)
    unembed = unembedding(model)
    with torch.inference_mode():
        final = forward(model, tokens, grad=True)
    for bias in (False, True):
        expected = _gradients(final, unembed, tokens, chunked=False, bias=bias)
        got = _gradients(final, unembed, tokens, chunked=True, bias=bias, chunk_bytes=5 * 8 * model.cfg.d_vocab)
        _assert_gradients_close(got, expected, 5e-5)
        assert all(float(g.abs().max()) > 1e-3 for g in got)  # gradients that are not trivially zero


def test_chunked_nll_gradient_in_half_precision() -> None:
    """A bf16 residual and weight: the matmuls in bf16, the softmax in float32, as autograd of the full logits
    (cast to float32 before the log-softmax) computes them."""
    model = get_model("toy-qwen3")
    tokens = _tokens(model)
    unembed = unembedding(model)
    with torch.inference_mode():
        final = forward(model, tokens, grad=True)
    half = type(unembed)(unembed.W_U.detach().bfloat16(), None, None)
    expected = _gradients(final.bfloat16(), half, tokens, chunked=False)
    got = _gradients(final.bfloat16(), half, tokens, chunked=True, chunk_bytes=5 * 8 * model.cfg.d_vocab)
    assert all(g.dtype == torch.bfloat16 for g in got)
    _assert_gradients_close(got, expected, 2e-2)  # bf16 rounding of the gradients (8 bits of mantissa)


def _toy_gemma3(softcap: float | None):
    config = transformers.Gemma3TextConfig(
        vocab_size=50257,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        final_logit_softcapping=softcap,
        sliding_window=16,
        architectures=["Gemma3ForCausalLM"],
    )
    torch.manual_seed(0)
    hf_model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # large weights, so that the cap (tanh) is far from linear
        hf_model.lm_head.weight.mul_(40.0)
    return wrap_hf_model(hf_model, load_bundled_tokenizer("gpt2"), name="toy-gemma3-softcap")


def test_chunked_nll_applies_the_final_logit_soft_cap() -> None:
    model = _toy_gemma3(softcap=3.0)
    tokens = _tokens(model)
    unembed = unembedding(model)
    assert unembed.softcap == 3.0
    logits = _logits(model, tokens)
    assert logits.abs().max() <= 3.0 + 1e-4  # the model itself caps its logits
    with torch.inference_mode():
        final = forward(model, tokens, grad=True)
        got = chunked_token_nll(final, unembed, tokens, chunk_bytes=4 * 4 * model.cfg.d_vocab)
        uncapped = chunked_token_nll(final, type(unembed)(unembed.W_U, unembed.b_U, None), tokens)
    torch.testing.assert_close(got, token_nll(logits, tokens), rtol=0, atol=2e-5)
    assert (got - uncapped).abs().max() > 0.1  # the cap matters here
    # the gradient through the cap's tanh (d logits / d raw = 1 - tanh^2), against autograd of the full logits
    expected = _gradients(final, unembed, tokens, chunked=False, bias=True)
    _assert_gradients_close(
        _gradients(final, unembed, tokens, chunked=True, bias=True, chunk_bytes=3 * 8 * model.cfg.d_vocab),
        expected,
        5e-5,
    )
    uncapped_grad = _gradients(final, type(unembed)(unembed.W_U, None, None), tokens, chunked=True, bias=True)
    assert (uncapped_grad[0] - expected[0]).abs().max() > 0.1 * expected[0].abs().max()


@pytest.mark.parametrize("family", ["toy-gpt2", "toy-qwen3.5"])
def test_kl_and_top1_agreement_by_hand_and_zero_for_a_no_op(family: str) -> None:
    """In float64 on both sides: ``evaluate``'s KL (its own forwards, the divergence scanned over vocabulary blocks)
    against the log-softmax of a plain forward's logits. In float32 the two forwards' summation orders differ by
    the CPU's kernels (AVX2, AVX-512, AMX), which moved a KL of 7e-4 by 2.4e-4 of itself on one CPU. In float64,
    toy-gpt2 agrees to 5e-13; toy-qwen3.5's Gated DeltaNet layers keep their recurrence in float32 inside
    transformers (a float32 rounding of inputs that differ in their 16th digit can differ by an ulp): 9e-9 here.
    1e-5 leaves that a thousandfold margin and still fails any error of the formula."""
    from lens_parallel import ComponentScale, apply_edits, evaluate, load_model, token_blocks
    from lens_parallel.losses import chunked_divergence

    model = load_model(family, dtype=torch.float64)
    blocks = token_blocks(model, "wikipedia-en", n_docs=3, seq_len=10)
    noop = evaluate(model, blocks, ComponentScale("value", s_par=1.0), n_resamples=50)
    assert noop.kl == 0.0 and noop.top1_agreement == 1.0
    edit = ComponentScale("value", s_par=0.0)
    effect = evaluate(model, blocks, edit, n_resamples=50)
    with torch.no_grad():
        log_p = torch.log_softmax(model(blocks.tokens)[:, :-1].double(), -1)
        with apply_edits(model, edit):
            log_q = torch.log_softmax(model(blocks.tokens)[:, :-1].double(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    agree = (log_p.argmax(-1) == log_q.argmax(-1)).double()
    assert effect.kl == pytest.approx(float(kl.mean()), rel=1e-5)
    assert effect.top1_agreement == pytest.approx(float(agree.mean()))
    assert effect.kl > 0 and effect.kl_ci[0] <= effect.kl <= effect.kl_ci[1]
    final_p = forward(model, blocks.tokens, grad=True)
    with apply_edits(model, edit):
        final_q = forward(model, blocks.tokens, grad=True)
    unembed = unembedding(model)
    whole = chunked_divergence(final_p, final_q, unembed, blocks.tokens)
    blocked = chunked_divergence(final_p, final_q, unembed, blocks.tokens, rows=5, block_bytes=4 * 5 * 1031)
    for a, b in zip(whole, blocked, strict=True):  # blocks of 5 rows x 1,031 columns
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(whole[0], chunked_token_nll(final_p, unembed, blocks.tokens))
    torch.testing.assert_close(whole[1], chunked_token_nll(final_q, unembed, blocks.tokens))


@pytest.mark.parametrize(("rows", "block_bytes"), [(1024, 2**21), (4, 4 * 4 * 37)])
def test_vocab_scan_equals_float64_log_softmax_where_the_maxima_lie_far_apart(rows: int, block_bytes: int) -> None:
    """The online scan over blocks of the vocabulary (one block; blocks of 4 rows and 37 columns, dividing neither
    6 rows nor 500 columns), on logits given directly (an identity unembedding), against float64."""
    from lens_parallel.losses import Unembedding, _vocab_scan

    g = torch.Generator().manual_seed(0)
    l_p = 4.0 * torch.randn(6, 500, generator=g, dtype=torch.float64)
    l_q = l_p + 0.5 * torch.randn(6, 500, generator=g, dtype=torch.float64)
    l_q[0, 7] += 60.0  # q's top token far above everything p predicts (and past the first block)
    l_q[1] = l_p[1] - 1000.0  # the same distribution, every logit shifted
    l_q[2] = l_p[2]  # identical rows: KL exactly 0
    l_p[3, 450] += 30.0  # p's largest logit in the last block
    target = torch.tensor([7, 3, 0, 499, 250, 1])
    l_p, l_q = l_p.float(), l_q.float()  # the reference: float64 of the same float32 logits
    log_p, log_q = torch.log_softmax(l_p.double(), -1), torch.log_softmax(l_q.double(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    identity = Unembedding(torch.eye(500), None, None)
    ((lse_p, picked_p, arg_p), (lse_q, picked_q, arg_q)), kl_rows = _vocab_scan(
        (l_p, l_q), target, identity, rows=rows, block_bytes=block_bytes
    )
    for lse, picked, log in ((lse_p, picked_p, log_p), (lse_q, picked_q, log_q)):
        expected = -log.gather(-1, target[:, None]).squeeze(-1)
        torch.testing.assert_close((lse - picked).double(), expected, rtol=1e-5, atol=1e-4)
    assert kl_rows is not None
    torch.testing.assert_close(kl_rows.double(), kl, rtol=1e-4, atol=1e-5)
    assert kl_rows[2] == 0.0 and float(kl[0]) > 30.0 and abs(float(kl_rows[1])) < 1e-5
    assert arg_p.tolist() == l_p.argmax(-1).tolist() and arg_q.tolist() == l_q.argmax(-1).tolist()
    assert arg_p[3] == 450 and arg_q[0] == 7
