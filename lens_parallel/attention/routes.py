"""The routes into TransformerLens and Hugging Face by which lens_parallel's attention serves a layer, and the
policy that picks one per layer (or says why TransformerLens's forward keeps it).

- **The module route** (TransformerLens's ``PositionEmbeddingsAttentionBridge`` and its subclasses: Llama, Mistral,
  Qwen 2/3/3.5, Gemma, OLMo, Cohere, ...): the component's forward becomes TransformerLens's generic one (hook_in,
  the Hugging Face module, hook_out), so the module makes its queries, keys and values as Hugging Face does (rotary
  of either layout, query/key norms wherever they sit, key multipliers, Llama 4's query scaling, the output gate)
  and hands them to transformers' attention interface, which lens_parallel registers
  (:func:`interface_attention`): hook_q, hook_k, hook_v and hook_z fire as the module calls the bridge's
  projections, hook_rot_q / hook_rot_k and hook_cos / hook_sin here. A hook on a point the route does not fire as
  TransformerLens does (hook_q_normed, hook_q_gate, the norms' own) runs that layer on TransformerLens's forward.
- **The interface route** (TransformerLens's generic ``AttentionBridge``: GPT-J, OPT, Llama 4, Jamba, ...): the
  module already hands its attention to the interface; lens_parallel computes it, so hook_pattern fires inside the
  forward (TransformerLens's own fires it after the fact, read-only).
- **The joint route** (the joint-QKV bridges: GPT-2, GPT-NeoX, Falcon, Phi-3, GPTBigCode, Bloom, MPT): their Hugging
  Face module calls one fused projection, so it cannot fire their q/k/v hooks, and TransformerLens's
  ``_reconstruct_attention`` writes the attention inline (no function to substitute): the smallest copy of it,
  pinned (:data:`ATTENTION_SOURCES`), calls the bridge's own steps in its order around lens_parallel's attention
  (:func:`_joint_attention`).

Fully masked rows, dropout while training and the options only TransformerLens's forward serves (compatibility
mode, split q/k/v inputs, per-head results) take TransformerLens's forward at that call.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
from collections.abc import Mapping
from typing import Any, ClassVar, cast

import einops
import torch
from torch import nn
from transformer_lens.hook_points import HookPoint
from transformer_lens.utilities.attention import clamp_qkv

from lens_parallel import architectures, compat
from lens_parallel.attention.features import Source
from lens_parallel.attention.features.base import source_names
from lens_parallel.attention.paths import chosen_path
from lens_parallel.attention.rows import STEP_VALUES
from lens_parallel.attention.site import SITE, AttentionSite, site_of
from lens_parallel.attention.spec import ScoreSpec
from lens_parallel.errors import LibraryError

INTERFACE = "lens_parallel"
"""The name lens_parallel registers with transformers' attention interface (and its mask interface, as SDPA's)."""
ROUTE_FIRES = frozenset(
    {"hook_in", "hook_out", "hook_attn_scores", "hook_pattern", "hook_rot_q", "hook_rot_k", "hook_cos", "hook_sin"}
)
"""The hook points of a PositionEmbeddingsAttentionBridge that the module route fires itself (its projections'
hook points, :data:`ROUTE_PROJECTIONS`, fire as the module calls them); less what a feature leaves unfired
(:meth:`~lens_parallel.attention.features.Feature.unfired`)."""
ROUTE_PROJECTIONS = frozenset("qkvo")
"""The bridge's submodules whose hook points fire on the module route as on TransformerLens's forward."""


class _Route:
    """How lens_parallel's attention reaches a layer (:class:`~lens_parallel.attention.site.Route`): its ``label``
    (:attr:`~lens_parallel.ModelInfo.attention_paths`), the scores' scale and layer index it reads (:meth:`scale`,
    :meth:`layer`), how it is put in place (:meth:`install`) and what it hands the attention (:meth:`handed`). As
    written here, the interface route (module docstring); the others differ where they say."""

    label: ClassVar[str] = "lens_parallel: the module's q, k, v"
    pattern_after: ClassVar[bool] = True
    """Whether TransformerLens's own forward fires hook_pattern after the attention ran (its generic bridge)."""
    fires_rotary: ClassVar[bool] = False
    """Whether the layer fires hook_rot_q / hook_rot_k (TransformerLens's joint rotary bridge and generic bridge
    declare them and never fire them)."""

    def scale(self, source: Source) -> float:
        """The scores' scale: the module's own (``scaling``), 1.0 where its forward scales the queries itself and
        hands the interface ``scaling=1.0`` (OPT)."""
        if source_names(type(source.module).forward, "scaling=1.0"):
            return 1.0
        scaling = getattr(source.module, "scaling", None)
        return float(scaling) if scaling is not None else float(source.bridged.d_head) ** -0.5

    def layer(self, source: Source) -> int | None:
        return getattr(source.module, "layer_idx", None)

    def install(self, site: AttentionSite) -> None:
        """Put the route in place (the module already calls the interface: nothing)."""

    def handed(self, site: AttentionSite, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries and keys as the attention reads them, from what the module handed the interface."""
        return query, key


class _ModuleRoute(_Route):
    """The module route (module docstring)."""

    pattern_after: ClassVar[bool] = False
    fires_rotary: ClassVar[bool] = True

    def install(self, site: AttentionSite) -> None:
        fired = ROUTE_FIRES - site.spec.unfired()
        points = [point for name, point in site.component.named_children() if name in fired]
        for name, projection in site.component.named_children():
            points.extend(projection.modules() if name in ROUTE_PROJECTIONS else ())
        site.unfired = tuple(
            p for p in site.component.modules() if isinstance(p, HookPoint) and not any(p is q for q in points)
        )
        compat.install_step(site.component, "forward", functools.partial(_module_forward, site))

    def handed(self, site: AttentionSite, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hook_rot_q on the queries, hook_rot_k on the new keys (the last ``query_pos`` of the keys: the module's
        cache holds the earlier ones), ``[batch, head_index, pos, d_head]`` as TransformerLens's forward fires them;
        not where a feature leaves them unfired, nor on a layer without them (NoPE)."""
        if "hook_rot_q" in site.spec.unfired() or not site.fires_rotary:
            return query, key
        component = site.component
        query = component.hook_rot_q(query)
        new = key[:, :, -query.shape[2] :]
        hooked = component.hook_rot_k(new)
        return query, key if hooked is new else torch.cat([key[:, :, : -query.shape[2]], hooked], dim=2)


class _JointRoute(_Route):
    """The joint route (module docstring); ``rotary``: the bridge applies rotary (GPT-NeoX, Falcon, Phi-3)."""

    label: ClassVar[str] = "lens_parallel"
    pattern_after: ClassVar[bool] = False

    def __init__(self, rotary: bool) -> None:
        self.rotary = rotary

    def scale(self, source: Source) -> float:
        """The bridge's softmax scale (MPT's), else 1 / sqrt(d_head), divided by the layer's number where GPT-2
        scales by the inverse layer index."""
        scale = compat.bridge_attribute(source.component, "softmax_scale") or float(source.bridged.d_head) ** -0.5
        layer = compat.bridge_attribute(source.component, "layer")
        if not self.rotary and getattr(source.bridged, "scale_attn_by_inverse_layer_idx", False) and layer is not None:
            scale /= float(layer + 1)
        return float(scale)

    def layer(self, source: Source) -> int | None:
        return cast(int | None, compat.bridge_attribute(source.component, "layer"))

    def install(self, site: AttentionSite) -> None:
        compat.install_step(site.component, "reconstruction", functools.partial(_joint_attention, site, self.rotary))


def _route(source: Source) -> _Route:
    """The route that would serve the layer (:func:`_reasons` says whether one can)."""
    classes = compat.bridge_classes()
    if isinstance(source.component, classes.position):
        return _ModuleRoute()
    if type(source.component).forward is classes.generic.forward:
        return _Route()
    return _JointRoute(isinstance(source.component, classes.joint_rotary))


def _reasons(source: Source, spec: ScoreSpec) -> list[str]:
    """Why lens_parallel's attention cannot take the layer (none: it can): its module not computing its attention
    through the attention interface, or with projections that are not the bridge's; a bridge class no route
    follows; not causal self-attention; a feature's own reason; GPT-2's float32 upcast."""
    component, module, config = source.component, source.module, getattr(source.module, "config", None)
    classes = compat.bridge_classes()
    generic = type(component).forward is classes.generic.forward
    position = isinstance(component, classes.position)
    children = list(module.children())
    joint = (classes.joint, classes.joint_rotary, classes.bloom, classes.mpt)
    checks = [
        (
            f"{type(module).__name__} computes its attention itself, not through transformers' attention interface"
            + (" (TransformerLens's generic AttentionBridge calls it whole)" if generic else ""),
            (generic or position) and not source_names(type(module).forward, "ALL_ATTENTION_FUNCTIONS"),
        ),
        (
            f"{type(module).__name__} fires hook_pattern itself (accepts_pattern_fn)",
            generic and bool(getattr(module, "accepts_pattern_fn", False)),
        ),
        (
            f"{type(component).__name__}, a bridge lens_parallel's path does not reproduce",
            not (generic or position or type(component) in joint),
        ),
        (
            f"{type(module).__name__}'s projections are not the bridge's q, k, v and o",
            position
            and not all(
                any(child is dict(component.named_children()).get(part) for child in children) for part in "qkvo"
            ),
        ),
        (
            "not causal self-attention",
            not component.is_causal
            or component.is_cross_attention
            or getattr(module, "is_causal", True) is False
            or bool(getattr(config, "use_bidirectional_attention", False)),
        ),
        (spec.reason, bool(spec.reason)),
        ("float32-upcast attention (reorder_and_upcast_attn)", bool(compat.bridge_attribute(component, "upcast"))),
    ]
    return [reason for reason, found in checks if found]


def make_site(component: Any, config: Any) -> AttentionSite:
    """The site of one attention component (``config``: the Hugging Face model's text config), kept on it and on
    its module."""
    module = compat.hf_module(component)
    source = Source(component, module, config, component.config)
    route = _route(source)
    spec = ScoreSpec.resolve(source, scale=route.scale(source))
    reason = "; ".join(_reasons(source, spec))
    site = AttentionSite(component, module, route.layer(source), spec, route, reason)
    vars(component)[SITE] = vars(module)[SITE] = site
    return site


def sites(model: Any) -> tuple[AttentionSite, ...]:
    """Every attention component's site, in the bridge's module order, made where not yet (kept on each)."""
    config = architectures.text_config(model.original_model.config)
    found = [m for m in model.modules() if isinstance(m, compat.bridge_classes().generic)]
    return tuple(site_of(m) or make_site(m, config) for m in found)


def install(model: Any) -> int:
    """Put every route in place on ``model`` (a TransformerBridge) where a layer takes one; returns how many layers
    lens_parallel's attention serves (the others keep TransformerLens's forward). Idempotent. The Hugging Face
    model then builds its masks for SDPA (a boolean mask, or none when causal alone suffices) instead of eager's
    additive float square, where it allows SDPA and no layer's blocks read eager's masks only (MPT's)."""
    found = sites(model)
    served = [site for site in found if site.served]
    for site in served:
        if not site.installed:
            site.route.install(site)
            site.installed = True
    if served and not any(site.spec.keeps_eager_masks for site in found):
        _register_interface()
        hf_model: Any = model.original_model
        with contextlib.suppress(ValueError):  # a model that refuses it keeps eager's additive mask, which is read
            hf_model.set_attn_implementation(INTERFACE)
        if any(f.masks_by_name for site in found for f in site.spec.features):
            compat.name_attention_implementation(hf_model.config, INTERFACE)
    return len(served)


def _register_interface() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(INTERFACE, interface_attention)
    AttentionMaskInterface.register(INTERFACE, sdpa_mask)


def interface_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface under :data:`INTERFACE`: the site of a module lens_parallel serves computes
    its attention (its spec checked against what the module hands: :meth:`ScoreSpec.check`); any other module (of a
    model that only shares the config's implementation name), and a module training with dropout, run transformers'
    SDPA function. Returns ``(attn_output [batch, query_pos, head, d_head], None)``: no weights, so the bridge fires
    no read-only pattern after the fact (hook_pattern fired inside). At a cached decoding step the layer's values
    over every key go to the edits that read them (:data:`~lens_parallel.attention.rows.STEP_VALUES`)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    site = site_of(module)
    if site is None or not site.installed or (module.training and dropout):
        out: tuple[torch.Tensor, None] = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        return out
    if kwargs.get("is_causal") is False:
        raise LibraryError(
            f"{type(module).__name__} hands the attention interface is_causal=False, which lens_parallel's routed "
            "attention does not compute: a TransformerLens or transformers release changed it"
        )
    site.spec.check(module, scaling, kwargs)
    query, key = site.route.handed(site, query, key)
    values = STEP_VALUES.get()
    if values is not None and site.layer is not None:  # the decoding loop's dictionary: every key's values
        values[site.layer] = einops.rearrange(value, "batch kv key d -> batch key kv d")
    z = site.attend(query, key, value, attention_mask)
    return einops.rearrange(z, "batch head pos d -> batch pos head d").contiguous(), None


def cache_handed(call: dict[str, Any]) -> dict[str, Any]:
    """The keywords a block handed its attention, the key/value cache among them as TransformerLens 4.3's bridges
    read it (``past_key_values``) where transformers 5 handed it as ``cache=`` only: else the bridge's cache step
    never extends the cache, and each new token attends to itself alone."""
    if call.get("past_key_values") is None and call.get("layer_past") is None and "cache" in call:
        return call | {"past_key_values": call["cache"]}
    return call


def _eager_now(component: Any) -> bool:
    """Options switched on after boot that only TransformerLens's forward serves."""
    config = component.config
    dropout = getattr(compat.hf_module(component), "attention_dropout", 0.0)
    return (
        component.compatibility_mode
        or any(bool(getattr(config, flag, False)) for flag in ("use_split_qkv_input", "use_attn_in", "use_attn_result"))
        or (component.training and isinstance(dropout, float) and dropout > 0.0)
    )


def _module_forward(site: AttentionSite, *args: Any, **kwargs: Any) -> Any:
    """The forward of a component on the module route: TransformerLens's generic AttentionBridge forward, hook_cos /
    hook_sin fired on the position embeddings handed to it; TransformerLens's own forward where a hook waits on a
    point the route does not fire (:attr:`AttentionSite.unfired`) or an option only that forward serves is on."""
    component = site.component
    if any(point.has_hooks() for point in site.unfired) or _eager_now(component):
        return type(component).forward(component, *args, **kwargs)
    if kwargs.get("position_embeddings") is not None:
        kwargs["position_embeddings"] = compat.bridge_attribute(component, "position_hooks")(
            kwargs["position_embeddings"]
        )
    return compat.bridge_classes().generic.forward(component, *args, **kwargs)


def _joint_attention(site: AttentionSite, rotary: bool, q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
    """A joint-QKV bridge's ``_reconstruct_attention`` (TransformerLens 4.3, pinned by :data:`ATTENTION_SOURCES`),
    the attention itself lens_parallel's: the bridge's own steps (:data:`~lens_parallel.compat.PRIVATE`: its heads
    split, rotary, cache, heads merged and output projection) in its order around it, after its clip_qkv;
    TransformerLens's whole reconstruction where the path forms the square (its keywords as it reads them:
    :meth:`ScoreSpec.for_transformer_lens`). A copy because TransformerLens writes the attention inline, with
    nothing to substitute for it."""
    component, spec, kwargs = site.component, site.spec, cache_handed(kwargs)

    def step(name: str) -> Any:
        return compat.bridge_attribute(component, name)

    path = None if _eager_now(component) else chosen_path(component)
    if path is None or path.whole_square:
        own = compat.bridge_attribute(type(component), "reconstruction")
        return own(component, q, k, v, **spec.for_transformer_lens(kwargs, q.shape[1], q.dtype))
    clip = step("clip_qkv")
    if clip:
        q, k, v = clamp_qkv(q, k, v, clip)
    q, k, v, batch, pos, head_dim = step("to_heads")(q, k, v, spec.n_heads, spec.n_kv_heads)
    embeddings = kwargs.get("position_embeddings")
    if rotary and isinstance(embeddings, tuple):
        q, k = step("rotary")(q, k, *step("position_hooks")(embeddings))
    k, v = step("cache_update")(k, v, **kwargs)
    z = site.attend(q, k, v, kwargs.get("attention_mask"), path=path, call=kwargs)
    return step("project")(step("merge_heads")(z, batch, pos, spec.n_heads, head_dim)), None


ATTENTION_SOURCES: Mapping[str, str] = {
    "AttentionBridge.forward": "ee8f78b0e8f340d6",
    "PositionEmbeddingsAttentionBridge.forward": "792c3e1b665a0ae2",
    "JointQKVAttentionBridge._reconstruct_attention": "6b9aae7f4356029e",
    "JointQKVPositionEmbeddingsAttentionBridge._reconstruct_attention": "b507ec0b79b97b83",
    "BloomAttentionBridge._reconstruct_attention": "b4743a44b10ee000",
    "MPTALiBiAttentionBridge._reconstruct_attention": "8237bcd82422b574",
}
"""The TransformerLens 4.3.0 forwards the routes stand in for, by the first 16 hex digits of the SHA-256 of their
source: the joint-QKV bridges' reconstruction, whose steps :func:`_joint_attention` calls in its order; the rotary
bridge's forward, whose hook points the module route fires or hands back to it; the generic bridge's, whose call of
the Hugging Face module the interface and module routes rely on. A release that changes one must be checked again."""


def attention_sources() -> dict[str, str]:
    """The installed TransformerLens's versions of :data:`ATTENTION_SOURCES` (the same digests of their source)."""
    classes = compat.bridge_classes()
    functions = [classes.generic.forward, classes.position.forward]
    functions += [
        compat.bridge_attribute(cls, "reconstruction")
        for cls in (classes.joint, classes.joint_rotary, classes.bloom, classes.mpt)
    ]
    return {f.__qualname__: hashlib.sha256(inspect.getsource(f).encode()).hexdigest()[:16] for f in functions}
