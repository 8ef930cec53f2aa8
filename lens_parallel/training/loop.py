"""Train one arm with one seed: data, model, AdamW with warmup + cosine, validation curve, exact resume.

A run is a deterministic function of (config, arm, seed): the model initialisation and the data order depend on
the seed only (identical across arms), dropout is 0, and the random directions depend on the layer only. A run
writes ``checkpoint.pt`` every ``checkpoint_every`` steps (model, arm parameters, optimiser, curves, RNG state);
calling :func:`train` again on the same folder resumes from it and ends bit-identical to an uninterrupted run.
A finished run leaves ``run.json``/``run.npz`` (the :class:`TrainRun`) and ``model/`` (a Hugging Face folder that
:func:`lens_parallel.load_model` loads, plus the arm's parameters for :func:`load_trained`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
import transformers
from jaxtyping import Int
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens.model_bridge import TransformerBridge
from transformers import PreTrainedTokenizerBase

from lens_parallel.analyses.evaluate import document_losses
from lens_parallel.choices import CurveLoss
from lens_parallel.data import boundary_token, load_texts, stream_blocks
from lens_parallel.edits import Edit, LearnedGate, apply_edits, compile_hooks
from lens_parallel.errors import LensParallelError, kept_in, long_call
from lens_parallel.hooks import Hook, forward, hook_name
from lens_parallel.losses import chunked_token_nll, unembedding
from lens_parallel.models import export_hf_model, load_model, model_info, wrap_hf_model
from lens_parallel.plots.training import training_curves
from lens_parallel.results import Provenance, ResultMixin
from lens_parallel.tokenizers import BUNDLED_TOKENIZERS, load_bundled_tokenizer, trained_bpe_folder
from lens_parallel.training.arms import ArmParameters, check_arms
from lens_parallel.training.config import TrainConfig
from lens_parallel.validate import check_choice

VAL_SPLIT_SEED = 0
"""The validation blocks are the same for every seed and arm: the first ``n_val_blocks`` of a permutation seeded
with this."""
ARM_FILE = "lens_parallel_arm.pt"


@dataclass(frozen=True, repr=False)
class TrainRun(ResultMixin):
    """One finished run: validation loss (nats/token) at ``eval_steps``, training loss per step, learned gates.

    ``gates``: ``[layer, head_index]``, g = tanh(alpha) for the gated arms, the mean of s_par = sigmoid(w.x + b) over
    validation tokens for ``learned-gate`` (``gate_std`` its std), else None. ``device_type`` / ``precision``: where
    and how it was trained (``cpu``/``cuda``; ``float32``/``bfloat16``), part of the run's identity
    (:func:`run_identity`).

    Examples:
        >>> import lens_parallel as lp
        >>> config = lp.TrainConfig(n_layers=1, d_model=32, steps=2, warmup_steps=0)
        >>> run = lp.train(config, "baseline", 0, out="runs/tiny", progress=False)
        >>> fig = run.figure()
        >>> run.arm
        'baseline'
    """

    columns: ClassVar[str] = "arm seed step val_loss model final_val_loss n_params steps wall_s"

    arm: str
    seed: int
    config: dict[str, Any]
    device_type: str
    precision: str
    eval_steps: np.ndarray
    val_loss: np.ndarray
    train_loss: np.ndarray
    gates: np.ndarray | None
    gate_std: np.ndarray | None
    n_params: int
    wall_s: float
    model_dir: str
    provenance: Provenance

    @property
    def final_val_loss(self) -> float:
        return float(self.val_loss[-1])

    def to_dataframe(self) -> pd.DataFrame:
        """One row per evaluation: arm, seed, step, val_loss."""
        return pd.DataFrame({"arm": self.arm, "seed": self.seed, "step": self.eval_steps, "val_loss": self.val_loss})

    def train_curve(self) -> pd.DataFrame:
        """One row per optimiser step: arm, seed, step (1 = after the first update), train_loss (the step's batch
        loss, nats/token, before its update)."""
        steps = np.arange(1, len(self.train_loss) + 1)
        return pd.DataFrame({"arm": self.arm, "seed": self.seed, "step": steps, "train_loss": self.train_loss})

    def curve(self, loss: CurveLoss = "validation") -> pd.DataFrame:
        """:meth:`to_dataframe` (validation) or :meth:`train_curve` (training)."""
        check_choice("loss", loss, CurveLoss)
        return self.to_dataframe() if loss == "validation" else self.train_curve()

    def summary(self) -> pd.DataFrame:
        """One row: the run's final validation loss, its size and its wall time."""
        row = {
            "model": self.info.name,
            "arm": self.arm,
            "seed": self.seed,
            "final_val_loss": self.final_val_loss,
            "n_params": self.n_params,
            "steps": int(self.config["steps"]),
            "wall_s": self.wall_s,
        }
        return pd.DataFrame([row])

    def figure(self, *, loss: CurveLoss = "validation", smooth: int = 1) -> go.Figure:
        """The run's ``loss`` curve (``smooth``: running mean over that many points)."""
        return training_curves(self.curve(loss), title=f"{self.arm}, seed {self.seed}", smooth=smooth)


