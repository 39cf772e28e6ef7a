"""compress: quantize, export and serve causal language models.

The Python API mirrors the CLI: ``compress.quantize``, ``compress.evaluate``, ``compress.export``
(compress/api.py). They are looked up lazily, so ``import compress`` loads nothing heavy.
"""

__all__ = ["quantize", "evaluate", "export"]


def __getattr__(name: str):
    if name in __all__:
        from compress import api

        return getattr(api, name)
    raise AttributeError(f"module 'compress' has no attribute {name!r}")
