"""Independent computations the tests compare lens_parallel against, written with plain torch ops on TransformerLens's
own eager hooks (``run_with_cache``)."""

from __future__ import annotations

from functools import partial

import torch

from lens_parallel.models import model_info


def _get(cache, layer: int, name: str) -> torch.Tensor:
    return cache[f"blocks.{layer}.{name}"].double()


def alignment_stats(m, r):
    """Per-unit means over batch and positions t >= 1 (``m``, ``r``: [batch, pos, unit, d]) of the self-cosine, its
    std, the parallel and perpendicular fractions and the parallel coefficient, over positions with |m|, |r| > 1e-8;
    and how many positions were degenerate."""
    m, r = m[:, 1:].double().flatten(0, 1), r[:, 1:].double().flatten(0, 1)
    valid = (m.norm(dim=-1) > 1e-8) & (r.norm(dim=-1) > 1e-8)  # [position, unit]
    out = {"n_degenerate": (~valid).sum(0)}
    for name in ("self_cos", "self_cos_std", "par_frac", "perp_frac", "par_coef"):
        out[name] = torch.zeros(m.shape[1], dtype=torch.float64)
    for u in range(m.shape[1]):
        mu, ru = m[valid[:, u], u], r[valid[:, u], u]
        cos = torch.nn.functional.cosine_similarity(mu, ru, dim=-1, eps=0)
        coef = (mu * ru).sum(-1) / (ru * ru).sum(-1)
        par = coef[..., None] * ru
        out["self_cos"][u], out["self_cos_std"][u] = cos.mean(), cos.std(unbiased=False)
        out["par_frac"][u] = (par.norm(dim=-1) / mu.norm(dim=-1)).mean()
        out["perp_frac"][u] = ((mu - par).norm(dim=-1) / mu.norm(dim=-1)).mean()
        out["par_coef"][u] = coef.mean()
    return out


def decompose_reference(model, tokens):
    """Every (space, level, layer) decompose defines on ``model``, from a full ``run_with_cache``: the value aggregate
    from hook_pattern @ hook_v (the pre-gate A v, whatever hook_z holds), a linear-attention layer's from its own
    hooks (a_tt = beta_t (k_t . q_t) on the kernel's normalised q, k), per-head residual writes from hook_z and W_O
    (none with a post-attention norm), a mixer's update as resid_mid - resid_pre, the MLP's against resid_pre in a
    parallel block."""
    info = model_info(model)
    with torch.inference_mode():
        _, cache = model.run_with_cache(tokens)
    out = {}
    stats = alignment_stats
    for layer in range(info.n_layers):
        c = partial(_get, cache, layer)
        has = set(info.block_roles[layer])
        x = c("hook_resid_pre")
        if "mlp_out" in has:
            x_mlp = x if info.parallel_attn_mlp else c("hook_resid_mid")
            out["residual-mlp", "sublayer", layer] = stats(c("hook_mlp_out")[:, :, None], x_mlp[:, :, None])
        out["residual-block", "sublayer", layer] = stats((c("hook_resid_post") - x)[:, :, None], x[:, :, None])
        kind = info.kind(layer)
        if not kind.heads:  # a mixer: its update, where the block has a resid_mid
            if "resid_mid" in has:
                update = c("hook_resid_mid") - x
                out["residual-attn", "sublayer", layer] = stats(update[:, :, None], x[:, :, None])
            continue
        if not kind.pattern:  # linear attention (gated delta rule): per value head
            o, v = c("linear_attn.hook_recurrence_out"), c("linear_attn.hook_v")
            group = v.shape[2] // c("linear_attn.hook_k").shape[2]
            q, k = (c(f"linear_attn.hook_{n}").repeat_interleave(group, dim=2) for n in "qk")
            q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / q.shape[-1] ** 0.5
            k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
            a = c("linear_attn.hook_beta")[..., None] * (q * k).sum(-1, keepdim=True)
            out["value", "head", layer] = stats(o, v)
            out["value-exclude-self", "head", layer] = stats(o - a * v, v)
            out["value-merged", "sublayer", layer] = stats(o.flatten(2)[:, :, None], v.flatten(2)[:, :, None])
            out["residual-attn", "sublayer", layer] = stats(c("linear_attn.hook_out")[:, :, None], x[:, :, None])
            hf = model.blocks[layer].linear_attn.original_component  # its own gated norm and output projection
            flat = (o.float().flatten(0, 2), c("linear_attn.hook_gate_input").float().flatten(0, 2))
            u = hf.norm(*flat).detach().reshape(o.shape).double()
            w = hf.out_proj.weight.detach().double().unflatten(1, o.shape[2:])  # [d_model, head, d_v]
            writes = torch.einsum("bphd,mhd->bphm", u, w)
            out["residual-attn", "head", layer] = stats(writes, x[:, :, None].expand_as(writes))
            continue
        pattern = c("attn.hook_pattern")
        v = c("attn.hook_v").repeat_interleave(info.group_size, dim=2)
        o = torch.einsum("bhqk,bkhd->bqhd", pattern, v)  # the pre-gate aggregate (hook_z without a gate)
        diag = torch.diagonal(pattern, dim1=-2, dim2=-1).transpose(1, 2)[..., None]
        out["value", "head", layer] = stats(o, v)
        out["value-exclude-self", "head", layer] = stats(o - diag * v, v)
        out["value-merged", "sublayer", layer] = stats(o.flatten(2)[:, :, None], v.flatten(2)[:, :, None])
        out["residual-attn", "sublayer", layer] = stats(c("hook_attn_out")[:, :, None], x[:, :, None])
        if not info.post_norm:  # one head's write is a term of the update
            heads = torch.einsum("bphd,hdm->bphm", c("attn.hook_z"), model.blocks[layer].attn.W_O.detach().double())
            out["residual-attn", "head", layer] = stats(heads, x[:, :, None].expand_as(heads))
    return out
