from __future__ import annotations

import datasets
import huggingface_hub
import pytest
import torch

from lens_parallel.data import CORPORA, load_texts, token_blocks

from .conftest import get_model


@pytest.mark.parametrize("name", CORPORA)
def test_bundled_corpora_load(name):
    docs = load_texts(name)
    assert len(docs) >= 8 and all(len(d) >= 600 for d in docs)
    assert load_texts(name, n_docs=3) == docs[:3]


def test_unknown_corpus():
    with pytest.raises(ValueError, match=r"unknown corpus 'wikitext'; bundled corpora: wikipedia-en, austen"):
        load_texts("wikitext")


def test_hub_data_set_while_offline(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        ValueError, match=r"cannot load hub data set 'hf:Salesforce/wikitext:wikitext-2-raw-v1'.*bundled"
    ):
        load_texts("hf:Salesforce/wikitext:wikitext-2-raw-v1")


def test_token_blocks_are_deterministic_and_start_with_the_boundary_token(toy):
    a = token_blocks(toy, "wikipedia-en", n_docs=4, seq_len=32, seed=3)
    b = token_blocks(toy, "wikipedia-en", n_docs=4, seq_len=32, seed=3)
    c = token_blocks(toy, "wikipedia-en", n_docs=4, seq_len=32, seed=4)
    assert a.tokens.shape == (4, 32) and a.tokens.dtype == torch.long
    assert torch.equal(a.tokens, b.tokens) and a.doc_indices == b.doc_indices
    assert a.doc_indices != c.doc_indices
    assert a.boundary_token == "<|endoftext|>"
    assert (a.tokens[:, 0] == a.boundary_token_id).all()
    assert toy.tokenizer.convert_ids_to_tokens(a.boundary_token_id) == "<|endoftext|>"
    # the text tokens are the document's own first tokens
    doc = load_texts("wikipedia-en")[a.doc_indices[0]]
    assert a.tokens[0, 1:].tolist() == toy.tokenizer(doc, add_special_tokens=False)["input_ids"][:31]
    assert "document-boundary token" in a.describe()["bos_policy"]


def test_chinese_corpus_blocks():
    model = get_model("toy-qwen3")
    blocks = token_blocks(model, "lunyu", n_docs=8, seq_len=64)
    text = model.tokenizer.decode(blocks.tokens[0, 1:])
    assert any("\u4e00" <= ch <= "\u9fff" for ch in text)


def test_token_block_errors():
    model = get_model("toy-gpt2")
    with pytest.raises(ValueError, match=r"seq_len=600 exceeds the model's context length n_ctx=512"):
        token_blocks(model, "austen", seq_len=600)
    with pytest.raises(ValueError, match=r"corpus 'user-texts' is empty"):
        token_blocks(model, [], n_docs=1)
    with pytest.raises(ValueError, match=r"corpus 'user-texts' is empty"):
        token_blocks(model, ["  ", ""], n_docs=1)
    with pytest.raises(
        ValueError, match=r"n_docs=2 blocks asked for, but .user-texts. has 1 documents \(of 2\) with the 15 tokens"
    ):
        token_blocks(model, ["short text", "word " * 40], n_docs=2, seq_len=16)
    with pytest.raises(ValueError, match=r"seq_len must be >= 2"):
        token_blocks(model, "austen", seq_len=1)
