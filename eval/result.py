"""What `compress eval` (and ``compress.evaluate``) returns, typed: each model's figures, the change from the baseline,
the settings. ``to_json`` is the JSON `compress eval --json` writes. The API returned nested dicts before these types:
``result["delta"]["ppl"]`` still reads ``result.delta.ppl`` (``__getitem__`` maps the old keys to the fields, a
compatibility shim; new code uses the attributes)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields


class _Keys:
    """The compatibility shim: ``x["name"]`` is ``x.name`` for the dataclass's fields (a KeyError for any other)."""

    def __getitem__(self, key: str):
        if key not in {f.name for f in fields(self)}:
            raise KeyError(key)
        return getattr(self, key)


@dataclass(frozen=True)
class PplResult(_Keys):
    """Perplexity, the mean NLL it comes from, and how many tokens/windows were scored."""

    ppl: float
    nll: float
    tokens: int
    windows: int


@dataclass(frozen=True)
class ModelResult(_Keys):
    """One model measured: its size (None for a served model), perplexity per text, accuracy per task (metric ->
    value, and ``samples``), their average over the tasks' primary metrics, and the seconds of each stage."""

    model: str
    size_bytes: int | None
    size_label: str  # what size_bytes measures (eval/report.py SIZE_ON_DISK, SIZE_GGUF), or "served"
    tokenizer: str | None  # a served model's tokenizer (left out of the JSON for a local model)
    ppl_detail: dict[str, PplResult]
    accuracy: dict[str, dict[str, float]]
    accuracy_avg: float | None
    seconds: dict[str, float]

    @property
    def ppl(self) -> dict[str, float]:
        return {text: r.ppl for text, r in self.ppl_detail.items()}

    def __getitem__(self, key: str):
        return self.ppl if key == "ppl" else super().__getitem__(key)

    def to_json(self) -> dict:
        out = {"model": self.model, "size_bytes": self.size_bytes, "size_label": self.size_label,
               "tokenizer": self.tokenizer, "ppl": self.ppl, **asdict(self)}
        if self.tokenizer is None:
            del out["tokenizer"]
        return out


@dataclass(frozen=True)
class Delta(_Keys):
    """Compressed minus baseline: size (bytes, and the ratio; None beside a served model), ppl per text, accuracy per
    task and metric, average accuracy."""

    size_bytes: int | None
    size_ratio: float | None
    ppl: dict[str, float]
    accuracy: dict[str, dict[str, float]]
    accuracy_avg: float | None

    @classmethod
    def between(cls, base: ModelResult, comp: ModelResult) -> Delta:
        acc = {t: {k: comp.accuracy[t][k] - v for k, v in m.items() if k != "samples"}
               for t, m in base.accuracy.items()}
        avg = None if base.accuracy_avg is None else comp.accuracy_avg - base.accuracy_avg
        sized = comp.size_bytes is not None and base.size_bytes  # a served model has no size here
        return cls(comp.size_bytes - base.size_bytes if sized else None,
                   comp.size_bytes / base.size_bytes if sized else None,
                   {k: comp.ppl[k] - v for k, v in base.ppl.items()}, acc, avg)


@dataclass(frozen=True)
class Settings(_Keys):
    """How the perplexity and the tasks were measured."""

    seqlen: int
    max_windows: int | None
    limit: int | None  # documents per task (None: all)
    split: str = "eval"


@dataclass(frozen=True)
class EvalResult(_Keys):
    """The compressed model (or the served one) beside the baseline when one was given, and their difference."""

    baseline: ModelResult | None
    compressed: ModelResult
    delta: Delta | None
    settings: Settings

    def to_json(self) -> dict:
        return {"baseline": None if self.baseline is None else self.baseline.to_json(),
                "compressed": self.compressed.to_json(), "delta": None if self.delta is None else asdict(self.delta),
                "settings": asdict(self.settings)}
