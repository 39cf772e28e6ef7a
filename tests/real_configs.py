"""Published checkpoints' configs (tests/configs/<model_type>/<org>--<name>.json) shrunk to tiny random models.

Only sizes shrink; every id, flag and setting of the published config is kept, so the quirks real checkpoints carry
(special ids at the end of a large vocabulary, bos == eos, untied heads, rope scaling, sliding-window patterns,
multipliers, partial rotary, explicit head_dim unequal to hidden / heads) reach every step. The rules:

- heads: the attention kind is kept. MHA becomes 4 heads, MQA 1 KV head and up to 4 query heads, GQA 2 KV heads
  with the published group size (query heads per KV head) unchanged.
- head_dim: 16, doubled until the attention width (heads x head_dim) is a multiple of 64 (the recipes' group
  size) and, where the published config's hidden size differs from heads x head_dim, until the tiny one differs the
  same way (larger or smaller); head_dim is written out when the published config writes it or when it differs
  from hidden / heads. ``query_pre_attn_scalar`` follows head_dim by the same ratio.
- hidden 64 (or what the head rule asks), intermediate widths keep their ratio to hidden, in multiples of 64.
- layers: 2; where the config has layer types (sliding and full attention), the first two published layer types,
  plus the first full (or sliding) layer when the two lack one, so both kinds appear.
- experts: 4, top-k = min(published top-k, 2); ``mlp_only_layers`` keeps the indices that still exist.
- vocabulary: ``SMALL_VOCAB`` rows. A special id below 256 is kept; an id in the last ``SMALL_VOCAB - 256`` rows
  of the published vocabulary keeps its distance from the end (new = SMALL_VOCAB - (vocab - id)), so a pad id
  near the end stays near the end; any other id is an error (no config in the corpus has one). The tiny models
  carry the 256-token byte tokenizer of tests/tiny_models.py: calibration text only reaches the first 256 rows,
  and the rows above are the vocabulary padding real checkpoints carry beyond their tokenizer.
- rope: every setting kept (theta, llama3/yarn/longrope scaling, original and max positions); longrope's per-dim
  factor lists are resampled (evenly spaced, ends kept) to the tiny rotary width, which they must match.
- dtype: the tiny models are saved in float32 (the parity tests compare fp32 numerics); the published dtype is
  the one setting not kept.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIGS = Path(__file__).resolve().parent / "configs"
SMALL_VOCAB = 1024
KEPT_IDS = 256  # ids below this are kept as they are
ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass(frozen=True)
class RealConfig:
    """One published checkpoint's files, as stored under tests/configs."""

    model_type: str
    name: str  # "<org>--<name>", the hub id with "/" spelled "--"
    source: str
    config: dict
    generation_config: dict | None
    special_tokens: dict | None

    @property
    def id(self) -> str:
        return f"{self.model_type}/{self.name}"

    @property
    def hub_id(self) -> str:
        return self.name.replace("--", "/", 1)


def load_all() -> list[RealConfig]:
    """Every stored config, sorted by model type then name."""
    out = []
    for path in sorted(CONFIGS.glob("*/*.json")):
        data = json.loads(path.read_text())
        out.append(RealConfig(path.parent.name, path.stem, data["source"], data["config"],
                              data.get("generation_config"), data.get("special_tokens")))
    return out


def covered() -> dict[str, list[str]]:
    """model_type -> the hub ids of its stored configs."""
    out: dict[str, list[str]] = {}
    for real in load_all():
        out.setdefault(real.model_type, []).append(real.hub_id)
    return out


def remap_id(i: int | None, vocab: int) -> int | None:
    """A special id of a ``vocab``-row vocabulary in the ``SMALL_VOCAB``-row one (the module's rule)."""
    if i is None or i < KEPT_IDS:
        return i
    if vocab - i <= SMALL_VOCAB - KEPT_IDS:
        return SMALL_VOCAB - (vocab - i)
    raise ValueError(f"id {i} of a {vocab}-row vocabulary is neither below {KEPT_IDS} nor in its last "
                     f"{SMALL_VOCAB - KEPT_IDS} rows")


def remap_ids(d: dict, vocab: int) -> dict:
    """``d`` with its bos/eos/pad ids (ints or lists) remapped."""
    out = dict(d)
    for k in ID_KEYS:
        v = out.get(k)
        if isinstance(v, list):
            out[k] = [remap_id(i, vocab) for i in v]
        elif v is not None:
            out[k] = remap_id(v, vocab)
    return out


def _width(n: int, ratio: float) -> int:
    """A width ``ratio`` times ``n``, in multiples of 64 (at least 64)."""
    return max(64, round(n * ratio / 64) * 64)


