"""What the toolkit knows about each decoder family, in one table keyed by ``config.model_type``.

Every step reads its part of a :class:`Family` here: AWQ's smoothing map and the rotations' folding
(``smooth``, compress/format/mappings.py), GQA conversion (``attn``), MoE packing (``experts``), the runtime's
routing (``moe``) and its native model (the modeling fields), the ONNX exporters (``onnx``) and the GGUF
writer (``gguf``). A step whose entry is ``None`` (or ``False``) does not handle the family, and says so
before any work through :func:`require`. Values read from a model's own config (sliding windows,
soft-capping, rotary parameters, multipliers) stay in that config; this table says how to read them.
``python scripts/support_matrix.py`` writes the family x step matrix in the README from this table.
"""
from __future__ import annotations

from dataclasses import dataclass



@dataclass(frozen=True)
class Smooth:
    prev: str  # a norm or a linear inside the block
    linears: tuple[str, ...]
    inspect: str | None = None


@dataclass(frozen=True)
class Residual:
    """How a block reads and writes the residual stream, for rotations (compress/transforms/rotate.py). Names are
    parameters: ``reads`` pairs each norm with the weights that read its output (last dim = hidden),
    ``writes`` are the weights that add to the stream (dim -2 = hidden; a sibling ``bias`` is rotated too),
    ``values`` the value/output projections rotated per head."""

    reads: tuple[tuple[str, tuple[str, ...]], ...]
    writes: tuple[str, ...]
    values: tuple[str, str] = ("self_attn.v_proj.weight", "self_attn.o_proj.weight")


@dataclass(frozen=True)
class BlockMap:
    smooths: tuple[Smooth, ...]
    norm_offset: float = 0.0  # Gemma's RMSNorm multiplies by (offset + weight)
    # AWQ's clipping search skips q/k: their error is read through a softmax, not their own output
    no_clip: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj")
    residual: Residual | None = None  # None: a residual rotation cannot be folded; ``no_rotation`` says why
    no_rotation: str = ""


_ATTN_IN = Smooth("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn")
_ATTN_OUT = Smooth("self_attn.v_proj", ("self_attn.o_proj",))
_MLP_UP = ("mlp.gate_proj", "mlp.up_proj")
_MLP_DOWN = Smooth("mlp.up_proj", ("mlp.down_proj",))

_QKV = ("input_layernorm.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"))
_DENSE_RES = Residual((_QKV, ("post_attention_layernorm.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"))),
                      ("self_attn.o_proj.weight", "mlp.down_proj.weight"))
_MOE_RES = Residual((_QKV, ("post_attention_layernorm.weight", ("mlp.gate.weight", "mlp.experts.gate_up_proj"))),
                    ("self_attn.o_proj.weight", "mlp.experts.down_proj"))
_SHARED = ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight", "mlp.shared_expert_gate.weight")
_QWEN2_MOE_RES = Residual((_QKV, ("post_attention_layernorm.weight", (*_MOE_RES.reads[1][1], *_SHARED))),
                          (*_MOE_RES.writes, "mlp.shared_expert.down_proj.weight"))

_POST_NORMS = ("its post-attention and post-feedforward norms normalize what the block writes to the residual "
               "stream, so their weights cannot be folded into any linear")
LLAMA = BlockMap((_ATTN_IN, _ATTN_OUT, Smooth("post_attention_layernorm", _MLP_UP, "mlp"), _MLP_DOWN),
                 residual=_DENSE_RES)
GEMMA = BlockMap(LLAMA.smooths, norm_offset=1.0, residual=_DENSE_RES)
GEMMA2 = BlockMap((_ATTN_IN, _ATTN_OUT, Smooth("pre_feedforward_layernorm", _MLP_UP, "mlp"), _MLP_DOWN),
                  norm_offset=1.0, no_rotation=_POST_NORMS)
# Phi-3 fuses q/k/v and gate/up: each fused linear is smoothed whole; o and down have no separable producer
PHI3 = BlockMap((Smooth("input_layernorm", ("self_attn.qkv_proj",), "self_attn"),
                 Smooth("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp")),
                no_clip=("self_attn.qkv_proj",),
                no_rotation="its value projection is fused into qkv_proj, which the per-head value rotation "
                "does not split")
# OLMo 2 has no norm before attention or the MLP: only the linear -> linear pairs can be smoothed
OLMO2 = BlockMap((_ATTN_OUT, _MLP_DOWN), no_rotation=_POST_NORMS)
# Mixture-of-experts blocks: only attention is smoothed here; experts are handled by compress/methods/common/moe.py
MOE = BlockMap((_ATTN_IN, _ATTN_OUT), residual=_MOE_RES)
QWEN2_MOE = BlockMap(MOE.smooths, residual=_QWEN2_MOE_RES)

