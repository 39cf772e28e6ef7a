"""The HTTP side's settings (``compress serve`` flags); the engine has its own EngineConfig."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runtime.serve.tool_calls import FORMATS


@dataclass(frozen=True)
class ServerConfig:
    """How the HTTP side behaves; the engine has its own EngineConfig."""

    model_name: str
    api_key: str | None = None
    served_model_names: tuple[str, ...] = ()  # the names requests may use; default: model_name and its folder name
    tool_call_parser: str = "hermes"  # how the model writes tool calls: a runtime/serve/tool_calls.py FORMATS name
    max_queue: int = 256  # requests admitted beyond the running batch before answering 429
    max_num_seqs: int = 64

    def __post_init__(self):
        if self.max_queue < 0:
            raise ValueError(f"max_queue={self.max_queue} must be >= 0")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty; pass a non-empty key or none")
        if self.tool_call_parser not in FORMATS:
            raise ValueError(f"tool_call_parser={self.tool_call_parser!r} is unknown; use one of {sorted(FORMATS)}")
        if any(not n or not n.strip() for n in self.served_model_names):
            raise ValueError(f"served_model_names={self.served_model_names!r} holds an empty name")

    @property
    def names(self) -> tuple[str, ...]:
        """Names a request's ``model`` may use; the first is the one responses carry."""
        return tuple(self.served_model_names) or (self.model_name, Path(self.model_name).name)
