"""The quantization config and the recipes that map 1:1 onto it.

A recipe is a flat YAML mapping; the config groups what only one method reads into typed option groups
(``cfg.gptq``, ``cfg.awq``, ``cfg.qat``, like ``cfg.scheme``) that each method's dense and expert paths
take whole. Every group field keeps its flat recipe name, so ``damp: 0.05`` is ``cfg.gptq.damp``.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from compress.format.quant import Scheme

METHODS = ("rtn", "gptq", "awq", "nf4", "qat")  # compress/pipeline.py METHODS runs each
QAT_INITS = ("rtn", "awq", "gptq")  # compress/methods/qat.py: the PTQ result training starts from
ROUNDINGS = ("rtn", "gptq")  # awq's final rounding
TRAIN_DTYPES = ("bfloat16", "float32")
KV_INITS = ("mean", "pca")  # compress/transforms/gqa.py
UPTRAIN_SCOPES = ("blocks", "attn")  # what uptraining moves (compress/transforms/gqa.py)
ROTATIONS = ("none", "hadamard")  # compress/transforms/rotate.py
OUTER_CHOICES = ("none", "int8", "int4")  # the embedding's and the head's codes (compress/methods/embed_head.py)
DAMP_REFS = ("mean", "median")  # what GPTQ's damp is a fraction of: the Hessian diagonal's mean or median
HEAD_METHODS = ("rtn", "gptq")  # a quantized head's rounding (compress/methods/head_gptq.py)
RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


def _at_least_one(group, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(group, name) < 1:
            raise ValueError(f"{name}={getattr(group, name)} must be >= 1")


@dataclass(frozen=True)
class GPTQOptions:
    """GPTQ's rounding (method gptq, and awq with ``rounding: gptq``)."""

    damp: float = 0.01  # Hessian damping, as a fraction of its mean (or median: damp_of) diagonal
    # the median is not moved by a few outlier input channels (massive activations), whose size differs by family
    damp_of: str = "mean"
    block_size: int = 128  # columns per lazy batch update (speed only)
    act_order: bool = False
    static_groups: bool = False
    mse: bool = False  # clip each group's grid to minimise the H-diagonal-weighted rounding error
    mse_coarse: int = 0  # the mse grid: every step (0), or every mse_coarse-th, then refined (quant.mse_params)
    # the Hessians' x^T x from the inputs rounded to bfloat16 (what a bf16 linear multiplies), every product and sum
    # in float32: ~2x faster where the CPU has bf16 dot products (methods/common/hessian.py add_gram_bf16_)
    bf16_gram: bool = False
    guided: bool = False  # weigh each Hessian's tokens by their loss gradients (methods/common/guided.py; not streamed)
    guided_mix: float = 1.0  # the gradient-weighted Hessian's share, the plain one the rest (1: GuidedQuant's)
    guided_nsamples: int = 0  # calibration sequences the gradient pass covers (0: all)
    sequential: bool = True  # False: each block's Hessians on the fp model's activations (one forward per block)
    refit: bool = False  # a layer that keeps GPTQ over RTN is solved again with the held-out windows too
    # after GPTQ, sweeps of coordinate descent over the codes (CDQuant): each moves to the grid point that minimises
    # the layer's (damped) quadratic error with the others fixed; scales and zeros unchanged
    # (methods/common/coordinate_descent.py). 0: off
    cd_passes: int = 0

    def __post_init__(self):
        if not 0 < self.damp < 1:
            raise ValueError(f"damp={self.damp} must be in (0, 1), e.g. 0.01")
        if self.damp_of not in DAMP_REFS:
            raise ValueError(f"damp_of={self.damp_of!r}: choose one of {', '.join(DAMP_REFS)}")
        _at_least_one(self, ("block_size",))
        if self.cd_passes < 0:
            raise ValueError(f"cd_passes={self.cd_passes} must be 0 (off) or the sweeps to run, e.g. 5")
        if self.mse_coarse < 0 or (self.mse_coarse and not self.mse):
            raise ValueError(f"mse_coarse={self.mse_coarse} thins the mse grid: set mse: true too, and 0 or a step "
                             "count >= 1 (e.g. 4)")
        if not 0 < self.guided_mix <= 1:
            raise ValueError(f"guided_mix={self.guided_mix} must be in (0, 1], e.g. 0.5")
        if self.guided_mix != 1 and not self.guided:
            raise ValueError(f"guided_mix={self.guided_mix} mixes guided GPTQ's Hessians; set guided: true too")
        if self.guided_nsamples < 0:
            raise ValueError(f"guided_nsamples={self.guided_nsamples} must be >= 1 (or 0 for every sequence)")
        if self.guided_nsamples and (not self.guided or self.guided_mix == 1):
            raise ValueError(f"guided_nsamples={self.guided_nsamples} leaves the other sequences to the plain Hessian; "
                             "set guided: true and guided_mix below 1 (e.g. 0.5), or remove guided_nsamples")