@dataclass(frozen=True)
class AttnLayout:
    """Where a decoder block keeps its attention and which projections produce keys and values."""

    attn: str = "self_attn"
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    rope_keys: bool = True  # keys are q.k-scored right after rotate_half RoPE (no per-head q/k norm in between)


@dataclass(frozen=True)
class ExpertLayout:
    """Where a decoder block keeps its fused experts (relative name) and their two 3D parameters."""

    experts: str = "mlp.experts"
    gate_up: str = "gate_up_proj"  # [E, 2I, H]: gate rows then up rows
    down: str = "down_proj"  # [E, H, I]


@dataclass(frozen=True)
class MoEArch:
    """How one MoE family names, places and routes its experts (runtime/models/moe.py)."""

    intermediate_key: str = "moe_intermediate_size"  # config key of one expert's width
    always_renormalize: bool = False  # Mixtral renormalizes the top-k weights whatever norm_topk_prob says
    fp32_weights: bool = False  # Mixtral scales expert outputs by fp32 weights; others by model-dtype ones
    shared_expert: bool = False  # Qwen2-MoE: a dense expert on every token, times sigmoid(shared_expert_gate(x))
    sparse_step: bool = False  # Qwen-MoE: decoder_sparse_step and mlp_only_layers choose the MoE layers
    legacy_block: str = "mlp"  # per-expert checkpoints (the hub layout): the block's name...
    legacy_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # ...and each expert's linears


@dataclass(frozen=True)
class GGUFArch:
    name: str  # general.architecture
    permute_qk: bool  # interleave the rows of each q/k head for NORM rope (compress/exporters/gguf_arch.py)
    scalars: tuple[tuple[str, str], ...] = ()  # (key under the architecture, config attribute): float hparams
    names: tuple[tuple[str, str], ...] = ()  # (block module, GGUF name) where llama.cpp's name for it differs
    counts: tuple[tuple[str, str], ...] = ()  # (key under the architecture, config attribute): integer hparams
    swa_layers: bool = False  # write which layers use the sliding window (config.layer_types)


NORMS = ("pre", "sandwich", "post")


@dataclass(frozen=True)
class Family:
    # the modeling: what the native runtime model and the weight transforms must reproduce
    norms: str = "pre"  # "pre": norms before attention and MLP (Llama); "sandwich": also after each (Gemma 2/3);
    #                     "post": after each only (OLMo 2)
    norm_offset: float = 0.0  # RMSNorm multiplies by (offset + w) (Gemma: 1)
    final_norm: str = "model.norm"  # the norm after the last block, whose output the head reads (relative to the model)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    qk_norm: str = ""  # RMSNorm on q and k before RoPE: "head" per head (Qwen3, Gemma 3), "proj" whole projection
    fused_proj: bool = False  # the checkpoint stores qkv_proj and gate_up_proj fused (Phi-3)
    multipliers: bool = False  # embedding/residual/attention multipliers and logits_scaling in the config (Granite)
    default_act: str = "silu"
    moe: MoEArch | None = None  # mixture-of-experts MLP routing in the runtime
    # the steps: None or False when the step does not handle the family
    smooth: BlockMap | None = None  # AWQ's smoothing map, and the rotations' folding (its ``residual``)
    attn: AttnLayout | None = None  # GQA/MQA conversion of the KV heads
    experts: ExpertLayout | None = None  # fused 3D expert weights quantized and packed per expert
    onnx: bool = False  # the ONNX exporters trace it
    gguf: GGUFArch | None = None  # llama.cpp's architecture
    runtime: bool = True  # a native runtime model (else served through transformers' modeling code, slower)
    refused: tuple[tuple[str, str], ...] = ()  # (step, why the family cannot take it), for the error

    def why_not(self, step: str) -> str:
        if step == "rotate" and self.smooth is not None and self.smooth.no_rotation:
            return self.smooth.no_rotation
        return dict(self.refused).get(step, "")

    def __post_init__(self):
        if self.norms not in NORMS:
            raise ValueError(f"norms={self.norms!r}; expected one of {NORMS}")
        if self.smooth is not None and self.smooth.norm_offset != self.norm_offset:
            raise ValueError("the smoothing map's norm_offset disagrees with the family's")


_K_NORM_ALL_HEADS = "its k_norm spans all KV heads at once (width K x head_dim), so pooled heads cannot keep it exact"
_MOE_ONNX = ("torch's ONNX exporter has no function for transformers' grouped_mm experts, and onnx-int4 no op for "
             "packed experts")
