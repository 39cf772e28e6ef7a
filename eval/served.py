"""Scoring a running OpenAI-compatible server on the same documents as an in-process checkpoint.

The artifact as served (by ``compress serve``, vLLM or any server whose ``/v1/completions`` echoes prompt
logprobs) is measured with the protocols of eval/perplexity.py and eval/tasks.py: perplexity on the same token
windows, sent as token-id prompts with ``echo`` and ``logprobs`` and scored from the returned prompt logprobs;
task accuracy through lm-eval's own ``local-completions`` client on the offline task definitions. Requests ask
for ``max_tokens: 1`` (the generated token is dropped), as lm-eval does, since not every server takes 0.
The client tokenizes with a local tokenizer only (a folder, an embedded name or a .gguf): never the model hub.
"""
from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from eval.perplexity import token_windows
from eval.progress import StepProgress, no_progress
from eval.result import ModelResult, PplResult
from eval.tasks import RequestProgress, check_limit, score_tasks

TIMEOUT_S = 600  # one request may score a batch of long windows on a slow CPU


@dataclass(frozen=True)
class Endpoint:
    """A server and the model name its requests carry, as /v1/models describes them."""

    url: str  # the server root, e.g. http://127.0.0.1:8000 (no /v1)
    model: str  # the name requests send (the first /v1/models id unless one was asked for)
    root: str | None = None  # what the server says it loaded (a folder or name), when it says
    max_model_len: int | None = None
    api_key: str | None = None

    @property
    def completions_url(self) -> str:
        return self.url + "/v1/completions"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def server_root(url: str) -> str:
    """``url`` without a trailing ``/``, ``/v1`` or ``/v1/completions``; ValueError unless it is http(s)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--server {url!r} must be an http(s) URL, e.g. http://127.0.0.1:8000")
    root = url.rstrip("/")
    for tail in ("/v1/completions", "/v1"):
        root = root.removesuffix(tail)
    return root


def _get_json(url: str, headers: dict[str, str], body: dict | None = None, timeout: float = TIMEOUT_S) -> dict:
    """GET (or POST ``body``) and decode the JSON answer; ConnectionError naming the URL and the answer."""
    import requests

    try:
        r = (requests.post(url, json=body, headers=headers, timeout=timeout) if body is not None
             else requests.get(url, headers=headers, timeout=timeout))
    except requests.RequestException as e:
        raise ConnectionError(f"no answer from {url} ({e.__class__.__name__}): is the server running there?") from e
    if r.status_code == 401:
        raise ConnectionError(f"{url} answered 401: pass the server's key with --api-key (or OPENAI_API_KEY)")
    if not r.ok:
        raise StatusError(f"{url} answered {r.status_code}: {r.text[:500]}", r.status_code)
    return r.json()


class StatusError(ConnectionError):
    """The server answered, with an HTTP error status (``status``)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def connect(url: str, api_key: str | None = None, model: str | None = None, timeout: float = 30) -> Endpoint:
    """The server at ``url`` and the model to score (``model``, or the first it lists at /v1/models)."""
    root = server_root(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    cards = _get_json(root + "/v1/models", headers, timeout=timeout).get("data") or []
    if not cards:
        raise ConnectionError(f"{root}/v1/models lists no model: is this an OpenAI-compatible server?")
    ids = [c.get("id") for c in cards]
    if model is not None and model not in ids:
        raise ValueError(f"--served-model {model!r} is not served at {root}: it serves {', '.join(map(str, ids))}")
    card = cards[ids.index(model)] if model is not None else cards[0]
    limit = card.get("max_model_len")
    return Endpoint(root, card["id"], card.get("root"), limit if isinstance(limit, int) else None, api_key)


def tokenizer_spec(endpoint: Endpoint, tokenizer: str | None) -> str:
    """Where the client's tokenizer comes from: ``tokenizer``, else the served folder when it is on this machine."""
    from compress.format.models import resolve

    if tokenizer is not None:
        resolve(tokenizer)  # FileNotFoundError naming what is expected
        return tokenizer
    for candidate in (endpoint.root, endpoint.model):
        if candidate:
            try:
                resolve(candidate)
                return candidate
            except FileNotFoundError:
                continue
    raise ValueError(f"the server's model {endpoint.model!r} is not a folder on this machine: pass --tokenizer PATH "
                     "(the served model's folder, .gguf or embedded name; tokenizers are read locally, never downloaded)")


def tokenizer_folder(spec: str, scratch: Path) -> str:
    """A folder lm-eval's client can load the tokenizer of ``spec`` from (a GGUF's tokenizer is saved to ``scratch``)."""
    from compress.format.models import load_tokenizer, resolve

    src = resolve(spec)
    if src.gguf_file is None:
        return str(src.path)
    load_tokenizer(src).save_pretrained(scratch)
    return str(scratch)


def _window_nll(endpoint: Endpoint, windows: Tensor) -> float:
    """Summed next-token NLL of ``windows: [b, seqlen]`` from one echo request's prompt logprobs."""
    body = {"model": endpoint.model, "prompt": windows.tolist(), "max_tokens": 1, "temperature": 0, "echo": True,
            "logprobs": 1}
    out = _get_json(endpoint.completions_url, endpoint.headers, body)
    choices = sorted(out.get("choices") or [], key=lambda c: c["index"])
    seqlen, total = windows.shape[1], 0.0
    if len(choices) != windows.shape[0]:
        raise ValueError(f"{endpoint.url} answered {len(choices)} choices for {windows.shape[0]} prompts")
    for c in choices:
        lps = ((c.get("logprobs") or {}).get("token_logprobs") or [])[1:seqlen]  # [0] is None: nothing predicts it
        if len(lps) != seqlen - 1 or any(lp is None for lp in lps):
            raise ValueError(f"{endpoint.url} returned no prompt logprobs for an echo request: the server must "
                             "support echo=true with logprobs on /v1/completions (vLLM and compress serve do)")
        total -= math.fsum(lps)
    return total


def check_echo(endpoint: Endpoint, tokenizer) -> None:
    """ValueError unless the server returns prompt logprobs for an echo request, checked before anything is scored:
    lm-eval's client would otherwise score every choice alike and report chance accuracy (llama-server refuses echo
    or returns the generated token's logprob only: ggml-org/llama.cpp#27174, open as of 2026-12)."""
    import torch

    ids = tokenizer("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)["input_ids"][:8]
    try:
        _window_nll(endpoint, torch.tensor([ids]))
    except (ValueError, StatusError) as e:  # not a missing key or a server that is down: those say so themselves
        raise ValueError(f"{endpoint.url} cannot be scored: its /v1/completions must return prompt logprobs for "
                         "echo=true (compress serve and vLLM do; llama-server does not yet, ggml-org/llama.cpp"
                         f"#27174). The server said: {e}") from e


def served_perplexity(endpoint: Endpoint, tokenizer, texts: list[str], seqlen: int = 512,
                      max_windows: int | None = None, batch_size: int = 8, concurrency: int = 1,
                      progress: Callable[[int, int], None] | None = None) -> PplResult:
    """eval/perplexity.py's protocol on the server: the same windows, the NLL from echoed prompt logprobs;
    ``batch_size`` windows per request, ``concurrency`` requests in flight."""
    if batch_size < 1 or concurrency < 1:
        raise ValueError(f"batch_size={batch_size} and concurrency={concurrency} must be >= 1")
    windows = token_windows(tokenizer, texts, seqlen, max_windows)  # [n, seqlen]
    n = windows.shape[0]
    batches = [windows[b:b + batch_size] for b in range(0, n, batch_size)]
    nll, done = 0.0, 0
    if progress:
        progress(0, n)
    with ThreadPoolExecutor(concurrency) as pool:
        for batch, part in zip(batches, pool.map(lambda w: _window_nll(endpoint, w), batches)):
            nll, done = nll + part, done + batch.shape[0]
            if progress:
                progress(done, n)
    mean = nll / (n * (seqlen - 1))
    return PplResult(ppl=math.exp(mean), nll=mean, tokens=n * (seqlen - 1), windows=n)


def scratch_dir() -> tempfile.TemporaryDirectory:
    """A temporary folder for a GGUF's tokenizer files, removed when the evaluation ends."""
    return tempfile.TemporaryDirectory(prefix="compress-eval-tok-")


def served_lm(endpoint: Endpoint, tokenizer_dir: str, batch_size: int = 8, concurrency: int = 1,
              progress: StepProgress = no_progress, label: str = ""):
    """lm-eval's own ``local-completions`` client for ``endpoint``, with one of our bars per task."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    class ProgressAPI(RequestProgress, LocalCompletionsAPI):
        def model_call(self, messages, **kw):
            out = super().model_call(messages, **kw)
            self._tick(len(messages))
            return out

        async def amodel_call(self, session, sem, messages, **kw):
            out = await super().amodel_call(session, sem, messages, **kw)
            self._tick(len(messages))
            return out

    # max_length: lm-eval truncates contexts to it (its default 2048 may exceed a small model's context)
    lm = ProgressAPI(base_url=endpoint.completions_url, model=endpoint.model, tokenizer=tokenizer_dir,
                     tokenizer_backend="huggingface", tokenized_requests=True, batch_size=batch_size,
                     num_concurrent=concurrency, max_length=endpoint.max_model_len or 2048, max_retries=2,
                     timeout=TIMEOUT_S, header=endpoint.headers or None)
    lm.progress, lm.label = progress, label
    return lm


def run_served_tasks(endpoint: Endpoint, tokenizer_dir: str, tasks: list[str], limit: int | None = None,
                     batch_size: int = 8, concurrency: int = 1, progress: StepProgress = no_progress,
                     label: str = "") -> dict[str, dict[str, float]]:
    """eval/tasks.py's metrics per task, the requests answered by the server (see ``run_tasks``)."""
    check_limit(tasks, limit)
    lm = served_lm(endpoint, tokenizer_dir, batch_size, concurrency, progress, label)
    return score_tasks(lm, tasks, limit, quiet=("lm_eval.api.task", "lm_eval.models.api_models"))


@dataclass(frozen=True)
class ServerTarget:
    """What ``compress eval --server`` scores: the URL, and how to talk to it."""

    url: str
    tokenizer: str | None = None  # a local folder, .gguf or embedded name; default: the served folder
    api_key: str | None = None
    model: str | None = None  # the served name to score; default: the first /v1/models lists
    concurrency: int = 1  # requests in flight (each carries --batch-size prompts)

    def __post_init__(self):
        server_root(self.url)
        if self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency} must be >= 1")


def evaluate_server(target: ServerTarget, texts: dict[str, list[str]], tasks: list[str], limit: int | None,
                    seqlen: int, max_windows: int | None, batch_size: int = 8,
                    progress: StepProgress = no_progress) -> ModelResult:
    """eval/report.py's ``evaluate_model`` for a served model: ppl per text and accuracy per task (no size)."""
    import time

    from compress.format.models import load_tokenizer, resolve

    start = time.perf_counter()
    endpoint = connect(target.url, target.api_key, target.model)
    spec = tokenizer_spec(endpoint, target.tokenizer)
    tokenizer = load_tokenizer(resolve(spec))
    check_echo(endpoint, tokenizer)
    name = f"{endpoint.model} @ {endpoint.url}"
    seconds, detail = {"load": time.perf_counter() - start}, {}
    for text, t in texts.items():
        tick, stage = time.perf_counter(), f"served: ppl {text}"
        detail[text] = served_perplexity(endpoint, tokenizer, t, seqlen, max_windows, batch_size, target.concurrency,
                                         lambda d, n, s=stage: progress(s, d, n, "window"))
        seconds[f"ppl {text}"] = time.perf_counter() - tick
    tick, accuracy = time.perf_counter(), {}
    if tasks:
        with scratch_dir() as scratch:
            folder = tokenizer_folder(spec, Path(scratch))
            accuracy = run_served_tasks(endpoint, folder, tasks, limit, batch_size, target.concurrency, progress,
                                        label="served: ")
    seconds["tasks"] = time.perf_counter() - tick
    from eval.report import average_accuracy

    return ModelResult(name, None, "served", spec, detail, accuracy, average_accuracy(accuracy), seconds)
