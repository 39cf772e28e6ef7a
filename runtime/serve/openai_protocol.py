"""OpenAI-compatible request bodies for the server (the responses are in runtime/serve/openai_responses.py).

Requests are pydantic models (FastAPI turns a wrong type into a 422 naming the field); the OpenAI
sampling fields (penalties, ``logit_bias``, ``n``, logprobs) plus vLLM's extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``seed``, ``stop_token_ids``, ``guided_*``,
``structured_outputs``) map onto the engine's ``SamplingParams``; ``response_format`` and ``tools`` onto a
grammar (runtime/guided.py, runtime/serve/tool_calls.py). A field we do not implement is refused
with 400 naming it (``unknown_fields``), never dropped, so a client never silently gets something it
did not ask for; the only fields accepted and ignored are the bookkeeping ones in ``IGNORED_FIELDS``.
"""
from __future__ import annotations

import json
import logging
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runtime.guided import GuideSpec
from runtime.sequence import MAX_LOGPROBS

log = logging.getLogger(__name__)
MAX_N = 16  # choices per request


# Fields clients send by default that cannot change the output: accepted and ignored (everything else
# unknown is a 400). ``user``/``stream_options`` are declared on the request models themselves.
IGNORED_FIELDS = ("metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
IGNORED_MESSAGE_FIELDS = ("name",)


class APIError(Exception):
    """An error the client caused or must handle, rendered as OpenAI's ``{"error": {...}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    """A request body: unknown fields are kept aside so the route can refuse them by name."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None

    def unknown_fields(self) -> list[str]:
        """Request fields this server does not implement (the caller answers 400 naming them)."""
        names = [k for k in (self.model_extra or {}) if k not in IGNORED_FIELDS]
        for i, m in enumerate(getattr(self, "messages", None) or ()):
            names += [f"messages[{i}].{k}" for k in (m.model_extra or {}) if k not in IGNORED_MESSAGE_FIELDS]
        return names


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None  # the output always follows the schema here, strict or not


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's newer spelling of the guided_* fields."""

    model_config = ConfigDict(extra="forbid")

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _Sampling(_Request):
    """Fields shared by both generation endpoints."""

    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # vLLM: -1 (or 0) disables
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logit_bias: dict[int, float] | None = None  # JSON keys are token-id strings; pydantic turns them into ints
    user: str | None = None
    # structured output: OpenAI's response_format, vLLM's guided_* fields or structured_outputs (one of them)
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    def guide_spec(self) -> tuple[GuideSpec, str] | None:
        """The output constraint asked for and the field that asked; ValueError when several fields ask."""
        so, rf = self.structured_outputs, self.response_format
        asked = {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                 "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar,
                 "structured_outputs.json": so and so.json_, "structured_outputs.regex": so and so.regex,
                 "structured_outputs.choice": so and so.choice, "structured_outputs.grammar": so and so.grammar,
                 "response_format": rf if rf is not None and rf.type != "text" else None}
        given = [k for k, v in asked.items() if v is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} each constrain the output; send one of them")
        if not given:
            return None
        field, value = given[0], asked[given[0]]
        if field == "response_format":
            if value.type == "json_object":
                return GuideSpec("json_object"), field
            if value.json_schema is None:
                raise ValueError("response_format type json_schema needs response_format.json_schema.schema")
            return GuideSpec.json_schema(value.json_schema.schema_), field
        kind = field.rsplit(".", 1)[-1].removeprefix("guided_")
        if kind == "json":
            return GuideSpec.json_schema(value), field
        return (GuideSpec.choice(value) if kind == "choice" else GuideSpec(kind, value)), field

    @model_validator(mode="after")
    def _supported(self):
        if self.max_tokens and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}; lower min_tokens")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_kwargs(self, max_tokens: int) -> dict:
        """Keyword arguments for the engine's ``SamplingParams``."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0), max_tokens=max_tokens,
                    min_tokens=self.min_tokens, stop=stop, stop_token_ids=tuple(self.stop_token_ids or ()),
                    ignore_eos=self.ignore_eos, seed=self.seed, min_p=self.min_p,
                    presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                    repetition_penalty=self.repetition_penalty, logit_bias=tuple((self.logit_bias or {}).items()))


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only with echo: score the prompt, generate nothing
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0)  # above MAX_LOGPROBS: a 400 from the route
    suffix: str | None = None

    @model_validator(mode="after")
    def _prompts(self):
        prompts = self.prompts
        if not self.prompt or any(len(q) == 0 for q in prompts):
            raise ValueError("prompt is empty; send at least one token of text")
        if len(prompts) * self.n > MAX_N * 8:
            raise ValueError(f"{len(prompts)} prompts x n={self.n} choices is more than {MAX_N * 8}; split the request")
        if self.suffix:
            raise ValueError("suffix (fill-in-the-middle) is not supported by this server; leave it unset")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 generates nothing; use it with echo=true to score the prompt, else >= 1")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt (a string or token ids), however the request spelled them."""
        p = self.prompt
        return [p] if isinstance(p, str) or not p or isinstance(p[0], int) else list(p)


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict:
        """Chat templates (Qwen, Hermes, Llama 3) expect the arguments as an object, not JSON text."""
        try:
            args = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            args = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": args}}


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: dict[str, str]  # {"name": ...}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: which call it answers

    def for_template(self) -> dict:
        """The message as chat templates read it (``developer`` is OpenAI's new name for ``system``)."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.for_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if "name" in (self.model_extra or {}):
            out["name"] = self.model_extra["name"]
        return out

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    return [m.for_template() for m in messages]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def tool_dicts(self) -> list[dict]:
        return [t.model_dump(exclude_none=True) for t in self.tools or ()]

    @property
    def tools_active(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def named_tool(self) -> str | None:
        return self.tool_choice.function.get("name") if isinstance(self.tool_choice, NamedToolChoice) else None

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true; set both")
        return self

    def template_messages(self) -> list[dict]:
        return template_messages(self.messages)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a ``prompt``, or chat ``messages`` rendered by the chat template."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def template_messages(self) -> list[dict]:
        return template_messages(self.messages or [])

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Request):
    tokens: list[int]


def check_logprobs(k: int | None, field: str) -> None:
    if k is not None and k > MAX_LOGPROBS:
        raise APIError(400, f"{field}={k} is above this server's limit of {MAX_LOGPROBS}; ask for at most "
                       f"{MAX_LOGPROBS}", param=field)
