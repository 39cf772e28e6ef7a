"""The `compress` command line: quantize, export, eval, serve, bench, recipes.

Each command parses and validates its flags, then calls one library entry point; the work lives in
the packages. Heavy imports happen inside the commands so `compress --help` stays instant.
"""
from __future__ import annotations

import logging
import sys

import click


class CompressGroup(click.Group):
    """Turns the library's user-facing errors into one clear line and a non-zero exit."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError) as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)


@click.group(cls=CompressGroup)
@click.option("-v", "--verbose", is_flag=True, help="Log progress details.")
def main(verbose: bool):
    """Compress causal language models, export them, evaluate them and serve them."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


# --- quantize / recipes --------------------------------------------------------------------------
def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


@main.command()
@click.option("--recipe", default="awq4", show_default=True, help="Recipe name (see `compress recipes`) or a YAML path.")
@click.option("--model", "model_spec", default="smollm2-135m", show_default=True,
              help="Embedded model name, HF folder or .gguf file.")
@click.option("--out", type=click.Path(), default=None, help="Output folder [default: out/MODEL-RECIPE].")
@click.option("--calib", default=None, help="Calibration text: wiki, lambada, a .txt/.jsonl file, or a datasets name.")
@click.option("--nsamples", type=int, default=None, help="Calibration windows.")
@click.option("--seqlen", type=int, default=None, help="Tokens per calibration window.")
@click.option("--bits", type=int, default=None)
@click.option("--group-size", type=int, default=None, help="Inputs per scale; -1 for per channel.")
@click.option("--sym/--asym", default=None, help="Symmetric (no zero points) or asymmetric grid.")
@click.option("--act-order/--no-act-order", default=None, help="GPTQ: quantize columns by Hessian diagonal.")
@click.option("--seed", type=int, default=None)
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--trust-remote-code", is_flag=True, help="Allow the model folder's own Python code to run.")
@click.option("--allow-pickle", is_flag=True, help="Allow pickled .bin weights (they can run code when loaded).")
def quantize(recipe, model_spec, out, calib, nsamples, seqlen, bits, group_size, sym, act_order, seed, overwrite,
             trust_remote_code, allow_pickle):
    """Quantize MODEL with a recipe into a packed checkpoint folder."""
    from pathlib import Path

    from tqdm import tqdm

    from compress.config import load_recipe
    from compress.models import resolve
    from compress.pipeline import quantize_to_folder

    cfg = load_recipe(recipe).replace(calib=calib, nsamples=nsamples, seqlen=seqlen, bits=bits, group_size=group_size,
                                      sym=sym, act_order=act_order, seed=seed)
    src = resolve(model_spec)
    out = out or str(Path("out") / f"{src.name}-{Path(recipe).stem}")
    s = cfg.scheme
    click.echo(f"quantize {src.name} with {recipe}: {cfg.method} {s.bits}-bit, group {s.group_size}, "
               f"{'sym' if s.sym else 'asym'}" + (f", calibration {cfg.nsamples}x{cfg.seqlen} tokens of {cfg.calib}"
                                                  if cfg.needs_calibration else ", data-free"))
    bar = tqdm(total=None, desc="blocks", unit="block")

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    try:
        res = quantize_to_folder(model_spec, cfg, out, overwrite, Path(recipe).stem, progress, trust_remote_code,
                                 allow_pickle)
    finally:
        bar.close()
    click.echo(f"size: {_mb(res.fp_bytes)} (fp) -> {_mb(res.out_bytes)} ({res.fp_bytes / max(res.out_bytes, 1):.2f}x smaller)")
    click.echo(f"time: {res.seconds:.1f} s (quantization {res.report.seconds:.1f} s), peak memory {_mb(res.peak_rss_bytes)}")
    click.echo(f"wrote {res.out}")


@main.command()
def recipes():
    """List the bundled recipes."""
    from compress.config import list_recipes

    for name, desc in list_recipes().items():
        click.echo(f"{name:16s} {desc}")


# --- eval ---------------------------------------------------------------------------------------

# --- export -------------------------------------------------------------------------------------

# --- serve / bench ------------------------------------------------------------------------------


if __name__ == "__main__":
    main()