_STD = AttnLayout()
_QK_NORM = AttnLayout(rope_keys=False)
_GEMMA = dict(norm_offset=1.0, embed_scale=True, default_act="gelu_pytorch_tanh")
_QWEN_MOE = MoEArch(sparse_step=True)

# llama.cpp's gemma2: Gemma's graph with sandwich norms, soft-capping and sliding-window layers
_GEMMA2_GGUF = GGUFArch("gemma2", False, (("attn_logit_softcapping", "attn_logit_softcapping"),
                                          ("final_logit_softcapping", "final_logit_softcapping")),
                        names=(("post_attention_layernorm", "post_attention_norm"),
                               ("pre_feedforward_layernorm", "ffn_norm"),
                               ("post_feedforward_layernorm", "post_ffw_norm")),
                        counts=(("attention.sliding_window", "sliding_window"),))
_GEMMA3_GGUF = GGUFArch("gemma3", False, names=_GEMMA2_GGUF.names, counts=_GEMMA2_GGUF.counts, swa_layers=True)
# llama.cpp's granite: a llama graph scaled by the config's multipliers
_GRANITE_GGUF = GGUFArch("granite", True, (("attention.scale", "attention_multiplier"),
                                            ("embedding_scale", "embedding_multiplier"),
                                            ("residual_scale", "residual_multiplier"),
                                            ("logit_scale", "logits_scaling")))

FAMILIES: dict[str, Family] = {
    "llama": Family(smooth=LLAMA, attn=_STD, onnx=True, gguf=GGUFArch("llama", True)),
    "mistral": Family(smooth=LLAMA, attn=_STD, onnx=True, gguf=GGUFArch("llama", True)),
    "qwen2": Family(smooth=LLAMA, attn=_STD, onnx=True, gguf=GGUFArch("qwen2", False)),
    "qwen3": Family(qk_norm="head", smooth=LLAMA, attn=_QK_NORM, onnx=True, gguf=GGUFArch("qwen3", False)),
    "gemma": Family(**_GEMMA, smooth=GEMMA, attn=_STD, onnx=True, gguf=GGUFArch("gemma", False)),
    "gemma2": Family(**_GEMMA, norms="sandwich", smooth=GEMMA2, attn=_STD, onnx=True, gguf=_GEMMA2_GGUF),
    "gemma3_text": Family(**_GEMMA, norms="sandwich", qk_norm="head", smooth=GEMMA2, attn=_QK_NORM, onnx=True,
                          gguf=_GEMMA3_GGUF),
    "phi3": Family(fused_proj=True, smooth=PHI3, onnx=True, gguf=GGUFArch("phi3", False, names=(
        ("self_attn.qkv_proj", "attn_qkv"), ("mlp.gate_up_proj", "ffn_up"))),
        refused=(("gqa", "its keys and values are rows of the fused qkv_proj, which the conversion does not split"),)),
    "olmo2": Family(norms="post", qk_norm="proj", smooth=OLMO2, onnx=True, gguf=GGUFArch("olmo2", False, names=(
        ("post_attention_layernorm", "post_attention_norm"), ("post_feedforward_layernorm", "post_ffw_norm"))),
        refused=(("gqa", _K_NORM_ALL_HEADS),)),
    "granite": Family(multipliers=True, smooth=LLAMA, attn=_STD, onnx=True, gguf=_GRANITE_GGUF),
    "mixtral": Family(moe=MoEArch(intermediate_key="intermediate_size", always_renormalize=True, fp32_weights=True,
                                  legacy_block="block_sparse_moe", legacy_names=("w1", "w3", "w2")),
                      smooth=MOE, attn=_STD, experts=ExpertLayout(), gguf=GGUFArch("llama", True),
                      refused=(("onnx", _MOE_ONNX),)),
    "qwen2_moe": Family(moe=MoEArch(shared_expert=True, sparse_step=True), smooth=QWEN2_MOE, attn=_STD,
                        experts=ExpertLayout(), gguf=GGUFArch("qwen2moe", False), refused=(("onnx", _MOE_ONNX),)),
    "qwen3_moe": Family(qk_norm="head", moe=_QWEN_MOE, smooth=MOE, attn=_QK_NORM, experts=ExpertLayout(),
                        gguf=GGUFArch("qwen3moe", False), refused=(("onnx", _MOE_ONNX),)),
    "olmoe": Family(qk_norm="proj", moe=MoEArch(intermediate_key="intermediate_size"), smooth=MOE,
                    experts=ExpertLayout(), refused=(("gqa", _K_NORM_ALL_HEADS), ("onnx", _MOE_ONNX),
                                                     ("gguf", "its GGUF tensor names are not mapped yet"))),
}

