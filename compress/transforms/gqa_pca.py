"""Activation-aware, RoPE-compatible KV-head merging in closed form (the ``pca`` init of compress/transforms/gqa.py).

Mean pooling (Ainslie et al.) averages the old k/v heads a new head replaces; when those heads are
nearly orthogonal (SmolLM2's are) the mean keeps little of any of them. Here each merge is instead the
best low-rank fit under the attention input's second moment ``Sigma = E[x x^T]`` (x: the k/v_proj input,
augmented with a constant 1 so that biases fold in), with the error weighted by what reads it:

* values: ``v' = U^T B v_all`` with ``B = blockdiag(G_g^1/2)``, ``G_g = sum_h W_o,h^T W_o,h`` over the
  query heads ``h`` that read old head ``g``, and ``U`` the top ``head_dim`` eigenvectors of
  ``B Sigma_V B``; query head ``h`` reads ``C_g v'`` with ``C = B^+ U`` folded into its o_proj columns.
* keys: RoPE (HF's rotate_half layout) multiplies the pair of dims ``(i, i + head_dim/2)`` of a head, as
  the complex number ``z = k[i] + 1j k[i + head_dim/2]``, by ``e^(j theta_i pos)``; a complex scalar
  commutes with that. Per plane, ``z_g ~ d_g z'`` is the complex rank-1 PCA of ``w_g z_g`` (``w_g``:
  the RMS query magnitude of the heads reading ``g`` in that plane), and each query head's plane is
  multiplied by ``conj(d_g)`` so that ``q . k`` scores are kept up to the rank cut.

Mean pooling is the special case of averaging weights, so on the measured objective these merges are
no worse. Weights are handled as augmented matrices ``[out, in + 1]`` whose last column is the bias.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

MAX_STATS_TOKENS = 65536  # calibration tokens that estimate Sigma (more changes little, and costs a forward)
ROWS_PER_FORWARD = 8  # calibration windows per forward pass while collecting


@torch.no_grad()
def collect_input_moments(model: nn.Module, batches: list[Tensor], modules: list[nn.Module],
                          max_tokens: int = MAX_STATS_TOKENS) -> list[Tensor]:
    """One fp forward over ``batches``: the second moment ``E[x~ x~^T]`` (fp64 ``[in + 1, in + 1]``) of
    the augmented input ``x~ = [x, 1]`` of each of ``modules`` (e.g. every layer's k_proj)."""
    d, device = modules[0].in_features, modules[0].weight.device
    acc = [torch.zeros(d + 1, d + 1, dtype=torch.float64, device=device) for _ in modules]

    def hook_for(i: int):
        def hook(module, args):
            x = args[0].detach().reshape(-1, d).float()  # [tokens, in]
            acc[i][:d, :d] += (x.T @ x).double()
            s = x.sum(0).double()
            acc[i][:d, d] += s
            acc[i][d, :d] += s
            acc[i][d, d] += x.shape[0]
        return hook

    handles = [m.register_forward_pre_hook(hook_for(i)) for i, m in enumerate(modules)]
    base = model.get_decoder() if hasattr(model, "get_decoder") else model  # no output head needed
    seen = 0
    try:
        for rows in (r for ids in batches for r in ids.split(ROWS_PER_FORWARD)):
            if seen >= max_tokens:
                break
            rows = rows[: -(-(max_tokens - seen) // rows.shape[1])]  # no more rows than the budget needs
            base(input_ids=rows, use_cache=False)
            seen += rows.numel()
    finally:
        for h in handles:
            h.remove()
    if seen == 0:
        raise ValueError("collecting attention-input statistics needs calibration tokens; got none")
    return [a / a[d, d] for a in acc]


def augmented(lin: nn.Linear) -> Tensor:
    """``[out, in + 1]`` fp64: the weight with the bias (or zeros) as an extra column."""
    w = lin.weight.detach().double()
    b = lin.bias.detach().double() if lin.bias is not None else w.new_zeros(w.shape[0])
    return torch.cat([w, b[:, None]], dim=1)


def psd_sqrt(g: Tensor, rel_eps: float = 1e-10) -> tuple[Tensor, Tensor]:
    """Square root and pseudo-inverse square root of a symmetric PSD matrix (eigenvalues below
    ``rel_eps * max`` count as zero)."""
    evals, evecs = torch.linalg.eigh(g)
    keep = evals > rel_eps * evals.max().clamp_min(1e-300)
    root = torch.where(keep, evals.clamp_min(0).sqrt(), torch.zeros_like(evals))
    inv = torch.where(keep, 1 / root.clamp_min(1e-300), torch.zeros_like(evals))
    return (evecs * root) @ evecs.T, (evecs * inv) @ evecs.T


class ValueMerge(NamedTuple):
    weight: Tensor  # [head_dim, in + 1]: the new v_proj rows (bias last)
    decode: Tensor  # [m, head_dim, head_dim]: old value g ~ decode[g] @ new value


def merge_values(w_v: Tensor, read_gram: Tensor, sigma: Tensor) -> ValueMerge:
    """Merge ``m`` value heads ``w_v: [m, D, in + 1]`` into one, minimising ``sum_g E|G_g^1/2 (v_g - C_g v')|^2``
    with ``read_gram[g] = G_g: [D, D]`` and ``sigma: [in + 1, in + 1]``."""
    m, dh, _ = w_v.shape
    roots = [psd_sqrt(g) for g in read_gram]
    b = torch.block_diag(*[r for r, _ in roots])  # [m D, m D]
    b_pinv = torch.block_diag(*[p for _, p in roots])
    w = w_v.reshape(m * dh, -1)  # [m, D, in+1] -> [m D, in+1]
    bw = b @ w
    _, evecs = torch.linalg.eigh(bw @ sigma @ bw.T)
    u = evecs[:, -dh:]  # top D eigenvectors: [m D, D]
    return ValueMerge(u.T @ bw, (b_pinv @ u).reshape(m, dh, dh))


def as_complex(w: Tensor) -> Tensor:
    """Rows ``[..., D, in]`` of a rotate_half RoPE head -> ``[..., D/2, in]`` complex: row i + 1j row i + D/2."""
    half = w.shape[-2] // 2
    return torch.complex(w[..., :half, :], w[..., half:, :])


def as_real(z: Tensor) -> Tensor:
    return torch.cat([z.real, z.imag], dim=-2)


def plane_energy(w_q: Tensor, sigma: Tensor) -> Tensor:
    """``E|zq_i|^2`` per RoPE plane of query heads ``w_q: [..., D, in + 1]`` -> ``[..., D/2]``."""
    diag = torch.einsum("...oi,ij,...oj->...o", w_q, sigma, w_q)  # E[q_o^2]
    half = diag.shape[-1] // 2
    return diag[..., :half] + diag[..., half:]


class KeyMerge(NamedTuple):
    weight: Tensor  # [D, in + 1]: the new k_proj rows (bias last)
    decode: Tensor  # [m, D/2] complex: old key plane z_g ~ decode[g] * new plane z'


def merge_keys(w_k: Tensor, plane_weight: Tensor, sigma: Tensor) -> KeyMerge:
    """Merge ``m`` RoPE key heads ``w_k: [m, D, in + 1]`` into one by a complex rank-1 PCA per plane of
    ``plane_weight[g, i] * z_g,i`` (``plane_weight: [m, D/2]``, e.g. the RMS query magnitude reading it)."""
    z = as_complex(w_k)  # [m, P, in+1]
    sig = sigma.to(z.dtype)
    r = torch.einsum("gpi,ij,hpj->pgh", z, sig, z.conj())  # E[z z^H] per plane: [P, m, m]
    w = plane_weight.T  # [P, m]
    _, evecs = torch.linalg.eigh(w[:, :, None] * r * w[:, None, :])
    u = evecs[:, :, -1]  # top eigenvector per plane: [P, m]
    enc = u.conj() * w  # z' = sum_g enc_g z_g
    dec = torch.where(w > 0, u / w.clamp_min(1e-300), torch.zeros_like(u))
    new = torch.einsum("pg,gpi->pi", enc, z)
    return KeyMerge(as_real(new), dec.T)


def rotate_planes(w_q: Tensor, c: Tensor) -> Tensor:
    """Multiply every RoPE plane ``i`` of a query head ``w_q: [D, in + 1]`` by the complex ``c[i]``."""
    return as_real(c[:, None] * as_complex(w_q))


class MergedAttention(NamedTuple):
    q: Tensor  # [H D, in + 1]
    k: Tensor | None  # [K' D, in + 1]; None: not merged here (no RoPE-compatible keys), pool them instead
    v: Tensor  # [K' D, in + 1]
    o: Tensor  # [hidden, H D] (o_proj's bias is unchanged)


def merge_attention(w_q: Tensor, w_k: Tensor, w_v: Tensor, w_o: Tensor, sigma: Tensor, n_heads: int, n_kv: int,
                    new_kv: int, rope_keys: bool = True) -> MergedAttention:
    """Merge one attention's ``n_kv`` KV heads into ``new_kv``. Query head ``h`` reads old head
    ``h // (H / n_kv)`` and new head ``h // (H / new_kv)``; each new head merges the old heads its
    query heads read. Weights are augmented fp64 (``[out, in + 1]``, bias last) except ``w_o``."""
    dh = w_k.shape[0] // n_kv
    q = w_q.reshape(n_heads, dh, -1).clone()  # [H D, in+1] -> [H, D, in+1]
    k, v = w_k.reshape(n_kv, dh, -1), w_v.reshape(n_kv, dh, -1)
    o = w_o.reshape(w_o.shape[0], n_heads, dh).clone()  # [hidden, H D] -> [hidden, H, D]
    reads, per_new = n_heads // n_kv, n_heads // new_kv
    new_k, new_v = [], []
    for j in range(new_kv):
        heads = list(range(j * per_new, (j + 1) * per_new))
        members = sorted({h // reads for h in heads})
        readers = [[i for i, h in enumerate(heads) if h // reads == g] for g in members]  # positions in heads
        slot = [members.index(h // reads) for h in heads]
        o_j = o[:, heads]  # [hidden, n, D]
        gram = torch.stack([torch.einsum("xnd,xne->de", o_j[:, r], o_j[:, r]) for r in readers])
        vm = merge_values(v[members], gram, sigma)
        new_v.append(vm.weight)
        o[:, heads] = torch.einsum("xnd,nde->xne", o_j, vm.decode[slot])
        if rope_keys:
            energy = plane_energy(q[heads], sigma)  # [n, D/2]
            km = merge_keys(k[members], torch.stack([energy[r].sum(0).sqrt() for r in readers]), sigma)
            new_k.append(km.weight)
            for i, h in enumerate(heads):
                q[h] = rotate_planes(q[h], km.decode[slot[i]].conj())
    return MergedAttention(q.reshape(n_heads * dh, -1), torch.cat(new_k) if rope_keys else None,
                           torch.cat(new_v), o.reshape(o.shape[0], -1))
