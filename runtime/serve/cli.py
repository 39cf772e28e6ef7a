"""`compress serve`: its options and what it calls (cli.py registers it with the other commands, so a fault inside it
reaches the user as one line like theirs)."""
from __future__ import annotations

from collections.abc import Callable

import click

KV_CACHE_DTYPE = click.option(
    "--kv-cache-dtype", default="auto", show_default=True, type=click.Choice(["auto", "int8", "fp8_e4m3"]),
    help="KV cache storage: auto (the compute dtype), or 8-bit codes with an fp16 scale per token and KV head, "
    "about twice the tokens in the same memory (fp8_e4m3 where torch has float8_e4m3fn).")


def with_options(options: tuple, fn: Callable) -> Callable:
    """``fn`` decorated with ``options`` (click's decorators, in the order they read top to bottom)."""
    for option in reversed(options):
        fn = option(fn)
    return fn


SERVE_OPTIONS = (
    click.argument("model_spec", metavar="MODEL"),
    click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind; loopback unless you mean it."),
    click.option("--port", type=int, default=8000, show_default=True),
    click.option("--draft", default=None, help="Speculative decoding: 'ngram' or a draft model (name or folder)."),
    click.option("--api-key", default=None, envvar="COMPRESS_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1 "
                 "(or set COMPRESS_API_KEY)."),
    click.option("--max-num-seqs", type=int, default=64, show_default=True, help="Requests decoded together."),
    click.option("--max-queue", type=int, default=256, show_default=True, help="Requests waiting beyond the batch before 429."),
    click.option("--max-model-len", type=int, default=None, help="Context limit (default: the model's)."),
    click.option("--dtype", default="auto", show_default=True, help="Compute dtype: auto (bf16 for quantized checkpoints "
                 "where this CPU has native bf16, else the checkpoint's own), float32, bfloat16, float16."),
    click.option("--lm-head", default="auto", show_default=True, type=click.Choice(["auto", "fp", "int8", "int4"]),
                 help="CPU LM head: auto (int8 for quantized checkpoints in bf16), fp, or rounded at load to int8/int4."),
    KV_CACHE_DTYPE,
    click.option("--model-impl", default="auto", show_default=True, type=click.Choice(["auto", "native", "transformers"]),
                 help="auto: the runtime's native model where the family has one (fast), else transformers' own modeling "
                 "code on the engine's paged KV cache (slower); or force one."),
    click.option("--trust-remote-code", is_flag=True, help="Allow the model folder's own Python code to run."),
    click.option("--served-model-name", "served_model_names", multiple=True,
                 help="A name requests use for the model (repeat for aliases); /v1/models lists them [default: MODEL]."),
    click.option("--chat-template", default=None, help="A Jinja chat template file, or the template itself."),
    click.option("--kv-cache-memory", default=None, help="Bytes for the paged KV cache, e.g. 2GiB [default: 1GiB]; on "
                 "CPU an upper bound, committed as the cache fills."),
    click.option("--quant-kernel", default=None, type=click.Choice(["auto", "hybrid", "packed", "dequant"]),
                 help="Quantized linears: auto (packed kernels, no weight copies) [default], hybrid (plus a persistent "
                 "bf16 copy of each weight for prompts: 2 bytes a weight more), packed, dequant."),
    click.option("--block-size", type=int, default=None, help="Tokens per KV block [default: 16]."),
    click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=None,
                 help="Share the KV blocks of common prompt prefixes [default: on]."),
    click.option("--max-num-batched-tokens", type=int, default=None, help="Tokens per forward; longer prompts are "
                 "prefilled in chunks [default: 2048]."),
    click.option("--num-speculative-tokens", type=int, default=None, help="Drafted tokens per step with --draft [default: 4]."),
    click.option("--seed", type=int, default=None, help="Seed of the sampling of requests without their own seed."),
    click.option("--tool-call-parser", default="hermes", show_default=True,
                 type=click.Choice(["hermes", "llama3_json", "mistral"]),
                 help="How the model writes tool calls: hermes (<tool_call> JSON: Qwen2.5/3, Hermes), llama3_json, or "
                 "mistral ([TOOL_CALLS] and a JSON array of calls; [TOOL_CALLS]name[ARGS]{...} per call where the "
                 "tokenizer holds [ARGS], v11 and later)."),
)


def serve(model_spec, host, port, api_key, max_queue, served_model_names, chat_template, kv_cache_memory,
          tool_call_parser, **engine):
    """Serve MODEL over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /metrics)."""
    from compress.format.host import parse_size
    from runtime.serve.server import serve as run_server

    if kv_cache_memory is not None:
        engine["kv_cache_memory"] = parse_size(kv_cache_memory)
    run_server(model_spec, host=host, port=port, api_key=api_key, max_queue=max_queue,
               served_model_names=served_model_names, chat_template=chat_template, tool_call_parser=tool_call_parser,
               **{k: v for k, v in engine.items() if v is not None})
