"""The input embedding and the LM head by round-to-nearest, a slab of rows at a time.

These tables are [vocab, hidden]: 30-60% of a small model with a 128k-262k vocabulary. Their schemes are
row-local (groups run along ``hidden``), so a table is quantized slab by slab and no fp copy of it, nor a
full-size temporary, is ever held; the streamed and in-memory paths cut different slabs and write the same
codes. On a tied model the embedding and the head are one tensor: it is quantized once, under the embedding's
name, and the head reads it (:meth:`compress.format.qlinear.QuantEmbedding.as_linear`).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor, nn

from compress.format.checkpoint import set_module
from compress.format.qlinear import QuantEmbedding, QuantLinear
from compress.format.quant import QuantizedWeight, Scheme, compute_qparams, pack, quantize

# per row symmetric int8 (llama.cpp's Q8_0 width, and what the runtime's int8 packed kernel takes); int4 in groups of
# 32 with zero points (Q4_1's grid); the same as the runtime's load-time head rounding (runtime/kernels/qmatmul.py)
OUTER_SCHEMES = {"int8": Scheme(bits=8, group_size=-1, sym=True), "int4": Scheme(bits=4, group_size=32, sym=False)}
SLAB_ROWS = 4096  # rows handed over per step on the in-memory path
CHUNK_VALUES = 1 << 20  # values quantized at once: their temporaries (int64 codes while packing) take ~40 bytes each


def outer_scheme(choice: str, group_size: int = 0, sym: bool | None = None) -> Scheme | None:
    """The scheme of an ``embed``/``head`` choice; ``group_size`` 0 and ``sym`` None keep the choice's own."""
    if choice == "none":
        return None
    base = OUTER_SCHEMES[choice]
    try:
        return Scheme(base.bits, group_size or base.group_size, base.sym if sym is None else sym)
    except ValueError as e:
        raise ValueError(f"{choice} embedding/head: {e}") from None


@dataclass(frozen=True)
class OuterPlan:
    """What happens to the tables outside the blocks: the embedding's scheme (on a tied model, the one tensor's)
    and an untied head's; None keeps a table full width."""

    embed: Scheme | None
    head: Scheme | None
    tied: bool

    @property
    def any(self) -> bool:
        return self.embed is not None or self.head is not None


def plan_outer(cfg, tied: bool) -> OuterPlan:
    """The plan for ``cfg``'s ``embed``/``head`` on a model that ties them or not; a tied model given two different
    schemes is refused (they are one tensor)."""
    embed, head = cfg.outer_scheme("embed"), cfg.outer_scheme("head")
    if not tied:
        return OuterPlan(embed, head, False)
    if embed is not None and head is not None and embed != head:
        raise ValueError(f"this model ties its LM head to its embedding (one tensor), but embed: {cfg.embed} "
                         f"({embed.to_dict()}) and head: {cfg.head} ({head.to_dict()}) ask for two schemes; "
                         "give both the same (e.g. --embed int8 --head int8) or set only one of them")
    return OuterPlan(embed or head, None, True)


def head_scheme(plan: OuterPlan, cfg) -> Scheme | None:
    """The scheme the head is calibrated to (``head_method: gptq``): an untied head's, or on a tied model the one
    table's, rounded for the head's products (the lookups read the same codes); None: RTN, or no quantized head."""
    if not cfg.calibrated_head:
        return None
    return plan.embed if plan.tied else plan.head


