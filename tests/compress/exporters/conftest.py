"""Fixtures: tiny quantized folders built once per session and keyed by their recipe."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def quantized_dir(tmp_path_factory):
    """quantized_dir(family, bits, group, sym, act_order=False, hidden=64, fmt="int") -> saved folder."""
    from compress.format.quant import Scheme
    from .models import byte_tokenizer, quantize_model, save, tiny_model

    cache: dict[tuple, Path] = {}

    def build(family: str, bits: int = 4, group: int = 32, sym: bool = False, act_order: bool = False,
              hidden: int = 64, fmt: str = "int") -> Path:
        key = (family, bits, group, sym, act_order, hidden, fmt)
        if key not in cache:
            scheme = Scheme(bits=bits, group_size=group, sym=sym, format=fmt)
            model = quantize_model(tiny_model(family, hidden), scheme, act_order)
            folder = tmp_path_factory.mktemp("q") / "-".join(map(str, key))
            cache[key] = save(model, folder, scheme, act_order, tokenizer=byte_tokenizer())
        return cache[key]

    return build


@pytest.fixture(scope="session")
def exported(tmp_path_factory, quantized_dir):
    """exported(fmt, dtype=None, **recipe) -> (quantized folder, export folder), built once per recipe."""
    from compress.exporters.dispatch import export

    cache: dict[tuple, tuple[Path, Path]] = {}

    def build(fmt: str, dtype: str | None = None, **recipe) -> tuple[Path, Path]:
        key = (fmt, dtype, tuple(sorted(recipe.items())))
        if key not in cache:
            src = quantized_dir(**recipe)
            out = tmp_path_factory.mktemp("x") / fmt
            cache[key] = (src, export(str(src), fmt, out, dtype=dtype))
        return cache[key]

    return build
