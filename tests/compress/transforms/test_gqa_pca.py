import pytest
import torch

from compress.transforms import gqa_pca as gp


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _sigma(d, seed=0):
    """A full-rank augmented second moment [d + 1, d + 1] with a nonzero mean (last row/column) and 1 last."""
    x = torch.cat([_rand(4 * d, d, seed=seed) + 0.3, torch.ones(4 * d, 1, dtype=torch.float64)], dim=1)
    return x.T @ x / x.shape[0]


def _complex_multiple(w, c):
    """Key rows ``w: [D, in]`` with every RoPE plane multiplied by the complex ``c: [D/2]``."""
    return gp.as_real(c[:, None] * gp.as_complex(w))


def _value_error(w_v, gram, sigma, weight, decode):
    """sum_g E|G_g^1/2 (v_g - C_g v')|^2 of a merge."""
    err = w_v - torch.einsum("gde,ei->gdi", decode, weight)  # [m, D, in+1]
    return sum(torch.trace(gram[g] @ err[g] @ sigma @ err[g].T) for g in range(len(w_v))).item()


def _key_error(w_k, plane_weight, sigma, weight, decode):
    """sum_{g,i} w_g,i^2 E|z_g,i - d_g,i z'_i|^2 of a merge."""
    err = gp.as_complex(w_k) - decode[:, :, None] * gp.as_complex(weight)[None]  # [m, P, in+1]
    e2 = torch.einsum("gpi,ij,gpj->gp", err, sigma.to(err.dtype), err.conj()).real
    return (plane_weight ** 2 * e2).sum().item()


def test_psd_sqrt_is_a_root_and_a_pseudo_inverse_root():
    a = _rand(5, 3)
    g = a @ a.T  # rank 3
    root, inv = gp.psd_sqrt(g)
    assert torch.allclose(root @ root, g, atol=1e-10)
    assert torch.allclose(root @ inv @ root, root, atol=1e-10)  # pseudo-inverse on the range, 0 off it
    assert torch.allclose(inv @ inv, torch.linalg.pinv(g), atol=1e-8)


def test_merge_values_is_exact_when_the_values_span_one_head():
    m, dh, d = 3, 4, 6
    base = _rand(dh, d + 1, seed=1)
    w_v = torch.stack([base, _rand(dh, dh, seed=2) @ base, _rand(dh, dh, seed=3) @ base])
    gram = torch.stack([(a := _rand(8, dh, seed=4 + g)).T @ a for g in range(m)])
    res = gp.merge_values(w_v, gram, _sigma(d))
    assert res.weight.shape == (dh, d + 1) and res.decode.shape == (m, dh, dh)
    assert torch.allclose(torch.einsum("gde,ei->gdi", res.decode, res.weight), w_v, atol=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_merge_values_is_no_worse_than_the_mean(seed):
    m, dh, d = 3, 4, 10
    w_v = _rand(m, dh, d + 1, seed=seed)
    gram = torch.stack([(a := _rand(8, dh, seed=10 + seed + g)).T @ a for g in range(m)])
    sigma = _sigma(d, seed)
    res = gp.merge_values(w_v, gram, sigma)
    mean_decode = torch.eye(dh, dtype=torch.float64).expand(m, dh, dh)  # every head reads the mean
    assert (_value_error(w_v, gram, sigma, res.weight, res.decode)
            < _value_error(w_v, gram, sigma, w_v.mean(0), mean_decode))


def test_merge_keys_is_exact_for_per_plane_complex_multiples():
    dh, d = 8, 6
    base = _rand(dh, d + 1, seed=1)
    c = [torch.complex(_rand(dh // 2, seed=s), _rand(dh // 2, seed=s + 10)) for s in (2, 3)]
    w_k = torch.stack([base, _complex_multiple(base, c[0]), _complex_multiple(base, c[1])])
    res = gp.merge_keys(w_k, _rand(3, dh // 2, seed=5).abs() + 0.1, _sigma(d))
    rebuilt = torch.stack([_complex_multiple(res.weight, res.decode[g]) for g in range(3)])
    assert torch.allclose(rebuilt, w_k, atol=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_merge_keys_is_no_worse_than_the_mean(seed):
    m, dh, d = 3, 8, 10
    w_k, sigma = _rand(m, dh, d + 1, seed=seed), _sigma(d, seed)
    plane_weight = _rand(m, dh // 2, seed=20 + seed).abs() + 0.1
    res = gp.merge_keys(w_k, plane_weight, sigma)
    mean_decode = torch.ones(m, dh // 2, dtype=torch.complex128)
    assert (_key_error(w_k, plane_weight, sigma, res.weight, res.decode)
            < _key_error(w_k, plane_weight, sigma, w_k.mean(0), mean_decode))


def test_rotated_query_against_scaled_key_keeps_hf_rope_scores():
    """The sign conventions, checked against transformers' own rotate_half RoPE: scores of (q, c k')
    equal those of (rotate_planes(q, conj(c)), k') at every pair of positions."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    dh, n = 8, 5
    q, k1 = _rand(n, dh, seed=1), _rand(n, dh, seed=2)
    c = torch.complex(_rand(dh // 2, seed=3), _rand(dh // 2, seed=4))
    k = _complex_multiple(k1.T, c).T  # [n, D]: the old key, c times the new one per plane
    q1 = gp.rotate_planes(q.T, c.conj()).T
    freqs = torch.outer(torch.arange(n, dtype=torch.float64), 1.0 / 10000 ** (torch.arange(0, dh, 2) / dh))
    emb = torch.cat([freqs, freqs], dim=-1)[None]  # [1, n, D]
    cos, sin = emb.cos(), emb.sin()
    qr, kr = apply_rotary_pos_emb(q[None, None], k[None, None], cos, sin)
    q1r, k1r = apply_rotary_pos_emb(q1[None, None], k1[None, None], cos, sin)
    assert torch.allclose(qr @ kr.transpose(-1, -2), q1r @ k1r.transpose(-1, -2), atol=1e-10)
    assert not torch.allclose(qr @ kr.transpose(-1, -2), q1r @ (k1r * 1.01).transpose(-1, -2), atol=1e-4)


def test_collect_input_moments_matches_the_layer_inputs():
    from tiny_models import tiny_model

    model = tiny_model("qwen2")
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    ks = [layer.self_attn.k_proj for layer in model.model.layers]
    moments = gp.collect_input_moments(model, [ids[:2], ids[2:]], ks)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
        for i, layer in enumerate(model.model.layers):
            x = layer.input_layernorm(hidden[i]).reshape(-1, 64).double()
            x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
            assert torch.allclose(moments[i], x.T @ x / len(x), atol=1e-5)
    capped = gp.collect_input_moments(model, [ids], ks, max_tokens=20)  # 2 windows of 16 tokens cover 20
    with torch.no_grad():
        x = model.model.layers[0].input_layernorm(hidden[0][:2]).reshape(-1, 64).double()
    assert torch.allclose(capped[0][:64, :64], x.T @ x / len(x), atol=1e-5)
    with pytest.raises(ValueError, match="needs calibration tokens"):
        gp.collect_input_moments(model, [], ks)
