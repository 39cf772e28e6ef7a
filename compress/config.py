"""The quantization config and the recipes that map 1:1 onto it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from compress.quant import Scheme

METHODS = ("rtn", "gptq", "awq", "nf4")
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
    # gptq
    damp: float = 0.01
    block_size: int = 128
    act_order: bool = False
    static_groups: bool = False
    # awq
    grid: int = 20
    clip: bool = True
    search_tokens: int = 4096
    # fp linears kept as they are (regular expressions on module names)
    ignore: tuple[str, ...] = ("lm_head",)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is unknown; use one of {METHODS}")
        self.scheme  # validates bits / group_size
        for name in ("nsamples", "seqlen", "batch_size", "block_size", "grid", "search_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not 0 < self.damp < 1:
            raise ValueError(f"damp={self.damp} must be in (0, 1), e.g. 0.01")
        if self.act_order and self.method != "gptq":
            raise ValueError("act_order applies to method gptq only")
        object.__setattr__(self, "ignore", tuple(self.ignore))

    @property
    def scheme(self) -> Scheme:
        fmt = "nf4" if self.method == "nf4" else "int"
        return Scheme(bits=self.bits, group_size=self.group_size, sym=self.sym or fmt == "nf4", format=fmt)

    @property
    def needs_calibration(self) -> bool:
        return self.method in ("gptq", "awq")

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
