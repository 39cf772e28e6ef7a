"""GGUF (llama.cpp, Ollama, LM Studio): one file holding the checkpoint's own integers in GGUF block types.

Each quantized linear maps onto a 32-wide block type without rounding again (see gguf_quants.py):
4-bit symmetric -> ``Q4_0``, 4-bit asymmetric -> ``Q4_1``, 8-bit symmetric -> ``Q8_0``. A group of 32, or
any multiple of 32 (each block then repeats its group's scale), maps; so does act-order when every
32-wide block of columns lies in one group. Other layers are refused, naming the fix, unless
``--requantize TYPE``: their dequantized weights are rounded again by llama.cpp's rules, which the file
records (``compress.requantized``). ``--k-quants`` writes 4-bit layers whose width divides by 256 as ``Q4_K``
(our codes; each super-block's scales rounded to 6 bits, so not lossless), the rest as above, as llama.cpp
falls back. Unquantized matrices are ``--embed-type`` (f16, bf16, f32, q8_0 or q6_k), except an unquantized head
(``output``, or ``token_embd`` of a tied model), which is ``--output-type``: by default Q6_K for a quantized model,
as llama.cpp's Q4_K_M writes it (Q8_0 where the width is not whole 256-wide super-blocks, as llama.cpp falls
back), else --embed-type. A quantized embedding or head (the checkpoint's ``embed``/``head``) is written from its
own codes, like the linears (see :func:`encode_table`). Norms, biases, MoE routers and the per-frequency factors
of llama3 rope and longrope (``rope_freqs``, ``rope_factors_long/short``) are F32. Model knowledge (names, rotary
layout and scaling) lives in gguf_arch.py.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from compress.exporters import gguf_arch, gguf_quants
from compress.exporters.common import QuantizedTable, Source, Tables, fp_tensors, tied_lm_head
from compress.format.families import FAMILIES
from compress.format.moe_packed import PackedLinears, PackedMoEExperts
from compress.format.qlinear import QuantLinear
from compress.format.quant import QuantizedWeight, Scheme

log = logging.getLogger(__name__)

REQUANTIZE_TYPES = tuple(gguf_quants.REQUANTIZE)
EMBED_TYPES = ("f16", "bf16", "f32", "q8_0", "q6_k")
# llama.cpp's LLAMA_FTYPE_MOSTLY_*
FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q4_k": 14, "q6_k": 18, "bf16": 32}
HEAD_TYPE = "q6_k"  # an fp head of a quantized model, as llama.cpp's Q4_K_M writes ``output``
FIX = ("re-quantize with `compress quantize ... --group-size 32 --no-act-order` (--sym for Q4_0/Q8_0), "
       f"or pass --requantize {'|'.join(REQUANTIZE_TYPES)} to round the dequantized weights again (not lossless)")


@dataclass(frozen=True)
class GGUFOptions:
    """``--requantize``: the block type for layers whose integers do not map (None: refuse them).
    ``--embed-type``: unquantized matrices (None: from --dtype). ``--output-type``: an unquantized head (``output``,
    or ``token_embd`` when tied; None: Q6_K for a quantized model as llama.cpp's Q4_K_M, else --embed-type).
    ``--k-quants``: 4-bit layers as Q4_K."""

    requantize: str | None = None
    embed_type: str | None = None
    k_quants: bool = False
    output_type: str | None = None

    def __post_init__(self):
        if self.requantize is not None and self.requantize not in REQUANTIZE_TYPES:
            raise ValueError(f"--requantize {self.requantize!r} is not supported; use one of {', '.join(REQUANTIZE_TYPES)}")
        for flag, value in (("--embed-type", self.embed_type), ("--output-type", self.output_type)):
            if value is not None and value not in EMBED_TYPES:
                raise ValueError(f"{flag} {value!r} is not supported; use one of {', '.join(EMBED_TYPES)}")


def block_type(scheme: Scheme) -> str | None:
    """The GGUF block type that carries this scheme's codes exactly."""
    if scheme.format != "int":
        return None
    return {(4, True): "q4_0", (4, False): "q4_1", (8, True): "q8_0"}.get((scheme.bits, scheme.sym))


def recipe_block_type(scheme: Scheme, act_order: bool = False, static_groups: bool = False) -> str | None:
    """The GGUF type a recipe's checkpoints export to without rounding again (widths divisible by 32), or None.
    Act-order forms groups in permuted order unless its groups are static, which mixes groups inside blocks."""
    if act_order and not static_groups:
        return None
    if scheme.group_size != -1 and scheme.group_size % gguf_quants.BLOCK:
        return None
    return block_type(scheme)


def block_groups(in_features: int, scheme: Scheme, g_idx: Tensor | None) -> Tensor:
    """The group of each 32-wide block of input columns."""
    starts = torch.arange(0, in_features, gguf_quants.BLOCK)
    return g_idx.long()[starts] if g_idx is not None else starts // scheme.group(in_features)


def why_not(scheme: Scheme, in_features: int, g_idx: Tensor | None) -> str | None:
    """Why these integers do not map onto a GGUF block type as they are (None: they do)."""
    if block_type(scheme) is None:
        kind = scheme.format if scheme.format != "int" else f"{scheme.bits}-bit {'symmetric' if scheme.sym else 'asymmetric'}"
        return f"{kind} codes have no GGUF block type (4-bit -> Q4_0/Q4_1, 8-bit symmetric -> Q8_0); {FIX}"
    if in_features % gguf_quants.BLOCK:
        return (f"in_features {in_features} is not a multiple of GGUF's block of 32; pass --requantize "
                f"{'|'.join(REQUANTIZE_TYPES)} to write such layers as F16 (--embed-type f32: F32)")
    if scheme.group(in_features) % gguf_quants.BLOCK:
        return f"group_size {scheme.group_size} does not cover whole 32-wide GGUF blocks; {FIX}"
    if g_idx is not None:
        # g_idx: [..., in] -> [..., n_blocks, 32]: each block must sit in one group
        blocks = g_idx.reshape(*g_idx.shape[:-1], -1, gguf_quants.BLOCK)
        if not bool((blocks == blocks[..., :1]).all()):
            return f"the act-order group map mixes groups inside 32-wide blocks; {FIX}"
    return None


def check(m: QuantLinear) -> str | None:
    return why_not(m.scheme, m.in_features, m.g_idx)


@dataclass(frozen=True)
class Encoded:
    """One GGUF tensor: ``data`` is block bytes (uint8) for block types, floats otherwise; ``how`` it was made:
    "exact" (our values), "6-bit scales" (Q4_K: our codes, scales rounded) or "requantized" (rounded again)."""

    qtype: str
    data: Tensor
    how: str = "exact"


def encode_exact(qw: QuantizedWeight, k_quants: bool = False) -> Encoded:
    """Our codes and scales as GGUF blocks (rows [..., out, in] -> bytes [..., out, n_blocks * size]); with
    ``k_quants``, 4-bit rows whose width divides by 256 become Q4_K, their scales rounded to 6 bits."""
    qtype = block_type(qw.scheme)
    gid = block_groups(qw.q.shape[-1], qw.scheme, qw.g_idx)
    d = qw.scale.index_select(-1, gid)  # [out, n_blocks]
    if k_quants and qtype in ("q4_0", "q4_1") and qw.q.shape[-1] % gguf_quants.SUPER_BLOCK == 0:
        z = qw.scheme.sym_zero if qw.zero is None else qw.zero.index_select(-1, gid).float()
        return Encoded("q4_k", gguf_quants.pack_q4_k(qw.q, d, d.float() * z), "6-bit scales")
    if qtype == "q4_0":
        return Encoded(qtype, gguf_quants.pack_q4_0(qw.q, d))
    if qtype == "q4_1":
        m = -d.float() * qw.zero.index_select(-1, gid).float()
        return Encoded(qtype, gguf_quants.pack_q4_1(qw.q, d, m))
    return Encoded(qtype, gguf_quants.pack_q8_0(qw.q.to(torch.int16) - qw.scheme.sym_zero, d))


def encode_float(w: Tensor, qtype: str) -> Encoded:
    """A float matrix as F32, F16, BF16 or a block type; a row width that is not whole blocks falls back as llama.cpp
    does (Q6_K's 256 to Q8_0, then F16)."""
    if qtype == "f32":
        return Encoded("f32", w.float())
    if qtype == "bf16":  # numpy has no bfloat16: its bytes, [..., n] -> uint8 [..., 2n]
        return Encoded("bf16", w.to(torch.bfloat16).contiguous().view(torch.uint8))
    if qtype == "q6_k" and w.shape[-1] % gguf_quants.SUPER_BLOCK:
        qtype = "q8_0"
    if qtype == "f16" or w.shape[-1] % gguf_quants.BLOCK:
        return Encoded("f16", w.half())
    return Encoded(qtype, gguf_quants.FLOAT_BLOCKS[qtype](w))


def encode_quantized(weights: list[QuantizedWeight], name: str, options: GGUFOptions, fallback: str) -> Encoded:
    """One linear (or a stack of experts) exactly, or requantized when allowed; else refuse."""
    qw = weights[0]
    why = next((r for w in weights if (r := why_not(w.scheme, w.q.shape[-1], w.g_idx)) is not None), None)
    if why is None:
        parts = [encode_exact(w, options.k_quants) for w in weights]
    elif options.requantize is None:
        raise ValueError(f"--format gguf cannot carry {name} exactly ({why})")
    else:
        wanted = options.requantize if qw.q.shape[-1] % gguf_quants.BLOCK == 0 else fallback
        parts = [replace(encode_float(w.dequantize(), wanted), how="requantized") for w in weights]
    data = parts[0].data if len(parts) == 1 else torch.stack([p.data for p in parts])
    return replace(parts[0], data=data)


def _stack(lin: QuantLinear | PackedLinears) -> list[QuantizedWeight]:
    if isinstance(lin, QuantLinear):
        return [lin.quantized_weight()]
    return [lin.quantized_weight(e) for e in range(lin.num_experts)]


def _float_type(gguf_name: str, t: Tensor, embed_type: str, output_type: str, tied: bool) -> str:
    base = gguf_name.rsplit(".", 2)[-2]
    if t.dim() == 1 or base in gguf_arch.ROUTERS:
        return "f32"
    head = gguf_name == "output.weight" or (tied and gguf_name == "token_embd.weight")  # llama.cpp's rule
    return output_type if head else embed_type


def _finish(name: str, enc: Encoded, model: nn.Module, arch: gguf_arch.GGUFArch) -> Encoded:
    """llama.cpp's conventions on top of the values: Gemma's norm offset, Llama's q/k rotary rows."""
    offset = FAMILIES[model.config.model_type].norm_offset
    if offset and name.endswith("norm.weight"):
        enc = replace(enc, data=enc.data + offset)
    heads = gguf_arch.rope_heads(name.rsplit(".", 1)[0], model.config, arch)
    if heads is not None:
        enc = replace(enc, data=gguf_arch.rope_rows(enc.data, heads))
    return enc


def table_type(scheme: Scheme, options: GGUFOptions) -> str:
    """The block type a quantized embedding or head whose codes do not map is rounded again to."""
    if options.requantize is not None:
        return options.requantize
    return {(4, True): "q4_0", (4, False): "q4_1"}.get((scheme.bits, scheme.sym), "q8_0")


def encode_table(table: QuantizedTable, options: GGUFOptions) -> Encoded:
    """A quantized embedding or LM head from its own codes (lossless where the grid maps onto a block type), else
    its dequantized weights rounded again by llama.cpp's rules, logged: never refused, never widened to F16."""
    qw = table.weight
    why = why_not(qw.scheme, qw.q.shape[-1], None)
    if why is None:
        return encode_exact(qw, options.k_quants)
    qtype = table_type(qw.scheme, options)
    if qw.q.shape[-1] % gguf_quants.BLOCK:
        log.warning("%s: width %d is not whole 32-wide blocks; written as F16 from its dequantized weights",
                    table.name, qw.q.shape[-1])
        return Encoded("f16", qw.dequantize().half(), "requantized")
    log.warning("%s: its codes do not map onto a GGUF block type (%s); rounding its dequantized weights again "
                "to %s (not lossless)", table.name, why.split(";")[0], qtype.upper())
    return replace(encode_float(qw.dequantize(), qtype), how="requantized")


def plan_tensors(model: nn.Module, arch: gguf_arch.GGUFArch, options: GGUFOptions, embed_type: str,
                 tables: Tables | None = None, output_type: str | None = None) -> dict[str, Encoded]:
    """Every GGUF tensor by name, encoded; raises before anything is written if one cannot be carried. Quantized
    tables become ``token_embd``/``output`` from their codes; a tied head has no ``output`` (llama.cpp then reads
    ``token_embd``)."""
    tables = tables or Tables()
    tied = tied_lm_head(model) or (tables.head is not None and tables.head.tied)
    out: dict[str, Encoded] = {}
    packed = {n: m for n, m in model.named_modules() if isinstance(m, PackedMoEExperts)}
    for table in (tables.embed, tables.head):
        if table is not None and not table.tied:
            (name,) = gguf_arch.gguf_names(table.name, arch)
            out[f"{name}.weight"] = encode_table(table, options)
    for key, t in fp_tensors(model, torch.float32, tables, dequantize_embed=False).items():
        if any(key.startswith(f"{p}.") for p in packed):
            continue
        owner, _, leaf = key.rpartition(".")
        names = gguf_arch.gguf_names(key if leaf not in ("weight", "bias") else owner, arch)
        suffix = leaf if leaf in ("weight", "bias") else "weight"
        rows = torch.chunk(t, len(names), dim=-2) if len(names) > 1 else (t,)
        for n, part in zip(names, rows):
            if n.rsplit(".", 1)[-1] in gguf_arch.VECTORS:
                part = part.reshape(-1)
            qtype = _float_type(f"{n}.{suffix}", part, embed_type, output_type or embed_type, tied)
            out[f"{n}.{suffix}"] = encode_float(part, qtype)
    for mod, lin in quantized_linears(model, packed).items():
        if mod in tables.owners:
            continue
        names = gguf_arch.gguf_names(mod, arch)
        enc = encode_quantized(_stack(lin), mod, options, embed_type if embed_type in ("f32", "bf16") else "f16")
        for n, part in zip(names, torch.chunk(enc.data, len(names), dim=-2)):
            out[f"{n}.weight"] = replace(enc, data=part.contiguous())
    rope = {name: Encoded("f32", t) for name, t in gguf_arch.rope_tensors(model.config).items()}  # llama3, longrope
    return {**{name: _finish(name, enc, model, arch) for name, enc in out.items()}, **rope}


def quantized_linears(model: nn.Module, packed: dict[str, PackedMoEExperts]) -> dict[str, QuantLinear | PackedLinears]:
    """Quantized linears by Hugging Face name; packed experts by their fused parameter's name."""
    out: dict[str, QuantLinear | PackedLinears] = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    for n, m in packed.items():
        out[f"{n}.gate_up_proj"], out[f"{n}.down_proj"] = m.gate_up_proj, m.down_proj
    return out


def provenance(source: Source, tensors: dict[str, Encoded], options: GGUFOptions) -> dict[str, object]:
    """compress.* metadata: how the integers were made, and which tensors are not exactly ours."""
    qc: dict = {}
    cfg = source.path / "config.json" if source.path is not None else None
    if cfg is not None and cfg.is_file():
        qc = json.loads(cfg.read_text()).get("quantization_config") or {}
    out: dict[str, object] = {"compress.quant_method": str(qc.get("method", "none"))}
    for key in ("recipe", "source_model"):
        if qc.get(key):
            out[f"compress.{key}"] = str(qc[key])
    if qc:
        scheme = {k: qc[k] for k in ("bits", "group_size", "sym", "format", "act_order") if k in qc}
        out["compress.scheme"] = json.dumps(scheme, sort_keys=True)
        out["compress.calibration"] = json.dumps(qc.get("calibration") or {}, sort_keys=True)
    out["compress.lossless"] = all(e.how == "exact" for e in tensors.values())
    if options.k_quants:
        out["compress.k_quants"] = sum(e.qtype == "q4_k" for e in tensors.values())  # tensors with 6-bit scales
    requantized = sorted(n for n, e in tensors.items() if e.how == "requantized")
    if requantized:
        out["compress.requantize_type"] = str(options.requantize or "/".join(sorted({tensors[n].qtype for n in requantized})))
        out["compress.requantized"] = requantized
    return out


def _add(writer, key: str, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif value:  # a non-empty list (GGUF has no empty arrays)
        writer.add_array(key, value)


def write(source: Source, path: Path, dtype: torch.dtype, options: GGUFOptions) -> None:
    """Write ``source`` as one GGUF file at ``path``."""
    import gguf

    from compress.exporters.gguf_vocab import vocab_of

    model, config = source.model, source.model.config
    arch = gguf_arch.arch_of(source.model_type)
    if source.tokenizer is None:
        raise ValueError("--format gguf needs the model's tokenizer beside its weights; none was found")
    embed_type = options.embed_type or {torch.float32: "f32", torch.bfloat16: "bf16"}.get(dtype, "f16")
    metadata = {**gguf_arch.hparams(config, arch), **vocab_of(source.tokenizer, config.vocab_size).values()}
    output_type = options.output_type or (HEAD_TYPE if source.quantized and options.embed_type is None else None)
    tensors = plan_tensors(model, arch, options, embed_type, source.tables, output_type)
    requantized = sorted(n for n, e in tensors.items() if e.how == "requantized")
    if requantized:
        log.warning("requantized %d tensor(s) to %s by llama.cpp's rounding (not lossless): %s", len(requantized),
                    "/".join(sorted({tensors[n].qtype for n in requantized})),
                    ", ".join(requantized[:4]) + (" ..." if len(requantized) > 4 else ""))
    blocks = Counter(e.qtype for e in tensors.values() if e.qtype in gguf_quants.BYTES_PER_BLOCK)
    main_type = blocks.most_common(1)[0][0] if blocks else embed_type
    metadata.update({"general.name": source.path.name if source.path else source.model_type,
                     "general.file_type": FILE_TYPES[main_type], "general.quantization_version": 2,
                     **provenance(source, tensors, options)})
    writer = gguf.GGUFWriter(str(path), arch.name)
    for key, value in metadata.items():
        _add(writer, key, value)
    for name, enc in tensors.items():
        raw = getattr(gguf.GGMLQuantizationType, enc.qtype.upper()) if enc.data.dtype == torch.uint8 else None
        writer.add_tensor(name, enc.data.contiguous().numpy(), raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    log.info("wrote %d tensors (%s) to %s", len(tensors), dict(Counter(e.qtype for e in tensors.values())), path)