def check_seed(seed: object) -> int:
    """A training seed: an integer >= 0 (numpy's generators take no negative seed)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise LensParallelError(f"a training seed must be an integer >= 0, got {seed!r}")
    return int(seed)


def run_identity(config: TrainConfig, arm: str, seed: int, device: str, bf16: bool) -> dict[str, Any]:
    """What makes two runs the same run: the config's digest, arm, seed, and the resolved device type and precision
    (a bf16 or GPU run is not the float32 CPU run; resuming or pairing across them is refused)."""
    precision = "bfloat16" if bf16 else "float32"
    return {
        "config": config.digest(),
        "arm": arm,
        "seed": seed,
        "device_type": device.split(":")[0],
        "precision": precision,
    }


def runtime(config: TrainConfig) -> tuple[str, bool]:
    """(device, bf16 autocast?) for a config's ``device`` and ``precision``."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise LensParallelError(f"device {config.device!r} asked for, but torch sees no CUDA device; use device='cpu'")
    bf16 = config.precision == "bfloat16" or (config.precision == "auto" and device.startswith("cuda"))
    if bf16 and not device.startswith("cuda"):
        raise LensParallelError("precision='bfloat16' (autocast) is only used on CUDA; use precision='float32' on CPU")
    return device, bf16


TrainingData = tuple[PreTrainedTokenizerBase, Int[Tensor, "train_block pos"], Int[Tensor, "val_block pos"]]
"""(tokenizer, train blocks ``[n, seq_len]``, validation blocks ``[n_val_blocks, seq_len]``)."""


@functools.lru_cache(maxsize=2)
def _data(tokenizer_spec: str, texts: tuple[str, ...], seq_len: int, n_val: int) -> TrainingData:
    docs = [doc for name in texts for doc in load_texts(name)]
    if tokenizer_spec in BUNDLED_TOKENIZERS:
        tokenizer = load_bundled_tokenizer(tokenizer_spec)
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(trained_bpe_folder(docs, int(tokenizer_spec[4:])))
    blocks = stream_blocks(tokenizer, docs, seq_len=seq_len)
    if n_val >= len(blocks):
        raise LensParallelError(f"n_val_blocks={n_val} leaves no training blocks: the texts give {len(blocks)} blocks")
    order = torch.from_numpy(np.random.default_rng(VAL_SPLIT_SEED).permutation(len(blocks)))
    return tokenizer, blocks[order[n_val:]], blocks[order[:n_val]]


def training_data(config: TrainConfig) -> TrainingData:
    """(tokenizer, train blocks ``[n, seq_len]``, validation blocks ``[n_val_blocks, seq_len]``) for a config."""
    return _data(config.tokenizer, config.texts, config.seq_len, config.n_val_blocks)