# step -> (the part of a Family it needs, what it is called in errors)
STEPS = {
    "awq": ("smooth", "AWQ smoothing (method awq)"),
    "rotate": ("rotate", "rotation folding (rotate: hadamard)"),
    "gqa": ("attn", "KV-head conversion (kv_heads)"),
    "moe": ("experts", "mixture-of-experts packing"),
    "onnx": ("onnx", "the ONNX export (--format onnx, onnx-int4)"),
    "gguf": ("gguf", "the GGUF export (--format gguf)"),
    "runtime": ("runtime", "the runtime's native models"),
}


def supports(model_type: str, step: str) -> bool:
    fam = FAMILIES.get(model_type)
    if fam is None:
        return False
    if step == "rotate":
        return fam.smooth is not None and fam.smooth.residual is not None
    return bool(getattr(fam, STEPS[step][0]))


def supported(step: str) -> list[str]:
    return [t for t in FAMILIES if supports(t, step)]


def family(model_type: str) -> Family:
    """The family's entry, or a ValueError naming the known ones."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not in compress/format/families.py; known families: "
                         f"{', '.join(FAMILIES)} (rtn, gptq, nf4 and int8 quantize any decoder whose blocks are "
                         f"model.layers)")
    return FAMILIES[model_type]


def require(model_type: str, step: str, why: str = "") -> Family:
    """The family's entry when ``step`` handles it; else one ValueError naming the family, the step and
    the families it does handle (``why``: the family's own reason, when it has one)."""
    if not supports(model_type, step):
        why = why or (FAMILIES[model_type].why_not(step) if model_type in FAMILIES else "")
        reason = f" ({why})" if why else ""
        raise ValueError(f"{STEPS[step][1]} does not handle model_type {model_type!r}{reason}; "
                         f"supported: {', '.join(supported(step))}")
    return FAMILIES[model_type]


# what every step reads from a decoder's config.json
REQUIRED_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# rope_type -> the parameters its frequencies are computed from, which no default stands in for (transformers only
# warns when one is absent, and the model then fails deep inside its first forward or the export)
ROPE_FIELDS = {"default": (), "linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
               "longrope": ("short_factor", "long_factor"),
               "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def check_rope(config: dict, what: str = "this model") -> None:
    """Refuse rope parameters that name a rope type without the values its frequencies need, naming them."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    groups = params.values() if params and all(isinstance(v, dict) for v in params.values()) else [params]
    for p in groups:  # one rotary, or one per layer type (Gemma 3's local and global)
        kind = p.get("rope_type", p.get("type", "default"))
        if kind not in ROPE_FIELDS:
            continue  # a type the steps that use rope refuse themselves, naming the ones they handle
        lacks = [k for k in ROPE_FIELDS[kind] if p.get(k) is None
                 and not (k == "original_max_position_embeddings" and config.get(k) is not None)]
        if lacks:
            raise ValueError(f"{what}'s config.json sets rope_type {kind!r} without {', '.join(lacks)} (model_type "
                             f"{config.get('model_type')!r}); copy them from the published config.json's "
                             "rope_scaling (or rope_parameters)")


def check_fields(config: dict, what: str = "this model") -> None:
    """Refuse, naming them, the fields of a ``config.json`` dict every step reads and nothing can default."""
    missing = [f for f in REQUIRED_FIELDS if config.get(f) is None]
    if missing:
        raise ValueError(f"{what}'s config.json lacks {', '.join(missing)} (model_type "
                         f"{config.get('model_type')!r}); a decoder-only causal LM config is expected")
    check_rope(config, what)


def check_config(config: dict, trust_remote_code: bool = False, what: str = "this model") -> str:
    """The model type of a ``config.json`` dict, after the checks every step needs before reading weights:
    the fields it reads are there, and a model that needs its own Python code has ``trust_remote_code``."""
    check_fields(config, what)
    mt = config["model_type"]
    from transformers import CONFIG_MAPPING

    # a published config may keep the auto_map of the code it shipped before transformers had the model (Phi-3.5,
    # Phi-4-mini): transformers then runs its own implementation, as runtime/models/hf_backend.py does
    if config.get("auto_map") and not trust_remote_code and mt not in CONFIG_MAPPING:
        raise ValueError(f"model_type {mt!r} of {what} runs its own Python code (auto_map in config.json); pass "
                         "--trust-remote-code (trust_remote_code=True) only if you trust its source")
    if mt not in FAMILIES and not config.get("auto_map"):
        if mt not in CONFIG_MAPPING:
            raise ValueError(f"model_type {mt!r} of {what} is unknown to this transformers and has no code of its "
                             f"own; known families: {', '.join(FAMILIES)}")
    return mt
