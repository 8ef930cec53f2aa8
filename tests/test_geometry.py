from __future__ import annotations

import pytest
import torch

from lens_parallel import geometry
from lens_parallel.hooks import expand_kv
from lens_parallel.spaces import SPACES, ResidualFrame

gen = torch.Generator().manual_seed(0)


def rand(*shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def test_projection_reconstructs_and_is_orthogonal():
    m, r = rand(5, 7, 16), rand(5, 7, 16)
    p = geometry.project(m, r)
    assert torch.allclose(p.par + p.perp, m, atol=1e-12)
    assert torch.allclose((p.perp * r).sum(-1), torch.zeros(5, 7, dtype=torch.float64), atol=1e-10)
    assert torch.allclose(p.par, p.coef[..., None] * r)
    assert p.valid.all()


def test_alignment_matches_the_vectors():
    m, r = rand(4, 9, 8), rand(4, 9, 8)
    a, p = geometry.alignment(m, r), geometry.project(m, r)
    norm = m.norm(dim=-1)
    assert torch.allclose(a.cos, torch.nn.functional.cosine_similarity(m, r, dim=-1), atol=1e-12)
    assert torch.allclose(a.par_frac, p.par.norm(dim=-1) / norm, atol=1e-12)
    assert torch.allclose(a.perp_frac, p.perp.norm(dim=-1) / norm, atol=1e-12)
    assert torch.allclose(a.par_frac**2 + a.perp_frac**2, torch.ones_like(norm), atol=1e-12)
    assert torch.allclose(a.coef, p.coef, atol=1e-12)


def test_hand_computed_example():
    m = torch.tensor([3.0, 4.0], dtype=torch.float64)
    r = torch.tensor([2.0, 0.0], dtype=torch.float64)
    a, p = geometry.alignment(m, r), geometry.project(m, r)
    assert p.par.tolist() == [3.0, 0.0] and p.perp.tolist() == [0.0, 4.0] and p.coef.item() == 1.5
    assert a.cos.item() == pytest.approx(0.6) and a.perp_frac.item() == pytest.approx(0.8)


def test_degenerate_reference_is_guarded_and_flagged():
    m, r = rand(3, 4), rand(3, 4)
    r[1] = 0.0
    m[2] = 1e-12
    a, p = geometry.alignment(m, r), geometry.project(m, r)
    assert a.valid.tolist() == [True, False, False]
    assert torch.isfinite(a.cos).all() and a.cos[1] == 0
    assert torch.equal(p.perp[1], m[1]) and not p.valid[1]


def test_scale_components():
    m, r = rand(6, 8), rand(6, 8)
    p = geometry.project(m, r)
    assert torch.allclose(geometry.scale_components(m, r), m, atol=1e-12)
    assert torch.allclose(geometry.scale_components(m, r, s_par=0.0), p.perp, atol=1e-12)
    assert torch.allclose(geometry.scale_components(m, r, s_par=0.5, s_perp=2.0), 0.5 * p.par + 2 * p.perp)
    per_position = torch.linspace(0, 1, 6, dtype=torch.float64)
    out = geometry.scale_components(m, r, s_par=per_position)
    assert torch.allclose(out, per_position[:, None] * p.par + p.perp)


def test_split_self():
    z, v = rand(2, 5, 3, 4), rand(2, 5, 3, 4)
    diag = torch.rand(2, 3, 5, generator=gen, dtype=torch.float64)
    d, c = geometry.split_self(z, v, diag)
    assert torch.allclose(d[1, 2, 0], diag[1, 0, 2] * v[1, 2, 0])
    assert torch.allclose(d + c, z)


def test_head_residual_products_match_explicit_head_outputs():
    z, W_O, x = rand(2, 5, 3, 4), rand(3, 4, 10), rand(2, 5, 10)
    dot, mm = geometry.head_residual_dots(z, W_O, x), geometry.head_write_norms(z, geometry.write_gram(W_O))
    m = torch.einsum("bphd,hdm->bphm", z, W_O)
    assert torch.allclose(dot, (m * x[:, :, None]).sum(-1), atol=1e-10)
    assert torch.allclose(mm, (m * m).sum(-1), atol=1e-10)


def test_expand_kv_is_repeat_interleave_not_repeat():
    """Query head h reads kv head h // group: kv-major order. Tiling (``repeat``) would fail this."""
    v = torch.arange(2, dtype=torch.float64).reshape(1, 1, 2, 1).expand(1, 1, 2, 3).clone()  # kv0 = 0s, kv1 = 1s
    out = expand_kv(v, 6)
    assert out[0, 0, :, 0].tolist() == [0, 0, 0, 1, 1, 1]
    assert torch.equal(out, v.repeat_interleave(3, dim=2))
    assert not torch.equal(out, v.repeat(1, 1, 3, 1))
    with pytest.raises(ValueError, match="n_heads=5 is not a multiple of n_kv_heads=2"):
        expand_kv(v, 5)


def test_parallel_coefficients_of_the_three_spaces():
    g = torch.Generator().manual_seed(3)
    pattern = torch.softmax(torch.randn(2, 3, 5, 5, generator=g, dtype=torch.float64), -1)
    v = torch.randn(2, 5, 3, 4, generator=g, dtype=torch.float64)
    x = torch.randn(2, 5, 7, generator=g, dtype=torch.float64)
    W_O = torch.randn(3, 4, 7, generator=g, dtype=torch.float64)
    o = geometry.value_aggregate(pattern, v)
    vv = (v * v).sum(-1)
    value = SPACES["value"].coefficient(pattern, v)
    torch.testing.assert_close(value * vv, (o * v).sum(-1))
    own = torch.diagonal(pattern, dim1=-2, dim2=-1).transpose(1, 2)  # A_tt as [batch, pos, head]
    exclude = SPACES["value-exclude-self"].coefficient(pattern, v)
    torch.testing.assert_close(exclude, value - own)  # c = o - A_tt v, so c.v/|v|^2 = o.v/|v|^2 - A_tt
    m = torch.einsum("bphd,hdm->bphm", o, W_O)
    residual = SPACES["residual-attn"].coefficient(pattern, v, frame=ResidualFrame(x, W_O))
    torch.testing.assert_close(residual, (m * x[:, :, None]).sum(-1) / (x * x).sum(-1, keepdim=True))