def quantize_table(slabs: Iterable[Tensor], rows: int, cols: int, scheme: Scheme,
                   embed_scale: float | None = None) -> QuantEmbedding:
    """RTN of a ``[rows, cols]`` table given as consecutive row slabs (any float dtype), into packed codes."""
    table = QuantEmbedding(rows, cols, scheme, embed_scale=embed_scale)
    step = max(1, CHUNK_VALUES // cols)
    start = 0
    for slab in slabs:
        for part in slab.split(step):  # packing widens codes to int64: a chunk's temporaries stay ~40 MB
            w = part.float()  # [n, cols]
            stop = start + w.shape[0]
            scale, zero = compute_qparams(w, scheme)
            table.qweight[start:stop] = pack(quantize(w, scale, zero, scheme), scheme.bits)
            table.scales[start:stop] = scale
            if zero is not None:
                table.qzeros[start:stop] = zero
            start = stop
    assert start == rows, f"slabs covered {start} of {rows} rows"
    return table


def table_of(qw: QuantizedWeight, embed_scale: float | None = None) -> QuantEmbedding:
    """The packed table of codes already rounded (a calibrated head, compress/methods/head_gptq.py): natural column order."""
    assert qw.g_idx is None, "a table's groups are consecutive columns"
    rows, cols = qw.q.shape
    table = QuantEmbedding(rows, cols, qw.scheme, embed_scale=embed_scale)
    step = max(1, CHUNK_VALUES // cols)
    for start in range(0, rows, step):  # as quantize_table: packing's int64 temporaries a chunk's, not the table's
        table.qweight[start:start + step] = pack(qw.q[start:start + step], qw.scheme.bits)
    table.scales.copy_(qw.scale)
    if qw.zero is not None:
        table.qzeros.copy_(qw.zero)
    return table


def row_slabs(weight: Tensor, step: int = SLAB_ROWS) -> Iterable[Tensor]:
    for s in range(0, weight.shape[0], step):
        yield weight[s:s + step].detach()


def _scale_of(emb: nn.Module) -> float | None:
    """Gemma's embedding multiplies its rows by sqrt(hidden) itself (transformers' ScaledWordEmbedding)."""
    return getattr(emb, "scalar_embed_scale", None)


def quantize_outer(model: nn.Module, plan: OuterPlan, head_codes: QuantizedWeight | None = None) -> None:
    """In place: the embedding becomes a :class:`QuantEmbedding` and the head a QuantLinear as ``plan`` says (a
    tied head reads the embedding's buffers); the head takes ``head_codes`` when given (its calibrated rounding,
    compress/methods/head_gptq.py; on a tied model the one table's), else RTN."""
    if plan.embed is not None:
        emb = model.get_input_embeddings()
        if plan.tied and head_codes is not None:
            assert head_codes.scheme == plan.embed and head_codes.q.shape == emb.weight.shape
            q = table_of(head_codes, _scale_of(emb))
        else:
            q = quantize_table(row_slabs(emb.weight), emb.num_embeddings, emb.embedding_dim, plan.embed,
                               _scale_of(emb))
        model.set_input_embeddings(q.to(emb.weight.device))
        if plan.tied:
            set_module(model, head_name(model), q.as_linear())
    if plan.head is not None:
        name = head_name(model)
        head = model.get_submodule(name)
        if head_codes is not None:
            assert head_codes.scheme == plan.head and head_codes.q.shape == head.weight.shape
            q = table_of(head_codes)
        else:
            q = quantize_table(row_slabs(head.weight), head.out_features, head.in_features, plan.head)
        lin = q.as_linear(tied=False)
        if head.bias is not None:
            lin.bias = nn.Parameter(head.bias.detach().clone(), requires_grad=False)
        set_module(model, name, lin)


def empty_outer(model: nn.Module, plan: OuterPlan) -> None:
    """In place, on a (meta) skeleton: the modules :func:`quantize_outer` would make, without values (the streamed
    path writes the codes itself and describes the checkpoint from this)."""
    if plan.embed is not None:
        emb = model.get_input_embeddings()
        q = QuantEmbedding(emb.num_embeddings, emb.embedding_dim, plan.embed, device="meta",
                           embed_scale=_scale_of(emb))
        model.set_input_embeddings(q)
        if plan.tied:
            set_module(model, head_name(model), q.as_linear())
    if plan.head is not None:
        name = head_name(model)
        head = model.get_submodule(name)
        set_module(model, name, QuantLinear(head.in_features, head.out_features, plan.head,
                                            bias=head.bias is not None, device="meta"))


def head_name(model: nn.Module) -> str:
    head = model.get_output_embeddings()
    return next(n for n, m in model.named_modules() if m is head)
