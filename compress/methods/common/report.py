"""What a quantization run reports: one typed record per rounded linear, AWQ smoothing group or MoE expert, and one
typed note per step that ran (rotation, KV-head conversion, QAT, the RTN fallback, the head's calibration). Plain data,
importing nothing of the project, so the drivers, the methods, the transforms and the job all share it; ``to_json``
gives the dicts the run wrote before these types (`compress quantize --json`, the checkpoint's quantization_config):
the same keys in the same order, fields left unset omitted."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Judgement:
    """Held-out output errors (relative to the fp output's) of a calibrated result and of plain RTN, and which one
    was kept (compress/methods/common/fallback.py)."""

    heldout_error: float
    rtn_heldout_error: float
    choice: str  # "kept" (the calibrated result) or "rtn"


class _Json:
    """``to_json``: the dataclass's fields that are set, in their order; a part (a judgement, the KV heads) spread in
    place as its own keys."""

    def to_json(self) -> dict:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if is_dataclass(value):
                out.update(asdict(value))
            elif value is not None:
                out[f.name] = value
        return out


@dataclass(frozen=True)
class LayerRecord(_Json):
    """One rounded linear of block ``layer``: its method's loss (None when it has none), and with held-out windows
    the judgement against RTN, AWQ's clipping ratio and the full names judged (this linear's)."""

    layer: int
    name: str  # relative to the block
    loss: float | None = None
    judged: Judgement | None = None
    clip: float | None = None
    names: list[str] | None = None


@dataclass(frozen=True)
class SmoothRecord(_Json):
    """One AWQ smoothing group of block ``layer``: the module its scales fold into, the scale search's best ratio
    and block-output losses (scaled, and RTN unscaled), and with held-out windows the group's judgement."""

    layer: int
    smooth: str
    ratio: float
    loss: float
    rtn_loss: float
    judged: Judgement | None = None
    clip: float | None = None  # the group's mean clipping ratio (recorded when judged)
    names: list[str] | None = None  # the group's linears, full names (when judged: they fall back together)


@dataclass(frozen=True)
class ExpertRecord(_Json):
    """One MoE expert of block ``layer``: its routed calibration tokens, whether it fell back to RTN for too few
    of them, and its method's losses by name (e.g. ``down_proj``; none for a data-free method)."""

    layer: int
    expert: int
    tokens: int
    fallback: bool
    losses: dict[str, float] = field(default_factory=dict)
    judged: ClassVar[None] = None  # experts are not judged against RTN on held-out windows

    def to_json(self) -> dict:
        return {"layer": self.layer, "expert": self.expert, "tokens": self.tokens, "fallback": self.fallback,
                **self.losses}


Record = LayerRecord | SmoothRecord | ExpertRecord


@dataclass(frozen=True)
class RotateNote(_Json):
    """The rotation folded into the weights (compress/transforms/rotate.py)."""

    kind: str
    hidden: int
    head_dim: int
    untied_head: bool  # the tied head had to become its own matrix
    added_bytes: int  # parameter bytes the untied head adds


@dataclass(frozen=True)
class KVHeads:
    """A KV-head conversion's heads and fp16 KV-cache bytes per token, before and after (compress/transforms/gqa.py)."""

    kv_heads_before: int
    kv_heads_after: int
    kv_bytes_per_token_before: int
    kv_bytes_per_token_after: int


@dataclass(frozen=True)
class FitNote:
    """The attention fit's mean relative output error before and after, and its time."""

    fit_error_before: float
    fit_error_after: float
    fit_seconds: float


@dataclass(frozen=True)
class UptrainNote:
    """Uptraining's KL at the start and the end, and its time."""

    uptrain_loss_first: float
    uptrain_loss_last: float
    uptrain_seconds: float


@dataclass(frozen=True)
class GQANote(_Json):
    """The KV-head conversion, and the fit and uptraining when they ran."""

    kv: KVHeads
    fit: FitNote | None = None
    uptrain: UptrainNote | None = None

    def line(self) -> str:
        kv, fit, up = self.kv, self.fit, self.uptrain
        return (f"kv heads: {kv.kv_heads_before} -> {kv.kv_heads_after}, KV cache "
                f"{kv.kv_bytes_per_token_before:,} -> {kv.kv_bytes_per_token_after:,} bytes/token (fp16)"
                + (f", attention fit error {fit.fit_error_before:.3f} -> {fit.fit_error_after:.3f}" if fit else "")
                + (f", uptraining KL {up.uptrain_loss_first:.4f} -> {up.uptrain_loss_last:.4f}" if up else ""))


@dataclass(frozen=True)
class QATNote(_Json):
    """QAT's training (compress/methods/qat.py): its init, the linears trained, steps and KL losses."""

    init: str
    modules: int
    steps: int
    loss_first: float
    loss_last: float
    train_seconds: float
    self_data_seconds: float

    def line(self) -> str:
        return (f"qat: {self.steps} steps from {self.init}, KL {self.loss_first:.4f} -> {self.loss_last:.4f} "
                f"in {self.train_seconds:.0f} s")


@dataclass(frozen=True)
class FallbackNote(_Json):
    """The RTN fallback's outcome: the held-out windows, the layers judged, and the full names that kept RTN."""

    heldout_windows: int
    judged: int
    rtn: int
    layers: dict[str, str]  # full name -> "rtn"

    def line(self) -> str:
        return (f"fallback: {self.rtn} of {self.judged} layers kept RTN, better on {self.heldout_windows} held-out "
                "calibration windows")


@dataclass(frozen=True)
class HeadNote(_Json):
    """The untied head's GPTQ calibration (compress/methods/head_gptq.py): the rounding kept, GPTQ's loss, the
    judgement against RTN (with held-out windows) and the pass's time."""

    method: str  # "gptq" or "rtn"
    gptq_loss: float
    judged: Judgement | None = None
    seconds: float = 0.0


@dataclass
class Notes:
    """One note per step that ran, in the order the steps run (the JSON's key order)."""

    rotate: RotateNote | None = None
    gqa: GQANote | None = None
    qat: QATNote | None = None
    fallback: FallbackNote | None = None
    head_calibration: HeadNote | None = None

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name).to_json() for f in fields(self) if getattr(self, f.name) is not None}

    def checkpoint(self) -> dict:
        """What the checkpoint's quantization_config carries: where RTN was kept (the fallback, the head)."""
        return {k: v for k, v in self.to_json().items() if k in ("fallback", "head_calibration")}


@dataclass
class QuantizeReport:
    """A run's method, its time, one record per rounded linear, smoothing group or expert, and the steps' notes."""

    method: str
    seconds: float = 0.0
    layers: list[Record] = field(default_factory=list)
    notes: Notes = field(default_factory=Notes)

    def decisions(self) -> dict[str, str]:
        """Each judged linear's full name -> "kept" or "rtn"."""
        return {n: r.judged.choice for r in self.layers if r.judged is not None for n in r.names}

    def to_json(self) -> dict:
        return {"method": self.method, "seconds": self.seconds, "layers": [r.to_json() for r in self.layers],
                "notes": self.notes.to_json()}
