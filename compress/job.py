"""`compress quantize` as a function: load (or stream), calibrate, quantize, write the folder atomically.

Two paths write the same tensors. Streamed (the default where it applies: a safetensors source,
a layer-by-layer method): one decoder block in memory at a time (compress/stream.py). In memory:
the whole fp32 model, for what needs it (QAT, GQA conversion, rotations, a quantized source).
"""
from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from compress.calibrate import BlockStore
from compress.config import QuantizeConfig
from compress.format.families import FAMILIES
from compress.memory import check, plan_offload
from compress.methods.embed_head import head_scheme, plan_outer
from compress.pipeline import Progress, QuantizeReport, TrainProgress, quantize_model

STREAM_METHODS = ("rtn", "nf4", "gptq", "awq")
SEQUENTIAL_METHODS = ("gptq", "awq")  # calibrated block by block: a streamed run ends with the last block's outputs


@dataclass
class QuantizeSummary:
    out: str
    report: QuantizeReport
    fp_bytes: int  # the fp model's parameters in memory
    out_bytes: int  # the written weight files
    seconds: float
    peak_rss_bytes: int
    streamed: bool = False
    memory: dict = field(default_factory=dict)  # the estimate, and the largest block held (streamed)

    def to_json(self) -> dict:
        """What `compress quantize --json` writes: every field, the report as its JSON."""
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"report": self.report.to_json()}

    def lines(self) -> list[str]:
        """What a person reads after a run: KV heads, QAT, size, time and memory, streaming."""
        notes = self.report.notes
        out = [note.line() for note in (notes.gqa, notes.qat, notes.fallback) if note is not None]
        out.append(f"size: {_mb(self.fp_bytes)} (fp) -> {_mb(self.out_bytes)} "
                   f"({self.fp_bytes / max(self.out_bytes, 1):.2f}x smaller)")
        out.append(f"time: {self.seconds:.1f} s (quantization {self.report.seconds:.1f} s), peak memory "
                   f"{_mb(self.peak_rss_bytes)}" + (f" (estimate {_mb(self.memory['estimate_bytes'])})"
                                                    if "estimate_bytes" in self.memory else ""))
        if self.memory.get("activations_offloaded"):
            out.append("activations: on disk beside the output, one batch in memory at a time")
        if self.streamed:
            out.append(f"streamed: one block at a time, largest {_mb(self.memory['largest_block_bytes'])} (fp32), "
                       f"{self.memory['seconds_per_block']:.1f} s per block")
        return out


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def peak_rss() -> int:
    """Peak resident memory of this process image (VmHWM: unlike ru_maxrss, not inherited across exec)."""
    import resource

    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux, bytes on macOS


def why_not_streamed(src, cfg: QuantizeConfig) -> str | None:
    """Why ``cfg`` on ``src`` needs the whole model in memory, or None when it can stream."""
    if cfg.method not in STREAM_METHODS:
        return f"method {cfg.method} trains the whole model"
    if cfg.kv_heads:
        return "GQA conversion (kv_heads) uptrains the whole model"
    if getattr(cfg, "rotate", "none") != "none":
        return "rotations are folded over the whole model"
    if src.quantized:
        return "the source is already a quantized checkpoint"
    if cfg.gptq.guided:
        return "guided GPTQ backpropagates through the whole model"
    return None


def preflight(src, cfg: QuantizeConfig, trust_remote_code: bool) -> None:
    """Refuse, before any weight is read, a model whose family a step of ``cfg`` does not handle."""
    import json

    from compress.format.families import check_config, require

    config_file = src.path / "config.json"
    if src.gguf_file or not config_file.is_file():  # a GGUF: transformers checks its architecture on load
        return
    mt = check_config(json.loads(config_file.read_text()), trust_remote_code, src.name)
    if cfg.method == "awq" or (cfg.method == "qat" and cfg.qat.init == "awq"):
        require(mt, "awq", "rtn, gptq, nf4 and int8 need no smoothing map")
    if getattr(cfg, "rotate", "none") != "none":
        require(mt, "rotate")
    if getattr(cfg, "kv_heads", None):
        require(mt, "gqa")
    if cfg.method == "qat" and cfg.qat.self_data > 0:  # sampling needs a start token (transformers fills defaults)
        from transformers import AutoConfig

        from compress.methods.common.selfdata import start_token
        start_token(AutoConfig.from_pretrained(src.path, trust_remote_code=trust_remote_code))


