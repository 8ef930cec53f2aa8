from __future__ import annotations

import huggingface_hub
import pytest
import torch
import transformers

from lens_parallel.errors import EnvironmentFailure, LensParallelError
from lens_parallel.models import TOY_MODELS, ModelSpecError, load_model, model_info, weights_digest
from lens_parallel.tokenizers import load_bundled_tokenizer

from .conftest import get_model

EXPECTED = {  # family, n_heads, n_kv_heads, parallel attn/MLP, positional
    "toy-gpt2": ("gpt2", 4, 4, False, "learned"),
    "toy-pythia": ("pythia", 4, 4, True, "rotary"),
    "toy-qwen2": ("qwen2", 6, 2, False, "rotary"),
    "toy-qwen3": ("qwen3", 6, 2, False, "rotary"),
    "toy-llama": ("llama", 6, 2, False, "rotary"),
    "toy-qwen3.5": ("qwen3.5", 6, 2, False, "rotary"),
}


@pytest.mark.parametrize("spec", EXPECTED)
def test_toy_model_info_and_logits_match_hf(spec):
    model = get_model(spec)
    info = model_info(model)
    assert (info.family, info.n_heads, info.n_kv_heads, info.parallel_attn_mlp, info.positional) == EXPECTED[spec]
    assert info.d_head == 16 and info.group_size == info.n_heads // info.n_kv_heads
    if spec == "toy-qwen3.5":
        assert info.layer_types == ("linear", "softmax", "softmax", "linear", "linear") and info.gated_attention
        assert info.softmax_layers == (1, 2) and (info.n_linear_heads, info.n_linear_key_heads) == (4, 2)
    else:
        assert info.n_layers == 3 and info.softmax_layers == (0, 1, 2) and not info.gated_attention
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        bridge = model(tokens)
        hf = model.original_model(tokens).logits
    assert torch.allclose(bridge, hf, atol=1e-5)


def test_toys_are_seeded_and_leave_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = load_model("toy-llama")
    after = torch.rand(3)
    b = load_model("toy-llama")
    assert torch.equal(before, after)
    for (name, p), q in zip(a.original_model.named_parameters(), b.original_model.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize(
    ("family", "ids"), [("gpt2", [15496, 995]), ("gpt-neox", [12092, 1533]), ("qwen3", [9707, 1879])]
)
def test_bundled_tokenizers_give_the_real_ids(family, ids):
    assert load_bundled_tokenizer(family)("Hello world", add_special_tokens=False)["input_ids"] == ids


@pytest.mark.parametrize("spec", ["toy-gpt2", "toy-pythia", "toy-qwen3"])
def test_a_toys_bridge_keeps_the_tokenizer_transformer_lens_makes_of_the_default_one(spec):
    """A toy's tokenizer is loaded as the bridge keeps it (with a BOS token: add_bos_token=True, else as it is),
    so TransformerLens does not load it a second time: the bridge's tokenizer is the one TransformerLens makes of
    the tokenizer loaded with Hugging Face's defaults."""
    from lens_parallel.models import find_toy, wrap_hf_model

    toy = find_toy(spec)
    assert toy is not None
    theirs = wrap_hf_model(toy.build(), load_bundled_tokenizer(toy.tokenizer), name=spec).tokenizer
    ours = load_bundled_tokenizer(toy.tokenizer, for_bridge=True)
    assert type(ours) is type(theirs) and ours.init_kwargs == theirs.init_kwargs
    assert (ours.padding_side, ours.name_or_path) == (theirs.padding_side, theirs.name_or_path)
    for text in ("Hello world", "a\n\nb  c<|endoftext|>d"):
        assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert load_model(spec).tokenizer.init_kwargs == theirs.init_kwargs
    assert ours.init_kwargs.get("add_bos_token") is (True if ours.bos_token is not None else None)


def test_unknown_spec_names_what_is_accepted():
    with pytest.raises(ModelSpecError, match=r"unknown model spec 'toy-bert'.*accepted: toy-gpt2, toy-pythia"):
        load_model("toy-bert")
    with pytest.raises(ModelSpecError, match="non-empty string"):
        load_model("")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelSpecError, match=r"has no config.json.*save_pretrained"):
        load_model(str(tmp_path))


def test_folder_whose_config_is_not_json(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"],')
    with pytest.raises(ModelSpecError, match=r"config.json is not valid JSON"):
        load_model(str(tmp_path))


def test_folder_with_an_empty_config_or_no_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelSpecError, match=r"config.json names no model_type or architectures"):
        load_model(str(tmp_path))
    transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ModelSpecError, match=r"holds a config.json but no weights \(one of model.safetensors"):
        load_model(str(tmp_path))


def test_weights_digest_is_exact():
    """Every value counts: one value changed between any sampling stride's samples (through ``.data``, which no
    version counter sees) changes the digest; the same weights loaded twice give the same digest."""
    a, b = load_model("toy-qwen2"), load_model("toy-qwen2")
    assert weights_digest(a) == weights_digest(b)
    weight = b.original_model.model.embed_tokens.weight
    weight.data[1, 1] += 2**-10  # element 97 of a tensor a 4096-sample stride reads every 3,557th element of
    assert weights_digest(a) != weights_digest(b)
    weight.data[1, 1] -= 2**-10
    assert weights_digest(a) == weights_digest(b)
    b.original_model.model.norm.weight.data[0] = 2.0  # a small tensor (a norm's scale) counts too
    assert weights_digest(a) != weights_digest(b)


def test_bad_device_is_refused_before_loading():
    with pytest.raises(LensParallelError, match=r"unknown device 'gpu'; accepted: cpu, cuda"):
        load_model("toy-gpt2", device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(LensParallelError, match="no CUDA device"):
            load_model("toy-gpt2", device="cuda")


def test_architectures_left_out_are_refused_in_one_line_saying_why(tmp_path):
    """An encoder, and a model TransformerLens does not bridge, are refused before any weights load (the folder holds
    none), each in one line naming what it is."""
    transformers.BertConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, architectures=["BertForMaskedLM"]
    ).save_pretrained(tmp_path / "bert")
    with pytest.raises(ModelSpecError, match=r"BertForMaskedLM \(bert\) is left out: an encoder \(bidirectional"):
        load_model(str(tmp_path / "bert"))
    transformers.T5Config(num_layers=1, d_model=32, num_heads=2).save_pretrained(tmp_path / "t5")
    with pytest.raises(ModelSpecError, match=r"\(t5\): TransformerLens .* does not bridge it") as caught:
        load_model(str(tmp_path / "t5"))
    assert "\n" not in str(caught.value)


def test_hub_name_while_offline(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    offline = r"cannot load hub model 'openai-community/gpt2'.*offline.*local folder"
    with pytest.raises(EnvironmentFailure, match=offline):
        load_model("openai-community/gpt2")


def test_local_folder_loads_offline_and_matches_hf(tmp_path):
    """A model written by save_pretrained (here a seeded toy Qwen3) loads from its folder as the same model."""
    torch.manual_seed(5)
    hf = transformers.AutoModelForCausalLM.from_config(TOY_MODELS["toy-qwen3"].config()).eval()
    hf.save_pretrained(tmp_path)
    load_bundled_tokenizer("qwen3").save_pretrained(tmp_path)
    model = load_model(str(tmp_path))
    tokens = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.allclose(model(tokens), hf(tokens).logits, atol=1e-5)
    assert model_info(model).family == "qwen3" and model_info(model).name == str(tmp_path)