@dataclass(frozen=True)
class AWQOptions:
    """AWQ's scale and clipping searches (method awq, and qat with ``init: awq``)."""

    grid: int = 20
    coarse: int = 0  # the scale search: every grid point (0), or every coarse-th, then refined (awq.py grid_order)
    duo_scaling: bool = True  # search x_mean^r / w_mean^(1-r) (AutoAWQ, llm-compressor) instead of x_mean^r
    clip: bool = True
    search_tokens: int = 4096
    clip_tokens: int = 512  # token rows of each linear's input that judge its clipping range
    clip_grid: int = 20  # clipping shrink factors are tried in steps of 1 / clip_grid, down to 0.5
    rounding: str = "rtn"  # round the smoothed, clipped weights by rtn (AutoAWQ) or gptq (the gptq options)
    observe_tokens: int = 0  # the fp observe pass over the first windows holding this many tokens (0: all; rtn only)
    search_dtype: str = "float32"  # the scale search's and held-out judging's products: float32 or bfloat16

    def __post_init__(self):
        _at_least_one(self, ("grid", "search_tokens", "clip_tokens", "clip_grid"))
        if not 0 <= self.coarse < self.grid:
            raise ValueError(f"coarse={self.coarse} must be in [0, grid={self.grid}): 0 visits every grid point, "
                             "4 every fourth, then refines")
        if self.search_dtype not in TRAIN_DTYPES:
            raise ValueError(f"search_dtype={self.search_dtype!r} is unknown; use one of {TRAIN_DTYPES}")
        if self.observe_tokens < 0:
            raise ValueError(f"observe_tokens={self.observe_tokens} must be >= 0 (0: every fitting window)")
        if 0 < self.observe_tokens < self.search_tokens:
            raise ValueError(f"observe_tokens={self.observe_tokens} is fewer than the search_tokens="
                             f"{self.search_tokens} the scale search samples from them; raise it, or 0 for all")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding={self.rounding!r} is unknown; use one of {ROUNDINGS}")


@dataclass(frozen=True)
class QATOptions:
    """QAT: start from a PTQ result (``init``), then distil the fp model for ``steps``."""

    init: str = "rtn"
    steps: int = 200
    lr: float = 1e-5  # the weights'
    scale_lr: float = 1e-3  # the scales' (0 keeps them fixed)
    learn_zero: bool = False
    lr_in_steps: bool = False  # lr in each group's grid steps, not the weight's units: unlike ranges move alike
    self_data: float = 0.0  # the share of training windows the fp model samples itself (methods/common/selfdata.py)

    def __post_init__(self):
        if self.init not in QAT_INITS:
            raise ValueError(f"init={self.init!r} is unknown; use one of {QAT_INITS}")
        _at_least_one(self, ("steps",))
        if not 0 < self.lr < 1:
            raise ValueError(f"lr={self.lr} must be in (0, 1), e.g. 1e-5 (or 2e-3 with lr_in_steps)")
        if not 0 <= self.scale_lr < 1:
            raise ValueError(f"scale_lr={self.scale_lr} must be in [0, 1), e.g. 1e-3 (0 keeps the scales fixed)")
        if not 0 <= self.self_data < 1:
            raise ValueError(f"self_data={self.self_data} must be a share in [0, 1), e.g. 0.5 "
                             "(0: calibration text only)")


GROUPS = {"gptq": GPTQOptions, "awq": AWQOptions, "qat": QATOptions}


