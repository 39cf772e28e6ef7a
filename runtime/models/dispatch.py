"""Which model serves a checkpoint: the native runtime model for its family, else transformers' own code.

``MODEL_IMPLS`` are EngineConfig's ``model_impl`` choices: ``"auto"`` takes the native model
(runtime/models/llama.py, the fast path) when the family table (compress/format/families.py, step ``runtime``) says the
runtime has one, and transformers' modeling code with the engine's paged KV cache (runtime/models/hf_backend.py,
slower) otherwise; ``"native"`` and ``"transformers"`` force one. Both decisions are made from ``config.json``
alone, so an unsupported family or a remote-code model without ``trust_remote_code`` fails before any weight is
read.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from compress.format.families import supported, supports
from runtime.config import MODEL_IMPLS
from runtime.models.hf_backend import TransformersConfig, build_transformers_model
from runtime.models.llama import ModelConfig
from runtime.models.loader import Checkpoint, build_model as build_native_model

log = logging.getLogger(__name__)

RuntimeConfig = ModelConfig | TransformersConfig  # what the engine sizes a model's KV pool by


def uses_native(cfg: dict, impl: str = "auto") -> bool:
    """Whether ``impl`` serves the model of config ``cfg`` with the native runtime model."""
    if impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl={impl!r} is unknown; use one of {MODEL_IMPLS}")
    return impl == "native" or (impl == "auto" and supports(cfg.get("model_type"), "runtime"))


def model_config(ckpt: Checkpoint, impl: str = "auto", trust_remote_code: bool = False) -> RuntimeConfig:
    """The shape the engine sizes its KV pool by; raises ValueError naming the model type when nothing serves it."""
    if uses_native(ckpt.config, impl):
        return ModelConfig.from_hf(ckpt.config)
    source = ckpt.source.path if ckpt.source is not None else None
    try:
        return TransformersConfig.from_hf(ckpt.config, source, trust_remote_code)
    except ValueError as e:
        raise ValueError(f"{e}; served natively: {', '.join(supported('runtime'))}") from None


def build_model(ckpt: Checkpoint, dtype: torch.dtype, max_positions: int, impl: str = "auto",
                trust_remote_code: bool = False) -> nn.Module:
    """The runtime's model for ``ckpt`` (see the module docstring), logging which path it takes."""
    model_type = ckpt.config.get("model_type")
    if uses_native(ckpt.config, impl):
        log.info("runtime: native %s model", model_type)
        return build_native_model(ckpt, dtype, max_positions)
    log.info("runtime: transformers backend for %s (slower)", model_type)
    return build_transformers_model(ckpt, dtype, trust_remote_code)
