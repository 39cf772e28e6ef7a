"""The `compress` command line: quantize, export, eval, serve, bench, recipes.

Each command parses and validates its flags, then calls one library entry point; the work lives in
the packages. Heavy imports happen inside the commands so `compress --help` stays instant.
"""
from __future__ import annotations

import logging
import sys

import click

from compress.exporters.dispatch import FORMATS as EXPORT_FORMATS  # the one list of export formats (loads no exporter)
from runtime.bench import cli as bench_cli
from runtime.serve import cli as serve_cli


class StepFault(Exception):
    """A fault inside a command (not bad input), with the command and model it happened on."""

    def __init__(self, command: str, spec: str | None, cause: Exception):
        super().__init__(str(cause))
        self.command, self.spec, self.cause = command, spec, cause


class StepCommand(click.Command):
    """Hands a fault raised inside the command to the group with the command's name and MODEL."""

    def invoke(self, ctx):
        from compress.errors import USER_ERRORS

        try:
            return super().invoke(ctx)
        except (*USER_ERRORS, click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as e:
            spec = ctx.params.get("model_spec")
            raise StepFault(ctx.info_name, None if spec is None else str(spec), e) from e


class CompressGroup(click.Group):
    """Turns the library's user-facing errors into one clear line (exit 2) and a fault inside a step into one
    line naming the step, the model type and the cause (exit 1; the traceback with -v)."""

    command_class = StepCommand

    def invoke(self, ctx):
        from compress.errors import REPORT_HINT, USER_ERRORS, fault_line

        try:
            return super().invoke(ctx)
        except USER_ERRORS as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except StepFault as f:
            if ctx.params.get("verbose"):
                import traceback

                traceback.print_exception(f.cause, file=sys.stderr)
            click.echo(fault_line(f.command, f.spec, f.cause), err=True)
            click.echo(REPORT_HINT, err=True)
            sys.exit(1)


@click.group(cls=CompressGroup)
@click.option("-v", "--verbose", is_flag=True, help="Log progress details.")
def main(verbose: bool):
    """Compress causal language models, export them, evaluate them and serve them."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


# --- quantize / recipes --------------------------------------------------------------------------
@main.command()
@click.option("--recipe", default="awq4", show_default=True, help="Recipe name (see `compress recipes`) or a YAML path.")
@click.option("--model", "model_spec", default="smollm2-135m", show_default=True,
              help="Embedded model name, HF folder or .gguf file.")
@click.option("--out", type=click.Path(), default=None, help="Output folder [default: out/MODEL-RECIPE].")
@click.option("--calib", default=None,
              help="Calibration text: wiki, lambada, news, coqa, a .txt/.jsonl file, a datasets name, or a +-joined mix "
                   "(wiki+news).")
@click.option("--nsamples", type=int, default=None, help="Calibration windows.")
@click.option("--seqlen", type=int, default=None, help="Tokens per calibration window.")
@click.option("--bits", type=int, default=None)
@click.option("--group-size", type=int, default=None, help="Inputs per scale; -1 for per channel.")
@click.option("--sym/--asym", default=None, help="Symmetric (no zero points) or asymmetric grid.")
@click.option("--zero-floor", type=click.Choice(["0", "1"]), default=None,
              help="Asymmetric: 1 keeps every zero point >= 1, so `export --format gptq` writes v1 (read by every GPTQ "
              "loader) rather than gptq_v2; a group whose zero would be 0 gives up one step of its grid.")
@click.option("--act-order/--no-act-order", default=None, help="GPTQ: quantize columns by Hessian diagonal.")
@click.option("--seed", type=int, default=None)
@click.option("--kv-heads", type=int, default=None, help="Pool the KV heads down to N (GQA/MQA) before quantizing.")
@click.option("--kv-init", type=click.Choice(["pca", "mean"]), default=None,
              help="--kv-heads: activation-aware merge (pca, uses calibration text) or mean pooling.")
@click.option("--kv-fit-steps", type=int, default=None,
              help="--kv-heads: steps per layer fitting each merged attention to the original's outputs (0: none).")
@click.option("--uptrain-steps", type=int, default=None, help="Distillation steps after --kv-heads (0: none).")
@click.option("--steps", type=int, default=None, help="QAT: fine-tuning steps.")
@click.option("--lr", type=float, default=None, help="QAT: learning rate of the weights (in grid steps where the recipe sets lr_in_steps).")
@click.option("--init", "qat_init", type=click.Choice(["rtn", "awq", "gptq"]), default=None,
              help="QAT: PTQ to start from (compress/config.py QAT_INITS).")
@click.option("--rotate", type=click.Choice(["none", "hadamard"]), default=None,
              help="Fold the norms and rotate the weights by randomized Hadamards before quantizing.")
@click.option("--embed", type=click.Choice(["none", "int8", "int4"]), default=None,
              help="The input embedding: full width, int8 (per row) or int4 (groups of 32) [default: the recipe's].")
@click.option("--head", type=click.Choice(["none", "int8", "int4"]), default=None,
              help="The LM head, likewise; a tied head is the embedding (set either, or both alike).")
@click.option("--head-method", type=click.Choice(["rtn", "gptq"]), default=None,
              help="A quantized head (a tied one: the table): RTN, or GPTQ on the final hidden states of the "
                   "calibration text (RTN kept where better on held-out windows) [default: the recipe's].")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--trust-remote-code", is_flag=True, help="Allow the model folder's own Python code to run.")
@click.option("--allow-pickle", is_flag=True, help="Allow pickled .bin weights (they can run code when loaded).")
@click.option("--json", "json_path", type=click.Path(), default=None, help="Also write the summary as JSON.")
@click.option("--stream/--no-stream", default=None,
              help="Hold one decoder block in memory at a time [default: wherever the method and source allow].")
@click.option("--max-memory", default=None, help="Refuse up front when the memory estimate exceeds this, e.g. 8GB.")
@click.option("--offload-activations/--no-offload-activations", default=None,
              help="Keep the calibration activations on disk [default: only when they would not fit in memory].")
def quantize(recipe, model_spec, out, calib, nsamples, seqlen, bits, group_size, sym, zero_floor, act_order, seed,
             kv_heads, kv_init, kv_fit_steps, uptrain_steps, steps, lr, qat_init, rotate, embed, head, head_method,
             overwrite, trust_remote_code, allow_pickle, json_path, stream, max_memory, offload_activations):
    """Quantize MODEL with a recipe into a packed checkpoint folder."""
    import signal
    from pathlib import Path

    # a kill (SIGTERM) unwinds like Ctrl-C, so the half-written temporary output folder is removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from tqdm import tqdm

    from compress import api
    from compress.config import load_recipe
    from compress.format.models import resolve

    overrides = {k: v for k, v in dict(calib=calib, nsamples=nsamples, seqlen=seqlen, bits=bits, group_size=group_size,
                                       sym=sym, act_order=act_order, seed=seed, kv_heads=kv_heads, kv_init=kv_init,
                                       kv_fit_steps=kv_fit_steps, uptrain_steps=uptrain_steps, steps=steps, lr=lr,
                                       init=qat_init, rotate=rotate, embed=embed, head=head,
                                       head_method=head_method, zero_floor=None if zero_floor is None else int(zero_floor)).items()
                 if v is not None}
    cfg = load_recipe(recipe).replace(**overrides)  # validated here, so a bad flag fails before the model loads
    src = resolve(model_spec)
    out = out or str(Path("out") / f"{src.name}-{Path(recipe).stem}")
    s = cfg.scheme
    click.echo(f"quantize {src.name} with {recipe}: {cfg.method} {s.bits}-bit, group {s.group_size}, "
               f"{'sym' if s.sym else 'asym'}" + (f", calibration {cfg.nsamples}x{cfg.seqlen} tokens of {cfg.calib}"
                                                  if cfg.needs_calibration else ", data-free"))
    bar = tqdm(total=None, desc="blocks", unit="block")

    def progress(done: int, total: int, unit: str = "block") -> None:  # restarts per pass (compress/calibrate.py)
        if done == 0 or bar.unit != unit or (done == 1 and bar.n != 0):
            bar.unit = unit  # label first: reset() redraws, and would show the new count under the old pass's name
            bar.set_description(f"{unit}s", refresh=False)
            bar.set_postfix(refresh=False)
            bar.reset(total=total)
        bar.update(done - bar.n)

    def train_progress(step: int, steps: int, loss: float) -> None:  # QAT / uptraining: the bar restarts per run
        if step == 1:
            bar.unit = "step"
            bar.set_description("train", refresh=False)
            bar.reset(total=steps)
        bar.set_postfix(kl=f"{loss:.4f}")
        bar.update(step - bar.n)

    try:
        res = api.quantize(model_spec, recipe, out, overwrite=overwrite, stream=stream, max_memory=max_memory,
                           offload_activations=offload_activations, trust_remote_code=trust_remote_code,
                           allow_pickle=allow_pickle, progress=progress, train_progress=train_progress, **overrides)
    finally:
        bar.close()
    for line in res.lines():
        click.echo(line)
    click.echo(f"wrote {res.out}")
    if json_path:
        import json

        Path(json_path).write_text(json.dumps({**res.to_json(), "recipe": recipe}, indent=2))


@main.command()
def recipes():
    """List the bundled recipes, and the GGUF type each exports to losslessly (`compress export --format gguf`)."""
    from compress.config import list_recipes, load_recipe
    from compress.exporters.gguf import recipe_block_type

    for name, desc in list_recipes().items():
        cfg = load_recipe(name)
        kind = recipe_block_type(cfg.scheme, cfg.gptq.act_order, cfg.gptq.static_groups)
        gguf = f"gguf {kind.upper()}" if kind else "gguf needs --requantize"
        click.echo(f"{name:16s} {desc} [{gguf}]")


# --- eval ---------------------------------------------------------------------------------------
def _csv(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _quiet_lm_eval() -> None:
    if not logging.getLogger().isEnabledFor(logging.INFO):
        logging.getLogger("lm_eval").setLevel(logging.ERROR)  # lm-eval warns about our custom datasets per task


@main.command("eval")
@click.argument("model_spec", metavar="[MODEL]", required=False)
@click.option("--baseline", default=None, help="Model to compare against (name, HF folder or .gguf).")
@click.option("--server", default=None, help="Score a running OpenAI-compatible server (e.g. http://127.0.0.1:8000) "
              "in place of MODEL: lm-eval's local-completions client, ppl from echoed prompt logprobs.")
@click.option("--tokenizer", default=None, help="--server: the served model's tokenizer (a local folder, .gguf or "
              "embedded name) [default: the served folder, when it is on this machine].")
@click.option("--api-key", default=None, envvar="OPENAI_API_KEY", help="--server: its key (or set OPENAI_API_KEY).")
@click.option("--served-model", default=None, help="--server: the served name to score [default: the first listed].")
@click.option("--concurrency", type=int, default=1, show_default=True,
              help="--server: requests in flight, each carrying --batch-size prompts.")
@click.option("--ppl", default="wiki", show_default=True, help="Comma-separated texts: wiki, lambada, news, coqa, PATH.txt, ...")
@click.option("--tasks", default="", help="Comma-separated lm-eval tasks, e.g. hellaswag,piqa,arc_easy,winogrande.")
@click.option("--limit", type=int, default=None, help="Score only the first N documents of each task.")
@click.option("--seqlen", type=int, default=512, show_default=True, help="Tokens per perplexity window.")
@click.option("--max-windows", type=int, default=None, help="Score only the first N perplexity windows.")
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Also write the results here.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars on stderr.")
def eval_cmd(model_spec, baseline, server, tokenizer, api_key, served_model, concurrency, ppl, tasks, limit, seqlen,
             max_windows, batch_size, json_path, quiet):
    """Perplexity, task accuracy and size of MODEL (or of the model a --server serves), beside --baseline."""
    import json
    from pathlib import Path

    from eval.api import evaluate
    from eval.progress import Bars
    from eval.report import format_table

    target = None
    if server is not None:
        from eval.served import ServerTarget

        target = ServerTarget(server, tokenizer, api_key, served_model, concurrency)
    elif model_spec is None:
        raise click.UsageError("give MODEL, or --server URL to score a running server")
    elif tokenizer or served_model:
        raise click.UsageError("--tokenizer and --served-model apply to --server")
    _quiet_lm_eval()
    bars = Bars(quiet)
    try:
        result = evaluate(model_spec, baseline, _csv(ppl), _csv(tasks), limit, seqlen, max_windows, batch_size,
                          progress=bars, server=target)
    finally:
        bars.close()
    click.echo(format_table(result))
    if json_path:
        Path(json_path).write_text(json.dumps(result.to_json(), indent=2))
        click.echo(f"wrote {json_path}")


@main.command("report")
@click.argument("model_spec", metavar="MODEL")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Report folder (its cache is reused).")
@click.option("--recipes", default="fp32,int8,nf4,rtn4,gptq4,awq4,awq-gptq4", show_default=True,
              help="Comma-separated recipes applied to MODEL; fp32 is MODEL itself. Empty: none.")
@click.option("--variants", default="", help="Comma-separated existing folders or files (checkpoint, ONNX export, "
              ".gguf) or URLs of running OpenAI-compatible servers, scored as `compress eval --server` does.")
@click.option("--api-key", default=None, envvar="OPENAI_API_KEY", help="The key of the --variants servers (or set "
              "OPENAI_API_KEY); never written to the report.")
@click.option("--exports", default="", help="Comma-separated FORMAT:RECIPE exports to measure, e.g. onnx-int4:rtn4,gguf:gptq4.")
@click.option("--ppl", default="wiki", show_default=True, help="Comma-separated texts; the first one ranks the variants.")
@click.option("--seqlen", type=int, default=512, show_default=True, help="Tokens per perplexity window.")
@click.option("--max-windows", type=int, default=32, show_default=True, help="Perplexity/KL windows per text.")
@click.option("--tasks", default="", help="Comma-separated lm-eval tasks (see compress eval).")
@click.option("--limit", type=int, default=None, help="Score only the first N documents of each task.")
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--concurrency", type=int, default=8, show_default=True, help="Requests at once for the throughput column.")
@click.option("--prompt-len", type=int, default=128, show_default=True)
@click.option("--output-len", type=int, default=64, show_default=True)
@click.option("--no-speed", is_flag=True, help="Skip the speed measurements.")
@click.option("--nsamples", type=int, default=None, help="Calibration windows for every recipe (default: each recipe's).")
@click.option("--calib-seqlen", type=int, default=None, help="Tokens per calibration window (default: each recipe's).")
@click.option("--max-size", default=None, help="Size budget of the 'most accurate' recommendation, e.g. 120MB "
              "[default: 30% of the baseline].")
@click.option("--max-ppl-increase", type=float, default=5.0, show_default=True,
              help="Percent over the baseline's perplexity the 'smallest' and 'fastest' recommendations allow.")
@click.option("--fp-tables", is_flag=True, help="Beside each recipe that quantizes the embedding/LM head, the same "
              "recipe with them full width (RECIPE-fp-tables: embed/head none): what the tables cost and save.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars on stderr.")
def report_cmd(model_spec, out, recipes, variants, api_key, exports, ppl, seqlen, max_windows, tasks, limit,
               batch_size, concurrency, prompt_len, output_len, no_speed, nsamples, calib_seqlen, max_size,
               max_ppl_increase, fp_tables, quiet):
    """Quality vs size vs speed of every variant of MODEL: report.md/.json/.html and plots in --out."""
    import shlex

    from eval.progress import Bars
    from eval.tradeoff.config import ReportConfig, parse_size
    from eval.tradeoff.run import run_report

    cfg = ReportConfig(model=model_spec, out=out, recipes=tuple(_csv(recipes)), variants=tuple(_csv(variants)),
                       exports=tuple(_csv(exports)), ppl=tuple(_csv(ppl)), seqlen=seqlen, max_windows=max_windows,
                       tasks=tuple(_csv(tasks)), limit=limit, batch_size=batch_size, speed=not no_speed,
                       concurrency=concurrency, prompt_len=prompt_len, output_len=output_len, calib_nsamples=nsamples,
                       calib_seqlen=calib_seqlen, max_size=parse_size(max_size) if max_size else None,
                       max_ppl_increase=max_ppl_increase, fp_tables=fp_tables, api_key=api_key)
    _quiet_lm_eval()
    bars = Bars(quiet)
    command = "compress report " + shlex.join(a.replace(api_key, "***") if api_key else a for a in sys.argv[2:])
    try:
        result = run_report(cfg, bars, command=command)
    finally:
        bars.close()
    from pathlib import Path

    click.echo(Path(out, "report.md").read_text().split("\n## Plots")[0])
    failed = [r["label"] for r in result["rows"] if r.get("error")]
    if failed:
        click.echo(f"failed (see the error column): {', '.join(failed)}", err=True)
    click.echo(f"wrote {out}/report.md, report.json, report.html and the plots")


# --- export -------------------------------------------------------------------------------------
@main.command("export")
@click.argument("model_spec", metavar="MODEL_DIR")
@click.option("--format", "fmt", required=True, help=f"Target format: {', '.join(EXPORT_FORMATS)}.")
@click.option("--out", required=True, type=click.Path(), help="Output folder, or FILE.gguf for gguf (written atomically).")
@click.option("--overwrite", is_flag=True, help="Replace an existing output.")
@click.option("--dtype", default=None, help="float32, float16 or bfloat16 for the unquantized tensors [default: the "
              "model's own for compressed-tensors/gptq/awq, float32 for onnx/onnx-int4 (which take no bfloat16), "
              "float16 for gguf]; float16 only where a float16 forward of a few tokens stays finite.")
@click.option("--requantize", default=None, help="gguf: round layers whose integers do not map (group size, "
              "act-order, 3-bit, nf4) again by llama.cpp's rules into q4_0, q4_1 or q8_0 (not lossless).")
@click.option("--embed-type", default=None, help="gguf: f16, bf16, f32, q8_0 or q6_k for the unquantized matrices "
              "(embeddings, an fp lm_head) [default: from --dtype].")
@click.option("--output-type", default=None, help="gguf: the same choice for an unquantized head (output, or a tied "
              "token_embd) [default: q6_k for a quantized model, as llama.cpp's Q4_K_M, else --embed-type].")
@click.option("--k-quants", is_flag=True, help="gguf: 4-bit layers whose width divides by 256 as Q4_K (our codes, "
              "scales rounded to 6 bits: smaller than Q4_1, not lossless); the others stay Q4_0/Q4_1.")
@click.option("--dequantize-embedding", is_flag=True, help="compressed-tensors/gptq/awq: write a quantized "
              "embedding (and its tied head) dequantized at full width, which these formats otherwise refuse.")
def export_cmd(model_spec, fmt, out, overwrite, dtype, requantize, embed_type, output_type, k_quants,
               dequantize_embedding):
    """Export a quantized folder (or, for --format onnx/gguf, any model) to another runtime's format."""
    from compress import api

    options = (dict(requantize=requantize, embed_type=embed_type, output_type=output_type, k_quants=k_quants)
               if fmt == "gguf" else {})
    if fmt != "gguf" and (requantize or embed_type or output_type or k_quants):
        raise ValueError(f"--requantize, --embed-type, --output-type and --k-quants apply to --format gguf, not {fmt}")
    path = api.export(model_spec, fmt, out, overwrite=overwrite, dtype=dtype,
                      dequantize_embedding=dequantize_embedding, **options)
    click.echo(f"wrote {fmt} export to {path}")


# generate, serve and bench run through the serving engine: serve and bench keep their options beside it
KV_CACHE_DTYPE = serve_cli.KV_CACHE_DTYPE


@main.command("generate")
@click.argument("model_spec", metavar="MODEL")
@click.option("--prompt", required=True, help="Text to continue.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--dtype", default="auto", show_default=True, help="Compute dtype, as `compress serve` takes it.")
@KV_CACHE_DTYPE
def generate_cmd(model_spec, prompt, max_new_tokens, dtype, kv_cache_dtype):
    """Greedy continuation of PROMPT: through the serving engine with serve's defaults (so `compress serve` answers
    a temperature-0 request with the same text), or through ONNX Runtime for an exported ONNX folder."""
    from compress.exporters.onnx_runner import greedy_generate, is_onnx_folder, load_causal_lm

    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens} must be at least 1")
    if not is_onnx_folder(model_spec):
        from runtime import LLM, SamplingParams

        llm = LLM(model_spec, dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=1 << 28)
        click.echo(llm.generate([prompt], SamplingParams(max_tokens=max_new_tokens))[0].text)
        return
    if dtype != "auto" or kv_cache_dtype != "auto":
        raise ValueError("--dtype and --kv-cache-dtype apply to the serving engine, not to an ONNX export")
    model, tokenizer = load_causal_lm(model_spec)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = greedy_generate(model, ids, max_new_tokens)
    click.echo(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))


main.command()(serve_cli.with_options(serve_cli.SERVE_OPTIONS, serve_cli.serve))
main.command()(serve_cli.with_options(bench_cli.BENCH_OPTIONS, bench_cli.bench))

if __name__ == "__main__":
    main()
