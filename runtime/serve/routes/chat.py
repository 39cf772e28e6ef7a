"""/v1/chat/completions: the messages through the chat template, tool calls guided and parsed, the answer whole
or streamed."""
from __future__ import annotations

from fastapi import APIRouter, Request

from runtime.guided import GuideSpec
from runtime.sequence import TokenLogprob
from runtime.serve import tool_calls
from runtime.serve.openai_protocol import APIError, ChatCompletionRequest, TokenizeRequest, check_logprobs
from runtime.serve.openai_responses import chat_body, chat_choice, chat_chunk, chat_logprobs, new_id, usage_chunk
from runtime.serve.routes.generation import AbortOnClose, guide_for, sampling_params, sse
from runtime.serve.serving import Choice, RequestRunner, Submitted
from runtime.serve.state import served
from runtime.serve.tool_calls import ToolFormat
from runtime.serve.tool_stream import ToolStream

router = APIRouter()


def chat_prompt(engine, req: ChatCompletionRequest | TokenizeRequest) -> list[int]:
    """The messages through the model's chat template, as token ids."""
    tok = engine.tokenizer
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
    try:
        tools = req.tool_dicts() if getattr(req, "tools_active", False) else None
        text = tok.apply_chat_template(req.template_messages(), tools=tools, tokenize=False,
                                       add_generation_prompt=getattr(req, "add_generation_prompt", True))
    except Exception as e:  # jinja raises its own TemplateError for e.g. unsupported role orders
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    return list(tok(text, add_special_tokens=False)["input_ids"])  # the template already placed special tokens


def tool_guide(req: ChatCompletionRequest, fmt: ToolFormat) -> tuple[GuideSpec, str] | None:
    """The constraint of tool_choice "required" or a named function, checked against the tools offered."""
    if req.tool_choice not in (None, "none", "auto") and not req.tools:
        raise APIError(400, "tool_choice needs tools; send the tools or drop tool_choice", param="tool_choice")
    if not req.tools_active or req.tool_choice in (None, "auto"):
        return None
    names = [t.function.name for t in req.tools]
    if req.named_tool is not None and req.named_tool not in names:
        raise APIError(400, f"tool_choice names function {req.named_tool!r}, which is not among the tools {names}; "
                       "name one of them", param="tool_choice")
    return tool_calls.guide_spec(req.tool_dicts(), fmt, req.named_tool, req.parallel_tool_calls), "tool_choice"


def skips_special(engine, req: ChatCompletionRequest, fmt: ToolFormat) -> bool:
    """False where the tool-call marker is one of the tokenizer's special tokens (Mistral's ``[TOOL_CALLS]``): the
    text must keep it for the calls to be found."""
    marker = fmt.begin.strip()
    return not (req.tools_active and marker and marker in getattr(engine.tokenizer, "all_special_tokens", ()))


async def chat_guide(runner: RequestRunner, req: ChatCompletionRequest, fmt: ToolFormat):
    tool = tool_guide(req, fmt)
    if tool is None:
        return await guide_for(runner, req)
    if req.guide_spec() is not None:
        raise APIError(400, "tool_choice and response_format both constrain the output; send one", param="tool_choice")
    return await runner.compile_guide(tool)


def _message(c: Choice, req: ChatCompletionRequest, fmt: ToolFormat) -> tuple[str | None, list | None, str | None]:
    """A finished choice's content, parsed tool calls (when tools are on) and finish reason."""
    text = "".join(c.text)
    if not req.tools_active:
        return text, None, c.finish_reason
    content, calls = tool_calls.parse(text, fmt)
    calls = calls if req.parallel_tool_calls else calls[:1]
    return content, calls or None, "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason


class _ChatShape:
    """Builds /v1/chat/completions choices and streamed chunks (logprobs, tool calls, usage) for one request."""

    def __init__(self, engine, req: ChatCompletionRequest, sub: Submitted, model: str, fmt: ToolFormat,
                 top: int | None):
        self.engine, self.req, self.sub, self.model, self.fmt, self.top = engine, req, sub, model, fmt, top
        self.streams: dict[int, ToolStream] = {}

    def logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if self.top is None:
            return None
        return chat_logprobs(entries, self.engine.token_strings([e.token_id for e in entries] +
                                                                [t for e in entries for t, _ in e.top]))

    def final(self, use) -> dict | None:
        return usage_chunk(self.sub.rid, self.model, "chat.completion.chunk", use) if self.req.include_usage else None

    def choice(self, c: Choice) -> dict:
        content, calls, finish = _message(c, self.req, self.fmt)
        return chat_choice(c.index, content, self.logprobs(c.logprobs), finish, tool_calls=calls)

    def chunk(self, c: Choice, out) -> dict | None:
        text = c.unsent_text()
        delta = {"role": "assistant", "content": text} if not c.emitted else ({"content": text} if text else {})
        if not delta and not out.finished:
            return None
        finish = out.finish_reason if out.finished else None
        choice = chat_choice(c.index, "", self.logprobs(c.unsent_logprobs()), finish, delta=delta)
        return chat_chunk(self.sub.rid, self.model, [choice])

    def tool_chunks(self, c: Choice, out) -> list[dict]:
        """With tools: content as it comes, each call once named, its arguments as written (tool_stream.py)."""
        stream = self.streams.setdefault(c.index, ToolStream(self.fmt, self.req.parallel_tool_calls))
        if out.finished:
            content, calls, finish = _message(c, self.req, self.fmt)
            deltas = stream.finish(content, calls or [])
        else:
            deltas, finish = stream.step("".join(c.text)), None
        if not c.emitted:
            deltas = [{"role": "assistant", **(deltas[0] if deltas else {"content": ""})}] + deltas[1:]
        if finish is not None:
            deltas.append({})
        logprobs = self.logprobs(c.unsent_logprobs())
        return [chat_chunk(self.sub.rid, self.model, [chat_choice(c.index, None, logprobs if k == 0 else None,
                                                                  finish if k == len(deltas) - 1 else None, delta=d)])
                for k, d in enumerate(deltas)]


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request):
    s = served(request)
    s.check(req)
    engine, runner, model, fmt = s.engine, s.runner, s.model, s.tool_format
    ids = chat_prompt(engine, req)
    max_tokens = req.requested_max_tokens
    if max_tokens is None:
        limit = getattr(engine, "max_model_len", None)
        max_tokens = max(1, limit - len(ids)) if isinstance(limit, int) else 256
    check_logprobs(req.top_logprobs, "top_logprobs")
    top = (req.top_logprobs or 0) if req.logprobs else None
    guide = await chat_guide(runner, req, fmt)
    params = sampling_params(req, max_tokens, engine.runner.vocab_size, logprobs=top, guide=guide,
                             skip_special_tokens=skips_special(engine, req, fmt))
    sub = runner.submit([ids], params, req.n, new_id("chatcmpl"), "messages")
    shape = _ChatShape(engine, req, sub, model, fmt, top)
    if req.stream:
        chunk = shape.tool_chunks if req.tools_active else shape.chunk
        events = runner.stream(sub, chunk, shape.final if req.include_usage else None)
        return AbortOnClose(sse(events), lambda: runner.abort(sub))
    choices = await runner.collect(sub, request)
    return chat_body(sub.rid, model, [shape.choice(c) for c in choices], sub.usage(choices))