@dataclass(frozen=True)
class QuantizeConfig:
    """Everything `compress quantize` needs; recipes and CLI flags set these fields by their flat names
    (:meth:`from_flat`, :meth:`replace`)."""

    method: str = "rtn"
    bits: int = 4
    group_size: int = 128
    sym: bool = False
    zero_floor: int = 0  # 1: asymmetric zero points >= 1, so `export --format gptq` writes v1
    description: str = ""
    calib: str = "wiki"  # calibration text
    nsamples: int = 128
    seqlen: int = 512
    seed: int = 0
    batch_size: int = 8
    calib_dtype: str = "float32"  # or bfloat16: calibration's block forwards under CPU autocast
    gptq: GPTQOptions = field(default_factory=GPTQOptions)
    awq: AWQOptions = field(default_factory=AWQOptions)
    qat: QATOptions = field(default_factory=QATOptions)
    rotate: str = "none"  # before any method, a rotation folded into the weights
    weighted_range: bool = False  # the final rounding picks each group's range by the activation-weighted error
    fallback: bool = True  # gptq and awq keep RTN per layer where it is better on held-out windows
    holdout: float = 0.125  # the share of calibration windows held out for the fallback
    ignore: tuple[str, ...] = ("lm_head",)  # linears kept in fp (regular expressions searched in full names)
    train_dtype: str = "bfloat16"  # autocast dtype of qat's and uptraining's forwards; float32 disables
    kv_heads: int = 0  # pool the KV heads down to this many before quantizing (0 keeps them)
    kv_init: str = "pca"  # the new KV heads: "pca" (activation-aware, needs calibration) or "mean" pooling
    kv_fit_steps: int = 0  # then fit each merged attention to the original's outputs, steps per layer
    kv_fit_lr: float = 1e-3
    uptrain_steps: int = 0
    uptrain_lr: float = 5e-5
    uptrain_scope: str = "blocks"  # what uptraining moves: "blocks" or "attn"
    moe_min_tokens: int | None = None  # an expert routed fewer calibration tokens is RTN-quantized (None: moe.py's)
    # the input embedding and the LM head: none (the source's dtype), int8 or int4 RTN codes; a group size of 0 and a
    # sym of None take the choice's own; on a tied model both name one tensor (set either, or both alike)
    embed: str = "none"
    head: str = "none"
    embed_group_size: int = 0
    head_group_size: int = 0
    embed_sym: bool | None = None
    head_sym: bool | None = None
    head_method: str = "rtn"  # a quantized head's rounding: rtn, or gptq on the final hidden states

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is unknown; use one of {METHODS}")
        self.scheme  # validates bits / group_size
        for name in ("nsamples", "seqlen", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.calib_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"calib_dtype={self.calib_dtype!r} must be float32 or bfloat16")
        if not 0 < self.holdout < 1:
            raise ValueError(f"holdout={self.holdout} must be a share in (0, 1), e.g. 0.125")
        if self.rotate not in ROTATIONS:
            raise ValueError(f"rotate={self.rotate!r} is unknown; use one of {ROTATIONS}")
        self._validate_rounding()
        self._validate_training()
        self._validate_outer()
        object.__setattr__(self, "ignore", tuple(self.ignore))

    def _validate_rounding(self) -> None:
        """Fields that only a method's own rounding reads are refused where nothing would read them."""
        if self.awq.rounding != "rtn" and self.method != "awq":
            raise ValueError(f"rounding={self.awq.rounding!r} applies to method awq only, not {self.method!r}")
        for name in ("act_order", "static_groups", "mse", "guided", "bf16_gram"):
            if getattr(self.gptq, name) and not self.gptq_rounding:
                raise ValueError(f"{name} applies to method gptq (or awq with rounding: gptq, qat with init: gptq) "
                                 f"only, not {self.method!r}")
        if self.gptq.cd_passes and (not self.gptq_rounding or self.method == "qat"):
            raise ValueError(f"cd_passes applies to method gptq (or awq with rounding: gptq) only, not {self.method!r}: "
                             "it moves GPTQ's codes, and qat with init: gptq starts from the weights before rounding")
        gptq_runs = self.method == "gptq" or (self.method == "qat" and self.qat.init == "gptq")
        if self.gptq.refit and (self.method != "gptq" or not self.fallback):
            raise ValueError(f"refit applies to method gptq with fallback: true only (it solves a layer kept over RTN "
                             f"again with the held-out windows), not {self.method!r} with fallback: {self.fallback}")
        if not self.gptq.sequential and not gptq_runs:
            raise ValueError(f"sequential: false applies to method gptq (or qat with init: gptq) only, not "
                             f"{self.method!r} (awq searches its scales block by block on the quantized blocks' "
                             "outputs)")
        if self.method == "qat" and self.qat.init == "gptq" and self.gptq.act_order and not self.gptq.static_groups:
            raise ValueError("qat with init: gptq and act_order needs static_groups: true (QAT trains groups of "
                             "consecutive columns; act_order alone makes a group of scattered ones)")
        if self.weighted_range:
            if self.method not in ("gptq", "awq", "qat"):
                raise ValueError(f"weighted_range needs calibration statistics: it applies to gptq, awq and qat, "
                                 f"not {self.method!r} (for a weighted RTN use method: awq with grid: 1 and "
                                 "clip: false)")
            if self.method == "qat" and self.qat.init == "rtn":
                raise ValueError("weighted_range applies to qat's AWQ or GPTQ init only; set init: awq or gptq")
            if self.gptq.mse:
                raise ValueError("weighted_range and mse both pick gptq's grid; set one of them")

    def _validate_training(self) -> None:
        for name in ("uptrain_lr", "kv_fit_lr"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be in (0, 1), e.g. 1e-5")
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

    def _validate_outer(self) -> None:
        for part in ("embed", "head"):
            choice, group, sym = (getattr(self, f"{part}{s}") for s in ("", "_group_size", "_sym"))
            if choice not in OUTER_CHOICES:
                raise ValueError(f"{part}={choice!r} is unknown; use one of {OUTER_CHOICES}")
            if sym is not None and not isinstance(sym, bool):
                raise ValueError(f"{part}_sym={sym!r} must be true or false (or left out for the {part} choice's own)")
            if choice == "none" and (group or sym is not None):
                raise ValueError(f"{part}_group_size/{part}_sym shape a quantized {part}, but {part} is none; "
                                 f"set {part}: int8 or int4, or remove them")
            if group:
                self.outer_scheme(part)  # validates the group size
        if self.head_method not in HEAD_METHODS:
            raise ValueError(f"head_method={self.head_method!r} is unknown; use one of {HEAD_METHODS}")

    def outer_scheme(self, part: str) -> Scheme | None:
        """The RTN scheme of ``part`` ("embed" or "head"), or None when it stays full width."""
        from compress.methods.embed_head import outer_scheme

        return outer_scheme(getattr(self, part), getattr(self, f"{part}_group_size"), getattr(self, f"{part}_sym"))

    @property
    def scheme(self) -> Scheme:
        fmt = "nf4" if self.method == "nf4" else "int"
        return Scheme(bits=self.bits, group_size=self.group_size, sym=self.sym or fmt == "nf4", format=fmt,
                      zero_floor=self.zero_floor)

    @property
    def gptq_rounding(self) -> bool:
        """Whether the final rounding is GPTQ's (method gptq, awq with rounding: gptq, or qat's init: gptq)."""
        return (self.method == "gptq" or (self.method == "awq" and self.awq.rounding == "gptq")
                or (self.method == "qat" and self.qat.init == "gptq"))

    @property
    def needs_calibration(self) -> bool:
        return (self.method in ("gptq", "awq", "qat") or self.uptrain_steps > 0 or self.kv_fit_steps > 0
                or (self.kv_heads > 0 and self.kv_init == "pca") or self.calibrated_head)

    @property
    def calibrated_head(self) -> bool:
        """Whether a quantized head (on a tied model, the one table) is rounded by GPTQ on calibration data."""
        return self.head != "none" and self.head_method == "gptq"

    @classmethod
    def from_flat(cls, **fields) -> "QuantizeConfig":
        """The config from flat recipe fields (``damp`` goes to ``gptq.damp``); an unknown name is an error."""
        unknown = sorted(set(fields) - FIELDS)
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}; allowed: {sorted(FIELDS)}")
        groups = {g: t(**{k: fields.pop(k) for k in _names(t) if k in fields}) for g, t in GROUPS.items()}
        return cls(**fields, **groups)

    def replace(self, **changes) -> "QuantizeConfig":
        """A copy with flat fields changed; ``None`` keeps a field (CLI flags left unset)."""
        return QuantizeConfig.from_flat(**{**self.to_dict(), **{k: v for k, v in changes.items() if v is not None}})

    def to_dict(self) -> dict:
        """The flat recipe form (what ``from_flat`` takes back)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out.update(dataclasses.asdict(value) if f.name in GROUPS else {f.name: value})
        return {**out, "ignore": list(self.ignore)}


def _names(t) -> list[str]:
    return [f.name for f in dataclasses.fields(t)]


# every flat recipe field: the config's own, and each group's under its own name
FIELDS = frozenset([n for n in _names(QuantizeConfig) if n not in GROUPS]
                   + [n for t in GROUPS.values() for n in _names(t)])


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
    return QuantizeConfig.from_flat(**{k: _typed(p.name, k, v) for k, v in data.items()})


@functools.cache
def _defaults() -> dict[str, object]:
    """Flat field name -> its default value (whose type a recipe's value must have)."""
    out = {}
    for t in (QuantizeConfig, *GROUPS.values()):
        for f in dataclasses.fields(t):
            if f.name not in GROUPS and f.default is not dataclasses.MISSING and f.default is not None:
                out[f.name] = f.default
    return out


def _typed(recipe: str, key: str, value):
    """``value`` checked against the field's type. YAML reads ``2e-4`` (no dot) as a string: a float field takes
    it as the number it spells."""
    want = type(_defaults().get(key, value))
    if want is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if value is not None and not isinstance(value, want) or (want is not bool and isinstance(value, bool)):
        raise ValueError(f"recipe {recipe}: {key}: {value!r} is {type(value).__name__}, expected {want.__name__} "
                         f"(e.g. {key}: {_defaults()[key]!r})")
    return value


def list_recipes() -> dict[str, str]:
    """Recipe name -> its one-line description."""
    out = {}
    for p in sorted(RECIPES_DIR.glob("*.yaml")):
        out[p.stem] = (yaml.safe_load(p.read_text()) or {}).get("description", "")
    return out
