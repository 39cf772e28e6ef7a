"""vLLM's tokenizer routes: /tokenize, /detokenize and /tokenizer_info (what lm-eval's remote tokenizer reads)."""
from __future__ import annotations

from fastapi import APIRouter, Request

from runtime.serve.openai_protocol import APIError, DetokenizeRequest, TokenizeRequest
from runtime.serve.routes.chat import chat_prompt
from runtime.serve.state import context_limit, served

router = APIRouter()


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request):  # vLLM's /tokenize answer
    s = served(request)
    s.check(req)
    engine = s.engine
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer; send token ids", param="prompt")
    if req.messages is not None:
        ids = chat_prompt(engine, req)
    else:
        ids = engine.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    strs = engine.token_strings(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": context_limit(engine), "tokens": ids,
            "token_strs": [strs[t] for t in ids] if strs else None}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request):
    s = served(request)
    s.check(req)
    engine = s.engine
    vocab = engine.runner.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise APIError(400, f"tokens must be ids in [0, {vocab})", param="tokens")
    return {"prompt": engine.decode(req.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request):  # what lm-eval's remote tokenizer reads: special tokens, chat template
    engine = served(request).engine
    tok = engine.tokenizer
    if tok is None:
        raise APIError(404, "this model has no tokenizer", type="not_found_error")
    return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
            "pad_token": tok.pad_token, "chat_template": getattr(tok, "chat_template", None),
            "model_max_length": getattr(engine, "max_model_len", None)}