def _heads(n: int, kv: int) -> tuple[int, int]:
    if n % kv:
        raise ValueError(f"{n} attention heads do not share {kv} KV heads evenly")
    if kv == n:
        return 4, 4
    if kv == 1:
        return min(n, 4), 1
    return 2 * (n // kv), 2


def _attention(c: dict) -> dict:
    """Heads, head_dim and hidden size of the tiny model (the module's head rule)."""
    n, kv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    hd = c.get("head_dim") or c["hidden_size"] // n
    ratio = c["hidden_size"] / (n * hd)
    n_s, kv_s = _heads(n, kv)
    hd_s = 16 * (4 // math.gcd(n_s, 4))
    while True:
        width = n_s * hd_s * ratio
        hidden = 64 * (math.ceil(width / 64) if ratio > 1 else math.floor(width / 64))
        if hidden >= 64 and (ratio == 1 or hidden != n_s * hd_s):
            break
        hd_s *= 2
    out = {"num_attention_heads": n_s, "num_key_value_heads": kv_s, "hidden_size": hidden}
    if "head_dim" in c or hidden != n_s * hd_s:
        out["head_dim"] = hd_s
    if c.get("query_pre_attn_scalar") is not None:
        out["query_pre_attn_scalar"] = round(c["query_pre_attn_scalar"] * hd_s / hd)
    return out


def _resample(factors: list, k: int) -> list:
    """``k`` of ``factors``, evenly spaced, first and last kept."""
    if k == 1:
        return factors[:1]
    return [factors[round(j * (len(factors) - 1) / (k - 1))] for j in range(k)]


def _layer_types(model_type: str, c: dict) -> list[str] | None:
    from transformers import AutoConfig

    kw = {k: v for k, v in c.items() if k != "model_type"}
    types = getattr(AutoConfig.for_model(model_type, **kw), "layer_types", None)
    if not types:
        return None
    pick = list(types[:2])
    for kind in ("full_attention", "sliding_attention"):
        if kind in types and kind not in pick:
            pick.append(kind)
    return pick


def shrunk(real: RealConfig) -> dict:
    """The published config dict with only its sizes shrunk (the module's rules)."""
    c = dict(real.config)
    vocab = c["vocab_size"]
    small = remap_ids(c, vocab)
    small["vocab_size"] = SMALL_VOCAB
    att = _attention(c)
    small.update(att)
    hidden, ratio = att["hidden_size"], 1 / c["hidden_size"]
    for k in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if c.get(k):
            small[k] = _width(hidden, c[k] * ratio)
    for k in ("num_experts", "num_local_experts"):
        if c.get(k):
            small[k] = 4
    if c.get("num_experts_per_tok"):
        small["num_experts_per_tok"] = min(c["num_experts_per_tok"], 2)
    types = _layer_types(real.model_type, c)
    small["num_hidden_layers"] = len(types) if types else 2
    if types:
        small["layer_types"] = types
    if c.get("mlp_only_layers"):
        small["mlp_only_layers"] = [i for i in c["mlp_only_layers"] if i < small["num_hidden_layers"]]
    scaling = c.get("rope_scaling")
    if isinstance(scaling, dict) and "long_factor" in scaling:  # longrope: one factor per rotary frequency
        hd = small.get("head_dim") or hidden // small["num_attention_heads"]
        k = int(hd * c.get("partial_rotary_factor", 1.0)) // 2
        small["rope_scaling"] = {**scaling, "long_factor": _resample(scaling["long_factor"], k),
                                 "short_factor": _resample(scaling["short_factor"], k)}
    small.pop("_name_or_path", None)
    return small


def tiny_config(real: RealConfig):
    """The shrunk config as transformers' config class for the model type (its own validation applies)."""
    from transformers import AutoConfig

    c = shrunk(real)
    return AutoConfig.for_model(c.pop("model_type"), **c)


def build(real: RealConfig, path: Path, seed: int = 0, weight_std: float = 0.15):
    """The tiny random model saved in ``path`` with the byte tokenizer and the published generation config (its
    ids remapped); returns the fp32 model. Linear weights get a wide spread so greedy outputs vary step to step."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from tiny_models import byte_tokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(real), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name:  # linears, and fused 3D experts
                p.copy_(torch.randn(p.shape, generator=g) * weight_std)
            elif "norm" in name:  # away from 1 (or 0 for Gemma's 1 + w), so a wrong norm form shows
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    if real.generation_config is not None:
        gen = remap_ids(real.generation_config, real.config["vocab_size"])
        model.generation_config = GenerationConfig.from_dict({k: v for k, v in gen.items() if not k.startswith("_")})
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return model