def batch_indices(step: int, *, batch_size: int, n_train: int, seed: int) -> Int[Tensor, " batch"]:
    """The training blocks of ``step``: epoch e is ``default_rng([seed, e]).permutation(n_train)``, read in order
    (a function of the seed and step only, so arms share it and a resumed run continues it)."""
    idx = np.arange(step * batch_size, (step + 1) * batch_size)
    epochs = idx // n_train
    perms = {e: np.random.default_rng([seed, int(e)]).permutation(n_train) for e in np.unique(epochs)}
    return torch.tensor([perms[e][i % n_train] for e, i in zip(epochs, idx, strict=True)], device="cpu")


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr`` at ``steps``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_model(config: TrainConfig, *, seed: int, device: str = "cpu") -> TransformerBridge:
    """The untrained model of ``config`` with weights seeded by ``seed`` (a bridge around a fresh HF model)."""
    tokenizer, _, _ = training_data(config)
    _, boundary_id = boundary_token(tokenizer)
    hf_config = config.hf_config(len(tokenizer), boundary_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    return wrap_hf_model(hf_model, tokenizer, name=f"train-{config.architecture}-{config.digest()}", device=device)


def _optimizer(model: TransformerBridge, arm: ArmParameters, config: TrainConfig) -> torch.optim.AdamW:
    weights = list(model.original_model.parameters())
    groups = [
        {"params": [p for p in weights if p.ndim >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in weights if p.ndim < 2] + list(arm.parameters()), "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95))


def _save_atomic(obj: object, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)
    kept_in(path)


def _gate_statistics(
    model: TransformerBridge, arm: ArmParameters, val: Tensor
) -> tuple[np.ndarray | None, np.ndarray | None]:
    gates = arm.gates()
    if gates is not None:
        return gates.numpy(), None
    edits = arm.edits()
    if not edits or not isinstance(edits[0], LearnedGate):
        return None, None
    names = [hook_name(layer, "resid_pre") for layer in range(model.cfg.n_layers)]
    with torch.inference_mode(), apply_edits(model, edits):
        _, cache = model.run_with_cache(val, names_filter=names)
        s = torch.stack([edits[0].scale(cache[name], layer) for layer, name in enumerate(names)])  # layer b p h
    flat = s.flatten(1, 2).double()
    return flat.mean(1).cpu().numpy(), flat.std(1).cpu().numpy()


def _run_mismatch(what: Path, found: dict[str, Any], expected: dict[str, Any]) -> LensParallelError:
    differ = ", ".join(f"{k} {found.get(k)!r} (this run: {v!r})" for k, v in expected.items() if found.get(k) != v)
    return LensParallelError(f"{what} belongs to another run ({differ}): use another folder")


def _finished_run(out: Path, identity: dict[str, Any]) -> TrainRun | None:
    """The finished run saved in ``out``, if any, after checking that it is this run (:func:`run_identity`)."""
    if not (out / "run.json").is_file():
        return None
    try:
        run = TrainRun.load(out / "run")
    except LensParallelError as exc:
        raise LensParallelError(
            f"the finished run in {out} cannot be read ({exc}); delete {out} to train it again"
        ) from exc
    found = {
        "config": TrainConfig.from_dict(run.config).digest(),
        "arm": run.arm,
        "seed": run.seed,
        "device_type": run.device_type,
        "precision": run.precision,
    }
    if found != identity:
        raise _run_mismatch(out / "run.json", found, identity)
    return run


@dataclass
class _Trainer:
    """The live state of one run: model, arm parameters, optimiser and the curves so far."""

    config: TrainConfig
    arm: str
    seed: int
    device: str
    bf16: bool
    model: TransformerBridge
    params: ArmParameters
    optimizer: torch.optim.AdamW
    state: dict[str, Any]

    @classmethod
    def start(cls, config: TrainConfig, arm: str, seed: int, device: str, bf16: bool) -> _Trainer:
        model = build_model(config, seed=seed, device=device)
        params = ArmParameters(arm, model_info(model), gate_init=config.gate_init).to(device)
        optimizer = _optimizer(model, params, config)
        state = {"step": 0, "train_loss": [], "evals": [], "wall_s": 0.0}
        return cls(config, arm, seed, device, bf16, model, params, optimizer, state)

    @property
    def identity(self) -> dict[str, Any]:
        return run_identity(self.config, self.arm, self.seed, self.device, self.bf16)

    def resume(self, ckpt: Path) -> None:
        """Restore model, gates, optimiser, RNG and curves from ``ckpt`` (refusing another run's checkpoint, one
        that does not record its device and precision, or a damaged one)."""
        restart = f"delete {ckpt} to restart this run from step 0"
        try:
            saved = torch.load(ckpt, map_location=self.device, weights_only=True)
        except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as exc:
            raise LensParallelError(f"{ckpt} is damaged ({str(exc).splitlines()[0]}); {restart}") from exc
        if not isinstance(saved, dict) or "identity" not in saved:
            raise LensParallelError(
                f"{ckpt} was written by an older lens_parallel that did not record the device and precision it "
                f"trained in, so resuming it could mix precisions; {restart}"
            )
        if saved["identity"] != self.identity:
            raise _run_mismatch(ckpt, saved["identity"], self.identity)
        try:
            self.model.original_model.load_state_dict(saved["model"])
            self.params.load_state_dict(saved["arm_params"])
            self.optimizer.load_state_dict(saved["optimizer"])
            torch.set_rng_state(saved["rng"])
            self.state = saved["state"]
        except (KeyError, RuntimeError, ValueError) as exc:
            raise LensParallelError(f"{ckpt} is damaged (no usable {exc}); {restart}") from exc

    def checkpoint(self, ckpt: Path) -> None:
        payload = {
            "identity": self.identity,
            "state": self.state,
            "model": self.model.original_model.state_dict(),
            "arm_params": self.params.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
        }
        _save_atomic(payload, ckpt)

    def val_loss(self, val: Tensor) -> float:
        return document_losses(self.model, val, self.params.edits(), batch_size=self.config.batch_size).loss

    def step(self, batch: Tensor, hooks: list[Hook], autocast: contextlib.AbstractContextManager[Any]) -> float:
        """One optimiser step at the scheduled learning rate; returns the training loss (nats/token)."""
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.state["step"], self.config)
        self.model.train()
        with autocast:
            final = forward(self.model, batch, hooks, grad=True)
            assert final is not None  # no training hook ends the forward early
            loss = chunked_token_nll(final, unembedding(self.model), batch).sum() / batch[:, 1:].numel()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip)
        self.optimizer.step()
        self.model.eval()
        return float(loss.detach())

    def finish(self, out: Path, val: Tensor, n_train: int) -> TrainRun:
        """Final validation, gate statistics, the saved model and the saved :class:`TrainRun`."""
        self.state["evals"].append((self.config.steps, self.val_loss(val)))
        gates, gate_std = _gate_statistics(self.model, self.params, val)
        model_dir = out / "model"
        save_trained(self.model, self.params, model_dir)
        steps, losses = zip(*self.state["evals"], strict=True)
        provenance = Provenance.of(
            model_info(self.model),
            val,
            "train",
            {"config": self.config.to_dict()},
            None,
            arm=self.arm,
            seed=self.seed,
            device=self.device,
            bf16=self.bf16,
        )
        texts = {
            "corpora": list(self.config.texts),
            "tokenizer": self.config.tokenizer,
            "n_train_blocks": n_train,
            "n_val_blocks": len(val),
            "split_seed": VAL_SPLIT_SEED,
        }
        run = TrainRun(
            arm=self.arm,
            seed=self.seed,
            config=self.config.to_dict(),
            device_type=self.identity["device_type"],
            precision=self.identity["precision"],
            eval_steps=np.array(steps),
            val_loss=np.array(losses),
            train_loss=np.array(self.state["train_loss"]),
            gates=gates,
            gate_std=gate_std,
            n_params=sum(p.numel() for p in self.model.original_model.parameters()),
            wall_s=self.state["wall_s"],
            model_dir=str(model_dir),
            provenance=dataclasses.replace(provenance, texts=texts),
        )
        run.save(out / "run")
        return run


@long_call
def train(
    config: TrainConfig,
    arm: str,
    seed: int,
    *,
    out: str | Path,
    progress: bool = True,
    callback: Callable[[int, float], None] | None = None,
) -> TrainRun:
    """Train ``arm`` with ``seed`` into folder ``out`` (resuming from its checkpoint, or returning its finished run
    after checking that it is this run: config, arm, seed, and the device type and precision ``config`` resolves to
    here, :func:`run_identity`).

    ``callback(step, train_loss)`` is called after every optimiser step (``step`` counts finished steps).

    Examples:
        >>> import lens_parallel as lp
        >>> config = lp.TrainConfig(n_layers=1, d_model=32, steps=2, warmup_steps=0)
        >>> run = lp.train(config, "baseline", 0, out="runs/tiny", progress=False)
    """
    (arm,) = check_arms(arm)
    seed = check_seed(seed)
    out = Path(out)
    device, bf16 = runtime(config)
    if (finished := _finished_run(out, run_identity(config, arm, seed, device, bf16))) is not None:
        return finished
    _, train_blocks, val_blocks = training_data(config)
    trainer = _Trainer.start(config, arm, seed, device, bf16)
    ckpt = out / "checkpoint.pt"
    if ckpt.is_file():
        trainer.resume(ckpt)
    out.mkdir(parents=True, exist_ok=True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    hooks = compile_hooks(trainer.model, trainer.params.edits())
    val, state = val_blocks.to(device), trainer.state
    bar = tqdm(total=config.steps, initial=state["step"], desc=f"train {arm} seed {seed}", disable=not progress)
    start = time.perf_counter() - state["wall_s"]
    while state["step"] < config.steps:
        step = state["step"]
        if step % config.eval_every == 0:
            state["evals"].append((step, trainer.val_loss(val)))
        rows = batch_indices(step, batch_size=config.batch_size, n_train=len(train_blocks), seed=seed)
        state["train_loss"].append(trainer.step(train_blocks[rows].to(device), hooks, autocast))
        state["step"] = step + 1
        state["wall_s"] = time.perf_counter() - start
        bar.update(1)
        bar.set_postfix(loss=f"{state['train_loss'][-1]:.3f}", val=f"{state['evals'][-1][1]:.3f}")
        if state["step"] % config.checkpoint_every == 0 and state["step"] < config.steps:
            trainer.checkpoint(ckpt)
        if callback is not None:
            callback(state["step"], state["train_loss"][-1])
    bar.close()
    run = trainer.finish(out, val, len(train_blocks))
    ckpt.unlink(missing_ok=True)
    return run


def save_trained(model: TransformerBridge, arm: ArmParameters, folder: str | Path) -> Path:
    """Write a trained model as a Hugging Face folder (weights, config, tokenizer) plus its arm's parameters."""
    folder = Path(folder)
    export_hf_model(cast(transformers.PreTrainedModel, model.original_model)).save_pretrained(folder)
    model.tokenizer.save_pretrained(folder)
    torch.save({"arm": arm.arm, "state": arm.state_dict()}, folder / ARM_FILE)
    (folder / "lens_parallel_arm.json").write_text(json.dumps({"arm": arm.arm}))
    return folder


def load_trained(folder: str | Path, *, device: str = "cpu") -> tuple[TransformerBridge, list[Edit]]:
    """A model written by :func:`train` and the edits of the arm it was trained with: ``model`` alone is the
    plain architecture; ``apply_edits(model, edits)`` is the model as it was trained. Its name (titles,
    provenance) is the run's ``<arm>/seed<k>`` when the folder is where :func:`train` put it, not a path."""
    model = load_model(str(folder), device=device)
    folder = Path(folder)
    if folder.name == "model" and folder.parent.name.startswith("seed"):
        model.cfg.model_name = f"{folder.parent.parent.name}/{folder.parent.name}"
    saved = torch.load(Path(folder) / ARM_FILE, map_location=device, weights_only=True)
    params = ArmParameters(saved["arm"], model_info(model)).to(device)
    params.load_state_dict(saved["state"])
    return model, params.edits()
