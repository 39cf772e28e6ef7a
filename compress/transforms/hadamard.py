"""Hadamard matrices of any order this toolkit meets, and the randomized orthogonal rotations built on them.

A Hadamard matrix ``H`` of order ``n`` has entries +-1 and ``H H^T = n I``; ``H / sqrt(n)`` is orthogonal with
every entry of the same magnitude, which is what spreads a weight's or an activation's outlier channel over all
channels (QuaRot, QuIP#). Orders that are not a power of two are built as Kronecker products of a Sylvester
power of two and Paley matrices (Paley I: ``q + 1`` for a prime ``q = 3 mod 4``; Paley II: ``2 (q + 1)`` for a
prime ``q = 1 mod 4``): SmolLM2's 576 = 2 x 2 x 2 x 72 (Paley I of 71), 1536 = 4 x 384 (of 383),
960 = 2 x 480 (of 479).
A true Hadamard of the full order is preferred over a block-diagonal one: a block-diagonal rotation keeps an
outlier inside its block, a full one spreads it over every channel. Orders with no construction here (e.g.
an odd hidden size) fall back to a seeded random orthogonal matrix (QR of a Gaussian), which still folds
exactly and spreads outliers with high probability, only without the equal-magnitude guarantee.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, math.isqrt(q) + 1))


def _jacobsthal(q: int) -> Tensor:
    """The ``q x q`` matrix ``chi(j - i)`` of the quadratic character mod the prime ``q``."""
    squares = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0] + [1 if a in squares else -1 for a in range(1, q)], dtype=torch.float64)
    idx = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    return chi[idx]


def _paley1(q: int) -> Tensor:
    """Order ``q + 1`` for a prime ``q = 3 mod 4``: ``I + S`` with the skew ``S = [[0, 1], [-1, Q]]``."""
    n = q + 1
    s = torch.zeros(n, n, dtype=torch.float64)
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, _jacobsthal(q)
    return s + torch.eye(n, dtype=torch.float64)


def _paley2(q: int) -> Tensor:
    """Order ``2 (q + 1)`` for a prime ``q = 1 mod 4``: ``C x [[1, -1], [-1, -1]] + I x [[1, 1], [1, -1]]``
    with the symmetric conference matrix ``C = [[0, 1], [1, Q]]``."""
    n = q + 1
    c = torch.zeros(n, n, dtype=torch.float64)
    c[0, 1:], c[1:, 0], c[1:, 1:] = 1, 1, _jacobsthal(q)
    a = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    return torch.kron(c, a) + torch.kron(torch.eye(n, dtype=torch.float64), b)


def _direct(n: int) -> Tensor | None:
    """A Hadamard of order ``n`` from one construction (Sylvester 1/2, Paley I or II), or None."""
    if n == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    if n == 2:
        return torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    if n % 4:
        return None
    if _is_prime(n - 1) and (n - 1) % 4 == 3:
        return _paley1(n - 1)
    if _is_prime(n // 2 - 1) and (n // 2 - 1) % 4 == 1:
        return _paley2(n // 2 - 1)
    return None


@functools.lru_cache(maxsize=32)
def _build(n: int) -> Tensor | None:
    direct = _direct(n)
    if direct is not None:
        return direct
    for a in range(2, math.isqrt(n) + 1):  # n = a * b, both Hadamard orders: the Kronecker product is one
        if n % a == 0:
            ha = _build(a)
            hb = _build(n // a) if ha is not None else None
            if hb is not None:
                return torch.kron(ha, hb)
    return None


def hadamard(n: int) -> Tensor | None:
    """A ``+-1`` Hadamard matrix of order ``n`` (float64, ``H H^T = n I``), or None when none is built here."""
    if n < 1:
        raise ValueError(f"a Hadamard order must be >= 1, got {n}")
    h = _build(n)
    return None if h is None else h.clone()


def random_orthogonal(n: int, seed: int) -> Tensor:
    """A seeded Haar-random orthogonal matrix (float64), for orders with no Hadamard construction."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))[None, :]  # sign fix makes the distribution Haar


def random_hadamard(n: int, seed: int) -> Tensor:
    """The orthogonal rotation ``diag(s) H / sqrt(n)`` with seeded random signs ``s`` (float64, ``[n, n]``):
    QuaRot's randomized Hadamard. Falls back to :func:`random_orthogonal` when order ``n`` has no Hadamard."""
    h = hadamard(n)
    if h is None:
        return random_orthogonal(n, seed)
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=g).to(torch.float64).mul_(2).sub_(1)
    return signs[:, None] * h / math.sqrt(n)
