"""Training configuration: model shape, data, optimiser, schedule, and the named presets."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import transformers

from lens_parallel.choices import Architecture, Precision
from lens_parallel.data import CORPORA
from lens_parallel.errors import LensParallelError
from lens_parallel.tokenizers import BUNDLED_TOKENIZERS
from lens_parallel.validate import literal_values

GATE_INIT = 0.5
"""The default removal gate of the ``learned-gate-layer`` arm at init (s_par = 0.5, as ``learned-gate`` starts): the
authors' ``train.py`` requires a ``xsa_forward_gate_init`` in (0, 1) for a learnable gate (its default 1.0 is
refused there), and the value of the paper's runs is not in the public code."""
ARCHITECTURES: tuple[Architecture, ...] = literal_values(Architecture)
PRECISIONS: tuple[Precision, ...] = literal_values(Precision)


@dataclass(frozen=True)
class TrainConfig:
    """A small causal LM and how to train it. Every field is JSON-serialisable; :meth:`digest` names the config.

    Model: ``architecture`` ``gpt2`` (learned positions, biases, LayerNorm, GELU MLP), ``gpt-neox`` (RoPE on every
    head dimension, LayerNorm, GELU MLP, sequential residual, biases) or ``qwen3`` (RoPE, RMSNorm, q/k
    norms, SwiGLU MLP, no biases, GQA when ``n_kv_heads < n_heads``); ``d_mlp`` defaults to 4 ``d_model``; embeddings
    are tied. A run sees :attr:`tokens_per_run` = steps x batch_size x seq_len tokens (:meth:`with_tokens`).
    Dropout is 0 (so a run is a deterministic function of its seed). ``tokenizer``: ``bpe-N`` trains a byte-level
    BPE of N tokens on ``texts`` (:func:`lens_parallel.tokenizers.trained_bpe_folder`) or a bundled tokenizer
    (``gpt2``, ``gpt-neox``, ``qwen3``). ``texts``: bundled corpora or ``hf:DATASET[:CONFIG[:SPLIT]]``.
    Optimiser: AdamW (betas 0.9, 0.95; no weight decay on biases, norms and gate parameters), linear warmup over
    ``warmup_steps`` then cosine decay to ``min_lr_ratio * lr`` at ``steps``, gradient-norm clipping at ``grad_clip``.
    ``device``/``precision`` ``auto``: CUDA with bf16 autocast when available, else CPU in float32.
    ``gate_init``: the removal gate sigmoid(b) of the ``learned-gate-layer`` arm at init, in (0, 1) (no other arm
    reads it; :meth:`to_dict` and the digest name it only when it is not the default, so earlier configs keep their
    digests).

    Examples:
        >>> import lens_parallel as lp
        >>> lp.TrainConfig(n_layers=2, d_model=64).n_layers
        2
    """

    architecture: Architecture = "gpt2"
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_model: int = 128
    d_mlp: int | None = None
    seq_len: int = 128
    tokenizer: str = "bpe-4096"
    texts: tuple[str, ...] = ("wikipedia-en", "austen", "moby-dick")
    n_val_blocks: int = 64
    batch_size: int = 16
    steps: int = 400
    lr: float = 3e-3
    warmup_steps: int = 40
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    checkpoint_every: int = 50
    device: str = "auto"
    precision: Precision = "auto"
    gate_init: float = GATE_INIT

    def __post_init__(self) -> None:
        object.__setattr__(self, "texts", (self.texts,) if isinstance(self.texts, str) else tuple(self.texts))
        problems: list[str] = []
        if self.architecture not in ARCHITECTURES:
            problems.append(f"architecture {self.architecture!r} (accepted: {', '.join(ARCHITECTURES)})")
        for name in ("n_layers", "n_heads", "d_model", "batch_size", "steps", "eval_every", "checkpoint_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)!r} (a positive integer)")
        if self.seq_len < 2:
            problems.append(f"seq_len={self.seq_len} (>= 2)")
        if self.d_model % self.n_heads:
            problems.append(f"d_model={self.d_model} (a multiple of n_heads={self.n_heads})")
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv or (self.architecture != "qwen3" and kv != self.n_heads):
            problems.append(f"n_kv_heads={self.n_kv_heads} (divides n_heads; GQA needs architecture='qwen3')")
        tok_ok = self.tokenizer in BUNDLED_TOKENIZERS or (
            self.tokenizer.startswith("bpe-") and self.tokenizer[4:].isdigit() and int(self.tokenizer[4:]) > 256
        )
        if not tok_ok:
            problems.append(f"tokenizer {self.tokenizer!r} (bpe-N with N > 256, or one of {BUNDLED_TOKENIZERS})")
        bad_texts = [t for t in self.texts if t not in CORPORA and not t.startswith("hf:")]
        if bad_texts or not self.texts:
            problems.append(f"texts {list(self.texts)} (bundled corpora {', '.join(CORPORA)} or hf:DATASET)")
        if not isinstance(self.n_val_blocks, int) or self.n_val_blocks < 1:
            problems.append(f"n_val_blocks={self.n_val_blocks!r} (a positive integer)")
        if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps < self.steps:
            problems.append(f"warmup_steps={self.warmup_steps!r} (an integer, 0 <= warmup_steps < steps)")
        ranges: dict[str, tuple[float, str, Callable[[float], bool]]] = {
            "lr": (self.lr, "a finite number > 0", lambda x: x > 0),
            "min_lr_ratio": (self.min_lr_ratio, "a finite number in [0, 1]", lambda x: 0 <= x <= 1),
            "weight_decay": (self.weight_decay, "a finite number >= 0", lambda x: x >= 0),
            "grad_clip": (self.grad_clip, "a finite number > 0", lambda x: x > 0),
            "gate_init": (self.gate_init, "a finite number strictly between 0 and 1", lambda x: 0 < x < 1),
        }
        for name, (value, accepted, ok) in ranges.items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not math.isfinite(value) or not ok(float(value)):
                problems.append(f"{name}={value!r} ({accepted})")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            problems.append(f"device {self.device!r} (auto, cpu or cuda[:N])")
        if self.precision not in PRECISIONS:
            problems.append(f"precision {self.precision!r} (accepted: {', '.join(PRECISIONS)})")
        if problems:
            raise LensParallelError("invalid TrainConfig: " + "; ".join(problems))

    @property
    def tokens_per_run(self) -> int:
        """Training tokens one run sees: steps x batch_size x seq_len."""
        return self.steps * self.batch_size * self.seq_len

    def with_tokens(self, tokens: int) -> TrainConfig:
        """This config with ``steps`` = the whole number of batches in ``tokens`` (rounded down, as the
        sanity-checks paper did: 399,900,672 = 3051 batches of 128 x 1024)."""
        steps = int(tokens) // (self.batch_size * self.seq_len)
        if steps <= self.warmup_steps:
            raise LensParallelError(
                f"{tokens} tokens make {steps} steps of {self.batch_size} x {self.seq_len} tokens: not more than "
                f"warmup_steps={self.warmup_steps}"
            )
        return dataclasses.replace(self, steps=steps)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> TrainConfig:
        """The config :meth:`to_dict` wrote (texts back to a tuple)."""
        return cls(**(fields | {"texts": tuple(fields["texts"])}))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["texts"] = list(self.texts)
        if self.gate_init == GATE_INIT:  # added in 0.12.0: earlier configs keep their digest and plans
            del out["gate_init"]
        return out

    def digest(self) -> str:
        """A short hash of the fields that change what is trained (not device or precision)."""
        fields = {k: v for k, v in self.to_dict().items() if k not in ("device", "precision")}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]

    def hf_config(self, vocab_size: int, boundary_id: int) -> transformers.PretrainedConfig:
        """The Hugging Face config of the model (dropout 0, tied embeddings)."""
        d_mlp = self.d_mlp or 4 * self.d_model
        if self.architecture == "gpt2":
            return transformers.GPT2Config(
                n_layer=self.n_layers,
                n_embd=self.d_model,
                n_head=self.n_heads,
                n_inner=d_mlp,
                n_positions=self.seq_len,
                vocab_size=vocab_size,
                bos_token_id=boundary_id,
                eos_token_id=boundary_id,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                tie_word_embeddings=True,
            )
        if self.architecture == "gpt-neox":
            return transformers.GPTNeoXConfig(
                num_hidden_layers=self.n_layers,
                hidden_size=self.d_model,
                num_attention_heads=self.n_heads,
                intermediate_size=d_mlp,
                rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 1.0, "rope_type": "default"},
                use_parallel_residual=False,
                attention_bias=True,  # TransformerLens's NeoX bridge splits a fused qkv bias
                max_position_embeddings=self.seq_len,
                vocab_size=vocab_size,
                tie_word_embeddings=True,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                bos_token_id=boundary_id,
                eos_token_id=boundary_id,
            )
        return transformers.Qwen3Config(
            num_hidden_layers=self.n_layers,
            hidden_size=self.d_model,
            num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_kv_heads or self.n_heads,
            head_dim=self.d_model // self.n_heads,
            intermediate_size=d_mlp,
            max_position_embeddings=self.seq_len,
            vocab_size=vocab_size,
            tie_word_embeddings=True,
            attention_bias=False,
            attention_dropout=0.0,
            bos_token_id=boundary_id,
            eos_token_id=boundary_id,
        )


