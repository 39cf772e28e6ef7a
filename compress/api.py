"""The Python API, one function per CLI command (the CLI is a thin layer over these):

    import compress
    summary = compress.quantize("smollm2-135m", recipe="awq4", out="out/smollm2-awq4", nsamples=64)
    result = compress.evaluate("out/smollm2-awq4", baseline="smollm2-135m", ppl=["wiki"], tasks=["piqa"])
    compress.export("out/smollm2-awq4", "compressed-tensors", "out/smollm2-awq4-ct")

``compress.quantize``'s keyword overrides are any recipe field (see ``compress recipes`` and
compress/config.py): an unknown one is an error naming the known ones, as in a recipe file.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from importlib import import_module
from pathlib import Path


def quantize(model: str, recipe: str = "awq4", out: str | Path | None = None, *, overwrite: bool = False,
             stream: bool | None = None, max_memory: int | str | None = None,
             offload_activations: bool | None = None, trust_remote_code: bool = False,
             allow_pickle: bool = False, progress: Callable[[int, int], None] | None = None,
             train_progress: Callable[[int, int, float], None] | None = None, **overrides):
    """Quantize ``model`` (an embedded name, an HF folder or a .gguf file) with ``recipe`` (a bundled name or a
    YAML path) into the folder ``out`` [default: out/MODEL-RECIPE]; returns compress.job.QuantizeSummary."""
    from compress.config import FIELDS, load_recipe
    from compress.format.host import parse_size
    from compress.format.models import resolve
    from compress.job import quantize_to_folder

    cfg = load_recipe(recipe)
    unknown = sorted(set(overrides) - FIELDS)
    if unknown:
        raise ValueError(f"unknown recipe field(s) {', '.join(unknown)}; known: {', '.join(sorted(FIELDS))}")
    cfg = cfg.replace(**overrides)
    if out is None:
        out = Path("out") / f"{resolve(model).name}-{Path(recipe).stem}"
    if isinstance(max_memory, str):
        max_memory = parse_size(max_memory)
    return quantize_to_folder(model, cfg, str(out), overwrite, Path(recipe).stem, progress, trust_remote_code,
                              allow_pickle, train_progress, stream, max_memory, offload_activations)


def evaluate(model: str | None, baseline: str | None = None, ppl: Iterable[str] = ("wiki",), tasks: Iterable[str] = (),
             limit: int | None = None, seqlen: int = 512, max_windows: int | None = None, batch_size: int = 8,
             progress=None, server=None):
    """Held-out perplexity on each text in ``ppl``, accuracy on each lm-eval task, and size of ``model``, side by
    side with ``baseline``: an eval/result.py EvalResult (``.baseline``, ``.compressed``, ``.delta``, ``.settings``;
    ``result["delta"]``, the dict key of old, still reads). ``server`` (a URL, or an eval/served.py ServerTarget)
    scores a running OpenAI-compatible server in place of ``model``."""
    # eval/api.py holds it: compress imports nothing from eval (tests/test_imports.py checks the static graph, and
    # allows this one lookup by name, made only when the function is called)
    return import_module("eval.api").evaluate(model, baseline, ppl, tasks, limit, seqlen, max_windows, batch_size,
                                              progress, server)


def export(model: str, format: str, out: str | Path, *, overwrite: bool = False, dtype: str | None = None,
           dequantize_embedding: bool = False, **options) -> Path:
    """Export ``model`` as ``format`` (compressed-tensors, gptq, awq, onnx, onnx-int4, gguf) to ``out``; GGUF
    takes ``requantize``, ``embed_type``, ``output_type`` and ``k_quants`` (compress/exporters/gguf.py GGUFOptions).
    A quantized embedding that ``format`` has no codes for is refused unless ``dequantize_embedding``."""
    from compress.exporters.dispatch import export as run

    opts = None
    if format == "gguf":
        from compress.exporters.gguf import GGUFOptions

        opts = GGUFOptions(**options)
    elif options:
        raise ValueError(f"{', '.join(sorted(options))} apply to format gguf, not {format}")
    return run(model, format, out, overwrite=overwrite, dtype=dtype, options=opts,
               dequantize_embedding=dequantize_embedding)
