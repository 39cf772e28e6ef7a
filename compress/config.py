"""The quantization config and the recipes that map 1:1 onto it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from compress.quant import Scheme

METHODS = ("rtn", "gptq", "awq", "nf4", "qat")
QAT_INITS = ("rtn", "awq")
ROUNDINGS = ("rtn", "gptq")  # awq's final rounding
TRAIN_DTYPES = ("bfloat16", "float32")
KV_INITS = ("mean", "pca")  # compress/gqa.py
UPTRAIN_SCOPES = ("blocks", "attn")  # compress/gqa.py: uptraining moves whole decoder blocks, or attention only
ROTATIONS = ("none", "hadamard")  # compress/rotate.py: a randomized Hadamard folded into the weights
RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


@dataclass(frozen=True)
class QuantizeConfig:
    """Everything `compress quantize` needs; recipes and CLI flags set these fields."""

    method: str = "rtn"
    bits: int = 4
    group_size: int = 128
    sym: bool = False
    description: str = ""
    # calibration
    calib: str = "wiki"
    nsamples: int = 128
    seqlen: int = 512
    seed: int = 0
    batch_size: int = 8
    calib_dtype: str = "float32"  # or bfloat16: block forwards during calibration under CPU autocast
    # gptq
    damp: float = 0.01
    block_size: int = 128
    act_order: bool = False
    static_groups: bool = False
    mse: bool = False  # gptq: clip each group's grid to minimise H-diagonal-weighted rounding error
    # awq
    grid: int = 20
    duo_scaling: bool = True  # search x_mean^r / w_mean^(1-r) (AutoAWQ, llm-compressor) instead of x_mean^r
    clip: bool = True
    search_tokens: int = 4096
    clip_tokens: int = 512  # token rows of each linear's input that judge its clipping range
    clip_grid: int = 20  # clipping shrink factors are tried in steps of 1 / clip_grid, down to 0.5
    rounding: str = "rtn"  # awq: round the smoothed, clipped weights by rtn (AutoAWQ) or gptq (the gptq fields)
    # before any method: fold the norms and rotate the residual stream and each value head (compress/rotate.py)
    rotate: str = "none"
    # pick each group's range by the activation-weighted rounding error (gptq's grid, awq's rtn rounding)
    weighted_range: bool = False
    # fp linears kept as they are (regular expressions on module names)
    ignore: tuple[str, ...] = ("lm_head",)
    # qat: start from a PTQ result (init), then distil the fp model for `steps` (weights at lr, scales at scale_lr)
    init: str = "rtn"
    steps: int = 200
    lr: float = 1e-5
    scale_lr: float = 1e-3
    learn_zero: bool = False
    train_dtype: str = "bfloat16"  # autocast dtype of training forwards (qat and uptraining); float32 disables
    # gqa: pool the KV heads down to kv_heads (0 keeps them), uptrain for uptrain_steps, then quantize
    kv_heads: int = 0
    kv_init: str = "pca"  # new KV heads: "pca" (activation-aware merge, needs calibration) or "mean" pooling
    kv_fit_steps: int = 0  # then fit each merged attention to the original's outputs, this many steps per layer
    kv_fit_lr: float = 1e-3
    uptrain_steps: int = 0
    uptrain_lr: float = 5e-5
    uptrain_scope: str = "blocks"  # what uptraining moves: whole decoder "blocks" or "attn" (attention) only
    # moe: an expert routed fewer calibration tokens than this is RTN-quantized (None: compress.moe default)
    moe_min_tokens: int | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is unknown; use one of {METHODS}")
        self.scheme  # validates bits / group_size
        for name in ("nsamples", "seqlen", "batch_size", "block_size", "grid", "search_tokens", "clip_tokens",
                     "clip_grid"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not 0 < self.damp < 1:
            raise ValueError(f"damp={self.damp} must be in (0, 1), e.g. 0.01")
        if self.calib_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"calib_dtype={self.calib_dtype!r} must be float32 or bfloat16")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding={self.rounding!r} is unknown; use one of {ROUNDINGS}")
        if self.rounding != "rtn" and self.method != "awq":
            raise ValueError(f"rounding={self.rounding!r} applies to method awq only, not {self.method!r}")
        gptq_rounding = self.method == "gptq" or self.rounding == "gptq"
        if self.rotate not in ROTATIONS:
            raise ValueError(f"rotate={self.rotate!r} is unknown; use one of {ROTATIONS}")
        if self.weighted_range and self.method not in ("gptq", "awq", "qat"):
            raise ValueError(f"weighted_range needs calibration statistics: it applies to gptq, awq and qat, not "
                             f"{self.method!r} (for a weighted RTN use method: awq with grid: 1 and clip: false)")
        if self.weighted_range and self.mse:
            raise ValueError("weighted_range and mse both pick gptq's grid; set one of them")
        for name in ("act_order", "static_groups", "mse"):
            if getattr(self, name) and not gptq_rounding:
                raise ValueError(f"{name} applies to method gptq (or awq with rounding: gptq) only, "
                                 f"not {self.method!r}")
        self._validate_training()
        object.__setattr__(self, "ignore", tuple(self.ignore))

    def _validate_training(self) -> None:
        if self.init not in QAT_INITS:
            raise ValueError(f"init={self.init!r} is unknown; use one of {QAT_INITS}")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be >= 1")
        for name in ("lr", "uptrain_lr", "kv_fit_lr"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be in (0, 1), e.g. 1e-5")
        if not 0 <= self.scale_lr < 1:
            raise ValueError(f"scale_lr={self.scale_lr} must be in [0, 1), e.g. 1e-3 (0 keeps the scales fixed)")
        if self.train_dtype not in TRAIN_DTYPES:
            raise ValueError(f"train_dtype={self.train_dtype!r} is unknown; use one of {TRAIN_DTYPES}")
        if self.kv_heads < 0:
            raise ValueError(f"kv_heads={self.kv_heads} must be >= 1 (or 0 to keep the model's KV heads)")
        if self.kv_init not in KV_INITS:
            raise ValueError(f"kv_init={self.kv_init!r} is unknown; use one of {KV_INITS}")
        for name in ("uptrain_steps", "kv_fit_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
            if getattr(self, name) and not self.kv_heads:
                raise ValueError(f"{name}={getattr(self, name)} trains a KV-head conversion; set kv_heads too")
        if self.uptrain_scope not in UPTRAIN_SCOPES:
            raise ValueError(f"uptrain_scope={self.uptrain_scope!r} is unknown; use one of {UPTRAIN_SCOPES}")
        if self.moe_min_tokens is not None and self.moe_min_tokens < 1:
            raise ValueError(f"moe_min_tokens={self.moe_min_tokens} must be >= 1")

    @property
    def scheme(self) -> Scheme:
        fmt = "nf4" if self.method == "nf4" else "int"
        return Scheme(bits=self.bits, group_size=self.group_size, sym=self.sym or fmt == "nf4", format=fmt)

    @property
    def needs_calibration(self) -> bool:
        return (self.method in ("gptq", "awq", "qat") or self.uptrain_steps > 0 or self.kv_fit_steps > 0
                or (self.kv_heads > 0 and self.kv_init == "pca"))

    def replace(self, **changes) -> "QuantizeConfig":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "ignore": list(self.ignore)}


FIELDS = {f.name for f in dataclasses.fields(QuantizeConfig)}


def recipe_path(name: str) -> Path:
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    p = RECIPES_DIR / f"{name}.yaml"
    if not p.is_file():
        raise FileNotFoundError(f"recipe {name!r} not found; known recipes: {', '.join(list_recipes())}")
    return p


def load_recipe(name: str) -> QuantizeConfig:
    """A recipe name (recipes/NAME.yaml) or a path to a YAML file -> QuantizeConfig."""
    p = recipe_path(name)
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"recipe {p} must be a flat mapping of config fields")
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise ValueError(f"recipe {p.name}: unknown key(s) {unknown}; allowed: {sorted(FIELDS)}")
    return QuantizeConfig(**data)


def list_recipes() -> dict[str, str]:
    """Recipe name -> its one-line description."""
    out = {}
    for p in sorted(RECIPES_DIR.glob("*.yaml")):
        out[p.stem] = (yaml.safe_load(p.read_text()) or {}).get("description", "")
    return out