PRESETS: dict[str, TrainConfig] = {
    "tiny": TrainConfig(
        n_layers=2,
        n_heads=2,
        d_model=32,
        seq_len=32,
        tokenizer="bpe-512",
        texts=("austen",),
        n_val_blocks=8,
        batch_size=4,
        steps=12,
        warmup_steps=2,
        eval_every=4,
        checkpoint_every=5,
    ),
    "cpu-small": TrainConfig(steps=360, eval_every=40, checkpoint_every=40),
    "qwen3-59m": TrainConfig(
        architecture="qwen3",
        n_layers=8,
        n_heads=8,
        d_model=512,
        seq_len=512,
        tokenizer="gpt2",
        n_val_blocks=256,
        batch_size=64,
        steps=5000,
        lr=1e-3,
        warmup_steps=250,
        eval_every=250,
        checkpoint_every=250,
    ),
    "xsa-controls-51m": TrainConfig(
        architecture="gpt-neox",
        n_layers=8,
        n_heads=8,
        d_model=512,
        seq_len=1024,
        tokenizer="gpt2",
        texts=("hf:HuggingFaceFW/fineweb-edu:sample-10BT",),
        n_val_blocks=4096,
        batch_size=128,
        steps=3051,
        lr=6e-4,
        warmup_steps=200,
        min_lr_ratio=0.1,
        weight_decay=0.1,
        grad_clip=1.0,
        eval_every=250,
        checkpoint_every=250,
    ),
}
"""``tiny``: tests (a few seconds). ``cpu-small``: GPT-2 style, 4 layers x 4 heads, d_model 128, a 4096-token BPE,
~1.5M parameters, 360 steps of 16 x 128 tokens (~0.9 epoch of the bundled English texts), 161-267 s a run on one
CPU thread (measured). ``qwen3-59m``: Qwen3 style (RoPE, RMSNorm, SwiGLU, no biases, tied embeddings), 8 layers x 8
heads, d_model 512, the GPT-2 tokenizer: 59.3M parameters (the SwiGLU MLP has three matrices); give it a large
corpus (``texts=("hf:...",)``) on a GPU. ``xsa-controls-51m``: the sanity-checks paper's factorial model (8 layers,
8 heads, width 512, RoPE, GELU MLP, tied embeddings, 1024-token blocks): 50.95M parameters with the GPT-2 tokenizer
(the paper's 50.93M has no biases and a vocabulary padded to 50304; TransformerLens's NeoX bridge needs the qkv
bias); AdamW lr 6e-4 (betas 0.9,
0.95), 200 warmup steps, cosine to 10%, weight decay 0.1, clipping 1.0, 3051 steps of 128 x 1024 tokens =
399,900,672 tokens per run; FineWeb-Edu sample-10BT (hub, online)."""