def check_outer(src, cfg: QuantizeConfig, trust_remote_code: bool) -> str | None:
    """Refuse, before any weight is read, ``embed``/``head`` schemes that a tied model cannot take (one tensor);
    returns why the run cannot stream because of them (a calibrated untied head), or None."""
    if cfg.embed == "none" and cfg.head == "none":
        return None
    from compress.format.models import source_config

    config = source_config(src, trust_remote_code)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if head_scheme(plan_outer(cfg, bool(getattr(text, "tie_word_embeddings", False))), cfg) is None:
        return None
    if cfg.method not in SEQUENTIAL_METHODS:  # a streamed run of these never computes the blocks' outputs
        return (f"head_method: gptq calibrates the head on the quantized body's final hidden states, which a "
                f"streamed {cfg.method} run does not compute (gptq and awq runs do)")
    if getattr(text, "model_type", None) not in FAMILIES:
        return "head_method: gptq on a streamed run needs the family's final norm (compress/format/families.py)"
    return None


def _calibrated_head(model, cfg: QuantizeConfig, scheme, batches, progress, report: QuantizeReport, **streamed):
    """The head's GPTQ codes on the quantized body's final hidden states (``streamed``: the last block's outputs and
    the head's weight, compress/methods/head_gptq.py calibrate_head), its record in the report."""
    from compress.methods.head_gptq import calibrate_head

    t0 = time.perf_counter()
    res = calibrate_head(model, cfg, scheme, batches, progress, **streamed)
    seconds = time.perf_counter() - t0
    report.seconds += seconds  # the summary's quantization time includes the head's pass
    report.notes.head_calibration = res.note(seconds)
    return res.weight


def stream_folder(src, trust_remote_code: bool) -> Path:
    """The safetensors folder to stream from: the model's own, or for a GGUF its dequantized cache."""
    from compress.format.models import gguf_cache

    if src.gguf_file:
        return gguf_cache(src)
    if not any(src.path.glob("*.safetensors")):
        raise ValueError(f"{src.path} holds no safetensors shards to stream from; pass --no-stream")
    return src.path


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def _calibration(cfg: QuantizeConfig, tokenizer):
    if not cfg.needs_calibration:
        return None, {}
    from compress.data import calibration_batches

    ids = calibration_batches(tokenizer, cfg.calib, cfg.nsamples, cfg.seqlen, cfg.seed)
    return list(ids.split(cfg.batch_size)), {"source": cfg.calib, "nsamples": cfg.nsamples, "seqlen": cfg.seqlen,
                                             "seed": cfg.seed}


def _quantization_config(model, cfg: QuantizeConfig, calibration: dict, recipe: str | None, src,
                         report: QuantizeReport) -> dict:
    from compress.format.checkpoint import build_quantization_config

    fell = report.notes.checkpoint()  # RTN kept, and where
    return build_quantization_config(model, cfg.method, cfg.scheme, cfg.gptq.act_order and not cfg.gptq.static_groups,
                                     calibration, extra={"recipe": recipe, "source_model": src.name,
                                                         "config": cfg.to_dict(), **fell})


def _streamed(src, cfg, out, overwrite, recipe, progress, trust_remote_code, max_memory, offload):
    from compress.format.checkpoint import atomic_dir
    from compress.format.models import load_tokenizer
    from compress.format.shards import ShardReader
    from compress.methods.embed_head import empty_outer
    from compress.stream import StreamedBlocks, skeleton, tied, write_side_files

    folder = stream_folder(src, trust_remote_code)
    model = skeleton(folder, trust_remote_code)
    plan = plan_outer(cfg, tied(model))
    estimate, offloaded = plan_offload(model, cfg, True, max_memory, offload)
    check(estimate, max_memory, f"streaming {src.name} with {cfg.method}")
    reader = ShardReader(folder)
    fp_bytes = sum(math.prod(e.shape) for e in reader.entries.values()) * 4  # the source's parameters in fp32
    tokenizer = load_tokenizer(src, trust_remote_code)
    batches, calibration = _calibration(cfg, tokenizer)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        store = StreamedBlocks(model, reader, tmp, _offload_dir(out) if offloaded else None, bool(src.gguf_file))
        report = quantize_model(model, cfg, batches, progress, store=store)
        scheme, head_codes = head_scheme(plan, cfg), None
        if scheme is not None:
            head_codes = _calibrated_head(model, cfg, scheme, batches, progress, report, outputs=store.final.hidden,
                                          weight=store.head_weight())
        store.final = None
        store.finish(plan, head_codes)
        empty_outer(model, plan)  # the skeleton now describes what was written
        write_side_files(model, folder, tokenizer, tmp,
                         _quantization_config(model, cfg, calibration, recipe, src, report))
    blocks = store.stats.block_seconds
    memory = {"estimate_bytes": estimate.peak, "largest_block_bytes": store.stats.block_bytes,
              "seconds_per_block": sum(blocks) / max(len(blocks), 1), "activations_offloaded": offloaded}
    return report, fp_bytes, memory, estimate


