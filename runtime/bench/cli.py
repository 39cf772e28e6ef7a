"""`compress bench`: its options and what it runs (cli.py registers it)."""
from __future__ import annotations

import click

from runtime.serve.cli import KV_CACHE_DTYPE

BENCH_OPTIONS = (
    click.argument("model_spec", metavar="MODEL"),
    click.option("--baseline", default=None, help="fp model for the transformers and engine-fp32 rows (default: MODEL)."),
    click.option("--prompt-len", type=int, default=128, show_default=True, help="Longest prompt, in tokens."),
    click.option("--output-len", type=int, default=128, show_default=True, help="Longest output, in tokens."),
    click.option("--concurrency", default="1,8,32", show_default=True, help="Comma-separated levels of concurrent requests."),
    click.option("--requests", "requests_per_level", type=int, default=None, help="Requests per run (default max(4, 2 x level))."),
    click.option("--jitter", type=float, default=0.5, show_default=True, help="Lengths drawn from [len * (1 - jitter), len]."),
    click.option("--repeats", type=int, default=1, show_default=True, help="Runs per row; rows report the median run."),
    click.option("--no-hf", is_flag=True, help="Skip the transformers generate rows."),
    click.option("--no-spec", is_flag=True, help="Skip the speculative decoding rows."),
    click.option("--dtype", default="auto", show_default=True, help="Engine dtype for MODEL (auto: bf16 with the packed "
                 "kernels for quantized checkpoints where the CPU has bf16); the baseline rows stay float32."),
    click.option("--lm-head", default="auto", show_default=True, type=click.Choice(["auto", "fp", "int8", "int4"]),
                 help="The engine's LM head on CPU (see compress serve)."),
    KV_CACHE_DTYPE,
    click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Also write the results here."),
)


def _levels(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--concurrency {value!r} must be comma-separated integers, e.g. 1,8,32") from None


def bench(model_spec, baseline, prompt_len, output_len, concurrency, requests_per_level, jitter, repeats, no_hf, no_spec,
          dtype, lm_head, kv_cache_dtype, json_path):
    """Throughput and latency of MODEL: transformers vs this engine, static vs continuous batching, speculative."""
    import json
    from pathlib import Path

    from runtime.bench.scenarios import BenchConfig, format_table, run_bench

    cfg = BenchConfig(model=model_spec, baseline=baseline, prompt_len=prompt_len, output_len=output_len,
                      concurrency=_levels(concurrency), requests_per_level=requests_per_level, jitter=jitter,
                      repeats=repeats, hf=not no_hf, speculative=not no_spec, dtype=dtype, lm_head=lm_head,
                      kv_cache_dtype=kv_cache_dtype)
    result = run_bench(cfg, progress=lambda msg: click.echo(f"  running {msg}", err=True))
    click.echo(format_table(result["rows"]))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2, default=str))
        click.echo(f"wrote {json_path}")
