"""A report variant that is a running OpenAI-compatible server (``--variants http://host:port``): scored through
the path ``compress eval --server`` takes (eval/served.py: the same perplexity windows from echoed prompt
logprobs, lm-eval's local-completions client for tasks), timed over HTTP on the report's workload. It has no size
(the weights are not here) and no KL (a server returns the chosen tokens' logprobs, not whole distributions), so
it sits in the table but not on the frontier, the plots or the recommendations."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

from eval.progress import StepProgress, no_progress
from runtime.bench.timing import median, stream_times

SIZE_LABEL = "served over HTTP: no size"
URL_PREFIXES = ("http://", "https://")


def is_url(text: str) -> bool:
    return text.startswith(URL_PREFIXES)


def served_label_key(url: str, api_key: str | None) -> tuple[str, str, list]:
    """(row label, server root, what identifies it) of the server at ``url``: reached now, so a wrong URL or key
    fails before any work."""
    from eval.served import connect

    endpoint = connect(url, api_key)
    name = endpoint.model.rstrip("/").rsplit("/", 1)[-1] or endpoint.model
    return f"{name}@{urlparse(endpoint.url).netloc}", endpoint.url, [endpoint.url, endpoint.model, endpoint.root]


def _endpoint(url: str, cfg):
    """The server's Endpoint and the tokenizer to count its windows with: the served folder when it is on this
    machine, else the report's model (its variants share a tokenizer)."""
    from eval.served import connect, tokenizer_spec

    endpoint = connect(url, cfg.api_key)
    try:
        return endpoint, tokenizer_spec(endpoint, None)
    except ValueError:
        return endpoint, cfg.model


def served_quality(url: str, texts: dict[str, list[str]], cfg, progress: StepProgress = no_progress) -> dict:
    """measure_quality's dict for a server: perplexity (and accuracy) as `compress eval --server` measures them."""
    from eval.served import ServerTarget, evaluate_server

    tokenizer = _endpoint(url, cfg)[1]
    target = ServerTarget(url, tokenizer, cfg.api_key, concurrency=cfg.concurrency)
    res = evaluate_server(target, texts, list(cfg.tasks), cfg.limit, cfg.seqlen, cfg.max_windows,
                          cfg.batch_size, progress)
    detail = res.ppl_detail
    return {"size_bytes": None, "size_label": SIZE_LABEL, "params": None, "bits_per_weight": None,
            "ppl": {t: r.ppl for t, r in detail.items()}, "nll": {t: r.nll for t, r in detail.items()},
            "kl": {t: None for t in detail}, "windows": next(iter(detail.values())).windows,
            "accuracy": res.accuracy, "accuracy_avg": res.accuracy_avg, "seconds": res.seconds,
            "tokenizer": res.tokenizer}


def _timed_request(endpoint, prompt_ids: list[int], output_len: int) -> tuple[float, float, int]:
    """(seconds to the first streamed token, seconds from it to the last, completion tokens) of one request."""
    import requests

    body = {"model": endpoint.model, "prompt": prompt_ids, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    with requests.post(endpoint.completions_url, json=body, headers=endpoint.headers, stream=True, timeout=600) as r:
        if not r.ok:
            raise ConnectionError(f"{endpoint.completions_url} answered {r.status_code}: {r.text[:300]}")
        ttft, span, tokens = stream_times(r.iter_lines(), t0)
    if ttft is None or tokens < 2:
        raise ValueError(f"{endpoint.url} streamed no tokens (or no usage): the speed needs streamed completions "
                         "with stream_options.include_usage and ignore_eos (vLLM and compress serve take them)")
    return ttft, span, tokens


def served_speed(url: str, cfg) -> dict:
    """The server's speed on the report's workload: TTFT/TPOT medians of streamed requests at batch 1, and output
    tokens per second with ``cfg.concurrency`` requests at once; over HTTP, so it includes the network."""
    from compress.format.models import load_tokenizer, resolve
    from eval.tradeoff.speed import BATCH1_REQUESTS, workload

    endpoint, spec = _endpoint(url, cfg)
    tok = load_tokenizer(resolve(spec))
    _timed_request(endpoint, list(workload(tok, 1, cfg, 1)[0].prompt_ids), cfg.output_len)  # warm-up
    one = [_timed_request(endpoint, list(r.prompt_ids), r.output_len) for r in workload(tok, BATCH1_REQUESTS, cfg, 2)]
    ttft_ms, tpot_ms = 1000 * median([t for t, _, _ in one]), 1000 * median([d / (n - 1) for _, d, n in one])
    many = workload(tok, 2 * cfg.concurrency, cfg, 3)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(cfg.concurrency) as pool:
        done = list(pool.map(lambda r: _timed_request(endpoint, list(r.prompt_ids), r.output_len), many))
    wall = time.perf_counter() - t0
    return {"runtime": "served", "ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "decode_tok_s": 1000.0 / tpot_ms,
            "output_tok_s": sum(n for _, _, n in done) / wall, "concurrency": cfg.concurrency,
            "kv_bytes_per_token": None, "note": "over HTTP, streamed"}