def _in_memory(model_spec, src, cfg, out, overwrite, recipe, progress, trust_remote_code, allow_pickle, train_progress,
               max_memory, offload):
    from compress.format.checkpoint import save_quantized
    from compress.format.models import load_model
    from compress.format.shards import ShardReader
    from compress.methods.embed_head import quantize_outer
    from compress.stream import blocks_bfloat16, outer_dtypes, skeleton, tied

    estimate, dtypes, offloaded = None, None, bool(offload)
    if not src.gguf_file and not src.quantized and any(src.path.glob("*.safetensors")):
        skel, reader = skeleton(src.path, trust_remote_code), ShardReader(src.path)
        estimate, offloaded = plan_offload(skel, cfg, False, max_memory, offload, blocks_bfloat16(skel, reader))
        check(estimate, max_memory, f"{cfg.method} on {src.name} (the whole model in memory)")
        dtypes = outer_dtypes(skel, reader)
    model, tokenizer, src = load_model(model_spec, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
    if src.gguf_file:  # loaded from its fp32 cache: the tensors outside the blocks go back to 16 bits
        from compress.format.models import gguf_cache

        cache = gguf_cache(src)
        dtypes = outer_dtypes(skeleton(cache), ShardReader(cache), gguf=True)
    fp_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    batches, calibration = _calibration(cfg, tokenizer)
    store = BlockStore(_offload_dir(out) if offloaded else None)
    report = quantize_model(model, cfg, batches, progress, train_progress, store)
    plan, head_codes = plan_outer(cfg, tied(model)), None
    scheme = head_scheme(plan, cfg)
    if scheme is not None:  # on the quantized body's final hidden states
        head_codes = _calibrated_head(model, cfg, scheme, batches, progress, report)
    quantize_outer(model, plan, head_codes)
    save_quantized(model, tokenizer, out, _quantization_config(model, cfg, calibration, recipe, src, report),
                   overwrite=overwrite, dtypes=dtypes)
    memory = {"estimate_bytes": estimate.peak} if estimate else {}
    return report, fp_bytes, {**memory, "activations_offloaded": offloaded}, estimate


def _offload_dir(out) -> Path:
    """Where offloaded activations go: beside the output folder (one filesystem; /tmp may be memory)."""
    return Path(out).parent / f".{Path(out).name}.activations"


def quantize_to_folder(model_spec: str, cfg: QuantizeConfig, out: str, overwrite: bool = False,
                       recipe: str | None = None, progress: Progress | None = None,
                       trust_remote_code: bool = False, allow_pickle: bool = False,
                       train_progress: TrainProgress | None = None, stream: bool | None = None,
                       max_memory: int | None = None, offload_activations: bool | None = None) -> QuantizeSummary:
    """Quantize ``model_spec`` with ``cfg`` into ``out``. ``stream``: None streams where the method and the
    source allow it, True insists (an error says why not), False loads the whole model. ``offload_activations``:
    the calibration activations on disk beside ``out``; None: only when the run would not fit otherwise."""
    from compress.format.models import resolve

    if Path(out).exists() and not overwrite:  # fail before any heavy work
        raise FileExistsError(f"{out} already exists; pass --overwrite to replace it")
    if offload_activations and cfg.method == "qat":
        raise ValueError("--offload-activations applies to the layer-by-layer methods; qat trains on token batches "
                         "and stores no activations: drop it")
    t0 = time.perf_counter()
    src = resolve(model_spec)
    preflight(src, cfg, trust_remote_code)
    reason = check_outer(src, cfg, trust_remote_code)
    reason = why_not_streamed(src, cfg) or reason
    if stream and reason:
        raise ValueError(f"cannot stream {src.name}: {reason}; drop --stream")
    try:
        if stream is not False and reason is None:
            report, fp_bytes, memory, _ = _streamed(src, cfg, out, overwrite, recipe, progress, trust_remote_code,
                                                    max_memory, offload_activations)
        else:
            report, fp_bytes, memory, _ = _in_memory(model_spec, src, cfg, out, overwrite, recipe, progress,
                                                     trust_remote_code, allow_pickle, train_progress, max_memory,
                                                     offload_activations)
    finally:
        shutil.rmtree(_offload_dir(out), ignore_errors=True)
    return QuantizeSummary(str(out), report, fp_bytes, _size(Path(out)), time.perf_counter() - t0, peak_rss(),
                           streamed=stream is not False and reason is None, memory=memory)
