"""GPTQ's Hessians: the running mean of ``2 x^T x`` over calibration tokens (optionally each token weighted), and
which linears share one because they read the very same tensor."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import Tensor


def add_gram_(H: Tensor, x: Tensor, width: int = 512) -> Tensor:
    """``H += x^T x`` (``x: [tokens, in]``, float32), computing the lower triangle only, a panel of ``width`` columns
    at a time, then mirroring it: (n / width + 1) / (2 n / width) of the products (0.55x at 4,864 wide, 1.8x faster
    measured), exactly symmetric. Each entry is the same dot product over the tokens as the full product's: bit for
    bit from zero on this CPU's BLAS; added to a running sum, the last bits of a few entries may round apart."""
    n = H.shape[0]
    if n <= width:
        return H.addmm_(x.T, x)
    for i in range(0, n, width):
        H[i:, i:i + width].addmm_(x[:, i:].T, x[:, i:i + width])
    for i in range(0, n, width):
        block = H[i:i + width, i:i + width]  # its two triangles come from one product, maybe rounded apart
        block.copy_(block.tril() + block.tril(-1).T)
        H[i:i + width, i + width:].copy_(H[i + width:, i:i + width].T)
    return H


@functools.cache
def _bf16_kernel() -> bool:
    """Whether the native bf16 Gram runs here (runtime/kernels/cpu/gram.cpp: built once per machine, AVX512-BF16)."""
    from runtime.kernels import cpu_ext

    return cpu_ext.load() and bool(torch.ops.compress_cpu.has_bf16_dot())


def add_gram_bf16_(H: Tensor, x: Tensor, alpha: float) -> Tensor:
    """``H += alpha x^T x`` for ``x: [tokens, in]`` bfloat16, every product and sum in float32: the Gram of the
    bfloat16 values, positive semidefinite as any Gram (a bfloat16 matmul's rounded output is not). The native
    kernel where this CPU has bfloat16 dot products (~2x float32's rate), else the float32 product of the same
    values; the two agree to float32 summation order."""
    if _bf16_kernel():
        torch.ops.compress_cpu.gram_bf16_(H, x.contiguous(), alpha)
        return H
    return add_gram_(H, x.float() * alpha ** 0.5)


def product_of(opts) -> torch.dtype:
    """The Hessians' products GPTQ's options ask for (``GPTQOptions.bf16_gram``)."""
    return torch.bfloat16 if opts.bf16_gram else torch.float32


@dataclass
class Hessian:
    """Running mean of ``2 x^T x`` over calibration tokens, held in float32. ``product``: float32, or bfloat16 for
    the Gram of the inputs rounded to bfloat16 (each weighted token's ``sqrt(w) x``), summed in float32
    (:func:`add_gram_bf16_`): what a linear computing in bfloat16 multiplies, at about twice the rate where the CPU
    has bfloat16 dot products."""

    H: Tensor
    n: int = 0
    product: torch.dtype = torch.float32

    @classmethod
    def zeros(cls, in_features: int, product: torch.dtype = torch.float32) -> "Hessian":
        if product not in (torch.float32, torch.bfloat16):
            raise ValueError(f"Hessian products in {product}: float32 or bfloat16")
        return cls(torch.zeros(in_features, in_features, dtype=torch.float32), product=product)

    def add(self, x: Tensor, weight: Tensor | None = None) -> None:
        """``x: [..., in]``; ``weight: [...]`` counts each token's ``x x^T`` that many times
        (compress/methods/common/guided.py)."""
        x = x.reshape(-1, x.shape[-1])
        if weight is not None or self.product == torch.float32:
            x = x.float()
        if weight is not None:
            x = x * weight.reshape(-1, 1).sqrt()
        t = x.shape[0]
        self.H.mul_(self.n / (self.n + t))
        self.n += t
        if self.product == torch.float32:
            add_gram_(self.H, x * (2 / self.n) ** 0.5)
        else:
            add_gram_bf16_(self.H, x.to(torch.bfloat16), 2 / self.n)

    def release(self) -> Tensor:
        """The matrix, handed over: this object lets go of it, so that :func:`quantize_weight` frees it as
        soon as its own working copy exists (one [in, in] matrix less at the peak)."""
        H, self.H = self.H, None
        return H


@dataclass
class InputOwners:
    """Which linear's Hessian each linear adds to: linears fed the very same tensor (q/k/v, gate/up) share the
    first one's. Decided on the first call of each; the first inputs are held so that their addresses stay
    unique while the others are compared against them."""

    owner: dict = field(default_factory=dict)
    _first: dict[int, tuple] = field(default_factory=dict)

    def owns(self, key, x: Tensor) -> bool:
        """Whether ``key`` keeps its own Hessian (and so adds ``x`` to it)."""
        if key not in self.owner:
            rep = self._first.get(x.data_ptr())
            self.owner[key] = rep[0] if rep is not None and rep[1] is x else key
            self._first.setdefault(x.data_ptr(), (key, x))
        return self.owner[key] == key

    def forget(self) -> None:
        """Drop the first inputs once every linear's owner is known (the decisions stay)."""
        self._first.clear()
