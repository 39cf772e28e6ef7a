"""The packed quantized linear layer: stores integers, scales and zeros, never fp weights.

State dict of a ``QuantLinear`` named ``P`` (the checkpoint format, see compress/format/checkpoint.py):
- ``P.qweight``  int32  [out, ceil(in / (32 // bits))]  codes packed along ``in`` (compress/format/quant.py)
- ``P.scales``   fp16   [out, n_groups]
- ``P.qzeros``   uint8  [out, n_groups]    asymmetric int schemes only
- ``P.g_idx``    int32  [in]               only when columns are not grouped in natural order (act-order)
- ``P.bias``     fp     [out]              when the original linear had one

A quantized input embedding ``E`` (:class:`QuantEmbedding`, ``[vocab, hidden]``) is stored exactly like a
QuantLinear with ``out = vocab`` and ``in = hidden``: ``E.qweight`` int32 ``[vocab, ceil(hidden / (32 // bits))]``
packed along ``hidden``, ``E.scales`` fp16 ``[vocab, n_groups]``, ``E.qzeros`` uint8 (asymmetric only); no
``E.weight``. A tied LM head is the same tensors read as a linear (:meth:`QuantEmbedding.as_linear`, no copy).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from compress.format.quant import QuantizedWeight, Scheme, dequantize, pack, per_word, unpack


def register_codes(module: nn.Module, rows: int, cols: int, scheme: Scheme, device=None) -> None:
    """The empty ``qweight``/``scales``/``qzeros`` buffers of a ``[rows, cols]`` weight packed along ``cols``."""
    words = -(-cols // per_word(scheme.bits))
    n_groups = scheme.n_groups(cols)
    module.register_buffer("qweight", torch.zeros(rows, words, dtype=torch.int32, device=device))
    module.register_buffer("scales", torch.ones(rows, n_groups, dtype=torch.float16, device=device))
    if scheme.has_zeros:
        module.register_buffer("qzeros", torch.zeros(rows, n_groups, dtype=torch.uint8, device=device))
    else:
        module.qzeros = None


class QuantLinear(nn.Module):
    """A linear layer whose weight lives as packed integer codes plus group-wise scales/zeros."""

    def __init__(self, in_features: int, out_features: int, scheme: Scheme, bias: bool = False,
                 act_order: bool = False, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        register_codes(self, out_features, in_features, scheme, device)
        if act_order:
            self.register_buffer("g_idx", torch.zeros(in_features, dtype=torch.int32, device=device))
        else:
            self.g_idx = None
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        self.compute_dtype = dtype
        self._cache: Tensor | None = None  # optional dequantized weight, see cache_weight()

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: Tensor | None = None, dtype: torch.dtype = torch.float32) -> "QuantLinear":
        out_f, in_f = qw.q.shape
        m = cls(in_f, out_f, qw.scheme, bias=bias is not None, act_order=qw.g_idx is not None, dtype=dtype,
                device=qw.q.device)
        m.qweight.copy_(pack(qw.q, qw.scheme.bits))
        m.scales.copy_(qw.scale)
        if m.qzeros is not None:
            m.qzeros.copy_(qw.zero)
        if m.g_idx is not None:
            m.g_idx.copy_(qw.g_idx.to(torch.int32))
        if bias is not None:
            m.bias.data.copy_(bias.detach().to(dtype))
        return m

    def codes(self) -> Tensor:
        """The unpacked integer codes, uint8 [out, in]."""
        return unpack(self.qweight, self.scheme.bits, self.in_features)

    def quantized_weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.codes(), self.scales, self.qzeros, self.scheme,
                               None if self.g_idx is None else self.g_idx.long())

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> Tensor:
        """The real-valued weight ``[out, in]`` these integers stand for."""
        g_idx = None if self.g_idx is None else self.g_idx.long()
        return dequantize(self.codes(), self.scales, self.qzeros, self.scheme, g_idx, dtype or self.compute_dtype)

    def cache_weight(self, enabled: bool = True) -> None:
        """Keep a dequantized copy for repeated forwards (calibration, evaluation); off by default."""
        self._cache = self.dequantized_weight() if enabled else None

    def forward(self, x: Tensor) -> Tensor:
        w = self._cache if self._cache is not None else self.dequantized_weight(x.dtype)
        return nn.functional.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        s = self.scheme
        return (f"in={self.in_features}, out={self.out_features}, bits={s.bits}, group={s.group_size}, "
                f"sym={s.sym}, format={s.format}, act_order={self.g_idx is not None}")


class QuantEmbedding(nn.Module):
    """An input embedding stored as packed codes (QuantLinear's layout, one row per token): a lookup gathers and
    dequantizes only the rows its ids name, never the whole table."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scheme: Scheme, dtype: torch.dtype = torch.float32,
                 device=None, embed_scale: float | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.scheme = num_embeddings, embedding_dim, scheme
        register_codes(self, num_embeddings, embedding_dim, scheme, device)
        self.compute_dtype = dtype
        self.embed_scale = embed_scale  # Gemma's sqrt(hidden), applied in the compute dtype as transformers does

    def rows(self, ids: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """The dequantized rows ``[..., hidden]`` of token ``ids`` (only those rows are unpacked)."""
        flat = ids.reshape(-1)
        q = unpack(self.qweight.index_select(0, flat), self.scheme.bits, self.embedding_dim)  # [N, hidden]
        zero = None if self.qzeros is None else self.qzeros.index_select(0, flat)
        w = dequantize(q, self.scales.index_select(0, flat), zero, self.scheme, None, dtype or self.compute_dtype)
        return w.reshape(*ids.shape, self.embedding_dim)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.rows(ids)
        return x if self.embed_scale is None else x * torch.tensor(self.embed_scale).to(x.dtype)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> Tensor:
        """The whole table ``[vocab, hidden]`` (tests and references only: the point is never to need it)."""
        return self.rows(torch.arange(self.num_embeddings, device=self.qweight.device), dtype)

    def as_linear(self, tied: bool = True) -> QuantLinear:
        """A QuantLinear ``hidden -> vocab`` over these very buffers (a tied LM head: no second copy)."""
        head = QuantLinear(self.embedding_dim, self.num_embeddings, self.scheme, dtype=self.compute_dtype,
                           device="meta")
        head.qweight, head.scales, head.qzeros = self.qweight, self.scales, self.qzeros
        head.tied = tied  # compress/format/checkpoint.py records it as the tied head, not as a linear of its own
        return head

    def extra_repr(self) -> str:
        s = self.scheme
        return (f"vocab={self.num_embeddings}, dim={self.embedding_dim}, bits={s.bits}, group={s.group_size}, "
                f"sym={s.sym}")
